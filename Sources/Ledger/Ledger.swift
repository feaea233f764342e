/// Durable state of the pipeline: which (issuer, jti) pairs have been seen, what each event was,
/// where it came from, and what became of it. One protocol, several back ends.
public protocol Ledger: Sendable {
    /// Records a verified event with its planned steps and tells, atomically, whether its
    /// (issuer, jti) is new. The event's record holds its first delivery; a duplicate is recorded
    /// as a further delivery of the event already known, and its plan is not touched. Claim and plan are one write, so no crash can leave an event
    /// claimed without a plan.
    func claim(_ event: LedgerEvent, outcome: EventOutcome, steps: [String]) async throws(LedgerError) -> Claim
    /// Records what became of a claimed event.
    func record(outcome: EventOutcome, steps: [String], forEvent eventID: Int64) async throws(LedgerError)
    /// Records a message that failed verification (it has no issuer or jti to trust).
    func recordRejection(_ rejection: Rejection) async throws(LedgerError)
    /// Claims and rejections in one atomic write, in order: all are recorded or none. Returns the
    /// claim of each event entry (nil for rejections).
    func record(_ entries: [LedgerEntry]) async throws(LedgerError) -> [Claim?]
    /// Whether the ledger can be written.
    func isReachable() async -> Bool
    /// Finishes pending writes and closes.
    func close() async
}

/// A verified event as the ledger keeps it.
public struct LedgerEvent: Sendable, Equatable {
    public var issuer: String
    public var jti: String
    /// The compact SET as received, so it can be verified again later.
    public var token: String
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

    public init(issuer: String, jti: String, token: String, source: String, eventTypes: [String], subject: String?,
                keyID: String, algorithm: String, keyThumbprint: String, issuedAt: Double, receivedAt: Double) {
        self.issuer = issuer
        self.jti = jti
        self.token = token
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

/// One part of an atomic ledger write.
public enum LedgerEntry: Sendable, Equatable {
    /// A verified event with its plan: claimed if new, a duplicate delivery otherwise.
    case event(LedgerEvent, outcome: EventOutcome, steps: [String])
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
    /// Every step is done.
    case processed
    /// A step failed permanently.
    case failed
}

/// A message that did not verify.
public struct Rejection: Sendable, Equatable {
    /// The message value as received (not necessarily text).
    public var token: [UInt8]
    public var source: String
    /// RFC 8935 error code.
    public var code: String
    public var description: String
    public var receivedAt: Double

    public init(token: [UInt8], source: String, code: String, description: String, receivedAt: Double) {
        self.token = token
        self.source = source
        self.code = code
        self.description = description
        self.receivedAt = receivedAt
    }
}

public struct LedgerError: Error, Sendable, CustomStringConvertible {
    public var message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}
