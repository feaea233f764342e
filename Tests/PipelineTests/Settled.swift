@testable import Pipeline
import Synchronization

/// What the pipeline settled each record with, in the order the records were fed; a test
/// door that feeds batches and waits until all are settled.
final class Settled: Sendable {
    private let dispositions = Mutex<[Int: Disposition]>([:])
    private let counts = Mutex<[Int: Int]>([:])

    struct Door: Acknowledgement {
        let settled: Settled
        let index: Int
        let take: @Sendable () -> Bool

        func settle(_ disposition: Disposition) {
            settled.dispositions.withLock { $0[index] = disposition }
            settled.counts.withLock { $0[index, default: 0] += 1 }
        }

        func beginAction() -> Bool { take() }
    }

    var all: [Disposition?] {
        dispositions.withLock { d in (0..<(d.keys.max().map { $0 + 1 } ?? 0)).map { d[$0] } }
    }

    /// Records settled more than once (each must be settled exactly once).
    var settledTwice: [Int] { counts.withLock { $0.filter { $0.value > 1 }.map(\.key).sorted() } }

    /// Feeds the batches to the pipeline as one door would and returns each record's disposition.
    /// `takeBack(i)` is asked before each action for record i: false takes the record back.
    static func run(_ pipeline: EventPipeline, _ batches: [[IntakeMessage]],
                    takeBack: @escaping @Sendable (Int) -> Bool = { _ in false }) async -> [Disposition] {
        let settled = Settled()
        var index = 0
        var records: [[IntakeRecord]] = []
        for batch in batches {
            records.append(batch.map { message in
                defer { index += 1 }
                let i = index
                return IntakeRecord(message, acknowledgement: Door(settled: settled, index: i, take: { !takeBack(i) }))
            })
        }
        let (stream, continuation) = AsyncStream.makeStream(of: [IntakeRecord].self)
        for batch in records { continuation.yield(batch) }
        continuation.finish()
        await pipeline.run(stream)
        precondition(settled.settledTwice.isEmpty, "records settled twice: \(settled.settledTwice)")
        return settled.all.map { $0 ?? .abandoned }
    }
}

extension Disposition {
    /// The error code of a rejection.
    var code: String? {
        if case .rejected(let code, _) = self { return code }
        return nil
    }
}
