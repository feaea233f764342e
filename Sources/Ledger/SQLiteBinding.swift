internal import GRDB
internal import GRDBSQLite

/// Runs a statement of the hot write path with its values bound straight to SQLite.
///
/// GRDB's `StatementArguments` turn every value into a `DatabaseValue` first; on the intake's
/// path (one event insert per message, thousands per transaction) that conversion cost more
/// CPU than SQLite's own work. Texts are copied once into one scratch buffer that outlives the
/// step and bound without SQLite copying them again (SQLITE_STATIC: a copy would be a malloc
/// per value). The statement is still GRDB's cached one (GRDB finalizes it when the connection
/// closes); it is only ever executed here.
struct SQLiteBinder {
    private enum Value {
        case text(String)
        case null
        case double(Double)
    }

    private var values: [Value] = []

    /// Lets `bind` give the statement's parameters in order, binds them, and steps the
    /// statement to its end. Returns the number of rows it changed.
    @discardableResult
    static func execute(_ statement: Statement, in db: Database, _ bind: (inout SQLiteBinder) -> Void) throws -> Int {
        var binder = SQLiteBinder()
        binder.values.reserveCapacity(16)
        bind(&binder)
        let handle = statement.sqliteStatement
        // Every parameter is bound on every execution.
        guard binder.values.count == Int(sqlite3_bind_parameter_count(handle)) else {
            throw DatabaseError(message: "\(binder.values.count) values for \(sqlite3_bind_parameter_count(handle)) parameters",
                                sql: statement.sql)
        }
        var bytes = 0
        for case .text(let text) in binder.values { bytes += text.utf8.count }
        return try withUnsafeTemporaryAllocation(of: UInt8.self, capacity: max(bytes, 1)) { scratch in
            sqlite3_reset(handle)
            // Before the scratch buffer goes, whatever happens: no step runs on it, and no
            // binding points into it.
            defer {
                sqlite3_reset(handle)
                sqlite3_clear_bindings(handle)
            }
            var offset = 0
            for (index, value) in binder.values.enumerated() {
                let position = Int32(index + 1)
                let code: Int32
                switch value {
                case .text(var text):
                    let start = scratch.baseAddress! + offset
                    let count = text.withUTF8 { utf8 in
                        if let base = utf8.baseAddress { start.update(from: base, count: utf8.count) }
                        return utf8.count
                    }
                    offset += count
                    // A non-null pointer even for an empty string: SQLite binds NULL for a null one.
                    code = sqlite3_bind_text(handle, position, start, Int32(count), nil)
                case .null: code = sqlite3_bind_null(handle, position)
                case .double(let number): code = sqlite3_bind_double(handle, position, number)
                }
                if code != SQLITE_OK { throw error(code, db, statement) }
            }
            var code = sqlite3_step(handle)
            while code == SQLITE_ROW { code = sqlite3_step(handle) }
            guard code == SQLITE_DONE else { throw error(code, db, statement) }
            return Int(sqlite3_changes(db.sqliteConnection))
        }
    }

    private static func error(_ code: Int32, _ db: Database, _ statement: Statement) -> DatabaseError {
        let message = db.sqliteConnection.flatMap { sqlite3_errmsg($0) }.map { String(cString: $0) }
        return DatabaseError(resultCode: ResultCode(rawValue: code), message: message, sql: statement.sql)
    }

    mutating func text(_ value: String) { values.append(.text(value)) }

    mutating func text(_ value: String?) { values.append(value.map { .text($0) } ?? .null) }

    mutating func double(_ value: Double) { values.append(.double(value)) }
}
