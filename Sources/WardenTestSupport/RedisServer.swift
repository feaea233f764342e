import Foundation

/// A real `redis-server` on a free loopback port, in a temporary folder, with persistence off.
/// It can be stopped and started again on the same port (to test reconnects), and may require
/// a password.
public final class RedisServer: @unchecked Sendable {
    // `@unchecked Sendable`: `process` is replaced only by `start`/`stop`, which a test calls
    // from one task; the other properties are constants.
    public let port: Int
    public let password: String?
    /// Whether data survives a kill: append-only file, fsync on every write.
    public let persistent: Bool
    /// When set, the server speaks only TLS, with this certificate, and asks clients for a
    /// certificate signed by `caFile` when `clientCAFile` is set.
    public let tls: TLS?
    private let directory: URL
    private var process: Process?

    public struct TLS: Sendable {
        public var server: TestCertificates.Pair
        public var caFile: String
        /// When set, clients must present a certificate `caFile` signed; `redis-cli` uses this one.
        public var clientCertificate: TestCertificates.Pair?

        public init(server: TestCertificates.Pair, caFile: String, clientCertificate: TestCertificates.Pair? = nil) {
            self.server = server
            self.caFile = caFile
            self.clientCertificate = clientCertificate
        }
    }

    public init(password: String? = nil, persistent: Bool = false, tls: TLS? = nil) async throws {
        self.port = try freeLoopbackPort()
        self.password = password
        self.persistent = persistent
        self.tls = tls
        directory = try Scratch.directory("redis")
        try await start()
    }

    deinit {
        kill()
        try? FileManager.default.removeItem(at: directory)
    }

    public func start() async throws {
        let p = Process()
        p.executableURL = URL(fileURLWithPath: "/usr/bin/redis-server")
        var arguments = ["--bind", "127.0.0.1", "--save", "",
                         "--appendonly", persistent ? "yes" : "no", "--appendfsync", "always",
                         "--dir", directory.path, "--daemonize", "no", "--loglevel", "warning"]
        if let password { arguments += ["--requirepass", password] }
        if let tls {
            arguments += ["--port", "0", "--tls-port", String(port), "--tls-cert-file", tls.server.certificateFile,
                          "--tls-key-file", tls.server.keyFile, "--tls-ca-cert-file", tls.caFile,
                          "--tls-auth-clients", tls.clientCertificate == nil ? "no" : "yes"]
        } else {
            arguments += ["--port", String(port)]
        }
        p.arguments = arguments
        p.standardOutput = FileHandle.nullDevice
        p.standardError = FileHandle.nullDevice
        try p.run()
        process = p
        // Ready when it accepts connections.
        for _ in 0..<200 {
            if canConnect(port: port) { return }
            try await Task.sleep(for: .milliseconds(25))
        }
        throw TestServerError("redis-server did not start on port \(port)")
    }

    /// Kills the server at once (SIGKILL: a child of the test process may inherit a mask that
    /// blocks SIGTERM, and a crash is what the tests want to survive anyway).
    public func stop() async {
        guard let process else { return }
        Foundation.kill(process.processIdentifier, SIGKILL)
        _ = try? await onOwnThread { process.waitUntilExit() }
        self.process = nil
    }

    /// Freezes the server (SIGSTOP): it keeps its connections and answers nothing — a wedged
    /// Redis, not a stopped one. `thaw()` lets it go on.
    public func freeze() {
        if let process { Foundation.kill(process.processIdentifier, SIGSTOP) }
    }

    public func thaw() {
        if let process { Foundation.kill(process.processIdentifier, SIGCONT) }
    }

    private func kill() {
        guard let process else { return }
        Foundation.kill(process.processIdentifier, SIGKILL)
        process.waitUntilExit()
    }

    /// Runs `redis-cli` against this server (as an independent client would) and returns its
    /// output; `password` in place of the server's own (after a rotation).
    public func cli(_ arguments: [String], password: String? = nil) async throws -> String {
        let password = password ?? self.password
        var secure = tls.map { ["--tls", "--cacert", $0.caFile] } ?? []
        if let client = tls?.clientCertificate { secure += ["--cert", client.certificateFile, "--key", client.keyFile] }
        return try await runProgram("/usr/bin/redis-cli", ["-h", "127.0.0.1", "-p", String(port)] + secure + arguments,
                       environment: password.map { ["REDISCLI_AUTH": $0] } ?? [:])
    }
}

public struct TestServerError: Error, CustomStringConvertible {
    public var description: String
    public init(_ description: String) { self.description = description }
}

/// A loopback TCP port nobody listens on right now.
public func freeLoopbackPort() throws -> Int {
    let (fd, port) = try boundLoopbackSocket()
    close(fd)
    return port
}

/// A TCP socket bound to a free loopback port: the descriptor (the caller closes it) and the port.
func boundLoopbackSocket() throws -> (Int32, Int) {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { throw TestServerError("socket() failed") }
    var address = sockaddr_in()
    address.sin_family = sa_family_t(AF_INET)
    address.sin_port = 0
    address.sin_addr.s_addr = inet_addr("127.0.0.1")
    let bound = withUnsafePointer(to: &address) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
    }
    guard bound == 0 else {
        close(fd)
        throw TestServerError("bind() failed")
    }
    var length = socklen_t(MemoryLayout<sockaddr_in>.size)
    _ = withUnsafeMutablePointer(to: &address) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
    }
    return (fd, Int(UInt16(bigEndian: address.sin_port)))
}

/// A loopback port that takes connections (the kernel completes them) and never answers: a
/// server that hangs, for as long as this object lives.
public final class SilentListener: Sendable {
    public let port: Int
    private let fd: Int32

    public init() throws {
        (fd, port) = try boundLoopbackSocket()
        guard listen(fd, 64) == 0 else {
            close(fd)
            throw TestServerError("listen() failed")
        }
    }

    deinit { close(fd) }
}

public func canConnect(port: Int) -> Bool {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { return false }
    defer { close(fd) }
    var address = sockaddr_in()
    address.sin_family = sa_family_t(AF_INET)
    address.sin_port = in_port_t(UInt16(port).bigEndian)
    address.sin_addr.s_addr = inet_addr("127.0.0.1")
    return withUnsafePointer(to: &address) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
    } == 0
}
