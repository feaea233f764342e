internal import CRdkafka
import Logging
import Synchronization

/// What librdkafka's callbacks need, reached through the handle's opaque pointer (C callbacks
/// cannot capture). Owned by the `KafkaClient`; lives as long as the handle.
final class CallbackContext: Sendable {
    let logger: Logger
    /// Set once librdkafka reports a fatal error.
    let fatal = Mutex<String?>(nil)
    /// Consumer only: offset bookkeeping and rebalance handling.
    let consumer: ConsumerState?
    /// Producer only: delivery reports come back through `msg_opaque`; nothing to hold here.

    init(logger: Logger, consumer: ConsumerState?) {
        self.logger = logger
        self.consumer = consumer
    }

    static func from(_ rk: OpaquePointer?) -> CallbackContext? {
        guard let rk, let opaque = rd_kafka_opaque(rk) else { return nil }
        return Unmanaged<CallbackContext>.fromOpaque(opaque).takeUnretainedValue()
    }
}

/// A librdkafka client handle (`rd_kafka_t *`) with its callbacks wired to swift-log.
///
/// `@unchecked Sendable`: librdkafka documents its handle as safe to use from several threads
/// for the calls made here (poll, commit, produce, assignment queries). The pointer is
/// destroyed exactly once, in `deinit`, when no other reference to this object exists.
final class KafkaClient: @unchecked Sendable {
    let handle: OpaquePointer
    let context: CallbackContext
    private let retainedContext: Unmanaged<CallbackContext>

    enum Role { case producer, consumer }

    init(role: Role, properties: KafkaProperties, context: CallbackContext,
         configure: (OpaquePointer) -> Void = { _ in }) throws(KafkaError) {
        let conf = try properties.makeConfiguration()
        let retained = Unmanaged.passRetained(context)
        rd_kafka_conf_set_opaque(conf, retained.toOpaque())
        rd_kafka_conf_set_log_cb(conf, kafkaLogCallback)
        rd_kafka_conf_set_error_cb(conf, kafkaErrorCallback)
        configure(conf)
        var errstr = [CChar](repeating: 0, count: 512)
        guard let rk = rd_kafka_new(role == .producer ? RD_KAFKA_PRODUCER : RD_KAFKA_CONSUMER, conf, &errstr, errstr.count) else {
            // rd_kafka_new destroys nothing on failure: the configuration is still ours.
            rd_kafka_conf_destroy(conf)
            retained.release()
            let reason = String(decoding: errstr.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
            throw KafkaError(.client, "cannot create the Kafka client: \(reason)")
        }
        self.handle = rk
        self.context = context
        self.retainedContext = retained
    }

    /// Set when destroying the handle could abort the process (see `leaveUndestroyed`).
    private let undestroyed = Atomic<Bool>(false)

    /// Keeps `deinit` from destroying the handle: for a consumer closed before its first
    /// assignment, which librdkafka 2.0.2 cannot destroy. Its memory goes with the process.
    func leaveUndestroyed() { undestroyed.store(true, ordering: .relaxed) }

    deinit {
        guard !undestroyed.load(ordering: .relaxed) else { return }
        rd_kafka_destroy(handle)
        retainedContext.release()
    }

    /// The fatal error librdkafka reported, if any: as its error callback recorded it, or asked
    /// of librdkafka itself, which marks the client failed (and refuses calls) before that
    /// callback has run.
    var fatalError: String? { context.fatal.withLock { $0 } ?? fatalErrorText(handle) }
}

/// librdkafka's log lines, at the matching swift-log level (syslog levels 0–7).
private let kafkaLogCallback: @convention(c) (OpaquePointer?, Int32, UnsafePointer<CChar>?, UnsafePointer<CChar>?) -> Void = {
    rk, level, facility, text in
    guard let context = CallbackContext.from(rk) else { return }
    let swiftLevel: Logger.Level
    switch level {
    case ...3: swiftLevel = .error
    case 4: swiftLevel = .warning
    case 5, 6: swiftLevel = .info
    default: swiftLevel = .debug
    }
    context.logger.log(level: swiftLevel, "\(text.map { String(cString: $0) } ?? "")",
                       metadata: ["kafka.facility": "\(facility.map { String(cString: $0) } ?? "")"])
}

/// The fatal error librdkafka holds for the client, as "NAME: reason"; nil while it has none.
private func fatalErrorText(_ rk: OpaquePointer) -> String? {
    var buffer = [CChar](repeating: 0, count: 512)
    let original = rd_kafka_fatal_error(rk, &buffer, buffer.count)
    guard original != RD_KAFKA_RESP_ERR_NO_ERROR else { return nil }
    return "\(String(cString: rd_kafka_err2name(original))): \(String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self))"
}

/// Client-level errors. Most are transient (librdkafka retries by itself) and are logged; a
/// fatal error is recorded so the owner stops.
private let kafkaErrorCallback: @convention(c) (OpaquePointer?, Int32, UnsafePointer<CChar>?, UnsafeMutableRawPointer?) -> Void = {
    rk, err, reason, _ in
    guard let context = CallbackContext.from(rk) else { return }
    let text = reason.map { String(cString: $0) } ?? ""
    let code = rd_kafka_resp_err_t(err)
    if code == RD_KAFKA_RESP_ERR__FATAL, let rk {
        let message = fatalErrorText(rk) ?? text
        context.fatal.withLock { if $0 == nil { $0 = message } }
        context.logger.critical("Kafka client failed fatally", metadata: ["kafka.error": "\(message)"])
    } else {
        context.logger.warning("Kafka client error", metadata: [
            "kafka.error": "\(String(cString: rd_kafka_err2name(code)))", "kafka.reason": "\(text)",
        ])
    }
}
