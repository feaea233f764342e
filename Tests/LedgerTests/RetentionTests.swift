import Foundation
@testable import Ledger
import SecurityEvents
import Testing
import WardenTestSupport

/// Retention on every back end: what is old and finished goes, in small batches; what is not
/// finished stays; the audit chain stays provable across the cut, and moving its start is named.
@Suite("Ledger retention, every back end", .serialized)
struct RetentionTests {
    typealias E = SQLiteLedgerTests
    let audit = AuditTrailTests()

    /// Runs SQL behind the ledger's back and returns what it printed.
    func query(_ storage: LedgerUnderTest, _ sql: String) async throws -> String {
        switch storage.backend {
        case .sqlite: try await runProgram("/usr/bin/sqlite3", [storage.path, sql])
        case .postgres: try await storage.server!.psql(storage.database, sql)
        }
    }

    /// Prunes in batches of `limit` until nothing more is found, adding up what went.
    func pruneAll(_ ledger: any AuditingLedger, before cutoff: Double, limit: Int) async throws -> PruneResult {
        var total = PruneResult(lastEventID: 0), after: Int64 = 0, passes = 0
        while true {
            let result = try await ledger.prune(before: cutoff, limit: limit, afterEventID: after)
            total.events += result.events
            total.rejections += result.rejections
            total.auditRecords += result.auditRecords
            after = result.lastEventID
            passes += 1
            if !result.more || passes > 100 { return total }
        }
    }

    @Test(arguments: Backend.allCases) func oldFinishedEventsGoAndTheChainStaysProvable(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        // Received at 1_800_000_001…2: plain (processed) and its duplicate, a rejection, acted
        // (its steps finished), nobody (unresolved).
        let ledger = try await audit.populated(storage)
        // Old but not finished: a step still pending.
        _ = try await ledger.claim(E.event(jti: "waiting"), outcome: .pending, steps: [OutboxStep(index: 0, kind: "purge-set", action: "{}")])
        // Received after the cutoff.
        var late = E.event(jti: "late")
        late.receivedAt = 1_900_000_000
        _ = try await ledger.record([.event(late, outcome: .processed, steps: [])])
        // A rejected message keeps a bounded part of itself, and its digest.
        let junk = [UInt8](repeating: UInt8(ascii: "x"), count: 20_000)
        try await ledger.recordRejection(Rejection(token: junk, source: "push", code: "invalid_request", description: "junk",
                                                   receivedAt: 1_900_000_000))
        let kept = try await query(storage, storage.backend == .sqlite
                                   ? "SELECT max(length(token)) FROM deliveries WHERE verdict = 'invalid'"
                                   : "SELECT max(octet_length(token)) FROM deliveries WHERE verdict = 'invalid'")
        #expect(kept == "\(Retention.keptRejectedBytes)")
        #expect(try await ledger.rejectedDigests([AuditChain.sha256Hex(junk)]) == [AuditChain.sha256Hex(junk)])

        let head = try await ledger.auditHead()
        #expect(try await ledger.retentionCutoff() == nil)
        let total = try await pruneAll(ledger, before: 1_800_000_005, limit: 2)
        // Replay reads what was dropped: anything received before the cutoff may be gone.
        #expect(try await ledger.retentionCutoff() == 1_800_000_005)
        _ = try await pruneAll(ledger, before: 1_700_000_000, limit: 2)
        #expect(try await ledger.retentionCutoff() == 1_800_000_005, "an earlier cutoff does not move it back")
        // plain and acted; nobody (unresolved) still has its step pending — resumed at the next
        // start, so not finished — and stays with waiting.
        #expect(total.events == 2)
        #expect(total.rejections == 1)  // the old one; the junk came after the cutoff
        let keys = ["plain", "acted", "nobody", "waiting", "late"].map { EventKey(issuer: "https://issuer.example/", jti: $0) }
        let states = try await ledger.eventStates(keys)
        #expect(Set(states.keys.map(\.jti)) == ["nobody", "waiting", "late"])
        #expect(try await query(storage, "SELECT count(*) FROM deliveries") == "1")  // the junk's

        // Every record was written before the (future) cutoff: all went but the last checkpoint.
        let start = try await ledger.auditStart()
        let headAfter = try await ledger.auditHead()
        #expect(start.seq > 0 && start.seq < headAfter.seq)
        #expect(total.auditRecords >= Int(head.seq))
        guard case .intact(let count, _, _) = try await ledger.checkAuditChain() else {
            Issue.record("the chain must verify across the cut: \(try await ledger.checkAuditChain())"); return
        }
        #expect(count == 1)
        let checkpoint = try #require(try await audit.records(ledger).last)
        #expect(checkpoint["kind"]?.stringValue == "checkpoint")
        #expect(checkpoint["pruned_through_seq"]?.numberValue == Double(start.seq))
        #expect(checkpoint["pruned_through_hash"]?.stringValue == start.hash)

        // New records go on from the checkpoint; the chain still verifies.
        _ = try await ledger.record([.event(E.event(jti: "after"), outcome: .processed, steps: [])])
        let newHead = try await ledger.auditHead()
        #expect(try await ledger.checkAuditChain() == .intact(count: 2, seq: newHead.seq, head: newHead.hash))

        // Nothing left to prune: nothing changes.
        let again = try await pruneAll(ledger, before: 1_800_000_005, limit: 100)
        #expect(again.events == 0 && again.rejections == 0)
        // (Records written since were recorded before the future cutoff too: they went, and the
        // checkpoint that says so is now the chain's last record.)
        let last = try await ledger.auditHead()
        #expect(try await audit.records(ledger).last?["kind"]?.stringValue == "checkpoint")
        let afterAgain = try await ledger.checkAuditChain()
        #expect(afterAgain == .intact(count: 2, seq: last.seq, head: last.hash), "\(afterAgain)")

        // The cutoff replay reads is carried by the newest checkpoint: moved or removed by hand,
        // audit verify names that checkpoint.
        for edit in ["pruned_before = pruned_before + 86400", "pruned_before = pruned_before - 86400", "pruned_before = NULL"] {
            _ = try await query(storage, "UPDATE audit_start SET \(edit) WHERE id = 1")
            let finding = try await ledger.checkAuditChain()
            guard case .broken(let seq, let reason) = finding else { Issue.record("\(edit): \(finding)"); continue }
            #expect(seq == last.seq && reason.contains("the retention cutoff kept beside the chain"), "\(edit): \(finding)")
            _ = try await query(storage, "UPDATE audit_start SET pruned_before = 1800000005 WHERE id = 1")
        }
        let restored = try await ledger.checkAuditChain()
        #expect(restored == .intact(count: 2, seq: last.seq, head: last.hash), "\(restored)")
    }

    /// A batch that drops only events (no audit record is old enough) still records its cutoff
    /// in the chain, so the cutoff kept beside the chain always has a checkpoint to match.
    @Test(arguments: Backend.allCases) func droppingOnlyEventsRecordsTheCutoffInTheChain(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await audit.open(storage)
        // Events received long ago, their audit records written now: after this cutoff, so none
        // of the records goes. (A later event, so that SQLite may drop the newest old one.)
        for jti in ["old-1", "old-2", "recent"] {
            var event = E.event(jti: jti)
            if jti != "recent" { event.receivedAt = 1_000_000_000 }
            _ = try await ledger.record([.event(event, outcome: .processed, steps: [])])
        }
        let total = try await pruneAll(ledger, before: 1_500_000_000, limit: 100)
        #expect(total.events == 2 && total.auditRecords == 0)
        let checkpoint = try #require(try await audit.records(ledger).last)
        #expect(checkpoint["kind"]?.stringValue == "checkpoint")
        #expect(checkpoint["received_at"]?.stringValue == Retention.text(1_500_000_000))
        #expect(checkpoint["pruned_through_seq"]?.numberValue == 0)
        guard case .intact = try await ledger.checkAuditChain() else {
            Issue.record("\(try await ledger.checkAuditChain())"); return
        }
        _ = try await query(storage, "UPDATE audit_start SET pruned_before = 1900000000 WHERE id = 1")
        guard case .broken(_, let reason) = try await ledger.checkAuditChain() else { Issue.record("an edited cutoff passed"); return }
        #expect(reason.contains("is not the one this checkpoint carries"), "\(reason)")
    }

    /// An event id names one event for ever: after retention dropped the newest events, a new
    /// event gets a new id (SQLite would give the largest remaining id plus one).
    @Test(arguments: Backend.allCases) func anEventIDIsNeverGivenAgainAfterRetention(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await storage.open() as! any AuditingLedger
        var ids: [Int64] = []
        for jti in ["old-1", "old-2"] {
            guard case .new(let id)? = try await ledger.record([.event(E.event(jti: jti), outcome: .processed, steps: [])])[0] else {
                Issue.record("not new"); return
            }
            ids.append(id)
        }
        _ = try await pruneAll(ledger, before: 1_900_000_000, limit: 10)
        var newer = E.event(jti: "new")
        newer.receivedAt = 1_950_000_000
        guard case .new(let id)? = try await ledger.record([.event(newer, outcome: .processed, steps: [])])[0] else {
            Issue.record("not new"); return
        }
        #expect(id > ids.max()!, "event id \(id) was given again")
        // The one kept goes with the next pass, once a later event holds the largest id.
        _ = try await pruneAll(ledger, before: 1_900_000_000, limit: 10)
        let states = try await ledger.eventStates(["old-1", "old-2", "new"].map { EventKey(issuer: "https://issuer.example/", jti: $0) })
        #expect(Set(states.keys.map(\.jti)) == ["new"])
        await ledger.close()
    }

    @Test(arguments: Backend.allCases) func movingTheStartIsNamed(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await audit.populated(storage)
        _ = try await pruneAll(ledger, before: 1_800_000_005, limit: 3)
        guard case .intact = try await ledger.checkAuditChain() else { Issue.record("intact after the cut"); return }
        // Someone moves the start back onto a record that was dropped and "restores" it.
        try await audit.tamper(storage, "UPDATE audit_start SET seq = seq - 1")
        guard case .broken(_, let reason) = try await ledger.checkAuditChain() else {
            Issue.record("a moved start must be named"); return
        }
        #expect(reason.contains("missing") || reason.contains("start"), "\(reason)")
    }

    /// The worker prunes while `warden audit verify` reads: a start moved between reading it and
    /// reading the records is no tampering — the check starts again from the new start.
    @Test(arguments: Backend.allCases) func pruningWhileTheChainIsReadIsNoBreak(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await audit.populated(storage)
        var pruned = false
        let finding = try await ledger.checkAuditChain(pageSize: 1000, afterReadingTheStart: { () async throws(LedgerError) in
            guard !pruned else { return }
            pruned = true
            _ = try await ledger.prune(before: 1_800_000_005, limit: 100, afterEventID: 0)
        })
        #expect(pruned)
        #expect(try await ledger.auditStart().seq > 0, "the prune dropped records")
        guard case .intact = finding else { Issue.record("a prune during the check is not tampering: \(finding)"); return }
    }

    /// Retention running all along while a long chain is walked (a prune after every page,
    /// dropping records ahead of the walk and records it has passed): still no tampering, and
    /// every attempt of the check sees prunes, so starting again does not help.
    @Test(arguments: Backend.allCases) func pruningAllAlongTheWalkIsNoBreak(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await audit.populated(storage)
        for i in 0..<24 { _ = try await ledger.record([.event(E.event(jti: "more-\(i)"), outcome: .processed, steps: [])]) }
        var pages = 0, dropped = 0
        // Events keep coming while it runs, so retention always has something to drop.
        let finding = try await ledger.checkAuditChain(pageSize: 4, afterReadingTheStart: {}, afterEachPage: { () async throws(LedgerError) in
            pages += 1
            _ = try await ledger.record([.event(E.event(jti: "meanwhile-\(pages)"), outcome: .processed, steps: [])])
            dropped += try await ledger.prune(before: 1_800_000_005, limit: pages % 2 == 1 ? 6 : 1, afterEventID: 0).auditRecords
        })
        #expect(dropped > 20)
        guard case .intact = finding else { Issue.record("retention during the check is not tampering: \(finding)"); return }
        // And a chain whose front was cut by hand is still named.
        let start = try await ledger.auditStart()
        try await audit.tamper(storage, "DELETE FROM audit_records WHERE seq = \(start.seq + 1)")
        guard case .broken = try await ledger.checkAuditChain() else { Issue.record("a record cut from the front must be named"); return }
    }

    /// Retention leaves no record at or before the start: one put there by hand is named by
    /// verify (it would otherwise be exported unchecked).
    @Test(arguments: Backend.allCases) func aRecordInsertedBeforeTheStartIsNamed(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await audit.populated(storage)
        _ = try await pruneAll(ledger, before: 1_800_000_005, limit: 100)
        let start = try await ledger.auditStart()
        guard case .intact = try await ledger.checkAuditChain() else { Issue.record("intact after the cut"); return }
        try await audit.tamper(storage, "INSERT INTO audit_records (seq, record, prev_hash, hash) VALUES (\(start.seq), '{\"forged\":1}', 'x', 'y')")
        guard case .broken(let seq, let reason) = try await ledger.checkAuditChain() else {
            Issue.record("a record before the start must be named"); return
        }
        #expect(seq == start.seq)
        #expect(reason.contains("inserted by hand"), "\(reason)")
    }
}
