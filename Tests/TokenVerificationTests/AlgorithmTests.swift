import SETMinting
import SecurityEvents
import Testing
import TokenVerification

/// Tokens signed by swift-crypto (BoringSSL) verify through Warden's OpenSSL path, for every
/// supported algorithm; a one-bit change to the signature fails each of them.
@Suite("Supported algorithms")
struct AlgorithmTests {
    static let keys: [SigningKey] = [
        Keys.rsa,
        try! SigningKey.rsa(keyID: "rs384", algorithm: "RS384"),
        try! SigningKey.rsa(keyID: "rs512", algorithm: "RS512"),
        try! SigningKey.rsa(keyID: "ps256", algorithm: "PS256"),
        try! SigningKey.rsa(keyID: "ps384", algorithm: "PS384"),
        try! SigningKey.rsa(keyID: "ps512", algorithm: "PS512"),
        Keys.rsa3072,
        SigningKey.ec(keyID: "es256", algorithm: "ES256"),
        SigningKey.ec(keyID: "es384", algorithm: "ES384"),
        SigningKey.ec(keyID: "es512", algorithm: "ES512"),
        SigningKey.ed25519(keyID: "ed25519"),
    ]

    @Test(arguments: AlgorithmTests.keys)
    func verifiesAndRejectsFlippedSignature(_ key: SigningKey) async throws {
        let clock = ManualClock()
        let verifier = Fixture.pinnedVerifier(keys: AlgorithmTests.keys, algorithms: Set(JOSEAlgorithm.allCases), clock: clock)
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: key)
        let verified = await verifier.verify(token)
        #expect(verified.value?.header.algorithm.rawValue == key.algorithm, "\(String(describing: verified.error))")

        var parts = token.split(separator: ".").map(String.init)
        var signature = Base64URL.decode(parts[2])!
        signature[signature.count / 2] ^= 0x01
        parts[2] = Base64URL.encode(signature)
        #expect(await verifier.verify(parts.joined(separator: ".")).error?.kind == .badSignature)
    }

    @Test func keysWithoutAlgBindToTheirFamily() async throws {
        let clock = ManualClock()
        var rsa = try SigningKey.rsa(keyID: "bare", algorithm: "PS384")
        rsa.publishesAlgorithm = false
        let verifier = Fixture.pinnedVerifier(keys: [rsa], algorithms: [.ps384, .rs256], clock: clock)
        #expect(await verifier.verify(try SETMinter.token(claims: Fixture.riscClaims(clock), key: rsa)).value != nil)
        // The same RSA key cannot be used with an EC algorithm.
        let forged = try SETMinter.token(header: ["alg": "ES256", "kid": "bare"], claims: Fixture.riscClaims(clock), key: rsa)
        let v2 = Fixture.pinnedVerifier(keys: [rsa], algorithms: [.es256], clock: clock)
        #expect(await v2.verify(forged).error?.kind == .algorithmMismatch)
    }

    @Test func thumbprintFollowsRFC7638() throws {
        // RFC 7638 §3.1's example key and thumbprint.
        let jwk: JSONObject = [
            "kty": "RSA", "kid": "2011-04-29", "alg": "RS256", "e": "AQAB",
            "n": "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw",
        ]
        guard case .success(let key) = KeySet.makeKey(jwk, keyID: "2011-04-29") else {
            Issue.record("the RFC 7638 example key was refused")
            return
        }
        #expect(key.thumbprint == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs")
    }
}

extension SigningKey: CustomTestStringConvertible {
    public var testDescription: String { "\(algorithm) \(keyID)" }
}
