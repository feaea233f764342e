import AsyncHTTPClient
import Foundation
import Kafka
import Ledger
import SETMinting
import SecurityEvents
import Testing
import TokenVerification
import WardenTestSupport
@testable import WardenCLI

/// `warden replay` and `warden audit` against what a real worker left in its ledger: a push
/// receiver on loopback, a JWKS served over HTTP and then rotated, a webhook that counts calls.
@Suite("warden replay and audit", .serialized, .timeLimit(.minutes(6)))
struct ReplayTests {
    /// The key the issuer used first, and the one it rotated to.
    static let before = try! SigningKey.rsa(keyID: "replay-before", algorithm: "RS256")
    static let after = try! SigningKey.rsa(keyID: "replay-after", algorithm: "RS256")
    /// Another key under the first key's kid: what a forger would sign with.
    static let forger = try! SigningKey.rsa(keyID: "replay-before", algorithm: "RS256")

    static func token(_ jti: String, key: SigningKey = before, subject: String = "u1") throws -> String {
        try SETMinter.token(claims: SETMinter.riscClaims(issuer: WorkerTests.issuer, audience: WorkerTests.audience,
                                                         subject: subject, jti: jti), key: key)
    }

    struct Report {
        let status: Int32
        let stdout: String
        let lines: [JSONObject]
        var statuses: [String] { lines.compactMap { $0["status"]?.stringValue } }
    }

    /// A RISC SET of `event` for `subject`, signed by the worker tests' EC key.
    static func token(_ event: EventType, _ subject: String, _ jti: String, issuedAt: Double) throws -> String {
        try SETMinter.token(claims: SETMinter.riscClaims(issuer: WorkerTests.issuer, audience: WorkerTests.audience, event: event,
                                                         subject: subject, jti: jti, issuedAt: issuedAt), key: WorkerTests.ec)
    }

    /// Applies an account-disabled of subject `u1` issued a minute before `now`.
    static func disableU1(_ config: URL, _ directory: URL, now: Double) async throws {
        let first = directory.appendingPathComponent("first.log")
        try (try token(.accountDisabled, "u1", "disabled-1", issuedAt: now - 60) + "\n").write(to: first, atomically: true, encoding: .utf8)
        let disabled = try await replay(config, first, apply: true)
        #expect(disabled.status == 0, "\(disabled.stdout)")
    }

    static func replay(_ config: URL, _ log: URL, apply: Bool = false, html: URL? = nil) async throws -> Report {
        let report = config.deletingLastPathComponent().appendingPathComponent("report-\(UUID().uuidString).jsonl")
        var arguments = ["replay", "--config", config.path, "--file", log.path, "--report", report.path]
        if apply { arguments.append("--apply") }
        if let html { arguments += ["--html", html.path] }
        let result = try await Warden.run(arguments)
        let text = (try? String(contentsOf: report, encoding: .utf8)) ?? ""
        let lines = try text.split(separator: "\n").map { try #require(try JSONParser.parse(String($0)).objectValue) }
        return Report(status: result.status, stdout: result.stdout + result.stderr, lines: lines)
    }

    @Test func aLogIsComparedWithTheLedgerThenRepairedExactlyOnce() async throws {
        let keys = try await KeyServer.start()
        keys.serve("/jwks", json: SETMinter.jwks([Self.before]))
        let hooks = try await KeyServer.start()
        hooks.serve("/hook", .init(body: "", status: 400))  // refuses for good until told otherwise
        let setup = try PushReceiverTests.Setup(keySource: "jwks-uri: \(keys.url("/jwks"))", bearerTokens: false,
                                                extra: WorkerTests.notifyPolicy(hook: hooks.url("/hook")))
        defer { setup.cleanUp() }
        let failed = try Self.token("failed-1"), done = try Self.token("done-1"), never = try Self.token("never-1")
        let forged = try Self.token("forged-1", key: Self.forger)
        let lateKey = try Self.token("late-key-1", key: Self.after)

        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        #expect(try await PushReceiverTests.send(port, failed, bearer: nil).status == 202)
        try await WorkerTests.waitFor("the first event's step failed for good") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().first?.outcome == "failed"
        }
        hooks.serve("/hook", .init(body: "", status: 200))
        #expect(try await PushReceiverTests.send(port, done, bearer: nil).status == 202)
        #expect(try await PushReceiverTests.send(port, forged, bearer: nil).status == 400)
        // Signed by a key the issuer does not publish yet: refused.
        #expect(try await PushReceiverTests.send(port, lateKey, bearer: nil).status == 400)
        try await WorkerTests.waitFor("the second event processed") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 2
                && SQLiteLedgerReader(path: setup.ledgerPath).eventCount(outcome: .processed) == 1
        }
        #expect(await worker.terminate() == 0)

        // The issuer rotates: its JWKS now holds only the new key. Old tokens verify from the
        // archive the worker kept; the token refused for its unknown key verifies now.
        keys.serve("/jwks", json: SETMinter.jwks([Self.after]))
        let log = setup.directory.appendingPathComponent("events.log")
        try """
        \(done)
        \(failed)

        \(forged)
        {"token": "\(done)", "received_at": "\(RFC3339.string(from: Date().timeIntervalSince1970 + 1))"}
        \(never)
        not a token at all
        \(lateKey)
        {"no-token": true}
        """.write(to: log, atomically: true, encoding: .utf8)
        _ = try await runProgram("/usr/bin/gzip", ["-k", log.path])
        let gzipped = URL(fileURLWithPath: log.path + ".gz")
        let callsBefore = hooks.requests("/hook")

        let html = setup.directory.appendingPathComponent("replay.html")
        let dry = try await Self.replay(setup.config, gzipped, html: html)
        #expect(dry.status == 1, "\(dry.stdout)")
        #expect(dry.statuses == ["ok", "planned-not-done", "invalid", "duplicate", "never-processed", "invalid", "verdict-changed", "invalid"])
        #expect(dry.lines.map { $0["position"]?.stringValue } == ["line 1", "line 2", "line 4", "line 5", "line 6", "line 7", "line 8", "line 9"])
        #expect(dry.lines[0]["jti"]?.stringValue == "done-1")
        #expect(dry.lines[0]["iss"]?.stringValue == WorkerTests.issuer)
        #expect(dry.lines[0]["verdict"]?.stringValue == "valid")
        #expect(dry.lines[0]["types"]?.arrayValue == [.string("sessions-revoked")])
        #expect(dry.lines[0]["planned"]?.arrayValue == [.string("notify")])
        // The key a valid entry verified with, to check before --apply; none for an invalid one.
        #expect(dry.lines[0]["kid"]?.stringValue?.isEmpty == false && dry.lines[0]["key_thumbprint"]?.stringValue?.count == 43,
                "\(dry.lines[0])")
        #expect(dry.lines[2]["kid"] == nil && dry.lines[2]["key_thumbprint"] == nil)
        #expect(dry.lines[2]["verdict"]?.stringValue == "invalid")
        #expect(dry.lines[2]["err"]?.stringValue == "invalid_key", "a token forged under an archived kid is refused: \(dry.lines[2])")
        #expect(dry.lines[2]["jti"]?.stringValue == "forged-1")
        #expect(dry.lines[1]["ledger_steps"]?.arrayValue?.first?.objectValue?["status"]?.stringValue == "failed")
        #expect(dry.stdout.contains("never-processed    1"), "\(dry.stdout)")
        // Lines that hold no token are said on stderr (the report's stdout+stderr): the wrong log
        // must not pass for one with nothing to repair.
        #expect(dry.stdout.contains("2 of 8 entries held no token (the first at line 7)"), "\(dry.stdout)")
        #expect(dry.stdout.contains("sessions-revoked: "), "\(dry.stdout)")
        #expect(hooks.requests("/hook") == callsBefore, "a dry run acts on nothing")
        let page = try String(contentsOf: html, encoding: .utf8)
        #expect(page.contains("<svg"))
        #expect(page.contains("never-1"))
        for external in ["<script", "<link", "src=", "url(", "@import"] {
            #expect(!page.contains(external), "the page must fetch nothing: found \(external)")
        }

        // --apply: the failed step runs again, the never-processed event and the one refused
        // then are claimed and acted on: three webhook calls, no more.
        let applied = try await Self.replay(setup.config, gzipped, apply: true)
        #expect(applied.status == 0, "\(applied.stdout)")
        #expect(hooks.requests("/hook") == callsBefore + 3)
        #expect(applied.lines.compactMap { $0["applied"]?.stringValue } == ["steps-run", "processed", "processed"])
        let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
        #expect(try reader.eventCount(outcome: .processed) == 4)
        #expect(try reader.deliveries().filter { $0.source == "replay" }.count == 1, "the failed event's steps ran as a replayed delivery")

        // Afterwards a dry run finds nothing missing, and applying again does nothing.
        let again = try await Self.replay(setup.config, gzipped)
        #expect(again.status == 0, "\(again.stdout)")
        #expect(again.statuses == ["ok", "ok", "invalid", "duplicate", "ok", "invalid", "ok", "invalid"])
        #expect(try await Self.replay(setup.config, log, apply: true).status == 0)
        #expect(hooks.requests("/hook") == callsBefore + 3)

        // A gzip file cut short is no whole log: exit 3, not a replay of what came before the cut.
        let whole = try Data(contentsOf: gzipped)
        let cut = setup.directory.appendingPathComponent("cut.log.gz")
        try whole.prefix(whole.count * 2 / 3).write(to: cut)
        let short = try await Self.replay(setup.config, cut)
        #expect(short.status == 3, "\(short.stdout)")
        #expect(short.stdout.contains("cut short"), "\(short.stdout)")
        // What could be read whole before the cut was still compared and reported.
        #expect(!short.lines.isEmpty && short.lines.count < 8, "\(short.lines.count) lines reported")
        #expect(short.lines.first?["jti"]?.stringValue == "done-1")
        // An empty log is said to be one.
        let empty = setup.directory.appendingPathComponent("empty.log")
        try "".write(to: empty, atomically: true, encoding: .utf8)
        let none = try await Self.replay(setup.config, empty)
        #expect(none.status == 0)
        #expect(none.stdout.contains("holds no entries"), "\(none.stdout)")

        // The audit trail holds every outcome, and exports as the schema says.
        let verified = try await Warden.run(["audit", "verify", "--config", setup.config.path])
        #expect(verified.status == 0, "\(verified.stdout)\(verified.stderr)")
        #expect(verified.stdout.hasPrefix("audit log intact: "))
        let export = try await Warden.run(["audit", "export", "--config", setup.config.path])
        #expect(export.status == 0)
        let exported = export.stdout.split(separator: "\n").map(String.init)
        #expect(exported.count >= 8)
        try await AuditExportTests.validate(exported)
    }

    /// `--apply` that cannot record an event (the ledger refuses it for good: it is dead-lettered)
    /// has repaired nothing: exit 1, not 0.
    @Test func anApplyTheLedgerRefusesIsNoRepair() async throws {
        let (directory, config, path) = try AuditExportTests.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        await (try SQLiteLedger(path: path)).close()
        _ = try await runProgram("/usr/bin/sqlite3", ["-cmd", ".timeout 5000", path, "CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;"])
        let log = directory.appendingPathComponent("events.log")
        try (try WorkerTests.token(jti: "refused-1", subject: "u-refused") + "\n").write(to: log, atomically: true, encoding: .utf8)
        let applied = try await Self.replay(config, log, apply: true)
        #expect(applied.lines.first?["applied"]?.stringValue?.hasPrefix("rejected") == true, "\(applied.lines)")
        #expect(applied.status == 1, "\(applied.stdout)")
    }

    /// `--apply` leaves alone an old event that lifts a restriction when the ledger holds a later
    /// event of its subject: acted on now, it would undo that one (an old account-enabled
    /// deleting the sign-in flag a later account-disabled set). It stays a discrepancy. Another
    /// subject's, and an old revocation of the same subject, are applied.
    @Test func anOldLiftingEventIsNotAppliedAfterALaterOneOfItsSubject() async throws {
        let (directory, config, path) = try AuditExportTests.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        await (try SQLiteLedger(path: path)).close()
        let now = Date().timeIntervalSince1970
        try await Self.disableU1(config, directory, now: now)

        let late = directory.appendingPathComponent("late.log")
        try ([try Self.token(.accountEnabled, "u1", "enabled-old", issuedAt: now - 600),
              try Self.token(.accountEnabled, "u2", "enabled-other", issuedAt: now - 600),
              try Self.token(.sessionsRevoked, "u1", "revoked-old", issuedAt: now - 600)].joined(separator: "\n") + "\n")
            .write(to: late, atomically: true, encoding: .utf8)
        let applied = try await Self.replay(config, late, apply: true)
        #expect(applied.status == 1, "\(applied.stdout)")
        let notes = applied.lines.map { $0["applied"]?.stringValue ?? "" }
        #expect(notes.count == 3)
        #expect(notes.first?.hasPrefix("not applied: it lifts a restriction, and ledger event") == true, "\(notes)")
        #expect(notes.dropFirst().allSatisfy { !$0.isEmpty && !$0.hasPrefix("not applied") }, "\(notes)")
        #expect(Set(try SQLiteLedgerReader(path: path).events().map(\.jti)) == ["disabled-1", "enabled-other", "revoked-old"])
        let dry = try await Self.replay(config, late)
        #expect(dry.statuses == ["never-processed", "ok", "ok"], "\(dry.stdout)")
    }

    /// Keys unavailable stop the replay with exit 3, after comparing every entry before the one
    /// that needed them, those of its own batch included.
    @Test func keysUnavailableStopAfterComparingTheEntriesBeforeThem() async throws {
        let (directory, config, path) = try AuditExportTests.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        await (try SQLiteLedger(path: path)).close()
        let unreachable = "https://unreachable.example"
        try """
        \(WorkerTests.issuerSection("jwks-file: jwks.json"))
          - issuer: \(unreachable)
            jwks-uri: http://127.0.0.1:1/jwks
            key-retry-interval: 100ms
            audiences: [\(WorkerTests.audience)]
            algorithms: [ES256]
        ledger: sqlite:ledger.sqlite
        """.write(to: config, atomically: true, encoding: .utf8)
        let stranded = try SETMinter.token(claims: SETMinter.riscClaims(issuer: unreachable, audience: WorkerTests.audience,
                                                                         subject: "s", jti: "stranded"), key: WorkerTests.ec)
        let log = directory.appendingPathComponent("keys.log")
        try ([try WorkerTests.token(jti: "before-1", subject: "a"), try WorkerTests.token(jti: "before-2", subject: "b"), stranded,
              try WorkerTests.token(jti: "after", subject: "c")].joined(separator: "\n") + "\n").write(to: log, atomically: true, encoding: .utf8)
        let stopped = try await Self.replay(config, log)
        #expect(stopped.status == 3, "\(stopped.stdout)")
        #expect(stopped.lines.map { $0["jti"]?.stringValue ?? "" } == ["before-1", "before-2"], "\(stopped.lines)")
        #expect(stopped.statuses == ["never-processed", "never-processed"])
    }

    /// The same holds for an old lifting event whose own steps failed: run again now, they would
    /// undo the later event of its subject. They are left failed, a discrepancy still.
    @Test func anOldLiftingEventsFailedStepsAreNotRunAgainAfterALaterOneOfItsSubject() async throws {
        let (directory, config, path) = try AuditExportTests.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        await (try SQLiteLedger(path: path)).close()
        let now = Date().timeIntervalSince1970
        try await Self.disableU1(config, directory, now: now)

        // An older account-enabled of the same subject, claimed with a step that failed for good.
        let enabled = try Self.token(.accountEnabled, "u1", "enabled-old", issuedAt: now - 600)
        let configuration = try WardenConfiguration.parse(yaml: String(contentsOf: config, encoding: .utf8), baseDirectory: directory)
        let verified = try await configuration.makeVerifier(client: HTTPClient.shared, logger: WorkerTests.quiet).verify(enabled).get()
        let ledger = try SQLiteLedger(path: path)
        let event = LedgerEvent(issuer: WorkerTests.issuer, jti: "enabled-old", token: enabled, source: "push",
                                eventTypes: [EventType.accountEnabled.uri], subject: verified.token.primarySubject?.jsonText,
                                keyID: WorkerTests.ec.keyID, algorithm: "ES256", keyThumbprint: verified.keyThumbprint,
                                issuedAt: now - 600, receivedAt: now - 590)
        guard case .new(let id) = try await ledger.claim(event, outcome: .pending, steps: [OutboxStep(index: 0, kind: "delete-flag", action: "{}")]) else {
            Issue.record("not claimed")
            return
        }
        _ = try await ledger.recordSteps([RecordedStep(eventID: id, index: 0, status: .failed, detail: "refused by the target", finishing: .failed)])
        await ledger.close()

        let late = directory.appendingPathComponent("late.log")
        try (enabled + "\n").write(to: late, atomically: true, encoding: .utf8)
        let applied = try await Self.replay(config, late, apply: true)
        #expect(applied.status == 1, "\(applied.stdout)")
        #expect(applied.lines.first?["status"]?.stringValue == "planned-not-done", "\(applied.lines)")
        #expect(applied.lines.first?["applied"]?.stringValue?.hasPrefix("not applied: it lifts a restriction, and ledger event") == true,
                "\(applied.lines)")
        let steps: [OutboxStep] = try SQLiteLedgerReader(path: path).steps(ofEvent: id)
        #expect(steps.map { $0.status } == [StepStatus.failed] && steps.first?.detail == "refused by the target", "\(steps)")
    }

    /// `warden replay --topic`: a consumer of its own over a time range, against the ledger.
    @Test func aTopicRangeIsComparedWithTheLedger() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("security-events", 2)], logger: WorkerTests.quiet)
        let directory = try WorkerTests.keyFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        let config = directory.appendingPathComponent("warden.yaml")
        try """
        \(WorkerTests.issuerSection("jwks-file: jwks.json"))
        kafka:
          brokers: \(cluster.bootstrapServers)
          topic: security-events
          group: replay-test
        ledger: sqlite:ledger.sqlite
        """.write(to: config, atomically: true, encoding: .utf8)
        // In the range: one the ledger holds, one it never saw; before it: one ignored.
        let start = (Date().timeIntervalSince1970 - 120).rounded(.down)
        let seen = try WorkerTests.token(jti: "seen", subject: "a", key: WorkerTests.rsa)
        let unseen = try WorkerTests.token(jti: "unseen", subject: "b", key: WorkerTests.rsa)
        let early = try WorkerTests.token(jti: "early", subject: "c", key: WorkerTests.rsa)
        // A forged copy of an event the ledger recorded and the topic no longer holds: it must
        // not hide that event's absence.
        let forgedGone = try SETMinter.token(claims: SETMinter.riscClaims(issuer: WorkerTests.issuer, audience: WorkerTests.audience,
                                                                          subject: "d", jti: "gone"), key: Self.forger)
        let producer = """
            import sys
            from confluent_kafka import Producer
            p = Producer({"bootstrap.servers": sys.argv[1]})
            for ts, value in ((\(Int(start) - 3600) * 1000, sys.argv[2]), (\(Int(start) + 10) * 1000, sys.argv[3]), (\(Int(start) + 20) * 1000, sys.argv[4]), (\(Int(start) + 25) * 1000, sys.argv[5])):
                p.produce("security-events", value=value.encode(), key=b"k", partition=1, timestamp=ts)
            p.flush(10)
            """
        _ = try await runProgram("/usr/bin/python3", ["-c", producer, cluster.bootstrapServers, early, seen, unseen, forgedGone])
        let ledgerPath = directory.appendingPathComponent("ledger.sqlite").path
        let ledger = try SQLiteLedger(path: ledgerPath)
        func event(_ jti: String, _ token: String, source: String, at time: Double) -> LedgerEvent {
            LedgerEvent(issuer: WorkerTests.issuer, jti: jti, token: token, source: source,
                        eventTypes: [EventType.sessionsRevoked.uri], subject: nil, keyID: WorkerTests.rsa.keyID, algorithm: "RS256",
                        keyThumbprint: "t", issuedAt: time, receivedAt: time)
        }
        _ = try await ledger.claim(event("seen", seen, source: "kafka:security-events/1/1", at: start + 11), outcome: .processed, steps: [])
        // Produced before the range (its timestamp) but consumed in it (the ledger's time): still
        // on the topic, outside the range, so not missing from it.
        _ = try await ledger.claim(event("early", early, source: "kafka:security-events/1/0", at: start + 5), outcome: .processed, steps: [])
        // Recorded from the topic in the range, but no longer on it (retention).
        _ = try await ledger.claim(event("gone", "x.y.z", source: "kafka:security-events/0/0", at: start + 30), outcome: .processed, steps: [])
        // Received by a worker after the replay took the topic's ends (it goes on consuming
        // meanwhile), from an offset past them: not missing from what the replay read.
        _ = try await ledger.claim(event("later", "x.y.z", source: "kafka:security-events/1/99", at: Date().timeIntervalSince1970 + 600),
                                   outcome: .processed, steps: [])
        // From another topic: not this replay's business.
        _ = try await ledger.claim(event("other", "x.y.z", source: "kafka:other/0/0", at: start + 30), outcome: .processed, steps: [])
        await ledger.close()

        let report = directory.appendingPathComponent("report.jsonl")
        let result = try await Warden.run(["replay", "--config", config.path, "--topic", "security-events",
                                           "--from", RFC3339.string(from: start), "--to", RFC3339.string(from: start + 3 * 3600),
                                           "--report", report.path])
        #expect(result.status == 1, "\(result.stdout)\(result.stderr)")
        let lines = try String(contentsOf: report, encoding: .utf8).split(separator: "\n").map { try #require(try JSONParser.parse(String($0)).objectValue) }
        let byJTI = lines.map { "\($0["jti"]?.stringValue ?? ""): \($0["status"]?.stringValue ?? "")" }.sorted()
        #expect(byJTI == ["gone: invalid", "gone: not-in-log", "seen: ok", "unseen: never-processed"])
        #expect(result.stdout.contains("not-in-log         1"), "\(result.stdout)")
        // --apply repairs what it can (the unseen event is claimed), and still exits 1: an event
        // gone from the topic is no replay's to repair.
        let applied = try await Warden.run(["replay", "--config", config.path, "--topic", "security-events",
                                            "--from", RFC3339.string(from: start), "--to", RFC3339.string(from: start + 3 * 3600), "--apply"])
        #expect(applied.status == 1, "\(applied.stdout)\(applied.stderr)")
        #expect(try SQLiteLedgerReader(path: ledgerPath).events().map(\.jti).contains("unseen"))
    }

    @Test func usageErrorsExitTwo() async throws {
        let directory = try WorkerTests.keyFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        let config = directory.appendingPathComponent("warden.yaml")
        try "\(WorkerTests.issuerSection("jwks-file: jwks.json"))\nledger: sqlite:ledger.sqlite\n".write(to: config, atomically: true, encoding: .utf8)
        for arguments in [["--file", "a", "--topic", "b"], [], ["--topic", "t", "--from", "yesterday"], ["--file", "/nonexistent/log"],
                          ["--topic", "t"]] {
            let result = try await Warden.run(["replay", "--config", config.path] + arguments)
            #expect(result.status == 2, "\(arguments): \(result.stderr)")
        }
        // No ledger yet: audit and replay refuse rather than create an empty one.
        let audit = try await Warden.run(["audit", "verify", "--config", config.path])
        #expect(audit.status == 2)
        #expect(audit.stderr.contains("no ledger at"))
        #expect(!FileManager.default.fileExists(atPath: directory.appendingPathComponent("ledger.sqlite").path))
    }
}

/// `warden audit`: exports valid against the schema, with hashes an independent program
/// recomputes; tampering named with exit 1.
@Suite("warden audit", .serialized)
struct AuditExportTests {
    /// Validates exported lines against schemas/audit-record.schema.json, and recomputes every
    /// hash and link in Python from the exported objects alone.
    static func validate(_ lines: [String]) async throws {
        let directory = try Warden.temporaryDirectory()
        let file = directory.appendingPathComponent("export.jsonl")
        try (lines.joined(separator: "\n") + "\n").write(to: file, atomically: true, encoding: .utf8)
        let checker = """
            import hashlib, json, sys
            from jsonschema import Draft202012Validator
            schema = json.load(open(sys.argv[1]))
            validator = Draft202012Validator(schema)
            previous, start = "0" * 64, None
            for n, line in enumerate(open(sys.argv[2]), 1):
                record = json.loads(line)
                errors = list(validator.iter_errors(record))
                if errors: sys.exit(f"line {n}: {errors[0].message}")
                stored, link = record.pop("hash"), record.pop("prev_hash")
                # After retention the export starts where the chain kept does: a checkpoint must name it.
                if n == 1 and link != previous: previous = start = link
                if record.get("kind") == "checkpoint" and record["pruned_through_hash"] == start: start = None
                if link != previous: sys.exit(f"line {n}: prev_hash does not link")
                text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                if hashlib.sha256((previous + "\\n" + text).encode()).hexdigest() != stored: sys.exit(f"line {n}: hash differs")
                previous = stored
            if start: sys.exit("the export starts after a cut no checkpoint names")
            print(n)
            """
        let schema = Warden.packageRoot.appendingPathComponent("schemas/audit-record.schema.json")
        let counted = try await runProgram("/usr/bin/python3", ["-c", checker, schema.path, file.path])
        #expect(counted == String(lines.count))
    }

    /// A key folder with a configuration naming a SQLite ledger in it (not created yet).
    static func ledgerFolder() throws -> (directory: URL, config: URL, ledger: String) {
        let directory = try WorkerTests.keyFolder()
        let config = directory.appendingPathComponent("warden.yaml")
        try "\(WorkerTests.issuerSection("jwks-file: jwks.json"))\nledger: sqlite:ledger.sqlite\n".write(to: config, atomically: true, encoding: .utf8)
        return (directory, config, directory.appendingPathComponent("ledger.sqlite").path)
    }

    /// A verified event as pushed, for writing a ledger directly.
    static func pushedEvent(_ jti: String, subject: String?) -> LedgerEvent {
        LedgerEvent(issuer: WorkerTests.issuer, jti: jti, token: "a.b.c", source: "push", eventTypes: ["urn:e"], subject: subject,
                    keyID: "k", algorithm: "RS256", keyThumbprint: "t", issuedAt: 1, receivedAt: 2)
    }

    /// A key last seen published 30 hours before a token was issued: the worker, its provider
    /// unreachable, went on using its cached copy that long (24 h lifetime at most, then 24 h
    /// stale), so replay trusts the archived key as long; past that the token is refused.
    @Test func archivedKeysAreTrustedAsLongAsTheWorkerUsesThem() async throws {
        let directory = try WorkerTests.keyFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        try SETMinter.jwks([WorkerTests.ec]).write(to: directory.appendingPathComponent("live.json"), atomically: true, encoding: .utf8)
        let configuration = try WardenConfiguration.parse(yaml: WorkerTests.issuerSection("jwks-file: live.json"), baseDirectory: directory)
        let jwk = try #require(try JSONParser.parse(SETMinter.jwks([WorkerTests.rsa])).objectValue?["keys"]?.arrayValue?.first?.objectValue)
        let thumbprint = try KeySet.makeKey(jwk, keyID: WorkerTests.rsa.keyID).get().thumbprint
        func verifier(lastSeenHoursAgo hours: Double) -> SETVerifier {
            let seen = Date().timeIntervalSince1970 - hours * 3600
            let archived = ArchivedKey(issuer: WorkerTests.issuer, keyID: WorkerTests.rsa.keyID, thumbprint: thumbprint,
                                       jwk: JSONValue.object(jwk).jsonText, firstSeen: seen - 86_400, lastSeen: seen)
            return configuration.makeVerifier(client: HTTPClient.shared, logger: WorkerTests.quiet, archived: [archived])
        }
        let token = try WorkerTests.token(jti: "while-stale", subject: "u", key: WorkerTests.rsa)
        let trusted = await verifier(lastSeenHoursAgo: 30).verify(token)
        if case .failure(let error) = trusted { Issue.record("refused: \(error)") }
        guard case .failure(let late) = await verifier(lastSeenHoursAgo: 49).verify(token) else {
            Issue.record("a token issued 49 hours after its key was last seen must be refused"); return
        }
        #expect(late.reportedCode == "invalid_key", "\(late)")
    }

    /// A key put into the ledger's archive by hand (its JWK and thumbprint made right, under a
    /// kid the issuer never published) is not trusted by replay: the token signed with it is
    /// invalid, replay says the archive is not attested, and `audit verify` names the key.
    @Test func aKeyAddedToTheArchiveByHandIsNotTrusted() async throws {
        let keys = try await KeyServer.start()
        keys.serve("/jwks", json: SETMinter.jwks([ReplayTests.before]))
        let setup = try PushReceiverTests.Setup(keySource: "jwks-uri: \(keys.url("/jwks"))", bearerTokens: false)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        #expect(try await PushReceiverTests.send(port, try ReplayTests.token("genuine-1"), bearer: nil).status == 202)
        #expect(await worker.terminate() == 0)

        let planted = try SigningKey.rsa(keyID: "planted", algorithm: "RS256")
        let jwk = try #require(try JSONParser.parse(SETMinter.jwks([planted])).objectValue?["keys"]?.arrayValue?.first?.objectValue)
        let thumbprint = try KeySet.makeKey(jwk, keyID: planted.keyID).get().thumbprint
        let now = Date().timeIntervalSince1970
        let jwkText = JSONValue.object(jwk).jsonText.replacingOccurrences(of: "'", with: "''")
        _ = try await runProgram("/usr/bin/sqlite3", [setup.ledgerPath, """
            INSERT INTO signing_keys (issuer, kid, thumbprint, jwk, first_seen, last_seen)
            VALUES ('\(WorkerTests.issuer)', 'planted', '\(thumbprint)', '\(jwkText)', \(now - 86_400), \(now))
            """])
        let log = setup.directory.appendingPathComponent("forged.log")
        try (try ReplayTests.token("forged-under-planted", key: planted) + "\n").write(to: log, atomically: true, encoding: .utf8)
        let dry = try await ReplayTests.replay(setup.config, log)
        #expect(dry.lines.first?["verdict"]?.stringValue == "invalid", "a token signed with a planted key passed: \(dry.lines)")
        #expect(dry.statuses == ["invalid"])
        #expect(dry.stdout.contains("archived keys no intact record attests are not used"), "\(dry.stdout)")
        // The entry compares as it should, but the ledger's chain is broken: not a clean replay.
        #expect(dry.status == 1, "\(dry.stdout)")
        #expect(dry.stdout.contains("the replay exits 1"), "\(dry.stdout)")
        let applied = try await ReplayTests.replay(setup.config, log, apply: true)
        #expect(applied.statuses == ["invalid"])
        #expect(applied.status == 1, "\(applied.stdout)")

        let verified = try await Warden.run(["audit", "verify", "--config", setup.config.path])
        #expect(verified.status == 1, "\(verified.stdout)\(verified.stderr)")
        #expect(verified.stdout.contains(#""planted""#) && verified.stdout.contains(thumbprint), "\(verified.stdout)")
    }

    /// A line holding a token longer than the maximum token size is refused for its size
    /// alone, and not kept while its batch is compared (a log of such lines stays small in
    /// memory); the entries beside it are replayed.
    @Test func aTokenTooLongIsRefusedWithoutBeingKept() async throws {
        let (directory, config, path) = try Self.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        await (try SQLiteLedger(path: path)).close()
        let log = directory.appendingPathComponent("events.log")
        let long = String(repeating: "a", count: 70_000)
        try "\(long)\n{\"token\": \"\(long)\"}\n\(try WorkerTests.token(jti: "fine", subject: "u"))\n".write(to: log, atomically: true, encoding: .utf8)
        let report = try await ReplayTests.replay(config, log)
        #expect(report.statuses == ["invalid", "invalid", "never-processed"])
        for line in report.lines.prefix(2) {
            #expect(line["err"]?.stringValue == "invalid_request")
            #expect(line["description"]?.stringValue == "the token is 70000 bytes, more than the 65536 allowed", "\(line)")
        }
    }

    /// An event the ledger's retention dropped is reported `beyond-retention`, not
    /// `never-processed`, and `--apply` does not act on it a second time.
    @Test func anEventRetentionDroppedIsNotActedOnAgain() async throws {
        let hooks = try await KeyServer.start()
        hooks.serve("/hook", .init(body: "", status: 200))
        let (directory, config, path) = try Self.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        let text = try String(contentsOf: config, encoding: .utf8) + WorkerTests.notifyPolicy(hook: hooks.url("/hook")) + "\n"
        try text.write(to: config, atomically: true, encoding: .utf8)
        await (try SQLiteLedger(path: path)).close()
        let log = directory.appendingPathComponent("events.log")
        try (try WorkerTests.token(jti: "old-1", subject: "u-old") + "\n").write(to: log, atomically: true, encoding: .utf8)
        let first = try await ReplayTests.replay(config, log, apply: true)
        #expect(first.status == 0, "\(first.stdout)")
        #expect(hooks.requests("/hook") == 1)
        // Retention drops everything received before a cutoff a minute ahead (but the newest
        // event, kept until a later one comes so its id is never given again: one comes).
        let ledger = try SQLiteLedger(path: path)
        let later = LedgerEvent(issuer: "https://other.example/", jti: "later", token: "h.p.s", source: "push", eventTypes: [],
                                subject: nil, keyID: "k", algorithm: "RS256", keyThumbprint: "t", issuedAt: 0,
                                receivedAt: Date().timeIntervalSince1970 + 3600)
        _ = try await ledger.record([.event(later, outcome: .processed, steps: [])])
        var after: Int64 = 0, dropped = 0
        while true {
            let result = try await ledger.prune(before: Date().timeIntervalSince1970 + 60, limit: 100, afterEventID: after)
            dropped += result.events
            after = result.lastEventID
            if !result.more { break }
        }
        await ledger.close()
        #expect(dropped == 1)
        let dry = try await ReplayTests.replay(config, log)
        #expect(dry.statuses == ["beyond-retention"])
        #expect(dry.status == 0, "\(dry.stdout)")
        let again = try await ReplayTests.replay(config, log, apply: true)
        #expect(again.status == 0, "\(again.stdout)")
        #expect(hooks.requests("/hook") == 1, "acted on a second time")
    }

    /// After retention: the export starts at the chain's start, checkpoints valid against the
    /// schema; a record put before the start is named by verify and not exported.
    @Test func aPrunedChainExportsValidAndWhatLiesBeforeItsStartIsNamed() async throws {
        let (directory, config, path) = try Self.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        let ledger = try SQLiteLedger(path: path)
        for i in 0..<3 {
            _ = try await ledger.record([
                .event(Self.pushedEvent("j\(i)", subject: #"{"format":"opaque","id":"x"}"#), outcome: .processed, steps: []),
                .rejection(Rejection(token: [0, 1, 2], source: "push", code: "invalid_request", description: "junk", receivedAt: 3)),
            ])
        }
        // Everything was recorded before a cutoff a day ahead: all goes but the checkpoint.
        _ = try await ledger.prune(before: Date().timeIntervalSince1970 + 86_400, limit: 100, afterEventID: 0)
        _ = try await ledger.record([.event(Self.pushedEvent("later", subject: nil), outcome: .processed, steps: [])])
        let start = try await ledger.auditStart(), head = try await ledger.auditHead()
        #expect(start.seq > 0)
        await ledger.close()
        let export = try await Warden.run(["audit", "export", "--config", config.path])
        #expect(export.status == 0)
        let lines = export.stdout.split(separator: "\n").map(String.init)
        #expect(lines.count == Int(head.seq - start.seq), "the records after the start: \(export.stdout)")
        #expect(lines.contains { $0.contains(#""kind":"checkpoint""#) })
        try await Self.validate(lines)
        #expect(try await Warden.run(["audit", "verify", "--config", config.path]).status == 0)

        _ = try await runProgram("/usr/bin/sqlite3", ["-cmd", ".timeout 5000", path, "INSERT INTO audit_records VALUES (\(start.seq), '{\"seq\":\(start.seq)}', 'x', 'y')"])
        let broken = try await Warden.run(["audit", "verify", "--config", config.path])
        #expect(broken.status == 1)
        #expect(broken.stdout.contains("broken at record \(start.seq)"), "\(broken.stdout)")
        let after = try await Warden.run(["audit", "export", "--config", config.path])
        #expect(after.stdout == export.stdout, "what lies before the start is not part of the chain")
    }

    @Test func tamperingIsNamedWithExitOne() async throws {
        let (directory, config, path) = try Self.ledgerFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        let ledger = try SQLiteLedger(path: path)
        for i in 0..<5 {
            _ = try await ledger.record([
                .event(Self.pushedEvent("j\(i)", subject: #"{"format":"opaque","id":"\u0008x\u000c"}"#), outcome: .processed, steps: []),
                .rejection(Rejection(token: [0, 1, 2], source: "push", code: "invalid_request", description: "ünïcode \u{1} ok",
                                     receivedAt: 3)),
            ])
        }
        await ledger.close()
        let export = try await Warden.run(["audit", "export", "--config", config.path])
        #expect(export.status == 0)
        try await Self.validate(export.stdout.split(separator: "\n").map(String.init))
        let windowed = try await Warden.run(["audit", "export", "--config", config.path, "--from", "2000-01-01T00:00:00Z",
                                             "--to", "2001-01-01T00:00:00Z"])
        #expect(windowed.status == 0)
        #expect(windowed.stdout.isEmpty, "no record was recorded in 2000")

        let intact = try await Warden.run(["audit", "verify", "--config", config.path])
        #expect(intact.stdout.hasPrefix("audit log intact: 10 records, head 10:"), "\(intact.stdout)")
        let anchor = String(intact.stdout.split(separator: " ").last ?? "").trimmingCharacters(in: .whitespacesAndNewlines)
        #expect(try await Warden.run(["audit", "verify", "--config", config.path, "--anchor", anchor]).status == 0)
        #expect(try await Warden.run(["audit", "verify", "--config", config.path, "--anchor", "10:xyz"]).status == 2)
        _ = try await runProgram("/usr/bin/sqlite3", ["-cmd", ".timeout 5000", path, "UPDATE audit_records SET record = replace(record, 'j3', 'j9') WHERE seq = 7"])
        let broken = try await Warden.run(["audit", "verify", "--config", config.path])
        #expect(broken.status == 1)
        #expect(broken.stdout.contains("broken at record 7"), "\(broken.stdout)")

        // The tail cut and the head moved to match: only the anchor tells.
        _ = try await runProgram("/usr/bin/sqlite3", ["-cmd", ".timeout 5000", path, "UPDATE audit_records SET record = replace(record, 'j9', 'j3') WHERE seq = 7"])
        _ = try await runProgram("/usr/bin/sqlite3", ["-cmd", ".timeout 5000", path, "DELETE FROM audit_records WHERE seq = 10; UPDATE audit_head SET seq = 9, hash = (SELECT hash FROM audit_records WHERE seq = 9)"])
        #expect(try await Warden.run(["audit", "verify", "--config", config.path]).status == 0)
        let cut = try await Warden.run(["audit", "verify", "--config", config.path, "--anchor", anchor])
        #expect(cut.status == 1)
        #expect(cut.stdout.contains("broken at record 10"), "\(cut.stdout)")
    }
}

@Suite("warden replay: HTML report")
struct ReplayHTMLTests {
    /// A mark that joins the next character into one grapheme must not carry a `<` past the
    /// escaping: the jti, issuer and types of a report come from tokens anyone can send.
    @Test func hostileTextIsEscapedScalarByScalar() {
        let hostile = "\u{600}<img src=x onerror=alert(1)\u{600}>"
        let escaped = ReplayHTML.escape(hostile)
        #expect(!escaped.unicodeScalars.contains("<"))
        #expect(!escaped.unicodeScalars.contains(">"))
        #expect(escaped.contains("&lt;img"))
        var statistics = ReplayStatistics()
        statistics.add(ReplayFinding(position: "line 1", jti: hostile, issuer: "\u{301}<script>", valid: true, types: ["t"],
                                     status: .neverProcessed, planned: [], time: 1_800_000_000))
        let page = ReplayHTML.render(statistics, title: "<b>", applied: false)
        #expect(!page.contains("<img"))
        #expect(!page.contains("<script"))
    }
}

/// The replay's memory of events met: bounded in memory, exact across its move to disk.
@Suite("warden replay: events met")
struct SeenPairsTests {
    @Test func laterCopiesAreFoundInMemoryAndOnDisk() throws {
        let seen = SeenPairs(memoryLimit: 8)
        let first = try seen.insert((0..<20).map { $0 * 7 })
        #expect(first == Array(repeating: true, count: 20))
        // A batch mixing pairs met long ago (moved to disk), lately (in memory), within the
        // batch itself, and new ones.
        let second = try seen.insert([0, 133, 500, 500, 7, 501])
        #expect(second == [false, false, true, false, false, true])
        #expect(try seen.contains(14))
        #expect(try seen.contains(500))
        #expect(try !seen.contains(502))
    }
}
