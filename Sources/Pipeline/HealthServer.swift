import Foundation
public import Hummingbird
public import Logging
import NIOCore
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

    public init(host: String, port: Int, checks: [Check], metricsText: @escaping @Sendable () -> [UInt8]) {
        self.host = host
        self.port = port
        self.checks = checks
        self.metricsText = metricsText
    }

    /// The HTTP service; `onListening` receives the bound port (useful with port 0).
    public func service(logger: Logger, routes: (Router<BasicRequestContext>) -> Void = { _ in },
                        onListening: @escaping @Sendable (Int) -> Void = { _ in }) -> some Service {
        let router = Router()
        routes(router)
        let checks = self.checks
        let metricsText = self.metricsText
        router.get("healthz") { _, _ in
            Response(status: .ok, headers: [.contentType: "text/plain"], body: .init(byteBuffer: ByteBuffer(string: "ok\n")))
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
        return Application(router: router, configuration: .init(address: .hostname(host, port: port)),
                           onServerRunning: { channel in onListening(channel.localAddress?.port ?? 0) },
                           logger: logger)
    }
}
