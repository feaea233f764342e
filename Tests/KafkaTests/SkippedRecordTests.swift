import CRdkafka
import Foundation
@testable import Kafka
import Logging
import Testing

/// A record librdkafka reports it could not deliver whole (a CRC mismatch, a compression it
/// cannot undo), and then skips, is handed out as a message that says so, so the pipeline
/// records and dead-letters it; the commit point never passes it unseen. Other consumer errors
/// are not messages.
@Suite("Records librdkafka skips")
struct SkippedRecordTests {
    /// An error message as librdkafka hands one out: a message structure at the start of a
    /// zeroed block (librdkafka's own message record is larger; its other fields read as unset).
    static func withErrorMessage<T>(_ err: rd_kafka_resp_err_t, partition: Int32, offset: Int64,
                                    _ body: (UnsafeMutablePointer<rd_kafka_message_t>) throws -> T) throws -> T {
        var errstr = [CChar](repeating: 0, count: 512)
        let rk = try #require(rd_kafka_new(RD_KAFKA_PRODUCER, rd_kafka_conf_new(), &errstr, errstr.count))
        defer { rd_kafka_destroy(rk) }
        let rkt = try #require(rd_kafka_topic_new(rk, "security-events", nil))
        defer { rd_kafka_topic_destroy(rkt) }
        let block = UnsafeMutableRawPointer.allocate(byteCount: 4096, alignment: 16)
        block.initializeMemory(as: UInt8.self, repeating: 0, count: 4096)
        defer { block.deallocate() }
        let text = strdup("Message at offset \(offset) failed CRC check")!
        defer { free(text) }
        let message = block.bindMemory(to: rd_kafka_message_t.self, capacity: 1)
        message.pointee.err = err
        message.pointee.rkt = rkt
        message.pointee.partition = partition
        message.pointee.offset = offset
        message.pointee.payload = UnsafeMutableRawPointer(text)
        message.pointee.len = strlen(text)
        return try body(message)
    }

    static var logger: Logger {
        var logger = Logger(label: "skipped-record-test")
        logger.logLevel = .critical
        return logger
    }

    @Test func aRecordLibrdkafkaSkippedIsHandedOutAsUnreadable() throws {
        let message = try Self.withErrorMessage(RD_KAFKA_RESP_ERR__BAD_MSG, partition: 2, offset: 41) {
            KafkaConsumer.convert($0, deliver: true, logger: Self.logger)
        }
        let unreadable = try #require(message)
        #expect(unreadable.address() == "security-events/2/41")
        #expect(unreadable.deliveryError?.hasPrefix("_BAD_MSG: Message at offset 41 failed CRC check") == true,
                "\(String(describing: unreadable.deliveryError))")
        // Polled after fetching stopped: not handed out, as any message.
        #expect(try Self.withErrorMessage(RD_KAFKA_RESP_ERR__BAD_COMPRESSION, partition: 0, offset: 7) {
            KafkaConsumer.convert($0, deliver: false, logger: Self.logger)
        } == nil)
    }

    // `warden replay --topic` reads past such a record too, reporting it, where it stopped.
    @Test func theTopicReaderHandsOutASkippedRecordAsUnreadable() throws {
        let message = try Self.withErrorMessage(RD_KAFKA_RESP_ERR__BAD_MSG, partition: 1, offset: 9) {
            try KafkaTopicReader.message($0, topic: "security-events")
        }
        #expect(message.partition == 1 && message.offset == 9)
        #expect(message.deliveryError?.hasPrefix("_BAD_MSG: Message at offset 9 failed CRC check") == true)
        #expect(throws: KafkaError.self) {
            try Self.withErrorMessage(RD_KAFKA_RESP_ERR__TRANSPORT, partition: 0, offset: 3) { try KafkaTopicReader.message($0, topic: "t") }
        }
    }

    @Test func otherConsumerErrorsAreNoMessages() throws {
        for err in [RD_KAFKA_RESP_ERR__PARTITION_EOF, RD_KAFKA_RESP_ERR__AUTO_OFFSET_RESET, RD_KAFKA_RESP_ERR__TRANSPORT] {
            #expect(try Self.withErrorMessage(err, partition: 0, offset: 3) { KafkaConsumer.convert($0, deliver: true, logger: Self.logger) } == nil)
        }
    }

    /// A skipped record's report that comes behind what was handed out already is not tracked
    /// (an offset is tracked once, in increasing order).
    @Test func aReportBehindWhatWasHandedOutIsNotTracked() {
        var tracker = OffsetTracker()
        let tp = TopicPartition("security-events", 0)
        tracker.assigned([tp])
        #expect(tracker.isAhead(tp, offset: 0))
        _ = tracker.handedOut(tp, offset: 5)
        #expect(!tracker.isAhead(tp, offset: 5))
        #expect(tracker.isAhead(tp, offset: 6))
        #expect(!tracker.isAhead(TopicPartition("security-events", 1), offset: 9))
    }

    /// A message waiting aside leaves the fetch budget, but the offsets held behind it do not
    /// grow without bound: past 64 budgets of them, the budget counts as full.
    @Test func offsetsHeldBehindAMessageWaitingAsideAreBounded() {
        var tracker = OffsetTracker()
        let tp = TopicPartition("security-events", 0)
        tracker.assigned([tp])
        let assignment = tracker.handedOut(tp, offset: 0)
        tracker.setAside(tp, assignment: assignment, true)
        #expect(tracker.load(budget: 4) == 0)
        for offset in Int64(1)..<Int64(4 * OffsetTracker.spanBudgets) {
            _ = tracker.handedOut(tp, offset: offset)
            tracker.finished(tp, offset: offset, assignment: nil)
        }
        #expect(tracker.load(budget: 4) == 0)
        _ = tracker.handedOut(tp, offset: Int64(4 * OffsetTracker.spanBudgets))
        #expect(tracker.load(budget: 4) == 4, "full once the span behind the waiting message passes 64 budgets")
        // The waiting message finishes: the commit point moves, the span is gone.
        tracker.setAside(tp, assignment: assignment, false)
        tracker.finished(tp, offset: 0, assignment: nil)
        #expect(tracker.load(budget: 4) == 1)
        // A revoked partition's messages leave the budget with it.
        tracker.revoked([tp])
        #expect(tracker.load(budget: 4) == 0)
    }
}
