import SecurityEvents
/// RFC 8935 §2.3 / SSF error codes, as the push receiver answers them in its 400 body.
public enum SETErrorCode: String, Sendable, Hashable, CaseIterable {
    case invalidRequest = "invalid_request"
    case invalidKey = "invalid_key"
    case invalidIssuer = "invalid_issuer"
    case invalidAudience = "invalid_audience"
    case authenticationFailed = "authentication_failed"
    case accessDenied = "access_denied"
    case invalidState = "invalid_state"
}

/// Why a token was not accepted. `kind` is precise; `code` is the RFC 8935 code it maps to;
/// `description` says what was wrong in words a person can act on and never contains the
/// token or any configured secret.
public struct VerificationError: Error, Sendable, Equatable, CustomStringConvertible {
    public enum Kind: String, Sendable, Hashable, CaseIterable {
        // Format (invalid_request)
        case tooLarge = "too-large"
        case malformed
        case encrypted
        case duplicateMember = "duplicate-member"
        case headerKeyMaterial = "header-key-material"
        case criticalHeader = "critical-header"
        case compressed
        case wrongType = "wrong-type"
        case missingClaim = "missing-claim"
        case invalidClaim = "invalid-claim"
        case invalidEvent = "invalid-event"
        case invalidSubject = "invalid-subject"
        case issuedInFuture = "issued-in-future"
        /// `nbf` (RFC 7519 §4.1.5) beyond the clock skew: not to be accepted yet.
        case notYetValid = "not-yet-valid"
        case tooOld = "too-old"
        case expired
        case wrongKindOfToken = "wrong-kind-of-token"
        // Keys and signatures (invalid_key)
        case unsupportedAlgorithm = "unsupported-algorithm"
        case missingKeyID = "missing-key-id"
        case unknownKeyID = "unknown-key-id"
        case unusableKey = "unusable-key"
        case algorithmMismatch = "algorithm-mismatch"
        case badSignature = "bad-signature"
        // Issuer and audience
        case unknownIssuer = "unknown-issuer"
        case audienceMismatch = "audience-mismatch"
        /// Genuine, but from another issuer than the stream it came by (SSF: the SET's `iss`
        /// must be the stream's): `access_denied`.
        case otherStreamsIssuer = "other-streams-issuer"
        // Not a verdict on the token: the issuer's keys could not be obtained. Retry later.
        case keysUnavailable = "keys-unavailable"
        /// The issuer's keys could not be obtained for as long as a message may wait for them:
        /// the message is refused (reported `keys_unavailable`), not retried any more.
        case keysUnavailableTooLong = "keys-unavailable-too-long"
    }

    public var kind: Kind
    public var description: String
    /// For `keysUnavailable`: the lane of the subject the token claims (unverified), whose
    /// later events must wait behind it (`SecurityEventToken.laneKey`).
    public var unverifiedSubject: String? = nil

    public init(_ kind: Kind, _ description: String) {
        self.kind = kind
        // A description may quote what an attacker wrote (an event URI, a member name). It goes
        // to logs, dead-letter headers and the ledger's text columns, so control characters
        // (U+0000 above all, which PostgreSQL's text refuses) are replaced here, once.
        // C1 characters too (U+009B is CSI): the description may reach a terminal. And it is
        // cut at `maximumDescriptionScalars`: a signed token may carry tens of kilobytes of
        // member names or event URIs that a parse error names, and each dead-letter header,
        // ledger row and log line would repeat them.
        var text = description
        if text.unicodeScalars.count > Self.maximumDescriptionScalars {
            text = String(String.UnicodeScalarView(text.unicodeScalars.prefix(Self.maximumDescriptionScalars))) + "…"
        }
        self.description = hasControlCharacters(text)
            ? String(text.unicodeScalars.map { isControl($0) ? "?" : Character($0) })
            : text
    }

    /// Longest description kept, in Unicode scalars (a description's own words are a few
    /// hundred at most).
    public static let maximumDescriptionScalars = 1000

    /// The RFC 8935 code; nil for `keysUnavailable`, which is not a verdict on the token, and
    /// for `keysUnavailableTooLong` (reported `keys_unavailable`): no fault of the token.
    public var code: SETErrorCode? {
        switch kind {
        case .keysUnavailable, .keysUnavailableTooLong: nil
        case .unsupportedAlgorithm, .missingKeyID, .unknownKeyID, .unusableKey, .algorithmMismatch, .badSignature: .invalidKey
        case .unknownIssuer: .invalidIssuer
        case .audienceMismatch: .invalidAudience
        case .otherStreamsIssuer: .accessDenied
        default: .invalidRequest
        }
    }

    /// Whether the same token may verify later (the issuer's keys were unreachable).
    public var isRetryable: Bool { kind == .keysUnavailable }

    /// The code to report: the RFC 8935 code, or `keys_unavailable`.
    public var reportedCode: String { code?.rawValue ?? "keys_unavailable" }
}

/// Shortens untrusted text before it goes into an error message or a log.
func quoted(_ text: String, limit: Int = 80) -> String {
    // Counted in scalars, not characters: one character may hold any number of combining
    // marks, and the limit must bound the bytes echoed.
    var cleaned = String.UnicodeScalarView()
    cleaned.append(contentsOf: text.unicodeScalars.prefix(limit + 1).map { isControl($0) ? "?" : $0 })
    if cleaned.count <= limit { return "\"\(String(cleaned))\"" }
    return "\"\(String(String.UnicodeScalarView(cleaned.prefix(limit))))…\""
}

/// A number of seconds for a message, whole. The claims a token carries may hold any number
/// JSON allows (1e300 is a valid `iat`), so this never converts what it cannot hold.
func wholeSeconds(_ value: Double) -> String {
    guard abs(value) < 1e15 else { return value > 0 ? "more than 10^15" : "less than -10^15" }
    return String(Int64(value.rounded(.towardZero)))
}
