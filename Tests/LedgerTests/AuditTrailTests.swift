import Foundation
@testable import Ledger
import SecurityEvents
import Testing
import WardenTestSupport

/// The audit trail on every back end: one hash-chained record per outcome, named tampering,
/// the key archive, and the lookups a replay compares with.
@Suite("Audit trail, every back end", .serialized)
struct AuditTrailTests {
    typealias E = SQLiteLedgerTests

    func open(_ storage: LedgerUnderTest) async throws -> any AuditingLedger {
        try #require(try await storage.open() as? any AuditingLedger)
    }

    /// Runs SQL on the storage behind the ledger's back, as someone editing the database would.
    func tamper(_ storage: LedgerUnderTest, _ sql: String) async throws {
        switch storage.backend {
        case .sqlite: _ = try await runProgram("/usr/bin/sqlite3", [storage.path, sql])
        case .postgres: _ = try await storage.server!.psql(storage.database, sql)
        }
    }

    func records(_ ledger: any AuditingLedger) async throws -> [JSONObject] {
        try await ledger.auditRecords(afterSeq: 0, limit: 1000).map { try #require(try JSONParser.parse($0.record).objectValue) }
    }

    /// A ledger holding one record of each kind: an event without steps, a duplicate, a
    /// rejection, an event whose steps finished (one retried), and an unresolved one.
    func populated(_ storage: LedgerUnderTest) async throws -> any AuditingLedger {
        let ledger = try await open(storage)
        _ = try await ledger.record([
            .event(E.event(jti: "plain"), outcome: .processed, steps: []),
            .event(E.event(jti: "plain", source: "kafka:t/0/2"), outcome: .processed, steps: []),
            .rejection(Rejection(token: Array("junk".utf8), source: "push", code: "invalid_request", description: "not a JWS",
                                 receivedAt: 1_800_000_002)),
        ])
        guard case .new(let withSteps) = try await ledger.claim(E.event(jti: "acted"), outcome: .pending, steps: [
            OutboxStep(index: 0, kind: "purge-set", action: "{}"), OutboxStep(index: 1, kind: "webhook", action: "{}"),
        ]) else { throw Failure("the claim must be new") }
        #expect(try await ledger.auditRecords(afterSeq: 0, limit: 10).count == 3, "no record while steps are pending")
        _ = try await ledger.recordSteps([RecordedStep(eventID: withSteps, index: 0, status: .done, detail: "purged 2", attempts: 1)])
        _ = try await ledger.recordSteps([RecordedStep(eventID: withSteps, index: 1, status: .failed, detail: "answered 403",
                                                       finishing: .failed, attempts: 3)])
        guard case .new(let unresolved) = try await ledger.claim(E.event(jti: "nobody"), outcome: .pending, steps: [
            OutboxStep(index: 0, kind: "purge-set", action: "{}"),
        ]) else { throw Failure("the claim must be new") }
        try await ledger.record(outcome: .unresolved, forEvent: unresolved)
        return ledger
    }

    struct Failure: Error, CustomStringConvertible {
        var description: String
        init(_ description: String) { self.description = description }
    }

    /// A record's text is canonical JSON whatever its texts hold: members in code-point order,
    /// each value read back as it was, every text escaped as JSON's own writer escapes it, and
    /// within the room the record is written into.
    @Test func aRecordsTextIsCanonicalWhateverItsTextsHold() throws {
        let awkward = ["", "\u{0}", "\"\\\u{1F}\n", "é«»🙂", String(repeating: "\u{7}x\"", count: 40), "plain-ascii-long-enough-for-words"]
        var records: [(AuditRecord, Int64)] = []
        for (i, text) in awkward.enumerated() {
            records.append((AuditRecord(kind: .event, eventID: Int64(i) - 3, source: text, receivedAt: 1_800_000_000.5 + Double(i),
                                        tokenSHA256: text, error: (code: text, description: text + text), issuer: text, jti: text,
                                        eventTypes: [text, "https://schemas.openid.net/secevent/risc/event-type/sessions-revoked"],
                                        subject: #"{"format":"opaque","id":"# + "\"x\(text)\"}", keyID: text, algorithm: text,
                                        keyThumbprint: text, issuedAt: -62_135_596_800 + Double(i), outcome: text,
                                        steps: [.init(index: i, kind: text, status: .failed, detail: text, attempts: Int.max),
                                                .init(index: -i, kind: "k", status: .done, detail: nil, attempts: 0)],
                                        note: text, prunedThroughSeq: Int64.min + Int64(i), prunedThroughHash: text, recordedAt: 1e12),
                            Int64.max - Int64(i)))
        }
        records.append((AuditRecord(kind: .checkpoint, eventID: nil, source: "", receivedAt: 0, tokenSHA256: nil, outcome: "",
                                    recordedAt: 0), 1))
        for (record, seq) in records {
            let text = record.canonicalJSON(seq: seq)
            #expect(text.count <= record.maximumCanonicalLength)
            let object = try #require(try JSONParser.parse(text).objectValue)
            let names = object.members.map(\.name)
            #expect(names == names.sorted { Array($0.unicodeScalars.map(\.value)).lexicographicallyPrecedes($1.unicodeScalars.map(\.value)) })
            #expect(object["seq"]?.numberValue == Double(seq))
            #expect(object["source"]?.stringValue == record.source)
            #expect(object["issuer"]?.stringValue == record.issuer && object["jti"]?.stringValue == record.jti)
            #expect(object["subject"]?.stringValue == record.subject && object["description"]?.stringValue == record.error?.description)
            #expect(object["event_types"]?.arrayValue?.compactMap(\.stringValue) ?? [] == record.eventTypes)
            #expect(object["received_at"]?.stringValue == RFC3339.string(from: record.receivedAt))
            #expect(object["issued_at"]?.stringValue == record.issuedAt.map { RFC3339.string(from: $0) })
            let steps = object["steps"]?.arrayValue?.compactMap(\.objectValue) ?? []
            #expect(steps.map { $0["detail"]?.stringValue } == record.steps.map(\.detail))
            #expect(steps.map { $0["kind"]?.stringValue } == record.steps.map(\.kind))
            // Every text as JSON's own writer writes it.
            var expected: [UInt8] = []
            JSONValue.writeString(record.source, to: &expected)
            #expect(text.firstRange(of: Array(#""source":"#.utf8) + expected) != nil)
        }
        // Integers at their longest, both signs.
        let extremes = String(decoding: records[0].0.canonicalJSON(seq: Int64.max), as: UTF8.self)
        #expect(extremes.contains(#""seq":9223372036854775807"#) && extremes.contains(#""pruned_through_seq":-9223372036854775808"#))
        #expect(extremes.contains(#""event_id":-3"#) && extremes.contains(#""attempts":\#(Int.max)"#))
    }

    /// The record of a finished event is made from the ledger's own claim when it made the
    /// claim, and read back from the event's row otherwise (another process's claim, or one from
    /// before a restart): the two are the same, but for what tells the events apart.
    @Test func aFinishedEventsRecordIsTheSameWhoeverClaimedIt() async throws {
        let path = Scratch.path("claimed", extension: "sqlite")
        let detail = "purged\u{0}2 «é»"
        let step = [OutboxStep(index: 0, kind: "purge-set", action: "{}")]
        func finish(_ ledger: SQLiteLedger, _ id: Int64) async throws {
            // Attempts recorded while the step was still pending count too.
            let tried = try await ledger.recordSteps([RecordedStep(eventID: id, index: 0, status: .pending, detail: "busy", attempts: 2)])
            let written = try await ledger.recordSteps([RecordedStep(eventID: id, index: 0, status: .failed, detail: detail,
                                                                     finishing: .failed, attempts: 3)])
            #expect((tried.refusals + written.refusals).allSatisfy { $0 == nil })
        }
        let first = try SQLiteLedger(path: path)
        guard case .new(let own) = try await first.claim(E.event(jti: "own"), outcome: .pending, steps: step),
              case .new(let inherited) = try await first.claim(E.event(jti: "inherited"), outcome: .pending, steps: step) else {
            throw Failure("the claims must be new")
        }
        try await finish(first, own)
        await first.close()
        let second = try SQLiteLedger(path: path)
        try await finish(second, inherited)
        let records = try await records(second)
        #expect(records.map { $0["jti"]?.stringValue } == ["own", "inherited"])
        func alike(_ record: JSONObject) -> JSONObject {
            JSONObject(record.filter { !["jti", "event_id", "seq", "recorded_at"].contains($0.name) }.map { ($0.name, $0.value) })
        }
        #expect(alike(records[0]) == alike(records[1]))
        let only = try #require(records[0]["steps"]?.arrayValue?.first?.objectValue)
        #expect(only["kind"]?.stringValue == "purge-set" && only["status"]?.stringValue == "failed")
        #expect(only["detail"]?.stringValue == detail && only["attempts"]?.numberValue == 5 && only["index"]?.numberValue == 0)
        #expect(try await second.checkAuditChain() == .intact(count: 2, seq: 2, head: try await second.auditHead().hash))
        await second.close()
    }

    @Test(arguments: Backend.allCases) func everyOutcomeIsOneChainedRecord(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await populated(storage)
        let records = try await records(ledger)
        #expect(records.map { $0["kind"]?.stringValue } == ["event", "duplicate", "rejection", "event", "event"])
        #expect(records.map { $0["outcome"]?.stringValue } == ["processed", "duplicate", "invalid", "failed", "unresolved"])
        #expect(records.map { $0["seq"]?.numberValue } == [1, 2, 3, 4, 5])
        #expect(records[1]["source"]?.stringValue == "kafka:t/0/2")
        #expect(records[2]["err"]?.stringValue == "invalid_request")
        #expect(records[2]["verdict"]?.stringValue == "invalid")
        #expect(records[2]["token_sha256"]?.stringValue == AuditChain.sha256Hex(Array("junk".utf8)))
        #expect(records[0]["token_sha256"]?.stringValue == AuditChain.sha256Hex(Array("h.p.s".utf8)))
        #expect(records[0]["key_thumbprint"]?.stringValue == "tp")
        let subject = try #require(records[0]["subject"]?.stringValue)
        #expect(try JSONParser.parse(subject).objectValue?["sub"]?.stringValue == "1")
        let steps = try #require(records[3]["steps"]?.arrayValue?.compactMap { $0.objectValue })
        #expect(steps.map { $0["status"]?.stringValue } == ["done", "failed"])
        #expect(steps.map { $0["attempts"]?.numberValue } == [1, 3])
        #expect(steps[1]["detail"]?.stringValue == "answered 403")
        #expect(try await ledger.checkAuditChain() == .intact(count: 5, seq: try await ledger.auditHead().seq, head: try await ledger.auditHead().hash))
        await ledger.close()
    }

    enum Tampering: String, CaseIterable, Sendable, CustomTestStringConvertible {
        case edited, removed, swapped, truncated, headMovedBack
        var testDescription: String { rawValue }
    }

    @Test(arguments: Backend.allCases, Tampering.allCases) func tamperingIsNamed(_ backend: Backend, _ tampering: Tampering) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await populated(storage)
        let expected: (seq: Int64, words: String)
        switch tampering {
        case .edited:
            try await tamper(storage, "UPDATE audit_records SET record = replace(record, '\"failed\"', '\"processed\"') WHERE seq = 4")
            expected = (4, "changed")
        case .removed:
            try await tamper(storage, "DELETE FROM audit_records WHERE seq = 2")
            expected = (3, "missing")
        case .swapped:
            // Rows exchanged whole, hashes and all.
            try await tamper(storage, """
                UPDATE audit_records SET seq = -1 WHERE seq = 2;
                UPDATE audit_records SET seq = 2 WHERE seq = 3;
                UPDATE audit_records SET seq = 3 WHERE seq = -1;
                """)
            expected = (2, "previous hash")
        case .truncated:
            try await tamper(storage, "DELETE FROM audit_records WHERE seq = 5")
            expected = (5, "removed from the end")
        case .headMovedBack:
            // The head set back to record 3, so that records 4 and 5 could be rewritten at will.
            try await tamper(storage, "UPDATE audit_head SET seq = 3, hash = (SELECT hash FROM audit_records WHERE seq = 3)")
            expected = (4, "moved back")
        }
        let finding = try await ledger.checkAuditChain(pageSize: 2)
        guard case .broken(let seq, let reason) = finding else {
            Issue.record("\(tampering) went unnoticed: \(finding)"); return
        }
        #expect(seq == expected.seq, "\(reason)")
        #expect(reason.contains(expected.words), "\(reason)")
        await ledger.close()
    }

    /// The chain's tail cut and its head moved to match passes a check of the ledger alone; an
    /// anchor (a head printed earlier, kept elsewhere) names it, as it names a rewritten record.
    @Test(arguments: Backend.allCases) func anAnchorNamesATailCutWithItsHead(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await populated(storage)
        let head = try await ledger.auditHead()
        let anchor = AuditAnchor(seq: head.seq, hash: head.hash)
        #expect(AuditAnchor(anchor.description) == anchor)
        #expect(try await ledger.checkAuditChain(anchors: [anchor]) == .intact(count: head.seq, seq: head.seq, head: head.hash))
        let earlier = try #require(try await ledger.auditRecords(afterSeq: 2, limit: 1).first)
        guard case .broken(3, let wrong) = try await ledger.checkAuditChain(anchors: [AuditAnchor(seq: 3, hash: String(repeating: "0", count: 64))]) else {
            Issue.record("a record whose hash is not the anchored one must be named"); return
        }
        #expect(wrong.contains("anchored"), "\(wrong)")

        try await tamper(storage, "DELETE FROM audit_records WHERE seq = \(head.seq)")
        try await tamper(storage, "UPDATE audit_head SET seq = \(head.seq - 1), hash = (SELECT hash FROM audit_records WHERE seq = \(head.seq - 1))")
        guard case .intact = try await ledger.checkAuditChain() else { Issue.record("alone, the ledger cannot tell"); return }
        guard case .broken(let seq, let reason) = try await ledger.checkAuditChain(anchors: [anchor, AuditAnchor(seq: earlier.seq, hash: earlier.hash)]) else {
            Issue.record("the anchor must name the cut"); return
        }
        #expect(seq == head.seq, "\(reason)")
        #expect(reason.contains("anchored record \(head.seq)"), "\(reason)")
        await ledger.close()
    }

    /// SQLite keeps any type in any cell: a record edited into a blob that is not UTF-8, or a
    /// head or start edited into text, is named as tampering — never a trap of the checker.
    @Test func cellsEditedIntoOtherTypesAreNamedNotTrapped() async throws {
        let storage = try await LedgerUnderTest(.sqlite)
        let ledger = try await populated(storage)
        try await tamper(storage, "UPDATE audit_records SET record = X'FF00FE' WHERE seq = 2")
        guard case .broken(let seq, let reason) = try await ledger.checkAuditChain() else { Issue.record("a blob record went unnoticed"); return }
        #expect(seq == 2, "\(reason)")
        #expect(reason.contains("changed"), "\(reason)")

        for edit in ["UPDATE audit_head SET seq = 'x'", "UPDATE audit_start SET seq = 'x'"] {
            let other = try await LedgerUnderTest(.sqlite)
            let edited = try await populated(other)
            try await tamper(other, "INSERT OR IGNORE INTO audit_start (id, seq, hash) VALUES (1, 0, '\(AuditChain.genesis)')")
            try await tamper(other, edit)
            guard case .broken = try await edited.checkAuditChain() else { Issue.record("\(edit) went unnoticed"); continue }
            await edited.close()
        }
        try await tamper(storage, "INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen) VALUES ('i', 'k', 't', '{}', 'soon', X'00')")
        #expect(try await ledger.archivedKeys().allSatisfy { $0.keyID != "k" })
        await ledger.close()
    }

    @Test(arguments: Backend.allCases) func aRejectionRecordedAloneHasItsRecord(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await open(storage)
        try await ledger.recordRejection(Rejection(token: [1, 2, 3], source: "push", code: "invalid_key", description: "forged",
                                                   receivedAt: 1_800_000_000))
        let records = try await records(ledger)
        #expect(records.map { $0["kind"]?.stringValue } == ["rejection"])
        #expect(records.first?["err"]?.stringValue == "invalid_key")
        #expect(try await ledger.checkAuditChain() == .intact(count: 1, seq: try await ledger.auditHead().seq, head: try await ledger.auditHead().hash))
        await ledger.close()
    }

    @Test(arguments: Backend.allCases) func keysAreArchivedWithFirstAndLastSeen(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await open(storage)
        let key = ArchivedKey(issuer: "https://i.example/", keyID: "k1", thumbprint: "t1", jwk: #"{"kty":"RSA"}"#, firstSeen: 0, lastSeen: 0)
        try await ledger.archive(keys: [key], issuer: key.issuer, seenAt: 100)
        try await ledger.archive(keys: [key, ArchivedKey(issuer: key.issuer, keyID: "k2", thumbprint: "t2", jwk: "{}", firstSeen: 0, lastSeen: 0)],
                                 issuer: key.issuer, seenAt: 200)
        try await ledger.archive(keys: [key], issuer: key.issuer, seenAt: 150)
        let archived = try await ledger.archivedKeys()
        #expect(archived.map(\.keyID) == ["k1", "k2"])
        #expect(archived.map(\.firstSeen) == [100, 200])
        #expect(archived.map(\.lastSeen) == [200, 200])
        #expect(archived[0].jwk == #"{"kty":"RSA"}"#)
        await ledger.close()
    }

    /// The key archive is bound to the chain: a key new to it gets a key record; one added by
    /// hand is named by the check and left out of the keys replay trusts; one whose record was
    /// edited breaks the chain, and then no archived key is trusted; retention writes the
    /// record again after its checkpoint.
    @Test(arguments: Backend.allCases) func everyArchivedKeyIsAttestedByTheChain(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await open(storage)
        let issuer = "https://i.example/"
        let key = ArchivedKey(issuer: issuer, keyID: "k1", thumbprint: "t1", jwk: "{}", firstSeen: 0, lastSeen: 0)
        try await ledger.archive(keys: [key], issuer: issuer, seenAt: 1_800_000_000)
        try await ledger.archive(keys: [key], issuer: issuer, seenAt: 1_800_000_100)  // seen again: no second record
        let written = try await records(ledger)
        #expect(written.map { $0["kind"]?.stringValue } == ["key"])
        #expect(written.first?["key_id"]?.stringValue == "k1")
        #expect(written.first?["key_thumbprint"]?.stringValue == "t1")
        #expect(written.first?["received_at"]?.stringValue == "2027-01-15T08:00:00.000Z")
        guard case .intact = try await ledger.checkAuditChain() else { Issue.record("an attested archive is not intact"); return }
        #expect(try await ledger.attestedArchivedKeys().keys.map(\.keyID) == ["k1"])

        // Retention drops the key record: it is written again after the checkpoint.
        _ = try await ledger.record([.event(E.event(jti: "later"), outcome: .processed, steps: [])])
        let pruned = try await ledger.prune(before: Date().timeIntervalSince1970 + 3600, limit: 100, afterEventID: 0)
        #expect(pruned.auditRecords == 1)
        #expect(try await records(ledger).map { $0["kind"]?.stringValue } == ["event", "checkpoint", "key"])
        guard case .intact = try await ledger.checkAuditChain() else { Issue.record("the carried key record is not intact"); return }
        #expect(try await ledger.attestedArchivedKeys().keys.map(\.keyID) == ["k1"])

        // A key added to the archive by hand.
        try await tamper(storage, "INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen) "
                         + "VALUES ('\(issuer)', 'forged', 'tf', '{}', 1800000000, 1800000000)")
        guard case .broken(_, let reason) = try await ledger.checkAuditChain() else { Issue.record("a key added by hand went unnoticed"); return }
        #expect(reason.contains(#""forged""#) && reason.contains("tf"), "\(reason)")
        let attested = try await ledger.attestedArchivedKeys()
        #expect(attested.keys.map(\.keyID) == ["k1"])
        guard case .broken = attested.finding else { Issue.record("the finding does not name the stray key"); return }

        // A key record edited to attest the forged key instead: the chain is broken, and no
        // archived key is trusted.
        try await tamper(storage, "UPDATE audit_records SET record = replace(replace(record, '\"k1\"', '\"forged\"'), '\"t1\"', '\"tf\"') "
                         + "WHERE record LIKE '%\"kind\":\"key\"%'")
        let afterEdit = try await ledger.attestedArchivedKeys()
        #expect(afterEdit.keys.isEmpty)
        guard case .broken(_, let edited) = afterEdit.finding else { Issue.record("an edited key record went unnoticed"); return }
        #expect(edited.contains("changed"), "\(edited)")
        await ledger.close()
    }

    /// Removes the mark of the migration that attests archived keys, as if it had never run.
    func forgetKeyRecordsMigration(_ storage: LedgerUnderTest) async throws {
        switch storage.backend {
        case .sqlite: try await tamper(storage, "DELETE FROM grdb_migrations WHERE identifier = 'v10-key-records'")
        case .postgres: try await tamper(storage, "DELETE FROM warden_migrations WHERE name = 'v8-key-records'")
        }
    }

    /// A ledger from before key records: its archived keys are attested when it is first
    /// opened by this version (the migration run again on a key archived the old way).
    @Test(arguments: Backend.allCases) func keysArchivedBeforeKeyRecordsAreAttestedOnUpgrade(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let first = try await open(storage)
        _ = try await first.record([.event(E.event(jti: "old"), outcome: .processed, steps: [])])
        await first.close()
        try await tamper(storage, "INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen) "
                         + "VALUES ('https://i.example/', 'old-key', 'to', '{}', 1800000000, 1800000000)")
        try await forgetKeyRecordsMigration(storage)
        let upgraded = try await open(storage)
        #expect(try await records(upgraded).map { $0["kind"]?.stringValue } == ["event", "key"])
        guard case .intact = try await upgraded.checkAuditChain() else { Issue.record("an upgraded archive is not attested"); return }
        #expect(try await upgraded.attestedArchivedKeys().keys.map(\.keyID) == ["old-key"])
        await upgraded.close()

        // Once the chain holds key records, the migration's mark removed again attests nothing
        // added since.
        try await tamper(storage, "INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen) "
                         + "VALUES ('https://i.example/', 'planted', 'tp', '{}', 1800000000, 1800000000)")
        try await forgetKeyRecordsMigration(storage)
        let again = try await open(storage)
        #expect(try await again.attestedArchivedKeys().keys.map(\.keyID) == ["old-key"])
        await again.close()
    }

    /// Retention drops only records that prove themselves: a key record edited to attest
    /// another key is kept (evidence for `audit verify`), not dropped and carried forward as a
    /// genuine one. And a key deleted from the archive stops being carried.
    @Test(arguments: Backend.allCases) func retentionCarriesOnlyProvenRecordsOfArchivedKeys(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await open(storage)
        let issuer = "https://i.example/"
        for kid in ["k1", "k2"] {
            try await ledger.archive(keys: [ArchivedKey(issuer: issuer, keyID: kid, thumbprint: "t-" + kid, jwk: "{}", firstSeen: 0, lastSeen: 0)],
                                     issuer: issuer, seenAt: 1_800_000_000)
        }
        _ = try await ledger.record([.event(E.event(jti: "later"), outcome: .processed, steps: [])])
        try await tamper(storage, "INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen) "
                         + "VALUES ('\(issuer)', 'forged', 'tf', '{}', 1800000000, 1800000000)")
        try await tamper(storage, "UPDATE audit_records SET record = replace(replace(record, '\"k2\"', '\"forged\"'), '\"t-k2\"', '\"tf\"') "
                         + "WHERE record LIKE '%\"k2\"%'")
        try await tamper(storage, "DELETE FROM signing_keys WHERE kid = 'k1'")
        let pruned = try await ledger.prune(before: Date().timeIntervalSince1970 + 3600, limit: 100, afterEventID: 0)
        #expect(pruned.auditRecords == 1, "only the record before the edited one goes")
        let kinds = try await records(ledger).map { "\($0["kind"]?.stringValue ?? "?"):\($0["key_id"]?.stringValue ?? "")" }
        #expect(kinds == ["key:forged", "event:k1", "checkpoint:"], "k1's record is not carried; the edited one stays")
        guard case .broken(let seq, let reason) = try await ledger.checkAuditChain() else { Issue.record("the edit went unnoticed"); return }
        #expect(seq == 2 && reason.contains("changed"), "\(seq): \(reason)")
        #expect(try await ledger.attestedArchivedKeys().keys.isEmpty)
        await ledger.close()
    }

    @Test(arguments: Backend.allCases) func replayLookupsAndReopeningFailedSteps(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await populated(storage)
        let states = try await ledger.eventStates([EventKey(issuer: "https://issuer.example/", jti: "acted"),
                                                   EventKey(issuer: "https://issuer.example/", jti: "never")])
        let acted = try #require(states[EventKey(issuer: "https://issuer.example/", jti: "acted")])
        #expect(states.count == 1)
        #expect(acted.outcome == .failed)
        #expect(acted.steps.map(\.status) == [.done, .failed])
        #expect(acted.tokenSHA256 == AuditChain.sha256Hex(Array("h.p.s".utf8)))
        let junk = AuditChain.sha256Hex(Array("junk".utf8))
        #expect(try await ledger.rejectedDigests([junk, AuditChain.sha256Hex([1])]) == [junk])
        let listed = try await ledger.events(sourcePrefix: "kafka:t/", receivedFrom: 1_800_000_000, to: 1_800_000_002, afterID: 0, limit: 2)
        #expect(listed.map(\.jti) == ["plain", "acted"])
        #expect(try await ledger.events(sourcePrefix: "kafka:other/", receivedFrom: 0, to: .infinity, afterID: 0, limit: 9).isEmpty)

        #expect(try await ledger.reopenFailedSteps(ofEvent: acted.id, reason: "replay --apply") == 1)
        #expect(try await ledger.reopenFailedSteps(ofEvent: acted.id, reason: "replay --apply") == 0, "nothing failed is left")
        #expect(try await ledger.steps(ofEvent: acted.id).map(\.status) == [.done, .pending])
        let last = try #require(try await records(ledger).last)
        #expect(last["kind"]?.stringValue == "reopened")
        #expect(last["note"]?.stringValue == "replay --apply")
        _ = try await ledger.recordSteps([RecordedStep(eventID: acted.id, index: 1, status: .done, detail: "ok", finishing: .processed)])
        let done = try #require(try await records(ledger).last)
        #expect(done["outcome"]?.stringValue == "processed")
        #expect(done["steps"]?.arrayValue?.last?.objectValue?["attempts"]?.numberValue == 4, "attempts add up across runs")
        #expect(try await ledger.checkAuditChain() == .intact(count: 7, seq: try await ledger.auditHead().seq, head: try await ledger.auditHead().hash))
        await ledger.close()
    }

    /// Replay's lookups tell apart jtis the ledger holds as two events though Swift's `==` takes
    /// them for one (canonically equivalent: `K` and the Kelvin sign U+212A).
    @Test(arguments: Backend.allCases) func lookupsCompareCodePoints(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await open(storage)
        let issuer = "https://issuer.example/"
        let latin = EventKey(issuer: issuer, jti: "K-1"), kelvin = EventKey(issuer: issuer, jti: "\u{212A}-1")
        #expect("K-1" == "\u{212A}-1", "Swift's own comparison, which the key must not use")
        #expect(latin != kelvin)
        let claims = try await ledger.record([.event(E.event(jti: latin.jti), outcome: .processed, steps: []),
                                              .event(E.event(jti: kelvin.jti), outcome: .processed, steps: [])])
        #expect(claims.compactMap { $0 }.count == 2, "two events, two claims")
        let states = try await ledger.eventStates([latin, kelvin])
        #expect(states.count == 2)
        #expect(try #require(states[latin]).id != (try #require(states[kelvin])).id)
        #expect(Set([latin, kelvin]).count == 2)
        await ledger.close()
    }

    /// Replay's question before lifting a restriction: is a later event of this subject held?
    @Test(arguments: Backend.allCases) func aLaterEventOfASubjectIsFound(_ backend: Backend) async throws {
        let storage = try await LedgerUnderTest(backend)
        let ledger = try await open(storage)
        let event = E.event(jti: "later")  // iat 1_800_000_000
        let subject = try #require(event.subject)
        let claims = try await ledger.record([.event(event, outcome: .processed, steps: [])])
        guard case .new(let id)?? = claims.first else {
            Issue.record("no claim: \(claims)")
            return
        }
        #expect(try await ledger.laterEvent(issuer: event.issuer, subject: subject, issuedAfter: 1_799_999_999) == id)
        #expect(try await ledger.laterEvent(issuer: event.issuer, subject: subject, issuedAfter: 1_800_000_000) == nil, "not later: the same time")
        #expect(try await ledger.laterEvent(issuer: "https://other.example/", subject: subject, issuedAfter: 0) == nil, "another issuer's")
        #expect(try await ledger.laterEvent(issuer: event.issuer, subject: #"{"format":"iss_sub","iss":"https://issuer.example/","sub":"2"}"#,
                                            issuedAfter: 0) == nil, "another subject's")
        await ledger.close()
    }

    /// Two replicas on one PostgreSQL ledger append to one chain, never forking it.
    @Test func replicasAppendToOneChain() async throws {
        let storage = try await LedgerUnderTest(.postgres)
        let a = try await open(storage), b = try await open(storage)
        try await withThrowingTaskGroup(of: Void.self) { group in
            for (n, ledger) in [a, b].enumerated() {
                group.addTask {
                    for i in 0..<40 {
                        _ = try await ledger.record([.event(E.event(jti: "r\(n)-\(i)"), outcome: .processed, steps: []),
                                                     .event(E.event(jti: "shared-\(i)"), outcome: .processed, steps: [])])
                    }
                }
            }
            try await group.waitForAll()
        }
        #expect(try await a.checkAuditChain() == .intact(count: 160, seq: try await a.auditHead().seq, head: try await a.auditHead().hash))
        await a.close()
        await b.close()
    }
}
