import Foundation
import Kafka
import Ledger
import SETMinting
import SecurityEvents
import Testing
import WardenTestSupport

/// `warden stream …` against local fakes of Google's RISC API and of an SSF transmitter (real
/// HTTP on loopback), and `warden run` polling the SSF one (RFC 8936).
@Suite("warden stream and the poll door", .serialized, .timeLimit(.minutes(5)))
struct StreamCommandTests {
    static let riscPrefix = "https://schemas.openid.net/secevent/risc/event-type/"

    static func json(_ text: String) throws -> JSONObject {
        try #require(try JSONParser.parse(text).objectValue)
    }

    static func jwtClaims(_ authorization: String?) throws -> JSONObject {
        let token = try #require(authorization?.dropFirst("Bearer ".count))
        let parts = token.split(separator: ".")
        return try #require(try JSONParser.parse(Base64URL.decode(String(parts[1]))!).objectValue)
    }

    /// A config whose issuer's stream is managed through `stream`, with a push receiver.
    static func config(_ directory: URL, stream: String, receiver: Bool = true) throws -> URL {
        let config = directory.appendingPathComponent("warden.yaml")
        try """
        \(WorkerTests.issuerSection("jwks-file: jwks.json"))
            stream:
        \(stream.split(separator: "\n").map { "      " + $0 }.joined(separator: "\n"))
        \(receiver ? "receiver:\n  listen: 127.0.0.1:0" : "")
        http:
          listen: 127.0.0.1:0
        ledger: sqlite:ledger.sqlite
        """.write(to: config, atomically: true, encoding: .utf8)
        return config
    }

    @Test func googleCallsCarryTheServiceAccountJWTAndAVerificationMakesTheRoundTrip() async throws {
        let risc = try await KeyServer.start()
        risc.serve("/v1beta/stream:update", json: "{}")
        risc.serve("/v1beta/stream", json: #"{"delivery":{"url":"https://warden.example.com/events"},"events_delivered":[]}"#)
        risc.serve("/v1beta/stream/status", json: #"{"status":"enabled"}"#)
        risc.serve("/v1beta/stream/status:update", json: "{}")
        risc.serve("/v1beta/stream:verify", json: "{}")
        let account = try SigningKey.rsa(keyID: "sa-key-7")
        let directory = try WorkerTests.keyFolder()
        let keyFile: JSONValue = .object([
            "type": "service_account", "client_email": "risc@example-project.iam.gserviceaccount.com",
            "private_key_id": "sa-key-7", "private_key": .string(account.privateKeyPEM!),
        ])
        try keyFile.jsonText.write(to: directory.appendingPathComponent("sa.json"), atomically: true, encoding: .utf8)
        let config = try Self.config(directory, stream: """
            api: google
            endpoint: \(risc.baseURL)
            credentials-file: sa.json
            delivery: {method: push, endpoint-url: "https://warden.example.com/events"}
            events: [sessions-revoked, verification]
            """)

        // create: stream:update with Google's names, the account's JWT.
        let created = try await Warden.run(["stream", "create", "--config", config.path])
        #expect(created.status == 0, "\(created.stderr)")
        let update = try #require(risc.recordedRequests("/v1beta/stream:update").first)
        #expect(update.method == "POST")
        let body = try Self.json(update.body)
        #expect(body["delivery"] == .object(["delivery_method": "https://schemas.openid.net/secevent/risc/delivery-method/push",
                                              "url": "https://warden.example.com/events"]))
        #expect(body["events_requested"] == .array([.string(Self.riscPrefix + "sessions-revoked"), .string(Self.riscPrefix + "verification")]))
        let authorization = try #require(update.headers["authorization"])
        #expect(account.verifies(String(authorization.dropFirst("Bearer ".count))))
        let claims = try Self.jwtClaims(authorization)
        #expect(claims["iss"] == "risc@example-project.iam.gserviceaccount.com" && claims["sub"] == claims["iss"])
        #expect(claims["aud"] == "https://risc.googleapis.com/google.identity.risc.v1beta.RiscManagementService")

        // get and status print the API's JSON; disable posts the status.
        let got = try await Warden.run(["stream", "get", "--config", config.path])
        #expect(got.status == 0)
        #expect(try Self.json(got.stdout)["delivery"] != nil)
        let status = try await Warden.run(["stream", "status", "--config", config.path])
        #expect(try Self.json(status.stdout)["status"] == "enabled")
        #expect(try await Warden.run(["stream", "disable", "--config", config.path]).status == 0)
        #expect(try Self.json(try #require(risc.recordedRequests("/v1beta/stream/status:update").last).body) == ["status": "disabled"])

        // The API has no delete: said clearly, nothing sent. An error names the call, the status
        // and what to do.
        let deleted = try await Warden.run(["stream", "delete", "--config", config.path])
        #expect(deleted.status == 2)
        #expect(deleted.stderr.contains("warden stream disable"))
        risc.enqueue("/v1beta/stream", [.init(body: #"{"error":{"code":404,"message":"Not found."}}"#, status: 404)])
        let missing = try await Warden.run(["stream", "get", "--config", config.path])
        #expect(missing.status == 1)
        #expect(missing.stderr.contains("read the stream failed: HTTP 404"))
        #expect(missing.stderr.contains("warden stream create"))
        #expect(!missing.stderr.contains(String(authorization.dropFirst(7).prefix(40))))
        risc.enqueue("/v1beta/stream:update", [.init(body: "{}", status: 403)])
        let forbidden = try await Warden.run(["stream", "update", "--config", config.path])
        #expect(forbidden.status == 1)
        #expect(forbidden.stderr.contains("HTTP 403") && forbidden.stderr.contains("roles/riscconfigs.admin"))

        // verify: a fresh state, asked of the API; the test plays Google and pushes the
        // verification SET to the running receiver; the command sees it recorded.
        let worker = try WorkerProcess(config: config)
        let port = try await worker.announcedPort("receiver")
        let verifying = Task { try await Warden.run(["stream", "verify", "--config", config.path, "--timeout", "60"]) }
        try await WorkerTests.waitFor("the verification asked of the API") { !risc.recordedRequests("/v1beta/stream:verify").isEmpty }
        let verifyRequest = try #require(risc.recordedRequests("/v1beta/stream:verify").first)
        let state = try #require(try Self.json(verifyRequest.body)["state"]?.stringValue)
        #expect(state.count >= 16)
        // One whose state Warden never asked for is refused; the asked one is taken.
        let unasked = try await PushReceiverTests.send(port, try PushReceiverTests.verification(state: "not-asked-by-warden"), bearer: nil)
        #expect(unasked.status == 400)
        #expect(unasked.body.contains("\"err\":\"invalid_state\""))
        #expect(try await PushReceiverTests.send(port, try PushReceiverTests.verification(state: state), bearer: nil).status == 202)
        let verified = try await verifying.value
        #expect(verified.status == 0, "\(verified.stderr)")
        #expect(try Self.json(verified.stdout)["verified"] == true)
        #expect(try Self.json(verified.stdout)["round_trip_ms"]?.numberValue != nil)
        #expect(await worker.terminate() == 0)
        try? FileManager.default.removeItem(at: directory)
        await risc.stop()
    }

    /// A local SSF transmitter: discovery, stream endpoints, and a poll endpoint.
    static func transmitter() async throws -> KeyServer {
        let ssf = try await KeyServer.start()
        ssf.serve("/.well-known/ssf-configuration", json: """
            {"issuer":"\(ssf.baseURL)","jwks_uri":"\(ssf.url("/jwks"))","configuration_endpoint":"\(ssf.url("/streams"))",
             "status_endpoint":"\(ssf.url("/status"))","verification_endpoint":"\(ssf.url("/verify"))",
             "delivery_methods_supported":["urn:ietf:rfc:8935","urn:ietf:rfc:8936"]}
            """)
        ssf.serve("/jwks", json: SETMinter.jwks([WorkerTests.ec]))
        return ssf
    }

    static func ssfIssuerSection(_ ssf: KeyServer, stream: String) -> String {
        """
        issuers:
          - issuer: \(ssf.baseURL)
            jwks-uri: \(ssf.url("/jwks"))
            audiences: [\(WorkerTests.audience)]
            algorithms: [ES256]
            profile: ssf
            stream:
        \(stream.split(separator: "\n").map { "      " + $0 }.joined(separator: "\n"))
        """
    }

    /// A scratch folder with the test keys, a bearer-token file, and a config whose only issuer
    /// is `ssf`'s, with this `stream:` section and `extra` top-level sections.
    static func ssfConfig(_ ssf: KeyServer, bearer: String, stream: String, extra: String = "") throws -> (directory: URL, config: URL) {
        let directory = try WorkerTests.keyFolder()
        try (bearer + "\n").write(to: directory.appendingPathComponent("bearer"), atomically: true, encoding: .utf8)
        let config = directory.appendingPathComponent("warden.yaml")
        try """
        \(Self.ssfIssuerSection(ssf, stream: stream))
        \(extra)
        ledger: sqlite:ledger.sqlite
        """.write(to: config, atomically: true, encoding: .utf8)
        return (directory, config)
    }

    /// The `stream:` section of an SSF stream polled at `ssf`'s /poll with the bearer token file.
    static func pollStream(_ ssf: KeyServer) -> String {
        """
        api: ssf
        credentials-file: bearer
        delivery: {method: poll, endpoint-url: "\(ssf.url("/poll"))"}
        events: [session-revoked]
        """
    }

    static func ssfToken(_ ssf: KeyServer, jti: String, key: SigningKey = WorkerTests.ec) throws -> String {
        try SETMinter.token(claims: [
            "iss": .string(ssf.baseURL), "aud": .string(WorkerTests.audience), "iat": .number(Date().timeIntervalSince1970.rounded(.down)),
            "jti": .string(jti), "sub_id": .object(["format": "email", "email": "user@example.com"]),
            "events": .object(["https://schemas.openid.net/secevent/caep/event-type/session-revoked": .object([:])]),
        ], key: key, type: "secevent+jwt")
    }

    @Test func anSSFStreamIsCreatedWithItsIdKeptAndAStreamOfAnotherIssuerIsRefused() async throws {
        let ssf = try await Self.transmitter()
        ssf.serve("/streams", .init(body: """
            {"stream_id":"strm-1","iss":"\(ssf.baseURL)","aud":"\(WorkerTests.audience)","delivery":{"method":"urn:ietf:rfc:8936","endpoint_url":"\(ssf.url("/poll"))"},
             "events_requested":[],"events_delivered":[]}
            """, status: 201, headers: ["Content-Type": "application/json"]))
        ssf.serve("/status", json: #"{"stream_id":"strm-1","status":"enabled"}"#)
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "ssf-bearer-token-1", stream: """
            api: ssf
            credentials-file: bearer
            delivery: {method: poll}
            events: [session-revoked, verification]
            description: warden test
            """)

        let created = try await Warden.run(["stream", "create", "--config", config.path])
        #expect(created.status == 0, "\(created.stderr)")
        let request = try #require(ssf.recordedRequests("/streams").first)
        #expect(request.method == "POST")
        #expect(request.headers["authorization"] == "Bearer ssf-bearer-token-1")
        let body = try Self.json(request.body)
        // Only what a receiver may set.
        #expect(Set(body.map(\.name)) == ["events_requested", "delivery", "description"])
        #expect(body["delivery"] == .object(["method": "urn:ietf:rfc:8936"]))
        #expect(body["events_requested"] == .array(["https://schemas.openid.net/secevent/caep/event-type/session-revoked",
                                                     "https://schemas.openid.net/secevent/ssf/event-type/verification"]))
        // The id is kept in the ledger: later calls name it.
        let status = try await Warden.run(["stream", "status", "--config", config.path])
        #expect(status.status == 0, "\(status.stderr)")
        #expect(ssf.recordedRequests("/status").first?.path == "/status")
        #expect(try Self.json(status.stdout)["status"] == "enabled")
        let reading = try #require(ssf.recordedRequests("/status").first)
        #expect(reading.headers["authorization"] == "Bearer ssf-bearer-token-1")
        let deleted = try await Warden.run(["stream", "delete", "--config", config.path])
        #expect(deleted.status == 0, "\(deleted.stderr)")
        #expect(ssf.recordedRequests("/streams").last?.method == "DELETE")
        // Forgotten once deleted.
        let afterDelete = try await Warden.run(["stream", "status", "--config", config.path])
        #expect(afterDelete.status == 1)
        #expect(afterDelete.stderr.contains("no stream id"))

        // A transmitter that answers with another issuer's stream: refused and not used.
        ssf.serve("/streams", .init(body: #"{"stream_id":"strm-2","iss":"https://elsewhere.example/","delivery":{}}"#, status: 201,
                                    headers: ["Content-Type": "application/json"]))
        let foreign = try await Warden.run(["stream", "create", "--config", config.path])
        #expect(foreign.status == 1)
        #expect(foreign.stderr.contains("https://elsewhere.example/") && foreign.stderr.contains("not used"))
        let afterForeign = try await Warden.run(["stream", "status", "--config", config.path])
        #expect(afterForeign.stderr.contains("no stream id"))
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }

    /// An SSF stream's credentials never go in clear: an issuer that is not https (http only on
    /// loopback) is refused with a stream section, and a bearer token holding a control byte is
    /// refused without being echoed (the HTTP client would quote the whole header in its error).
    @Test func anSSFStreamsCredentialsNeverGoInClearNorIntoErrors() async throws {
        let ssf = try await Self.transmitter()
        let stream = """
            api: ssf
            credentials-file: bearer
            events: [session-revoked]
            """
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "ssf-bearer-token-1", stream: stream)
        let accepted = try await Warden.run(["check-config", "--config", config.path])
        #expect(accepted.status == 0, "\(accepted.stderr)")

        let text = try String(contentsOf: config, encoding: .utf8)
        try text.replacingOccurrences(of: "- issuer: \(ssf.baseURL)", with: "- issuer: http://transmitter.example/")
            .write(to: config, atomically: true, encoding: .utf8)
        let clear = try await Warden.run(["check-config", "--config", config.path])
        #expect(clear.status == 2)
        #expect(clear.stderr.contains("http://transmitter.example/") && clear.stderr.contains("not an https URL"), "\(clear.stderr)")

        try text.write(to: config, atomically: true, encoding: .utf8)
        try "ssf-bearer-token-1\u{0}\n".write(to: directory.appendingPathComponent("bearer"), atomically: true, encoding: .utf8)
        let control = try await Warden.run(["stream", "status", "--config", config.path])
        #expect(control.status == 2)
        #expect(control.stderr.contains("printable ASCII"), "\(control.stderr)")
        #expect(!control.stderr.contains("ssf-bearer-token-1"), "the token is echoed: \(control.stderr)")
        #expect(ssf.requests("/.well-known/ssf-configuration") == 0)
        // A timeout of centuries is a usage error, not a trap converting it to nanoseconds.
        try "ssf-bearer-token-1\n".write(to: directory.appendingPathComponent("bearer"), atomically: true, encoding: .utf8)
        #expect(try await Warden.run(["stream", "status", "--config", config.path, "--timeout", "5"]).status == 1, "no stream id yet")
        let forever = try await Warden.run(["stream", "status", "--config", config.path, "--timeout", "1e17"])
        #expect(forever.status == 2, "\(forever.stderr)")
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }

    /// A transmitter's words reach stderr without their control characters: an escape sequence
    /// in an error_description must not retitle the terminal or write its clipboard.
    @Test func aTransmittersEscapeSequencesDoNotReachTheTerminal() async throws {
        let ssf = try await Self.transmitter()
        ssf.serve("/status", .init(body: #"{"error":"access_denied","error_description":"\u001b]52;c;cHduZWQ=\u0007 no"}"#, status: 403,
                                   headers: ["Content-Type": "application/json"]))
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "ssf-bearer-token-1", stream: """
            api: ssf
            credentials-file: bearer
            stream-id: strm-1
            events: [session-revoked]
            """)
        let refused = try await Warden.run(["stream", "status", "--config", config.path])
        #expect(refused.status == 1)
        #expect(ssf.requests("/status") == 1)
        #expect(!refused.stderr.unicodeScalars.contains { $0.value == 0x1B || $0.value == 0x07 }, "\(refused.stderr.debugDescription)")
        #expect(refused.stderr.contains("\\u{1b}]52"), "\(refused.stderr.debugDescription)")
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }

    /// `warden run` polls: each SET persisted is acknowledged in the next request, an invalid one
    /// reported in setErrs, a redelivered one acknowledged again; Retry-After is honoured.
    @Test func polledSetsAreAcknowledgedOnlyOncePersistedAndInvalidOnesReported() async throws {
        let ssf = try await Self.transmitter()
        let good = try Self.ssfToken(ssf, jti: "p-1"), forged = try Self.ssfToken(ssf, jti: "p-2", key: WorkerTests.impostor)
        // The transmitter pauses the stream, and says so.
        let paused = try SETMinter.token(claims: [
            "iss": .string(ssf.baseURL), "aud": .string(WorkerTests.audience), "iat": .number(Date().timeIntervalSince1970.rounded(.down)),
            "jti": "su-1", "sub_id": .object(["format": "opaque", "id": "strm-1"]),
            "events": .object(["https://schemas.openid.net/secevent/ssf/event-type/stream-updated": .object(["status": "paused"])]),
        ], key: WorkerTests.ec, type: "secevent+jwt")
        ssf.enqueue("/poll", [
            .init(body: #"{"sets":{"p-1":"\#(good)","p-2":"\#(forged)","su-1":"\#(paused)"},"moreAvailable":true}"#, headers: ["Content-Type": "application/json"]),
            // Told to come back later: no request before it.
            .init(body: "", status: 429, headers: ["Retry-After": "3"]),
            // The same SET again (the transmitter did not see the ack): acknowledged again.
            .init(body: #"{"sets":{"p-1":"\#(good)"}}"#, headers: ["Content-Type": "application/json"]),
        ])
        ssf.serve("/poll", .init(body: #"{"sets":{}}"#, headers: ["Content-Type": "application/json"], delay: 0.3))
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "poll-token", stream: Self.pollStream(ssf), extra: "http:\n  listen: 127.0.0.1:0")
        let ledgerPath = directory.appendingPathComponent("ledger.sqlite").path
        let worker = try WorkerProcess(config: config)
        let httpPort = try await worker.httpPort()

        try await WorkerTests.waitFor("the 429 answered") { ssf.requests("/poll") >= 2 }
        // Retry-After: 3 — nothing for two seconds after the 429 (a backoff alone would be under one).
        let afterRefusal = ssf.requests("/poll")
        try await Task.sleep(for: .seconds(2))
        #expect(ssf.requests("/poll") == afterRefusal)
        try await WorkerTests.waitFor("the redelivery acknowledged") { ssf.requests("/poll") >= 4 }

        let bodies = try ssf.recordedRequests("/poll").map { try Self.json($0.body) }
        #expect(bodies.allSatisfy { $0["maxEvents"]?.numberValue ?? 0 > 0 })
        #expect(bodies[0]["ack"] == nil)
        // The second request acknowledges the persisted SET and reports the forged one.
        #expect(Set(bodies[1]["ack"]?.arrayValue?.compactMap(\.stringValue) ?? []) == ["p-1", "su-1"])
        let errors = try #require(bodies[1]["setErrs"]?.objectValue)
        #expect(errors["p-2"]?.objectValue?["err"] == "invalid_key")
        #expect(bodies[1]["returnImmediately"] == true)  // moreAvailable: at once
        // Refused with 429, the acknowledgement is sent again; the redelivery is acknowledged again.
        #expect(bodies[2]["ack"] == bodies[1]["ack"] && bodies[2]["setErrs"] != nil)
        #expect(bodies[3]["ack"] == .array(["p-1"]) && bodies[3]["setErrs"] == nil)
        // setErrs descriptions are English, and say so (RFC 8936).
        let recorded = ssf.recordedRequests("/poll")
        #expect(recorded[1].headers["content-language"] == "en" && recorded[3].headers["content-language"] == nil)
        #expect(ssf.recordedRequests("/poll").allSatisfy { $0.headers["authorization"] == "Bearer poll-token" })

        let reader = try SQLiteLedgerReader(path: ledgerPath)
        #expect(Set(try reader.events().map(\.jti)) == ["p-1", "su-1"])
        #expect(try reader.events().allSatisfy { $0.source == "poll" })
        // The stream's status, from its stream-updated event.
        let metrics = try await WorkerTests.httpGet(httpPort, "/metrics").1
        #expect(metrics.contains(#"warden_stream_status{issuer="\#(ssf.baseURL)",status="paused"} 1"#))
        #expect(metrics.contains(#"warden_stream_status{issuer="\#(ssf.baseURL)",status="enabled"} 0"#))
        #expect(metrics.contains(#"warden_events_received_total{source="poll"}"#))
        #expect(try reader.deliveries().map(\.verdict).sorted() == ["duplicate", "invalid"])
        #expect(await worker.terminate() == 0)
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }

    /// SSF: a SET's `iss` must be its stream's issuer. A genuine SET of another configured issuer
    /// answered by this stream's transmitter is refused (`access_denied`), not acted on.
    @Test func aPollStreamRefusesAnotherIssuersSET() async throws {
        let ssf = try await Self.transmitter()
        let other = "https://other.example/"
        let foreign = try SETMinter.token(claims: SETMinter.riscClaims(issuer: other, audience: WorkerTests.audience, subject: "s",
                                                                       jti: "foreign-1"), key: WorkerTests.ec)
        let own = try Self.ssfToken(ssf, jti: "own-1")
        ssf.enqueue("/poll", [.init(body: #"{"sets":{"foreign-1":"\#(foreign)","own-1":"\#(own)"}}"#,
                                    headers: ["Content-Type": "application/json"])])
        ssf.serve("/poll", .init(body: #"{"sets":{}}"#, headers: ["Content-Type": "application/json"], delay: 0.3))
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "poll-token", stream: Self.pollStream(ssf))
        let text = try String(contentsOf: config, encoding: .utf8).replacingOccurrences(of: "ledger: sqlite:ledger.sqlite", with: """
              - issuer: \(other)
                jwks-file: jwks.json
                audiences: [\(WorkerTests.audience)]
                algorithms: [ES256]
            ledger: sqlite:ledger.sqlite
            """)
        try text.write(to: config, atomically: true, encoding: .utf8)
        let worker = try WorkerProcess(config: config)
        try await WorkerTests.waitFor("the answer acknowledged") { ssf.requests("/poll") >= 2 }
        #expect(await worker.terminate() == 0)
        let second = try Self.json(try #require(ssf.recordedRequests("/poll").dropFirst().first).body)
        #expect(second["ack"] == .array(["own-1"]))
        #expect(second["setErrs"]?.objectValue?["foreign-1"]?.objectValue?["err"] == "access_denied")
        let reader = try SQLiteLedgerReader(path: directory.appendingPathComponent("ledger.sqlite").path)
        #expect(try reader.events().map(\.jti) == ["own-1"])
        #expect(try reader.deliveries().map(\.errorCode) == ["access_denied"])
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }

    /// A transmitter that ignores acknowledgements (or errors reported) and answers every poll
    /// at once with the same SET is asked again after the idle pause, not in a tight loop
    /// writing a duplicate (or a rejection) each time.
    @Test(arguments: [true, false])
    func aTransmitterSendingTheSameSETForeverIsNotPolledInATightLoop(valid: Bool) async throws {
        let ssf = try await Self.transmitter()
        let token = valid ? try Self.ssfToken(ssf, jti: "again-1") : "not.a.token"
        ssf.serve("/poll", .init(body: #"{"sets":{"again-1":"\#(token)"},"moreAvailable":true}"#, headers: ["Content-Type": "application/json"]))
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "poll-token", stream: Self.pollStream(ssf))
        let worker = try WorkerProcess(config: config)
        try await WorkerTests.waitFor("the SET acknowledged once") { ssf.requests("/poll") >= 3 }
        let before = ssf.requests("/poll")
        try await Task.sleep(for: .seconds(3))
        #expect(ssf.requests("/poll") - before <= 5, "\(ssf.requests("/poll") - before) requests in 3 s")
        #expect(await worker.terminate() == 0)
        let reader = try SQLiteLedgerReader(path: directory.appendingPathComponent("ledger.sqlite").path)
        #expect(try reader.eventCount() == (valid ? 1 : 0))
        #expect(try reader.deliveries().count <= ssf.requests("/poll"))
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }

    /// A poll stream keeps moving: an answer of 100 large SETs is taken (not refused as too
    /// large, for ever); one SET that cannot be had now (its issuer's keys are down) does not
    /// make the others wait a backoff; "moreAvailable" with no SETs is not asked again in a
    /// tight loop.
    @Test func aPollStreamFlowsPastLargeSETsAStuckSETAndEmptyMoreAvailable() async throws {
        let ssf = try await Self.transmitter()
        let pad = String(repeating: "x", count: 11_000)
        var sets: [String] = []
        for i in 0..<99 {
            let token = try SETMinter.token(claims: [
                "iss": .string(ssf.baseURL), "aud": .string(WorkerTests.audience), "iat": .number(Date().timeIntervalSince1970.rounded(.down)),
                "jti": .string("big-\(i)"), "sub_id": .object(["format": "email", "email": .string("user\(i)@example.com")]), "pad": .string(pad),
                "events": .object(["https://schemas.openid.net/secevent/caep/event-type/session-revoked": .object([:])]),
            ], key: WorkerTests.ec, type: "secevent+jwt")
            sets.append("\"big-\(i)\":\"\(token)\"")
        }
        let down = "https://down.example/"
        let stuck = try SETMinter.token(claims: SETMinter.riscClaims(issuer: down, audience: WorkerTests.audience, subject: "s", jti: "stuck"),
                                        key: WorkerTests.ec)
        sets.append("\"stuck\":\"\(stuck)\"")
        // One more than the 100 asked for: neither persisted nor reported (sent again later).
        sets.append("\"extra\":\"\(try Self.ssfToken(ssf, jti: "extra"))\"")
        let first = #"{"sets":{"# + sets.joined(separator: ",") + #"},"moreAvailable":true}"#
        #expect(first.utf8.count > 1 << 20, "more than the 1 MiB an answer used to be allowed")
        ssf.enqueue("/poll", [.init(body: first, headers: ["Content-Type": "application/json"])])
        ssf.serve("/poll", .init(body: #"{"sets":{},"moreAvailable":true}"#, headers: ["Content-Type": "application/json"]))
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "poll-token", stream: Self.pollStream(ssf))
        // A second issuer whose keys cannot be fetched.
        let text = try String(contentsOf: config, encoding: .utf8).replacingOccurrences(of: "ledger: sqlite:ledger.sqlite", with: """
              - issuer: \(down)
                jwks-uri: http://127.0.0.1:1/jwks
                audiences: [\(WorkerTests.audience)]
                algorithms: [ES256]
            ledger: sqlite:ledger.sqlite
            """)
        try text.write(to: config, atomically: true, encoding: .utf8)
        let worker = try WorkerProcess(config: config)
        try await WorkerTests.waitFor("the large SETs acknowledged") { ssf.requests("/poll") >= 3 }
        let bodies = try ssf.recordedRequests("/poll").map { try Self.json($0.body) }
        #expect(bodies[1]["ack"]?.arrayValue?.count == 99)
        #expect(bodies[1]["ack"]?.arrayValue?.contains(.string("extra")) == false && bodies[1]["setErrs"]?.objectValue?["extra"] == nil)
        #expect(bodies[1]["returnImmediately"] == true, "the stuck SET must not make the stream back off")
        let reader = try SQLiteLedgerReader(path: directory.appendingPathComponent("ledger.sqlite").path)
        #expect(try reader.eventCount() == 99)
        // Empty answers saying moreAvailable: asked again after the idle pause (1 s), not at once.
        let before = ssf.requests("/poll")
        try await Task.sleep(for: .seconds(3))
        #expect(ssf.requests("/poll") - before <= 8, "\(ssf.requests("/poll") - before) requests in 3 s")
        #expect(await worker.terminate() == 0)
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }

    /// With Kafka, a polled SET is produced to the topic with the header `source: poll` (the
    /// door it came by), read by an independent client (kcat).
    @Test func withKafkaAPolledSetIsProducedWithItsSource() async throws {
        let ssf = try await Self.transmitter()
        let cluster = try EmbeddedKafkaCluster(topics: [("security-events", 1)], logger: WorkerTests.quiet)
        let polled = try Self.ssfToken(ssf, jti: "kp-1")
        ssf.enqueue("/poll", [.init(body: #"{"sets":{"kp-1":"\#(polled)"}}"#, headers: ["Content-Type": "application/json"])])
        ssf.serve("/poll", .init(body: #"{"sets":{}}"#, headers: ["Content-Type": "application/json"], delay: 0.3))
        let (directory, config) = try Self.ssfConfig(ssf, bearer: "poll-token", stream: Self.pollStream(ssf), extra: """
            kafka:
              brokers: \(cluster.bootstrapServers)
              topic: security-events
              group: warden
            """)
        let worker = try WorkerProcess(config: config)
        try await WorkerTests.waitFor("the polled SET acknowledged") { ssf.requests("/poll") >= 2 }
        let messages = try await PushReceiverTests.topicMessages(cluster.bootstrapServers)
        #expect(messages.map(\.value) == [polled])
        #expect(messages.first?.headers["source"] == "poll")
        #expect(await worker.terminate() == 0)
        try? FileManager.default.removeItem(at: directory)
        await ssf.stop()
    }
}
