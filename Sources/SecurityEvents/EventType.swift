/// The URI prefixes of the event-type families (SPEC §1–3).
public enum EventURIPrefix {
    public static let risc = "https://schemas.openid.net/secevent/risc/event-type/"
    public static let oauth = "https://schemas.openid.net/secevent/oauth/event-type/"
    public static let caep = "https://schemas.openid.net/secevent/caep/event-type/"
    public static let ssf = "https://schemas.openid.net/secevent/ssf/event-type/"
    /// Event types of SSF's earlier drafts ("SSE").
    public static let sse = "https://schemas.openid.net/secevent/sse/event-type/"
    /// Google's pre-standard URIs, still listed in its live `events_supported` (unconfirmed).
    public static let googleLegacy = "https://accounts.google.com/risc/event/"
    /// OpenID Connect Back-Channel Logout's event member (note: http).
    public static let backchannelLogout = "http://schemas.openid.net/event/backchannel-logout"
}

/// Where an event type is defined.
public enum EventFamily: String, Sendable, Hashable, CaseIterable {
    case risc, caep, oauth, ssf, logout
    /// Google's pre-standard URIs.
    case googleLegacy = "google-legacy"
}

/// The JSON type a claim of an event payload must have.
public enum ClaimType: String, Sendable, Hashable {
    case string, number, object, array
    /// An object mapping language tags to strings (CAEP `reason_admin`, `reason_user`).
    case languageMap = "language-map"

    func accepts(_ value: JSONValue) -> Bool {
        switch (self, value) {
        case (.string, .string), (.number, .number), (.object, .object), (.array, .array): true
        case (.languageMap, .object(let o)): o.allSatisfy { $0.value.stringValue != nil }
        default: false
        }
    }
}

/// One claim an event payload may or must carry.
public struct ClaimRule: Sendable, Hashable {
    public var name: String
    public var type: ClaimType
    public var required: Bool
    /// Values the defining spec lists. Other values are kept (a provider may add reasons), not refused.
    public var knownValues: [String]

    public init(_ name: String, _ type: ClaimType, required: Bool = false, knownValues: [String] = []) {
        self.name = name
        self.type = type
        self.required = required
        self.knownValues = knownValues
    }
}

/// Whether an event's payload carries a `subject` member.
public enum SubjectPlacement: Sendable, Hashable {
    /// The subject is in the payload (Google, RISC, OAuth) or in `sub_id` (SSF); either will do.
    case expected
    /// The payload itself must carry an `oauth_token` subject: the token the event names
    /// (OAuth `token-issued`, `token-revoked`).
    case tokenInEvent
    /// The payload has no subject of its own (verification, stream-updated, logout).
    case none
}

/// What the specifications say about one event type.
public struct EventDefinition: Sendable, Hashable {
    /// The full event-type URI.
    public var uri: String
    /// A short name used in configuration and metrics (`sessions-revoked`).
    public var name: String
    public var family: EventFamily
    /// For alias URIs (Google's legacy names, SSE drafts): the URI of the standard event it stands for.
    public var aliasOf: String?
    public var claims: [ClaimRule]
    public var subject: SubjectPlacement

    /// The URI that policy and planning should treat this event as.
    public var canonicalURI: String { aliasOf ?? uri }
}

/// An event-type URI, known or not.
public struct EventType: Sendable, Hashable, Comparable, CustomStringConvertible {
    public let uri: String
    /// Position in `EventCatalog.all`, looked up once.
    private let catalogIndex: Int?

    public init(_ uri: String) {
        self.uri = uri
        self.catalogIndex = EventCatalog.index(of: uri)
    }

    /// A verification (test) event: RISC's, SSF's, or an old SSE draft's.
    public var isVerification: Bool {
        uri == EventType.riscVerification.uri || uri == EventType.ssfVerification.uri || uri == EventURIPrefix.sse + "verification"
    }

    /// SSF's `stream-updated` (or an old SSE draft's).
    public var isStreamUpdated: Bool { uri == EventType.streamUpdated.uri || uri == EventURIPrefix.sse + "stream-updated" }

    /// The definition, or nil for an event type no spec we implement defines.
    public var definition: EventDefinition? { catalogIndex.map { EventCatalog.all[$0] } }
    public var isKnown: Bool { catalogIndex != nil }

    public static func == (a: EventType, b: EventType) -> Bool { a.uri == b.uri }
    public func hash(into hasher: inout Hasher) { hasher.combine(uri) }
    /// The short name of a known type; the URI itself otherwise.
    public var name: String { definition?.name ?? uri }
    /// The canonical definition (following aliases).
    public var canonical: EventDefinition? {
        guard let definition else { return nil }
        if let alias = definition.aliasOf { return EventCatalog.definition(for: alias) }
        return definition
    }

    public var description: String { uri }
    public static func < (lhs: EventType, rhs: EventType) -> Bool { lhs.uri < rhs.uri }

    // Google's seven (SPEC §1.4).
    public static let sessionsRevoked = EventType(EventURIPrefix.risc + "sessions-revoked")
    public static let tokensRevoked = EventType(EventURIPrefix.oauth + "tokens-revoked")
    public static let tokenRevoked = EventType(EventURIPrefix.oauth + "token-revoked")
    public static let accountDisabled = EventType(EventURIPrefix.risc + "account-disabled")
    public static let accountEnabled = EventType(EventURIPrefix.risc + "account-enabled")
    public static let accountCredentialChangeRequired = EventType(EventURIPrefix.risc + "account-credential-change-required")
    public static let riscVerification = EventType(EventURIPrefix.risc + "verification")
    // SSF control events.
    public static let ssfVerification = EventType(EventURIPrefix.ssf + "verification")
    public static let streamUpdated = EventType(EventURIPrefix.ssf + "stream-updated")
    // CAEP.
    public static let sessionRevoked = EventType(EventURIPrefix.caep + "session-revoked")
    // Back-channel logout.
    public static let backchannelLogout = EventType(EventURIPrefix.backchannelLogout)
}

/// Every event type Warden knows, by URI and by short name.
public enum EventCatalog {
    static let caepCommon: [ClaimRule] = [
        ClaimRule("event_timestamp", .number),
        ClaimRule("initiating_entity", .string, knownValues: ["admin", "user", "policy", "system"]),
        ClaimRule("reason_admin", .languageMap),
        ClaimRule("reason_user", .languageMap),
    ]

    static let credentialTypes = [
        "password", "pin", "x509", "fido2-platform", "fido2-roaming", "fido-u2f", "verifiable-credential",
        "phone-voice", "phone-sms", "app",
    ]

    public static let all: [EventDefinition] = {
        var defs: [EventDefinition] = []
        func add(_ family: EventFamily, _ prefix: String, _ name: String, _ claims: [ClaimRule] = [],
                 subject: SubjectPlacement = .expected, aliasOf: String? = nil, shortName: String? = nil) {
            defs.append(EventDefinition(uri: prefix + name, name: shortName ?? name, family: family,
                                        aliasOf: aliasOf, claims: claims, subject: subject))
        }
        let risc = EventURIPrefix.risc, caep = EventURIPrefix.caep
        let oauth = EventURIPrefix.oauth, ssf = EventURIPrefix.ssf

        // RISC 1.0 (SPEC §3.3), which includes Google's RISC events (§1.4).
        add(.risc, risc, "account-credential-change-required")
        add(.risc, risc, "account-purged")
        add(.risc, risc, "account-disabled", [ClaimRule("reason", .string, knownValues: ["hijacking", "bulk-account"])])
        add(.risc, risc, "account-enabled")
        add(.risc, risc, "identifier-changed", [ClaimRule("new-value", .string)])
        add(.risc, risc, "identifier-recycled")
        add(.risc, risc, "credential-compromise",
            [ClaimRule("credential_type", .string, required: true, knownValues: credentialTypes),
             ClaimRule("event_timestamp", .number), ClaimRule("reason_admin", .languageMap),
             ClaimRule("reason_user", .languageMap)])
        add(.risc, risc, "opt-in")
        add(.risc, risc, "opt-out-initiated")
        add(.risc, risc, "opt-out-cancelled")
        add(.risc, risc, "opt-out-effective")
        add(.risc, risc, "recovery-activated")
        add(.risc, risc, "recovery-information-changed")
        add(.risc, risc, "sessions-revoked")
        add(.risc, risc, "verification", [ClaimRule("state", .string)], subject: .none)

        // CAEP 1.0 (SPEC §3.2).
        add(.caep, caep, "session-revoked", caepCommon)
        add(.caep, caep, "token-claims-change", caepCommon + [ClaimRule("claims", .object, required: true)])
        add(.caep, caep, "credential-change", caepCommon + [
            ClaimRule("credential_type", .string, required: true, knownValues: credentialTypes),
            ClaimRule("change_type", .string, required: true, knownValues: ["create", "revoke", "update", "delete"]),
            ClaimRule("friendly_name", .string), ClaimRule("x509_issuer", .string),
            ClaimRule("x509_serial", .string), ClaimRule("fido2_aaguid", .string),
        ])
        add(.caep, caep, "assurance-level-change", caepCommon + [
            ClaimRule("namespace", .string, required: true,
                      knownValues: ["RFC8176", "RFC6711", "ISO-IEC-29115", "NIST-IAL", "NIST-AAL", "NIST-FAL"]),
            ClaimRule("current_level", .string, required: true), ClaimRule("previous_level", .string),
            ClaimRule("change_direction", .string, knownValues: ["increase", "decrease"]),
        ])
        add(.caep, caep, "device-compliance-change", caepCommon + [
            ClaimRule("previous_status", .string, required: true, knownValues: ["compliant", "not-compliant"]),
            ClaimRule("current_status", .string, required: true, knownValues: ["compliant", "not-compliant"]),
        ])
        add(.caep, caep, "session-established", caepCommon + [
            ClaimRule("fp_ua", .string), ClaimRule("acr", .string), ClaimRule("amr", .array), ClaimRule("ext_id", .string),
        ])
        add(.caep, caep, "session-presented", caepCommon + [ClaimRule("fp_ua", .string), ClaimRule("ext_id", .string)])
        add(.caep, caep, "risk-level-change", caepCommon + [
            ClaimRule("principal", .string, required: true,
                      knownValues: ["USER", "DEVICE", "SESSION", "TENANT", "ORG_UNIT", "GROUP"]),
            ClaimRule("current_level", .string, required: true, knownValues: ["LOW", "MEDIUM", "HIGH"]),
            ClaimRule("previous_level", .string, knownValues: ["LOW", "MEDIUM", "HIGH"]),
            ClaimRule("risk_reason", .string),
        ])

        // OAuth Event Types 1.0 (SPEC §3.4).
        let tokenReasons = ["inactive", "too_many", "api", "user", "issuer"]
        add(.oauth, oauth, "token-issued", [ClaimRule("token_subject", .object), ClaimRule("reason", .string)],
            subject: .tokenInEvent)
        add(.oauth, oauth, "token-revoked",
            [ClaimRule("token_subject", .object), ClaimRule("reason", .string, knownValues: tokenReasons)],
            subject: .tokenInEvent)
        add(.oauth, oauth, "tokens-revoked", [ClaimRule("reason", .string, knownValues: ["user", "issuer"])])
        add(.oauth, oauth, "client-disabled")
        add(.oauth, oauth, "client-enabled")
        add(.oauth, oauth, "client-credential-changed")

        // SSF 1.0 control events (SPEC §3.1), and their SSE-draft aliases.
        add(.ssf, ssf, "verification", [ClaimRule("state", .string)], subject: .none)
        add(.ssf, ssf, "stream-updated", [ClaimRule("status", .string, required: true,
                                                    knownValues: ["enabled", "paused", "disabled"]),
                                          ClaimRule("reason", .string)], subject: .none)
        add(.ssf, EventURIPrefix.sse, "verification", [ClaimRule("state", .string)], subject: .none,
            aliasOf: ssf + "verification", shortName: "sse-verification")
        add(.ssf, EventURIPrefix.sse, "stream-updated", [ClaimRule("status", .string, required: true),
                                                         ClaimRule("reason", .string)], subject: .none,
            aliasOf: ssf + "stream-updated", shortName: "sse-stream-updated")

        // OpenID Connect Back-Channel Logout 1.0 (SPEC §3.5): the member's value is normally {}.
        defs.append(EventDefinition(uri: EventURIPrefix.backchannelLogout, name: "backchannel-logout",
                                    family: .logout, aliasOf: nil, claims: [], subject: .none))

        // Google's legacy URIs (third-party reports; SPEC §1.4), mapped to the standard events.
        let legacy = EventURIPrefix.googleLegacy
        add(.googleLegacy, legacy, "one-token-revoked", aliasOf: oauth + "token-revoked",
            shortName: "google-one-token-revoked")
        add(.googleLegacy, legacy, "all-token-revoked", aliasOf: oauth + "tokens-revoked",
            shortName: "google-all-token-revoked")
        add(.googleLegacy, legacy, "account-disabled", [ClaimRule("reason", .string)],
            aliasOf: risc + "account-disabled", shortName: "google-account-disabled")
        add(.googleLegacy, legacy, "sessions-revoked", aliasOf: risc + "sessions-revoked",
            shortName: "google-sessions-revoked")
        add(.googleLegacy, legacy, "account-credential-change-required",
            aliasOf: risc + "account-credential-change-required",
            shortName: "google-account-credential-change-required")
        return defs
    }()

    private static let indexByURI: [String: Int] = Dictionary(all.enumerated().map { ($1.uri, $0) }, uniquingKeysWith: { a, _ in a })

    static func index(of uri: String) -> Int? { indexByURI[uri] }

    /// Short names map to every definition bearing them (`verification` names both RISC and SSF's).
    private static let byName: [String: [EventDefinition]] = Dictionary(grouping: all, by: \.name)

    public static func definition(for uri: String) -> EventDefinition? { index(of: uri).map { all[$0] } }

    /// The definitions a configuration key names: a short name or a full URI.
    public static func definitions(named key: String) -> [EventDefinition] {
        if let definition = definition(for: key) { return [definition] }
        return byName[key] ?? []
    }
}
