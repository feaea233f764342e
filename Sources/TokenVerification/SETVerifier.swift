public import SecurityEvents
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The protected header of a verified token.
public struct JOSEHeader: Sendable, Hashable {
    public var algorithm: JOSEAlgorithm
    public var keyID: String
    public var type: String?
    public var members: JSONObject
}

/// A token that passed every check.
public struct VerifiedSET: Sendable {
    public var token: SecurityEventToken
    public var header: JOSEHeader
    public var profile: TokenProfile
    /// RFC 7638 thumbprint of the key that verified the signature.
    public var keyThumbprint: String
    /// The JWK that verified the signature (public members only), for the key archive.
    public var key: JSONObject
}

/// A key from the archive, and the latest `iat` it is trusted for: a token its issuer sent
/// after it stopped publishing the key (signed with a retired, perhaps stolen, key) is refused.
public struct ArchivedKeyEntry: Sendable {
    public let entry: KeySetEntry
    public let issuedNotAfter: Double

    public init(entry: KeySetEntry, issuedNotAfter: Double) {
        self.entry = entry
        self.issuedNotAfter = issuedNotAfter
    }
}

/// Verifies compact SETs against per-issuer policy. Checks, in order: size and shape, header
/// (alg allow-list, no key material or URLs, no `crit`, no `zip`), issuer, key by `kid`,
/// signature, then claims (`events`, `jti`, `iat`, `aud`, profile rules).
public final class SETVerifier: Sendable {
    /// A class: every verification picks one, and copying a policy would retain each of its
    /// strings and arrays, shared by every verifying thread.
    public final class Issuer: Sendable {
        public let policy: IssuerPolicy
        public let keys: IssuerKeyCache
        /// Keys from the ledger's archive, by `kid`: used before the live keys, so a token signed
        /// by a key the issuer has since removed verifies if that key was ever seen (replay). A
        /// `kid` not in it is looked up in the live keys as usual.
        public let archived: [String: ArchivedKeyEntry]
        /// `policy.algorithms` as a bit mask.
        let algorithmMask: UInt32

        public init(policy: IssuerPolicy, keys: IssuerKeyCache, archived: [String: ArchivedKeyEntry] = [:]) {
            self.policy = policy
            self.keys = keys
            self.archived = archived
            self.algorithmMask = JOSEAlgorithm.mask(policy.algorithms)
        }
    }

    /// Largest token accepted, checked before anything else. Default 64 KiB.
    public let maximumTokenBytes: Int
    let issuers: [String: Issuer]
    /// Now, as this verifier judges it.
    public let clock: WallClock

    public static let defaultMaximumTokenBytes = 64 * 1024

    public init(issuers: [Issuer], maximumTokenBytes: Int = SETVerifier.defaultMaximumTokenBytes,
                clock: WallClock = .system) {
        self.issuers = Dictionary(issuers.map { ($0.policy.issuer, $0) }, uniquingKeysWith: { first, _ in first })
        self.maximumTokenBytes = maximumTokenBytes
        self.clock = clock
    }

    public var configuredIssuers: [Issuer] { Array(issuers.values) }

    public func verify(_ token: String) async -> Result<VerifiedSET, VerificationError> {
        await verify(Array(token.utf8))
    }

    /// Verifies a compact JWS given as bytes (a Kafka message value, a request body).
    /// `claimsCheckedAt` (seconds since 1970): the time its claims are judged at (`iat` in the
    /// future, `max-age`, a logout token's `exp`) instead of now — for a token verified before
    /// and stored, judged as of when it arrived. Keys are always judged now.
    public func verify(_ token: some Collection<UInt8>, claimsCheckedAt: Double? = nil) async -> Result<VerifiedSET, VerificationError> {
        await verify(token, claimsTime: claimsCheckedAt.map(ClaimsTime.at) ?? .now)
    }

    /// When a token's claims (`iat` in the future, `max-age`, a logout token's `exp`) are judged.
    public enum ClaimsTime: Sendable {
        /// Now: a token arriving.
        case now
        /// At this time (seconds since 1970): a stored token, as of when it first arrived.
        case at(Double)
        /// At the token's own `iat`: a logged token whose arrival is not known, judged as it
        /// would have been when it was sent (a replay).
        case issuedAt
    }

    /// Verifies a compact JWS, its claims judged at `claimsTime`. Keys are always judged now.
    public func verify(_ token: some Collection<UInt8>, claimsTime: ClaimsTime) async -> Result<VerifiedSET, VerificationError> {
        let claimsCheckedAt = claimsTime
        // Fast path: the issuer's keys are at hand, so everything happens in place, without
        // suspending or copying the token.
        let first = token.withContiguousStorageIfAvailable { attempt($0, keys: .cached, claimsCheckedAt: claimsCheckedAt) }
            ?? Array(token).withUnsafeBufferPointer { attempt($0, keys: .cached, claimsCheckedAt: claimsCheckedAt) }
        let issuer: Issuer, keyID: String, claims: JSONObject
        switch first {
        case .done(let result): return result
        case .needsKeys(let i, let k, let c): (issuer, keyID, claims) = (i, k, c)
        }
        var result = await verifyNeedingKeys(token, issuer: issuer, keyID: keyID, claimsCheckedAt: claimsCheckedAt)
        // A token that waits for keys holds back the later events of its subject (as it claims
        // it, unverified): they must not act before it.
        if case .failure(var error) = result, error.isRetryable {
            let claimed = try? SecurityEventToken.parse(claims: claims)
            error.unverifiedSubject = claimed?.laneKey ?? SecurityEventToken.laneKey(issuer: issuer.policy.issuer, subject: nil)
            result = .failure(error)
        }
        return result
    }

    private func verifyNeedingKeys(_ token: some Collection<UInt8>, issuer: Issuer, keyID: String, claimsCheckedAt: ClaimsTime) async
        -> Result<VerifiedSET, VerificationError>
    {

        // Slow path: load or refresh the issuer's keys, then verify with what they hold.
        var entry: KeySetEntry? = nil
        switch await issuer.keys.keys() {
        case .unavailable(let reason): return .failure(VerificationError(.keysUnavailable, reason))
        case .keys(let keys): entry = keys[keyID]
        }
        if entry == nil {
            switch await issuer.keys.keysAfterUnknownKeyID() {
            case .unavailable(let reason): return .failure(VerificationError(.keysUnavailable, reason))
            case .keys(let keys): entry = keys[keyID]
            }
            // Keys past their freshness, a refresh that failed: the provider may have rotated to a
            // key we cannot fetch yet, so this is not a verdict. Keys still fresh are the
            // provider's current set, and a kid they lack is refused whether or not the refresh
            // it caused succeeded: a forged kid sent while the provider is down must not pass
            // for a rotation and hold the token's partition.
            if entry == nil, !issuer.keys.isFresh(at: clock.now()), let failure = await issuer.keys.lastFetchFailure {
                return .failure(VerificationError(.keysUnavailable,
                    "no key \(quoted(keyID)) is cached for issuer \(quoted(issuer.policy.issuer)) and the JWKS cannot be fetched: \(failure)"))
            }
        }
        return Array(token).withUnsafeBufferPointer { buffer in
            guard case .done(let result) = attempt(buffer, keys: .resolved(entry), claimsCheckedAt: claimsCheckedAt) else {
                preconditionFailure("a resolved key never asks for keys")
            }
            return result
        }
    }

    private enum Attempt {
        case done(Result<VerifiedSET, VerificationError>)
        /// With the token's claims, unverified: the subject they claim is read only if the
        /// keys turn out to be unavailable.
        case needsKeys(Issuer, keyID: String, claims: JSONObject)
    }

    /// Which key a verification attempt uses.
    private enum KeyChoice {
        /// The issuer's published keys, if fresh and holding the kid; otherwise ask for keys.
        case cached
        /// What the key cache resolved (nil: the issuer has no such kid).
        case resolved(KeySetEntry?)
    }

    /// Verifies in place, in the caller's buffer, without suspending.
    private func attempt(_ token: UnsafeBufferPointer<UInt8>, keys: KeyChoice, claimsCheckedAt: ClaimsTime) -> Attempt {
        do throws(VerificationError) {
            let parsed = try ParsedToken(token, maximumBytes: maximumTokenBytes)
            let issuer = try selectIssuer(parsed)
            let now = clock.now()
            let entry: KeySetEntry?
            var issuedNotAfter: Double? = nil
            switch keys {
            case .resolved(let resolved):
                entry = resolved
            case .cached:
                if !issuer.archived.isEmpty, let archived = issuer.archived[parsed.keyID] {
                    entry = archived.entry
                    issuedNotAfter = archived.issuedNotAfter
                    break
                }
                guard let cached = issuer.keys.freshEntry(keyID: parsed.keyID, at: now) else {
                    return .needsKeys(issuer, keyID: parsed.keyID, claims: parsed.claims)
                }
                entry = cached
            }
            return .done(.success(try finish(parsed, token: token, issuer: issuer, entry: entry, now: now, claimsTime: claimsCheckedAt,
                                             issuedNotAfter: issuedNotAfter)))
        } catch {
            return .done(.failure(error))
        }
    }

    private func selectIssuer(_ parsed: ParsedToken) throws(VerificationError) -> Issuer {
        guard let issValue = parsed.claims["iss"] else {
            throw VerificationError(.missingClaim, "the token has no \"iss\" claim")
        }
        guard let iss = issValue.stringValue else {
            throw VerificationError(.invalidClaim, "\"iss\" must be a string, not \(issValue.typeName)")
        }
        // Dictionaries match canonically equivalent strings ("\u{212A}" finds "K"): the issuer
        // found must be the one named.
        guard let issuer = issuers[iss], sameName(issuer.policy.issuer, iss) else {
            throw VerificationError(.unknownIssuer, "the issuer \(quoted(iss)) is not configured (configured: \(issuers.keys.sorted().map { quoted($0) }.joined(separator: ", ")))")
        }
        // The policy is read in place (a copy would retain each of its strings and arrays).
        guard issuer.algorithmMask & parsed.algorithm.bit != 0 else {
            throw VerificationError(.unsupportedAlgorithm, "the algorithm \(parsed.algorithm.rawValue) is not allowed for issuer \(quoted(iss)) (allowed: \(issuer.policy.algorithms.sorted().map(\.rawValue).joined(separator: ", ")))")
        }
        try checkType(parsed.type, profile: issuer.policy.profile)
        return issuer
    }

    private func checkType(_ typ: String?, profile: TokenProfile) throws(VerificationError) {
        // RFC 7515 §4.1.9: a typ without "/" means application/<typ>; compared case-insensitively.
        let normalized = typ.map { t -> String in
            let lower = t.lowercased()
            return lower.hasPrefix("application/") ? String(lower.dropFirst("application/".count)) : lower
        }
        switch profile {
        case .ssf:
            guard let normalized else {
                throw VerificationError(.wrongType, "the header has no \"typ\"; SSF requires \"secevent+jwt\"")
            }
            guard normalized == "secevent+jwt" else {
                throw VerificationError(.wrongType, "the header's typ \(quoted(typ!)) is not \"secevent+jwt\"")
            }
        case .risc:
            // Google does not document typ: absent, generic JWT, or secevent+jwt are accepted;
            // any other typed JWT (at+jwt, logout+jwt, …) is another kind of token.
            if let normalized, normalized != "secevent+jwt", normalized != "jwt" {
                throw VerificationError(.wrongType, "the header's typ \(quoted(typ!)) is not a Security Event Token type")
            }
        case .logout:
            if let normalized, normalized != "logout+jwt", normalized != "jwt" {
                throw VerificationError(.wrongType, "the header's typ \(quoted(typ!)) is not \"logout+jwt\"")
            }
        }
    }

    private func finish(_ parsed: ParsedToken, token: UnsafeBufferPointer<UInt8>, issuer: Issuer,
                        entry: KeySetEntry?, now current: Double, claimsTime: ClaimsTime,
                        issuedNotAfter: Double? = nil) throws(VerificationError) -> VerifiedSET {
        let key: VerificationKey
        // Looked up by a dictionary, which matches canonically equivalent key ids: the key found
        // must have the id the token names.
        switch entry.flatMap({ sameName($0.keyID, parsed.keyID) ? $0 : nil }) {
        case nil:
            throw VerificationError(.unknownKeyID, "issuer \(quoted(issuer.policy.issuer)) has no key with kid \(quoted(parsed.keyID)) in its JWKS")
        case .unusable(_, let reason)?:
            throw VerificationError(.unusableKey, "the key \(quoted(parsed.keyID)) cannot be used: \(reason)")
        case .usable(let k)?:
            key = k
        }
        guard key.algorithmMask & parsed.algorithm.bit != 0 else {
            throw VerificationError(.algorithmMismatch, "the key \(quoted(parsed.keyID)) is a \(key.family.rawValue) key for \(key.algorithms.sorted().map(\.rawValue).joined(separator: "/")), but the token says \(parsed.algorithm.rawValue)")
        }
        // Each key is used with exactly one algorithm (RFC 8725 §3.1): its JWK's `alg`, or, for a
        // JWK without one, the one algorithm of its type the issuer allows. An RSA key naming no
        // `alg` under an issuer that allows several RSA algorithms could otherwise sign with
        // PKCS #1 v1.5 and PSS alike.
        let usable = key.algorithmMask & issuer.algorithmMask
        guard usable & (usable &- 1) == 0 else {
            let allowed = key.algorithms.intersection(issuer.policy.algorithms).sorted().map(\.rawValue).joined(separator: ", ")
            throw VerificationError(.unusableKey, "the key \(quoted(parsed.keyID)) names no \"alg\" and issuer \(quoted(issuer.policy.issuer)) allows several \(key.family.rawValue) algorithms (\(allowed)); a key is used with exactly one: the JWK must name its \"alg\", or the issuer allow one \(key.family.rawValue) algorithm")
        }
        let signaturePart = UnsafeBufferPointer(rebasing: token[parsed.signaturePart])
        let valid = withUnsafeTemporaryAllocation(of: UInt8.self, capacity: signaturePart.count) { scratch -> Bool in
            guard let count = Base64URL.decode(buffer: signaturePart, into: scratch) else { return false }
            return key.isValidSignature(UnsafeRawBufferPointer(UnsafeMutableBufferPointer(rebasing: scratch[..<count])),
                                        for: UnsafeRawBufferPointer(UnsafeBufferPointer(rebasing: token[..<parsed.signingInputEnd])),
                                        algorithm: parsed.algorithm)
        }
        guard valid else {
            throw VerificationError(.badSignature, "the signature does not verify with key \(quoted(parsed.keyID)) (\(parsed.algorithm.rawValue))")
        }

        // Authenticated from here on: the claims may be trusted to say what the issuer said.
        let set: SecurityEventToken
        do {
            set = try SecurityEventToken.parse(claims: parsed.claims)
        } catch {
            switch error.kind {
            case .missingClaim: throw VerificationError(.missingClaim, error.message)
            case .invalidClaim: throw VerificationError(.invalidClaim, error.message)
            case .invalidEvent: throw VerificationError(.invalidEvent, error.message)
            case .invalidSubject: throw VerificationError(.invalidSubject, error.message)
            }
        }
        if let issuedNotAfter, set.issuedAt > issuedNotAfter {
            throw VerificationError(.unusableKey, "the archived key \(quoted(parsed.keyID)) was last seen published well before this token's \"iat\"; a token signed with a key its issuer had retired is not accepted")
        }
        try checkAudience(set, policy: issuer.policy)
        let now = switch claimsTime {
        case .now: current
        case .at(let time): time
        case .issuedAt: set.issuedAt
        }
        try checkTimes(set, policy: issuer.policy, now: now)
        try checkProfile(set, policy: issuer.policy, now: now)
        return VerifiedSET(token: set, header: JOSEHeader(algorithm: parsed.algorithm, keyID: parsed.keyID,
                                                          type: parsed.type, members: parsed.header),
                           profile: issuer.policy.profile, keyThumbprint: key.thumbprint, key: key.jwk)
    }

    private func checkAudience(_ set: SecurityEventToken, policy: IssuerPolicy) throws(VerificationError) {
        guard set.claims["aud"] != nil else {
            throw VerificationError(.audienceMismatch, "the token has no \"aud\" claim; it must name one of this receiver's audiences")
        }
        guard set.audience.contains(where: { audience in policy.audiences.contains { sameName($0, audience) } }) else {
            throw VerificationError(.audienceMismatch, "the token's audience \(set.audience.prefix(3).map { quoted($0) }.joined(separator: ", ")) does not include any configured audience for issuer \(quoted(policy.issuer))")
        }
    }

    private func checkTimes(_ set: SecurityEventToken, policy: IssuerPolicy, now: Double) throws(VerificationError) {
        if set.issuedAt > now + policy.clockSkew {
            throw VerificationError(.issuedInFuture, "\"iat\" is \(wholeSeconds(set.issuedAt - now)) s in the future; at most \(wholeSeconds(policy.clockSkew)) s of clock skew is allowed")
        }
        // RFC 7519 §4.1.5: a JWT must not be accepted before its "nbf". SETs rarely carry one.
        if let notBeforeValue = set.claims["nbf"] {
            guard let notBefore = notBeforeValue.numberValue, notBefore.isFinite else {
                throw VerificationError(.invalidClaim, "\"nbf\" must be a number of seconds, not \(notBeforeValue.typeName)")
            }
            if notBefore > now + policy.clockSkew {
                throw VerificationError(.notYetValid, "\"nbf\" is \(wholeSeconds(notBefore - now)) s in the future; at most \(wholeSeconds(policy.clockSkew)) s of clock skew is allowed")
            }
        }
        if let maximumAge = policy.maximumAge, now - set.issuedAt > maximumAge {
            throw VerificationError(.tooOld, "the token was issued \(wholeSeconds(now - set.issuedAt)) s ago; the configured maximum age is \(wholeSeconds(maximumAge)) s")
        }
    }

    private func checkProfile(_ set: SecurityEventToken, policy: IssuerPolicy, now: Double) throws(VerificationError) {
        let logoutURI = EventType.backchannelLogout.uri
        let hasLogoutEvent = set.events.contains { $0.type.uri == logoutURI }
        switch policy.profile {
        case .risc, .ssf:
            if hasLogoutEvent {
                throw VerificationError(.wrongKindOfToken, "the token is a back-channel logout token, not a Security Event Token for this issuer")
            }
            if policy.profile == .ssf {
                if set.claims["sub"] != nil {
                    throw VerificationError(.invalidClaim, "SSF tokens must not carry \"sub\"; the subject belongs in \"sub_id\"")
                }
                if set.claims["exp"] != nil {
                    throw VerificationError(.invalidClaim, "SSF tokens must not carry \"exp\"")
                }
                if set.subjectIdentifier == nil {
                    throw VerificationError(.missingClaim, "the token has no \"sub_id\" claim, which SSF requires")
                }
            }
            // SETs are not checked for exp (Google's guide: they describe past events).
            for event in set.events {
                if let definition = event.type.definition, definition.subject != .none, event.subject == nil {
                    throw VerificationError(.invalidEvent, "event \(definition.name) has no subject (neither \"subject\" in the event nor \"sub_id\")")
                }
            }
            // The kind's own claims (SPEC §4, row 8): `events` with a known URI. A token whose
            // events are all unknown is no event this receiver acts on, and not counted processed.
            guard set.events.contains(where: { $0.type.definition != nil }) else {
                throw VerificationError(.invalidEvent, "no event type of the token is one this receiver knows (\(quoted(set.events.first?.type.uri ?? "")))")
            }
        case .logout:
            guard hasLogoutEvent else {
                throw VerificationError(.wrongKindOfToken, "the token's events lack \(logoutURI), so it is not a logout token")
            }
            guard let exp = set.expiration else {
                throw VerificationError(.missingClaim, "the logout token has no \"exp\" claim")
            }
            if now > exp + policy.clockSkew {
                throw VerificationError(.expired, "the logout token expired \(wholeSeconds(now - exp)) s ago")
            }
            if set.claims["nonce"] != nil {
                throw VerificationError(.invalidClaim, "a logout token must not carry \"nonce\"")
            }
            let sid = set.claims["sid"]
            if let sid, sid.stringValue == nil {
                throw VerificationError(.invalidClaim, "\"sid\" must be a string")
            }
            if set.subject == nil && sid == nil {
                throw VerificationError(.missingClaim, "the logout token has neither \"sub\" nor \"sid\"")
            }
        }
    }
}

/// The pieces of a compact JWS, checked for shape and header rules but not yet authenticated.
struct ParsedToken {
    var header: JSONObject
    var algorithm: JOSEAlgorithm
    var keyID: String
    var type: String?
    var claims: JSONObject
    /// Where the signature part lies in the token.
    var signaturePart: Range<Int>
    /// The JWS signing input is the token up to its second dot.
    var signingInputEnd: Int

    init(_ token: UnsafeBufferPointer<UInt8>, maximumBytes: Int) throws(VerificationError) {
        guard token.count <= maximumBytes else {
            throw VerificationError(.tooLarge, "the token is \(token.count) bytes; the limit is \(maximumBytes)")
        }
        guard !token.isEmpty else { throw VerificationError(.malformed, "the token is empty") }
        // Find up to five dots without allocating.
        var firstDot = -1, secondDot = -1, dotCount = 0
        if let base = token.baseAddress {
            var from = 0
            while dotCount < 5, from < token.count,
                  let hit = memchr(base + from, Int32(UInt8(ascii: ".")), token.count - from) {
                let index = base.distance(to: hit.assumingMemoryBound(to: UInt8.self))
                if dotCount == 0 { firstDot = index } else if dotCount == 1 { secondDot = index }
                dotCount += 1
                from = index + 1
            }
        }
        if dotCount == 4 {
            throw VerificationError(.encrypted, "the token is an encrypted JWT (JWE, five parts); only signed compact SETs (JWS) are accepted")
        }
        guard dotCount == 2 else {
            throw VerificationError(.malformed, "a compact JWS has three dot-separated parts; this token has \(dotCount + 1)\(dotCount == 5 ? " or more" : "")")
        }
        let headerPart = UnsafeBufferPointer(rebasing: token[..<firstDot])
        let payloadPart = UnsafeBufferPointer(rebasing: token[(firstDot + 1)..<secondDot])
        let signaturePart = UnsafeBufferPointer(rebasing: token[(secondDot + 1)...])
        guard !headerPart.isEmpty, !payloadPart.isEmpty else {
            throw VerificationError(.malformed, "the token's header or payload part is empty")
        }
        guard !signaturePart.isEmpty else {
            throw VerificationError(.unsupportedAlgorithm, "the token has no signature; unsigned tokens are never accepted")
        }

        let header = try Self.decodeObject(headerPart, part: "header")
        // One pass over the header picks out what is used and what is refused.
        var algValue, kidValue, typValue: JSONValue?
        var refused: (member: String, kind: VerificationError.Kind)? = nil
        for (name, value) in header {
            switch name {
            case "alg": algValue = value
            case "kid": kidValue = value
            case "typ": typValue = value
            case "jwk", "jku", "x5u", "x5c": if refused == nil { refused = (name, .headerKeyMaterial) }
            case "crit", "b64": if refused == nil { refused = (name, .criticalHeader) }
            case "zip": if refused == nil { refused = (name, .compressed) }
            case "enc": if refused == nil { refused = (name, .encrypted) }
            default: continue
            }
        }
        // alg first: an unsigned or HMAC token is refused whatever else it says.
        guard let algValue else { throw VerificationError(.malformed, "the header has no \"alg\"") }
        guard let algName = algValue.stringValue else { throw VerificationError(.malformed, "the header's \"alg\" must be a string") }
        guard let algorithm = JOSEAlgorithm(rawValue: algName) else {
            throw VerificationError(.unsupportedAlgorithm, JOSEAlgorithm.refusal(for: algName))
        }
        if let (member, kind) = refused {
            switch kind {
            case .headerKeyMaterial:
                throw VerificationError(kind, "the header carries \"\(member)\"; keys are taken only from the issuer's published JWKS, never from the token")
            case .compressed:
                throw VerificationError(kind, "the header asks for compression (\"zip\"), which JWS does not allow")
            case .encrypted:
                throw VerificationError(kind, "the header has \"enc\": encrypted tokens are not accepted")
            default:
                throw VerificationError(kind, member == "b64"
                    ? "the header has \"b64\" (unencoded payload), which is not supported"
                    : "the header lists critical extensions (\"crit\"), none of which are supported")
            }
        }
        guard let kidValue else {
            throw VerificationError(.missingKeyID, "the header has no \"kid\"; the signing key must be named")
        }
        guard let kid = kidValue.stringValue, !kid.isEmpty, kid.utf8.count <= KeySet.maximumKeyIDLength, !kid.utf8.contains(0) else {
            throw VerificationError(.missingKeyID, "the header's \"kid\" must be a non-empty string of at most \(KeySet.maximumKeyIDLength) bytes, without NUL characters")
        }
        var type: String? = nil
        if let typValue {
            guard let t = typValue.stringValue else { throw VerificationError(.wrongType, "the header's \"typ\" must be a string") }
            type = t
        }
        guard Base64URL.isValid(buffer: signaturePart) else {
            throw VerificationError(.malformed, "the signature part is not unpadded base64url")
        }
        self.header = header
        self.algorithm = algorithm
        self.keyID = kid
        self.type = type
        self.claims = try Self.decodeObject(payloadPart, part: "payload")
        self.signaturePart = (secondDot + 1)..<token.count
        self.signingInputEnd = secondDot
    }

    static func decodeObject(_ part: UnsafeBufferPointer<UInt8>, part name: String) throws(VerificationError) -> JSONObject {
        let parsed = withUnsafeTemporaryAllocation(of: UInt8.self, capacity: part.count) { scratch in
            Result { () throws(JSONParseError) -> JSONValue? in
                guard let count = Base64URL.decode(buffer: part, into: scratch) else { return nil }
                return try JSONParser.parse(buffer: UnsafeBufferPointer(rebasing: scratch[..<count]))
            }
        }
        let value: JSONValue
        do {
            guard let decoded = try parsed.get() else {
                throw VerificationError(.malformed, "the \(name) part is not unpadded base64url")
            }
            value = decoded
        } catch let error as VerificationError {
            throw error
        } catch let error as JSONParseError {
            if case .duplicateMember(let member) = error.kind {
                throw VerificationError(.duplicateMember, "the \(name) has the member \(quoted(member)) more than once")
            }
            throw VerificationError(.malformed, "the \(name) is not valid JSON: \(error)")
        } catch {
            throw VerificationError(.malformed, "the \(name) could not be read")
        }
        guard let object = value.objectValue else {
            throw VerificationError(.malformed, "the \(name) must be a JSON object, not \(value.typeName)")
        }
        return object
    }
}
