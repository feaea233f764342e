import Foundation
import Synchronization

/// `warden replay --apply`'s door: messages from a log, run through the pipeline as the worker
/// runs them — claimed with their plan when new, their pending steps run when the ledger holds
/// them already — a batch at a time, each batch's dispositions handed back once every one of
/// them is settled.
public final class ReplayDoor: Sendable {
    /// The source a replayed delivery is recorded with.
    public static let source = "replay"

    public let processor: EventProcessor
    private let feed = RecordFeed()
    private let running = Mutex<Task<Void, Never>?>(nil)

    public init(processor: EventProcessor) {
        self.processor = processor
    }

    /// Starts the pipeline; `apply` may be called from then on, `finish` ends it.
    public func start() {
        let pipeline = EventPipeline(processor: processor)
        let feed = self.feed
        running.withLock { $0 = Task { await pipeline.run(feed) } }
    }

    /// Runs `messages` and returns what became of each, in order, once all are settled (steps
    /// done or failed for good). A message whose issuer's keys cannot be had is `.abandoned`.
    public func apply(_ messages: [IntakeMessage]) async -> [Disposition] {
        guard !messages.isEmpty else { return [] }
        let collector = Collector(count: messages.count)
        let records = messages.enumerated().map { i, message in
            IntakeRecord(message, acknowledgement: ReplayAcknowledgement(index: i, collector: collector))
        }
        guard feed.submit(records) else { return Array(repeating: .abandoned, count: messages.count) }
        return await collector.all()
    }

    /// Takes no more, lets what was taken finish, and stops.
    public func finish() async {
        feed.close()
        await running.withLock { $0 }?.value
        processor.stop.stop()
    }

    /// Gathers one batch's dispositions.
    final class Collector: Sendable {
        private struct State {
            var dispositions: [Disposition?]
            var left: Int
            var waiter: CheckedContinuation<[Disposition], Never>?
        }

        private let state: Mutex<State>

        init(count: Int) { state = Mutex(State(dispositions: Array(repeating: nil, count: count), left: count, waiter: nil)) }

        func settle(_ index: Int, _ disposition: Disposition) {
            let done = state.withLock { s -> (CheckedContinuation<[Disposition], Never>, [Disposition])? in
                guard s.dispositions[index] == nil else { return nil }
                s.dispositions[index] = disposition
                s.left -= 1
                guard s.left == 0, let waiter = s.waiter else { return nil }
                s.waiter = nil
                return (waiter, s.dispositions.map { $0 ?? .abandoned })
            }
            if let (waiter, all) = done { waiter.resume(returning: all) }
        }

        func all() async -> [Disposition] {
            await withCheckedContinuation { continuation in
                let now = state.withLock { s -> [Disposition]? in
                    if s.left == 0 { return s.dispositions.map { $0 ?? .abandoned } }
                    s.waiter = continuation
                    return nil
                }
                if let now { continuation.resume(returning: now) }
            }
        }
    }

    final class ReplayAcknowledgement: Acknowledgement {
        let index: Int
        let collector: Collector

        init(index: Int, collector: Collector) {
            self.index = index
            self.collector = collector
        }

        func settle(_ disposition: Disposition) { collector.settle(index, disposition) }
        /// A replay does not wait aside for keys: the operator is told, and runs it again.
        var waitsForKeys: Bool { false }
    }
}
