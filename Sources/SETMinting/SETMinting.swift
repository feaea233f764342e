public import Crypto
public import _CryptoExtras
public import Foundation
public import SecurityEvents

/// A private key that signs test and development tokens, with its public JWK.
public struct SigningKey: Sendable {
    public enum Material: Sendable {
        case rsa(_RSA.Signing.PrivateKey)
        case p256(P256.Signing.PrivateKey)
        case p384(P384.Signing.PrivateKey)
        case p521(P521.Signing.PrivateKey)
        case ed25519(Curve25519.Signing.PrivateKey)
    }

    public var keyID: String
    /// The JWS `alg` this key signs with.
    public var algorithm: String
    public var material: Material
    /// Whether the public JWK names its `alg`.
    public var publishesAlgorithm = true

    public init(keyID: String, algorithm: String, material: Material) {
        self.keyID = keyID
        self.algorithm = algorithm
        self.material = material
    }

    /// A fresh RSA key (RS256/384/512 or PS256/384/512). Sizes under 2048 bits are for tests of refusal.
    public static func rsa(keyID: String = "rsa-\(UUID().uuidString.prefix(8))", algorithm: String = "RS256",
                           bits: Int = 2048) throws -> SigningKey {
        let key = bits >= 2048
            ? try _RSA.Signing.PrivateKey(keySize: .init(bitCount: bits))
            : try _RSA.Signing.PrivateKey(unsafeKeySize: .init(bitCount: bits))
        return SigningKey(keyID: keyID, algorithm: algorithm, material: .rsa(key))
    }

    /// An RSA key read from PEM (PKCS#8 `BEGIN PRIVATE KEY`, or PKCS#1), signing RS256.
    public static func rsa(keyID: String, pkcs8PEM pem: String) throws -> SigningKey {
        SigningKey(keyID: keyID, algorithm: "RS256", material: .rsa(try _RSA.Signing.PrivateKey(pemRepresentation: pem)))
    }

    public static func ec(keyID: String = "ec-\(UUID().uuidString.prefix(8))", algorithm: String = "ES256") -> SigningKey {
        switch algorithm {
        case "ES384": SigningKey(keyID: keyID, algorithm: algorithm, material: .p384(P384.Signing.PrivateKey()))
        case "ES512": SigningKey(keyID: keyID, algorithm: algorithm, material: .p521(P521.Signing.PrivateKey()))
        default: SigningKey(keyID: keyID, algorithm: algorithm, material: .p256(P256.Signing.PrivateKey()))
        }
    }

    public static func ed25519(keyID: String = "ed-\(UUID().uuidString.prefix(8))") -> SigningKey {
        SigningKey(keyID: keyID, algorithm: "EdDSA", material: .ed25519(Curve25519.Signing.PrivateKey()))
    }

    /// The public JWK (RFC 7517) as a JWKS entry would carry it.
    public var publicJWK: JSONObject {
        var jwk = JSONObject()
        switch material {
        case .rsa(let key):
            let primitives = try! key.publicKey.getKeyPrimitives()
            jwk["kty"] = "RSA"
            jwk["n"] = .string(Base64URL.encode(Array(primitives.modulus)))
            jwk["e"] = .string(Base64URL.encode(Array(primitives.publicExponent)))
        case .p256(let key): jwk = Self.ecJWK("P-256", key.publicKey.x963Representation)
        case .p384(let key): jwk = Self.ecJWK("P-384", key.publicKey.x963Representation)
        case .p521(let key): jwk = Self.ecJWK("P-521", key.publicKey.x963Representation)
        case .ed25519(let key):
            jwk["kty"] = "OKP"
            jwk["crv"] = "Ed25519"
            jwk["x"] = .string(Base64URL.encode(Array(key.publicKey.rawRepresentation)))
        }
        jwk["kid"] = .string(keyID)
        jwk["use"] = "sig"
        if publishesAlgorithm { jwk["alg"] = .string(algorithm) }
        return jwk
    }

    static func ecJWK(_ curve: String, _ x963: Data) -> JSONObject {
        let bytes = Array(x963.dropFirst())
        let half = bytes.count / 2
        return ["kty": "EC", "crv": .string(curve),
                "x": .string(Base64URL.encode(Array(bytes[..<half]))),
                "y": .string(Base64URL.encode(Array(bytes[half...])))]
    }

    /// An RSA key's private key as PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`), as a Google
    /// service-account key file holds it; nil for other keys.
    public var privateKeyPEM: String? {
        guard case .rsa(let key) = material else { return nil }
        return key.pkcs8PEMRepresentation
    }

    /// Whether `compact` carries a valid RS256 signature by this (RSA) key: for tests of what
    /// Warden signs.
    public func verifies(_ compact: String) -> Bool {
        guard case .rsa(let key) = material else { return false }
        let parts = compact.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let signature = Base64URL.decode(String(parts[2])) else { return false }
        let input = Array((parts[0] + "." + parts[1]).utf8)
        return key.publicKey.isValidSignature(_RSA.Signing.RSASignature(rawRepresentation: signature), for: SHA256.hash(data: input),
                                              padding: .insecurePKCS1v1_5)
    }

    /// Signs the JWS signing input.
    public func sign(_ input: [UInt8]) throws -> [UInt8] {
        switch material {
        case .rsa(let key):
            let padding: _RSA.Signing.Padding = algorithm.hasPrefix("PS") ? .PSS : .insecurePKCS1v1_5
            let signature: _RSA.Signing.RSASignature
            switch algorithm.suffix(3) {
            case "384": signature = try key.signature(for: SHA384.hash(data: input), padding: padding)
            case "512": signature = try key.signature(for: SHA512.hash(data: input), padding: padding)
            default: signature = try key.signature(for: SHA256.hash(data: input), padding: padding)
            }
            return Array(signature.rawRepresentation)
        case .p256(let key): return Array(try key.signature(for: input).rawRepresentation)
        case .p384(let key): return Array(try key.signature(for: input).rawRepresentation)
        case .p521(let key): return Array(try key.signature(for: input).rawRepresentation)
        case .ed25519(let key): return Array(try key.signature(for: input))
        }
    }
}

/// Builds compact JWS tokens and JWKS documents.
public enum SETMinter {
    /// A JWKS document holding the public keys.
    public static func jwks(_ keys: [SigningKey], extra: [JSONObject] = []) -> String {
        JSONValue.object(["keys": .array(keys.map { .object($0.publicJWK) } + extra.map { .object($0) })]).jsonText
    }

    /// The standard header for a key: alg, kid and (optionally) typ.
    public static func header(for key: SigningKey, type: String? = nil) -> JSONObject {
        var header: JSONObject = ["alg": .string(key.algorithm), "kid": .string(key.keyID)]
        if let type { header["typ"] = .string(type) }
        return header
    }

    /// Signs header and claims into a compact JWS.
    public static func token(header: JSONObject, claims: JSONObject, key: SigningKey) throws -> String {
        try token(headerJSON: JSONValue.object(header).jsonText, claimsJSON: JSONValue.object(claims).jsonText, key: key)
    }

    public static func token(claims: JSONObject, key: SigningKey, type: String? = nil) throws -> String {
        try token(header: header(for: key, type: type), claims: claims, key: key)
    }

    /// Signs raw JSON texts, so tests can craft what a JSON encoder would refuse (duplicate names).
    public static func token(headerJSON: String, claimsJSON: String, key: SigningKey) throws -> String {
        let input = Base64URL.encode(headerJSON) + "." + Base64URL.encode(claimsJSON)
        let signature = try key.sign(Array(input.utf8))
        return input + "." + Base64URL.encode(signature)
    }

    /// Assembles a token from raw parts without signing (for forged-signature tests).
    public static func unsigned(headerJSON: String, claimsJSON: String, signature: [UInt8]) -> String {
        Base64URL.encode(headerJSON) + "." + Base64URL.encode(claimsJSON) + "." + Base64URL.encode(signature)
    }

    /// Claims of a Google-style RISC SET with one event whose subject is an `iss-sub` account.
    public static func riscClaims(issuer: String, audience: String, event: EventType = .sessionsRevoked,
                                  subject: String = "10987654321", extra: JSONObject = [:],
                                  jti: String = UUID().uuidString, issuedAt: Double = Date().timeIntervalSince1970) -> JSONObject {
        var payload: JSONObject = ["subject": ["subject_type": "iss-sub", "iss": .string(issuer), "sub": .string(subject)]]
        for (name, value) in extra { payload[name] = value }
        return ["iss": .string(issuer), "aud": .string(audience), "iat": .number(issuedAt.rounded(.down)),
                "jti": .string(jti), "events": .object([event.uri: .object(payload)])]
    }
}
