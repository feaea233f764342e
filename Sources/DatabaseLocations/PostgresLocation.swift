import Foundation
package import Logging
package import PostgresNIO

/// Why a database URL was refused; never shows a password.
public struct LocationError: Error, Sendable, CustomStringConvertible {
    public var message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}

/// A PostgreSQL server and database, parsed once from its URL for the ledger and for SQL
/// targets alike: every URL parameter is honoured or refused, never ignored.
public struct PostgresLocation: Sendable, Hashable, CustomStringConvertible {
    public var host: String
    public var port: Int
    public var username: String
    public var password: String?
    public var database: String

    public init(host: String, port: Int = 5432, username: String, password: String? = nil, database: String) {
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.database = database
    }

    /// `postgres://user[:password]@host[:port]/database`; the error never shows the password.
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
        for item in c.queryItems ?? [] {
            switch (item.name, item.value ?? "") {
            case ("sslmode", "disable"), ("sslmode", "allow"), ("sslmode", "prefer"):
                continue  // libpq's meaning: a connection without TLS is acceptable
            case ("sslmode", "require"), ("sslmode", "verify-ca"), ("sslmode", "verify-full"):
                return .failure(LocationError("sslmode=\(item.value ?? "") asks for TLS, which this version cannot make to PostgreSQL; use sslmode=disable on a trusted network, or a TLS tunnel"))
            case ("sslmode", let value):
                return .failure(LocationError("sslmode=\(value.prefix(32)) is not an sslmode (disable, allow, prefer, require, verify-ca, verify-full)"))
            default:
                return .failure(LocationError("the URL parameter \"\(item.name.prefix(32))\" is not supported (supported: sslmode=disable|allow|prefer)"))
            }
        }
        return .success(PostgresLocation(host: host, port: c.port ?? 5432, username: user.removingPercentEncoding ?? user,
                                 password: c.password.map { $0.removingPercentEncoding ?? $0 }, database: database))
    }

    public var description: String { "postgres://\(username)@\(host):\(port)/\(database)" }

    /// A client for this location (no TLS; run it with `run()`).
    package func makeClient(maximumConnections: Int, logger: Logger) -> PostgresClient {
        var configuration = PostgresClient.Configuration(host: host, port: port, username: username, password: password,
                                                         database: database, tls: .disable)
        configuration.options.maximumConnections = maximumConnections
        configuration.options.connectTimeout = .seconds(5)
        return PostgresClient(configuration: configuration, backgroundLogger: logger)
    }
}
