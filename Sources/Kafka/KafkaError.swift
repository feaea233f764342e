internal import CRdkafka

/// A librdkafka failure: the error's name and librdkafka's own words.
public struct KafkaError: Error, Sendable, CustomStringConvertible {
    public enum Kind: Sendable, Equatable {
        /// A configuration property was refused (unknown name or bad value).
        case configuration
        /// The client could not be created or a call failed.
        case client
        /// librdkafka reported a fatal error; the client cannot continue.
        case fatal
        /// A message could not be delivered.
        case delivery
        /// The client is closed.
        case closed
    }

    public var kind: Kind
    public var message: String
    /// librdkafka's error name (`MSG_SIZE_TOO_LARGE`, `_MSG_TIMED_OUT`, …) when it gave one.
    public var name: String?

    public init(_ kind: Kind, _ message: String, name: String? = nil) {
        self.kind = kind
        self.message = message
        self.name = name
    }

    public var description: String { message }

    /// Whether the same call may succeed later. A message the cluster can never take (too
    /// large, malformed, refused by authorisation), a refused configuration, a fatal error
    /// or a closed client will fail the same way however often it is tried.
    public var isRetryable: Bool {
        switch kind {
        case .configuration, .fatal, .closed: return false
        case .client, .delivery: return name.map { !Self.permanentErrors.contains($0) } ?? true
        }
    }

    /// The message is larger than the cluster or the client accepts.
    public var isMessageTooLarge: Bool { name == "MSG_SIZE_TOO_LARGE" || name == "INVALID_MSG_SIZE" || name == "RECORD_LIST_TOO_LARGE" }

    static let permanentErrors: Set<String> = [
        "MSG_SIZE_TOO_LARGE", "INVALID_MSG_SIZE", "RECORD_LIST_TOO_LARGE", "INVALID_MSG", "INVALID_RECORD",
        "TOPIC_AUTHORIZATION_FAILED", "CLUSTER_AUTHORIZATION_FAILED", "TOPIC_EXCEPTION", "_INVALID_ARG", "_UNKNOWN_TOPIC",
        "UNKNOWN_TOPIC_OR_PART", "INVALID_REQUIRED_ACKS", "UNSUPPORTED_VERSION", "_FATAL", "_FENCED",
    ]

    /// `_FATAL` is always `.fatal`: librdkafka refuses a call or fails a delivery with it as soon
    /// as the client failed, before its error callback has told Warden so.
    static func code(_ err: rd_kafka_resp_err_t, _ context: String, kind: Kind = .client) -> KafkaError {
        let name = String(cString: rd_kafka_err2name(err))
        return KafkaError(err == RD_KAFKA_RESP_ERR__FATAL ? .fatal : kind,
                          "\(context): \(name) (\(String(cString: rd_kafka_err2str(err))))", name: name)
    }
}

/// librdkafka properties, passed through as given (`bootstrap.servers`, `security.protocol`,
/// SASL, SSL, …). Values are strings, as librdkafka takes them.
public struct KafkaProperties: Sendable, ExpressibleByDictionaryLiteral {
    public var values: [String: String]

    public init(_ values: [String: String] = [:]) { self.values = values }
    public init(dictionaryLiteral elements: (String, String)...) {
        self.values = Dictionary(elements, uniquingKeysWith: { _, last in last })
    }

    public subscript(name: String) -> String? {
        get { values[name] }
        set { values[name] = newValue }
    }

    /// Checks every property with librdkafka itself, as a client would be configured: an
    /// unknown name or a bad value is refused with librdkafka's message (`check-config` and
    /// `warden run` refuse it before anything starts).
    public func validate() throws(KafkaError) {
        rd_kafka_conf_destroy(try makeConfiguration())
    }

    /// Makes each client as `warden run` will — the consumer, and each producer with its own
    /// properties — with no broker to reach, and destroys it at once: librdkafka refuses some
    /// combinations only then (`fetch.max.bytes` under `message.max.bytes`, `linger.ms` over
    /// `message.timeout.ms`, an SSL key file it cannot read). Only for `check-config` and the
    /// start of `warden run`: making a client may run a SASL `kinit` or fetch an OIDC token.
    /// librdkafka's words, with the value of any secret property left out.
    public static func checkClients(consumer: KafkaConsumerConfiguration, producers: [(name: String, properties: KafkaProperties)])
        throws(KafkaError)
    {
        var clients: [(String, rd_kafka_type_t, KafkaProperties)] = [("consumer", RD_KAFKA_CONSUMER, consumer.effectiveProperties)]
        for producer in producers {
            clients.append((producer.name, RD_KAFKA_PRODUCER, KafkaProducer.effectiveProperties(bootstrapServers: "", producer.properties)))
        }
        for (name, role, var properties) in clients {
            properties["bootstrap.servers"] = nil
            let conf = try properties.makeConfiguration()
            rd_kafka_conf_set_log_cb(conf, { _, _, _, _ in })
            var errstr = [CChar](repeating: 0, count: 512)
            guard let rk = rd_kafka_new(role, conf, &errstr, errstr.count) else {
                rd_kafka_conf_destroy(conf)
                var reason = String(decoding: errstr.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
                for (key, value) in properties.values where isSecret(key) && !value.isEmpty {
                    reason = reason.replacing(value, with: "(not shown)")
                }
                throw KafkaError(.configuration, "librdkafka refuses the properties together (\(name)): \(reason)")
            }
            rd_kafka_destroy(rk)
        }
    }

    /// Whether a property's value is a secret, never repeated in a message.
    static func isSecret(_ name: String) -> Bool {
        ["password", "secret", "key", "token", "jaas"].contains { name.lowercased().contains($0) }
    }

    /// A librdkafka configuration object holding these properties; refuses unknown names or
    /// bad values with librdkafka's message and the property's name. Secrets are not echoed.
    func makeConfiguration() throws(KafkaError) -> OpaquePointer {
        let conf = rd_kafka_conf_new()!
        var errstr = [CChar](repeating: 0, count: 512)
        for (name, value) in values.sorted(by: { $0.key < $1.key }) {
            if rd_kafka_conf_set(conf, name, value, &errstr, errstr.count) != RD_KAFKA_CONF_OK {
                rd_kafka_conf_destroy(conf)
                let reason = String(decoding: errstr.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
                // librdkafka's message may quote the value; never repeat a secret's.
                throw KafkaError(.configuration, "Kafka property \"\(name)\": \(Self.isSecret(name) ? "the value was refused (not shown)" : reason)")
            }
        }
        return conf
    }
}

extension KafkaProperties {
    /// Properties Warden sets itself, with why: given in `kafka.properties`, one of them would
    /// quietly undo what Warden promises (an offset committed before its event is durable is an
    /// event lost in a crash), so they are refused.
    public static let reserved: [String: String] = [
        "bootstrap.servers": "set by kafka.brokers",
        "metadata.broker.list": "set by kafka.brokers",
        "group.id": "set by kafka.group",
        "enable.auto.commit": "Warden commits an offset only once its event's outcome is durable",
        "auto.commit.enable": "Warden commits an offset only once its event's outcome is durable",
        "enable.auto.offset.store": "Warden commits an offset only once its event's outcome is durable",
        "auto.offset.reset": "a new group starts at the earliest offset, so that no event published before the first start is missed",
        "enable.partition.eof": "Warden reads partitions without end-of-partition events",
        "partition.assignment.strategy": "Warden's rebalances are cooperative (cooperative-sticky): a partition's work is finished before it is given up",
        "acks": "a dead letter is sent only once every in-sync replica has it (acks=all)",
        "enable.idempotence": "dead letters are produced idempotently",
    ]
}
