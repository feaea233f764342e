public import Foundation
public import Redis
import DatabaseLocations
import HTTPExchange

extension RedisConnectionSettings {
    /// Parses `redis://[user[:password]@]host[:port][/database]` (or `rediss://…` for TLS, with
    /// the system's certificate authorities until a CA file is given); the error says what is
    /// wrong with it (without the password).
    public static func parse(_ text: String) -> Result<RedisConnectionSettings, TargetSettingsError> {
        let secure = text.hasPrefix("rediss://")
        guard secure || text.hasPrefix("redis://"), let components = URLComponents(string: text), let host = components.host,
              !host.isEmpty
        else {
            return .failure(TargetSettingsError("expected redis://[user[:password]@]host[:port][/database] or rediss://… for TLS"))
        }
        if let query = components.query, !query.isEmpty {
            // Named, not quoted: a parameter may hold a password.
            let names = (components.queryItems ?? []).map(\.name).filter { !$0.isEmpty }.prefix(5)
            return .failure(TargetSettingsError("Redis URL parameters are not read (\(names.map { "\"\($0.prefix(32))\"" }.joined(separator: ", "))): "
                                                + "give ca-file, cert-file and key-file beside the URL"))
        }
        var settings = RedisConnectionSettings(host: host, port: components.port ?? 6379, tls: secure ? RedisTLSSettings() : nil)
        let path = components.path.trimmingCharacters(in: CharacterSet(charactersIn: "/"))
        if !path.isEmpty {
            guard let database = Int(path), database >= 0 else {
                return .failure(TargetSettingsError("the database number \"\(path)\" is not a number"))
            }
            settings.database = database
        }
        // `user` and `password` are already percent-decoded: decoded again, `%2541` would become `A`.
        if let user = components.user, !user.isEmpty { settings.username = user }
        if let password = components.password { settings.password = password }
        return .success(settings)
    }

    /// `redis://host:port/db`, never the password.
    public var summary: String {
        "\(tls == nil ? "redis" : "rediss")://\(username.map { "\($0)@" } ?? "")\(host):\(port)/\(database)"
    }
}

/// An RFC 7009 revocation endpoint and how Warden authenticates to it.
public struct RevocationEndpoint: Sendable, Hashable {
    public enum ClientAuthentication: Sendable, Hashable {
        /// Public client: `client_id` in the body when one is configured.
        case none(clientID: String?)
        case clientSecretBasic(clientID: String, secret: String)
        case clientSecretPost(clientID: String, secret: String)

        public var name: String {
            switch self {
            case .none: "none"
            case .clientSecretBasic: "client_secret_basic"
            case .clientSecretPost: "client_secret_post"
            }
        }
    }

    public var url: URL
    public var authentication: ClientAuthentication
    /// Request timeout, seconds. Default 10.
    public var timeout: Double

    public init(url: URL, authentication: ClientAuthentication, timeout: Double = 10) {
        self.url = url
        self.authentication = authentication
        self.timeout = timeout
    }
}

/// A webhook the app listens on: the normalized event is POSTed as JSON, signed with HMAC-SHA256.
public struct WebhookEndpoint: Sendable, Hashable {
    public var url: URL
    public var hmacSecret: [UInt8]
    public var timeout: Double

    public init(url: URL, hmacSecret: [UInt8], timeout: Double = 10) {
        self.url = url
        self.hmacSecret = hmacSecret
        self.timeout = timeout
    }
}

/// A system Warden acts on, by kind.
public enum TargetSettings: Sendable, Hashable {
    case redis(RedisConnectionSettings)
    case revoke(RevocationEndpoint)
    case webhook(WebhookEndpoint)
    /// The app's database: `sqlite:PATH` or `postgres://…`.
    case sql(String)

    public var kind: String {
        switch self {
        case .redis: "redis"
        case .revoke: "revoke"
        case .webhook: "webhook"
        case .sql: "sql"
        }
    }

    /// A URL as shown: without a user and password, and with its query (a webhook's
    /// `?token=…`) only said to be there.
    static func shown(_ url: URL) -> String { shownURL(url) }

    /// A URL's text as shown (`shownURL`).
    public static func shown(text: String) -> String { shownURL(text) }

    /// One line for `check-config` and logs, without secrets.
    public var summary: String {
        switch self {
        case .redis(let settings): "redis \(settings.summary)"
        case .revoke(let endpoint): "revoke \(Self.shown(endpoint.url)) (auth \(endpoint.authentication.name))"
        case .webhook(let endpoint): "webhook \(Self.shown(endpoint.url))"
        case .sql(let location):
            // A PostgreSQL URL is shown without its password.
            "sql \((try? PostgresLocation.parse(location).get())?.description ?? location)"
        }
    }
}

/// Where the app keeps the OAuth tokens it holds for each user: a Redis hash per user
/// (`field` = the app's token id, `value` = the token), and optionally an index hash the app
/// keeps from `prefix:<first 16 chars>` and `sha512:<double SHA-512>` to `<user>/<token id>`.
public struct TokenStoreSettings: Sendable, Hashable {
    public var redisTarget: String
    /// The per-user hash's key, with `{user}`.
    public var hash: String
    public var index: String?

    public init(redisTarget: String, hash: String, index: String? = nil) {
        self.redisTarget = redisTarget
        self.hash = hash
        self.index = index
    }

    /// Whether `template` can be a store's hash: one hash per user, so `{user}` exactly once
    /// and no other placeholder (a hash without it would be every user's; `{iss}` or `{sub}`
    /// would stay unfilled, and the step would find nothing and call that done).
    public static func isHashTemplate(_ template: String) -> Bool {
        Planner.placeholderNames(in: template) == ["user"]
    }

    /// The user's hash.
    public func hash(of user: String) -> String { hash.replacingOccurrences(of: "{user}", with: user) }

    /// A SCAN pattern matching every user's hash.
    var hashPattern: String { Planner.globEscaped(hash).replacingOccurrences(of: "{user}", with: "*") }

    /// The user whose hash is `key` (as SCAN listed it), if it is one of this store's.
    func user(ofHash key: [UInt8]) -> String? {
        guard let marker = hash.range(of: "{user}") else { return nil }
        let prefix = Array(hash[..<marker.lowerBound].utf8), suffix = Array(hash[marker.upperBound...].utf8)
        guard key.count >= prefix.count + suffix.count, key.starts(with: prefix), key.suffix(suffix.count).elementsEqual(suffix),
              let user = String(validating: key[prefix.count..<(key.count - suffix.count)], as: UTF8.self) else { return nil }
        return user
    }
}

/// How a provider subject becomes the local user id.
public enum SubjectResolverSettings: Sendable, Hashable {
    /// The provider's `sub` is the local user id.
    case identity
    /// A Redis string key (with placeholders such as `{iss}`, `{sub}`, `{email}`) holds the id.
    case redis(target: String, key: String)
    /// A query on a SQL target; `$1`… are bound to the parameters (placeholder texts).
    case sql(target: String, query: String, parameters: [String])
}

public struct TargetSettingsError: Error, Sendable, Equatable, CustomStringConvertible {
    public var message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}
