public import DatabaseLocations
import Foundation
public import Logging
import PostgresNIO

/// The ledger in PostgreSQL, shared by every replica: the unique (issuer, jti) constraint is the
/// one place a claim is decided, and the outbox is seen by all. Each write is one transaction;
/// migrations take an advisory lock, so replicas starting together migrate once.
///
/// Its connection pool runs in `run()`, a service of the process's service group (it ends when
/// the group shuts down, after the services that use it); `open()` migrates once it runs.
public final class PostgresLedger: AuditingLedger {
    /// Where the database is: `postgres://user[:password]@host[:port]/database`.
    public typealias Location = PostgresLocation

    public let location: Location
    private let client: PostgresClient
    let logger: Logger
    /// This process's clock. Leases are set and compared on the server's clock (replicas on
    /// several hosts share the ledger, and their clocks differ); this one only turns a lease's
    /// end, as the caller gives it, into a length of time from now.
    let clock: @Sendable () -> Double

    /// Makes the connection pool; nothing connects until `run()`.
    public convenience init(_ location: Location, logger: Logger) {
        self.init(location, logger: logger, clock: { Date().timeIntervalSince1970 })
    }

    init(_ location: Location, logger: Logger, clock: @escaping @Sendable () -> Double) {
        self.location = location
        self.logger = logger
        self.clock = clock
        self.client = location.makeClient(maximumConnections: 8, logger: logger)
    }

    /// The server's time, seconds since 1970, in SQL.
    static let serverNow = "extract(epoch from clock_timestamp())::double precision"

    /// Runs the connection pool until the task is cancelled or the service group shuts down.
    /// Every query waits for it.
    public func run() async {
        await client.run()
    }

    /// Migrates, retrying for a while when the server is not up yet; `run()` must be running.
    /// A failure that waiting will not mend (TLS refused, login refused) ends it at once, in the
    /// words of a direct connection rather than the pool's.
    public func open() async throws(LedgerError) {
        var attempt = 0
        while true {
            do {
                // One direct connection first: the pool only says why after a minute.
                try await location.probe(logger: logger)
                try await migrate()
                return
            } catch {
                attempt += 1
                // Stopped (the process shuts down while the server does not answer): no more tries.
                if Task.isCancelled { throw LedgerError(.unavailable, "opening the PostgreSQL ledger at \(location) was stopped: \(Self.describe(error))") }
                if attempt >= 20 || PostgresLocation.isPermanentConnectionFailure(error) {
                    throw LedgerError(.unavailable, "cannot open the PostgreSQL ledger at \(location): \(Self.describe(error))")
                }
                try? await Task.sleep(for: .milliseconds(250))
            }
        }
    }

    /// Versioned migrations, each once, in order, under an advisory lock.
    static let migrations: [(String, [String])] = [
        ("v1-events", [
            """
            CREATE TABLE events (
                id BIGSERIAL PRIMARY KEY,
                issuer TEXT NOT NULL,
                jti TEXT NOT NULL,
                token TEXT NOT NULL,
                source TEXT NOT NULL,
                event_types TEXT NOT NULL,
                subject TEXT,
                key_id TEXT NOT NULL,
                algorithm TEXT NOT NULL,
                key_thumbprint TEXT NOT NULL,
                issued_at DOUBLE PRECISION NOT NULL,
                received_at DOUBLE PRECISION NOT NULL,
                outcome TEXT NOT NULL,
                steps TEXT NOT NULL DEFAULT '[]',
                updated_at DOUBLE PRECISION NOT NULL,
                UNIQUE (issuer, jti)
            )
            """,
            """
            CREATE TABLE deliveries (
                id BIGSERIAL PRIMARY KEY,
                event_id BIGINT REFERENCES events(id),
                source TEXT NOT NULL,
                received_at DOUBLE PRECISION NOT NULL,
                verdict TEXT NOT NULL CHECK (verdict IN ('duplicate', 'invalid')),
                error_code TEXT,
                error_description TEXT,
                token BYTEA
            )
            """,
            "CREATE INDEX deliveries_event ON deliveries(event_id)",
        ]),
        ("v2-outbox", [
            """
            CREATE TABLE steps (
                event_id BIGINT NOT NULL REFERENCES events(id),
                idx INTEGER NOT NULL,
                kind TEXT NOT NULL,
                action TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed')),
                detail TEXT,
                updated_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (event_id, idx)
            )
            """,
        ]),
        ("v3-lease", [
            "ALTER TABLE events ADD COLUMN lease_owner TEXT",
            "ALTER TABLE events ADD COLUMN lease_until DOUBLE PRECISION",
        ]),
        ("v4-verifications", [
            """
            CREATE TABLE verifications (
                issuer TEXT NOT NULL,
                state TEXT NOT NULL,
                requested_at DOUBLE PRECISION NOT NULL,
                arrived_at DOUBLE PRECISION,
                PRIMARY KEY (issuer, state)
            )
            """,
            "CREATE TABLE streams (issuer TEXT PRIMARY KEY, stream_id TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL)",
            // The pending steps, found without reading the others (the resume at start-up).
            "CREATE INDEX steps_pending ON steps(event_id) WHERE status = 'pending'",
        ]),
        // The audit trail (see the SQLite ledger's v6-audit). Replicas append to one chain: the
        // head's row is locked from the append to the commit, so the chain's order is the order
        // of commits.
        ("v5-audit", [
            "CREATE TABLE audit_records (seq BIGINT PRIMARY KEY, record TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL)",
            "CREATE TABLE audit_head (id INTEGER PRIMARY KEY CHECK (id = 1), seq BIGINT NOT NULL, hash TEXT NOT NULL)",
            "INSERT INTO audit_head (id, seq, hash) VALUES (1, 0, '\(AuditChain.genesis)')",
            """
            CREATE TABLE signing_keys (
                issuer TEXT NOT NULL,
                kid TEXT NOT NULL,
                thumbprint TEXT NOT NULL,
                jwk TEXT NOT NULL,
                first_seen DOUBLE PRECISION NOT NULL,
                last_seen DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (issuer, kid, thumbprint)
            )
            """,
            "ALTER TABLE steps ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE deliveries ADD COLUMN token_sha256 TEXT",
            "CREATE INDEX deliveries_rejected ON deliveries(token_sha256) WHERE token_sha256 IS NOT NULL",
        ]),
        // Retention: where the kept audit chain starts once older records are dropped.
        ("v6-retention", [
            "CREATE TABLE audit_start (id INTEGER PRIMARY KEY CHECK (id = 1), seq BIGINT NOT NULL, hash TEXT NOT NULL)",
            "INSERT INTO audit_start (id, seq, hash) VALUES (1, 0, '\(AuditChain.genesis)')",
        ]),
        // Retention: the latest cutoff events or rejections were dropped before, so that replay
        // does not take an event it dropped for one never processed.
        ("v7-retention-cutoff", ["ALTER TABLE audit_start ADD COLUMN pruned_before DOUBLE PRECISION"]),
    ]

    private func migrate() async throws {
        try await client.withTransaction(logger: logger) { connection in
            // One migrating replica at a time; the others find the work done.
            try await connection.query("SELECT pg_advisory_xact_lock(7402117)", logger: logger)
            try await connection.query("CREATE TABLE IF NOT EXISTS warden_migrations (name TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)",
                                       logger: logger)
            var applied = Set<String>()
            for try await name in try await connection.query("SELECT name FROM warden_migrations", logger: logger).decode(String.self) {
                applied.insert(name)
            }
            for (name, statements) in Self.migrations where !applied.contains(name) {
                for statement in statements { try await connection.query(PostgresQuery(unsafeSQL: statement), logger: logger) }
                let now = Date().timeIntervalSince1970
                try await connection.query("INSERT INTO warden_migrations (name, applied_at) VALUES (\(name), \(now))", logger: logger)
            }
            // Keys archived before each new key was attested by a record of the audit chain:
            // attested now, as the archive holds them (see the SQLite ledger's v10-key-records).
            let keyRecords = "v8-key-records"
            if !applied.contains(keyRecords) {
                // A chain that already holds key records was written by a version that attests
                // each key: the mark removed by hand must not get keys added since attested.
                var attested = false
                for try await _ in try await connection.query(
                    #"SELECT 1 FROM audit_records WHERE record LIKE '%"kind":"key"%' LIMIT 1"#, logger: logger).decode(Int.self) {
                    attested = true
                }
                let now = Date().timeIntervalSince1970
                if !attested {
                    var attest: [AuditRecord] = []
                    for try await (issuer, kid, thumbprint, firstSeen) in try await connection.query(
                        "SELECT issuer, kid, thumbprint, first_seen FROM signing_keys ORDER BY issuer, kid, thumbprint", logger: logger)
                        .decode((String, String, String, Double).self) {
                        attest.append(AuditRecord(key: .init(issuer: issuer, keyID: kid, thumbprint: thumbprint), firstSeen: firstSeen,
                                                  recordedAt: now))
                    }
                    try await append(attest, on: connection)
                }
                try await connection.query("INSERT INTO warden_migrations (name, applied_at) VALUES (\(keyRecords), \(now))", logger: logger)
            }
        }
    }

    // MARK: - Writes

    public func claim(_ event: LedgerEvent, outcome: EventOutcome, steps: [OutboxStep]) async throws(LedgerError) -> Claim {
        try await record([.event(event, outcome: outcome, steps: steps)])[0]!
    }

    public func record(_ entries: [LedgerEntry]) async throws(LedgerError) -> [Claim?] {
        try await transaction("record") { connection in
            var claims: [Claim?] = []
            var audit: [AuditRecord] = []
            let now = Date().timeIntervalSince1970
            for entry in entries {
                switch entry {
                case .event(let event, let outcome, let steps):
                    let claim = try await self.claim(event, outcome: outcome, steps: steps, on: connection)
                    if let record = AuditRecord.ofClaim(claim, event, outcome: outcome, hasSteps: !steps.isEmpty, at: now) {
                        audit.append(record)
                    }
                    claims.append(claim)
                case .rejection(let rejection):
                    try await self.insert(rejection, on: connection)
                    audit.append(AuditRecord(rejection: rejection, recordedAt: now))
                    claims.append(nil)
                }
            }
            try await self.append(audit, on: connection)
            return claims
        }
    }

    private func claim(_ e: LedgerEvent, outcome: EventOutcome, steps: [OutboxStep], on connection: PostgresConnection) async throws
        -> Claim
    {
        let types = jsonArray(e.eventTypes), kinds = jsonArray(steps.map(\.kind))
        // The lease as a length of time, ended on the server's clock.
        let leaseLeft = e.leaseUntil.map { $0 - clock() }
        let inserted = try await connection.query("""
            INSERT INTO events (issuer, jti, token, source, event_types, subject, key_id, algorithm, key_thumbprint,
                                issued_at, received_at, outcome, steps, updated_at, lease_owner, lease_until)
            VALUES (\(e.issuer), \(e.jti), \(e.token), \(e.source), \(types), \(e.subject), \(e.keyID), \(e.algorithm),
                    \(e.keyThumbprint), \(e.issuedAt), \(e.receivedAt), \(outcome.rawValue), \(kinds), \(e.receivedAt),
                    \(e.leaseOwner), \(leaseLeft)::double precision + \(unescaped: Self.serverNow))
            ON CONFLICT (issuer, jti) DO NOTHING
            RETURNING id
            """, logger: logger)
        var newID: Int64? = nil
        for try await id in inserted.decode(Int64.self) { newID = id }
        if let id = newID {
            for step in steps {
                try await connection.query("""
                    INSERT INTO steps (event_id, idx, kind, action, status, detail, updated_at)
                    VALUES (\(id), \(step.index), \(step.kind), \(step.action), \(step.status.rawValue), \(step.detail), \(e.receivedAt))
                    """, logger: logger)
            }
            return .new(eventID: id)
        }
        var existing: Int64? = nil
        for try await id in try await connection.query("SELECT id FROM events WHERE issuer = \(e.issuer) AND jti = \(e.jti)",
                                                       logger: logger).decode(Int64.self) {
            existing = id
        }
        guard let id = existing else { throw LedgerError(.conflict, "the event \(e.jti.prefix(64).debugDescription) vanished during its claim") }
        try await connection.query("""
            INSERT INTO deliveries (event_id, source, received_at, verdict) VALUES (\(id), \(e.source), \(e.receivedAt), 'duplicate')
            """, logger: logger)
        return .duplicate(eventID: id)
    }

    private func insert(_ r: Rejection, on connection: PostgresConnection) async throws {
        let token = ByteBuffer(bytes: r.token.prefix(Retention.keptRejectedBytes))
        try await connection.query("""
            INSERT INTO deliveries (event_id, source, received_at, verdict, error_code, error_description, token, token_sha256)
            VALUES (NULL, \(r.source), \(r.receivedAt), 'invalid', \(r.code), \(storable(r.description)), \(token),
                    \(AuditChain.sha256Hex(r.token)))
            """, logger: logger)
    }

    public func recordRejection(_ rejection: Rejection) async throws(LedgerError) {
        _ = try await record([.rejection(rejection)])
    }

    public func record(outcome: EventOutcome, forEvent eventID: Int64) async throws(LedgerError) {
        try await transaction("record outcome") { connection in
            let now = Date().timeIntervalSince1970
            var found = false
            for try await _ in try await connection.query(
                "UPDATE events SET outcome = \(outcome.rawValue), updated_at = \(now) WHERE id = \(eventID) RETURNING id",
                logger: self.logger).decode(Int64.self) { found = true }
            guard found else { throw LedgerError(.conflict, "no event with id \(eventID) in the ledger") }
            if outcome.isFinal {
                try await self.append([try await self.outcomeRecord(ofEvent: eventID, outcome: outcome, at: now, on: connection)],
                                      on: connection)
            }
        }
    }

    public func recordSteps(_ records: [RecordedStep]) async throws(LedgerError) -> RecordedSteps {
        // Durable when the commit's answer arrives, just before this task runs again.
        RecordedSteps(refusals: try await recordStepsInOneTransaction(records))
    }

    private func recordStepsInOneTransaction(_ records: [RecordedStep]) async throws(LedgerError) -> [LedgerError?] {
        try await transaction("record steps") { connection in
            let now = Date().timeIntervalSince1970
            var refusals: [LedgerError?] = []
            refusals.reserveCapacity(records.count)
            var audit: [AuditRecord] = []
            for record in records {
                var found = false
                for try await _ in try await connection.query("""
                    UPDATE steps SET status = \(record.status.rawValue), detail = \(storable(record.detail)), updated_at = \(now),
                                     attempts = attempts + \(record.attempts)
                    WHERE event_id = \(record.eventID) AND idx = \(record.index) AND status = 'pending' RETURNING idx
                    """, logger: self.logger).decode(Int.self) { found = true }
                guard found else {
                    // Only a pending step is recorded: one recorded already (by another owner of the
                    // event, after a rebalance) keeps its outcome.
                    var recorded: String? = nil
                    for try await status in try await connection.query(
                        "SELECT status FROM steps WHERE event_id = \(record.eventID) AND idx = \(record.index)",
                        logger: self.logger).decode(String.self) {
                        recorded = status
                    }
                    refusals.append(LedgerError(.conflict, recorded.map { "step \(record.index) of event \(record.eventID) is already recorded \($0)" }
                                                ?? "event \(record.eventID) has no step \(record.index) in the ledger"))
                    continue
                }
                if let finishing = record.finishing {
                    try await connection.query(
                        "UPDATE events SET outcome = \(finishing.rawValue), updated_at = \(now) WHERE id = \(record.eventID)",
                        logger: self.logger)
                    audit.append(try await self.outcomeRecord(ofEvent: record.eventID, outcome: finishing, at: now, on: connection))
                }
                refusals.append(nil)
            }
            try await self.append(audit, on: connection)
            return refusals
        }
    }

    // MARK: - Reads

    public func steps(ofEvent eventID: Int64) async throws(LedgerError) -> [OutboxStep] {
        try await transaction("read steps") { connection in
            var steps: [OutboxStep] = []
            let rows = try await connection.query(
                "SELECT idx, kind, action, status, detail FROM steps WHERE event_id = \(eventID) ORDER BY idx", logger: self.logger)
            for try await (idx, kind, action, status, detail) in rows.decode((Int, String, String, String, String?).self) {
                steps.append(OutboxStep(index: idx, kind: kind, action: action, status: StepStatus(rawValue: status) ?? .pending,
                                        detail: detail))
            }
            return steps
        }
    }

    public func lease(event eventID: Int64, owner: String, seconds: Double) async throws(LedgerError) -> Bool {
        try await transaction("lease") { connection in
            var granted = false
            // On the server's clock: a replica whose clock runs ahead must not find a live lease run out.
            for try await _ in try await connection.query("""
                UPDATE events SET lease_owner = \(owner), lease_until = \(unescaped: Self.serverNow) + \(seconds)
                WHERE id = \(eventID) AND (lease_owner IS NULL OR lease_owner = \(owner) OR lease_until < \(unescaped: Self.serverNow))
                RETURNING id
                """, logger: self.logger).decode(Int64.self) { granted = true }
            return granted
        }
    }

    public func pendingEvents(receivedBefore: Double, afterID: Int64, limit: Int, unleasedAt: Double?) async throws(LedgerError)
        -> [PendingEvent]
    {
        // The time asked about, as seconds from now on the server's clock.
        let unleasedAfter = unleasedAt.map { $0 - clock() }
        return try await transaction("read pending events") { connection in
            var events: [PendingEvent] = []
            let rows = try await connection.query("""
                SELECT id, token, source, received_at FROM events
                WHERE id IN (SELECT event_id FROM steps WHERE status = 'pending') AND id > \(afterID) AND received_at < \(receivedBefore)
                  AND (\(unleasedAfter)::double precision IS NULL OR lease_until IS NULL
                       OR lease_until < \(unleasedAfter)::double precision + \(unescaped: Self.serverNow))
                ORDER BY id LIMIT \(limit)
                """, logger: self.logger)
            for try await (id, token, source, receivedAt) in rows.decode((Int64, String, String, Double).self) {
                events.append(PendingEvent(id: id, token: Array(token.utf8), source: source, receivedAt: receivedAt))
            }
            return events
        }
    }

    public func requestVerification(issuer: String, state: String, at time: Double) async throws(LedgerError) {
        _ = try await transaction("request verification") { connection in
            try await connection.query("""
                INSERT INTO verifications (issuer, state, requested_at) VALUES (\(storable(issuer)), \(storable(state)), \(time))
                ON CONFLICT DO NOTHING
                """, logger: self.logger)
        }
    }

    public func verificationArrived(issuer: String, state: String, at time: Double) async throws(LedgerError) -> Bool {
        try await transaction("verification arrived") { connection in
            var matched = false
            for try await _ in try await connection.query("""
                UPDATE verifications SET arrived_at = coalesce(arrived_at, \(time))
                WHERE issuer = \(storable(issuer)) AND state = \(storable(state)) RETURNING state
                """, logger: self.logger).decode(String.self) { matched = true }
            return matched
        }
    }

    public func verificationArrival(issuer: String, state: String) async throws(LedgerError) -> Double? {
        try await transaction("read verification") { connection in
            var arrived: Double? = nil
            for try await value in try await connection.query("""
                SELECT arrived_at FROM verifications WHERE issuer = \(storable(issuer)) AND state = \(storable(state))
                """, logger: self.logger).decode(Double?.self) { arrived = value }
            return arrived
        }
    }

    public func streamID(issuer: String) async throws(LedgerError) -> String? {
        try await transaction("read the stream id") { connection in
            var id: String? = nil
            for try await value in try await connection.query("SELECT stream_id FROM streams WHERE issuer = \(storable(issuer))",
                                                              logger: self.logger).decode(String.self) { id = value }
            return id
        }
    }

    public func keepStreamID(_ id: String?, issuer: String) async throws(LedgerError) {
        _ = try await transaction("keep the stream id") { connection in
            if let id {
                try await connection.query("""
                    INSERT INTO streams (issuer, stream_id, updated_at) VALUES (\(storable(issuer)), \(storable(id)), \(Date().timeIntervalSince1970))
                    ON CONFLICT (issuer) DO UPDATE SET stream_id = excluded.stream_id, updated_at = excluded.updated_at
                    """, logger: self.logger)
            } else {
                try await connection.query("DELETE FROM streams WHERE issuer = \(storable(issuer))", logger: self.logger)
            }
        }
    }

    public func events() async throws(LedgerError) -> [StoredEvent] {
        try await transaction("read events") { connection in
            var events: [StoredEvent] = []
            let rows = try await connection.query(
                "SELECT id, issuer, jti, token, source, event_types, outcome, steps FROM events ORDER BY id", logger: self.logger)
            for try await (id, issuer, jti, token, source, types, outcome, steps)
                in rows.decode((Int64, String, String, String, String, String, String, String).self) {
                events.append(StoredEvent(id: id, issuer: issuer, jti: jti, token: token, source: source, eventTypes: types,
                                          outcome: outcome, steps: steps))
            }
            return events
        }
    }

    public func deliveries() async throws(LedgerError) -> [StoredDelivery] {
        try await transaction("read deliveries") { connection in
            var deliveries: [StoredDelivery] = []
            let rows = try await connection.query(
                "SELECT id, event_id, source, verdict, error_code, error_description FROM deliveries ORDER BY id", logger: self.logger)
            for try await (id, eventID, source, verdict, code, description) in rows.decode((Int64, Int64?, String, String, String?, String?).self) {
                deliveries.append(StoredDelivery(id: id, eventID: eventID, source: source, verdict: verdict, errorCode: code,
                                                 errorDescription: description))
            }
            return deliveries
        }
    }

    /// A server that answers but takes no writes (a standby after a failover, a database set
    /// `default_transaction_read_only`) is not: every claim would fail there.
    public func isReachable() async -> Bool {
        let readOnly = try? await transaction("ping") { connection in
            var readOnly = true
            for try await flag in try await connection.query(
                "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'", logger: self.logger).decode(Bool.self) {
                readOnly = flag
            }
            return readOnly
        }
        return readOnly == false
    }

    /// Nothing to finish: every write is its own transaction. The pool closes when `run()` ends.
    public func close() async {}

    func transaction<T: Sendable>(_ what: String, _ body: (PostgresConnection) async throws -> T) async throws(LedgerError) -> T {
        do {
            return try await client.withTransaction(logger: logger) { connection in try await body(connection) }
        } catch {
            // What failed inside the transaction (the body, or BEGIN/COMMIT), never the wrapper:
            // its description holds the query with its values.
            let cause = Self.cause(of: error)
            if let ledgerError = cause as? LedgerError { throw ledgerError }
            throw LedgerError(Self.kind(of: cause), "PostgreSQL ledger (\(what)): \(Self.describe(cause))")
        }
    }

    /// What failed inside a transaction (its body, or BEGIN or COMMIT), rather than the wrapper.
    static func cause(of error: any Error) -> any Error {
        guard let wrapped = error as? PostgresTransactionError else { return error }
        return wrapped.closureError ?? wrapped.beginError ?? wrapped.commitError ?? wrapped.rollbackError ?? error
    }

    /// Whether a PostgreSQL failure can pass: a data exception (class 22: a value the column
    /// cannot hold) or an integrity violation (class 23) will fail the same way again.
    static func kind(of error: any Error) -> LedgerError.Kind {
        guard let error = cause(of: error) as? PSQLError, let state = error.serverInfo?[.sqlState] else { return .unavailable }
        return state.hasPrefix("22") || state.hasPrefix("23") ? .refused : .unavailable
    }

    /// What went wrong, in the server's words, without the query or its values (a token may be
    /// among them).
    static func describe(_ error: any Error) -> String {
        let error = cause(of: error)
        if error is PostgresTransactionError { return "the transaction failed" }
        guard let error = error as? PSQLError else { return "\(error)" }
        var text = "\(error.code)"
        if let message = error.serverInfo?[.message] { text += ": " + message }
        if let underlying = error.underlying { text += " (\(underlying))" }
        return text
    }
}

/// A free text (an error's description, a step's detail) as PostgreSQL's `text` can hold it:
/// U+0000, which it refuses, becomes U+FFFD. Identifiers are never changed so: the verifier
/// refuses a `jti` or `kid` holding U+0000, and subjects are stored as escaped JSON.
func storable(_ text: String) -> String {
    guard text.utf8.contains(0) else { return text }
    return String(text.unicodeScalars.map { $0 == "\u{0}" ? "\u{FFFD}" : Character($0) })
}
