import Foundation
public import Kafka
import Ledger
public import Logging
public import ServiceLifecycle

/// Turns a Kafka topic of SETs into recorded events: messages of one subject (same key, or
/// same partition when unkeyed) are handled in order by one lane; lanes run concurrently. A
/// message's offset becomes committable only when its outcome is durable.
///
/// On graceful shutdown: stop fetching, let every lane finish what it holds (messages waiting on
/// a retry are abandoned, to be delivered again), commit, leave the group.
public final class KafkaIntake: Service {
    let consumer: KafkaConsumer
    let processor: EventProcessor
    let lanes: Int
    let metrics: WardenMetrics
    let logger: Logger

    public init(consumer: KafkaConsumer, processor: EventProcessor, lanes: Int, metrics: WardenMetrics, logger: Logger) {
        self.consumer = consumer
        self.processor = processor
        self.lanes = max(1, lanes)
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
        var inboxes: [AsyncStream<KafkaMessage>.Continuation] = []
        await withTaskGroup(of: Void.self) { group in
            for _ in 0..<lanes {
                let (stream, continuation) = AsyncStream.makeStream(of: KafkaMessage.self)
                inboxes.append(continuation)
                group.addTask { await self.lane(stream) }
            }
            for await message in consumer.messages {
                metrics.received(source: "kafka")
                inboxes[laneIndex(message)].yield(message)
            }
            for inbox in inboxes { inbox.finish() }
            await group.waitForAll()
        }
        // Every lane is done: commit and leave the group.
        processor.stop.stop()
        consumer.close()
    }

    private func lane(_ inbox: AsyncStream<KafkaMessage>) async {
        var abandoning = false
        for await message in inbox {
            // Once one message of a lane is abandoned, later ones of the same subject must not
            // overtake it: they are left for redelivery too.
            if abandoning { continue }
            let intake = IntakeMessage(value: message.value, source: "kafka:\(message.address)",
                                       receivedAt: Date().timeIntervalSince1970)
            let disposition = await processor.process(intake)
            if disposition == .abandoned {
                abandoning = true
                logger.info("left for redelivery", metadata: ["warden.source": "\(intake.source)"])
                continue
            }
            consumer.finished(message)
        }
    }

    /// Same key → same lane (order per subject); unkeyed messages keep their partition's order.
    func laneIndex(_ message: KafkaMessage) -> Int {
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        func mix(_ byte: UInt8) { hash = (hash ^ UInt64(byte)) &* 0x100_0000_01b3 }
        if let key = message.key, !key.isEmpty {
            for b in key { mix(b) }
        } else {
            for b in message.topic.utf8 { mix(b) }
            withUnsafeBytes(of: message.partition.littleEndian) { for b in $0 { mix(b) } }
        }
        return Int(hash % UInt64(lanes))
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
