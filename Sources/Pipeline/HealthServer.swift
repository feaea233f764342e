import Foundation
public import Hummingbird
import HummingbirdCore
public import Logging
public import NIOCore
public import ServiceLifecycle

/// `GET /healthz` (alive), `GET /readyz` (every check passes), `GET /metrics` (Prometheus text).
public struct HealthServer: Sendable {
    /// A named readiness check.
    public struct Check: Sendable {
        public var name: String
        public var isReady: @Sendable () async -> Bool
        public init(_ name: String, _ isReady: @escaping @Sendable () async -> Bool) {
            self.name = name
            self.isReady = isReady
        }
    }

    public var host: String
    public var port: Int
    public var checks: [Check]
    /// Renders the metrics in Prometheus text format.
    public var metricsText: @Sendable () -> [UInt8]
    /// nil while the process is live; otherwise why it is not (`/healthz` answers 503 with it).
    public var liveness: @Sendable () -> String?

    /// How long an idle connection is kept (the receiver's `idle-timeout` when it shares this address).
    public var idleTimeout: Double
    /// Connections open at once (the receiver's `max-connections` when it shares this address).
    public var maximumConnections: Int

    /// On an address of its own: probes and scrapes use a few connections, and with the
    /// receiver's 512 the two stay well inside the 1,024 descriptors a process is commonly allowed.
    public static let defaultMaximumConnections = 128

    public init(host: String, port: Int, checks: [Check], metricsText: @escaping @Sendable () -> [UInt8],
                liveness: @escaping @Sendable () -> String? = { nil }, idleTimeout: Double = PushReceiver.Settings.defaultIdleTimeout,
                maximumConnections: Int = Self.defaultMaximumConnections) {
        self.idleTimeout = idleTimeout
        self.maximumConnections = maximumConnections
        self.host = host
        self.port = port
        self.checks = checks
        self.metricsText = metricsText
        self.liveness = liveness
    }

    /// The HTTP service; `onListening` receives the bound port (useful with port 0).
    public func service(logger: Logger, routes: (Router<WardenRequestContext>) -> Void = { _ in },
                        onListening: @escaping @Sendable (Int) -> Void = { _ in }) -> some Service {
        let router = Router(context: WardenRequestContext.self)
        routes(router)
        let checks = self.checks
        let metricsText = self.metricsText, liveness = self.liveness
        router.get("healthz") { _, _ in
            let problem = liveness()
            return Response(status: problem == nil ? .ok : .serviceUnavailable, headers: [.contentType: "text/plain"],
                            body: .init(byteBuffer: ByteBuffer(string: (problem ?? "ok") + "\n")))
        }
        router.get("readyz") { _, _ in
            var failing: [String] = []
            for check in checks where !(await check.isReady()) { failing.append(check.name) }
            let body = failing.isEmpty ? "ready\n" : "not ready: \(failing.joined(separator: ", "))\n"
            return Response(status: failing.isEmpty ? .ok : .serviceUnavailable, headers: [.contentType: "text/plain"],
                            body: .init(byteBuffer: ByteBuffer(string: body)))
        }
        router.get("metrics") { _, _ in
            Response(status: .ok, headers: [.contentType: "text/plain; version=0.0.4"],
                     body: .init(byteBuffer: ByteBuffer(bytes: metricsText())))
        }
        return Application(router: router, server: .http1(idleTimeout: idleTimeout),
                           configuration: .init(address: .hostname(host, port: port),
                                                availableConnectionsDelegate: .maximum(maximumConnections, logger: logger)),
                           onServerRunning: { channel in onListening(channel.localAddress?.port ?? 0) },
                           logger: logger)
    }
}

/// The request context of Warden's HTTP servers: Hummingbird's basic one, plus the peer's
/// address (the push receiver limits each client's rate by it).
public struct WardenRequestContext: RequestContext, RemoteAddressRequestContext {
    public var coreContext: CoreRequestContextStorage
    public let remoteAddress: SocketAddress?
    /// The request's connection, to be closed when a request is refused before its body is read.
    let channel: any Channel

    public init(source: ApplicationRequestContextSource) {
        coreContext = .init(source: source)
        remoteAddress = source.channel.remoteAddress
        channel = source.channel
    }

    /// `response`, for a request refused before its body was read (or read whole): the server
    /// would otherwise read the rest of the body to take the connection's next request — ten
    /// gigabytes announced, or a byte every half minute from a client that never authenticates.
    /// The connection is closed `closeRefusedAfter` later: time for the client to read the
    /// answer (closed at once, with its body unread, the connection would be reset and the
    /// answer lost), not to send gigabytes.
    func closingConnection(after response: Response) -> Response {
        var response = response
        response.headers[.connection] = "close"
        let channel = self.channel
        channel.eventLoop.scheduleTask(in: Self.closeRefusedAfter) { channel.close(promise: nil) }
        return response
    }

    static let closeRefusedAfter: TimeAmount = .seconds(2)

    /// The client's IP address (or the whole address when it has none).
    var clientAddress: String {
        guard let remoteAddress else { return "unknown" }
        return remoteAddress.ipAddress ?? "\(remoteAddress)"
    }
}

extension HTTPServerBuilder {
    /// HTTP/1 whose connections close after `idleTimeout` seconds without a request part.
    static func http1(idleTimeout seconds: Double) -> HTTPServerBuilder {
        .http1(configuration: .init(idleTimeout: .nanoseconds(Int64(seconds * 1_000_000_000))))
    }
}
