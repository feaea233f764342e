import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import Ledger
import SETMinting
import SecurityEvents
import Synchronization
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

        /// `receiver`: one more line of the receiver section (e.g. `idle-timeout: 1s`).
        init(keySource: String = "jwks-file: jwks.json", bearerTokens: Bool = true, receiver: String = "", extra: String = "") throws {
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
              \(receiver)
            http:
              listen: 127.0.0.1:0
            ledger: sqlite:ledger.sqlite
            \(extra)
            """.write(to: config, atomically: true, encoding: .utf8)
        }

        func cleanUp() { try? FileManager.default.removeItem(at: directory) }
    }

    /// Runs `script` in python3 (an independent client) with `s`, a socket connected to the
    /// receiver's `port`, and `argument` as `sys.argv[2]`; returns what it prints.
    static func rawClient(_ port: Int, _ script: String, _ argument: String? = nil) async throws -> String {
        let prelude = """
            import socket, sys, time
            s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))

            """
        return try await runProgram("/usr/bin/python3", ["-c", prelude + script, "\(port)"] + (argument.map { [$0] } ?? []))
    }

    /// A client that sends a request head (its argument, `|` for CRLF), then a body byte
    /// every 0.2 s at most for 15 s; prints the answer's status (`-`: none) and whether the
    /// connection was closed meanwhile.
    static let trickle = """
        s.sendall(sys.argv[2].encode().replace(b"|", b"\\r\\n"))
        s.settimeout(0.2)
        answer, started, verdict = b"", time.time(), "still open"
        while time.time() - started < 15:
            try:
                s.sendall(b"x")
                part = s.recv(4096)
                if part == b"":
                    verdict = "closed"; break
                answer += part
            except socket.timeout:
                pass
            except OSError:
                verdict = "closed"; break
        print(answer.split(b" ")[1].decode() if answer else "-", verdict)
        """

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
        for bearer in [nil, "guess", String(Self.bearer.dropLast()), Self.bearer + "0", Self.bearer.uppercased()] as [String?] {
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
        #expect(metrics.contains(#"warden_push_requests_total{status="401"} 5"#))
        #expect(metrics.contains(#"warden_events_received_total{source="push"} 7"#))
        #expect(try await WorkerTests.httpGet(httpPort, "/readyz").0 == 200)

        #expect(await worker.terminate() == 0)
        #expect(!worker.standardError.contains(token))
        #expect(!worker.standardError.contains(Self.bearer))
    }

    /// Bodies no transmitter should send: each is answered 400 (413 over the limit), none crashes
    /// the receiver or is answered with a 5xx, and the receiver still takes a good SET after them.
    @Test func badBodiesAreRefusedAndNeverCrashIt() async throws {
        let setup = try Setup(bearerTokens: false)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let token = try WorkerTests.token(subject: "user-b")
        let parts = token.split(separator: ".")
        let bodies: [(String, Data)] = [
            ("empty", Data()),
            ("binary", Data((0..<512).map { UInt8(truncatingIfNeeded: $0 &* 37) })),
            ("invalid UTF-8", Data([0xC3, 0x28, 0x2E, 0xFF, 0xFE, 0x2E, 0x80])),
            ("a truncated SET", Data(token.prefix(token.count / 2).utf8)),
            ("a SET without its signature", Data((parts[0] + "." + parts[1] + ".").utf8)),
            ("five parts (JWE)", Data("a.b.c.d.e".utf8)),
            ("NUL bytes", Data([0x65, 0x79, 0x00, 0x2E, 0x00, 0x2E, 0x00])),
            ("JSON, not a JWS", Data(#"{"iss":"https://accounts.google.com/"}"#.utf8)),
        ]
        for (name, body) in bodies {
            var request = URLRequest(url: URL(string: "http://127.0.0.1:\(port)/events")!)
            request.httpMethod = "POST"
            request.httpBody = body
            request.setValue("application/secevent+jwt", forHTTPHeaderField: "Content-Type")
            let (data, response) = try await URLSession.shared.data(for: request)
            let status = (response as! HTTPURLResponse).statusCode
            #expect(status == 400, "\(name): \(status)")
            #expect(String(decoding: data, as: UTF8.self).contains("\"err\":\"invalid_request\"") || String(decoding: data, as: UTF8.self).contains("\"err\":\"invalid_key\""), "\(name)")
        }
        #expect(try await Self.send(port, String(repeating: "x", count: 20_000), bearer: nil).status == 413)
        #expect(try await Self.send(port, token, bearer: nil).status == 202)
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().filter { $0.verdict == "invalid" }.count == bodies.count)
        #expect(await worker.terminate() == 0)
    }

    /// A SIGKILL in the middle of a burst: every SET that was answered 202 is in the ledger.
    @Test func aKillDuringABurstLosesNoSetThatGot202() async throws {
        let setup = try Setup(bearerTokens: false)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let tokens = try (0..<400).map { i in
            (jti: "burst-\(i)", token: try WorkerTests.token(jti: "burst-\(i)", subject: "user-\(i % 37)"))
        }
        final class Burst: Sendable {
            let next = Mutex(0), answered = Mutex(0), accepted = Mutex<[String]>([])
        }
        let burst = Burst()
        await withTaskGroup(of: Void.self) { group in
            for _ in 0..<16 {
                group.addTask {
                    while true {
                        let i = burst.next.withLock { n -> Int in defer { n += 1 }; return n }
                        guard i < tokens.count else { return }
                        let status = (try? await Self.send(port, tokens[i].token, bearer: nil).status) ?? 0
                        if status == 202 { burst.accepted.withLock { $0.append(tokens[i].jti) } }
                        let count = burst.answered.withLock { n -> Int in n += 1; return n }
                        if count == 150 { await worker.kill() }
                    }
                }
            }
        }
        let acknowledged = burst.accepted.withLock { $0 }
        #expect(acknowledged.count >= 100)
        #expect(acknowledged.count < tokens.count)  // the kill came mid-burst
        let recorded = Set(try SQLiteLedgerReader(path: setup.ledgerPath).events().map(\.jti))
        #expect(Set(acknowledged).subtracting(recorded).isEmpty, "answered 202 but not in the ledger: \(Set(acknowledged).subtracting(recorded).sorted().prefix(5))")
    }

    /// A client that opens a connection and sends half a request line holds it no longer than
    /// `idle-timeout`: the receiver closes it (seen by an independent client, python3).
    @Test func aSilentConnectionIsClosedAfterTheIdleTimeout() async throws {
        let setup = try Setup(receiver: "idle-timeout: 1s")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let client = """
            s.sendall(b"POST /events HTTP/1.1\\r\\nHost: x")
            s.settimeout(20)
            try:
                print("closed" if s.recv(1) == b"" else "answered")
            except socket.timeout:
                print("still open")
            """
        #expect(try await Self.rawClient(port, client) == "closed")
        // A request that is sent whole is still answered.
        #expect(try await Self.send(port, try WorkerTests.token(subject: "u-idle"), bearer: Self.bearer).status == 202)
        #expect(await worker.terminate() == 0)
    }

    // A request refused before its body is read (no bearer token, a body announced too large,
    // another method): the connection is closed once the answer is written, not kept reading
    // the rest of the body a byte at a time, each byte restarting the idle timer.
    @Test func aRequestRefusedBeforeItsBodyIsReadHasItsConnectionClosed() async throws {
        let setup = try Setup(receiver: "idle-timeout: 1s")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let heads = [
            ("POST /events HTTP/1.1|Host: x|Content-Type: application/secevent+jwt|Content-Length: 100000||", 401),
            ("POST /events HTTP/1.1|Host: x|Authorization: Bearer \(Self.bearer)|Content-Type: application/secevent+jwt|Content-Length: 10000000000||", 413),
            ("PUT /events HTTP/1.1|Host: x|Content-Length: 100000||", 405),
        ]
        for (head, status) in heads {
            #expect(try await Self.rawClient(port, Self.trickle, head) == "\(status) closed")
        }
        // A request sent whole is still answered, on a connection kept open.
        #expect(try await Self.send(port, try WorkerTests.token(subject: "u-refused"), bearer: Self.bearer).status == 202)
        #expect(await worker.terminate() == 0)
    }

    /// An authenticated request whose body trickles in a byte at a time (each byte restarting
    /// the idle timer) holds its connection no longer than `idle-timeout` after its head: the
    /// connection is closed and nothing of the body is taken.
    @Test func aBodyThatTricklesInHasItsConnectionClosed() async throws {
        let setup = try Setup(receiver: "idle-timeout: 1s")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        // 1,000 bytes announced, one sent every 0.2 s at most: 200 s to arrive whole.
        let head = "POST /events HTTP/1.1|Host: x|Authorization: Bearer \(Self.bearer)|Content-Type: application/secevent+jwt|Content-Length: 1000||"
        // Closed before an answer could be written, or just after one.
        #expect(["- closed", "408 closed"].contains(try await Self.rawClient(port, Self.trickle, head)))
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().isEmpty)
        // A request sent whole is still answered.
        #expect(try await Self.send(port, try WorkerTests.token(subject: "u-trickle"), bearer: Self.bearer).status == 202)
        #expect(await worker.terminate() == 0)
    }

    /// Connections past `max-connections` wait in the listen queue, unanswered, until one of
    /// those open closes; then they are taken and answered.
    @Test func connectionsPastTheMaximumWaitUntilOneCloses() async throws {
        let setup = try Setup(receiver: "max-connections: 3")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        // Three connections, each answered once (so each was taken) and left open (a `404`
        // keeps its connection; the `405` of another method on the endpoint closes it); a
        // fourth sends a request, and is answered only once one of the three has closed.
        let script = """
            import socket, sys, time
            port = int(sys.argv[1])
            request = b"GET /elsewhere HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"
            def answered(s, seconds):
                s.settimeout(seconds)
                try:
                    return s.recv(4096).startswith(b"HTTP/1.1 ")
                except socket.timeout:
                    return False
            held = []
            for _ in range(3):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(request)
                if not answered(s, 10):
                    print("an open connection was not answered"); sys.exit()
                held.append(s)
            fourth = socket.create_connection(("127.0.0.1", port))
            fourth.sendall(request)
            early = answered(fourth, 3)
            held[0].close()
            later = early or answered(fourth, 15)
            print(("answered-early" if early else "held") + " " + ("answered" if later else "never-answered"))
            """
        let outcome = try await runProgram("/usr/bin/python3", ["-c", script, "\(port)"])
        #expect(outcome == "held answered", "\(outcome)")
        // With the others closed, requests are answered as before.
        #expect(try await Self.send(port, try WorkerTests.token(subject: "u-connections"), bearer: Self.bearer).status == 202)
        #expect(await worker.terminate() == 0)
    }

    /// The receiver and the health server on one address: both answer there.
    @Test func theReceiverAndTheHealthEndpointsShareOneAddress() async throws {
        let port = try freeLoopbackPort()
        let setup = try Setup(bearerTokens: false)
        defer { setup.cleanUp() }
        let text = try String(contentsOf: setup.config, encoding: .utf8)
            .replacingOccurrences(of: "listen: 127.0.0.1:0", with: "listen: 127.0.0.1:\(port)")
        try text.write(to: setup.config, atomically: true, encoding: .utf8)
        let worker = try WorkerProcess(config: setup.config)
        #expect(try await worker.announcedPort("receiver") == port)
        #expect(try await Self.send(port, try WorkerTests.token(subject: "user-s"), bearer: nil).status == 202)
        let (ready, _) = try await WorkerTests.httpGet(port, "/readyz")
        #expect(ready == 200)
        let metrics = try await WorkerTests.httpGet(port, "/metrics").1
        #expect(metrics.contains(#"warden_push_requests_total{status="202"} 1"#))
        #expect(await worker.terminate() == 0)
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

    /// A RISC verification SET of the test issuer, echoing `state` when given.
    static func verification(state: String?) throws -> String {
        let payload: JSONObject = state.map { ["state": .string($0)] } ?? [:]
        return try SETMinter.token(claims: ["iss": .string(WorkerTests.issuer), "aud": .string(WorkerTests.audience),
                                            "iat": .number(Date().timeIntervalSince1970.rounded(.down)), "jti": .string(UUID().uuidString),
                                            "events": .object([EventType.riscVerification.uri: .object(payload)])],
                                   key: WorkerTests.ec)
    }

    /// The topic's messages, read by an independent client (kcat): key, headers, value.
    static func topicMessages(_ brokers: String, _ topic: String = "security-events") async throws -> [(key: String, headers: [String: String], value: String)] {
        let read = try await runToEnd(URL(fileURLWithPath: "/usr/bin/kcat"),
                                      ["-C", "-b", brokers, "-t", topic, "-e", "-q", "-f", "%k\t%h\t%s\n"])
        #expect(read.status == 0, "kcat failed: \(read.stderr)")
        return read.stdout.split(separator: "\n").map { line in
            let parts = line.split(separator: "\t", maxSplits: 2, omittingEmptySubsequences: false).map(String.init)
            var headers: [String: String] = [:]
            for pair in parts[1].split(separator: ",") {
                let nameValue = pair.split(separator: "=", maxSplits: 1).map(String.init)
                headers[nameValue[0]] = nameValue.count > 1 ? nameValue[1] : ""
            }
            return (parts[0], headers, parts[2])
        }
    }

    /// With `kafka:`, a pushed SET is verified, produced to the topic and answered 202 once the
    /// cluster has it; the worker side then records it as any message of the topic.
    @Test func withKafkaAPushedSetIsAnswered202OnceOnTheTopicAndTheWorkerRecordsIt() async throws {
        let setup = try WorkerTests.Setup(extra: """
            receiver:
              listen: 127.0.0.1:0
            """)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let brokers = setup.cluster.bootstrapServers

        let token = try WorkerTests.token(subject: "user-k")
        #expect(try await Self.send(port, token + "\n", bearer: nil).status == 202)
        // On the topic by the time the answer came.
        let first = try await Self.topicMessages(brokers)
        #expect(first.count == 1)
        #expect(first.first?.value == token)
        #expect(first.first?.headers["content-type"] == "application/secevent+jwt")
        #expect(first.first?.headers["source"] == "push")
        let rfc3339 = ISO8601DateFormatter()
        rfc3339.formatOptions = [.withInternetDateTime, .withFractionalSeconds]
        #expect(first.first?.headers["received-at"].flatMap { rfc3339.date(from: $0) } != nil)
        // The key: a stable hash of issuer and subject, the same for the subject's next event,
        // another for another subject; it names neither.
        #expect(try await Self.send(port, try WorkerTests.token(subject: "user-k"), bearer: nil).status == 202)
        #expect(try await Self.send(port, try WorkerTests.token(subject: "user-l"), bearer: nil).status == 202)
        let keys = try await Self.topicMessages(brokers).map(\.key)
        #expect(keys.count == 3)
        #expect(keys[0] == keys[1] && keys[0] != keys[2] && !keys[0].isEmpty)
        #expect(!keys[0].contains("user-k"))

        // The worker side records them from the topic.
        try await WorkerTests.waitFor("the pushed events recorded by the worker") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 3
        }
        let events = try SQLiteLedgerReader(path: setup.ledgerPath).events()
        #expect(events.allSatisfy { $0.source.hasPrefix("kafka:security-events/") })

        // A duplicate: 202 again (the worker finds it known); a forged SET: 400, kept in the
        // ledger as a pushed rejection, and never on the topic.
        #expect(try await Self.send(port, token, bearer: nil).status == 202)
        let forged = try await Self.send(port, try WorkerTests.token(subject: "user-k", key: WorkerTests.impostor), bearer: nil)
        #expect(forged.status == 400)
        #expect(forged.body.contains("\"err\":\"invalid_key\""))
        // A verification whose state Warden never asked for: 400 invalid_state, not produced; one
        // without a state (sent unasked) is taken.
        let unasked = try await Self.send(port, try Self.verification(state: "never-asked"), bearer: nil)
        #expect(unasked.status == 400)
        #expect(unasked.body.contains("\"err\":\"invalid_state\""))
        #expect(try await Self.send(port, try Self.verification(state: nil), bearer: nil).status == 202)
        #expect(try await Self.topicMessages(brokers).count == 5)
        try await WorkerTests.waitFor("the duplicate recorded") {
            try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().contains { $0.verdict == "duplicate" }
        }
        let rejections = try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().filter { $0.verdict == "invalid" }
        #expect(rejections.map(\.source) == ["push", "push"])
        #expect(rejections.map(\.errorCode) == ["invalid_key", "invalid_state"])
        try await WorkerTests.waitFor("the verification recorded") { try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 4 }
        // The two refused pushes are counted as invalid events, as the pipeline counts its own.
        let metrics = try await WorkerTests.httpGet(try await worker.httpPort(), "/metrics").1
        #expect(metrics.contains(#"warden_events_total{outcome="invalid"} 2"#), "\(metrics)")
        #expect(await worker.terminate() == 0)
    }

    /// A cluster that cannot be reached: the sender hears 503 with Retry-After within the
    /// producer's delivery timeout, and nothing is recorded.
    @Test func withKafkaUnreachableAPushIsAnswered503() async throws {
        let setup = try Setup(bearerTokens: false, extra: """
            kafka:
              brokers: 127.0.0.1:\(try freeLoopbackPort())
              properties: {message.timeout.ms: "1500"}
            """)
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let answer = try await Self.send(port, try WorkerTests.token(subject: "user-m"), bearer: nil)
        #expect(answer.status == 503)
        #expect(answer.header("Retry-After") == "5")
        #expect(await worker.terminate() == 0)
    }

    /// Each client address has its own rate: past its burst it hears 429 with Retry-After.
    @Test func aClientOverItsRateIsAnswered429() async throws {
        let setup = try Setup(bearerTokens: false, receiver: "rate-limit: {per-second: 0.001, burst: 3}")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let httpPort = try await worker.httpPort()
        var statuses: [Int] = []
        for i in 0..<5 { statuses.append(try await Self.send(port, try WorkerTests.token(subject: "rate-\(i)"), bearer: nil).status) }
        #expect(statuses.prefix(3).allSatisfy { $0 == 202 })
        // One request refills every 1,000 s: past the burst, each is refused however slow the machine.
        #expect(statuses.suffix(2) == [429, 429], "\(statuses)")
        let limited = try await Self.send(port, "x", bearer: nil)
        #expect(limited.status == 429)
        #expect(Int(limited.header("Retry-After") ?? "") ?? 0 >= 1)
        let (ready, readiness) = try await WorkerTests.httpGet(httpPort, "/readyz")
        #expect(ready == 200, "\(readiness)")
        #expect(await worker.terminate() == 0)
    }

    /// Refusals kept in the ledger have a budget per address, a hundredth of the rate: past
    /// it, junk is answered 400 as before but leaves nothing behind, so a flood of it cannot
    /// fill the ledger's disk; a genuine SET is still taken.
    @Test func refusalsPastTheirBudgetAreAnsweredButNotKept() async throws {
        let setup = try Setup(bearerTokens: false, receiver: "rate-limit: {per-second: 100, burst: 200}")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        let httpPort = try await worker.httpPort()
        // Sent at once: they must not all find the budget's places left.
        let statuses = try await withThrowingTaskGroup(of: Int.self) { group in
            for i in 0..<8 { group.addTask { try await Self.send(port, "junk \(i)", bearer: nil).status } }
            return try await group.reduce(into: [Int]()) { $0.append($1) }
        }
        #expect(statuses == Array(repeating: 400, count: 8), "\(statuses)")
        let forged = try await Self.send(port, try WorkerTests.token(subject: "u", key: WorkerTests.impostor), bearer: nil)
        #expect(forged.status == 400)
        #expect(forged.body.contains("\"err\":\"invalid_key\""))
        #expect(try await Self.send(port, try WorkerTests.token(subject: "genuine"), bearer: nil).status == 202)
        let kept = try SQLiteLedgerReader(path: setup.ledgerPath).deliveries().filter { $0.verdict == "invalid" }.count
        let metrics = try await WorkerTests.httpGet(httpPort, "/metrics").1
        let notKept = metrics.split(separator: "\n").first { $0.hasPrefix("warden_push_refusals_not_kept_total ") }
            .flatMap { Int($0.split(separator: " ").last ?? "") } ?? 0
        // Two at once (the budget's burst), then one a second.
        #expect(kept >= 2 && kept <= 4, "\(kept) kept")
        #expect(kept + notKept == 9, "\(kept) kept, \(notKept) not")
        #expect(metrics.contains(#"warden_verify_failures_total{err="invalid_key"}"#))
        #expect(try SQLiteLedgerReader(path: setup.ledgerPath).events().count == 1)
        #expect(await worker.terminate() == 0)
    }

    /// Requests that fail authentication have a rate of their own: a flood of them from an
    /// address (a load balancer's) does not make a transmitter behind it hear 429.
    @Test func requestsFailingAuthenticationDoNotUseUpATransmittersRate() async throws {
        let setup = try Setup(receiver: "rate-limit: {per-second: 0.001, burst: 3}")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        let port = try await worker.announcedPort("receiver")
        var statuses: [Int] = []
        for i in 0..<6 { statuses.append(try await Self.send(port, try WorkerTests.token(subject: "junk-\(i)"), bearer: "wrong").status) }
        #expect(statuses.prefix(3).allSatisfy { $0 == 401 }, "\(statuses)")
        #expect(statuses.suffix(3) == [429, 429, 429], "\(statuses)")
        #expect(try await Self.send(port, try WorkerTests.token(subject: "genuine"), bearer: Self.bearer).status == 202)
        #expect(await worker.terminate() == 0)
    }

    /// No sender delivers a pushed SET again once it got its 202: steps a killed process left
    /// pending are resumed by the next start, the ones recorded done are not run again.
    @Test func stepsLeftPendingByAKillAreResumedAtTheNextStart() async throws {
        let redis = try await RedisServer()
        let hooks = try await KeyServer.start()
        hooks.serve("/hook", .init(body: "", status: 503))  // down until the test says otherwise
        // A max-age shorter than the outage: the resumed SET is judged as of when it arrived.
        let setup = try Setup(keySource: "jwks-file: jwks.json\n    max-age: 4s", bearerTokens: false, extra: """
            targets:
              sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}
              app: {webhook: {url: "\(hooks.url("/hook"))", hmac-secret: test-secret}}
            policy:
              sessions-revoked:
                - set-flag: {target: sessions, key: "step-one:{user}", value: "{jti}"}
                - notify: {target: app}
            """)
        defer { setup.cleanUp() }
        let jti = "pushed-then-killed"
        let first = try WorkerProcess(config: setup.config)
        let port = try await first.announcedPort("receiver")
        let token = try SETMinter.token(claims: SETMinter.riscClaims(issuer: WorkerTests.issuer, audience: WorkerTests.audience,
                                                                     event: .sessionsRevoked, subject: "u9", jti: jti),
                                        key: WorkerTests.ec)
        #expect(try await Self.send(port, token, bearer: nil).status == 202)
        try await WorkerTests.waitFor("step one done, step two retried") {
            let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
            guard let event = try reader.events().first else { return false }
            return try reader.steps(ofEvent: event.id).map(\.status) == [.done, .pending] && hooks.requests("/hook") >= 2
        }
        #expect(try await redis.cli(["GET", "step-one:u9"]) == jti)
        await first.kill()

        // If step one ran again, this key would come back.
        _ = try await redis.cli(["DEL", "step-one:u9"])
        hooks.serve("/hook", .init(body: "", status: 200))
        let failingCalls = hooks.requests("/hook")
        try await Task.sleep(for: .seconds(4))  // the SET is now older than max-age
        let second = try WorkerProcess(config: setup.config)
        _ = try await second.announcedPort("receiver")
        try await WorkerTests.waitFor("the event processed after the restart, with nothing pushed again") {
            try SQLiteLedgerReader(path: setup.ledgerPath).events().first?.outcome == "processed"
        }
        #expect(hooks.requests("/hook") == failingCalls + 1)  // step two: once, after the restart
        #expect(try await redis.cli(["EXISTS", "step-one:u9"]) == "0")  // step one: not again
        let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
        #expect(try reader.events().count == 1)
        #expect(try reader.deliveries().map(\.source) == ["resume"])
        let metrics = try await WorkerTests.httpGet(try await second.httpPort(), "/metrics").1
        #expect(metrics.contains("warden_events_resumed_total 1"))
        #expect(await second.terminate() == 0)
    }
}
