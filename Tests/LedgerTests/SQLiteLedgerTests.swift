import Foundation
@testable import Ledger
import CWardenFiles
import GRDB
import GRDBSQLite
import Synchronization
import Testing
import WardenTestSupport

@Suite("SQLite ledger")
struct SQLiteLedgerTests {
    static func temporaryPath() -> String {
        (try! Scratch.directory("ledger")).appendingPathComponent("ledger.sqlite").path
    }

    static func event(jti: String, issuer: String = "https://issuer.example/", source: String = "kafka:t/0/1") -> LedgerEvent {
        LedgerEvent(issuer: issuer, jti: jti, token: "h.p.s", source: source,
                    eventTypes: ["https://schemas.openid.net/secevent/risc/event-type/sessions-revoked"],
                    subject: #"{"format":"iss_sub","iss":"https://issuer.example/","sub":"1"}"#, keyID: "k1",
                    algorithm: "RS256", keyThumbprint: "tp", issuedAt: 1_800_000_000, receivedAt: 1_800_000_001)
    }

    /// No write is answered before the WAL holding it is synced, so a claim or an outcome
    /// survives the machine going down, not only the process: while the sync is held back the
    /// claim is committed (a reader sees it) but its caller still waits; once the sync returns,
    /// the caller is answered. Migrations commit synced themselves (FULL).
    @Test func noWriteIsAnsweredBeforeTheWALIsSynced() async throws {
        let path = Self.temporaryPath()
        let gate = SyncGate()
        let ledger = try SQLiteLedger(path: path, syncWAL: { gate.sync($0) })
        #expect(try await ledger.writerPragma("synchronous") == 1)
        let syncedBefore = gate.syncs
        gate.hold()
        let answered = Mutex(false)
        let claim = Task {
            let claim = try await ledger.claim(Self.event(jti: "synced"), outcome: .processed, steps: [])
            answered.withLock { $0 = true }
            return claim
        }
        // The syncer is held inside a sync taken after the claim's commit.
        for _ in 0..<500 where gate.waiting == 0 { try await Task.sleep(for: .milliseconds(10)) }
        #expect(gate.waiting == 1)
        #expect(try SQLiteLedgerReader(path: path).eventCount() == 1)
        try await Task.sleep(for: .milliseconds(100))
        #expect(!answered.withLock { $0 })
        gate.release()
        guard case .new = try await claim.value else { Issue.record("the claim was not new"); return }
        #expect(answered.withLock { $0 })
        #expect(gate.syncs == syncedBefore + 1)
        // The descriptor synced is the WAL's.
        #expect(gate.syncedPaths.allSatisfy { $0 == path + "-wal" })
        await ledger.close()
    }

    /// A transaction committed while a sync is under way is answered only after a later one:
    /// the sync under way may have begun before its commit.
    @Test func aCommitDuringASyncWaitsForTheNextSync() async throws {
        let path = Self.temporaryPath()
        let gate = SyncGate()
        let ledger = try SQLiteLedger(path: path, syncWAL: { gate.sync($0) })
        _ = try await ledger.writerPragma("synchronous")
        let syncedBefore = gate.syncs
        gate.hold()
        let answeredA = Mutex(false), answeredB = Mutex(false)
        let a = Task {
            _ = try await ledger.claim(Self.event(jti: "a"), outcome: .processed, steps: [])
            answeredA.withLock { $0 = true }
        }
        for _ in 0..<500 where gate.waiting == 0 { try await Task.sleep(for: .milliseconds(10)) }
        #expect(gate.waiting == 1)
        // B commits while the sync taken for A is held.
        let b = Task {
            _ = try await ledger.claim(Self.event(jti: "b"), outcome: .processed, steps: [])
            answeredB.withLock { $0 = true }
        }
        for _ in 0..<500 where try SQLiteLedgerReader(path: path).eventCount() < 2 { try await Task.sleep(for: .milliseconds(10)) }
        #expect(try SQLiteLedgerReader(path: path).eventCount() == 2)
        gate.releaseOne()
        try await a.value
        // The next sync, for B, is held again.
        for _ in 0..<500 where gate.waiting == 0 { try await Task.sleep(for: .milliseconds(10)) }
        #expect(gate.waiting == 1)
        try await Task.sleep(for: .milliseconds(100))
        #expect(answeredA.withLock { $0 })
        #expect(!answeredB.withLock { $0 }, "B was answered by a sync that may have begun before its commit")
        gate.release()
        try await b.value
        #expect(answeredB.withLock { $0 })
        #expect(gate.syncs == syncedBefore + 2)
        await ledger.close()
    }

    /// Reads answer without a sync when nothing is left unsynced (a disk that stalls then holds
    /// no health probe), and a read whose result leaves the process (an audit) waits for one.
    @Test func readsSyncOnlyWhenTheirResultLeavesTheProcess() async throws {
        let gate = SyncGate()
        let ledger = try SQLiteLedger(path: Self.temporaryPath(), syncWAL: { gate.sync($0) })
        _ = try await ledger.claim(Self.event(jti: "r"), outcome: .processed, steps: [])
        let syncs = gate.syncs
        #expect(await ledger.isReachable())
        _ = try await ledger.writerPragma("synchronous")
        #expect(gate.syncs == syncs, "a read was synced")
        _ = try await ledger.auditHead()
        #expect(gate.syncs == syncs + 1, "an audit read did not wait for a sync")
        await ledger.close()
    }

    /// A WAL sync that a test holds back, counting the syncs and naming the files synced.
    final class SyncGate: Sendable {
        private struct State {
            var held = false
            var permits = 0
            var waiting = 0
            var syncs = 0
            var paths: [String] = []
        }
        private let state = Mutex(State())

        func hold() { state.withLock { $0.held = true } }
        func release() { state.withLock { $0.held = false } }
        /// Lets one held sync through; the next is held again.
        func releaseOne() { state.withLock { $0.permits += 1 } }
        var waiting: Int { state.withLock { $0.waiting } }
        var syncs: Int { state.withLock { $0.syncs } }
        var syncedPaths: [String] { state.withLock { $0.paths } }

        func sync(_ fd: Int32) -> Int32 {
            let path = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(fd)")) ?? "?"
            state.withLock { $0.waiting += 1 }
            while !state.withLock({ s -> Bool in
                guard s.held else { return true }
                guard s.permits > 0 else { return false }
                s.permits -= 1
                return true
            }) { usleep(1000) }
            state.withLock {
                $0.waiting -= 1
                $0.syncs += 1
                $0.paths.append(path)
            }
            return fdatasync(fd)
        }
    }

    /// The writer and checkpoint threads carry names of their own where `top -H` and `perf`
    /// read them (`/proc/…/task/…/comm`), not the name of the thread that opened the ledger.
    @Test func theLedgersThreadsAreNamedForTheKernel() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        _ = try await ledger.writerPragma("synchronous")  // the writer has run
        func names() -> Set<String> {
            let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task")) ?? []
            return Set(tasks.compactMap { try? String(contentsOfFile: "/proc/self/task/\($0)/comm", encoding: .utf8) }
                .map { $0.trimmingCharacters(in: .whitespacesAndNewlines) })
        }
        var seen = names()
        for _ in 0..<100 where !seen.isSuperset(of: ["warden-ledger", "warden-checkpts", "warden-walsync"]) {
            try await Task.sleep(for: .milliseconds(20))
            seen = names()
        }
        #expect(seen.isSuperset(of: ["warden-ledger", "warden-checkpts", "warden-walsync"]))
    }

    /// A new ledger has 4 KiB pages, and its WAL starts over at 256 MiB whatever the page size: a
    /// ledger made with 16 KiB pages keeps them, with a quarter of the pages before the WAL's
    /// checkpoint.
    @Test func newLedgersHaveSmallPagesAndTheWALStartsOverAtTheSameSize() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path)
        #expect(try await ledger.writerPragma("page_size") == 4096)
        #expect(ledger.writerCheckpoint.frames == 65536)
        // SQLite's own autocheckpoint is replaced by the writer's.
        #expect(try await ledger.writerPragma("wal_autocheckpoint") == 0)
        await ledger.close()
        let older = Self.temporaryPath()
        _ = try await runProgram("/usr/bin/sqlite3", [older, "PRAGMA page_size = 16384; PRAGMA journal_mode = WAL; CREATE TABLE made_before (x);"])
        let reopened = try SQLiteLedger(path: older)
        #expect(try await reopened.writerPragma("page_size") == 16384)
        #expect(reopened.writerCheckpoint.frames == 16384)
        _ = try await reopened.claim(Self.event(jti: "after"), outcome: .processed, steps: [])
        #expect(try reopened.events().map(\.jti) == ["after"])
        await reopened.close()
    }

    /// Frames in the WAL of the ledger at `path`, as another process's passive checkpoint
    /// reports them; asked again while the ledger's own checkpoint keeps it busy (`1|-1|-1`).
    static func walFrames(_ path: String) async throws -> Int {
        for _ in 0..<200 {
            let answer = try await runProgram("/usr/bin/sqlite3", [path, "PRAGMA wal_checkpoint(PASSIVE)"]).split(separator: "|")
            if answer.first == "0", answer.count == 3, let frames = Int(answer[1]) { return frames }
            try await Task.sleep(for: .milliseconds(10))
        }
        Issue.record("the WAL of \(path) stayed busy")
        return -1
    }

    /// A read transaction of another connection, held until `release`: while it reads the WAL,
    /// the checkpoints cannot copy past the frames it reads; while it reads the database file
    /// alone (the WAL was all copied when it began), they copy nothing. Either way the WAL
    /// cannot start over. Raw SQLite calls, each short: no thread waits while it is held.
    final class HeldSnapshot {
        private var connection: OpaquePointer?
        init(_ path: String) throws {
            guard sqlite3_open_v2(path, &connection, SQLITE_OPEN_READWRITE, nil) == SQLITE_OK,
                  sqlite3_exec(connection, "BEGIN; SELECT count(*) FROM events;", nil, nil, nil) == SQLITE_OK
            else {
                release()
                throw CocoaError(.fileReadUnknown)
            }
        }
        func release() {
            guard let connection else { return }
            sqlite3_exec(connection, "COMMIT", nil, nil, nil)
            sqlite3_close_v2(connection)
            self.connection = nil
        }
        deinit { release() }
    }

    /// The WAL's size from which the tests' ledgers have it start over: above what a new
    /// ledger's schema and first writes make (about 60 frames).
    static let restartFrames = 128

    /// Claims 60 events while a reader holds a snapshot, so that the WAL grows past
    /// `restartFrames` without starting over; returns the reader, still held.
    static func growTheWALHeld(_ ledger: SQLiteLedger, at path: String) async throws -> HeldSnapshot {
        let reader = try HeldSnapshot(path)
        for i in 0..<60 { _ = try await ledger.claim(event(jti: "e-\(i)"), outcome: .processed, steps: []) }
        return reader
    }

    /// The checkpoint thread has the WAL start over once it holds `walRestartBytes` with every
    /// frame copied, long before the writer's own checkpoint (at 256 MiB) would, and nothing is
    /// lost. A reader still on the WAL's older frames defers it: no pass tries while it is there
    /// (each try would hold the writer back). Once it has started over, an idle ledger is not
    /// made to start over again at every pass.
    @Test func theCheckpointThreadHasTheWALStartOver() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path, syncWAL: { fdatasync($0) }, walRestartBytes: Self.restartFrames * 4096)
        let checkpointer = ledger.checkpointer
        _ = try await ledger.claim(Self.event(jti: "first"), outcome: .processed, steps: [])
        let triedBefore = checkpointer.restartAttempts.load(ordering: .acquiring)
        let reader = try await Self.growTheWALHeld(ledger, at: path)
        try await Self.waitForPasses(3, of: ledger)
        let held = try await Self.walFrames(path)
        #expect(held >= Self.restartFrames, "\(held) frames")
        #expect(checkpointer.restartAttempts.load(ordering: .acquiring) == triedBefore)
        reader.release()
        #expect(await eventually { checkpointer.restarts.load(ordering: .acquiring) > 0 })
        // Idle, the WAL is the one just restarted after: no pass tries again.
        let tried = checkpointer.restartAttempts.load(ordering: .acquiring)
        try await Self.waitForPasses(3, of: ledger)
        #expect(checkpointer.restartAttempts.load(ordering: .acquiring) == tried)
        // The next write starts the WAL over: it holds that write's frames, not every write's.
        _ = try await ledger.claim(Self.event(jti: "after"), outcome: .processed, steps: [])
        let frames = try await Self.walFrames(path)
        #expect(frames > 0 && frames < held, "\(frames) frames")
        await ledger.close()
        let reopened = try SQLiteLedger(path: path)
        #expect(try reopened.events().count == 62)
        guard case .intact(let count, _, _) = try await reopened.checkAuditChain() else { Issue.record("the audit chain is broken"); return }
        #expect(count == 62)
        await reopened.close()
    }

    /// The writer checkpoints by itself once the WAL holds `writerCheckpointBytes`, as SQLite's
    /// autocheckpoint did (through a WAL hook of its own, which stops the process on a failed
    /// sync: `aFailedSyncWithinACheckpointStopsTheProcess`); not before.
    @Test func theWriterCheckpointsByItselfOnceTheWALIsLarge() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path, syncWAL: { fdatasync($0) }, writerCheckpointBytes: Self.restartFrames * 4096)
        _ = try await ledger.claim(Self.event(jti: "first"), outcome: .processed, steps: [])
        #expect(ledger.writerCheckpoint.made.load(ordering: .acquiring) == 0)
        let reader = try await Self.growTheWALHeld(ledger, at: path)
        let frames = try await Self.walFrames(path)
        #expect(frames >= Self.restartFrames, "\(frames) frames")
        #expect(ledger.writerCheckpoint.made.load(ordering: .acquiring) > 0)
        reader.release()
        await ledger.close()
    }

    /// A failed sync of the database before the WAL starts over stops the process: the failure
    /// is told once, and SQLite's next sync would succeed and let the WAL, which still holds the
    /// pages, be overwritten. The WAL is left as it was, for the next start to recover from.
    @Test func aFailedSyncBeforeTheWALStartsOverStopsTheProcess() async throws {
        let exit = await #expect(processExitsWith: .failure, observing: [\.standardErrorContent]) {
            let path = SQLiteLedgerTests.temporaryPath()
            let ledger = try SQLiteLedger(path: path, syncWAL: { fdatasync($0) }, walRestartBytes: SQLiteLedgerTests.restartFrames * 4096,
                                          syncDatabase: { _ in
                                              errno = EIO
                                              return -1
                                          })
            _ = try await ledger.claim(SQLiteLedgerTests.event(jti: "first"), outcome: .processed, steps: [])
            try await SQLiteLedgerTests.growTheWALHeld(ledger, at: path).release()
            try await Task.sleep(for: .seconds(10))
        }
        let said = String(decoding: exit?.standardErrorContent ?? [], as: UTF8.self)
        #expect(said.contains("cannot sync the SQLite ledger"), "\(said.suffix(400))")
    }

    /// A sync that failed within one of SQLite's checkpoints stops the process too: the pages
    /// lost may belong to frames an earlier pass counted copied, which no checkpoint copies
    /// again. Any other failure of a checkpoint (busy, a failed read) is left to the next one.
    @Test func aFailedSyncWithinACheckpointStopsTheProcess() async throws {
        for code in [ResultCode.SQLITE_BUSY, .SQLITE_IOERR_READ, .SQLITE_IOERR_WRITE, .SQLITE_FULL] {
            Checkpointer.stopIfSyncFailed(DatabaseError(resultCode: code), path: "/nowhere")
        }
        for code: Int32 in [ResultCode.SQLITE_IOERR_FSYNC.rawValue, ResultCode.SQLITE_IOERR_DIR_FSYNC.rawValue] {
            let exit = await #expect(processExitsWith: .failure, observing: [\.standardErrorContent]) { [code = code as Int32] in
                Checkpointer.stopIfSyncFailed(DatabaseError(resultCode: ResultCode(rawValue: code), message: "disk I/O error"), path: "/nowhere")
            }
            let said = String(decoding: exit?.standardErrorContent ?? [], as: UTF8.self)
            #expect(said.contains("cannot sync the SQLite ledger /nowhere: disk I/O error; stopping"), "\(said.suffix(400))")
        }
    }

    /// Waits for `count` more passes of `ledger`'s checkpoint thread.
    static func waitForPasses(_ count: Int, of ledger: SQLiteLedger) async throws {
        let checkpointer = ledger.checkpointer
        let target = checkpointer.passes.load(ordering: .acquiring) + count
        for _ in 0..<500 where checkpointer.passes.load(ordering: .acquiring) < target { try await Task.sleep(for: .milliseconds(10)) }
        #expect(checkpointer.passes.load(ordering: .acquiring) >= target)
    }

    /// A writeback that fails changes nothing the ledger answers for: every write is still
    /// answered once its WAL is synced, and the events are all there when the file is opened again.
    @Test func aWritebackThatFailsLosesNothing() async throws {
        let path = Self.temporaryPath()
        let failed = Mutex(0)
        let ledger = try SQLiteLedger(path: path, syncWAL: { fdatasync($0) }, startWriteback: { _ in
            failed.withLock { $0 += 1 }
            errno = EIO
            return -1
        })
        for write in 0..<3 {
            _ = try await ledger.record((0..<20).map { .event(Self.event(jti: "w\(write)-\($0)"), outcome: .processed, steps: []) })
            try await Self.waitForPasses(2, of: ledger)
        }
        #expect(failed.withLock { $0 } > 0)
        await ledger.close()
        let reopened = try SQLiteLedger(path: path)
        #expect(try reopened.events().count == 60)
        #expect(try await reopened.checkAuditChain() == .intact(count: 60, seq: 60, head: try await reopened.auditHead().hash))
        await reopened.close()
    }

    /// The checkpoint thread starts the writeback of the pages each pass copied (through
    /// SQLite's own descriptor of the database file), so the writer's checkpoint does not sync a
    /// WAL's worth of them at once; a pass that copied nothing starts none.
    @Test func checkpointsStartTheWritebackOfWhatTheyCopied() async throws {
        let path = Self.temporaryPath()
        let started = Mutex<[(fd: Int32, result: Int32)]>([])
        let ledger = try SQLiteLedger(path: path, syncWAL: { fdatasync($0) }, startWriteback: { fd in
            let result = warden_start_writeback(fd)
            started.withLock { $0.append((fd, result)) }
            return result
        })
        func passesGo(_ count: Int) async throws { try await Self.waitForPasses(count, of: ledger) }
        _ = try await ledger.record((0..<50).map { .event(Self.event(jti: "copied-\($0)"), outcome: .processed, steps: []) })
        try await passesGo(2)
        let afterWrites = started.withLock { $0 }
        let first = try #require(afterWrites.first)
        #expect(afterWrites.allSatisfy { $0.result == 0 }, "sync_file_range: \(afterWrites.map(\.result))")
        // The descriptor is open on the database file (not the WAL).
        var used = stat(), databaseFile = stat()
        #expect(fstat(first.fd, &used) == 0 && stat(path, &databaseFile) == 0)
        #expect(used.st_ino == databaseFile.st_ino)
        // Idle, the passes copy nothing and start nothing.
        try await passesGo(3)
        #expect(started.withLock { $0.count } == afterWrites.count)
        _ = try await ledger.claim(Self.event(jti: "later"), outcome: .processed, steps: [])
        try await passesGo(2)
        #expect(started.withLock { $0.count } > afterWrites.count)
        await ledger.close()
    }

    /// Two ledgers of one process on one file: closing one leaves the other's locks on the file
    /// (SQLite keeps a lock on a database in WAL mode while a connection has it open; another
    /// process closing its last connection would otherwise take the file for unused and delete
    /// the WAL). Closing any descriptor of the file would release every lock the process holds
    /// on it, so the ledger never closes one SQLite does not manage.
    @Test func closingOneLedgerLeavesAnotherOnTheSameFileItsLocks() async throws {
        let path = Self.temporaryPath()
        var file = stat()
        // Read to its end: Foundation's `String(contentsOfFile:)` reads a file of /proc (whose
        // size says 0) only as far as its first read, about 4 KB, and with other tests' locks
        // the table is longer.
        func locksHeld() -> Int {
            let table = FileHandle(forReadingAtPath: "/proc/locks").flatMap { try? $0.readToEnd() }.map { String(decoding: $0, as: UTF8.self) } ?? ""
            let inode = ":\(file.st_ino) "
            return table.split(separator: "\n").filter { $0.contains("POSIX") && $0.contains(" \(getpid()) ") && $0.contains(inode) }.count
        }
        let kept = try SQLiteLedger(path: path)
        _ = try await kept.claim(Self.event(jti: "kept"), outcome: .processed, steps: [])
        #expect(stat(path, &file) == 0)
        do {
            let closed = try SQLiteLedger(path: path)
            _ = try await closed.claim(Self.event(jti: "closed"), outcome: .processed, steps: [])
            try await Self.waitForPasses(2, of: closed)
            #expect(locksHeld() > 0)
            await closed.close()
        }
        try await Task.sleep(for: .milliseconds(50))
        #expect(locksHeld() > 0, "no lock of this process left on the ledger")
        _ = try await kept.claim(Self.event(jti: "after"), outcome: .processed, steps: [])
        await kept.close()
    }

    static func events(_ prefix: String, count: Int, tokenBytes: Int) -> [LedgerEntry] {
        (0..<count).map { i in
            var event = Self.event(jti: "\(prefix)-\(i)")
            event.token = String(repeating: "t", count: tokenBytes)
            return .event(event, outcome: .processed, steps: [])
        }
    }

    static func integrity(_ reader: SQLiteLedgerReader) throws -> [String] {
        try reader.read { try String.fetchAll($0, sql: "PRAGMA integrity_check") }
    }

    /// The ledger's database and WAL copied as a crash would leave them (without the WAL's
    /// index, which SQLite then rebuilds from the WAL's own frames and checksums), and `sql`'s
    /// answer there.
    static func recovered(_ path: String, _ sql: String) async throws -> String {
        let copy = try Scratch.directory("recovered").appendingPathComponent("ledger.sqlite").path
        try FileManager.default.copyItem(atPath: path, toPath: copy)
        try FileManager.default.copyItem(atPath: path + "-wal", toPath: copy + "-wal")
        return try await runProgram("/usr/bin/sqlite3", [copy, sql])
    }

    /// The writer's WAL writes reach the file as one write for each 124 KiB of a commit (SQLite
    /// makes two a frame), the last with the commit's last frame (not left for when SQLite
    /// publishes it); and the writer, which names the file in a URI, opens it at its very path
    /// whatever characters the path holds.
    @Test func aCommitsWALWritesAreGathered() async throws {
        let directory = try Scratch.directory("ledger").appendingPathComponent("a ?#%&=;+ é b")
        let path = directory.appendingPathComponent("ledger.sqlite").path
        let ledger = try SQLiteLedger(path: path)
        #expect(ledger.gathersWALWrites)
        #expect(FileManager.default.fileExists(atPath: path))
        let before = try #require(ledger.walCounts())
        _ = try await ledger.record(Self.events("one-write", count: 200, tokenBytes: 1500))
        let after = try #require(ledger.walCounts())
        // 200 events with tokens of 1.5 KB fill more than 75 pages: SQLite made two writes for each.
        let received = after.received - before.received, made = after.made - before.made
        #expect(received >= 150)
        // About 500 KB: one write for each 124 KiB, and one more when the WAL starts over (its
        // new header is synced before the frames).
        #expect(made <= 6, "\(made) writes for \(received) from SQLite")
        #expect(after.late == before.late, "a commit's last bytes were written only when it was published")
        #expect(try ledger.reader.eventCount() == 200)
        #expect(try Self.integrity(ledger.reader) == ["ok"])
        // The commit is in the WAL file itself.
        #expect(try await Self.recovered(path, "SELECT count(*) FROM events") == "200")
        await ledger.close()
        let beside = try FileManager.default.contentsOfDirectory(atPath: directory.path).filter { !$0.hasPrefix("ledger.sqlite") }
        #expect(beside.isEmpty, "files made beside the ledger: \(beside)")
    }

    /// A commit whose write fails is refused to its caller and is not written to the WAL later
    /// (SQLite reads and releases its locks after the failure; a recovery of the WAL would take
    /// a whole commit written then for a good one), and the ledger goes on.
    @Test func aCommitWhoseWriteFailsNeverReachesTheWAL() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path)
        // A reader holding its snapshot from before the next commits keeps the checkpoints from
        // copying them, and so the WAL from starting over: the write that fails is then the
        // commit's gathered frames, not a new WAL header.
        var held = Configuration()
        held.allowsUnsafeTransactions = true
        let pin = try DatabaseQueue(path: path, configuration: held)
        try pin.inDatabase { db in
            try db.execute(sql: "BEGIN")
            _ = try Int.fetchOne(db, sql: "SELECT count(*) FROM events")
        }
        _ = try await ledger.record(Self.events("before", count: 50, tokenBytes: 1000))
        let before = try #require(ledger.walCounts())
        // Small enough to be gathered whole: the write that fails holds the commit frame.
        ledger.failWALWrites(1)
        await #expect(throws: LedgerError.self) {
            _ = try await ledger.record(Self.events("failed", count: 10, tokenBytes: 1000))
        }
        let after = try #require(ledger.walCounts())
        #expect(after.made - before.made == 1)
        #expect(after.dropped - before.dropped > 10_000, "the write that failed did not hold the commit's frames")
        let counted = "SELECT count(*) FILTER (WHERE jti LIKE 'before-%'), count(*) FILTER (WHERE jti LIKE 'failed-%'), count(*) FILTER (WHERE jti LIKE 'after-%') FROM events"
        #expect(try await Self.recovered(path, counted) == "50|0|0")
        _ = try await ledger.record(Self.events("after", count: 50, tokenBytes: 1000))
        #expect(try await Self.recovered(path, counted) == "50|0|50")
        try pin.inDatabase { try $0.execute(sql: "COMMIT") }
        #expect(try ledger.reader.eventCount() == 100)
        #expect(try Self.integrity(ledger.reader) == ["ok"])
        await ledger.close()
    }

    /// Within one of the writer's transactions, with a page cache of 4 pages: a new table
    /// `table` of 2,000 rows of 300 bytes, then `then`, so that SQLite spills pages into the WAL
    /// (and writes some of them again) before the commit. `failing`: the first WAL write after
    /// the table is made fails, and every failure is passed over, so that only the commit's own
    /// answer counts.
    static func spill(_ db: Database, into table: String, then: String? = nil, failing: Bool = false) throws {
        try db.execute(sql: "PRAGMA cache_size = 4")
        defer { try? db.execute(sql: "PRAGMA cache_size = -65536") }
        try db.execute(sql: "CREATE TABLE \(table) (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        if failing { warden_wal_fail_writes(db.sqliteConnection, 1, SQLITE_IOERR | (3 << 8)) }
        for i in 0..<2000 {
            do {
                try db.execute(sql: "INSERT INTO \(table) (body) VALUES (?)", arguments: [String(repeating: "s", count: 300) + "\(i)"])
            } catch where failing {}
        }
        if let then { try db.execute(sql: then) }
    }

    /// A write that fails in the middle of a transaction (SQLite spilling pages) fails the rest
    /// of it, even if the caller goes on: its commit is refused, nothing of it is in the WAL,
    /// and the next transaction is written as usual.
    @Test func aWriteThatFailsMidTransactionFailsTheTransaction() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path)
        let before = try #require(ledger.walCounts())
        await #expect(throws: LedgerError.self) {
            try await ledger.writer.submit { db in try Self.spill(db, into: "failed_spill", failing: true) }
        }
        let after = try #require(ledger.walCounts())
        #expect(after.dropped > before.dropped, "no write failed")
        _ = try await ledger.record(Self.events("after", count: 20, tokenBytes: 500))
        #expect(try await Self.recovered(path, "SELECT count(*) FROM sqlite_schema WHERE name = 'failed_spill'") == "0")
        #expect(try await Self.recovered(path, "SELECT count(*) FROM events") == "20")
        #expect(try Self.integrity(ledger.reader) == ["ok"])
        await ledger.close()
    }

    /// A transaction larger than the page cache spills pages into the WAL before it commits,
    /// then writes some of them again in place, and rewrites the frames' checksums at its
    /// commit: those writes go to the file at once, after what is gathered, and the commit is
    /// whole in the file.
    @Test func pagesRewrittenWithinATransactionGoStraightToTheFile() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path)
        let before = try #require(ledger.walCounts())
        try await ledger.writer.submit { db in
            try Self.spill(db, into: "spilled", then: "UPDATE spilled SET body = body || 'x' WHERE id % 7 = 0")
        }
        let after = try #require(ledger.walCounts())
        #expect(after.rewrites > before.rewrites, "no page was rewritten in place: the test did not spill")
        #expect(after.late == before.late, "rewritten bytes were left for when SQLite published the commit")
        #expect(try ledger.reader.read { try Int.fetchOne($0, sql: "SELECT count(*) FROM spilled WHERE body LIKE '%x'") } == 285)
        #expect(try Self.integrity(ledger.reader) == ["ok"])
        #expect(try await Self.recovered(path, "SELECT count(*), sum(body LIKE '%x') FROM spilled") == "2000|285")
        _ = try await ledger.record(Self.events("after", count: 20, tokenBytes: 500))
        #expect(try await Self.recovered(path, "SELECT count(*) FROM events") == "20")
        await ledger.close()
    }

    /// Another connection reading while the writer commits sees each commit whole: a commit's
    /// frames are in the WAL before SQLite publishes it in the WAL index. Each claim writes its
    /// event, its token and its audit record in one transaction; a reader that took frames for
    /// written before they were would count them apart, or find the file malformed.
    @Test func readersSeeEveryCommitWhole() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path)
        let reader = try SQLiteLedgerReader(path: path)
        final class Progress: Sendable {
            let done = Atomic(false)
            let reads = Atomic(0)
            let failures = Mutex<[String]>([])
            let stopped = DispatchSemaphore(value: 0)
        }
        let progress = Progress()
        // On a thread of its own: its reads block, and must not hold one of the few threads of
        // Swift's pool that every other test shares.
        Thread {
            while !progress.done.load(ordering: .acquiring), progress.failures.withLock({ $0.count }) < 5 {
                do {
                    let (events, records, bytes) = try reader.read { db in
                        (try Int.fetchOne(db, sql: "SELECT count(*) FROM events") ?? -1,
                         try Int.fetchOne(db, sql: "SELECT count(*) FROM audit_records") ?? -1,
                         try Int.fetchOne(db, sql: "SELECT coalesce(sum(length(token)), 0) FROM event_tokens") ?? -1)
                    }
                    if records != events || bytes != events * 1000 {
                        progress.failures.withLock { $0.append("\(events) events, \(records) audit records, \(bytes) bytes of tokens") }
                    }
                } catch {
                    progress.failures.withLock { $0.append("\(error)") }
                }
                progress.reads.add(1, ordering: .relaxed)
            }
            progress.stopped.signal()
        }.start()
        var batch = 0
        while batch < 100 || progress.reads.load(ordering: .relaxed) < 200, batch < 2000 {
            _ = try await ledger.record(Self.events("read-\(batch)", count: 40, tokenBytes: 1000))
            batch += 1
        }
        progress.done.store(true, ordering: .releasing)
        await progress.stopped.waitOffThePool()
        let failures = progress.failures.withLock { $0 }
        #expect(failures.isEmpty, "\(failures)")
        #expect(progress.reads.load(ordering: .relaxed) >= 200)
        #expect(try reader.eventCount() == batch * 40)
        #expect(try Self.integrity(reader) == ["ok"])
        await ledger.close()
    }

    /// Two ledgers on one file (two writers, each gathering its WAL writes) and another process
    /// writing at once: a commit is in the WAL before its writer lets another take the write
    /// lock, so the file stays whole, holds every event once, and its audit chain is intact.
    @Test func writersOnOneFileKeepItWhole() async throws {
        let path = Self.temporaryPath()
        let first = try SQLiteLedger(path: path), second = try SQLiteLedger(path: path)
        #expect(first.gathersWALWrites && second.gathersWALWrites)
        let script = ["CREATE TABLE IF NOT EXISTS other_process (n INTEGER);"]
            + (0..<200).map { "INSERT INTO other_process VALUES (\($0));" }
        try await withThrowingTaskGroup(of: Void.self) { group in
            for (name, ledger) in [("first", first), ("second", second)] {
                group.addTask {
                    for batch in 0..<50 { _ = try await ledger.record(Self.events("\(name)-\(batch)", count: 20, tokenBytes: 800)) }
                }
            }
            group.addTask { _ = try await runProgram("/usr/bin/sqlite3", ["-cmd", ".timeout 20000", path, script.joined(separator: "\n")]) }
            try await group.waitForAll()
        }
        #expect(try first.reader.eventCount() == 2000)
        #expect(try first.reader.read { try Int.fetchOne($0, sql: "SELECT count(*) FROM other_process") } == 200)
        #expect(try Self.integrity(first.reader) == ["ok"])
        let head = try await second.auditHead()
        #expect(try await first.checkAuditChain() == .intact(count: 2000, seq: head.seq, head: head.hash))
        #expect(try await Self.recovered(path, "SELECT count(*) FROM events") == "2000")
        await first.close()
        await second.close()
    }

    static func pageCacheCounts(pageSize: Int32 = 4096) -> WardenPageCacheCounts {
        var counts = WardenPageCacheCounts()
        warden_page_cache_counts(pageSize, &counts)
        return counts
    }

    /// Claims of random jtis split the (issuer, jti) index's pages in no order, and SQLite then
    /// swaps sibling pages' numbers through the number of the locking bytes' page. That number
    /// never reaches SQLite's own page cache, which would keep it as the largest it was given
    /// and walk every page it holds at the end of the transaction (page_cache.c); the ledger is
    /// whole. (Other tests' ledgers swap too: the count of swaps only shows there were some.)
    @Test func theNumberLentDuringASwapOfPagesNeverReachesSQLitesCache() async throws {
        let swapsBefore = Self.pageCacheCounts().swapsOfPageSize
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        #expect(SQLiteLedger.pageCacheInstalled, "SQLite was initialised before the page cache was installed")
        for round in 0..<20 {
            _ = try await ledger.record((0..<200).map { i in
                .event(Self.event(jti: "\(UUID().uuidString)-\(round)-\(i)"), outcome: .processed, steps: [])
            })
        }
        let counts = Self.pageCacheCounts()
        #expect(counts.swapsOfPageSize > swapsBefore, "no swap of two pages' numbers")
        #expect(counts.lentNumbersGiven == 0)
        #expect(try ledger.reader.eventCount() == 4000)
        #expect(try Self.integrity(ledger.reader) == ["ok"])
        await ledger.close()
    }

    /// SQLite does not count the memory it holds: with the count on, every allocation and free
    /// of the ledger's writer takes one process-wide mutex. Checked once the ledger has written.
    @Test func sqliteDoesNotCountTheMemoryItHolds() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        _ = try await ledger.record((0..<50).map { .event(Self.event(jti: "count-\($0)"), outcome: .processed, steps: []) })
        #expect(!SQLiteLedger.sqliteCountsMemory, "SQLite counts its memory: it was initialised before the count could be turned off")
        await ledger.close()
    }

    /// Through thousands of swaps of pages' numbers, in a page cache of 20 pages (so that pages
    /// are evicted, and dirty ones spilled, around them), with transactions rolled back among
    /// them: what a table holds is what was committed to it, and the file is whole. Pages of
    /// 1 KiB, which no other test uses, so that the swaps counted are this test's.
    @Test func aSmallPageCacheKeepsEveryCommitThroughSwapsOfPages() async throws {
        let path = Self.temporaryPath()
        let queue = try DatabaseQueue(path: path)
        try await queue.writeWithoutTransaction { db in
            try db.execute(sql: "PRAGMA page_size = 1024")
            try db.execute(sql: "PRAGMA cache_size = 20")
            try db.execute(sql: "CREATE TABLE keys (key TEXT PRIMARY KEY, body TEXT NOT NULL) WITHOUT ROWID")
        }
        #expect(try await queue.read { try Int.fetchOne($0, sql: "PRAGMA page_size") } == 1024)
        let swapsBefore = Self.pageCacheCounts(pageSize: 1024).swapsOfPageSize
        var kept = Set<String>()
        struct RolledBack: Error {}
        for round in 0..<60 {
            let added = (0..<300).map { _ in UUID().uuidString }
            let removed = Array(kept.shuffled().prefix(100))
            let rollsBack = round % 5 == 4
            do {
                try await queue.write { db in
                    for key in added {
                        try db.execute(sql: "INSERT INTO keys (key, body) VALUES (?, ?)", arguments: [key, String(repeating: "b", count: 120)])
                    }
                    for key in removed { try db.execute(sql: "DELETE FROM keys WHERE key = ?", arguments: [key]) }
                    if rollsBack { throw RolledBack() }
                }
                kept.formUnion(added)
                kept.subtract(removed)
            } catch is RolledBack {}
        }
        #expect(Self.pageCacheCounts(pageSize: 1024).swapsOfPageSize > swapsBefore + 100, "too few swaps of two pages' numbers")
        #expect(Self.pageCacheCounts().lentNumbersGiven == 0)
        let stored = try await queue.read { try String.fetchAll($0, sql: "SELECT key FROM keys ORDER BY key") }
        // Compared in counts, not lists of thousands of keys.
        let missing = kept.subtracting(stored).count, unexpected = stored.count - (kept.count - missing)
        let same = stored == kept.sorted()
        #expect(same, "\(missing) committed keys missing, \(unexpected) rows not committed, of \(kept.count)")
        #expect(try await queue.read { try String.fetchAll($0, sql: "PRAGMA integrity_check") } == ["ok"])
        try queue.close()
    }

    /// A new event's token is kept apart from its row (which its outcome rewrites); events of
    /// a ledger written before that keep theirs in the row, and both read back whole.
    @Test func tokensOfEventsRecordedBeforeAndAfterTheyMovedToATableOfTheirOwn() async throws {
        let path = Self.temporaryPath()
        try SQLiteLedger.create(path: path, upTo: "v3-lease")
        _ = try await runProgram("/usr/bin/sqlite3", [path, """
            INSERT INTO events (issuer, jti, token, source, event_types, subject, key_id, algorithm, key_thumbprint,
                                issued_at, received_at, outcome, steps, updated_at)
            VALUES ('https://issuer.example/', 'old', 'old.token.sig', 'kafka:t/0/0', '[]', NULL, 'k1', 'RS256', 'tp',
                    1800000000, 1800000001, 'processed', '[]', 1800000001)
            """])
        let ledger = try SQLiteLedger(path: path)
        guard case .duplicate = try await ledger.claim(Self.event(jti: "old"), outcome: .pending, steps: []) else {
            Issue.record("the event recorded before the migration is not found")
            return
        }
        var new = Self.event(jti: "new")
        new.tokenBytes = Array("new.token.sig".utf8)
        guard case .new(let id) = try await ledger.claim(new, outcome: .pending, steps: []) else {
            Issue.record("a new event was not claimed")
            return
        }
        #expect(try ledger.events().map(\.token) == ["old.token.sig", "new.token.sig"])
        #expect(try await runProgram("/usr/bin/sqlite3", [path, "SELECT length(e.token), t.token FROM events e JOIN event_tokens t ON t.event_id = e.id"])
            == "0|new.token.sig")
        try await ledger.record(outcome: .processed, forEvent: id)
        #expect(try ledger.events().map(\.token) == ["old.token.sig", "new.token.sig"])
    }

    /// The steps' status check is made of comparisons, so inserting or updating a step builds
    /// no temporary b-tree; a ledger from before keeps its steps and still refuses an unknown
    /// status. Each event keeps its token's digest; the outcome of an event claimed before
    /// that names its token's digest, read from the token.
    @Test func stepsKeepTheirCheckWithoutATemporaryTableAndOlderEventsOutcomesNameTheirTokensDigest() async throws {
        let path = Self.temporaryPath()
        try SQLiteLedger.create(path: path, upTo: "v7-retention")
        _ = try await runProgram("/usr/bin/sqlite3", [path, """
            INSERT INTO events (id, issuer, jti, token, source, event_types, subject, key_id, algorithm, key_thumbprint,
                                issued_at, received_at, outcome, steps, updated_at)
            VALUES (1, 'https://issuer.example/', 'old', '', 'kafka:t/0/0', '["urn:x"]', NULL, 'k1', 'RS256', 'tp',
                    1800000000, 1800000001, 'pending', '["sessions"]', 1800000001);
            INSERT INTO event_tokens (event_id, token) VALUES (1, 'old.token.sig');
            INSERT INTO steps (event_id, idx, kind, action, status, detail, updated_at, attempts)
            VALUES (1, 0, 'sessions', '{}', 'pending', NULL, 1800000001, 2);
            """])
        let ledger = try SQLiteLedger(path: path)
        #expect(try await runProgram("/usr/bin/sqlite3", [path, "SELECT event_id, idx, kind, status, attempts FROM steps"])
            == "1|0|sessions|pending|2")
        for statement in ["INSERT INTO steps (event_id, idx, kind, action, status, detail, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                          "UPDATE steps SET status = ?, detail = ? WHERE event_id = ? AND idx = ? AND status = 'pending'"] {
            let plan = try await runProgram("/usr/bin/sqlite3", [path, "EXPLAIN " + statement])
            #expect(plan.contains("Insert") || plan.contains("IdxInsert"))
            #expect(!plan.contains("OpenEphemeral"), "\(statement)")
        }
        do {
            _ = try await runProgram("/usr/bin/sqlite3", [path, """
                INSERT INTO steps (event_id, idx, kind, action, status, detail, updated_at) VALUES (1, 1, 'x', '{}', 'maybe', NULL, 0)
                """])
            Issue.record("a step with an unknown status was inserted")
        } catch {
            #expect("\(error)".contains("CHECK constraint failed"))
        }
        // The older event's outcome: its token's digest, read from the token.
        let refusals = try await ledger.recordSteps([RecordedStep(eventID: 1, index: 0, status: .done, detail: "ok", finishing: .processed)]).refusals
        #expect(refusals.count == 1 && refusals.allSatisfy { $0 == nil })
        let old = try #require(try await ledger.auditRecords(afterSeq: 0, limit: 10).last?.record)
        #expect(old.contains(#""token_sha256":"\#(AuditChain.sha256Hex(Array("old.token.sig".utf8)))""#))
        #expect(old.contains(#""jti":"old""#) && old.contains(#""attempts":3"#))

        // A new event keeps its digest; its outcome's record is made from the claim.
        var new = Self.event(jti: "new")
        new.tokenBytes = Array("new.token.sig".utf8)
        let steps = [OutboxStep(index: 0, kind: "sessions", action: "{}")]
        guard case .new(let id) = try await ledger.claim(new, outcome: .pending, steps: steps) else {
            Issue.record("a new event was not claimed")
            return
        }
        let digest = AuditChain.sha256Hex(Array("new.token.sig".utf8))
        #expect(new.tokenSHA256 == digest)
        #expect(try await runProgram("/usr/bin/sqlite3", [path, "SELECT token_sha256 FROM events WHERE id = \(id)"]) == digest)
        #expect(ledger.claimed.count == 1)
        // Made from the claim, not read back: a subject changed behind the ledger's back is not seen.
        _ = try await runProgram("/usr/bin/sqlite3", [path, "UPDATE events SET subject = '{}' WHERE id = \(id)"])
        _ = try await ledger.recordSteps([RecordedStep(eventID: id, index: 0, status: .done, detail: "ok", finishing: .processed)])
        #expect(ledger.claimed.count == 0)
        let record = try #require(try await ledger.auditRecords(afterSeq: 0, limit: 10).last?.record)
        #expect(record.contains(#""token_sha256":"\#(digest)""#) && record.contains(#""jti":"new""#))
        // Replay's lookups name the same digests: the one kept, and the older event's from its token.
        let states = try await ledger.eventStates([EventKey(issuer: "https://issuer.example/", jti: "old"),
                                                   EventKey(issuer: "https://issuer.example/", jti: "new")])
        #expect(states[EventKey(issuer: "https://issuer.example/", jti: "old")]?.tokenSHA256 == AuditChain.sha256Hex(Array("old.token.sig".utf8)))
        #expect(states[EventKey(issuer: "https://issuer.example/", jti: "new")]?.tokenSHA256 == digest)
        #expect(record.contains(#""outcome":"processed""#) && record.contains(#""status":"done""#))
        #expect(record.contains(#"\"sub\":\"1\""#))

        // A claim kept for an id whose row is now another claim (another process's write, an id
        // used again: another jti, or the same one received at another time) is not used: the
        // record is read from the row.
        for (n, change) in ["jti = 'replaced'", "received_at = 1800000099"].enumerated() {
            var other = Self.event(jti: "other-\(n)")
            other.tokenBytes = Array("other.token.sig".utf8)
            guard case .new(let otherID) = try await ledger.claim(other, outcome: .pending, steps: steps) else {
                Issue.record("a new event was not claimed")
                return
            }
            _ = try await runProgram("/usr/bin/sqlite3", [path, "UPDATE events SET \(change), subject = '{}' WHERE id = \(otherID)"])
            _ = try await ledger.recordSteps([RecordedStep(eventID: otherID, index: 0, status: .done, detail: "ok", finishing: .processed)])
            let replaced = try #require(try await ledger.auditRecords(afterSeq: 0, limit: 10).last?.record)
            #expect(replaced.contains(n == 0 ? #""jti":"replaced""# : #""received_at":"2027-01-15T08:01:39.000Z""#), "\(replaced)")
            #expect(replaced.contains(#""subject":"{}""#), "\(replaced)")
            #expect(try await runProgram("/usr/bin/sqlite3", [path, "SELECT outcome FROM events WHERE id = \(otherID)"]) == "processed")
        }
        await ledger.close()
    }

    /// Committed writes reach the database file beside the writer, well before the WAL is
    /// large enough for the writer to stop and checkpoint it itself.
    @Test func committedWritesAreCopiedIntoTheDatabaseInTheBackground() async throws {
        let path = Self.temporaryPath()
        let ledger = try SQLiteLedger(path: path)
        for jti in ["a", "b", "c"] { _ = try await ledger.claim(Self.event(jti: jti), outcome: .pending, steps: []) }
        // The database file alone (without its WAL), as a copy read by another program.
        let copy = Self.temporaryPath()
        try FileManager.default.createDirectory(atPath: URL(fileURLWithPath: copy).deletingLastPathComponent().path,
                                                withIntermediateDirectories: true)
        var copied = false
        for _ in 0..<250 where !copied {
            try? FileManager.default.removeItem(atPath: copy)
            try FileManager.default.copyItem(atPath: path, toPath: copy)
            copied = (try? await runProgram("/usr/bin/sqlite3", [copy, "SELECT count(*) FROM events"])) == "3"
            if !copied { try await Task.sleep(for: .milliseconds(20)) }
        }
        #expect(copied)
        await ledger.close()
    }

    /// A write that holds the writer thread inside its transaction until released.
    struct HeldWrite {
        let gate = DispatchSemaphore(value: 0)
        let committed: Task<BatchWriter.Commit, any Error>

        init(_ ledger: SQLiteLedger) async {
            let entered = DispatchSemaphore(value: 0), gate = self.gate
            committed = Task {
                try await ledger.writer.submitTimed { _ in
                    entered.signal()
                    gate.wait()
                }.1
            }
            await entered.waitOffThePool()
        }

        /// Lets it commit; returns when it did.
        func release() async throws -> BatchWriter.Commit {
            gate.signal()
            return try await committed.value
        }
    }

    /// A step's outcome queued while an intake write runs joins that write's transaction: it is
    /// durable with its commit, not after a transaction (and a sync) of its own.
    @Test func anUrgentWriteQueuedDuringAnotherJoinsItsTransaction() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let intake = await HeldWrite(ledger)
        async let urgent = ledger.writer.submitTimed(urgent: true) { _ in 2 }
        #expect(await eventually { ledger.writer.urgentQueued == 1 })
        let intakeCommit = try await intake.release()
        let (second, urgentCommit) = try await urgent
        #expect(second == 2)
        #expect(urgentCommit == intakeCommit)
        await ledger.close()
    }

    /// Urgent writes queued while the writer is busy are committed a few to a transaction
    /// (`urgentPerTransaction`), oldest first, all before the intake's next write. Once the
    /// writer fell behind, one transaction took every outcome queued, and each waited for all.
    @Test func urgentWritesAreCommittedAFewToATransactionBeforeTheIntakesNext() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let held = await HeldWrite(ledger)
        async let intake = ledger.writer.submitTimed(alone: true) { _ in 0 }
        #expect(await eventually { ledger.writer.queued == 1 })
        let perTransaction = BatchWriter.urgentPerTransaction
        var urgent: [Task<BatchWriter.Commit, any Error>] = []
        for i in 0...(2 * perTransaction) {
            urgent.append(Task { try await ledger.writer.submitTimed(urgent: true) { _ in i }.1 })
            #expect(await eventually { ledger.writer.urgentQueued == i + 1 })
        }
        let heldCommit = try await held.release()
        var commits: [Int] = []
        for write in urgent { commits.append(try await write.value.number) }
        // The oldest join the write under way; the others follow, as many to a transaction.
        #expect(commits == commits.indices.map { heldCommit.number + $0 / perTransaction })
        #expect(Set(commits).count == 3, "not every urgent write in the one under way")
        #expect(try await intake.1.number == commits.last! + 1, "the intake's next write waits for every urgent one")
        await ledger.close()
    }

    /// Closing (on SIGTERM) while outcomes and an intake write are queued behind a write under
    /// way commits every one of them, outcomes first, before the ledger closes: none is left
    /// unanswered behind the urgent ones.
    @Test(.timeLimit(.minutes(1))) func closingCommitsTheUrgentAndTheIntakeWritesQueued() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let held = await HeldWrite(ledger)
        async let intake = ledger.writer.submitTimed(alone: true) { db in
            try SQLiteLedger.claimForTesting(Self.event(jti: "queued"), in: db)
        }
        #expect(await eventually { ledger.writer.queued == 1 })
        var urgent: [Task<BatchWriter.Commit, any Error>] = []
        for i in 0...(2 * BatchWriter.urgentPerTransaction) {
            urgent.append(Task { try await ledger.writer.submitTimed(urgent: true) { _ in i }.1 })
            #expect(await eventually { ledger.writer.urgentQueued == i + 1 })
        }
        let closing = Task { await ledger.close() }
        _ = try await held.release()
        var commits: [Int] = []
        for write in urgent { commits.append(try await write.value.number) }
        let (claim, intakeCommit) = try await intake
        guard case .new = claim else { Issue.record("the queued intake write was not committed: \(claim)"); return }
        #expect(commits.allSatisfy { $0 < intakeCommit.number })
        await closing.value
        #expect(try ledger.events().map(\.jti) == ["queued"])
    }

    /// Writes queued together share a transaction, except a write its caller sized (`alone`,
    /// the pipeline's intake batches): it is committed by itself, so a step's outcome never
    /// waits for several of them.
    @Test func aWriteSizedByItsCallerIsCommittedAlone() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let held = await HeldWrite(ledger)
        // Queued in this order while the writer is held: two grouped, two alone, one grouped.
        async let x = ledger.writer.submitTimed { _ in 1 }
        #expect(await eventually { ledger.writer.queued == 1 })
        async let y = ledger.writer.submitTimed { _ in 2 }
        #expect(await eventually { ledger.writer.queued == 2 })
        async let a = ledger.writer.submitTimed(alone: true) { _ in 3 }
        #expect(await eventually { ledger.writer.queued == 3 })
        async let b = ledger.writer.submitTimed(alone: true) { _ in 4 }
        #expect(await eventually { ledger.writer.queued == 4 })
        async let z = ledger.writer.submitTimed { _ in 5 }
        #expect(await eventually { ledger.writer.queued == 5 })
        let heldCommit = try await held.release()
        let commits = try await [heldCommit, x.1, y.1, a.1, b.1, z.1]
        #expect(commits[1] == commits[2], "two grouped writes queued together share a transaction")
        #expect(Set(commits[2...]).count == 4, "each write alone has a transaction of its own: \(commits)")
        #expect(commits == commits.sorted(), "in the order queued")
        await ledger.close()
    }

    /// Issue 10, defect 10: a revocation answered under load was made again after a SIGKILL,
    /// because its outcome waited behind the intake's ledger writes. An outcome queued behind
    /// several intake writes is committed with the one under way, before the others.
    @Test func aStepsOutcomeIsNotQueuedBehindIntakeWrites() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let underWay = await HeldWrite(ledger)
        async let first = ledger.writer.submitTimed(alone: true) { _ in 1 }
        #expect(await eventually { ledger.writer.queued == 1 })
        async let second = ledger.writer.submitTimed(alone: true) { _ in 2 }
        #expect(await eventually { ledger.writer.queued == 2 })
        async let outcome = ledger.writer.submitTimed(urgent: true) { _ in 3 }
        #expect(await eventually { ledger.writer.urgentQueued == 1 })
        let underWayCommit = try await underWay.release()
        let (firstCommit, secondCommit, outcomeCommit) = try await (first.1, second.1, outcome.1)
        #expect(outcomeCommit == underWayCommit, "the outcome joins the write under way")
        #expect(outcomeCommit < firstCommit && outcomeCommit < secondCommit)
        await ledger.close()
    }

    /// An urgent write that fails while joining an intake write fails alone: the intake write
    /// is tried again by itself and committed.
    @Test(.timeLimit(.minutes(1))) func anUrgentWriteThatFailsWhileJoiningAnotherFailsAlone() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let entered = DispatchSemaphore(value: 0), gate = DispatchSemaphore(value: 0)
        let first = Mutex(true)
        async let intake: Claim = ledger.writer.submit { db in
            if first.withLock({ f in defer { f = false }; return f }) {
                entered.signal()
                gate.wait()
            }
            return try SQLiteLedger.claimForTesting(Self.event(jti: "kept"), in: db)
        }
        await entered.waitOffThePool()
        async let urgent: Void = ledger.writer.submit(urgent: true) { _ in throw LedgerError(.refused, "never recordable") }
        #expect(await eventually { ledger.writer.urgentQueued == 1 })
        gate.signal()
        guard case .new = try await intake else { Issue.record("the intake write was not committed"); return }
        var failed = false
        do { try await urgent } catch { failed = true }
        #expect(failed)
        #expect(try ledger.events().map(\.jti) == ["kept"])
        await ledger.close()
    }

    @Test func firstClaimIsNewThenDuplicate() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let first = try await ledger.claim(Self.event(jti: "a"), outcome: .pending, steps: [OutboxStep(index: 0, kind: "purge-set", action: "{}")])
        guard case .new(let id) = first else { Issue.record("first claim was \(first)"); return }
        #expect(try await ledger.claim(Self.event(jti: "a", source: "kafka:t/0/9"), outcome: .pending, steps: []) == .duplicate(eventID: id))
        // Same jti from another issuer is another event.
        if case .duplicate = try await ledger.claim(Self.event(jti: "a", issuer: "https://other.example/"), outcome: .pending, steps: []) {
            Issue.record("a jti is unique per issuer, not globally")
        }
        // The duplicate claim did not touch the plan.
        var events = try ledger.events()
        #expect(events.count == 2)
        #expect(events.first?.outcome == "pending")
        #expect(events.first?.steps == #"["purge-set"]"#)
        try await ledger.record(outcome: .processed, forEvent: id)
        events = try ledger.events()
        #expect(events.first?.outcome == "processed")
        let deliveries = try ledger.deliveries()
        // The event row is the first delivery; later ones are recorded as duplicates.
        #expect(deliveries.map(\.verdict) == ["duplicate"])
        #expect(deliveries.first?.source == "kafka:t/0/9")
        #expect(deliveries.first?.eventID == id)
        #expect(events.first?.source == "kafka:t/0/1")
        await ledger.close()
    }

    @Test func emptyAndEscapedValuesAreStoredAsGiven() async throws {
        // Values are bound straight to SQLite: an empty string stays a string (not NULL, which
        // the NOT NULL columns would refuse), and quotes are data, not SQL.
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        var event = Self.event(jti: "it's \"quoted\"")
        event.keyID = ""
        event.subject = nil
        guard case .new = try await ledger.claim(event, outcome: .processed, steps: []) else {
            Issue.record("the first claim must be new"); return
        }
        guard case .duplicate = try await ledger.claim(event, outcome: .processed, steps: []) else {
            Issue.record("the second claim must be a duplicate"); return
        }
        #expect(try ledger.events().map(\.jti) == ["it's \"quoted\""])
        await ledger.close()
    }

    @Test func rowsOfOneWriteKeepTheirOwnValues() async throws {
        // One binder buffer serves every row of a write: each row must read back exactly its
        // own values, whatever the lengths of the rows before it; event types are JSON arrays
        // with quotes, backslashes and control characters escaped.
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        var long = Self.event(jti: String(repeating: "j", count: 300), source: "kafka:" + String(repeating: "s", count: 500))
        long.token = String(repeating: "t", count: 2000) + ".p.s"
        long.eventTypes = ["urn:a", #"urn:"quoted"\back"#, "urn:tab\tnl\ncr\r\u{1}", "urn:é"]
        var short = Self.event(jti: "s", source: "push")
        short.eventTypes = []
        let entries: [LedgerEntry] = [
            .event(long, outcome: .pending, steps: [OutboxStep(index: 0, kind: "purge-set", action: "{}"),
                                                    OutboxStep(index: 1, kind: "revoke-tokens", action: "{}")]),
            .event(short, outcome: .processed, steps: []),
            .event(Self.event(jti: "m"), outcome: .unresolved, steps: []),
        ]
        _ = try await ledger.record(entries)
        let events = try ledger.events()
        #expect(events.map(\.jti) == [long.jti, "s", "m"])
        #expect(events.map(\.source) == [long.source, "push", "kafka:t/0/1"])
        #expect(events.map(\.token) == [long.token, short.token, "h.p.s"])
        #expect(events.map(\.outcome) == ["pending", "processed", "unresolved"])
        #expect(events.map(\.steps) == [#"["purge-set","revoke-tokens"]"#, "[]", "[]"])
        let types = try events.map { try JSONSerialization.jsonObject(with: Data($0.eventTypes.utf8)) as? [String] }
        #expect(types == [long.eventTypes, [], Self.event(jti: "m").eventTypes])
        #expect(events[0].eventTypes.contains(#"\u0001"#))
        await ledger.close()
    }

    @Test func concurrentClaimsOfOneJTIYieldExactlyOneNew() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let results = await withTaskGroup(of: Claim?.self) { group in
            for i in 0..<64 {
                group.addTask { try? await ledger.claim(Self.event(jti: "same", source: "kafka:t/0/\(i)"), outcome: .pending, steps: []) }
            }
            var out: [Claim?] = []
            for await r in group { out.append(r) }
            return out
        }
        #expect(results.allSatisfy { $0 != nil })
        #expect(results.filter { if case .new = $0 { true } else { false } }.count == 1)
        #expect(try ledger.deliveries().count == 63)
        #expect(try ledger.events().count == 1)
        await ledger.close()
    }

    @Test func aBatchIsRecordedInOrderInOneWrite() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        let rejection = Rejection(token: Array("x.y.z".utf8), source: "kafka:t/0/2", code: "invalid_key",
                                  description: "bad signature", receivedAt: 1)
        let claims = try await ledger.record([
            .event(Self.event(jti: "b1", source: "kafka:t/0/1"), outcome: .pending, steps: []),
            .rejection(rejection),
            .event(Self.event(jti: "b1", source: "kafka:t/0/3"), outcome: .pending, steps: []),
            .event(Self.event(jti: "b2", source: "kafka:t/0/4"), outcome: .pending, steps: []),
        ])
        guard case .new(let first)? = claims[0], case .new(let second)? = claims[3] else {
            Issue.record("unexpected claims \(claims)")
            return
        }
        #expect(claims[1] == nil)
        #expect(claims[2] == .duplicate(eventID: first))
        #expect(second > first)
        #expect(try ledger.deliveries().map(\.verdict) == ["invalid", "duplicate"])
        await ledger.close()
    }

    @Test func rejectionsAreRecordedWithTheirError() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        try await ledger.recordRejection(Rejection(token: Array("not-a-token".utf8), source: "kafka:t/1/3",
                                                   code: "invalid_key", description: "bad signature", receivedAt: 1))
        let deliveries = try ledger.deliveries()
        #expect(deliveries.count == 1)
        #expect(deliveries.first?.verdict == "invalid")
        #expect(deliveries.first?.errorCode == "invalid_key")
        #expect(deliveries.first?.eventID == nil)
        await ledger.close()
    }

    @Test func recordingAnUnknownEventFails() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        await #expect(throws: LedgerError.self) { try await ledger.record(outcome: .processed, forEvent: 42) }
        await ledger.close()
    }

    @Test func survivesReopeningAndMigratesOnce() async throws {
        let path = Self.temporaryPath()
        do {
            let ledger = try SQLiteLedger(path: path)
            _ = try await ledger.claim(Self.event(jti: "kept"), outcome: .pending, steps: [])
            await ledger.close()
        }
        let reopened = try SQLiteLedger(path: path)
        #expect(try reopened.events().map(\.jti) == ["kept"])
        if case .new = try await reopened.claim(Self.event(jti: "kept"), outcome: .pending, steps: []) { Issue.record("a claim was lost across reopening") }
        await reopened.close()
    }

    @Test func closedLedgerRefusesWrites() async throws {
        let ledger = try SQLiteLedger(path: Self.temporaryPath())
        await ledger.close()
        await #expect(throws: LedgerError.self) { _ = try await ledger.claim(Self.event(jti: "late"), outcome: .pending, steps: []) }
    }
}

@Suite("Ledger outbox")
struct LedgerOutboxTests {
    @Test func stepsAreClaimedWithTheEventAndTheirOutcomesSurviveReopening() async throws {
        let path = SQLiteLedgerTests.temporaryPath()
        let planned = [OutboxStep(index: 0, kind: "purge-set", action: #"{"purgeSet":{"set":"s:u","target":"sessions"}}"#),
                       OutboxStep(index: 1, kind: "notify", action: #"{"notify":{"target":"app"}}"#)]
        let id: Int64
        do {
            let ledger = try SQLiteLedger(path: path)
            guard case .new(let claimed) = try await ledger.claim(SQLiteLedgerTests.event(jti: "o"), outcome: .pending, steps: planned)
            else { Issue.record("not new"); return }
            id = claimed
            #expect(try await ledger.steps(ofEvent: id) == planned)
            try await ledger.recordStep(0, of: id, status: .done, detail: "3 keys deleted")
            // A redelivery does not touch the outbox.
            _ = try await ledger.claim(SQLiteLedgerTests.event(jti: "o"), outcome: .pending, steps: [])
            await #expect(throws: LedgerError.self) { try await ledger.recordStep(7, of: id, status: .done, detail: "") }
            await ledger.close()
        }
        let reopened = try SQLiteLedger(path: path)
        let steps = try await reopened.steps(ofEvent: id)
        #expect(steps.map(\.status) == [.done, .pending])
        #expect(steps[0].detail == "3 keys deleted")
        #expect(try SQLiteLedgerReader(path: path).steps(ofEvent: id) == steps)
        try await reopened.record(outcome: .processed, forEvent: id)
        #expect(try reopened.events().first?.outcome == "processed")
        await reopened.close()
    }

    /// The benchmark's scan-free count: every event but those with a step still pending (one
    /// with two pending steps counted once; a failed step is finished).
    @Test func eventsWithoutPendingStepsAreCountedFromTheNewestIDAndThePendingSteps() async throws {
        let path = SQLiteLedgerTests.temporaryPath()
        let ledger = try SQLiteLedger(path: path)
        let reader = try SQLiteLedgerReader(path: path)
        let two = [OutboxStep(index: 0, kind: "purge-set", action: "{}"), OutboxStep(index: 1, kind: "notify", action: "{}")]
        var ids: [Int64] = []
        for jti in ["a", "b", "c", "d"] {
            guard case .new(let id) = try await ledger.claim(SQLiteLedgerTests.event(jti: jti), outcome: jti == "d" ? .processed : .pending,
                                                             steps: jti == "d" ? [] : two)
            else { Issue.record("not new"); return }
            ids.append(id)
        }
        #expect(try reader.eventsWithoutPendingSteps() == 1)
        try await ledger.recordStep(0, of: ids[0], status: .done, detail: "")
        #expect(try reader.eventsWithoutPendingSteps() == 1)
        try await ledger.recordStep(1, of: ids[0], status: .done, detail: "")
        try await ledger.recordStep(0, of: ids[1], status: .failed, detail: "refused")
        try await ledger.recordStep(1, of: ids[1], status: .failed, detail: "refused")
        #expect(try reader.eventsWithoutPendingSteps() == 3)
        await ledger.close()
    }
}

@Suite("Ledger JSON text")
struct LedgerJSONTests {
    @Test func stepListsAreValidJSON() async throws {
        let ledger = try SQLiteLedger(path: SQLiteLedgerTests.temporaryPath())
        let awkward = ["plain", "quote \" backslash \\ newline \n tab \t", "ünïcödé", ""]
        let steps = awkward.enumerated().map { OutboxStep(index: $0.offset, kind: $0.element, action: "{}") }
        guard case .new = try await ledger.claim(SQLiteLedgerTests.event(jti: "j"), outcome: .pending, steps: steps) else {
            Issue.record("not new")
            return
        }
        let text = try #require(try ledger.events().first?.steps)
        let decoded = try JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String]
        #expect(decoded == awkward)
        await ledger.close()
    }
}
