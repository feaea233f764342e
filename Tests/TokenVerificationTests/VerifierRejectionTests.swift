import Crypto
import Foundation
import SETMinting
import SecurityEvents
import Testing
import TokenVerification

/// One test per rule of SPEC.md §4 (and the other rejections the verifier promises).
@Suite("Verifier rejections")
struct VerifierRejectionTests {
    let clock = ManualClock()

    func verifier(_ keys: [SigningKey] = [Keys.rsa], profile: TokenProfile = .risc,
                  algorithms: Set<JOSEAlgorithm> = [.rs256], extraJWKs: [JSONObject] = [],
                  maximumAge: Double? = nil, maximumTokenBytes: Int = 64 * 1024) -> SETVerifier {
        Fixture.pinnedVerifier(keys: keys, extraJWKs: extraJWKs, profile: profile, algorithms: algorithms,
                               maximumAge: maximumAge, clock: clock, maximumTokenBytes: maximumTokenBytes)
    }

    var claimsJSON: String { JSONValue.object(Fixture.riscClaims(clock)).jsonText }

    func expect(_ result: Result<VerifiedSET, VerificationError>, _ kind: VerificationError.Kind, _ code: SETErrorCode?,
                sourceLocation: SourceLocation = #_sourceLocation) {
        #expect(result.error?.kind == kind, "got \(String(describing: result.error))", sourceLocation: sourceLocation)
        #expect(result.error?.code == code, sourceLocation: sourceLocation)
    }

    @Test func acceptsAGenuineGoogleSET() async throws {
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa)
        let verified = try #require(await verifier().verify(token).value)
        #expect(verified.token.events.first?.type == .sessionsRevoked)
        #expect(verified.header.keyID == "rsa-1")
    }

    // §4 row 1
    @Test(arguments: ["none", "None", "noNE", "NONE"])
    func refusesAlgNone(_ alg: String) async {
        let header = #"{"alg":"\#(alg)","kid":"rsa-1"}"#
        // Unsigned: empty signature part. And with a junk signature.
        let unsigned = Base64URL.encode(header) + "." + Base64URL.encode(claimsJSON) + "."
        expect(await verifier().verify(unsigned), .unsupportedAlgorithm, .invalidKey)
        let junk = SETMinter.unsigned(headerJSON: header, claimsJSON: claimsJSON, signature: [1, 2, 3])
        expect(await verifier().verify(junk), .unsupportedAlgorithm, .invalidKey)
    }

    // §4 row 2: HS256 signed with the issuer's RSA public key as the HMAC secret.
    @Test func refusesHMACKeyConfusion() async throws {
        let header = #"{"alg":"HS256","kid":"rsa-1"}"#
        let input = Base64URL.encode(header) + "." + Base64URL.encode(claimsJSON)
        let publicKeyBytes = Array(JSONValue.object(Keys.rsa.publicJWK).jsonText.utf8)
        let mac = HMAC<SHA256>.authenticationCode(for: Array(input.utf8), using: SymmetricKey(data: publicKeyBytes))
        let token = input + "." + Base64URL.encode(Array(mac))
        expect(await verifier().verify(token), .unsupportedAlgorithm, .invalidKey)
    }

    // §4 row 2: a symmetric key in the JWKS is never usable, even under an RSA alg.
    @Test func refusesSymmetricJWKs() async throws {
        let oct: JSONObject = ["kty": "oct", "kid": "sym", "k": .string(Base64URL.encode(Array(repeating: 7, count: 32)))]
        var key = Keys.rsa
        key.keyID = "sym"
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: key)
        let result = await verifier(extraJWKs: [oct]).verify(token)
        expect(result, .unusableKey, .invalidKey)
        #expect(result.error?.description.contains("symmetric") == true)
    }

    // §4 row 3
    @Test(arguments: ["jwk", "jku", "x5u", "x5c"])
    func refusesKeyMaterialInHeader(_ member: String) async throws {
        let value: JSONValue = member == "jwk" ? .object(Keys.rsa.publicJWK)
            : member == "x5c" ? .array(["MIIB"]) : .string("https://attacker.example/keys")
        var header = SETMinter.header(for: Keys.rsa)
        header[member] = value
        let token = try SETMinter.token(header: header, claims: Fixture.riscClaims(clock), key: Keys.rsa)
        expect(await verifier().verify(token), .headerKeyMaterial, .invalidRequest)
    }

    // §4 row 4
    @Test func refusesUnknownKeyID() async throws {
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsaRotated)
        expect(await verifier().verify(token), .unknownKeyID, .invalidKey)
    }

    @Test(arguments: [String(repeating: "k", count: 300), ""])
    func refusesOversizedOrEmptyKeyID(_ kid: String) async throws {
        var header = SETMinter.header(for: Keys.rsa)
        header["kid"] = .string(kid)
        let token = try SETMinter.token(header: header, claims: Fixture.riscClaims(clock), key: Keys.rsa)
        expect(await verifier().verify(token), .missingKeyID, .invalidKey)
    }

    @Test func refusesMissingKeyID() async throws {
        let token = try SETMinter.token(header: ["alg": "RS256"], claims: Fixture.riscClaims(clock), key: Keys.rsa)
        expect(await verifier().verify(token), .missingKeyID, .invalidKey)
    }

    // §4 row 5 (CVE-2022-21449): r = s = 0, and r, s = n.
    @Test func refusesZeroAndOutOfRangeECDSASignatures() async throws {
        let ec = SigningKey.ec(keyID: "ec-1", algorithm: "ES256")
        let v = verifier([ec], algorithms: [.es256])
        let header = #"{"alg":"ES256","kid":"ec-1"}"#
        let zero = SETMinter.unsigned(headerJSON: header, claimsJSON: claimsJSON, signature: Array(repeating: 0, count: 64))
        expect(await v.verify(zero), .badSignature, .invalidKey)
        let n = bytes(hex: "FFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551")
        let atOrder = SETMinter.unsigned(headerJSON: header, claimsJSON: claimsJSON, signature: n + n)
        expect(await v.verify(atOrder), .badSignature, .invalidKey)
        // A DER-encoded signature (valid as DER) is not the JWS form.
        let input = Base64URL.encode(header) + "." + Base64URL.encode(claimsJSON)
        guard case .p256(let privateKey) = ec.material else { Issue.record("not P-256"); return }
        let der = Array(try privateKey.signature(for: Array(input.utf8)).derRepresentation)
        expect(await v.verify(input + "." + Base64URL.encode(der)), .badSignature, .invalidKey)
        // The same signature in R||S form is accepted.
        let raw = Array(try privateKey.signature(for: Array(input.utf8)).rawRepresentation)
        #expect(await v.verify(input + "." + Base64URL.encode(raw)).value != nil)
    }

    // §4 row 6
    @Test func refusesCrit() async throws {
        var header = SETMinter.header(for: Keys.rsa)
        header["crit"] = ["exp"]
        header["exp"] = 1
        let token = try SETMinter.token(header: header, claims: Fixture.riscClaims(clock), key: Keys.rsa)
        expect(await verifier().verify(token), .criticalHeader, .invalidRequest)
        var b64 = SETMinter.header(for: Keys.rsa)
        b64["b64"] = false
        let unencoded = try SETMinter.token(header: b64, claims: Fixture.riscClaims(clock), key: Keys.rsa)
        expect(await verifier().verify(unencoded), .criticalHeader, .invalidRequest)
    }

    // §4 row 7: in the header and in the claims.
    @Test func refusesDuplicateMembersInHeader() async throws {
        let token = try SETMinter.token(headerJSON: #"{"alg":"RS256","kid":"rsa-1","kid":"rsa-2"}"#,
                                        claimsJSON: claimsJSON, key: Keys.rsa)
        expect(await verifier().verify(token), .duplicateMember, .invalidRequest)
    }

    @Test func refusesDuplicateMembersInClaims() async throws {
        var text = claimsJSON
        text.removeLast()
        text += #","iss":"https://evil.example/"}"#
        let token = try SETMinter.token(headerJSON: #"{"alg":"RS256","kid":"rsa-1"}"#, claimsJSON: text, key: Keys.rsa)
        expect(await verifier().verify(token), .duplicateMember, .invalidRequest)
    }

    // §4 row 8: typ per profile.
    @Test func ssfRequiresSeceventType() async throws {
        let v = verifier(profile: .ssf)
        var claims = Fixture.riscClaims(clock)
        claims["sub_id"] = ["format": "opaque", "id": "strm-1"]
        let untyped = try SETMinter.token(claims: claims, key: Keys.rsa)
        expect(await v.verify(untyped), .wrongType, .invalidRequest)
        let wrong = try SETMinter.token(claims: claims, key: Keys.rsa, type: "JWT")
        expect(await v.verify(wrong), .wrongType, .invalidRequest)
        for typ in ["secevent+jwt", "application/secevent+jwt", "SecEvent+JWT"] {
            #expect(await v.verify(try SETMinter.token(claims: claims, key: Keys.rsa, type: typ)).value != nil, "\(typ)")
        }
    }

    @Test func riscRefusesOtherTypedTokens() async throws {
        for typ in ["at+jwt", "logout+jwt", "application/at+jwt"] {
            let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa, type: typ)
            expect(await verifier().verify(token), .wrongType, .invalidRequest)
        }
        #expect(await verifier().verify(try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa, type: "JWT")).value != nil)
    }

    // §4 row 9: an ID token (same Google keys, no events) is not a SET.
    @Test func refusesIDTokens() async throws {
        let idToken: JSONObject = ["iss": .string(Fixture.issuer), "aud": .string(Fixture.audience),
                                   "iat": .number(clock.now), "exp": .number(clock.now + 3600), "sub": "1",
                                   "jti": "id-1", "email": "a@gmail.com"]
        let result = await verifier().verify(try SETMinter.token(claims: idToken, key: Keys.rsa))
        expect(result, .missingClaim, .invalidRequest)
        #expect(result.error?.description.contains("events") == true)
    }

    @Test func setProfilesRefuseLogoutTokens() async throws {
        let logout: JSONObject = ["iss": .string(Fixture.issuer), "aud": .string(Fixture.audience), "iat": .number(clock.now),
                                  "exp": .number(clock.now + 120), "jti": "l-1", "sub": "1",
                                  "events": .object([EventURIPrefix.backchannelLogout: .object([:])])]
        expect(await verifier().verify(try SETMinter.token(claims: logout, key: Keys.rsa)), .wrongKindOfToken, .invalidRequest)
    }

    // §4 row 8: the kind's own claims are `events` with a known URI. A signed token whose
    // events are all unknown is not an event this receiver acts on (nor counts processed).
    @Test func refusesATokenWhoseEventsAreAllUnknown() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["events"] = .object(["https://example.com/other-event": .object([:])])
        let result = await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa))
        expect(result, .invalidEvent, result.error?.code)
        #expect(result.error?.description.contains("https://example.com/other-event") == true)
        // Beside a known one, an unknown event type is kept (and not acted on).
        var mixed = Fixture.riscClaims(clock)
        mixed["events"] = .object(["https://example.com/other-event": .object([:]),
                                   EventType.sessionsRevoked.uri: .object(["subject": .object(["subject_type": "iss-sub", "iss": .string(Fixture.issuer), "sub": "1"])])])
        #expect(await verifier().verify(try SETMinter.token(claims: mixed, key: Keys.rsa)).value != nil)
    }

    /// Attacker text in an error is bounded in bytes: one character with thousands of combining
    /// marks is still cut.
    @Test func quotedAttackerTextIsBoundedInBytes() async throws {
        let iss = "x" + String(repeating: "\u{301}", count: 20_000)
        let token = Base64URL.encode(#"{"alg":"RS256","kid":"rsa-1"}"#) + "." + Base64URL.encode(JSONValue.object(["iss": .string(iss)]).jsonText) + ".AAAA"
        let result = await verifier().verify(token)
        #expect(result.error != nil)
        #expect((result.error?.description.utf8.count ?? .max) < 1024, "\(result.error?.description.utf8.count ?? 0) bytes")
    }

    /// C1 control characters (U+009B is CSI, U+009D OSC) drive a terminal as their ESC forms
    /// do: none reaches an error's description, whatever the token says.
    @Test func c1ControlCharactersNeverReachAnErrorDescription() async throws {
        let iss = "https://x.example/\u{9b}2J\u{9d}52;c;cHduZWQ=\u{9c}"
        let token = Base64URL.encode(#"{"alg":"RS256","kid":"rsa-1"}"#) + "." + Base64URL.encode(JSONValue.object(["iss": .string(iss)]).jsonText) + ".AAAA"
        let description = try #require(await verifier().verify(token).error?.description)
        #expect(!description.unicodeScalars.contains { (0x80..<0xA0).contains($0.value) || $0.value < 0x20 }, "\(description.debugDescription)")
    }

    /// A modulus padded with leading zero bytes is the same key, sized without them.
    @Test func aZeroPaddedModulusIsSizedWithoutItsPadding() async throws {
        var jwk = Keys.rsa.publicJWK
        let n = try #require(jwk["n"]?.stringValue.flatMap { Base64URL.decode($0) })
        jwk["n"] = .string(Base64URL.encode(Array(repeating: 0, count: 100_000) + n))
        jwk["kid"] = "padded"
        var key = Keys.rsa
        key.keyID = "padded"
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: key)
        #expect(await verifier(extraJWKs: [jwk]).verify(token).value != nil)
    }

    // §4 row 10
    @Test func refusesRSAKeysUnder2048Bits() async throws {
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa1024)
        let result = await verifier([Keys.rsa1024]).verify(token)
        expect(result, .unusableKey, .invalidKey)
        #expect(result.error?.description.contains("1024") == true)
    }

    @Test func refusesKeysNotForSignatures() async throws {
        var jwk = Keys.rsaRotated.publicJWK
        jwk["use"] = "enc"
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsaRotated)
        expect(await verifier(extraJWKs: [jwk]).verify(token), .unusableKey, .invalidKey)
    }

    @Test func refusesAlgorithmOtherThanTheKeys() async throws {
        // The JWK says RS256; a PS256 token under the same kid is refused even though the issuer allows PS256.
        var ps = Keys.rsa
        ps.algorithm = "PS256"
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: ps)
        expect(await verifier(algorithms: [.rs256, .ps256]).verify(token), .algorithmMismatch, .invalidKey)
        // An ES384 header against a P-256 key.
        let ec = SigningKey.ec(keyID: "ec-256", algorithm: "ES256")
        var lying = ec
        lying.algorithm = "ES384"
        lying.publishesAlgorithm = false
        let forged = try SETMinter.token(header: ["alg": "ES384", "kid": "ec-256"], claims: Fixture.riscClaims(clock), key: ec)
        expect(await verifier([lying], algorithms: [.es256, .es384]).verify(forged), .algorithmMismatch, .invalidKey)
    }

    @Test func refusesAlgorithmsTheIssuerDoesNotAllow() async throws {
        let ec = SigningKey.ec(keyID: "ec-1", algorithm: "ES256")
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: ec)
        expect(await verifier([ec], algorithms: [.rs256]).verify(token), .unsupportedAlgorithm, .invalidKey)
    }

    /// RFC 7519 §4.1.5: not before its `nbf` (beyond the skew); an `nbf` that is no number is refused.
    @Test func refusesATokenBeforeItsNotBefore() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["nbf"] = .number(clock.now + 3600)
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .notYetValid, .invalidRequest)
        claims["nbf"] = "soon"
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .invalidClaim, .invalidRequest)
        claims["nbf"] = .number(clock.now + 299)
        #expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)).value != nil)
        claims["nbf"] = .number(clock.now - 60)
        #expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)).value != nil)
    }

    // §4 row 11
    @Test func refusesIssuedAtBeyondSkew() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["iat"] = .number(clock.now + 301)
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .issuedInFuture, .invalidRequest)
        claims["iat"] = .number(clock.now + 299)
        #expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)).value != nil)
    }

    @Test func acceptsOldSETsUnlessMaxAgeIsSet() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["iat"] = .number(clock.now - 90 * 86_400)
        let token = try SETMinter.token(claims: claims, key: Keys.rsa)
        #expect(await verifier().verify(token).value != nil)
        expect(await verifier(maximumAge: 30 * 86_400).verify(token), .tooOld, .invalidRequest)
    }

    @Test func doesNotCheckExpOnSETs() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["exp"] = .number(clock.now - 86_400)
        #expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)).value != nil)
    }

    // §4 row 12
    @Test(arguments: ["a.b", "a.b.c.d", "abc", "a..c", "..", "a.b.c.d.e.f"])
    func refusesWrongSegmentCounts(_ token: String) async {
        let kind = await verifier().verify(token).error?.kind
        #expect(kind == .malformed || kind == .unsupportedAlgorithm, "\(String(describing: kind))")
        #expect(await verifier().verify(token).error?.code != nil)
    }

    @Test func refusesBadEncoding() async throws {
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa)
        let parts = token.split(separator: ".").map(String.init)
        // Padding, standard-alphabet characters, whitespace, a non-JSON header.
        for bad in [parts[0] + "=." + parts[1] + "." + parts[2],
                    parts[0] + "." + parts[1] + "." + parts[2].replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/") + "+/",
                    parts[0] + "." + parts[1] + " ." + parts[2],
                    Base64URL.encode("not json") + "." + parts[1] + "." + parts[2],
                    Base64URL.encode("[1]") + "." + parts[1] + "." + parts[2]] {
            expect(await verifier().verify(bad), .malformed, .invalidRequest)
        }
    }

    @Test func refusesJWE() async {
        let jwe = Base64URL.encode(#"{"alg":"RSA-OAEP","enc":"A256GCM"}"#) + ".a.b.c.d"
        expect(await verifier().verify(jwe), .encrypted, .invalidRequest)
    }

    @Test func refusesCompression() async throws {
        var header = SETMinter.header(for: Keys.rsa)
        header["zip"] = "DEF"
        expect(await verifier().verify(try SETMinter.token(header: header, claims: Fixture.riscClaims(clock), key: Keys.rsa)),
               .compressed, .invalidRequest)
    }

    @Test func refusesTokensOverTheSizeLimit() async throws {
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock, extra: ["pad": .string(String(repeating: "x", count: 2000))]),
                                        key: Keys.rsa)
        expect(await verifier(maximumTokenBytes: 1024).verify(token), .tooLarge, .invalidRequest)
        let huge = String(repeating: "A", count: 70_000)
        expect(await verifier().verify(huge + "." + huge + "." + huge), .tooLarge, .invalidRequest)
    }

    // §4 row 13
    @Test func refusesWrongOrUnconfiguredIssuer() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["iss"] = "https://accounts.google.com"  // no trailing slash: not the configured string
        let result = await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa))
        expect(result, .unknownIssuer, .invalidIssuer)
        claims["iss"] = "https://attacker.example/"
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .unknownIssuer, .invalidIssuer)
        claims["iss"] = nil
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .missingClaim, .invalidRequest)
    }

    @Test func refusesWrongOrMissingAudience() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["aud"] = "other-client.apps.googleusercontent.com"
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .audienceMismatch, .invalidAudience)
        claims["aud"] = nil
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .audienceMismatch, .invalidAudience)
        claims["aud"] = .array(["x", .string(Fixture.audience)])
        #expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)).value != nil)
    }

    /// Issuer, audience and key id match byte for byte: a canonically equivalent spelling (the
    /// Kelvin sign U+212A for "K") names another issuer, audience or key.
    @Test func issuerAudienceAndKeyIDMatchByteForByte() async throws {
        let kelvin = "\u{212A}"
        #expect(kelvin == "K", "Swift holds the two equal: the verifier must not")
        func pinned(_ keys: [SigningKey] = [Keys.rsa], issuer: String = Fixture.issuer, audience: String = Fixture.audience) -> SETVerifier {
            Fixture.pinnedVerifier(keys: keys, issuer: issuer, audiences: [audience], clock: clock)
        }
        var claims = Fixture.riscClaims(clock)
        claims["aud"] = .string("\(kelvin)-app")
        expect(await pinned(audience: "K-app").verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .audienceMismatch, .invalidAudience)
        claims["aud"] = "K-app"
        #expect(await pinned(audience: "K-app").verify(try SETMinter.token(claims: claims, key: Keys.rsa)).value != nil)

        claims = Fixture.riscClaims(clock)
        claims["iss"] = .string("https://\(kelvin).example/")
        expect(await pinned(issuer: "https://K.example/").verify(try SETMinter.token(claims: claims, key: Keys.rsa)),
               .unknownIssuer, .invalidIssuer)
        claims["iss"] = "https://K.example/"
        #expect(await pinned(issuer: "https://K.example/").verify(try SETMinter.token(claims: claims, key: Keys.rsa)).value != nil)

        var published = Keys.rsa, forged = Keys.rsa
        published.keyID = "K1"
        forged.keyID = "\(kelvin)1"
        expect(await pinned([published]).verify(try SETMinter.token(claims: Fixture.riscClaims(clock), key: forged)), .unknownKeyID, .invalidKey)
        #expect(await pinned([published]).verify(try SETMinter.token(claims: Fixture.riscClaims(clock), key: published)).value != nil)
    }

    @Test func refusesMissingOrEmptyEvents() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["events"] = .object([:])
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .invalidClaim, .invalidRequest)
        claims["events"] = nil
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .missingClaim, .invalidRequest)
    }

    @Test func refusesMissingJTIOrIAT() async throws {
        for name in ["jti", "iat"] {
            var claims = Fixture.riscClaims(clock)
            claims[name] = nil
            let result = await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa))
            expect(result, .missingClaim, .invalidRequest)
            #expect(result.error?.description.contains(name) == true)
        }
    }

    @Test func refusesTamperedPayloadAndForeignKeys() async throws {
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa)
        let parts = token.split(separator: ".").map(String.init)
        var claims = Fixture.riscClaims(clock)
        claims["events"] = .object([EventType.accountEnabled.uri: .object(["subject": ["format": "opaque", "id": "x"]])])
        let swapped = Base64URL.encode(JSONValue.object(claims).jsonText)
        expect(await verifier().verify(parts[0] + "." + swapped + "." + parts[2]), .badSignature, .invalidKey)
        // Signed by another key that claims the same kid.
        let impostor = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsaImpostor)
        expect(await verifier().verify(impostor), .badSignature, .invalidKey)
        // A truncated signature.
        let short = Base64URL.encode(Base64URL.decode(parts[2])!.dropLast(3))
        expect(await verifier().verify(parts[0] + "." + parts[1] + "." + short), .badSignature, .invalidKey)
    }

    @Test func refusesEventsWithoutSubject() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["events"] = .object([EventType.sessionsRevoked.uri: .object([:])])
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .invalidEvent, .invalidRequest)
    }

    @Test func ssfProfileRules() async throws {
        let v = verifier(profile: .ssf)
        var claims = Fixture.riscClaims(clock)
        claims["events"] = .object([EventType.sessionRevoked.uri: .object([:])])
        // No sub_id.
        expect(await v.verify(try SETMinter.token(claims: claims, key: Keys.rsa, type: "secevent+jwt")), .missingClaim, .invalidRequest)
        claims["sub_id"] = ["format": "email", "email": "a@example.com"]
        #expect(await v.verify(try SETMinter.token(claims: claims, key: Keys.rsa, type: "secevent+jwt")).value != nil)
        var withSub = claims
        withSub["sub"] = "1"
        expect(await v.verify(try SETMinter.token(claims: withSub, key: Keys.rsa, type: "secevent+jwt")), .invalidClaim, .invalidRequest)
        var withExp = claims
        withExp["exp"] = .number(clock.now + 60)
        expect(await v.verify(try SETMinter.token(claims: withExp, key: Keys.rsa, type: "secevent+jwt")), .invalidClaim, .invalidRequest)
    }

    @Test func logoutProfileRules() async throws {
        let v = verifier(profile: .logout)
        let base: JSONObject = ["iss": .string(Fixture.issuer), "aud": .string(Fixture.audience), "iat": .number(clock.now),
                                "exp": .number(clock.now + 120), "jti": "l-1", "sid": "s-1",
                                "events": .object([EventURIPrefix.backchannelLogout: .object([:])])]
        #expect(await v.verify(try SETMinter.token(claims: base, key: Keys.rsa, type: "logout+jwt")).value != nil)
        var expired = base
        expired["exp"] = .number(clock.now - 120)
        expect(await v.verify(try SETMinter.token(claims: expired, key: Keys.rsa)), .expired, .invalidRequest)
        var noExp = base
        noExp["exp"] = nil
        expect(await v.verify(try SETMinter.token(claims: noExp, key: Keys.rsa)), .missingClaim, .invalidRequest)
        var nonce = base
        nonce["nonce"] = "n"
        expect(await v.verify(try SETMinter.token(claims: nonce, key: Keys.rsa)), .invalidClaim, .invalidRequest)
        var neither = base
        neither["sid"] = nil
        expect(await v.verify(try SETMinter.token(claims: neither, key: Keys.rsa)), .missingClaim, .invalidRequest)
        // A RISC SET is not a logout token.
        expect(await v.verify(try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa)), .wrongKindOfToken, .invalidRequest)
        // Logout tokens follow ID-token skew: 60 s.
        var future = base
        future["iat"] = .number(clock.now + 90)
        expect(await v.verify(try SETMinter.token(claims: future, key: Keys.rsa)), .issuedInFuture, .invalidRequest)
    }

    // Numbers JSON allows but no Int holds: refused with a message, never a trap (a trap on an
    // uncommitted message is a crash loop for every replica that takes its partition).
    @Test(arguments: [9.3e18, 1e300])
    func absurdIssuedAtIsRefusedWithoutTrapping(_ iat: Double) async throws {
        var claims = Fixture.riscClaims(clock)
        claims["iat"] = .number(iat)
        let result = await verifier(maximumAge: 3_600).verify(try SETMinter.token(claims: claims, key: Keys.rsa))
        expect(result, .issuedInFuture, .invalidRequest)
        #expect(result.error?.description.contains("10^15") == true)
    }

    @Test func logoutExpFarInThePastIsRefusedWithoutTrapping() async throws {
        let claims: JSONObject = ["iss": .string(Fixture.issuer), "aud": .string(Fixture.audience), "iat": .number(clock.now),
                                  "exp": .number(-9.3e18), "jti": "l-1", "sid": "s-1",
                                  "events": .object([EventURIPrefix.backchannelLogout: .object([:])])]
        let result = await verifier(profile: .logout).verify(try SETMinter.token(claims: claims, key: Keys.rsa))
        expect(result, .expired, .invalidRequest)
    }

    // Member names are compared by code points: "K" and the Kelvin sign (U+212A) are two names,
    // so neither is a duplicate of the other, and neither can be read as the other.
    @Test func memberNamesAreComparedByCodePoints() async throws {
        var text = claimsJSON
        text.removeLast()
        text += #","K":1,"\u212A":2}"#
        let token = try SETMinter.token(headerJSON: #"{"alg":"RS256","kid":"rsa-1"}"#, claimsJSON: text, key: Keys.rsa)
        let verified = try #require(await verifier().verify(token).value)
        #expect(verified.token.claims["K"] == .number(1))
        #expect(verified.token.claims["\u{212A}"] == .number(2))
        let parsed = try JSONParser.parse(Array(#"{"\u212Aid":"x"}"#.utf8))
        #expect(parsed.objectValue?["Kid"] == nil)
    }

    // U+0000 in what the ledger keeps as an identifier, or echoed into an error's description.
    @Test func nulInAnIdentifierIsRefusedAndNeverEchoed() async throws {
        var claims = Fixture.riscClaims(clock)
        claims["jti"] = "abc\u{0}def"
        expect(await verifier().verify(try SETMinter.token(claims: claims, key: Keys.rsa)), .invalidClaim, .invalidRequest)
        let kid = try SETMinter.token(headerJSON: #"{"alg":"RS256","kid":"rsa-1\u0000"}"#, claimsJSON: claimsJSON, key: Keys.rsa)
        expect(await verifier().verify(kid), .missingKeyID, .invalidKey)
        let alg = SETMinter.unsigned(headerJSON: #"{"alg":"X\u0000","kid":"rsa-1"}"#, claimsJSON: claimsJSON, signature: [1])
        let result = await verifier().verify(alg)
        expect(result, .unsupportedAlgorithm, .invalidKey)
        #expect(result.error?.description.utf8.contains(0) == false)
        // An event type with a NUL in its name, signed: the description does not carry it.
        var event = Fixture.riscClaims(clock)
        event["events"] = .object(["urn:x\u{0}": .string("not an object")])
        let invalid = await verifier().verify(try SETMinter.token(claims: event, key: Keys.rsa))
        #expect(invalid.error?.kind == .invalidEvent)
        #expect(invalid.error?.description.utf8.contains(0) == false)
    }

    // A signed token may carry tens of kilobytes of event URI or member name that a parse
    // error names: each dead letter, ledger row and log line would repeat it whole.
    @Test func aLongNameInASignedTokenIsCutInTheDescription() async throws {
        let long = "urn:x:" + String(repeating: "e", count: 40_000)
        var event = Fixture.riscClaims(clock)
        event["events"] = .object([long: .string("not an object")])
        let invalid = await verifier().verify(try SETMinter.token(claims: event, key: Keys.rsa))
        #expect(invalid.error?.kind == .invalidEvent)
        let description = invalid.error?.description ?? ""
        #expect(description.hasPrefix("the payload of event urn:x:eee"), "\(description.prefix(80))")
        #expect(description.unicodeScalars.count <= VerificationError.maximumDescriptionScalars + 1)
        #expect(description.hasSuffix("…"))
    }

    @Test func errorsNeverEchoTheToken() async throws {
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsaRotated)
        let signature = String(token.split(separator: ".")[2])
        let description = await verifier().verify(token).error?.description ?? ""
        #expect(!description.contains(signature))
        #expect(!description.contains(token))
    }
}

func bytes(hex: String) -> [UInt8] {
    let digits = Array(hex.utf8)
    return stride(from: 0, to: digits.count - 1, by: 2).map { i in
        UInt8(String(decoding: digits[i...(i + 1)], as: UTF8.self), radix: 16)!
    }
}
