import Foundation
@testable import Invalidation
import Logging
import SecurityEvents
import Synchronization
import Testing

/// The step runner's journal writes: outcomes answered at about the same time share one write,
/// and one the journal refuses for good does not keep the others from being recorded.
@Suite("Step runner's outcome writes", .timeLimit(.minutes(1)))
struct StepRunnerTests {
    /// A journal that records writes, can hold every write until released, and refuses for
    /// good any write holding a record whose detail is "refuse".
    final class GatedJournal: StepJournal {
        struct State {
            var writes: [[StepRecord]] = []
            var holding = false
            var held: [CheckedContinuation<Void, Never>] = []
            var heldRecords = 0
            var inFlight = 0
            var mostInFlight = 0
        }

        let state = Mutex(State())

        func hold() { state.withLock { $0.holding = true } }

        /// Lets every held write go on, and the next ones.
        func release() {
            let held = state.withLock { s -> [CheckedContinuation<Void, Never>] in
                s.holding = false
                defer { s.held = [] }
                return s.held
            }
            for write in held { write.resume() }
        }

        var heldWrites: Int { state.withLock { $0.held.count } }
        var heldRecords: Int { state.withLock { $0.heldRecords } }
        var mostInFlight: Int { state.withLock { $0.mostInFlight } }
        var writes: [[StepRecord]] { state.withLock { $0.writes } }

        func record(_ outcomes: [StepRecord]) async throws(JournalError) -> [JournalError?] {
            state.withLock { s in
                s.inFlight += 1
                s.mostInFlight = max(s.mostInFlight, s.inFlight)
            }
            defer { state.withLock { $0.inFlight -= 1 } }
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let hold = state.withLock { s -> Bool in
                    guard s.holding else { return false }
                    s.held.append(continuation)
                    s.heldRecords += outcomes.count
                    return true
                }
                if !hold { continuation.resume() }
            }
            if outcomes.contains(where: { $0.detail == "refuse" }) {
                throw JournalError("the journal cannot hold this detail", isRetryable: false)
            }
            state.withLock { $0.writes.append(outcomes) }
            return outcomes.map { $0.index == 99 ? JournalError("already recorded", isRetryable: false) : nil }
        }

        func steps(ofEvent eventID: Int64) async throws(JournalError) -> [JournalStep] { [] }
        func lease(event eventID: Int64, owner: String, seconds: Double) async throws(JournalError) -> Bool { true }
        func finish(event eventID: Int64, outcome: EventEnd) async throws(JournalError) {}
    }

    struct Counting: StepObserver {
        func retried(_ what: String) {}
        func failedForGood(_ what: String) {}
        func stepAnswered(kind: String, result: String) {}
        func deadLettered() {}
        func outcomeDurable(since answeredAt: ContinuousClock.Instant) {}
    }

    static func writer(_ journal: GatedJournal) -> OutcomeWriter {
        var logger = Logger(label: "step-runner-test")
        logger.logLevel = .critical
        let persistence = Persistence(timing: .init(initialBackoff: .milliseconds(10), maximumBackoff: .milliseconds(20)),
                                      stop: StopSignal(), observer: Counting(), logger: logger,
                                      isRetryable: { ($0 as? JournalError)?.isRetryable ?? true })
        return OutcomeWriter(journal: journal, persistence: persistence)
    }

    static func record(_ event: Int64, detail: String = "done", index: Int = 0) -> StepRecord {
        StepRecord(eventID: event, index: index, failed: false, detail: detail, finishing: nil)
    }

    @Test func outcomesAnsweredWhileWritesAreUnderWayShareTheNextWrite() async throws {
        let journal = GatedJournal()
        let writer = Self.writer(journal)
        journal.hold()
        try await withThrowingTaskGroup(of: Bool.self) { group in
            for event in 1...51 { group.addTask { await writer.write(Self.record(Int64(event))) } }
            // At most `maximumWriters` writes are under way; what arrives meanwhile waits.
            #expect(await eventually {
                journal.heldWrites == OutcomeWriter.maximumWriters && journal.heldRecords + writer.waitingCount == 51
            })
            let waiting = writer.waitingCount
            #expect(waiting > 0)
            journal.release()
            var recorded = 0
            for try await ok in group where ok { recorded += 1 }
            #expect(recorded == 51)
        }
        // Those that waited went in one more write.
        let writes = journal.writes
        #expect(writes.count == OutcomeWriter.maximumWriters + 1)
        #expect(journal.mostInFlight == OutcomeWriter.maximumWriters)
        #expect(Set(writes.flatMap { $0.map(\.eventID) }) == Set(1...51))
    }

    @Test func aRecordTheJournalRefusesForGoodDoesNotKeepTheOthersFromBeingRecorded() async throws {
        let journal = GatedJournal()
        let writer = Self.writer(journal)
        journal.hold()
        let answers = try await withThrowingTaskGroup(of: (Int64, Bool).self) { group in
            // Writes under way, so the next records wait and go in one write together.
            for event in 10..<(10 + Int64(OutcomeWriter.maximumWriters)) {
                group.addTask { (event, await writer.write(Self.record(event))) }
            }
            #expect(await eventually { journal.heldWrites == OutcomeWriter.maximumWriters })
            group.addTask { (1, await writer.write(Self.record(1))) }
            group.addTask { (2, await writer.write(Self.record(2, detail: "refuse"))) }
            group.addTask { (3, await writer.write(Self.record(3))) }
            group.addTask { (4, await writer.write(Self.record(4, index: 99))) }
            #expect(await eventually { writer.waitingCount == 4 })
            journal.release()
            var answers: [Int64: Bool] = [:]
            for try await (event, ok) in group where event < 10 { answers[event] = ok }
            return answers
        }
        // The refused record is not recorded, nor is one the journal says was recorded already;
        // every other one is.
        #expect(answers == [1: true, 2: false, 3: true, 4: false])
        #expect(Set(journal.writes.flatMap { $0.filter { $0.index != 99 && $0.eventID < 10 }.map(\.eventID) }) == [1, 3])
    }
}

func eventually(attempts: Int = 2000, _ condition: () -> Bool) async -> Bool {
    for _ in 0..<attempts {
        if condition() { return true }
        try? await Task.sleep(for: .milliseconds(5))
    }
    return condition()
}
