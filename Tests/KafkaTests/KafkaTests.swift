import Foundation
@testable import Kafka
import Logging
import Testing
import WardenTestSupport

/// Against librdkafka's mock cluster over TCP, with kcat as an independent client.
@Suite("Kafka over the mock cluster", .serialized, .timeLimit(.minutes(3)))
struct KafkaTests {
    static var logger: Logger {
        var logger = Logger(label: "kafka-test")
        logger.logLevel = .critical
        return logger
    }

    static let fastGroup: KafkaProperties = ["session.timeout.ms": "6000", "heartbeat.interval.ms": "500"]

    /// Produces `values` with kcat (one message per line) to one partition.
    static func kcatProduce(_ brokers: String, topic: String, partition: Int, lines: [String], key: String? = nil) async throws {
        var arguments = ["-P", "-b", brokers, "-t", topic, "-p", "\(partition)"]
        if key != nil { arguments += ["-K", "\t"] }
        let text = lines.map { line in key.map { "\($0)\t\(line)" } ?? line }.joined(separator: "\n") + "\n"
        let result = try await runToEnd(URL(fileURLWithPath: "/usr/bin/kcat"), arguments, stdin: text)
        #expect(result.status == 0, "kcat failed: \(result.stderr.suffix(2000))")
    }

    /// Reads `count` messages (or gives up after `timeout` seconds), finishing those `finish` accepts.
    static func read(_ consumer: KafkaConsumer, count: Int, timeout: Double = 60,
                     finish: @escaping @Sendable (KafkaMessage) -> Bool = { _ in true }) async throws -> [KafkaMessage] {
        try await withThrowingTaskGroup(of: [KafkaMessage]?.self) { group in
            group.addTask {
                var out: [KafkaMessage] = []
                for await message in consumer.messages {
                    out.append(message)
                    if finish(message) { consumer.finished(message) }
                    if out.count == count { break }
                }
                return out
            }
            group.addTask {
                try await Task.sleep(for: .seconds(timeout))
                return nil
            }
            let first = try await group.next()!
            group.cancelAll()
            return first ?? []
        }
    }

    @Test func consumesWhatKcatProducesAndCommitsOnlyFinishedOffsets() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("t1", 2)], logger: Self.logger)
        try await Self.kcatProduce(cluster.bootstrapServers, topic: "t1", partition: 0, lines: (0..<10).map { "message-\($0)" }, key: "user-1")

        let configuration = KafkaConsumerConfiguration(bootstrapServers: cluster.bootstrapServers, groupID: "g1", topics: ["t1"],
                                                       properties: Self.fastGroup, commitInterval: .milliseconds(200))
        let first = try KafkaConsumer(configuration: configuration, logger: Self.logger)
        async let firstRun: Void = first.run()
        // Offset 5 is never finished: the commit point must stop there although 6…9 finish.
        let messages = try await Self.read(first, count: 10) { $0.offset != 5 }
        #expect(messages.map(\.offset) == Array(0..<10))
        #expect(messages.map { String(decoding: $0.value, as: UTF8.self) } == (0..<10).map { "message-\($0)" })
        #expect(messages.allSatisfy { $0.key == Array("user-1".utf8) && $0.partition == 0 })
        first.close()
        try await firstRun

        let second = try KafkaConsumer(configuration: configuration, logger: Self.logger)
        async let secondRun: Void = second.run()
        let again = try await Self.read(second, count: 5)
        #expect(again.map(\.offset) == [5, 6, 7, 8, 9])
        second.close()
        try await secondRun
    }

    // Commits the cluster refuses are counted, and the committed offset reported is the one the
    // cluster confirmed, not the one last sent: lag does not look healthy while nothing commits.
    @Test func refusedCommitsAreCountedAndOnlyConfirmedOffsetsReported() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("t5", 1)], logger: Self.logger)
        try await Self.kcatProduce(cluster.bootstrapServers, topic: "t5", partition: 0, lines: (0..<5).map { "m-\($0)" })
        let configuration = KafkaConsumerConfiguration(bootstrapServers: cluster.bootstrapServers, groupID: "g5", topics: ["t5"],
                                                       properties: Self.fastGroup, commitInterval: .milliseconds(200))
        let consumer = try KafkaConsumer(configuration: configuration, logger: Self.logger)
        async let run: Void = consumer.run()
        cluster.failOffsetCommits(1000)
        #expect(try await Self.read(consumer, count: 5).count == 5)
        for _ in 0..<100 where consumer.commitFailureCount < 3 { try await Task.sleep(for: .milliseconds(100)) }
        #expect(consumer.commitFailureCount >= 3)
        #expect(consumer.partitionStatus().allSatisfy { $0.committed == nil }, "\(consumer.partitionStatus())")
        consumer.close()
        try await run

        // A cluster that takes the commits: the confirmed offset is reported.
        let taking = try EmbeddedKafkaCluster(topics: [("t5", 1)], logger: Self.logger)
        try await Self.kcatProduce(taking.bootstrapServers, topic: "t5", partition: 0, lines: (0..<5).map { "m-\($0)" })
        let other = try KafkaConsumer(configuration: .init(bootstrapServers: taking.bootstrapServers, groupID: "g5", topics: ["t5"],
                                                           properties: Self.fastGroup, commitInterval: .milliseconds(200)),
                                      logger: Self.logger)
        async let otherRun: Void = other.run()
        #expect(try await Self.read(other, count: 5).count == 5)
        for _ in 0..<100 where other.partitionStatus().first?.committed != 5 { try await Task.sleep(for: .milliseconds(100)) }
        #expect(other.partitionStatus().map(\.committed) == [5])
        #expect(other.commitFailureCount == 0)
        other.close()
        try await otherRun
    }

    @Test func producerReportsDeliveryAndHeadersArriveIntact() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("t2", 1)], logger: Self.logger)
        let producer = try KafkaProducer(bootstrapServers: cluster.bootstrapServers, logger: Self.logger)
        var offsets: [Int64] = []
        for i in 0..<3 {
            let report = try await producer.send(topic: "t2", key: Array("k".utf8), value: Array("v\(i)".utf8),
                                                 headers: [KafkaHeader("warden-error", "invalid_key"), KafkaHeader("empty", nil)])
            offsets.append(report.offset)
        }
        #expect(offsets == [0, 1, 2])
        producer.close()

        let consumer = try KafkaConsumer(configuration: .init(bootstrapServers: cluster.bootstrapServers, groupID: "g2",
                                                              topics: ["t2"], properties: Self.fastGroup), logger: Self.logger)
        async let run: Void = consumer.run()
        let messages = try await Self.read(consumer, count: 3)
        #expect(messages.map { String(decoding: $0.value, as: UTF8.self) } == ["v0", "v1", "v2"])
        #expect(messages.first?.header("warden-error") == Array("invalid_key".utf8))
        #expect(messages.first?.headers.contains(KafkaHeader("empty", nil)) == true)
        consumer.close()
        try await run
    }

    /// Messages sent together land in their order, each with its report; a cluster that cannot
    /// be reached fails every one of them (none waits forever).
    @Test func messagesSentTogetherKeepTheirOrderAndEachIsReported() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("t3", 1)], logger: Self.logger)
        let producer = try KafkaProducer(bootstrapServers: cluster.bootstrapServers, logger: Self.logger)
        let reports = await producer.send(all: (0..<20).map { KafkaProducer.Outgoing(topic: "t3", key: Array("k".utf8), value: Array("v\($0)".utf8)) })
        #expect(try reports.map { try $0.get().offset } == (0..<20).map(Int64.init))
        #expect(await producer.send(all: []).isEmpty)
        producer.close()

        let nowhere = try KafkaProducer(bootstrapServers: "127.0.0.1:1", properties: ["message.timeout.ms": "500"], logger: Self.logger)
        let failed = await nowhere.send(all: (0..<5).map { KafkaProducer.Outgoing(topic: "t3", key: nil, value: Array("x\($0)".utf8)) })
        #expect(failed.count == 5)
        #expect(failed.allSatisfy { if case .failure = $0 { true } else { false } })
        nowhere.close()
    }

    @Test func unknownPropertyIsRefusedByName() throws {
        #expect {
            _ = try KafkaProducer(bootstrapServers: "127.0.0.1:1", properties: ["no.such.property": "1"], logger: Self.logger)
        } throws: { error in
            guard let error = error as? KafkaError else { return false }
            return error.kind == .configuration && error.message.contains("no.such.property")
        }
    }

    @Test func twoMembersSplitPartitionsAndTheSurvivorTakesOver() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("t3", 4)], logger: Self.logger)
        let configuration = KafkaConsumerConfiguration(bootstrapServers: cluster.bootstrapServers, groupID: "g3", topics: ["t3"],
                                                       properties: Self.fastGroup, commitInterval: .milliseconds(200))
        let a = try KafkaConsumer(configuration: configuration, logger: Self.logger)
        let b = try KafkaConsumer(configuration: configuration, logger: Self.logger)
        async let runA: Void = a.run()
        async let runB: Void = b.run()
        // Wait until both hold partitions.
        for _ in 0..<300 {
            if !a.partitionStatus().isEmpty, !b.partitionStatus().isEmpty,
               a.partitionStatus().count + b.partitionStatus().count == 4 { break }
            try await Task.sleep(for: .milliseconds(100))
        }
        let heldByA = Set(a.partitionStatus().map(\.partition.partition))
        let heldByB = Set(b.partitionStatus().map(\.partition.partition))
        #expect(heldByA.isDisjoint(with: heldByB))
        #expect(heldByA.union(heldByB) == [0, 1, 2, 3])

        a.close()
        try await runA
        for p in 0..<4 { try await Self.kcatProduce(cluster.bootstrapServers, topic: "t3", partition: p, lines: ["after-\(p)"]) }
        // The survivor takes over every partition. A message may come twice (a rebalance can
        // move a partition before its commit lands); that is what the ledger absorbs.
        var seen: [Int32: String] = [:]
        for await message in b.messages {
            seen[message.partition] = String(decoding: message.value, as: UTF8.self)
            b.finished(message)
            if seen.count == 4 { break }
        }
        #expect(seen == [0: "after-0", 1: "after-1", 2: "after-2", 3: "after-3"])
        b.close()
        try await runB
    }
}
