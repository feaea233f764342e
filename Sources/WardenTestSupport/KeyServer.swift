import Foundation
import HTTPTypes
import Hummingbird
import Logging
import NIOCore
import ServiceLifecycle
import Synchronization

/// A real HTTP server on a random loopback port that serves whatever documents a test puts on
/// it (discovery, JWKS, …), counts the requests per path, can delay its answers, and can be
/// taken down and brought back on the same port.
public final class KeyServer: Sendable {
    public struct Document: Sendable {
        public var body: String
        public var status: Int
        public var headers: [String: String]
        /// Seconds to wait before answering (to exercise timeouts).
        public var delay: Double
        /// Seconds to stall after sending the head and the first half of the body (a server
        /// that answers and then hangs).
        public var stallAfterHead: Double

        public init(body: String, status: Int = 200, headers: [String: String] = [:], delay: Double = 0,
                    stallAfterHead: Double = 0) {
            self.body = body
            self.status = status
            self.headers = headers
            self.delay = delay
            self.stallAfterHead = stallAfterHead
        }
    }

    /// A request as it reached the server.
    public struct RecordedRequest: Sendable {
        public var method: String
        public var path: String
        /// Header names lowercased.
        public var headers: [String: String]
        public var body: String
    }

    struct State {
        var documents: [String: Document] = [:]
        /// One-shot answers, used in order before the standing document.
        var queued: [String: [Document]] = [:]
        var recorded: [RecordedRequest] = []
        var counts: [String: Int] = [:]
        var port: Int = 0
        var running: (group: ServiceGroup, task: Task<Void, any Error>)?
        /// Set while stopping: delayed answers stop waiting.
        var stopping = false
    }

    private let state = Mutex(State())

    public init() {}

    /// Starts a server on 127.0.0.1 and a random port.
    public static func start() async throws -> KeyServer {
        let server = KeyServer()
        try await server.start(port: 0)
        return server
    }

    public var port: Int { state.withLock { $0.port } }
    public var baseURL: String { "http://127.0.0.1:\(port)" }

    public func url(_ path: String) -> String { baseURL + path }

    public func serve(_ path: String, _ document: Document) {
        state.withLock { $0.documents[path] = document }
    }

    public func serve(_ path: String, json: String, cacheControl: String? = nil) {
        var headers = ["Content-Type": "application/json"]
        if let cacheControl { headers["Cache-Control"] = cacheControl }
        serve(path, Document(body: json, headers: headers))
    }

    public func remove(_ path: String) { state.withLock { $0.documents[path] = nil } }

    /// Answers the next requests to `path` with these documents, in order, then with the
    /// standing one again.
    public func enqueue(_ path: String, _ documents: [Document]) {
        state.withLock { $0.queued[path, default: []] += documents }
    }

    /// Every request that reached `path`, oldest first.
    public func recordedRequests(_ path: String) -> [RecordedRequest] {
        state.withLock { $0.recorded.filter { $0.path == path } }
    }

    /// How many requests reached `path` (whatever the answer).
    public func requests(_ path: String) -> Int { state.withLock { $0.counts[path, default: 0] } }
    public var totalRequests: Int { state.withLock { $0.counts.values.reduce(0, +) } }

    /// Starts the server (again) on `port`, 0 for a random one.
    public func start(port: Int) async throws {
        let (stream, continuation) = AsyncStream<Int>.makeStream()
        let responder = CallbackResponder<BasicRequestContext> { [self] request, _ in
            let path = request.uri.path
            let body = try await request.body.collect(upTo: 1 << 20)
            var headers: [String: String] = [:]
            for field in request.headers { headers[field.name.canonicalName.lowercased()] = field.value }
            let recorded = RecordedRequest(method: request.method.rawValue, path: path, headers: headers,
                                           body: String(buffer: body))
            let document = self.state.withLock { s -> Document? in
                s.counts[path, default: 0] += 1
                s.recorded.append(recorded)
                if var queue = s.queued[path], !queue.isEmpty {
                    let next = queue.removeFirst()
                    s.queued[path] = queue
                    return next
                }
                return s.documents[path]
            }
            guard let document else { return Response(status: .notFound) }
            let answerAt = ContinuousClock.now + .milliseconds(Int(document.delay * 1000))
            while ContinuousClock.now < answerAt, !self.state.withLock({ $0.stopping }) {
                try await Task.sleep(for: .milliseconds(20))
            }
            var fields = HTTPFields()
            for (name, value) in document.headers {
                if let fieldName = HTTPField.Name(name) { fields[fieldName] = value }
            }
            guard document.stallAfterHead > 0 else {
                return Response(status: .init(code: document.status), headers: fields,
                                body: .init(byteBuffer: ByteBuffer(string: document.body)))
            }
            let bytes = Array(document.body.utf8)
            let stallUntil = ContinuousClock.now + .milliseconds(Int(document.stallAfterHead * 1000))
            return Response(status: .init(code: document.status), headers: fields,
                            body: .init(contentLength: bytes.count) { writer in
                                try await writer.write(ByteBuffer(bytes: bytes.prefix(bytes.count / 2)))
                                while ContinuousClock.now < stallUntil, !self.state.withLock({ $0.stopping }) {
                                    try await Task.sleep(for: .milliseconds(20))
                                }
                                try await writer.write(ByteBuffer(bytes: bytes.dropFirst(bytes.count / 2)))
                                try await writer.finish(nil)
                            })
        }
        var logger = Logger(label: "key-server")
        logger.logLevel = .critical
        let app = Application(
            responder: responder,
            configuration: .init(address: .hostname("127.0.0.1", port: port)),
            onServerRunning: { channel in continuation.yield(channel.localAddress?.port ?? 0) },
            logger: logger
        )
        // Run in a service group so that `stop` can shut it down gracefully: cancelling the
        // serving task while an accepted connection is still queued for it traps in NIO
        // ("Deinited NIOAsyncWriter without calling finish()").
        let group = ServiceGroup(configuration: .init(services: [app], gracefulShutdownSignals: [], logger: logger))
        let task = Task { try await group.run() }
        var bound = 0
        for await p in stream {
            bound = p
            break
        }
        state.withLock {
            $0.port = bound
            $0.running = (group, task)
            $0.stopping = false
        }
    }

    /// Takes the server down: connections are refused until `restart()`. Shuts down gracefully
    /// (delayed answers are cut short); cancels only if that has not finished in ten seconds.
    public func stop() async {
        guard let (group, task) = state.withLock({ s -> (ServiceGroup, Task<Void, any Error>)? in
            defer { s.running = nil }
            s.stopping = true
            return s.running
        }) else { return }
        await group.triggerGracefulShutdown()
        let finished = await withTaskGroup(of: Bool.self) { waiting in
            waiting.addTask { _ = try? await task.value; return true }
            waiting.addTask { try? await Task.sleep(for: .seconds(10)); return false }
            let first = await waiting.next() ?? false
            waiting.cancelAll()
            return first
        }
        if !finished {
            task.cancel()
            _ = try? await task.value
        }
    }

    public func restart() async throws {
        try await start(port: port)
    }
}
