import Foundation
@testable import Ledger
import Logging
import Synchronization
import Testing
import WardenTestSupport

/// The ledger's contract, run against every back end: SQLite in a temporary file, and a real
/// PostgreSQL server started for the test.
enum Backend: String, CaseIterable, Sendable, CustomTestStringConvertible {
    case sqlite, postgres
    var testDescription: String { rawValue }
}

/// A ledger under test and what keeps it alive; `reopen` opens the same storage again.
final class LedgerUnderTest: Sendable {
    /// The PostgreSQL ledgers' connection pools, running until this ends.
    private let pools = Mutex<[Task<Void, Never>]>([])
    let backend: Backend
    let path: String
    let server: PostgresServer?
    let database: String

    init(_ backend: Backend) async throws {
        self.backend = backend
        path = SQLiteLedgerTests.temporaryPath()
        server = backend == .postgres ? try await PostgresServer() : nil
        database = try await server?.createDatabase() ?? ""
    }

    deinit {
        pools.withLock { $0.forEach { $0.cancel() } }
    }

    func open() async throws -> any Ledger {
        var logger = Logger(label: "ledger-test")
        logger.logLevel = .critical
        switch backend {
        case .sqlite: return try SQLiteLedger(path: path)
        case .postgres:
            let ledger = PostgresLedger(.init(host: "127.0.0.1", port: server!.port, username: server!.username, database: database),
                                        logger: logger)
            pools.withLock { $0.append(Task { await ledger.run() }) }
            try await ledger.open()
            return ledger
        }
    }
}

@Suite("Ledger contract, every back end", .serialized)
struct LedgerContractTests {
    typealias E = SQLiteLedgerTests

    @Test(arguments: Backend.allCases) func claimsAreNewThenDuplicatePerIssuer(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await storage.open()
        guard case .new(let id) = try await ledger.claim(E.event(jti: "a"), outcome: .pending, steps: []) else {
            Issue.record("the first claim must be new"); return
        }
        #expect(try await ledger.claim(E.event(jti: "a", source: "kafka:t/0/9"), outcome: .pending, steps: []) == .duplicate(eventID: id))
        guard case .new = try await ledger.claim(E.event(jti: "a", issuer: "https://other.example/"), outcome: .pending, steps: []) else {
            Issue.record("a jti is unique per issuer, not globally"); return
        }
        #expect(try await ledger.events().map(\.jti) == ["a", "a"])
        let deliveries = try await ledger.deliveries()
        #expect(deliveries.map(\.verdict) == ["duplicate"] && deliveries.first?.eventID == id && deliveries.first?.source == "kafka:t/0/9")
        await ledger.close()
    }

    @Test(arguments: Backend.allCases) func concurrentClaimsOfOneJTIMakeExactlyOneNew(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await storage.open()
        let claims = await withTaskGroup(of: Claim?.self) { group in
            for i in 0..<32 {
                group.addTask { try? await ledger.claim(E.event(jti: "same", source: "kafka:t/0/\(i)"), outcome: .pending, steps: []) }
            }
            var all: [Claim?] = []
            for await claim in group { all.append(claim) }
            return all
        }
        #expect(claims.filter { if case .new? = $0 { true } else { false } }.count == 1)
        #expect(claims.filter { if case .duplicate? = $0 { true } else { false } }.count == 31)
        await ledger.close()
    }

    @Test(arguments: Backend.allCases) func aBatchIsRecordedInOrderWithRejectionsAndSurvivesReopening(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        do {
            let ledger = try await storage.open()
            let claims = try await ledger.record([
                .event(E.event(jti: "b1", source: "kafka:t/0/1"), outcome: .pending, steps: []),
                .rejection(Rejection(token: [0xFF, 0x00, 0x41], source: "kafka:t/0/2", code: "invalid_key",
                                     description: "bad signature", receivedAt: 1)),
                .event(E.event(jti: "b1", source: "kafka:t/0/3"), outcome: .pending, steps: []),
                .event(E.event(jti: "b2", source: "kafka:t/0/4"), outcome: .processed, steps: []),
            ])
            guard case .new(let first)? = claims[0], case .new(let second)? = claims[3] else { Issue.record("\(claims)"); return }
            #expect(claims[1] == nil && claims[2] == .duplicate(eventID: first) && second > first)
            await ledger.close()
        }
        let reopened = try await storage.open()
        #expect(try await reopened.events().map(\.outcome) == ["pending", "processed"])
        #expect(try await reopened.events().map(\.token) == [E.event(jti: "b1").token, E.event(jti: "b2").token])
        #expect(try await reopened.deliveries().map(\.verdict) == ["invalid", "duplicate"])
        #expect(try await reopened.deliveries().first?.errorCode == "invalid_key")
        if case .new = try await reopened.claim(E.event(jti: "b2"), outcome: .pending, steps: []) { Issue.record("a claim was lost") }
        await reopened.close()
    }

    @Test(arguments: Backend.allCases) func theOutboxKeepsEachStepsOutcome(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let planned = [OutboxStep(index: 0, kind: "purge-set", action: #"{"a":1}"#), OutboxStep(index: 1, kind: "notify", action: #"{"b":2}"#)]
        let id: Int64
        do {
            let ledger = try await storage.open()
            guard case .new(let claimed) = try await ledger.claim(E.event(jti: "o"), outcome: .pending, steps: planned) else {
                Issue.record("not new"); return
            }
            id = claimed
            #expect(try await ledger.steps(ofEvent: id) == planned)
            try await ledger.recordStep(0, of: id, status: .done, detail: "2 keys deleted")
            _ = try await ledger.claim(E.event(jti: "o"), outcome: .pending, steps: [])  // a redelivery: outbox untouched
            await #expect(throws: LedgerError.self) { try await ledger.recordStep(5, of: id, status: .done, detail: "") }
            // A step is recorded once: a second owner of the event (after a rebalance) learns
            // that it was not first, and the first outcome stays.
            do {
                try await ledger.recordStep(0, of: id, status: .failed, detail: "late")
                Issue.record("a recorded step was recorded again")
            } catch {
                #expect(error.kind == .conflict && error.message.contains("already recorded done"))
            }
            await #expect(throws: LedgerError.self) { try await ledger.record(outcome: .processed, forEvent: id + 100) }
            await ledger.close()
        }
        let reopened = try await storage.open()
        #expect(try await reopened.steps(ofEvent: id).map(\.status) == [.done, .pending])
        try await reopened.recordStep(1, of: id, status: .failed, detail: "refused", finishing: .failed)
        #expect(try await reopened.steps(ofEvent: id).map(\.detail) == ["2 keys deleted", "refused"])
        #expect(try await reopened.events().first?.outcome == "failed")
        #expect(try await reopened.events().first?.steps == #"["purge-set","notify"]"#)
        await reopened.close()
    }

    // Texts an attacker shapes may hold U+0000. A description or a step's detail is stored
    // (PostgreSQL's text cannot hold U+0000: there it becomes U+FFFD); an identifier holding
    // it is stored whole and de-duplicated by its whole value where the store can hold it
    // (SQLite), and refused as a value that can never be written where it cannot (PostgreSQL)
    // — never a trap, never an error that says a retry could help.
    @Test(arguments: Backend.allCases) func textsHoldingNULAreStoredOrRefusedForGood(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await storage.open()
        _ = try await ledger.record([.rejection(Rejection(token: [0x41, 0, 0x42], source: "kafka:t/0/1", code: "invalid_key",
                                                          description: "the algorithm \"X\u{0}\" is not supported", receivedAt: 1))])
        #expect(try await ledger.deliveries().first?.errorDescription?.hasPrefix("the algorithm \"X") == true)
        guard case .new(let id) = try await ledger.claim(E.event(jti: "step-detail"), outcome: .pending,
                                                         steps: [OutboxStep(index: 0, kind: "purge-set", action: "{}")]) else {
            Issue.record("not new"); return
        }
        try await ledger.recordStep(0, of: id, status: .done, detail: "user-sessions:a\u{0}b purged")
        #expect(try await ledger.steps(ofEvent: id).first?.status == .done)
        switch backend {
        case .sqlite:
            guard case .new(let nul) = try await ledger.claim(E.event(jti: "a\u{0}b"), outcome: .pending, steps: []) else {
                Issue.record("not new"); return
            }
            #expect(try await ledger.claim(E.event(jti: "a\u{0}b", source: "kafka:t/0/2"), outcome: .pending, steps: [])
                    == .duplicate(eventID: nul))
            guard case .new = try await ledger.claim(E.event(jti: "a"), outcome: .pending, steps: []) else {
                Issue.record("a jti cut at its NUL was taken for another"); return
            }
        case .postgres:
            do {
                _ = try await ledger.claim(E.event(jti: "a\u{0}b"), outcome: .pending, steps: [])
                Issue.record("PostgreSQL cannot hold U+0000 in text; the claim must be refused")
            } catch {
                #expect(error.kind == .refused)
                #expect(!error.isRetryable)
            }
        }
        await ledger.close()
    }

    // Two owners of one event (a partition's old and new owner after a rebalance): only one
    // holds its lease at a time; the holder renews it; it passes on once it runs out.
    @Test(arguments: Backend.allCases) func oneOwnerAtATimeRunsAnEventsSteps(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await storage.open()
        guard case .new(let id) = try await ledger.claim(E.event(jti: "leased"), outcome: .pending,
                                                         steps: [OutboxStep(index: 0, kind: "notify", action: "{}")]) else {
            Issue.record("not new"); return
        }
        #expect(try await ledger.lease(event: id, owner: "worker-a", seconds: 60))
        #expect(try await !ledger.lease(event: id, owner: "worker-b", seconds: 60))
        #expect(try await ledger.lease(event: id, owner: "worker-a", seconds: 0.2))
        try await Task.sleep(for: .milliseconds(400))
        #expect(try await ledger.lease(event: id, owner: "worker-b", seconds: 60))
        #expect(try await !ledger.lease(event: id, owner: "worker-a", seconds: 60))
        #expect(try await !ledger.lease(event: id + 100, owner: "worker-a", seconds: 60))
        await ledger.close()
    }

    /// What a door without redelivery resumes: events with a step pending, received before the
    /// process started, in id order, page by page; nothing once their steps are recorded.
    @Test(arguments: Backend.allCases) func pendingEventsAreReadPageByPageUntilTheirStepsAreRecorded(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await storage.open()
        var pendingIDs: [Int64] = []
        for i in 0..<3 {
            var event = E.event(jti: "pending-\(i)", source: "push")
            event.token = "h.p\(i).s"
            guard case .new(let id) = try await ledger.claim(event, outcome: .pending, steps: [OutboxStep(index: 0, kind: "notify", action: "{}")])
            else { Issue.record("not new"); return }
            pendingIDs.append(id)
        }
        _ = try await ledger.claim(E.event(jti: "no-steps"), outcome: .processed, steps: [])
        var later = E.event(jti: "received-later")
        later.receivedAt = 1_900_000_000
        _ = try await ledger.claim(later, outcome: .pending, steps: [OutboxStep(index: 0, kind: "notify", action: "{}")])

        let first = try await ledger.pendingEvents(receivedBefore: 1_850_000_000, afterID: 0, limit: 2)
        #expect(first.map(\.id) == Array(pendingIDs.prefix(2)))
        #expect(first.first?.token == Array("h.p0.s".utf8))
        #expect(first.first?.source == "push")
        let rest = try await ledger.pendingEvents(receivedBefore: 1_850_000_000, afterID: first.last!.id, limit: 2)
        #expect(rest.map(\.id) == [pendingIDs[2]])
        try await ledger.recordStep(0, of: pendingIDs[0], status: .done, detail: "ok", finishing: .processed)
        #expect(try await ledger.pendingEvents(receivedBefore: 1_850_000_000, afterID: 0, limit: 10).map(\.id) == Array(pendingIDs.dropFirst()))
        // Only those no process works on: a lease held now keeps its event out; once run out, in.
        let now = Date().timeIntervalSince1970
        #expect(try await ledger.lease(event: pendingIDs[1], owner: "replica-a", seconds: 60))
        #expect(try await ledger.pendingEvents(receivedBefore: 1_850_000_000, afterID: 0, limit: 10, unleasedAt: now).map(\.id) == [pendingIDs[2]])
        #expect(try await ledger.pendingEvents(receivedBefore: 1_850_000_000, afterID: 0, limit: 10, unleasedAt: now + 120).map(\.id)
            == Array(pendingIDs.dropFirst()))
        await ledger.close()
    }

    /// Verification states are scoped to their issuer; an arrival is kept once; stream ids are
    /// kept and forgotten.
    @Test(arguments: Backend.allCases) func verificationStatesAndStreamIDs(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await storage.open()
        let a = "https://a.example/", b = "https://b.example/"
        try await ledger.requestVerification(issuer: a, state: "s-1", at: 100)
        #expect(try await ledger.verificationArrival(issuer: a, state: "s-1") == nil)
        #expect(try await !ledger.verificationArrived(issuer: b, state: "s-1", at: 101))
        #expect(try await !ledger.verificationArrived(issuer: a, state: "s-2", at: 101))
        #expect(try await ledger.verificationArrived(issuer: a, state: "s-1", at: 102))
        #expect(try await ledger.verificationArrived(issuer: a, state: "s-1", at: 150))  // a redelivery matches too
        #expect(try await ledger.verificationArrival(issuer: a, state: "s-1") == 102)
        #expect(try await ledger.verificationArrival(issuer: b, state: "s-1") == nil)

        #expect(try await ledger.streamID(issuer: a) == nil)
        try await ledger.keepStreamID("strm-1", issuer: a)
        try await ledger.keepStreamID("strm-2", issuer: a)
        #expect(try await ledger.streamID(issuer: a) == "strm-2")
        #expect(try await ledger.streamID(issuer: b) == nil)
        try await ledger.keepStreamID(nil, issuer: a)
        #expect(try await ledger.streamID(issuer: a) == nil)
        await ledger.close()
    }

    @Test func postgresTablesAreReadableByAnotherClient() async throws {
        let storage = try await LedgerUnderTest(.postgres)
        let ledger = try await storage.open()
        _ = try await ledger.claim(E.event(jti: "seen-by-psql"), outcome: .pending, steps: [OutboxStep(index: 0, kind: "notify", action: "{}")])
        #expect(try await storage.server!.psql(storage.database, "SELECT jti, outcome FROM events") == "seen-by-psql|pending")
        #expect(try await storage.server!.psql(storage.database, "SELECT kind, status FROM steps") == "notify|pending")
        #expect(try await storage.server!.psql(storage.database, "SELECT name FROM warden_migrations ORDER BY name") == "v1-events\nv2-outbox\nv3-lease\nv4-verifications\nv5-audit\nv6-retention\nv7-retention-cutoff\nv8-key-records")
        await ledger.close()
        // A second ledger on the same database finds the schema in place.
        let again = try await storage.open()
        #expect(try await again.events().count == 1)
        await again.close()
    }

    /// `/readyz` asks the ledger whether it can be written: a PostgreSQL server that answers but
    /// takes no writes (a standby after a failover) must not read ready.
    @Test func aPostgresLedgerThatTakesNoWritesIsNotReady() async throws {
        let storage = try await LedgerUnderTest(.postgres)
        let ledger = try await storage.open()
        #expect(await ledger.isReachable())
        // Applies to the pool's open connections at their next transaction, once reloaded.
        _ = try await storage.server!.psql("postgres", "ALTER SYSTEM SET default_transaction_read_only = on")
        _ = try await storage.server!.psql("postgres", "SELECT pg_reload_conf()")
        var ready = true
        for _ in 0..<50 where ready {
            ready = await ledger.isReachable()
            if ready { try await Task.sleep(for: .milliseconds(100)) }
        }
        #expect(!ready, "a read-only PostgreSQL server still reads ready")
        // Writes there fail, as readiness said.
        await #expect(throws: LedgerError.self) { try await ledger.claim(E.event(jti: "a"), outcome: .pending, steps: []) }
        _ = try await storage.server!.psql("postgres", "ALTER SYSTEM RESET default_transaction_read_only")
        _ = try await storage.server!.psql("postgres", "SELECT pg_reload_conf()")
        for _ in 0..<50 where !ready {
            ready = await ledger.isReachable()
            if !ready { try await Task.sleep(for: .milliseconds(100)) }
        }
        #expect(ready, "writable again, the ledger reads ready again")
        await ledger.close()
    }

    /// Replicas on several hosts share a PostgreSQL ledger, and their clocks differ: a lease is
    /// set and compared on the server's clock, so a replica whose clock runs two minutes ahead
    /// neither takes a live lease nor lists its event as free.
    @Test func aReplicaWhoseClockRunsAheadCannotTakeALiveLease() async throws {
        let storage = try await LedgerUnderTest(.postgres)
        let ledger = try await storage.open()
        let step = OutboxStep(index: 0, kind: "notify", action: "{}")
        guard case .new(let id) = try await ledger.claim(E.event(jti: "leased"), outcome: .pending, steps: [step]) else {
            Issue.record("not new"); return
        }
        #expect(try await ledger.lease(event: id, owner: "replica-a", seconds: 60))
        var logger = Logger(label: "ledger-test")
        logger.logLevel = .critical
        let skew = 120.0
        let ahead = PostgresLedger(.init(host: "127.0.0.1", port: storage.server!.port, username: storage.server!.username,
                                         database: storage.database), logger: logger, clock: { Date().timeIntervalSince1970 + skew })
        let pool = Task { await ahead.run() }
        defer { pool.cancel() }
        try await ahead.open()
        #expect(try await ahead.lease(event: id, owner: "replica-b", seconds: 10) == false, "a live lease taken by a clock ahead")
        #expect(try await ahead.pendingEvents(receivedBefore: 2e9, afterID: 0, limit: 10, unleasedAt: Date().timeIntervalSince1970 + skew)
            .isEmpty)
        // A claim's lease from that replica lasts its length on the server's clock.
        var claimed = E.event(jti: "claimed-ahead")
        claimed.leaseOwner = "replica-b"
        claimed.leaseUntil = Date().timeIntervalSince1970 + skew + 30
        guard case .new(let other) = try await ahead.claim(claimed, outcome: .pending, steps: [step]) else { Issue.record("not new"); return }
        #expect(try await ledger.lease(event: other, owner: "replica-a", seconds: 10) == false)
        #expect(try await ledger.pendingEvents(receivedBefore: 2e9, afterID: 0, limit: 10, unleasedAt: Date().timeIntervalSince1970 + 60)
            .map(\.id) == [id, other])
        await ledger.close()
    }
}
