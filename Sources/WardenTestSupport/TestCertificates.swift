public import Foundation

/// Certificates for tests, made by the `openssl` command in a scratch folder: a certificate
/// authority, and server and client certificates it signs (RSA 2048, PEM). A second, unrelated
/// authority stands for "the wrong CA".
public struct TestCertificates: Sendable {
    public let directory: URL
    /// The authority that signs everything below.
    public let caFile: String
    /// An authority that signed nothing here.
    public let otherCAFile: String

    public struct Pair: Sendable {
        public let certificateFile: String
        public let keyFile: String
    }

    /// Made once per process: key generation is the slow part.
    public static func shared() async throws -> TestCertificates {
        try await Cache.shared.value
    }

    private actor Cache {
        static let shared = Cache()
        private var made: Task<TestCertificates, any Error>?
        var value: TestCertificates {
            get async throws {
                if made == nil { made = Task { try await TestCertificates() } }
                return try await made!.value
            }
        }
    }

    public init() async throws {
        directory = try Scratch.directory("certificates")
        caFile = directory.appendingPathComponent("ca.pem").path
        otherCAFile = directory.appendingPathComponent("other-ca.pem").path
        for (name, subject) in [("ca", "Warden Test CA"), ("other-ca", "Somebody Else's CA")] {
            try await openssl(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                               "-keyout", path("\(name)-key.pem"), "-out", path("\(name).pem"), "-subj", "/CN=\(subject)",
                               "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        }
    }

    /// A certificate signed by the test CA for the given names (`DNS:localhost`, `IP:127.0.0.1`).
    public func issue(_ name: String, subjectAlternativeNames: [String], client: Bool = false) async throws -> Pair {
        let key = path("\(name)-key.pem"), request = path("\(name).csr"), certificate = path("\(name).pem")
        let extensions = path("\(name).ext")
        var lines = ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment",
                     "extendedKeyUsage=\(client ? "clientAuth" : "serverAuth")"]
        if !subjectAlternativeNames.isEmpty { lines.append("subjectAltName=" + subjectAlternativeNames.joined(separator: ",")) }
        try lines.joined(separator: "\n").write(toFile: extensions, atomically: true, encoding: .utf8)
        try await openssl(["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", "/CN=\(name)"])
        try await openssl(["x509", "-req", "-in", request, "-CA", caFile, "-CAkey", path("ca-key.pem"),
                           // A serial of its own: tests issuing at once would race on a shared serial file.
                           "-set_serial", String(UInt64.random(in: 1...UInt64(Int64.max))),
                           "-days", "2", "-out", certificate, "-extfile", extensions])
        // Servers (PostgreSQL) refuse a key file others can read.
        try FileManager.default.setAttributes([.posixPermissions: 0o600], ofItemAtPath: key)
        return Pair(certificateFile: certificate, keyFile: key)
    }

    private func path(_ file: String) -> String { directory.appendingPathComponent(file).path }

    private func openssl(_ arguments: [String]) async throws {
        let result = try await runToEnd(URL(fileURLWithPath: "/usr/bin/openssl"), arguments)
        guard result.status == 0 else { throw TestServerError("openssl \(arguments.prefix(2).joined(separator: " ")): \(result.stderr)") }
    }
}

/// The files of a folder served over HTTPS by `openssl s_server -WWW` on a loopback port, with a
/// certificate from `TestCertificates` (one connection at a time, HTTP/1.x GET only).
public final class StaticHTTPSServer {
    public let port: Int
    private let process: Process

    public static func start(serving directory: URL, certificate: TestCertificates.Pair) async throws -> StaticHTTPSServer {
        let port = try freeLoopbackPort()
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/openssl")
        process.arguments = ["s_server", "-accept", "127.0.0.1:\(port)", "-cert", certificate.certificateFile,
                             "-key", certificate.keyFile, "-WWW", "-quiet"]
        process.currentDirectoryURL = directory
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        process.standardInput = FileHandle.nullDevice
        try process.run()
        for _ in 0..<100 where !canConnect(port: port) { try await Task.sleep(for: .milliseconds(50)) }
        return StaticHTTPSServer(port: port, process: process)
    }

    private init(port: Int, process: Process) {
        self.port = port
        self.process = process
    }

    /// SIGKILL: a child may inherit a signal mask that blocks SIGTERM, and the server keeps nothing.
    public func stop() { kill(process.processIdentifier, SIGKILL) }
}
