public import SecurityEvents
public import TokenVerification

/// The JSON `warden verify` prints (DESIGN.md, "The contract").
public enum VerificationReport {
    public static func json(_ result: Result<VerifiedSET, VerificationError>) -> JSONValue {
        switch result {
        case .success(let verified): return valid(verified)
        case .failure(let error): return invalid(error)
        }
    }

    public static func valid(_ verified: VerifiedSET) -> JSONValue {
        let token = verified.token
        var o = JSONObject()
        o["valid"] = true
        o["iss"] = .string(token.issuer)
        o["jti"] = .string(token.jti)
        o["aud"] = .array(token.audience.map { .string($0) })
        o["kid"] = .string(verified.header.keyID)
        o["alg"] = .string(verified.header.algorithm.rawValue)
        if let typ = verified.header.type { o["typ"] = .string(typ) }
        o["profile"] = .string(verified.profile.rawValue)
        o["key_thumbprint"] = .string(verified.keyThumbprint)
        // Subjects are shown redacted already; an event's other members are redacted here.
        o["events"] = .array(token.events.map { event in
            guard case .object(var report) = event.reportJSON, let attributes = report["attributes"] else { return event.reportJSON }
            report["attributes"] = redacted(attributes)
            return .object(report)
        })
        if let subject = token.subjectIdentifier { o["sub_id"] = subject.json }
        let unknown = token.unknownEventTypes
        if !unknown.isEmpty { o["unknown_event_types"] = .array(unknown.map { .string($0.uri) }) }
        o["claims"] = .object(redactedClaims(token.claims))
        return .object(o)
    }

    public static func invalid(_ error: VerificationError) -> JSONValue {
        var o = JSONObject()
        o["valid"] = false
        o["err"] = .string(error.reportedCode)
        o["description"] = .string(error.description)
        o["reason"] = .string(error.kind.rawValue)
        if error.isRetryable { o["retryable"] = true }
        return .object(o)
    }

    /// The claims as received, except token values, which are shown only as a short prefix:
    /// every string member named `token`, wherever it is — an `oauth_token` subject in an
    /// event, in `sub_id`, in an `aliases` list or a `complex` subject's members.
    static func redactedClaims(_ claims: JSONObject) -> JSONObject {
        guard case .object(let redacted) = redacted(.object(claims)) else { return claims }
        return redacted
    }

    static func redacted(_ value: JSONValue) -> JSONValue {
        switch value {
        case .object(let object):
            var out = JSONObject()
            for (name, member) in object {
                if name == "token", let token = member.stringValue {
                    out[name] = .string(TokenFingerprint.redact(token))
                } else {
                    out[name] = redacted(member)
                }
            }
            return .object(out)
        case .array(let items): return .array(items.map(redacted))
        default: return value
        }
    }
}
