internal import CRdkafka
import Foundation
public import Logging
import Synchronization

/// How a consumer joins its group and what it reads.
public struct KafkaConsumerConfiguration: Sendable {
    public var bootstrapServers: String
    public var groupID: String
    public var topics: [String]
    /// Passed to librdkafka after Warden's defaults, so they may override them
    /// (e.g. `auto.offset.reset`, `session.timeout.ms`, `security.protocol`).
    public var properties: KafkaProperties
    /// Messages handed out but not yet finished before fetching pauses. Default 4096.
    public var maximumInFlight: Int
    /// How often finished offsets are committed. Default 1 s.
    public var commitInterval: Duration
    /// How long a revocation waits for work under way on the revoked partitions' messages
    /// (see `PartitionAssignment`). Default 15 s: longer than one call to a target.
    public var revocationGrace: Duration

    public init(bootstrapServers: String, groupID: String, topics: [String], properties: KafkaProperties = [:],
                maximumInFlight: Int = 4096, commitInterval: Duration = .seconds(1), revocationGrace: Duration = .seconds(15)) {
        self.bootstrapServers = bootstrapServers
        self.groupID = groupID
        self.topics = topics
        self.properties = properties
        self.maximumInFlight = maximumInFlight
        self.commitInterval = commitInterval
        self.revocationGrace = revocationGrace
    }

    /// Offsets are committed only by `finished`; a new group starts at the earliest offset (a
    /// security event published before the first start must not be missed); cooperative
    /// rebalancing keeps partitions that do not move flowing during a rebalance.
    var effectiveProperties: KafkaProperties {
        var p: KafkaProperties = [
            "bootstrap.servers": bootstrapServers,
            "group.id": groupID,
            "enable.auto.commit": "false",
            "enable.auto.offset.store": "false",
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.partition.eof": "false",
        ]
        for (name, value) in properties.values { p[name] = value }
        return p
    }
}

/// State shared by the poll thread, librdkafka's rebalance callback (which runs on the poll
/// thread) and the tasks that finish messages.
final class ConsumerState: Sendable {
    let tracker = Mutex(OffsetTracker())
    /// Offset commits the cluster refused or that could not be sent, partition by partition.
    let commitFailures = Atomic<Int>(0)
    /// The lifecycle: what the poll thread does next.
    let machine: Mutex<ConsumerStateMachine>
    let revocationGrace: Duration
    /// Signalled when messages finish while the poll thread waits for room.
    let room = DispatchSemaphore(value: 0)
    /// Whether the poll thread waits on `room` (so finishing messages signal it only then).
    let waitingForRoom = Atomic(false)
    /// A poll thread waiting for room is woken once no more than this many messages are in
    /// flight: room for a whole poll round, not one wake (two thread switches) per message
    /// finished while the intake is full.
    let roomAt: Int
    /// `maximumInFlight`.
    let budget: Int

    /// Wakes the poll thread if it waits for room and `inFlight` leaves enough.
    func madeRoom(inFlight: Int) {
        if inFlight <= roomAt, waitingForRoom.exchange(false, ordering: .acquiringAndReleasing) { room.signal() }
    }

    init(maximumInFlight: Int, revocationGrace: Duration) {
        self.machine = Mutex(ConsumerStateMachine(maximumInFlight: maximumInFlight))
        self.revocationGrace = revocationGrace
        self.roomAt = maximumInFlight - max(1, min(KafkaConsumer.maximumBatch, maximumInFlight / 8))
        self.budget = maximumInFlight
    }
}

/// A member of a Kafka consumer group. Messages arrive through `messages`; each must be passed
/// to `finished` once its outcome is durable, and only then can its offset be committed.
/// Offsets are committed periodically, before partitions are revoked, and on close.
///
/// librdkafka's blocking poll runs on a thread of its own, never on Swift's cooperative pool.
/// When too many messages are in flight the assigned partitions are paused, and polling goes on,
/// so the member stays in its group however long the work takes.
public final class KafkaConsumer: Sendable {
    /// Messages in the order they were fetched, in the batches one poll round produced.
    public let batches: AsyncStream<[KafkaMessage]>
    private let continuation: AsyncStream<[KafkaMessage]>.Continuation
    private let client: KafkaClient
    private let state: ConsumerState
    private let configuration: KafkaConsumerConfiguration
    private let logger: Logger

    public init(configuration: KafkaConsumerConfiguration, logger: Logger) throws(KafkaError) {
        let state = ConsumerState(maximumInFlight: max(1, configuration.maximumInFlight),
                                  revocationGrace: max(.zero, configuration.revocationGrace))
        let context = CallbackContext(logger: logger, consumer: state)
        self.client = try KafkaClient(role: .consumer, properties: configuration.effectiveProperties, context: context) { conf in
            rd_kafka_conf_set_rebalance_cb(conf, rebalanceCallback)
            rd_kafka_conf_set_offset_commit_cb(conf, offsetCommitCallback)
        }
        self.state = state
        self.configuration = configuration
        self.logger = logger
        (batches, continuation) = AsyncStream.makeStream(of: [KafkaMessage].self)

        rd_kafka_poll_set_consumer(client.handle)
        let topics = rd_kafka_topic_partition_list_new(Int32(configuration.topics.count))!
        defer { rd_kafka_topic_partition_list_destroy(topics) }
        for topic in configuration.topics { rd_kafka_topic_partition_list_add(topics, topic, RD_KAFKA_PARTITION_UA) }
        let err = rd_kafka_subscribe(client.handle, topics)
        guard err == RD_KAFKA_RESP_ERR_NO_ERROR else {
            throw KafkaError.code(err, "cannot subscribe to \(configuration.topics.joined(separator: ", "))")
        }
    }

    /// Polls until `close()`; then commits what is finished and leaves the group. Throws when
    /// librdkafka reports a fatal error (the stream of messages ends first).
    public func run() async throws(KafkaError) {
        let failure: String? = await withCheckedContinuation { (done: CheckedContinuation<String?, Never>) in
            let thread = Thread { [self] in
                done.resume(returning: self.pollLoop())
            }
            thread.name = "warden-kafka-consumer"
            thread.start()
        }
        if let failure { throw KafkaError(.fatal, "Kafka consumer stopped: \(failure)") }
    }

    /// Every message, one at a time.
    public var messages: KafkaMessages { KafkaMessages(batches: batches) }

    /// The message's outcome is durable: its offset may be committed once every earlier
    /// message of its partition is finished too.
    public func finished(_ message: KafkaMessage) {
        let active = state.tracker.withLock {
            $0.finished(TopicPartition(message.topic, message.partition), offset: message.offset, assignment: message.assignment)
            return $0.load(budget: state.budget)
        }
        state.madeRoom(inFlight: active)
    }

    /// The message waits aside for its issuer's keys (or no longer does): while aside it does
    /// not count against `maximumInFlight`, so other issuers' messages keep being fetched (the
    /// pipeline bounds what may wait). It still holds back its partition's commit point.
    public func setAside(_ message: KafkaMessage, _ aside: Bool) {
        let active = state.tracker.withLock {
            $0.setAside(TopicPartition(message.topic, message.partition), assignment: message.assignment, aside)
            return $0.load(budget: state.budget)
        }
        state.madeRoom(inFlight: active)
    }

    /// Stops handing out messages (the stream ends) while staying in the group, so in-flight
    /// work can finish and be committed.
    public func stopFetching() {
        state.machine.withLock { $0.stopFetching() }
    }

    /// Commits what is finished, leaves the group and ends `run()`.
    public func close() {
        state.machine.withLock { $0.close() }
    }

    /// Whether the member has received an assignment (possibly empty) from its group.
    public var hasJoinedGroup: Bool { state.machine.withLock { $0.joined } }

    /// Per assigned partition: the offset last committed and the messages still in flight.
    /// `committed`: the offset the cluster last confirmed committed (not merely sent).
    public func partitionStatus() -> [(partition: TopicPartition, committed: Int64?, inFlight: Int)] {
        state.tracker.withLock { tracker in
            tracker.partitions.map { ($0.key, $0.value.confirmed, $0.value.inFlight) }
        }
    }

    /// Offset commits failed so far (each partition of a failed commit counts once).
    public var commitFailureCount: Int { state.commitFailures.load(ordering: .relaxed) }

    /// The partition's high watermark as last seen in a fetch (librdkafka's cached value; no
    /// request is made), or nil before any fetch.
    public func highWatermark(of partition: TopicPartition) -> Int64? {
        var low: Int64 = -1, high: Int64 = -1
        let error = rd_kafka_get_watermark_offsets(client.handle, partition.topic, partition.partition, &low, &high)
        return error == RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0 ? high : nil
    }

    // MARK: - The poll thread

    private func pollLoop() -> String? {
        let rk = client.handle
        var lastCommit = ContinuousClock.now
        while true {
            if let fatal = client.fatalError {
                state.machine.withLock { $0.failed() }
                continuation.finish()
                rd_kafka_consumer_close(rk)
                return fatal
            }
            // Messages waiting aside for keys do not count (the pipeline bounds them); the time
            // is monotonic, so a clock stepped back cannot keep the loop from pausing.
            let active = state.tracker.withLock { $0.load(budget: state.budget) }
            let now = Double(DispatchTime.now().uptimeNanoseconds) / 1e9
            switch state.machine.withLock({ $0.next(inFlight: active, now: now) }) {
            case .finishStream:
                continuation.finish()
            case .pause:
                setPaused(true)
            case .resume:
                setPaused(false)
            case .waitForRoom:
                // Finished messages wake this once there is room for a poll round; commits go on
                // meanwhile. In-flight is read again once the flag is up: messages finished just
                // before then woke no one.
                state.waitingForRoom.store(true, ordering: .sequentiallyConsistent)
                if state.tracker.withLock({ $0.load(budget: state.budget) }) > state.roomAt {
                    _ = state.room.wait(timeout: .now() + .milliseconds(100))
                }
                commitIfDue(&lastCommit)
            case .poll(let deliver):
                poll(deliver: deliver)
                commitIfDue(&lastCommit)
            case .leave(let finishStream):
                if finishStream { continuation.finish() }
                leave()
                return nil
            case .exit:
                return nil
            }
        }
    }

    /// One blocking poll, then whatever else is ready, handed out as one batch (when `deliver`).
    private func poll(deliver: Bool) {
        var owned: [KafkaMessage] = []
        var timeout: Int32 = 100
        while owned.count < Self.maximumBatch, let message = rd_kafka_consumer_poll(client.handle, timeout) {
            // Each message is tagged with its partition's assignment right after the poll that
            // returned it: a rebalance callback runs inside a poll, so a later poll of this round
            // may revoke (and reassign) the partition, and then this message belongs to the
            // earlier assignment. A message of a partition no longer assigned is not handed out.
            if var m = convert(message, deliver: deliver),
               let assignment = state.tracker.withLock({ tracker in
                   // A skipped record's report never goes behind what was handed out already.
                   m.deliveryError != nil && !tracker.isAhead(TopicPartition(m.topic, m.partition), offset: m.offset)
                       ? nil : tracker.handedOut(TopicPartition(m.topic, m.partition), offset: m.offset)
               }) {
                m.assignment = assignment
                owned.append(m)
            }
            rd_kafka_message_destroy(message)
            timeout = 0
        }
        if !owned.isEmpty { continuation.yield(owned) }
    }

    /// Commits what is finished and leaves the group.
    private func leave() {
        commit(synchronously: true)
        // Leaving the group runs the revoke callback, which commits once more.
        let err = rd_kafka_consumer_close(client.handle)
        if err != RD_KAFKA_RESP_ERR_NO_ERROR {
            logger.warning("Kafka consumer close reported an error", metadata: ["kafka.error": "\(String(cString: rd_kafka_err2name(err)))"])
        }
        // librdkafka 2.0.2 (Debian's) aborts destroying a cooperative-sticky member that joined
        // but never got its first assignment (its assignor state is still NULL; fixed upstream
        // in 2.3.0): a worker sent SIGTERM during a rebalance died with SIGABRT. Such a handle
        // is left to the exiting process instead of being destroyed.
        if !state.machine.withLock({ $0.joined }) { client.leaveUndestroyed() }
    }

    private func commitIfDue(_ lastCommit: inout ContinuousClock.Instant) {
        if ContinuousClock.now - lastCommit >= configuration.commitInterval {
            commit(synchronously: false)
            lastCommit = .now
        }
    }

    private func setPaused(_ pause: Bool) {
        let rk = client.handle
        var assignment: UnsafeMutablePointer<rd_kafka_topic_partition_list_t>? = nil
        guard rd_kafka_assignment(rk, &assignment) == RD_KAFKA_RESP_ERR_NO_ERROR, let assignment else { return }
        defer { rd_kafka_topic_partition_list_destroy(assignment) }
        _ = pause ? rd_kafka_pause_partitions(rk, assignment) : rd_kafka_resume_partitions(rk, assignment)
        logger.debug(pause ? "paused fetching" : "resumed fetching", metadata: ["kafka.partitions": "\(assignment.pointee.cnt)"])
    }

    /// Most messages handed out by one poll round.
    static let maximumBatch = 512

    private func convert(_ pointer: UnsafeMutablePointer<rd_kafka_message_t>, deliver: Bool) -> KafkaMessage? {
        Self.convert(pointer, deliver: deliver, logger: logger)
    }

    /// Errors librdkafka reports for one record that it then skips, fetching on from the next:
    /// the record at that offset is never delivered.
    static let skippedRecordErrors: Set<rd_kafka_resp_err_t.RawValue> = [
        RD_KAFKA_RESP_ERR__BAD_MSG.rawValue, RD_KAFKA_RESP_ERR__BAD_COMPRESSION.rawValue,
    ]

    /// A polled message as handed out, or nil. A record librdkafka could not deliver whole and
    /// skipped is handed out as a message with `deliveryError`, so that it is recorded and
    /// dead-lettered like any message that can never succeed, and the commit point does not
    /// pass it unseen. Other errors (a broker down, an offset reset) are logged.
    static func convert(_ pointer: UnsafeMutablePointer<rd_kafka_message_t>, deliver: Bool, logger: Logger) -> KafkaMessage? {
        let m = pointer.pointee
        if m.err != RD_KAFKA_RESP_ERR_NO_ERROR {
            guard m.err != RD_KAFKA_RESP_ERR__PARTITION_EOF else { return nil }
            let name = String(cString: rd_kafka_err2name(m.err))
            let detail = rd_kafka_message_errstr(pointer).map { String(cString: $0) } ?? ""
            guard skippedRecordErrors.contains(m.err.rawValue), m.rkt != nil, m.partition >= 0, m.offset >= 0 else {
                logger.warning("Kafka consumer error", metadata: ["kafka.error": "\(name)", "kafka.reason": "\(detail)"])
                return nil
            }
            guard deliver else { return nil }
            var message = KafkaMessage(copying: pointer)
            message.deliveryError = "\(name): \(detail)"
            logger.error("Kafka could not deliver a record whole; it is recorded and dead-lettered as unreadable", metadata: [
                "kafka.error": "\(name)", "kafka.reason": "\(detail)", "warden.source": "\(message.address(prefix: "kafka:"))",
            ])
            return message
        }
        // A message polled after fetching stopped is not handed out and not tracked: it is
        // fetched again by whoever owns the partition next.
        guard deliver else { return nil }
        return KafkaMessage(copying: pointer)
    }

    private func commit(synchronously: Bool) {
        let commits = state.tracker.withLock { $0.takeCommits() }
        Self.commit(client.handle, commits, synchronously: synchronously, state: state, logger: logger)
    }

    static func commit(_ rk: OpaquePointer, _ commits: [(TopicPartition, Int64)], synchronously: Bool,
                       state: ConsumerState, logger: Logger) {
        guard !commits.isEmpty else { return }
        let list = rd_kafka_topic_partition_list_new(Int32(commits.count))!
        defer { rd_kafka_topic_partition_list_destroy(list) }
        for (tp, offset) in commits {
            rd_kafka_topic_partition_list_add(list, tp.topic, tp.partition)!.pointee.offset = offset
        }
        let err = rd_kafka_commit(rk, list, synchronously ? 0 : 1)
        if err != RD_KAFKA_RESP_ERR_NO_ERROR {
            // Not committed: let the next round send these offsets again.
            state.tracker.withLock { tracker in tracker.forgetCommitted(commits.map(\.0)) }
            state.commitFailures.add(commits.count, ordering: .relaxed)
            logger.warning("Kafka offset commit failed", metadata: [
                "kafka.error": "\(String(cString: rd_kafka_err2name(err)))",
                "kafka.partitions": "\(commits.map { "\($0.0)@\($0.1)" }.joined(separator: ","))",
            ])
        } else if synchronously {
            state.tracker.withLock { tracker in for (tp, offset) in commits { tracker.confirmed(tp, offset: offset) } }
            logger.debug("committed offsets", metadata: ["kafka.partitions": "\(commits.map { "\($0.0)@\($0.1)" }.joined(separator: ","))"])
        }
    }
}

func partitions(of list: UnsafeMutablePointer<rd_kafka_topic_partition_list_t>) -> [TopicPartition] {
    let count = Int(list.pointee.cnt)
    return (0..<count).map { i in
        let element = list.pointee.elems[i]
        return TopicPartition(String(cString: element.topic), element.partition)
    }
}

/// Assignment changes. Before partitions go, what is finished for them is committed
/// synchronously; messages still in flight for them will be delivered again to their next owner
/// (the ledger's de-duplication absorbs that).
private let rebalanceCallback: @convention(c) (OpaquePointer?, rd_kafka_resp_err_t, UnsafeMutablePointer<rd_kafka_topic_partition_list_t>?, UnsafeMutableRawPointer?) -> Void = {
    rk, err, list, _ in
    guard let rk, let list, let context = CallbackContext.from(rk), let state = context.consumer else { return }
    // NULL while the group is being torn down (a rebalance during shutdown): never unwrapped.
    let cooperative = rd_kafka_rebalance_protocol(rk).map { String(cString: $0) == "COOPERATIVE" } ?? false
    let changed = partitions(of: list)
    switch err {
    case RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS:
        state.tracker.withLock { $0.assigned(changed) }
        if cooperative {
            if let error = rd_kafka_incremental_assign(rk, list) { rd_kafka_error_destroy(error) }
        } else {
            rd_kafka_assign(rk, list)
        }
        if state.machine.withLock({ $0.assigned() }) { rd_kafka_pause_partitions(rk, list) }
        context.logger.info("partitions assigned", metadata: ["kafka.partitions": "\(changed.map(\.description).joined(separator: ","))"])
    case RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS:
        // First the work under way for these partitions stops (no new call to a target starts,
        // and the calls already made end), so that their next owner never acts on an event
        // while this member still is; then what finished is committed, and the partitions go.
        let assignments = state.tracker.withLock { tracker in
            changed.flatMap { tp in tracker.partitions[tp].map { [$0.assignment] + $0.superseded } ?? [] }
        }
        let unfinished = PartitionAssignment.revoke(assignments, waitingUpTo: state.revocationGrace)
        if unfinished > 0 {
            context.logger.warning("work of revoked partitions still under way after the grace period", metadata: [
                "kafka.work": "\(unfinished)", "kafka.grace": "\(state.revocationGrace)",
            ])
        }
        let revoked = Set(changed)
        let commits = state.tracker.withLock { $0.takeCommits(only: revoked) }
        KafkaConsumer.commit(rk, commits, synchronously: true, state: state, logger: context.logger)
        _ = state.tracker.withLock { $0.revoked(changed) }
        if cooperative {
            if let error = rd_kafka_incremental_unassign(rk, list) { rd_kafka_error_destroy(error) }
        } else {
            rd_kafka_assign(rk, nil)
        }
        context.logger.info("partitions revoked", metadata: ["kafka.partitions": "\(changed.map(\.description).joined(separator: ","))"])
    default:
        context.logger.error("rebalance failed", metadata: ["kafka.error": "\(String(cString: rd_kafka_err2name(err)))"])
        if cooperative {
            if let error = rd_kafka_incremental_unassign(rk, list) { rd_kafka_error_destroy(error) }
        } else {
            rd_kafka_assign(rk, nil)
        }
    }
}

/// Results of asynchronous commits: a failed partition is sent again next round.
private let offsetCommitCallback: @convention(c) (OpaquePointer?, rd_kafka_resp_err_t, UnsafeMutablePointer<rd_kafka_topic_partition_list_t>?, UnsafeMutableRawPointer?) -> Void = {
    rk, err, list, _ in
    guard let context = CallbackContext.from(rk), let state = context.consumer, let list else { return }
    guard err != RD_KAFKA_RESP_ERR__NO_OFFSET else { return }
    var failed: [TopicPartition] = []
    var confirmed: [(TopicPartition, Int64)] = []
    for i in 0..<Int(list.pointee.cnt) {
        let element = list.pointee.elems[i]
        let tp = TopicPartition(String(cString: element.topic), element.partition)
        if err != RD_KAFKA_RESP_ERR_NO_ERROR || element.err != RD_KAFKA_RESP_ERR_NO_ERROR {
            failed.append(tp)
        } else {
            confirmed.append((tp, element.offset))
        }
    }
    if !confirmed.isEmpty { state.tracker.withLock { tracker in for (tp, offset) in confirmed { tracker.confirmed(tp, offset: offset) } } }
    if !failed.isEmpty {
        state.tracker.withLock { $0.forgetCommitted(failed) }
        state.commitFailures.add(failed.count, ordering: .relaxed)
        context.logger.warning("Kafka offset commit failed; will retry", metadata: [
            "kafka.error": "\(String(cString: rd_kafka_err2name(err)))",
            "kafka.partitions": "\(failed.map(\.description).joined(separator: ","))",
        ])
    }
}

/// The messages of a consumer's batches, one at a time.
public struct KafkaMessages: AsyncSequence, Sendable {
    public typealias Element = KafkaMessage
    let batches: AsyncStream<[KafkaMessage]>

    public struct AsyncIterator: AsyncIteratorProtocol {
        var batches: AsyncStream<[KafkaMessage]>.AsyncIterator
        var current: [KafkaMessage] = []
        var index = 0

        public mutating func next() async -> KafkaMessage? {
            while index >= current.count {
                guard let batch = await batches.next() else { return nil }
                current = batch
                index = 0
            }
            defer { index += 1 }
            return current[index]
        }
    }

    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(batches: batches.makeAsyncIterator()) }
}
