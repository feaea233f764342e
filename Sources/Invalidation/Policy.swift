public import SecurityEvents

/// What one step does, with its text still holding placeholders (`{user}`, `{sub}`, …) that the
/// planner fills from the event and the resolved subject.
public enum StepAction: Sendable, Hashable, Codable {
    /// Deletes every key listed in the Redis set, then the set.
    case purgeSet(target: String, set: String)
    /// Deletes the listed keys.
    case purgeKeys(target: String, keys: [String])
    /// Deletes every key matching a glob pattern (SCAN + UNLINK, never KEYS).
    case purgePattern(target: String, pattern: String)
    /// Sets a key (for instance one that blocks sign-in), optionally expiring after `ttl` seconds.
    case setFlag(target: String, key: String, value: String, ttl: Double?)
    /// Deletes the held token the event names (by `prefix` or hash identifier) from a token store.
    case deleteToken(store: String)
    /// Deletes every token a store holds for the user. `user`: the local user the plan was made
    /// for, filled by the planner, so a step run later (redelivered, replayed) acts on that user
    /// even if the subject now resolves to another; nil in a policy rule (and in steps planned
    /// before the user was kept with them, which act on the user the subject resolves to).
    case deleteTokens(store: String, user: String? = nil)
    /// Revokes every token a store holds for the user at an RFC 7009 endpoint, then deletes it.
    /// `user` as for `deleteTokens`.
    case revokeTokens(store: String, target: String, tokenTypeHint: String?, user: String? = nil)
    /// POSTs the normalized event to a webhook target. `user` as for `deleteTokens`: the user the
    /// body names.
    case notify(target: String, user: String? = nil)
    /// Runs a parameterized statement against a SQL target; parameters are placeholder texts.
    case sql(target: String, statement: String, parameters: [String])

    /// The step's kind, as written in the configuration and in metrics (`warden_steps_total{kind}`).
    public var kind: String {
        switch self {
        case .purgeSet: "purge-set"
        case .purgeKeys: "purge-keys"
        case .purgePattern: "purge-pattern"
        case .setFlag: "set-flag"
        case .deleteToken: "delete-token"
        case .deleteTokens: "delete-tokens"
        case .revokeTokens: "revoke-tokens"
        case .notify: "notify"
        case .sql: "sql"
        }
    }

    public static let kinds = ["purge-set", "purge-keys", "purge-pattern", "set-flag", "delete-token", "delete-tokens",
                               "revoke-tokens", "notify", "sql"]

    /// The targets (by name) the step acts on.
    public var targets: [String] {
        switch self {
        case .purgeSet(let t, _), .purgeKeys(let t, _), .purgePattern(let t, _), .setFlag(let t, _, _, _), .notify(let t, _),
             .sql(let t, _, _):
            [t]
        case .revokeTokens(_, let t, _, _): [t]
        case .deleteToken, .deleteTokens: []
        }
    }

    /// The token store (by name) the step reads, if any.
    public var store: String? {
        switch self {
        case .deleteToken(let s), .deleteTokens(let s, _), .revokeTokens(let s, _, _, _): s
        default: nil
        }
    }

    /// The action as `Codable` forms it, as compact JSON text: the case's name, holding its
    /// labelled values (an absent optional left out). Written directly, without a `JSONObject`
    /// between: it is written for every step of every event.
    func write(to out: inout [UInt8]) {
        func strings(_ texts: [String]) -> JSONValue { .array(texts.map { .string($0) }) }
        func optional(_ name: String, _ value: JSONValue?) -> [(String, JSONValue)] { value.map { [(name, $0)] } ?? [] }
        let (name, members): (String, [(String, JSONValue)]) = switch self {
        case .purgeSet(let target, let set): ("purgeSet", [("target", .string(target)), ("set", .string(set))])
        case .purgeKeys(let target, let keys): ("purgeKeys", [("target", .string(target)), ("keys", strings(keys))])
        case .purgePattern(let target, let pattern): ("purgePattern", [("target", .string(target)), ("pattern", .string(pattern))])
        case .setFlag(let target, let key, let value, let ttl):
            ("setFlag", [("target", .string(target)), ("key", .string(key)), ("value", .string(value))]
                + optional("ttl", ttl.map { .number($0) }))
        case .deleteToken(let store): ("deleteToken", [("store", .string(store))])
        case .deleteTokens(let store, let user): ("deleteTokens", [("store", .string(store))] + optional("user", user.map { .string($0) }))
        case .revokeTokens(let store, let target, let hint, let user):
            ("revokeTokens", [("store", .string(store)), ("target", .string(target))] + optional("tokenTypeHint", hint.map { .string($0) })
                + optional("user", user.map { .string($0) }))
        case .notify(let target, let user): ("notify", [("target", .string(target))] + optional("user", user.map { .string($0) }))
        case .sql(let target, let statement, let parameters):
            ("sql", [("target", .string(target)), ("statement", .string(statement)), ("parameters", strings(parameters))])
        }
        out.append(UInt8(ascii: "{"))
        JSONValue.writeString(name, to: &out)
        out += ":{".utf8
        for (i, (key, value)) in members.enumerated() {
            if i > 0 { out.append(UInt8(ascii: ",")) }
            JSONValue.writeString(key, to: &out)
            out.append(UInt8(ascii: ":"))
            value.write(to: &out)
        }
        out += "}}".utf8
    }

    /// Whether the step acts on, or names, the local user the subject resolved to.
    public var usesUser: Bool {
        switch self {
        case .deleteTokens, .revokeTokens, .notify: true
        default: templates.contains { Planner.placeholderNames(in: $0).contains("user") }
        }
    }

    /// Every text that may hold placeholders.
    var templates: [String] {
        switch self {
        case .purgeSet(_, let set): [set]
        case .purgeKeys(_, let keys): keys
        case .purgePattern(_, let pattern): [pattern]
        case .setFlag(_, let key, let value, _): [key, value]
        case .sql(_, _, let parameters): parameters
        case .deleteToken, .deleteTokens, .revokeTokens, .notify: []
        }
    }
}

/// When a rule applies: every listed claim must match. Claims are looked up in the event's
/// payload, then among the token's top-level claims (`sid` of a back-channel logout).
public struct Condition: Sendable, Hashable {
    public enum Match: Sendable, Hashable {
        /// The claim is absent (`reason: none`).
        case absent
        /// The claim is present, whatever its value (`sid: any`).
        case present
        /// The claim is this string (or one of these strings).
        case oneOf([String])
    }

    public var claims: [(name: String, match: Match)]

    public init(_ claims: [(name: String, match: Match)]) { self.claims = claims }

    public static func == (a: Condition, b: Condition) -> Bool {
        a.claims.map(\.name) == b.claims.map(\.name) && a.claims.map(\.match) == b.claims.map(\.match)
    }

    public func hash(into hasher: inout Hasher) {
        for claim in claims {
            hasher.combine(claim.name)
            hasher.combine(claim.match)
        }
    }

    public func matches(_ event: SecurityEvent, in token: SecurityEventToken) -> Bool {
        claims.allSatisfy { claim in
            let value = event.payload[claim.name] ?? token.claims[claim.name]
            switch (claim.match, value) {
            case (.absent, nil), (.absent, .null?): return true
            case (.absent, _): return false
            case (.present, nil), (.present, .null?): return false
            case (.present, _): return true
            case (.oneOf(let allowed), let value?):
                guard let text = value.stringValue else { return false }
                return allowed.contains(text)
            case (.oneOf, nil): return false
            }
        }
    }

    /// `reason: hijacking`, `sid: any`, `reason: none`: for plans and logs.
    public var description: String {
        claims.map { claim in
            switch claim.match {
            case .absent: "\(claim.name): none"
            case .present: "\(claim.name): any"
            case .oneOf(let values): "\(claim.name): \(values.count == 1 ? values[0] : "[" + values.joined(separator: ", ") + "]")"
            }
        }.joined(separator: ", ")
    }
}

/// One entry of a policy: a step, and when it applies (always when `when` is nil).
public struct PolicyRule: Sendable, Hashable {
    public var when: Condition?
    public var action: StepAction

    public init(when: Condition? = nil, _ action: StepAction) {
        self.when = when
        self.action = action
    }
}

/// Event type → ordered rules. Keys are canonical event-type URIs (legacy Google URIs share
/// their canonical type's rules). An event type without an entry gets no steps.
public struct Policy: Sendable, Equatable {
    public var rules: [String: [PolicyRule]]

    public init(rules: [String: [PolicyRule]] = [:]) { self.rules = rules }

    /// The key an event type's rules are kept under.
    public static func key(for type: EventType) -> String { type.canonical?.uri ?? type.uri }

    public func rules(for type: EventType) -> [PolicyRule]? { rules[Self.key(for: type)] }

    /// This policy with `overrides` replacing whole entries: an event type the overrides name
    /// gets only their rules; the others keep these.
    public func overridden(by overrides: [String: [PolicyRule]]) -> Policy {
        Policy(rules: rules.merging(overrides) { $1 })
    }

    /// The same policy without the rules whose target or store is not in `available`: the
    /// built-in default names conventional targets (`sessions`, `app`) and store (`tokens`)
    /// that a deployment may not have. Returns what was left out, for the operator.
    public func keepingOnly(targets available: Set<String>, stores: Set<String>) -> (Policy, [(String, PolicyRule)]) {
        var kept: [String: [PolicyRule]] = [:]
        var dropped: [(String, PolicyRule)] = []
        for (type, list) in rules {
            kept[type] = list.filter { rule in
                let ok = rule.action.targets.allSatisfy(available.contains) && (rule.action.store.map(stores.contains) ?? true)
                if !ok { dropped.append((type, rule)) }
                return ok
            }
        }
        return (Policy(rules: kept), dropped.sorted { $0.0 < $1.0 })
    }
}

extension Policy {
    /// Target and store names the built-in policy uses.
    public static let sessionsTarget = "sessions"
    public static let appTarget = "app"
    public static let tokenStore = "tokens"
    public static let sessionSet = "user-sessions:{user}"
    public static let signInFlag = "signin-disabled:{user}"

    /// What Google's guide requires and suggests for each of its event types (SPEC §1.4), and
    /// sensible defaults for CAEP, RISC 1.0, OAuth and back-channel logout events. Verification
    /// and stream events get no steps (they are recorded as processed).
    public static let builtIn: Policy = builtIn(severalIssuers: false)

    /// The built-in policy for a deployment with one issuer or several. With several, a
    /// back-channel logout's `sid` may be one another issuer also gave (the built-in key
    /// `session:{sid}` does not name the issuer), so a logout ends every session of the user the
    /// signer's subject resolved to: more than the one session, never another issuer's.
    public static func builtIn(severalIssuers: Bool) -> Policy {
        let purgeSessions = StepAction.purgeSet(target: sessionsTarget, set: sessionSet)
        let notify = StepAction.notify(target: appTarget)
        let disableSignIn = StepAction.setFlag(target: sessionsTarget, key: signInFlag, value: "1", ttl: nil)
        let risc = EventURIPrefix.risc, caep = EventURIPrefix.caep, oauth = EventURIPrefix.oauth
        let rules: [String: [PolicyRule]] = [
            // Google: required — end the user's open sessions.
            risc + "sessions-revoked": [PolicyRule(purgeSessions), PolicyRule(notify)],
            caep + "session-revoked": [PolicyRule(purgeSessions), PolicyRule(notify)],
            // Google: required for Sign-in tokens — end sessions; suggested — delete the stored tokens.
            oauth + "tokens-revoked": [PolicyRule(purgeSessions), PolicyRule(.deleteTokens(store: tokenStore)),
                                       PolicyRule(notify)],
            // Google: required — delete the held refresh token the event names.
            oauth + "token-revoked": [PolicyRule(.deleteToken(store: tokenStore)), PolicyRule(notify)],
            // Google: hijacking — required, end sessions; no reason — suggested, disable Google
            // Sign-in; bulk-account — suggested, review (the app is told).
            risc + "account-disabled": [
                PolicyRule(when: Condition([("reason", .oneOf(["hijacking"]))]), purgeSessions),
                PolicyRule(when: Condition([("reason", .absent)]), disableSignIn),
                PolicyRule(notify),
            ],
            // Google: suggested — turn Google Sign-in back on.
            risc + "account-enabled": [PolicyRule(.purgeKeys(target: sessionsTarget, keys: [signInFlag])), PolicyRule(notify)],
            risc + "account-credential-change-required": [PolicyRule(notify)],
            risc + "account-purged": [PolicyRule(purgeSessions), PolicyRule(.deleteTokens(store: tokenStore)),
                                      PolicyRule(notify)],
            risc + "credential-compromise": [PolicyRule(purgeSessions), PolicyRule(notify)],
            risc + "identifier-changed": [PolicyRule(notify)],
            risc + "identifier-recycled": [PolicyRule(purgeSessions), PolicyRule(.deleteTokens(store: tokenStore)),
                                           PolicyRule(notify)],
            risc + "recovery-activated": [PolicyRule(notify)],
            risc + "recovery-information-changed": [PolicyRule(notify)],
            risc + "opt-in": [], risc + "opt-out-initiated": [], risc + "opt-out-cancelled": [], risc + "opt-out-effective": [],
            risc + "verification": [],
            caep + "credential-change": [PolicyRule(notify)],
            caep + "token-claims-change": [PolicyRule(notify)],
            caep + "assurance-level-change": [PolicyRule(notify)],
            caep + "device-compliance-change": [PolicyRule(notify)],
            caep + "risk-level-change": [PolicyRule(notify)],
            caep + "session-established": [],
            caep + "session-presented": [],
            oauth + "token-issued": [],
            oauth + "client-disabled": [PolicyRule(notify)],
            oauth + "client-enabled": [PolicyRule(notify)],
            oauth + "client-credential-changed": [PolicyRule(notify)],
            EventURIPrefix.ssf + "verification": [],
            EventURIPrefix.ssf + "stream-updated": [],
            // Back-channel logout: the session named by `sid`, or without one every session of the user.
            EventURIPrefix.backchannelLogout: severalIssuers ? [PolicyRule(purgeSessions)] : [
                PolicyRule(when: Condition([("sid", .present)]), .purgeKeys(target: sessionsTarget, keys: ["session:{sid}"])),
                PolicyRule(when: Condition([("sid", .absent)]), purgeSessions),
            ],
        ]
        return Policy(rules: rules)
    }
}
