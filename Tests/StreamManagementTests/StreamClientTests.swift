import AsyncHTTPClient
import Foundation
@testable import HTTPExchange
import NIOCore
import NIOHTTP1
import SecurityEvents
import StreamManagement
import Synchronization
import Testing

/// Where an SSF transmitter's credentials may go: only over https. An http URL is taken only on a
/// loopback host named by a transmitter that is on loopback itself (a local one, in tests).
@Suite("SSF stream client")
struct StreamClientTests {
    /// Answers each URL with the JSON given for it (404 otherwise) and records what was asked.
    final class Transmitter: HTTPExchanging {
        let answers: [String: String]
        /// A status other than 200 for a URL.
        let statuses: [String: Int]
        let asked = Mutex<[(url: String, authorization: String?)]>([])

        init(_ answers: [String: String], statuses: [String: Int] = [:]) {
            self.answers = answers
            self.statuses = statuses
        }

        func exchange(_ request: HTTPClientRequest, timeout: Double, maximumBodyBytes: Int) async throws(HTTPExchangeError) -> HTTPExchange {
            asked.withLock { $0.append((request.url, request.headers.first(name: "Authorization"))) }
            guard let json = answers[request.url] else { return HTTPExchange(status: .notFound, headers: [:], body: ByteBuffer()) }
            return HTTPExchange(status: .init(statusCode: statuses[request.url] ?? 200), headers: ["Content-Type": "application/json"],
                                body: ByteBuffer(string: json))
        }
    }

    static func stream(issuer: String, _ transmitter: Transmitter, streamID: String? = "strm-1",
                       keep: @escaping @Sendable (String?) -> Void = { _ in }, ledgerDown: Bool = false) -> SSFStream {
        SSFStream(settings: StreamSettings(issuer: issuer, api: .ssf, delivery: nil, events: [], streamID: streamID, description: nil),
                  credentials: StaticBearer(token: "bearer-secret"), http: transmitter, timeout: 5,
                  storedStreamID: { () async throws(StreamError) -> String? in nil },
                  keepStreamID: { (id: String?) async throws(StreamError) in
                      if ledgerDown { throw StreamError(.unavailable, "the ledger cannot be reached") }
                      keep(id)
                  },
                  allowsHTTP: { url in ["127.0.0.1", "localhost", "::1"].contains(url.host ?? "") })
    }

    /// A stream configuration whose `iss` is not the issuer's string (a number, a list, absent)
    /// is refused, and a created stream's id is not kept.
    @Test func aStreamWhoseIssIsNoStringIsRefusedAndNotKept() async throws {
        for iss in [#","iss":1"#, #","iss":["https://tr.example/"]"#, ""] {
            let transmitter = Transmitter([
                "https://tr.example/.well-known/ssf-configuration": #"{"issuer":"https://tr.example/","configuration_endpoint":"https://tr.example/streams"}"#,
                "https://tr.example/streams": #"{"stream_id":"strm-9"\#(iss)}"#,
                "https://tr.example/streams?stream_id=strm-9": #"{"stream_id":"strm-9"\#(iss)}"#,
            ])
            let kept = Mutex<[String?]>([])
            do {
                _ = try await Self.stream(issuer: "https://tr.example/", transmitter, streamID: nil, keep: { id in kept.withLock { $0.append(id) } }).create()
                Issue.record("created with \(iss)")
            } catch {
                #expect(error.kind == .invalidAnswer, "\(error)")
            }
            #expect(kept.withLock { $0 }.isEmpty)
            do {
                _ = try await Self.stream(issuer: "https://tr.example/", transmitter, streamID: "strm-9").get()
                Issue.record("read with \(iss)")
            } catch {
                #expect(error.kind == .invalidAnswer, "\(error)")
            }
        }
    }

    /// A stream created at the transmitter whose id the ledger cannot keep: the error names the
    /// id, so the operator can pin it (creating it again is refused with 409).
    @Test func aCreatedStreamsIDIsToldWhenTheLedgerCannotKeepIt() async throws {
        let transmitter = Transmitter([
            "https://tr.example/.well-known/ssf-configuration": #"{"issuer":"https://tr.example/","configuration_endpoint":"https://tr.example/streams"}"#,
            "https://tr.example/streams": #"{"stream_id":"strm-77","iss":"https://tr.example/"}"#,
        ])
        do {
            _ = try await Self.stream(issuer: "https://tr.example/", transmitter, streamID: nil, ledgerDown: true).create()
            Issue.record("created while the ledger could not keep the id")
        } catch {
            #expect(error.message.contains("strm-77") && error.message.contains("stream-id"), "\(error)")
        }
    }

    /// SSF: an update may be answered 202 (accepted, to take effect later) with no body.
    @Test func anUpdateAcceptedWithNoBodyIsASuccess() async throws {
        let transmitter = Transmitter([
            "https://tr.example/.well-known/ssf-configuration": #"{"issuer":"https://tr.example/","configuration_endpoint":"https://tr.example/streams"}"#,
            "https://tr.example/streams": "",
        ], statuses: ["https://tr.example/streams": 202])
        #expect(try await Self.stream(issuer: "https://tr.example/", transmitter).update() == .object([:]))
    }

    @Test func anHTTPSTransmitterNamingAnHTTPEndpointOnLoopbackIsRefusedBeforeAnyCall() async throws {
        let transmitter = Transmitter([
            "https://tr.example/.well-known/ssf-configuration": """
                {"issuer":"https://tr.example/","configuration_endpoint":"https://tr.example/streams",
                 "status_endpoint":"http://127.0.0.1:9/status","verification_endpoint":"https://tr.example/verify"}
                """,
            "https://tr.example/streams?stream_id=strm-1": """
                {"stream_id":"strm-1","iss":"https://tr.example/","delivery":{"method":"urn:ietf:rfc:8936","endpoint_url":"http://127.0.0.1:9/poll"}}
                """,
        ])
        let stream = Self.stream(issuer: "https://tr.example/", transmitter)
        do {
            _ = try await stream.status()
            Issue.record("the credentials were sent to an http endpoint")
        } catch {
            #expect(error.kind == .invalidAnswer, "\(error)")
        }
        // A poll endpoint the stream's delivery names: refused alike.
        do {
            _ = try await stream.pollEndpoint()
            Issue.record("an http poll endpoint was taken from an https transmitter")
        } catch {
            #expect(error.kind == .invalidAnswer, "\(error)")
        }
        #expect(!transmitter.asked.withLock { $0 }.contains { $0.url.hasPrefix("http:") })
    }

    @Test func anIssuerThatIsNotHTTPSIsNeverSentTheCredentials() async throws {
        let transmitter = Transmitter([
            "http://tr.example/.well-known/ssf-configuration": #"{"issuer":"http://tr.example/","status_endpoint":"http://tr.example/status"}"#,
        ])
        do {
            _ = try await Self.stream(issuer: "http://tr.example/", transmitter).status()
            Issue.record("an http issuer was asked")
        } catch {
            #expect(error.kind == .configuration, "\(error)")
        }
        #expect(transmitter.asked.withLock { $0 }.isEmpty)
    }

    @Test func aTransmitterOnLoopbackMayUseHTTPOnLoopback() async throws {
        let transmitter = Transmitter([
            "http://127.0.0.1:8/.well-known/ssf-configuration": """
                {"issuer":"http://127.0.0.1:8/","status_endpoint":"http://127.0.0.1:8/status"}
                """,
            "http://127.0.0.1:8/status?stream_id=strm-1": #"{"stream_id":"strm-1","status":"enabled"}"#,
        ])
        let status = try await Self.stream(issuer: "http://127.0.0.1:8/", transmitter).status()
        #expect(status.objectValue?["status"]?.stringValue == "enabled")
        #expect(transmitter.asked.withLock { $0 }.last?.authorization == "Bearer bearer-secret")
    }
}
