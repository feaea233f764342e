import Foundation
import SecurityEvents
public import Logging
import Synchronization

/// What acts on verified events: the planner (policy), subject resolution, and the executor
/// that runs steps on targets.
public struct InvalidationEngine: Sendable {
    public var planner: Planner
    public var resolver: any SubjectResolver
    public var executor: any StepExecutor

    public init(planner: Planner, resolver: any SubjectResolver, executor: any StepExecutor) {
        self.planner = planner
        self.resolver = resolver
        self.executor = executor
    }

    /// Records events and acts on none: an empty policy.
    public static let recordOnly = InvalidationEngine(planner: Planner(policy: Policy()), resolver: IdentityResolver(),
                                                      executor: NoTargets())

    struct NoTargets: StepExecutor {
        func execute(_ action: StepAction, context: StepContext) async -> StepOutcome { .failed("no targets are configured") }
    }
}

// MARK: - The journal

/// Where an event's steps and their outcomes are kept (the ledger's outbox): what the step
/// runner reads and records. Every outcome is recorded before the event's message is
/// acknowledged, so a step answered is never made again after a crash.
public protocol StepJournal: Sendable {
    /// An event's steps in order, with their status.
    func steps(ofEvent eventID: Int64) async throws(JournalError) -> [JournalStep]
    /// Takes, or renews, the right to run an event's steps for `seconds`; whether `owner`
    /// holds it now. Two processes never run one event's steps at once.
    func lease(event eventID: Int64, owner: String, seconds: Double) async throws(JournalError) -> Bool
    /// Records the outcomes of steps of any events, in one write. Only a pending step is
    /// recorded: for each outcome, nil when it was recorded, or why it was not (the step was
    /// recorded already, by another owner of its event), and when the write became durable.
    func record(_ outcomes: [StepRecord]) async throws(JournalError) -> JournalWrite
    /// Records an event's outcome (when its last step's record did not).
    func finish(event eventID: Int64, outcome: EventEnd) async throws(JournalError)
    /// True when concurrent `record` calls already share writes (a writer of its own that puts
    /// whatever is queued in one transaction): outcomes then go to it as they come, not
    /// gathered first by the caller.
    var groupsConcurrentWrites: Bool { get }
}

extension StepJournal {
    public var groupsConcurrentWrites: Bool { false }
}

/// One step of an event as the journal keeps it.
public struct JournalStep: Sendable, Equatable {
    public enum Status: String, Sendable { case pending, done, failed }

    public var index: Int
    /// `purge-set`, `revoke-tokens`, … (for reports and metrics).
    public var kind: String
    /// The step as planned, every placeholder filled (`PlannedStep.encoded`).
    public var action: String
    public var status: Status

    public init(index: Int, kind: String, action: String, status: Status = .pending) {
        self.index = index
        self.kind = kind
        self.action = action
        self.status = status
    }
}

/// The outcome of one step, to be recorded.
public struct StepRecord: Sendable, Equatable {
    public var eventID: Int64
    public var index: Int
    /// Done, or failed for good.
    public var failed: Bool
    /// What the target said (done: what it did; failed: why).
    public var detail: String
    /// With an event's last step: the event's outcome, recorded in the same write.
    public var finishing: EventEnd?
    /// How many times this process called the step's target for it (for the audit trail).
    public var attempts: Int

    public init(eventID: Int64, index: Int, failed: Bool, detail: String, finishing: EventEnd?, attempts: Int = 1) {
        self.eventID = eventID
        self.index = index
        self.failed = failed
        self.detail = detail
        self.finishing = finishing
        self.attempts = attempts
    }
}

/// What one write of outcomes came to.
public struct JournalWrite: Sendable {
    /// For each outcome, in order: nil when it was recorded, or why it was not.
    public var refusals: [JournalError?]
    /// When the write became durable (not when its caller ran again).
    public var durableAt: ContinuousClock.Instant

    public init(refusals: [JournalError?], durableAt: ContinuousClock.Instant = .now) {
        self.refusals = refusals
        self.durableAt = durableAt
    }
}

/// How an event's steps ended.
public enum EventEnd: String, Sendable {
    /// Every step is done.
    case processed
    /// Every step planned is done, but the subject named no local user, so steps that need
    /// one were not planned.
    case unresolved
    /// A step failed for good (dead-lettered); the others still ran.
    case failed
}

/// Why the journal could not do what it was asked, and whether asking again can help.
public struct JournalError: Error, Sendable, CustomStringConvertible {
    public var description: String
    public var isRetryable: Bool

    public init(_ description: String, isRetryable: Bool) {
        self.description = description
        self.isRetryable = isRetryable
    }
}

/// The right to act for a message, asked before each call to a target and the recording of its
/// outcome: a door refuses it once it has taken the message back (a Kafka partition revoked),
/// and waits for the actions under way before it lets the message go.
public protocol ActionPermit: Sendable {
    /// False when no action may start for the message. Each true is followed by one `endAction()`.
    func beginAction() -> Bool
    func endAction()
}

extension ActionPermit {
    /// Whether no action may start for the message now (its door took it back), asked without
    /// starting one.
    public var refusesActions: Bool {
        guard beginAction() else { return true }
        endAction()
        return false
    }
}

/// An event whose steps are to run.
public struct EventSteps: Sendable {
    public var eventID: Int64
    /// The steps to run (a new event's, all pending), or nil to read them from the journal when
    /// their turn comes (a redelivery: a crash may have left some pending).
    public var steps: [JournalStep]?
    /// The steps as planned (a new event's); a resumed one's are read from their journal text.
    public var planned: [PlannedStep]
    public var context: StepContext
    /// The event's outcome when every step is done.
    public var outcomeIfDone: EventEnd
    /// Until when this process holds the event's lease (taken with its claim); 0 if not.
    public var leasedUntil: Double
    /// What a failed step's dead letter carries: the message as received, and where it came from.
    public var message: [UInt8]
    public var source: String
    public var permit: any ActionPermit
    /// When the event arrived (seconds since 1970), for `warden_event_to_done_seconds`; 0 if unknown.
    public var receivedAt: Double

    public init(eventID: Int64, steps: [JournalStep]?, planned: [PlannedStep], context: StepContext, outcomeIfDone: EventEnd,
                leasedUntil: Double, message: [UInt8], source: String, permit: any ActionPermit, receivedAt: Double = 0) {
        self.receivedAt = receivedAt
        self.eventID = eventID
        self.steps = steps
        self.planned = planned
        self.context = context
        self.outcomeIfDone = outcomeIfDone
        self.leasedUntil = leasedUntil
        self.message = message
        self.source = source
        self.permit = permit
    }
}

extension EventSteps {
    /// What a step of this event is told about it.
    func context(for planned: PlannedStep) -> StepContext {
        var context = self.context
        context.eventType = planned.eventType
        return context
    }
}

extension PlannedStep {
    /// The step as the journal keeps it: JSON text, in the form `Codable` gives it (which
    /// `init(encoded:)` reads), written directly: it is written for every step of every event.
    public var encoded: String {
        var out: [UInt8] = []
        out.reserveCapacity(160)
        out += #"{"index":"#.utf8
        JSONValue.number(Double(index)).write(to: &out)
        out += #","eventType":"#.utf8
        JSONValue.writeString(eventType, to: &out)
        out += #","action":"#.utf8
        action.write(to: &out)
        out.append(UInt8(ascii: "}"))
        return String(decoding: out, as: UTF8.self)
    }

    public init?(encoded text: String) {
        guard let step = try? JSONDecoder().decode(PlannedStep.self, from: Data(text.utf8)) else { return nil }
        self = step
    }
}

// MARK: - The runner

/// Runs events' steps on their targets and records each outcome in the journal.
///
/// - A target that fails again and again is left alone by its circuit breaker; events wait,
///   nothing is dropped. A target's `Retry-After` is honoured (up to five minutes).
/// - A step its target keeps refusing while it serves other events is failed after
///   `maximumAttempts` and dead-lettered; the event's other steps still run.
/// - The event's lease keeps two processes from running its steps at once; recording checks the
///   step is still pending.
/// - Steps of many events run together (`runTogether`): one executor call for their first
///   attempts (one round trip per target where it allows), one journal write for the outcomes.
///   Events run on their own (`run`, one task each) still share: the Redis client pipelines
///   concurrent requests, and concurrent outcomes are recorded in one write.
public final class StepRunner: Sendable {
    public struct Configuration: Sendable {
        /// Attempts at a step that its target keeps refusing with a retryable answer while it
        /// serves other events; then the step is failed and dead-lettered. Attempts made while
        /// the target is down (no success from it meanwhile) are not counted: those events wait.
        public var maximumAttempts: Int
        /// How long a lease on an event's steps lasts; renewed while its steps run.
        public var lease: Duration
        /// Who this process is when it leases an event's steps.
        public var owner: String
        public var breakers: CircuitBreakers.Settings

        public init(maximumAttempts: Int = 10, lease: Duration = .seconds(10), owner: String = StepRunner.processName,
                    breakers: CircuitBreakers.Settings = .init()) {
            self.maximumAttempts = maximumAttempts
            self.lease = lease
            self.owner = owner
            self.breakers = breakers
        }
    }

    /// This process, as a lease owner: host, process id and a random part.
    public static let processName =
        "\(ProcessInfo.processInfo.hostName)/\(ProcessInfo.processInfo.processIdentifier)/\(UUID().uuidString.prefix(8))"

    public let configuration: Configuration
    let executor: any StepExecutor
    let journal: any StepJournal
    let deadLetters: any DeadLetterSink
    let persistence: Persistence
    let breakers: CircuitBreakers
    let outcomes: OutcomeWriter
    let leases: LeaseKeeper
    let logger: Logger

    var observer: any StepObserver { persistence.observer }
    var leaseSeconds: Double { configuration.lease.timeInterval }

    public init(configuration: Configuration = .init(), executor: any StepExecutor, journal: any StepJournal,
                deadLetters: any DeadLetterSink, persistence: Persistence, logger: Logger) {
        self.configuration = configuration
        self.executor = executor
        self.journal = journal
        self.deadLetters = deadLetters
        self.persistence = persistence
        self.breakers = CircuitBreakers(settings: configuration.breakers)
        self.outcomes = OutcomeWriter(journal: journal, persistence: persistence)
        self.leases = LeaseKeeper(journal: journal, owner: configuration.owner, seconds: configuration.lease.timeInterval, logger: logger)
        self.logger = logger
    }

    /// Gives up this process's lease on an event at once (its steps are left for the next
    /// delivery), so the next owner does not wait for it to run out.
    public func release(event eventID: Int64) async {
        _ = try? await journal.lease(event: eventID, owner: configuration.owner, seconds: 0)
    }

    /// Runs an event's pending steps in order and records each outcome, then the event's.
    /// A step that fails for good is dead-lettered with its reason, and the others still run.
    /// Returns nil when the process stops first, or the door takes the message back.
    public func run(_ event: EventSteps) async -> EventEnd? {
        await run(event, attempts: Attempts(), pause: nil)
    }

    /// `run`, the first pending step taken up where `runTogether` left it: `attempts` made,
    /// and a pause before the next.
    private func run(_ event: EventSteps, attempts: Attempts, pause: Double?) async -> EventEnd? {
        var outcomeIfDone = event.outcomeIfDone
        let steps: [JournalStep]
        if let known = event.steps {
            steps = known
        } else {
            // A redelivery: its steps are read now, in its turn in the subject's lane, so steps
            // the delivery before it finished meanwhile are not run again.
            guard let recorded = await persistence.retrying("ledger", {
                try await journal.steps(ofEvent: event.eventID)
            }) else { return nil }
            if recorded.contains(where: { $0.status == .failed }) { outcomeIfDone = .failed }
            steps = recorded.filter { $0.status == .pending }
            // Nothing left: the delivery before finished the event and recorded its outcome.
            if steps.isEmpty { return outcomeIfDone }
        }
        var lease = Lease(runner: self, eventID: event.eventID, until: event.leasedUntil)
        var failed = outcomeIfDone == .failed
        var finished = false
        for (n, step) in steps.enumerated() {
            let isLast = step.index == steps.last?.index
            let planned = event.planned.first(where: { $0.index == step.index }) ?? PlannedStep(encoded: step.action)
            switch await run(step, planned, of: event, isLast: isLast, failedSoFar: failed, lease: &lease,
                             attempts: n == 0 ? attempts : Attempts(), pause: n == 0 ? pause : nil) {
            case .recorded(let stepFailed):
                if stepFailed { failed = true }
                finished = isLast
            case .stopped:
                return nil
            }
        }
        let outcome: EventEnd = failed ? .failed : outcomeIfDone
        if !finished {
            guard await persistence.retrying("ledger", {
                try await journal.finish(event: event.eventID, outcome: outcome)
            }) != nil else { return nil }
        }
        logFinished(event, outcome)
        return outcome
    }

    private func logFinished(_ event: EventSteps, _ outcome: EventEnd) {
        if outcome == .processed, event.receivedAt > 0 {
            observer.eventDone(afterArrival: max(0, Date().timeIntervalSince1970 - event.receivedAt))
        }
        logger.info("event's steps finished", metadata: [
            "warden.event_id": "\(event.eventID)", "warden.outcome": "\(outcome.rawValue)", "warden.source": "\(event.source)",
        ])
    }

    /// Runs the steps of several events at once, sharing round trips and writes: the first
    /// attempts at the events' first steps go to each target in one executor call (for steps
    /// the executor runs together: one round trip), and the outcomes each target answered are
    /// recorded in one write. Targets do not wait for each other. What is left of an event — its
    /// next steps, a retry, a target resting behind its breaker, a lease to renew, a step the
    /// executor does not run together — runs on its own, as `run` would. Each event is new (its
    /// steps known, all pending). `finished` hears about each event once, as it ends, what
    /// `run` would return.
    public func runTogether(_ events: [EventSteps], finished: @escaping @Sendable (Int, EventEnd?) async -> Void) async {
        await withTaskGroup(of: Void.self) { group in
            func alone(_ i: Int, _ event: EventSteps) { group.addTask { [self] in await finished(i, await run(event)) } }
            var byTarget: [String: [Call]] = [:]
            var targets: [String] = []
            let now = Date().timeIntervalSince1970
            for (i, event) in events.enumerated() {
                guard let steps = event.steps, let step = steps.first, step.status == .pending,
                      let planned = event.planned.first(where: { $0.index == step.index }),
                      executor.runsTogether(planned.action),
                      Lease(runner: self, eventID: event.eventID, until: event.leasedUntil).isFresh(at: now) else {
                    alone(i, event)
                    continue
                }
                guard event.permit.beginAction() else {
                    logTakenBack(event)
                    await finished(i, nil)
                    continue
                }
                let target = Self.target(of: planned, step)
                guard breakers.allow(target, for: event.eventID) else {
                    event.permit.endAction()
                    alone(i, event)
                    continue
                }
                if byTarget[target] == nil { targets.append(target) }
                byTarget[target, default: []].append(Call(i: i, step: step, target: target, isLast: steps.count == 1,
                                                          call: StepCall(action: planned.action, context: event.context(for: planned))))
            }
            for target in targets {
                let calls = byTarget[target]!
                group.addTask { [self] in await runTogether(calls, of: events, finished: finished) }
            }
        }
    }

    /// A first step of one event, to run with others'.
    private struct Call {
        let i: Int
        let step: JournalStep
        let target: String
        let isLast: Bool
        let call: StepCall
    }

    /// One target's calls: one executor call, one write of the outcomes; then what is left of
    /// each event on its own.
    private func runTogether(_ calls: [Call], of events: [EventSteps], finished: @escaping @Sendable (Int, EventEnd?) async -> Void) async {
        await withTaskGroup(of: Void.self) { alone in
            /// The event goes on on its own from here.
            func goOn(_ i: Int, _ event: EventSteps, attempts: Attempts = Attempts(), pause: Double? = nil) {
                alone.addTask { [self] in await finished(i, await run(event, attempts: attempts, pause: pause)) }
            }
            // The leases are kept renewed while the call and the recording are under way.
            let holding = leases.keep(Dictionary(calls.map { (events[$0.i].eventID, events[$0.i].leasedUntil) }, uniquingKeysWith: min))
            let calledAt = breakers.currentTime
            let answers = await executor.execute(calls.map(\.call))
            let answeredAt = ContinuousClock.now
            var toRecord: [(call: Call, record: StepRecord)] = []
            toRecord.reserveCapacity(calls.count)
            // Each event is read in place (`events[call.i]`): a copy of one retains each of its
            // texts and references, twice per event here, and only an event that goes on alone
            // needs one of its own.
            for (call, outcome) in zip(calls, answers) {
                var attempts = Attempts()
                switch judge(outcome, call.step, of: events[call.i], target: call.target, calledAt: calledAt, isLast: call.isLast,
                             failedSoFar: events[call.i].outcomeIfDone == .failed, attempts: &attempts) {
                case .record(let record, let deadLetter):
                    if let deadLetter {
                        guard await send(deadLetter, for: events[call.i]) else {
                            events[call.i].permit.endAction()
                            leases.forget(holding, event: events[call.i].eventID)
                            await finished(call.i, nil)
                            continue
                        }
                    }
                    toRecord.append((call, record))
                case .retry(let after):
                    events[call.i].permit.endAction()
                    goOn(call.i, events[call.i], attempts: attempts, pause: after)
                }
            }
            let written = await outcomes.write(together: toRecord.map(\.record), answeredAt: answeredAt)
            let renewed = leases.release(holding)
            for ((call, record), recorded) in zip(toRecord, written) {
                events[call.i].permit.endAction()
                guard recorded else {
                    await finished(call.i, nil)
                    continue
                }
                if let outcome = record.finishing {
                    logFinished(events[call.i], outcome)
                    await finished(call.i, outcome)
                } else {
                    var event = events[call.i]
                    if let until = renewed[event.eventID] { event.leasedUntil = max(event.leasedUntil, until) }
                    event.steps?.removeFirst()
                    if record.failed { event.outcomeIfDone = .failed }
                    goOn(call.i, event)
                }
            }
        }
    }

    /// What one step came to.
    private enum StepEnd {
        /// Its outcome is recorded (by this process, or by the lease's previous holder).
        case recorded(failed: Bool)
        /// The process is stopping, or the message was taken back.
        case stopped
    }

    /// What one attempt at a step came to.
    private enum Attempt {
        case recorded(failed: Bool)
        /// Run it again after this many seconds.
        case retry(after: Double)
        case stopped
    }

    /// What attempts at one step have come to so far.
    struct Attempts {
        /// Attempts made (the backoff grows with them).
        var attempt = 0
        /// Retryable refusals while the target answered other events.
        var refusals = 0
        /// When the last attempt called the target.
        var previousCall: Double? = nil
    }

    /// What a target's answer to one attempt comes to.
    private enum Answer {
        /// To be recorded: done, or failed for good (then dead-lettered first, with this description).
        case record(StepRecord, deadLetter: String?)
        /// Run it again after this many seconds.
        case retry(after: Double)
    }

    /// The target a step calls, for its circuit breaker.
    private static func target(of planned: PlannedStep, _ step: JournalStep) -> String {
        planned.action.targets.first ?? planned.action.store.map { "store:" + $0 } ?? step.kind
    }

    private func logTakenBack(_ event: EventSteps) {
        logger.notice("message taken back by its door; its steps are left to the next owner",
                      metadata: ["warden.event_id": "\(event.eventID)", "warden.source": "\(event.source)"])
    }

    /// Tells the target's breaker how it answered, counts a refusal (a step its target keeps
    /// refusing while it serves other events fails after `maximumAttempts`), reports and logs
    /// the answer; what it comes to.
    private func judge(_ answer: StepOutcome, _ step: JournalStep, of event: EventSteps, target: String, calledAt: Double,
                       isLast: Bool, failedSoFar: Bool, attempts: inout Attempts) -> Answer {
        var outcome = answer
        if case .retry = outcome {
            breakers.record(target, reachable: false, calledAt: calledAt)
            // The target answered someone else since our last try, yet not us: this event, not
            // the target, is the problem.
            if let previousCall = attempts.previousCall, breakers.succeeded(target, since: previousCall) { attempts.refusals += 1 }
            attempts.previousCall = calledAt
            if attempts.refusals >= configuration.maximumAttempts, case .retry(let reason, _) = outcome {
                outcome = .failed("gave up after \(attempts.refusals) attempts while the target served other events: \(reason)")
            }
        } else {
            breakers.record(target, reachable: true)
        }
        observer.breaker(target: target, open: breakers.isOpen(target))
        observer.stepTook(kind: step.kind, seconds: max(0, breakers.currentTime - calledAt))
        observer.stepAnswered(kind: step.kind, result: outcome.result)
        // Built only for a message that is logged (a step is run for every event).
        func about() -> Logger.Metadata { [
            "warden.event_id": "\(event.eventID)", "warden.step": "\(step.index)", "warden.kind": "\(step.kind)",
            "warden.target": "\(target)",
        ] }
        let finishing: (Bool) -> EventEnd? = { stepFailed in
            isLast ? (failedSoFar || stepFailed ? .failed : event.outcomeIfDone) : nil
        }
        switch outcome {
        case .done(let detail):
            logger.info("step done", metadata: about().merging(["warden.detail": "\(detail)"]) { $1 })
            return .record(StepRecord(eventID: event.eventID, index: step.index, failed: false, detail: detail,
                                      finishing: finishing(false), attempts: attempts.attempt + 1), deadLetter: nil)
        case .failed(let reason):
            logger.critical("step failed permanently; dead-lettered", metadata: about().merging(["warden.reason": "\(reason)"]) { $1 })
            return .record(StepRecord(eventID: event.eventID, index: step.index, failed: true, detail: reason,
                                      finishing: finishing(true), attempts: attempts.attempt + 1), deadLetter: "\(step.kind) step \(step.index) failed: \(reason)")
        case .retry(let reason, let after):
            observer.retried("step")
            logger.warning("step will be retried", metadata: about().merging([
                "warden.reason": "\(reason)", "warden.attempt": "\(attempts.attempt)",
            ]) { $1 })
            // While the target is down its breaker paces the calls: a step's own backoff stays
            // short, so the step runs again within seconds of the target's return.
            let initial = persistence.timing.initialBackoff.timeInterval
            return .retry(after: after.map { min(max($0, initial), 300) }
                ?? (breakers.isOpen(target) ? initial : persistence.backoff(attempts.attempt)))
        }
    }

    /// Dead-letters the event's message with `description`; false when the process stopped
    /// first. One the sink refuses for good is kept in the ledger only (the step is recorded
    /// failed).
    private func send(_ description: String, for event: EventSteps) async -> Bool {
        switch await persistence.attempting("dead-letter", {
            try await deadLetters.deadLetter(value: event.message, code: "step-failed", description: description, source: event.source)
        }) {
        case .stopped: return false
        case .done: observer.deadLettered()
        case .refused: break
        }
        return true
    }

    private func run(_ step: JournalStep, _ planned: PlannedStep?, of event: EventSteps, isLast: Bool, failedSoFar: Bool,
                     lease: inout Lease, attempts: Attempts, pause: Double?) async -> StepEnd {
        guard let planned else {
            // Cannot happen with this version's ledger; refuse to guess what to do.
            let record = StepRecord(eventID: event.eventID, index: step.index, failed: true,
                                    detail: "the step in the ledger cannot be read",
                                    finishing: isLast ? .failed : nil)
            return await outcomes.write(record) ? .recorded(failed: true) : .stopped
        }
        let context = event.context(for: planned)
        var attempts = attempts
        let target = Self.target(of: planned, step)
        let stop = persistence.stop
        if let pause {
            // Taken up after an attempt made with other events' steps.
            guard await stop.pause(pause) else { return .stopped }
            attempts.attempt += 1
        }
        while true {
            // The lease first, outside the action: waiting for another owner's lease must not
            // hold up a revocation.
            switch await lease.hold() {
            case .stopped:
                return .stopped
            case .held(let mayHaveMoved):
                if mayHaveMoved {
                    // Another owner may have held the lease since this process last did (it
                    // waited for it, or the lease ran out meanwhile, as during a long retry
                    // pause): the steps it recorded are read again, this one's and the later ones'.
                    guard let current = await persistence.retrying("ledger", {
                        try await journal.steps(ofEvent: event.eventID)
                    }) else { return .stopped }
                    lease.recordedElsewhere = Dictionary(current.filter { $0.status != .pending }.map { ($0.index, $0.status) },
                                                         uniquingKeysWith: { a, _ in a })
                }
                if let status = lease.recordedElsewhere[step.index] {
                    return .recorded(failed: status == .failed)
                }
            }
            // The call and the recording of its outcome are one action for the door: a Kafka
            // partition's revocation waits for it to end, and none starts once the door has
            // taken the message back (its next owner runs the step).
            guard event.permit.beginAction() else {
                logTakenBack(event)
                return .stopped
            }
            // The breaker last, right before the call: a half-open breaker's one trial is
            // always made (and its result recorded), never taken and then left unused.
            guard breakers.allow(target, for: event.eventID) else {
                event.permit.endAction()
                // The target is resting after repeated failures: wait without calling it, and
                // look again soon, so events flow as soon as the trial call succeeds.
                observer.retried("circuit_open")
                guard await stop.pause(breakers.retryDelay(target)) else { return .stopped }
                continue
            }
            // The lease is kept renewed while the call and its recording are under way.
            let holding = leases.keep([event.eventID: lease.until])
            let next: Attempt = await {
                defer { event.permit.endAction() }
                let calledAt = breakers.currentTime
                let outcome = await executor.execute(planned.action, context: context)
                let answeredAt = ContinuousClock.now
                switch judge(outcome, step, of: event, target: target, calledAt: calledAt, isLast: isLast,
                             failedSoFar: failedSoFar, attempts: &attempts) {
                case .record(let record, let deadLetter):
                    if let deadLetter { guard await send(deadLetter, for: event) else { return .stopped } }
                    guard await outcomes.write(record, answeredAt: answeredAt) else { return .stopped }
                    return .recorded(failed: record.failed)
                case .retry(let after):
                    return .retry(after: after)
                }
            }()
            if let renewed = leases.release(holding)[event.eventID] { lease.until = max(lease.until, renewed) }
            switch next {
            case .recorded(let failed):
                return .recorded(failed: failed)
            case .stopped:
                return .stopped
            case .retry(let wait):
                // Waiting outside the action: a revocation does not wait for the pause.
                guard await stop.pause(wait) else { return .stopped }
                attempts.attempt += 1
            }
        }
    }

    /// This process's lease on one event's steps. While another holds it, `hold` waits;
    /// it renews the lease once a third of it is left.
    private struct Lease {
        /// `mayHaveMoved`: another owner may have held the lease since this process last did.
        enum Held { case held(mayHaveMoved: Bool), stopped }

        let runner: StepRunner
        let eventID: Int64
        var until: Double
        /// The steps recorded when the ledger was last read after the lease may have moved
        /// (by its other holder): not run again.
        var recordedElsewhere: [Int: JournalStep.Status] = [:]

        /// Held, with more than a third of it left: no renewal is due.
        func isFresh(at now: Double) -> Bool { now <= until - runner.leaseSeconds / 3 }

        mutating func hold() async -> Held {
            let seconds = runner.leaseSeconds, journal = runner.journal, owner = runner.configuration.owner, eventID = self.eventID
            var waited = false
            while true {
                let now = Date().timeIntervalSince1970
                guard !isFresh(at: now) else { return .held(mayHaveMoved: waited) }
                guard let granted = await runner.persistence.retrying("ledger", {
                    try await journal.lease(event: eventID, owner: owner, seconds: seconds)
                }) else { return .stopped }
                if granted {
                    // Run out before it was taken again (or never held: a redelivery): another
                    // owner may have held it in between.
                    let lapsed = now >= until
                    until = now + seconds
                    return .held(mayHaveMoved: waited || lapsed)
                }
                if !waited {
                    runner.logger.notice("another owner runs this event's steps; waiting for its lease",
                                         metadata: ["warden.event_id": "\(eventID)"])
                }
                waited = true
                runner.observer.retried("lease")
                guard await runner.persistence.stop.pause(min(1, seconds / 3)) else { return .stopped }
            }
        }
    }
}

/// Records the outcomes of steps answered at about the same time in one journal write. A caller
/// that finds fewer than `maximumWriters` writes under way writes every outcome waiting (its own
/// among them, unless another write took it); the others wait. After one write, a writer hands
/// its turn to the owner of an outcome still waiting, so no caller writes others' outcomes
/// round after round while its own event waits. Several writes may be under way at once, so an
/// outcome never waits for a whole earlier write of outcomes before its own begins (the SQLite
/// ledger then joins them in one transaction).
///
/// A journal that groups concurrent writes itself (`groupsConcurrentWrites`: the SQLite ledger's
/// writer thread) gets each outcome as it comes instead: gathering here would make outcomes wait
/// for a writer task to run again, behind every event's work, before their write could start.
final class OutcomeWriter: Sendable {
    static let maximumWriters = 4

    /// What wakes a caller waiting for its outcome.
    private enum Wake {
        case answered(Bool)
        /// Write what is waiting, then wait again.
        case write
    }

    private struct Waiting {
        var id: Int
        var record: StepRecord
        /// When the step's target answered, if it did (the metric of time to durable).
        var answeredAt: ContinuousClock.Instant?
    }

    private struct State {
        var waiting: [Waiting] = []
        /// Writes under way, and turns to write handed to callers not yet writing.
        var writers = 0
        /// Callers handed a turn to write that have not taken it yet.
        var turns: Set<Int> = []
        /// Answers and turns to write, in order, for callers not waiting yet.
        var wakes: [Int: [Wake]] = [:]
        var waiters: [Int: CheckedContinuation<Wake, Never>] = [:]
        var next = 0
    }

    private let journal: any StepJournal
    private let persistence: Persistence
    private let state = Mutex(State())

    init(journal: any StepJournal, persistence: Persistence) {
        self.journal = journal
        self.persistence = persistence
    }

    /// Outcomes waiting for the next write (tests).
    var waitingCount: Int { state.withLock { $0.waiting.count } }

    /// Records `record`; true once it is durable, false when the process stopped first or the
    /// step could not be recorded (recorded already by another owner, or refused for good):
    /// then the event is left for its next delivery.
    func write(_ record: StepRecord, answeredAt: ContinuousClock.Instant? = nil) async -> Bool {
        // The journal gathers concurrent writes on a thread of its own: no task needs to run
        // again before the next write starts.
        if journal.groupsConcurrentWrites { return await write([Waiting(id: -1, record: record, answeredAt: answeredAt)])[0] }
        let (id, writes) = state.withLock { s -> (Int, Bool) in
            let id = s.next
            s.next += 1
            s.waiting.append(Waiting(id: id, record: record, answeredAt: answeredAt))
            guard s.writers < Self.maximumWriters else { return (id, false) }
            s.writers += 1
            return (id, true)
        }
        var turn = writes
        while true {
            if turn { await writeWaiting(as: id) }
            let wake = await withCheckedContinuation { (continuation: CheckedContinuation<Wake, Never>) in
                let wake = state.withLock { s -> Wake? in
                    if var pending = s.wakes[id], !pending.isEmpty {
                        let wake = pending.removeFirst()
                        s.wakes[id] = pending.isEmpty ? nil : pending
                        return wake
                    }
                    s.waiters[id] = continuation
                    return nil
                }
                if let wake { continuation.resume(returning: wake) }
            }
            switch wake {
            case .answered(let recorded): return recorded
            case .write: turn = true
            }
        }
    }

    /// Records outcomes answered together, in one write (see `write(_:answeredAt:)`): for each,
    /// whether it is durable.
    func write(together records: [StepRecord], answeredAt: ContinuousClock.Instant) async -> [Bool] {
        records.isEmpty ? [] : await write(records.map { Waiting(id: -1, record: $0, answeredAt: answeredAt) })
    }

    /// Writes `records` in one write; when the journal refuses it for good, one by one, so a
    /// record it can never hold does not keep the others from being recorded.
    private func write(_ records: [Waiting]) async -> [Bool] {
        switch await persistence.attempting("ledger", { try await journal.record(records.map(\.record)) }) {
        case .done(let written) where written.refusals.count == records.count:
            return zip(records, written.refusals).map { entry, refusal in
                if let refusal {
                    persistence.logger.notice("step not recorded", metadata: ["warden.reason": "\(refusal)"])
                } else if let answeredAt = entry.answeredAt {
                    persistence.observer.outcomeDurable(after: written.durableAt - answeredAt)
                }
                return refusal == nil
            }
        case .done, .stopped:
            return Array(repeating: false, count: records.count)
        case .refused where records.count > 1:
            var answers: [Bool] = []
            for record in records { answers += await write([record]) }
            return answers
        case .refused:
            return [false]
        }
    }

    /// One write of everything waiting; then the turn passes to the owner of the first outcome
    /// still waiting that has none yet, or the writer slot is given back.
    private func writeWaiting(as writer: Int) async {
        let batch = state.withLock { s -> [Waiting] in
            s.turns.remove(writer)
            defer { s.waiting = [] }
            return s.waiting
        }
        let answers = batch.isEmpty ? [] : await write(batch)
        let woken = state.withLock { s -> [(CheckedContinuation<Wake, Never>, Wake)] in
            var woken: [(CheckedContinuation<Wake, Never>, Wake)] = []
            func wake(_ id: Int, _ wake: Wake) {
                if let waiter = s.waiters.removeValue(forKey: id) { woken.append((waiter, wake)) } else { s.wakes[id, default: []].append(wake) }
            }
            for (entry, answer) in zip(batch, answers) { wake(entry.id, .answered(answer)) }
            if let next = s.waiting.first(where: { !s.turns.contains($0.id) }) {
                s.turns.insert(next.id)
                wake(next.id, .write)
            } else {
                s.writers -= 1
            }
            return woken
        }
        for (waiter, wake) in woken { waiter.resume(returning: wake) }
    }
}

/// Keeps the leases of events whose steps are under way from running out during a call. A call
/// may last longer than what is left of a lease when it starts (a webhook's timeout is as long
/// as a whole lease by default), and another process must not take the event's steps up and
/// run the same step meanwhile. One task renews every lease held this way once a third of it is
/// gone, looking every tenth of a lease: two thirds of a lease (about 6.7 s by default) are left
/// for a busy machine to run the renewal. It runs only while calls are under way, and ends a
/// tick after the last one.
final class LeaseKeeper: Sendable {
    private struct State {
        /// Until when each event's lease runs, by holding: one call, or one call for many events.
        var held: [Int: [Int64: Double]] = [:]
        var next = 0
        var renewing = false
    }

    private let state = Mutex(State())
    private let journal: any StepJournal
    private let owner: String
    private let seconds: Double
    private let logger: Logger

    init(journal: any StepJournal, owner: String, seconds: Double, logger: Logger) {
        self.journal = journal
        self.owner = owner
        self.seconds = seconds
        self.logger = logger
    }

    /// Keeps these events' leases (running until the times given) renewed until `release`.
    func keep(_ leases: [Int64: Double]) -> Int {
        let (holding, start) = state.withLock { s -> (Int, Bool) in
            defer { s.next += 1 }
            s.held[s.next] = leases
            let start = !s.renewing
            s.renewing = true
            return (s.next, start)
        }
        if start { Task { await self.renew() } }
        return holding
    }

    /// Stops renewing a holding's leases; until when each now runs.
    func release(_ holding: Int) -> [Int64: Double] {
        state.withLock { $0.held.removeValue(forKey: holding) } ?? [:]
    }

    private func renew() async {
        while true {
            try? await Task.sleep(for: .seconds(seconds / 10))
            let now = Date().timeIntervalSince1970
            let due = state.withLock { s -> Set<Int64>? in
                if s.held.isEmpty {
                    s.renewing = false
                    return nil
                }
                var due = Set<Int64>()
                for leases in s.held.values {
                    for (eventID, until) in leases where until - now < seconds * 2 / 3 { due.insert(eventID) }
                }
                return due
            }
            guard let due else { return }
            // All at once: a burst of events admitted together comes due on one tick, and the
            // ledger joins concurrent writes; one after another, the last could run out.
            await withTaskGroup(of: Void.self) { group in
                for eventID in due { group.addTask { await self.renew(eventID) } }
            }
        }
    }

    private func isHeld(_ eventID: Int64) -> Bool {
        state.withLock { s in s.held.values.contains { $0[eventID] != nil } }
    }

    /// Stops keeping one event's lease (its holding goes on for the others).
    func forget(_ holding: Int, event eventID: Int64) {
        state.withLock { s in _ = s.held[holding]?.removeValue(forKey: eventID) }
    }

    private func renew(_ eventID: Int64) async {
        // Given up meanwhile (its message taken back, its call over): not taken again.
        guard isHeld(eventID) else { return }
        let asked = Date().timeIntervalSince1970
        let granted: Bool
        do {
            granted = try await journal.lease(event: eventID, owner: owner, seconds: seconds)
        } catch {
            logger.warning("an event's lease could not be renewed while its step is under way; trying again",
                           metadata: ["warden.event_id": "\(eventID)", "warden.error": "\(error)"])
            return
        }
        guard granted else {
            // Too late: it ran out (the ledger was slower than a third of a lease) and another
            // owner holds it now. Recording still checks the step is pending.
            logger.error("an event's lease ran out while its step was under way; another owner may run that step too",
                         metadata: ["warden.event_id": "\(eventID)"])
            // No longer held: the next step waits for the lease again.
            state.withLock { s in
                for (holding, leases) in s.held where leases[eventID] != nil { s.held[holding]![eventID] = nil }
            }
            return
        }
        // Given up while the renewal was under way, the lease is left to run out rather than
        // given back: this process may have taken the event up again meanwhile.
        state.withLock { s in
            for (holding, leases) in s.held where leases[eventID] != nil { s.held[holding]![eventID] = asked + seconds }
        }
    }
}
