import CWardenCrypto

/// The JWS algorithms Warden verifies. HMAC and `none` are deliberately absent: they can never
/// be configured, so no token can select them.
public enum JOSEAlgorithm: String, Sendable, Hashable, CaseIterable, Comparable {
    case rs256 = "RS256", rs384 = "RS384", rs512 = "RS512"
    case ps256 = "PS256", ps384 = "PS384", ps512 = "PS512"
    case es256 = "ES256", es384 = "ES384", es512 = "ES512"
    case edDSA = "EdDSA"

    public enum Family: String, Sendable { case rsa = "RSA", ec = "EC", okp = "OKP" }

    public var family: Family {
        switch self {
        case .rs256, .rs384, .rs512, .ps256, .ps384, .ps512: .rsa
        case .es256, .es384, .es512: .ec
        case .edDSA: .okp
        }
    }

    /// For ECDSA: the curve the key must be on.
    public var curve: String? {
        switch self {
        case .es256: "P-256"
        case .es384: "P-384"
        case .es512: "P-521"
        default: nil
        }
    }

    var cValue: warden_alg {
        switch self {
        case .rs256: WARDEN_RS256
        case .rs384: WARDEN_RS384
        case .rs512: WARDEN_RS512
        case .ps256: WARDEN_PS256
        case .ps384: WARDEN_PS384
        case .ps512: WARDEN_PS512
        case .es256: WARDEN_ES256
        case .es384: WARDEN_ES384
        case .es512: WARDEN_ES512
        case .edDSA: WARDEN_EDDSA
        }
    }

    public static func < (a: Self, b: Self) -> Bool { a.rawValue < b.rawValue }

    /// The algorithms as bits of a mask, for checks on the verification path.
    static func mask(_ algorithms: Set<JOSEAlgorithm>) -> UInt32 {
        algorithms.reduce(0) { $0 | 1 << UInt32($1.ordinal) }
    }

    var bit: UInt32 { 1 << UInt32(ordinal) }

    /// A dense index, for per-algorithm tables.
    var ordinal: Int {
        switch self {
        case .rs256: 0
        case .rs384: 1
        case .rs512: 2
        case .ps256: 3
        case .ps384: 4
        case .ps512: 5
        case .es256: 6
        case .es384: 7
        case .es512: 8
        case .edDSA: 9
        }
    }

    /// Explains why a name that is not a supported algorithm is refused.
    public static func refusal(for name: String) -> String {
        let upper = name.uppercased()
        if upper == "NONE" { return "unsigned tokens (alg \"none\") are never accepted" }
        if upper.hasPrefix("HS") { return "HMAC algorithms (\(quoted(name, limit: 16))) are never accepted from an external issuer" }
        return "the algorithm \(quoted(name, limit: 32)) is not supported (supported: \(allCases.map(\.rawValue).joined(separator: ", ")))"
    }
}
