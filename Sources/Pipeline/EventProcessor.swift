import Foundation
public import Invalidation
public import Ledger
public import Logging
import SecurityEvents
public import TokenVerification
import Synchronization

/// Where invalid messages go, with the error as headers. Returns once the dead letter is durable.
public protocol DeadLetterSink: Sendable {
    func deadLetter(value: [UInt8], code: String, description: String, source: String) async throws(DeadLetterError)
}

/// Why a dead letter could not be sent, and whether sending it again can help.
public struct DeadLetterError: Error, Sendable, CustomStringConvertible {
    public var description: String
    public var isRetryable: Bool

    public init(_ description: String, isRetryable: Bool) {
        self.description = description
        self.isRetryable = isRetryable
    }
}

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

/// Tells long waits (retries, backoffs) that the process is stopping: a wait ends when the
/// signal is given or its task is cancelled, not by looking at a flag now and then.
public final class StopSignal: Sendable {
    private struct State {
        var stopping = false
        var waiters: [Int: CheckedContinuation<Void, Never>] = [:]
        var next = 0
    }

    private let state = Mutex(State())
    public init() {}

    public func stop() {
        let waiters = state.withLock { s -> [CheckedContinuation<Void, Never>] in
            s.stopping = true
            defer { s.waiters = [:] }
            return Array(s.waiters.values)
        }
        for waiter in waiters { waiter.resume() }
    }

    public var isStopping: Bool { state.withLock { $0.stopping } }

    /// Returns once `stop()` is called, or at once when the task is cancelled.
    func stopped() async {
        let id = state.withLock { s -> Int in
            defer { s.next += 1 }
            return s.next
        }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { s -> Bool in
                    if s.stopping || Task.isCancelled { return true }
                    s.waiters[id] = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            state.withLock { $0.waiters.removeValue(forKey: id) }?.resume()
        }
    }

    /// Sleeps up to `seconds`, ending early when stopping (or cancelled). Returns false when
    /// stopping or cancelled.
    func pause(_ seconds: Double) async -> Bool {
        if isStopping || Task.isCancelled { return false }
        let slept = await withTaskGroup(of: Bool.self) { group in
            group.addTask { (try? await Task.sleep(for: .seconds(seconds))) != nil }
            group.addTask {
                await self.stopped()
                return false
            }
            let first = await group.next() ?? false
            group.cancelAll()
            return first
        }
        return slept && !isStopping && !Task.isCancelled
    }
}

/// What each stage of `EventPipeline` does to records: verify (`check`, on every core), admit
/// (subject, plan, dead letters), record (one atomic ledger write, in arrival order, after
/// which outcomes are durable and records are settled), and run an event's steps.
public struct EventProcessor: Sendable {
    public let verifier: SETVerifier
    public let ledger: any Ledger
    public let deadLetters: any DeadLetterSink
    public let metrics: WardenMetrics
    public let logger: Logger
    public let stop: StopSignal
    /// Planner, subject resolution and executor. Default: record only.
    public var engine: InvalidationEngine = .recordOnly
    /// Backoff bounds for retries (keys unavailable, ledger or dead-letter failures), seconds.
    public var initialBackoff: Double = 0.5
    public var maximumBackoff: Double = 30
    /// Tasks verifying one batch at once.
    public var parallelism: Int = max(1, ProcessInfo.processInfo.activeProcessorCount)
    /// Attempts at a step that its target keeps refusing with a retryable answer while it
    /// serves other events; then the step is failed and dead-lettered. Attempts made while
    /// the target is down (no success from it meanwhile) are not counted: those events wait.
    public var maximumStepAttempts: Int = 10
    /// Per-target circuit breakers.
    let breakers = CircuitBreakers()
    /// Who this process is when it leases an event's steps in the ledger.
    public var leaseOwner = "\(ProcessInfo.processInfo.hostName)/\(ProcessInfo.processInfo.processIdentifier)/\(UUID().uuidString.prefix(8))"
    /// How long a lease on an event's steps lasts; renewed while its steps run.
    public var leaseSeconds: Double = 10

    public init(verifier: SETVerifier, ledger: any Ledger, deadLetters: any DeadLetterSink, metrics: WardenMetrics,
                logger: Logger, stop: StopSignal) {
        self.verifier = verifier
        self.ledger = ledger
        self.deadLetters = deadLetters
        self.metrics = metrics
        self.logger = logger
        self.stop = stop
    }

    enum Verdict: Sendable {
        case valid(ValidEvent)
        case invalid(code: String, description: String)
    }

    /// A verified token behind a reference. Verification results move through several stages
    /// on their way to the ledger, and copying a `VerifiedSET` retains each of its many strings
    /// and arrays (visible in the intake's profile); a reference is one retain.
    final class Verified: Sendable {
        let set: VerifiedSET
        init(_ set: VerifiedSET) { self.set = set }
    }

    /// A verified event with its local user and plan (a class for the same reason).
    final class ValidEvent: Sendable {
        let verified: Verified
        let user: String?
        let plan: Plan

        init(_ verified: Verified, user: String?, plan: Plan) {
            self.verified = verified
            self.user = user
            self.plan = plan
        }

        var token: SecurityEventToken { verified.set.token }
    }

    /// A record and its verification result: what the verification stage hands on.
    public struct Checked: Sendable {
        public let record: IntakeRecord
        let result: Result<Verified, VerificationError>

        /// Waiting for its issuer's keys: the lane of the subject it claims, which it holds back.
        var waitingLane: String? {
            guard case .failure(let error) = result, error.isRetryable else { return nil }
            return error.unverifiedSubject ?? ""
        }

        /// The lane of a verified token's subject.
        var lane: String? {
            guard case .success(let verified) = result else { return nil }
            return verified.set.token.laneKey
        }
    }

    /// A record with its verdict and ledger entry: what admission hands to the ledger writer.
    public struct Admitted: Sendable {
        public let record: IntakeRecord
        var verdict: Verdict
        var entry: LedgerEntry
    }

    /// Verifies every record of the batch, on every core.
    public func check(_ records: [IntakeRecord]) async -> [Checked] {
        let results = await verifyAll(records.map(\.message))
        return zip(records, results).map { Checked(record: $0, result: $1) }
    }

    /// Verifies a record again (one that waited for its issuer's keys).
    func checkAgain(_ checked: Checked) async -> Checked {
        Checked(record: checked.record, result: await verify(checked.record.message))
    }

    /// Admission: resolves and plans each verified record, dead-letters each invalid one, and
    /// makes their ledger entries, in order. A subject lookup that cannot be made now waits,
    /// retrying. Returns the admitted records and, when the process stopped first (or a record
    /// still waits for keys), the rest of the batch, not admitted, from the first such record on.
    public func admit(_ batch: [Checked]) async -> (admitted: [Admitted], rest: ArraySlice<Checked>) {
        var verdicts: [Verdict] = []
        verdicts.reserveCapacity(batch.count)
        resolving: for checked in batch {
            switch checked.result {
            case .success(let verified):
                // The subject's local user: a lookup that cannot be made now makes admission
                // wait here rather than record the event unresolved.
                var attempt = 0
                while true {
                    switch await engine.resolver.resolve(verified.set.token) {
                    case .resolved(let resolution):
                        let user: String? = if case .user(let u) = resolution { u } else { nil }
                        let plan = engine.planner.plan(verified.set.token, subject: resolution)
                        verdicts.append(.valid(ValidEvent(verified, user: user, plan: plan)))
                        continue resolving
                    case .retry(let reason):
                        metrics.retried("subject_lookup")
                        logger.warning("subject lookup failed; will retry", metadata: [
                            "warden.source": "\(checked.record.message.source)", "warden.reason": "\(reason)", "warden.attempt": "\(attempt)",
                        ])
                        guard await stop.pause(backoff(attempt)) else { break resolving }
                        attempt += 1
                    }
                }
            case .failure(let error) where error.isRetryable:
                break resolving
            case .failure(let error):
                verdicts.append(.invalid(code: error.reportedCode, description: error.description))
            }
        }

        // Dead letters first: an invalid message is committed only once its dead letter is durable.
        let invalid = verdicts.indices.filter { if case .invalid = verdicts[$0] { true } else { false } }
        if !invalid.isEmpty {
            let firstUnsent = await withTaskGroup(of: (Int, Bool).self) { group in
                for i in invalid {
                    guard case .invalid(let code, let description) = verdicts[i] else { continue }
                    metrics.verifyFailure(code)
                    let message = batch[i].record.message
                    group.addTask {
                        // A dead letter that can never be produced (refused by the cluster even
                        // truncated) is kept in the ledger only: the message is still recorded
                        // and committed, never retried for ever.
                        let sent = await attempting("dead-letter") { () async throws -> Bool in
                            try await deadLetters.deadLetter(value: message.value, code: code, description: description,
                                                             source: message.source)
                            return true
                        }
                        if case .stopped = sent { return (i, false) }
                        return (i, true)
                    }
                }
                var failed: [Int] = []
                for await (i, ok) in group where !ok { failed.append(i) }
                return failed.min()
            }
            if let firstUnsent { verdicts.removeSubrange(firstUnsent...) }
        }

        var admitted: [Admitted] = []
        admitted.reserveCapacity(verdicts.count)
        for (checked, verdict) in zip(batch, verdicts) {
            let message = checked.record.message
            switch verdict {
            case .valid(let event):
                let plan = event.plan
                // The event is claimed together with its outbox: the planned steps, all pending.
                let steps = plan.steps.map { OutboxStep(index: $0.index, kind: $0.action.kind, action: Self.encode($0)) }
                let outcome: EventOutcome = !steps.isEmpty ? .pending : plan.isUnresolved ? .unresolved : .processed
                var claimed = ledgerEvent(event.verified, message)
                if !steps.isEmpty {
                    // The claim takes the event's lease: its first step needs no write of its own.
                    claimed.leaseOwner = leaseOwner
                    claimed.leaseUntil = Date().timeIntervalSince1970 + leaseSeconds
                }
                admitted.append(Admitted(record: checked.record, verdict: verdict,
                                         entry: .event(claimed, outcome: outcome, steps: steps)))
            case .invalid(let code, let description):
                metrics.deadLettered()
                admitted.append(Admitted(record: checked.record, verdict: verdict,
                                         entry: .rejection(Rejection(token: message.value, source: message.source, code: code,
                                                                     description: description, receivedAt: message.receivedAt))))
            }
        }
        return (admitted, batch[verdicts.count...])
    }

    /// The ledger writer: writes admitted records in one atomic write (retried until it
    /// succeeds or the process stops), and settles each record that is then finished. Returns
    /// the events whose steps are to run: new events with steps, and duplicates (a crash may
    /// have left their steps pending). When the process stops first, every record is abandoned.
    public func record(_ batch: [Admitted]) async -> [Work] {
        guard !batch.isEmpty else { return [] }
        var batch = batch
        let claims: [Claim?]
        switch await attempting("ledger", { [batch] in try await ledger.record(batch.map(\.entry)) }) {
        case .done(let written): claims = written
        case .stopped:
            for admitted in batch { admitted.record.acknowledgement.settle(.abandoned) }
            return []
        case .refused:
            // One entry the store can never hold must not stop the others: they are written one
            // by one, and an event the store refuses becomes a dead-lettered rejection.
            claims = await recordOneByOne(&batch)
        }
        var work: [Work] = []
        // Outcomes counted here and added to the metrics once per batch.
        var outcomes = OutcomeCounts()
        defer { outcomes.report(to: metrics) }
        for (admitted, claim) in zip(batch, claims) {
            let message = admitted.record.message
            let acknowledgement = admitted.record.acknowledgement
            switch (admitted.verdict, claim) {
            case (.valid(let event), .new(let id)?):
                if !event.plan.unknownTypes.isEmpty {
                    metrics.counter("warden_unknown_event_types_total").increment(by: event.plan.unknownTypes.count)
                    logger.notice("event type without a policy entry: recorded, no steps", metadata: [
                        "warden.types": "\(event.plan.unknownTypes.map(\.uri).joined(separator: ","))", "warden.event_id": "\(id)",
                    ])
                }
                if event.plan.isUnresolved {
                    logger.notice("subject resolved to no local user; steps that need one were not planned", metadata: metadata(event.token, message, eventID: id))
                }
                guard case .event(_, _, let steps) = admitted.entry else { preconditionFailure("entries follow verdicts") }
                let outcome: EventOutcome = event.plan.isUnresolved ? .unresolved : .processed
                if steps.isEmpty {
                    outcomes.add(outcome.rawValue)
                    logger.info("event recorded", metadata: metadata(event.token, message, eventID: id))
                    acknowledgement.settle(.recorded(eventID: id, outcome: outcome))
                } else {
                    var new = Work(record: admitted.record, eventID: id, isNew: true, steps: steps, planned: event.plan.steps,
                                   outcomeIfDone: outcome, context: StepContext(token: event.token, user: event.user))
                    if case .event(let claimed, _, _) = admitted.entry { new.leasedUntil = claimed.leaseUntil ?? 0 }
                    work.append(new)
                }
            case (.valid(let event), .duplicate(let id)?):
                outcomes.add("duplicate")
                logger.info("duplicate event", metadata: metadata(event.token, message, eventID: id))
                // A crash may have left this event's steps part-done: what is still pending runs
                // when its turn in the subject's lane comes (read from the outbox then).
                work.append(Work(record: admitted.record, eventID: id, isNew: false, steps: [],
                                 outcomeIfDone: event.plan.isUnresolved ? .unresolved : .processed,
                                 context: StepContext(token: event.token, user: event.user)))
            case (.invalid(let code, let description), _):
                outcomes.add("invalid")
                logger.warning("invalid token dead-lettered", metadata: [
                    "warden.source": "\(message.source)", "warden.err": "\(code)", "warden.reason": "\(description)",
                    "warden.token": "\(TokenDigest.short(message.value))",
                ])
                acknowledgement.settle(.rejected(code: code, description: description))
            case (.valid, nil):
                preconditionFailure("the ledger returned no claim for an event")
            }
        }
        for admitted in batch[claims.count...] { admitted.record.acknowledgement.settle(.abandoned) }
        return work
    }

    /// Writes entries one at a time, in order; an event the ledger refuses for good is
    /// dead-lettered and recorded as a rejection instead. Returns the claims of the entries
    /// written before the process stopped (a prefix of `batch`).
    private func recordOneByOne(_ batch: inout [Admitted]) async -> [Claim?] {
        var claims: [Claim?] = []
        for i in batch.indices {
            let entry = batch[i].entry
            switch await attempting("ledger", { try await ledger.record([entry]) }) {
            case .done(let written):
                claims.append(written[0])
                continue
            case .stopped:
                return claims
            case .refused(let error):
                let message = batch[i].record.message
                let code = SETErrorCode.invalidRequest.rawValue
                let description = "the ledger cannot store this event: \(error)"
                let rejection = Rejection(token: message.value, source: message.source, code: code, description: description,
                                          receivedAt: message.receivedAt)
                switch await attempting("dead-letter", {
                    try await deadLetters.deadLetter(value: message.value, code: code, description: description, source: message.source)
                }) {
                case .stopped: return claims
                case .done: metrics.deadLettered()
                case .refused: break  // kept in the ledger only
                }
                metrics.verifyFailure(code)
                batch[i].entry = .rejection(rejection)
                batch[i].verdict = .invalid(code: code, description: description)
                if case .stopped = await attempting("ledger", { try await ledger.record([.rejection(rejection)]) }) {
                    return claims
                }
                claims.append(nil)
            }
        }
        return claims
    }

    /// An event whose steps are to run, with the record it came in.
    public struct Work: Sendable {
        public let record: IntakeRecord
        var eventID: Int64
        var isNew: Bool
        /// The steps to run; for a redelivery, read from the outbox when its turn comes.
        var steps: [OutboxStep]
        /// The steps as planned, for a new event (a resumed one reads them from its outbox).
        var planned: [PlannedStep] = []
        var outcomeIfDone: EventOutcome
        var context: StepContext
        /// Until when this process holds the event's lease (taken with its claim); 0 if not.
        var leasedUntil = 0.0

        var message: IntakeMessage { record.message }

        /// One subject's events act in order: keyed by the local user, else the provider's
        /// subject (scoped to its issuer).
        public var subjectKey: String {
            context.user.map { "user:" + $0 } ?? context.token.laneKey
        }
    }

    /// Runs one event's steps; its disposition once they are all done or failed for good, or
    /// `.abandoned` when the process stopped first.
    public func run(_ work: Work) async -> Disposition {
        guard let outcome = await runSteps(work) else {
            // Left for the next delivery: the lease, if this process holds it, is given up at
            // once, so the next owner does not wait for it to run out.
            _ = try? await ledger.lease(event: work.eventID, owner: leaseOwner, seconds: 0)
            return .abandoned
        }
        return work.isNew ? .recorded(eventID: work.eventID, outcome: outcome) : .duplicate(eventID: work.eventID)
    }

    /// Runs an event's pending steps in order and records each outcome, then the event's.
    /// A step that fails for good is dead-lettered with its reason, and the others still run.
    /// Returns nil when the process stops while a step waits to be retried.
    func runSteps(_ work: Work) async -> EventOutcome? {
        var work = work
        if !work.isNew {
            // A redelivery: its steps are read now, in its turn in the subject's lane, so steps
            // the delivery before it finished meanwhile are not run again.
            guard let steps = await retrying("ledger", { try await ledger.steps(ofEvent: work.eventID) }) else { return nil }
            if steps.contains(where: { $0.status == .failed }) { work.outcomeIfDone = .failed }
            work.steps = steps.filter { $0.status == .pending }
            // Nothing left: the delivery before finished the event and recorded its outcome.
            if work.steps.isEmpty { return work.outcomeIfDone }
        }
        // The event's lease: no other process (a partition's old owner after a rebalance, or a
        // killed process whose lease has not run out yet) runs its steps while this one does.
        // While another holds it, this one waits; once it has it after waiting, the step's
        // status is read again, as the holder may have finished it. Nil when stopping.
        var leasedUntil = work.leasedUntil
        func holdLease() async -> (held: Bool, waited: Bool) {
            var waited = false
            while true {
                let now = Date().timeIntervalSince1970
                guard now > leasedUntil - leaseSeconds / 3 else { return (true, waited) }
                guard let granted = await retrying("ledger", { try await ledger.lease(event: work.eventID, owner: leaseOwner,
                                                                                      seconds: leaseSeconds) }) else { return (false, waited) }
                if granted {
                    leasedUntil = now + leaseSeconds
                    return (true, waited)
                }
                if !waited {
                    logger.notice("another owner runs this event's steps; waiting for its lease", metadata: ["warden.event_id": "\(work.eventID)"])
                }
                waited = true
                metrics.retried("lease")
                guard await stop.pause(min(1, leaseSeconds / 3)) else { return (false, waited) }
            }
        }
        var failed = false
        var finished = false
        for step in work.steps {
            let isLast = step.index == work.steps.last?.index
            guard let planned = work.planned.first(where: { $0.index == step.index }) ?? Self.decode(step.action) else {
                // Cannot happen with this version's ledger; refuse to guess what to do.
                failed = true
                guard await retrying("ledger", { try await ledger.recordStep(step.index, of: work.eventID, status: .failed,
                                                                             detail: "the step in the ledger cannot be read",
                                                                             finishing: isLast ? .failed : nil) }) != nil
                else { return nil }
                finished = isLast
                continue
            }
            var context = work.context
            context.eventType = planned.eventType
            var attempt = 0, refusals = 0
            var previousCall: Double? = nil
            let target = planned.action.targets.first ?? planned.action.store.map { "store:" + $0 } ?? step.kind
            let about: Logger.Metadata = [
                "warden.event_id": "\(work.eventID)", "warden.step": "\(step.index)", "warden.kind": "\(step.kind)",
                "warden.target": "\(target)",
            ]
            stepLoop: while true {
                guard breakers.allow(target) else {
                    // The target is resting after repeated failures: wait without calling it,
                    // and look again soon, so events flow as soon as the trial call succeeds.
                    metrics.retried("circuit_open")
                    guard await stop.pause(breakers.retryDelay(target)) else { return nil }
                    continue
                }
                // The lease first, outside the action: waiting for another owner's lease must
                // not hold up a revocation.
                let lease = await holdLease()
                guard lease.held else { return nil }
                if lease.waited {
                    // The lease's last holder may have recorded this step meanwhile.
                    guard let current = await retrying("ledger", { try await ledger.steps(ofEvent: work.eventID) }) else { return nil }
                    if let recorded = current.first(where: { $0.index == step.index }), recorded.status != .pending {
                        if recorded.status == .failed { failed = true }
                        finished = isLast
                        break stepLoop
                    }
                }
                // The call and the recording of its outcome are one action for the door: a Kafka
                // partition's revocation waits for it to end, and none starts once the door has
                // taken the message back (its next owner runs the step).
                let acknowledgement = work.record.acknowledgement
                guard acknowledgement.beginAction() else {
                    logger.notice("message taken back by its door; its steps are left to the next owner",
                                  metadata: ["warden.event_id": "\(work.eventID)", "warden.source": "\(work.message.source)"])
                    return nil
                }
                let next: StepNext = await {
                    defer { acknowledgement.endAction() }
                    let calledAt = breakers.currentTime
                    var outcome = await engine.executor.execute(planned.action, context: context)
                    if case .retry = outcome {
                        breakers.record(target, reachable: false, calledAt: calledAt)
                        // The target answered someone else since our last try, yet not us: this
                        // event, not the target, is the problem.
                        if let previousCall, breakers.succeeded(target, since: previousCall) { refusals += 1 }
                        previousCall = calledAt
                        if refusals >= maximumStepAttempts, case .retry(let reason, _) = outcome {
                            outcome = .failed("gave up after \(refusals) attempts while the target served other events: \(reason)")
                        }
                    } else {
                        breakers.record(target, reachable: true)
                    }
                    metrics.step(kind: step.kind, result: outcome.result)
                    let answeredAt = ContinuousClock.now
                    switch outcome {
                    case .done(let detail):
                        logger.info("step done", metadata: about.merging(["warden.detail": "\(detail)"]) { $1 })
                        let finishing: EventOutcome? = isLast ? (failed ? .failed : work.outcomeIfDone) : nil
                        guard await retrying("ledger", { try await ledger.recordStep(step.index, of: work.eventID, status: .done,
                                                                                     detail: detail, finishing: finishing) })
                            != nil else { return .stopped }
                        metrics.stepRecordSeconds.recordElapsed(since: answeredAt)
                        return .recorded
                    case .failed(let reason):
                        failed = true
                        logger.critical("step failed permanently; dead-lettered", metadata: about.merging(["warden.reason": "\(reason)"]) { $1 })
                        let description = "\(step.kind) step \(step.index) failed: \(reason)"
                        let sent = await attempting("dead-letter") { () async throws -> Bool in
                            try await deadLetters.deadLetter(value: work.message.value, code: "step-failed", description: description,
                                                             source: work.message.source)
                            return true
                        }
                        switch sent {
                        case .stopped: return .stopped
                        case .done: metrics.deadLettered()
                        case .refused: break  // kept in the ledger only: the step is recorded failed below
                        }
                        guard await retrying("ledger", { try await ledger.recordStep(step.index, of: work.eventID, status: .failed,
                                                                                     detail: reason, finishing: isLast ? .failed : nil) })
                            != nil else { return .stopped }
                        metrics.stepRecordSeconds.recordElapsed(since: answeredAt)
                        return .recorded
                    case .retry(let reason, let after):
                        metrics.retried("step")
                        logger.warning("step will be retried", metadata: about.merging([
                            "warden.reason": "\(reason)", "warden.attempt": "\(attempt)",
                        ]) { $1 })
                        // While the target is down its breaker paces the calls: a step's own backoff
                        // stays short, so the step runs again within seconds of the target's return.
                        return .retry(after: after.map { min(max($0, initialBackoff), 300) }
                            ?? (breakers.isOpen(target) ? initialBackoff : backoff(attempt)))
                    }
                }()
                switch next {
                case .recorded:
                    finished = isLast
                    break stepLoop
                case .stopped:
                    return nil
                case .retry(let wait):
                    // Waiting outside the action: a revocation does not wait for the pause.
                    guard await stop.pause(wait) else { return nil }
                    attempt += 1
                }
            }
        }
        let outcome: EventOutcome = failed ? .failed : work.outcomeIfDone
        if !finished {
            guard await retrying("ledger", { try await ledger.record(outcome: outcome, forEvent: work.eventID) }) != nil else { return nil }
        }
        if work.isNew { metrics.outcome(outcome.rawValue) }
        logger.info("event's steps finished", metadata: [
            "warden.event_id": "\(work.eventID)", "warden.outcome": "\(outcome.rawValue)", "warden.source": "\(work.message.source)",
        ])
        return outcome
    }

    /// What one attempt at a step came to.
    private enum StepNext {
        /// Its outcome is recorded (by this attempt, or by the lease's previous holder).
        case recorded
        /// Run it again after this many seconds.
        case retry(after: Double)
        /// The process is stopping.
        case stopped
    }

    static func encode(_ step: PlannedStep) -> String {
        // A PlannedStep holds only strings, numbers and arrays of them: encoding cannot fail.
        String(decoding: (try? JSONEncoder().encode(step)) ?? Data(), as: UTF8.self)
    }

    static func decode(_ text: String) -> PlannedStep? {
        try? JSONDecoder().decode(PlannedStep.self, from: Data(text.utf8))
    }

    /// Verifies every message, the batch split across `parallelism` tasks.
    private func verifyAll(_ batch: [IntakeMessage]) async -> [Result<Verified, VerificationError>] {
        let workers = min(parallelism, max(1, batch.count / 8))
        if workers <= 1 {
            var results: [Result<Verified, VerificationError>] = []
            results.reserveCapacity(batch.count)
            for message in batch { results.append(await verify(message)) }
            return results
        }
        // Each task takes the next unverified message, so a task slowed by another thread on
        // its core does not leave the others idle at the end of the batch.
        let next = SharedIndex()
        return await withTaskGroup(of: [(Int, Result<Verified, VerificationError>)].self) { group in
            for _ in 0..<workers {
                group.addTask {
                    var part: [(Int, Result<Verified, VerificationError>)] = []
                    while case let i = next.take(), i < batch.count {
                        part.append((i, await verify(batch[i])))
                    }
                    return part
                }
            }
            var results = [Result<Verified, VerificationError>?](repeating: nil, count: batch.count)
            for await part in group { for (i, result) in part { results[i] = result } }
            return results.map { $0! }
        }
    }

    private func verify(_ message: IntakeMessage) async -> Result<Verified, VerificationError> {
        let started = ContinuousClock.now
        // Whitespace around a compact JWS (a trailing newline from a file or a shell) is not
        // part of it; a dead letter keeps the value as received, the ledger the token verified.
        let result = await verifier.verify(trimmedASCIIWhitespace(message.value))
        metrics.verifySeconds.recordElapsed(since: started)
        return result.map(Verified.init)
    }

    /// The event's ledger record. Reads the verified token in place, through its reference:
    /// a copy of the `VerifiedSET` would retain each of its strings and arrays.
    private func ledgerEvent(_ verified: Verified, _ message: IntakeMessage) -> LedgerEvent {
        // The verified token is the message value less surrounding whitespace (usually none:
        // then the value itself is shared, not copied). It verified, so it is ASCII.
        let trimmed = trimmedASCIIWhitespace(message.value)
        return LedgerEvent(
            issuer: verified.set.token.issuer, jti: verified.set.token.jti,
            tokenBytes: trimmed.count == message.value.count ? message.value : Array(trimmed),
            source: message.source, eventTypes: verified.set.token.events.map(\.type.uri),
            subject: verified.set.token.primarySubject.map { $0.jsonText }, keyID: verified.set.header.keyID,
            algorithm: verified.set.header.algorithm.rawValue, keyThumbprint: verified.set.keyThumbprint,
            issuedAt: verified.set.token.issuedAt, receivedAt: message.receivedAt)
    }

    /// What calling something until it succeeds came to.
    enum Attempted<T> {
        case done(T)
        /// It failed in a way no retry can mend (a value the ledger cannot hold, a dead letter
        /// the cluster will never take, a step recorded by another owner).
        case refused(any Error)
        /// The process is stopping.
        case stopped
    }

    /// Runs `body` until it succeeds, backing off between failures a retry may mend; a failure
    /// that no retry can mend is returned at once, and counted.
    func attempting<T>(_ what: String, _ body: () async throws -> T) async -> Attempted<T> {
        var attempt = 0
        while true {
            do {
                return .done(try await body())
            } catch {
                guard Self.isRetryable(error) else {
                    metrics.counter("warden_permanent_failures_total", [("what", what)]).increment()
                    logger.critical("\(what) failed for good; not retried", metadata: ["warden.reason": "\(error)"])
                    return .refused(error)
                }
                metrics.retried(what)
                logger.error("\(what) failed; will retry", metadata: ["warden.reason": "\(error)", "warden.attempt": "\(attempt)"])
                guard await stop.pause(backoff(attempt)) else { return .stopped }
                attempt += 1
            }
        }
    }

    /// `attempting`, for callers to whom a refusal and a stop mean the same: leave the work for
    /// later (nil).
    private func retrying<T>(_ what: String, _ body: () async throws -> T) async -> T? {
        if case .done(let value) = await attempting(what, body) { return value }
        return nil
    }

    /// Whether a retry may mend `error`: each error type says so; anything else is assumed
    /// transient.
    static func isRetryable(_ error: any Error) -> Bool {
        switch error {
        case let error as LedgerError: error.isRetryable
        case let error as DeadLetterError: error.isRetryable
        default: true
        }
    }

    func backoff(_ attempt: Int) -> Double {
        let base = min(maximumBackoff, initialBackoff * pow(2, Double(min(attempt, 16))))
        return base * Double.random(in: 0.5...1.0)
    }

    private func metadata(_ token: SecurityEventToken, _ message: IntakeMessage, eventID: Int64) -> Logger.Metadata {
        [
            "warden.source": "\(message.source)", "warden.iss": "\(token.issuer)", "warden.jti": "\(token.jti)",
            "warden.events": "\(token.events.map(\.type.name).joined(separator: ","))", "warden.event_id": "\(eventID)",
        ]
    }
}

func trimmedASCIIWhitespace(_ bytes: [UInt8]) -> ArraySlice<UInt8> {
    let isSpace: (UInt8) -> Bool = { $0 == 0x20 || $0 == 0x09 || $0 == 0x0A || $0 == 0x0D }
    guard let start = bytes.firstIndex(where: { !isSpace($0) }), let end = bytes.lastIndex(where: { !isSpace($0) }) else {
        return []
    }
    return bytes[start...end]
}

/// Tokens never appear whole in logs: a short digest identifies one.
enum TokenDigest {
    static func short(_ bytes: [UInt8]) -> String {
        // FNV-1a, 64 bits: enough to tell tokens apart in logs, useless for recovering them.
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in bytes { hash = (hash ^ UInt64(b)) &* 0x100_0000_01b3 }
        return "fnv1a:" + String(hash, radix: 16) + " (\(bytes.count) bytes)"
    }
}

/// How many events of a batch ended with each outcome (a handful of distinct ones).
struct OutcomeCounts {
    private var counts: [(outcome: String, count: Int)] = []

    mutating func add(_ outcome: String) {
        if let i = counts.firstIndex(where: { $0.outcome == outcome }) { counts[i].count += 1 } else { counts.append((outcome, 1)) }
    }

    func report(to metrics: WardenMetrics) {
        for (outcome, count) in counts { metrics.outcome(outcome, count: count) }
    }
}

/// An index handed out once to each of several tasks.
final class SharedIndex: Sendable {
    private let next = Atomic<Int>(0)
    func take() -> Int { next.add(1, ordering: .relaxed).oldValue }
}
