import DatabaseLocations
import Foundation
import Ledger
import Logging
import Testing
import WardenTestSupport

/// The PostgreSQL ledger over TLS, against a real server with `ssl=on` and certificates made by
/// openssl: each sslmode does what libpq's does, and a server that cannot be trusted is refused
/// with words that say why.
@Suite("PostgreSQL ledger over TLS", .serialized)
struct PostgresTLSTests {
    /// Opens a ledger at `url` (its pool runs for the length of `body`).
    static func withLedger(_ url: String, _ body: (PostgresLedger) async throws -> Void) async throws {
        var logger = Logger(label: "ledger-tls-test")
        logger.logLevel = .critical
        let ledger = PostgresLedger(try PostgresLocation.parse(url).get(), logger: logger)
        let pool = Task { await ledger.run() }
        defer { pool.cancel() }
        try await body(ledger)
    }

    static func refusal(_ url: String) async throws -> String {
        var message = "opened"
        try await withLedger(url) { ledger in
            do { try await ledger.open() } catch { message = "\(error)" }
        }
        return message
    }

    @Test func everySSLMode() async throws {
        let certificates = try await TestCertificates.shared()
        let pair = try await certificates.issue("postgres-\(UUID().uuidString.prefix(6))",
                                                subjectAlternativeNames: ["DNS:localhost", "IP:127.0.0.1"])
        let server = try await PostgresServer(tls: pair)
        let database = try await server.createDatabase()
        let base = "postgres://warden@localhost:\(server.port)/\(database)"

        // verify-full: the CA and the name both checked; the connection really is encrypted.
        try await Self.withLedger(base + "?sslmode=verify-full&sslrootcert=\(certificates.caFile)") { ledger in
            try await ledger.open()
            let encrypted = try await server.psql(database, """
                SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
                WHERE ssl AND datname = '\(database)' AND application_name <> 'psql'
                """)
            #expect(Int(encrypted) ?? 0 > 0)
        }
        // By IP address the certificate names 127.0.0.1 too.
        try await Self.withLedger("postgres://warden@127.0.0.1:\(server.port)/\(database)?sslmode=verify-full&sslrootcert=\(certificates.caFile)") {
            try await $0.open()
        }
        for mode in ["require", "verify-ca", "prefer", "disable"] {
            let root = mode == "verify-ca" ? "&sslrootcert=\(certificates.caFile)" : ""
            try await Self.withLedger(base + "?sslmode=\(mode)" + root) { try await $0.open() }
        }

        // A CA that did not sign the server's certificate.
        let untrusted = try await Self.refusal(base + "?sslmode=verify-full&sslrootcert=\(certificates.otherCAFile)")
        #expect(untrusted.contains("CERTIFICATE_VERIFY_FAILED"), "\(untrusted)")
        // require with a root certificate verifies the chain, as libpq does.
        #expect(try await Self.refusal(base + "?sslmode=require&sslrootcert=\(certificates.otherCAFile)").contains("CERTIFICATE_VERIFY_FAILED"))
    }

    @Test func aCertificateForAnotherNameIsRefusedByVerifyFullOnly() async throws {
        let certificates = try await TestCertificates.shared()
        let pair = try await certificates.issue("db-elsewhere-\(UUID().uuidString.prefix(6))", subjectAlternativeNames: ["DNS:db.elsewhere.example"])
        let server = try await PostgresServer(tls: pair)
        let database = try await server.createDatabase()
        let base = "postgres://warden@localhost:\(server.port)/\(database)?sslrootcert=\(certificates.caFile)&sslmode="
        let refused = try await Self.refusal(base + "verify-full")
        #expect(refused.contains("failedToValidateHostname"), "\(refused)")
        try await Self.withLedger(base + "verify-ca") { try await $0.open() }
    }

    @Test func tlsRequiredFromAServerWithoutItIsRefused() async throws {
        let server = try await PostgresServer()
        let database = try await server.createDatabase()
        let refused = try await Self.refusal("postgres://warden@127.0.0.1:\(server.port)/\(database)?sslmode=require")
        #expect(refused != "opened")
        #expect(refused.lowercased().contains("tls") || refused.lowercased().contains("ssl"), "\(refused)")
        // prefer falls back to plain TCP.
        try await Self.withLedger("postgres://warden@127.0.0.1:\(server.port)/\(database)?sslmode=prefer") { try await $0.open() }
    }
}
