import CoreMetrics
import Foundation
import Invalidation
import Kafka
import Ledger
import Logging
import Prometheus
@testable import Pipeline
import Synchronization
import Testing
import TokenVerification
import WardenTestSupport

/// Dead letters that cannot be produced whole, or at all: one message that can never be
/// dead-lettered must not stop the messages after it.
@Suite("Dead letters that cannot be produced", .serialized, .timeLimit(.minutes(2)))
struct DeadLetterTests {
    static var logger: Logger {
        var logger = Logger(label: "dead-letter-test")
        logger.logLevel = .critical
        return logger
    }

    // A junk message of about the cluster's size limit: with Warden's headers its dead letter
    // is over the limit, so a truncated copy goes instead, saying so.
    @Test func aValueTooLargeToDeadLetterWholeGoesAsATruncatedCopy() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("dlq", 1)], logger: Self.logger)
        let producer = try KafkaProducer(bootstrapServers: cluster.bootstrapServers, logger: Self.logger)
        let sink = KafkaDeadLetters(producer: producer, topic: "dlq")
        let junk = [UInt8](repeating: UInt8(ascii: "j"), count: 999_900)
        try await sink.deadLetter(value: junk, code: "invalid_request", description: "the token is 999900 bytes; the limit is 65536",
                                  source: "kafka:security-events/0/7")
        // The original's key and headers are kept (a stale warden-error of an earlier pass is replaced).
        try await sink.deadLetter(value: Array("small".utf8), key: Array("user-7".utf8),
                                  headers: [MessageHeader(name: "content-type", value: Array("application/secevent+jwt".utf8)),
                                            MessageHeader(name: "trace", value: nil),
                                            MessageHeader(name: "warden-error", value: Array("old".utf8))],
                                  code: "invalid_key", description: "bad signature", source: "kafka:security-events/0/8")
        // A small value whose own headers (and key) put it over the limit: the copy leaves them out.
        try await sink.deadLetter(value: Array("small-too".utf8), key: [UInt8](repeating: UInt8(ascii: "k"), count: 2000),
                                  headers: [MessageHeader(name: "pad", value: [UInt8](repeating: UInt8(ascii: "p"), count: 999_000))],
                                  code: "invalid_request", description: "not a token", source: "kafka:security-events/0/9")
        producer.close()
        let consumer = try KafkaConsumer(configuration: .init(bootstrapServers: cluster.bootstrapServers, groupID: "dlq-reader",
                                                              topics: ["dlq"], properties: ["session.timeout.ms": "6000"]),
                                         logger: Self.logger)
        async let run: Void = consumer.run()
        var messages: [KafkaMessage] = []
        for await batch in consumer.batches {
            messages += batch
            if messages.count >= 3 { break }
        }
        consumer.close()
        try await run
        try #require(messages.count == 3)
        #expect(messages[2].value == Array("small-too".utf8))
        #expect(messages[2].key == nil && messages[2].header("pad") == nil)
        #expect(messages[2].header("warden-error") == Array("invalid_request".utf8))
        let leftOut = String(decoding: messages[2].header("warden-truncated") ?? [], as: UTF8.self)
        #expect(leftOut.hasPrefix("9 bytes, the first 9 kept; sha256 ") && leftOut.hasSuffix("; the original's 1 headers left out; its key (2000 bytes) left out"),
                "\(leftOut)")
        #expect(messages[0].value.count == KafkaDeadLetters.truncatedBytes)
        #expect(messages[0].header("warden-error") == Array("invalid_request".utf8))
        #expect(messages[0].header("warden-source") == Array("security-events/0/7".utf8))
        let truncated = String(decoding: messages[0].header("warden-truncated") ?? [], as: UTF8.self)
        #expect(truncated.hasPrefix("999900 bytes, the first 16384 kept; sha256 "))
        #expect(messages[1].value == Array("small".utf8))
        #expect(messages[1].header("warden-truncated") == nil)
        #expect(messages[1].key == Array("user-7".utf8))
        #expect(messages[1].header("content-type") == Array("application/secevent+jwt".utf8))
        #expect(messages[1].headers.contains { $0.name == "trace" && $0.value == nil })
        #expect(messages[1].headers.filter { $0.name == "warden-error" }.map(\.value) == [Array("invalid_key".utf8)])
    }

    /// Counts the attempts of another sink.
    final class CountingSink: DeadLetterSink {
        let inner: any DeadLetterSink
        let attempts = Mutex(0)
        init(_ inner: any DeadLetterSink) { self.inner = inner }
        func deadLetter(value: [UInt8], key: [UInt8]?, headers: [MessageHeader], code: String, description: String,
                        source: String) async throws(DeadLetterError) {
            attempts.withLock { $0 += 1 }
            try await inner.deadLetter(value: value, key: key, headers: headers, code: code, description: description, source: source)
        }
    }

    // A producer that failed fatally can never send again, but that is no fault of the message:
    // its dead letter is retried (not kept in the ledger only and committed) until the process
    // stops, which a fatal producer error makes it do; the message is then left unsettled, to be
    // read again after the restart.
    @Test func aFatallyFailedProducerLeavesTheMessageForTheNextProcess() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("dlq", 1)], logger: Self.logger)
        let producer = try KafkaProducer(bootstrapServers: cluster.bootstrapServers, logger: Self.logger)
        defer { producer.close(timeout: 0) }
        #expect(producer.fatalError == nil)
        let sink = CountingSink(KafkaDeadLetters(producer: producer, topic: "dlq"))
        func deadLetterIsRetried() async {
            do {
                try await sink.deadLetter(value: Array("junk".utf8), code: "invalid_request", description: "not a token", source: "kafka:t/0/0")
                Issue.record("a failed producer sent a dead letter")
            } catch {
                #expect(error.isRetryable, "\(error)")
            }
        }
        producer.failFatally("sequence lost in a test")
        // At once, before the error callback has run: librdkafka refuses the send with _FATAL.
        #expect(producer.fatalError?.contains("sequence lost in a test") == true)
        await deadLetterIsRetried()
        let failure = await producer.failure()
        #expect(failure?.contains("sequence lost in a test") == true, "\(failure ?? "nil")")
        await deadLetterIsRetried()

        let path = Scratch.path("dlq-fatal", extension: "sqlite")
        defer { try? FileManager.default.removeItem(atPath: path) }
        let ledger = try SQLiteLedger(path: path)
        let stop = StopSignal()
        let processor = EventProcessor(verifier: SETVerifier(issuers: []), ledger: ledger, deadLetters: sink,
                                       metrics: WardenMetrics(factory: PrometheusMetricsFactory(registry: PrometheusCollectorRegistry())),
                                       logger: Self.logger, stop: stop)
        let stopper = Task {
            while sink.attempts.withLock({ $0 }) < 3 { try await Task.sleep(for: .milliseconds(20)) }
            stop.stop()
        }
        let settled = await Settled.run(EventPipeline(processor: processor), [[IntakeMessage(value: Array("junk".utf8), source: "kafka:t/0/1", receivedAt: 1)]])
        stopper.cancel()
        #expect(settled == [.abandoned])
        #expect(sink.attempts.withLock { $0 } >= 3)
        #expect(try ledger.deliveries().isEmpty)
        await ledger.close()
    }

    /// A sink that refuses every dead letter for good, counting the attempts.
    final class RefusingSink: DeadLetterSink {
        let attempts = Mutex(0)
        func deadLetter(value: [UInt8], key: [UInt8]?, headers: [MessageHeader], code: String, description: String,
                        source: String) async throws(DeadLetterError) {
            attempts.withLock { $0 += 1 }
            throw DeadLetterError("MSG_SIZE_TOO_LARGE even truncated", isRetryable: false)
        }
    }

    // A dead letter the cluster will never take: the message is recorded in the ledger (kept
    // there only), committed, and the next message is handled — no retry for ever.
    @Test func aDeadLetterRefusedForGoodIsKeptInTheLedgerAndTheIntakeGoesOn() async throws {
        let path = Scratch.path("dlq", extension: "sqlite")
        defer { try? FileManager.default.removeItem(atPath: path) }
        let ledger = try SQLiteLedger(path: path)
        let sink = RefusingSink()
        let registry = PrometheusCollectorRegistry()
        let processor = EventProcessor(verifier: SETVerifier(issuers: []), ledger: ledger, deadLetters: sink,
                                       metrics: WardenMetrics(factory: PrometheusMetricsFactory(registry: registry)), logger: Self.logger,
                                       stop: StopSignal())
        let batch = ["junk-1", "junk-2"].enumerated().map { i, value in
            IntakeMessage(value: Array(value.utf8), source: "kafka:t/0/\(i)", receivedAt: 1)
        }
        let settled = await Settled.run(EventPipeline(processor: processor), [batch])
        #expect(settled.map(\.code) == ["invalid_request", "invalid_request"])
        #expect(sink.attempts.withLock { $0 } == 2)
        #expect(try ledger.deliveries().map(\.verdict) == ["invalid", "invalid"])
        // Counted as what they are: failed for good, not dead-lettered.
        var text: [UInt8] = []
        registry.emit(into: &text)
        let metrics = String(decoding: text, as: UTF8.self)
        #expect(metrics.contains("warden_dead_letters_total 0"), "\(metrics)")
        #expect(metrics.contains(#"warden_permanent_failures_total{what="dead-letter"} 2"#), "\(metrics)")
        await ledger.close()
    }
}
