import Foundation
import SETMinting
import SecurityEvents
import Testing
import TokenVerification
import WardenTestSupport

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

    /// SPEC §4 row 2: each key is bound to exactly one algorithm.
    @Test func aKeyWithoutAlgIsBoundToTheOneAlgorithmOfItsTypeTheIssuerAllows() async throws {
        let clock = ManualClock()
        var rsa = try SigningKey.rsa(keyID: "bare", algorithm: "PS384")
        rsa.publishesAlgorithm = false
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: rsa)
        let verifier = Fixture.pinnedVerifier(keys: [rsa], algorithms: [.ps384, .es256], clock: clock)
        #expect(await verifier.verify(token).value != nil)
        // The same RSA key cannot be used with an EC algorithm.
        let forged = try SETMinter.token(header: ["alg": "ES256", "kid": "bare"], claims: Fixture.riscClaims(clock), key: rsa)
        #expect(await verifier.verify(forged).error?.kind == .algorithmMismatch)
        // Nor with two RSA algorithms: with several allowed, a key naming no "alg" is used with none.
        let ambiguous = Fixture.pinnedVerifier(keys: [rsa], algorithms: [.ps384, .rs256], clock: clock)
        let refused = await ambiguous.verify(token)
        #expect(refused.error?.kind == .unusableKey)
        #expect(refused.error?.description.contains("PS384, RS256") == true, "\(String(describing: refused.error))")
        // A JWK that names its "alg" is bound to it whatever else the issuer allows.
        rsa.publishesAlgorithm = true
        #expect(await Fixture.pinnedVerifier(keys: [rsa], algorithms: [.ps384, .rs256], clock: clock).verify(token).value != nil)
    }

    /// RSASSA-PKCS1-v1_5 compares the whole encoded message: a signature whose DigestInfo names
    /// another hash, or whose padding is PSS, does not verify under an RS header.
    @Test(arguments: [("RS384", "RS256"), ("RS256", "RS512"), ("PS256", "RS256"), ("RS256", "PS256")])
    func signatureMustUseTheHeadersHashAndPadding(_ signedAs: String, _ claimedAs: String) async throws {
        let clock = ManualClock()
        var key = try SigningKey.rsa(keyID: "bare", algorithm: signedAs)
        key.publishesAlgorithm = false
        let honest = try SETMinter.token(claims: Fixture.riscClaims(clock), key: key)
        let signed = try #require(JOSEAlgorithm(rawValue: signedAs)), claimed = try #require(JOSEAlgorithm(rawValue: claimedAs))
        #expect(await Fixture.pinnedVerifier(keys: [key], algorithms: [signed], clock: clock).verify(honest).value != nil)
        // The key, naming no "alg", is bound to the one RSA algorithm the issuer allows: the header's.
        let verifier = Fixture.pinnedVerifier(keys: [key], algorithms: [claimed], clock: clock)
        let mislabelled = try SETMinter.token(header: ["alg": .string(claimedAs), "kid": "bare"],
                                              claims: Fixture.riscClaims(clock), key: key)
        #expect(await verifier.verify(mislabelled).error?.kind == .badSignature)
    }

    /// RFC 8017 §8.2.2 / §5.2.2: a signature representative not below the modulus is refused,
    /// even s + n, which reduces to a valid signature.
    @Test func rsaSignatureNotBelowTheModulusIsRefused() async throws {
        let clock = ManualClock()
        // s + n must fit in k bytes: find a key whose modulus starts low, then a signature that does.
        var found: (key: SigningKey, token: String, sum: [UInt8])? = nil
        search: for _ in 0..<40 {
            let key = try SigningKey.rsa(keyID: "low-n", algorithm: "RS256")
            let modulus = Base64URL.decode(key.publicJWK["n"]!.stringValue!)!
            guard modulus[0] <= 0xB0 else { continue }
            for _ in 0..<60 {
                let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: key)
                let signature = Base64URL.decode(String(token.split(separator: ".")[2]))!
                var sum = [UInt8](repeating: 0, count: modulus.count), carry = 0
                for i in stride(from: modulus.count - 1, through: 0, by: -1) {
                    let t = Int(modulus[i]) + Int(signature[i]) + carry
                    sum[i] = UInt8(t & 0xFF)
                    carry = t >> 8
                }
                if carry == 0 { found = (key, token, sum); break search }
            }
        }
        let (key, token, sum) = try #require(found)
        let verifier = Fixture.pinnedVerifier(keys: [key], clock: clock)
        #expect(await verifier.verify(token).value != nil)
        let parts = token.split(separator: ".").map(String.init)
        let modulus = Base64URL.decode(key.publicJWK["n"]!.stringValue!)!
        for candidate in [sum, modulus, [UInt8](repeating: 0xFF, count: modulus.count)] {
            let forged = parts[0] + "." + parts[1] + "." + Base64URL.encode(candidate)
            #expect(await verifier.verify(forged).error?.kind == .badSignature)
        }
    }

    /// Public exponents other than 65537 (e = 3, 17, 65539), with keys and signatures made by the
    /// openssl command-line tool: an independent signer for the square-and-multiply check.
    @Test(arguments: [3, 17, 65539])
    func rsaKeysWithOtherExponentsVerify(_ exponent: Int) async throws {
        let clock = ManualClock()
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("warden-rsa-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let pem = directory.appendingPathComponent("key.pem").path
        _ = try await openssl(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
                         "-pkeyopt", "rsa_keygen_pubexp:\(exponent)", "-out", pem])
        let modulusLine = String(decoding: try await openssl(["rsa", "-in", pem, "-noout", "-modulus"]), as: UTF8.self)
        let hex = Array(modulusLine.trimmingCharacters(in: .whitespacesAndNewlines).dropFirst("Modulus=".count))
        let modulus = stride(from: 0, to: hex.count, by: 2).map { UInt8(String(hex[$0..<$0 + 2]), radix: 16)! }
        var e = [UInt8](), rest = exponent
        while rest > 0 { e.insert(UInt8(rest & 0xFF), at: 0); rest >>= 8 }
        let jwk: JSONObject = ["kty": "RSA", "kid": "other-e", "alg": "RS256", "use": "sig",
                               "n": .string(Base64URL.encode(modulus)), "e": .string(Base64URL.encode(e))]
        let jwks = JSONValue.object(["keys": [.object(jwk)]]).jsonText
        let policy = IssuerPolicy(issuer: Fixture.issuer, keySource: .pinned(document: Array(jwks.utf8), origin: "test"),
                                  audiences: [Fixture.audience], algorithms: [.rs256])
        let cache = IssuerKeyCache(issuer: Fixture.issuer, source: policy.keySource, settings: policy.keyCache,
                                   fetcher: OfflineKeyFetcher(reason: "no network in this test"), clock: clock.wall, logger: Fixture.quietLogger)
        let verifier = SETVerifier(issuers: [.init(policy: policy, keys: cache)], clock: clock.wall)

        let input = Base64URL.encode(#"{"alg":"RS256","kid":"other-e"}"#) + "."
            + Base64URL.encode(JSONValue.object(Fixture.riscClaims(clock)).jsonText)
        let message = directory.appendingPathComponent("input").path
        try Data(input.utf8).write(to: URL(fileURLWithPath: message))
        var signature = try await openssl(["dgst", "-sha256", "-sign", pem, message])
        #expect(await verifier.verify(input + "." + Base64URL.encode(signature)).value != nil)
        signature[7] ^= 0x40
        #expect(await verifier.verify(input + "." + Base64URL.encode(signature)).error?.kind == .badSignature)
    }

    private func openssl(_ arguments: [String]) async throws -> [UInt8] {
        let result = try await runToEnd(URL(fileURLWithPath: "/usr/bin/openssl"), arguments)
        guard result.status == 0 else {
            throw CocoaError(.executableLoad, userInfo: [NSLocalizedDescriptionKey: "openssl \(arguments.first ?? "") failed: \(result.stderr)"])
        }
        return Array(result.output)
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
