import Foundation
import Invalidation
import Redis
import Testing
import TokenVerification
import WardenTestSupport
@testable import WardenCLI

/// What the configuration refuses, and what its errors leave out: secrets never appear in an
/// error (which `check-config` prints and a reload logs), and no value is dropped in silence.
@Suite("Configuration: secrets kept out of errors, nothing dropped in silence")
struct ConfigurationSafetyTests {
    let operators = OperatorConfigurationTests()

    func error(_ yaml: String, files: [String: String] = [:], environment: [String: String] = [:]) -> String {
        operators.error(yaml, files: files, environment: environment)
    }

    @Test func aSecretOnALineThatIsNotValidYAMLIsNotQuoted() {
        let failures = [
            "targets: {t: {revoke: {endpoint: \"https://auth.example/revoke\", client-id: c, client-secret: @hunter2}}}\n",
            "targets: {t: {redis: redis://:ab}hunter2@h/0}}\n",
            "http-client: {ca-file: x}\nkafka:\n  brokers: embedded\n  properties: {sasl.password: \"hunter2\n",
        ]
        for yaml in failures {
            let text = error(yaml)
            #expect(text.contains("not valid YAML") && text.contains("line "), "\(text)")
            #expect(!text.contains("hunter2"), "\(text)")
        }
    }

    @Test func aURLRefusedIsShownWithoutItsCredentialsOrQuery() {
        let refused = [
            "targets: {t: {revoke: {endpoint: \"http://w:hunter2@auth.internal/revoke\", client-id: c, client-secret: s}}}\n",
            "targets: {app: {webhook: {url: \"app.internal/h?token=hunter2\"}}}\n",
            "targets: {app: {webhook: {url: \"ftp://u:hunter2@app.internal/h\"}}}\n",
            "ledger: \"Postgres://w:hunter2@db/w\"\n",
            "ledger: \"mysql://w:hunter2@db/w\"\n",
        ]
        for yaml in refused {
            let text = error(yaml)
            #expect(text != "no error" && !text.contains("hunter2"), "\(text)")
        }
        #expect(error(refused[0]).contains("\"http://auth.internal/revoke\" must use https"))
        #expect(error(refused[1]).contains("\"app.internal/h?…\" is not an absolute URL"))
    }

    @Test func twoPolicyKeysForOneEventTypeAreRefused() {
        let sessions = "targets: {sessions: {redis: \"redis://127.0.0.1/0\"}}\n"
        let purge = "[{purge-set: {target: sessions, set: \"user-sessions:{user}\"}}]"
        let text = error(sessions + "policy:\n  sessions-revoked: \(purge)\n"
                         + "  https://schemas.openid.net/secevent/risc/event-type/sessions-revoked: []\n")
        #expect(text.contains("configures the same event type as policy.sessions-revoked"), "\(text)")
        #expect(error(sessions + "policy:\n  sessions-revoked: \(purge)\n") == "no error")
    }

    @Test func deadLettersNeedATopicOfTheirOwnAndTopicsAName() {
        #expect(error("kafka: {brokers: embedded, topic: ev, dead-letter-topic: ev}\n")
            .contains("kafka.dead-letter-topic: is the topic Warden consumes"))
        #expect(error("kafka: {brokers: embedded, topic: events}\n", environment: ["WARDEN_KAFKA_DEAD_LETTER_TOPIC": "events"])
            .contains("kafka.dead-letter-topic: is the topic Warden consumes"))
        #expect(error("kafka: {brokers: embedded, topic: \"\"}\n").contains("kafka.topic: \"\" is not a Kafka topic name"))
        #expect(error("kafka: {brokers: embedded, topic: \"a b\"}\n").contains("is not a Kafka topic name"))
        #expect(error("kafka: {brokers: embedded}\n", environment: ["WARDEN_KAFKA_GROUP": ""]).contains("kafka.group: needs a value"))
        #expect(error("kafka: {brokers: embedded, topic: risc.events_v-2, dead-letter-topic: risc.dlq}\n") == "no error")
    }

    @Test func theJWKSURLCanComeFromTheEnvironment() throws {
        let c = try operators.parse("", environment: ["WARDEN_ISSUERS_0_JWKS_URI": "https://keys.example/jwks"])
        #expect(c.issuers[0].keySource == .jwks(URL(string: "https://keys.example/jwks")!))
    }

    @Test func theLedgerMapCanComeFromTheEnvironment() throws {
        let c = try operators.parse("", files: ["pw": "s3cret\n"], environment: [
            "WARDEN_LEDGER_URL": "postgres://warden@db.internal/warden", "WARDEN_LEDGER_PASSWORD_FILE": "pw",
        ])
        guard case .postgres(let location)? = c.ledger else {
            Issue.record("no postgres ledger: \(String(describing: c.ledger))")
            return
        }
        #expect(location.password == "s3cret" && location.host == "db.internal")
        let retained = try operators.parse("ledger: \"sqlite:l.sqlite\"\n", environment: [
            "WARDEN_LEDGER_RETENTION": "400d", "WARDEN_ISSUERS_0_MAX_AGE": "30d",
        ])
        #expect(abs((retained.ledgerRetention ?? 0) - 400 * 86_400) < 1)
        #expect(error("ledger: \"sqlite:l.sqlite\"\n", environment: ["WARDEN_LEDGER_URL": "sqlite:other.sqlite"])
            .contains("ledger.url: gives the ledger's URL a second time"))
    }

    /// A URL's credentials are percent-decoded once: `%25` is a `%` of the password.
    @Test func aRedisURLsCredentialsAreDecodedOnce() throws {
        let settings = try RedisConnectionSettings.parse("redis://us%2541r:ab%2541cd%40@h:6380/1").get()
        #expect(settings.username == "us%41r")
        #expect(settings.password == "ab%41cd@")
    }

    @Test func aRedisPasswordGivenTwiceIsRefused() {
        #expect(error("targets: {s: {redis: {url: \"redis://:inline@h/0\", password-file: p}}}\n", files: ["p": "x\n"])
            .contains("targets.s.redis.url: gives a password too"))
        #expect(error("targets: {s: {redis: {url: \"redis://h/0\", password-file: p}}}\n", files: ["p": "x\n"]) == "no error")
    }

    @Test func keyTimingsThatWouldFetchForEveryTokenAreRefused() throws {
        let base = OperatorConfigurationTests.issuer
        func issuerError(_ line: String) -> String {
            do {
                _ = try WardenConfiguration.parse(yaml: base + "    \(line)\n", baseDirectory: URL(fileURLWithPath: "/tmp"))
                return "no error"
            } catch { return error.description }
        }
        #expect(issuerError("key-retry-interval: 0s").contains("issuers[0].key-retry-interval: must be at least 100ms"))
        #expect(issuerError("max-key-lifetime: 0s").contains("issuers[0].max-key-lifetime: must be at least 1s"))
        #expect(issuerError("key-retry-interval: 5s") == "no error")
    }

    @Test func theReceiversConnectionCapIsAPositiveNumber() throws {
        func receiverError(_ line: String) -> String {
            do {
                let parsed = try WardenConfiguration.parse(yaml: OperatorConfigurationTests.issuer
                    + "receiver:\n  listen: 127.0.0.1:0\n  \(line)\n", baseDirectory: URL(fileURLWithPath: "/tmp"))
                return "no error: \(parsed.receiver?.maximumConnections ?? -1)"
            } catch { return error.description }
        }
        #expect(receiverError("max-connections: 0").contains("receiver.max-connections: \"0\" is not a positive whole number"))
        #expect(receiverError("max-connections: many").contains("receiver.max-connections"))
        #expect(receiverError("max-connections: 64") == "no error: 64")
        #expect(receiverError("path: /events") == "no error: 512")
    }

    // SIGHUP: a stream's settings and credentials are read at start, so a rotated bearer-token
    // file, or another delivery, is named as needing a restart, never reported as nothing.
    @Test func aReloadNamesAChangedStreamAsNeedingARestart() throws {
        let ssf = """
            issuers:
              - issuer: https://ssf.example/
                profile: ssf
                jwks-uri: https://ssf.example/jwks
                audiences: [app]
                stream:
                  api: ssf
                  credentials-file: bearer
                  delivery: {method: poll, endpoint-url: "https://ssf.example/poll"}
                  events: [session-revoked]

            """
        func parse(bearer: String, events: String = "session-revoked") throws -> WardenConfiguration {
            let directory = try Scratch.directory("reload-stream")
            try bearer.write(to: directory.appendingPathComponent("bearer"), atomically: true, encoding: .utf8)
            return try WardenConfiguration.parse(yaml: ssf.replacingOccurrences(of: "[session-revoked]", with: "[\(events)]"),
                                                 environment: [:], baseDirectory: directory)
        }
        let first = try parse(bearer: "token-one")
        var running = first
        let planner = Invalidation.Planner(policy: first.invalidation.policy)
        #expect(ConfigurationReload.apply(try parse(bearer: "token-one"), to: &running, planner: planner).needsRestart.isEmpty)
        #expect(ConfigurationReload.apply(try parse(bearer: "token-two"), to: &running, planner: planner).needsRestart == ["issuers[].stream"])
        #expect(ConfigurationReload.apply(try parse(bearer: "token-one", events: "session-revoked, credential-change"), to: &running,
                                          planner: planner).needsRestart == ["issuers[].stream"])
    }
}
