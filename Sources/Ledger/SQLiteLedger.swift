import Foundation
internal import GRDB
internal import GRDBSQLite
internal import CWardenFiles
import Synchronization

/// The ledger in one SQLite file, in WAL mode. No caller is told a write is done before it is
/// synced to the disk, so a recorded outcome survives a crash of the process or the machine.
///
/// Writes from many concurrent callers are grouped: a writer thread takes whatever is queued
/// and writes it in one transaction (if that transaction fails, each caller's write is tried
/// again in a transaction of its own). A second thread (`WALSyncer`) syncs the WAL and then
/// answers the callers of every transaction committed before that sync began. One sync then serves
/// several transactions, and the writer goes on to the next one while the disk syncs the last.
public final class SQLiteLedger: AuditingLedger {
    public let path: String
    private let database: DatabaseQueue
    let writer: BatchWriter
    /// The audit fields of events this ledger claimed with steps, until their outcome is recorded.
    let claimed = ClaimedEvents()
    let checkpointer: Checkpointer
    /// Reads for audits and replays, beside the writer (WAL: each sees what is committed).
    let reader: SQLiteLedgerReader
    /// The writer's WAL writes are gathered into one per commit (see `writerLocation`).
    let gathersWALWrites: Bool

    public convenience init(path: String) throws(LedgerError) {
        try self.init(path: path, syncWAL: { fdatasync($0) })
    }

    /// `syncWAL`: how the WAL's file descriptor is synced (tests watch it); 0 on success.
    /// `startWriteback`: how the checkpoints' pages are sent to the disk (tests watch it).
    /// `walRestartBytes`: the WAL's size from which the checkpoint thread has it start over,
    /// after syncing the database file with `syncDatabase` (0 on success).
    /// `writerCheckpointBytes`: the WAL's size from which the writer checkpoints by itself.
    init(path: String, syncWAL: @escaping @Sendable (Int32) -> Int32,
         startWriteback: @escaping @Sendable (Int32) -> Int32 = { warden_start_writeback($0) },
         walRestartBytes: Int = Checkpointer.restartBytes,
         syncDatabase: @escaping @Sendable (Int32) -> Int32 = { fdatasync($0) },
         writerCheckpointBytes: Int = WriterCheckpoint.bytes) throws(LedgerError) {
        self.path = path
        var writerCheckpoint: WriterCheckpoint? = nil
        var configuration = Configuration()
        configuration.busyMode = .timeout(10)
        configuration.prepareDatabase { db in
            // 4 KiB pages for a new ledger (an existing one keeps its own). Providers' jtis are
            // random, so once the ledger holds more (issuer, jti) index leaves than a write has
            // claims, every claim rewrites a leaf of its own: a whole page into the WAL, then
            // again into the database. With 16 KiB pages, a ledger holding a million events
            // wrote 33–34 KB per event recorded; with 4 KiB, 16 KB.
            try db.execute(sql: "PRAGMA page_size = 4096")
            // A 64 MiB page cache: the (issuer, jti) index is probed at a random leaf for every
            // event, and SQLite's default 2 MiB cache holds only the index of ~40,000 events;
            // past that, each claim read its leaf back from the file.
            try db.execute(sql: "PRAGMA cache_size = -65536")
            // Set here rather than by GRDB, which looks for the WAL at a path made from the name
            // it was given (here a URI, see `writerLocation`).
            guard try String.fetchOne(db, sql: "PRAGMA journal_mode = WAL") == "wal" else {
                throw DatabaseError(message: "could not put the ledger in WAL mode")
            }
        }
        // Several workers may open the same file at once: switching to WAL and migrating take
        // the write lock, and a migration another worker commits first makes ours fail. Both
        // are retried for a while; the retry finds the schema in place.
        var attempt = 0
        while true {
            do {
                let directory = URL(fileURLWithPath: path).deletingLastPathComponent().path
                try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
                let opened = try DatabaseQueue(path: Self.writerLocation(path), configuration: configuration)
                // Migrations commit synced (`FULL`).
                try opened.writeWithoutTransaction { try $0.execute(sql: "PRAGMA synchronous = FULL") }
                try Self.migrator.migrate(opened)
                // Then `NORMAL`: a commit writes the WAL without syncing it, and `WALSyncer` syncs
                // it before any caller is answered. SQLite still syncs the WAL before each
                // checkpoint, the database after it, and the WAL's header when it starts over.
                try opened.writeWithoutTransaction { try $0.execute(sql: "PRAGMA synchronous = NORMAL") }
                // The WAL is copied into the database by a thread of its own (`Checkpointer`),
                // while the writer goes on, and has the WAL start over at 128 MiB
                // (`Checkpointer.restart`). The writer still checkpoints by itself once the WAL
                // holds 256 MiB (a reader kept it from starting over), so that it starts over
                // then (`WriterCheckpoint`, in place of SQLite's autocheckpoint). The threshold is
                // counted in pages, of the size the file has once made (here, whichever process
                // made it).
                let pageSize = try opened.inDatabase { try Int.fetchOne($0, sql: "PRAGMA page_size") } ?? 4096
                let checkpoint = WriterCheckpoint(frames: max(1, writerCheckpointBytes / pageSize), path: path)
                opened.inDatabase { checkpoint.install(on: $0) }
                writerCheckpoint = checkpoint
                // The WAL is open once the migrations have read the schema. Linked only in the
                // normal locking mode, in which each transaction takes the WAL's write lock.
                gathersWALWrites = try opened.inDatabase { db in
                    try String.fetchOne(db, sql: "PRAGMA locking_mode") == "normal" && warden_wal_link(db.sqliteConnection) == 1
                }
                database = opened
                break
            } catch is DatabaseError where attempt < 100 {
                attempt += 1
                usleep(100_000)
            } catch {
                throw LedgerError(.unavailable, "cannot open the SQLite ledger at \(path): \(error)")
            }
        }
        // The WAL's descriptor first, then the reader, then the threads: a failure leaves none running.
        let syncer = try WALSyncer(walPath: path + "-wal", sync: syncWAL)
        reader = try SQLiteLedgerReader(path: path)
        checkpointer = try Checkpointer(path: path, startWriteback: startWriteback, syncDatabase: syncDatabase, restartBytes: walRestartBytes)
        writer = BatchWriter(database: database, syncer: syncer, keeping: writerCheckpoint!)
    }

    /// The writer's own checkpoint, once the WAL holds 256 MiB (kept by the writer, which commits).
    var writerCheckpoint: WriterCheckpoint { writer.walHook }

    /// Whether SQLite's page cache is the one that keeps the number SQLite lends a page during a
    /// swap of two pages' numbers out of its default cache (`CWardenFiles/page_cache.c`): false
    /// if SQLite was initialised before it could be installed (or has not been yet).
    public static var pageCacheInstalled: Bool {
        var counts = WardenPageCacheCounts()
        warden_page_cache_counts(0, &counts)
        return counts.installed == 1
    }

    /// Whether SQLite counts the memory it holds, taking a process-wide mutex at every
    /// allocation and free (`CWardenFiles/memory_count.c` turns the count off as the library
    /// loads): true if SQLite was initialised before that.
    public static var sqliteCountsMemory: Bool { warden_sqlite_counts_memory() != 0 }

    /// Where the writer's connection opens the ledger: through the VFS that gathers its WAL's
    /// writes (`CWardenFiles`), named in a URI, where this SQLite reads names as URIs; else the
    /// path itself. SQLite writes each WAL frame in two calls, its header and then its page;
    /// measured with `pwrite` into a file as SQLite's WAL fills it, 60 frames a commit, the two
    /// calls per frame took 2.6 µs of CPU per frame, one call per commit 0.7 µs.
    static func writerLocation(_ path: String) -> String {
        guard sqlite3_compileoption_used("USE_URI") == 1, warden_wal_vfs_register() == SQLITE_OK else { return path }
        // Every byte but unreserved ones and slashes escaped; an absolute path after an empty
        // authority ("file:///…"), so that one beginning "//" is not taken for one.
        guard let escaped = path.addingPercentEncoding(withAllowedCharacters: uriPathCharacters) else { return path }
        let uri = (path.hasPrefix("/") ? "file://" : "file:") + escaped
        return uri + "?vfs=" + WARDEN_WAL_VFS
    }

    private static let uriPathCharacters = CharacterSet(charactersIn: "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~/")

    /// What became of the writes SQLite made to the writer's WAL (tests).
    func walCounts() -> WardenWALCounts? {
        database.inDatabase { db in
            var counts = WardenWALCounts()
            return warden_wal_counts(db.sqliteConnection, &counts) == 1 ? counts : nil
        }
    }

    /// Tests: the writer's next `count` writes to its WAL fail (an I/O error), writing nothing.
    func failWALWrites(_ count: Int) {
        database.inDatabase { db in _ = warden_wal_fail_writes(db.sqliteConnection, Int32(count), SQLITE_IOERR | (3 << 8)) }
    }

    /// A read whose result leaves the process (an audit, a replay's comparison): returned once
    /// everything it may have seen is on the disk, by a sync of the WAL begun after it. Other
    /// processes sharing the file write the same WAL, so their commits are covered too.
    func durableRead<T>(_ body: (Database) throws -> T) async throws(LedgerError) -> T {
        let value = try reader.read(body)
        try await writer.sync()
        return value
    }

    /// Creates a ledger file with the schema as it was after `migration` (for tests of what a
    /// later version makes of an older ledger).
    static func create(path: String, upTo migration: String) throws {
        try FileManager.default.createDirectory(atPath: URL(fileURLWithPath: path).deletingLastPathComponent().path,
                                                withIntermediateDirectories: true)
        try migrator.migrate(DatabaseQueue(path: path), upTo: migration)
    }

    /// Claims `event` (no steps) inside a write already under way (for tests of the writer).
    static func claimForTesting(_ event: LedgerEvent, in db: Database) throws -> Claim {
        var writer = try EventWriter(db)
        return try writer.claim(event, outcome: .pending, steps: [])
    }

    /// Versioned schema migrations; each runs once, in order, in its own transaction.
    static var migrator: DatabaseMigrator {
        var migrator = DatabaseMigrator()
        migrator.registerMigration("v1-events") { db in
            try db.execute(sql: """
                CREATE TABLE events (
                    id INTEGER PRIMARY KEY,
                    issuer TEXT NOT NULL,
                    jti TEXT NOT NULL,
                    token TEXT NOT NULL,
                    source TEXT NOT NULL,
                    event_types TEXT NOT NULL,
                    subject TEXT,
                    key_id TEXT NOT NULL,
                    algorithm TEXT NOT NULL,
                    key_thumbprint TEXT NOT NULL,
                    issued_at REAL NOT NULL,
                    received_at REAL NOT NULL,
                    outcome TEXT NOT NULL,
                    steps TEXT NOT NULL DEFAULT '[]',
                    updated_at REAL NOT NULL,
                    UNIQUE (issuer, jti)
                );
                CREATE TABLE deliveries (
                    id INTEGER PRIMARY KEY,
                    event_id INTEGER REFERENCES events(id),
                    source TEXT NOT NULL,
                    received_at REAL NOT NULL,
                    verdict TEXT NOT NULL CHECK (verdict IN ('duplicate', 'invalid')),
                    error_code TEXT,
                    error_description TEXT,
                    token BLOB
                );
                CREATE INDEX deliveries_event ON deliveries(event_id);
                CREATE TABLE schema_info (name TEXT PRIMARY KEY, value TEXT NOT NULL);
                INSERT INTO schema_info VALUES ('format', 'warden-ledger');
                """)
        }
        migrator.registerMigration("v2-outbox") { db in
            try db.execute(sql: """
                CREATE TABLE steps (
                    event_id INTEGER NOT NULL REFERENCES events(id),
                    idx INTEGER NOT NULL,
                    kind TEXT NOT NULL,
                    action TEXT NOT NULL,
                    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed')),
                    detail TEXT,
                    updated_at REAL NOT NULL,
                    PRIMARY KEY (event_id, idx)
                ) WITHOUT ROWID;
                CREATE INDEX steps_pending ON steps(status) WHERE status = 'pending';
                """)
        }
        migrator.registerMigration("v3-lease") { db in
            try db.execute(sql: """
                ALTER TABLE events ADD COLUMN lease_owner TEXT;
                ALTER TABLE events ADD COLUMN lease_until REAL;
                """)
        }
        // An event's row is rewritten when its outcome is recorded; its token (over a kilobyte)
        // is written once, so it goes in a table of its own, appended in id order and never
        // rewritten. Events recorded before keep theirs in `events.token`; later ones have ''
        // there.
        migrator.registerMigration("v4-event-tokens") { db in
            try db.execute(sql: """
                CREATE TABLE event_tokens (
                    event_id INTEGER PRIMARY KEY REFERENCES events(id),
                    token TEXT NOT NULL
                );
                """)
        }
        // States of the verification events asked for, and when each arrived; the ids of the
        // streams made at transmitters.
        migrator.registerMigration("v5-verifications") { db in
            try db.execute(sql: """
                CREATE TABLE verifications (
                    issuer TEXT NOT NULL,
                    state TEXT NOT NULL,
                    requested_at REAL NOT NULL,
                    arrived_at REAL,
                    PRIMARY KEY (issuer, state)
                ) WITHOUT ROWID;
                CREATE TABLE streams (
                    issuer TEXT PRIMARY KEY,
                    stream_id TEXT NOT NULL,
                    updated_at REAL NOT NULL
                );
                """)
        }
        // The audit trail: hash-chained records of what became of each delivery, with the
        // chain's head beside them; every signing key fetched; each step's attempts; a digest of
        // each rejected message, to find it again.
        migrator.registerMigration("v6-audit") { db in
            try db.execute(sql: """
                CREATE TABLE audit_records (
                    seq INTEGER PRIMARY KEY,
                    record TEXT NOT NULL,
                    prev_hash TEXT NOT NULL,
                    hash TEXT NOT NULL
                );
                CREATE TABLE audit_head (
                    id INTEGER PRIMARY KEY CHECK (id = 1),
                    seq INTEGER NOT NULL,
                    hash TEXT NOT NULL
                );
                INSERT INTO audit_head (id, seq, hash) VALUES (1, 0, '\(AuditChain.genesis)');
                CREATE TABLE signing_keys (
                    issuer TEXT NOT NULL,
                    kid TEXT NOT NULL,
                    thumbprint TEXT NOT NULL,
                    jwk TEXT NOT NULL,
                    first_seen REAL NOT NULL,
                    last_seen REAL NOT NULL,
                    PRIMARY KEY (issuer, kid, thumbprint)
                ) WITHOUT ROWID;
                ALTER TABLE steps ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
                ALTER TABLE deliveries ADD COLUMN token_sha256 TEXT;
                CREATE INDEX deliveries_rejected ON deliveries(token_sha256) WHERE token_sha256 IS NOT NULL;
                """)
        }
        // Retention: where the kept audit chain starts once older records are dropped.
        migrator.registerMigration("v7-retention") { db in
            try db.execute(sql: """
                CREATE TABLE audit_start (
                    id INTEGER PRIMARY KEY CHECK (id = 1),
                    seq INTEGER NOT NULL,
                    hash TEXT NOT NULL
                );
                INSERT INTO audit_start (id, seq, hash) VALUES (1, 0, '\(AuditChain.genesis)');
                """)
        }
        // The steps' status check as comparisons: written `status IN (…)`, SQLite built a
        // temporary b-tree of the list for every row inserted or updated (in a ledger of 16 KiB
        // pages, as they then were, a page cache of its own each time). Each event keeps its
        // token's digest, so its audit record is made without reading the token back.
        migrator.registerMigration("v8-steps-check-token-digest") { db in
            try db.execute(sql: """
                CREATE TABLE steps_v8 (
                    event_id INTEGER NOT NULL REFERENCES events(id),
                    idx INTEGER NOT NULL,
                    kind TEXT NOT NULL,
                    action TEXT NOT NULL,
                    status TEXT NOT NULL CHECK (status = 'pending' OR status = 'done' OR status = 'failed'),
                    detail TEXT,
                    updated_at REAL NOT NULL,
                    attempts INTEGER NOT NULL DEFAULT 0,
                    PRIMARY KEY (event_id, idx)
                ) WITHOUT ROWID;
                INSERT INTO steps_v8 (event_id, idx, kind, action, status, detail, updated_at, attempts)
                    SELECT event_id, idx, kind, action, status, detail, updated_at, attempts FROM steps;
                DROP TABLE steps;
                ALTER TABLE steps_v8 RENAME TO steps;
                CREATE INDEX steps_pending ON steps(status) WHERE status = 'pending';
                ALTER TABLE events ADD COLUMN token_sha256 TEXT;
                """)
        }
        // Retention: the latest cutoff events or rejections were dropped before, so that replay
        // does not take an event it dropped for one never processed.
        migrator.registerMigration("v9-retention-cutoff") { db in
            try db.execute(sql: "ALTER TABLE audit_start ADD COLUMN pruned_before REAL")
        }
        // Keys archived before each new key was attested by a record of the audit chain: attested
        // now, as the archive holds them (what happened to it before cannot be told any more),
        // once.
        migrator.registerMigration("v10-key-records") { db in
            // A chain that already holds key records was written by a version that attests each
            // key: the migration's mark removed by hand must not get keys added since attested.
            guard try Bool.fetchOne(db, sql: #"SELECT EXISTS (SELECT 1 FROM audit_records WHERE record LIKE '%"kind":"key"%')"#) != true
            else { return }
            var audit = SQLiteAuditAppender()
            let now = Date().timeIntervalSince1970
            for row in try Row.fetchAll(db, sql: "SELECT issuer, kid, thumbprint, first_seen FROM signing_keys ORDER BY issuer, kid, thumbprint") {
                audit.append(AuditRecord(key: .init(issuer: lossyText(row, 0), keyID: lossyText(row, 1), thumbprint: lossyText(row, 2)),
                                         firstSeen: number(row, 3) ?? 0, recordedAt: now))
            }
            try audit.commit(in: db)
        }
        return migrator
    }

    public func claim(_ event: LedgerEvent, outcome: EventOutcome, steps: [OutboxStep]) async throws(LedgerError) -> Claim {
        let (claim, kept) = try await writer.submit { db in
            var writer = try EventWriter(db)
            let claim = try writer.claim(event, outcome: outcome, steps: steps)
            try writer.audit.commit(in: db)
            return (claim, writer.claimedWithSteps)
        }
        // Kept once committed: a write rolled back leaves nothing behind under its ids.
        kept.forEach(claimed.keep)
        return claim
    }

    /// In a transaction of its own: the caller sized the batch (the pipeline keeps its writes
    /// short while steps' outcomes wait for them).
    public func record(_ entries: [LedgerEntry]) async throws(LedgerError) -> [Claim?] {
        let (claims, kept) = try await writer.submit(alone: true) { db in
            var writer = try EventWriter(db)
            var claims: [Claim?] = []
            claims.reserveCapacity(entries.count)
            for entry in entries {
                switch entry {
                case .event(let event, let outcome, let steps): claims.append(try writer.claim(event, outcome: outcome, steps: steps))
                case .rejection(let rejection):
                    try Self.insert(rejection, in: db)
                    writer.audit.append(AuditRecord(rejection: rejection, recordedAt: writer.now))
                    claims.append(nil)
                }
            }
            try writer.audit.commit(in: db)
            return (claims, writer.claimedWithSteps)
        }
        kept.forEach(claimed.keep)
        return claims
    }

    /// Claims events within one write: the insert statements looked up once, and one binder
    /// (with its buffer) for every row.
    private struct EventWriter {
        let db: Database
        let insert: Statement
        /// The token insert, looked up with the first new event.
        var insertToken: Statement? = nil
        /// The outbox insert, looked up with the first event that has steps.
        var insertStep: Statement? = nil
        var binder = SQLiteBinder()
        /// The audit records of what this write decides: appended to the chain at its end.
        var audit = SQLiteAuditAppender()
        let now = Date().timeIntervalSince1970
        /// The audit fields of the new events with steps, for `ClaimedEvents` once committed.
        var claimedWithSteps: [AuditRecord] = []

        init(_ db: Database) throws {
            self.db = db
            insert = try db.cachedStatement(sql: """
                INSERT INTO events (issuer, jti, token, source, event_types, subject, key_id, algorithm,
                                    key_thumbprint, issued_at, received_at, outcome, steps, updated_at, lease_owner, lease_until,
                                    token_sha256)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (issuer, jti) DO NOTHING
                """)
        }

        /// `claim`, its audit record (if the claim is its outcome) kept for the write's end.
        private mutating func audited(_ claim: Claim, _ event: LedgerEvent, outcome: EventOutcome, hasSteps: Bool) -> Claim {
            if let record = AuditRecord.ofClaim(claim, event, outcome: outcome, hasSteps: hasSteps, at: now) { audit.append(record) }
            return claim
        }

        mutating func claim(_ event: LedgerEvent, outcome: EventOutcome, steps: [OutboxStep]) throws -> Claim {
            let inserted = try binder.execute(insert, in: db) {
                $0.text(event.issuer)
                $0.text(event.jti)
                $0.text("")  // kept in `event_tokens`
                $0.text(event.source)
                $0.jsonArray(event.eventTypes)
                $0.text(event.subject)
                $0.text(event.keyID)
                $0.text(event.algorithm)
                $0.text(event.keyThumbprint)
                $0.double(event.issuedAt)
                $0.double(event.receivedAt)
                $0.text(outcome.rawValue)
                $0.jsonArray(steps.map(\.kind))
                $0.double(event.receivedAt)
                $0.text(event.leaseOwner)
                $0.double(event.leaseUntil)
                $0.text(event.tokenSHA256)
            }
            if inserted == 1 {
                // SQLite's own call: GRDB's property checks the dispatch queue on every read.
                let id = sqlite3_last_insert_rowid(db.sqliteConnection)
                insertToken = try insertToken ?? db.cachedStatement(sql: "INSERT INTO event_tokens (event_id, token) VALUES (?, ?)")
                try binder.execute(insertToken!, in: db) {
                    $0.integer(id)
                    $0.text(utf8: event.tokenBytes)
                }
                if !steps.isEmpty, insertStep == nil {
                    insertStep = try db.cachedStatement(sql: """
                        INSERT INTO steps (event_id, idx, kind, action, status, detail, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)
                        """)
                }
                for step in steps {
                    try binder.execute(insertStep!, in: db) {
                        $0.integer(id)
                        $0.integer(Int64(step.index))
                        $0.text(step.kind)
                        $0.text(step.action)
                        $0.text(step.status.rawValue)
                        $0.text(step.detail)
                        $0.double(event.receivedAt)
                    }
                }
                if !steps.isEmpty {
                    claimedWithSteps.append(AuditRecord(event: event, eventID: id, kind: .event, outcome: outcome.rawValue, steps: [],
                                                        recordedAt: now))
                }
                return audited(.new(eventID: id), event, outcome: outcome, hasSteps: !steps.isEmpty)
            }
            // Bound with their lengths, as the insert bound them: a text is never cut at a NUL.
            var id: Int64? = nil
            try binder.query(db.cachedStatement(sql: "SELECT id FROM events WHERE issuer = ? AND jti = ?"), in: db, {
                $0.text(event.issuer)
                $0.text(event.jti)
            }, row: { id = sqlite3_column_int64($0, 0) })
            guard let id else {
                throw LedgerError(.refused, "the event \(event.jti.prefix(64).debugDescription) of \(event.issuer) was neither inserted nor found")
            }
            // The event row records its first delivery; later ones are recorded as duplicates.
            try db.cachedStatement(sql: "INSERT INTO deliveries (event_id, source, received_at, verdict) VALUES (?, ?, ?, 'duplicate')")
                .execute(arguments: [id, event.source, event.receivedAt])
            return audited(.duplicate(eventID: id), event, outcome: outcome, hasSteps: !steps.isEmpty)
        }
    }

    private static func insert(_ rejection: Rejection, in db: Database) throws {
        try db.cachedStatement(sql: """
            INSERT INTO deliveries (event_id, source, received_at, verdict, error_code, error_description, token, token_sha256)
            VALUES (NULL, ?, ?, 'invalid', ?, ?, ?, ?)
            """).execute(arguments: [rejection.source, rejection.receivedAt, rejection.code, rejection.description,
                                     Data(rejection.token.prefix(Retention.keptRejectedBytes)), AuditChain.sha256Hex(rejection.token)])
    }

    public func record(outcome: EventOutcome, forEvent eventID: Int64) async throws(LedgerError) {
        let claimed = self.claimed
        try await writer.submit(urgent: true) { db in
            if outcome.isFinal { _ = claimed.take(eventID) }
            let now = Date().timeIntervalSince1970
            try db.cachedStatement(sql: "UPDATE events SET outcome = ?, updated_at = ? WHERE id = ?")
                .execute(arguments: [outcome.rawValue, now, eventID])
            guard db.changesCount == 1 else { throw LedgerError(.conflict, "no event with id \(eventID) in the ledger") }
            if outcome.isFinal {
                var audit = SQLiteAuditAppender()
                try audit.appendOutcome(ofEvent: eventID, outcome: outcome, at: now, in: db)
                try audit.commit(in: db)
            }
        }
    }

    public func recordSteps(_ records: [RecordedStep]) async throws(LedgerError) -> RecordedSteps {
        let claimed = self.claimed
        let (refusals, committedAt) = try await writer.submitTimed(urgent: true) { db in
            let now = Date().timeIntervalSince1970
            // Looked up once for the whole write, and bound without building arguments: one
            // write holds the outcomes of hundreds of steps.
            let recordStep = try db.cachedStatement(sql: """
                UPDATE steps SET status = ?, detail = ?, updated_at = ?, attempts = attempts + ?
                WHERE event_id = ? AND idx = ? AND status = 'pending'
                """)
            var finishEvent: Statement? = nil
            var audit = SQLiteAuditAppender()
            var binder = SQLiteBinder()
            var refusals: [LedgerError?] = []
            refusals.reserveCapacity(records.count)
            for record in records {
                // Only a pending step is recorded: one already done or failed (by another owner of
                // the event, after a rebalance) keeps its outcome, and the caller learns it was not first.
                let changed = try binder.execute(recordStep, in: db) {
                    $0.text(record.status.rawValue)
                    $0.text(record.detail)
                    $0.double(now)
                    $0.integer(Int64(record.attempts))
                    $0.integer(record.eventID)
                    $0.integer(Int64(record.index))
                }
                guard changed == 1 else {
                    let recorded = try String.fetchOne(db, sql: "SELECT status FROM steps WHERE event_id = ? AND idx = ?",
                                                       arguments: [record.eventID, record.index])
                    refusals.append(LedgerError(.conflict, recorded.map { "step \(record.index) of event \(record.eventID) is already recorded \($0)" }
                                                ?? "event \(record.eventID) has no step \(record.index) in the ledger"))
                    continue
                }
                if let finishing = record.finishing {
                    // The event's audit fields as this ledger claimed it, if it did: the update
                    // confirms the row is still that claim (issuer, jti and when it was received),
                    // or they are read back from the row.
                    var claim = claimed.take(record.eventID)
                    if finishEvent == nil {
                        finishEvent = try db.cachedStatement(sql: """
                            UPDATE events SET outcome = ?, updated_at = ?
                            WHERE id = ? AND (?4 IS NULL OR (issuer = ?4 AND jti = ?5 AND received_at = ?6))
                            """)
                    }
                    func finish(as claim: AuditRecord?) throws -> Int {
                        try binder.execute(finishEvent!, in: db) {
                            $0.text(finishing.rawValue)
                            $0.double(now)
                            $0.integer(record.eventID)
                            $0.text(claim?.issuer)
                            $0.text(claim?.jti)
                            $0.double(claim?.receivedAt)
                        }
                    }
                    if try finish(as: claim) == 0, claim != nil {
                        claim = nil
                        _ = try finish(as: nil)
                    }
                    try audit.appendOutcome(ofEvent: record.eventID, outcome: finishing, at: now, in: db, claimed: claim)
                }
                refusals.append(nil)
            }
            try audit.commit(in: db)
            return refusals
        }
        return RecordedSteps(refusals: refusals, durableAt: committedAt.syncedAt)
    }

    public func steps(ofEvent eventID: Int64) async throws(LedgerError) -> [OutboxStep] {
        try await writer.submit { db in try SQLiteLedgerReader.steps(db, eventID: eventID) }
    }

    public func lease(event eventID: Int64, owner: String, seconds: Double) async throws(LedgerError) -> Bool {
        try await writer.submit(urgent: true) { db in
            let now = Date().timeIntervalSince1970
            var binder = SQLiteBinder()
            let changed = try binder.execute(db.cachedStatement(sql: """
                UPDATE events SET lease_owner = ?, lease_until = ?
                WHERE id = ? AND (lease_owner IS NULL OR lease_owner = ? OR lease_until < ?)
                """), in: db) {
                $0.text(owner)
                $0.double(now + seconds)
                $0.integer(eventID)
                $0.text(owner)
                $0.double(now)
            }
            return changed == 1
        }
    }

    public func pendingEvents(receivedBefore: Double, afterID: Int64, limit: Int, unleasedAt: Double?) async throws(LedgerError)
        -> [PendingEvent]
    {
        try await writer.submit { db in
            try SQLiteLedgerReader.pendingEvents(db, receivedBefore: receivedBefore, afterID: afterID, limit: limit, unleasedAt: unleasedAt)
        }
    }

    public func requestVerification(issuer: String, state: String, at time: Double) async throws(LedgerError) {
        try await writer.submit(urgent: true) { db in
            try db.execute(sql: "INSERT INTO verifications (issuer, state, requested_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                           arguments: [issuer, state, time])
        }
    }

    public func verificationArrived(issuer: String, state: String, at time: Double) async throws(LedgerError) -> Bool {
        try await writer.submit(urgent: true) { db in
            try db.execute(sql: "UPDATE verifications SET arrived_at = coalesce(arrived_at, ?) WHERE issuer = ? AND state = ?",
                           arguments: [time, issuer, state])
            return db.changesCount > 0
        }
    }

    public func verificationArrival(issuer: String, state: String) async throws(LedgerError) -> Double? {
        try await writer.submit { db in
            try Double.fetchOne(db, sql: "SELECT arrived_at FROM verifications WHERE issuer = ? AND state = ?", arguments: [issuer, state])
        }
    }

    public func streamID(issuer: String) async throws(LedgerError) -> String? {
        try await writer.submit { db in try String.fetchOne(db, sql: "SELECT stream_id FROM streams WHERE issuer = ?", arguments: [issuer]) }
    }

    public func keepStreamID(_ id: String?, issuer: String) async throws(LedgerError) {
        try await writer.submit(urgent: true) { db in
            if let id {
                try db.execute(sql: """
                    INSERT INTO streams (issuer, stream_id, updated_at) VALUES (?, ?, ?)
                    ON CONFLICT (issuer) DO UPDATE SET stream_id = excluded.stream_id, updated_at = excluded.updated_at
                    """, arguments: [issuer, id, Date().timeIntervalSince1970])
            } else {
                try db.execute(sql: "DELETE FROM streams WHERE issuer = ?", arguments: [issuer])
            }
        }
    }

    public func recordRejection(_ rejection: Rejection) async throws(LedgerError) {
        try await writer.submit { db in
            try Self.insert(rejection, in: db)
            var audit = SQLiteAuditAppender()
            audit.append(AuditRecord(rejection: rejection, recordedAt: Date().timeIntervalSince1970))
            try audit.commit(in: db)
        }
    }

    /// A pragma's value on the writing connection, read in the writer's turn (tests: e.g.
    /// `synchronous` is 1, NORMAL, since `WALSyncer` syncs each commit).
    func writerPragma(_ name: StaticString) async throws(LedgerError) -> Int {
        try await writer.submit { db in try Int.fetchOne(db, sql: "PRAGMA \(name)") ?? -1 }
    }

    /// Its writer thread puts every write queued in one transaction.
    public var groupsConcurrentWrites: Bool { true }

    public func isReachable() async -> Bool {
        (try? await writer.submit { db in try Int.fetchOne(db, sql: "SELECT 1") }) != nil
    }

    public func close() async {
        await writer.close()
        await checkpointer.close()
    }

    /// Whether an SQLite failure can pass: busy, locked, I/O and a full disk can; a constraint,
    /// a type mismatch or a value too big cannot.
    static func kind(of error: any Error) -> LedgerError.Kind {
        guard let error = error as? DatabaseError else { return .unavailable }
        switch error.resultCode {
        case .SQLITE_CONSTRAINT, .SQLITE_MISMATCH, .SQLITE_TOOBIG, .SQLITE_RANGE: return .refused
        default: return .unavailable
        }
    }

    // MARK: - Reading (reports, tests)

    /// Every event, oldest first.
    public func events() throws(LedgerError) -> [StoredEvent] { try SQLiteLedgerReader.events(database) }

    /// Every delivery (each message that reached the ledger), oldest first.
    public func deliveries() throws(LedgerError) -> [StoredDelivery] { try SQLiteLedgerReader.deliveries(database) }
}

/// Reads a ledger file, possibly while a worker writes it.
public struct SQLiteLedgerReader: Sendable {
    private let database: DatabaseQueue

    public init(path: String) throws(LedgerError) {
        var configuration = Configuration()
        configuration.readonly = true
        configuration.busyMode = .timeout(10)
        do {
            database = try DatabaseQueue(path: path, configuration: configuration)
        } catch {
            throw LedgerError(.unavailable, "cannot open the SQLite ledger at \(path): \(error)")
        }
    }

    public func events() throws(LedgerError) -> [StoredEvent] { try Self.events(database) }

    /// How many events the ledger holds.
    public func eventCount() throws(LedgerError) -> Int {
        try Self.read(database) { db in try Int.fetchOne(db, sql: "SELECT count(*) FROM events") ?? 0 }
    }

    public func deliveries() throws(LedgerError) -> [StoredDelivery] { try Self.deliveries(database) }

    /// How many events have this outcome.
    public func eventCount(outcome: EventOutcome) throws(LedgerError) -> Int {
        try Self.read(database) { db in
            try Int.fetchOne(db, sql: "SELECT count(*) FROM events WHERE outcome = ?", arguments: [outcome.rawValue]) ?? 0
        }
    }

    /// How many events have no step pending: the newest event's id less the events with a
    /// pending step, in one snapshot. Read through the partial index of pending steps, never
    /// scanning the events: a benchmark polls it while the worker writes (its statements
    /// prepared once: compiling them at each read was most of a read's time, on the worker's cores).
    public func eventsWithoutPendingSteps() throws(LedgerError) -> Int64 {
        try Self.read(database) { db in
            let latest = try Self.latestEventID(db)
            let pending = try Int64.fetchOne(db.cachedStatement(sql: "SELECT count(DISTINCT event_id) FROM steps WHERE status = 'pending'")) ?? 0
            return latest - pending
        }
    }

    /// The id of the newest event: how many events were ever recorded (ids are never reused),
    /// read without scanning the table.
    public func latestEventID() throws(LedgerError) -> Int64 {
        try Self.read(database) { db in try Self.latestEventID(db) }
    }

    private static func latestEventID(_ db: Database) throws -> Int64 {
        try Int64.fetchOne(db.cachedStatement(sql: "SELECT max(id) FROM events")) ?? 0
    }

    static func events(_ database: DatabaseQueue) throws(LedgerError) -> [StoredEvent] {
        try read(database) { db in
            try Row.fetchAll(db, sql: """
                SELECT e.id, issuer, jti, coalesce(t.token, e.token) AS token, source, event_types, outcome, steps
                FROM events e LEFT JOIN event_tokens t ON t.event_id = e.id ORDER BY e.id
                """).map {
                StoredEvent(id: $0["id"], issuer: $0["issuer"], jti: $0["jti"], token: $0["token"], source: $0["source"],
                            eventTypes: $0["event_types"], outcome: $0["outcome"], steps: $0["steps"])
            }
        }
    }

    /// An event's steps, in order.
    public func steps(ofEvent eventID: Int64) throws(LedgerError) -> [OutboxStep] {
        try Self.read(database) { db in try Self.steps(db, eventID: eventID) }
    }

    static func steps(_ db: Database, eventID: Int64) throws -> [OutboxStep] {
        try Row.fetchAll(db, sql: "SELECT idx, kind, action, status, detail FROM steps WHERE event_id = ? ORDER BY idx",
                         arguments: [eventID]).map {
            OutboxStep(index: $0["idx"], kind: $0["kind"], action: $0["action"],
                       status: StepStatus(rawValue: $0["status"]) ?? .pending, detail: $0["detail"])
        }
    }

    static func pendingEvents(_ db: Database, receivedBefore: Double, afterID: Int64, limit: Int, unleasedAt: Double? = nil) throws
        -> [PendingEvent]
    {
        // The pending steps are found through their partial index, their events by id.
        try Row.fetchAll(db, sql: """
            SELECT e.id, coalesce(t.token, e.token) AS token, e.source, e.received_at
            FROM events e LEFT JOIN event_tokens t ON t.event_id = e.id
            WHERE e.id IN (SELECT event_id FROM steps WHERE status = 'pending') AND e.id > ?1 AND e.received_at < ?2
              AND (?4 IS NULL OR e.lease_until IS NULL OR e.lease_until < ?4)
            ORDER BY e.id LIMIT ?3
            """, arguments: [afterID, receivedBefore, limit, unleasedAt]).map {
            let token: String = $0["token"]
            return PendingEvent(id: $0["id"], token: Array(token.utf8), source: $0["source"], receivedAt: $0["received_at"])
        }
    }

    static func deliveries(_ database: DatabaseQueue) throws(LedgerError) -> [StoredDelivery] {
        try read(database) { db in
            try Row.fetchAll(db, sql: "SELECT id, event_id, source, verdict, error_code, error_description FROM deliveries ORDER BY id").map {
                StoredDelivery(id: $0["id"], eventID: $0["event_id"], source: $0["source"], verdict: $0["verdict"],
                               errorCode: $0["error_code"], errorDescription: $0["error_description"])
            }
        }
    }

    /// Runs `body` on a snapshot of what is committed.
    func read<T>(_ body: (Database) throws -> T) throws(LedgerError) -> T { try Self.read(database, body) }

    private static func read<T>(_ database: DatabaseQueue, _ body: (Database) throws -> T) throws(LedgerError) -> T {
        do {
            return try database.read(body)
        } catch let error as LedgerError {
            throw error
        } catch {
            throw LedgerError(SQLiteLedger.kind(of: error), "cannot read the ledger: \(error)")
        }
    }
}

public struct StoredEvent: Sendable, Equatable {
    public var id: Int64
    public var issuer: String
    public var jti: String
    /// The compact SET as received (less surrounding whitespace).
    public var token: String
    public var source: String
    /// JSON array text.
    public var eventTypes: String
    public var outcome: String
    /// JSON array text.
    public var steps: String
}

public struct StoredDelivery: Sendable, Equatable {
    public var id: Int64
    public var eventID: Int64?
    public var source: String
    public var verdict: String
    public var errorCode: String?
    public var errorDescription: String?
}

/// Groups writes from concurrent callers into shared transactions, on a thread of its own.
/// Names the calling thread as the kernel shows it (`top -H`, `perf`; at most 15 bytes):
/// Foundation's `Thread.name` does not reach it on Linux, and the thread would show the name of
/// the one that started it.
private func nameThisThread(_ name: String) {
    try? name.write(toFile: "/proc/thread-self/comm", atomically: false, encoding: .utf8)
}

final class BatchWriter: Sendable {
    /// One caller's write: runs inside the shared transaction, answers after it commits.
    struct Job: Sendable {
        let execute: @Sendable (Database) throws -> Void
        /// Committed in a transaction without other queued writes (urgent ones may join it).
        let alone: Bool
        /// Answered only after a sync of the WAL, even if its transaction wrote nothing.
        var mustSync = false
        /// Called on the writer's or the syncer's thread: when the transaction was synced, or why
        /// it failed.
        let complete: @Sendable (Result<Commit, any Error>) -> Void
    }

    /// A transaction as its callers learn it: its place in the writer's order, and when it was
    /// synced (several may share a sync). Two commits are equal when they are one transaction.
    struct Commit: Sendable, Hashable, Comparable {
        let number: Int
        let syncedAt: ContinuousClock.Instant

        static func == (a: Commit, b: Commit) -> Bool { a.number == b.number }
        func hash(into hasher: inout Hasher) { hasher.combine(number) }
        static func < (a: Commit, b: Commit) -> Bool { a.number < b.number }
    }

    private struct Queue {
        var jobs: [Job] = []
        /// Small writes that must not wait behind the intake's large ones: steps' outcomes.
        var urgent: [Job] = []
        var closed = false
        var finished: CheckedContinuation<Void, Never>? = nil

        /// The oldest urgent writes, as many as one transaction takes.
        mutating func takeUrgent() -> [Job] {
            let taken = Array(urgent.prefix(BatchWriter.urgentPerTransaction))
            urgent.removeFirst(taken.count)
            return taken
        }
    }

    /// Urgent writes one transaction takes at most. Each of the step runner's holds up to a
    /// short intake write's worth of outcomes (96). Once the writer fell behind, a transaction
    /// took every one queued: up to seven of them joined one intake write, and all their
    /// outcomes waited for that one long transaction, and then for its sync. Two at a time, the
    /// first are durable while the writer goes on with the next (the syncer syncs beside it).
    static let urgentPerTransaction = 2

    private let database: DatabaseQueue
    private let queue = Mutex(Queue())
    private let wakeUp = DispatchSemaphore(value: 0)
    private let exited = DispatchSemaphore(value: 0)

    private let syncer: WALSyncer
    /// What the connection's WAL hook points to: kept as long as the writer may commit.
    let walHook: WriterCheckpoint

    init(database: DatabaseQueue, syncer: WALSyncer, keeping walHook: WriterCheckpoint) {
        self.database = database
        self.syncer = syncer
        self.walHook = walHook
        syncer.start()
        let thread = Thread { [self] in
            nameThisThread("warden-ledger")
            self.loop()
        }
        thread.name = "warden-ledger-writer"
        thread.start()
    }

    /// Runs `body` in the next transaction. An `urgent` write (a step's outcome: a revocation
    /// answered and not yet recorded would be made again after a crash) goes ahead of the queued
    /// intake writes, in a transaction of its own or joining the intake write already running,
    /// so it waits for at most that one, not for every batch queued before it. A write `alone`
    /// (a batch sized by its caller) is not grouped with other queued writes.
    func submit<T: Sendable>(urgent: Bool = false, alone: Bool = false, _ body: @escaping @Sendable (Database) throws -> T)
        async throws(LedgerError) -> T
    {
        try await submitTimed(urgent: urgent, alone: alone, body).0
    }

    /// Returns once a sync of the WAL begun after this call returned: what any connection could
    /// read before the call is then on the disk.
    func sync() async throws(LedgerError) {
        _ = try await submitTimed(mustSync: true) { _ in }
    }

    /// `submit`, also telling which transaction held the write, and when it was synced.
    func submitTimed<T: Sendable>(urgent: Bool = false, alone: Bool = false, mustSync: Bool = false,
                                  _ body: @escaping @Sendable (Database) throws -> T) async throws(LedgerError) -> (T, Commit)
    {
        let result: Result<(T, Commit), LedgerError> = await withCheckedContinuation { continuation in
            let box = ResultBox<T>()
            var job = Job(execute: { db in box.set(try body(db)) }, alone: alone && !urgent, complete: { result in
                switch result {
                case .failure(let error):
                    continuation.resume(returning: .failure(error as? LedgerError ?? LedgerError(SQLiteLedger.kind(of: error), "ledger write failed: \(error)")))
                case .success(let commit):
                    continuation.resume(returning: .success((box.take(), commit)))
                }
            })
            job.mustSync = mustSync
            let accepted = queue.withLock { q -> Bool in
                guard !q.closed else { return false }
                if urgent { q.urgent.append(job) } else { q.jobs.append(job) }
                return true
            }
            if accepted { wakeUp.signal() } else { continuation.resume(returning: .failure(LedgerError(.closed, "the ledger is closed"))) }
        }
        return try result.get()
    }

    /// Urgent writes queued and not yet taken by the writer thread.
    var urgentQueued: Int { queue.withLock { $0.urgent.count } }
    /// Other writes queued and not yet taken (tests).
    var queued: Int { queue.withLock { $0.jobs.count } }

    func close() async {
        queue.withLock { $0.closed = true }
        wakeUp.signal()
        await exited.waitOffThePool()
    }

    /// Each turn: the oldest urgent writes (`urgentPerTransaction`); once none is left, the next
    /// transaction's worth of the others (a write `alone`, or every write queued before the next
    /// one alone), which urgent writes queued meanwhile join, as many as one transaction takes.
    private func loop() {
        // Transactions committed so far.
        var commits = 0
        while true {
            let (urgent, batch, closed) = queue.withLock { q -> ([Job], [Job], Bool) in
                let urgent = q.takeUrgent()
                // The intake's next write waits until no urgent write is left.
                let count = !q.urgent.isEmpty ? 0 : q.jobs.first.map { $0.alone ? 1 : (q.jobs.firstIndex(where: \.alone) ?? q.jobs.count) } ?? 0
                let batch = Array(q.jobs.prefix(count))
                q.jobs.removeFirst(count)
                return (urgent, batch, q.closed)
            }
            if urgent.isEmpty, batch.isEmpty {
                if closed { break }
                // Woken by each submit: a wake-up left over from writes already taken only
                // makes one more turn.
                wakeUp.wait()
                continue
            }
            if !urgent.isEmpty { run(urgent, commits: &commits) }
            if !batch.isEmpty { run(batch, joiningUrgent: true, commits: &commits) }
        }
        syncer.close()
        exited.signal()
    }

    /// One transaction for the whole batch. If it fails (a job threw, or SQLite did), each job
    /// runs again in a transaction of its own, so one bad write cannot fail the others.
    ///
    /// `joiningUrgent`: urgent writes queued while the batch ran join its transaction before it
    /// commits (the oldest, `urgentPerTransaction` at most), so a step's outcome answered during
    /// an intake write is durable with that write's commit, not after a transaction (and a sync)
    /// of its own.
    private func run(_ jobs: [Job], joiningUrgent: Bool = false, commits: inout Int) {
        var batch = jobs
        do {
            try commit(&batch, joiningUrgent: joiningUrgent, commits: &commits)
        } catch {
            guard batch.count > 1 else {
                batch[0].complete(.failure(error))
                return
            }
            for job in batch {
                var alone = [job]
                do { try commit(&alone, joiningUrgent: false, commits: &commits) } catch { job.complete(.failure(error)) }
            }
        }
    }

    /// Runs `jobs` in one transaction (the urgent writes queued meanwhile join them, with
    /// `joiningUrgent`) and, once it committed, hands them to the syncer, telling it whether the
    /// transaction wrote anything.
    private func commit(_ jobs: inout [Job], joiningUrgent: Bool, commits: inout Int) throws {
        var wrote = false
        try database.inTransaction(.immediate) { db in
            let changesBefore = db.totalChangesCount
            defer { wrote = db.totalChangesCount != changesBefore }
            for job in jobs { try job.execute(db) }
            if joiningUrgent {
                let late = queue.withLock { $0.takeUrgent() }
                jobs += late
                for job in late { try job.execute(db) }
            }
            return .commit
        }
        commits += 1
        syncer.committed(jobs, number: commits, wrote: wrote)
    }
}

/// Copies the WAL's committed pages into the database file, on a connection and a thread of
/// its own, every `interval`. A checkpoint run by the writer (SQLite's automatic one) stops
/// every write for as long as it copies: with 64,000 events in flight that was one stall of
/// 100–250 ms, during which every step's outcome waited. A passive checkpoint here copies
/// beside the writer, never waits for it, and lets it be (a busy database is tried again next
/// time); only pages not yet copied are left to the writer's own checkpoint.
///
/// It also has the WAL start over before the writer's own checkpoint would (see `restart`).
final class Checkpointer: Sendable {
    static let interval = DispatchTimeInterval.milliseconds(100)
    /// The WAL's size, in bytes, from which a pass ends with `restart`: half the size at which
    /// the writer checkpoints by itself.
    static let restartBytes = 128 << 20
    /// Tries at a restart, half a millisecond apart, while the writer is in a transaction (or a
    /// reader began one on the WAL meanwhile).
    static let restartTries = 20

    private let database: DatabaseQueue
    private let closed = Atomic(false)
    private let wake = DispatchSemaphore(value: 0)
    private let exited = DispatchSemaphore(value: 0)
    /// Passes made, whatever they copied (tests).
    let passes = Atomic(0)
    /// Checkpoints made that leave the WAL to start over, and tries at them (tests).
    let restarts = Atomic(0)
    let restartAttempts = Atomic(0)

    /// `startWriteback`: starts writing the database file's dirty pages to the disk, without
    /// waiting; 0 on success. `syncDatabase`: syncs the database file; 0 on success.
    init(path: String, startWriteback: @escaping @Sendable (Int32) -> Int32,
         syncDatabase: @escaping @Sendable (Int32) -> Int32 = { fdatasync($0) },
         restartBytes: Int = Checkpointer.restartBytes) throws(LedgerError) {
        let databaseFile: Int32?
        let restartFrames: Int
        do {
            var configuration = Configuration()
            configuration.busyMode = .immediateError
            database = try DatabaseQueue(path: path, configuration: configuration)
            databaseFile = database.inDatabase { db in Self.descriptor(of: db, path: path) }
            restartFrames = max(1, restartBytes / (try database.inDatabase { try Int.fetchOne($0, sql: "PRAGMA page_size") } ?? 4096))
        } catch {
            throw LedgerError(.unavailable, "cannot open the SQLite ledger at \(path) for checkpoints: \(error)")
        }
        let thread = Thread { [self] in
            nameThisThread("warden-checkpts")
            var seen = (frames: 0, copied: 0)
            /// The WAL's frames when it was last made to start over.
            var restartedAfter = -1
            while !closed.load(ordering: .acquiring) {
                _ = wake.wait(timeout: .now() + Self.interval)
                let pass: (walFrameCount: Int, checkpointedFrameCount: Int)
                do {
                    pass = try database.writeWithoutTransaction { try $0.checkpoint(.passive) }
                } catch {
                    // Busy (another checkpoint) or anything a later pass may mend: tried again
                    // then. Not a failed sync (see `stopIfSyncFailed`).
                    Self.stopIfSyncFailed(error, path: path)
                    continue
                }
                // SQLite syncs the database after a pass only if the pass reached the WAL's end,
                // which under load it never does: the writer commits while it copies. Left to the
                // kernel's flusher, the copied pages stay dirty long enough for the writer's own
                // checkpoint at 256 MiB to sync a WAL's worth of them at once, while no write
                // commits. Their writeback is started here instead, after each pass that may
                // have copied pages (the WAL's frames or SQLite's count of those copied moved),
                // so that sync finds little left. This is not a sync and nothing rests on it: it
                // changes only when the kernel writes these pages, and a failure to write them is
                // reported to the next sync of the file, as one of the flusher's would be (and
                // stops the process: `stopIfSyncFailed`).
                let now = (frames: pass.walFrameCount, copied: pass.checkpointedFrameCount)
                if now != seen {
                    seen = now
                    if now.copied > 0, let databaseFile { _ = startWriteback(databaseFile) }
                }
                // Only once the pass copied every frame: one left means a reader still uses
                // the WAL's older frames, and no checkpoint can copy past them before it is done.
                // Not again for the frames it restarted after: until the writer's next write
                // starts the WAL over, every pass finds that same WAL, and a restart syncs the
                // database each time.
                if pass.walFrameCount >= restartFrames, pass.checkpointedFrameCount == pass.walFrameCount,
                   pass.walFrameCount != restartedAfter, let databaseFile {
                    restartedAfter = restart(databaseFile: databaseFile, path: path, sync: syncDatabase) ?? restartedAfter
                }
                passes.add(1, ordering: .releasing)
            }
            exited.signal()
        }
        thread.name = "warden-ledger-checkpoints"
        thread.start()
    }

    /// Has the WAL start over: a checkpoint of every frame, after which the writer's next
    /// transaction writes the WAL from its beginning. Left to the writer, this happened in its
    /// own checkpoint at 256 MiB: it copied what the passes had not, and synced the database
    /// with every page copied since the last sync, while no write committed (48 ms, measured
    /// under load; every step's outcome waited).
    ///
    /// Here the database is first synced beside the writer. Then a `RESTART` checkpoint holds
    /// the writer back while it copies the frames committed since the pass and syncs the WAL and
    /// the few database pages they make (a write meanwhile waits in the writer's busy handler).
    /// It is tried again while the writer is in a transaction (each such try is a passive
    /// checkpoint), at most `restartTries` times, and no try waits for a reader (its connection
    /// has no busy handler). Whatever does not happen here is left to the next pass, or to the
    /// writer's own checkpoint, as before.
    ///
    /// A failed sync of the database stops the process, as one of the WAL does (see
    /// `stopIfSyncFailed`).
    ///
    /// (When the writer is idle, a pass that copies every frame is enough: the writer's next
    /// write starts the WAL over by itself. Under load a pass never finds every frame copied when
    /// the writer begins its next transaction.)
    ///
    /// Returns the WAL's frames when it was made to start over, or nil if it was not.
    private func restart(databaseFile: Int32, path: String, sync: @Sendable (Int32) -> Int32) -> Int? {
        guard sync(databaseFile) == 0 else { Self.stopAfterFailedSync(path: path, reason: String(cString: strerror(errno))) }
        for _ in 0..<Self.restartTries {
            restartAttempts.add(1, ordering: .releasing)
            do {
                let made = try database.writeWithoutTransaction { try $0.checkpoint(.restart) }
                restarts.add(1, ordering: .releasing)
                return made.walFrameCount
            } catch let error as DatabaseError where error.resultCode == .SQLITE_BUSY {
                usleep(500)
            } catch {
                Self.stopIfSyncFailed(error, path: path)
                return nil
            }
        }
        return nil
    }

    /// Stops the process if `error` is a failed sync of the ledger's files (SQLite's own, within
    /// a checkpoint); any other failure of a checkpoint is left for a later one to mend.
    ///
    /// Linux reports a failed writeback once, to the next sync of the file; the pages it lost
    /// are clean in memory, and a later sync succeeds without them. A pass that stopped short of
    /// the WAL's end counted its frames copied without a sync, so no later checkpoint copies them
    /// again: once one succeeds, the WAL, the only copy left, may be overwritten. Stopping here,
    /// with the WAL as it is, lets the next start recover from it (PostgreSQL stops for the same
    /// reason on a failed fsync).
    static func stopIfSyncFailed(_ error: any Error, path: String) {
        guard let error = error as? DatabaseError, isFailedSync(error.extendedResultCode) else { return }
        stopAfterFailedSync(path: path, reason: error.message ?? "\(error.extendedResultCode)")
    }

    static func isFailedSync(_ code: ResultCode) -> Bool { code == .SQLITE_IOERR_FSYNC || code == .SQLITE_IOERR_DIR_FSYNC }

    static func stopAfterFailedSync(path: String, reason: String) -> Never {
        FileHandle.standardError.write(Data("warden: cannot sync the SQLite ledger \(path): \(reason); stopping\n".utf8))
        fatalError("cannot sync the SQLite ledger \(path)")
    }

    /// The descriptor SQLite holds for the database file on this connection, or nil if it cannot
    /// be told for sure.
    ///
    /// Not a descriptor of our own: closing any descriptor of a file releases every POSIX lock
    /// the process holds on it, SQLite's included. Another process closing its last connection
    /// would then find no one else using the database, checkpoint it, and delete the WAL this
    /// process still writes. SQLite's own descriptor stays open as long as this connection,
    /// which only the checkpoint thread uses.
    ///
    /// SQLite hands out its file object (`SQLITE_FCNTL_FILE_POINTER`). Read only if the
    /// connection's VFS is SQLite's unix one, whose file object begins with three pointers (its
    /// methods, its VFS, its inode's lock record) and then the descriptor; and the descriptor
    /// is used only if it is open on the very file at `path` (same device and inode).
    private static func descriptor(of db: Database, path: String) -> Int32? {
        var vfs: UnsafeMutablePointer<sqlite3_vfs>? = nil
        var file: UnsafeMutablePointer<sqlite3_file>? = nil
        guard sqlite3_file_control(db.sqliteConnection, "main", SQLITE_FCNTL_VFS_POINTER, &vfs) == SQLITE_OK, let vfs,
              let name = vfs.pointee.zName, String(cString: name).hasPrefix("unix"),
              sqlite3_file_control(db.sqliteConnection, "main", SQLITE_FCNTL_FILE_POINTER, &file) == SQLITE_OK, let file,
              file.pointee.pMethods != nil else { return nil }
        let fields = UnsafeRawPointer(file)
        let stride = MemoryLayout<UnsafeRawPointer>.stride
        guard fields.load(fromByteOffset: stride, as: UnsafeRawPointer?.self) == UnsafeRawPointer(vfs) else { return nil }
        let fd = fields.load(fromByteOffset: 3 * stride, as: Int32.self)
        var held = stat(), named = stat()
        guard fd >= 0, fstat(fd, &held) == 0, stat(path, &named) == 0,
              held.st_dev == named.st_dev, held.st_ino == named.st_ino else { return nil }
        return fd
    }

    func close() async {
        closed.store(true, ordering: .releasing)
        wake.signal()
        await exited.waitOffThePool()
    }
}

/// The writer's own checkpoint, once the WAL holds `frames` frames: what SQLite's
/// autocheckpoint does after a commit, except that a failed sync within it stops the process
/// (`Checkpointer.stopIfSyncFailed`), where SQLite's drops every error of its own. SQLite calls
/// the hook on the writer's connection, from whichever thread commits.
final class WriterCheckpoint: Sendable {
    /// The WAL's size from which the writer checkpoints by itself.
    static let bytes = 256 << 20

    let frames: Int32
    let path: String
    /// Checkpoints made (tests).
    let made = Atomic(0)

    init(frames: Int, path: String) {
        self.frames = Int32(clamping: frames)
        self.path = path
    }

    /// Installs this as `db`'s WAL hook, which SQLite calls after each commit with the WAL's
    /// frames. It replaces SQLite's autocheckpoint (`PRAGMA wal_autocheckpoint` then reads 0).
    /// The connection must not commit once this is released: its owner keeps it.
    func install(on db: Database) {
        sqlite3_wal_hook(db.sqliteConnection, { context, connection, name, frames in
            guard let context else { return SQLITE_OK }
            let hook = Unmanaged<WriterCheckpoint>.fromOpaque(context).takeUnretainedValue()
            guard frames >= hook.frames else { return SQLITE_OK }
            // Passive, as SQLite's own: it never waits for a reader. Its result is not the
            // commit's, which has succeeded.
            let code = sqlite3_wal_checkpoint_v2(connection, name, SQLITE_CHECKPOINT_PASSIVE, nil, nil)
            hook.made.add(1, ordering: .releasing)
            if Checkpointer.isFailedSync(ResultCode(rawValue: code)) {
                Checkpointer.stopAfterFailedSync(path: hook.path, reason: String(cString: sqlite3_errstr(code)))
            }
            return SQLITE_OK
        }, Unmanaged.passUnretained(self).toOpaque())
    }
}

extension DispatchSemaphore {
    /// Waits for a thread's signal without holding a thread of Swift's cooperative pool.
    func waitOffThePool() async {
        await withCheckedContinuation { (done: CheckedContinuation<Void, Never>) in
            DispatchQueue.global().async { [self] in
                wait()
                done.resume()
            }
        }
    }
}

/// Carries a job's result from the transaction to its caller.
///
/// `@unchecked Sendable`: written once by the writer thread inside the transaction and read once
/// when the job is completed, strictly after: by the writer thread (a failure), or by the WAL
/// syncer's thread, which takes the job from the writer through a lock.
final class ResultBox<T>: @unchecked Sendable {
    private var value: T?
    func set(_ v: T) { value = v }
    func take() -> T { value! }
}

/// Syncs the WAL after commits, on a thread of its own, and only then answers their callers.
///
/// The writer commits with `synchronous = NORMAL` (the WAL written, not synced) and hands the
/// transaction's callers here. Each turn takes every transaction committed so far, syncs the WAL
/// (`fdatasync`), and answers them: a sync covers every byte written before it began, and a
/// crash keeps the WAL up to its last whole commit, so each of them is durable. Meanwhile the
/// writer runs the next transaction instead of waiting for the disk. A turn whose transactions
/// wrote nothing (reads) answers them without a sync: every earlier turn left its own durable.
///
/// The WAL is opened once, when the ledger is, and checked on every turn to be still the file at
/// its path: one removed or put in its place would be synced in vain while SQLite writes the old.
///
/// A sync that fails leaves unknown what reached the disk (the kernel may have dropped the
/// pages it could not write), and trying again proves nothing: the process stops, without
/// answering, and a restart takes up again from what the ledger and the intake's sources hold.
final class WALSyncer: Sendable {
    private struct Committed {
        var jobs: [BatchWriter.Job]
        var number: Int
        var needsSync: Bool
    }

    private struct State {
        var committed: [Committed] = []
        var closed = false
        var started = false
    }

    let walPath: String
    private let fd: Int32
    private let sync: @Sendable (Int32) -> Int32
    private let state = Mutex(State())
    private let wakeUp = DispatchSemaphore(value: 0)
    private let exited = DispatchSemaphore(value: 0)

    init(walPath: String, sync: @escaping @Sendable (Int32) -> Int32) throws(LedgerError) {
        self.walPath = walPath
        self.sync = sync
        fd = open(walPath, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else {
            let code = errno
            throw LedgerError(.unavailable, "cannot open the SQLite ledger's WAL \(walPath) to sync it: \(String(cString: strerror(code)))")
        }
    }

    deinit {
        if !state.withLock({ $0.started }) { Glibc.close(fd) }
    }

    /// Starts the thread (once the writer that feeds it exists).
    func start() {
        state.withLock { $0.started = true }
        let thread = Thread { [self] in
            nameThisThread("warden-walsync")
            self.loop()
        }
        thread.name = "warden-ledger-sync"
        thread.start()
    }

    /// Answers `jobs`, whose transaction `number` committed (and `wrote` something), once the
    /// WAL is synced.
    func committed(_ jobs: [BatchWriter.Job], number: Int, wrote: Bool) {
        let entry = Committed(jobs: jobs, number: number, needsSync: wrote || jobs.contains(where: \.mustSync))
        state.withLock { $0.committed.append(entry) }
        wakeUp.signal()
    }

    /// Syncs and answers what is committed, then stops (called by the writer once it stopped).
    func close() {
        state.withLock { $0.closed = true }
        wakeUp.signal()
        exited.wait()
    }

    private func loop() {
        while true {
            let (committed, closed) = state.withLock { s -> ([Committed], Bool) in
                defer { s.committed = [] }
                return (s.committed, s.closed)
            }
            if committed.isEmpty {
                if closed { break }
                // Woken by each commit: a wake-up left over from commits already taken only
                // makes one more turn.
                wakeUp.wait()
                continue
            }
            if committed.contains(where: \.needsSync) {
                checkStillTheWAL()
                let synced = sync(fd), code = errno
                guard synced == 0 else { fail("cannot sync the SQLite ledger's WAL \(walPath)", code) }
            }
            let syncedAt = ContinuousClock.now
            for entry in committed {
                for job in entry.jobs { job.complete(.success(BatchWriter.Commit(number: entry.number, syncedAt: syncedAt))) }
            }
        }
        Glibc.close(fd)
        exited.signal()
    }

    /// Stops the process unless the descriptor is still the file at the WAL's path.
    private func checkStillTheWAL() {
        var open = stat(), named = stat()
        let opened = fstat(fd, &open), openCode = errno
        guard opened == 0 else { fail("cannot read the state of the SQLite ledger's WAL \(walPath)", openCode) }
        guard open.st_nlink > 0 else { fail("the SQLite ledger's WAL \(walPath) was removed while in use", 0) }
        let found = stat(walPath, &named), foundCode = errno
        guard found == 0 else { fail("the SQLite ledger's WAL \(walPath) is gone", foundCode) }
        guard named.st_dev == open.st_dev, named.st_ino == open.st_ino else {
            fail("another file took the place of the SQLite ledger's WAL \(walPath) while in use", 0)
        }
    }

    private func fail(_ what: String, _ code: Int32) -> Never {
        let reason = code == 0 ? "" : ": " + String(cString: strerror(code))
        FileHandle.standardError.write(Data("warden: \(what)\(reason); stopping without answering the writes not yet synced\n".utf8))
        fatalError(what)
    }
}
