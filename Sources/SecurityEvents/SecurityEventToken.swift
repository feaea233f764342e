/// The claims of a Security Event Token (RFC 8417), with its events and their subjects.
/// Built from an already-authenticated claims object; holds no I/O.
public struct SecurityEventToken: Sendable, Hashable {
    public var issuer: String { storage.fields.issuer }
    /// `iat`, seconds since the epoch.
    public var issuedAt: Double { storage.fields.issuedAt }
    public var jti: String { storage.fields.jti }
    /// `aud` as a list (a single string becomes a one-element list); empty when absent.
    public var audience: [String] { storage.fields.audience }
    public var events: [SecurityEvent] { storage.fields.events }
    /// `sub` (RFC 8417 optional; SSF forbids it).
    public var subject: String? { storage.fields.subject }
    /// `sub_id` (RFC 9493; SSF's primary subject).
    public var subjectIdentifier: SubjectIdentifier? { storage.fields.subjectIdentifier }
    public var transaction: String? { storage.fields.transaction }
    /// `toe`: when the event happened.
    public var timeOfEvent: Double? { storage.fields.timeOfEvent }
    public var expiration: Double? { storage.fields.expiration }
    /// Every claim as received, including ones Warden does not interpret.
    public var claims: JSONObject { storage.fields.claims }

    struct Fields: Sendable, Hashable {
        var issuer: String
        var issuedAt: Double
        var jti: String
        var audience: [String]
        var events: [SecurityEvent]
        var subject: String?
        var subjectIdentifier: SubjectIdentifier?
        var transaction: String?
        var timeOfEvent: Double?
        var expiration: Double?
        var claims: JSONObject
    }

    /// The fields behind one reference: a token travels with its event through every stage
    /// and step, and a copy is then one retain instead of one per string, array and object.
    private final class Storage: Sendable {
        let fields: Fields
        init(_ fields: Fields) { self.fields = fields }
    }

    private let storage: Storage

    init(_ fields: Fields) { storage = Storage(fields) }

    public static func == (a: Self, b: Self) -> Bool { a.storage === b.storage || a.storage.fields == b.storage.fields }

    public func hash(into hasher: inout Hasher) { hasher.combine(storage.fields) }

    /// Event types no specification Warden implements defines. They are kept, not refused.
    public var unknownEventTypes: [EventType] { events.map(\.type).filter { !$0.isKnown } }

    /// The subject the token is about: `sub_id`, else the first event's own subject.
    public var primarySubject: SubjectIdentifier? {
        subjectIdentifier ?? events.lazy.compactMap(\.subject).first
    }

    /// The lane of this token's subject, scoped to its issuer: one subject's events act in
    /// order, and a token waiting for its issuer's keys holds back the later ones of its lane.
    public var laneKey: String { Self.laneKey(issuer: issuer, subject: primarySubject) }

    /// The `state` of the verification event this token carries, if it carries one with a state.
    public var verificationState: String? { events.first { $0.type.isVerification }?.state }

    /// A subject's lane; without a subject, the issuer's.
    public static func laneKey(issuer: String, subject: SubjectIdentifier?) -> String {
        subject.map { "subject:" + issuer + "\n" + $0.jsonText } ?? "issuer:" + issuer
    }
}

/// One event of a SET: its type URI, its payload, and its subject.
public struct SecurityEvent: Sendable, Hashable {
    public enum SubjectSource: String, Sendable, Hashable {
        /// The payload's own `subject` member (Google, RISC, OAuth).
        case event
        /// The SET's top-level `sub_id` (SSF).
        case subID = "sub_id"
    }

    public var type: EventType
    /// The payload object as received (including `subject`).
    public var payload: JSONObject
    public var subject: SubjectIdentifier?
    public var subjectSource: SubjectSource?

    public var reason: String? { payload["reason"]?.stringValue }
    /// Verification events: the `state` to compare with the one requested.
    public var state: String? { payload["state"]?.stringValue }
    /// `stream-updated`: the stream's new status.
    public var status: String? { payload["status"]?.stringValue }
    /// CAEP `event_timestamp`, RISC `credential-compromise` time of discovery.
    public var eventTimestamp: Double? { payload["event_timestamp"]?.numberValue }
    public var initiatingEntity: String? { payload["initiating_entity"]?.stringValue }
    public var credentialType: String? { payload["credential_type"]?.stringValue }
    public var changeType: String? { payload["change_type"]?.stringValue }
    /// RISC `identifier-changed`: the new email or phone number.
    public var newValue: String? { payload["new-value"]?.stringValue }
    /// `token-revoked`: the token the event names.
    public var token: TokenReference? {
        if case .oauthToken(let t) = subject { return t }
        return nil
    }
}

/// Why a claims object is not a well-formed SET.
public struct SETFormatError: Error, Sendable, Equatable, CustomStringConvertible {
    public enum Kind: Sendable, Equatable {
        /// A required claim is absent.
        case missingClaim(String)
        /// A claim has the wrong type or an unusable value.
        case invalidClaim(String)
        /// An event payload does not fit its definition.
        case invalidEvent(String)
        /// A subject identifier is malformed.
        case invalidSubject
    }

    public var kind: Kind
    public var message: String
    public var description: String { message }
}

extension SecurityEventToken {
    /// Longest `jti` accepted: identifiers are keys in the ledger, not documents.
    public static let maximumJTILength = 512

    /// Reads the envelope and events from a claims object. Checks structure only; issuer,
    /// audience, times and profile rules are the verifier's.
    public static func parse(claims: JSONObject) throws(SETFormatError) -> SecurityEventToken {
        func fail(_ kind: SETFormatError.Kind, _ message: String) -> SETFormatError {
            SETFormatError(kind: kind, message: message)
        }

        // One pass over the claims picks out the registered ones.
        var issClaim, iatClaim, jtiClaim, audClaim, subClaim, txnClaim, toeClaim, expClaim, subIDClaim, eventsClaim: JSONValue?
        for (name, value) in claims {
            switch name {
            case "iss": issClaim = value
            case "iat": iatClaim = value
            case "jti": jtiClaim = value
            case "aud": audClaim = value
            case "sub": subClaim = value
            case "txn": txnClaim = value
            case "toe": toeClaim = value
            case "exp": expClaim = value
            case "sub_id": subIDClaim = value
            case "events": eventsClaim = value
            default: continue
            }
        }

        guard let issValue = issClaim else { throw fail(.missingClaim("iss"), "the token has no \"iss\" claim") }
        guard let iss = issValue.stringValue, !iss.isEmpty else {
            throw fail(.invalidClaim("iss"), "\"iss\" must be a non-empty string, not \(issValue.typeName)")
        }
        guard let iatValue = iatClaim else { throw fail(.missingClaim("iat"), "the token has no \"iat\" claim") }
        guard let iat = iatValue.numberValue, iat >= 0 else {
            throw fail(.invalidClaim("iat"), "\"iat\" must be a NumericDate (seconds since 1970), not \(iatValue.typeName)")
        }
        guard let jtiValue = jtiClaim else { throw fail(.missingClaim("jti"), "the token has no \"jti\" claim") }
        guard let jti = jtiValue.stringValue, !jti.isEmpty else {
            throw fail(.invalidClaim("jti"), "\"jti\" must be a non-empty string")
        }
        guard jti.utf8.count <= maximumJTILength else {
            throw fail(.invalidClaim("jti"), "\"jti\" is longer than \(maximumJTILength) bytes")
        }
        // The jti is a key of the ledger and of reports, stored as text; PostgreSQL's text
        // cannot hold U+0000, and no identifier needs it.
        guard !jti.utf8.contains(0) else {
            throw fail(.invalidClaim("jti"), "\"jti\" contains a NUL character (U+0000), which an identifier may not hold")
        }

        var audience: [String] = []
        switch audClaim {
        case nil: break
        case .string(let a)?: audience = [a]
        case .array(let list)?:
            for item in list {
                guard let a = item.stringValue else { throw fail(.invalidClaim("aud"), "\"aud\" must be a string or an array of strings") }
                audience.append(a)
            }
        case let other?:
            throw fail(.invalidClaim("aud"), "\"aud\" must be a string or an array of strings, not \(other.typeName)")
        }

        func optionalString(_ name: String, _ claim: JSONValue?) throws(SETFormatError) -> String? {
            guard let v = claim else { return nil }
            guard let s = v.stringValue else { throw fail(.invalidClaim(name), "\"\(name)\" must be a string, not \(v.typeName)") }
            return s
        }
        func optionalNumber(_ name: String, _ claim: JSONValue?) throws(SETFormatError) -> Double? {
            guard let v = claim else { return nil }
            guard let n = v.numberValue else { throw fail(.invalidClaim(name), "\"\(name)\" must be a NumericDate, not \(v.typeName)") }
            return n
        }
        let sub = try optionalString("sub", subClaim)
        let txn = try optionalString("txn", txnClaim)
        let toe = try optionalNumber("toe", toeClaim)
        let exp = try optionalNumber("exp", expClaim)

        var subID: SubjectIdentifier? = nil
        if let raw = subIDClaim {
            do {
                subID = try SubjectIdentifier.parse(raw, path: "sub_id")
            } catch {
                throw fail(.invalidSubject, error.description)
            }
        }

        guard let eventsValue = eventsClaim else {
            throw fail(.missingClaim("events"), "the token has no \"events\" claim, so it is not a Security Event Token")
        }
        guard let eventsObject = eventsValue.objectValue else {
            throw fail(.invalidClaim("events"), "\"events\" must be a JSON object, not \(eventsValue.typeName)")
        }
        guard !eventsObject.isEmpty else { throw fail(.invalidClaim("events"), "\"events\" is empty: a SET carries at least one event") }

        var events: [SecurityEvent] = []
        events.reserveCapacity(eventsObject.count)
        for (uri, value) in eventsObject {
            guard let payload = value.objectValue else {
                throw fail(.invalidEvent(uri), "the payload of event \(uri) must be a JSON object, not \(value.typeName)")
            }
            let type = EventType(uri)
            var subject: SubjectIdentifier? = nil
            var source: SecurityEvent.SubjectSource? = nil
            if let raw = payload["subject"] {
                do {
                    subject = try SubjectIdentifier.parse(raw, path: "events[\(uri)].subject")
                } catch {
                    throw fail(.invalidSubject, error.description)
                }
                source = .event
            } else if let subID {
                subject = subID
                source = .subID
            }
            if let definition = type.definition {
                for rule in definition.claims {
                    guard let claim = payload[rule.name] else {
                        if rule.required {
                            throw fail(.invalidEvent(uri), "event \(definition.name) requires the claim \"\(rule.name)\"")
                        }
                        continue
                    }
                    guard rule.type.accepts(claim) else {
                        throw fail(.invalidEvent(uri), "event \(definition.name): \"\(rule.name)\" must be \(rule.type.rawValue), not \(claim.typeName)")
                    }
                }
                if definition.subject == .tokenInEvent {
                    guard case .oauthToken? = subject, source == .event else {
                        throw fail(.invalidEvent(uri), "event \(definition.name) requires an oauth_token subject in the event")
                    }
                }
            }
            events.append(SecurityEvent(type: type, payload: payload, subject: subject, subjectSource: source))
        }

        return SecurityEventToken(Fields(issuer: iss, issuedAt: iat, jti: jti, audience: audience, events: events,
                                         subject: sub, subjectIdentifier: subID, transaction: txn, timeOfEvent: toe,
                                         expiration: exp, claims: claims))
    }
}

extension SecurityEvent {
    /// The normalised form used in reports and `warden verify`'s output.
    public var reportJSON: JSONValue {
        var o = JSONObject()
        o["type"] = .string(type.uri)
        o["name"] = .string(type.name)
        o["known"] = .bool(type.isKnown)
        if let canonical = type.definition?.aliasOf { o["alias_of"] = .string(canonical) }
        if let subject {
            o["subject"] = subject.json
            o["subject_source"] = .string(subjectSource?.rawValue ?? "event")
        }
        var attributes = payload
        attributes["subject"] = nil
        if !attributes.isEmpty { o["attributes"] = .object(attributes) }
        return .object(o)
    }
}
