internal import CRdkafka

/// A message as it came from a partition.
public struct KafkaMessage: Sendable {
    public var topic: String
    public var partition: Int32
    public var offset: Int64
    public var key: [UInt8]?
    public var value: [UInt8]
    public var headers: [KafkaHeader]
    /// Milliseconds since the epoch, when the broker or producer set one.
    public var timestamp: Int64?
    /// The assignment of its partition it was fetched under (nil for a message not fetched by
    /// a consumer group member).
    public internal(set) var assignment: PartitionAssignment?
    /// Set when librdkafka could not deliver the message at this offset whole (a corrupt
    /// record, a compression it cannot undo) and went on past it: what it said. The value is
    /// then whatever librdkafka gave (its error text), never the record.
    public internal(set) var deliveryError: String?

    public init(topic: String, partition: Int32, offset: Int64, key: [UInt8]?, value: [UInt8],
                headers: [KafkaHeader] = [], timestamp: Int64? = nil) {
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.key = key
        self.value = value
        self.headers = headers
        self.timestamp = timestamp
    }

    /// The first header with this name.
    public func header(_ name: String) -> [UInt8]? {
        headers.first { $0.name == name }?.value
    }

    /// `prefix` followed by `topic/partition/offset`, the message's address, built in one string.
    public func address(prefix: String = "") -> String {
        var text = prefix
        text.reserveCapacity(prefix.utf8.count + topic.utf8.count + 24)
        text += topic
        text += "/"
        text += String(partition)
        text += "/"
        text += String(offset)
        return text
    }
}

public struct KafkaHeader: Sendable, Equatable {
    public var name: String
    public var value: [UInt8]?

    public init(_ name: String, _ value: [UInt8]?) {
        self.name = name
        self.value = value
    }

    public init(_ name: String, _ value: String) {
        self.init(name, Array(value.utf8))
    }
}

/// One partition of one topic.
public struct TopicPartition: Sendable, Hashable, CustomStringConvertible {
    public var topic: String
    public var partition: Int32

    public init(_ topic: String, _ partition: Int32) {
        self.topic = topic
        self.partition = partition
    }

    public var description: String { "\(topic)/\(partition)" }
}

extension KafkaMessage {
    /// A copy of a message librdkafka fetched without error: its value, key, headers and
    /// timestamp.
    init(copying pointer: UnsafeMutablePointer<rd_kafka_message_t>) {
        let m = pointer.pointee
        let topic = String(cString: rd_kafka_topic_name(m.rkt))
        let value = m.payload.map { Array(UnsafeRawBufferPointer(start: $0, count: m.len)) } ?? []
        let key = m.key.map { Array(UnsafeRawBufferPointer(start: $0, count: m.key_len)) }
        var headers: [KafkaHeader] = []
        var hdrs: OpaquePointer? = nil
        if rd_kafka_message_headers(pointer, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR, let hdrs {
            var index = 0
            var name: UnsafePointer<CChar>? = nil
            var valuePointer: UnsafeRawPointer? = nil
            var size = 0
            while rd_kafka_header_get_all(hdrs, index, &name, &valuePointer, &size) == RD_KAFKA_RESP_ERR_NO_ERROR {
                let headerValue = valuePointer.map { Array(UnsafeRawBufferPointer(start: $0, count: size)) }
                headers.append(KafkaHeader(name.map { String(cString: $0) } ?? "", headerValue))
                index += 1
            }
        }
        var timestampType = RD_KAFKA_TIMESTAMP_NOT_AVAILABLE
        let timestamp = rd_kafka_message_timestamp(pointer, &timestampType)
        self.init(topic: topic, partition: m.partition, offset: m.offset, key: key, value: value,
                  headers: headers, timestamp: timestampType == RD_KAFKA_TIMESTAMP_NOT_AVAILABLE ? nil : timestamp)
    }
}
