import Foundation
import HTTPTypes
import Ledger
public import Hummingbird
public import Logging
import NIOCore
import SecurityEvents
public import ServiceLifecycle
public import Invalidation
import Synchronization

/// The RFC 8935 push door: `POST` of one compact SET (`Content-Type: application/secevent+jwt`)
/// is handed to its destination (the pipeline into the ledger, or a Kafka topic), and the
/// request is answered once the SET is persisted there — `202` with an empty body (a duplicate
/// too, every time) — or refused: `400` with `{"err", "description"}` for a SET that fails
/// verification (recorded in the ledger as a rejection), `503` with `Retry-After` when it
/// cannot be persisted now (the issuer's keys or the topic cannot be had, the process is
/// stopping). Before the body is read: `401` with
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
        /// Each client's rate (by IP address); nil: none.
        public var rateLimit: ClientRateLimiter.Settings?
        /// Seconds a connection may stay silent (no request part arriving, none answered) before
        /// it is closed: a client that opens connections and sends nothing, or a request line a
        /// byte at a time, holds none for long. Also how long a request's body may take to
        /// arrive whole once its head is read. Default 30.
        public var idleTimeout: Double
        /// Connections open at once (a few more at most: up to four are accepted per read);
        /// past it, new ones wait in the listen queue until one closes. Each holds a file
        /// descriptor: without a bound, clients opening connections (idle ones live for
        /// `idleTimeout`) could take every descriptor the process may have, and the ledger,
        /// Kafka and the targets with them. Default 512.
        public var maximumConnections: Int

        public init(host: String, port: Int, path: String = "/events", bearerTokens: [String] = [], maximumBodyBytes: Int = 65_536,
                    rateLimit: ClientRateLimiter.Settings? = Self.defaultRateLimit, idleTimeout: Double = Self.defaultIdleTimeout,
                    maximumConnections: Int = Self.defaultMaximumConnections) {
            self.host = host
            self.port = port
            self.path = path
            self.bearerTokens = bearerTokens
            self.maximumBodyBytes = maximumBodyBytes
            self.rateLimit = rateLimit
            self.idleTimeout = idleTimeout
            self.maximumConnections = maximumConnections
        }

        public static let defaultIdleTimeout = 30.0

        /// Half of the 1,024 descriptors a process is commonly allowed.
        public static let defaultMaximumConnections = 512

        /// 1,000 requests a second per client after a burst of 2,000.
        public static let defaultRateLimit = ClientRateLimiter.Settings(perSecond: 1000, burst: 2000)
    }

    public let settings: Settings
    let destination: any PushDestination
    let limiter: ClientRateLimiter?
    /// Requests that fail authentication are counted apart: however many a client behind the
    /// same address (a load balancer's) sends, they never use up a transmitter's rate.
    let unauthenticatedLimiter: ClientRateLimiter?
    let metrics: WardenMetrics
    let logger: Logger
    /// SHA-256 of each configured bearer token: a presented token is compared by its digest,
    /// so the time taken says nothing of a token's length or of where they first differ.
    let bearerDigests: [[UInt8]]
    /// Refusals kept in the ledger (a rejection, with the message's first 16 KiB) per client,
    /// a hundredth of `rate-limit`: past it, a refused request is answered as any other but
    /// leaves nothing behind (`warden_push_refusals_not_kept_total`), so junk sent from one
    /// address as fast as the rate allows cannot fill the ledger's disk.
    let keptRefusals: ClientRateLimiter?
    /// Verifies a message without keeping anything: how a refusal past `keptRefusals` is told.
    let judge: EventProcessor?

    /// Seconds a sender is told to wait before sending again (`Retry-After` on `503`).
    static let retryAfterSeconds = 5

    public init(settings: Settings, destination: any PushDestination, metrics: WardenMetrics, logger: Logger,
                judge: EventProcessor? = nil) {
        self.settings = settings
        self.destination = destination
        self.limiter = settings.rateLimit.map { ClientRateLimiter(settings: $0) }
        self.unauthenticatedLimiter = settings.rateLimit.map { ClientRateLimiter(settings: $0) }
        self.metrics = metrics
        self.logger = logger
        self.bearerDigests = settings.bearerTokens.map { secretDigest(Array($0.utf8)) }
        self.judge = judge
        self.keptRefusals = judge == nil ? nil : settings.rateLimit.map {
            ClientRateLimiter(settings: .init(perSecond: $0.perSecond / 100, burst: $0.burst / 100))
        }
    }

    /// The HTTP service; `onListening` receives the bound port (useful with port 0). On graceful
    /// shutdown it stops taking connections and answers the requests under way.
    public func service(onListening: @escaping @Sendable (Int) -> Void = { _ in }) -> some Service {
        let router = Router(context: WardenRequestContext.self)
        addRoutes(to: router)
        return Application(router: router, server: .http1(idleTimeout: settings.idleTimeout),
                           configuration: .init(address: .hostname(settings.host, port: settings.port),
                                                availableConnectionsDelegate: .maximum(settings.maximumConnections, logger: logger)),
                           onServerRunning: { channel in onListening(channel.localAddress?.port ?? 0) },
                           logger: logger)
    }

    /// The endpoint's routes (on a router of its own, or on the health server's when both
    /// listen on one address).
    public func addRoutes(to router: Router<WardenRequestContext>) {
        let path = RouterPath(settings.path)
        router.post(path) { request, context in
            let response = await self.handle(request, client: context.clientAddress, connection: context.channel)
            // Refused before (or while) its body was read: the rest is not read.
            return Self.refusedUnread.contains(response.status) ? context.closingConnection(after: response) : response
        }
        let metrics = self.metrics
        for method: HTTPRequest.Method in [.get, .head, .put, .patch, .delete, .options] {
            router.on(path, method: method) { _, context in
                metrics.pushAnswered(405)
                return context.closingConnection(after: Response(status: .methodNotAllowed, headers: [.allow: "POST"]))
            }
        }
    }

    /// Answers given before the body is read whole (`answer`).
    static let refusedUnread: Set<HTTPResponse.Status> = [
        .unauthorized, .tooManyRequests, .unsupportedMediaType, .contentTooLarge, .requestTimeout,
    ]

    func handle(_ request: Request, client: String, connection: any Channel) async -> Response {
        let response = await answer(request, client: client, connection: connection)
        metrics.pushAnswered(response.status.code)
        return response
    }

    private func answer(_ request: Request, client: String, connection: any Channel) async -> Response {
        // The bearer token is checked first (in constant time, before the body is read): a
        // request that fails it counts against a rate of its own, never against the rate of
        // the transmitters that authenticate from the same address.
        guard isAuthorized(request.headers[.authorization]) else {
            if let limited = Self.overRate(unauthenticatedLimiter, client) { return limited }
            // Says nothing about what is configured: only that a bearer token is wanted.
            let challenge = request.headers[.authorization] == nil ? "Bearer" : "Bearer error=\"invalid_token\""
            return Response(status: .unauthorized, headers: [.wwwAuthenticate: challenge])
        }
        // A client over its rate is refused before the request is looked at further.
        if let limited = Self.overRate(limiter, client) { return limited }
        guard Self.isSecurityEventToken(request.headers[.contentType]) else {
            return Response(status: .unsupportedMediaType, headers: [.accept: "application/secevent+jwt"])
        }
        if let length = request.headers[.contentLength].flatMap({ Int($0) }), length > settings.maximumBodyBytes {
            return Response(status: .contentTooLarge)
        }
        // The body must arrive whole within `idle-timeout` of the request's head: sent a byte
        // at a time, each byte restarting the idle timer, it would hold the connection (and
        // this request) for up to `max-body-bytes` times that. Past it the connection is closed,
        // which ends the read whatever the body stream does with cancellation.
        let deadline = BodyDeadline(connection, seconds: settings.idleTimeout)
        let body: ByteBuffer
        do {
            body = try await request.body.collect(upTo: settings.maximumBodyBytes)
            deadline.cancel()
        } catch {
            deadline.cancel()
            return Response(status: deadline.fired ? .requestTimeout : .contentTooLarge)
        }
        // Closed as the last byte came: what arrived is not taken.
        if deadline.fired { return Response(status: .requestTimeout) }
        metrics.pushBytes(body.readableBytes)
        metrics.received(source: "push")
        let message = IntakeMessage(value: Array(buffer: body), source: "push", receivedAt: Date().timeIntervalSince1970)
        // A refusal's place in the budget is taken before the request goes on (requests sent
        // at once must not all find the one place left), and given back if it is not refused.
        let mayKeepRefusal = keptRefusals.map { if case .success = $0.admit(client) { true } else { false } } ?? true
        if !mayKeepRefusal, let judge, let code = await judge.refusalCode(of: message) {
            metrics.counter("warden_push_refusals_not_kept_total").increment()
            return Self.refused(code: code, description: Self.publicDescription(code))
        }
        let outcome = await destination.persist(message)
        if case .refused = outcome {} else if mayKeepRefusal { keptRefusals?.giveBack(client) }
        switch outcome {
        case .accepted:
            return Response(status: .accepted)
        case .refused(let code):
            // The verifier's own description (kept in the ledger and the log) may name what is
            // configured — issuers, audiences, algorithms, key ids: the sender gets the code's.
            return Self.refused(code: code, description: Self.publicDescription(code))
        case .unavailable:
            return Self.unavailable()
        }
    }

    /// Closes a connection whose request body has not arrived whole in time.
    struct BodyDeadline: Sendable {
        private final class Flag: Sendable { let value = Atomic(false) }
        private let scheduled: Scheduled<Void>
        private let flag = Flag()

        init(_ connection: any Channel, seconds: Double) {
            let flag = self.flag
            scheduled = connection.eventLoop.scheduleTask(in: .nanoseconds(Int64(seconds * 1_000_000_000))) {
                flag.value.store(true, ordering: .releasing)
                connection.close(promise: nil)
            }
        }

        /// Whether the deadline passed and the connection was closed.
        var fired: Bool { flag.value.load(ordering: .acquiring) }

        func cancel() { scheduled.cancel() }
    }

    /// `429` with `Retry-After` when `client` is over its rate at `limiter`.
    private static func overRate(_ limiter: ClientRateLimiter?, _ client: String) -> Response? {
        guard let limiter, case .failure(let limited) = limiter.admit(client) else { return nil }
        return Response(status: .tooManyRequests, headers: [.retryAfter: "\(max(1, Int(limited.retryAfter.rounded(.up))))"])
    }

    /// A bearer token is wanted when some are configured; each is compared in full, by digest.
    private func isAuthorized(_ authorization: String?) -> Bool {
        guard !bearerDigests.isEmpty else { return true }
        guard let authorization, authorization.count > 7, authorization.prefix(7).lowercased() == "bearer " else { return false }
        let presented = Array(authorization.dropFirst(7).trimmingCharacters(in: .whitespaces).utf8)
        return secretMatches(presented, digests: bearerDigests)
    }

    /// `application/secevent+jwt`, compared case-insensitively, parameters allowed. Compared
    /// byte by byte: Foundation's trimming and lowercasing cost more than the rest of the
    /// request's checks together (seen in the push benchmark's profile).
    static func isSecurityEventToken(_ contentType: String?) -> Bool {
        guard let contentType else { return false }
        let expected = "application/secevent+jwt".utf8
        var bytes = contentType.utf8[...]
        while let first = bytes.first, first == 0x20 || first == 0x09 { bytes = bytes.dropFirst() }
        guard bytes.count >= expected.count else { return false }
        for (byte, wanted) in zip(bytes, expected) {
            // ASCII letters: the lower-case bit set makes the comparison case-insensitive.
            let folded = (byte >= 0x41 && byte <= 0x5A) ? byte | 0x20 : byte
            guard folded == wanted else { return false }
        }
        // After the media type: nothing, or parameters (`;`), with optional white space.
        for byte in bytes.dropFirst(expected.count) {
            if byte == 0x3B { return true }
            guard byte == 0x20 || byte == 0x09 else { return false }
        }
        return true
    }

    /// RFC 8935 §2.3: `400`, JSON, with the language of the description.
    static func refused(code: String, description: String) -> Response {
        var body: [UInt8] = []
        body += Array("{\"err\":".utf8)
        JSONValue.writeString(code, to: &body)
        body += Array(",\"description\":".utf8)
        JSONValue.writeString(description, to: &body)
        body += Array("}".utf8)
        return Response(status: .badRequest, headers: [.contentType: "application/json", .contentLanguage: "en"],
                        body: .init(byteBuffer: ByteBuffer(bytes: body)))
    }

    /// What a sender is told about a refusal: the meaning of its RFC 8935 code, nothing of
    /// this receiver's configuration.
    public static func publicDescription(_ code: String) -> String {
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
}

/// What became of a pushed SET at its destination.
public enum PushOutcome: Sendable, Equatable {
    /// Persisted (or known already): answered `202`.
    case accepted
    /// It failed verification (RFC 8935 code): answered `400`.
    case refused(code: String)
    /// It cannot be persisted now: answered `503` with `Retry-After`.
    case unavailable
}

/// Where a pushed (or polled) SET is persisted before its sender hears `202` (or its `ack`).
public protocol PushDestination: Sendable {
    func persist(_ message: IntakeMessage) async -> PushOutcome
    /// Several at once (one poll answer), taken in their order: one subject's events keep it.
    func persist(all messages: [IntakeMessage]) async -> [PushOutcome]
}

extension PushDestination {
    /// One after the other.
    public func persist(all messages: [IntakeMessage]) async -> [PushOutcome] {
        var outcomes: [PushOutcome] = []
        for message in messages { outcomes.append(await persist(message)) }
        return outcomes
    }
}

/// Pushed SETs into the ledger: each becomes a record for the pipeline (`PushIntake` runs it),
/// answered once its event is claimed with its plan, or found a duplicate.
public final class LedgerPushDestination: PushDestination {
    /// The records the requests make, in batches of whatever arrived since the pipeline last took.
    public let records: RecordFeed
    /// How long a request waits for its records to become durable before it is answered "try
    /// again later" (503): while the ledger or a subject lookup is down, requests do not hang
    /// (nor does shutdown, which waits for them). A record answered so may still be recorded;
    /// its sender's retry is then a duplicate, answered 202.
    let answerWithin: Duration

    public static let defaultAnswerWithin: Duration = .seconds(10)

    /// Requests waiting for an answer, with the time each gives up: one sweeper (`sweep()`)
    /// gives up those past it, rather than a timer task per request.
    private struct Waiting {
        var next = 0
        var requests: [Int: (deadline: ContinuousClock.Instant, acknowledgements: [PushAcknowledgement])] = [:]
    }

    private let waiting = Mutex(Waiting())
    /// Whether a sweeper runs: the first request starts one if the intake has not (its ledger
    /// still opening, say), so no request waits past its deadline whatever the intake does.
    private let sweeping = Atomic<Bool>(false)

    /// `maximumWaiting`: records waiting for the pipeline beyond which requests are answered
    /// 503 at once, so that memory stays bounded while the ledger is down.
    public init(answerWithin: Duration = defaultAnswerWithin, maximumWaiting: Int = 4096) {
        self.answerWithin = answerWithin
        records = RecordFeed(maximumWaiting: maximumWaiting)
    }

    /// Gives up, every tenth of a second, the requests past their deadline, until the feed is
    /// closed and no request waits (`PushIntake` runs it beside the pipeline).
    public func sweep() async {
        guard sweeping.compareExchange(expected: false, desired: true, ordering: .acquiringAndReleasing).exchanged else { return }
        defer { sweeping.store(false, ordering: .releasing) }
        while !(records.isClosed && waiting.withLock { $0.requests.isEmpty }) {
            try? await Task.sleep(for: .milliseconds(100))
            let now = ContinuousClock.now
            let expired = waiting.withLock { w -> [PushAcknowledgement] in
                var expired: [PushAcknowledgement] = []
                for (id, request) in w.requests where request.deadline <= now {
                    expired += request.acknowledgements
                    w.requests[id] = nil
                }
                return expired
            }
            for acknowledgement in expired { acknowledgement.giveUp() }
        }
    }

    public func persist(_ message: IntakeMessage) async -> PushOutcome {
        await persist(all: [message])[0]
    }

    /// Handed to the pipeline together, in order (its lanes keep one subject's events in it),
    /// then each answered as it becomes durable.
    public func persist(all messages: [IntakeMessage]) async -> [PushOutcome] {
        let acknowledgements = messages.map { _ in PushAcknowledgement() }
        guard records.submit(zip(messages, acknowledgements).map { IntakeRecord($0, acknowledgement: $1) }) else {
            return messages.map { _ in .unavailable }
        }
        let deadline = ContinuousClock.now.advanced(by: answerWithin)
        let id = waiting.withLock { w -> Int in
            w.next += 1
            w.requests[w.next] = (deadline, acknowledgements)
            return w.next
        }
        defer { _ = waiting.withLock { $0.requests.removeValue(forKey: id) } }
        if !sweeping.load(ordering: .acquiring) { Task { await self.sweep() } }
        var outcomes: [PushOutcome] = []
        outcomes.reserveCapacity(messages.count)
        for acknowledgement in acknowledgements {
            switch await acknowledgement.answer() {
            case .recorded, .duplicate: outcomes.append(.accepted)
            // Not a verdict on the SET: this receiver's own lookup, or its ledger, refused it.
            // Its sender keeps it and tries again (a 400 would have it dropped at the source).
            case .rejected(let code, _) where EventProcessor.isOwnRefusal(code): outcomes.append(.unavailable)
            case .rejected(let code, _): outcomes.append(.refused(code: code))
            case .abandoned: outcomes.append(.unavailable)
            }
        }
        return outcomes
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

    /// The request stops waiting (its deadline passed): to it, the record is abandoned (try
    /// again later), whatever the pipeline makes of it afterwards.
    func giveUp() { resolve(.abandoned) }

    /// The first answer wakes the request; later ones change nothing.
    private func resolve(_ disposition: Disposition) {
        let waiter = state.withLock { s -> CheckedContinuation<Disposition, Never>? in
            guard s.answer == nil else { return nil }
            s.answer = disposition
            defer { s.waiter = nil }
            return s.waiter
        }
        waiter?.resume(returning: disposition)
    }

    /// The first of `durable`, `settle` and `giveUp`.
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
    /// Records from requests that may wait for the pipeline; beyond it `submit` refuses.
    let maximumWaiting: Int

    init(maximumWaiting: Int = .max) {
        self.maximumWaiting = maximumWaiting
    }

    /// False when closed: the record was not taken.
    func submit(_ record: IntakeRecord) -> Bool { submit([record]) }

    /// Records that go ahead of any waiting (taken unless closed, however many wait: they are
    /// the process's own, a page at a time).
    @discardableResult
    func submitFront(_ records: [IntakeRecord]) -> Bool { submit(records, front: true) }

    /// Several records at once, in order; false when closed or when `maximumWaiting` records
    /// already wait (the pipeline is not taking them: the ledger may be down).
    @discardableResult
    func submit(_ records: [IntakeRecord], front: Bool = false) -> Bool {
        guard !records.isEmpty else { return true }
        let (taken, waiter) = state.withLock { s -> (Bool, CheckedContinuation<[IntakeRecord]?, Never>?) in
            guard !s.closed else { return (false, nil) }
            guard front || s.pending.count + records.count <= maximumWaiting else { return (false, nil) }
            if let waiter = s.waiter {
                s.waiter = nil
                return (true, waiter)
            }
            if front { s.pending.insert(contentsOf: records, at: 0) } else { s.pending.append(contentsOf: records) }
            return (true, nil)
        }
        waiter?.resume(returning: records)
        return taken
    }

    /// Whether `close()` was called.
    var isClosed: Bool { state.withLock { $0.closed } }

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
/// delivered again: its steps are finished before the process exits). At start it resumes the
/// events the ledger holds with steps still pending (left by a process that was killed): no
/// sender will deliver those again. Then, every `resumeEvery`, it resumes those whose lease
/// has run out (no process works on them): replicas sharing a ledger take up what one that
/// stopped left, without waiting for a restart.
public struct PushIntake: Service {
    let destination: LedgerPushDestination
    let pipeline: EventPipeline
    let resumeEvery: Duration

    public init(destination: LedgerPushDestination, pipeline: EventPipeline, resumeEvery: Duration = .seconds(60)) {
        self.destination = destination
        self.pipeline = pipeline
        self.resumeEvery = resumeEvery
    }

    public func run() async {
        let feed = destination.records
        let processor = pipeline.processor
        // Events whose stored token no longer verifies: left pending, not tried again every pass.
        let givenUp = GivenUpEvents()
        let resume = PendingStepsResume(processor: processor, receivedBefore: Date().timeIntervalSince1970, givenUp: givenUp)
        await withGracefulShutdownHandler {
            await withDiscardingTaskGroup { group in
                // Requests are taken (and answered, 503 once they waited too long) from the
                // start, whatever reading what was left pending meets (a ledger down).
                group.addTask { await pipeline.run(feed) }
                group.addTask { await destination.sweep() }
                // What was left goes in ahead of the requests waiting: older events first.
                if let first = await resume.nextPage() {
                    guard feed.submitFront(first.records), await Self.resume(resume, from: first, into: feed) else { return }
                }
                // Now and then: what no process works on any more (a replica stopped while its
                // steps waited for a retry, or was killed). This process's own events, a retry
                // pause included, are its own to finish.
                while await processor.stop.pause(resumeEvery / .seconds(1)) {
                    let now = Date().timeIntervalSince1970
                    let pass = PendingStepsResume(processor: processor, receivedBefore: now, unleasedAt: now, givenUp: givenUp)
                    guard let first = await pass.nextPage() else { continue }
                    guard feed.submitFront(first.records), await Self.resume(pass, from: first, into: feed) else { return }
                }
            }
        } onGracefulShutdown: {
            // The receiver has answered its requests by now (it stops first). Steps under way
            // finish their attempt; what waits for a retry or for keys is left pending in the
            // ledger, and the next start (or another replica) resumes it.
            feed.close()
            pipeline.processor.stop.stop()
        }
        pipeline.processor.stop.stop()
    }

    /// Feeds the pass's pages after `page` (already fed), one at a time: however much was left,
    /// what is held in memory is bounded. False when the feed is closed.
    private static func resume(_ pass: PendingStepsResume, from page: (records: [IntakeRecord], page: PendingStepsResume.Page)?,
                               into feed: RecordFeed) async -> Bool {
        var page = page
        while let current = page?.page {
            await current.settled()
            guard !current.isLast, let next = await pass.nextPage() else { return true }
            // Ahead of requests still waiting in the feed: older events first.
            guard feed.submitFront(next.records) else { return false }
            page = next
        }
        return true
    }
}

/// Reads, page by page, the events whose steps were left pending, as records for the pipeline:
/// each is verified again (a stored token is acted on only while its issuer's keys still vouch
/// for it), found a duplicate, and its pending steps run in its subject's turn, as a Kafka
/// redelivery's would.
final class PendingStepsResume: Sendable {
    /// Records of one page, and a way to wait until each is settled.
    final class Page: Sendable {
        /// Fewer than a page's worth: nothing is left after it.
        let isLast: Bool
        private let remaining: Mutex<(count: Int, waiter: CheckedContinuation<Void, Never>?)>

        init(count: Int, isLast: Bool) {
            self.isLast = isLast
            remaining = Mutex((count, nil))
        }

        func settledOne() {
            let waiter = remaining.withLock { r -> CheckedContinuation<Void, Never>? in
                r.count -= 1
                guard r.count == 0 else { return nil }
                defer { r.waiter = nil }
                return r.waiter
            }
            waiter?.resume()
        }

        func settled() async {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let done = remaining.withLock { r -> Bool in
                    if r.count <= 0 { return true }
                    r.waiter = continuation
                    return false
                }
                if done { continuation.resume() }
            }
        }
    }

    /// The source of a resumed event's delivery in the ledger.
    static let source = "resume"
    static let pageSize = 256

    let processor: EventProcessor
    /// Only events received before this: at start, later ones are this process's own.
    let receivedBefore: Double
    /// When given, only events whose lease is free at this time: none is taken while its owner
    /// works on it.
    let unleasedAt: Double?
    /// Events a pass before found no longer verify: not read again.
    let givenUp: GivenUpEvents
    private let lastID = Mutex<Int64>(0)

    init(processor: EventProcessor, receivedBefore: Double, unleasedAt: Double? = nil, givenUp: GivenUpEvents = GivenUpEvents()) {
        self.processor = processor
        self.receivedBefore = receivedBefore
        self.unleasedAt = unleasedAt
        self.givenUp = givenUp
    }

    /// The next page's records, or nil when nothing (more) is pending or the process is stopping.
    /// Events this process holds in hand (its own, a retry pause included) and those given up
    /// are passed over.
    func nextPage() async -> (records: [IntakeRecord], page: Page)? {
        let first = lastID.withLock { $0 } == 0
        var events: [PendingEvent] = [], full = false
        // Pages wholly passed over are read past, not returned empty.
        while events.isEmpty {
            let after = lastID.withLock { $0 }
            switch await processor.attempting("ledger", {
                try await processor.ledger.pendingEvents(receivedBefore: receivedBefore, afterID: after, limit: Self.pageSize,
                                                         unleasedAt: unleasedAt)
            }) {
            case .done(let listed):
                guard let last = listed.last else { return nil }
                lastID.withLock { $0 = last.id }
                full = listed.count == Self.pageSize
                events = listed.filter { !processor.inSteps.contains($0.id) && !givenUp.contains($0.id) }
                if events.isEmpty, !full { return nil }
            case .stopped:
                return nil
            case .refused(let error):
                processor.logger.error("cannot read the events left pending; their steps are not resumed", metadata: ["warden.reason": "\(error)"])
                return nil
            }
        }
        if first {
            processor.logger.notice("resuming events whose steps were left pending", metadata: ["warden.events": "\(events.count)\(full ? "+" : "")"])
        }
        processor.metrics.counter("warden_events_resumed_total").increment(by: events.count)
        let page = Page(count: events.count, isLast: !full)
        let records = events.map { event in
            // Its claims are judged as of when it first arrived: a `max-age` passed during an
            // outage must not strand steps whose SET was acknowledged.
            IntakeRecord(IntakeMessage(value: event.token, source: Self.source, receivedAt: Date().timeIntervalSince1970,
                                       claimsTime: .at(event.receivedAt)),
                         acknowledgement: ResumeAcknowledgement(eventID: event.id, page: page, metrics: processor.metrics,
                                                                logger: processor.logger, givenUp: givenUp))
        }
        return (records, page)
    }
}

/// Events a resume found no longer verify (or whose stored token names another event): this
/// process does not read them again (a new start does). At most `limit` are kept.
final class GivenUpEvents: Sendable {
    static let limit = 100_000
    private let ids = Mutex<Set<Int64>>([])

    func insert(_ id: Int64) { ids.withLock { if $0.count < Self.limit { $0.insert(id) } } }
    func contains(_ id: Int64) -> Bool { ids.withLock { $0.contains(id) } }
}

/// A resumed event's acknowledgement: nobody waits for an answer; what became of it is logged.
final class ResumeAcknowledgement: Acknowledgement {
    let eventID: Int64
    let page: PendingStepsResume.Page
    let metrics: WardenMetrics
    let logger: Logger
    let givenUp: GivenUpEvents

    init(eventID: Int64, page: PendingStepsResume.Page, metrics: WardenMetrics, logger: Logger, givenUp: GivenUpEvents) {
        self.eventID = eventID
        self.page = page
        self.metrics = metrics
        self.logger = logger
        self.givenUp = givenUp
    }

    func settle(_ disposition: Disposition) {
        defer { page.settledOne() }
        switch disposition {
        case .duplicate(let id) where id == eventID:
            logger.info("resumed event's steps finished", metadata: ["warden.event_id": "\(eventID)"])
        case .abandoned:
            break  // stopping: the next start resumes it
        case .rejected(let code, let description):
            // Its issuer's keys no longer vouch for the stored token (a key removed since):
            // nothing is done on its strength; its steps stay pending, visible in the ledger (and
            // resumed again at the next start, not by every pass of this process).
            givenUp.insert(eventID)
            metrics.counter("warden_resume_failures_total").increment()
            logger.error("a stored event no longer verifies; its pending steps were not run", metadata: [
                "warden.event_id": "\(eventID)", "warden.err": "\(code)", "warden.reason": "\(description)",
            ])
        case .duplicate, .recorded:
            // The stored token names another event than the row it was read from.
            givenUp.insert(eventID)
            metrics.counter("warden_resume_failures_total").increment()
            logger.error("a stored token does not match its event; its pending steps were not run", metadata: [
                "warden.event_id": "\(eventID)", "warden.disposition": "\(disposition)",
            ])
        }
    }
}

/// Dead letters without a topic: a refused SET is answered `400` to its sender and kept in the
/// ledger as a rejection (its deliveries), which is where it can be found.
public struct LedgerOnlyDeadLetters: DeadLetterSink {
    public init() {}
    public func deadLetter(value: [UInt8], key: [UInt8]?, headers: [MessageHeader], code: String, description: String,
                           source: String) async throws(DeadLetterError) {}
}
