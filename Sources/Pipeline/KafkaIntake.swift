import Foundation
public import Kafka
import Ledger
import SecurityEvents
import Synchronization
public import Logging
public import ServiceLifecycle

/// Turns a Kafka topic of SETs into recorded events. Messages come in batches (what one poll
/// round fetched); each batch is verified on every core and written to the ledger in an atomic
/// write, in arrival order, so one subject's events stay in order. While one write waits for
/// the disk, the batches after it are verified, and they are written together next. A message's offset becomes committable only when its
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
        let processor = self.processor, consumer = self.consumer, logger = self.logger, metrics = self.metrics
        let queue = WriteQueue(limit: Self.maximumUnwritten)
        let lanes = SubjectLanes()
        await withTaskGroup(of: Void.self) { group in
            // One writer: it takes every batch prepared since its last write and writes them
            // together, in order, in one atomic ledger write. While it waits for the disk,
            // verification goes on, so the next write is larger rather than later. Events with
            // steps to run are handed to tasks of their own, one subject's in order; the
            // writer goes on with the next batches meanwhile.
            group.addTask {
              await withTaskGroup(of: Void.self) { steps in
                while let ready = await queue.takeAll() {
                    var prepared = ready[0].prepared
                    var messages = ready[0].messages
                    var intake = ready[0].intake
                    for next in ready.dropFirst() {
                        precondition(prepared.count == intake.count, "only the last batch may be cut")
                        prepared.append(next.prepared)
                        messages += next.messages
                        intake += next.intake
                    }
                    let recorded = await processor.record(prepared, intake)
                    // Finished out of order is fine: the commit point stops at the first
                    // message not finished (an abandoned one is never finished).
                    consumer.finished(zip(messages, recorded.dispositions).lazy.filter {
                        if let d = $0.1 { d != .abandoned } else { false }
                    }.map(\.0))
                    for work in recorded.work {
                        let message = messages[work.position]
                        let subjectKey = work.subjectKey
                        let turn = lanes.enter(subjectKey)
                        steps.addTask {
                            // A later event of this subject must not act before this one: when
                            // one is abandoned (stopping), the subject's later ones are too.
                            var done = await turn.previous?.wait() ?? true
                            if done {
                                done = await processor.run(work) != .abandoned
                                if done { consumer.finished(message) }
                            }
                            turn.mine.open(passed: done)
                            lanes.leave(subjectKey, turn.mine)
                        }
                    }
                }
                await steps.waitForAll()
              }
            }
            // Verification runs one batch ahead of the rest of preparation (the ledger rows, dead
            // letters, subjects and plans), so the cores are not left to one task meanwhile.
            let checkedQueue = BatchQueue<CheckedBatch>(limit: Self.checkedAhead)
            group.addTask {
                for await batch in consumer.batches {
                    metrics.received(source: "kafka", count: batch.count)
                    let receivedAt = Date().timeIntervalSince1970
                    let intake = batch.map { IntakeMessage(value: $0.value, source: $0.address(prefix: "kafka:"), receivedAt: receivedAt) }
                    await checkedQueue.push(CheckedBatch(messages: batch, intake: intake, checked: await processor.check(intake)))
                }
                checkedQueue.close()
            }
            var cut = false
            while let batches = await checkedQueue.takeAll() {
                for batch in batches {
                    // After a cut batch, later messages must not overtake the ones left behind.
                    if cut { continue }
                    let prepared = await processor.prepare(batch.intake, checked: batch.checked)
                    if prepared.count < batch.messages.count {
                        cut = true
                        logger.info("left for redelivery", metadata: ["warden.messages": "\(batch.messages.count - prepared.count)"])
                    }
                    await queue.push(PreparedBatch(messages: batch.messages, intake: batch.intake, prepared: prepared))
                }
            }
            queue.close()
        }
        // Everything fetched is done: commit and leave the group.
        processor.stop.stop()
        consumer.close()
    }

    /// Verified messages that may wait for the ledger at once; verification pauses beyond it.
    static let maximumUnwritten = 16_384

    /// Verified messages that may wait for the rest of their preparation: one batch verified
    /// ahead while the one before is prepared.
    static let checkedAhead = 1

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

    /// What a dead letter keeps of a value the cluster will not take whole.
    static let truncatedBytes = 16 * 1024

    public func deadLetter(value: [UInt8], code: String, description: String, source: String) async throws(DeadLetterError) {
        let address = source.hasPrefix("kafka:") ? String(source.dropFirst("kafka:".count)) : source
        var headers = [
            KafkaHeader("warden-error", code),
            KafkaHeader("warden-error-description", description),
            KafkaHeader("warden-source", address),
        ]
        do {
            do {
                _ = try await producer.send(topic: topic, value: value, headers: headers)
            } catch where error.isMessageTooLarge && value.count > Self.truncatedBytes {
                // The original cannot be produced whole (a junk message of about the size
                // limit, plus our headers): a truncated copy goes instead, saying so; the
                // ledger's record of the delivery keeps the whole value.
                headers.append(KafkaHeader("warden-truncated", "\(value.count) bytes, the first \(Self.truncatedBytes) kept; sha256 "
                                           + TokenFingerprint.fingerprint(value)))
                _ = try await producer.send(topic: topic, value: Array(value.prefix(Self.truncatedBytes)), headers: headers)
            }
        } catch {
            throw DeadLetterError(error.description, isRetryable: error.isRetryable)
        }
    }
}

/// Batches handed from one stage of the intake to the next, in arrival order. `push` waits
/// while `limit` messages are already waiting; `takeAll` waits for at least one batch.
final class BatchQueue<Item: IntakeBatch>: Sendable {
    private struct State {
        var items: [Item] = []
        var waiting = 0
        var closed = false
        var reader: CheckedContinuation<[Item]?, Never>? = nil
        var writers: [CheckedContinuation<Void, Never>] = []
    }

    private let limit: Int
    private let state = Mutex(State())

    init(limit: Int) { self.limit = limit }

    func push(_ item: Item) async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let (reader, items, proceed) = state.withLock { s -> (CheckedContinuation<[Item]?, Never>?, [Item], Bool) in
                s.items.append(item)
                s.waiting += item.messages.count
                if let reader = s.reader {
                    s.reader = nil
                    let items = s.items
                    s.items = []
                    s.waiting = 0
                    return (reader, items, true)
                }
                if s.waiting < limit { return (nil, [], true) }
                s.writers.append(continuation)
                return (nil, [], false)
            }
            reader?.resume(returning: items)
            if proceed { continuation.resume() }
        }
    }

    func takeAll() async -> [Item]? {
        await withCheckedContinuation { (continuation: CheckedContinuation<[Item]?, Never>) in
            let (taken, released) = state.withLock { s -> ([Item]??, [CheckedContinuation<Void, Never>]) in
                if s.items.isEmpty {
                    if s.closed { return (.some(nil), []) }
                    s.reader = continuation
                    return (nil, [])
                }
                let items = s.items
                s.items = []
                s.waiting = 0
                defer { s.writers = [] }
                return (.some(items), s.writers)
            }
            for writer in released { writer.resume() }
            if let taken { continuation.resume(returning: taken) }
        }
    }

    func close() {
        let reader = state.withLock { s -> CheckedContinuation<[Item]?, Never>? in
            s.closed = true
            defer { s.reader = nil }
            return s.items.isEmpty ? s.reader : nil
        }
        reader?.resume(returning: nil)
    }
}

/// What the intake's stages hand on: a batch of Kafka messages and what was made of them.
protocol IntakeBatch: Sendable {
    var messages: [KafkaMessage] { get }
}

/// Verified batches, between verification and the rest of preparation.
struct CheckedBatch: IntakeBatch {
    var messages: [KafkaMessage]
    var intake: [IntakeMessage]
    var checked: EventProcessor.Checked
}

/// Prepared batches, between preparation and the ledger writer.
struct PreparedBatch: IntakeBatch {
    var messages: [KafkaMessage]
    var intake: [IntakeMessage]
    var prepared: EventProcessor.Prepared
}

typealias WriteQueue = BatchQueue<PreparedBatch>

/// Keeps one subject's events in order while different subjects' run at once: each event
/// waits for the gate of the subject's previous event, which opens when that one is done.
final class SubjectLanes: Sendable {
    struct Turn: Sendable {
        let previous: Gate?
        let mine: Gate
    }

    private let last = Mutex<[String: Gate]>([:])

    func enter(_ key: String) -> Turn {
        let gate = Gate()
        let previous = last.withLock { lanes -> Gate? in
            defer { lanes[key] = gate }
            return lanes[key]
        }
        return Turn(previous: previous, mine: gate)
    }

    /// Forgets the subject's lane when `gate` is still its last one.
    func leave(_ key: String, _ gate: Gate) {
        last.withLock { lanes in if lanes[key] === gate { lanes[key] = nil } }
    }
}

/// Opens once, telling whether the event before passed (its steps done) or was abandoned;
/// `wait` returns that once it is open.
final class Gate: Sendable {
    private let state = Mutex<(passed: Bool?, waiters: [CheckedContinuation<Bool, Never>])>((nil, []))

    func open(passed: Bool) {
        let waiters = state.withLock { s -> [CheckedContinuation<Bool, Never>] in
            s.passed = passed
            defer { s.waiters = [] }
            return s.waiters
        }
        for waiter in waiters { waiter.resume(returning: passed) }
    }

    func wait() async -> Bool {
        await withCheckedContinuation { (continuation: CheckedContinuation<Bool, Never>) in
            let passed = state.withLock { s -> Bool? in
                if s.passed == nil { s.waiters.append(continuation) }
                return s.passed
            }
            if let passed { continuation.resume(returning: passed) }
        }
    }
}
