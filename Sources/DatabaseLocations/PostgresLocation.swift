import Foundation
import Synchronization
package import Logging
package import PostgresNIO
public import NIOSSL

/// Why a database URL was refused; never shows a password.
public struct LocationError: Error, Sendable, CustomStringConvertible {
    public var message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}

/// TLS to PostgreSQL as libpq's `sslmode` spells it, with the files it names already read.
public struct PostgresTLS: Sendable, Hashable {
    public enum Mode: String, Sendable, Hashable, CaseIterable {
        /// Plain TCP.
        case disable
        /// TLS when the server offers it, unverified; plain otherwise (libpq's `allow` and
        /// `prefer`: Warden tries TLS first for both).
        case allow, prefer
        /// TLS or nothing; the certificate is checked against `sslrootcert` when one is given
        /// (libpq's rule), otherwise not at all.
        case require
        /// TLS with a certificate signed by `sslrootcert` (or the system's authorities).
        case verifyCA = "verify-ca"
        /// As verify-ca, and the certificate must name the host (or its IP address).
        case verifyFull = "verify-full"
    }

    public var mode: Mode
    /// `sslrootcert`: the authorities trusted; nil for the system's.
    public var rootCertificates: [NIOSSLCertificate]?
    /// `sslcert` and `sslkey`: presented when the server asks for a client certificate.
    public var certificateChain: [NIOSSLCertificate]
    public var privateKey: NIOSSLPrivateKey?

    public init(mode: Mode, rootCertificates: [NIOSSLCertificate]? = nil, certificateChain: [NIOSSLCertificate] = [],
                privateKey: NIOSSLPrivateKey? = nil) {
        self.mode = mode
        self.rootCertificates = rootCertificates
        self.certificateChain = certificateChain
        self.privateKey = privateKey
    }

    /// NIO's TLS settings for this mode; nil for `disable`.
    var configuration: TLSConfiguration? {
        guard mode != .disable else { return nil }
        var c = TLSConfiguration.makeClientConfiguration()
        c.minimumTLSVersion = .tlsv12
        if let rootCertificates { c.trustRoots = .certificates(rootCertificates) }
        switch mode {
        case .disable, .allow, .prefer: c.certificateVerification = .none
        case .require: c.certificateVerification = rootCertificates == nil ? .none : .noHostnameVerification
        case .verifyCA: c.certificateVerification = .noHostnameVerification
        case .verifyFull: c.certificateVerification = .fullVerification
        }
        c.certificateChain = certificateChain.map { .certificate($0) }
        c.privateKey = privateKey.map { .privateKey($0) }
        return c
    }
}

/// A PostgreSQL server and database, parsed once from its URL for the ledger and for SQL
/// targets alike: every URL parameter is honoured or refused, never ignored.
public struct PostgresLocation: Sendable, Hashable, CustomStringConvertible {
    public var host: String
    public var port: Int
    public var username: String
    public var password: String?
    public var database: String
    public var tls: PostgresTLS

    public init(host: String, port: Int = 5432, username: String, password: String? = nil, database: String,
                tls: PostgresTLS = PostgresTLS(mode: .disable)) {
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.database = database
        self.tls = tls
    }

    /// `postgres://user[:password]@host[:port]/database[?sslmode=…&sslrootcert=…&sslcert=…&sslkey=…]`;
    /// the error never shows the password. Certificate files are read here, so a missing or
    /// malformed one is named at start-up.
    public static func parse(_ text: String) -> Result<PostgresLocation, LocationError> {
        guard text.hasPrefix("postgres://") || text.hasPrefix("postgresql://"), let c = URLComponents(string: text),
              let host = c.host, !host.isEmpty, let user = c.user, !user.isEmpty
        else {
            return .failure(LocationError("expected postgres://user[:password]@host[:port]/database"))
        }
        let database = c.path.trimmingCharacters(in: CharacterSet(charactersIn: "/"))
        guard !database.isEmpty else { return .failure(LocationError("the URL names no database (postgres://user@host/database)")) }
        // Every parameter is honoured or refused, never ignored: a dropped sslmode=require
        // would connect without TLS while the operator believes otherwise.
        var parameters: [String: String] = [:]
        let supported = ["sslmode", "sslrootcert", "sslcert", "sslkey"]
        for item in c.queryItems ?? [] {
            guard supported.contains(item.name) else {
                return .failure(LocationError("the URL parameter \"\(item.name.prefix(32))\" is not supported (supported: \(supported.joined(separator: ", ")))"))
            }
            guard parameters[item.name] == nil else { return .failure(LocationError("the URL parameter \(item.name) is given twice")) }
            parameters[item.name] = item.value ?? ""
        }
        let modeName = parameters["sslmode"] ?? "disable"
        guard let mode = PostgresTLS.Mode(rawValue: modeName) else {
            return .failure(LocationError("sslmode=\(modeName.prefix(32)) is not an sslmode (\(PostgresTLS.Mode.allCases.map(\.rawValue).joined(separator: ", ")))"))
        }
        var tls = PostgresTLS(mode: mode, certificateChain: [])
        if mode == .disable, let extra = supported.dropFirst().first(where: { parameters[$0] != nil }) {
            return .failure(LocationError("\(extra) needs an sslmode that makes TLS (require, verify-ca, verify-full)"))
        }
        if (parameters["sslcert"] == nil) != (parameters["sslkey"] == nil) {
            return .failure(LocationError("sslcert and sslkey go together"))
        }
        do {
            if let root = parameters["sslrootcert"], root != "system" {
                tls.rootCertificates = try read("sslrootcert", root) { try NIOSSLCertificate.fromPEMFile($0) }
            }
            if let certificate = parameters["sslcert"], let key = parameters["sslkey"] {
                tls.certificateChain = try read("sslcert", certificate) { try NIOSSLCertificate.fromPEMFile($0) }
                tls.privateKey = try read("sslkey", key) { try NIOSSLPrivateKey(file: $0, format: .pem) }
            }
        } catch {
            return .failure(error)
        }
        // `URLComponents` gives the user and password decoded already: decoding again would
        // turn a password holding `%41` into one holding `A`.
        return .success(PostgresLocation(host: host, port: c.port ?? 5432, username: user,
                                         password: c.password, database: database, tls: tls))
    }

    private static func read<T>(_ parameter: String, _ path: String, _ load: (String) throws -> T) throws(LocationError) -> T {
        guard FileManager.default.isReadableFile(atPath: path) else { throw LocationError("\(parameter): cannot read the file \(path)") }
        do { return try load(path) } catch { throw LocationError("\(parameter): \(path) is not PEM that can be used: \(error)") }
    }

    public var description: String {
        "postgres://\(username)@\(host):\(port)/\(database)" + (tls.mode == .disable ? "" : "?sslmode=\(tls.mode.rawValue)")
    }

    /// Connects once, outside any pool, and closes: the pool hides why a connection could not
    /// be made ("circuit breaker tripped"), this says it (a certificate not trusted, a name that
    /// does not match, a server without TLS, a password refused).
    package func probe(logger: Logger) async throws {
        let mode: PostgresConnection.Configuration.TLS
        switch (tls.mode, tls.configuration) {
        case (.allow, let c?), (.prefer, let c?): mode = .prefer(try NIOSSLContext(configuration: c))
        case (_, let c?): mode = .require(try NIOSSLContext(configuration: c))
        case (_, nil): mode = .disable
        }
        var configuration = PostgresConnection.Configuration(host: host, port: port, username: username, password: password,
                                                             database: database, tls: mode)
        configuration.options.connectTimeout = .seconds(5)
        // The connect timeout covers the TCP connection only: a server (or a balancer in front of
        // one) that takes the connection and never answers would hold the probe for ever.
        let settings = configuration
        let connection = try await Self.answer(within: Self.probeDeadline) {
            try await PostgresConnection.connect(configuration: settings, id: 0, logger: logger)
        }
        try? await connection.close()
    }

    /// How long a probe waits for the server to answer its connection, TLS and login included.
    package static let probeDeadline: Duration = .seconds(10)

    struct NoAnswer: Error, CustomStringConvertible {
        var limit: Duration
        var description: String { "the server took the connection and did not answer within \(limit)" }
    }

    /// `body`'s result, or `NoAnswer` once `limit` has passed: `body` is then cancelled and not
    /// waited for (a connection attempt that ignores cancellation ends on its own).
    static func answer<T: Sendable>(within limit: Duration, _ body: @escaping @Sendable () async throws -> T) async throws -> T {
        let first = FirstAnswer<T>()
        return try await withCheckedThrowingContinuation { continuation in
            first.waiting(continuation)
            let work = Task {
                do { first.answer(.success(try await body())) } catch { first.answer(.failure(error)) }
            }
            Task {
                try? await Task.sleep(for: limit)
                if first.answer(.failure(NoAnswer(limit: limit))) { work.cancel() }
            }
        }
    }

    /// Whether a failure to connect will recur until the configuration, the certificates or the
    /// server's accounts change — not worth waiting for: TLS refused or failed, the login or the
    /// database refused (SQLSTATE class 28, 3D).
    package static func isPermanentConnectionFailure(_ error: any Error) -> Bool {
        guard let error = error as? PSQLError else { return error is NIOSSLError || error is NIOSSLExtraError }
        if error.code == .sslUnsupported { return true }
        if let underlying = error.underlying, underlying is NIOSSLError || underlying is NIOSSLExtraError { return true }
        if let state = error.serverInfo?[.sqlState], state.hasPrefix("28") || state.hasPrefix("3D") { return true }
        return false
    }

    /// A client for this location (run it with `run()`).
    package func makeClient(maximumConnections: Int, logger: Logger) -> PostgresClient {
        let mode: PostgresClient.Configuration.TLS
        switch (tls.mode, tls.configuration) {
        case (.allow, let c?), (.prefer, let c?): mode = .prefer(c)
        case (_, let c?): mode = .require(c)
        case (_, nil): mode = .disable
        }
        var configuration = PostgresClient.Configuration(host: host, port: port, username: username, password: password,
                                                         database: database, tls: mode)
        configuration.options.maximumConnections = maximumConnections
        configuration.options.connectTimeout = .seconds(5)
        return PostgresClient(configuration: configuration, backgroundLogger: logger)
    }
}

/// Resumes a continuation with the first answer given; later ones are dropped.
final class FirstAnswer<T: Sendable>: Sendable {
    private let state = Mutex<(continuation: CheckedContinuation<T, any Error>?, answered: Bool)>((nil, false))

    func waiting(_ continuation: CheckedContinuation<T, any Error>) { state.withLock { $0.continuation = continuation } }

    /// Whether this was the first answer.
    @discardableResult
    func answer(_ result: Result<T, any Error>) -> Bool {
        let continuation = state.withLock { s -> CheckedContinuation<T, any Error>? in
            guard !s.answered else { return nil }
            s.answered = true
            defer { s.continuation = nil }
            return s.continuation
        }
        continuation?.resume(with: result)
        return continuation != nil
    }
}
