import Foundation
public import Kafka
import Ledger
public import Logging
public import ServiceLifecycle

/// Turns a Kafka topic of SETs into recorded events. Messages come in batches (what one poll
/// round fetched); each batch is verified on every core and written to the ledger in one atomic
/// write, in arrival order, so one subject's events stay in order. While batch k is being
/// written, batch k+1 is verified. A message's offset becomes committable only when its
/// outcome is durable.
///
/// On graceful shutdown: stop fetching, finish the batches already fetched (a batch waiting on
/// a retry is cut there, and everything after it is left for redelivery), commit, leave the group.
public final class KafkaIntake: Service {
    let consumer: KafkaConsumer
    let processor: EventProcessor
    let metrics: WardenMetrics
    let logger: Logger

    public init(consumer: KafkaConsumer, processor: EventProcessor, metrics: WardenMetrics, logger: Logger) {
        self.consumer = consumer
        self.processor = processor
        self.metrics = metrics
        self.logger = logger
    }

    public func run() async throws {
        let stop = processor.stop
        try await withGracefulShutdownHandler {
            try await withThrowingTaskGroup(of: Void.self) { group in
                group.addTask { try await self.consumer.run() }
                group.addTask { await self.dispatch() }
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

    private func dispatch() async {
        let processor = self.processor, consumer = self.consumer, logger = self.logger
        var cut = false
        await withTaskGroup(of: Void.self) { writes in
            var writing = false
            for await batch in consumer.batches {
                metrics.received(source: "kafka", count: batch.count)
                // After a cut batch, later messages must not overtake the ones left behind.
                if cut { continue }
                let receivedAt = Date().timeIntervalSince1970
                let intake = batch.map { IntakeMessage(value: $0.value, source: "kafka:\($0.address)", receivedAt: receivedAt) }
                let prepared = await processor.prepare(intake)
                if prepared.count < batch.count {
                    cut = true
                    logger.info("left for redelivery", metadata: ["warden.messages": "\(batch.count - prepared.count)"])
                }
                // One write at a time, in order.
                if writing { await writes.next() }
                writes.addTask {
                    let dispositions = await processor.record(prepared, intake)
                    let done = zip(batch, dispositions).prefix { $0.1 != .abandoned }.map(\.0)
                    consumer.finished(done)
                }
                writing = true
            }
            await writes.waitForAll()
        }
        // Everything fetched is done: commit and leave the group.
        processor.stop.stop()
        consumer.close()
    }

    private func reportOffsets(until stop: StopSignal) async {
        while await stop.pause(1) {
            for status in consumer.partitionStatus() {
                let labels = [("topic", status.partition.topic), ("partition", "\(status.partition.partition)")]
                if let committed = status.committed {
                    metrics.gauge("warden_kafka_committed_offset", labels).record(committed)
                }
                metrics.gauge("warden_kafka_in_flight", labels).record(status.inFlight)
            }
        }
    }
}

/// Dead letters to a Kafka topic: the original value, with `warden-error`,
/// `warden-error-description` and `warden-source` headers.
public struct KafkaDeadLetters: DeadLetterSink {
    let producer: KafkaProducer
    let topic: String

    public init(producer: KafkaProducer, topic: String) {
        self.producer = producer
        self.topic = topic
    }

    public func deadLetter(value: [UInt8], code: String, description: String, source: String) async throws {
        let address = source.hasPrefix("kafka:") ? String(source.dropFirst("kafka:".count)) : source
        _ = try await producer.send(topic: topic, value: value, headers: [
            KafkaHeader("warden-error", code),
            KafkaHeader("warden-error-description", description),
            KafkaHeader("warden-source", address),
        ])
    }
}
