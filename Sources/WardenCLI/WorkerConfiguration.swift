public import Ledger
public import Pipeline
import Kafka
import Foundation
import Invalidation
import TokenVerification

/// The `kafka:` section.
public struct KafkaSettings: Sendable, Equatable {
    /// `host:port,…`, or `embedded` for librdkafka's in-process mock cluster.
    public var brokers: String
    public var topic: String
    public var group: String
    public var deadLetterTopic: String
    /// Passed through to librdkafka (`security.protocol`, `sasl.*`, `ssl.*`, `session.timeout.ms`, …).
    public var properties: [String: String]
    /// Partitions of the topics the embedded cluster creates. Default 4.
    public var embeddedPartitions: Int
    /// Tasks verifying a batch at once. Default: the number of cores.
    public var concurrency: Int
    /// Messages fetched but not finished before fetching pauses. Default 4096.
    public var maximumInFlight: Int
    /// Seconds between offset commits. Default 1.
    public var commitInterval: Double
    /// Seconds a message may wait aside for its issuer's keys before it is refused and
    /// dead-lettered (`keys_unavailable`). Default 24 h.
    public var maximumKeyWait: Double = 86_400

    public var isEmbedded: Bool { brokers == "embedded" }

    static let keys = ["brokers", "topic", "group", "dead-letter-topic", "properties", "embedded-partitions",
                       "concurrency", "max-in-flight", "commit-interval", "max-key-wait"]

    static func parse(_ r: ConfigReader) throws(ConfigError) -> KafkaSettings? {
        guard r.isPresent else { return nil }
        try r.requireOnly(keys)
        var properties: [String: String] = [:]
        let p = r.child("properties")
        for key in try p.keys() {
            if let reason = KafkaProperties.reserved[key] {
                throw p.child(key).error("is set by Warden and cannot be changed: \(reason)")
            }
            // Any property ending in .password may be read from a file: `sasl.password-file`.
            var name = key
            let value: String
            if key.hasSuffix(".password-file") {
                name = String(key.dropLast("-file".count))
                guard let secret = try p.secret(name) else { throw p.child(key).error("needs a value") }
                value = secret
            } else if key.hasSuffix("-file") {
                throw p.child(key).error("only a property ending in .password can be read from a file (\(key.dropLast(5)).password-file)")
            } else {
                guard let text = try p.child(key).string() else { throw p.child(key).error("needs a value") }
                value = text
            }
            if name.hasSuffix(".password"), p.child(name + "-file").isPresent, key == name { continue }  // the -file form reports the conflict
            properties[name] = value
            do {
                try KafkaProperties([name: value]).validate()
            } catch {
                // librdkafka's words, never the value of a password.
                throw p.child(key).error(name.hasSuffix(".password") ? "librdkafka refused it" : error.message)
            }
        }
        let topic = try topicName(r.child("topic")) ?? "security-events"
        let deadLetterTopic = try topicName(r.child("dead-letter-topic")) ?? "security-events.dlq"
        // Each refused SET would come back to be refused and dead-lettered again, for ever.
        guard deadLetterTopic != topic else {
            throw r.child("dead-letter-topic").error("is the topic Warden consumes (kafka.topic): dead letters need a topic of their own")
        }
        let group = try r.child("group").string() ?? "warden"
        guard !group.isEmpty else {
            throw r.child("group").error("needs a value")
        }
        var settings = KafkaSettings(
            brokers: try r.child("brokers").requiredString(),
            topic: topic,
            group: group,
            deadLetterTopic: deadLetterTopic,
            properties: properties,
            embeddedPartitions: try positiveInt(r.child("embedded-partitions"), atMost: 1000) ?? 4,
            concurrency: try positiveInt(r.child("concurrency"), atMost: 1024) ?? ProcessInfo.processInfo.activeProcessorCount,
            maximumInFlight: try positiveInt(r.child("max-in-flight"), atMost: 1_000_000) ?? 4096,
            commitInterval: try WardenConfiguration.positive(r.child("commit-interval")) ?? 1)
        if let wait = try WardenConfiguration.positive(r.child("max-key-wait")) { settings.maximumKeyWait = wait }
        return settings
    }
}

/// The `http:` section: health, readiness and metrics.
public struct HTTPSettings: Sendable, Equatable {
    public var host: String
    public var port: Int
    /// `stall-timeout`: `/healthz` fails when messages wait and none has been finished for this
    /// long. Default 60 s.
    public var stallTimeout: Double = 60

    public static let `default` = HTTPSettings(host: "127.0.0.1", port: 9464)

    static func parse(_ r: ConfigReader) throws(ConfigError) -> HTTPSettings {
        guard r.isPresent else { return .default }
        try r.requireOnly(["listen", "stall-timeout"])
        var settings = HTTPSettings.default
        if let listen = try r.child("listen").string() {
            guard let (host, port) = parseListen(listen) else {
                throw r.child("listen").error("\"\(listen)\" is not host:port (e.g. 127.0.0.1:9464; port 0 picks a free one)")
            }
            (settings.host, settings.port) = (host, port)
        }
        if let stall = try WardenConfiguration.positive(r.child("stall-timeout")) { settings.stallTimeout = stall }
        return settings
    }

    static func parseListen(_ text: String) -> (String, Int)? {
        guard let colon = text.lastIndex(of: ":"), let port = Int(text[text.index(after: colon)...]), (0...65535).contains(port) else {
            return nil
        }
        var host = String(text[..<colon])
        if host.hasPrefix("["), host.hasSuffix("]") { host = String(host.dropFirst().dropLast()) }
        return host.isEmpty ? nil : (host, port)
    }
}

/// The `receiver:` section: the RFC 8935 push endpoint.
public struct ReceiverSettings: Sendable, Equatable {
    public var host: String
    public var port: Int
    /// Default `/events`.
    public var path: String
    /// From `bearer-tokens-file` (one per line); none: no bearer token is asked for.
    public var bearerTokens: [String]
    /// Default 65,536.
    public var maximumBodyBytes: Int
    /// `rate-limit: {per-second, burst}` per client address, or `off`; default 1,000/s, burst 2,000.
    public var rateLimit: ClientRateLimiter.Settings? = PushReceiver.Settings.defaultRateLimit
    /// `idle-timeout`: seconds a silent connection is kept; default 30.
    public var idleTimeout: Double = PushReceiver.Settings.defaultIdleTimeout
    /// `max-connections`: connections open at once; default 512.
    public var maximumConnections: Int = PushReceiver.Settings.defaultMaximumConnections

    static let keys = ["listen", "path", "bearer-tokens-file", "max-body-bytes", "rate-limit", "idle-timeout", "max-connections"]

    static func parse(_ r: ConfigReader) throws(ConfigError) -> ReceiverSettings? {
        guard r.isPresent else { return nil }
        try r.requireOnly(keys)
        let listen = try r.child("listen").requiredString()
        guard let (host, port) = HTTPSettings.parseListen(listen) else {
            throw r.child("listen").error("\"\(listen)\" is not host:port (e.g. 0.0.0.0:8080; port 0 picks a free one)")
        }
        let path = try r.child("path").string() ?? "/events"
        guard path.hasPrefix("/"), !path.contains(where: { $0 == " " || $0 == "?" || $0 == "#" }) else {
            throw r.child("path").error("\"\(path)\" is not a path (e.g. /events)")
        }
        var tokens: [String] = []
        let file = r.child("bearer-tokens-file")
        if let (contents, filePath) = try file.fileContents() {
            guard let text = String(bytes: contents, encoding: .utf8) else { throw file.error("the file \(filePath) is not UTF-8 text") }
            // One token per line; blank lines and surrounding whitespace (a CRLF too) are not part of one.
            tokens = text.split(whereSeparator: \.isNewline).map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
            guard !tokens.isEmpty else { throw file.error("the file \(filePath) holds no token") }
            if tokens.contains(where: { $0.contains(" ") }) { throw file.error("a line of \(filePath) holds more than one word: one token per line") }
        }
        let idleTimeout = try r.child("idle-timeout").duration() ?? PushReceiver.Settings.defaultIdleTimeout
        guard idleTimeout >= 1 else { throw r.child("idle-timeout").error("must be at least 1s") }
        return ReceiverSettings(host: host, port: port, path: path, bearerTokens: tokens,
                                maximumBodyBytes: try r.child("max-body-bytes").byteSize() ?? 65_536,
                                rateLimit: try parseRateLimit(r.child("rate-limit")), idleTimeout: idleTimeout,
                                maximumConnections: try positiveInt(r.child("max-connections"), atMost: 1_000_000)
                                    ?? PushReceiver.Settings.defaultMaximumConnections)
    }

    /// `off`, or `{per-second: N, burst: M}` (N may be a fraction; burst default: twice the rate, at least 1).
    static func parseRateLimit(_ r: ConfigReader) throws(ConfigError) -> ClientRateLimiter.Settings? {
        guard r.isPresent else { return PushReceiver.Settings.defaultRateLimit }
        if let text = try? r.string() {
            guard text == "off" else { throw r.error("\"\(text)\" is not off or {per-second: N, burst: M}") }
            return nil
        }
        try r.requireOnly(["per-second", "burst"])
        // A fraction is a rate below one a second (0.1: one request every ten seconds).
        let rate = r.child("per-second")
        guard let text = try rate.string()?.trimmingCharacters(in: .whitespaces) else {
            throw rate.error("is required (requests a second per client address)")
        }
        guard let perSecond = Double(text), perSecond >= 0.001, perSecond <= 1e9 else {
            throw rate.error("\"\(text)\" is not a number of requests a second from 0.001 to 1000000000")
        }
        return ClientRateLimiter.Settings(perSecond: perSecond,
                                          burst: try positiveInt(r.child("burst")) ?? max(1, Int((2 * perSecond).rounded(.up))))
    }
}

/// The `ledger:` URL.
public enum LedgerLocation: Sendable, Equatable {
    /// `sqlite:///absolute/path`, `sqlite:relative/path` (relative to the configuration file).
    case sqlite(path: String)
    /// `postgres://user[:password]@host[:port]/database`: shared by every replica.
    case postgres(PostgresLedger.Location)

    /// `ledger: URL`, or `ledger: {url: URL, password-file: …, retention: 90d}` (PostgreSQL's
    /// password from a file; retention read by `retention(_:)`).
    static let keys = ["url", "password", "password-file", "retention"]

    static func parse(_ r: ConfigReader) throws(ConfigError) -> LedgerLocation {
        // The map's keys may come from the environment alone (WARDEN_LEDGER_URL,
        // WARDEN_LEDGER_PASSWORD_FILE), or beside `ledger: URL` (WARDEN_LEDGER_RETENTION).
        let inFile: Bool
        if case .map = r.tree { inFile = true } else { inFile = false }
        guard inFile || keys.contains(where: { r.child($0).isPresent }) else { return try parseURL(r) }
        if inFile { try r.requireOnly(keys) }
        if !inFile, r.isGiven, r.child("url").isPresent {
            throw r.child("url").error("gives the ledger's URL a second time (ledger: is a URL already): give it in one place")
        }
        let location = try parseURL(inFile || r.child("url").isPresent ? r.child("url") : r)
        guard let password = try r.secret("password") else { return location }
        guard case .postgres(var postgres) = location else {
            throw r.child(r.child("password").isGiven ? "password" : "password-file").error("is for a postgres:// ledger")
        }
        if postgres.password != nil { throw r.child("url").error("gives a password too: give it in one place") }
        postgres.password = password
        return .postgres(postgres)
    }

    /// `ledger.retention`: how long de-duplication claims, outbox rows, stored tokens and audit
    /// records are kept. Every issuer must refuse tokens older than it (`max-age` at most the
    /// retention): a token whose claim was dropped would otherwise be acted on again.
    static func retention(_ r: ConfigReader, issuers: [IssuerPolicy]) throws(ConfigError) -> Double? {
        guard let retention = try r.child("retention").duration() else { return nil }
        guard retention >= 1 else { throw r.child("retention").error("must be at least 1s") }
        // A token may say it was issued up to the clock skew after it arrived, so it passes the
        // max-age until max-age + skew after its arrival: its claim must outlive that.
        for issuer in issuers where (issuer.maximumAge ?? .infinity) + issuer.clockSkew > retention {
            throw r.child("retention").error("is shorter than the max-age of \(issuer.issuer) (\(issuer.maximumAge.map { "\(Int($0)) s" } ?? "none set")) "
                                             + "plus its clock skew (\(Int(issuer.clockSkew)) s): "
                                             + "a token older than the retention would be acted on again once its claim is dropped; "
                                             + "give that issuer a max-age no longer than the retention less the clock skew")
        }
        return retention
    }

    static func parseURL(_ r: ConfigReader) throws(ConfigError) -> LedgerLocation {
        guard let text = try r.string() else {
            throw r.error("is required by warden run (e.g. sqlite:///var/lib/warden/ledger.sqlite)")
        }
        if text.hasPrefix("sqlite://") {
            let path = String(text.dropFirst("sqlite://".count))
            guard path.hasPrefix("/") else { throw r.error("\"\(text)\": use sqlite:///absolute/path or sqlite:relative/path") }
            return .sqlite(path: path)
        }
        if text.hasPrefix("sqlite:") {
            let path = String(text.dropFirst("sqlite:".count))
            guard !path.isEmpty else { throw r.error("\"\(text)\" names no file") }
            return .sqlite(path: path.hasPrefix("/") ? path : r.baseDirectory.appendingPathComponent(path).standardizedFileURL.path)
        }
        if text.hasPrefix("postgres://") || text.hasPrefix("postgresql://") {
            switch PostgresLedger.Location.parse(text) {
            case .success(let location): return .postgres(location)
            case .failure(let error): throw r.error(error.message)
            }
        }
        throw r.error("\"\(text.lowercased().hasPrefix("postgres") ? "postgres://…" : TargetSettings.shown(text: text))\" is not a ledger URL (sqlite:///path, sqlite:relative/path or postgres://user@host/database)")
    }
}

/// A Kafka topic's name, as Kafka allows it: 1 to 249 of a–z, A–Z, 0–9, `.`, `_` and `-`,
/// and not `.` or `..`.
func topicName(_ r: ConfigReader) throws(ConfigError) -> String? {
    guard let name = try r.string() else { return nil }
    let allowed = name.utf8.allSatisfy { c in
        (c >= UInt8(ascii: "a") && c <= UInt8(ascii: "z")) || (c >= UInt8(ascii: "A") && c <= UInt8(ascii: "Z"))
            || (c >= UInt8(ascii: "0") && c <= UInt8(ascii: "9")) || c == UInt8(ascii: ".") || c == UInt8(ascii: "_") || c == UInt8(ascii: "-")
    }
    guard !name.isEmpty, name.utf8.count <= 249, allowed, name != ".", name != ".." else {
        throw r.error("\"\(name.prefix(64))\" is not a Kafka topic name (1 to 249 of a-z, A-Z, 0-9, '.', '_' and '-')")
    }
    return name
}

/// A whole number from 1 to `limit`: a count or size beyond what a process can hold is refused
/// here, not met later as an overflow or a trap in `run`.
func positiveInt(_ r: ConfigReader, atMost limit: Int = 1_000_000_000) throws(ConfigError) -> Int? {
    guard let text = try r.string() else { return nil }
    guard let n = Int(text.trimmingCharacters(in: .whitespaces)), n > 0 else { throw r.error("\"\(text.prefix(64))\" is not a positive whole number") }
    guard n <= limit else { throw r.error("\(n) is more than the \(limit) allowed") }
    return n
}

extension KafkaSettings {
    /// The consumer's properties: the embedded cluster's session times out in 6 s unless set.
    var consumerProperties: KafkaProperties {
        var p = KafkaProperties(properties)
        if isEmbedded, p["session.timeout.ms"] == nil { p["session.timeout.ms"] = "6000" }
        return p
    }

    /// The dead-letter producer's: a send that cannot be delivered fails within 30 s, not
    /// librdkafka's five minutes, so that its retries (which end on SIGTERM) are what waits —
    /// not one send that outlasts a shutdown's grace period.
    var deadLetterProperties: KafkaProperties { withDeliveryTimeout("30000") }

    /// The pushed SETs' producer's: a sender waits for its answer, so a cluster that cannot be
    /// reached is a 503 within seconds.
    var pushProperties: KafkaProperties { withDeliveryTimeout("10000") }

    private func withDeliveryTimeout(_ milliseconds: String) -> KafkaProperties {
        var p = consumerProperties
        if p["message.timeout.ms"] == nil { p["message.timeout.ms"] = milliseconds }
        return p
    }

    func consumerConfiguration(brokers: String) -> KafkaConsumerConfiguration {
        .init(bootstrapServers: brokers, groupID: group, topics: [topic], properties: consumerProperties,
              maximumInFlight: maximumInFlight, commitInterval: .seconds(commitInterval))
    }

    /// Makes every client `warden run` makes from these settings, connecting to nothing, so that
    /// what librdkafka refuses only together is a configuration error (exit 2) found by
    /// `check-config` and at the start of `run`. `pushing`: SETs are pushed or polled onto the topic.
    func checkClients(pushing: Bool) throws(ConfigError) {
        do {
            try KafkaProperties.checkClients(consumer: consumerConfiguration(brokers: ""),
                                             producers: [("dead-letter producer", deadLetterProperties)]
                                                 + (pushing ? [("pushed SETs' producer", pushProperties)] : []))
        } catch {
            throw ConfigError(path: "kafka.properties", error.message)
        }
    }
}
