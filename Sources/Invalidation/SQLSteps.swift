import Foundation
internal import GRDB
import DatabaseLocations
public import Logging
internal import PostgresNIO
public import SecurityEvents

/// The app's database, for `sql` steps and SQL subject lookups: PostgreSQL (`$1`, `$2`, …
/// parameters) or SQLite (`?` parameters). Values are always bound, never spliced into the text.
public final class SQLTarget: Sendable {
    enum Storage: Sendable {
        case postgres(PostgresClient)
        case sqlite(DatabaseQueue)
    }

    private let storage: Storage
    private let logger: Logger
    public let summary: String

    /// `sqlite:PATH` or `postgres://user[:password]@host[:port]/database`.
    public init(location: String, logger: Logger) throws(TargetSettingsError) {
        self.logger = logger
        if location.hasPrefix("sqlite:") {
            var path = String(location.dropFirst("sqlite:".count))
            if path.hasPrefix("//") { path = String(path.dropFirst(2)) }
            do {
                var configuration = Configuration()
                configuration.busyMode = .timeout(5)
                storage = .sqlite(try DatabaseQueue(path: path, configuration: configuration))
            } catch {
                throw TargetSettingsError("cannot open the SQLite database \(path): \(error)")
            }
            summary = "sqlite \(path)"
            return
        }
        let parsed: PostgresLocation
        switch PostgresLocation.parse(location) {
        case .success(let value): parsed = value
        case .failure(let error): throw TargetSettingsError("expected sqlite:PATH or a PostgreSQL URL: \(error.message)")
        }
        let client = parsed.makeClient(maximumConnections: 4, logger: logger)
        storage = .postgres(client)
        summary = parsed.description
    }

    /// Why a statement did not run: `retryable` when the database could not be reached.
    public struct Failure: Error, Sendable {
        public var message: String
        public var retryable: Bool
    }

    /// Runs a statement; returns what it did, for the step's record.
    public func execute(_ sql: String, _ parameters: [String]) async throws(Failure) -> String {
        switch storage {
        case .sqlite(let queue):
            do {
                return try await queue.write { db in
                    try db.execute(sql: sql, arguments: StatementArguments(parameters))
                    return "\(db.changesCount) row(s) changed"
                }
            } catch {
                throw Self.sqliteFailure(error)
            }
        case .postgres(let client):
            let logger = self.logger
            do {
                return try await Self.withinTimeout { () async throws -> String in
                    let rows = try await client.query(Self.query(sql, parameters), logger: logger)
                    var returned = 0
                    for try await _ in rows { returned += 1 }
                    return returned > 0 ? "statement ran, \(returned) row(s) returned" : "statement ran"
                }
            } catch {
                throw Self.failure(error)
            }
        }
    }

    /// The first column of the first row, as text; nil when there is no row.
    public func firstValue(_ sql: String, _ parameters: [String]) async throws(Failure) -> String? {
        switch storage {
        case .sqlite(let queue):
            do {
                return try await queue.read { db in try String.fetchOne(db, sql: sql, arguments: StatementArguments(parameters)) }
            } catch {
                // A busy database is tried again: a lookup given up would record the event
                // unresolved, its steps never planned.
                throw Self.sqliteFailure(error)
            }
        case .postgres(let client):
            let logger = self.logger
            do {
                return try await Self.withinTimeout { () async throws -> String? in
                    for try await row in try await client.query(Self.query(sql, parameters), logger: logger) {
                        guard let cell = row.first else { return nil }
                        return try Self.text(of: cell)
                    }
                    return nil
                }
            } catch {
                throw Self.failure(error)
            }
        }
    }

    /// A PostgreSQL value as the text PostgreSQL itself writes for it. Answers come in binary:
    /// read as bytes, a `bigint` 7 would be "\0\0\0\0\0\0\0\u{7}", a user id that names no one.
    /// NULL is no value; a type other than text, an integer or a uuid is refused, not guessed.
    static func text(of cell: PostgresCell) throws -> String? {
        guard cell.bytes != nil else { return nil }
        switch cell.dataType {
        case .text, .varchar, .bpchar, .name: return try cell.decode(String.self)
        case .int2, .int4, .int8: return String(try cell.decode(Int64.self))
        case .uuid: return try cell.decode(UUID.self).uuidString.lowercased()
        default:
            throw Failure(message: "the lookup's first column \(cell.columnName) is of type \(cell.dataType), not text, an integer or a uuid "
                                   + "(cast it: \(cell.columnName)::text)", retryable: false)
        }
    }

    static func sqliteFailure(_ error: any Error) -> Failure {
        guard let error = error as? DatabaseError else { return Failure(message: "SQLite: \(error)", retryable: true) }
        let busy = error.resultCode == .SQLITE_BUSY || error.resultCode == .SQLITE_LOCKED
        return Failure(message: "SQLite: \(error.message ?? "\(error.resultCode)")", retryable: busy)
    }

    /// Runs a PostgreSQL database's connection pool until the task is cancelled or the service
    /// group shuts down (every statement waits for it); returns at once for SQLite.
    public func run() async {
        if case .postgres(let client) = storage { await client.run() }
    }

    /// A statement that gets no answer within this many seconds (the server down: the pool
    /// would wait for a connection much longer) is given up and retried later.
    static let timeout: Double = 10

    struct TimedOut: Error {}

    static func withinTimeout<T: Sendable>(_ body: @escaping @Sendable () async throws -> T) async throws -> T {
        try await withThrowingTaskGroup(of: T.self) { group in
            group.addTask { try await body() }
            group.addTask {
                try await Task.sleep(for: .seconds(timeout))
                throw TimedOut()
            }
            defer { group.cancelAll() }
            return try await group.next()!
        }
    }

    static func query(_ sql: String, _ parameters: [String]) -> PostgresQuery {
        var binds = PostgresBindings(capacity: parameters.count)
        for parameter in parameters { binds.append(parameter) }
        return PostgresQuery(unsafeSQL: sql, binds: binds)
    }

    /// The server's words without the statement's values; a connection problem is retryable.
    static func failure(_ error: any Error) -> Failure {
        if let failure = error as? Failure { return failure }
        if error is TimedOut { return Failure(message: "PostgreSQL did not answer within \(Int(timeout)) s", retryable: true) }
        // An answer that cannot be read will not read better next time.
        if error is PostgresDecodingError { return Failure(message: "PostgreSQL: the answer cannot be read: \(error)", retryable: false) }
        guard let error = error as? PSQLError else { return Failure(message: "PostgreSQL: \(error)", retryable: true) }
        if let message = error.serverInfo?[.message] {
            // Classes that say "not now": connection (08), transaction rollback (40: deadlock,
            // serialization), insufficient resources (53), operator intervention (57: shutdown),
            // lock not available (55P03). The others refuse the statement itself.
            let state = error.serverInfo?[.sqlState] ?? ""
            let transient = ["08", "40", "53", "57"].contains(where: { state.hasPrefix($0) }) || state == "55P03"
            return Failure(message: "PostgreSQL \(transient ? "could not run" : "refused") the statement: \(message)", retryable: transient)
        }
        return Failure(message: "PostgreSQL unreachable: \(error.code)", retryable: true)
    }
}

/// Runs `sql` steps.
public struct SQLStepExecutor: StepExecutor {
    public let targets: [String: SQLTarget]

    public init(targets: [String: SQLTarget]) { self.targets = targets }

    public func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
        guard case .sql(let name, let statement, let parameters) = action else { return .failed("\(action.kind) is not a sql step") }
        guard let target = targets[name] else { return .failed("no sql target named \"\(name)\"") }
        do {
            return .done(try await target.execute(statement, parameters))
        } catch {
            return error.retryable ? .retry(error.message, after: nil) : .failed(error.message)
        }
    }
}

/// A query on the app's database gives the local user id (first column of the first row).
public struct SQLResolver: SubjectResolver {
    public let target: SQLTarget
    public let query: String
    public let parameters: [String]

    public init(target: SQLTarget, query: String, parameters: [String]) {
        self.target = target
        self.query = query
        self.parameters = parameters
    }

    public func resolve(_ token: SecurityEventToken) async -> ResolutionOutcome {
        guard let event = token.events.first else { return .resolved(.unresolved) }
        let values = Planner.values(for: event, in: token, resolution: .unresolved)
        var bound: [String] = []
        for parameter in parameters {
            guard let value = try? Planner.substitute(parameter, values: values, escapeGlob: false) else { return .resolved(.unresolved) }
            bound.append(value)
        }
        do {
            return .resolved(try await target.firstValue(query, bound).map { .user($0) } ?? .unresolved)
        } catch {
            return error.retryable ? .retry(error.message) : .refused("the subject lookup was refused: \(error.message)")
        }
    }
}
