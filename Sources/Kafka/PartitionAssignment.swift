import Dispatch
import Synchronization

/// One assignment of a partition to this member, from the moment it is assigned until it is
/// revoked. Each message carries the assignment it was fetched under, so:
/// - finishing a message of an earlier assignment does nothing (after a revoke and a
///   reassignment, a late `finished` from before must not commit past the redelivered copy);
/// - work done on a message's behalf outside Kafka (a call to a target) is bracketed by
///   `beginWork`/`endWork`, and a revocation waits for the work under way to end and lets
///   no new work begin: the partition's next owner never runs a step while this one still is.
public final class PartitionAssignment: Sendable {
    public let partition: TopicPartition
    /// Increases with every assignment this member receives.
    public let generation: UInt64

    private struct State {
        var revoked = false
        var working = 0
        var drained: DispatchSemaphore? = nil
    }

    private let state = Mutex(State())

    init(partition: TopicPartition, generation: UInt64) {
        self.partition = partition
        self.generation = generation
    }

    /// Whether the partition was revoked from this assignment.
    public var isRevoked: Bool { state.withLock { $0.revoked } }

    /// Before work on a message's behalf: false once the partition is revoked (the work must
    /// not start). Each true is followed by one `endWork()`.
    public func beginWork() -> Bool {
        state.withLock { s in
            guard !s.revoked else { return false }
            s.working += 1
            return true
        }
    }

    public func endWork() {
        let drained = state.withLock { s -> DispatchSemaphore? in
            s.working -= 1
            return s.revoked && s.working == 0 ? s.drained : nil
        }
        drained?.signal()
    }

    /// Marks the assignment revoked and waits up to `seconds` for the work under way to end.
    /// Returns how many pieces of work were still under way when it stopped waiting. Blocks:
    /// called on the poll thread, inside librdkafka's rebalance callback.
    func revoke(waitingUpTo seconds: Double) -> Int {
        let semaphore = DispatchSemaphore(value: 0)
        let working = state.withLock { s -> Int in
            s.revoked = true
            if s.working > 0 { s.drained = semaphore }
            return s.working
        }
        guard working > 0 else { return 0 }
        if semaphore.wait(timeout: .now() + seconds) == .success { return 0 }
        return state.withLock { $0.working }
    }
}
