import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import Kafka
import Ledger
import Logging
import SETMinting
import SecurityEvents
import Synchronization
import Testing
import WardenTestSupport
import WardenCLI

/// `warden run` as a user runs it: the built binary against librdkafka's mock cluster over TCP,
/// fed by an independent client (python3-confluent-kafka), its ledger read back from disk.
@Suite("warden run", .serialized, .timeLimit(.minutes(8)))
struct WorkerTests {
    static let issuer = "https://accounts.google.com/"
    static let audience = "1234-abc.apps.googleusercontent.com"
    static let rsa = try! SigningKey.rsa(keyID: "worker-rsa", algorithm: "RS256")
    static let ec = SigningKey.ec(keyID: "worker-ec", algorithm: "ES256")
    static let impostor = SigningKey.ec(keyID: "worker-ec", algorithm: "ES256")

    static var quiet: Logger {
        var logger = Logger(label: "worker-test")
        logger.logLevel = .critical
        return logger
    }

    /// A cluster, a folder with keys and a config, and the ledger path.
    struct Setup {
        let cluster: EmbeddedKafkaCluster
        let directory: URL
        let config: URL
        var ledgerPath: String { directory.appendingPathComponent("ledger.sqlite").path }

        init(partitions: Int = 4, keySource: String = "jwks-file: jwks.json", ledger: String = "sqlite:ledger.sqlite",
             extra: String = "") throws {
            cluster = try EmbeddedKafkaCluster(topics: [("security-events", partitions), ("security-events.dlq", 1)],
                                               logger: WorkerTests.quiet)
            directory = try WorkerTests.keyFolder()
            config = directory.appendingPathComponent("warden.yaml")
            try """
            \(WorkerTests.issuerSection(keySource))
            kafka:
              brokers: \(cluster.bootstrapServers)
              topic: security-events
              group: warden
              dead-letter-topic: security-events.dlq
              commit-interval: 200ms
              properties:
                session.timeout.ms: "6000"
                heartbeat.interval.ms: "500"
            http:
              listen: 127.0.0.1:0
            ledger: \(ledger)
            \(extra)
            """.write(to: config, atomically: true, encoding: .utf8)
        }

        func cleanUp() { try? FileManager.default.removeItem(at: directory) }
    }

    /// A scratch folder with `jwks.json` holding the test keys.
    static func keyFolder() throws -> URL {
        let directory = try Warden.temporaryDirectory()
        try SETMinter.jwks([rsa, ec]).write(to: directory.appendingPathComponent("jwks.json"), atomically: true, encoding: .utf8)
        return directory
    }

    /// The `issuers:` section for the test issuer, its keys from `keySource`.
    static func issuerSection(_ keySource: String) -> String {
        """
        issuers:
          - issuer: \(issuer)
            \(keySource)
            key-retry-interval: 500ms
            audiences: [\(audience)]
            algorithms: [RS256, ES256]
        """
    }

    static func token(jti: String = UUID().uuidString, subject: String, key: SigningKey = WorkerTests.ec) throws -> String {
        try SETMinter.token(claims: SETMinter.riscClaims(issuer: issuer, audience: audience, subject: subject, jti: jti), key: key)
    }

    /// Produces `(key, value)` pairs with python3-confluent-kafka.
    static func produce(_ brokers: String, _ messages: [(key: String, value: String)], topic: String = "security-events") async throws {
        let script = """
        import sys
        from confluent_kafka import Producer
        p = Producer({'bootstrap.servers': sys.argv[1]})
        failed = []
        for line in sys.stdin:
            key, value = line.rstrip('\\n').split('\\t', 1)
            while True:
                try:
                    p.produce(sys.argv[2], value=value.encode(), key=key.encode(),
                              headers={'content-type': 'application/secevent+jwt'},
                              on_delivery=lambda err, msg: failed.append(err) if err else None)
                    break
                except BufferError:
                    p.poll(0.1)
            p.poll(0)
        p.flush(30)
        sys.exit(1 if failed else 0)
        """
        let result = try await runToEnd(URL(fileURLWithPath: "/usr/bin/python3"), ["-c", script, brokers, topic],
                                        stdin: messages.map { "\($0.key)\t\($0.value)\n" }.joined())
        #expect(result.status == 0, "the confluent-kafka producer failed: \(result.stderr.suffix(2000))")
    }

    /// Waits (polling the ledger file) until `condition` holds, up to `timeout` seconds.
    static func waitFor(_ what: String, timeout: Double = 120, _ condition: () async throws -> Bool) async throws {
        let deadline = Date().addingTimeInterval(timeout)
        while Date() < deadline {
            if (try? await condition()) == true { return }
            try await Task.sleep(for: .milliseconds(200))
        }
        Issue.record("timed out waiting for \(what)")
        throw CancellationError()
    }

    /// Targets and policy for a configuration: every sessions-revoked event notifies a webhook.
    static func notifyPolicy(hook: String) -> String {
        """
        targets:
          app: {webhook: {url: "\(hook)", hmac-secret: test-secret}}
        policy:
          sessions-revoked:
            - notify: {target: app}
        """
    }

    /// The value of one sample in Prometheus text.
    static func metric(_ text: String, _ name: String) -> Double? {
        for line in text.split(separator: "\n") where line.hasPrefix(name + " ") {
            return Double(line.dropFirst(name.count + 1))
        }
        return nil
    }

    static func httpGet(_ port: Int, _ path: String) async throws -> (Int, String) {
        let (data, response) = try await URLSession.shared.data(from: URL(string: "http://127.0.0.1:\(port)\(path)")!)
        return ((response as! HTTPURLResponse).statusCode, String(decoding: data, as: UTF8.self))
    }

    @Test func recordsEachEventOnceDeadLettersInvalidOnesAndCommitsOnShutdown() async throws {
        let setup = try Setup()
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.httpPort()

        var messages: [(key: String, value: String)] = []
        for i in 0..<30 { messages.append(("user-\(i % 7)", try Self.token(subject: "user-\(i % 7)"))) }
        let recorded = Set(messages.map(\.value))
        messages[5].value = " " + messages[5].value + "  "  // whitespace around a token is not part of it
        messages.append(messages[3])  // the same SET delivered twice
        let forged = try Self.token(subject: "user-1", key: Self.impostor)
        messages.append(("user-1", forged))
        try await Self.produce(setup.cluster.bootstrapServers, messages)

        try await Self.waitFor("30 events and 2 more deliveries in the ledger") {
            let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
            return try reader.eventCount() >= 30 && reader.deliveries().count >= 2
        }
        let ledger = try SQLiteLedgerReader(path: setup.ledgerPath)
        let events = try ledger.events()
        #expect(events.count == 30)
        #expect(Set(events.map(\.jti)).count == 30)
        // Each event keeps its token exactly as it was verified, to be verified again later.
        #expect(Set(events.map(\.token)) == recorded)
        #expect(events.allSatisfy { $0.outcome == "processed" && $0.source.hasPrefix("kafka:security-events/") })
        let deliveries = try ledger.deliveries()
        #expect(deliveries.count == 2)
        #expect(deliveries.filter { $0.verdict == "duplicate" }.count == 1)
        let invalid = deliveries.filter { $0.verdict == "invalid" }
        #expect(invalid.count == 1)
        #expect(invalid.first?.errorCode == "invalid_key")

        // The dead letter: the original value, with the error and where it came from.
        let deadLetter = try await EngineWorkerTests.firstDeadLetter(setup.cluster.bootstrapServers)
        let letter = try #require(deadLetter)
        #expect(letter.value == Array(forged.utf8))
        // On the original's key, so it lands where that user's events go and can be re-driven.
        #expect(letter.key == Array("user-1".utf8))
        #expect(letter.header("warden-error") == Array("invalid_key".utf8))
        #expect(String(decoding: letter.header("warden-error-description") ?? [], as: UTF8.self).contains("signature"))
        #expect(String(decoding: letter.header("warden-source") ?? [], as: UTF8.self).hasPrefix("security-events/"))

        // Health, readiness and metrics.
        #expect(try await Self.httpGet(port, "/healthz").0 == 200)
        let ready = try await Self.httpGet(port, "/readyz")
        #expect(ready.0 == 200, "\(ready.1)")
        let metrics = try await Self.httpGet(port, "/metrics").1
        #expect(metrics.contains(#"warden_events_total{outcome="duplicate"} 1"#))
        #expect(metrics.contains(#"warden_events_total{outcome="processed"} 30"#))
        #expect(metrics.contains(#"warden_events_received_total{source="kafka"} 32"#))
        #expect(metrics.contains(#"warden_verify_failures_total{err="invalid_key"} 1"#))
        #expect(metrics.contains("warden_dead_letters_total 1"))
        #expect(metrics.contains("warden_verify_seconds_bucket"))
        #expect(metrics.contains(#"warden_build_info{version="\#(WardenVersion.current)"} 1"#))
        #expect(!metrics.contains("warden_keys_age_seconds{"))  // pinned keys are never fetched
        try await Self.waitFor("the consumer lag, reported each second") {
            try await Self.httpGet(port, "/metrics").1.contains(#"warden_kafka_consumer_lag{topic="security-events",partition="#)
        }
        // Every metric is described: a # HELP line before each # TYPE line.
        let lines = metrics.split(separator: "\n")
        for (i, line) in lines.enumerated() where line.hasPrefix("# TYPE ") {
            let name = line.dropFirst("# TYPE ".count).prefix { $0 != " " }
            #expect(i > 0 && lines[i - 1].hasPrefix("# HELP \(name) "), "no # HELP for \(name)")
        }

        #expect(await worker.terminate() == 0)
        // Tokens never appear whole in the logs.
        #expect(!worker.standardError.contains(forged))
        #expect(!worker.standardError.contains(messages[0].value))

        // Restarted, the worker resumes after the committed offsets: the 32 messages are not
        // delivered again. One new message per partition shows it is consuming.
        let restarted = try WorkerProcess(config: setup.config)
        _ = try await restarted.httpPort()
        var fresh: [(key: String, value: String)] = []
        for i in 0..<8 { fresh.append(("later-\(i)", try Self.token(subject: "later-\(i)"))) }
        try await Self.produce(setup.cluster.bootstrapServers, fresh)
        try await Self.waitFor("the new events") { try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 38 }
        #expect(await restarted.terminate() == 0)
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().count == 2)

        // The dead-letter topic replays like any other: the forged token is refused again, as
        // the ledger recorded it — consistent, exit 0.
        let report = setup.directory.appendingPathComponent("dlq-report.jsonl")
        let replay = try await Warden.run(["replay", "--config", setup.config.path, "--topic", "security-events.dlq",
                                           "--report", report.path])
        #expect(replay.status == 0, "\(replay.stdout)\(replay.stderr)")
        let replayed = try String(contentsOf: report, encoding: .utf8).split(separator: "\n")
        #expect(replayed.count == 1)
        #expect(replayed.first?.contains(#""status":"invalid""#) == true && replayed.first?.contains(#""err":"invalid_key""#) == true,
                "\(replayed)")
    }

    /// The provider's keys cannot be fetched: the message is neither recorded nor committed; it
    /// waits, retried, and a graceful stop leaves it for the next run, which records it once
    /// the keys are back.
    @Test func keysUnavailableIsRetriedAndNeverCommitted() async throws {
        let server = try await KeyServer.start()
        server.serve("/certs", KeyServer.Document(body: "unavailable", status: 503))
        let setup = try Setup(keySource: "jwks-uri: \(server.url("/certs"))")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.httpPort()
        let token = try Self.token(subject: "user-9")
        try await Self.produce(setup.cluster.bootstrapServers, [("user-9", token)])

        try await Self.waitFor("retries while keys are unavailable") {
            let metrics = try await Self.httpGet(port, "/metrics").1
            return Self.metric(metrics, #"warden_retries_total{reason="keys_unavailable"}"#) ?? 0 >= 3
        }
        #expect(try await Self.httpGet(port, "/readyz").0 == 503)
        let failing = try await Self.httpGet(port, "/metrics").1
        #expect(Self.metric(failing, #"warden_jwks_fetches_total{issuer="\#(Self.issuer)",result="error"}"#) ?? 0 >= 1, "\(failing)")
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().isEmpty)
        #expect(await worker.terminate() == 0)

        server.serve("/certs", json: SETMinter.jwks([Self.rsa, Self.ec]))
        let restarted = try WorkerProcess(config: setup.config)
        let restartedPort = try await restarted.httpPort()
        try await Self.waitFor("the event, once keys are back") { try SQLiteLedgerReader(path: setup.ledgerPath).eventCount() == 1 }
        // Fetched keys have an age, and the fetch is counted.
        let fetched = try await Self.httpGet(restartedPort, "/metrics").1
        #expect(Self.metric(fetched, #"warden_jwks_fetches_total{issuer="\#(Self.issuer)",result="ok"}"#) ?? 0 >= 1, "\(fetched)")
        let age = fetched.split(separator: "\n")
            .first { $0.hasPrefix("warden_keys_age_seconds{issuer=") }
        #expect(age.flatMap { Double($0.split(separator: " ").last ?? "") }.map { $0 >= 0 && $0 < 3600 } == true, "\(String(describing: age))")
        #expect(await restarted.terminate() == 0)
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().isEmpty)
        await server.stop()
    }

    /// The provider's keys stay unavailable longer than `kafka.max-key-wait`: the message is
    /// refused (`keys_unavailable`), recorded, dead-lettered and counted, its offset committed
    /// so the partition goes on; once the keys are back, `warden replay --apply` over the topic
    /// acts on it, and a dry run afterwards finds nothing missing.
    @Test func keysUnavailableTooLongIsRefusedAndReplayRepairsIt() async throws {
        let server = try await KeyServer.start()
        server.serve("/certs", KeyServer.Document(body: "unavailable", status: 503))
        let setup = try Setup(partitions: 1, keySource: "jwks-uri: \(server.url("/certs"))")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config, environment: ["WARDEN_KAFKA_MAX_KEY_WAIT": "2s"])
        let port = try await worker.httpPort()
        try await Self.produce(setup.cluster.bootstrapServers, [("user-9", try Self.token(subject: "user-9"))])

        try await Self.waitFor("the refusal in the ledger") { try !SQLiteLedgerReader(path: setup.ledgerPath).deliveries().isEmpty }
        let refused = try SQLiteLedgerReader(path: setup.ledgerPath).deliveries()
        #expect(refused.map(\.verdict) == ["invalid"])
        #expect(refused.map(\.errorCode) == ["keys_unavailable"])
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).eventCount() == 0)
        try await Self.waitFor("the refusal counted") {
            let metrics = try await Self.httpGet(port, "/metrics").1
            return Self.metric(metrics, #"warden_permanent_failures_total{what="keys_unavailable"}"#) == 1
        }
        // Its offset is committed: the consumer lag of the partition comes back to zero.
        try await Self.waitFor("the offset committed") {
            let metrics = try await Self.httpGet(port, "/metrics").1
            return Self.metric(metrics, #"warden_kafka_consumer_lag{topic="security-events",partition="0"}"#) == 0
        }
        #expect(await worker.terminate() == 0)
        #expect(worker.standardError.contains("issuer keys unavailable for too long"))

        let deadLetter = try await EngineWorkerTests.firstDeadLetter(setup.cluster.bootstrapServers)
        let letter = try #require(deadLetter)
        #expect(letter.header("warden-error") == Array("keys_unavailable".utf8))
        let description = String(decoding: letter.header("warden-error-description") ?? [], as: UTF8.self)
        #expect(description.contains("could not be obtained in 2 s"), "\(description)")

        // The keys are back: replay finds the event refused then and valid now, and applies it.
        server.serve("/certs", json: SETMinter.jwks([Self.rsa, Self.ec]))
        let applied = try await Warden.run(["replay", "--config", setup.config.path, "--topic", "security-events", "--apply"])
        #expect(applied.stdout.contains("verdict-changed"), "\(applied.stdout)\(applied.stderr)")
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).eventCount() == 1)
        let again = try await Warden.run(["replay", "--config", setup.config.path, "--topic", "security-events"])
        #expect(again.status == 0, "\(again.stdout)\(again.stderr)")
        await server.stop()
    }

    /// One issuer's keys cannot be had while another's can: more of the first's messages than
    /// `max-in-flight` wait aside for keys, and the second's events are still fetched and
    /// recorded. `/healthz` stays live: waiting for keys is not a stall a restart would mend.
    @Test func messagesWaitingForOneIssuersKeysDoNotStopAnothers() async throws {
        let server = try await KeyServer.start()
        server.serve("/certs", KeyServer.Document(body: "unavailable", status: 503))
        let broken = "https://broken.example/"
        let setup = try Setup(partitions: 1, keySource: """
            jwks-file: jwks.json
                audiences: [\(Self.audience)]
                algorithms: [RS256, ES256]
              - issuer: \(broken)
                jwks-uri: \(server.url("/certs"))
            """)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config, environment: ["WARDEN_KAFKA_MAX_IN_FLIGHT": "4", "WARDEN_HTTP_STALL_TIMEOUT": "1s"])
        let port = try await worker.httpPort()
        let waiting = try (0..<8).map { i in
            try SETMinter.token(claims: SETMinter.riscClaims(issuer: broken, audience: Self.audience, subject: "w-\(i)", jti: "w-\(i)"),
                                key: Self.ec)
        }
        try await Self.produce(setup.cluster.bootstrapServers, waiting.enumerated().map { ("w-\($0.offset)", $0.element) })
        try await Self.waitFor("eight messages waiting for keys") {
            Self.metric(try await Self.httpGet(port, "/metrics").1, "warden_waiting_for_keys") == 8
        }
        try await Self.produce(setup.cluster.bootstrapServers, [("healthy", try Self.token(jti: "healthy", subject: "healthy"))])
        try await Self.waitFor("the other issuer's event recorded") { try SQLiteLedgerReader(path: setup.ledgerPath).eventCount() == 1 }
        try await Task.sleep(for: .seconds(2))  // past the stall timeout
        #expect(try await Self.httpGet(port, "/healthz").0 == 200)
        #expect(try await Self.httpGet(port, "/readyz").0 == 503)
        #expect(await worker.terminate() == 0)
        await server.stop()
    }

    @Test func configurationErrorsNameTheKeyAndExitTwo() async throws {
        let directory = try Warden.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: directory) }
        let cases: [(String, String)] = [
            ("", "kafka"),
            ("kafka: {brokers: embedded}\nledger: postgres://db/warden", "ledger"),
            ("kafka: {brokers: embedded, concurrency: none}\nledger: sqlite:l.sqlite", "kafka.concurrency"),
            ("kafka: {brokers: embedded, propertys: {}}\nledger: sqlite:l.sqlite", "kafka.propertys"),
            ("kafka: {brokers: embedded}\nledger: sqlite:l.sqlite\nhttp: {listen: nowhere}", "http.listen"),
        ]
        for (extra, key) in cases {
            let config = directory.appendingPathComponent("c.yaml")
            try """
            issuers:
              - issuer: \(Self.issuer)
                jwks-file: jwks.json
                audiences: [\(Self.audience)]
            \(extra)
            """.write(to: config, atomically: true, encoding: .utf8)
            try SETMinter.jwks([Self.rsa]).write(to: directory.appendingPathComponent("jwks.json"), atomically: true, encoding: .utf8)
            let out = try await Warden.run(["run", "--config", config.path])
            #expect(out.status == 2, "\(key): \(out.stderr)")
            #expect(out.stderr.contains(key), "\(out.stderr)")
        }
    }

    @Test func twoWorkersSurviveSIGKILLWithEveryEventRecordedOnce() async throws {
        let setup = try Setup()
        defer { setup.cleanUp() }
        let total = 1200
        var tokens: [(key: String, value: String)] = []
        var jtis: [String] = []
        for i in 0..<total {
            let jti = "jti-\(i)"
            jtis.append(jti)
            tokens.append(("user-\(i % 50)", try Self.token(jti: jti, subject: "user-\(i % 50)")))
        }
        var a = try WorkerProcess(config: setup.config)
        let b = try WorkerProcess(config: setup.config)
        _ = try await a.httpPort()
        _ = try await b.httpPort()

        try await Self.produce(setup.cluster.bootstrapServers, Array(tokens[0..<400]))
        try await Self.waitFor("some events") { try SQLiteLedgerReader(path: setup.ledgerPath).events().count >= 100 }
        await a.kill()
        try await Self.produce(setup.cluster.bootstrapServers, Array(tokens[400..<800]))
        a = try WorkerProcess(config: setup.config)
        _ = try await a.httpPort()
        try await Self.produce(setup.cluster.bootstrapServers, Array(tokens[800...]))

        try await Self.waitFor("every event", timeout: 240) { try SQLiteLedgerReader(path: setup.ledgerPath).events().count >= total }
        #expect(await a.terminate() == 0)
        #expect(await b.terminate() == 0)
        let events = try SQLiteLedgerReader(path: setup.ledgerPath).events()
        #expect(events.count == total)
        #expect(Set(events.map(\.jti)) == Set(jtis))
        let deliveries = try SQLiteLedgerReader(path: setup.ledgerPath).deliveries()
        #expect(deliveries.allSatisfy { $0.verdict == "duplicate" })
    }
}

/// A `warden run` child process.
final class WorkerProcess: Sendable {
    private let process: Process
    /// What the process wrote, gathered by the pipes' handlers.
    final class Captured: Sendable {
        let text = Mutex("")
        func append(_ data: Data) { text.withLock { $0 += String(decoding: data, as: UTF8.self) } }
    }

    private let output = Captured()
    private let errors = Captured()

    init(config: URL, environment extra: [String: String] = [:]) throws {
        let process = Process()
        process.executableURL = Warden.executable
        process.arguments = ["run", "--config", config.path]
        var environment = ProcessInfo.processInfo.environment.merging(extra) { $1 }
        environment["WARDEN_LOG_LEVEL"] = "info"
        process.environment = environment
        let out = Pipe(), err = Pipe()
        process.standardOutput = out
        process.standardError = err
        out.fileHandleForReading.readabilityHandler = { [output] handle in output.append(handle.availableData) }
        err.fileHandleForReading.readabilityHandler = { [errors] handle in errors.append(handle.availableData) }
        try process.run()
        self.process = process
    }

    var standardOutput: String { output.text.withLock { $0 } }
    var standardError: String { errors.text.withLock { $0 } }

    /// The HTTP port from the worker's `warden: http: host:port` line, once it is listening.
    func httpPort() async throws -> Int { try await announcedPort("http") }

    /// The port from the worker's `warden: <what>: host:port` line, once it is listening.
    func announcedPort(_ what: String) async throws -> Int {
        let prefix = "warden: \(what): "
        for _ in 0..<600 {
            for line in standardOutput.split(separator: "\n") where line.hasPrefix(prefix) {
                let address = line.dropFirst(prefix.count).split(separator: " ")[0]
                if let port = Int(address.split(separator: ":").last ?? "") { return port }
            }
            if !process.isRunning {
                Issue.record("warden run exited with \(process.terminationStatus): \(standardError.suffix(2000))")
                throw CancellationError()
            }
            try await Task.sleep(for: .milliseconds(100))
        }
        Issue.record("warden run did not start listening: \(standardError.suffix(2000))")
        throw CancellationError()
    }

    /// SIGTERM, then the exit status.
    func terminate() async -> Int32 {
        process.terminate()
        return await exitStatus()
    }

    /// Sends a signal (SIGHUP: reload) without waiting.
    func signal(_ number: Int32) {
        Foundation.kill(process.processIdentifier, number)
    }

    var isRunning: Bool { process.isRunning }

    func kill() async {
        Foundation.kill(process.processIdentifier, SIGKILL)
        _ = await exitStatus()
    }

    private func exitStatus() async -> Int32 {
        let process = process
        return (try? await onOwnThread {
            process.waitUntilExit()
            return process.terminationStatus
        }) ?? -1
    }
}
