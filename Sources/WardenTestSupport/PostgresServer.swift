import Foundation

/// A real PostgreSQL server (Debian's `postgresql` package) made with `initdb` in a temporary
/// folder and run on a free loopback port; stopped and removed when released. As root, the
/// server runs as the `postgres` user (PostgreSQL refuses to run as root).
public final class PostgresServer: @unchecked Sendable {
    // `@unchecked Sendable`: every property is set in `init` and only read afterwards.
    public let port: Int
    public let username = "warden"
    private let directory: URL
    private let bin: String
    private let process: Process

    /// `tls`: the server also speaks TLS (`ssl=on`) with this certificate; clients may still
    /// connect without it.
    public init(tls: TestCertificates.Pair? = nil) async throws {
        guard let version = try? FileManager.default.contentsOfDirectory(atPath: "/usr/lib/postgresql").sorted().last else {
            throw TestServerError("PostgreSQL is not installed (Debian package postgresql)")
        }
        let bin = "/usr/lib/postgresql/\(version)/bin"
        let directory = URL(fileURLWithPath: "/tmp").appendingPathComponent("warden-pg-\(UUID().uuidString.prefix(8))")
        let dataPath = directory.appendingPathComponent("data").path
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        if getuid() == 0 { try await runProgram("/bin/chown", ["postgres", directory.path]) }
        try await onOwnThread { [username] in
            try Self.asServerUser("\(bin)/initdb", ["-D", dataPath, "-U", username, "--auth=trust", "-E", "UTF8", "--no-sync"],
                                  logFolder: directory)
        }
        var settings: [String] = []
        if let tls {
            // The server reads its key as the postgres user, and refuses one others can read.
            let certificate = directory.appendingPathComponent("server.pem").path, key = directory.appendingPathComponent("server-key.pem").path
            try FileManager.default.copyItem(atPath: tls.certificateFile, toPath: certificate)
            try FileManager.default.copyItem(atPath: tls.keyFile, toPath: key)
            try FileManager.default.setAttributes([.posixPermissions: 0o600], ofItemAtPath: key)
            if getuid() == 0 { try await runProgram("/bin/chown", ["postgres", certificate, key]) }
            settings += ["-c", "ssl=on", "-c", "ssl_cert_file=\(certificate)", "-c", "ssl_key_file=\(key)"]
        }
        // The server runs in the foreground as our child (pg_ctl's daemon would outlive the
        // test process's bookkeeping of children); ready when it accepts logins. A free port can
        // be taken by another test between being found and being bound: the server then exits,
        // and is started again on another port. While the machine is busy (a whole test run on
        // two cores), starting can take many seconds: up to a minute is waited for.
        var attempt = 0
        while true {
            attempt += 1
            let port = try freeLoopbackPort()
            let server = Process()
            let command = ["\(bin)/postgres", "-D", dataPath, "-p", String(port), "-k", directory.path,
                           "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"] + settings
            server.executableURL = URL(fileURLWithPath: getuid() == 0 ? "/usr/sbin/runuser" : command[0])
            server.arguments = getuid() == 0 ? ["-u", "postgres", "--"] + command : Array(command.dropFirst())
            server.standardOutput = FileHandle.nullDevice
            server.standardError = FileHandle.nullDevice
            try server.run()
            let deadline = Date().addingTimeInterval(60)
            var ready = false
            while Date() < deadline, server.isRunning, !ready {
                // Accepting connections is not yet accepting logins: wait for a query to work.
                if canConnect(port: port) {
                    ready = (try? await Self.psql(port: port, username: username, "postgres", "SELECT 1")) == "1"
                }
                if !ready { try await Task.sleep(for: .milliseconds(50)) }
            }
            if ready {
                (self.bin, self.port, self.directory, self.process) = (bin, port, directory, server)
                return
            }
            if server.isRunning { kill(server.processIdentifier, SIGKILL) }
            if attempt >= 3 {
                try? FileManager.default.removeItem(at: directory)
                throw TestServerError("PostgreSQL did not start on port \(port) (attempt \(attempt))")
            }
        }
    }

    deinit {
        try? Self.asServerUser("\(bin)/pg_ctl", ["-D", directory.appendingPathComponent("data").path, "-m", "immediate", "-w", "stop"],
                               logFolder: directory)
        if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        try? FileManager.default.removeItem(at: directory)
    }

    /// Creates an empty database and returns its name.
    public func createDatabase() async throws -> String {
        let name = "warden_\(UUID().uuidString.prefix(8).lowercased())"
        _ = try await psql("postgres", "CREATE DATABASE \(name)")
        return name
    }

    /// Runs `psql` (an independent client) and returns its unaligned output.
    public func psql(_ database: String, _ sql: String) async throws -> String {
        try await Self.psql(port: port, username: username, database, sql)
    }

    static func psql(port: Int, username: String, _ database: String, _ sql: String) async throws -> String {
        try await runProgram("/usr/bin/psql", ["-h", "127.0.0.1", "-p", String(port), "-U", username, "-d", database, "-At", "-q", "-c", sql],
                             environment: ["PGSSLMODE": "disable", "PGAPPNAME": "psql"])
    }

    /// Runs initdb or pg_ctl, blocking. Their output goes nowhere: the server pg_ctl starts
    /// inherits it and would hold a pipe open for ever; the server's own log is in the folder.
    private static func asServerUser(_ program: String, _ arguments: [String], logFolder: URL) throws {
        let p = Process()
        p.executableURL = URL(fileURLWithPath: getuid() == 0 ? "/usr/sbin/runuser" : program)
        p.arguments = getuid() == 0 ? ["-u", "postgres", "--", program] + arguments : arguments
        p.standardOutput = FileHandle.nullDevice
        p.standardError = FileHandle.nullDevice
        try p.run()
        p.waitUntilExit()
        guard p.terminationStatus == 0 else {
            let log = (try? String(contentsOf: logFolder.appendingPathComponent("log"), encoding: .utf8)) ?? ""
            throw TestServerError("\(program) failed (\(p.terminationStatus)): \(log.suffix(2000))")
        }
    }
}
