import Foundation
internal import GRDB
internal import GRDBSQLite
import SecurityEvents
import Synchronization

/// Collects the audit records one write decides, and appends them to the chain before the write
/// commits: records and outcomes are durable together, and the chain's order is the order of
/// commits (the ledger has one writer).
struct SQLiteAuditAppender {
    private var records: [AuditRecord] = []
    private var binder = SQLiteBinder()

    mutating func append(_ record: AuditRecord) { records.append(record) }

    /// The record of an event that has reached `outcome`, read from the event and its steps.
    /// `claimed`: the event's fields as this ledger claimed it, if known: then only its steps are read.
    mutating func appendOutcome(ofEvent eventID: Int64, outcome: EventOutcome, at now: Double, in db: Database,
                                kind: AuditRecord.Kind = .event, note: String? = nil, claimed: AuditRecord? = nil) throws {
        var record: AuditRecord? = claimed.map {
            var record = $0
            record.kind = kind
            record.outcome = outcome.rawValue
            record.note = note
            record.recordedAt = now
            return record
        }
        if record == nil {
            try binder.query(db.cachedStatement(sql: """
                SELECT e.issuer, e.jti, \(tokenDigestColumns), e.source, e.event_types, e.subject, e.key_id, e.algorithm,
                       e.key_thumbprint, e.issued_at, e.received_at
                FROM events e LEFT JOIN event_tokens t ON t.event_id = e.id WHERE e.id = ?
                """), in: db, { $0.integer(eventID) }, row: { row in
                let types = (try? JSONParser.parse(columnBytes(row, 5)))?.arrayValue?.compactMap(\.stringValue) ?? []
                record = AuditRecord(kind: kind, eventID: eventID, source: columnText(row, 4) ?? "", receivedAt: sqlite3_column_double(row, 11),
                                     tokenSHA256: tokenDigest(stored: columnText(row, 2), token: columnBytes(row, 3)), issuer: columnText(row, 0),
                                     jti: columnText(row, 1), eventTypes: types, subject: columnText(row, 6),
                                     keyID: columnText(row, 7), algorithm: columnText(row, 8), keyThumbprint: columnText(row, 9),
                                     issuedAt: sqlite3_column_double(row, 10), outcome: outcome.rawValue, note: note, recordedAt: now)
            })
        }
        guard var record else { throw LedgerError(.conflict, "no event with id \(eventID) in the ledger") }
        try binder.query(db.cachedStatement(sql: "SELECT idx, kind, status, detail, attempts FROM steps WHERE event_id = ? ORDER BY idx"),
                         in: db, { $0.integer(eventID) }, row: { row in
            record.steps.append(AuditRecord.Step(index: Int(sqlite3_column_int64(row, 0)), kind: columnText(row, 1) ?? "",
                                                 status: StepStatus(rawValue: columnText(row, 2) ?? "") ?? .pending,
                                                 detail: columnText(row, 3), attempts: Int(sqlite3_column_int64(row, 4))))
        })
        records.append(record)
    }

    /// Links the collected records onto the chain and writes them, with the chain's new head.
    mutating func commit(in db: Database) throws {
        guard !records.isEmpty else { return }
        var linker: AuditChain.Linker? = nil
        try binder.query(db.cachedStatement(sql: "SELECT seq, hash FROM audit_head WHERE id = 1"), in: db, { _ in }, row: { row in
            linker = AuditChain.Linker(seq: sqlite3_column_int64(row, 0), hash: columnText(row, 1) ?? "")
        })
        guard var linker else { throw LedgerError(.refused, "the ledger has no audit chain head") }
        let insert = try db.cachedStatement(sql: "INSERT INTO audit_records (seq, record, prev_hash, hash) VALUES (?, ?, ?, ?)")
        for record in records {
            // Bound as the bytes made, without a string between.
            let (text, previous) = linker.linkBytes(record)
            try binder.execute(insert, in: db) {
                $0.integer(linker.seq)
                $0.text(utf8: text)
                $0.text(previous)
                $0.text(linker.hash)
            }
        }
        try binder.execute(db.cachedStatement(sql: "UPDATE audit_head SET seq = ?, hash = ? WHERE id = 1"), in: db) {
            $0.integer(linker.seq)
            $0.text(linker.hash)
        }
        records.removeAll()
    }
}

/// An event's token digest, as two columns of `events e LEFT JOIN event_tokens t`: the digest kept
/// with the event, and (only for an event claimed before digests were kept) its token.
let tokenDigestColumns = "e.token_sha256, CASE WHEN e.token_sha256 IS NULL THEN coalesce(t.token, e.token) END"

/// The digest `tokenDigestColumns` read: the one kept, or the token's.
func tokenDigest(stored: String?, token: [UInt8]) -> String { stored ?? AuditChain.sha256Hex(token) }

/// The audit fields of events a SQLite ledger claimed with steps, from their claim until their
/// outcome is recorded, so that the outcome's audit record is made without reading the event
/// back. An entry is kept once its claim committed, and used only after the outcome's update
/// confirmed the row is still that claim (issuer, jti, time received). A bounded cache: when
/// full, the oldest half goes (an event whose outcome another process recorded stays until then).
final class ClaimedEvents: Sendable {
    static let capacity = 16_384
    private let entries = Mutex([Int64: AuditRecord]())

    func keep(_ record: AuditRecord) {
        guard let id = record.eventID else { return }
        entries.withLock { entries in
            if entries.count >= Self.capacity {
                // The oldest half (claimed first: the smaller ids) makes room.
                let keys = entries.keys.sorted()
                for key in keys.prefix(keys.count / 2) { entries[key] = nil }
            }
            entries[id] = record
        }
    }

    func take(_ id: Int64) -> AuditRecord? { entries.withLock { $0.removeValue(forKey: id) } }

    var count: Int { entries.withLock { $0.count } }
}

/// A cell as text whatever it holds: a blob's bytes decoded (invalid UTF-8 replaced), a number
/// written out, NULL empty. GRDB's `row[i] as String` traps on what it cannot convert.
func lossyText(_ row: Row, _ index: Int) -> String {
    switch (row[index] as DatabaseValue).storage {
    case .string(let text): text
    case .blob(let data): String(decoding: data, as: UTF8.self)
    case .int64(let n): String(n)
    case .double(let x): String(x)
    case .null: ""
    }
}

/// A cell's integer, nil when it holds anything else.
private func integer(_ row: Row, _ index: Int) -> Int64? {
    if case .int64(let n) = (row[index] as DatabaseValue).storage { n } else { nil }
}

/// A cell's number, nil when it holds anything else.
func number(_ row: Row, _ index: Int) -> Double? {
    switch (row[index] as DatabaseValue).storage {
    case .double(let x): x
    case .int64(let n): Double(n)
    default: nil
    }
}

private func columnText(_ row: OpaquePointer, _ column: Int32) -> String? {
    guard sqlite3_column_type(row, column) != SQLITE_NULL, let text = sqlite3_column_text(row, column) else { return nil }
    let count = Int(sqlite3_column_bytes(row, column))
    return String(decoding: UnsafeBufferPointer(start: text, count: count), as: UTF8.self)
}

private func columnBytes(_ row: OpaquePointer, _ column: Int32) -> [UInt8] {
    guard let text = sqlite3_column_text(row, column) else { return [] }
    return Array(UnsafeBufferPointer(start: text, count: Int(sqlite3_column_bytes(row, column))))
}

extension SQLiteLedger {
    public func archive(keys: [ArchivedKey], issuer: String, seenAt time: Double) async throws(LedgerError) {
        try await writer.submit(urgent: true) { db in
            var audit = SQLiteAuditAppender()
            for key in keys {
                try db.execute(sql: """
                    INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen) VALUES (?, ?, ?, ?, ?, ?)
                    ON CONFLICT (issuer, kid, thumbprint) DO NOTHING
                    """, arguments: [issuer, key.keyID, key.thumbprint, key.jwk, time, time])
                if db.changesCount == 1 {
                    // New to the archive: a record of the chain attests it, in the same transaction.
                    audit.append(AuditRecord(key: .init(issuer: issuer, keyID: key.keyID, thumbprint: key.thumbprint),
                                             firstSeen: time, recordedAt: Date().timeIntervalSince1970))
                } else {
                    try db.execute(sql: """
                        UPDATE signing_keys SET last_seen = max(last_seen, ?) WHERE issuer = ? AND kid = ? AND thumbprint = ?
                        """, arguments: [time, issuer, key.keyID, key.thumbprint])
                }
            }
            try audit.commit(in: db)
        }
    }

    public func archivedKeys() async throws(LedgerError) -> [ArchivedKey] {
        try await durableRead { db in
            try Row.fetchAll(db, sql: "SELECT issuer, kid, thumbprint, jwk, first_seen, last_seen FROM signing_keys ORDER BY issuer, kid, last_seen")
                .compactMap { row -> ArchivedKey? in
                    // A row edited by hand to hold other types is no key (GRDB's conversions would trap).
                    guard let firstSeen = number(row, 4), let lastSeen = number(row, 5) else { return nil }
                    return ArchivedKey(issuer: lossyText(row, 0), keyID: lossyText(row, 1), thumbprint: lossyText(row, 2),
                                       jwk: lossyText(row, 3), firstSeen: firstSeen, lastSeen: lastSeen)
                }
        }
    }

    public func auditRecords(afterSeq: Int64, limit: Int) async throws(LedgerError) -> [StoredAuditRecord] {
        try await durableRead { db in
            try Row.fetchAll(db, sql: "SELECT seq, record, prev_hash, hash FROM audit_records WHERE seq > ? ORDER BY seq LIMIT ?",
                             arguments: [afterSeq, limit])
                // `seq` is the rowid, always an integer; the texts may have been edited into
                // anything (a blob, bytes that are not UTF-8): read as they are, they then fail
                // their hash, which names the record.
                .map { StoredAuditRecord(seq: $0[0], record: lossyText($0, 1), previousHash: lossyText($0, 2), hash: lossyText($0, 3)) }
        }
    }

    public func auditHead() async throws(LedgerError) -> (seq: Int64, hash: String) {
        try await durableRead { db in
            guard let row = try Row.fetchOne(db, sql: "SELECT seq, hash FROM audit_head WHERE id = 1") else {
                return (-1, "the head is missing")
            }
            return (integer(row, 0) ?? -1, lossyText(row, 1))
        }
    }

    public func eventStates(_ keys: [EventKey]) async throws(LedgerError) -> [EventKey: EventState] {
        try await durableRead { db in
            var states: [EventKey: EventState] = [:]
            var binder = SQLiteBinder()
            // One index probe per pair, by statements prepared once per connection: a statement
            // naming hundreds of pairs cost more to prepare than all its probes.
            let event = try db.cachedStatement(sql: """
                SELECT e.id, \(tokenDigestColumns), e.outcome, e.source, e.received_at
                FROM events e LEFT JOIN event_tokens t ON t.event_id = e.id WHERE e.issuer = ? AND e.jti = ?
                """)
            let steps = try db.cachedStatement(sql: "SELECT idx, kind, action, status, detail FROM steps WHERE event_id = ? ORDER BY idx")
            for key in keys where states[key] == nil {
                var state: EventState?
                try binder.query(event, in: db, { $0.text(key.issuer); $0.text(key.jti) }, row: { row in
                    state = EventState(id: sqlite3_column_int64(row, 0), tokenSHA256: tokenDigest(stored: columnText(row, 1), token: columnBytes(row, 2)),
                                       outcome: EventOutcome(rawValue: columnText(row, 3) ?? "") ?? .claimed, source: columnText(row, 4) ?? "",
                                       receivedAt: sqlite3_column_double(row, 5), steps: [])
                })
                guard var found = state else { continue }
                try binder.query(steps, in: db, { $0.integer(found.id) }, row: { row in
                    found.steps.append(OutboxStep(index: Int(sqlite3_column_int64(row, 0)), kind: columnText(row, 1) ?? "",
                                                  action: columnText(row, 2) ?? "",
                                                  status: StepStatus(rawValue: columnText(row, 3) ?? "") ?? .pending, detail: columnText(row, 4)))
                })
                states[key] = found
            }
            return states
        }
    }

    public func laterEvent(issuer: String, subject: String, issuedAfter issuedAt: Double) async throws(LedgerError) -> Int64? {
        try await durableRead { db in
            var found: Int64?
            var binder = SQLiteBinder()
            try binder.query(db.cachedStatement(sql: """
                SELECT id FROM events WHERE issuer = ? AND subject = ? AND issued_at > ? ORDER BY issued_at LIMIT 1
                """), in: db, { $0.text(issuer); $0.text(subject); $0.double(issuedAt) }, row: { found = sqlite3_column_int64($0, 0) })
            return found
        }
    }

    public func retentionCutoff() async throws(LedgerError) -> Double? {
        try await durableRead { db in try Double.fetchOne(db, sql: "SELECT pruned_before FROM audit_start WHERE id = 1") }
    }

    public func rejectedDigests(_ digests: [String]) async throws(LedgerError) -> Set<String> {
        try await durableRead { db in
            var found = Set<String>()
            var binder = SQLiteBinder()
            let delivery = try db.cachedStatement(sql: "SELECT 1 FROM deliveries WHERE token_sha256 = ? LIMIT 1")
            for digest in digests where !found.contains(digest) {
                try binder.query(delivery, in: db, { $0.text(digest) }, row: { _ in found.insert(digest) })
            }
            return found
        }
    }

    public func events(sourcePrefix: String, receivedFrom from: Double, to: Double, afterID: Int64, limit: Int) async throws(LedgerError)
        -> [EventSummary]
    {
        try await durableRead { db in
            try Row.fetchAll(db, sql: """
                SELECT id, issuer, jti, event_types, outcome, received_at, source FROM events
                WHERE id > ? AND substr(source, 1, ?) = ? AND received_at >= ? AND received_at < ? ORDER BY id LIMIT ?
                """, arguments: [afterID, sourcePrefix.utf8.count, sourcePrefix, from, to, limit]).map { row in
                let types: String = row[3]
                return EventSummary(id: row[0], issuer: row[1], jti: row[2],
                                    eventTypes: (try? JSONParser.parse(types))?.arrayValue?.compactMap(\.stringValue) ?? [],
                                    outcome: EventOutcome(rawValue: row[4]) ?? .claimed, receivedAt: row[5], source: row[6])
            }
        }
    }

    public func reopenFailedSteps(ofEvent eventID: Int64, reason: String) async throws(LedgerError) -> Int {
        try await writer.submit(urgent: true) { db in
            let now = Date().timeIntervalSince1970
            try db.execute(sql: "UPDATE steps SET status = 'pending', updated_at = ? WHERE event_id = ? AND status = 'failed'",
                           arguments: [now, eventID])
            let reopened = db.changesCount
            guard reopened > 0 else { return 0 }
            try db.execute(sql: "UPDATE events SET outcome = 'pending', updated_at = ? WHERE id = ?", arguments: [now, eventID])
            var audit = SQLiteAuditAppender()
            try audit.appendOutcome(ofEvent: eventID, outcome: .pending, at: now, in: db, kind: .reopened, note: reason)
            try audit.commit(in: db)
            return reopened
        }
    }
}

extension SQLiteLedger {
    public func auditStart() async throws(LedgerError) -> (seq: Int64, hash: String) {
        try await durableRead { db in
            guard let row = try Row.fetchOne(db, sql: "SELECT seq, hash FROM audit_start WHERE id = 1") else { return (0, AuditChain.genesis) }
            // Not a number (edited by hand): a start no record follows, named by the check.
            return (integer(row, 0) ?? .max, lossyText(row, 1))
        }
    }

    public func prune(before cutoff: Double, limit: Int, afterEventID: Int64) async throws(LedgerError) -> PruneResult {
        try await writer.submit { db in
            let now = Date().timeIntervalSince1970
            // The oldest events after the cursor, up to the first received at or after the cutoff.
            var candidates: [Int64] = [], last = afterEventID, reachedCutoff = false
            let rows = try Row.fetchAll(db, sql: "SELECT id, received_at, outcome FROM events WHERE id > ? ORDER BY id LIMIT ?",
                                        arguments: [afterEventID, limit])
            for row in rows {
                let received: Double = row[1]
                if received >= cutoff {
                    reachedCutoff = true
                    break
                }
                last = row[0]
                if (row[2] as String) != EventOutcome.pending.rawValue { candidates.append(row[0]) }
            }
            // The newest event stays until a later one comes: SQLite gives a new row the id after
            // the largest one there, and the audit trail and readers take an event id for ever
            // one event's (PostgreSQL's sequence never goes back).
            if let newest = try Int64.fetchOne(db, sql: "SELECT max(id) FROM events") { candidates.removeAll { $0 == newest } }
            // An event with a step still pending is not finished, whatever its outcome says.
            var dropped: [Int64] = []
            for chunk in candidates.chunks(of: 400) {
                let marks = databaseQuestionMarks(count: chunk.count)
                let unfinished = Set(try Int64.fetchAll(db, sql: "SELECT DISTINCT event_id FROM steps WHERE status = 'pending' AND event_id IN (\(marks))",
                                                        arguments: StatementArguments(chunk)))
                let ids = chunk.filter { !unfinished.contains($0) }
                guard !ids.isEmpty else { continue }
                let idMarks = databaseQuestionMarks(count: ids.count)
                for table in ["steps", "event_tokens", "deliveries"] {
                    try db.execute(sql: "DELETE FROM \(table) WHERE event_id IN (\(idMarks))", arguments: StatementArguments(ids))
                }
                try db.execute(sql: "DELETE FROM events WHERE id IN (\(idMarks))", arguments: StatementArguments(ids))
                dropped += ids
            }
            try db.execute(sql: """
                DELETE FROM deliveries WHERE id IN
                    (SELECT id FROM deliveries WHERE event_id IS NULL AND received_at < ? ORDER BY id LIMIT ?)
                """, arguments: [cutoff, limit])
            let rejections = db.changesCount
            // Audit records recorded before the cutoff, from the start of the kept chain.
            let startRow = try Row.fetchOne(db, sql: "SELECT seq, hash, pruned_before FROM audit_start WHERE id = 1")
            let start = startRow.map { $0[0] as Int64 } ?? 0
            var kept: (seq: Int64, hash: String) = (start, startRow.map { lossyText($0, 1) } ?? AuditChain.genesis)
            let records = try Row.fetchAll(db, sql: "SELECT seq, record, prev_hash, hash FROM audit_records WHERE seq > ? ORDER BY seq LIMIT ?",
                                           arguments: [start, limit])
                // `seq` is the rowid, always an integer; the texts may have been edited into
                // anything (a blob, bytes that are not UTF-8): read as they are, they then fail
                // their hash, which names the record.
                .map { StoredAuditRecord(seq: $0[0], record: lossyText($0, 1), previousHash: lossyText($0, 2), hash: lossyText($0, 3)) }
            let droppable = Retention.droppable(records, before: cutoff, limit: limit, startHash: kept.hash)
            if droppable > 0 {
                let through = records[droppable - 1]
                try db.execute(sql: "DELETE FROM audit_records WHERE seq <= ?", arguments: [through.seq])
                try db.execute(sql: "UPDATE audit_start SET seq = ?, hash = ? WHERE id = 1", arguments: [through.seq, through.hash])
                kept = (through.seq, through.hash)
            }
            if let cut = Retention.cut(start: kept, droppedRecords: droppable, events: dropped.count, rejections: rejections,
                                       cutoff: cutoff, previousCutoff: startRow?[2], at: now) {
                try db.execute(sql: "UPDATE audit_start SET pruned_before = ? WHERE id = 1", arguments: [cut.prunedBefore])
                var audit = SQLiteAuditAppender()
                audit.append(cut.checkpoint)
                let archived = Set(try Row.fetchAll(db, sql: "SELECT issuer, kid, thumbprint FROM signing_keys").map {
                    ArchivedKey.Reference(issuer: lossyText($0, 0), keyID: lossyText($0, 1), thumbprint: lossyText($0, 2))
                })
                for key in Retention.carriedKeys(records.prefix(droppable), archived: archived, at: now) { audit.append(key) }
                try audit.commit(in: db)
            }
            let more = (rows.count == limit && !reachedCutoff) || rejections == limit || droppable == limit
            return PruneResult(events: dropped.count, rejections: rejections, auditRecords: droppable, lastEventID: last, more: more)
        }
    }
}

extension Array {
    func chunks(of size: Int) -> [ArraySlice<Element>] {
        stride(from: 0, to: count, by: size).map { self[$0..<Swift.min($0 + size, count)] }
    }
}
