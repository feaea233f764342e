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
        o["events"] = .array(token.events.map(\.reportJSON))
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

    /// The claims as received, except token identifiers inside `oauth_token` subjects, which are
    /// shown only as a short prefix.
    static func redactedClaims(_ claims: JSONObject) -> JSONObject {
        var out = claims
        guard let events = claims["events"]?.objectValue else { return out }
        var redactedEvents = JSONObject()
        for (uri, payload) in events {
            guard var p = payload.objectValue, var subject = p["subject"]?.objectValue,
                  let token = subject["token"]?.stringValue else {
                redactedEvents[uri] = payload
                continue
            }
            subject["token"] = .string(TokenFingerprint.redact(token))
            p["subject"] = .object(subject)
            redactedEvents[uri] = .object(p)
        }
        out["events"] = .object(redactedEvents)
        return out
    }
}
