import Crypto
import SecurityEvents

/// The ledger as an audit trail: hash-chained audit records, the archive of every signing key
/// fetched, and the lookups `warden replay` compares a log with.
public protocol AuditingLedger: Ledger {
    /// Keeps `keys` of `issuer` as seen at `time` (seconds since 1970): a key new to the archive
    /// is added with that first-seen time, a known one has its last-seen time moved on.
    func archive(keys: [ArchivedKey], issuer: String, seenAt time: Double) async throws(LedgerError)
    /// Every key archived, of every issuer.
    func archivedKeys() async throws(LedgerError) -> [ArchivedKey]
    /// Audit records with `seq` above `afterSeq`, in order, at most `limit`.
    func auditRecords(afterSeq: Int64, limit: Int) async throws(LedgerError) -> [StoredAuditRecord]
    /// The chain's head as the ledger keeps it beside the records: the last record's `seq` and
    /// hash (0 and the genesis hash when there is none).
    func auditHead() async throws(LedgerError) -> (seq: Int64, hash: String)
    /// What the ledger holds of each of these (issuer, jti) pairs.
    func eventStates(_ keys: [EventKey]) async throws(LedgerError) -> [EventKey: EventState]
    /// Which of these SHA-256 digests (hex) of rejected messages were recorded as rejections.
    func rejectedDigests(_ digests: [String]) async throws(LedgerError) -> Set<String>
    /// The id of an event of `issuer` about `subject` (its JSON text, as the ledger keeps it)
    /// issued after `issuedAt`, if there is one: an older event acted on now would come after it.
    /// Not indexed: for the few events whose order matters.
    func laterEvent(issuer: String, subject: String, issuedAfter issuedAt: Double) async throws(LedgerError) -> Int64?
    /// The latest cutoff retention has dropped events or rejections before (seconds since 1970):
    /// what was received before it may be gone. Nil when retention never dropped any.
    func retentionCutoff() async throws(LedgerError) -> Double?
    /// Events whose first delivery came from `sourcePrefix…`, received in [from, to), with ids
    /// above `afterID`, oldest first, at most `limit`.
    func events(sourcePrefix: String, receivedFrom from: Double, to: Double, afterID: Int64, limit: Int) async throws(LedgerError)
        -> [EventSummary]
    /// Makes an event's failed steps pending again (and the event pending), so that its steps
    /// run again; the reopening is an audit record of its own. Returns how many were reopened.
    func reopenFailedSteps(ofEvent eventID: Int64, reason: String) async throws(LedgerError) -> Int
    /// Where the kept chain starts: the last record dropped by retention, (0, genesis) when none
    /// was. The first record kept must follow it.
    func auditStart() async throws(LedgerError) -> (seq: Int64, hash: String)
    /// One small batch of retention: drops, of what was received before `cutoff`, at most
    /// `limit` events whose steps are all finished (their claim, steps and stored token, and
    /// their deliveries), rejected deliveries, and the audit records before the first one kept
    /// — recording the cut in the chain with a `checkpoint` record. Events with ids up to
    /// `afterEventID` were looked at before. Never drops what is not finished.
    func prune(before cutoff: Double, limit: Int, afterEventID: Int64) async throws(LedgerError) -> PruneResult
}

/// What one batch of retention dropped.
public struct PruneResult: Sendable, Equatable {
    public var events: Int
    public var rejections: Int
    public var auditRecords: Int
    /// The last event id looked at (the next batch starts after it).
    public var lastEventID: Int64
    /// Whether a full batch was found: more may be waiting.
    public var more: Bool

    public init(events: Int = 0, rejections: Int = 0, auditRecords: Int = 0, lastEventID: Int64, more: Bool = false) {
        self.events = events
        self.rejections = rejections
        self.auditRecords = auditRecords
        self.lastEventID = lastEventID
        self.more = more
    }
}

/// How retention decides, the same on every back end.
enum Retention {
    /// Bytes of a rejected message the ledger keeps beside its SHA-256: as much as a truncated
    /// dead letter keeps, so a SET refused (to be verified again by a replay, its key archived
    /// meanwhile) is kept whole even when its dead letter could not be produced, never the whole
    /// of a junk message.
    static let keptRejectedBytes = 16 * 1024

    /// The recorded time of an audit record's canonical text (`"recorded_at":"…Z"`), as its
    /// RFC 3339 text: compared as text with the cutoff's (both UTC with milliseconds).
    static func recordedAt(_ record: String) -> Substring? {
        guard let range = record.range(of: "\"recorded_at\":\"") else { return nil }
        let rest = record[range.upperBound...]
        return rest.prefix { $0 != "\"" }
    }

    static func text(_ time: Double) -> String {
        var out: [UInt8] = []
        RFC3339.write(time, to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    /// How many of `records` (in seq order, after the start; `limit` were asked for) may go:
    /// the leading run of those recorded before `cutoff` — a record after the cutoff keeps
    /// everything after it — never the chain's last record (the checkpoint a batch has just
    /// written is not dropped by the next).
    /// Only records that prove themselves go (`provable`): `startHash` is the hash the first
    /// of `records` must link to.
    static func droppable(_ records: [StoredAuditRecord], before cutoff: Double, limit: Int, startHash: String) -> Int {
        let bound = text(cutoff)
        let run = records.prefix { (recordedAt($0.record).map { $0 < bound[...] }) ?? false }.count
        let count = records.count < limit && run == records.count ? max(0, run - 1) : run
        return min(count, provable(records.prefix(count), from: startHash))
    }

    /// How many of `records`, from the first, link from `startHash` and hash to their stored
    /// hash. Retention drops no record past them: one edited is evidence, kept for `audit
    /// verify` to name, and a key record carried from it would launder the edit.
    static func provable(_ records: ArraySlice<StoredAuditRecord>, from startHash: String) -> Int {
        var previous = startHash, count = 0
        for record in records {
            guard record.previousHash == previous,
                  AuditChain.hash(previous: previous, record: Array(record.record.utf8)) == record.hash else { break }
            previous = record.hash
            count += 1
        }
        return count
    }

    /// Key records among `dropped`, written again (as of `now`, each with its key's first-seen
    /// time) after the checkpoint: the kept chain must go on attesting every archived key. Only
    /// keys still `archived`, each once: a key deleted from the archive (one known to have
    /// leaked) stops being attested, and records do not pile up.
    static func carriedKeys(_ dropped: ArraySlice<StoredAuditRecord>, archived: Set<ArchivedKey.Reference>,
                            at now: Double) -> [AuditRecord] {
        var carried = Set<ArchivedKey.Reference>()
        return dropped.compactMap { stored -> AuditRecord? in
            guard stored.record.contains(#""kind":"key""#), let parsed = AuditChain.Checker.parse(Array(stored.record.utf8)),
                  let key = parsed.key, archived.contains(key.reference), carried.insert(key.reference).inserted else { return nil }
            return AuditRecord(key: key.reference, firstSeen: key.firstSeen, recordedAt: now)
        }
    }

    /// What a batch that dropped something writes: the cutoff the ledger keeps beside the chain
    /// (`pruned_before`: replay takes a token unknown to the ledger and received before it for
    /// dropped, never for missed; never moved back), and a checkpoint record carrying that
    /// cutoff (as its `received_at`) and the chain's new start — whenever either moved, so the
    /// cutoff is hash-chained and `audit verify` names an edit of it. Nil when nothing moved.
    /// `start`: the chain's start, after the records this batch dropped.
    static func cut(start: (seq: Int64, hash: String), droppedRecords: Int, events: Int, rejections: Int, cutoff: Double,
                    previousCutoff: Double?, at now: Double) -> (prunedBefore: Double, checkpoint: AuditRecord)? {
        guard droppedRecords > 0 || events > 0 || rejections > 0 else { return nil }
        let kept = max(previousCutoff ?? cutoff, cutoff)
        guard droppedRecords > 0 || kept != previousCutoff else { return nil }
        return (kept, AuditRecord(kind: .checkpoint, eventID: nil, source: "retention", receivedAt: kept, tokenSHA256: nil,
                                  outcome: "pruned", note: "\(droppedRecords) audit record(s), \(events) event(s) and \(rejections) "
                                      + "rejection(s) received before the cutoff dropped",
                                  prunedThroughSeq: start.seq, prunedThroughHash: start.hash, recordedAt: now))
    }
}

/// An issuer's signing key as the archive keeps it.
public struct ArchivedKey: Sendable, Equatable {
    public var issuer: String
    public var keyID: String
    /// RFC 7638 thumbprint.
    public var thumbprint: String
    /// The JWK's public members, as JSON text.
    public var jwk: String
    public var firstSeen: Double
    public var lastSeen: Double

    public init(issuer: String, keyID: String, thumbprint: String, jwk: String, firstSeen: Double, lastSeen: Double) {
        self.issuer = issuer
        self.keyID = keyID
        self.thumbprint = thumbprint
        self.jwk = jwk
        self.firstSeen = firstSeen
        self.lastSeen = lastSeen
    }

    /// What a `key` audit record names of a key: the thumbprint binds its material (replay
    /// checks an archived JWK against it).
    public struct Reference: Sendable, Hashable, CustomStringConvertible {
        public var issuer: String
        public var keyID: String
        public var thumbprint: String

        public init(issuer: String, keyID: String, thumbprint: String) {
            self.issuer = issuer
            self.keyID = keyID
            self.thumbprint = thumbprint
        }

        public var description: String { "key \(String(reflecting: keyID)) of \(String(reflecting: issuer)) (thumbprint \(thumbprint))" }
    }

    public var reference: Reference { Reference(issuer: issuer, keyID: keyID, thumbprint: thumbprint) }
}

/// An event's identity in the ledger: its issuer and `jti`.
///
/// Two keys are the same when their texts have the same code points, as the ledger compares
/// them: Swift's own `==` would take canonically equivalent texts (`K` and the Kelvin sign
/// U+212A) for one event, which the ledger holds as two.
public struct EventKey: Sendable, Hashable {
    public var issuer: String
    public var jti: String
    public init(issuer: String, jti: String) {
        self.issuer = issuer
        self.jti = jti
    }

    public static func == (a: EventKey, b: EventKey) -> Bool { sameName(a.issuer, b.issuer) && sameName(a.jti, b.jti) }

    public func hash(into hasher: inout Hasher) {
        var issuer = issuer
        var jti = jti
        issuer.withUTF8 { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
        hasher.combine(0xFF as UInt8)  // never in UTF-8: where the issuer ends
        jti.withUTF8 { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
    }
}

/// What the ledger holds of one event.
public struct EventState: Sendable, Equatable {
    public var id: Int64
    /// SHA-256 of the compact SET it stored (hex).
    public var tokenSHA256: String
    public var outcome: EventOutcome
    public var source: String
    public var receivedAt: Double
    public var steps: [OutboxStep]

    public init(id: Int64, tokenSHA256: String, outcome: EventOutcome, source: String, receivedAt: Double, steps: [OutboxStep]) {
        self.id = id
        self.tokenSHA256 = tokenSHA256
        self.outcome = outcome
        self.source = source
        self.receivedAt = receivedAt
        self.steps = steps
    }
}

/// An event as a report lists it.
public struct EventSummary: Sendable, Equatable {
    public var id: Int64
    public var issuer: String
    public var jti: String
    public var eventTypes: [String]
    public var outcome: EventOutcome
    public var receivedAt: Double
    /// Where its first delivery came from (`kafka:topic/partition/offset`, `push`, …).
    public var source: String

    public init(id: Int64, issuer: String, jti: String, eventTypes: [String], outcome: EventOutcome, receivedAt: Double,
                source: String = "") {
        self.id = id
        self.issuer = issuer
        self.jti = jti
        self.eventTypes = eventTypes
        self.outcome = outcome
        self.receivedAt = receivedAt
        self.source = source
    }
}

/// One audit record as stored: its text is what the hash covers.
public struct StoredAuditRecord: Sendable, Equatable {
    public var seq: Int64
    /// The record as canonical JSON text (members in code-point order, no spaces).
    public var record: String
    public var previousHash: String
    public var hash: String

    public init(seq: Int64, record: String, previousHash: String, hash: String) {
        self.seq = seq
        self.record = record
        self.previousHash = previousHash
        self.hash = hash
    }

    /// One line of `warden audit export`: the record with its `prev_hash` and `hash`.
    public var exportLine: String {
        var line = record
        guard line.last == "}" else { return line }
        line.removeLast()
        return line + ",\"hash\":\"\(hash)\",\"prev_hash\":\"\(previousHash)\"}"
    }
}

/// What became of one delivery, as the audit trail records it.
public struct AuditRecord: Sendable {
    public enum Kind: String, Sendable {
        /// An event's outcome: its steps done or failed, or none to do.
        case event
        /// A further delivery of an event already recorded.
        case duplicate
        /// A message that failed verification.
        case rejection
        /// An event's failed steps made pending again (`warden replay --apply`).
        case reopened
        /// Retention dropped the records up to `pruned_through_seq`: the kept chain starts
        /// after the hash it names.
        case checkpoint
        /// An issuer's signing key entered the key archive (`received_at`: when first seen);
        /// written again after a checkpoint when retention drops the first. Replay trusts an
        /// archived key only while a record of the kept chain attests it.
        case key
    }

    public struct Step: Sendable, Equatable {
        public var index: Int
        public var kind: String
        public var status: StepStatus
        public var detail: String?
        public var attempts: Int

        public init(index: Int, kind: String, status: StepStatus, detail: String?, attempts: Int) {
            self.index = index
            self.kind = kind
            self.status = status
            self.detail = detail
            self.attempts = attempts
        }
    }

    public var kind: Kind
    public var eventID: Int64?
    public var source: String
    public var receivedAt: Double
    /// nil for a checkpoint (no message).
    public var tokenSHA256: String?
    /// nil for a valid token; the RFC 8935 code for a rejected one.
    public var error: (code: String, description: String)?
    public var issuer: String?
    public var jti: String?
    public var eventTypes: [String]
    /// The primary subject, as JSON text.
    public var subject: String?
    public var keyID: String?
    public var algorithm: String?
    public var keyThumbprint: String?
    public var issuedAt: Double?
    public var outcome: String
    public var steps: [Step]
    public var note: String?
    /// A checkpoint's last dropped record.
    public var prunedThroughSeq: Int64?
    public var prunedThroughHash: String?
    public var recordedAt: Double

    public init(kind: Kind, eventID: Int64?, source: String, receivedAt: Double, tokenSHA256: String?,
                error: (code: String, description: String)? = nil, issuer: String? = nil, jti: String? = nil,
                eventTypes: [String] = [], subject: String? = nil, keyID: String? = nil, algorithm: String? = nil,
                keyThumbprint: String? = nil, issuedAt: Double? = nil, outcome: String, steps: [Step] = [],
                note: String? = nil, prunedThroughSeq: Int64? = nil, prunedThroughHash: String? = nil, recordedAt: Double) {
        self.kind = kind
        self.prunedThroughSeq = prunedThroughSeq
        self.prunedThroughHash = prunedThroughHash
        self.eventID = eventID
        self.source = source
        self.receivedAt = receivedAt
        self.tokenSHA256 = tokenSHA256
        self.error = error
        self.issuer = issuer
        self.jti = jti
        self.eventTypes = eventTypes
        self.subject = subject
        self.keyID = keyID
        self.algorithm = algorithm
        self.keyThumbprint = keyThumbprint
        self.issuedAt = issuedAt
        self.outcome = outcome
        self.steps = steps
        self.note = note
        self.recordedAt = recordedAt
    }

    /// The record a claim is audited with when the claim itself is the outcome: a new event
    /// without steps (its outcome is final at once), or a further delivery. A new event with
    /// steps is audited when its last step is recorded.
    static func ofClaim(_ claim: Claim, _ event: LedgerEvent, outcome: EventOutcome, hasSteps: Bool, at now: Double) -> AuditRecord? {
        switch claim {
        case .new(let id) where !hasSteps:
            AuditRecord(event: event, eventID: id, kind: .event, outcome: outcome.rawValue, steps: [], recordedAt: now)
        case .new:
            nil
        case .duplicate(let id):
            AuditRecord(event: event, eventID: id, kind: .duplicate, outcome: "duplicate", steps: [], recordedAt: now)
        }
    }

    /// A verified event as claimed, with the outcome it has at this point.
    init(event: LedgerEvent, eventID: Int64, kind: Kind, outcome: String, steps: [Step], recordedAt: Double) {
        self.init(kind: kind, eventID: eventID, source: event.source, receivedAt: event.receivedAt,
                  tokenSHA256: event.tokenSHA256, issuer: event.issuer, jti: event.jti,
                  eventTypes: event.eventTypes, subject: event.subject, keyID: event.keyID, algorithm: event.algorithm,
                  keyThumbprint: event.keyThumbprint, issuedAt: event.issuedAt, outcome: outcome, steps: steps,
                  recordedAt: recordedAt)
    }

    /// The record that attests an archived key.
    init(key: ArchivedKey.Reference, firstSeen: Double, recordedAt: Double) {
        self.init(kind: .key, eventID: nil, source: "jwks", receivedAt: firstSeen, tokenSHA256: nil, issuer: key.issuer,
                  keyID: key.keyID, keyThumbprint: key.thumbprint, outcome: "archived", recordedAt: recordedAt)
    }

    init(rejection: Rejection, recordedAt: Double) {
        self.init(kind: .rejection, eventID: nil, source: rejection.source, receivedAt: rejection.receivedAt,
                  tokenSHA256: AuditChain.sha256Hex(rejection.token), error: (rejection.code, rejection.description),
                  outcome: "invalid", recordedAt: recordedAt)
    }

    /// The record as canonical JSON: members in code-point order, no spaces, absent members left
    /// out, times as RFC 3339 with milliseconds. The subject is a string: its JSON text as the ledger keeps it.
    ///
    /// Written into an array made at the most the record can take (every text escaped at its
    /// longest): written byte by byte into a growing array, a record took 2.4 µs, on the ledger
    /// writer's one thread, for each event.
    public func canonicalJSON(seq: Int64) -> [UInt8] {
        [UInt8](unsafeUninitializedCapacity: maximumCanonicalLength) { buffer, count in
            var w = CanonicalWriter(buffer.baseAddress!, capacity: buffer.count)
            w.string("algorithm", algorithm)
            w.string("description", error?.description)
            w.string("err", error?.code)
            w.integer("event_id", eventID)
            if !eventTypes.isEmpty {
                w.name("event_types")
                w.byte(UInt8(ascii: "["))
                for (i, type) in eventTypes.enumerated() {
                    if i > 0 { w.byte(UInt8(ascii: ",")) }
                    w.escaped(type)
                }
                w.byte(UInt8(ascii: "]"))
            }
            w.time("issued_at", issuedAt)
            w.string("issuer", issuer)
            w.string("jti", jti)
            w.string("key_id", keyID)
            w.string("key_thumbprint", keyThumbprint)
            w.string("kind", kind.rawValue)
            w.string("note", note)
            w.string("outcome", outcome)
            w.string("pruned_through_hash", prunedThroughHash)
            w.integer("pruned_through_seq", prunedThroughSeq)
            w.time("received_at", receivedAt)
            w.time("recorded_at", recordedAt)
            w.integer("seq", seq)
            w.string("source", source)
            w.name("steps")
            w.byte(UInt8(ascii: "["))
            for (i, step) in steps.enumerated() {
                if i > 0 { w.byte(UInt8(ascii: ",")) }
                w.raw("{\"attempts\":")
                w.digits(Int64(step.attempts))
                if let detail = step.detail {
                    w.raw(",\"detail\":")
                    w.escaped(detail)
                }
                w.raw(",\"index\":")
                w.digits(Int64(step.index))
                w.raw(",\"kind\":")
                w.escaped(step.kind)
                w.raw(",\"status\":")
                w.escaped(step.status.rawValue)
                w.byte(UInt8(ascii: "}"))
            }
            w.byte(UInt8(ascii: "]"))
            // The subject as the JSON text the ledger keeps, in a string: re-serialised from its
            // parsed form, a string comes back byte for byte, where an object's members might not.
            w.string("subject", subject)
            w.string("token_sha256", tokenSHA256)
            if kind != .checkpoint && kind != .key { w.string("verdict", error == nil ? "valid" : "invalid") }
            w.byte(UInt8(ascii: "}"))
            count = w.count
        }
    }

    /// The most bytes `canonicalJSON` can make of this record: every member's name and
    /// punctuation (less than 24 bytes each, beyond the name: 32 allowed), every text at its
    /// longest escaped, every number at its longest.
    var maximumCanonicalLength: Int {
        func text(_ s: String?) -> Int { s.map { JSONValue.escapedCapacity($0.utf8.count) } ?? 0 }
        let member = 32, name = 20, number = 20
        var length = 2 + 24 * (member + name)
        length += text(algorithm) + text(error?.description) + text(error?.code) + text(issuer) + text(jti) + text(keyID)
        length += text(keyThumbprint) + text(kind.rawValue) + text(note) + text(outcome) + text(prunedThroughHash)
        length += text(source) + text(subject) + text(tokenSHA256) + 4 * number + 3 * (RFC3339.length + 2)
        for type in eventTypes { length += 1 + text(type) }
        for step in steps { length += 64 + 2 * number + text(step.detail) + text(step.kind) + text(step.status.rawValue) }
        return length
    }

    /// Writes one object's members, in the order given (the caller's is code-point order), at a
    /// buffer with room for them all (`maximumCanonicalLength`). Each write is checked against
    /// the room left before it is made: a bound that came out short stops the process rather
    /// than write past the buffer.
    struct CanonicalWriter {
        let out: UnsafeMutablePointer<UInt8>
        let capacity: Int
        var count = 0
        var first = true

        init(_ out: UnsafeMutablePointer<UInt8>, capacity: Int) {
            self.out = out
            self.capacity = capacity
        }

        @inline(__always) func room(_ bytes: Int) { precondition(count + bytes <= capacity, "an audit record outgrew its buffer") }

        @inline(__always) mutating func byte(_ b: UInt8) {
            room(1)
            out[count] = b
            count += 1
        }

        /// JSON text written as it is (from the source, so known to be valid).
        @inline(__always) mutating func raw(_ text: StaticString) {
            room(text.utf8CodeUnitCount)
            (out + count).update(from: text.utf8Start, count: text.utf8CodeUnitCount)
            count += text.utf8CodeUnitCount
        }

        /// Names are ASCII and need no escaping: written as they are.
        mutating func name(_ n: StaticString) {
            byte(first ? UInt8(ascii: "{") : UInt8(ascii: ","))
            first = false
            byte(UInt8(ascii: "\""))
            raw(n)
            byte(UInt8(ascii: "\""))
            byte(UInt8(ascii: ":"))
        }

        /// `value` as a JSON string.
        mutating func escaped(_ value: String) {
            var value = value
            count += value.withUTF8 { utf8 in
                room(JSONValue.escapedCapacity(utf8.count))
                return JSONValue.writeString(utf8, at: out + count)
            }
        }

        mutating func string(_ n: StaticString, _ value: String?) {
            guard let value else { return }
            name(n)
            escaped(value)
        }

        mutating func integer(_ n: StaticString, _ value: Int64?) {
            guard let value else { return }
            name(n)
            digits(value)
        }

        /// `value` in decimal.
        mutating func digits(_ value: Int64) {
            if value < 0 { byte(UInt8(ascii: "-")) }
            var magnitude = value.magnitude
            var length = 1
            var rest = magnitude / 10
            while rest > 0 {
                length += 1
                rest /= 10
            }
            room(length)
            for i in stride(from: count + length - 1, through: count, by: -1) {
                out[i] = UInt8(ascii: "0") + UInt8(magnitude % 10)
                magnitude /= 10
            }
            count += length
        }

        mutating func time(_ n: StaticString, _ value: Double?) {
            guard let value else { return }
            name(n)
            byte(UInt8(ascii: "\""))
            room(RFC3339.length)
            RFC3339.write(value, at: out + count)
            count += RFC3339.length
            byte(UInt8(ascii: "\""))
        }
    }
}

/// A head of the chain as a check printed it (`SEQ:HASH`), kept away from the ledger.
public struct AuditAnchor: Sendable, Equatable, CustomStringConvertible {
    public var seq: Int64
    public var hash: String

    public init(seq: Int64, hash: String) {
        self.seq = seq
        self.hash = hash
    }

    /// `SEQ:HASH`: a record number from 1 and 64 lowercase hex digits.
    public init?(_ text: String) {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 2, let seq = Int64(parts[0]), seq >= 1, parts[1].utf8.count == 64,
              parts[1].utf8.allSatisfy({ (UInt8(ascii: "0")...UInt8(ascii: "9")).contains($0) || (UInt8(ascii: "a")...UInt8(ascii: "f")).contains($0) })
        else { return nil }
        self.init(seq: seq, hash: String(parts[1]))
    }

    public var description: String { "\(seq):\(hash)" }
}

/// The hash chain: each record's hash is SHA-256 over the previous record's hash (hex), a line
/// feed, and the record's canonical JSON text. The first record's previous hash is 64 zeros.
public enum AuditChain {
    public static let genesis = String(repeating: "0", count: 64)

    public static func hash(previous: String, record: [UInt8]) -> String {
        // One buffer, hashed in one call: three incremental updates cost more than the copy.
        var input: [UInt8] = []
        input.reserveCapacity(previous.utf8.count + 1 + record.count)
        input += previous.utf8
        input.append(UInt8(ascii: "\n"))
        input += record
        return hex(SHA256.hash(data: input))
    }

    public static func sha256Hex(_ bytes: [UInt8]) -> String { hex(SHA256.hash(data: bytes)) }

    private static let hexDigits: [UInt8] = Array("0123456789abcdef".utf8)

    static func hex(_ digest: SHA256.Digest) -> String {
        digest.withUnsafeBytes { bytes in
            String(unsafeUninitializedCapacity: bytes.count * 2) { out in
                for (i, byte) in bytes.enumerated() {
                    out[2 * i] = hexDigits[Int(byte >> 4)]
                    out[2 * i + 1] = hexDigits[Int(byte & 0xF)]
                }
                return bytes.count * 2
            }
        }
    }

    /// Links records onto a chain whose head is (`seq`, `hash`).
    struct Linker {
        var seq: Int64
        var hash: String

        mutating func link(_ record: AuditRecord) -> StoredAuditRecord {
            let (text, previous) = linkBytes(record)
            return StoredAuditRecord(seq: seq, record: String(decoding: text, as: UTF8.self), previousHash: previous, hash: hash)
        }

        /// The record's text, and the hash it follows; `seq` and `hash` are then the record's.
        mutating func linkBytes(_ record: AuditRecord) -> (text: [UInt8], previous: String) {
            seq += 1
            let text = record.canonicalJSON(seq: seq)
            let previous = hash
            hash = AuditChain.hash(previous: previous, record: text)
            return (text, previous)
        }
    }

    /// What checking a chain found.
    public enum Finding: Sendable, Equatable, CustomStringConvertible {
        /// Every record links to the one before and hashes to its stored hash; `seq` and `head`
        /// are the last record checked (an anchor for the next check).
        case intact(count: Int64, seq: Int64, head: String)
        /// The first record that does not: its seq (or where one is missing) and why.
        case broken(seq: Int64, reason: String)

        public var description: String {
            switch self {
            case .intact(let count, let seq, let head): "intact: \(count) records, head \(seq):\(head)"
            case .broken(let seq, let reason): "broken at record \(seq): \(reason)"
            }
        }
    }

    /// Checks records page by page, in order; `head` is the head the ledger keeps beside them.
    public struct Checker: Sendable {
        public private(set) var count: Int64 = 0
        public private(set) var lastSeq: Int64 = 0
        public private(set) var lastHash = AuditChain.genesis
        public private(set) var broken: Finding? = nil
        /// Where the kept chain starts (the last record retention dropped), and the newest
        /// checkpoint record seen: it must name that start.
        private var start: (seq: Int64, hash: String)
        private var lastCheckpoint: (seq: Int64, hash: String)? = nil
        /// The newest checkpoint record's own seq and the retention cutoff it carries (its
        /// `received_at` text).
        private var lastCutoff: (seq: Int64, text: String?)? = nil
        /// Heads seen earlier and kept away from the ledger (seq → hash): the chain must still
        /// hold each. Without one, whoever can write the ledger can rewrite its tail and head.
        private let anchors: [Int64: String]
        /// The keys the records checked so far attest (`key` records).
        public private(set) var attestedKeys: Set<ArchivedKey.Reference> = []

        public init(start: (seq: Int64, hash: String) = (0, AuditChain.genesis), anchors: [AuditAnchor] = []) {
            self.start = start
            lastSeq = start.seq
            lastHash = start.hash
            self.anchors = Dictionary(anchors.map { ($0.seq, $0.hash) }, uniquingKeysWith: { first, _ in first })
        }

        /// Goes on from a later start: retention dropped, while the chain was read, the records
        /// after the last one checked up to `start` (the ledger's start now). What follows must
        /// link to it, and a checkpoint must name it, as for a check begun there.
        public mutating func restart(at start: (seq: Int64, hash: String)) {
            guard broken == nil, start.seq > lastSeq else { return }
            self.start = start
            lastSeq = start.seq
            lastHash = start.hash
        }

        /// Checks the next record; false once the chain is broken.
        @discardableResult
        public mutating func check(_ record: StoredAuditRecord) -> Bool {
            guard broken == nil else { return false }
            func fail(_ reason: String) -> Bool {
                broken = .broken(seq: record.seq, reason: reason)
                return false
            }
            guard record.seq == lastSeq + 1 else {
                return fail(record.seq > lastSeq + 1
                            ? "records \(lastSeq + 1)…\(record.seq - 1) are missing"
                            : "it comes after record \(lastSeq) out of order")
            }
            guard record.previousHash == lastHash else {
                return fail("its previous hash is not the hash of record \(lastSeq) (removed or reordered records)")
            }
            let text = Array(record.record.utf8)
            guard AuditChain.hash(previous: record.previousHash, record: text) == record.hash else {
                return fail("its content does not hash to its stored hash (the record was changed)")
            }
            guard let parsed = Self.parse(text), parsed.seq == record.seq else {
                return fail("the seq inside the record is not its place in the chain (records were swapped)")
            }
            if let anchored = anchors[record.seq], anchored != record.hash {
                return fail("its hash is not the one anchored for it (the chain was rewritten from here or before)")
            }
            if let key = parsed.key { attestedKeys.insert(key.reference) }
            if let through = parsed.checkpoint {
                guard through.seq < record.seq else { return fail("a checkpoint that names a record after itself") }
                lastCheckpoint = (through.seq, through.hash)
                lastCutoff = (record.seq, through.cutoff)
            }
            count += 1
            lastSeq = record.seq
            lastHash = record.hash
            return true
        }

        /// The finding once every record is checked, against the head kept beside them.
        /// `currentStart`: the ledger's start as read after the records; retention may have
        /// moved it meanwhile past records already checked, and then the last checkpoint names it.
        public func finish(head: (seq: Int64, hash: String), currentStart: (seq: Int64, hash: String)? = nil) -> Finding {
            if let broken { return broken }
            // Records were dropped: a checkpoint in the kept chain must say where, or the start
            // was moved by hand (records removed from the front).
            if start.seq > 0 || (currentStart?.seq ?? 0) > 0 {
                guard let checkpoint = lastCheckpoint else {
                    return .broken(seq: start.seq &+ 1, reason: "the chain starts after record \(start.seq) but no checkpoint record says so (records removed from the front)")
                }
                let movedBehind = currentStart.map { now in
                    checkpoint.seq == now.seq && checkpoint.hash == now.hash && now.seq > start.seq && now.seq <= lastSeq
                } ?? false
                guard (checkpoint.seq == start.seq && checkpoint.hash == start.hash) || movedBehind else {
                    return .broken(seq: start.seq &+ 1, reason: "the chain starts after record \(start.seq) but its last checkpoint "
                                   + "dropped up to record \(checkpoint.seq) (the start was moved)")
                }
            }
            guard head.seq == lastSeq, head.hash == lastHash else {
                return .broken(seq: lastSeq + 1,
                               reason: "the chain's head is record \(head.seq) but the records end at \(lastSeq) (records removed from the end)")
            }
            for (seq, hash) in anchors.sorted(by: { $0.key < $1.key }) {
                if seq > lastSeq {
                    return .broken(seq: lastSeq + 1, reason: "the chain ends at record \(lastSeq), before the anchored record \(seq) (records removed from the end)")
                }
                if seq == start.seq, hash != start.hash {
                    return .broken(seq: seq, reason: "the chain's start is not the anchored record \(seq) (the chain was rewritten)")
                }
                if seq < start.seq {
                    return .broken(seq: seq, reason: "the anchored record \(seq) is gone: dropped by retention, or the chain was cut "
                                   + "(check with an anchor newer than the retention)")
                }
            }
            return .intact(count: count, seq: lastSeq, head: lastHash)
        }

        /// The retention cutoff kept beside the chain (`pruned_before`, which replay reads) must
        /// be the one the newest checkpoint carries: edited, replay would take events received
        /// after the real cutoff for dropped (and never report them missed), or dropped ones for
        /// missed. `kept`: the kept cutoff as read before and after the records (a prune
        /// meanwhile moves it and appends the checkpoint that carries it). Nil when it matches.
        public func cutoffFinding(kept: [Double?]) -> Finding? {
            guard broken == nil else { return nil }
            let chained = lastCutoff?.text
            if kept.contains(where: { $0.map(Retention.text) == chained }) { return nil }
            let shown = kept.last.flatMap { $0 }.map(Retention.text) ?? "none"
            guard let lastCutoff else {
                return .broken(seq: lastSeq, reason: "the retention cutoff kept beside the chain (\(shown)) is carried by no checkpoint "
                               + "record (set by hand: replay would take events received before it for dropped)")
            }
            return .broken(seq: lastCutoff.seq, reason: "the retention cutoff kept beside the chain (\(shown)) is not the one this "
                           + "checkpoint carries (\(lastCutoff.text ?? "none")): edited by hand, replay would misjudge what was dropped")
        }

        static func seq(inRecord text: [UInt8]) -> Int64? { parse(text)?.seq }

        struct Parsed {
            var seq: Int64
            /// A checkpoint's last dropped record and the retention cutoff it carries.
            var checkpoint: (seq: Int64, hash: String, cutoff: String?)?
            /// A key record's key and when it was first seen.
            var key: (reference: ArchivedKey.Reference, firstSeen: Double)?
        }

        /// The record's own seq and, for a checkpoint or a key record, what it names.
        static func parse(_ text: [UInt8]) -> Parsed? {
            guard case .object(let object)? = try? JSONParser.parse(text), let n = object["seq"]?.numberValue,
                  let seq = Int64(exactly: n) else { return nil }
            switch object["kind"]?.stringValue {
            case AuditRecord.Kind.checkpoint.rawValue:
                guard let through = object["pruned_through_seq"]?.numberValue.flatMap({ Int64(exactly: $0) }),
                      let hash = object["pruned_through_hash"]?.stringValue else { return Parsed(seq: seq, checkpoint: (seq, "", nil)) }  // refused by the caller
                return Parsed(seq: seq, checkpoint: (through, hash, object["received_at"]?.stringValue))
            case AuditRecord.Kind.key.rawValue:
                guard let issuer = object["issuer"]?.stringValue, let keyID = object["key_id"]?.stringValue,
                      let thumbprint = object["key_thumbprint"]?.stringValue,
                      let firstSeen = object["received_at"]?.stringValue.flatMap(RFC3339.parse) else { return Parsed(seq: seq) }
                return Parsed(seq: seq, key: (ArchivedKey.Reference(issuer: issuer, keyID: keyID, thumbprint: thumbprint), firstSeen))
            default:
                return Parsed(seq: seq)
            }
        }
    }
}

extension AuditingLedger {
    /// Checks the whole chain, page by page, every record there is. The head is read before and
    /// after: the records must reach the first (none cut from the end) and go no further than
    /// the second (a head moved back would otherwise leave the records beyond it unchecked);
    /// records appended meanwhile lie between the two.
    ///
    /// Retention may move the start while the chain is read (the worker prunes as it runs): a
    /// break found after the start moved is checked again from the new start, a few times.
    ///
    /// `anchors`: heads printed by earlier checks and kept away from the ledger; the chain must
    /// still hold each (a rewritten tail with its head moved to match is named).
    public func checkAuditChain(pageSize: Int = 1000, anchors: [AuditAnchor] = []) async throws(LedgerError) -> AuditChain.Finding {
        try await checkAuditChain(pageSize: pageSize, anchors: anchors, afterReadingTheStart: {})
    }

    /// The archived keys a record of the kept chain attests, with the chain's finding: none
    /// when the chain itself is broken (its records prove nothing then). A key added to the
    /// archive by hand has no record, and is left out (the finding names the first).
    public func attestedArchivedKeys(pageSize: Int = 1000) async throws(LedgerError) -> (keys: [ArchivedKey], finding: AuditChain.Finding) {
        let checked = try await checkedAuditChain(pageSize: pageSize, anchors: [], afterReadingTheStart: {}, afterEachPage: {})
        return (checked.attested, checked.finding)
    }

    /// `afterReadingTheStart` runs between reading the start and the records, `afterEachPage`
    /// after each page of records is read: tests prune there.
    func checkAuditChain(pageSize: Int, anchors: [AuditAnchor] = [], afterReadingTheStart: () async throws(LedgerError) -> Void,
                         afterEachPage: () async throws(LedgerError) -> Void = {})
        async throws(LedgerError) -> AuditChain.Finding {
        try await checkedAuditChain(pageSize: pageSize, anchors: anchors, afterReadingTheStart: afterReadingTheStart,
                                    afterEachPage: afterEachPage).finding
    }

    private func checkedAuditChain(pageSize: Int, anchors: [AuditAnchor], afterReadingTheStart: () async throws(LedgerError) -> Void,
                                   afterEachPage: () async throws(LedgerError) -> Void)
        async throws(LedgerError) -> (finding: AuditChain.Finding, attested: [ArchivedKey]) {
        var attempts = 0
        while true {
            let start = try await auditStart()
            try await afterReadingTheStart()
            let checked = try await checkAuditChain(from: start, anchors: anchors, pageSize: pageSize, afterEachPage: afterEachPage)
            attempts += 1
            guard case .broken = checked.finding, attempts < 5, try await auditStart() != start else { return checked }
        }
    }

    private func checkAuditChain(from start: (seq: Int64, hash: String), anchors: [AuditAnchor], pageSize: Int,
                                 afterEachPage: () async throws(LedgerError) -> Void)
        async throws(LedgerError) -> (finding: AuditChain.Finding, attested: [ArchivedKey]) {
        let before = try await auditHead()
        let cutoffBefore = try await retentionCutoff()
        // Read before the records: a key archived meanwhile has its record after them.
        let archived = try await archivedKeys()
        // Retention drops records up to the start and moves the start in one transaction: a
        // record at or before it was put there by hand, and would be exported unchecked.
        if let first = try await auditRecords(afterSeq: .min, limit: 1).first, first.seq <= start.seq {
            return (.broken(seq: first.seq, reason: "it lies at or before the chain's start (record \(start.seq)), "
                            + "where retention left no record (a record inserted by hand)"), [])
        }
        var checker = AuditChain.Checker(start: start, anchors: anchors)
        var after: Int64 = start.seq
        pages: while true {
            let page = try await auditRecords(afterSeq: after, limit: pageSize)
            try await afterEachPage()
            for record in page {
                if record.seq > checker.lastSeq + 1 {
                    // Records missing ahead of the walk: retention (the worker prunes as it
                    // runs) may have dropped them since. Then the ledger's start is now at the
                    // last of them or beyond (a later prune), and the walk goes on from there;
                    // the last checkpoint must still name the start the ledger ends with.
                    let now = try await auditStart()
                    if now.seq >= record.seq - 1 { checker.restart(at: (record.seq - 1, record.previousHash)) }
                }
                guard checker.check(record) else { break pages }
                after = record.seq
            }
            if page.count < pageSize { break }
        }
        if let broken = checker.broken { return (broken, []) }
        let now = try await auditHead()
        if checker.lastSeq > now.seq {
            return (.broken(seq: now.seq + 1, reason: "records go on past the chain's head (record \(now.seq)): the head was moved back"), [])
        }
        if checker.lastSeq == now.seq, checker.lastHash != now.hash {
            return (.broken(seq: now.seq, reason: "the chain's head does not hold this record's hash"), [])
        }
        if let edited = checker.cutoffFinding(kept: [cutoffBefore, try await retentionCutoff()]) { return (edited, []) }
        // Appended since the head was first read, or cut from the end.
        let finding = checker.finish(head: checker.lastSeq >= before.seq ? (checker.lastSeq, checker.lastHash) : before,
                                     currentStart: try await auditStart())
        guard case .intact = finding else { return (finding, []) }
        let attested = archived.filter { checker.attestedKeys.contains($0.reference) }
        // Every archived key must be attested: one added by hand would be trusted by replay.
        if let stray = archived.first(where: { !checker.attestedKeys.contains($0.reference) }) {
            return (.broken(seq: checker.lastSeq, reason: "the key archive holds \(stray.reference), which no key record of the chain "
                            + "attests: replay does not use it (added by hand, or archived by a Warden older than key records: delete its row, and a worker archives it again, attested, while its issuer publishes it)"), attested)
        }
        return (finding, attested)
    }
}
