internal import CRdkafka
import Foundation
public import Logging
import Synchronization

/// Where a produced message landed.
public struct DeliveryReport: Sendable {
    public var partition: Int32
    public var offset: Int64
}

/// Produces messages and reports each one's delivery. `send` returns once the broker has the
/// message (acks=all by default) or delivery failed for good.
public final class KafkaProducer: Sendable {
    private let client: KafkaClient
    private let logger: Logger
    private let loop = PollLoopState()

    public init(bootstrapServers: String, properties: KafkaProperties = [:], logger: Logger) throws(KafkaError) {
        let p = Self.effectiveProperties(bootstrapServers: bootstrapServers, properties)
        self.client = try KafkaClient(role: .producer, properties: p, context: CallbackContext(logger: logger, consumer: nil)) { conf in
            rd_kafka_conf_set_dr_msg_cb(conf, deliveryCallback)
        }
        self.logger = logger
        // Delivery reports are served by polling; a thread of its own keeps that off the pool.
        // The error callback that records a fatal error runs here too: whoever waits on
        // `failure()` hears of it at once.
        let thread = Thread { [client, loop] in
            while loop.running.withLock({ $0 }) {
                rd_kafka_poll(client.handle, 100)
                if let fatal = client.fatalError { loop.ended.end(fatal) }
            }
            loop.ended.end(nil)
            loop.stopped.signal()
        }
        thread.name = "warden-kafka-producer"
        thread.start()
    }

    /// What the producer is made with: Warden's settings, and the given properties but the
    /// consumer's.
    static func effectiveProperties(bootstrapServers: String, _ properties: KafkaProperties) -> KafkaProperties {
        var p: KafkaProperties = [
            "bootstrap.servers": bootstrapServers,
            "acks": "all",
            "enable.idempotence": "true",
            "linger.ms": "5",
        ]
        for (name, value) in properties.values where !isConsumerOnly(name) { p[name] = value }
        return p
    }

    /// Consumer properties in a shared `properties` map are left out of the producer's (librdkafka
    /// would warn about each).
    static func isConsumerOnly(_ name: String) -> Bool {
        name.hasPrefix("group.") || name.hasPrefix("fetch.") || name.hasPrefix("auto.") || name.hasPrefix("enable.auto.")
            || ["session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy", "max.poll.interval.ms",
                "isolation.level", "enable.partition.eof", "check.crcs", "queued.min.messages", "queued.max.messages.kbytes",
                "coordinator.query.interval.ms", "offset.store.method", "consume.callback.max.messages"].contains(name)
    }

    /// Sends one message and waits for its delivery report.
    public func send(topic: String, key: [UInt8]? = nil, value: [UInt8], headers: [KafkaHeader] = []) async throws(KafkaError) -> DeliveryReport {
        if let fatal = client.fatalError { throw KafkaError(.fatal, "Kafka producer failed: \(fatal)") }
        guard loop.running.withLock({ $0 }) else { throw KafkaError(.closed, "the Kafka producer is closed") }
        let result: Result<DeliveryReport, KafkaError> = await withCheckedContinuation { continuation in
            let box = Unmanaged.passRetained(DeliveryBox { continuation.resume(returning: $0) })
            let err = produce(topic: topic, key: key, value: value, headers: headers, opaque: box.toOpaque())
            if err != RD_KAFKA_RESP_ERR_NO_ERROR {
                box.release()
                continuation.resume(returning: .failure(KafkaError.code(err, "cannot produce to \(topic)")))
            }
        }
        return try result.get()
    }

    /// A message for `send(all:)`.
    public struct Outgoing: Sendable {
        public var topic: String
        public var key: [UInt8]?
        public var value: [UInt8]
        public var headers: [KafkaHeader]

        public init(topic: String, key: [UInt8]?, value: [UInt8], headers: [KafkaHeader] = []) {
            self.topic = topic
            self.key = key
            self.value = value
            self.headers = headers
        }
    }

    /// Sends messages in their order (one partition keeps it) and waits for every delivery
    /// report: all in flight at once, so a cluster that cannot be reached costs one delivery
    /// timeout for all of them, not one each.
    public func send(all messages: [Outgoing]) async -> [Result<DeliveryReport, KafkaError>] {
        guard !messages.isEmpty else { return [] }
        if let fatal = client.fatalError { return messages.map { _ in .failure(KafkaError(.fatal, "Kafka producer failed: \(fatal)")) } }
        guard loop.running.withLock({ $0 }) else { return messages.map { _ in .failure(KafkaError(.closed, "the Kafka producer is closed")) } }
        return await withCheckedContinuation { continuation in
            let reports = DeliveryReports(count: messages.count) { continuation.resume(returning: $0) }
            for (i, message) in messages.enumerated() {
                let box = Unmanaged.passRetained(DeliveryBox { reports.deliver(i, $0) })
                let err = produce(topic: message.topic, key: message.key, value: message.value, headers: message.headers, opaque: box.toOpaque())
                if err != RD_KAFKA_RESP_ERR_NO_ERROR {
                    box.release()
                    reports.deliver(i, .failure(KafkaError.code(err, "cannot produce to \(message.topic)")))
                }
            }
        }
    }

    private func produce(topic: String, key: [UInt8]?, value: [UInt8], headers: [KafkaHeader],
                         opaque: UnsafeMutableRawPointer) -> rd_kafka_resp_err_t {
        let hdrs = rd_kafka_headers_new(headers.count)!
        for header in headers {
            if let v = header.value {
                v.withUnsafeBytes { _ = rd_kafka_header_add(hdrs, header.name, -1, $0.baseAddress, $0.count) }
            } else {
                _ = rd_kafka_header_add(hdrs, header.name, -1, nil, 0)
            }
        }
        return topic.withCString { topicName in
            value.withUnsafeBytes { valueBytes in
                (key ?? []).withUnsafeBytes { keyBytes in
                    var vus = [rd_kafka_vu_t](repeating: rd_kafka_vu_t(), count: 5)
                    vus[0].vtype = RD_KAFKA_VTYPE_TOPIC
                    vus[0].u.cstr = topicName
                    vus[1].vtype = RD_KAFKA_VTYPE_VALUE
                    vus[1].u.mem.ptr = UnsafeMutableRawPointer(mutating: valueBytes.baseAddress)
                    vus[1].u.mem.size = valueBytes.count
                    vus[2].vtype = RD_KAFKA_VTYPE_MSGFLAGS
                    vus[2].u.i = RD_KAFKA_MSG_F_COPY
                    vus[3].vtype = RD_KAFKA_VTYPE_OPAQUE
                    vus[3].u.ptr = opaque
                    vus[4].vtype = RD_KAFKA_VTYPE_HEADERS
                    vus[4].u.headers = hdrs
                    if key != nil {
                        var k = rd_kafka_vu_t()
                        k.vtype = RD_KAFKA_VTYPE_KEY
                        k.u.mem.ptr = UnsafeMutableRawPointer(mutating: keyBytes.baseAddress)
                        k.u.mem.size = keyBytes.count
                        vus.append(k)
                    }
                    let error = vus.withUnsafeBufferPointer { rd_kafka_produceva(client.handle, $0.baseAddress, $0.count) }
                    guard let error else { return RD_KAFKA_RESP_ERR_NO_ERROR }
                    // On failure the headers are still ours.
                    rd_kafka_headers_destroy(hdrs)
                    let code = rd_kafka_error_code(error)
                    rd_kafka_error_destroy(error)
                    return code
                }
            }
        }
    }

    /// The fatal error librdkafka reported, if any: the producer cannot send again, and a fresh
    /// process (a fresh producer) is what mends it.
    public var fatalError: String? { client.fatalError }

    /// Waits until the producer fails fatally (its reason) or is closed, or the task is
    /// cancelled (nil).
    public func failure() async -> String? { await loop.ended.wait() }

    /// Makes librdkafka report a fatal error, as an idempotent producer does when the cluster
    /// lost its sequence (for tests of what follows).
    package func failFatally(_ reason: String) {
        _ = rd_kafka_test_fatal_error(client.handle, RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER, reason)
    }

    /// Waits up to `timeout` seconds for outstanding deliveries, then stops the poll thread.
    public func close(timeout: Double = 10) {
        let err = rd_kafka_flush(client.handle, Int32(timeout * 1000))
        if err != RD_KAFKA_RESP_ERR_NO_ERROR {
            logger.warning("Kafka producer closed with messages undelivered", metadata: ["kafka.outstanding": "\(rd_kafka_outq_len(client.handle))"])
        }
        let wasRunning = loop.running.withLock { running -> Bool in
            defer { running = false }
            return running
        }
        if wasRunning { loop.stopped.wait() }
    }
}

/// Whether the delivery-report thread should go on, and its exit.
final class PollLoopState: Sendable {
    let running = Mutex(true)
    let stopped = DispatchSemaphore(value: 0)
    let ended = EndSignal()
}

/// Ends once, with a reason or none; waiters hear the end, or nil if cancelled first.
final class EndSignal: Sendable {
    private struct State {
        var ended: String?? = nil
        var waiters: [Int: CheckedContinuation<String?, Never>] = [:]
        var next = 0
    }
    private let state = Mutex(State())

    func end(_ reason: String?) {
        let waiters = state.withLock { s -> [CheckedContinuation<String?, Never>] in
            guard s.ended == nil else { return [] }
            s.ended = .some(reason)
            defer { s.waiters = [:] }
            return Array(s.waiters.values)
        }
        for waiter in waiters { waiter.resume(returning: reason) }
    }

    func wait() async -> String? {
        let id = state.withLock { s -> Int in
            defer { s.next += 1 }
            return s.next
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<String?, Never>) in
                let resume: String?? = state.withLock { s in
                    if let ended = s.ended { return .some(ended) }
                    if Task.isCancelled { return .some(nil) }
                    s.waiters[id] = continuation
                    return nil
                }
                if let resume { continuation.resume(returning: resume) }
            }
        } onCancel: {
            let waiter = state.withLock { $0.waiters.removeValue(forKey: id) }
            waiter?.resume(returning: nil)
        }
    }
}

/// Carries a `send` continuation through librdkafka's `msg_opaque`.
/// What a delivery report is handed to (the message's opaque pointer in librdkafka).
final class DeliveryBox: Sendable {
    let deliver: @Sendable (Result<DeliveryReport, KafkaError>) -> Void
    init(_ deliver: @escaping @Sendable (Result<DeliveryReport, KafkaError>) -> Void) { self.deliver = deliver }
}

/// The reports of several messages sent together; `done` hears them all once the last is in.
final class DeliveryReports: Sendable {
    private let state: Mutex<(results: [Result<DeliveryReport, KafkaError>?], left: Int)>
    private let done: @Sendable ([Result<DeliveryReport, KafkaError>]) -> Void

    init(count: Int, done: @escaping @Sendable ([Result<DeliveryReport, KafkaError>]) -> Void) {
        state = Mutex((Array(repeating: nil, count: count), count))
        self.done = done
    }

    func deliver(_ index: Int, _ result: Result<DeliveryReport, KafkaError>) {
        let all = state.withLock { s -> [Result<DeliveryReport, KafkaError>]? in
            guard s.results[index] == nil else { return nil }
            s.results[index] = result
            s.left -= 1
            return s.left == 0 ? s.results.map { $0! } : nil
        }
        if let all { done(all) }
    }
}

private let deliveryCallback: @convention(c) (OpaquePointer?, UnsafePointer<rd_kafka_message_t>?, UnsafeMutableRawPointer?) -> Void = {
    _, message, _ in
    guard let message, let opaque = message.pointee._private else { return }
    let box = Unmanaged<DeliveryBox>.fromOpaque(opaque).takeRetainedValue()
    let m = message.pointee
    if m.err == RD_KAFKA_RESP_ERR_NO_ERROR {
        box.deliver(.success(DeliveryReport(partition: m.partition, offset: m.offset)))
    } else {
        box.deliver(.failure(KafkaError.code(m.err, "delivery failed", kind: .delivery)))
    }
}
