internal import CHiredis
import Dispatch
import Foundation
import Synchronization

/// A reply from Redis.
public enum RedisReply: Sendable, Hashable {
    case string([UInt8])
    case status(String)
    case integer(Int64)
    case array([RedisReply])
    case null
    /// An error reply (`-ERR …`, `-WRONGTYPE …`): the command reached the server and failed there.
    case error(String)

    /// The reply as text (bulk string or status).
    public var text: String? {
        switch self {
        case .string(let bytes): String(decoding: bytes, as: UTF8.self)
        case .status(let s): s
        default: nil
        }
    }

    public var integer: Int64? {
        if case .integer(let n) = self { return n }
        return nil
    }

    public var array: [RedisReply]? {
        if case .array(let items) = self { return items }
        return nil
    }
}

/// Why a command did not get a reply. `isRetryable` is true for connection problems (the
/// server may be back soon), false for what the server refused (wrong password, bad database).
public struct RedisError: Error, Sendable, CustomStringConvertible {
    public var message: String
    public var isRetryable: Bool

    public init(_ message: String, retryable: Bool) {
        self.message = message
        self.isRetryable = retryable
    }

    public var description: String { message }
}

/// Where the server is and how to sign in.
public struct RedisConnectionSettings: Sendable, Hashable {
    public var host: String
    public var port: Int
    public var database: Int
    public var username: String?
    public var password: String?
    /// Connections kept open. Default 4.
    public var poolSize: Int
    /// Connect and per-command timeout, seconds. Default 5.
    public var timeout: Double

    public init(host: String, port: Int, database: Int = 0, username: String? = nil, password: String? = nil,
                poolSize: Int = 4, timeout: Double = 5) {
        self.host = host
        self.port = port
        self.database = database
        self.username = username
        self.password = password
        self.poolSize = poolSize
        self.timeout = timeout
    }
}

/// A Redis client over hiredis: a pool of blocking connections, each running on its own serial
/// queue, outside Swift's cooperative pool. Commands sent together are pipelined (written at
/// once, replies read in order), and so are the requests of concurrent callers: a connection
/// takes every request waiting when it becomes free and sends them in one round trip, so under
/// load the steps of many events share one write and one read. A connection that fails is
/// closed and opened again (with AUTH and SELECT) on its next use; the requests it carried
/// report a retryable error and are not repeated here — each caller decides, since only it
/// knows whether a retry is safe.
public final class RedisClient: Sendable {
    public let settings: RedisConnectionSettings
    private let pool: Mutex<Pool>

    private struct Request {
        /// Its commands in the protocol's encoding, ready to be written.
        let encoded: [UInt8]
        let count: Int
        let continuation: CheckedContinuation<Result<[RedisReply], RedisError>, Never>
    }

    private struct Pool {
        var idle: [Connection] = []
        var created = 0
        var queued: [Request] = []
        var closed = false
    }

    /// Most commands one round trip carries (whole requests; one larger request goes alone).
    static let maximumCommandsPerRoundTrip = 1024

    /// Round trips made (pipelines written and read), for tests.
    let roundTrips = Atomic<Int>(0)

    public init(settings: RedisConnectionSettings) {
        self.settings = settings
        self.pool = Mutex(Pool())
    }

    /// Sends one command (`["SET", key, value]`) and returns its reply.
    public func send(_ command: [String]) async throws(RedisError) -> RedisReply {
        try await pipeline([command])[0]
    }

    /// Sends commands in one write and returns their replies, in order. An error reply is a
    /// reply (`.error`), not a thrown error.
    public func pipeline(_ commands: [[String]]) async throws(RedisError) -> [RedisReply] {
        try await send(commands.map { $0.lazy.map(\.utf8) })
    }

    /// Commands whose arguments are bytes.
    public func pipeline(_ commands: [[[UInt8]]]) async throws(RedisError) -> [RedisReply] {
        try await send(commands)
    }

    /// Encodes the commands into one buffer and sends them in one write; returns their replies.
    private func send<Command: Collection>(_ commands: [Command]) async throws(RedisError) -> [RedisReply]
        where Command.Element: Collection<UInt8>
    {
        guard !commands.isEmpty else { return [] }
        var encoding = RESPEncoding()
        for command in commands { encoding.append(command) }
        return try await send(encoding.bytes, count: commands.count)
    }

    /// Sends `count` encoded commands in one write and returns their replies.
    private func send(_ encoded: [UInt8], count: Int) async throws(RedisError) -> [RedisReply] {
        let result = await withCheckedContinuation { (continuation: CheckedContinuation<Result<[RedisReply], RedisError>, Never>) in
            enum Start { case closed, queued, drive(Connection) }
            let start = pool.withLock { p -> Start in
                if p.closed { return .closed }
                p.queued.append(Request(encoded: encoded, count: count, continuation: continuation))
                if let connection = p.idle.popLast() { return .drive(connection) }
                if p.created < settings.poolSize {
                    p.created += 1
                    return .drive(Connection())
                }
                return .queued  // a busy connection takes it when it is free
            }
            switch start {
            case .closed: continuation.resume(returning: .failure(RedisError("the Redis client is closed", retryable: false)))
            case .queued: break
            case .drive(let connection): drive(connection)
            }
        }
        return try result.get()
    }

    /// Closes every connection; calls after this fail.
    public func close() {
        let (idle, queued) = pool.withLock { p -> ([Connection], [Request]) in
            p.closed = true
            defer { p.idle = []; p.queued = [] }
            return (p.idle, p.queued)
        }
        for connection in idle { connection.queue.async { connection.disconnect() } }
        for request in queued { request.continuation.resume(returning: .failure(RedisError("the Redis client is closed", retryable: false))) }
    }

    /// Runs on the connection's queue: sends every waiting request (up to the round-trip bound)
    /// in one pipeline, answers each, and goes on while requests wait; then returns to the pool.
    private func drive(_ connection: Connection) {
        connection.queue.async { [self] in
            while true {
                let batch = pool.withLock { p -> [Request]? in
                    if p.closed || p.queued.isEmpty {
                        if !p.closed { p.idle.append(connection) }
                        return p.closed ? nil : []
                    }
                    var count = 0, taken = 0
                    for request in p.queued {
                        if taken > 0, count + request.count > Self.maximumCommandsPerRoundTrip { break }
                        count += request.count
                        taken += 1
                    }
                    defer { p.queued.removeFirst(taken) }
                    return Array(p.queued.prefix(taken))
                }
                guard let batch else {
                    connection.disconnect()
                    return
                }
                if batch.isEmpty { return }
                roundTrips.add(1, ordering: .relaxed)
                let (replies, failure) = connection.run(batch.map(\.encoded), replies: batch.reduce(0) { $0 + $1.count },
                                                        settings: settings)
                // Each request whose replies were all read has its answer, even when the
                // connection failed later in the round trip; the others get the error.
                var start = 0
                for request in batch {
                    let end = start + request.count
                    if end <= replies.count {
                        request.continuation.resume(returning: .success(Array(replies[start..<end])))
                    } else {
                        request.continuation.resume(returning: .failure(failure ?? RedisError("Redis: missing replies", retryable: true)))
                    }
                    start = end
                }
            }
        }
    }
}

extension RedisReply {
    /// For an error reply: whether the server may take the same command later (`LOADING`,
    /// `BUSY`, `TRYAGAIN`, `MASTERDOWN`, `CLUSTERDOWN`) rather than refuse it again
    /// (`WRONGTYPE`, `NOPERM`, …). The one classification every Redis caller uses.
    public var isTransientError: Bool {
        guard case .error(let message) = self else { return false }
        return ["LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN"].contains { message.hasPrefix($0) }
    }
}

/// One hiredis connection, opened lazily and reopened after a failure.
///
/// `@unchecked Sendable`: its context is only touched on its own serial `queue` (the pool hands
/// an idle connection to one driver at a time, under the pool's lock), never by two threads at once.
final class Connection: @unchecked Sendable {
    private var context: UnsafeMutablePointer<redisContext>?
    /// Its blocking calls run here: one serial queue per connection keeps the threads doing
    /// Redis I/O to the pool's size (a shared concurrent queue made a thread per waiting call).
    let queue = DispatchQueue(label: "warden.redis.connection")

    deinit { disconnect() }

    func disconnect() {
        if let context { redisFree(context) }
        context = nil
    }

    /// Sends encoded commands in one write and reads `count` replies: all of them, or those
    /// read before the connection failed, with the failure.
    func run(_ encoded: [[UInt8]], replies count: Int, settings: RedisConnectionSettings) -> (replies: [RedisReply], failure: RedisError?) {
        var replies: [RedisReply] = []
        do throws(RedisError) {
            let context = try connected(settings)
            for part in encoded { try append(part, to: context) }
            replies.reserveCapacity(count)
            for _ in 0..<count { replies.append(try reply(from: context)) }
            return (replies, nil)
        } catch {
            // The connection's state is unknown (half-read replies): start afresh next time.
            disconnect()
            return (replies, error)
        }
    }

    private func connected(_ settings: RedisConnectionSettings) throws(RedisError) -> UnsafeMutablePointer<redisContext> {
        if let context { return context }
        let whole = settings.timeout.rounded(.down)
        let timeout = timeval(tv_sec: Int(whole), tv_usec: Int((settings.timeout - whole) * 1_000_000))
        guard let opened = redisConnectWithTimeout(settings.host, Int32(settings.port), timeout) else {
            throw RedisError("cannot connect to Redis at \(settings.host):\(settings.port): out of memory", retryable: true)
        }
        if opened.pointee.err != 0 {
            let message = Self.errorText(opened)
            redisFree(opened)
            throw RedisError("cannot connect to Redis at \(settings.host):\(settings.port): \(message)", retryable: true)
        }
        redisSetTimeout(opened, timeout)
        redisEnableKeepAlive(opened)
        context = opened
        var setup = RESPEncoding(), commands = 0
        if let password = settings.password {
            setup.append((settings.username.map { ["AUTH", $0, password] } ?? ["AUTH", password]).lazy.map(\.utf8))
            commands += 1
        }
        if settings.database != 0 {
            setup.append(["SELECT", String(settings.database)].lazy.map(\.utf8))
            commands += 1
        }
        if commands > 0 { try append(setup.bytes, to: opened) }
        for i in 0..<commands {
            if case .error(let message) = try reply(from: opened) {
                disconnect()
                // Never echo the password: say which step failed and the server's words.
                let step = i == 0 && settings.password != nil ? "AUTH" : "SELECT \(settings.database)"
                throw RedisError("Redis at \(settings.host):\(settings.port) refused \(step): \(message)", retryable: false)
            }
        }
        return opened
    }

    /// Queues encoded commands in hiredis's output buffer (it copies them before returning).
    private func append(_ encoded: [UInt8], to context: UnsafeMutablePointer<redisContext>) throws(RedisError) {
        let status = encoded.withUnsafeBufferPointer { buffer in
            buffer.withMemoryRebound(to: CChar.self) { redisAppendFormattedCommand(context, $0.baseAddress, $0.count) }
        }
        if status != REDIS_OK { throw RedisError("Redis: \(Self.errorText(context))", retryable: true) }
    }

    private func reply(from context: UnsafeMutablePointer<redisContext>) throws(RedisError) -> RedisReply {
        var raw: UnsafeMutableRawPointer? = nil
        guard redisGetReply(context, &raw) == REDIS_OK, let raw else {
            throw RedisError("Redis: \(Self.errorText(context))", retryable: true)
        }
        defer { freeReplyObject(raw) }
        return Self.convert(raw.assumingMemoryBound(to: redisReply.self))
    }

    private static func convert(_ reply: UnsafeMutablePointer<redisReply>) -> RedisReply {
        let r = reply.pointee
        func bytes() -> [UInt8] {
            guard let str = r.str, r.len > 0 else { return [] }
            return Array(UnsafeRawBufferPointer(start: str, count: Int(r.len)))
        }
        switch r.type {
        case REDIS_REPLY_STRING: return .string(bytes())
        case REDIS_REPLY_STATUS: return .status(String(decoding: bytes(), as: UTF8.self))
        case REDIS_REPLY_ERROR: return .error(String(decoding: bytes(), as: UTF8.self))
        case REDIS_REPLY_INTEGER: return .integer(r.integer)
        case REDIS_REPLY_ARRAY:
            var items: [RedisReply] = []
            for i in 0..<Int(r.elements) { if let element = r.element[i] { items.append(convert(element)) } }
            return .array(items)
        default: return .null
        }
    }

    private static func errorText(_ context: UnsafeMutablePointer<redisContext>) -> String {
        let text = withUnsafeBytes(of: context.pointee.errstr) { raw in
            String(decoding: raw.prefix { $0 != 0 }, as: UTF8.self)
        }
        return text.isEmpty ? "connection error \(context.pointee.err)" : text
    }
}

/// Commands in the Redis protocol's encoding (RESP: an array of bulk strings each), written
/// straight into one buffer: no copy of each argument on its way to the connection.
struct RESPEncoding {
    private(set) var bytes: [UInt8] = []

    /// One command: its arguments as bytes (`["SET", "k", "v"].lazy.map(\.utf8)`, or `[[UInt8]]`).
    mutating func append<Command: Collection>(_ command: Command) where Command.Element: Collection<UInt8> {
        header(UInt8(ascii: "*"), command.count)
        for argument in command {
            header(UInt8(ascii: "$"), argument.count)
            bytes.append(contentsOf: argument)
            endLine()
        }
    }

    /// `*3\r\n`, `$5\r\n`: a kind and a count in decimal.
    private mutating func header(_ kind: UInt8, _ n: Int) {
        bytes.append(kind)
        var divisor = 1
        while divisor <= n / 10 { divisor *= 10 }
        var rest = n
        while divisor > 0 {
            bytes.append(UInt8(ascii: "0") + UInt8(rest / divisor))
            rest %= divisor
            divisor /= 10
        }
        endLine()
    }

    private mutating func endLine() {
        bytes.append(13)
        bytes.append(10)
    }
}
