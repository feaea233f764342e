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
    /// Events whose first delivery came from `sourcePrefix…`, received in [from, to), with ids
    /// above `afterID`, oldest first, at most `limit`.
    func events(sourcePrefix: String, receivedFrom from: Double, to: Double, afterID: Int64, limit: Int) async throws(LedgerError)
        -> [EventSummary]
    /// Makes an event's failed steps pending again (and the event pending), so that its steps
    /// run again; the reopening is an audit record of its own. Returns how many were reopened.
    func reopenFailedSteps(ofEvent eventID: Int64, reason: String) async throws(LedgerError) -> Int
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
}

public struct EventKey: Sendable, Hashable {
    public var issuer: String
    public var jti: String
    public init(issuer: String, jti: String) {
        self.issuer = issuer
        self.jti = jti
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

    public init(id: Int64, issuer: String, jti: String, eventTypes: [String], outcome: EventOutcome, receivedAt: Double) {
        self.id = id
        self.issuer = issuer
        self.jti = jti
        self.eventTypes = eventTypes
        self.outcome = outcome
        self.receivedAt = receivedAt
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
public struct AuditRecord: Sendable, Equatable {
    public enum Kind: String, Sendable {
        /// An event's outcome: its steps done or failed, or none to do.
        case event
        /// A further delivery of an event already recorded.
        case duplicate
        /// A message that failed verification.
        case rejection
        /// An event's failed steps made pending again (`warden replay --apply`).
        case reopened
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
    public var tokenSHA256: String
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
    public var recordedAt: Double

    public init(kind: Kind, eventID: Int64?, source: String, receivedAt: Double, tokenSHA256: String,
                error: (code: String, description: String)? = nil, issuer: String? = nil, jti: String? = nil,
                eventTypes: [String] = [], subject: String? = nil, keyID: String? = nil, algorithm: String? = nil,
                keyThumbprint: String? = nil, issuedAt: Double? = nil, outcome: String, steps: [Step] = [],
                note: String? = nil, recordedAt: Double) {
        self.kind = kind
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

    public static func == (a: AuditRecord, b: AuditRecord) -> Bool {
        a.canonicalJSON(seq: 0) == b.canonicalJSON(seq: 0)
    }

    /// A verified event as claimed, with the outcome it has at this point.
    init(event: LedgerEvent, eventID: Int64, kind: Kind, outcome: String, steps: [Step], recordedAt: Double) {
        self.init(kind: kind, eventID: eventID, source: event.source, receivedAt: event.receivedAt,
                  tokenSHA256: AuditChain.sha256Hex(event.tokenBytes), issuer: event.issuer, jti: event.jti,
                  eventTypes: event.eventTypes, subject: event.subject, keyID: event.keyID, algorithm: event.algorithm,
                  keyThumbprint: event.keyThumbprint, issuedAt: event.issuedAt, outcome: outcome, steps: steps,
                  recordedAt: recordedAt)
    }

    init(rejection: Rejection, recordedAt: Double) {
        self.init(kind: .rejection, eventID: nil, source: rejection.source, receivedAt: rejection.receivedAt,
                  tokenSHA256: AuditChain.sha256Hex(rejection.token), error: (rejection.code, rejection.description),
                  outcome: "invalid", recordedAt: recordedAt)
    }

    /// The record as canonical JSON: members in code-point order, no spaces, absent members left
    /// out, times as RFC 3339 with milliseconds. The subject is embedded as the ledger stores it.
    public func canonicalJSON(seq: Int64) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(768)
        var first = true
        func name(_ n: String) {
            out.append(first ? UInt8(ascii: "{") : UInt8(ascii: ","))
            first = false
            JSONValue.writeString(n, to: &out)
            out.append(UInt8(ascii: ":"))
        }
        func string(_ n: String, _ value: String?) {
            guard let value else { return }
            name(n)
            JSONValue.writeString(value, to: &out)
        }
        func integer(_ n: String, _ value: Int64?) {
            guard let value else { return }
            name(n)
            out += String(value).utf8
        }
        func time(_ n: String, _ value: Double?) { string(n, value.map(RFC3339.string(from:))) }
        string("algorithm", algorithm)
        string("description", error?.description)
        string("err", error?.code)
        integer("event_id", eventID)
        if !eventTypes.isEmpty {
            name("event_types")
            writeJSONArray(eventTypes, to: &out)
        }
        time("issued_at", issuedAt)
        string("issuer", issuer)
        string("jti", jti)
        string("key_id", keyID)
        string("key_thumbprint", keyThumbprint)
        string("kind", kind.rawValue)
        string("note", note)
        string("outcome", outcome)
        time("received_at", receivedAt)
        time("recorded_at", recordedAt)
        integer("seq", seq)
        string("source", source)
        name("steps")
        out.append(UInt8(ascii: "["))
        for (i, step) in steps.enumerated() {
            if i > 0 { out.append(UInt8(ascii: ",")) }
            out += "{\"attempts\":\(step.attempts)".utf8
            if let detail = step.detail {
                out += ",\"detail\":".utf8
                JSONValue.writeString(detail, to: &out)
            }
            out += ",\"index\":\(step.index),\"kind\":".utf8
            JSONValue.writeString(step.kind, to: &out)
            out += ",\"status\":\"\(step.status.rawValue)\"}".utf8
        }
        out.append(UInt8(ascii: "]"))
        if let subject {
            name("subject")
            // Canonical too (the ledger keeps the subject as the token spelt it), so the record
            // can be re-serialised and hashed from its parsed form.
            if let parsed = try? JSONParser.parse(subject) {
                Self.writeCanonical(parsed, to: &out)
            } else {
                JSONValue.writeString(subject, to: &out)
            }
        }
        string("token_sha256", tokenSHA256)
        string("verdict", error == nil ? "valid" : "invalid")
        out.append(UInt8(ascii: "}"))
        return out
    }
}

extension AuditRecord {
    /// `value` as canonical JSON: object members in code-point order of their names.
    static func writeCanonical(_ value: JSONValue, to out: inout [UInt8]) {
        switch value {
        case .object(let object):
            out.append(UInt8(ascii: "{"))
            let members = object.members.sorted { $0.name.unicodeScalars.lexicographicallyPrecedes($1.name.unicodeScalars) }
            for (i, member) in members.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                JSONValue.writeString(member.name, to: &out)
                out.append(UInt8(ascii: ":"))
                writeCanonical(member.value, to: &out)
            }
            out.append(UInt8(ascii: "}"))
        case .array(let items):
            out.append(UInt8(ascii: "["))
            for (i, item) in items.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                writeCanonical(item, to: &out)
            }
            out.append(UInt8(ascii: "]"))
        default:
            value.write(to: &out)
        }
    }
}

/// The hash chain: each record's hash is SHA-256 over the previous record's hash (hex), a line
/// feed, and the record's canonical JSON text. The first record's previous hash is 64 zeros.
public enum AuditChain {
    public static let genesis = String(repeating: "0", count: 64)

    public static func hash(previous: String, record: [UInt8]) -> String {
        var hasher = SHA256()
        hasher.update(data: Array(previous.utf8))
        hasher.update(data: [UInt8(ascii: "\n")])
        hasher.update(data: record)
        return hex(hasher.finalize())
    }

    public static func sha256Hex(_ bytes: [UInt8]) -> String { hex(SHA256.hash(data: bytes)) }

    static func hex(_ digest: some Sequence<UInt8>) -> String {
        let digits = Array("0123456789abcdef".utf8)
        var out: [UInt8] = []
        out.reserveCapacity(64)
        for byte in digest {
            out.append(digits[Int(byte >> 4)])
            out.append(digits[Int(byte & 0xF)])
        }
        return String(decoding: out, as: UTF8.self)
    }

    /// Links records onto a chain whose head is (`seq`, `hash`).
    struct Linker {
        var seq: Int64
        var hash: String

        mutating func link(_ record: AuditRecord) -> StoredAuditRecord {
            seq += 1
            let text = record.canonicalJSON(seq: seq)
            let next = AuditChain.hash(previous: hash, record: text)
            defer { hash = next }
            return StoredAuditRecord(seq: seq, record: String(decoding: text, as: UTF8.self), previousHash: hash, hash: next)
        }
    }

    /// What checking a chain found.
    public enum Finding: Sendable, Equatable, CustomStringConvertible {
        /// Every record links to the one before and hashes to its stored hash.
        case intact(count: Int64, head: String)
        /// The first record that does not: its seq (or where one is missing) and why.
        case broken(seq: Int64, reason: String)

        public var description: String {
            switch self {
            case .intact(let count, let head): "intact: \(count) records, head \(head)"
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

        public init() {}

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
            guard Self.seq(inRecord: text) == record.seq else {
                return fail("the seq inside the record is not its place in the chain (records were swapped)")
            }
            count += 1
            lastSeq = record.seq
            lastHash = record.hash
            return true
        }

        /// The finding once every record is checked, against the head kept beside them.
        public func finish(head: (seq: Int64, hash: String)) -> Finding {
            if let broken { return broken }
            guard head.seq == lastSeq, head.hash == lastHash else {
                return .broken(seq: lastSeq + 1,
                               reason: "the chain's head is record \(head.seq) but the records end at \(lastSeq) (records removed from the end)")
            }
            return .intact(count: count, head: lastHash)
        }

        static func seq(inRecord text: [UInt8]) -> Int64? {
            guard case .object(let object)? = try? JSONParser.parse(text), let n = object["seq"]?.numberValue else { return nil }
            return Int64(exactly: n)
        }
    }
}

extension AuditingLedger {
    /// Checks the whole chain, page by page, up to the head read first (records appended while
    /// the check runs lie beyond it).
    public func checkAuditChain(pageSize: Int = 1000) async throws(LedgerError) -> AuditChain.Finding {
        let head = try await auditHead()
        var checker = AuditChain.Checker()
        var after: Int64 = 0
        pages: while true {
            let page = try await auditRecords(afterSeq: after, limit: pageSize)
            for record in page {
                guard record.seq <= head.seq, checker.check(record) else { break pages }
                after = record.seq
            }
            if page.count < pageSize { break }
        }
        return checker.finish(head: head)
    }
}
