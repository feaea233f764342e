public import Foundation

/// An HTTP `CONNECT` proxy for tests (Python's standard library, in a process of its own): it
/// tunnels `host:port` to the loopback address its routes give for that name — the names need
/// not exist in DNS, so a request that reaches its endpoint can only have come through the
/// proxy — and writes one line per request it receives (`CONNECT host:port auth=yes|no`).
/// With credentials, a request without the matching `Proxy-Authorization` gets 407.
public final class ConnectProxy {
    public let port: Int
    public let logFile: URL
    private let process: Process

    /// The proxy's URL as an `HTTPS_PROXY` value.
    public var url: String { "http://127.0.0.1:\(port)" }

    /// `routes`: `name:port` → loopback port.
    public static func start(routes: [String: Int], credentials: (user: String, password: String)? = nil) async throws -> ConnectProxy {
        let directory = try Scratch.directory("proxy")
        let script = directory.appendingPathComponent("proxy.py")
        try Self.script.write(to: script, atomically: true, encoding: .utf8)
        let log = directory.appendingPathComponent("requests.log")
        _ = FileManager.default.createFile(atPath: log.path, contents: nil)
        let port = try freeLoopbackPort()
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
        process.arguments = [script.path, String(port), log.path, credentials.map { "\($0.user):\($0.password)" } ?? ""]
            + routes.map { "\($0.key.lowercased())=\($0.value)" }
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        for _ in 0..<200 where !canConnect(port: port) { try await Task.sleep(for: .milliseconds(25)) }
        guard canConnect(port: port) else {
            process.terminate()
            throw TestServerError("the test proxy did not start on port \(port)")
        }
        return ConnectProxy(port: port, logFile: log, process: process)
    }

    private init(port: Int, logFile: URL, process: Process) {
        self.port = port
        self.logFile = logFile
        self.process = process
    }

    /// The request lines received so far.
    public var requests: [String] {
        ((try? String(contentsOf: logFile, encoding: .utf8)) ?? "").split(separator: "\n").map(String.init)
    }

    /// SIGKILL: a child may inherit a signal mask that blocks SIGTERM, and the proxy keeps nothing.
    public func stop() {
        kill(process.processIdentifier, SIGKILL)
    }

    private static let script = #"""
    import base64, select, socket, sys, threading
    port, log_path, credentials = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    routes = dict(arg.split("=", 1) for arg in sys.argv[4:])
    expected = "Basic " + base64.b64encode(credentials.encode()).decode() if credentials else None
    lock = threading.Lock()

    def log(line):
        with lock, open(log_path, "a") as f:
            f.write(line + "\n")

    def relay(a, b):
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [])
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except OSError:
            pass
        finally:
            a.close(); b.close()

    def handle(client):
        reader = client.makefile("rb")
        request = reader.readline().decode("latin-1").strip()
        headers = {}
        while True:
            line = reader.readline().decode("latin-1").strip()
            if not line:
                break
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        parts = request.split(" ")
        if len(parts) != 3:
            client.close(); return
        method, target, _ = parts
        log(f"{method} {target} auth={'yes' if 'proxy-authorization' in headers else 'no'}")
        if expected and headers.get("proxy-authorization") != expected:
            client.sendall(b'HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm="test"\r\nContent-Length: 0\r\n\r\n')
            client.close(); return
        route = routes.get(target.lower()) if method == "CONNECT" else None
        if route is None:
            client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            client.close(); return
        upstream = socket.create_connection(("127.0.0.1", int(route)))
        client.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        relay(client, upstream)

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    while True:
        connection, _ = server.accept()
        threading.Thread(target=handle, args=(connection,), daemon=True).start()
    """#
}
