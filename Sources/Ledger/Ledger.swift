internal import SecurityEvents

/// Durable state of the pipeline: which (issuer, jti) pairs have been seen, what each event was,
/// where it came from, and what became of it. One protocol, several back ends.
public protocol Ledger: Sendable {
    /// Records a verified event with its planned steps (its outbox) and tells, atomically,
    /// whether its (issuer, jti) is new. The event's record holds its first delivery; a
    /// duplicate is recorded as a further delivery of the event already known, and its plan is
    /// not touched. Claim and plan are one write, so no crash can leave an event claimed
    /// without a plan.
    func claim(_ event: LedgerEvent, outcome: EventOutcome, steps: [OutboxStep]) async throws(LedgerError) -> Claim
    /// Records what became of a claimed event.
    func record(outcome: EventOutcome, forEvent eventID: Int64) async throws(LedgerError)
    /// Records, in one write, that steps (of any events) are done or failed for good; a step
    /// recorded is never run again. Only a pending step is recorded: for each record, nil when
    /// it was, or the conflict that kept it (recorded already, by another owner of its event;
    /// no such step). A record with `finishing` also records its event's outcome (its last step).
    func recordSteps(_ records: [RecordedStep]) async throws(LedgerError) -> RecordedSteps
    /// Takes, or renews, the right to run an event's steps for `seconds`: granted when no one
    /// holds it, when its holder's time has run out, or when `owner` holds it already. Two
    /// processes (a partition's old and new owner after a rebalance) never run one event's
    /// steps at once. Returns whether `owner` holds it now.
    func lease(event eventID: Int64, owner: String, seconds: Double) async throws(LedgerError) -> Bool
    /// An event's steps in order, with their status: after a crash, the pending ones are what
    /// is left to do.
    func steps(ofEvent eventID: Int64) async throws(LedgerError) -> [OutboxStep]
    /// Events with a step still pending, received before `receivedBefore` (seconds since 1970),
    /// with ids above `afterID`, oldest first, at most `limit`: what a door that gets no
    /// redelivery (push into the ledger) resumes at start-up, and now and then after. With
    /// `unleasedAt`, only those whose lease is free at that time (none taken, or run out): no
    /// process is working on them.
    func pendingEvents(receivedBefore: Double, afterID: Int64, limit: Int, unleasedAt: Double?) async throws(LedgerError)
        -> [PendingEvent]
    /// Records that a verification event carrying `state` was asked of `issuer`'s transmitter
    /// (`warden stream verify`), at `time` (seconds since 1970).
    func requestVerification(issuer: String, state: String, at time: Double) async throws(LedgerError)
    /// Whether a verification with `state` was asked of `issuer`'s transmitter; when so, records
    /// that it arrived at `time` (the first arrival is kept: a redelivery matches too).
    func verificationArrived(issuer: String, state: String, at time: Double) async throws(LedgerError) -> Bool
    /// When the verification asked with `state` arrived; nil while it has not (or was never asked).
    func verificationArrival(issuer: String, state: String) async throws(LedgerError) -> Double?
    /// The id of the SSF stream `warden stream create` made for `issuer`, if any.
    func streamID(issuer: String) async throws(LedgerError) -> String?
    /// Keeps (or, with nil, forgets) the id of `issuer`'s stream.
    func keepStreamID(_ id: String?, issuer: String) async throws(LedgerError)
    /// Records a message that failed verification (it has no issuer or jti to trust).
    func recordRejection(_ rejection: Rejection) async throws(LedgerError)
    /// Claims and rejections in one atomic write, in order: all are recorded or none. Returns the
    /// claim of each event entry (nil for rejections).
    func record(_ entries: [LedgerEntry]) async throws(LedgerError) -> [Claim?]
    /// Every event, oldest first (reports, tests).
    func events() async throws(LedgerError) -> [StoredEvent]
    /// Every delivery recorded besides an event's first (duplicates, rejections), oldest first.
    func deliveries() async throws(LedgerError) -> [StoredDelivery]
    /// Whether the ledger can be written.
    func isReachable() async -> Bool
    /// Finishes pending writes and closes.
    func close() async
    /// True when concurrent writes are put in shared transactions by the ledger itself.
    var groupsConcurrentWrites: Bool { get }
}

extension Ledger {
    public var groupsConcurrentWrites: Bool { false }

    /// Records one step's outcome (`recordSteps`), throwing the conflict that kept it.
    public func recordStep(_ index: Int, of eventID: Int64, status: StepStatus, detail: String, finishing: EventOutcome? = nil)
        async throws(LedgerError)
    {
        let written = try await recordSteps([RecordedStep(eventID: eventID, index: index, status: status, detail: detail,
                                                          finishing: finishing)])
        if let refusal = written.refusals.first ?? nil { throw refusal }
    }
}

/// What one write of steps' outcomes came to.
public struct RecordedSteps: Sendable {
    /// For each record, in order: nil when it was recorded, or the conflict that kept it.
    public var refusals: [LedgerError?]
    /// When the write became durable (its transaction committed), which may be well before its
    /// caller runs again.
    public var durableAt: ContinuousClock.Instant

    public init(refusals: [LedgerError?], durableAt: ContinuousClock.Instant = .now) {
        self.refusals = refusals
        self.durableAt = durableAt
    }
}

/// A step's outcome, to be recorded.
public struct RecordedStep: Sendable, Equatable {
    public var eventID: Int64
    public var index: Int
    public var status: StepStatus
    public var detail: String
    /// With an event's last step: the event's outcome, recorded in the same write.
    public var finishing: EventOutcome?
    /// How many times the step's target was called for it.
    public var attempts: Int

    public init(eventID: Int64, index: Int, status: StepStatus, detail: String, finishing: EventOutcome? = nil, attempts: Int = 1) {
        self.eventID = eventID
        self.index = index
        self.status = status
        self.detail = detail
        self.finishing = finishing
        self.attempts = attempts
    }
}

/// One planned step of an event, as the outbox keeps it.
public struct OutboxStep: Sendable, Equatable {
    public var index: Int
    /// `purge-set`, `revoke-tokens`, … (for reports and metrics).
    public var kind: String
    /// The step with every placeholder filled, as JSON text: exactly what to run after a crash.
    public var action: String
    public var status: StepStatus
    /// What the executor said (done: what it did; failed: why).
    public var detail: String?

    public init(index: Int, kind: String, action: String, status: StepStatus = .pending, detail: String? = nil) {
        self.index = index
        self.kind = kind
        self.action = action
        self.status = status
        self.detail = detail
    }
}

public enum StepStatus: String, Sendable, CaseIterable {
    case pending, done, failed
}

/// A verified event as the ledger keeps it.
public struct LedgerEvent: Sendable, Equatable {
    public var issuer: String
    public var jti: String
    /// The compact SET as verified (the message less surrounding whitespace; ASCII, as every
    /// verified compact JWS is), so it can be verified again later. Kept as bytes: the intake
    /// hands over the message's own, without making a string of them.
    public var tokenBytes: [UInt8] { didSet { tokenSHA256 = AuditChain.sha256Hex(tokenBytes) } }
    /// SHA-256 of `tokenBytes`, lowercase hex: computed where the event is made (off the
    /// ledger's single writer), stored with the event and named by its audit records.
    public private(set) var tokenSHA256: String
    /// `tokenBytes` as text.
    public var token: String {
        get { String(decoding: tokenBytes, as: UTF8.self) }
        set { tokenBytes = Array(newValue.utf8) }
    }
    /// Where it came from: `kafka:topic/partition/offset`, `push`, …
    public var source: String
    public var eventTypes: [String]
    /// The primary subject as JSON text, if the token has one.
    public var subject: String?
    public var keyID: String
    public var algorithm: String
    public var keyThumbprint: String
    public var issuedAt: Double
    public var receivedAt: Double
    /// For an event with steps: who holds its lease once claimed, and until when (seconds
    /// since 1970). The claim takes the lease in the same write, so the claimant's first step
    /// needs no write of its own.
    public var leaseOwner: String? = nil
    public var leaseUntil: Double? = nil

    public init(issuer: String, jti: String, token: String, source: String, eventTypes: [String], subject: String?,
                keyID: String, algorithm: String, keyThumbprint: String, issuedAt: Double, receivedAt: Double) {
        self.init(issuer: issuer, jti: jti, tokenBytes: Array(token.utf8), source: source, eventTypes: eventTypes,
                  subject: subject, keyID: keyID, algorithm: algorithm, keyThumbprint: keyThumbprint, issuedAt: issuedAt,
                  receivedAt: receivedAt)
    }

    public init(issuer: String, jti: String, tokenBytes: [UInt8], source: String, eventTypes: [String], subject: String?,
                keyID: String, algorithm: String, keyThumbprint: String, issuedAt: Double, receivedAt: Double) {
        self.issuer = issuer
        self.jti = jti
        self.tokenBytes = tokenBytes
        self.tokenSHA256 = AuditChain.sha256Hex(tokenBytes)
        self.source = source
        self.eventTypes = eventTypes
        self.subject = subject
        self.keyID = keyID
        self.algorithm = algorithm
        self.keyThumbprint = keyThumbprint
        self.issuedAt = issuedAt
        self.receivedAt = receivedAt
    }
}

/// An event whose steps are not all recorded: its compact SET, to run them again from.
public struct PendingEvent: Sendable, Equatable {
    public var id: Int64
    /// The compact SET as verified and stored.
    public var token: [UInt8]
    /// Where its first delivery came from.
    public var source: String
    public var receivedAt: Double

    public init(id: Int64, token: [UInt8], source: String, receivedAt: Double) {
        self.id = id
        self.token = token
        self.source = source
        self.receivedAt = receivedAt
    }
}

/// One part of an atomic ledger write.
public enum LedgerEntry: Sendable, Equatable {
    /// A verified event with its plan: claimed if new, a duplicate delivery otherwise.
    case event(LedgerEvent, outcome: EventOutcome, steps: [OutboxStep])
    /// A message that failed verification.
    case rejection(Rejection)
}

public enum Claim: Sendable, Equatable {
    /// First time this (issuer, jti) is seen: act on it.
    case new(eventID: Int64)
    /// Seen before (a redelivery or a replayed token): do not act again.
    case duplicate(eventID: Int64)
}

/// What became of an event.
public enum EventOutcome: String, Sendable, CaseIterable {
    /// Claimed; no outcome recorded yet.
    case claimed
    /// Its steps are planned and wait to be executed.
    case pending
    /// Every step is done (or there were none to do).
    case processed
    /// A step failed permanently.
    case failed
    /// The subject named no local user: the steps that need one were not run.
    case unresolved

    /// Whether nothing more will happen to the event (its audit record is written then).
    public var isFinal: Bool { self == .processed || self == .failed || self == .unresolved }
}

/// A message that did not verify.
public struct Rejection: Sendable, Equatable {
    /// The message value less the ASCII whitespace around it, as a token is read (not
    /// necessarily text): its digest is the one replay compares.
    public var token: [UInt8]
    public var source: String
    /// RFC 8935 error code.
    public var code: String
    public var description: String
    public var receivedAt: Double

    public init(token: [UInt8], source: String, code: String, description: String, receivedAt: Double) {
        self.token = Array(trimmedASCIIWhitespace(token))
        self.source = source
        self.code = code
        self.description = description
        self.receivedAt = receivedAt
    }
}

/// Why the ledger could not do what it was asked, and whether asking again can help.
public struct LedgerError: Error, Sendable, CustomStringConvertible {
    public enum Kind: String, Sendable, Hashable {
        /// The store could not be reached or was busy (connection lost, locked, disk full): the
        /// same write may succeed later.
        case unavailable
        /// The store refused these values (a constraint, a value its types cannot hold): the
        /// same write will fail again however often it is tried.
        case refused
        /// What the write refers to is not there (an event id, a step index), or is no longer
        /// in the state the write expects (a step already recorded, a lease held by another).
        case conflict
        /// The ledger is closed.
        case closed
    }

    public var kind: Kind
    public var message: String

    public init(_ kind: Kind, _ message: String) {
        self.kind = kind
        self.message = message
    }

    /// Whether the same call may succeed later.
    public var isRetryable: Bool { kind == .unavailable }
    public var description: String { message }
}

/// A JSON array of strings (event type URIs, step names).
func jsonArray(_ items: [String]) -> String {
    var bytes: [UInt8] = []
    writeJSONArray(items, to: &bytes)
    return String(decoding: bytes, as: UTF8.self)
}

func writeJSONArray(_ items: [String], to bytes: inout [UInt8]) {
    bytes.append(UInt8(ascii: "["))
    for (i, item) in items.enumerated() {
        if i > 0 { bytes.append(UInt8(ascii: ",")) }
        JSONValue.writeString(item, to: &bytes)
    }
    bytes.append(UInt8(ascii: "]"))
}

extension Ledger {
    /// Every event with a step pending, leased or not.
    public func pendingEvents(receivedBefore: Double, afterID: Int64, limit: Int) async throws(LedgerError) -> [PendingEvent] {
        try await pendingEvents(receivedBefore: receivedBefore, afterID: afterID, limit: limit, unleasedAt: nil)
    }
}
