public import HTTPExchange
import Foundation
import Ledger
public import Invalidation
public import Logging
import Pipeline
import Redis
import SecurityEvents
import TokenVerification

/// The `targets`, `token-stores`, `subjects` and `policy` sections: what Warden acts on and how.
public struct InvalidationConfiguration: Sendable {
    public var targets: [String: TargetSettings]
    public var tokenStores: [String: TokenStoreSettings]
    public var subjects: SubjectResolverSettings
    /// The built-in policy with the configured entries replacing whole event types, keeping
    /// only rules whose targets and stores exist.
    public var policy: Policy
    /// Built-in rules left out because their target or store is not configured.
    public var leftOut: [(eventType: String, rule: PolicyRule)]
    /// A digest of every certificate and key file the targets name, by path, taken when the
    /// configuration is read: a reload notices a file replaced in place under the same name.
    public var targetFileDigests: [String: String] = [:]

    /// `issuers`: the configured issuers. With several, every text that names a subject
    /// (`{sub}`, `{email}`, `{phone}`, `{sid}`) must name its issuer (`{iss}`) too, and
    /// `identity` is refused when a step uses the user: a subject is always scoped to the issuer
    /// that signed the token, and two issuers may give one `sub` to different people.
    static func parse(_ root: ConfigReader, issuers: [String]) throws(ConfigError) -> InvalidationConfiguration {
        let scope = SubjectScope(issuers: issuers)
        var targets: [String: TargetSettings] = [:]
        let targetsReader = root.child("targets")
        for name in try targetsReader.keys() { targets[name] = try target(targetsReader.child(name)) }

        var stores: [String: TokenStoreSettings] = [:]
        let storesReader = root.child("token-stores")
        for name in try storesReader.keys() {
            let r = storesReader.child(name)
            try r.requireOnly(["redis", "hash", "index"])
            let target = try r.child("redis").requiredString()
            guard case .redis? = targets[target] else {
                throw r.child("redis").error("\"\(target)\" is not a redis target in targets:")
            }
            let hash = try r.child("hash").string() ?? "oauth-tokens:{user}"
            try placeholders(hash, r.child("hash"))
            guard TokenStoreSettings.isHashTemplate(hash) else {
                throw r.child("hash").error("a token store keeps one hash per user: the key must hold {user} once and no other placeholder")
            }
            stores[name] = TokenStoreSettings(redisTarget: target, hash: hash, index: try r.child("index").string())
        }

        let subjects = try resolver(root.child("subjects"), targets: targets, scope: scope)

        var overrides: [String: [PolicyRule]] = [:]
        /// The policy key that configured each event type: a second key naming it (a short
        /// name and the full URI, or two short names of one type) would silently replace it.
        var configuredBy: [String: String] = [:]
        let policyReader = root.child("policy")
        for key in try policyReader.keys() {
            let r = policyReader.child(key)
            let definitions = EventCatalog.definitions(named: key)
            let uris = definitions.isEmpty ? (key.contains("://") ? [key] : []) : Set(definitions.map(\.canonicalURI)).sorted()
            guard !uris.isEmpty else {
                throw r.error("unknown event type (use a short name such as sessions-revoked, or the full event-type URI)")
            }
            var rules: [PolicyRule] = []
            for item in try r.list() { rules.append(try rule(item, targets: targets, stores: stores, scope: scope)) }
            for uri in uris {
                if let other = configuredBy[uri] {
                    throw r.error("configures the same event type as policy.\(other) (\(uri)): give its steps in one place")
                }
                configuredBy[uri] = key
                overrides[uri] = rules
            }
        }

        // The configured entries are checked above; the built-in ones keep what can run here.
        var conventional = Set<String>()
        if case .redis? = targets[Policy.sessionsTarget] { conventional.insert(Policy.sessionsTarget) }
        if case .webhook? = targets[Policy.appTarget] { conventional.insert(Policy.appTarget) }
        let builtIn = Policy.builtIn(severalIssuers: scope.severalIssuers).keepingOnly(targets: conventional, stores: Set(stores.keys))
        let policy = builtIn.0.overridden(by: overrides)
        let leftOut = builtIn.1.filter { overrides[$0.0] == nil }.map { (eventType: $0.0, rule: $0.1) }
        if scope.severalIssuers, subjects == .identity,
           let (type, rule) = policy.rules.sorted(by: { $0.key < $1.key }).lazy
               .compactMap({ entry in entry.value.first(where: \.action.usesUser).map { (entry.key, $0) } }).first
        {
            throw root.child("subjects").child("resolve").error(
                "identity (the default) takes each issuer's sub as the local user id, and with several issuers one issuer's sub "
                + "could name another's user (\(Self.shortName(type)): \(Self.describe(rule.action)) acts on it): resolve with "
                + "{redis: …, key: \"…{iss}…{sub}…\"} or {sql: …} with {iss} among its parameters")
        }
        return InvalidationConfiguration(targets: targets, tokenStores: stores, subjects: subjects, policy: policy,
                                         leftOut: leftOut, targetFileDigests: fileDigests(targets))
    }

    /// A digest of each certificate and key file the targets name, by path.
    static func fileDigests(_ targets: [String: TargetSettings]) -> [String: String] {
        let paths = targets.values.flatMap(certificateFiles(of:))
        var digests: [String: String] = [:]
        for path in paths {
            digests[path] = FileManager.default.contents(atPath: path).map { AuditChain.sha256Hex([UInt8]($0)) }
                ?? "unreadable"
        }
        return digests
    }

    /// The certificate and key files a target names: Redis TLS files, and a PostgreSQL URL's
    /// `sslrootcert`, `sslcert` and `sslkey`.
    static func certificateFiles(of target: TargetSettings) -> [String] {
        switch target {
        case .redis(let settings):
            guard let tls = settings.tls else { return [] }
            return [tls.caFile, tls.certificateFile, tls.keyFile].compactMap { $0 }
        case .sql(let location):
            return (URLComponents(string: location)?.queryItems ?? [])
                .filter { ["sslrootcert", "sslcert", "sslkey"].contains($0.name) && $0.value != "system" }.compactMap(\.value)
        case .revoke, .webhook:
            return []
        }
    }

    static func target(_ r: ConfigReader) throws(ConfigError) -> TargetSettings {
        let kinds = ["redis", "revoke", "webhook", "sql"]
        // TLS files may sit beside `redis: URL` (targets: {sessions: {redis: "rediss://…", ca-file: …}}).
        let keys = try r.keys().filter { !(r.child("redis").isPresent && redisTLSKeys.contains($0)) }
        guard keys.count == 1, let kind = keys.first, kinds.contains(kind) else {
            try r.requireOnly(kinds + (r.child("redis").isPresent ? redisTLSKeys : []))
            throw r.error("a target is exactly one of: \(kinds.joined(separator: ", "))")
        }
        let c = r.child(kind)
        switch kind {
        case "redis":
            // `redis: URL` or `redis: {url, password(-file), pool-size, timeout}`; TLS files beside
            // the URL in either form.
            var endpoint: RedisConnectionSettings
            if case .map = c.tree {
                try c.requireOnly(["url", "password", "password-file", "pool-size", "timeout"] + redisTLSKeys)
                endpoint = try redisURL(c.child("url"))
                try redisTLS(c, &endpoint)
                if let password = try c.secret("password") {
                    // As for the ledger: one of them would be dropped without a word.
                    guard endpoint.password == nil else { throw c.child("url").error("gives a password too: give it in one place") }
                    endpoint.password = password
                }
                if let size = try c.child("pool-size").string() {
                    guard let n = Int(size), n > 0, n <= 64 else { throw c.child("pool-size").error("must be 1 to 64") }
                    endpoint.poolSize = n
                }
                if let timeout = try WardenConfiguration.positive(c.child("timeout")) { endpoint.timeout = timeout }
            } else {
                endpoint = try redisURL(c)
            }
            try redisTLS(r, &endpoint)
            return .redis(endpoint)
        case "revoke":
            try c.requireOnly(["endpoint", "auth", "client-id", "client-secret", "client-secret-file", "timeout"])
            let url = try WardenConfiguration.url(c.child("endpoint"))
            let auth = try c.child("auth").string() ?? "none"
            let clientID = try c.child("client-id").string()
            let secret = try c.secret("client-secret")
            let authentication: RevocationEndpoint.ClientAuthentication
            switch auth {
            case "none":
                if secret != nil { throw c.child("client-secret").error("a client secret needs auth client_secret_basic or client_secret_post") }
                authentication = .none(clientID: clientID)
            case "client_secret_basic", "client_secret_post":
                guard let clientID else { throw c.child("client-id").error("is required with auth \(auth)") }
                guard let secret else { throw c.child("client-secret-file").error("is required with auth \(auth)") }
                authentication = auth == "client_secret_basic" ? .clientSecretBasic(clientID: clientID, secret: secret)
                    : .clientSecretPost(clientID: clientID, secret: secret)
            default:
                throw c.child("auth").error("\"\(auth)\" is not one of none, client_secret_basic, client_secret_post")
            }
            return .revoke(RevocationEndpoint(url: url, authentication: authentication,
                                              timeout: try WardenConfiguration.positive(c.child("timeout")) ?? 10))
        case "webhook":
            try c.requireOnly(["url", "hmac-secret", "hmac-secret-file", "timeout"])
            let url = try WardenConfiguration.url(c.child("url"), plainHTTP: true)
            guard let secret = try c.secret("hmac-secret") else { throw c.child("hmac-secret-file").error("is required") }
            return .webhook(WebhookEndpoint(url: url, hmacSecret: Array(secret.utf8),
                                            timeout: try WardenConfiguration.positive(c.child("timeout")) ?? 10))
        default:
            // `sql: URL` or `sql: {url, password(-file)}` (PostgreSQL's password from a file).
            var location: String
            if case .map = c.tree {
                try c.requireOnly(["url", "password", "password-file"])
                location = try c.child("url").requiredString()
                if let password = try c.secret("password") {
                    guard location.hasPrefix("postgres"), var components = URLComponents(string: location), components.password == nil else {
                        throw c.child("url").error("a password from password(-file) needs a postgres:// URL without one")
                    }
                    components.password = password
                    location = components.string ?? location
                }
            } else {
                location = try c.requiredString()
            }
            guard location.hasPrefix("sqlite:") || location.hasPrefix("postgres://") || location.hasPrefix("postgresql://") else {
                throw c.error("expected sqlite:PATH or postgres://user[:password]@host[:port]/database")
            }
            if case .failure(let error) = PostgresLedger.Location.parse(location), !location.hasPrefix("sqlite:") {
                throw c.error(error.message)
            }
            if location.hasPrefix("sqlite:"), !location.dropFirst("sqlite:".count).hasPrefix("/") {
                let relative = String(location.dropFirst("sqlite:".count))
                return .sql("sqlite:" + c.baseDirectory.appendingPathComponent(relative).standardizedFileURL.path)
            }
            return .sql(location)
        }
    }

    static let redisTLSKeys = ["ca-file", "cert-file", "key-file"]

    /// `ca-file`, `cert-file`, `key-file` in `r` (paths relative to the configuration file),
    /// for a `rediss://` URL only; a certificate needs its key and the files must be readable.
    static func redisTLS(_ r: ConfigReader, _ endpoint: inout RedisConnectionSettings) throws(ConfigError) {
        var files: [String: String] = [:]
        for key in redisTLSKeys {
            let c = r.child(key)
            guard let name = try c.string() else { continue }
            let path = name.hasPrefix("/") ? name : r.baseDirectory.appendingPathComponent(name).standardizedFileURL.path
            guard FileManager.default.isReadableFile(atPath: path) else { throw c.error("cannot read the file \(path)") }
            guard endpoint.tls != nil else { throw c.error("needs a rediss:// URL (TLS); redis:// is plain TCP") }
            files[key] = path
        }
        if (files["cert-file"] == nil) != (files["key-file"] == nil) {
            throw r.child(files["cert-file"] == nil ? "cert-file" : "key-file").error("is required with \(files["cert-file"] == nil ? "key-file" : "cert-file")")
        }
        if endpoint.tls != nil, !files.isEmpty {
            endpoint.tls = RedisTLSSettings(caFile: files["ca-file"], certificateFile: files["cert-file"], keyFile: files["key-file"])
            // Loaded now: a file that is no PEM (a truncated renewal) is refused at start, by
            // check-config and by a reload, not found by every step once running.
            if let problem = RedisClient.tlsProblem(endpoint) { throw r.error(problem) }
        }
    }

    static func redisURL(_ r: ConfigReader) throws(ConfigError) -> RedisConnectionSettings {
        let text = try r.requiredString()
        switch RedisConnectionSettings.parse(text) {
        case .success(let endpoint): return endpoint
        case .failure(let error): throw r.error(error.message)
        }
    }

    static func resolver(_ r: ConfigReader, targets: [String: TargetSettings], scope: SubjectScope) throws(ConfigError) -> SubjectResolverSettings {
        try r.requireOnly(["resolve"])
        let c = r.child("resolve")
        if !c.isPresent { return .identity }
        if case .scalar = c.tree {
            guard try c.string() == "identity" else { throw c.error("expected identity, {redis: …} or {sql: …}") }
            return .identity
        }
        try c.requireOnly(["redis", "sql", "target", "key", "parameters"])
        if c.child("redis").isPresent {
            let target = try c.child("redis").requiredString()
            guard case .redis? = targets[target] else { throw c.child("redis").error("\"\(target)\" is not a redis target in targets:") }
            let key = try c.child("key").requiredString()
            try placeholders(key, c.child("key"), allowUser: false)
            try scope.check([key], c.child("key"))
            return .redis(target: target, key: key)
        }
        let query = try c.child("sql").requiredString()
        let target = try c.child("target").requiredString()
        guard case .sql? = targets[target] else { throw c.child("target").error("\"\(target)\" is not a sql target in targets:") }
        let parameters = try c.child("parameters").stringList() ?? ["{sub}"]
        for (i, parameter) in parameters.enumerated() {
            try placeholders(parameter, c.child("parameters").child(String(i)), allowUser: false)
        }
        try scope.check(parameters, c.child("parameters"))
        return .sql(target: target, query: query, parameters: parameters)
    }

    static func rule(_ r: ConfigReader, targets: [String: TargetSettings], stores: [String: TokenStoreSettings],
                     scope: SubjectScope) throws(ConfigError) -> PolicyRule
    {
        try r.requireOnly(["when"] + StepAction.kinds)
        let kinds = try r.keys().filter { $0 != "when" }
        guard kinds.count == 1, let kind = kinds.first else {
            throw r.error("each policy entry is one step: \(StepAction.kinds.joined(separator: ", ")), with an optional when:")
        }
        var when: Condition? = nil
        let w = r.child("when")
        if w.isPresent {
            var claims: [(name: String, match: Condition.Match)] = []
            for name in try w.keys() {
                let values = try w.child(name).stringList() ?? []
                if values == ["none"] { claims.append((name, .absent)) }
                else if values == ["any"] { claims.append((name, .present)) }
                else if values.isEmpty { throw w.child(name).error("expected a value, a list of values, none or any") }
                else { claims.append((name, .oneOf(values))) }
            }
            when = Condition(claims)
        }
        let s = r.child(kind)
        func target(_ expected: String) throws(ConfigError) -> String {
            let name = try s.child("target").requiredString()
            guard let settings = targets[name] else { throw s.child("target").error("no target named \"\(name)\" in targets:") }
            guard settings.kind == expected else {
                throw s.child("target").error("\(kind) needs a \(expected) target; \"\(name)\" is \(settings.kind)")
            }
            return name
        }
        func store() throws(ConfigError) -> String {
            let name = try s.child("store").requiredString()
            guard stores[name] != nil else { throw s.child("store").error("no token store named \"\(name)\" in token-stores:") }
            return name
        }
        func template(_ key: String) throws(ConfigError) -> String {
            let text = try s.child(key).requiredString()
            try placeholders(text, s.child(key))
            return text
        }
        let action: StepAction
        switch kind {
        case "purge-set":
            try s.requireOnly(["target", "set"])
            action = .purgeSet(target: try target("redis"), set: try template("set"))
        case "purge-keys":
            try s.requireOnly(["target", "keys"])
            let keys = try s.child("keys").stringList() ?? []
            guard !keys.isEmpty else { throw s.child("keys").error("list at least one key") }
            for (i, key) in keys.enumerated() { try placeholders(key, s.child("keys").child(String(i))) }
            action = .purgeKeys(target: try target("redis"), keys: keys)
        case "purge-pattern":
            try s.requireOnly(["target", "pattern"])
            let pattern = try template("pattern")
            guard pattern.contains("{") else {
                throw s.child("pattern").error("a pattern without a placeholder would purge the same keys for every event")
            }
            action = .purgePattern(target: try target("redis"), pattern: pattern)
        case "set-flag":
            try s.requireOnly(["target", "key", "value", "ttl"])
            let value = try s.child("value").string() ?? "1"
            try placeholders(value, s.child("value"))
            action = .setFlag(target: try target("redis"), key: try template("key"), value: value,
                              ttl: try WardenConfiguration.positive(s.child("ttl")))
        case "delete-token":
            try s.requireOnly(["store"])
            action = .deleteToken(store: try store())
        case "delete-tokens":
            try s.requireOnly(["store"])
            action = .deleteTokens(store: try store())
        case "revoke-tokens":
            try s.requireOnly(["store", "target", "token-type-hint"])
            let hint = try s.child("token-type-hint").string()
            if let hint, !["access_token", "refresh_token"].contains(hint) {
                throw s.child("token-type-hint").error("expected access_token or refresh_token")
            }
            action = .revokeTokens(store: try store(), target: try target("revoke"), tokenTypeHint: hint)
        case "notify":
            try s.requireOnly(["target"])
            action = .notify(target: try target("webhook"))
        default:
            try s.requireOnly(["target", "statement", "parameters"])
            let parameters = try s.child("parameters").stringList() ?? []
            for (i, parameter) in parameters.enumerated() { try placeholders(parameter, s.child("parameters").child(String(i))) }
            action = .sql(target: try target("sql"), statement: try s.child("statement").requiredString(), parameters: parameters)
        }
        // What names whose keys or rows a step touches: each Redis key on its own, a statement's
        // parameters together. A flag's value and a webhook's body are data, not a selector.
        let selectors: [[String]] = switch action {
        case .purgeSet(_, let set): [[set]]
        case .purgeKeys(_, let keys): keys.map { [$0] }
        case .purgePattern(_, let pattern): [[pattern]]
        case .setFlag(_, let key, _, _): [[key]]
        case .sql(_, _, let parameters): [parameters]
        case .deleteToken, .deleteTokens, .revokeTokens, .notify: []
        }
        for texts in selectors { try scope.check(texts, s) }
        return PolicyRule(when: when, action)
    }

    /// Whether texts naming a subject must name its issuer too.
    struct SubjectScope {
        var issuers: [String]
        var severalIssuers: Bool { issuers.count > 1 }

        /// Refuses, with several issuers, texts that together name a subject but not its issuer,
        /// and a text that names both without a separator no issuer holds: in
        /// `u:{iss}{sub}`, issuer `https://kc/realms/a` with subject `b1` would be issuer
        /// `https://kc/realms/ab` with subject `1`.
        func check(_ texts: [String], _ r: ConfigReader) throws(ConfigError) {
            guard severalIssuers else { return }
            if let name = Planner.unscopedSubjectPlaceholder(in: texts) {
                throw r.error("{\(name)} names a subject without its issuer: with several issuers, two may give one {\(name)} "
                    + "to different people, so name {iss} too")
            }
            for text in texts where Planner.placeholderNames(in: text).contains(where: Planner.subjectPlaceholders.contains) {
                var rest = text[...]
                while let range = rest.range(of: "{iss}") {
                    let separator = range.upperBound < rest.endIndex ? rest[range.upperBound]
                        : range.lowerBound > text.startIndex ? text[text.index(before: range.lowerBound)] : nil
                    if separator == nil || separator == "{" || separator == "}" || issuers.contains(where: { $0.contains(separator!) }) {
                        throw r.error("{iss} must be followed by a character no issuer holds (such as |), as in \"user:{iss}|{sub}\": "
                            + "otherwise one issuer's name and subject can spell another's")
                    }
                    rest = rest[range.upperBound...]
                }
            }
        }
    }

    /// Refuses unknown placeholders (and `{user}` where no user is known yet).
    static func placeholders(_ text: String, _ r: ConfigReader, allowUser: Bool = true) throws(ConfigError) {
        for name in Planner.placeholderNames(in: text) {
            guard Planner.placeholders.contains(name), allowUser || name != "user" else {
                let known = Planner.placeholders.subtracting(allowUser ? [] : ["user"]).sorted().map { "{\($0)}" }
                throw r.error("unknown placeholder {\(name)} (known: \(known.joined(separator: ", ")))")
            }
        }
    }
}

extension InvalidationConfiguration {
    /// The plan text `warden check-config` prints: each event type's steps, in order.
    public var planDescription: String {
        var lines: [String] = []
        for (uri, rules) in policy.rules.sorted(by: { Self.shortName($0.key) < Self.shortName($1.key) }) {
            lines.append("  \(Self.shortName(uri))")
            if rules.isEmpty {
                let needsTargets = leftOut.contains { $0.eventType == uri }
                lines.append(needsTargets ? "    (recorded; no steps: the built-in ones need targets not configured, see below)"
                    : "    (recorded; no steps)")
            }
            for (i, rule) in rules.enumerated() {
                lines.append("    \(i + 1). \(Self.describe(rule.action))\(rule.when.map { "  when \($0.description)" } ?? "")")
            }
        }
        lines.append("  any other event type: recorded, no steps, counted as unknown")
        return lines.joined(separator: "\n")
    }

    /// `risc:sessions-revoked`, `caep:session-revoked`, …; the URI when no prefix is known.
    static func shortName(_ uri: String) -> String {
        let prefixes = [("risc", EventURIPrefix.risc), ("oauth", EventURIPrefix.oauth), ("caep", EventURIPrefix.caep),
                        ("ssf", EventURIPrefix.ssf)]
        for (name, prefix) in prefixes where uri.hasPrefix(prefix) { return name + ":" + uri.dropFirst(prefix.count) }
        if uri == EventURIPrefix.backchannelLogout { return "backchannel-logout" }
        return uri
    }

    static func describe(_ action: StepAction) -> String {
        switch action {
        case .purgeSet(let t, let set): "purge-set \(set) on \(t)"
        case .purgeKeys(let t, let keys): "purge-keys \(keys.joined(separator: " ")) on \(t)"
        case .purgePattern(let t, let pattern): "purge-pattern \(pattern) on \(t)"
        case .setFlag(let t, let key, let value, let ttl): "set-flag \(key)=\(value)\(ttl.map { " ttl \(Int($0))s" } ?? "") on \(t)"
        case .deleteToken(let store): "delete-token (the token the event names) from store \(store)"
        case .deleteTokens(let store, _): "delete-tokens (every token held for {user}) from store \(store)"
        case .revokeTokens(let store, let t, let hint, _):
            "revoke-tokens held in store \(store) at \(t)\(hint.map { " (hint \($0))" } ?? ""), then delete them"
        case .notify(let t, _): "notify \(t)"
        case .sql(let t, let statement, let parameters): "sql on \(t): \(statement) [\(parameters.joined(separator: ", "))]"
        }
    }
}

extension InvalidationConfiguration {
    /// Connections to the configured targets: the subject resolver and the step executor, the
    /// PostgreSQL pools to run while they are used, and what closes the Redis clients.
    public func makeTargets(http: any HTTPExchanging, logger: Logger) throws(ConfigError) -> ReloadableTargets.Generation {
        var clients: [String: RedisClient] = [:]
        for (name, target) in targets {
            guard case .redis(let settings) = target else { continue }
            clients[name] = RedisClient(settings: settings)
        }
        var databases: [String: SQLTarget] = [:]
        for (name, target) in targets {
            guard case .sql(let location) = target else { continue }
            do {
                databases[name] = try SQLTarget(location: location, logger: logger)
            } catch {
                throw ConfigError(path: "targets.\(name).sql", error.message)
            }
        }
        let resolver: any SubjectResolver
        switch subjects {
        case .identity: resolver = IdentityResolver()
        case .redis(let target, let key): resolver = RedisResolver(client: clients[target]!, key: key)
        case .sql(let target, let query, let parameters):
            resolver = SQLResolver(target: databases[target]!, query: query, parameters: parameters)
        }
        let executor = TargetExecutor(redis: RedisStepExecutor(clients: clients, stores: tokenStores),
                                      revocation: RevocationClient(http: http), webhooks: WebhookNotifier(http: http),
                                      sql: SQLStepExecutor(targets: databases), targets: targets)
        return ReloadableTargets.Generation(
            resolver: resolver, executor: executor,
            pools: databases.values.map { database in { await database.run() } },
            close: { [clients = Array(clients.values)] in clients.forEach { $0.close() } })
    }

    /// Whether a running worker can take `fresh` targets in place of these: every target keeps
    /// its name and kind and every token store its name, so steps already planned still name
    /// targets that can run them. Settings and credentials may differ.
    public func canReloadTargets(as fresh: InvalidationConfiguration) -> Bool {
        targets.mapValues(\.kind) == fresh.targets.mapValues(\.kind) && Set(tokenStores.keys) == Set(fresh.tokenStores.keys)
    }
}
