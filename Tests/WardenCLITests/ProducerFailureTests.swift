import Foundation
import Kafka
import Logging
import ServiceLifecycle
import Synchronization
import Testing
@testable import WardenCLI

/// A Kafka producer that fails fatally can never send again: `warden run` must not go on unable
/// to dead-letter or take a push, but stop gracefully and exit 1 for a fresh start.
@Suite("A fatally failed producer", .timeLimit(.minutes(2)))
struct ProducerFailureTests {
    /// Stands for the intake: runs until the group shuts it down gracefully.
    final class Intake: Service {
        let stoppedGracefully = Mutex(false)
        func run() async throws {
            try? await gracefulShutdown()
            stoppedGracefully.withLock { $0 = true }
        }
    }

    @Test func shutsTheGroupDownGracefullyWithTheProducersReason() async throws {
        let cluster = try EmbeddedKafkaCluster(topics: [("dlq", 1)], logger: WorkerTests.quiet)
        let producer = try KafkaProducer(bootstrapServers: cluster.bootstrapServers, logger: WorkerTests.quiet)
        let intake = Intake()
        let group = ServiceGroup(configuration: .init(
            services: [ProducerService.configuration(producer, "the dead-letter producer"), .init(service: intake)],
            logger: WorkerTests.quiet))
        async let run: Void = group.run()
        producer.failFatally("sequence lost in a test")
        do {
            try await run
            Issue.record("the group ended without the producer's failure")
        } catch let error as KafkaError {
            #expect(error.kind == .fatal)
            #expect("\(error)".contains("the dead-letter producer failed") && "\(error)".contains("sequence lost in a test"), "\(error)")
        }
        #expect(intake.stoppedGracefully.withLock { $0 })
    }
}
