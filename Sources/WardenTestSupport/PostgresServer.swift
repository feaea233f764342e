import Foundation

/// A real PostgreSQL server (Debian's `postgresql` package) made with `initdb` in a temporary
/// folder and started with `pg_ctl` on a free loopback port; stopped and removed when released.
/// As root, the server runs as the `postgres` user (PostgreSQL refuses to run as root).
public final class PostgresServer: @unchecked Sendable {
    // `@unchecked Sendable`: every property is set in `init` and only read afterwards.
    public let port: Int
    public let username = "warden"
    private let directory: URL
    private let bin: String

    public init() throws {
        guard let version = try? FileManager.default.contentsOfDirectory(atPath: "/usr/lib/postgresql").sorted().last else {
            throw TestServerError("PostgreSQL is not installed (Debian package postgresql)")
        }
        bin = "/usr/lib/postgresql/\(version)/bin"
        port = try freeLoopbackPort()
        directory = URL(fileURLWithPath: "/tmp").appendingPathComponent("warden-pg-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        if getuid() == 0 { try runProgram("/bin/chown", ["postgres", directory.path]) }
        try asServerUser("\(bin)/initdb", ["-D", dataPath, "-U", username, "--auth=trust", "-E", "UTF8", "--no-sync"])
        // The server runs in the foreground as our child (pg_ctl's daemon would outlive the
        // test process's bookkeeping of children); ready when it accepts connections.
        let server = Process()
        let command = ["\(bin)/postgres", "-D", dataPath, "-p", String(port), "-k", directory.path,
                       "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
        server.executableURL = URL(fileURLWithPath: getuid() == 0 ? "/usr/sbin/runuser" : command[0])
        server.arguments = getuid() == 0 ? ["-u", "postgres", "--"] + command : Array(command.dropFirst())
        server.standardOutput = FileHandle.nullDevice
        server.standardError = FileHandle.nullDevice
        try server.run()
        process = server
        for _ in 0..<400 {
            if canConnect(port: port) {
                // Accepting connections is not yet accepting logins: wait for a query to work.
                if (try? runProgram("/usr/bin/psql", ["-h", "127.0.0.1", "-p", String(port), "-U", username, "-d", "postgres",
                                                    "-Atc", "SELECT 1"])) == "1" { return }
            }
            usleep(25_000)
        }
        throw TestServerError("PostgreSQL did not start on port \(port)")
    }

    private var process: Process?

    deinit {
        try? asServerUser("\(bin)/pg_ctl", ["-D", dataPath, "-m", "immediate", "-w", "stop"])
        if let process, process.isRunning { kill(process.processIdentifier, SIGKILL) }
        try? FileManager.default.removeItem(at: directory)
    }

    private var dataPath: String { directory.appendingPathComponent("data").path }

    /// Creates an empty database and returns its name.
    public func createDatabase() throws -> String {
        let name = "warden_\(UUID().uuidString.prefix(8).lowercased())"
        try runProgram("/usr/bin/psql", ["-h", "127.0.0.1", "-p", String(port), "-U", username, "-d", "postgres", "-q",
                                       "-c", "CREATE DATABASE \(name)"])
        return name
    }

    /// Runs `psql` (an independent client) and returns its unaligned output.
    public func psql(_ database: String, _ sql: String) throws -> String {
        try runProgram("/usr/bin/psql", ["-h", "127.0.0.1", "-p", String(port), "-U", username, "-d", database, "-At", "-c", sql])
    }

    /// Runs initdb or pg_ctl. Their output goes nowhere: the server pg_ctl starts inherits it and
    /// would hold a pipe open for ever; the server's own log is in the folder.
    private func asServerUser(_ program: String, _ arguments: [String]) throws {
        let p = Process()
        p.executableURL = URL(fileURLWithPath: getuid() == 0 ? "/usr/sbin/runuser" : program)
        p.arguments = getuid() == 0 ? ["-u", "postgres", "--", program] + arguments : arguments
        p.standardOutput = FileHandle.nullDevice
        p.standardError = FileHandle.nullDevice
        try p.run()
        p.waitUntilExit()
        guard p.terminationStatus == 0 else {
            let log = (try? String(contentsOf: directory.appendingPathComponent("log"), encoding: .utf8)) ?? ""
            throw TestServerError("\(program) failed (\(p.terminationStatus)): \(log.suffix(2000))")
        }
    }

}
