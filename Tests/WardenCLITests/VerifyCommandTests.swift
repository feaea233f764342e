import Foundation
import SETMinting
import SecurityEvents
import Testing
import TokenVerification
import WardenTestSupport

@Suite("warden verify", .serialized)
struct VerifyCommandTests {
    static let key = try! SigningKey.rsa(keyID: "cli-key", algorithm: "RS256")
    let audience = "1234-abc.apps.googleusercontent.com"

    /// A key server and a config that discovers its keys from it.
    func withServer(_ body: (KeyServer, String, URL) async throws -> Void) async throws {
        let server = try await KeyServer.start()
        let issuer = server.baseURL + "/"
        server.serve("/.well-known/risc-configuration",
                     json: JSONValue.object(["issuer": .string(issuer), "jwks_uri": .string(server.url("/certs"))]).jsonText)
        server.serve("/certs", json: SETMinter.jwks([Self.key]))
        let dir = try Warden.temporaryDirectory()
        let config = dir.appendingPathComponent("warden.yaml")
        try """
        issuers:
          - issuer: \(issuer)
            discovery: \(server.url("/.well-known/risc-configuration"))
            audiences: [\(audience)]
            fetch-timeout: 2s
        """.write(to: config, atomically: true, encoding: .utf8)
        do {
            try await body(server, issuer, config)
        } catch {
            await server.stop()
            throw error
        }
        await server.stop()
        try? FileManager.default.removeItem(at: dir)
    }

    func token(issuer: String, event: EventType = .sessionsRevoked, extra: JSONObject = [:]) throws -> String {
        try SETMinter.token(claims: SETMinter.riscClaims(issuer: issuer, audience: audience, event: event, extra: extra), key: Self.key)
    }

    // Keys over HTTPS from a server whose certificate a private authority signed: unavailable
    // until http-client.ca-file names that authority (beside the system's).
    @Test func keysFromAPrivateAuthorityNeedHTTPClientCAFile() async throws {
        let certificates = try await TestCertificates.shared()
        let pair = try await certificates.issue("jwks-\(UUID().uuidString.prefix(6))", subjectAlternativeNames: ["IP:127.0.0.1"])
        let dir = try Warden.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: dir) }
        try SETMinter.jwks([Self.key]).write(to: dir.appendingPathComponent("certs.json"), atomically: true, encoding: .utf8)
        let server = try await StaticHTTPSServer.start(serving: dir, certificate: pair)
        defer { server.stop() }
        let port = server.port
        let issuer = "https://127.0.0.1:\(port)/"
        let t = try token(issuer: issuer)
        let issuers = """
            issuers:
              - issuer: \(issuer)
                jwks-uri: https://127.0.0.1:\(port)/certs.json
                audiences: [\(audience)]
                fetch-timeout: 2s

            """
        let config = dir.appendingPathComponent("warden.yaml")
        try issuers.write(to: config, atomically: true, encoding: .utf8)
        let untrusted = try await Warden.run(["verify", "--config", config.path, t])
        #expect(untrusted.status == 3, "\(untrusted.stdout) \(untrusted.stderr)")
        try (issuers + "http-client: {ca-file: \(certificates.caFile)}\n").write(to: config, atomically: true, encoding: .utf8)
        let trusted = try await Warden.run(["verify", "--config", config.path, t])
        #expect(trusted.status == 0, "\(trusted.stdout) \(trusted.stderr)")
        // A file that is not PEM is named at start.
        try (issuers + "http-client: {ca-file: warden.yaml}\n").write(to: config, atomically: true, encoding: .utf8)
        let refused = try await Warden.run(["verify", "--config", config.path, t])
        #expect(refused.status == 2 && refused.stderr.contains("http-client.ca-file"), "\(refused.stderr)")
    }

    @Test func validTokenExitsZeroWithTheContractJSON() async throws {
        try await withServer { _, issuer, config in
            let t = try token(issuer: issuer, event: .accountDisabled, extra: ["reason": "hijacking"])
            let out = try await Warden.run(["verify", "--config", config.path, t])
            #expect(out.status == 0, "\(out.stderr)")
            let json = try #require(out.json)
            #expect(json["valid"] as? Bool == true)
            #expect(json["iss"] as? String == issuer)
            #expect(json["kid"] as? String == "cli-key")
            #expect(json["alg"] as? String == "RS256")
            #expect(json["aud"] as? [String] == [audience])
            let events = try #require(json["events"] as? [[String: Any]])
            #expect(events.first?["type"] as? String == EventType.accountDisabled.uri)
            let subject = try #require(events.first?["subject"] as? [String: Any])
            #expect(subject["format"] as? String == "iss_sub")
            #expect(subject["sub"] as? String == "10987654321")
            #expect((events.first?["attributes"] as? [String: Any])?["reason"] as? String == "hijacking")
            #expect(json["claims"] is [String: Any])
        }
    }

    @Test func readsStdinAndTrimsWhitespace() async throws {
        try await withServer { _, issuer, config in
            let out = try await Warden.run(["verify", "--config", config.path, "-"], stdin: "\n  " + (try token(issuer: issuer)) + " \n\n")
            #expect(out.status == 0, "\(out.stdout) \(out.stderr)")
            let implicit = try await Warden.run(["verify", "--config", config.path], stdin: try token(issuer: issuer) + "\n")
            #expect(implicit.status == 0)
        }
    }

    @Test func invalidTokenExitsOneWithAnRFC8935Code() async throws {
        try await withServer { _, issuer, config in
            var claims = SETMinter.riscClaims(issuer: issuer, audience: "someone-else")
            let wrongAudience = try SETMinter.token(claims: claims, key: Self.key)
            let out = try await Warden.run(["verify", "--config", config.path, wrongAudience])
            #expect(out.status == 1)
            #expect(out.json?["valid"] as? Bool == false)
            #expect(out.json?["err"] as? String == "invalid_audience")
            #expect((out.json?["description"] as? String)?.isEmpty == false)

            claims = SETMinter.riscClaims(issuer: "https://other.example/", audience: audience)
            let wrongIssuer = try await Warden.run(["verify", "--config", config.path, try SETMinter.token(claims: claims, key: Self.key)])
            #expect(wrongIssuer.status == 1)
            #expect(wrongIssuer.json?["err"] as? String == "invalid_issuer")

            let garbage = try await Warden.run(["verify", "--config", config.path, "not-a-token"])
            #expect(garbage.status == 1)
            #expect(garbage.json?["err"] as? String == "invalid_request")
        }
    }

    @Test func keysUnavailableExitsThree() async throws {
        try await withServer { server, issuer, config in
            let t = try token(issuer: issuer)
            await server.stop()
            let out = try await Warden.run(["verify", "--config", config.path, t])
            #expect(out.status == 3, "\(out.stdout)")
            #expect(out.json?["valid"] as? Bool == false)
            #expect(out.json?["retryable"] as? Bool == true)
        }
    }

    @Test func usageAndConfigErrorsExitTwo() async throws {
        let dir = try Warden.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: dir) }
        #expect(try await Warden.run(["verify"]).status == 2)                    // missing --config
        #expect(try await Warden.run(["verify", "--bogus", "x"]).status == 2)   // unknown option
        #expect(try await Warden.run(["frobnicate"]).status == 2)               // unknown command
        #expect(try await Warden.run(["verify", "--config", "/nonexistent.yaml", "x"]).status == 2)

        let cases: [(String, String)] = [
            ("issuers:\n  - issuer: https://i.example/\n    jwks-uri: http://keys.example.com/jwks\n    audiences: [a]\n", "https"),
            ("issuers:\n  - issuer: https://i.example/\n    audiences: [a]\n    algorithms: [HS256]\n", "HMAC"),
            ("issuers:\n  - issuer: https://i.example/\n    audiences: [a]\n    algorithms: [none]\n", "none"),
            ("issuers:\n  - issuer: https://i.example/\n    audience: [a]\n", "audiences"),
            ("issuers:\n  - issuer: https://i.example/\n    audiences: [a]\n    profile: saml\n", "profile"),
            ("issuers:\n  - issuer: https://i.example/\n    audiences: [a]\n    clock-skew: soon\n", "duration"),
            ("issuers: []\n", "issuer"),
            ("issuerz: []\n", "unknown key"),
        ]
        for (yaml, expected) in cases {
            let config = dir.appendingPathComponent("c.yaml")
            try yaml.write(to: config, atomically: true, encoding: .utf8)
            let out = try await Warden.run(["verify", "--config", config.path, "x"])
            #expect(out.status == 2, "\(yaml)")
            #expect(out.stderr.contains(expected), "\(yaml): \(out.stderr)")
        }
    }

    @Test func environmentOverridesConfiguration() async throws {
        try await withServer { _, issuer, config in
            let t = try token(issuer: issuer)
            let overridden = try await Warden.run(["verify", "--config", config.path, t],
                                            environment: ["WARDEN_ISSUERS_0_AUDIENCES": "another-client,yet-another"])
            #expect(overridden.status == 1)
            #expect(overridden.json?["err"] as? String == "invalid_audience")
            let both = try await Warden.run(["verify", "--config", config.path, t],
                                      environment: ["WARDEN_ISSUERS_0_AUDIENCES": "another-client,\(audience)"])
            #expect(both.status == 0)
        }
    }

    @Test func bundledExampleVerifiesAndForgeryFails() async throws {
        let config = Warden.packageRoot.appendingPathComponent("examples/warden.yaml").path
        for name in ["sessions-revoked", "account-disabled-hijacking", "token-revoked", "verification"] {
            let token = Warden.packageRoot.appendingPathComponent("examples/tokens/\(name).jwt")
            let text = try String(contentsOf: token, encoding: .utf8)
            let out = try await Warden.run(["verify", "--config", config, "-"], stdin: text)
            #expect(out.status == 0, "\(name): \(out.stdout)")
            #expect(out.json?["valid"] as? Bool == true)
        }
        // A file name works as well as the token itself (make run does this).
        let byPath = try await Warden.run(["verify", "--config", config,
                                     Warden.packageRoot.appendingPathComponent("examples/tokens/sessions-revoked.jwt").path])
        #expect(byPath.status == 0, "\(byPath.stdout)")
        let forged = try String(contentsOf: Warden.packageRoot.appendingPathComponent("examples/tokens/forged.jwt"), encoding: .utf8)
        let out = try await Warden.run(["verify", "--config", config, "-"], stdin: forged)
        #expect(out.status == 1)
        #expect(out.json?["err"] as? String == "invalid_key")
    }

    // A token value inside sub_id, inside an aliases list, or inside a complex subject's member
    // is shown as a short prefix only, as it is in an event's subject.
    @Test func tokenValuesInsideSubIDAliasesAndComplexSubjectsAreNotPrintedWhole() async throws {
        try await withServer { _, issuer, config in
            let secret = "1/SECRET-REFRESH-TOKEN-VALUE-0123456789"
            let oauth: JSONValue = ["format": "oauth_token", "token_type": "refresh_token", "token_identifier_alg": "plain",
                                    "token": .string(secret)]
            let subID: JSONValue = ["format": "complex", "user": ["format": "aliases", "identifiers": [oauth]], "session": oauth]
            let t = try token(issuer: issuer, extra: ["sub_id": subID])
            let out = try await Warden.run(["verify", "--config", config.path, t])
            #expect(out.status == 0, "\(out.stderr)")
            #expect(!out.stdout.isEmpty)
            #expect(!out.stdout.contains(secret))
            #expect(!out.stdout.contains("SECRET-REFRESH-TOKEN-VALUE"))
            #expect(out.stdout.contains("1/SECR"))
        }
    }

    @Test func tokenIdentifiersAreNotPrintedWhole() async throws {
        let config = Warden.packageRoot.appendingPathComponent("examples/warden.yaml").path
        let text = try String(contentsOf: Warden.packageRoot.appendingPathComponent("examples/tokens/token-revoked.jwt"), encoding: .utf8)
        let out = try await Warden.run(["verify", "--config", config, "-"], stdin: text)
        #expect(out.status == 0)
        // The double-SHA-512 of the example refresh token (see examples/make-examples.py).
        #expect(!out.stdout.contains("F/qXPzPxP4YI6TeuieUMmRGARX5fo+IkCZgQIhYbaAQodU5JH80/mvVO5x4JEH8bN2UxGxxMSv0tBQgvR38wmw=="))
        #expect(out.stdout.contains("hash_base64_sha512_sha512"))
    }
}
