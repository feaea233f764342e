internal import CRdkafka
public import Logging

/// librdkafka's in-process mock cluster: real Kafka protocol on loopback TCP ports, so other
/// processes (kcat, confluent-kafka, another `warden`) can produce and consume. It lives as
/// long as this object. For development and tests only: data is in memory, and each partition
/// keeps only its most recent few megabytes.
public final class EmbeddedKafkaCluster: Sendable {
    /// `host:port,…` for `bootstrap.servers`.
    public let bootstrapServers: String
    private let client: KafkaClient
    private let cluster: MockClusterPointer

    public init(brokers: Int = 1, topics: [(name: String, partitions: Int)], logger: Logger) throws(KafkaError) {
        // This handle only hosts the cluster: its own notices ("no bootstrap.servers") are noise.
        self.client = try KafkaClient(role: .producer, properties: ["log_level": "4"],
                                      context: CallbackContext(logger: logger, consumer: nil))
        guard let cluster = rd_kafka_mock_cluster_new(client.handle, Int32(brokers)) else {
            throw KafkaError(.client, "cannot start the embedded Kafka cluster")
        }
        self.cluster = MockClusterPointer(pointer: cluster)
        self.bootstrapServers = String(cString: rd_kafka_mock_cluster_bootstraps(cluster))
        for topic in topics {
            try createTopic(topic.name, partitions: topic.partitions)
        }
    }

    /// Creates a topic (the mock does not support the Admin API's CreateTopics).
    public func createTopic(_ name: String, partitions: Int) throws(KafkaError) {
        let err = rd_kafka_mock_topic_create(cluster.pointer, name, Int32(partitions), 1)
        guard err == RD_KAFKA_RESP_ERR_NO_ERROR else { throw KafkaError.code(err, "cannot create topic \(name)") }
    }

    /// Makes the next `count` offset commits fail with `TOPIC_AUTHORIZATION_FAILED` (tests).
    func failOffsetCommits(_ count: Int) {
        // OffsetCommit is Kafka protocol request 8.
        let errors = [rd_kafka_resp_err_t](repeating: RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED, count: count)
        rd_kafka_mock_push_request_errors_array(cluster.pointer, 8, count, errors)
    }

    deinit {
        rd_kafka_mock_cluster_destroy(cluster.pointer)
        // `client` is destroyed after this, by its own deinit.
    }
}

/// `rd_kafka_mock_cluster_t *`.
///
/// `@unchecked Sendable`: the mock cluster runs on its own thread; the pointer is only used to
/// create topics (serialised by librdkafka) and destroyed once, by its owner.
struct MockClusterPointer: @unchecked Sendable {
    let pointer: OpaquePointer
}
