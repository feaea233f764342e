public import Invalidation
public import Ledger
public import TokenVerification

/// A message from any door (Kafka, push, poll, replay), not yet verified.
public struct IntakeMessage: Sendable {
    public var value: [UInt8]
    /// Where it came from, for the ledger and the dead letter: `kafka:topic/partition/offset`, `push`, …
    public var source: String
    public var receivedAt: Double
    /// When its claims (`max-age`, `iat` in the future) are judged: now for a message arriving;
    /// when it first arrived for a token verified before and stored (an event resumed from the
    /// ledger); when it arrived, or at its own `iat`, for a logged token replayed.
    public var claimsTime: SETVerifier.ClaimsTime
    /// The key and headers it arrived with (Kafka's), kept for its dead letter.
    public var key: [UInt8]?
    public var headers: [MessageHeader]
    /// Set when the door could not read the message whole (Kafka skipped a corrupt record): why.
    /// It is refused as malformed, recorded and dead-lettered, never verified.
    public var unreadable: String?
    /// The issuer whose stream it came by (a poll stream), when the door knows: a SET another
    /// issuer signed is refused (`access_denied`), genuine or not.
    public var expectedIssuer: String?

    public init(value: [UInt8], source: String, receivedAt: Double, claimsTime: SETVerifier.ClaimsTime = .now,
                key: [UInt8]? = nil, headers: [MessageHeader] = []) {
        self.value = value
        self.key = key
        self.headers = headers
        self.source = source
        self.receivedAt = receivedAt
        self.claimsTime = claimsTime
    }
}

/// What happened to a message, once it is durable.
public enum Disposition: Sendable, Equatable {
    /// A new event, claimed and recorded with its outcome.
    case recorded(eventID: Int64, outcome: EventOutcome)
    /// The (issuer, jti) was already in the ledger (and its steps, if any, are finished).
    case duplicate(eventID: Int64)
    /// The token failed verification (or the ledger cannot hold it): dead-lettered and recorded.
    case rejected(code: String, description: String)
    /// Not finished (the process is stopping, or the door took the message back): the message
    /// must be delivered again.
    case abandoned
}

/// How a door hears what became of one of its messages, and how it takes one back.
///
/// Kafka finishes the message's offset; the push receiver answers the HTTP request; the poll
/// client adds the `jti` to its next `ack` list; replay writes a report line.
///
/// As an `ActionPermit`, it is asked before each action on a target made for the message (and
/// the recording of its outcome): it refuses once the door has taken the message back (its
/// Kafka partition was revoked). By default every action is permitted.
public protocol Acknowledgement: ActionPermit {
    /// Called exactly once per record, when its outcome is durable, or with `.abandoned`.
    func settle(_ disposition: Disposition)

    /// Called when the record's event is durable in the ledger, claimed with its plan
    /// (`.recorded` with outcome `.pending`) or found a duplicate, before its steps run; `settle`
    /// follows once they have. A door that answers at persistence (RFC 8935 push: `202` once the
    /// SET is persisted) answers here. Not called for records settled at once.
    func durable(_ disposition: Disposition)

    /// Whether the record may wait aside while its issuer's keys cannot be had (Kafka: it holds
    /// back its partition's commit point). When not, it is settled `.abandoned` at once, and
    /// its sender is told to try again later.
    var waitsForKeys: Bool { get }

    /// The record is put aside to wait for its issuer's keys (true), or taken up again (false).
    /// A record aside does not count against what its door lets in at once (Kafka: in-flight
    /// messages) nor as work stalled: what may wait so is bounded by the pipeline, and one
    /// issuer's keys must not stop other issuers' records at the door.
    func setAside(_ aside: Bool)
}

extension Acknowledgement {
    public func beginAction() -> Bool { true }
    public func endAction() {}
    public func durable(_ disposition: Disposition) {}
    public var waitsForKeys: Bool { true }
    public func setAside(_ aside: Bool) {}
}

/// One message travelling through the pipeline's stages, with its own acknowledgement.
///
/// A reference: each stage hands records on in arrays of its own, and a copy of a reference is
/// one retain where a copy of the message and acknowledgement was several (the retains of
/// objects last written on another core are what the stages' profile showed most of).
public final class IntakeRecord: Sendable {
    public let message: IntakeMessage
    public let acknowledgement: any Acknowledgement

    public init(_ message: IntakeMessage, acknowledgement: any Acknowledgement) {
        self.message = message
        self.acknowledgement = acknowledgement
    }
}
