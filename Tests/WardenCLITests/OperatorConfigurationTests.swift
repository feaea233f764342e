import Foundation
import HTTPExchange
import Invalidation
import Logging
import Synchronization
import Testing
import WardenTestSupport
@testable import WardenCLI

/// What an operator deploying Warden gives it: overrides in the environment, secrets in files,
/// the configuration's path in WARDEN_CONFIG.
@Suite("Environment overrides, secret files, version")
struct OperatorConfigurationTests {
    static let issuer = InvalidationConfigTests.issuer

    /// Parses `yaml` with `files` beside it and `environment` as the process's.
    func parse(_ yaml: String, files: [String: String] = [:], environment: [String: String] = [:]) throws(ConfigError) -> WardenConfiguration {
        let directory = try! Scratch.directory("operator-config")
        for (name, contents) in files { try! contents.write(to: directory.appendingPathComponent(name), atomically: true, encoding: .utf8) }
        return try WardenConfiguration.parse(yaml: Self.issuer + yaml, environment: environment, baseDirectory: directory)
    }

    func error(_ yaml: String, files: [String: String] = [:], environment: [String: String] = [:]) -> String {
        do { _ = try parse(yaml, files: files, environment: environment); return "no error" } catch { return error.description }
    }

    @Test func overridesApplyEvenToSectionsTheFileLeavesOut() throws {
        let c = try parse("kafka: {brokers: embedded}\n", environment: [
            "WARDEN_HTTP_LISTEN": "0.0.0.0:9999", "WARDEN_KAFKA_TOPIC": "other-events", "WARDEN_LOG_LEVEL": "debug",
            "WARDEN_LEDGER": "sqlite:///var/lib/warden/ledger.sqlite", "WARDEN_ISSUERS_0_AUDIENCES": "a, b",
        ])
        #expect(c.http.port == 9999 && c.http.host == "0.0.0.0")
        #expect(c.kafka?.topic == "other-events")
        #expect(c.ledger == .sqlite(path: "/var/lib/warden/ledger.sqlite"))
        #expect(c.issuers[0].audiences == ["a", "b"])
    }

    @Test func aVariableMatchingNoKeyIsRefusedNamingTheClosest() {
        let kafka = "kafka: {brokers: embedded}\n"
        #expect(error(kafka, environment: ["WARDEN_KAFKA_TOPICS": "x"])
            .contains("the environment variable WARDEN_KAFKA_TOPICS matches no configuration key (the closest is WARDEN_KAFKA_TOPIC)"))
        #expect(error(kafka, environment: ["WARDEN_HTTP_LISTN": "0.0.0.0:1"]).contains("(the closest is WARDEN_HTTP_LISTEN)"))
        #expect(error(kafka, environment: ["WARDEN_CONFIG": "/etc/warden.yaml", "WARDEN_LOG_FORMAT": "json"]) == "no error")
        #expect(error(kafka, environment: ["WARDEN_LOG_FORMAT": "text"]) == "no error")
        #expect(error(kafka, environment: ["WARDEN_LOG_FORMAT": "JSON"])
            .contains("WARDEN_LOG_FORMAT: \"JSON\" is not a log format (json, text)"))
        #expect(error(kafka, environment: ["WARDEN_LOG_LEVEL": "verbose"])
            .contains("WARDEN_LOG_LEVEL: \"verbose\" is not a level (trace, debug, info, notice, warning, error, critical)"))
        // A section's own variable is not a value for it.
        #expect(error("ledger: {url: \"sqlite:l.sqlite\"}\n", environment: ["WARDEN_LEDGER": "sqlite:other.sqlite"])
            .contains("ledger: is a section in the file: set its keys (WARDEN_LEDGER_…), not WARDEN_LEDGER"))
        #expect(error("ledger: {url: \"sqlite:l.sqlite\"}\n", environment: ["WARDEN_LEDGER_PASSWORD_FILE": "/etc/hostname"])
            .contains("ledger.password-file: is for a postgres:// ledger"))
        // Unrelated variables are not Warden's business.
        #expect(error(kafka, environment: ["WARDENX": "1", "HOME": "/root"]) == "no error")
    }

    @Test func kafkaPasswordsFromFiles() throws {
        let c = try parse("""
            kafka:
              brokers: embedded
              properties:
                security.protocol: SASL_SSL
                sasl.mechanism: PLAIN
                sasl.username: warden
                sasl.password-file: kafka-password
                ssl.key.password-file: key-password
            """, files: ["kafka-password": "s3cret value\r\n", "key-password": "k3y\n"])
        #expect(c.kafka?.properties["sasl.password"] == "s3cret value")
        #expect(c.kafka?.properties["ssl.key.password"] == "k3y")
        #expect(c.kafka?.properties["sasl.password-file"] == nil)
        let both = error("kafka: {brokers: embedded, properties: {sasl.password: inline-secret, sasl.password-file: p}}", files: ["p": "x"])
        #expect(both.contains("give either sasl.password or sasl.password-file") && !both.contains("inline-secret"))
        #expect(error("kafka: {brokers: embedded, properties: {ssl.ca.location-file: x}}")
            .contains("only a property ending in .password can be read from a file"))
        #expect(error("kafka: {brokers: embedded, properties: {sasl.password-file: missing}}").contains("cannot read the file"))
        #expect(error("kafka: {brokers: embedded, properties: {sasl.password-file: empty}}", files: ["empty": "\n"]).contains("is empty"))
    }

    /// Counts beyond what a process can hold are refused by the configuration, not met in `run`
    /// as an overflow (`max-in-flight` times the spans it allows) or a trap.
    @Test func hugeCountsAreRefused() throws {
        #expect(error("kafka: {brokers: embedded, max-in-flight: 200000000000000000}").contains("kafka.max-in-flight"))
        #expect(error("kafka: {brokers: embedded, embedded-partitions: 3000000000}").contains("more than the 1000 allowed"))
        #expect(error("kafka: {brokers: embedded, concurrency: 99999999999999999999}").contains("is not a positive whole number"))
        #expect(try parse("kafka: {brokers: embedded, max-in-flight: 1000000, embedded-partitions: 1000}").kafka?.maximumInFlight == 1_000_000)
    }

    /// A property Warden sets itself cannot be given: copied from another client's settings,
    /// `enable.auto.commit: true` would commit offsets of events not yet durable.
    @Test(arguments: ["enable.auto.commit", "enable.auto.offset.store", "auto.commit.enable", "group.id", "bootstrap.servers",
                      "metadata.broker.list", "auto.offset.reset", "partition.assignment.strategy", "acks", "enable.idempotence"])
    func kafkaPropertiesWardenSetsAreRefused(_ name: String) throws {
        let refused = error("kafka: {brokers: embedded, properties: {\(name): \"x\"}}")
        #expect(refused.contains("kafka.properties.\(name)") && refused.contains("is set by Warden"), "\(refused)")
        #expect(try parse("kafka: {brokers: embedded, properties: {session.timeout.ms: \"6000\"}}").kafka?.properties["session.timeout.ms"] == "6000")
    }

    @Test func databasePasswordsFromFiles() throws {
        let c = try parse("""
            ledger: {url: "postgres://warden@db.internal/warden?sslmode=verify-full", password-file: db-password}
            targets:
              appdb: {sql: {url: "postgres://app@db.internal/app", password-file: db-password}}
            """, files: ["db-password": "p@ss:word/1\n"])
        guard case .postgres(let ledger)? = c.ledger else { Issue.record("a PostgreSQL ledger expected"); return }
        #expect(ledger.password == "p@ss:word/1")
        #expect(ledger.tls.mode == .verifyFull)
        guard case .sql(let url)? = c.invalidation.targets["appdb"] else { Issue.record("a sql target expected"); return }
        #expect(URLComponents(string: url)?.password?.removingPercentEncoding == "p@ss:word/1")
        #expect(error("ledger: {url: \"sqlite:ledger.sqlite\", password-file: p}", files: ["p": "x"]).contains("ledger.password-file: is for a postgres:// ledger"))
        #expect(error("ledger: {url: \"postgres://w:inline@db/w\", password-file: p}", files: ["p": "x"]).contains("ledger.url: gives a password too"))
        // The plain form stays valid.
        #expect(try parse("ledger: \"sqlite:ledger.sqlite\"\n").ledger != nil)
    }

    /// A password is decoded once, as a URL gives it: `%41` in a secret stays `%41`.
    @Test func aDatabasePasswordIsDecodedOnce() throws {
        let inline = try parse("ledger: \"postgres://w:a%2541b@db/w\"\n")
        guard case .postgres(let ledger)? = inline.ledger else { Issue.record("a PostgreSQL ledger expected"); return }
        #expect(ledger.password == "a%41b")
        let fromFile = try parse("ledger: {url: \"postgres://w@db/w\", password-file: p}\n", files: ["p": "a%41b%zz\n"])
        guard case .postgres(let filed)? = fromFile.ledger else { Issue.record("a PostgreSQL ledger expected"); return }
        #expect(filed.password == "a%41b%zz")
    }

    /// A size too large to count is a configuration error, not a trap (also on reload).
    @Test func aSizeTooLargeToCountIsRefused() {
        #expect(error("max-token-size: 99999999999999MiB\n").contains("more bytes than this machine can count"))
    }

    /// A top-level `poll` section was once accepted and read by nothing; it now says where polling is set.
    @Test func aTopLevelPollSectionSaysWherePollingIsSet() {
        #expect(error("poll: {interval: 5s}\n").contains("poll: polling is set per issuer: issuers[].stream.delivery: {method: poll}"))
    }

    @Test func retentionNeedsEveryIssuerToRefuseTokensOlderThanIt() throws {
        #expect(try parse("ledger: \"sqlite:l.sqlite\"\n").ledgerRetention == nil)
        #expect(error("ledger: {url: \"sqlite:l.sqlite\", retention: 90d}\n")
            .contains("ledger.retention: is shorter than the max-age of https://accounts.google.com/ (none set) plus its clock skew"))
        let withMaxAge = Self.issuer.replacingOccurrences(of: "audiences: [app]", with: "audiences: [app]\n    max-age: 7d")
        let c = try WardenConfiguration.parse(yaml: withMaxAge + "ledger: {url: \"sqlite:l.sqlite\", retention: 90d}\n")
        #expect(c.ledgerRetention.map { abs($0 - 7_776_000) < 0.001 } == true, "\(String(describing: c.ledgerRetention))")
        #expect(throws: ConfigError.self) {
            try WardenConfiguration.parse(yaml: withMaxAge + "ledger: {url: \"sqlite:l.sqlite\", retention: 1d}\n")
        }
        // A token may say it was issued up to the clock skew (300 s) after it arrived: a
        // retention equal to the max-age would drop its claim while it still verifies.
        #expect(throws: ConfigError.self) {
            try WardenConfiguration.parse(yaml: withMaxAge + "ledger: {url: \"sqlite:l.sqlite\", retention: 7d}\n")
        }
        let skewed = try WardenConfiguration.parse(yaml: withMaxAge + "ledger: {url: \"sqlite:l.sqlite\", retention: 605100s}\n")
        #expect(skewed.ledgerRetention == 605_100)
        #expect(throws: ConfigError.self) {
            try WardenConfiguration.parse(yaml: withMaxAge + "ledger: {url: \"sqlite:l.sqlite\", retention: soon}\n")
        }
    }

    /// Without a cooldown every token naming an unknown kid would fetch the issuer's JWKS.
    @Test func aKeyRefreshCooldownOfNothingIsRefused() throws {
        let zero = Self.issuer.replacingOccurrences(of: "audiences: [app]", with: "audiences: [app]\n    key-refresh-cooldown: 0s")
        #expect(zero != Self.issuer)
        #expect(throws: ConfigError.self) { try WardenConfiguration.parse(yaml: zero) }
        let one = Self.issuer.replacingOccurrences(of: "audiences: [app]", with: "audiences: [app]\n    key-refresh-cooldown: 1s")
        #expect(try WardenConfiguration.parse(yaml: one).issuers.first?.keyCache.unknownKeyCooldown == 1)
    }

    /// How long a Kafka message may wait for its issuer's keys: a day unless set; never nothing.
    @Test func theLongestWaitForKeys() throws {
        #expect(try parse("kafka: {brokers: embedded}\n").kafka?.maximumKeyWait == 86_400)
        #expect(try parse("kafka: {brokers: embedded, max-key-wait: 6h}\n").kafka?.maximumKeyWait == 21_600)
        #expect(try parse("kafka: {brokers: embedded}\n", environment: ["WARDEN_KAFKA_MAX_KEY_WAIT": "90s"]).kafka?.maximumKeyWait == 90)
        #expect(error("kafka: {brokers: embedded, max-key-wait: 0s}\n").contains("kafka.max-key-wait: must be greater than zero"))
    }

    @Test func configFromTheEnvironmentAndVersion() async throws {
        let directory = try Scratch.directory("warden-config-env")
        let path = directory.appendingPathComponent("warden.yaml").path
        try (Self.issuer + "ledger: \"sqlite:ledger.sqlite\"\n").write(toFile: path, atomically: true, encoding: .utf8)
        let checked = try await Warden.run(["check-config"], environment: ["WARDEN_CONFIG": path])
        #expect(checked.status == 0, "\(checked.stderr)")
        let missing = try await Warden.run(["check-config"], environment: ["WARDEN_CONFIG": ""])
        #expect(missing.status == 2)
        #expect(missing.stderr.contains("give --config FILE or set WARDEN_CONFIG"), "\(missing.stderr)")
        let wrong = try await Warden.run(["check-config", "--config", path], environment: ["WARDEN_LEDGR": "x"])
        #expect(wrong.status == 2)
        #expect(wrong.stderr.contains("WARDEN_LEDGR matches no configuration key (the closest is WARDEN_LEDGER)"), "\(wrong.stderr)")
        let version = try await Warden.run(["--version"])
        #expect(version.status == 0)
        #expect(version.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == WardenVersion.current)
    }

    @Test func reloadAppliesPolicyAndLevelAndNamesWhatNeedsARestart() throws {
        let redis = "targets: {sessions: {redis: \"redis://127.0.0.1:6379\"}}\n"
        let first = try parse(redis + "logging: {level: info}\npolicy: {sessions-revoked: [{purge-set: {target: sessions, set: \"a:{user}\"}}]}\n")
        var running = first
        let planner = Invalidation.Planner(policy: first.invalidation.policy)
        LogLevelControl.current = .info
        let second = try parse(redis + "logging: {level: warning}\npolicy: {sessions-revoked: [{purge-set: {target: sessions, set: \"b:{user}\"}}]}\n")
        let (applied, restart) = ConfigurationReload.apply(second, to: &running, planner: planner)
        if ProcessInfo.processInfo.environment["WARDEN_LOG_LEVEL"] == nil {
            #expect(applied.contains("log level warning"))
            #expect(LogLevelControl.current == .warning)
        }
        #expect(applied.contains { $0.hasPrefix("policy") } && restart.isEmpty)
        #expect(planner.policy == second.invalidation.policy)
        // Nothing new: nothing applied.
        #expect(ConfigurationReload.apply(second, to: &running, planner: planner).applied.isEmpty)
        // Another target: the policy waits for a restart with it.
        let third = try parse("targets: {sessions: {redis: \"redis://127.0.0.1:6380\"}}\nhttp: {listen: \"127.0.0.1:9999\"}\n")
        let (_, later) = ConfigurationReload.apply(third, to: &running, planner: planner)
        #expect(later.contains { $0.hasPrefix("targets") } && later.contains("http"))
        #expect(planner.policy == second.invalidation.policy)
        LogLevelControl.current = .info
    }

    /// Pushed SETs go through the topic and are judged as of their arrival only within
    /// retention − (max-age + skew): a retention leaving less than an hour for a worker to read
    /// them is refused, or a SET answered 202 near the end of its max-age could be refused as
    /// too old once read.
    @Test func aRetentionLeavingPushedSETsNoTimeToBeReadIsRefused() throws {
        func parse(retention: String) throws(ConfigError) -> WardenConfiguration {
            try WardenConfiguration.parse(yaml: """
                issuers:
                  - issuer: https://accounts.google.com/
                    jwks-uri: https://www.googleapis.com/oauth2/v3/certs
                    audiences: [app]
                    max-age: 1d
                    clock-skew: 5m
                kafka: {brokers: embedded}
                receiver: {listen: "127.0.0.1:0"}
                ledger: {url: "sqlite:ledger.sqlite", retention: \(retention)}
                """, environment: [:], baseDirectory: FileManager.default.temporaryDirectory)
        }
        do {
            _ = try parse(retention: "1445m")
            Issue.record("a retention of max-age + skew (no arrival window) passed")
        } catch {
            #expect(error.description.contains("ledger.retention: leaves 0 s (at least 3600 s needed)"), "\(error)")
        }
        #expect(try parse(retention: "2d").ledgerRetention == 2 * 86_400)
    }

    /// A reload that changes the issuers applies no policy, lookup or target with them: those
    /// were checked against issuers that run only after a restart. (Two issuers run; the new file
    /// has one, where a key naming {sub} without {iss} passes the check.)
    @Test func aReloadThatChangesTheIssuersAppliesNoPolicy() throws {
        let second = """
              - issuer: https://other.example/
                jwks-uri: https://other.example/jwks
                audiences: [app]

            """
        let scoped = "subjects: {resolve: {redis: sessions, key: \"u:{iss}|{sub}\"}}\n"
        let redis = "targets: {sessions: {redis: \"redis://127.0.0.1:6379\"}}\n"
        let two = try WardenConfiguration.parse(yaml: Self.issuer + second + redis + scoped, environment: [:],
                                                baseDirectory: FileManager.default.temporaryDirectory)
        var running = two
        let planner = Invalidation.Planner(policy: two.invalidation.policy)
        let one = try parse(redis + scoped + "policy: {sessions-revoked: [{purge-keys: {target: sessions, keys: [\"sess:{sub}\"]}}]}\n")
        let (applied, restart) = ConfigurationReload.apply(one, to: &running, planner: planner)
        #expect(!applied.contains { $0.hasPrefix("policy") }, "\(applied)")
        #expect(restart.contains { $0.hasPrefix("targets, token stores, subjects and policy") } && restart.contains("issuers"), "\(restart)")
        #expect(planner.policy == two.invalidation.policy)
        #expect(running.invalidation.policy == two.invalidation.policy && running.invalidation.subjects == two.invalidation.subjects)
    }

    // A certificate authority file replaced in place under the same name: the reload sees the
    // new contents and builds new connections for that target (the path alone did not change).
    @Test func reloadNoticesACertificateFileReplacedInPlace() async throws {
        let certificates = try await TestCertificates.shared()
        let directory = try Scratch.directory("reload-ca")
        let ca = directory.appendingPathComponent("redis-ca.pem").path
        try FileManager.default.copyItem(atPath: certificates.caFile, toPath: ca)
        let yaml = Self.issuer + "targets: {sessions: {redis: \"rediss://127.0.0.1:6380/0\", ca-file: \(ca)}}\n"
        var running = try WardenConfiguration.parse(yaml: yaml, baseDirectory: directory)
        let planner = Invalidation.Planner(policy: running.invalidation.policy)
        let http = OutboundHTTP(configuration: .init(), proxies: .direct)
        let logger = Logger(label: "reload-test")
        let reloadable = ReloadableTargets(try running.invalidation.makeTargets(http: http, logger: logger))
        let made = Mutex(0)
        let reload = ConfigurationReload.TargetReload(reloadable: reloadable) { fresh throws(ConfigError) in
            made.withLock { $0 += 1 }
            return try fresh.makeTargets(http: http, logger: logger)
        }
        // Read again unchanged: nothing to apply.
        let same = try WardenConfiguration.parse(yaml: yaml, baseDirectory: directory)
        #expect(ConfigurationReload.apply(same, to: &running, planner: planner, targets: reload).applied.isEmpty)
        #expect(made.withLock { $0 } == 0)
        // The file replaced by another authority's certificate.
        try FileManager.default.removeItem(atPath: ca)
        try FileManager.default.copyItem(atPath: certificates.otherCAFile, toPath: ca)
        let rotated = try WardenConfiguration.parse(yaml: yaml, baseDirectory: directory)
        let (applied, restart) = ConfigurationReload.apply(rotated, to: &running, planner: planner, targets: reload)
        #expect(applied.contains { $0.hasPrefix("targets.sessions ") }, "\(applied)")
        #expect(restart.isEmpty, "\(restart)")
        #expect(made.withLock { $0 } == 1)
        try await http.shutdown()
    }
}
