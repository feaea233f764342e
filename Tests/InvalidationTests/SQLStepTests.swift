import Foundation
@testable import Invalidation
import Logging
import SecurityEvents
import Testing
import WardenTestSupport

@Suite("SQL steps and SQL subject lookups against real databases")
struct SQLStepTests {
    static var quiet: Logger {
        var logger = Logger(label: "sql-test")
        logger.logLevel = .critical
        return logger
    }

    @Test func postgresStatementAndLookup() async throws {
        let server = try await PostgresServer()
        let database = try await server.createDatabase()
        _ = try await server.psql(database, "CREATE TABLE users (id TEXT PRIMARY KEY, google_sub TEXT UNIQUE, google_signin BOOLEAN NOT NULL)")
        _ = try await server.psql(database, "INSERT INTO users VALUES ('local-7', '1234', true), ('local-8', '5678', true)")
        let target = try SQLTarget(location: "postgres://\(server.username)@127.0.0.1:\(server.port)/\(database)", logger: Self.quiet)
        let pool = Task { await target.run() }
        defer { pool.cancel() }
        let context = StepContext(token: token("account-disabled"), user: "local-7")

        // The subject 1234 (from the token) is local-7.
        let resolver = SQLResolver(target: target, query: "SELECT id FROM users WHERE google_sub = $1", parameters: ["{sub}"])
        #expect(await resolver.resolve(context.token) == .resolved(.user("local-7")))
        let nobody = SQLResolver(target: target, query: "SELECT id FROM users WHERE google_sub = $1", parameters: ["{email}"])
        #expect(await nobody.resolve(context.token) == .resolved(.unresolved))

        let executor = SQLStepExecutor(targets: ["appdb": target])
        // A value that looks like SQL is bound, not spliced.
        let step = StepAction.sql(target: "appdb", statement: "UPDATE users SET google_signin = false WHERE id = $1",
                                  parameters: ["local-7"])
        #expect(await executor.execute(step, context: context).result == "done")
        #expect(try await server.psql(database, "SELECT id, google_signin FROM users ORDER BY id") == "local-7|f\nlocal-8|t")
        let injection = StepAction.sql(target: "appdb", statement: "UPDATE users SET google_signin = false WHERE id = $1",
                                       parameters: ["x' OR '1'='1"])
        #expect(await executor.execute(injection, context: context).result == "done")
        #expect(try await server.psql(database, "SELECT count(*) FROM users WHERE google_signin") == "1")

        let broken = await executor.execute(.sql(target: "appdb", statement: "UPDATE no_such_table SET x = 1", parameters: []), context: context)
        guard case .failed(let reason) = broken else { Issue.record("expected failed, got \(broken)"); return }
        #expect(reason.contains("no_such_table"))

        // Answers come in binary: an integer or uuid id is read as PostgreSQL writes it, NULL is
        // no user, and another type is refused rather than read as bytes.
        _ = try await server.psql(database, """
            CREATE TABLE accounts (id BIGINT, small INTEGER, ref UUID, score REAL, google_sub TEXT);
            INSERT INTO accounts VALUES (7, 12, 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11', 1.5, '1234'), (NULL, NULL, NULL, NULL, '5678')
            """)
        func lookup(_ column: String, _ sub: String = "{sub}") -> SQLResolver {
            SQLResolver(target: target, query: "SELECT \(column) FROM accounts WHERE google_sub = $1", parameters: [sub])
        }
        #expect(await lookup("id").resolve(context.token) == .resolved(.user("7")))
        #expect(await lookup("small").resolve(context.token) == .resolved(.user("12")))
        #expect(await lookup("ref").resolve(context.token) == .resolved(.user("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")))
        #expect(await lookup("id", "5678").resolve(context.token) == .resolved(.unresolved))
        guard case .refused = await lookup("score").resolve(context.token) else {
            Issue.record("an answer that is not an id is a refused lookup, not \"no such user\""); return
        }
        do {
            _ = try await target.firstValue("SELECT score FROM accounts WHERE google_sub = '1234'", [])
            Issue.record("a REAL read as text")
        } catch {
            #expect(!error.retryable && error.message.contains("score::text"), "\(error.message)")
        }
    }

    @Test func postgresDownIsRetry() async throws {
        let port = try freeLoopbackPort()
        let target = try SQLTarget(location: "postgres://warden@127.0.0.1:\(port)/nothing", logger: Self.quiet)
        let pool = Task { await target.run() }
        defer { pool.cancel() }
        let outcome = await SQLStepExecutor(targets: ["db": target])
            .execute(.sql(target: "db", statement: "SELECT 1", parameters: []), context: StepContext(token: token("sessions-revoked"), user: nil))
        #expect(outcome.result == "retry")
    }

    @Test func sqliteStatementAndLookup() async throws {
        let path = Scratch.path("app", extension: "sqlite")
        defer { try? FileManager.default.removeItem(atPath: path) }
        let target = try SQLTarget(location: "sqlite:" + path, logger: Self.quiet)
        let executor = SQLStepExecutor(targets: ["app": target])
        let context = StepContext(token: token("account-disabled"), user: "u")
        for statement in ["CREATE TABLE users (id TEXT PRIMARY KEY, google_sub TEXT, google_signin INTEGER)",
                          "INSERT INTO users VALUES ('local-7', '1234', 1)"] {
            #expect(await executor.execute(.sql(target: "app", statement: statement, parameters: []), context: context).result == "done")
        }
        let resolver = SQLResolver(target: target, query: "SELECT id FROM users WHERE google_sub = ?", parameters: ["{sub}"])
        #expect(await resolver.resolve(context.token) == .resolved(.user("local-7")))
        #expect(await executor.execute(.sql(target: "app", statement: "UPDATE users SET google_signin = 0 WHERE id = ?",
                                            parameters: ["local-7"]), context: context) == .done("1 row(s) changed"))
        #expect(try await target.firstValue("SELECT google_signin FROM users", []) == "0")
    }

    /// A lookup on a SQLite file another process holds locked is "not now" (retried), never "no
    /// such user": that would record the event unresolved and never plan its steps.
    @Test func aLookupOnABusySQLiteFileIsRetriedNotUnresolved() async throws {
        let path = Scratch.path("busy", extension: "sqlite")
        defer { try? FileManager.default.removeItem(atPath: path) }
        let target = try SQLTarget(location: "sqlite:" + path, logger: Self.quiet)
        let context = StepContext(token: token("account-disabled"), user: "u")
        for statement in ["CREATE TABLE users (id TEXT PRIMARY KEY, google_sub TEXT)", "INSERT INTO users VALUES ('local-7', '1234')"] {
            #expect(await SQLStepExecutor(targets: ["app": target]).execute(.sql(target: "app", statement: statement, parameters: []),
                                                                           context: context).result == "done")
        }
        // Another process (Debian's sqlite3) holds an exclusive lock until its input ends.
        let holder = Process()
        holder.executableURL = URL(fileURLWithPath: "/usr/bin/sqlite3")
        holder.arguments = [path]
        let input = Pipe(), output = Pipe()
        holder.standardInput = input
        holder.standardOutput = output
        try holder.run()
        input.fileHandleForWriting.write(Data("BEGIN EXCLUSIVE;\nSELECT 'locked';\n".utf8))
        var seen = Data()
        while !String(decoding: seen, as: UTF8.self).contains("locked") {
            let chunk = output.fileHandleForReading.availableData
            if chunk.isEmpty { break }
            seen += chunk
        }
        let resolver = SQLResolver(target: target, query: "SELECT id FROM users WHERE google_sub = ?", parameters: ["{sub}"])
        let busy = await resolver.resolve(context.token)
        try input.fileHandleForWriting.close()
        holder.waitUntilExit()
        guard case .retry = busy else { Issue.record("a busy database must be retried, got \(busy)"); return }
        #expect(await resolver.resolve(context.token) == .resolved(.user("local-7")))
    }
}
