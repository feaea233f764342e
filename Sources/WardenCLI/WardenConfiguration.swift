public import Foundation
import Invalidation
import Pipeline
public import TokenVerification
import AsyncHTTPClient
public import HTTPExchange
import NIOSSL
public import Logging

/// Everything a configuration file says, validated. Built in one place from the YAML and the
/// `WARDEN_…` environment overrides.
public struct WardenConfiguration: Sendable {
    public var issuers: [IssuerPolicy]
    /// Largest token accepted before any parsing. Default 64 KiB.
    public var maximumTokenBytes: Int
    /// `kafka:`; nil when the section is absent.
    public var kafka: KafkaSettings?
    public var http: HTTPSettings
    /// `receiver:`; nil when the section is absent.
    public var receiver: ReceiverSettings?
    /// `ledger:`; nil when absent (`warden run` requires it).
    public var ledger: LedgerLocation?
    /// `targets:`, `token-stores:`, `subjects:`, `policy:`.
    public var invalidation: InvalidationConfiguration
    /// Issuers' `stream:` sections, in the issuers' order.
    public var streams: [StreamConfiguration] = []
    /// `logging: {level: …}`; `WARDEN_LOG_LEVEL` wins over it.
    public var logLevel: Logger.Level? = nil
    /// `ledger.retention`, seconds; nil keeps everything.
    public var ledgerRetention: Double? = nil
    /// `http-client: {ca-file: …}`: authorities every outgoing HTTPS call (keys, discovery,
    /// revoke, webhook, stream, poll) trusts beside the system's.
    public var outboundCAFile: String? = nil
    /// `HTTPS_PROXY` and `NO_PROXY` (or their lower-case forms) from the environment.
    public var outboundProxies: ProxySettings = .direct

    /// The client of every outgoing call: no redirects followed, the configured CA trusted,
    /// through the environment's proxy unless `NO_PROXY` or loopback exempts the host.
    public func makeHTTPClient() -> OutboundHTTP {
        var tls = TLSConfiguration.makeClientConfiguration()
        if let outboundCAFile { tls.additionalTrustRoots = [.file(outboundCAFile)] }
        return OutboundHTTP(configuration: .init(tlsConfiguration: tls, redirectConfiguration: .disallow), proxies: outboundProxies)
    }

    /// How outgoing calls leave, for the start-up log: "direct", or the proxies and exemptions.
    public var outboundRoute: String {
        guard let proxy = outboundProxies.https else { return "direct" }
        return "https via \(proxy)" + (outboundProxies.bypass == NoProxy() ? "" : ", NO_PROXY hosts direct")
    }

    /// The streams `warden run` polls (`delivery: {method: poll}`).
    public var pollStreams: [StreamConfiguration] {
        streams.filter { if case .poll? = $0.settings.delivery { true } else { false } }
    }

    /// The least time a pushed or polled SET may take from its arrival to a worker reading it
    /// from the topic and still be judged as of its arrival (`KafkaIntake.arrivalWindow`).
    static let minimumArrivalWindow: Double = 3600

    /// Whether `warden run` takes SETs by push or poll (produced onto the topic with Kafka).
    public var isPushing: Bool { receiver != nil || !pollStreams.isEmpty }

    /// Top-level sections of the product's configuration. Sections other parts of Warden read
    /// are accepted here and validated by those parts.
    static let topLevelKeys = ["issuers", "max-token-size", "kafka", "http", "receiver", "ledger", "subjects",
                               "targets", "token-stores", "policy", "logging", "http-client"]
    static let issuerKeys = ["issuer", "discovery", "jwks-uri", "jwks_uri", "jwks-file", "audiences", "algorithms",
                             "profile", "fetch-timeout", "clock-skew", "max-age", "key-refresh-cooldown",
                             "key-retry-interval", "max-key-staleness", "min-key-lifetime", "max-key-lifetime", "stream"]

    /// `WARDEN_CONFIG`: the configuration file when `--config` is not given; empty when unset.
    public static var environmentConfigPath: String { ProcessInfo.processInfo.environment["WARDEN_CONFIG"] ?? "" }

    /// Variables Warden reads that are not configuration keys.
    static let processVariables = ["WARDEN_CONFIG", "WARDEN_LOG_LEVEL", "WARDEN_LOG_FORMAT"]

    public static func load(path: String, environment: [String: String] = ProcessInfo.processInfo.environment)
        throws(ConfigError) -> WardenConfiguration
    {
        guard !path.isEmpty else { throw ConfigError(path: "", "no configuration file: give --config FILE or set WARDEN_CONFIG") }
        guard let data = FileManager.default.contents(atPath: path) else {
            throw ConfigError(path: "", "cannot read the configuration file \(path)")
        }
        guard let text = String(data: data, encoding: .utf8) else {
            throw ConfigError(path: "", "the configuration file \(path) is not UTF-8 text")
        }
        let base = URL(fileURLWithPath: path).deletingLastPathComponent()
        return try parse(yaml: text, environment: environment, baseDirectory: base)
    }

    public static func parse(yaml: String, environment: [String: String] = [:],
                             baseDirectory: URL = URL(fileURLWithPath: ".")) throws(ConfigError) -> WardenConfiguration {
        let root = ConfigReader(tree: try ConfigTree.parse(yaml: yaml), environment: environment, baseDirectory: baseDirectory)
        // Accepted once and read by nothing: an operator would believe it polled.
        if root.child("poll").isPresent {
            throw root.child("poll").error("polling is set per issuer: issuers[].stream.delivery: {method: poll}")
        }
        try root.requireOnly(topLevelKeys)

        var issuers: [IssuerPolicy] = []
        var streams: [StreamConfiguration] = []
        let issuerReaders = try root.child("issuers").list()
        if issuerReaders.isEmpty { throw root.child("issuers").error("at least one issuer is required") }
        for reader in issuerReaders {
            let policy = try issuer(reader)
            if issuers.contains(where: { $0.issuer == policy.issuer }) {
                throw reader.child("issuer").error("the issuer \"\(policy.issuer)\" is configured twice")
            }
            issuers.append(policy)
            if let stream = try StreamConfiguration.parse(reader.child("stream"), issuer: policy.issuer) { streams.append(stream) }
        }
        let maximum = try root.child("max-token-size").byteSize() ?? SETVerifier.defaultMaximumTokenBytes
        let configuration = WardenConfiguration(
            issuers: issuers, maximumTokenBytes: maximum, kafka: try KafkaSettings.parse(root.child("kafka")),
            http: try HTTPSettings.parse(root.child("http")), receiver: try ReceiverSettings.parse(root.child("receiver")),
            ledger: root.child("ledger").isPresent ? try LedgerLocation.parse(root.child("ledger")) : nil,
            invalidation: try InvalidationConfiguration.parse(root, issuers: issuers.map(\.issuer)), streams: streams,
            logLevel: try logLevel(root.child("logging")),
            ledgerRetention: try LedgerLocation.retention(root.child("ledger"), issuers: issuers),
            outboundCAFile: try outboundCAFile(root.child("http-client")),
            outboundProxies: try outboundProxies(environment))
        try checkEnvironment(root)
        // Pushed or polled SETs go through the topic, and the worker judges their claims as of
        // their arrival only within this window: with none, a SET answered 202 near the end of
        // its max-age and read a moment later would be refused as too old.
        if configuration.kafka != nil, configuration.isPushing, let retention = configuration.ledgerRetention {
            let window = KafkaIntake.arrivalWindow(retention: retention, issuers: issuers)
            if window < Self.minimumArrivalWindow {
                throw root.child("ledger").child("retention").error(
                    "leaves \(Int(window)) s (at least \(Int(Self.minimumArrivalWindow)) s needed) beyond the longest max-age plus clock skew "
                    + "for a pushed or polled SET to be read from the topic and still judged as of its arrival: a SET answered 202 "
                    + "could be refused as too old; lengthen the retention or shorten that max-age")
            }
        }
        return configuration
    }

    /// The environment's proxies, refused at start when a variable cannot be used.
    static func outboundProxies(_ environment: [String: String]) throws(ConfigError) -> ProxySettings {
        do {
            return try ProxySettings(environment: environment)
        } catch {
            throw ConfigError(path: "", "the environment's \(error.variable): \(error.message)")
        }
    }

    /// `http-client: {ca-file: PATH}` (relative to the configuration file): PEM certificates,
    /// read now so that a missing or malformed file is named at start.
    static func outboundCAFile(_ r: ConfigReader) throws(ConfigError) -> String? {
        guard r.isPresent else { return nil }
        try r.requireOnly(["ca-file"])
        let c = r.child("ca-file")
        guard let name = try c.string() else { return nil }
        let path = name.hasPrefix("/") ? name : r.baseDirectory.appendingPathComponent(name).standardizedFileURL.path
        guard FileManager.default.isReadableFile(atPath: path) else { throw c.error("cannot read the file \(path)") }
        do {
            guard !(try NIOSSLCertificate.fromPEMFile(path)).isEmpty else { throw c.error("\(path) holds no PEM certificate") }
        } catch let error as ConfigError {
            throw error
        } catch {
            throw c.error("\(path) is not PEM certificates: \(error)")
        }
        return path
    }

    /// `logging: {level: trace|debug|info|notice|warning|error|critical}`.
    static func logLevel(_ r: ConfigReader) throws(ConfigError) -> Logger.Level? {
        guard r.isPresent else { return nil }
        try r.requireOnly(["level"])
        guard let text = try r.child("level").string() else { return nil }
        guard let level = Logger.Level(rawValue: text) else {
            throw r.child("level").error("\"\(text.prefix(32))\" is not a level (\(Logger.Level.allCases.map(\.rawValue).joined(separator: ", ")))")
        }
        return level
    }

    /// Every `WARDEN_…` variable must have been read as a key (or be one of the process's own):
    /// a misspelt override would otherwise be ignored while the operator believes it applied.
    static func checkEnvironment(_ root: ConfigReader) throws(ConfigError) {
        if let level = root.environment["WARDEN_LOG_LEVEL"], Logger.Level(rawValue: level) == nil {
            throw ConfigError(path: "", "WARDEN_LOG_LEVEL: \"\(level.prefix(32))\" is not a level (\(Logger.Level.allCases.map(\.rawValue).joined(separator: ", ")))")
        }
        if let format = root.environment["WARDEN_LOG_FORMAT"], !JSONLogHandler.formats.contains(format) {
            throw ConfigError(path: "", "WARDEN_LOG_FORMAT: \"\(format.prefix(32))\" is not a log format (\(JSONLogHandler.formats.joined(separator: ", ")))")
        }
        let read = root.consulted.names.withLock { $0 }.union(processVariables)
        for name in root.environment.keys.sorted() where name.hasPrefix("WARDEN_") && !read.contains(name) {
            let closest = read.min { ConfigReader.distance($0, name) < ConfigReader.distance($1, name) }
            throw ConfigError(path: "", "the environment variable \(name) matches no configuration key"
                              + (closest.map { " (the closest is \($0))" } ?? ""))
        }
    }

    static func issuer(_ r: ConfigReader) throws(ConfigError) -> IssuerPolicy {
        try r.requireOnly(issuerKeys)
        let issuer = try r.child("issuer").requiredString()
        guard let issuerURL = URL(string: issuer), issuerURL.scheme != nil, issuerURL.host != nil else {
            throw r.child("issuer").error("\"\(issuer)\" is not an absolute URL")
        }

        let profileName = try r.child("profile").string() ?? "risc"
        guard let profile = TokenProfile(rawValue: profileName) else {
            throw r.child("profile").error("\"\(profileName)\" is not one of risc, ssf, logout")
        }

        // Key source: exactly one of discovery, jwks-uri, jwks-file; default: the profile's well-known discovery.
        var sources = ["discovery", "jwks-uri", "jwks_uri", "jwks-file"].filter { r.child($0).isPresent }
        // jwks-uri and jwks_uri have one environment variable between them: set alone, it counts
        // once, for the spelling the file uses (jwks-uri if neither).
        if sources.contains("jwks-uri"), sources.contains("jwks_uri"), !(r.child("jwks-uri").isInFile && r.child("jwks_uri").isInFile) {
            sources.removeAll { $0 == (r.child("jwks_uri").isInFile ? "jwks-uri" : "jwks_uri") }
        }
        if sources.count > 1 {
            throw r.error("give only one of discovery, jwks-uri, jwks-file (found \(sources.joined(separator: ", ")))")
        }
        let keySource: KeySource
        switch sources.first {
        case "discovery"?:
            keySource = .discovery(try url(r.child("discovery")))
        case "jwks-uri"?, "jwks_uri"?:
            keySource = .jwks(try url(r.child(sources[0])))
        case "jwks-file"?:
            let (contents, path) = try r.child("jwks-file").fileContents()!
            do {
                let keys = try KeySet.parse(jwks: contents)
                if keys.usableKeys.isEmpty { throw KeySetError(message: "it holds no usable key") }
            } catch {
                throw r.child("jwks-file").error("\(path) is not a usable JWKS: \(error)")
            }
            keySource = .pinned(document: contents, origin: path)
        default:
            guard let derived = KeySource.wellKnownDiscovery(issuer: issuer, profile: profile) else {
                throw r.child("issuer").error("cannot derive a discovery URL from \"\(issuer)\"")
            }
            guard URLRule.isAcceptableForKeys(derived) else {
                throw r.child("issuer").error("the derived discovery URL \(derived.absoluteString) is not https; give discovery or jwks-uri")
            }
            keySource = .discovery(derived)
        }

        guard let audiences = try r.child("audiences").stringList(), !audiences.isEmpty else {
            throw r.child("audiences").error("at least one audience (your OAuth client ID or receiver id) is required")
        }

        var algorithms: Set<JOSEAlgorithm> = [.rs256]
        if let names = try r.child("algorithms").stringList() {
            guard !names.isEmpty else { throw r.child("algorithms").error("the list is empty") }
            algorithms = []
            for (i, name) in names.enumerated() {
                guard let alg = JOSEAlgorithm(rawValue: name) else {
                    throw ConfigError(path: "\(r.child("algorithms").pathText)[\(i)]", JOSEAlgorithm.refusal(for: name))
                }
                algorithms.insert(alg)
            }
        }

        var cache = KeyCacheSettings()
        cache.fetchTimeout = try positive(r.child("fetch-timeout")) ?? cache.fetchTimeout
        cache.unknownKeyCooldown = try r.child("key-refresh-cooldown").duration() ?? cache.unknownKeyCooldown
        // Without a cooldown every token naming an unknown kid would fetch the JWKS again.
        guard cache.unknownKeyCooldown >= 1 else { throw r.child("key-refresh-cooldown").error("must be at least 1s") }
        cache.failureRetryInterval = try r.child("key-retry-interval").duration() ?? cache.failureRetryInterval
        // Without it, every token would fetch the JWKS again while the provider fails.
        guard cache.failureRetryInterval >= 0.1 else { throw r.child("key-retry-interval").error("must be at least 100ms") }
        cache.maximumStaleness = try r.child("max-key-staleness").duration() ?? cache.maximumStaleness
        cache.minimumLifetime = try r.child("min-key-lifetime").duration() ?? cache.minimumLifetime
        cache.maximumLifetime = try r.child("max-key-lifetime").duration() ?? cache.maximumLifetime
        // Keys that expire as they are fetched would make every token fetch the JWKS.
        guard cache.maximumLifetime >= 1 else { throw r.child("max-key-lifetime").error("must be at least 1s") }
        if cache.minimumLifetime > cache.maximumLifetime {
            throw r.child("min-key-lifetime").error("is larger than max-key-lifetime")
        }

        return IssuerPolicy(issuer: issuer, keySource: keySource, audiences: audiences, algorithms: algorithms,
                            profile: profile, clockSkew: try r.child("clock-skew").duration(),
                            maximumAge: try positive(r.child("max-age")), keyCache: cache)
    }

    /// An absolute URL; https only (http for loopback hosts) unless `plainHTTP` (a webhook,
    /// whose body is signed and whose token identifiers are redacted: the design allows
    /// `http://app.internal/…` there).
    static func url(_ r: ConfigReader, plainHTTP: Bool = false) throws(ConfigError) -> URL {
        let text = try r.requiredString()
        let shown = TargetSettings.shown(text: text)
        guard let url = URL(string: text), url.host != nil else { throw r.error("\"\(shown)\" is not an absolute URL") }
        if plainHTTP {
            guard let scheme = url.scheme?.lowercased(), scheme == "http" || scheme == "https" else {
                throw r.error("\"\(shown)\" must be an http or https URL")
            }
            return url
        }
        guard URLRule.isAcceptableForKeys(url) else {
            throw r.error("\"\(shown)\" must use https (http is allowed only for loopback hosts)")
        }
        return url
    }

    static func positive(_ r: ConfigReader) throws(ConfigError) -> Double? {
        guard let value = try r.duration() else { return nil }
        guard value > 0 else { throw r.error("must be greater than zero") }
        return value
    }
}
