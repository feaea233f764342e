internal import GRDB
internal import GRDBSQLite

/// Runs a statement of the hot write path with its values bound straight to SQLite.
///
/// GRDB's `StatementArguments` turn every value into a `DatabaseValue` first; on the intake's
/// path (one event insert per message, thousands per transaction) that conversion cost more
/// CPU than SQLite's own work. The statement is still GRDB's cached one (GRDB finalizes it when
/// the connection closes); it is only ever executed here.
struct SQLiteBinder {
    private let handle: OpaquePointer
    private var position: Int32 = 1
    private var failure: Int32 = SQLITE_OK

    private init(_ handle: OpaquePointer) { self.handle = handle }

    /// Resets `statement`, lets `bind` bind its parameters in order, and steps it to its end.
    /// Returns the number of rows it changed.
    @discardableResult
    static func execute(_ statement: Statement, in db: Database, _ bind: (inout SQLiteBinder) -> Void) throws -> Int {
        let handle = statement.sqliteStatement
        sqlite3_reset(handle)
        sqlite3_clear_bindings(handle)
        var binder = SQLiteBinder(handle)
        bind(&binder)
        if binder.failure != SQLITE_OK { throw error(binder.failure, db, statement) }
        var code = sqlite3_step(handle)
        while code == SQLITE_ROW { code = sqlite3_step(handle) }
        sqlite3_reset(handle)
        guard code == SQLITE_DONE else { throw error(code, db, statement) }
        return Int(sqlite3_changes(db.sqliteConnection))
    }

    private static func error(_ code: Int32, _ db: Database, _ statement: Statement) -> DatabaseError {
        let message = db.sqliteConnection.flatMap { sqlite3_errmsg($0) }.map { String(cString: $0) }
        return DatabaseError(resultCode: ResultCode(rawValue: code), message: message, sql: statement.sql)
    }

    private mutating func check(_ code: Int32) {
        if code != SQLITE_OK, failure == SQLITE_OK { failure = code }
        position += 1
    }

    /// SQLite copies what it is given (SQLITE_TRANSIENT): the bytes need not outlive the call.
    private static let transient = unsafeBitCast(-1, to: sqlite3_destructor_type.self)

    mutating func text(_ value: String) {
        var value = value
        let code = value.withUTF8 { utf8 in
            // SQLite binds NULL for a null pointer: an empty string must still be a string.
            guard let base = utf8.baseAddress else { return sqlite3_bind_text(handle, position, "", 0, Self.transient) }
            return sqlite3_bind_text(handle, position, base, Int32(utf8.count), Self.transient)
        }
        check(code)
    }

    mutating func text(_ value: String?) {
        if let value { text(value) } else { check(sqlite3_bind_null(handle, position)) }
    }

    mutating func double(_ value: Double) { check(sqlite3_bind_double(handle, position, value)) }
}
