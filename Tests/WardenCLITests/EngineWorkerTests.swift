import Foundation
import Kafka
import Ledger
import SETMinting
import SecurityEvents
import Testing
import WardenTestSupport

/// The invalidation engine inside `warden run`: real redis-server, a local revoke/webhook
/// server, the built binary, events produced by python3-confluent-kafka.
@Suite("warden run acts on events", .serialized, .timeLimit(.minutes(8)))
struct EngineWorkerTests {
    func token(_ event: EventType, subject: String, extra: JSONObject = [:], jti: String = UUID().uuidString) throws -> String {
        try SETMinter.token(claims: SETMinter.riscClaims(issuer: WorkerTests.issuer, audience: WorkerTests.audience, event: event,
                                                          subject: subject, extra: extra, jti: jti), key: WorkerTests.ec)
    }

    @Test func sessionsAndSignInFlagsFollowTheBuiltInPolicy() async throws {
        let redis = try await RedisServer()
        let setup = try WorkerTests.Setup(extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
            """)
        defer { setup.cleanUp() }
        for user in ["u1", "u2"] {
            for i in 0..<3 {
                _ = try await redis.cli(["SET", "session:\(user):\(i)", "x"])
                _ = try await redis.cli(["SADD", "user-sessions:\(user)", "session:\(user):\(i)"])
            }
        }
        let worker = try WorkerProcess(config: setup.config)
        _ = try await worker.httpPort()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [
            ("u1", try token(.sessionsRevoked, subject: "u1")),
            ("u3", try token(.accountDisabled, subject: "u3")),  // no reason: sign-in flag
            ("u2", try token(.accountDisabled, subject: "u2", extra: ["reason": "hijacking"])),  // sessions purged
        ])
        try await WorkerTests.waitFor("three events processed") {
            let events = try SQLiteLedgerReader(path: setup.ledgerPath).events()
            return events.count == 3 && events.allSatisfy { $0.outcome == "processed" }
        }
        #expect(try await redis.cli(["EXISTS", "user-sessions:u1", "session:u1:0", "session:u1:1", "session:u1:2"]) == "0")
        #expect(try await redis.cli(["EXISTS", "user-sessions:u2", "session:u2:0"]) == "0")
        #expect(try await redis.cli(["GET", "signin-disabled:u3"]) == "1")
        #expect(try await redis.cli(["EXISTS", "signin-disabled:u2"]) == "0")
        let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
        let first = try #require(try reader.events().first)
        #expect(try reader.steps(ofEvent: first.id).map(\.status) == [.done])
        #expect(await worker.terminate() == 0)
    }

    @Test func aKillBetweenTwoStepsRunsTheSecondOnceAndNotTheFirstAgain() async throws {
        let redis = try await RedisServer()
        let hooks = try await KeyServer.start()
        hooks.serve("/hook", .init(body: "", status: 503))  // down until the test says otherwise
        let setup = try WorkerTests.Setup(extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
              app: {webhook: {url: "\(hooks.url("/hook"))", hmac-secret: test-secret}}
            policy:
              sessions-revoked:
                - set-flag: {target: sessions, key: "step-one:{user}", value: "{jti}"}
                - notify: {target: app}
            """)
        defer { setup.cleanUp() }
        let jti = "kill-between-steps"
        let first = try WorkerProcess(config: setup.config)
        _ = try await first.httpPort()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("u7", try token(.sessionsRevoked, subject: "u7", jti: jti))])
        // Step one is done, step two is being retried against the failing webhook.
        try await WorkerTests.waitFor("step one done, step two retried") {
            let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
            guard let event = try reader.events().first else { return false }
            return try reader.steps(ofEvent: event.id).map(\.status) == [.done, .pending] && hooks.requests("/hook") >= 2
        }
        #expect(try await redis.cli(["GET", "step-one:u7"]) == jti)
        await first.kill()

        // If step one ran again, this key would come back.
        _ = try await redis.cli(["DEL", "step-one:u7"])
        hooks.serve("/hook", .init(body: "", status: 200))
        let failingCalls = hooks.requests("/hook")
        let second = try WorkerProcess(config: setup.config)
        _ = try await second.httpPort()
        try await WorkerTests.waitFor("the event processed after the restart") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().first?.outcome == "processed"
        }
        #expect(hooks.requests("/hook") == failingCalls + 1)  // step two: once, after the restart
        #expect(try await redis.cli(["EXISTS", "step-one:u7"]) == "0")  // step one: not again
        let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
        #expect(try reader.events().count == 1)
        #expect(try reader.deliveries().filter { $0.verdict == "duplicate" }.count == 1)  // the redelivery
        #expect(await second.terminate() == 0)
    }
}

extension EngineWorkerTests {
    // A crash leaves an event's step pending; when it is delivered again, its issuer's keys
    // cannot be had for longer than kafka.max-key-wait. It is not refused (its steps would be
    // left with nothing to run them): it keeps waiting, and its step runs once the keys are back.
    @Test func aKnownEventWaitingForKeysPastTheLimitKeepsWaitingForItsStep() async throws {
        let server = try await KeyServer.start()
        server.serve("/certs", json: SETMinter.jwks([WorkerTests.rsa, WorkerTests.ec]))
        server.serve("/hook", .init(body: "", status: 503))
        let setup = try WorkerTests.Setup(partitions: 1, keySource: "jwks-uri: \(server.url("/certs"))",
                                          extra: WorkerTests.notifyPolicy(hook: server.url("/hook")))
        defer { setup.cleanUp() }
        let environment = ["WARDEN_KAFKA_MAX_KEY_WAIT": "1s"]
        let first = try WorkerProcess(config: setup.config, environment: environment)
        _ = try await first.httpPort()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("u8", try token(.sessionsRevoked, subject: "u8"))])
        try await WorkerTests.waitFor("the step retried against the failing webhook") {
            let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
            guard let event = try reader.events().first else { return false }
            return try reader.steps(ofEvent: event.id).map(\.status) == [.pending] && server.requests("/hook") >= 2
        }
        await first.kill()

        // The provider's keys are gone; the webhook answers again.
        server.serve("/certs", .init(body: "unavailable", status: 503))
        server.serve("/hook", .init(body: "", status: 200))
        let second = try WorkerProcess(config: setup.config, environment: environment)
        let port = try await second.httpPort()
        // Rounds of retries 0.5 s, 1 s, 2 s apart: the redelivery has waited past the 1 s limit.
        try await WorkerTests.waitFor("the redelivery retried past the limit") {
            let metrics = try await WorkerTests.httpGet(port, "/metrics").1
            return WorkerTests.metric(metrics, #"warden_retries_total{reason="keys_unavailable"}"#) ?? 0 >= 4
        }
        let metrics = try await WorkerTests.httpGet(port, "/metrics").1
        #expect(WorkerTests.metric(metrics, #"warden_permanent_failures_total{what="keys_unavailable"}"#) == nil, "\(metrics)")
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().filter { $0.verdict == "invalid" }.isEmpty)

        server.serve("/certs", json: SETMinter.jwks([WorkerTests.rsa, WorkerTests.ec]))
        try await WorkerTests.waitFor("the event processed once the keys are back") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().first?.outcome == "processed"
        }
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().filter { $0.verdict == "invalid" }.isEmpty)
        #expect(await second.terminate() == 0)
        await server.stop()
    }

    @Test func redisDownAndARevokeEndpointFailingForAWhileLoseNothing() async throws {
        let redis = try await RedisServer(persistent: true)
        let revoke = try await KeyServer.start()
        revoke.serve("/revoke", .init(body: "", status: 503, headers: ["Retry-After": "1"]))
        let setup = try WorkerTests.Setup(extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
              google-revoke: {revoke: {endpoint: "\(revoke.url("/revoke"))", auth: client_secret_post, client-id: w, client-secret: s}}
            token-stores:
              tokens: {redis: sessions, hash: "oauth-tokens:{user}", index: "oauth-token-index"}
            policy:
              tokens-revoked:
                - purge-set: {target: sessions, set: "user-sessions:{user}"}
                - revoke-tokens: {store: tokens, target: google-revoke}
            """)
        defer { setup.cleanUp() }
        _ = try await redis.cli(["SADD", "user-sessions:u1", "session:u1:a"])
        _ = try await redis.cli(["SET", "session:u1:a", "x"])
        _ = try await redis.cli(["SADD", "user-sessions:u2", "session:u2:a"])
        _ = try await redis.cli(["SET", "session:u2:a", "x"])
        _ = try await redis.cli(["HSET", "oauth-tokens:u1", "t1", "1//0g-held-one", "t2", "1//0g-held-two"])
        await redis.stop()

        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.httpPort()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [
            ("u1", try token(.tokensRevoked, subject: "u1")),
            ("u2", try token(.sessionsRevoked, subject: "u2")),
        ])
        // Both events wait while Redis is down; the metrics show it.
        try await WorkerTests.waitFor("steps retried against the stopped Redis") {
            let metrics = try await WorkerTests.httpGet(port, "/metrics").1
            return metrics.contains(#"warden_steps_total{kind="purge-set",result="retry"}"#)
        }
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).events().allSatisfy { $0.outcome == "pending" })

        try await redis.start()
        try await WorkerTests.waitFor("u2 processed and u1's sessions purged once Redis is back") {
            let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
            let events = try reader.events()
            guard events.contains(where: { $0.outcome == "processed" }),
                  let u1 = events.first(where: { $0.eventTypes.contains("tokens-revoked") }) else { return false }
            return try reader.steps(ofEvent: u1.id).first?.status == .done
        }
        #expect(try await redis.cli(["EXISTS", "session:u2:a", "session:u1:a"]) == "0")
        // u1's tokens wait for the revocation endpoint.
        try await WorkerTests.waitFor("revocation retried") { revoke.requests("/revoke") >= 2 }
        #expect(try await redis.cli(["HLEN", "oauth-tokens:u1"]) == "2")

        revoke.serve("/revoke", .init(body: ""))
        try await WorkerTests.waitFor("every event processed") {
            let events = try SQLiteLedgerReader(path: setup.ledgerPath).events()
            return events.count == 2 && events.allSatisfy { $0.outcome == "processed" }
        }
        let revoked = revoke.recordedRequests("/revoke").filter { _ in true }.map(\.body)
        #expect(revoked.contains { $0.contains("token=1%2F%2F0g-held-one") })
        #expect(revoked.contains { $0.contains("token=1%2F%2F0g-held-two") })
        #expect(try await redis.cli(["EXISTS", "oauth-tokens:u1"]) == "0")
        let metrics = try await WorkerTests.httpGet(port, "/metrics").1
        #expect(!metrics.contains("warden_dead_letters_total 1"))
        #expect(metrics.contains(#"warden_steps_total{kind="revoke-tokens",result="done"} 1"#))
        #expect(await worker.terminate() == 0)
    }
}

extension EngineWorkerTests {
    @Test func twoWorkersShareAPostgreSQLLedger() async throws {
        let postgres = try await PostgresServer()
        let database = try await postgres.createDatabase()
        let redis = try await RedisServer()
        let setup = try WorkerTests.Setup(ledger: "postgres://\(postgres.username)@127.0.0.1:\(postgres.port)/\(database)", extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
            """)
        defer { setup.cleanUp() }
        for i in 0..<40 {
            _ = try await redis.cli(["SADD", "user-sessions:p\(i)", "session:p\(i)"])
            _ = try await redis.cli(["SET", "session:p\(i)", "x"])
        }
        let first = try WorkerProcess(config: setup.config), second = try WorkerProcess(config: setup.config)
        _ = try await first.httpPort()
        _ = try await second.httpPort()
        #expect(first.standardOutput.contains("warden: ledger: postgres://\(postgres.username)@127.0.0.1:\(postgres.port)/\(database)"))
        var messages: [(key: String, value: String)] = []
        for i in 0..<40 { messages.append(("p\(i)", try token(.sessionsRevoked, subject: "p\(i)", jti: "pg-\(i)"))) }
        messages.append(("p0", try token(.sessionsRevoked, subject: "p0", jti: "pg-0")))  // a duplicate
        try await WorkerTests.produce(setup.cluster.bootstrapServers, messages)
        try await WorkerTests.waitFor("40 events processed in PostgreSQL") {
            try await postgres.psql(database, "SELECT count(*) FROM events WHERE outcome = 'processed'") == "40"
        }
        // The duplicate is recorded as a delivery of the first event. (A rebalance while the
        // second worker joins may deliver other messages again too: at least once, each
        // recorded as a duplicate, never as a second event.)
        try await WorkerTests.waitFor("the duplicate recorded") {
            let duplicates = try await postgres.psql(database, """
                SELECT count(*) FROM deliveries d JOIN events e ON d.event_id = e.id WHERE d.verdict = 'duplicate' AND e.jti = 'pg-0'
                """)
            return (Int(duplicates) ?? 0) >= 1
        }
        #expect(try await postgres.psql(database, "SELECT count(DISTINCT jti) FROM events") == "40")
        #expect(try await postgres.psql(database, "SELECT count(*) FROM steps WHERE status = 'done'") == "40")
        #expect(try await redis.cli(["DBSIZE"]) == "0")
        #expect(await first.terminate() == 0)
        #expect(await second.terminate() == 0)
    }
}

extension EngineWorkerTests {
    @Test func aStepRefusedForGoodIsDeadLetteredAndTheOthersStillRun() async throws {
        let redis = try await RedisServer()
        let revoke = try await KeyServer.start()
        revoke.serve("/revoke", .init(body: #"{"error":"invalid_client"}"#, status: 401))
        let setup = try WorkerTests.Setup(extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
              app-revoke: {revoke: {endpoint: "\(revoke.url("/revoke"))", auth: client_secret_basic, client-id: w, client-secret: wrong}}
            token-stores:
              tokens: {redis: sessions, hash: "oauth-tokens:{user}"}
            policy:
              tokens-revoked:
                - revoke-tokens: {store: tokens, target: app-revoke}
                - purge-set: {target: sessions, set: "user-sessions:{user}"}
            """)
        defer { setup.cleanUp() }
        _ = try await redis.cli(["HSET", "oauth-tokens:u5", "t1", "1//0g-held"])
        _ = try await redis.cli(["SADD", "user-sessions:u5", "session:u5"])
        _ = try await redis.cli(["SET", "session:u5", "x"])
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.httpPort()
        let event = try token(.tokensRevoked, subject: "u5", jti: "refused-step")
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("u5", event)])
        try await WorkerTests.waitFor("the event recorded as failed") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().first?.outcome == "failed"
        }
        let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
        let steps = try reader.steps(ofEvent: try #require(try reader.events().first).id)
        #expect(steps.map(\.status) == [.failed, .done])
        #expect(steps[0].detail?.contains("check the client credentials") == true)
        #expect(try await redis.cli(["EXISTS", "session:u5"]) == "0")     // the other step still ran
        #expect(try await redis.cli(["HLEN", "oauth-tokens:u5"]) == "1")  // not revoked: not deleted
        #expect(revoke.requests("/revoke") == 1)                    // a refusal is not retried

        // The dead letter: the original SET, the step and its reason.
        let deadLetter = try #require(try await Self.firstDeadLetter(setup.cluster.bootstrapServers))
        #expect(deadLetter.value == Array(event.utf8))
        #expect(deadLetter.header("warden-error") == Array("step-failed".utf8))
        let description = String(decoding: deadLetter.header("warden-error-description") ?? [], as: UTF8.self)
        #expect(description.contains("revoke-tokens step 0 failed"))
        let metrics = try await WorkerTests.httpGet(port, "/metrics").1
        #expect(metrics.contains(#"warden_steps_total{kind="revoke-tokens",result="failed"} 1"#))
        #expect(metrics.contains(#"warden_events_total{outcome="failed"} 1"#))
        #expect(!worker.standardError.contains("wrong"))  // the client secret is not logged
        // Operators are alerted: the failure is logged at the highest level.
        #expect(worker.standardError.split(separator: "\n").contains {
            $0.contains(#""level":"critical""#) && $0.contains("step failed permanently")
        })
        #expect(await worker.terminate() == 0)
    }
}

extension EngineWorkerTests {
    /// A worker whose policy notifies the webhook at `hooks`' `/hook` of every sessions-revoked event.
    static func notifying(_ hooks: KeyServer) throws -> WorkerTests.Setup {
        try WorkerTests.Setup(extra: WorkerTests.notifyPolicy(hook: hooks.url("/hook")))
    }

    @Test func aRedeliveryWhileTheFirstDeliveryStillActsDoesNotRepeatItsSteps() async throws {
        let hooks = try await KeyServer.start()
        hooks.serve("/hook", .init(body: "", status: 503))
        let setup = try Self.notifying(hooks)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        _ = try await worker.httpPort()
        let event = try token(.sessionsRevoked, subject: "u9", jti: "twice")
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("u9", event)])
        try await WorkerTests.waitFor("the first delivery retrying") { hooks.requests("/hook") >= 1 }
        // The same event again while the first is still waiting on the webhook.
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("u9", event)])
        try await WorkerTests.waitFor("the redelivery recorded as a duplicate") {
            try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().count == 1
        }
        let failing = hooks.requests("/hook")
        hooks.serve("/hook", .init(body: "", status: 200))
        try await WorkerTests.waitFor("the event processed") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().first?.outcome == "processed"
        }
        try await Task.sleep(for: .seconds(2))  // room for a second, wrong call to arrive
        #expect(hooks.requests("/hook") == failing + 1)  // notified once, not once per delivery
        #expect(await worker.terminate() == 0)
    }
}

extension EngineWorkerTests {
    // SIGTERM to both members of a group while the second is joining (a rebalance under way)
    // and every step is failing: each finishes what it can, leaves, and exits 0 (it once
    // aborted with signal 6); nothing is recorded as done that was not.
    @Test func sigtermDuringARebalanceWhileStepsFailExitsZero() async throws {
        let hooks = try await KeyServer.start()
        hooks.serve("/hook", .init(body: "", status: 503))
        let setup = try Self.notifying(hooks)
        defer { setup.cleanUp() }
        let first = try WorkerProcess(config: setup.config)
        _ = try await first.httpPort()
        var messages: [(key: String, value: String)] = []
        for i in 0..<20 { messages.append(("r\(i)", try token(.sessionsRevoked, subject: "r\(i)", jti: "rebalance-\(i)"))) }
        try await WorkerTests.produce(setup.cluster.bootstrapServers, messages)
        try await WorkerTests.waitFor("steps failing") { hooks.requests("/hook") >= 5 }
        // The second member starts and joins the group: a rebalance begins, and both are told
        // to stop while it is under way.
        let second = try WorkerProcess(config: setup.config)
        _ = try await second.httpPort()
        async let firstExit = first.terminate()
        async let secondExit = second.terminate()
        #expect(await firstExit == 0)
        #expect(await secondExit == 0)
        // The webhook never answered: no event is recorded as processed.
        let events = try SQLiteLedgerReader(path: setup.ledgerPath).events()
        #expect(!events.isEmpty)
        #expect(events.allSatisfy { $0.outcome == "pending" })
    }
}

extension EngineWorkerTests {
    // Defect 1 end to end: a junk message of nearly a megabyte, whose dead letter with Warden’s
    // headers is over the cluster's limit, goes to the dead-letter topic as a truncated copy; the
    // good events behind it on the same partition are recorded, and the worker exits 0.
    @Test func aMegabyteOfJunkIsDeadLetteredTruncatedAndTheEventsBehindItAreRecorded() async throws {
        let setup = try WorkerTests.Setup()
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        _ = try await worker.httpPort()
        var messages: [(key: String, value: String)] = [("same", String(repeating: "j", count: 999_900))]
        for i in 0..<5 { messages.append(("same", try token(.sessionsRevoked, subject: "j\(i)", jti: "behind-junk-\(i)"))) }
        try await WorkerTests.produce(setup.cluster.bootstrapServers, messages)
        try await WorkerTests.waitFor("the five events behind the junk recorded") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 5
        }
        let deliveries = try SQLiteLedgerReader(path: setup.ledgerPath).deliveries()
        #expect(deliveries.map(\.verdict) == ["invalid"])
        #expect(deliveries.first?.errorCode == "invalid_request")

        let deadLetter = try #require(try await Self.firstDeadLetter(setup.cluster.bootstrapServers))
        #expect(deadLetter.value.count < 999_900)
        #expect(String(decoding: deadLetter.header("warden-truncated") ?? [], as: UTF8.self).hasPrefix("999900 bytes"))
        #expect(await worker.terminate() == 0)
    }
}

extension EngineWorkerTests {
    /// The first message on the dead-letter topic, read by a consumer group of its own.
    static func firstDeadLetter(_ brokers: String) async throws -> KafkaMessage? {
        let dlq = try KafkaConsumer(configuration: .init(bootstrapServers: brokers, groupID: "dlq-reader",
                                                         topics: ["security-events.dlq"], properties: ["session.timeout.ms": "6000"]),
                                    logger: WorkerTests.quiet)
        async let running: Void = dlq.run()
        var letter: KafkaMessage? = nil
        for await message in dlq.messages {
            letter = message
            break
        }
        dlq.close()
        try await running
        return letter
    }

    // A Redis that accepts connections and never answers: the event's step waits, nothing is
    // finished, and /healthz fails once http.stall-timeout passes; when Redis answers again,
    // the event is finished and /healthz recovers.
    @Test func healthzFailsWhileIntakeIsStalledByAWedgedRedis() async throws {
        let redis = try await RedisServer()
        let setup = try WorkerTests.Setup(extra: """
            targets:
              sessions: {redis: {url: "redis://127.0.0.1:\(redis.port)/0", timeout: 1s}}
            policy:
              sessions-revoked:
                - purge-set: {target: sessions, set: "user-sessions:{user}"}
            """)
        defer { setup.cleanUp() }
        _ = try await redis.cli(["SADD", "user-sessions:w1", "session:w1:a"])
        let worker = try WorkerProcess(config: setup.config, environment: ["WARDEN_HTTP_STALL_TIMEOUT": "2s"])
        let port = try await worker.httpPort()
        #expect(try await WorkerTests.httpGet(port, "/healthz").0 == 200)
        redis.freeze()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("w1", try token(.sessionsRevoked, subject: "w1"))])
        try await WorkerTests.waitFor("/healthz failing while the step cannot finish") {
            let (status, body) = try await WorkerTests.httpGet(port, "/healthz")
            return status == 503 && body.contains("intake stalled")
        }
        redis.thaw()
        try await WorkerTests.waitFor("the event processed once Redis answers") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().first?.outcome == "processed"
        }
        try await WorkerTests.waitFor("/healthz ok again") { try await WorkerTests.httpGet(port, "/healthz").0 == 200 }
        // The event's time to done, the step's time by kind, the target's breaker.
        let metrics = try await WorkerTests.httpGet(port, "/metrics").1
        #expect(WorkerTests.metric(metrics, "warden_event_to_done_seconds_count") == 1, "\(metrics)")
        #expect(metrics.contains(#"warden_step_duration_seconds_count{kind="purge-set"}"#))
        #expect(WorkerTests.metric(metrics, #"warden_circuit_breaker_open{target="sessions"}"#) == 0)
        #expect(try await redis.cli(["EXISTS", "session:w1:a"]) == "0")
        #expect(await worker.terminate() == 0)
    }

    // SIGHUP after editing the policy: events from then on follow the new policy; a file that
    // no longer parses, or a change that needs a restart, is logged and the worker goes on.
    @Test func sighupReloadsThePolicyAndNeverEndsTheProcess() async throws {
        let redis = try await RedisServer()
        let targets = """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
            logging: {level: info}
            """
        let setup = try WorkerTests.Setup(extra: targets + """

            policy:
              sessions-revoked:
                - purge-set: {target: sessions, set: "old-sessions:{user}"}
            """)
        defer { setup.cleanUp() }
        let original = try String(contentsOf: setup.config, encoding: .utf8)
        for user in ["h1", "h2"] {
            for set in ["old-sessions", "new-sessions"] { _ = try await redis.cli(["SADD", "\(set):\(user)", "\(set):\(user):s"]); _ = try await redis.cli(["SET", "\(set):\(user):s", "x"]) }
        }
        let worker = try WorkerProcess(config: setup.config)
        _ = try await worker.httpPort()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("h1", try token(.sessionsRevoked, subject: "h1"))])
        try await WorkerTests.waitFor("h1 under the first policy") { try await redis.cli(["EXISTS", "old-sessions:h1:s"]) == "0" }

        // A broken file: refused, logged, nothing changes, the process lives.
        try "issuers: [".write(to: setup.config, atomically: true, encoding: .utf8)
        worker.signal(SIGHUP)
        try await WorkerTests.waitFor("the refusal logged") { worker.standardError.contains("configuration reload refused") }
        #expect(worker.isRunning)

        // The policy edited (and the log level, and a setting that needs a restart).
        let edited = original.replacingOccurrences(of: "old-sessions", with: "new-sessions")
            .replacingOccurrences(of: "level: info", with: "level: debug")
            .replacingOccurrences(of: "commit-interval: 200ms", with: "commit-interval: 300ms")
        try edited.write(to: setup.config, atomically: true, encoding: .utf8)
        worker.signal(SIGHUP)
        try await WorkerTests.waitFor("the reload logged") { worker.standardError.contains("configuration reloaded") }
        let line = worker.standardError.split(separator: "\n").first { $0.contains("configuration reloaded") }.map(String.init) ?? ""
        #expect(line.contains("policy"), "\(line)")
        // The test's WARDEN_LOG_LEVEL=info wins over the file's level: said, not applied.
        #expect(line.contains("WARDEN_LOG_LEVEL in the environment wins"), "\(line)")
        #expect(line.contains("kafka"), "\(line)")  // needs a restart, said so
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("h2", try token(.sessionsRevoked, subject: "h2"))])
        try await WorkerTests.waitFor("h2 under the new policy") { try await redis.cli(["EXISTS", "new-sessions:h2:s"]) == "0" }
        #expect(try await redis.cli(["EXISTS", "old-sessions:h2:s"]) == "1")
        #expect(worker.isRunning)
        #expect(await worker.terminate() == 0)
    }

    // The ledger's disk full (a small tmpfs, filled): the worker keeps running, nothing is lost,
    // /healthz fails once http.stall-timeout passes with messages waiting; when space is given
    // back, the waiting events are recorded and acted on and /healthz recovers.
    @Test(.enabled(if: SmallFilesystem.canMount, "needs the privilege to mount a tmpfs"))
    func healthzFailsWhileTheLedgerDiskIsFullAndRecovers() async throws {
        let disk = try SmallFilesystem(megabytes: 16)
        defer { disk.unmount() }
        let redis = try await RedisServer()
        let setup = try WorkerTests.Setup(ledger: "sqlite:\(disk.path)/ledger.sqlite", extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
            """)
        defer { setup.cleanUp() }
        let ledgerPath = disk.path + "/ledger.sqlite"
        let worker = try WorkerProcess(config: setup.config, environment: ["WARDEN_HTTP_STALL_TIMEOUT": "2s"])
        let port = try await worker.httpPort()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("f0", try token(.sessionsRevoked, subject: "f0"))])
        try await WorkerTests.waitFor("the first event recorded") { try SQLiteLedgerReader(path: ledgerPath).eventCount() == 1 }
        #expect(try await WorkerTests.httpGet(port, "/healthz").0 == 200)

        disk.fill()
        let waiting = try (1...300).map { ("f\($0)", try token(.sessionsRevoked, subject: "f\($0)")) }
        try await WorkerTests.produce(setup.cluster.bootstrapServers, waiting)
        try await WorkerTests.waitFor("/healthz failing while the ledger cannot be written") {
            let (status, body) = try await WorkerTests.httpGet(port, "/healthz")
            return status == 503 && body.contains("intake stalled")
        }
        #expect(worker.isRunning)

        disk.free()
        try await WorkerTests.waitFor("every event recorded once space is back") {
            try SQLiteLedgerReader(path: ledgerPath).eventCount(outcome: .processed) == 301
        }
        try await WorkerTests.waitFor("/healthz ok again") { try await WorkerTests.httpGet(port, "/healthz").0 == 200 }
        #expect(worker.isRunning)
        #expect(await worker.terminate() == 0)
    }

    // A credential rotated while the worker runs: the new password written to the target's
    // password file, SIGHUP, the old password removed and every connection dropped — events go
    // on being acted on with the new one (the old client would reconnect with the old password
    // and be refused for good).
    @Test func sighupReadsATargetsRotatedPasswordFile() async throws {
        let redis = try await RedisServer(password: "first-pass")
        let setup = try WorkerTests.Setup(extra: """
            targets:
              sessions: {redis: {url: "redis://127.0.0.1:\(redis.port)/0", password-file: redis-password}}
            policy:
              sessions-revoked:
                - purge-set: {target: sessions, set: "sessions:{user}"}
            """)
        defer { setup.cleanUp() }
        let passwordFile = setup.directory.appendingPathComponent("redis-password")
        try "first-pass\n".write(to: passwordFile, atomically: true, encoding: .utf8)
        for user in ["r1", "r2"] {
            _ = try await redis.cli(["SADD", "sessions:\(user)", "session:\(user):a"])
            _ = try await redis.cli(["SET", "session:\(user):a", "x"])
        }
        let worker = try WorkerProcess(config: setup.config)
        _ = try await worker.httpPort()
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("r1", try token(.sessionsRevoked, subject: "r1"))])
        try await WorkerTests.waitFor("r1 purged with the first password") { try await redis.cli(["EXISTS", "session:r1:a"]) == "0" }

        // The rotation: the server accepts both, the file gets the new one, SIGHUP.
        _ = try await redis.cli(["ACL", "SETUSER", "default", "on", ">second-pass"])
        try "second-pass\r\n".write(to: passwordFile, atomically: true, encoding: .utf8)
        worker.signal(SIGHUP)
        try await WorkerTests.waitFor("the reload logged") { worker.standardError.contains("configuration reloaded") }
        let line = worker.standardError.split(separator: "\n").first { $0.contains("configuration reloaded") }.map(String.init) ?? ""
        #expect(line.contains("targets.sessions"), "\(line)")
        #expect(!worker.standardError.contains("second-pass") && !worker.standardError.contains("first-pass"))
        // The old password is withdrawn and every client connection dropped.
        _ = try await redis.cli(["ACL", "SETUSER", "default", "<first-pass"], password: "second-pass")
        _ = try await redis.cli(["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"], password: "second-pass")

        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("r2", try token(.sessionsRevoked, subject: "r2"))])
        try await WorkerTests.waitFor("r2 purged with the second password") {
            try await redis.cli(["EXISTS", "session:r2:a"], password: "second-pass") == "0"
        }
        #expect(worker.isRunning)
        #expect(await worker.terminate() == 0)
    }

    // Retention while the worker runs: old finished events, their steps and the audit records
    // before the cut go; the audit log still verifies (a checkpoint record); the worker goes on.
    @Test func retentionPrunesWhileTheWorkerRunsAndTheAuditLogStillVerifies() async throws {
        let redis = try await RedisServer()
        // The retention covers the max-age and the clock skew (a token may say it was issued
        // up to the skew after it arrived).
        let setup = try WorkerTests.Setup(keySource: "jwks-file: jwks.json\n    max-age: 8s\n    clock-skew: 1s",
                                          ledger: "{url: \"sqlite:ledger.sqlite\", retention: 9s}", extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
            """)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.httpPort()
        // Tokens are minted once the worker consumes: their max-age is short.
        try await WorkerTests.waitFor("the partitions assigned") { worker.standardError.contains("partitions assigned") }
        try await WorkerTests.produce(setup.cluster.bootstrapServers,
                                      try (0..<6).map { ("r\($0)", try token(.sessionsRevoked, subject: "r\($0)")) })
        defer { if worker.isRunning { print(worker.standardError.suffix(3000)) } }
        try await WorkerTests.waitFor("six events processed") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().filter { $0.outcome == "processed" }.count == 6
        }
        // The newest stays until a later one comes (so its id is never given again).
        try await WorkerTests.waitFor("the events pruned once older than the retention") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 1
        }
        let metrics = try await WorkerTests.httpGet(port, "/metrics").1
        #expect(metrics.contains(#"warden_ledger_pruned_total{what="events"} 5"#), "\(metrics)")
        let verified = try await Warden.run(["audit", "verify", "--config", setup.config.path])
        #expect(verified.status == 0, "\(verified.stdout) \(verified.stderr)")
        #expect(verified.stdout.hasPrefix("audit log intact"))
        // New events after the cut are taken as ever, and the newest old one then goes.
        try await WorkerTests.produce(setup.cluster.bootstrapServers, [("r9", try token(.sessionsRevoked, subject: "r9"))])
        try await WorkerTests.waitFor("the next event, and the last old one pruned") {
            try await WorkerTests.httpGet(port, "/metrics").1.contains(#"warden_ledger_pruned_total{what="events"} 6"#)
                && SQLiteLedgerReader(path: setup.ledgerPath).events().count == 1
        }
        #expect(await worker.terminate() == 0)
        #expect(try await Warden.run(["audit", "verify", "--config", setup.config.path]).status == 0)
    }
}
