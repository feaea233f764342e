import Foundation
public import Invalidation
public import Kafka
import Ledger
import SecurityEvents
import Synchronization
public import Logging
public import ServiceLifecycle
public import TokenVerification

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
    /// How long ago a message's `received-at` header may say it arrived for its claims to be
    /// judged then (see `claimsTime(of:now:)`); 0: never.
    let arrivalWindow: Double

    /// The message's `received-at` header (RFC 3339), set by the door that took the SET first.
    public static let receivedAtHeader = "received-at"

    public init(consumer: KafkaConsumer, pipeline: EventPipeline, metrics: WardenMetrics, logger: Logger, arrivalWindow: Double = 0) {
        self.consumer = consumer
        self.pipeline = pipeline
        self.metrics = metrics
        self.logger = logger
        self.arrivalWindow = arrivalWindow
    }

    public convenience init(consumer: KafkaConsumer, processor: EventProcessor,
                            maximumKeyWait: Duration?, metrics: WardenMetrics, logger: Logger,
                            arrivalWindow: Double = 0) {
        self.init(consumer: consumer, pipeline: EventPipeline(processor: processor, maximumKeyWait: maximumKeyWait, arrivalWindow: arrivalWindow),
                  metrics: metrics, logger: logger, arrivalWindow: arrivalWindow)
    }

    /// The longest `arrivalWindow` that is safe for these issuers and this retention. A SET the
    /// push receiver answered 202 and produced must not be refused as too old because the workers
    /// read it late (the transmitter will not send it again): its claims are judged when it
    /// arrived. But the header is only a claim of whoever produced the message, and a copy of an
    /// old token with an arrival made up would pass `max-age`; so it is honoured only while the
    /// ledger must still hold the claim of any copy acted on before: a token that passes
    /// `max-age` at time t was issued after t − max-age − skew, its claim was recorded after that
    /// and is kept for the retention, so up to retention − (max-age + skew) after t it is still
    /// there and the copy is a duplicate. Without retention the ledger keeps every claim.
    public static func arrivalWindow(retention: Double?, issuers: [IssuerPolicy]) -> Double {
        guard let retention else { return .infinity }
        let longest = issuers.map { ($0.maximumAge ?? .infinity) + $0.clockSkew }.max() ?? 0
        return max(0, retention - longest)
    }

    /// When a message's claims are judged: when its `received-at` header says it arrived, if
    /// that is within `arrivalWindow` of now (and not ahead of it by more than a second of clock
    /// difference between hosts); else now.
    static func claimsTime(of headers: [KafkaHeader], now: Double, window: Double) -> SETVerifier.ClaimsTime {
        guard window > 0, let header = headers.last(where: { $0.name == receivedAtHeader }), let value = header.value,
              value.count <= 64, let arrived = RFC3339.parse(String(decoding: value, as: UTF8.self)),
              arrived <= now + 1, now - arrived <= window else { return .now }
        return .at(min(arrived, now))
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
        let consumer = self.consumer, metrics = self.metrics, window = self.arrivalWindow
        return consumer.batches.map { batch in
            metrics.received(source: "kafka", count: batch.count)
            let receivedAt = Date().timeIntervalSince1970
            return batch.map { message in
                var intake = IntakeMessage(value: message.value, source: message.address(prefix: "kafka:"), receivedAt: receivedAt,
                                           claimsTime: Self.claimsTime(of: message.headers, now: receivedAt, window: window),
                                           key: message.key, headers: message.headers.map { MessageHeader(name: $0.name, value: $0.value) })
                intake.unreadable = message.deliveryError
                return IntakeRecord(intake, acknowledgement: KafkaAcknowledgement(consumer: consumer, message: message))
            }
        }
    }

    private func reportOffsets(until stop: StopSignal) async {
        let commitFailures = metrics.counter("warden_kafka_commit_failures_total")
        var failuresReported = 0
        var reported = Set<TopicPartition>()
        while await stop.pause(1) {
            let failures = consumer.commitFailureCount
            if failures > failuresReported { commitFailures.increment(by: Int64(failures - failuresReported)) }
            failuresReported = failures
            let statuses = consumer.partitionStatus()
            // A partition moved to another member (a rebalance): its series go, rather than
            // show their last values for ever beside the new owner's.
            let current = Set(statuses.map(\.partition))
            for gone in reported.subtracting(current) {
                let labels = [("topic", gone.topic), ("partition", "\(gone.partition)")]
                for name in ["warden_kafka_committed_offset", "warden_kafka_consumer_lag", "warden_kafka_in_flight"] {
                    metrics.dropGauge(name, labels)
                }
            }
            reported = current
            for status in statuses {
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
    /// The longest key a truncated copy keeps.
    static let keptKeyBytes = 1024

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
            } catch where error.isMessageTooLarge {
                // The original cannot be produced whole (a junk message of about the size limit
                // with our headers, or one whose own headers or key are that large): a
                // truncated copy goes instead, saying so — its value's first 16 KiB, with
                // Warden's headers only, and the key if it is short. The ledger's record of the
                // delivery keeps the value's first 16 KiB and its SHA-256.
                let keptKey = key.flatMap { $0.count <= Self.keptKeyBytes ? $0 : nil }
                var left = original.isEmpty ? "" : "; the original's \(original.count) headers left out"
                if key != nil, keptKey == nil { left += "; its key (\(key!.count) bytes) left out" }
                var copy = headers.filter { $0.name.hasPrefix("warden-") }
                copy.append(KafkaHeader("warden-truncated", "\(value.count) bytes, the first \(min(value.count, Self.truncatedBytes)) kept; sha256 "
                                        + TokenFingerprint.fingerprint(value) + left))
                _ = try await producer.send(topic: topic, key: keptKey, value: Array(value.prefix(Self.truncatedBytes)), headers: copy)
            }
        } catch {
            // A fatal producer error is the producer's, not the message's: it is never mended in
            // this process, which ends on it (the producer's service fails the group), so the
            // message waits unsettled and is read again after the restart — not kept in the
            // ledger only as if the cluster had refused it.
            throw DeadLetterError(error.description, isRetryable: error.isRetryable || error.kind == .fatal || producer.fatalError != nil)
        }
    }
}

