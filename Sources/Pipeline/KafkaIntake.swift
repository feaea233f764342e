import Foundation
public import Invalidation
public import Kafka
import Ledger
import SecurityEvents
import Synchronization
public import Logging
public import ServiceLifecycle

/// The Kafka door: turns a topic of SETs into records for the pipeline's stages. A message's
/// offset becomes committable when its record settles with its outcome durable; a message the
/// pipeline abandons is not finished, and is delivered again (after a restart, or to the
/// partition's next owner). The actions made for a message are work on its partition's
/// assignment: a revocation waits for the action under way and lets none start after it.
///
/// On graceful shutdown: stop fetching, finish what was fetched (what waits on a retry is
/// abandoned, and everything after it is left for redelivery), commit, leave the group.
public final class KafkaIntake: Service {
    let consumer: KafkaConsumer
    let pipeline: EventPipeline
    let metrics: WardenMetrics
    let logger: Logger

    public init(consumer: KafkaConsumer, pipeline: EventPipeline, metrics: WardenMetrics, logger: Logger) {
        self.consumer = consumer
        self.pipeline = pipeline
        self.metrics = metrics
        self.logger = logger
    }

    public convenience init(consumer: KafkaConsumer, processor: EventProcessor, metrics: WardenMetrics, logger: Logger) {
        self.init(consumer: consumer, pipeline: EventPipeline(processor: processor), metrics: metrics, logger: logger)
    }

    public func run() async throws {
        let stop = pipeline.processor.stop
        try await withGracefulShutdownHandler {
            try await withThrowingTaskGroup(of: Void.self) { group in
                group.addTask { try await self.consumer.run() }
                group.addTask {
                    await self.pipeline.run(self.records)
                    // Everything fetched is settled: commit and leave the group.
                    stop.stop()
                    self.consumer.close()
                }
                group.addTask { await self.reportOffsets(until: stop) }
                // The first to end decides: a fatal consumer error ends everything.
                try await group.next()
                try await group.waitForAll()
            }
        } onGracefulShutdown: {
            stop.stop()
            self.consumer.stopFetching()
        }
    }

    /// The consumer's batches as records, each acknowledged by finishing its message.
    var records: AsyncMapSequence<AsyncStream<[KafkaMessage]>, [IntakeRecord]> {
        let consumer = self.consumer, metrics = self.metrics
        return consumer.batches.map { batch in
            metrics.received(source: "kafka", count: batch.count)
            let receivedAt = Date().timeIntervalSince1970
            return batch.map { message in
                var intake = IntakeMessage(value: message.value, source: message.address(prefix: "kafka:"), receivedAt: receivedAt,
                                           key: message.key, headers: message.headers.map { MessageHeader(name: $0.name, value: $0.value) })
                intake.unreadable = message.deliveryError
                return IntakeRecord(intake, acknowledgement: KafkaAcknowledgement(consumer: consumer, message: message))
            }
        }
    }

    private func reportOffsets(until stop: StopSignal) async {
        while await stop.pause(1) {
            for status in consumer.partitionStatus() {
                let labels = [("topic", status.partition.topic), ("partition", "\(status.partition.partition)")]
                if let committed = status.committed {
                    metrics.gauge("warden_kafka_committed_offset", labels).record(committed)
                    if let high = consumer.highWatermark(of: status.partition) {
                        metrics.gauge("warden_kafka_consumer_lag", labels).record(max(0, high - committed))
                    }
                }
                metrics.gauge("warden_kafka_in_flight", labels).record(status.inFlight)
            }
        }
    }
}

/// A Kafka message's acknowledgement: finishing it (unless abandoned), and actions as work on
/// its partition's assignment.
struct KafkaAcknowledgement: Acknowledgement {
    let consumer: KafkaConsumer
    let message: KafkaMessage

    func settle(_ disposition: Disposition) {
        if disposition != .abandoned { consumer.finished(message) }
    }

    func beginAction() -> Bool { message.assignment?.beginWork() ?? true }
    func endAction() { message.assignment?.endWork() }
    func setAside(_ aside: Bool) { consumer.setAside(message, aside) }
}

/// Dead letters to a Kafka topic: the original value, key and headers, with `warden-error`,
/// `warden-error-description` and `warden-source` headers (replacing any `warden-…` header the
/// original carried from an earlier pass).
public struct KafkaDeadLetters: DeadLetterSink {
    let producer: KafkaProducer
    let topic: String

    public init(producer: KafkaProducer, topic: String) {
        self.producer = producer
        self.topic = topic
    }

    /// What a dead letter keeps of a value the cluster will not take whole.
    static let truncatedBytes = 16 * 1024

    public func deadLetter(value: [UInt8], key: [UInt8]?, headers original: [MessageHeader], code: String, description: String,
                           source: String) async throws(DeadLetterError) {
        let address = source.hasPrefix("kafka:") ? String(source.dropFirst("kafka:".count)) : source
        var headers = original.filter { !$0.name.hasPrefix("warden-") }.map { KafkaHeader($0.name, $0.value) }
        headers += [
            KafkaHeader("warden-error", code),
            KafkaHeader("warden-error-description", description),
            KafkaHeader("warden-source", address),
        ]
        do {
            do {
                _ = try await producer.send(topic: topic, key: key, value: value, headers: headers)
            } catch where error.isMessageTooLarge && value.count > Self.truncatedBytes {
                // The original cannot be produced whole (a junk message of about the size
                // limit, plus our headers): a truncated copy goes instead, saying so; the
                // ledger's record of the delivery keeps the whole value.
                headers.append(KafkaHeader("warden-truncated", "\(value.count) bytes, the first \(Self.truncatedBytes) kept; sha256 "
                                           + TokenFingerprint.fingerprint(value)))
                _ = try await producer.send(topic: topic, key: key, value: Array(value.prefix(Self.truncatedBytes)), headers: headers)
            }
        } catch {
            throw DeadLetterError(error.description, isRetryable: error.isRetryable)
        }
    }
}

