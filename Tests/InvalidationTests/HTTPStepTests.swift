import AsyncHTTPClient
import Crypto
import Foundation
@testable import Invalidation
import Redis
import SecurityEvents
import Testing
import WardenTestSupport

@Suite("RFC 7009 revocation and webhooks against local HTTP servers")
struct HTTPStepTests {
    static let http = HTTPClient(eventLoopGroupProvider: .singleton, configuration: .init(redirectConfiguration: .disallow))

    func endpoint(_ server: KeyServer, _ auth: RevocationEndpoint.ClientAuthentication, timeout: Double = 5) -> RevocationEndpoint {
        RevocationEndpoint(url: URL(string: server.url("/revoke"))!, authentication: auth, timeout: timeout)
    }

    /// A form body as a dictionary (names and values decoded).
    func form(_ body: String) -> [String: String] {
        var out: [String: String] = [:]
        for pair in body.split(separator: "&") {
            let parts = pair.split(separator: "=", maxSplits: 1).map {
                $0.replacingOccurrences(of: "+", with: " ").removingPercentEncoding ?? String($0)
            }
            out[parts[0]] = parts.count > 1 ? parts[1] : ""
        }
        return out
    }

    @Test func tokensRevokedRevokesEveryHeldTokenWithBasicAuthThenDeletesThem() async throws {
        let redisServer = try await RedisServer()
        let redis = RedisClient(settings: .init(host: "127.0.0.1", port: redisServer.port))
        defer { redis.close() }
        let server = try await KeyServer.start()
        server.serve("/revoke", .init(body: ""))
        let revoke = endpoint(server, .clientSecretBasic(clientID: "warden app", secret: "s3cr&t:x"))
        let executor = TargetExecutor(
            redis: RedisStepExecutor(clients: ["sessions": redis], stores: [
                "tokens": TokenStoreSettings(redisTarget: "sessions", hash: "oauth-tokens:{user}", index: "idx"),
            ]),
            revocation: RevocationClient(http: Self.http), webhooks: WebhookNotifier(http: Self.http),
            targets: ["google-revoke": .revoke(revoke)])
        let held = ["1//0g-refresh-one", "1//0g-refresh-two+/="]
        for (i, token) in held.enumerated() {
            _ = try await redis.send(["HSET", "oauth-tokens:u1", "t\(i)", token])
            for key in HeldTokenIdentifiers(token: token).indexKeys { _ = try await redis.send(["HSET", "idx", key, "u1/t\(i)"]) }
        }
        // The step acts on the user it was planned for (u1), not the one the subject resolves to
        // when it runs.
        let context = StepContext(token: token(EventURIPrefix.oauth + "tokens-revoked"), user: "u2")
        let outcome = await executor.execute(.revokeTokens(store: "tokens", target: "google-revoke", tokenTypeHint: "refresh_token", user: "u1"),
                                             context: context)
        #expect(outcome.result == "done")
        let requests = server.recordedRequests("/revoke")
        #expect(requests.count == 2)
        #expect(Set(requests.map { form($0.body)["token"] ?? "" }) == Set(held))
        for request in requests {
            #expect(request.method == "POST")
            #expect(request.headers["content-type"] == "application/x-www-form-urlencoded")
            #expect(form(request.body)["token_type_hint"] == "refresh_token")
            #expect(form(request.body)["client_secret"] == nil)
            // RFC 6749 §2.3.1: form-encoded id and secret, joined by a colon, base64.
            let encoded = request.headers["authorization"]?.dropFirst("Basic ".count) ?? ""
            #expect(String(decoding: Data(base64Encoded: String(encoded)) ?? Data(), as: UTF8.self) == "warden+app:s3cr%26t%3Ax")
        }
        #expect(try await redisServer.cli(["EXISTS", "oauth-tokens:u1"]) == "0")
        #expect(try await redisServer.cli(["HLEN", "idx"]) == "0")

        // The endpoint refuses the first token held (400): the second is revoked all the same,
        // the refused one kept, and the step fails (a revocation is never silently dropped).
        for (i, token) in held.enumerated() { _ = try await redis.send(["HSET", "oauth-tokens:u2", "t\(i)", token]) }
        server.enqueue("/revoke", [.init(body: #"{"error":"invalid_request"}"#, status: 400, headers: ["Content-Type": "application/json"])])
        let partly = await executor.execute(.revokeTokens(store: "tokens", target: "google-revoke", tokenTypeHint: nil),
                                            context: StepContext(token: token(EventURIPrefix.oauth + "tokens-revoked"), user: "u2"))
        guard case .failed(let reason) = partly else { Issue.record("expected failed, got \(partly)"); return }
        #expect(reason.hasPrefix("1 of 2 held token(s) refused"), "\(reason)")
        #expect(server.recordedRequests("/revoke").count == 4)
        #expect(try await redisServer.cli(["HKEYS", "oauth-tokens:u2"]) == "t0")
    }

    @Test func clientSecretPostAndPublicClientPutCredentialsInTheBody() async throws {
        let server = try await KeyServer.start()
        server.serve("/revoke", .init(body: ""))
        let client = RevocationClient(http: Self.http)
        #expect(await client.revoke("tok-1", hint: nil, at: endpoint(server, .clientSecretPost(clientID: "w", secret: "p"))) == .done("revoked at 127.0.0.1"))
        #expect(await client.revoke("tok-2", hint: nil, at: endpoint(server, .none(clientID: "public-app"))).result == "done")
        let bodies = server.recordedRequests("/revoke").map { form($0.body) }
        #expect(bodies[0] == ["token": "tok-1", "client_id": "w", "client_secret": "p"])
        #expect(bodies[1] == ["token": "tok-2", "client_id": "public-app"])
        #expect(server.recordedRequests("/revoke").allSatisfy { $0.headers["authorization"] == nil })
    }

    @Test func unavailableIsRetriedHonouringRetryAfterAndRefusalsArePermanent() async throws {
        let server = try await KeyServer.start()
        let client = RevocationClient(http: Self.http)
        // Answers are awaited for long enough on a loaded machine; only the hanging endpoint's
        // call is given a deadline shorter than its stall.
        let at = endpoint(server, .none(clientID: nil), timeout: 30)
        let hanging = endpoint(server, .none(clientID: nil), timeout: 1)
        // A busy endpoint's large error page is "later", not "never"; a 2xx whose body is large
        // has revoked all the same.
        let page = String(repeating: "x", count: 70_000)
        server.enqueue("/revoke", [.init(body: page, status: 503), .init(body: page, status: 200)])
        #expect(await client.revoke("t", hint: nil, at: at).result == "retry")
        #expect(await client.revoke("t", hint: nil, at: at).result == "done")
        server.enqueue("/revoke", [
            .init(body: "", status: 503, headers: ["Retry-After": "7"]),
            .init(body: "", status: 429),
            .init(body: "", status: 408),
            .init(body: #"{"error":"unsupported_token_type"}"#, status: 400, headers: ["Content-Type": "application/json"]),
            .init(body: #"{"error":"invalid_client"}"#, status: 401),
            .init(body: "", status: 200, delay: 3),
        ])
        #expect(await client.revoke("t", hint: nil, at: at) == .retry("revocation endpoint 127.0.0.1 answered 503", after: 7))
        #expect(await client.revoke("t", hint: nil, at: at) == .retry("revocation endpoint 127.0.0.1 answered 429", after: nil))
        // A proxy that gave up waiting: later, not never.
        #expect(await client.revoke("t", hint: nil, at: at) == .retry("revocation endpoint 127.0.0.1 answered 408", after: nil))
        let unsupported = await client.revoke("t", hint: nil, at: at)
        #expect(unsupported.result == "failed" && "\(unsupported)".contains("unsupported_token_type"))
        let unauthorized = await client.revoke("t", hint: nil, at: at)
        #expect(unauthorized.result == "failed" && "\(unauthorized)".contains("check the client credentials"))
        // A hanging endpoint times out and is retried later.
        #expect(await client.revoke("t", hint: nil, at: hanging).result == "retry")
        await server.stop()
        #expect(await client.revoke("t", hint: nil, at: hanging).result == "retry")
    }

    @Test func webhookBodyIsSignedAndCarriesNoRawToken() async throws {
        let server = try await KeyServer.start()
        server.serve("/hook", .init(body: "", status: 204))
        let secret = Array("hook-secret".utf8)
        let hook = WebhookEndpoint(url: URL(string: server.url("/hook"))!, hmacSecret: secret)
        let notifier = WebhookNotifier(http: Self.http, now: { 1_700_000_000 })
        let subject = #"{"subject_type":"oauth_token","token_type":"refresh_token","token_identifier_alg":"plain","token":"1//0g-the-whole-refresh-token"}"#
        let context = StepContext(token: token(EventURIPrefix.oauth + "token-revoked", subject: subject), user: "u1")
        #expect(await notifier.notify(context, eventType: context.eventType, at: hook) == .done("webhook 127.0.0.1 answered 204"))
        let request = try #require(server.recordedRequests("/hook").first)
        #expect(!request.body.contains("1//0g-the-whole-refresh-token"))
        let json = try JSONParser.parse(request.body).objectValue
        #expect(json?["jti"]?.stringValue == "j-1" && json?["user"]?.stringValue == "u1" && json?["event"]?.stringValue == "token-revoked")
        let expected = HMAC<SHA256>.authenticationCode(for: Array(("1700000000." + request.body).utf8), using: SymmetricKey(data: secret))
        #expect(request.headers["warden-signature"] == "t=1700000000,v1=" + expected.map { String(format: "%02x", $0) }.joined())
        #expect(request.headers["warden-event-id"] == "https://accounts.google.com/ j-1")

        // A planned notify step names the user it was planned for, whoever the subject resolves to
        // when it runs (a step resumed after a restart, or replayed).
        let executor = TargetExecutor(redis: RedisStepExecutor(clients: [:], stores: [:]), revocation: RevocationClient(http: Self.http),
                                      webhooks: notifier, targets: ["app": .webhook(hook)])
        #expect(await executor.execute(.notify(target: "app", user: "u-planned"), context: context).result == "done")
        let planned = try JSONParser.parse(try #require(server.recordedRequests("/hook").last).body).objectValue
        #expect(planned?["user"]?.stringValue == "u-planned")

        // A jti holding a line break (the signer's to choose) is escaped, not a header the client
        // refuses before sending — a step that could never succeed.
        let claims = #"{"iss":"https://accounts.google.com/","aud":"app","iat":1700000000,"jti":"j\n1 %","events":{"\#(EventURIPrefix.risc)sessions-revoked":{"subject":{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"1"}}}}"#
        let odd = StepContext(token: try SecurityEventToken.parse(claims: try #require(try JSONParser.parse(claims).objectValue)), user: "u1")
        #expect(await notifier.notify(odd, eventType: odd.eventType, at: hook).result == "done")
        #expect(server.recordedRequests("/hook").last?.headers["warden-event-id"] == "https://accounts.google.com/ j%0A1%20%25")

        server.enqueue("/hook", [.init(body: "", status: 502), .init(body: "", status: 410)])
        #expect(await notifier.notify(context, eventType: context.eventType, at: hook).result == "retry")
        #expect(await notifier.notify(context, eventType: context.eventType, at: hook).result == "failed")
    }

    // A webhook or revocation endpoint that answers its head and then stalls: the step's
    // deadline covers the body, so the step ends (to be retried) instead of hanging for ever.
    @Test func endpointsThatStallAfterTheirHeadEndTheStepWithinItsDeadline() async throws {
        let server = try await KeyServer.start()
        server.serve("/hook", .init(body: String(repeating: "x", count: 2048), stallAfterHead: 600))
        server.serve("/revoke", .init(body: String(repeating: "x", count: 2048), stallAfterHead: 600))
        let hook = WebhookEndpoint(url: URL(string: server.url("/hook"))!, hmacSecret: [1, 2, 3], timeout: 0.5)
        let context = StepContext(token: token("sessions-revoked"), user: "u1")
        let notified = await WebhookNotifier(http: Self.http).notify(context, eventType: "x", at: hook)
        guard case .retry(let reason, _) = notified else { Issue.record("\(notified)"); return }
        #expect(reason.contains("no complete answer within"))
        let revoked = await RevocationClient(http: Self.http).revoke("1//t", hint: nil, at: endpoint(server, .none(clientID: nil), timeout: 0.5))
        guard case .retry(let why, _) = revoked else { Issue.record("\(revoked)"); return }
        #expect(why.contains("no complete answer within"))
        await server.stop()
    }
}
