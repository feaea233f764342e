internal import CRdkafka
import Foundation
public import Logging

/// Reads one topic's messages in a time range, every partition from the start of the range to
/// the end it had when the reader was made, without joining a consumer group and without
/// committing anything: what `warden replay --topic` reads, beside the workers.
///
/// The range's start is looked up by time where the cluster answers (offsets for times); where
/// it does not (librdkafka's mock cluster), reading starts at the low watermark. Either way,
/// messages whose timestamp lies outside [from, to) are skipped.
public final class KafkaTopicReader {
    public let topic: String
    let client: KafkaClient
    private let from: Double?
    private let to: Double?
    /// Per partition: the offset reading ends before (the high watermark when the reader was made).
    private var ends: [Int32: Int64] = [:]
    /// Per partition: the oldest offset still on the topic, and where reading the range started.
    private var lowWatermarks: [Int32: Int64] = [:]
    private var starts: [Int32: Int64] = [:]
    /// Per partition: runs of offsets read and skipped for a timestamp outside [from, to).
    private var skipped: [Int32: [ClosedRange<Int64>]] = [:]
    private var remaining: Set<Int32> = []
    /// Messages to read in all (an upper bound: some may lie outside the time range).
    public let total: Int64
    /// When the partitions' ends were taken (seconds since 1970): a message consumed later by
    /// anyone may lie past them, beyond what this reader reads.
    public let endsTakenAt: Double

    /// `from`, `to`: seconds since 1970.
    public init(bootstrapServers: String, properties: KafkaProperties, topic: String, from: Double?, to: Double?,
                logger: Logger, timeout: Double = 10) throws(KafkaError) {
        var p = properties
        p["bootstrap.servers"] = bootstrapServers
        // A group id is required by the consumer handle; it is never joined (partitions are
        // assigned by hand) and nothing is committed under it.
        p["group.id"] = "warden-replay-\(UInt64.random(in: 0...UInt64.max))"
        p["enable.auto.commit"] = "false"
        p["enable.auto.offset.store"] = "false"
        p["enable.partition.eof"] = "false"
        client = try KafkaClient(role: .consumer, properties: p, context: CallbackContext(logger: logger, consumer: nil))
        self.topic = topic
        self.from = from
        self.to = to
        let rk = client.handle
        let milliseconds = Int32(timeout * 1000)

        // The topic's partitions.
        var metadata: UnsafePointer<rd_kafka_metadata>? = nil
        let topicHandle = rd_kafka_topic_new(rk, topic, nil)
        defer { rd_kafka_topic_destroy(topicHandle) }
        let err = rd_kafka_metadata(rk, 0, topicHandle, &metadata, milliseconds)
        guard err == RD_KAFKA_RESP_ERR_NO_ERROR, let metadata else {
            throw KafkaError(.client, "cannot read the metadata of topic \(topic): \(String(cString: rd_kafka_err2str(err)))")
        }
        defer { rd_kafka_metadata_destroy(metadata) }
        guard metadata.pointee.topic_cnt == 1, let described = metadata.pointee.topics?.pointee,
              described.err == RD_KAFKA_RESP_ERR_NO_ERROR, described.partition_cnt > 0 else {
            throw KafkaError(.client, "the cluster has no topic \(topic)")
        }
        let partitions = (0..<Int(described.partition_cnt)).map { described.partitions[$0].id }

        // Where each partition's range starts and ends.
        endsTakenAt = Date().timeIntervalSince1970
        var starts: [Int32: Int64] = [:]
        for partition in partitions {
            var low: Int64 = 0, high: Int64 = 0
            let answer = rd_kafka_query_watermark_offsets(rk, topic, partition, &low, &high, milliseconds)
            guard answer == RD_KAFKA_RESP_ERR_NO_ERROR else {
                throw KafkaError(.client, "cannot read the offsets of \(topic)/\(partition): \(String(cString: rd_kafka_err2str(answer)))")
            }
            starts[partition] = low
            lowWatermarks[partition] = low
            ends[partition] = high
        }
        if let from {
            let list = rd_kafka_topic_partition_list_new(Int32(partitions.count))!
            defer { rd_kafka_topic_partition_list_destroy(list) }
            for partition in partitions {
                rd_kafka_topic_partition_list_add(list, topic, partition).pointee.offset = Int64((from * 1000).rounded(.down))
            }
            if rd_kafka_offsets_for_times(rk, list, milliseconds) == RD_KAFKA_RESP_ERR_NO_ERROR {
                for i in 0..<Int(list.pointee.cnt) {
                    let element = list.pointee.elems[i]
                    // -1: no answer (or no message at or after that time): start at the low watermark.
                    if element.err == RD_KAFKA_RESP_ERR_NO_ERROR, element.offset >= 0 {
                        starts[element.partition] = max(starts[element.partition] ?? 0, element.offset)
                    }
                }
            }
        }
        let ends = self.ends
        self.starts = starts
        total = partitions.reduce(0) { $0 + max(0, ends[$1]! - starts[$1]!) }
        remaining = Set(partitions.filter { ends[$0]! > starts[$0]! })
        let assignment = rd_kafka_topic_partition_list_new(Int32(partitions.count))!
        defer { rd_kafka_topic_partition_list_destroy(assignment) }
        for partition in partitions {
            rd_kafka_topic_partition_list_add(assignment, topic, partition).pointee.offset = starts[partition]!
        }
        let assigned = rd_kafka_assign(rk, assignment)
        guard assigned == RD_KAFKA_RESP_ERR_NO_ERROR else {
            throw KafkaError(.client, "cannot assign the partitions of \(topic): \(String(cString: rd_kafka_err2str(assigned)))")
        }
    }

    /// Messages read so far (in range or not), for progress.
    public private(set) var consumed: Int64 = 0

    /// Up to `limit` messages of the range, in each partition's order; empty once every
    /// partition has reached its end. Throws when nothing arrives for `timeout` seconds while
    /// messages are still due.
    public func next(limit: Int, timeout: Double = 30) throws(KafkaError) -> [KafkaMessage] {
        var messages: [KafkaMessage] = []
        var progressSince = Date()
        var polls = 0
        while messages.count < limit, !remaining.isEmpty {
            polls += 1
            // Offsets that hold no message (transaction markers, compacted records) are never
            // delivered, and a busy topic may never poll empty: positions are looked at now and
            // then as well as whenever a poll comes back empty.
            if polls % 256 == 0 { dropFinishedPartitions() }
            guard let pointer = rd_kafka_consumer_poll(client.handle, 100) else {
                dropFinishedPartitions()
                if remaining.isEmpty { break }
                if messages.isEmpty, Date().timeIntervalSince(progressSince) > timeout {
                    throw KafkaError(.client, "no message of \(topic) in the range arrived for \(Int(timeout)) s while \(remaining.count) partitions have more to read")
                }
                if !messages.isEmpty { break }
                continue
            }
            defer { rd_kafka_message_destroy(pointer) }
            let message = try Self.message(pointer, topic: topic)
            let partition = message.partition, offset = message.offset
            guard let end = ends[partition], remaining.contains(partition) else { continue }
            guard offset < end else {
                // Past the range's end: this partition is done, and fetches no more.
                finish(partition)
                continue
            }
            consumed += 1
            progressSince = Date()
            if offset + 1 >= end { finish(partition) }
            if let timestamp = message.timestamp {
                let seconds = Double(timestamp) / 1000
                if let from, seconds < from { skip(partition, offset); continue }
                if let to, seconds >= to { skip(partition, offset); continue }
            }
            messages.append(message)
        }
        return messages
    }

    /// The message a poll returned. A record librdkafka could not deliver whole (a CRC
    /// mismatch, a batch it cannot decompress) and skips is a message marked unreadable
    /// (`deliveryError`), as the worker hands it out, so that a replay reports it and goes on;
    /// any other error stops the read.
    static func message(_ pointer: UnsafeMutablePointer<rd_kafka_message_t>, topic: String) throws(KafkaError) -> KafkaMessage {
        let m = pointer.pointee
        guard m.err != RD_KAFKA_RESP_ERR_NO_ERROR else { return KafkaMessage(copying: pointer) }
        let name = String(cString: rd_kafka_err2name(m.err))
        let reason = rd_kafka_message_errstr(pointer).map { String(cString: $0) } ?? ""
        guard KafkaConsumer.skippedRecordErrors.contains(m.err.rawValue), m.rkt != nil, m.partition >= 0, m.offset >= 0 else {
            throw KafkaError(.client, "reading \(topic) failed: \(name) \(reason)")
        }
        var message = KafkaMessage(copying: pointer)
        message.deliveryError = "\(name): \(reason)"
        return message
    }

    /// Remembered as a run of skipped offsets (the usual skips, before `from` where the cluster
    /// cannot look up offsets for times and after `to`, are one run each: memory stays small).
    private func skip(_ partition: Int32, _ offset: Int64) {
        if let last = skipped[partition]?.last, last.upperBound < offset, last.upperBound >= offset - 1 {
            skipped[partition]![skipped[partition]!.count - 1] = last.lowerBound...offset
        } else {
            skipped[partition, default: []].append(offset...offset)
        }
    }

    /// Whether the message at `offset` is still on the topic but outside the time range (before
    /// the range's start, or read and skipped for its timestamp): a ledger event recorded from
    /// it is no event missing from the range. Known once the range is read.
    public func isOutsideTheRange(partition: Int32, offset: Int64) -> Bool {
        guard let low = lowWatermarks[partition], offset >= low else { return false }
        if let start = starts[partition], offset < start { return true }
        return skipped[partition]?.contains { $0.contains(offset) } ?? false
    }

    /// A partition read to its end: no longer waited for, and paused so it fetches nothing more.
    private func finish(_ partition: Int32) {
        remaining.remove(partition)
        guard let list = rd_kafka_topic_partition_list_new(1) else { return }
        defer { rd_kafka_topic_partition_list_destroy(list) }
        rd_kafka_topic_partition_list_add(list, topic, partition)
        rd_kafka_pause_partitions(client.handle, list)
    }

    private func dropFinishedPartitions() {
        guard let list = rd_kafka_topic_partition_list_new(Int32(remaining.count)) else { return }
        defer { rd_kafka_topic_partition_list_destroy(list) }
        for partition in remaining { rd_kafka_topic_partition_list_add(list, topic, partition) }
        guard rd_kafka_position(client.handle, list) == RD_KAFKA_RESP_ERR_NO_ERROR else { return }
        for i in 0..<Int(list.pointee.cnt) {
            let element = list.pointee.elems[i]
            if element.offset >= 0, let end = ends[element.partition], element.offset >= end { finish(element.partition) }
        }
    }

    public func close() {
        rd_kafka_consumer_close(client.handle)
    }
}
