import HTTPExchange
public import Foundation

/// Which family of rules a token from an issuer must follow.
public enum TokenProfile: String, Sendable, Hashable, CaseIterable {
    /// Google RISC: `typ` optional, subject inside each event, legacy subject spellings, no `exp` check.
    case risc
    /// OpenID SSF 1.0: `typ: secevent+jwt` required, top-level `sub_id` required, no `sub`, no `exp`.
    case ssf
    /// OpenID Connect Back-Channel Logout 1.0: logout tokens, `exp` checked, `sub` or `sid`, no `nonce`.
    case logout
}

/// Where an issuer's signing keys come from.
public enum KeySource: Sendable, Hashable {
    /// A discovery document (`risc-configuration`, `ssf-configuration`, `openid-configuration`)
    /// whose `issuer` must equal the configured issuer and whose `jwks_uri` names the keys.
    case discovery(URL)
    /// A JWKS URL given directly.
    case jwks(URL)
    /// A JWKS document read once from configuration (pinned keys); never refreshed.
    case pinned(document: [UInt8], origin: String)

    /// The discovery URL a profile's metadata lives at for an issuer (SPEC §3.1 issuer-path rule:
    /// host + well-known path + issuer path without its trailing slash).
    public static func wellKnownDiscovery(issuer: String, profile: TokenProfile) -> URL? {
        guard var components = URLComponents(string: issuer), components.host != nil else { return nil }
        var path = components.path
        while path.hasSuffix("/") { path.removeLast() }
        switch profile {
        case .risc: components.path = "/.well-known/risc-configuration" + path
        case .ssf: components.path = "/.well-known/ssf-configuration" + path
        // OpenID Connect Discovery appends to the issuer instead.
        case .logout: components.path = path + "/.well-known/openid-configuration"
        }
        components.query = nil
        components.fragment = nil
        return components.url
    }
}

/// How long keys are kept and how often the provider may be asked for them.
public struct KeyCacheSettings: Sendable, Hashable {
    /// Least time between two JWKS requests caused by unknown `kid`s. Default 60 s.
    public var unknownKeyCooldown: Double = 60
    /// Least time between two attempts after a failed fetch. Default 5 s.
    public var failureRetryInterval: Double = 5
    /// Bounds on the `Cache-Control: max-age` honoured, and the lifetime used without one.
    public var minimumLifetime: Double = 60
    public var maximumLifetime: Double = 86_400
    public var defaultLifetime: Double = 3_600
    /// How long past their lifetime keys keep being used while the provider cannot be reached.
    /// After that, verification fails closed (keys unavailable). Default 24 h.
    public var maximumStaleness: Double = 86_400
    /// Timeout of each discovery or JWKS request. Default 5 s.
    public var fetchTimeout: Double = 5
    /// Largest discovery or JWKS document read. Default 1 MiB.
    public var maximumDocumentBytes: Int = 1 << 20

    public init() {}
}

/// What Warden accepts from one issuer.
public struct IssuerPolicy: Sendable, Hashable {
    /// Compared exactly with the token's `iss` (and the discovery document's `issuer`).
    public var issuer: String
    public var keySource: KeySource
    /// The token's `aud` must contain one of these.
    public var audiences: [String]
    /// Accepted `alg` values, compared case-sensitively.
    public var algorithms: Set<JOSEAlgorithm>
    public var profile: TokenProfile
    /// How far in the future `iat` may be. Default 5 min (60 s for logout tokens, as for ID tokens).
    public var clockSkew: Double
    /// When set, tokens whose `iat` is older than this are refused.
    public var maximumAge: Double?
    public var keyCache: KeyCacheSettings

    public init(issuer: String, keySource: KeySource, audiences: [String], algorithms: Set<JOSEAlgorithm> = [.rs256],
                profile: TokenProfile = .risc, clockSkew: Double? = nil, maximumAge: Double? = nil,
                keyCache: KeyCacheSettings = KeyCacheSettings()) {
        self.issuer = issuer
        self.keySource = keySource
        self.audiences = audiences
        self.algorithms = algorithms
        self.profile = profile
        self.clockSkew = clockSkew ?? (profile == .logout ? 60 : 300)
        self.maximumAge = maximumAge
        self.keyCache = keyCache
    }
}

/// Whether a URL may be used to fetch keys or metadata: https anywhere, http only on loopback.
public enum URLRule {
    public static func isAcceptableForKeys(_ url: URL) -> Bool {
        switch url.scheme?.lowercased() {
        case "https": return url.host != nil
        case "http": return isLoopback(url.host)
        default: return false
        }
    }

    public static func isLoopback(_ host: String?) -> Bool { HTTPRules.isLoopback(host) }
}

/// Seconds since 1970, injectable so tests control time.
public struct WallClock: Sendable {
    public let now: @Sendable () -> Double

    public init(now: @escaping @Sendable () -> Double) { self.now = now }

    public static let system = WallClock { Date().timeIntervalSince1970 }
}
