import Foundation
import HTTPTypes
public import Hummingbird
public import Logging
import NIOCore
public import ServiceLifecycle
public import Invalidation
import Synchronization

/// The RFC 8935 push door: `POST` of one compact SET (`Content-Type: application/secevent+jwt`)
/// becomes a record for the pipeline, and the request is answered once the record's event is
/// durable in the ledger — `202` with an empty body (a duplicate too, every time) — or refused:
/// `400` with `{"err", "description"}` for a SET that fails verification (recorded in the
/// ledger as a rejection), `503` with `Retry-After` when it cannot be persisted now (the
/// issuer's keys cannot be had, the process is stopping). Before the body is read: `401` with
/// `WWW-Authenticate: Bearer` when bearer tokens are configured and the request has none of
/// them (nothing else is said to such a caller), `415` for another content type, `413` over the
/// size limit; `405` with `Allow: POST` for another method.
public struct PushReceiver: Sendable {
    public struct Settings: Sendable, Equatable {
        public var host: String
        public var port: Int
        /// The endpoint's path. Default `/events`.
        public var path: String
        /// Tokens a transmitter may present (`Authorization: Bearer …`); none: no check.
        public var bearerTokens: [String]
        /// The largest body taken. Default 65,536 bytes.
        public var maximumBodyBytes: Int

        public init(host: String, port: Int, path: String = "/events", bearerTokens: [String] = [], maximumBodyBytes: Int = 65_536) {
            self.host = host
            self.port = port
            self.path = path
            self.bearerTokens = bearerTokens
            self.maximumBodyBytes = maximumBodyBytes
        }
    }

    public let settings: Settings
    let feed: RecordFeed
    let metrics: WardenMetrics
    let logger: Logger

    /// Seconds a sender is told to wait before sending again (`Retry-After` on `503`).
    static let retryAfterSeconds = 5

    public init(settings: Settings, metrics: WardenMetrics, logger: Logger) {
        self.settings = settings
        self.feed = RecordFeed()
        self.metrics = metrics
        self.logger = logger
    }

    /// The records the requests make, in batches of whatever arrived since the pipeline last took.
    public var records: RecordFeed { feed }

    /// The HTTP service; `onListening` receives the bound port (useful with port 0). On graceful
    /// shutdown it stops taking connections and answers the requests under way.
    public func service(onListening: @escaping @Sendable (Int) -> Void = { _ in }) -> some Service {
        let router = Router()
        addRoutes(to: router)
        return Application(router: router, configuration: .init(address: .hostname(settings.host, port: settings.port)),
                           onServerRunning: { channel in onListening(channel.localAddress?.port ?? 0) },
                           logger: logger)
    }

    /// The endpoint's routes (on a router of its own, or on the health server's when both
    /// listen on one address).
    public func addRoutes(to router: Router<BasicRequestContext>) {
        let path = RouterPath(settings.path)
        router.post(path) { request, _ in await self.handle(request) }
        let metrics = self.metrics
        for method: HTTPRequest.Method in [.get, .head, .put, .patch, .delete, .options] {
            router.on(path, method: method) { _, _ in
                metrics.pushAnswered(405)
                return Response(status: .methodNotAllowed, headers: [.allow: "POST"])
            }
        }
    }

    func handle(_ request: Request) async -> Response {
        let response = await answer(request)
        metrics.pushAnswered(response.status.code)
        return response
    }

    private func answer(_ request: Request) async -> Response {
        guard isAuthorized(request.headers[.authorization]) else {
            // Says nothing about what is configured: only that a bearer token is wanted.
            let challenge = request.headers[.authorization] == nil ? "Bearer" : "Bearer error=\"invalid_token\""
            return Response(status: .unauthorized, headers: [.wwwAuthenticate: challenge])
        }
        guard Self.isSecurityEventToken(request.headers[.contentType]) else {
            return Response(status: .unsupportedMediaType, headers: [.accept: "application/secevent+jwt"])
        }
        if let length = request.headers[.contentLength].flatMap({ Int($0) }), length > settings.maximumBodyBytes {
            return Response(status: .contentTooLarge)
        }
        let body: ByteBuffer
        do {
            body = try await request.body.collect(upTo: settings.maximumBodyBytes)
        } catch {
            return Response(status: .contentTooLarge)
        }
        metrics.pushBytes(body.readableBytes)
        let acknowledgement = PushAcknowledgement()
        let record = IntakeRecord(IntakeMessage(value: Array(buffer: body), source: "push", receivedAt: Date().timeIntervalSince1970),
                                  acknowledgement: acknowledgement)
        metrics.received(source: "push")
        guard feed.submit(record) else { return Self.unavailable() }
        switch await acknowledgement.answer() {
        case .recorded, .duplicate:
            return Response(status: .accepted)
        case .rejected(let code, _):
            // The verifier's own description (kept in the ledger and the log) may name what is
            // configured — issuers, audiences, algorithms, key ids: the sender gets the code's.
            return Self.refused(code: code, description: Self.publicDescription(code))
        case .abandoned:
            return Self.unavailable()
        }
    }

    /// A bearer token is wanted when some are configured; each is compared in full, in time
    /// that does not depend on where it first differs.
    private func isAuthorized(_ authorization: String?) -> Bool {
        guard !settings.bearerTokens.isEmpty else { return true }
        guard let authorization, authorization.count > 7, authorization.prefix(7).lowercased() == "bearer " else { return false }
        let presented = Array(authorization.dropFirst(7).trimmingCharacters(in: .whitespaces).utf8)
        var matched = false
        for token in settings.bearerTokens where Self.constantTimeEqual(presented, Array(token.utf8)) { matched = true }
        return matched
    }

    static func constantTimeEqual(_ a: [UInt8], _ b: [UInt8]) -> Bool {
        guard a.count == b.count else { return false }
        var difference: UInt8 = 0
        for i in a.indices { difference |= a[i] ^ b[i] }
        return difference == 0
    }

    /// `application/secevent+jwt`, compared case-insensitively, parameters allowed.
    static func isSecurityEventToken(_ contentType: String?) -> Bool {
        guard let contentType else { return false }
        let mediaType = contentType.split(separator: ";", maxSplits: 1, omittingEmptySubsequences: false).first ?? ""
        return mediaType.trimmingCharacters(in: .whitespaces).lowercased() == "application/secevent+jwt"
    }

    /// RFC 8935 §2.3: `400`, JSON, with the language of the description.
    static func refused(code: String, description: String) -> Response {
        var body: [UInt8] = []
        body += Array("{\"err\":".utf8)
        body += jsonString(code)
        body += Array(",\"description\":".utf8)
        body += jsonString(description)
        body += Array("}".utf8)
        return Response(status: .badRequest, headers: [.contentType: "application/json", .contentLanguage: "en"],
                        body: .init(byteBuffer: ByteBuffer(bytes: body)))
    }

    /// What a sender is told about a refusal: the meaning of its RFC 8935 code, nothing of
    /// this receiver's configuration.
    static func publicDescription(_ code: String) -> String {
        switch code {
        case "invalid_request": "the body is not a well-formed, valid Security Event Token"
        case "invalid_key": "the SET's signature cannot be verified with its issuer's published keys"
        case "invalid_issuer": "the SET's issuer is not accepted by this receiver"
        case "invalid_audience": "the SET's audience does not match this receiver"
        case "authentication_failed": "the transmitter could not be authenticated"
        case "access_denied": "the transmitter may not deliver this SET here"
        case "invalid_state": "the verification event's state matches no verification this receiver asked for"
        default: "the SET was refused"
        }
    }

    static func unavailable() -> Response {
        Response(status: .serviceUnavailable, headers: [.retryAfter: "\(retryAfterSeconds)"])
    }

    /// A JSON string literal: quotes, backslashes and control characters escaped.
    static func jsonString(_ text: String) -> [UInt8] {
        var out: [UInt8] = [0x22]
        for byte in text.utf8 {
            switch byte {
            case 0x22: out += [0x5C, 0x22]
            case 0x5C: out += [0x5C, 0x5C]
            case 0x0A: out += [0x5C, 0x6E]
            case 0x0D: out += [0x5C, 0x72]
            case 0x09: out += [0x5C, 0x74]
            case 0..<0x20: out += Array(String(format: "\\u%04x", byte).utf8)
            default: out.append(byte)
            }
        }
        out.append(0x22)
        return out
    }
}

/// A pushed record's acknowledgement: the request waits for its first answer (the event
/// durable, or the record settled). A pushed record never waits aside for keys: its sender is
/// told to send it again later.
final class PushAcknowledgement: Acknowledgement {
    private struct State {
        var answer: Disposition? = nil
        var waiter: CheckedContinuation<Disposition, Never>? = nil
    }

    private let state = Mutex(State())

    var waitsForKeys: Bool { false }

    func durable(_ disposition: Disposition) { resolve(disposition) }

    func settle(_ disposition: Disposition) { resolve(disposition) }

    private func resolve(_ disposition: Disposition) {
        let waiter = state.withLock { s -> CheckedContinuation<Disposition, Never>? in
            guard s.answer == nil else { return nil }
            s.answer = disposition
            defer { s.waiter = nil }
            return s.waiter
        }
        waiter?.resume(returning: disposition)
    }

    /// The first of `durable` and `settle`.
    func answer() async -> Disposition {
        await withCheckedContinuation { continuation in
            let now = state.withLock { s -> Disposition? in
                if let answer = s.answer { return answer }
                s.waiter = continuation
                return nil
            }
            if let now { continuation.resume(returning: now) }
        }
    }
}

/// Records handed in one at a time (by requests), taken by the pipeline in batches of all that
/// arrived since it last took. Closed, it ends once emptied, and takes no more.
public final class RecordFeed: AsyncSequence, Sendable {
    public typealias Element = [IntakeRecord]
    public typealias Failure = Never

    private struct State {
        var pending: [IntakeRecord] = []
        var waiter: CheckedContinuation<[IntakeRecord]?, Never>? = nil
        var closed = false
    }

    private let state = Mutex(State())

    init() {}

    /// False when closed: the record was not taken.
    func submit(_ record: IntakeRecord) -> Bool {
        let (taken, waiter) = state.withLock { s -> (Bool, CheckedContinuation<[IntakeRecord]?, Never>?) in
            guard !s.closed else { return (false, nil) }
            if let waiter = s.waiter {
                s.waiter = nil
                return (true, waiter)
            }
            s.pending.append(record)
            return (true, nil)
        }
        waiter?.resume(returning: [record])
        return taken
    }

    public func close() {
        let waiter = state.withLock { s -> CheckedContinuation<[IntakeRecord]?, Never>? in
            s.closed = true
            defer { s.waiter = nil }
            return s.pending.isEmpty ? s.waiter : nil
        }
        waiter?.resume(returning: nil)
    }

    fileprivate func next() async -> [IntakeRecord]? {
        await withCheckedContinuation { continuation in
            let now = state.withLock { s -> [IntakeRecord]?? in
                if !s.pending.isEmpty {
                    defer { s.pending = [] }
                    return .some(s.pending)
                }
                if s.closed { return .some(nil) }
                s.waiter = continuation
                return nil
            }
            if let now { continuation.resume(returning: now) }
        }
    }

    public struct AsyncIterator: AsyncIteratorProtocol {
        let feed: RecordFeed
        public mutating func next() async -> [IntakeRecord]? { await feed.next() }
        public mutating func next(isolation actor: isolated (any Actor)?) async -> [IntakeRecord]? { await feed.next() }
    }

    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(feed: self) }
}

/// The push door's intake: runs the pipeline on the receiver's records until graceful
/// shutdown, then takes no more and finishes what it took, steps included (a pushed SET is not
/// delivered again: its steps are finished before the process exits).
public struct PushIntake: Service {
    let receiver: PushReceiver
    let pipeline: EventPipeline

    public init(receiver: PushReceiver, pipeline: EventPipeline) {
        self.receiver = receiver
        self.pipeline = pipeline
    }

    public func run() async {
        let feed = receiver.records
        await withGracefulShutdownHandler {
            await pipeline.run(feed)
        } onGracefulShutdown: {
            feed.close()
        }
        pipeline.processor.stop.stop()
    }
}

/// Dead letters without a topic: a refused SET is answered `400` to its sender and kept in the
/// ledger as a rejection (its deliveries), which is where it can be found.
public struct LedgerOnlyDeadLetters: DeadLetterSink {
    public init() {}
    public func deadLetter(value: [UInt8], code: String, description: String, source: String) async throws(DeadLetterError) {}
}
