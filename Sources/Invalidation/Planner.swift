import Synchronization
public import SecurityEvents

/// A step ready to run: every placeholder filled.
public struct PlannedStep: Sendable, Hashable, Codable {
    /// Position in the event's plan (0-based); with the event id it names the step in the outbox.
    public var index: Int
    /// The event type (canonical URI) whose rule produced the step.
    public var eventType: String
    public var action: StepAction

    public init(index: Int, eventType: String, action: StepAction) {
        self.index = index
        self.eventType = eventType
        self.action = action
    }
}

/// A rule that applied but could not become a step.
public struct SkippedStep: Sendable, Hashable {
    public enum Reason: Error, Sendable, Hashable {
        /// The rule needs the local user and the subject did not resolve to one.
        case unresolvedSubject
        /// The rule names a value the event does not carry (`{email}` for an `iss_sub` subject).
        case missingValue(String)
    }

    public var eventType: String
    public var action: StepAction
    public var reason: Reason
}

/// What the planner made of one verified token.
public struct Plan: Sendable, Hashable {
    public var steps: [PlannedStep]
    public var skipped: [SkippedStep]
    /// Event types the policy has no entry for: recorded, no steps, counted.
    public var unknownTypes: [EventType]

    /// True when a rule could not run because the subject names no local user.
    public var isUnresolved: Bool { skipped.contains { $0.reason == .unresolvedSubject } }
}

/// The local user a provider subject stands for, when one was found.
public enum SubjectResolution: Sendable, Hashable {
    case user(String)
    case unresolved
}

/// Turns a verified token into steps: pure, no I/O. For each event in the token, the policy's
/// rules for its type apply in order; a rule with a `when` applies only if it matches. Every
/// placeholder is filled from the event, its subject and the resolved user.
///
/// Copies share one policy, which `replace` swaps for all of them (SIGHUP): events planned
/// after the swap follow the new policy; an event already planned keeps its steps.
public struct Planner: Sendable {
    private final class Current: Sendable {
        let policy: Mutex<Policy>
        init(_ policy: Policy) { self.policy = Mutex(policy) }
    }
    private let current: Current

    public var policy: Policy { current.policy.withLock { $0 } }

    public init(policy: Policy) { self.current = Current(policy) }

    /// Plans from now on follow `policy`.
    public func replace(_ policy: Policy) {
        current.policy.withLock { $0 = policy }
    }

    /// Placeholders a template may use.
    public static let placeholders: Set<String> = ["user", "sub", "iss", "email", "phone", "sid", "jti", "event", "reason"]

    /// Placeholders whose value is an issuer's name for the subject: two issuers may give one
    /// value to different people, so with several issuers a text naming one must name `{iss}` too.
    public static let subjectPlaceholders: Set<String> = ["sub", "email", "phone", "sid"]

    /// The first subject placeholder in `texts` when none of them holds `{iss}`: taken together
    /// (one SQL statement's parameters, one step), they would name a subject of any issuer.
    public static func unscopedSubjectPlaceholder(in texts: [String]) -> String? {
        let names = texts.flatMap(placeholderNames(in:))
        guard !names.contains("iss") else { return nil }
        return names.first(where: subjectPlaceholders.contains)
    }

    /// The placeholder names in `template` (`{user}` → `user`), in order; unbalanced braces are
    /// reported as a name that is never valid.
    public static func placeholderNames(in template: String) -> [String] {
        var names: [String] = []
        var rest = template[...]
        while let open = rest.firstIndex(of: "{") {
            guard let close = rest[open...].firstIndex(of: "}") else {
                names.append(String(rest[open...]))
                break
            }
            names.append(String(rest[rest.index(after: open)..<close]))
            rest = rest[rest.index(after: close)...]
        }
        return names
    }

    public func plan(_ token: SecurityEventToken, subject resolution: SubjectResolution) -> Plan {
        var plan = Plan(steps: [], skipped: [], unknownTypes: [])
        let policy = self.policy
        for event in token.events {
            guard let rules = policy.rules(for: event.type) else {
                plan.unknownTypes.append(event.type)
                continue
            }
            // The placeholder values are gathered only for an event with rules to fill.
            guard !rules.isEmpty else { continue }
            let values = Self.values(for: event, in: token, resolution: resolution)
            for rule in rules where rule.when?.matches(event, in: token) ?? true {
                let type = Policy.key(for: event.type)
                switch Self.fill(rule.action, values: values) {
                case .success(let action):
                    plan.steps.append(PlannedStep(index: plan.steps.count, eventType: type, action: action))
                case .failure(let reason):
                    plan.skipped.append(SkippedStep(eventType: type, action: rule.action, reason: reason))
                }
            }
        }
        return plan
    }

    /// The values placeholders stand for in one event.
    static func values(for event: SecurityEvent, in token: SecurityEventToken,
                       resolution: SubjectResolution) -> [String: String] {
        // {iss} is always the issuer that signed the token: a subject's own "iss" member never
        // replaces it, so issuer A cannot name a key of issuer B's users.
        var values: [String: String] = ["jti": token.jti, "event": event.type.name, "iss": token.issuer]
        if case .user(let user) = resolution { values["user"] = user }
        if let reason = event.reason { values["reason"] = reason }
        let subject = event.subject ?? token.primarySubject
        if let sub = Self.scopedSubject(subject, in: token) { values["sub"] = sub }
        if let subject {
            for simple in subject.simpleIdentifiers {
                switch simple {
                case .email(let email): values["email"] = values["email"] ?? email
                case .phoneNumber(let phone): values["phone"] = values["phone"] ?? phone
                case .idTokenClaims(_, _, let email?): values["email"] = values["email"] ?? email
                default: break
                }
            }
            if case .complex(let members) = subject, case .opaque(let id)? = members[.session] { values["sid"] = id }
        }
        if let sid = token.claims["sid"]?.stringValue { values["sid"] = sid }
        return values
    }

    /// The `sub` the token's signer vouches for: an `iss_sub` subject's `sub` when its `iss` is
    /// the signer, else the token's own `sub` claim. A subject of another issuer gives none: an
    /// account is always scoped to the issuer that signed the token.
    public static func scopedSubject(_ subject: SubjectIdentifier?, in token: SecurityEventToken) -> String? {
        if let (iss, sub) = subject?.issuerSubject { return sameName(iss, token.issuer) ? sub : nil }
        return token.subject
    }

    /// The action with its placeholders filled, or why it cannot be.
    static func fill(_ action: StepAction, values: [String: String]) -> Result<StepAction, SkippedStep.Reason> {
        // Steps on a user's token store need the user even though they hold no template, and
        // keep the one they were planned for.
        switch action {
        case .deleteTokens(let store, _):
            guard let user = values["user"], !user.isEmpty else { return .failure(.unresolvedSubject) }
            return .success(.deleteTokens(store: store, user: user))
        case .revokeTokens(let store, let target, let hint, _):
            guard let user = values["user"], !user.isEmpty else { return .failure(.unresolvedSubject) }
            return .success(.revokeTokens(store: store, target: target, tokenTypeHint: hint, user: user))
        default: break
        }
        do throws(SkippedStep.Reason) {
            func text(_ template: String, glob: Bool = false) throws(SkippedStep.Reason) -> String {
                try substitute(template, values: values, escapeGlob: glob)
            }
            switch action {
            case .purgeSet(let target, let set): return .success(.purgeSet(target: target, set: try text(set)))
            case .purgeKeys(let target, let keys):
                var filled: [String] = []
                for key in keys { filled.append(try text(key)) }
                return .success(.purgeKeys(target: target, keys: filled))
            case .purgePattern(let target, let pattern):
                return .success(.purgePattern(target: target, pattern: try text(pattern, glob: true)))
            case .setFlag(let target, let key, let value, let ttl):
                return .success(.setFlag(target: target, key: try text(key), value: try text(value), ttl: ttl))
            case .sql(let target, let statement, let parameters):
                var filled: [String] = []
                for parameter in parameters { filled.append(try text(parameter)) }
                return .success(.sql(target: target, statement: statement, parameters: filled))
            case .notify(let target, _):
                return .success(.notify(target: target, user: values["user"].flatMap { $0.isEmpty ? nil : $0 }))
            case .deleteToken, .deleteTokens, .revokeTokens:
                return .success(action)
            }
        } catch {
            return .failure(error)
        }
    }

    /// Replaces each `{name}` with its value. Inside a glob pattern, a value's own `*?[]\` are
    /// escaped, so a subject cannot widen what a pattern matches.
    static func substitute(_ template: String, values: [String: String], escapeGlob: Bool) throws(SkippedStep.Reason) -> String {
        // On UTF-8 bytes: `{`, `}` and the glob's special characters are ASCII, and in UTF-8 an
        // ASCII byte is never part of another character's encoding.
        let open = UInt8(ascii: "{"), close = UInt8(ascii: "}")
        let bytes = Array(template.utf8)
        guard bytes.contains(open) else { return template }
        var out: [UInt8] = []
        out.reserveCapacity(bytes.count + 32)
        var i = 0
        while i < bytes.count {
            guard bytes[i] == open, let end = bytes[(i + 1)...].firstIndex(of: close) else {
                out.append(bytes[i])
                i += 1
                continue
            }
            let name = String(decoding: bytes[(i + 1)..<end], as: UTF8.self)
            // An empty value is no value: `sess:{sub}*` filled with "" would name every user's
            // sessions. The step is skipped as missing it.
            guard let value = values[name], !value.isEmpty else {
                throw name == "user" ? .unresolvedSubject : .missingValue(name)
            }
            if escapeGlob { appendGlobEscaped(value, to: &out) } else { out += value.utf8 }
            i = end + 1
        }
        return String(decoding: out, as: UTF8.self)
    }

    /// `value` with a backslash before each of its `*?[]\` bytes. Redis matches patterns byte by
    /// byte, so the escaping is too: a `*` followed by a combining mark is one character to
    /// Swift, but still a wildcard to Redis.
    static func globEscaped(_ value: String) -> String {
        var out: [UInt8] = []
        out.reserveCapacity(value.utf8.count + 4)
        appendGlobEscaped(value, to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    private static func appendGlobEscaped(_ value: String, to out: inout [UInt8]) {
        for byte in value.utf8 {
            switch byte {
            case UInt8(ascii: "*"), UInt8(ascii: "?"), UInt8(ascii: "["), UInt8(ascii: "]"), UInt8(ascii: "\\"):
                out.append(UInt8(ascii: "\\"))
            default: break
            }
            out.append(byte)
        }
    }
}

extension SubjectIdentifier {
    /// The simple identifiers inside this one: itself, an alias list's members, a complex
    /// subject's members.
    var simpleIdentifiers: [SubjectIdentifier] {
        switch self {
        case .aliases(let list): list.flatMap(\.simpleIdentifiers)
        case .complex(let members): members.sorted { $0.key < $1.key }.flatMap(\.value.simpleIdentifiers)
        default: [self]
        }
    }
}
