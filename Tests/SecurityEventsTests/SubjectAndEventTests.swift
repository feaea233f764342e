import Testing
@testable import SecurityEvents

@Suite("Subject identifiers")
struct SubjectIdentifierTests {
    func parse(_ text: String) throws -> SubjectIdentifier {
        try SubjectIdentifier.parse(try JSONParser.parse(text), path: "subject")
    }

    @Test func rfc9493Formats() throws {
        #expect(try parse(#"{"format":"email","email":"a@example.com"}"#) == .email("a@example.com"))
        #expect(try parse(#"{"format":"phone_number","phone_number":"+12065550100"}"#) == .phoneNumber("+12065550100"))
        #expect(try parse(#"{"format":"iss_sub","iss":"https://i","sub":"1"}"#) == .issSub(iss: "https://i", sub: "1"))
        #expect(try parse(#"{"format":"opaque","id":"x"}"#) == .opaque("x"))
        #expect(try parse(#"{"format":"account","uri":"acct:a@example.com"}"#) == .account(uri: "acct:a@example.com"))
        #expect(try parse(#"{"format":"did","url":"did:example:123"}"#) == .did(url: "did:example:123"))
        #expect(try parse(#"{"format":"uri","uri":"https://example.com/u/1"}"#) == .uri("https://example.com/u/1"))
        #expect(try parse(#"{"format":"jwt_id","iss":"https://i","jti":"j"}"#) == .jwtID(iss: "https://i", jti: "j"))
        #expect(try parse(#"{"format":"saml_assertion_id","issuer":"https://i","assertion_id":"a"}"#)
                == .samlAssertionID(issuer: "https://i", assertionID: "a"))
        #expect(try parse(#"{"format":"aliases","identifiers":[{"format":"email","email":"a@x"},{"format":"opaque","id":"7"}]}"#)
                == .aliases([.email("a@x"), .opaque("7")]))
    }

    @Test func jsonTextIsTheNormalisedJSONForEveryFormat() throws {
        let texts = [
            #"{"format":"email","email":"a@example.com"}"#, #"{"format":"phone_number","phone_number":"+12065550100"}"#,
            #"{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"10987654321"}"#,
            #"{"format":"opaque","id":"quote\" backslash\\ tab\t"}"#, #"{"format":"account","uri":"acct:a@example.com"}"#,
            #"{"format":"did","url":"did:example:123"}"#, #"{"format":"uri","uri":"https://example.com/u/1"}"#,
            #"{"format":"jwt_id","iss":"https://i","jti":"j"}"#,
            #"{"format":"aliases","identifiers":[{"format":"email","email":"a@x"},{"format":"opaque","id":"7"}]}"#,
            #"{"format":"complex","session":{"format":"opaque","id":"s1"},"user":{"format":"iss_sub","iss":"https://i","sub":"u"}}"#,
            #"{"subject_type":"oauth_token","token_type":"refresh_token","token_identifier_alg":"prefix","token":"1//0gAbCdEfGhIjK"}"#,
        ]
        for text in texts {
            let subject = try parse(text)
            #expect(subject.jsonText == subject.json.jsonText, "\(text)")
        }
        #expect(try parse(texts[2]).jsonText == #"{"format":"iss_sub","iss":"https://accounts.google.com/","sub":"10987654321"}"#)
        #expect(try parse(texts[3]).jsonText == #"{"format":"opaque","id":"quote\" backslash\\ tab\t"}"#)
    }

    @Test func googleLegacySpellings() throws {
        let issSub = try parse(#"{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"10987654321"}"#)
        #expect(issSub == .issSub(iss: "https://accounts.google.com/", sub: "10987654321"))
        #expect(issSub.json == .object(["format": "iss_sub", "iss": "https://accounts.google.com/", "sub": "10987654321"]))
        #expect(try parse(#"{"subject_type":"id_token_claims","iss":"https://accounts.google.com/","sub":"1","email":"a@gmail.com"}"#)
                == .idTokenClaims(iss: "https://accounts.google.com/", sub: "1", email: "a@gmail.com"))
        #expect(try parse(#"{"subject_type":"phone","phone_number":"+1"}"#) == .phoneNumber("+1"))
        let token = try parse(#"{"subject_type":"oauth_token","token_type":"refresh_token","token_identifier_alg":"prefix","token":"1//0gAbCdEfGhIjK"}"#)
        #expect(token == .oauthToken(TokenReference(tokenType: "refresh_token", identifierAlgorithm: .prefix, value: "1//0gAbCdEfGhIjK")))
        // The normalised form never shows the token identifier whole.
        #expect(token.json.objectValue?["token"]?.stringValue?.contains("1//0gAbCdEfGhIjK") == false)
    }

    @Test func complexSubject() throws {
        let s = try parse(#"{"format":"complex","session":{"format":"opaque","id":"s1"},"user":{"format":"iss_sub","iss":"https://i","sub":"u"}}"#)
        #expect(s == .complex([.session: .opaque("s1"), .user: .issSub(iss: "https://i", sub: "u")]))
        #expect(s.issuerSubject?.sub == "u")
    }

    @Test(arguments: [
        #"{"email":"a@x"}"#,                                          // no format
        #"{"format":"email"}"#,                                       // missing member
        #"{"format":"email","email":""}"#,                            // empty member
        #"{"format":"email","email":"a@x","sub":"1"}"#,               // member the format does not describe
        #"{"format":"iss_sub","iss":"https://i"}"#,
        #"{"format":"aliases","identifiers":[]}"#,
        #"{"format":"aliases","identifiers":[{"format":"aliases","identifiers":[{"format":"opaque","id":"1"}]}]}"#,
        // A complex subject's members are simple identifiers: no aliases there, so none nest in aliases.
        #"{"format":"complex","user":{"format":"aliases","identifiers":[{"format":"email","email":"a@x"}]}}"#,
        #"{"format":"aliases","identifiers":[{"format":"complex","user":{"format":"aliases","identifiers":[{"format":"email","email":"a@x"}]}}]}"#,
        #"{"format":"complex","planet":{"format":"opaque","id":"1"}}"#,
        #"{"format":"account","uri":"mailto:a@x"}"#,
        #"{"format":"email","subject_type":"email","email":"a@x"}"#,
        #"{"subject_type":"oauth_token","token_type":"refresh_token","token_identifier_alg":"md5","token":"x"}"#,
        #""just a string""#,
    ])
    func rejectsMalformed(_ text: String) {
        #expect(throws: SubjectError.self) { try parse(text) }
    }

    @Test func unknownFormatsAreKept() throws {
        let s = try parse(#"{"format":"x-custom","thing":"1"}"#)
        #expect(s == .other(format: "x-custom", members: ["format": "x-custom", "thing": "1"]))
    }
}

@Suite("Event catalog")
struct EventCatalogTests {
    @Test func googleSevenAreKnown() {
        for type in [EventType.sessionsRevoked, .tokensRevoked, .tokenRevoked, .accountDisabled, .accountEnabled,
                     .accountCredentialChangeRequired, .riscVerification] {
            #expect(type.isKnown, "\(type)")
        }
    }

    @Test func everySpecFamilyIsPresent() {
        let names = Set(EventCatalog.all.map(\.name))
        for name in ["account-purged", "identifier-changed", "identifier-recycled", "credential-compromise", "opt-in",
                     "opt-out-initiated", "opt-out-cancelled", "opt-out-effective", "recovery-activated",
                     "recovery-information-changed", "session-revoked", "token-claims-change", "credential-change",
                     "assurance-level-change", "device-compliance-change", "session-established", "session-presented",
                     "risk-level-change", "token-issued", "client-disabled", "client-enabled",
                     "client-credential-changed", "stream-updated", "backchannel-logout"] {
            #expect(names.contains(name), "\(name)")
        }
        #expect(EventCatalog.definitions(named: "verification").count == 2)
        #expect(EventType(EventURIPrefix.googleLegacy + "one-token-revoked").canonical?.uri == EventType.tokenRevoked.uri)
        #expect(EventType(EventURIPrefix.sse + "verification").canonical?.uri == EventType.ssfVerification.uri)
        #expect(!EventType("https://example.com/event/new-thing").isKnown)
    }
}

@Suite("SET envelope")
struct SETEnvelopeTests {
    func claims(_ text: String) throws -> JSONObject { try #require(try JSONParser.parse(text).objectValue) }

    @Test func googleSET() throws {
        let set = try SecurityEventToken.parse(claims: claims("""
        {"iss":"https://accounts.google.com/","aud":"1234-abc.apps.googleusercontent.com","iat":1700000000,
         "jti":"e3b0c44298fc1c14","events":{"https://schemas.openid.net/secevent/risc/event-type/account-disabled":{
         "subject":{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"10987654321"},"reason":"hijacking"}}}
        """))
        #expect(set.audience == ["1234-abc.apps.googleusercontent.com"])
        #expect(set.events.count == 1)
        #expect(set.events[0].type == .accountDisabled)
        #expect(set.events[0].reason == "hijacking")
        #expect(set.events[0].subjectSource == .event)
        #expect(set.primarySubject?.issuerSubject?.sub == "10987654321")
    }

    @Test func ssfSETTakesSubjectFromSubID() throws {
        let set = try SecurityEventToken.parse(claims: claims("""
        {"iss":"https://idp.example.org/","aud":["a","b"],"iat":1700000200,"jti":"c-19","txn":"t1","toe":1700000190,
         "sub_id":{"format":"complex","session":{"format":"opaque","id":"sess-abc"},
                   "user":{"format":"iss_sub","iss":"https://idp.example.org/","sub":"u-1"}},
         "events":{"https://schemas.openid.net/secevent/caep/event-type/session-revoked":
           {"initiating_entity":"admin","reason_admin":{"en":"Offboarded"},"event_timestamp":1700000190}}}
        """))
        #expect(set.audience == ["a", "b"])
        #expect(set.transaction == "t1")
        #expect(set.timeOfEvent == 1700000190)
        #expect(set.events[0].subjectSource == .subID)
        #expect(set.events[0].initiatingEntity == "admin")
    }

    @Test func unknownEventTypesAreKept() throws {
        let set = try SecurityEventToken.parse(claims: claims(#"{"iss":"https://i","iat":1,"jti":"j","events":{"https://example.com/new":{"x":1}}}"#))
        #expect(set.unknownEventTypes == [EventType("https://example.com/new")])
    }

    @Test(arguments: [
        (#"{"iat":1,"jti":"j","events":{"e":{}}}"#, SETFormatError.Kind.missingClaim("iss")),
        (#"{"iss":"i","jti":"j","events":{"e":{}}}"#, .missingClaim("iat")),
        (#"{"iss":"i","iat":"yesterday","jti":"j","events":{"e":{}}}"#, .invalidClaim("iat")),
        (#"{"iss":"i","iat":1,"events":{"e":{}}}"#, .missingClaim("jti")),
        (#"{"iss":"i","iat":1,"jti":"","events":{"e":{}}}"#, .invalidClaim("jti")),
        (#"{"iss":"i","iat":1,"jti":"j"}"#, .missingClaim("events")),
        (#"{"iss":"i","iat":1,"jti":"j","events":{}}"#, .invalidClaim("events")),
        (#"{"iss":"i","iat":1,"jti":"j","events":[]}"#, .invalidClaim("events")),
        (#"{"iss":"i","iat":1,"jti":"j","events":{"e":"x"}}"#, .invalidEvent("e")),
        (#"{"iss":"i","iat":1,"jti":"j","aud":5,"events":{"e":{}}}"#, .invalidClaim("aud")),
    ])
    func rejectsBadEnvelopes(_ text: String, _ kind: SETFormatError.Kind) throws {
        let o = try claims(text)
        #expect { try SecurityEventToken.parse(claims: o) } throws: { ($0 as? SETFormatError)?.kind == kind }
    }

    @Test func eventPayloadRulesAreEnforced() throws {
        // credential-change requires credential_type and change_type.
        let missing = try claims(#"{"iss":"i","iat":1,"jti":"j","sub_id":{"format":"opaque","id":"1"},"events":{"https://schemas.openid.net/secevent/caep/event-type/credential-change":{"credential_type":"password"}}}"#)
        #expect(throws: SETFormatError.self) { try SecurityEventToken.parse(claims: missing) }
        // token-revoked requires an oauth_token subject.
        let noToken = try claims(#"{"iss":"i","iat":1,"jti":"j","events":{"https://schemas.openid.net/secevent/oauth/event-type/token-revoked":{"subject":{"format":"email","email":"a@x"}}}}"#)
        #expect(throws: SETFormatError.self) { try SecurityEventToken.parse(claims: noToken) }
        // A reason Warden does not know is kept, not refused.
        let newReason = try claims(#"{"iss":"i","iat":1,"jti":"j","events":{"https://schemas.openid.net/secevent/risc/event-type/account-disabled":{"subject":{"format":"opaque","id":"1"},"reason":"new-reason"}}}"#)
        #expect(try SecurityEventToken.parse(claims: newReason).events[0].reason == "new-reason")
    }
}

@Suite("Token identifiers")
struct TokenIdentifierTests {
    // Reference values computed with the openssl command line:
    //   printf %s "$t" | openssl dgst -sha512 -binary | openssl dgst -sha512 -binary | base64 -w0
    let token = "1//0gAbCdEfGhIjKlMnOpQrStUvWxYz-0123456789"
    let expectedHash = "F/qXPzPxP4YI6TeuieUMmRGARX5fo+IkCZgQIhYbaAQodU5JH80/mvVO5x4JEH8bN2UxGxxMSv0tBQgvR38wmw=="
    let expectedHashOfHex = "hZehPshSF/ACYoNga1XCntqeTw3xCX9xN6aD86hlBJ+6/wDiVFdpe6m7GT/+9bGAccj02YXkpe/4mDQF2Q4noA=="

    @Test func computesBothIdentifiers() {
        let held = HeldTokenIdentifiers(token: token)
        #expect(held.prefix == "1//0gAbCdEfGhIjK")
        #expect(held.hash == expectedHash)
        #expect(held.hash.count == 88)
        #expect(held.indexKeys == ["prefix:1//0gAbCdEfGhIjK", "sha512:" + expectedHash])
    }

    @Test func matchesReferences() {
        let held = HeldTokenIdentifiers(token: token)
        let other = HeldTokenIdentifiers(token: token + "x")
        let byPrefix = TokenReference(tokenType: "refresh_token", identifierAlgorithm: .prefix, value: "1//0gAbCdEfGhIjK")
        let byHash = TokenReference(tokenType: "refresh_token", identifierAlgorithm: .hashBase64SHA512SHA512, value: expectedHash)
        let byHexVariant = TokenReference(tokenType: "refresh_token", identifierAlgorithm: .hashBase64SHA512SHA512, value: expectedHashOfHex)
        #expect(byPrefix.match(held) == .prefix)
        #expect(byPrefix.match(other) == .prefix)  // a prefix need not be unique
        #expect(byHash.match(held) == .hash)
        #expect(byHash.match(other) == nil)
        #expect(byHexVariant.match(held) == .hashOfHexDigest)
        #expect(TokenReference(tokenType: "refresh_token", identifierAlgorithm: .plain, value: token).match(held) == .plain)
        #expect(!byHash.description.contains(expectedHash))
    }

    @Test func constantTimeComparison() {
        #expect(constantTimeEquals("abc", "abc"))
        #expect(!constantTimeEquals("abc", "abd"))
        #expect(!constantTimeEquals("abc", "abcd"))
        #expect(!constantTimeEquals("", "a"))
        #expect(constantTimeEquals("", ""))
    }
}
