import AsyncHTTPClient
import Foundation
import SETMinting
import SecurityEvents
import StreamManagement
import Synchronization
import Testing
import WardenTestSupport

/// Tokens for transmitters: minted or fetched when needed, reused until shortly before they
/// expire, never presented once known expired, fetched anew when refused.
@Suite("Stream credentials")
struct CredentialsTests {
    final class Clock: Sendable {
        let now = Mutex(1_700_000_000.0)
        func advance(_ seconds: Double) { now.withLock { $0 += seconds } }
        var read: @Sendable () -> Double { { self.now.withLock { $0 } } }
    }

    static func serviceAccount(_ key: SigningKey) -> [UInt8] {
        let json: JSONValue = .object([
            "type": "service_account", "client_email": "warden@project.iam.gserviceaccount.com",
            "private_key_id": .string(key.keyID), "private_key": .string(key.privateKeyPEM!),
        ])
        return Array(json.jsonText.utf8)
    }

    static func claims(of authorization: String) throws -> (header: JSONObject, claims: JSONObject) {
        let parts = authorization.dropFirst("Bearer ".count).split(separator: ".")
        #expect(parts.count == 3)
        let header = try #require(try JSONParser.parse(Base64URL.decode(String(parts[0]))!).objectValue)
        let claims = try #require(try JSONParser.parse(Base64URL.decode(String(parts[1]))!).objectValue)
        return (header, claims)
    }

    @Test func aServiceAccountJWTIsMintedAsGoogleAsksAndReusedUntilShortlyBeforeItExpires() async throws {
        let key = try SigningKey.rsa(keyID: "sa-key-1")
        let clock = Clock()
        let tokens = ServiceAccountTokens(key: try ServiceAccountKey(json: Self.serviceAccount(key)), now: clock.read)
        let first = try await tokens.authorization()
        let (header, claims) = try Self.claims(of: first)
        #expect(header["alg"] == "RS256" && header["kid"] == "sa-key-1")
        #expect(claims["iss"] == "warden@project.iam.gserviceaccount.com" && claims["sub"] == claims["iss"])
        #expect(claims["aud"] == "https://risc.googleapis.com/google.identity.risc.v1beta.RiscManagementService")
        let iat = try #require(claims["iat"]?.numberValue), exp = try #require(claims["exp"]?.numberValue)
        #expect(exp - iat == 3600)
        // Signed with the account's key: the public key verifies it.
        #expect(key.verifies(String(first.dropFirst("Bearer ".count))))
        #expect(!(try SigningKey.rsa()).verifies(String(first.dropFirst("Bearer ".count))))

        clock.advance(3000)  // 50 minutes: still reused
        #expect(try await tokens.authorization() == first)
        clock.advance(560)  // 59 min 20 s: within the last minute, a new one
        let second = try await tokens.authorization()
        #expect(second != first)
        #expect(try Self.claims(of: second).claims["iat"]?.numberValue == iat + 3560)
        // Refused by the transmitter: the next call gets a new one.
        #expect(await tokens.invalidate(second))
        clock.advance(1)
        #expect(try await tokens.authorization() != second)
    }

    @Test func aKeyFileThatIsNotOneIsRefusedWithoutQuotingIt() throws {
        #expect(throws: StreamError.self) { try ServiceAccountKey(json: Array(#"{"client_email":"a@b","private_key_id":"k","private_key":"secret-material"}"#.utf8)) }
        do {
            _ = try ServiceAccountKey(json: Array(#"{"client_email":"a@b","private_key_id":"k","private_key":"secret-material"}"#.utf8))
        } catch {
            #expect(!error.description.contains("secret-material"))
        }
    }

    @Test func theRenewalMarginShrinksForShortLivedTokens() {
        #expect(renewalMargin(lifetime: 3600) == 60)
        #expect(renewalMargin(lifetime: 100) == 20)
        #expect(renewalMargin(lifetime: 0) == 0)
    }

    /// Callers asking at once share one token request; an `expires_in` sent as a string ("3600",
    /// as some servers do) is a lifetime all the same, so the token is reused.
    @Test func concurrentCallersShareOneTokenRequestAndAStringLifetimeCounts() async throws {
        let server = try await KeyServer.start()
        defer { Task { await server.stop() } }
        let http = HTTPClient(eventLoopGroupProvider: .singleton)
        defer { Task { try? await http.shutdown() } }
        server.serve("/token", .init(body: #"{"access_token":"at-1","token_type":"Bearer","expires_in":"3600"}"#,
                                     headers: ["Content-Type": "application/json"], delay: 0.3))
        let credentials = OAuthClientCredentials(
            settings: .init(tokenEndpoint: URL(string: server.url("/token"))!, clientID: "w", clientSecret: "s", scope: nil), http: http)
        let answers = try await withThrowingTaskGroup(of: String.self) { group in
            for _ in 0..<10 { group.addTask { try await credentials.authorization() } }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        #expect(answers == Array(repeating: "Bearer at-1", count: 10))
        #expect(try await credentials.authorization() == "Bearer at-1")
        #expect(server.requests("/token") == 1)
    }

    @Test func clientCredentialsAreFetchedOnceReusedAndFetchedAnewWhenRefused() async throws {
        let server = try await KeyServer.start()
        defer { Task { await server.stop() } }
        let http = HTTPClient(eventLoopGroupProvider: .singleton)
        defer { Task { try? await http.shutdown() } }
        server.enqueue("/token", [
            .init(body: #"{"access_token":"at-1","token_type":"Bearer","expires_in":100}"#, headers: ["Content-Type": "application/json"]),
            .init(body: #"{"access_token":"at-2","token_type":"Bearer","expires_in":100}"#, headers: ["Content-Type": "application/json"]),
            .init(body: #"{"access_token":"at-3","token_type":"Bearer","expires_in":100}"#, headers: ["Content-Type": "application/json"]),
        ])
        server.serve("/token", .init(body: #"{"error":"invalid_client"}"#, status: 401))
        let clock = Clock()
        let credentials = OAuthClientCredentials(
            settings: .init(tokenEndpoint: URL(string: server.url("/token"))!, clientID: "warden client", clientSecret: "s3cr:et",
                            scope: "ssf.manage ssf.read"),
            http: http, now: clock.read)
        #expect(try await credentials.authorization() == "Bearer at-1")
        clock.advance(79)  // lifetime 100 s, margin 20 s: still reused
        #expect(try await credentials.authorization() == "Bearer at-1")
        #expect(server.requests("/token") == 1)
        clock.advance(2)  // past the margin: never presented so close to its expiry
        #expect(try await credentials.authorization() == "Bearer at-2")
        #expect(await credentials.invalidate("Bearer at-2"))
        #expect(try await credentials.authorization() == "Bearer at-3")
        let request = try #require(server.recordedRequests("/token").first)
        #expect(request.method == "POST")
        #expect(request.body == "grant_type=client_credentials&scope=ssf.manage+ssf.read")
        #expect(request.headers["authorization"] == "Basic " + Data("warden+client:s3cr%3Aet".utf8).base64EncodedString())
        // A refusal names the status, not the secret.
        #expect(await credentials.invalidate("Bearer at-3"))
        do {
            _ = try await credentials.authorization()
            Issue.record("a refused client was given a token")
        } catch {
            #expect(error.status == 401)
            #expect(!error.description.contains("s3cr"))
        }
    }
}
