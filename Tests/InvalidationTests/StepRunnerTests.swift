import Foundation
@testable import Invalidation
import Logging
import SecurityEvents
import Synchronization
import Testing
import WardenTestSupport

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
        let groupsConcurrentWrites: Bool
        /// When every write says it became durable (nil: when it returns).
        let durableAt: ContinuousClock.Instant?

        init(groupsConcurrentWrites: Bool = false, durableAt: ContinuousClock.Instant? = nil) {
            self.groupsConcurrentWrites = groupsConcurrentWrites
            self.durableAt = durableAt
        }

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

        /// Lets the first held write go on; the others stay held, and so do the next ones.
        func releaseFirst() {
            let first = state.withLock { s -> CheckedContinuation<Void, Never>? in s.held.isEmpty ? nil : s.held.removeFirst() }
            first?.resume()
        }

        var heldWrites: Int { state.withLock { $0.held.count } }
        var heldRecords: Int { state.withLock { $0.heldRecords } }
        var mostInFlight: Int { state.withLock { $0.mostInFlight } }
        var writes: [[StepRecord]] { state.withLock { $0.writes } }

        func record(_ outcomes: [StepRecord]) async throws(JournalError) -> JournalWrite {
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
            return JournalWrite(refusals: outcomes.map { $0.index == 99 ? JournalError("already recorded", isRetryable: false) : nil },
                                durableAt: durableAt ?? .now)
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
        func outcomeDurable(after wait: Duration) {}
    }

    /// Keeps the times to durable it is told.
    final class Waits: StepObserver {
        let waits = Mutex<[Duration]>([])
        func retried(_ what: String) {}
        func failedForGood(_ what: String) {}
        func stepAnswered(kind: String, result: String) {}
        func deadLettered() {}
        func outcomeDurable(after wait: Duration) { waits.withLock { $0.append(wait) } }
    }

    static var logger: Logger {
        var logger = Logger(label: "step-runner-test")
        logger.logLevel = .critical
        return logger
    }

    /// Short backoffs, and a stop signal of its own.
    static func persistence(observer: any StepObserver = Counting()) -> Persistence {
        Persistence(timing: .init(initialBackoff: .milliseconds(10), maximumBackoff: .milliseconds(20)),
                    stop: StopSignal(), observer: observer, logger: logger,
                    isRetryable: { ($0 as? JournalError)?.isRetryable ?? true })
    }

    static func writer(_ journal: GatedJournal, observer: any StepObserver = Counting()) -> OutcomeWriter {
        OutcomeWriter(journal: journal, persistence: persistence(observer: observer))
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

    // A journal with a writer of its own (the SQLite ledger's thread) gets every outcome as it
    // comes: none waits for a task to run again before its write starts. The time to durable is
    // counted to when the journal says the write became durable, not to when its caller ran again.
    @Test func aJournalThatGroupsWritesGetsEachOutcomeAsItComes() async throws {
        let durableAt = ContinuousClock.now
        let journal = GatedJournal(groupsConcurrentWrites: true, durableAt: durableAt)
        let observer = Waits()
        let writer = Self.writer(journal, observer: observer)
        journal.hold()
        let answeredAt = durableAt - .milliseconds(7)
        try await withThrowingTaskGroup(of: Bool.self) { group in
            for event in 1...20 { group.addTask { await writer.write(Self.record(Int64(event)), answeredAt: answeredAt) } }
            #expect(await eventually { journal.heldWrites == 20 })
            #expect(writer.waitingCount == 0)
            journal.release()
            var recorded = 0
            for try await ok in group where ok { recorded += 1 }
            #expect(recorded == 20)
        }
        #expect(journal.writes.count == 20)
        #expect(observer.waits.withLock { $0 } == Array(repeating: .milliseconds(7), count: 20))
    }

    // A writer whose own outcome is durable returns, and hands the writing of what arrived
    // meanwhile to one of those waiting: it does not write others' outcomes while its event waits.
    @Test func aWriterReturnsOnceItsOwnOutcomeIsDurable() async throws {
        let journal = GatedJournal()
        let writer = Self.writer(journal)
        journal.hold()
        let firstAnswer = Mutex<Bool?>(nil)
        let first = Task {
            let recorded = await writer.write(Self.record(1))
            firstAnswer.withLock { $0 = recorded }
        }
        #expect(await eventually { journal.heldWrites == 1 })
        let others = Task {
            await withTaskGroup(of: Bool.self) { group in
                for event in 2...20 { group.addTask { await writer.write(Self.record(Int64(event))) } }
                return await group.reduce(0) { $0 + ($1 ? 1 : 0) }
            }
        }
        #expect(await eventually { journal.heldWrites == OutcomeWriter.maximumWriters && writer.waitingCount > 0 })
        journal.releaseFirst()
        // It returns while the next writes are still held.
        #expect(await eventually { firstAnswer.withLock { $0 } == true })
        #expect(await eventually { journal.heldWrites == OutcomeWriter.maximumWriters })  // the handed-on turn
        journal.release()
        await first.value
        #expect(await others.value == 19)
        #expect(Set(journal.writes.flatMap { $0.map(\.eventID) }) == Set(1...20))
    }

    @Test func aRecordTheJournalRefusesForGoodDoesNotKeepTheOthersFromBeingRecorded() async throws {
        let journal = GatedJournal()
        let writer = Self.writer(journal)
        journal.hold()
        let answers = try await withThrowingTaskGroup(of: (Int64, Bool).self) { group in
            // Writes under way, so the next records wait and go in one write together. Each is
            // started once the one before is held in the journal: started together, the first
            // caller to write may take the others' outcomes into its own write, and fewer
            // writes than the most allowed are then under way.
            for (n, event) in (10..<(10 + Int64(OutcomeWriter.maximumWriters))).enumerated() {
                group.addTask { (event, await writer.write(Self.record(event))) }
                #expect(await eventually { journal.heldWrites == n + 1 })
            }
            #expect(journal.heldWrites == OutcomeWriter.maximumWriters)
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

    // MARK: - The runner and the circuit breaker

    /// Answers each call with the next scripted outcome, then `done`.
    final class Scripted: StepExecutor {
        let outcomes: Mutex<[StepOutcome]>
        let calls = Mutex(0)
        init(_ outcomes: [StepOutcome]) { self.outcomes = Mutex(outcomes) }

        func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
            calls.withLock { $0 += 1 }
            return outcomes.withLock { $0.isEmpty ? .done("ok") : $0.removeFirst() }
        }
    }

    /// Permits a number of actions, then refuses (the door took the message back).
    final class Permit: ActionPermit {
        let left: Mutex<Int>
        init(_ actions: Int) { left = Mutex(actions) }

        func beginAction() -> Bool {
            left.withLock { left in
                guard left > 0 else { return false }
                left -= 1
                return true
            }
        }
        func endAction() {}
    }

    struct NoDeadLetters: DeadLetterSink {
        func deadLetter(value: [UInt8], key: [UInt8]?, headers: [MessageHeader], code: String, description: String,
                        source: String) async throws(DeadLetterError) {}
    }

    static func event(_ id: Int64, permit: any ActionPermit) -> EventSteps {
        let planned = PlannedStep(index: 0, eventType: EventType.sessionsRevoked.uri, action: .purgeSet(target: "sessions", set: "s:u"))
        return EventSteps(eventID: id, steps: [JournalStep(index: 0, kind: "purge-set", action: planned.encoded)], planned: [planned],
                          context: StepContext(token: token("sessions-revoked"), user: "u"), outcomeIfDone: .processed,
                          leasedUntil: Date().timeIntervalSince1970 + 3600, message: [], source: "test:\(id)", permit: permit)
    }

    /// Answers by script per set name (then `done`), and keeps the size of each call.
    final class ByEvent: StepExecutor {
        let script: Mutex<[String: [StepOutcome]]>
        /// Calls of `execute(_ calls:)`, by size; calls of one step alone count as 1 each in `alone`.
        let batches = Mutex<[Int]>([])
        let alone = Mutex(0)
        init(_ script: [String: [StepOutcome]]) { self.script = Mutex(script) }

        func answer(_ action: StepAction) -> StepOutcome {
            guard case .purgeSet(_, let set) = action else { return .done("not a purge") }
            return script.withLock { $0[set]?.isEmpty == false ? $0[set]!.removeFirst() : .done("purged \(set)") }
        }
        func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
            alone.withLock { $0 += 1 }
            return answer(action)
        }
        func execute(_ calls: [StepCall]) async -> [StepOutcome] {
            batches.withLock { $0.append(calls.count) }
            return calls.map { answer($0.action) }
        }
        /// Purge-set steps run together; a flag is set alone.
        func runsTogether(_ action: StepAction) -> Bool {
            if case .purgeSet = action { return true }
            return false
        }
    }

    final class CountedDeadLetters: DeadLetterSink {
        let sources = Mutex<[String]>([])
        func deadLetter(value: [UInt8], key: [UInt8]?, headers: [MessageHeader], code: String, description: String,
                        source: String) async throws(DeadLetterError) {
            sources.withLock { $0.append(source) }
        }
    }

    static func event(_ id: Int64, permit: any ActionPermit, steps: Int, target: String = "sessions", flagFirst: Bool = false) -> EventSteps {
        var actions: [StepAction] = [.purgeSet(target: target, set: "s:\(id)"), .setFlag(target: target, key: "f:\(id)", value: "1", ttl: nil)]
        if flagFirst { actions.reverse() }
        let planned = (0..<steps).map { PlannedStep(index: $0, eventType: EventType.sessionsRevoked.uri, action: actions[$0]) }
        return EventSteps(eventID: id, steps: planned.map { JournalStep(index: $0.index, kind: $0.action.kind, action: $0.encoded) },
                          planned: planned, context: StepContext(token: token("sessions-revoked"), user: "u\(id)"),
                          outcomeIfDone: .processed, leasedUntil: Date().timeIntervalSince1970 + 3600, message: [],
                          source: "test:\(id)", permit: permit)
    }

    // Events run together: the first attempts at their first steps are one executor call per
    // target, and the outcomes answered go in one journal write. What is left — a retry, a
    // second step, a step the executor does not run together — runs on its own; a step failed
    // for good is dead-lettered; a message taken back runs nothing. Each event is finished once.
    @Test func eventsRunTogetherShareOneCallAndOneWrite() async throws {
        let persistence = Self.persistence()
        let executor = ByEvent(["s:3": [.retry("busy", after: nil)], "s:4": [.failed("refused")]])
        let journal = GatedJournal(groupsConcurrentWrites: true)
        let deadLetters = CountedDeadLetters()
        let runner = StepRunner(executor: executor, journal: journal, deadLetters: deadLetters, persistence: persistence, logger: Self.logger)
        var events = (1...6).map { Self.event(Int64($0), permit: Permit(100), steps: 1) }
        events.append(Self.event(7, permit: Permit(100), steps: 2))
        events.append(Self.event(8, permit: Permit(0), steps: 1))
        events.append(Self.event(9, permit: Permit(100), steps: 1, flagFirst: true))
        events.append(Self.event(10, permit: Permit(100), steps: 1, target: "other"))
        let ends = Mutex<[Int64: [EventEnd?]]>([:])
        let ids = events.map(\.eventID)
        await runner.runTogether(events) { i, end in
            ends.withLock { $0[ids[i], default: []].append(end) }
        }
        #expect(ends.withLock { $0 } == [1: [.processed], 2: [.processed], 3: [.processed], 4: [.failed], 5: [.processed],
                                         6: [.processed], 7: [.processed], 8: [nil], 9: [.processed], 10: [.processed]])
        // One call for the seven first steps on "sessions" (the message taken back made none),
        // one for "other"; then event 3's retry, event 7's second step and event 9's flag, each alone.
        #expect(executor.batches.withLock { $0 }.sorted() == [1, 7])
        #expect(executor.alone.withLock { $0 } == 3)
        let writes = journal.writes
        #expect(writes.contains { Set($0.map(\.eventID)) == [1, 2, 4, 5, 6, 7] })
        #expect(writes.count == 5)
        #expect(writes.joined().first(where: { $0.eventID == 4 })?.failed == true)
        #expect(writes.joined().first(where: { $0.eventID == 7 && $0.index == 0 })?.finishing == nil)
        #expect(deadLetters.sources.withLock { $0 } == ["test:4"])
    }

    // A message taken back while its target's breaker is about to let one trial call through
    // takes no trial with it: the next event's call is that trial, and the breaker closes.
    @Test func aMessageTakenBackDoesNotKeepTheBreakersTrial() async throws {
        let persistence = Self.persistence()
        let executor = Scripted([.retry("down", after: nil)])
        let runner = StepRunner(
            configuration: .init(breakers: .init(threshold: 1, cooldown: .milliseconds(50), maximumCooldown: .milliseconds(50))),
            executor: executor, journal: GatedJournal(), deadLetters: NoDeadLetters(), persistence: persistence, logger: Self.logger)
        // The first event's call fails and opens the breaker; its message is then taken back.
        #expect(await runner.run(Self.event(1, permit: Permit(1))) == nil)
        #expect(executor.calls.withLock { $0 } == 1)
        // The next event on the same target is done once the cooldown ends.
        let next = Task { await runner.run(Self.event(2, permit: Permit(100))) }
        let called = await eventually { executor.calls.withLock { $0 } == 2 }
        if !called { persistence.stop.stop() }  // the breaker never let it through: end the wait
        #expect(called)
        #expect(await next.value == .processed)
        #expect(!runner.breakers.isOpen("sessions"))
    }
}
