import Crypto
import Foundation

/// A reference to one OAuth token, as `token-revoked` events carry it (SPEC §1.3, §3.4).
public struct TokenReference: Sendable, Hashable, CustomStringConvertible {
    public enum IdentifierAlgorithm: String, Sendable, Hashable, CaseIterable {
        /// The whole token.
        case plain
        /// The first 16 characters of the token.
        case prefix
        /// Standard base64 (padded) of SHA-512(SHA-512(token's UTF-8 bytes)).
        case hashBase64SHA512SHA512 = "hash_base64_sha512_sha512"
    }

    public var tokenType: String
    public var identifierAlgorithm: IdentifierAlgorithm
    /// The identifier as sent: the token, its prefix, or its hash. Treat as a secret.
    public var value: String

    public init(tokenType: String, identifierAlgorithm: IdentifierAlgorithm, value: String) {
        self.tokenType = tokenType
        self.identifierAlgorithm = identifierAlgorithm
        self.value = value
    }

    /// A form safe for logs and reports: a few leading characters only.
    public var redacted: String { TokenFingerprint.redact(value) }

    public var description: String { "\(identifierAlgorithm.rawValue):\(redacted)" }

    /// Whether `held` is the token this reference names, compared in constant time. For a hash
    /// identifier that does not match the standard recipe, the other encodings public receivers
    /// have seen are tried too (SPEC §1.3); the result says which matched.
    public func match(_ held: HeldTokenIdentifiers) -> TokenMatch? {
        switch identifierAlgorithm {
        case .plain:
            return constantTimeEquals(value, held.token) ? .plain : nil
        case .prefix:
            return constantTimeEquals(value, held.prefix) ? .prefix : nil
        case .hashBase64SHA512SHA512:
            if constantTimeEquals(value, held.hash) { return .hash }
            if constantTimeEquals(value, held.hashBase64URL) { return .hashBase64URL }
            if constantTimeEquals(value, held.hashOfHex) { return .hashOfHexDigest }
            return nil
        }
    }
}

/// Which identifier recipe matched a held token.
public enum TokenMatch: String, Sendable, Hashable {
    case plain, prefix, hash
    /// base64url without padding instead of padded base64.
    case hashBase64URL = "hash-base64url"
    /// SHA-512 of the hex text of the first digest.
    case hashOfHexDigest = "hash-of-hex"
}

/// Both identifiers Google may send for a token we hold, computed once per held token.
public struct HeldTokenIdentifiers: Sendable, Hashable {
    public let token: String
    /// The first 16 characters.
    public let prefix: String
    /// Standard base64 with padding of SHA-512(SHA-512(UTF-8 bytes)): 88 characters.
    public let hash: String
    let hashBase64URL: String
    let hashOfHex: String

    public init(token: String) {
        self.token = token
        self.prefix = String(token.prefix(16))
        let first = SHA512.hash(data: Array(token.utf8))
        let second = SHA512.hash(data: Array(first))
        self.hash = Data(second).base64EncodedString()
        self.hashBase64URL = Base64URL.encode(Array(second))
        let hex = first.map { String(format: "%02x", $0) }.joined()
        self.hashOfHex = Data(SHA512.hash(data: Array(hex.utf8))).base64EncodedString()
    }

    /// The identifiers an index keyed like DESIGN.md's token-store index would use.
    public var indexKeys: [String] { ["prefix:" + prefix, "sha512:" + hash] }
}

/// A secret's SHA-256, kept to compare presented secrets with (`secretMatches`).
public func secretDigest(_ secret: [UInt8]) -> [UInt8] { Array(SHA256.hash(data: secret)) }

/// Whether `presented` is a secret whose digest (`secretDigest`) is one of `digests`. Digests
/// are compared, each in full: the time taken depends on neither secret's length nor on where
/// they differ, nor on which of them matched.
public func secretMatches(_ presented: [UInt8], digests: [[UInt8]]) -> Bool {
    let digest = secretDigest(presented)
    var matched = false
    for held in digests where constantTimeEquals(digest, held) { matched = true }
    return matched
}

/// Compares two strings' UTF-8 bytes in time that depends only on their lengths.
public func constantTimeEquals(_ a: String, _ b: String) -> Bool {
    constantTimeEquals(Array(a.utf8), Array(b.utf8))
}

public func constantTimeEquals(_ a: [UInt8], _ b: [UInt8]) -> Bool {
    var difference = UInt8(truncatingIfNeeded: a.count ^ b.count)
    if a.count != b.count { difference |= 1 }
    let n = min(a.count, b.count)
    // Walk the longer length so timing does not reveal the common prefix length.
    for i in 0..<max(a.count, b.count) {
        let x = i < n ? a[i] : 0
        let y = i < n ? b[i] : 0
        difference |= x ^ y
    }
    return difference == 0
}

/// Short, non-reversible renderings of secrets for logs and errors.
public enum TokenFingerprint {
    /// The first few characters followed by an ellipsis and the length.
    public static func redact(_ secret: String, keep: Int = 6) -> String {
        let count = secret.count
        if count <= keep { return String(repeating: "*", count: count) }
        return String(secret.prefix(keep)) + "…(\(count))"
    }

    /// A stable 12-character base64url SHA-256 fingerprint of a secret or token.
    public static func fingerprint(_ bytes: some Sequence<UInt8>) -> String {
        String(Base64URL.encode(Array(SHA256.hash(data: Array(bytes)))).prefix(12))
    }
}
