import NIOCore
import NIOPosix
import NIOSSL
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

    /// The reply's bytes as sent (bulk string or status): a key or member that is not UTF-8
    /// comes back as it is, where `text` would replace its bytes.
    public var bytes: [UInt8]? {
        switch self {
        case .string(let bytes): bytes
        case .status(let s): Array(s.utf8)
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
/// server may be back soon), false for what the server refused (wrong password, bad database)
/// and for a server whose certificate cannot be trusted.
public struct RedisError: Error, Sendable, CustomStringConvertible {
    public var message: String
    public var isRetryable: Bool

    public init(_ message: String, retryable: Bool) {
        self.message = message
        self.isRetryable = retryable
    }

    public var description: String { message }
}

/// TLS to Redis (`rediss://`): which certificate authorities to trust, and the client's own
/// certificate when the server asks for one. The server's name (or IP address) is always
/// checked against its certificate.
public struct RedisTLSSettings: Sendable, Hashable {
    /// PEM file of the authorities that sign the server's certificate; nil: the system's.
    public var caFile: String?
    /// PEM certificate chain and private key presented to the server (both or neither).
    public var certificateFile: String?
    public var keyFile: String?

    public init(caFile: String? = nil, certificateFile: String? = nil, keyFile: String? = nil) {
        self.caFile = caFile
        self.certificateFile = certificateFile
        self.keyFile = keyFile
    }
}

/// Where the server is and how to sign in.
public struct RedisConnectionSettings: Sendable, Hashable {
    public var host: String
    public var port: Int
    public var database: Int
    public var username: String?
    public var password: String?
    /// TLS settings for `rediss://`; nil for plain TCP.
    public var tls: RedisTLSSettings?
    /// Connections kept open. Default 4.
    public var poolSize: Int
    /// Connect and per-round-trip timeout, seconds. Default 5.
    public var timeout: Double

    public init(host: String, port: Int, database: Int = 0, username: String? = nil, password: String? = nil,
                tls: RedisTLSSettings? = nil, poolSize: Int = 4, timeout: Double = 5) {
        self.host = host
        self.port = port
        self.database = database
        self.username = username
        self.password = password
        self.tls = tls
        self.poolSize = poolSize
        self.timeout = timeout
    }
}

/// A Redis client on SwiftNIO, with TLS by swift-nio-ssl: a pool of connections, each on one
/// event loop. Commands sent together are pipelined (written at once, replies read in order),
/// and so are the requests of concurrent callers: a connection takes every request waiting
/// when its previous round trip is answered and sends them in one write, so under load the
/// steps of many events share one write and one read. A connection that fails is closed and
/// opened again (with AUTH and SELECT) on its next use; the requests it carried report a
/// retryable error and are not repeated here — each caller decides, since only it knows
/// whether a retry is safe.
public final class RedisClient: Sendable {
    public let settings: RedisConnectionSettings
    private let pool: Mutex<Pool>
    /// Built once from the settings' files; nil for plain TCP, or the reason it could not be.
    private let tls: Result<NIOSSLContext, RedisError>?

    struct Request {
        /// Its commands in the protocol's encoding, ready to be written.
        let encoded: [UInt8]
        let count: Int
        let continuation: CheckedContinuation<Result<[RedisReply], RedisError>, Never>
    }

    private struct Pool {
        var idle: [RedisConnection] = []
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
        self.tls = settings.tls.map { Self.context($0, settings) }
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
        // A command Redis does not answer would shift every later reply of a shared round trip
        // onto the wrong caller.
        if commands.contains(where: \.isEmpty) { throw RedisError("an empty Redis command", retryable: false) }
        var encoding = RESPEncoding()
        for command in commands { encoding.append(command) }
        return try await send(encoding.bytes, count: commands.count)
    }

    /// Sends `count` encoded commands in one write and returns their replies.
    private func send(_ encoded: [UInt8], count: Int) async throws(RedisError) -> [RedisReply] {
        let result = await withCheckedContinuation { (continuation: CheckedContinuation<Result<[RedisReply], RedisError>, Never>) in
            enum Start { case closed, queued, drive(RedisConnection) }
            let start = pool.withLock { p -> Start in
                if p.closed { return .closed }
                p.queued.append(Request(encoded: encoded, count: count, continuation: continuation))
                if let connection = p.idle.popLast() { return .drive(connection) }
                if p.created < max(1, settings.poolSize) {
                    p.created += 1
                    return .drive(RedisConnection(on: MultiThreadedEventLoopGroup.singleton.next()))
                }
                return .queued  // a busy connection takes it when it is free
            }
            switch start {
            case .closed: continuation.resume(returning: .failure(Self.closedError))
            case .queued: break
            case .drive(let connection): connection.eventLoop.execute { self.drive(connection) }
            }
        }
        return try result.get()
    }

    deinit { close() }

    private static let closedError = RedisError("the Redis client is closed", retryable: false)

    /// Closes every connection; calls after this fail.
    public func close() {
        let (idle, queued) = pool.withLock { p -> ([RedisConnection], [Request]) in
            p.closed = true
            defer { p.idle = []; p.queued = [] }
            return (p.idle, p.queued)
        }
        for connection in idle { connection.eventLoop.execute { connection.disconnect() } }
        for request in queued { request.continuation.resume(returning: .failure(Self.closedError)) }
    }

    /// On the connection's event loop: sends every waiting request (up to the round-trip bound)
    /// in one write; when all are answered, goes on while requests wait, then returns to the pool.
    private func drive(_ connection: RedisConnection) {
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
        // Each request whose replies were all read has its answer, even when the connection
        // failed later in the round trip; the others get the error.
        // Next round trip from the loop itself, not inside this completion: a run that fails at
        // once (no server) must not nest one drive in another for every request waiting.
        connection.run(batch, settings: settings, tls: tls).whenComplete { _ in
            connection.eventLoop.execute { self.drive(connection) }
        }
    }

    /// Why the TLS settings' files cannot be used (not PEM, a key that does not match), or nil:
    /// for configuration to refuse them, rather than every step fail once running.
    public static func tlsProblem(_ settings: RedisConnectionSettings) -> String? {
        guard let tls = settings.tls, case .failure(let error) = context(tls, settings) else { return nil }
        return error.message
    }

    /// The TLS context for the settings' files, or why it cannot be made (named, not retryable:
    /// a missing or unreadable file does not heal by itself).
    private static func context(_ tls: RedisTLSSettings, _ settings: RedisConnectionSettings) -> Result<NIOSSLContext, RedisError> {
        var configuration = TLSConfiguration.makeClientConfiguration()
        configuration.minimumTLSVersion = .tlsv12
        // A failed connection is closed at once: not kept open waiting for the peer's close_notify.
        configuration.shutdownTimeout = .milliseconds(500)
        var file = ""
        do {
            if let ca = tls.caFile {
                file = ca
                configuration.trustRoots = .certificates(try NIOSSLCertificate.fromPEMFile(ca))
            }
            if let certificate = tls.certificateFile {
                file = certificate
                configuration.certificateChain = try NIOSSLCertificate.fromPEMFile(certificate).map { .certificate($0) }
            }
            if let key = tls.keyFile {
                file = key
                configuration.privateKey = .privateKey(try NIOSSLPrivateKey(file: key, format: .pem))
            }
            file = ""
            return .success(try NIOSSLContext(configuration: configuration))
        } catch {
            let what = file.isEmpty ? "cannot set up TLS" : "cannot read \(file)"
            return .failure(RedisError("Redis at \(settings.host):\(settings.port): \(what): \(error)", retryable: false))
        }
    }
}

extension RedisReply {
    /// For an error reply: whether the server may take the same command later (`LOADING`,
    /// `BUSY`, `TRYAGAIN`, `MASTERDOWN`, `CLUSTERDOWN`) rather than refuse it again
    /// (`WRONGTYPE`, `NOPERM`, …). The one classification every Redis caller uses.
    /// `READONLY` (a replica after a failover: the connection is replaced too, so a new one
    /// reaches the new primary) and `NOREPLICAS`, `MISCONF` are passing states as well, as is
    /// `OOM` (a server at `maxmemory` that does not evict takes writes again once keys expire
    /// or are deleted).
    public var isTransientError: Bool {
        guard case .error(let message) = self else { return false }
        return Self.transientErrors.contains(message.prefix { $0 != " " })
    }

    static let transientErrors: Set<Substring> = ["LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN", "READONLY",
                                                  "NOREPLICAS", "MISCONF", "OOM"]
}

/// One connection, opened lazily and reopened after a failure.
///
/// `@unchecked Sendable`: its mutable state (`channel`, `handler`) is only touched on its own
/// `eventLoop`, and the pool hands it to one driver at a time under the pool's lock.
final class RedisConnection: @unchecked Sendable {
    let eventLoop: any EventLoop
    private var channel: (any Channel)?
    private var handler: RedisReplyHandler?

    init(on eventLoop: any EventLoop) {
        self.eventLoop = eventLoop
    }

    func disconnect() {
        eventLoop.assertInEventLoop()
        channel?.close(promise: nil)
        channel = nil
        handler = nil
    }

    /// Writes the requests' commands at once and answers each request as its replies arrive.
    /// The future completes when every request is answered.
    func run(_ batch: [RedisClient.Request], settings: RedisConnectionSettings,
             tls: Result<NIOSSLContext, RedisError>?) -> EventLoopFuture<Void> {
        eventLoop.assertInEventLoop()
        return connected(settings, tls: tls).flatMap { (channel, handler) -> EventLoopFuture<Void> in
            let answered = batch.map { request in
                let promise = self.eventLoop.makePromise(of: [RedisReply].self)
                promise.futureResult.whenComplete { result in
                    request.continuation.resume(returning: result.mapError { $0 as? RedisError ?? RedisError("Redis: \($0)", retryable: true) })
                }
                return (count: request.count, promise: promise)
            }
            self.write(batch.lazy.map(\.encoded), answered, on: channel, handler, settings: settings)
            return EventLoopFuture.andAllComplete(answered.map(\.promise.futureResult), on: self.eventLoop)
        }.flatMapErrorWithEventLoop { error, eventLoop in
            let failure = error as? RedisError ?? RedisError("Redis: \(error)", retryable: true)
            for request in batch { request.continuation.resume(returning: .failure(failure)) }
            return eventLoop.makeSucceededVoidFuture()
        }
    }

    /// Writes encoded commands in one flush, expecting replies for each promise in turn. The
    /// handler fails them all and closes the connection when no reply has come for the timeout.
    private func write(_ parts: some Collection<[UInt8]>, _ expected: [(count: Int, promise: EventLoopPromise<[RedisReply]>)],
                       on channel: any Channel, _ handler: RedisReplyHandler, settings: RedisConnectionSettings) {
        var buffer = channel.allocator.buffer(capacity: parts.reduce(0) { $0 + $1.count })
        for part in parts { buffer.writeBytes(part) }
        for (count, promise) in expected { handler.expect(count, promise) }
        channel.writeAndFlush(buffer).whenFailure { _ in channel.close(promise: nil) }
    }

    /// This connection's channel, connecting (and signing in) first when it has none.
    private func connected(_ settings: RedisConnectionSettings, tls: Result<NIOSSLContext, RedisError>?)
        -> EventLoopFuture<(any Channel, RedisReplyHandler)>
    {
        if let channel, let handler, channel.isActive, handler.isUsable { return eventLoop.makeSucceededFuture((channel, handler)) }
        disconnect()
        let context: NIOSSLContext?
        switch tls {
        case nil: context = nil
        case .success(let c)?: context = c
        case .failure(let error)?: return eventLoop.makeFailedFuture(error)
        }
        let endpoint = "\(settings.host):\(settings.port)"
        let handler = RedisReplyHandler(endpoint: endpoint, timeout: Self.timeAmount(settings.timeout))
        let serverName = context == nil || Self.isIPAddress(settings.host) ? nil : settings.host
        let timeout = Self.timeAmount(settings.timeout)
        let bootstrap = ClientBootstrap(group: eventLoop)
            .connectTimeout(timeout)
            .channelOption(.socketOption(.tcp_nodelay), value: 1)
            .channelOption(.socketOption(.so_keepalive), value: 1)
            .channelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    if let context {
                        try channel.pipeline.syncOperations.addHandler(NIOSSLClientHandler(context: context, serverHostname: serverName))
                    }
                    try channel.pipeline.syncOperations.addHandler(ByteToMessageHandler(RESPDecoder(),
                                                                                        maximumBufferSize: RESPDecoder.maximumBuffer))
                    try channel.pipeline.syncOperations.addHandler(handler)
                }
            }
        return bootstrap.connect(host: settings.host, port: settings.port).flatMapErrorThrowing { error in
            throw RedisError("cannot connect to Redis at \(endpoint): \(error)", retryable: true)
        }.flatMap { channel in
            self.channel = channel
            self.handler = handler
            return self.signIn(channel, handler, settings).map { (channel, handler) }
        }
    }

    /// AUTH and SELECT, when the settings ask for them; a refusal is not retryable.
    private func signIn(_ channel: any Channel, _ handler: RedisReplyHandler, _ settings: RedisConnectionSettings)
        -> EventLoopFuture<Void>
    {
        var setup = RESPEncoding(), named: [String] = []
        if let password = settings.password {
            setup.append((settings.username.map { ["AUTH", $0, password] } ?? ["AUTH", password]).lazy.map(\.utf8))
            named.append("AUTH")
        }
        if settings.database != 0 {
            setup.append(["SELECT", String(settings.database)].lazy.map(\.utf8))
            named.append("SELECT \(settings.database)")
        }
        // Without AUTH or SELECT, a PING: what a server says on accepting (over maxclients,
        // protected mode) must answer setup, never a caller's command.
        if named.isEmpty {
            setup.append(["PING"].lazy.map(\.utf8))
            named.append("PING")
        }
        let steps = named
        let promise = eventLoop.makePromise(of: [RedisReply].self)
        write(CollectionOfOne(setup.bytes), [(steps.count, promise)], on: channel, handler, settings: settings)
        return promise.futureResult.flatMapThrowing { replies in
            for (step, reply) in zip(steps, replies) {
                if case .error(let message) = reply {
                    self.disconnect()
                    // Never echo the password: say which step failed and the server's words (cut
                    // short: a proxy could say more than Redis does). Only a refusal of the
                    // credentials or the database is permanent; "max number of clients" passes.
                    let permanent = Self.permanentSetupRefusals.contains { message.hasPrefix($0) }
                    throw RedisError("Redis at \(settings.host):\(settings.port) refused \(step): \(message.prefix(120))",
                                     retryable: !permanent)
                }
            }
        }
    }

    static let permanentSetupRefusals = ["WRONGPASS", "NOAUTH", "NOPERM", "ERR invalid password", "ERR AUTH",
                                         "ERR DB index is out of range", "ERR invalid DB index", "ERR SELECT is not allowed"]

    /// Seconds as NIO's time, saturating (a configured `200000d` must not trap).
    static func timeAmount(_ seconds: Double) -> TimeAmount {
        .nanoseconds(Int64(min(max(seconds, 0.001), 1e9) * 1e9))
    }

    private static func isIPAddress(_ host: String) -> Bool {
        (try? SocketAddress(ipAddress: host, port: 0)) != nil
    }
}

/// Matches replies to the requests written, in order, and fails every request still waiting
/// when the connection ends — with the reason it ended (a TLS failure, a timeout, a malformed
/// reply) when one is known. The deadline restarts with every read that brings replies (once a
/// read, not once a reply: a pipelined round trip's read holds hundreds): a long round trip that
/// makes progress is not cut; one with no reply for the timeout fails at once, without waiting
/// for the connection's close (TLS waits for the peer's close_notify).
///
/// `@unchecked Sendable`: every method runs on its channel's event loop (the channel calls it
/// there, and the connection that owns it only runs there); its deadline is scheduled on that
/// loop. It is never used from another thread.
final class RedisReplyHandler: ChannelInboundHandler, RemovableChannelHandler, @unchecked Sendable {
    typealias InboundIn = RedisReply

    private let endpoint: String
    private let timeout: TimeAmount
    private var waiting = CircularBuffer<(remaining: Int, replies: [RedisReply], promise: EventLoopPromise<[RedisReply]>)>()
    private var failure: RedisError?
    private var context: ChannelHandlerContext?
    private var deadline: Scheduled<Void>?
    /// A reply came in the read under way (the deadline restarts when it completes).
    private var replied = false
    /// A reply said this server no longer takes writes (`READONLY`): the next round trip
    /// opens a new connection, which reaches the new primary.
    private var replace = false

    init(endpoint: String, timeout: TimeAmount) {
        self.endpoint = endpoint
        self.timeout = timeout
    }

    /// Whether a new round trip may use this connection.
    var isUsable: Bool { failure == nil && !replace }

    func handlerAdded(context: ChannelHandlerContext) { self.context = context }
    func handlerRemoved(context: ChannelHandlerContext) {
        deadline?.cancel()
        self.context = nil
    }

    func expect(_ count: Int, _ promise: EventLoopPromise<[RedisReply]>) {
        if let failure {
            promise.fail(failure)
            return
        }
        var replies: [RedisReply] = []
        replies.reserveCapacity(count)
        waiting.append((count, replies, promise))
        if deadline == nil { restartDeadline() }
    }

    private func restartDeadline() {
        deadline?.cancel()
        deadline = nil
        guard !waiting.isEmpty, let context else { return }
        let seconds = Double(timeout.nanoseconds) / 1e9
        deadline = context.eventLoop.scheduleTask(in: timeout) { [self] in
            deadline = nil
            guard let context = self.context else { return }
            fail(RedisError("Redis at \(endpoint): no reply within \(seconds) s", retryable: true), context: context)
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let reply = unwrapInboundIn(data)
        guard !waiting.isEmpty else {
            fail(RedisError("Redis at \(endpoint) sent a reply nobody asked for", retryable: true), context: context)
            return
        }
        if case .error(let message) = reply, message.hasPrefix("READONLY") { replace = true }
        waiting[waiting.startIndex].replies.append(reply)
        waiting[waiting.startIndex].remaining -= 1
        if waiting[waiting.startIndex].remaining == 0 {
            let done = waiting.removeFirst()
            done.promise.succeed(done.replies)
        }
        replied = true
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        if replied {
            replied = false
            restartDeadline()
        }
        context.fireChannelReadComplete()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        fail(Self.describe(error, endpoint: endpoint), context: context)
    }

    func channelInactive(context: ChannelHandlerContext) {
        failAll(failure ?? RedisError("Redis at \(endpoint) closed the connection", retryable: true))
        context.fireChannelInactive()
    }

    /// Fails every waiting request now and closes the connection.
    private func fail(_ error: RedisError, context: ChannelHandlerContext) {
        failAll(failure ?? error)
        context.close(promise: nil)
    }

    private func failAll(_ error: RedisError) {
        failure = error
        deadline?.cancel()
        deadline = nil
        while let next = waiting.popFirst() { next.promise.fail(error) }
    }

    /// A failure in words an operator can act on. A certificate that cannot be verified, is for
    /// another name, or a TLS handshake refused (a plain port, a client certificate the server
    /// does not take) is not retryable: it needs a change of configuration, certificate or clock.
    static func describe(_ error: any Error, endpoint: String) -> RedisError {
        switch error {
        case let error as RedisError:
            return error
        case let error as NIOSSLExtraError where error == .failedToValidateHostname:
            return RedisError("TLS to Redis at \(endpoint): the server's certificate is not for that name (\(error))", retryable: false)
        case let error as NIOSSLExtraError:
            return RedisError("TLS to Redis at \(endpoint): \(error)", retryable: false)
        case let NIOSSLError.handshakeFailed(reason):
            let text = "\(reason)"
            let unverified = text.contains("CERTIFICATE_VERIFY_FAILED")
            return RedisError("TLS handshake with Redis at \(endpoint) failed: "
                              + (unverified ? "its certificate could not be verified (not signed by a trusted authority, expired or "
                                 + "not yet valid: check ca-file and the clock): " : "")
                              + text, retryable: false)
        case is BoringSSLError:
            return RedisError("TLS to Redis at \(endpoint) refused: \(error)", retryable: false)
        case is NIOSSLError:
            return RedisError("TLS to Redis at \(endpoint): \(error)", retryable: true)
        case let error as RESPDecoder.MalformedReply:
            return RedisError("Redis at \(endpoint) sent a malformed reply: \(error.reason)", retryable: true)
        case is ByteToMessageDecoderError.PayloadTooLargeError:
            return RedisError("Redis at \(endpoint) sent a reply over \(RESPDecoder.maximumBuffer) bytes", retryable: false)
        default:
            return RedisError("Redis at \(endpoint): \(error)", retryable: true)
        }
    }
}

/// Reads RESP2 replies (`+`, `-`, `:`, `$`, `*`) from the byte stream. An incomplete reply waits
/// for more bytes; a malformed one (unknown kind, a header line over 64 KiB, nesting deeper than
/// 32, a bulk string not ended by CRLF) ends the connection.
struct RESPDecoder: ByteToMessageDecoder {
    typealias InboundOut = RedisReply

    struct MalformedReply: Error {
        var reason: String
    }

    static let maximumLine = 65_536
    static let maximumDepth = 32
    /// Redis's own limit on one bulk string (`proto-max-bulk-len`).
    static let maximumBulk = 512 * 1024 * 1024
    /// Most bytes one reply may take while it arrives.
    static let maximumBuffer = maximumBulk + 1024 * 1024
    static let maximumElements = 16 * 1024 * 1024

    mutating func decode(context: ChannelHandlerContext, buffer: inout ByteBuffer) throws -> DecodingState {
        var view = buffer
        guard let reply = try Self.parse(&view, depth: 0) else { return .needMoreData }
        buffer.moveReaderIndex(to: view.readerIndex)
        context.fireChannelRead(Self.wrapInboundOut(reply))
        return .continue
    }

    mutating func decodeLast(context: ChannelHandlerContext, buffer: inout ByteBuffer, seenEOF: Bool) throws -> DecodingState {
        while try decode(context: context, buffer: &buffer) == .continue {}
        return .needMoreData
    }

    /// One whole reply from the front of `buffer`, or nil when its bytes are not all there yet.
    static func parse(_ buffer: inout ByteBuffer, depth: Int) throws(MalformedReply) -> RedisReply? {
        guard depth <= maximumDepth else { throw MalformedReply(reason: "arrays nested deeper than \(maximumDepth)") }
        guard let kind = buffer.getInteger(at: buffer.readerIndex, as: UInt8.self) else { return nil }
        guard let line = try line(&buffer) else { return nil }
        switch kind {
        case UInt8(ascii: "+"): return .status(line)
        case UInt8(ascii: "-"): return .error(line)
        case UInt8(ascii: ":"):
            guard let n = Int64(line) else { throw MalformedReply(reason: "integer \"\(line.prefix(32))\"") }
            return .integer(n)
        case UInt8(ascii: "$"):
            guard let length = Int(line), length >= -1, length <= maximumBulk else {
                throw MalformedReply(reason: "bulk length \"\(line.prefix(32))\"")
            }
            if length == -1 { return .null }
            guard buffer.readableBytes - 2 >= length else { return nil }
            let bytes = buffer.readBytes(length: length)!
            guard buffer.readInteger(as: UInt16.self) == 0x0D0A else { throw MalformedReply(reason: "bulk string not ended by CRLF") }
            return .string(bytes)
        case UInt8(ascii: "*"):
            guard let count = Int(line), count >= -1, count <= maximumElements else {
                throw MalformedReply(reason: "array length \"\(line.prefix(32))\"")
            }
            if count == -1 { return .null }
            var items: [RedisReply] = []
            items.reserveCapacity(min(count, 1024))
            for _ in 0..<count {
                guard let item = try parse(&buffer, depth: depth + 1) else { return nil }
                items.append(item)
            }
            return .array(items)
        default:
            throw MalformedReply(reason: "unknown reply type byte \(kind)")
        }
    }

    /// The header line after the type byte, without its CRLF; nil when the CRLF has not arrived.
    private static func line(_ buffer: inout ByteBuffer) throws(MalformedReply) -> String? {
        let view = buffer.readableBytesView
        guard let cr = view.dropFirst().firstIndex(of: 0x0D) else {
            if view.count > maximumLine { throw MalformedReply(reason: "a header line longer than \(maximumLine) bytes") }
            return nil
        }
        guard cr - view.startIndex <= maximumLine else { throw MalformedReply(reason: "a header line longer than \(maximumLine) bytes") }
        guard cr + 1 < view.endIndex else { return nil }
        guard view[cr + 1] == 0x0A else { throw MalformedReply(reason: "CR not followed by LF") }
        let text = String(decoding: view[(view.startIndex + 1)..<cr], as: UTF8.self)
        buffer.moveReaderIndex(forwardBy: cr - view.startIndex + 2)
        return text
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
