import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import Ledger
import SETMinting
import Testing
import WardenTestSupport

/// `warden run` with `receiver:` and no `kafka:`: RFC 8935 push into the ledger, over real HTTP
/// on loopback, answered as the RFC and the contract say.
@Suite("warden run: push receiver", .serialized, .timeLimit(.minutes(4)))
struct PushReceiverTests {
    static let bearer = "push-secret-0c5e1d"

    /// A folder with keys, bearer tokens and a config whose only door is the push receiver.
    struct Setup {
        let directory: URL
        let config: URL
        var ledgerPath: String { directory.appendingPathComponent("ledger.sqlite").path }

        init(keySource: String = "jwks-file: jwks.json", bearerTokens: Bool = true) throws {
            directory = try WorkerTests.keyFolder()
            // CRLF and a blank line: neither is part of a token.
            try "\(PushReceiverTests.bearer)\r\n\r\nanother-token\n".write(to: directory.appendingPathComponent("push-tokens"),
                                                                            atomically: true, encoding: .utf8)
            config = directory.appendingPathComponent("warden.yaml")
            try """
            \(WorkerTests.issuerSection(keySource))
            receiver:
              listen: 127.0.0.1:0
              path: /events
              \(bearerTokens ? "bearer-tokens-file: push-tokens" : "")
              max-body-bytes: 8KiB
            http:
              listen: 127.0.0.1:0
            ledger: sqlite:ledger.sqlite
            """.write(to: config, atomically: true, encoding: .utf8)
        }

        func cleanUp() { try? FileManager.default.removeItem(at: directory) }
    }

    struct Answer {
        let status: Int
        let headers: [AnyHashable: Any]
        let body: String
        func header(_ name: String) -> String? {
            headers.first { ($0.key as? String)?.lowercased() == name.lowercased() }?.value as? String
        }
    }

    static func send(_ port: Int, _ body: String, method: String = "POST", contentType: String? = "application/secevent+jwt",
                     bearer: String? = PushReceiverTests.bearer, path: String = "/events") async throws -> Answer {
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(port)\(path)")!)
        request.httpMethod = method
        if method != "GET" { request.httpBody = Data(body.utf8) }
        if let contentType { request.setValue(contentType, forHTTPHeaderField: "Content-Type") }
        request.setValue("application/json", forHTTPHeaderField: "Accept")
        if let bearer { request.setValue("Bearer \(bearer)", forHTTPHeaderField: "Authorization") }
        let (data, response) = try await URLSession.shared.data(for: request)
        let http = response as! HTTPURLResponse
        return Answer(status: http.statusCode, headers: http.allHeaderFields, body: String(decoding: data, as: UTF8.self))
    }

    @Test func answersEachStatusOnlyAfterTheLedgerHoldsTheEvent() async throws {
        let setup = try Setup()
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let httpPort = try await worker.httpPort()

        // A valid SET: 202, empty body, and the event is in the ledger by then.
        let token = try WorkerTests.token(subject: "user-1")
        let accepted = try await Self.send(port, token)
        #expect(accepted.status == 202, "\(accepted.body)")
        #expect(accepted.body.isEmpty)
        let events = try SQLiteLedgerReader(path: setup.ledgerPath).events()
        #expect(events.map(\.token) == [token])
        #expect(events.first?.source == "push")

        // The same SET again: 202 every time, recorded as a duplicate delivery.
        #expect(try await Self.send(port, token).status == 202)
        #expect(try await Self.send(port, "\(token)\n", contentType: "Application/SecEvent+JWT; charset=us-ascii").status == 202)
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 1)
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().filter { $0.verdict == "duplicate" }.count == 2)

        // A forged SET: 400, JSON with the RFC 8935 code, in English; kept as a rejection.
        let forged = try WorkerTests.token(subject: "user-1", key: WorkerTests.impostor)
        let refused = try await Self.send(port, forged)
        #expect(refused.status == 400)
        #expect(refused.header("Content-Type") == "application/json")
        #expect(refused.header("Content-Language") == "en")
        let json = try #require(try JSONSerialization.jsonObject(with: Data(refused.body.utf8)) as? [String: String])
        #expect(json["err"] == "invalid_key")
        #expect(json["description"]?.isEmpty == false)
        #expect(!refused.body.contains(forged))
        // An issuer not configured here: the answer does not list the ones that are.
        let stranger = try SETMinting.SETMinter.token(
            claims: SETMinter.riscClaims(issuer: "https://stranger.example/", audience: WorkerTests.audience, subject: "user-1",
                                         jti: UUID().uuidString), key: WorkerTests.ec)
        let unknown = try await Self.send(port, stranger)
        #expect(unknown.status == 400)
        #expect(unknown.body.contains("\"err\":\"invalid_issuer\""))
        #expect(!unknown.body.contains(WorkerTests.issuer) && !unknown.body.contains(WorkerTests.audience))
        // Junk: 400 invalid_request, never a 5xx.
        let junk = try await Self.send(port, "not a token \u{1}\u{2}")
        #expect(junk.status == 400)
        #expect(junk.body.contains("\"err\":\"invalid_request\""))
        let rejections = try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().filter { $0.verdict == "invalid" }
        #expect(rejections.map(\.errorCode) == ["invalid_key", "invalid_issuer", "invalid_request"])
        #expect(rejections.allSatisfy { $0.source == "push" })

        // Without the bearer token, or with a wrong one: 401 with the challenge, and nothing
        // about the configuration.
        for bearer in [nil, "guess"] as [String?] {
            let denied = try await Self.send(port, token, bearer: bearer)
            #expect(denied.status == 401)
            #expect(denied.header("WWW-Authenticate")?.hasPrefix("Bearer") == true)
            #expect(denied.body.isEmpty)
        }
        #expect(try await Self.send(port, token, bearer: "another-token").status == 202)

        // Another content type, a body over the limit, another method.
        let wrongType = try await Self.send(port, token, contentType: "application/jwt")
        #expect(wrongType.status == 415)
        #expect(try await Self.send(port, String(repeating: "a", count: 9000)).status == 413)
        let get = try await Self.send(port, "", method: "GET")
        #expect(get.status == 405)
        #expect(get.header("Allow") == "POST")

        let metrics = try await WorkerTests.httpGet(httpPort, "/metrics").1
        #expect(metrics.contains(#"warden_push_requests_total{status="202"} 4"#))
        #expect(metrics.contains(#"warden_push_requests_total{status="400"} 3"#))
        #expect(metrics.contains(#"warden_push_requests_total{status="401"} 2"#))
        #expect(metrics.contains(#"warden_events_received_total{source="push"} 7"#))
        #expect(try await WorkerTests.httpGet(httpPort, "/readyz").0 == 200)

        #expect(await worker.terminate() == 0)
        #expect(!worker.standardError.contains(token))
        #expect(!worker.standardError.contains(Self.bearer))
    }

    /// Keys that cannot be had: the sender is told to try again later, and nothing waits.
    @Test func aSetWhoseKeysCannotBeHadIsAnswered503WithRetryAfter() async throws {
        let setup = try Setup(keySource: "jwks-uri: http://127.0.0.1:1/jwks.json", bearerTokens: false)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let answer = try await Self.send(port, try WorkerTests.token(subject: "user-2"), bearer: nil)
        #expect(answer.status == 503)
        #expect(answer.header("Retry-After") == "5")
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).events().isEmpty)
        #expect(await worker.terminate() == 0)
    }

    @Test func aReceiverWithAKafkaSectionIsRefusedAtStartNotIgnored() async throws {
        let setup = try Setup()
        defer { setup.cleanUp() }
        let text = try String(contentsOf: setup.config, encoding: .utf8) + "\nkafka:\n  brokers: embedded\n"
        try text.write(to: setup.config, atomically: true, encoding: .utf8)
        let result = try await Warden.run(["run", "--config", setup.config.path])
        #expect(result.status == 2)
        #expect(result.stderr.contains("receiver"))
    }
}
