internal import GRDB
internal import GRDBSQLite

/// Runs the statements of the hot write path with their values bound straight to SQLite.
///
/// GRDB's `StatementArguments` turn every value into a `DatabaseValue` first; on the intake's
/// path (one event insert per message, thousands per transaction) that conversion cost more
/// CPU than SQLite's own work. Here the texts of one execution are copied, back to back, into
/// one byte buffer that lives as long as the binder (one per ledger write, reused for every
/// row of it), and bound without SQLite copying them again (SQLITE_STATIC: a copy would be a
/// malloc per value). The statement is still GRDB's cached one (GRDB finalizes it when the
/// connection closes); it is only ever executed here.
struct SQLiteBinder {
    private enum Slot {
        /// A text at this range of `bytes`.
        case text(start: Int, count: Int)
        case null
        case double(Double)
        case integer(Int64)
    }

    private var slots: [Slot] = []
    private var bytes: [UInt8] = []

    init() {
        slots.reserveCapacity(16)
        bytes.reserveCapacity(4096)
    }

    /// Lets `bind` give the statement's parameters in order, binds them, and steps the
    /// statement to its end. Returns the number of rows it changed.
    @discardableResult
    mutating func execute(_ statement: Statement, in db: Database, _ bind: (inout SQLiteBinder) -> Void) throws -> Int {
        try query(statement, in: db, bind, row: { _ in })
    }

    /// Like `execute`, handing each row the statement yields to `row` while it is current.
    @discardableResult
    mutating func query(_ statement: Statement, in db: Database, _ bind: (inout SQLiteBinder) -> Void,
                        row: (OpaquePointer) -> Void) throws -> Int {
        slots.removeAll(keepingCapacity: true)
        bytes.removeAll(keepingCapacity: true)
        bind(&self)
        let handle = statement.sqliteStatement
        // Every parameter is bound on every execution.
        guard slots.count == Int(sqlite3_bind_parameter_count(handle)) else {
            throw DatabaseError(message: "\(slots.count) values for \(sqlite3_bind_parameter_count(handle)) parameters",
                                sql: statement.sql)
        }
        // One spare byte, so that even an empty text has an address (SQLite binds NULL for a
        // null pointer) and the buffer is never the empty array's shared storage.
        bytes.append(0)
        let slots = self.slots
        return try bytes.withUnsafeBufferPointer { buffer in
            let base = buffer.baseAddress!
            sqlite3_reset(handle)
            // Before the buffer may move or be reused, whatever happens: no step runs on it, and
            // no binding points into it.
            defer {
                sqlite3_reset(handle)
                sqlite3_clear_bindings(handle)
            }
            for (index, slot) in slots.enumerated() {
                let position = Int32(index + 1)
                let code: Int32 = switch slot {
                case .text(let start, let count): sqlite3_bind_text(handle, position, base + start, Int32(count), nil)
                case .null: sqlite3_bind_null(handle, position)
                case .double(let number): sqlite3_bind_double(handle, position, number)
                case .integer(let number): sqlite3_bind_int64(handle, position, number)
                }
                if code != SQLITE_OK { throw Self.error(code, db, statement) }
            }
            var code = sqlite3_step(handle)
            while code == SQLITE_ROW {
                row(handle)
                code = sqlite3_step(handle)
            }
            guard code == SQLITE_DONE else { throw Self.error(code, db, statement) }
            return Int(sqlite3_changes(db.sqliteConnection))
        }
    }

    private static func error(_ code: Int32, _ db: Database, _ statement: Statement) -> DatabaseError {
        let message = db.sqliteConnection.flatMap { sqlite3_errmsg($0) }.map { String(cString: $0) }
        return DatabaseError(resultCode: ResultCode(rawValue: code), message: message, sql: statement.sql)
    }

    mutating func text(_ value: String) {
        let start = bytes.count
        var value = value
        value.withUTF8 { bytes.append(contentsOf: $0) }
        slots.append(.text(start: start, count: bytes.count - start))
    }

    /// A text given as its UTF-8 bytes (valid UTF-8: the caller's guarantee).
    mutating func text(utf8 value: [UInt8]) {
        let start = bytes.count
        bytes.append(contentsOf: value)
        slots.append(.text(start: start, count: value.count))
    }

    mutating func text(_ value: String?) {
        if let value { text(value) } else { slots.append(.null) }
    }

    mutating func double(_ value: Double) { slots.append(.double(value)) }

    mutating func double(_ value: Double?) {
        if let value { double(value) } else { slots.append(.null) }
    }

    mutating func integer(_ value: Int64) { slots.append(.integer(value)) }

    /// A JSON array of strings (event type URIs, step names) as one text, written in place.
    mutating func jsonArray(_ items: [String]) {
        let start = bytes.count
        writeJSONArray(items, to: &bytes)
        slots.append(.text(start: start, count: bytes.count - start))
    }
}
