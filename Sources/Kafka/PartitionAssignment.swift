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

    /// Marks the assignment revoked; the semaphore signalled when its work under way has
    /// ended, or nil when none is under way.
    private func markRevoked() -> DispatchSemaphore? {
        state.withLock { s in
            s.revoked = true
            guard s.working > 0 else { return nil }
            let drained = s.drained ?? DispatchSemaphore(value: 0)
            s.drained = drained
            return drained
        }
    }

    /// Marks the assignment revoked and waits up to `seconds` for the work under way to end.
    /// Returns how many pieces of work were still under way when it stopped waiting.
    func revoke(waitingUpTo grace: Duration) -> Int {
        Self.revoke([self], waitingUpTo: grace)
    }

    /// Marks every assignment revoked first (no new work starts on any of them), then waits
    /// for the work under way on all of them, up to one shared deadline. Returns how many
    /// pieces of work were still under way then. Blocks: called on the poll thread, inside
    /// librdkafka's rebalance callback.
    static func revoke(_ assignments: [PartitionAssignment], waitingUpTo grace: Duration) -> Int {
        let draining = assignments.compactMap { assignment in assignment.markRevoked().map { (assignment, $0) } }
        let deadline = DispatchTime.now() + .nanoseconds(Int(grace / .nanoseconds(1)))
        var unfinished = 0
        for (assignment, drained) in draining where drained.wait(timeout: deadline) == .timedOut {
            unfinished += assignment.state.withLock { $0.working }
        }
        return unfinished
    }
}
