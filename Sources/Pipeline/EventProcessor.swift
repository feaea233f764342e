import Foundation
public import Invalidation
public import Ledger
public import Logging
import SecurityEvents
public import TokenVerification
import Synchronization

/// What each stage of `EventPipeline` does to records: verify (`check`, on every core), admit
/// (subject, plan, dead letters), record (one atomic ledger write, in arrival order, after
/// which outcomes are durable and records are settled), and run an event's steps.
public struct EventProcessor: Sendable {
    public struct Configuration: Sendable {
        /// Backoff bounds for retries (keys unavailable, subject lookups, ledger or dead-letter
        /// failures, steps).
        public var retry: Persistence.Timing
        /// Tasks verifying one batch at once.
        public var parallelism: Int
        /// How events' steps run: attempts, leases, circuit breakers.
        public var steps: StepRunner.Configuration

        /// `parallelism`: by default, one task per core.
        public init(retry: Persistence.Timing = .init(), parallelism: Int? = nil, steps: StepRunner.Configuration = .init()) {
            self.retry = retry
            self.parallelism = max(1, parallelism ?? ProcessInfo.processInfo.activeProcessorCount)
            self.steps = steps
        }
    }

    public let verifier: SETVerifier
    public let ledger: any Ledger
    public let deadLetters: any DeadLetterSink
    public let metrics: WardenMetrics
    public let logger: Logger
    public let stop: StopSignal
    /// Planner, subject resolution and executor. Default: record only.
    public let engine: InvalidationEngine
    public let configuration: Configuration
    /// Retries with backoff, ending when the process stops.
    let persistence: Persistence
    /// Runs events' steps and records their outcomes in the ledger.
    let steps: StepRunner
    /// The events whose steps this process has taken in hand (in their subject's lane, until
    /// settled), a retry pause included: a resume pass leaves them to it.
    let inSteps = EventsInHand()

    public init(verifier: SETVerifier, ledger: any Ledger, deadLetters: any DeadLetterSink, metrics: WardenMetrics,
                logger: Logger, stop: StopSignal, engine: InvalidationEngine = .recordOnly, configuration: Configuration = .init()) {
        self.verifier = verifier
        self.ledger = ledger
        self.deadLetters = deadLetters
        self.metrics = metrics
        self.logger = logger
        self.stop = stop
        self.engine = engine
        self.configuration = configuration
        let persistence = Persistence(timing: configuration.retry, stop: stop, observer: metrics, logger: logger,
                                      isRetryable: Self.isRetryable)
        self.persistence = persistence
        self.steps = StepRunner(configuration: configuration.steps, executor: engine.executor, journal: LedgerJournal(ledger: ledger),
                                deadLetters: deadLetters, persistence: persistence, logger: logger)
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

    /// A record with its verdict and ledger entry: what admission hands to the ledger writer
    /// (a reference, for the reason `IntakeRecord` is one: an entry holds a dozen strings).
    public final class Admitted: Sendable {
        public let record: IntakeRecord
        let verdict: Verdict
        let entry: LedgerEntry

        init(record: IntakeRecord, verdict: Verdict, entry: LedgerEntry) {
            self.record = record
            self.verdict = verdict
            self.entry = entry
        }

        /// Nothing to run once written: a rejection, or an event planned without steps.
        var recordOnly: Bool {
            if case .event(_, _, let steps) = entry { steps.isEmpty } else { true }
        }
    }

    /// Verifies every record of the batch, on every core.
    public func check(_ records: [IntakeRecord]) async -> [Checked] {
        let messages = records.map(\.message)
        var results = await verifyAll(messages)
        await judgeStoredTokensAsOfTheirArrival(messages, &results)
        return zip(records, results).map { Checked(record: $0, result: $1) }
    }

    /// How often the ledger is asked whether it holds a token refused for its age before it is
    /// left refused: a push request must not wait for a ledger outage to end.
    static let storedTokenLookupAttempts = 3

    /// A token refused only for its age (`max-age`, a logout token's `exp`) whose very bytes the
    /// ledger holds as an event is a redelivery of one accepted when it first arrived: a Kafka
    /// message read again after a crash or a long stop, a transmitter's retry of a push whose
    /// answer was lost. It is verified again with its claims judged as of that first arrival, as
    /// a resumed event is, and goes on as that event's duplicate (its pending steps, if any,
    /// run). Refused, its steps would be left with nothing to run them, and its sender told a
    /// SET Warden acted on was refused. A token the ledger does not hold, or holds other bytes
    /// under its (issuer, jti), stays refused; so does every token when the ledger cannot say.
    private func judgeStoredTokensAsOfTheirArrival(_ messages: [IntakeMessage], _ results: inout [Result<Verified, VerificationError>]) async {
        let aged = results.indices.filter {
            guard case .failure(let error) = results[$0] else { return false }
            return error.kind == .tooOld || error.kind == .expired
        }
        guard !aged.isEmpty, case .done(let stored) = await attempting("ledger", maximumAttempts: Self.storedTokenLookupAttempts, {
            try await storedEvents(holding: aged.map { messages[$0] })
        }) else { return }
        for (j, state) in stored {
            let i = aged[j]
            var message = messages[i]
            message.claimsTime = .at(state.receivedAt)
            results[i] = await verify(message)
            if case .success = results[i] {
                logger.info("a token the ledger holds, redelivered past its age limit, is judged as of its first arrival", metadata: [
                    "warden.source": "\(message.source)", "warden.event": "\(state.id)",
                ])
            }
        }
    }

    /// The RFC 8935 code `message` is refused with for good at verification (`check`), or nil:
    /// it verifies, or may later (its issuer's keys are unavailable). Nothing is recorded or
    /// dead-lettered; the refusal is counted in `warden_verify_failures_total`.
    public func refusalCode(of message: IntakeMessage) async -> String? {
        guard case .failure(let error) = await check([IntakeRecord(message, acknowledgement: Unanswered())])[0].result,
              !error.isRetryable else { return nil }
        metrics.verifyFailure(error.reportedCode)
        return error.reportedCode
    }

    /// The events the ledger holds whose stored token is the very value of one of `messages`
    /// (less surrounding whitespace; found by issuer and jti, read unverified, and compared by
    /// SHA-256), by the message's index; none without a ledger that can say.
    func storedEvents(holding messages: [IntakeMessage]) async throws(LedgerError) -> [Int: EventState] {
        guard let ledger = ledger as? any AuditingLedger else { return [:] }
        var wanted: [(i: Int, key: EventKey, digest: String)] = []
        for (i, message) in messages.enumerated() {
            let token = Array(trimmedASCIIWhitespace(message.value))
            let claimed = UnverifiedClaims(token)
            guard let issuer = claimed.issuer, let jti = claimed.jti else { continue }
            wanted.append((i, EventKey(issuer: issuer, jti: jti), AuditChain.sha256Hex(token)))
        }
        guard !wanted.isEmpty else { return [:] }
        let states = try await ledger.eventStates(wanted.map(\.key))
        var found: [Int: EventState] = [:]
        for (i, key, digest) in wanted {
            if let state = states[key], state.tokenSHA256 == digest { found[i] = state }
        }
        return found
    }

    /// Verifies a record again (one that waited for its issuer's keys): a record whose claims
    /// are judged now is judged as of its arrival instead, if that is at most `arrivalWindow`
    /// seconds ago (see `EventPipeline.arrivalWindow`).
    func checkAgain(_ checked: Checked, arrivalWindow: Double = 0) async -> Checked {
        var message = checked.record.message
        if arrivalWindow > 0 { message.claimsTime = Self.claimsTime(afterWaiting: message, now: verifier.clock.now(), window: arrivalWindow) }
        return Checked(record: checked.record, result: await check([IntakeRecord(message, acknowledgement: Unanswered())])[0].result)
    }

    /// When the claims of `message`, verified again after a wait, are judged: at the time it
    /// was to be judged at (its `received-at`) if that is still within `window` of now, else
    /// when this process fetched it if that is, else now. A token's own `iat` (a replay) stays.
    static func claimsTime(afterWaiting message: IntakeMessage, now: Double, window: Double) -> SETVerifier.ClaimsTime {
        switch message.claimsTime {
        case .issuedAt: return .issuedAt
        case .at(let time) where now - time <= window: return .at(time)
        case .now, .at: return now - message.receivedAt <= window ? .at(min(message.receivedAt, now)) : .now
        }
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
                // A verification event with a `state` is taken only when Warden asked for that
                // state (`warden stream verify`); its arrival is recorded for the one waiting.
                switch await verificationState(of: verified.set.token) {
                case .taken: break
                case .refused(let description):
                    verdicts.append(.invalid(code: SETErrorCode.invalidState.rawValue, description: description))
                    continue resolving
                case .stopped: break resolving
                }
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
                    case .refused(let reason):
                        // Not "no such user": recorded refused and dead-lettered, never acted on
                        // as if nobody had the account.
                        metrics.failedForGood("subject_lookup")
                        logger.error("subject lookup refused; the event is dead-lettered", metadata: [
                            "warden.source": "\(checked.record.message.source)", "warden.reason": "\(reason)",
                        ])
                        verdicts.append(.invalid(code: Self.subjectLookupRefused, description: reason))
                        continue resolving
                    }
                }
            case .failure(let error) where error.isRetryable:
                break resolving
            case .failure(let error):
                if error.kind == .keysUnavailableTooLong { metrics.failedForGood("keys_unavailable") }
                verdicts.append(.invalid(code: error.reportedCode, description: error.description))
            }
        }

        // Dead letters first: an invalid message is committed only once its dead letter is durable.
        let invalid = verdicts.indices.filter { if case .invalid = verdicts[$0] { true } else { false } }
        // Those whose dead letter was delivered (one refused for good is kept in the ledger only,
        // and counted as a permanent failure, not as a dead letter).
        var delivered = Set<Int>()
        if !invalid.isEmpty {
            let firstUnsent = await withTaskGroup(of: (Int, DeadLetterOutcome).self) { group in
                for i in invalid {
                    guard case .invalid(let code, let description) = verdicts[i] else { continue }
                    metrics.verifyFailure(code)
                    let message = batch[i].record.message
                    group.addTask {
                        // A dead letter that can never be produced (refused by the cluster even
                        // truncated) is kept in the ledger only: the message is still recorded
                        // and committed, never retried for ever.
                        let sent = await attempting("dead-letter") { () async throws -> Bool in
                            try await deadLetters.deadLetter(value: message.value, key: message.key, headers: message.headers,
                                                             code: code, description: description, source: message.source)
                            return true
                        }
                        switch sent {
                        case .done: return (i, .delivered)
                        case .refused: return (i, .refused)
                        case .stopped: return (i, .stopped)
                        }
                    }
                }
                var failed: [Int] = []
                for await (i, sent) in group {
                    switch sent {
                    case .delivered: delivered.insert(i)
                    case .refused: break
                    case .stopped: failed.append(i)
                    }
                }
                return failed.min()
            }
            if let firstUnsent { verdicts.removeSubrange(firstUnsent...) }
        }

        var admitted: [Admitted] = []
        admitted.reserveCapacity(verdicts.count)
        for (index, (checked, verdict)) in zip(batch, verdicts).enumerated() {
            // The message is read where the record holds it, not copied whole for each event.
            let record = checked.record
            switch verdict {
            case .valid(let event):
                let plan = event.plan
                // The event is claimed together with its outbox: the planned steps, all pending.
                let steps = plan.steps.map { OutboxStep(index: $0.index, kind: $0.action.kind, action: $0.encoded) }
                let outcome: EventOutcome = !steps.isEmpty ? .pending : plan.isUnresolved ? .unresolved : .processed
                var claimed = ledgerEvent(event.verified, record.message)
                if !steps.isEmpty {
                    // The claim takes the event's lease: its first step needs no write of its own.
                    claimed.leaseOwner = configuration.steps.owner
                    claimed.leaseUntil = Date().timeIntervalSince1970 + configuration.steps.lease.timeInterval
                }
                admitted.append(Admitted(record: record, verdict: verdict,
                                         entry: .event(claimed, outcome: outcome, steps: steps)))
            case .invalid(let code, let description):
                if delivered.contains(index) { metrics.deadLettered() }
                admitted.append(Admitted(record: record, verdict: verdict,
                                         entry: .rejection(Rejection(token: record.message.value, source: record.message.source, code: code,
                                                                     description: description, receivedAt: record.message.receivedAt))))
            }
        }
        return (admitted, batch[verdicts.count...])
    }

    enum DeadLetterOutcome: Sendable { case delivered, refused, stopped }

    /// The error code of a valid event whose subject lookup the target refused.
    public static let subjectLookupRefused = "subject_lookup_refused"
    /// The error code of a valid event the ledger refused to store for good: no fault of the
    /// token, so not an RFC 8935 code (a push is answered "try again later", not 400).
    public static let ledgerRefused = "ledger_refused"

    /// Whether a refusal is this receiver's own, not a verdict on the SET: a sender that
    /// pushed or was polled for it keeps it and tries again.
    public static func isOwnRefusal(_ code: String) -> Bool { code == subjectLookupRefused || code == ledgerRefused }

    enum StateCheck: Sendable, Equatable {
        case taken
        /// `invalid_state`, and why.
        case refused(String)
        case stopped
    }

    /// A verification event with a `state` is taken only when Warden asked its issuer for that
    /// state (`warden stream verify`); its arrival is recorded for the one waiting. Any other
    /// token (a verification without a state too) is taken.
    /// `maximumAttempts`: for a caller that must answer soon (a push request), how often the
    /// ledger is tried before `.stopped` (answer "try again later"); nil: until it answers.
    func verificationState(of token: SecurityEventToken, maximumAttempts: Int? = nil) async -> StateCheck {
        guard let state = token.verificationState else { return .taken }
        let issuer = token.issuer, now = Date().timeIntervalSince1970
        switch await attempting("ledger", maximumAttempts: maximumAttempts, {
            try await ledger.verificationArrived(issuer: issuer, state: state, at: now)
        }) {
        case .done(true): return .taken
        case .done(false): return .refused("the verification event's state matches no verification requested of \(issuer)")
        case .refused(let error): return .refused("the verification event's state cannot be looked up: \(error)")
        case .stopped: return .stopped
        }
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
            // Read in place where a line is logged: a copy of the message retains each of its
            // parts, for every event, though the log level usually drops those lines.
            let record = admitted.record
            let acknowledgement = record.acknowledgement
            switch (admitted.verdict, claim) {
            case (.valid(let event), .new(let id)?):
                if !event.plan.unknownTypes.isEmpty {
                    metrics.counter("warden_unknown_event_types_total").increment(by: event.plan.unknownTypes.count)
                    logger.notice("event type without a policy entry: recorded, no steps", metadata: [
                        "warden.types": "\(event.plan.unknownTypes.map(\.uri).joined(separator: ","))", "warden.event_id": "\(id)",
                    ])
                }
                if event.plan.isUnresolved {
                    logger.notice("subject resolved to no local user; steps that need one were not planned", metadata: metadata(event.token, record.message, eventID: id))
                }
                guard case .event(let claimed, _, let steps) = admitted.entry else { preconditionFailure("entries follow verdicts") }
                let outcome: EventEnd = event.plan.isUnresolved ? .unresolved : .processed
                if let updated = event.token.events.first(where: { $0.type.isStreamUpdated }), let status = updated.status {
                    metrics.streamStatus(issuer: event.token.issuer, status: status)
                    logger.notice("stream status changed", metadata: [
                        "warden.iss": "\(event.token.issuer)", "warden.status": "\(status)", "warden.reason": "\(updated.reason ?? "")",
                    ])
                }
                if steps.isEmpty {
                    outcomes.add(outcome.rawValue)
                    logger.info("event recorded", metadata: metadata(event.token, record.message, eventID: id))
                    acknowledgement.settle(.recorded(eventID: id, outcome: EventOutcome(outcome)))
                } else {
                    acknowledgement.durable(.recorded(eventID: id, outcome: .pending))
                    work.append(Work(record: admitted.record, eventID: id, isNew: true, steps: steps, planned: event.plan.steps,
                                     outcomeIfDone: outcome, context: StepContext(token: event.token, user: event.user),
                                     leasedUntil: claimed.leaseUntil ?? 0))
                }
            case (.valid(let event), .duplicate(let id)?):
                outcomes.add("duplicate")
                logger.info("duplicate event", metadata: metadata(event.token, record.message, eventID: id))
                acknowledgement.durable(.duplicate(eventID: id))
                // A crash may have left this event's steps part-done: what is still pending runs
                // when its turn in the subject's lane comes (read from the outbox then).
                work.append(Work(record: admitted.record, eventID: id, isNew: false, steps: [],
                                 outcomeIfDone: event.plan.isUnresolved ? .unresolved : .processed,
                                 context: StepContext(token: event.token, user: event.user)))
            case (.invalid(let code, let description), _):
                outcomes.add("invalid")
                logger.warning("invalid token dead-lettered", metadata: [
                    "warden.source": "\(record.message.source)", "warden.err": "\(code)", "warden.reason": "\(description)",
                    "warden.token": "\(TokenDigest.short(record.message.value))",
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
                let code = Self.ledgerRefused
                let description = "the ledger cannot store this event: \(error)"
                let rejection = Rejection(token: message.value, source: message.source, code: code, description: description,
                                          receivedAt: message.receivedAt)
                switch await attempting("dead-letter", {
                    try await deadLetters.deadLetter(value: message.value, key: message.key, headers: message.headers,
                                                     code: code, description: description, source: message.source)
                }) {
                case .stopped: return claims
                case .done: metrics.deadLettered()
                case .refused: break  // kept in the ledger only
                }
                metrics.verifyFailure(code)
                batch[i] = Admitted(record: batch[i].record, verdict: .invalid(code: code, description: description),
                                    entry: .rejection(rejection))
                if case .stopped = await attempting("ledger", { try await ledger.record([.rejection(rejection)]) }) {
                    return claims
                }
                claims.append(nil)
            }
        }
        return claims
    }

    /// An event whose steps are to run, with the record it came in (a reference, as `Admitted` is).
    public final class Work: Sendable {
        public let record: IntakeRecord
        let eventID: Int64
        let isNew: Bool
        /// The steps to run; for a redelivery, read from the outbox when its turn comes.
        let steps: [OutboxStep]
        /// The steps as planned, for a new event (a resumed one reads them from its outbox).
        let planned: [PlannedStep]
        let outcomeIfDone: EventEnd
        let context: StepContext
        /// Until when this process holds the event's lease (taken with its claim); 0 if not.
        let leasedUntil: Double

        init(record: IntakeRecord, eventID: Int64, isNew: Bool, steps: [OutboxStep], planned: [PlannedStep] = [],
             outcomeIfDone: EventEnd, context: StepContext, leasedUntil: Double = 0) {
            self.record = record
            self.eventID = eventID
            self.isNew = isNew
            self.steps = steps
            self.planned = planned
            self.outcomeIfDone = outcomeIfDone
            self.context = context
            self.leasedUntil = leasedUntil
        }

        /// One subject's events act in order: keyed by the local user, else the provider's
        /// subject (scoped to its issuer).
        public var subjectKey: String {
            context.user.map { "user:" + $0 } ?? context.token.laneKey
        }
    }

    /// Runs one event's steps; its disposition once they are all done or failed for good, or
    /// `.abandoned` when the process stopped first (or the door took the message back).
    public func run(_ work: Work) async -> Disposition {
        await disposition(of: work, await steps.run(eventSteps(work)))
    }

    /// Runs the steps of new events together (their first attempts in one executor call, their
    /// outcomes in one ledger write; what is left of each then on its own); `finished` hears
    /// each one's disposition as it ends.
    public func run(together works: [Work], finished: @escaping @Sendable (Int, Disposition) async -> Void) async {
        await steps.runTogether(works.map(eventSteps)) { i, end in
            await finished(i, await disposition(of: works[i], end))
        }
    }

    private func eventSteps(_ work: Work) -> EventSteps {
        EventSteps(
            eventID: work.eventID, steps: work.isNew ? work.steps.map(JournalStep.init) : nil, planned: work.planned,
            context: work.context, outcomeIfDone: work.outcomeIfDone, leasedUntil: work.leasedUntil, message: work.record.message.value,
            source: work.record.message.source, permit: work.record.acknowledgement, receivedAt: work.record.message.receivedAt)
    }

    private func disposition(of work: Work, _ end: EventEnd?) async -> Disposition {
        guard let end else {
            // Left for the next delivery: the lease, if this process holds it, is given up at
            // once, so the next owner does not wait for it to run out.
            await steps.release(event: work.eventID)
            return .abandoned
        }
        guard work.isNew else { return .duplicate(eventID: work.eventID) }
        metrics.outcome(end.rawValue)
        return .recorded(eventID: work.eventID, outcome: EventOutcome(end))
    }

    /// Verifies every message, the batch split across `parallelism` tasks, on the threads of
    /// `VerificationExecutor` (beneath the ledger's writer and the steps in priority).
    private func verifyAll(_ batch: [IntakeMessage]) async -> [Result<Verified, VerificationError>] {
        await onVerificationThreads(batch.count, workers: min(configuration.parallelism, max(1, batch.count / 8))) { i in
            await verify(batch[i])
        }
    }

    private func verify(_ message: IntakeMessage) async -> Result<Verified, VerificationError> {
        if let unreadable = message.unreadable {
            return .failure(VerificationError(.malformed, "the message could not be read whole: \(unreadable)"))
        }
        let started = ContinuousClock.now
        // Whitespace around a compact JWS (a trailing newline from a file or a shell) is not
        // part of it; a dead letter keeps the value as received, the ledger the token verified.
        let result = await verifier.verify(trimmedASCIIWhitespace(message.value), claimsTime: message.claimsTime)
        metrics.verifySeconds.recordElapsed(since: started)
        if let expected = message.expectedIssuer, case .success(let verified) = result, verified.token.issuer != expected {
            return .failure(VerificationError(.otherStreamsIssuer, "the SET was signed by another issuer than the stream's (\(expected))"))
        }
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

    /// `persistence.attempting`: calls `body` until it succeeds, it fails for good, or the process
    /// stops (or, with `maximumAttempts`, that many attempts failed: `.stopped`).
    func attempting<T>(_ what: String, maximumAttempts: Int? = nil, _ body: () async throws -> T) async -> Persistence.Attempted<T> {
        await persistence.attempting(what, maximumAttempts: maximumAttempts, body)
    }

    func backoff(_ attempt: Int) -> Double { persistence.backoff(attempt) }

    /// Whether a retry may mend `error`: each error type says so; anything else is assumed
    /// transient.
    @Sendable static func isRetryable(_ error: any Error) -> Bool {
        switch error {
        case let error as LedgerError: error.isRetryable
        case let error as DeadLetterError: error.isRetryable
        case let error as JournalError: error.isRetryable
        default: true
        }
    }

    private func metadata(_ token: SecurityEventToken, _ message: IntakeMessage, eventID: Int64) -> Logger.Metadata {
        [
            "warden.source": "\(message.source)", "warden.iss": "\(token.issuer)", "warden.jti": "\(token.jti)",
            "warden.events": "\(token.events.map(\.type.name).joined(separator: ","))", "warden.event_id": "\(eventID)",
        ]
    }
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

/// A count shared by tasks: the next index to take, or how many of something are under way.
final class SharedCount: Sendable {
    private let count = Atomic<Int>(0)
    /// The count before this call added one.
    func take() -> Int { count.add(1, ordering: .relaxed).oldValue }
    func add(_ n: Int) { count.add(n, ordering: .relaxed) }
    var value: Int { count.load(ordering: .relaxed) }
}

/// The ledger's outbox, as the step runner sees it.
struct LedgerJournal: StepJournal {
    let ledger: any Ledger

    var groupsConcurrentWrites: Bool { ledger.groupsConcurrentWrites }

    func steps(ofEvent eventID: Int64) async throws(JournalError) -> [JournalStep] {
        do { return try await ledger.steps(ofEvent: eventID).map(JournalStep.init) } catch { throw JournalError(error) }
    }

    func lease(event eventID: Int64, owner: String, seconds: Double) async throws(JournalError) -> Bool {
        do { return try await ledger.lease(event: eventID, owner: owner, seconds: seconds) } catch { throw JournalError(error) }
    }

    func record(_ outcomes: [StepRecord]) async throws(JournalError) -> JournalWrite {
        let records = outcomes.map {
            RecordedStep(eventID: $0.eventID, index: $0.index, status: $0.failed ? .failed : .done, detail: $0.detail,
                         finishing: $0.finishing.map(EventOutcome.init), attempts: $0.attempts)
        }
        do {
            let written = try await ledger.recordSteps(records)
            return JournalWrite(refusals: written.refusals.map { $0.map(JournalError.init) }, durableAt: written.durableAt)
        } catch { throw JournalError(error) }
    }

    func finish(event eventID: Int64, outcome: EventEnd) async throws(JournalError) {
        do { try await ledger.record(outcome: EventOutcome(outcome), forEvent: eventID) } catch { throw JournalError(error) }
    }
}

extension JournalError {
    init(_ error: LedgerError) { self.init(error.description, isRetryable: error.isRetryable) }
}

extension JournalStep {
    init(_ step: OutboxStep) {
        let status: Status = switch step.status {
        case .pending: .pending
        case .done: .done
        case .failed: .failed
        }
        self.init(index: step.index, kind: step.kind, action: step.action, status: status)
    }
}

extension EventOutcome {
    init(_ end: EventEnd) {
        switch end {
        case .processed: self = .processed
        case .unresolved: self = .unresolved
        case .failed: self = .failed
        }
    }
}

extension WardenMetrics: StepObserver {
    public func failedForGood(_ what: String) { counter("warden_permanent_failures_total", [("what", what)]).increment() }
    public func stepAnswered(kind: String, result: String) { step(kind: kind, result: result) }
    public func outcomeDurable(after wait: Duration) { stepRecordSeconds.record(wait) }
    public func stepTook(kind: String, seconds: Double) {
        stepDuration(kind: kind).recordNanoseconds(Int64(min(seconds, 1e9) * 1e9))
    }
    public func eventDone(afterArrival seconds: Double) { eventToDone.recordNanoseconds(Int64(min(seconds, 1e9) * 1e9)) }
    public func breaker(target: String, open: Bool) { breakerOpen(target: target).record(open ? 1 : 0) }
}

/// Event ids with a count of the works holding each (a redelivery may hold one beside its
/// first delivery).
final class EventsInHand: Sendable {
    private let held = Mutex<[Int64: Int]>([:])

    func take(_ eventID: Int64) { held.withLock { $0[eventID, default: 0] += 1 } }

    func leave(_ eventID: Int64) {
        held.withLock { h in
            if let n = h[eventID], n > 1 { h[eventID] = n - 1 } else { h[eventID] = nil }
        }
    }

    func contains(_ eventID: Int64) -> Bool { held.withLock { $0[eventID] != nil } }

    /// No step under way: the intake may write in its largest batches.
    var isEmpty: Bool { held.withLock { $0.isEmpty } }
}
