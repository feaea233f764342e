import Foundation
import PostgresNIO
import SecurityEvents

extension PostgresLedger {
    /// Links `records` onto the chain inside the caller's transaction: the head's row stays
    /// locked until it commits, so replicas append one after another.
    func append(_ records: [AuditRecord], on connection: PostgresConnection) async throws {
        guard !records.isEmpty else { return }
        var linker: AuditChain.Linker? = nil
        for try await (seq, hash) in try await connection.query("SELECT seq, hash FROM audit_head WHERE id = 1 FOR UPDATE",
                                                                logger: logger).decode((Int64, String).self) {
            linker = AuditChain.Linker(seq: seq, hash: hash)
        }
        guard var linker else { throw LedgerError(.refused, "the ledger has no audit chain head") }
        for record in records {
            let stored = linker.link(record)
            try await connection.query("""
                INSERT INTO audit_records (seq, record, prev_hash, hash)
                VALUES (\(stored.seq), \(stored.record), \(stored.previousHash), \(stored.hash))
                """, logger: logger)
        }
        try await connection.query("UPDATE audit_head SET seq = \(linker.seq), hash = \(linker.hash) WHERE id = 1", logger: logger)
    }

    /// The record of an event that has reached `outcome`, read from the event and its steps.
    func outcomeRecord(ofEvent eventID: Int64, outcome: EventOutcome, at now: Double, on connection: PostgresConnection,
                       kind: AuditRecord.Kind = .event, note: String? = nil) async throws -> AuditRecord {
        var record: AuditRecord? = nil
        let rows = try await connection.query("""
            SELECT issuer, jti, token, source, event_types, subject, key_id, algorithm, key_thumbprint, issued_at, received_at
            FROM events WHERE id = \(eventID)
            """, logger: logger)
        for try await (issuer, jti, token, source, types, subject, keyID, algorithm, thumbprint, issuedAt, receivedAt)
            in rows.decode((String, String, String, String, String, String?, String, String, String, Double, Double).self) {
            record = AuditRecord(kind: kind, eventID: eventID, source: source, receivedAt: receivedAt,
                                 tokenSHA256: AuditChain.sha256Hex(Array(token.utf8)), issuer: issuer, jti: jti,
                                 eventTypes: (try? JSONParser.parse(types))?.arrayValue?.compactMap(\.stringValue) ?? [],
                                 subject: subject, keyID: keyID, algorithm: algorithm, keyThumbprint: thumbprint, issuedAt: issuedAt,
                                 outcome: outcome.rawValue, note: note, recordedAt: now)
        }
        guard var record else { throw LedgerError(.conflict, "no event with id \(eventID) in the ledger") }
        for try await (idx, kind, status, detail, attempts) in try await connection.query(
            "SELECT idx, kind, status, detail, attempts FROM steps WHERE event_id = \(eventID) ORDER BY idx", logger: logger)
            .decode((Int, String, String, String?, Int).self) {
            record.steps.append(AuditRecord.Step(index: idx, kind: kind, status: StepStatus(rawValue: status) ?? .pending,
                                                 detail: detail, attempts: attempts))
        }
        return record
    }

    public func archive(keys: [ArchivedKey], issuer: String, seenAt time: Double) async throws(LedgerError) {
        _ = try await transaction("archive keys") { connection in
            var attest: [AuditRecord] = []
            for key in keys {
                var inserted = false
                for try await _ in try await connection.query("""
                    INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen)
                    VALUES (\(issuer), \(key.keyID), \(key.thumbprint), \(key.jwk), \(time), \(time))
                    ON CONFLICT (issuer, kid, thumbprint) DO NOTHING RETURNING kid
                    """, logger: self.logger).decode(String.self) {
                    inserted = true
                }
                if inserted {
                    // New to the archive: a record of the chain attests it, in the same transaction.
                    attest.append(AuditRecord(key: .init(issuer: issuer, keyID: key.keyID, thumbprint: key.thumbprint),
                                              firstSeen: time, recordedAt: Date().timeIntervalSince1970))
                } else {
                    try await connection.query("""
                        UPDATE signing_keys SET last_seen = greatest(last_seen, \(time))
                        WHERE issuer = \(issuer) AND kid = \(key.keyID) AND thumbprint = \(key.thumbprint)
                        """, logger: self.logger)
                }
            }
            try await self.append(attest, on: connection)
        }
    }

    public func archivedKeys() async throws(LedgerError) -> [ArchivedKey] {
        try await transaction("read archived keys") { connection in
            var keys: [ArchivedKey] = []
            for try await (issuer, kid, thumbprint, jwk, first, last) in try await connection.query(
                "SELECT issuer, kid, thumbprint, jwk, first_seen, last_seen FROM signing_keys ORDER BY issuer, kid, last_seen",
                logger: self.logger).decode((String, String, String, String, Double, Double).self) {
                keys.append(ArchivedKey(issuer: issuer, keyID: kid, thumbprint: thumbprint, jwk: jwk, firstSeen: first, lastSeen: last))
            }
            return keys
        }
    }

    public func auditRecords(afterSeq: Int64, limit: Int) async throws(LedgerError) -> [StoredAuditRecord] {
        try await transaction("read audit records") { connection in
            var records: [StoredAuditRecord] = []
            for try await (seq, record, previous, hash) in try await connection.query(
                "SELECT seq, record, prev_hash, hash FROM audit_records WHERE seq > \(afterSeq) ORDER BY seq LIMIT \(limit)",
                logger: self.logger).decode((Int64, String, String, String).self) {
                records.append(StoredAuditRecord(seq: seq, record: record, previousHash: previous, hash: hash))
            }
            return records
        }
    }

    public func retentionCutoff() async throws(LedgerError) -> Double? {
        try await transaction("read the retention cutoff") { connection in
            var cutoff: Double? = nil
            for try await value in try await connection.query("SELECT pruned_before FROM audit_start WHERE id = 1", logger: self.logger)
                .decode(Double?.self) { cutoff = value }
            return cutoff
        }
    }

    public func auditHead() async throws(LedgerError) -> (seq: Int64, hash: String) {
        try await transaction("read the audit head") { connection in
            var head: (Int64, String) = (-1, "the head is missing")
            for try await row in try await connection.query("SELECT seq, hash FROM audit_head WHERE id = 1", logger: self.logger)
                .decode((Int64, String).self) { head = row }
            return head
        }
    }

    public func eventStates(_ keys: [EventKey]) async throws(LedgerError) -> [EventKey: EventState] {
        try await transaction("read event states") { connection in
            var found: [(Int64, String, String, String, String, String, Double)] = []
            let issuers = keys.map(\.issuer), jtis = keys.map(\.jti)
            for try await row in try await connection.query("""
                SELECT id, issuer, jti, token, outcome, source, received_at FROM events
                WHERE (issuer, jti) IN (SELECT * FROM unnest(\(issuers)::text[], \(jtis)::text[]))
                """, logger: self.logger).decode((Int64, String, String, String, String, String, Double).self) { found.append(row) }
            guard !found.isEmpty else { return [:] }
            var steps: [Int64: [OutboxStep]] = [:]
            let ids = found.map(\.0)
            for try await (eventID, idx, kind, action, status, detail) in try await connection.query(
                "SELECT event_id, idx, kind, action, status, detail FROM steps WHERE event_id = ANY(\(ids)) ORDER BY event_id, idx",
                logger: self.logger).decode((Int64, Int, String, String, String, String?).self) {
                steps[eventID, default: []].append(OutboxStep(index: idx, kind: kind, action: action,
                                                              status: StepStatus(rawValue: status) ?? .pending, detail: detail))
            }
            var states: [EventKey: EventState] = [:]
            for (id, issuer, jti, token, outcome, source, receivedAt) in found {
                states[EventKey(issuer: issuer, jti: jti)] = EventState(
                    id: id, tokenSHA256: AuditChain.sha256Hex(Array(token.utf8)), outcome: EventOutcome(rawValue: outcome) ?? .claimed,
                    source: source, receivedAt: receivedAt, steps: steps[id] ?? [])
            }
            return states
        }
    }

    public func laterEvent(issuer: String, subject: String, issuedAfter issuedAt: Double) async throws(LedgerError) -> Int64? {
        try await transaction("read later events") { connection in
            for try await id in try await connection.query("""
                SELECT id FROM events WHERE issuer = \(issuer) AND subject = \(subject) AND issued_at > \(issuedAt) ORDER BY issued_at LIMIT 1
                """, logger: self.logger).decode(Int64.self) { return id }
            return nil
        }
    }

    public func rejectedDigests(_ digests: [String]) async throws(LedgerError) -> Set<String> {
        try await transaction("read rejections") { connection in
            var found = Set<String>()
            for try await digest in try await connection.query(
                "SELECT DISTINCT token_sha256 FROM deliveries WHERE token_sha256 = ANY(\(digests))", logger: self.logger)
                .decode(String.self) { found.insert(digest) }
            return found
        }
    }

    public func events(sourcePrefix: String, receivedFrom from: Double, to: Double, afterID: Int64, limit: Int) async throws(LedgerError)
        -> [EventSummary]
    {
        try await transaction("read events") { connection in
            var events: [EventSummary] = []
            for try await (id, issuer, jti, types, outcome, receivedAt, source) in try await connection.query("""
                SELECT id, issuer, jti, event_types, outcome, received_at, source FROM events
                WHERE id > \(afterID) AND starts_with(source, \(sourcePrefix))
                  AND received_at >= \(from) AND received_at < \(to)
                ORDER BY id LIMIT \(limit)
                """, logger: self.logger).decode((Int64, String, String, String, String, Double, String).self) {
                events.append(EventSummary(id: id, issuer: issuer, jti: jti,
                                           eventTypes: (try? JSONParser.parse(types))?.arrayValue?.compactMap(\.stringValue) ?? [],
                                           outcome: EventOutcome(rawValue: outcome) ?? .claimed, receivedAt: receivedAt, source: source))
            }
            return events
        }
    }

    public func reopenFailedSteps(ofEvent eventID: Int64, reason: String) async throws(LedgerError) -> Int {
        try await transaction("reopen failed steps") { connection in
            let now = Date().timeIntervalSince1970
            var reopened = 0
            for try await _ in try await connection.query("""
                UPDATE steps SET status = 'pending', updated_at = \(now) WHERE event_id = \(eventID) AND status = 'failed' RETURNING idx
                """, logger: self.logger).decode(Int.self) { reopened += 1 }
            guard reopened > 0 else { return 0 }
            try await connection.query("UPDATE events SET outcome = 'pending', updated_at = \(now) WHERE id = \(eventID)", logger: self.logger)
            try await self.append([try await self.outcomeRecord(ofEvent: eventID, outcome: .pending, at: now, on: connection,
                                                                kind: .reopened, note: reason)], on: connection)
            return reopened
        }
    }
}

extension PostgresLedger {
    public func auditStart() async throws(LedgerError) -> (seq: Int64, hash: String) {
        try await transaction("read the audit start") { connection in
            for try await (seq, hash) in try await connection.query("SELECT seq, hash FROM audit_start WHERE id = 1", logger: self.logger)
                .decode((Int64, String).self) { return (seq, hash) }
            return (0, AuditChain.genesis)
        }
    }

    public func prune(before cutoff: Double, limit: Int, afterEventID: Int64) async throws(LedgerError) -> PruneResult {
        try await transaction("prune") { connection in
            let now = Date().timeIntervalSince1970
            // One pruner at a time across replicas: the start's row stays locked until commit.
            var start: Int64 = 0, startHash = AuditChain.genesis, previousCutoff: Double? = nil
            for try await (seq, hash, pruned) in try await connection.query(
                "SELECT seq, hash, pruned_before FROM audit_start WHERE id = 1 FOR UPDATE", logger: self.logger
            ).decode((Int64, String, Double?).self) { (start, startHash, previousCutoff) = (seq, hash, pruned) }
            var candidates: [Int64] = [], last = afterEventID, reachedCutoff = false, looked = 0
            for try await (id, received, outcome) in try await connection.query("""
                SELECT id, received_at, outcome FROM events WHERE id > \(afterEventID) ORDER BY id LIMIT \(limit)
                """, logger: self.logger).decode((Int64, Double, String).self) {
                looked += 1
                if reachedCutoff { continue }
                if received >= cutoff {
                    reachedCutoff = true
                    continue
                }
                last = id
                if outcome != EventOutcome.pending.rawValue { candidates.append(id) }
            }
            var unfinished = Set<Int64>()
            if !candidates.isEmpty {
                for try await id in try await connection.query("""
                    SELECT DISTINCT event_id FROM steps WHERE status = 'pending' AND event_id = ANY(\(candidates))
                    """, logger: self.logger).decode(Int64.self) { unfinished.insert(id) }
            }
            let dropped = candidates.filter { !unfinished.contains($0) }
            if !dropped.isEmpty {
                try await connection.query("DELETE FROM steps WHERE event_id = ANY(\(dropped))", logger: self.logger)
                try await connection.query("DELETE FROM deliveries WHERE event_id = ANY(\(dropped))", logger: self.logger)
                try await connection.query("DELETE FROM events WHERE id = ANY(\(dropped))", logger: self.logger)
            }
            var rejections = 0
            for try await _ in try await connection.query("""
                DELETE FROM deliveries WHERE id IN
                    (SELECT id FROM deliveries WHERE event_id IS NULL AND received_at < \(cutoff) ORDER BY id LIMIT \(limit))
                RETURNING id
                """, logger: self.logger).decode(Int64.self) { rejections += 1 }
            var records: [StoredAuditRecord] = []
            for try await (seq, record, previous, hash) in try await connection.query("""
                SELECT seq, record, prev_hash, hash FROM audit_records WHERE seq > \(start) ORDER BY seq LIMIT \(limit)
                """, logger: self.logger).decode((Int64, String, String, String).self) {
                records.append(StoredAuditRecord(seq: seq, record: record, previousHash: previous, hash: hash))
            }
            let droppable = Retention.droppable(records, before: cutoff, limit: limit, startHash: startHash)
            var kept = (seq: start, hash: startHash)
            if droppable > 0 {
                let through = records[droppable - 1]
                try await connection.query("DELETE FROM audit_records WHERE seq <= \(through.seq)", logger: self.logger)
                try await connection.query("UPDATE audit_start SET seq = \(through.seq), hash = \(through.hash) WHERE id = 1",
                                           logger: self.logger)
                kept = (through.seq, through.hash)
            }
            if let cut = Retention.cut(start: kept, droppedRecords: droppable, events: dropped.count, rejections: rejections,
                                       cutoff: cutoff, previousCutoff: previousCutoff, at: now) {
                try await connection.query("UPDATE audit_start SET pruned_before = \(cut.prunedBefore) WHERE id = 1", logger: self.logger)
                var archived = Set<ArchivedKey.Reference>()
                for try await (issuer, kid, thumbprint) in try await connection.query(
                    "SELECT issuer, kid, thumbprint FROM signing_keys", logger: self.logger).decode((String, String, String).self) {
                    archived.insert(ArchivedKey.Reference(issuer: issuer, keyID: kid, thumbprint: thumbprint))
                }
                try await self.append([cut.checkpoint] + Retention.carriedKeys(records.prefix(droppable), archived: archived, at: now),
                                      on: connection)
            }
            let more = (looked == limit && !reachedCutoff) || rejections == limit || droppable == limit
            return PruneResult(events: dropped.count, rejections: rejections, auditRecords: droppable, lastEventID: last, more: more)
        }
    }
}
