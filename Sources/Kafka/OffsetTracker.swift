/// Which offsets of each assigned partition are in flight, and so how far the committed offset
/// may move: up to the first message whose outcome is not yet durable. Messages of one partition
/// may finish out of order (the consumer does not know how its user schedules work); the commit
/// point only ever covers a contiguous run of finished ones.
struct OffsetTracker: Sendable {
    struct Partition: Sendable {
        /// The assignment these offsets belong to.
        let assignment: PartitionAssignment
        /// Earlier assignments of the partition under the same librdkafka assignment, left when
        /// its position went back (`handedOut`): their work may still be under way, and a
        /// revocation waits for it too.
        var superseded: [PartitionAssignment] = []
        /// Offsets handed out, in increasing order, with whether each is done. `head` is the
        /// first entry not yet dropped.
        var offsets: [Int64] = []
        var done: [Bool] = []
        var head = 0
        /// The offset after the last message handed out (the commit point when nothing is in flight).
        var next: Int64?
        /// The offset last committed (or sent for commit).
        var committed: Int64?
        /// The offset the cluster last confirmed committed.
        var confirmed: Int64?

        /// The offset a commit may name: the first unfinished message, or the one after the last.
        var committable: Int64? { head < offsets.count ? offsets[head] : next }

        /// Handed out and not finished.
        var inFlight = 0
        /// Of those, waiting aside for their issuer's keys (not counted against the fetch budget).
        var aside = 0

        mutating func handedOut(_ offset: Int64) {
            offsets.append(offset)
            done.append(false)
            inFlight += 1
            next = offset + 1
        }

        mutating func finished(_ offset: Int64) {
            // Binary search: offsets are increasing.
            var low = head, high = offsets.count
            while low < high {
                let mid = (low + high) / 2
                if offsets[mid] < offset { low = mid + 1 } else { high = mid }
            }
            guard low < offsets.count, offsets[low] == offset, !done[low] else { return }
            done[low] = true
            inFlight -= 1
            while head < offsets.count, done[head] { head += 1 }
            if head > 1024, head * 2 > offsets.count {
                offsets.removeFirst(head)
                done.removeFirst(head)
                head = 0
            }
        }
    }

    private(set) var partitions: [TopicPartition: Partition] = [:]
    private var generation: UInt64 = 0

    /// Over every partition, kept as messages come and go (read for every message finished):
    /// in flight and not waiting aside, and offsets still held behind the commit points.
    private var active = 0
    private var tracked = 0

    var inFlight: Int { partitions.values.reduce(0) { $0 + $1.inFlight } }
    /// What the fetch budget (`max-in-flight`, `budget`) counts: messages in flight and not
    /// waiting aside. A message waiting aside still holds its partition's commit point, and
    /// every later offset stays tracked behind it: once the offsets held so pass 64 budgets,
    /// the budget counts as full, so that span (and what a restart fetches again) stays bounded.
    func load(budget: Int) -> Int {
        tracked > budget * Self.spanBudgets ? max(active, budget) : active
    }

    static let spanBudgets = 64

    /// A partition's share of `active` and `tracked`.
    private func weight(_ tp: TopicPartition) -> (active: Int, tracked: Int) {
        guard let partition = partitions[tp] else { return (0, 0) }
        return (partition.inFlight - partition.aside, partition.offsets.count - partition.head)
    }

    /// Changes a partition in place and its share of the totals with it.
    private mutating func change(_ tp: TopicPartition, _ body: (inout Partition) -> Void) {
        let before = weight(tp)
        body(&partitions[tp]!)
        let after = weight(tp)
        active += after.active - before.active
        tracked += after.tracked - before.tracked
    }

    /// A message handed out under `assignment` is put aside to wait for keys, or taken up again.
    mutating func setAside(_ tp: TopicPartition, assignment: PartitionAssignment?, _ aside: Bool) {
        guard let current = partitions[tp]?.assignment, assignment == nil || assignment === current else { return }
        change(tp) { $0.aside = max(0, $0.aside + (aside ? 1 : -1)) }
    }

    mutating func assigned(_ list: [TopicPartition]) {
        for tp in list where partitions[tp] == nil {
            generation += 1
            partitions[tp] = Partition(assignment: PartitionAssignment(partition: tp, generation: generation))
        }
    }

    /// Forgets revoked partitions and returns their assignments; a late `finished` for them is
    /// ignored, also once the partition is assigned again.
    @discardableResult
    mutating func revoked(_ list: [TopicPartition]) -> [PartitionAssignment] {
        list.compactMap { tp in
            let share = weight(tp)
            active -= share.active
            tracked -= share.tracked
            return partitions.removeValue(forKey: tp)?.assignment
        }
    }

    /// Tracks a message about to be handed out and returns its assignment; nil if its partition
    /// is not assigned (it was revoked while the batch was being polled), in which case it must
    /// not be handed out: its next owner fetches it, and no commit for a partition this member
    /// no longer owns is made.
    mutating func handedOut(_ tp: TopicPartition, offset: Int64) -> PartitionAssignment? {
        // No copy of the partition is held across the change below: its arrays would then be
        // shared, and the append would copy them whole for every message.
        guard partitions[tp] != nil else { return nil }
        if let next = partitions[tp]!.next, offset < next {
            let left = partitions[tp]!.superseded + [partitions[tp]!.assignment]
            // The partition went back under the same assignment: librdkafka reset its position
            // (`auto.offset.reset` after an offset out of range: the topic re-created, or
            // truncated). Offsets must increase for the commit point to be found, so what was
            // handed out before is tracked no more — its late finishes are ignored, as a
            // revoked assignment's, and its work goes on — and the commit point starts here:
            // what follows is read again (duplicates the ledger knows) or new.
            revoked([tp])
            assigned([tp])
            partitions[tp]!.superseded = left
        }
        change(tp) { $0.handedOut(offset) }
        return partitions[tp]!.assignment
    }

    /// Whether `offset` is after every offset of the partition handed out so far.
    func isAhead(_ tp: TopicPartition, offset: Int64) -> Bool {
        guard let partition = partitions[tp] else { return false }
        return partition.next.map { offset >= $0 } ?? true
    }

    /// The message at `offset`, handed out under `assignment`, is finished. A message of an
    /// earlier assignment of the partition (revoked since) is ignored.
    mutating func finished(_ tp: TopicPartition, offset: Int64, assignment: PartitionAssignment?) {
        guard let current = partitions[tp]?.assignment, assignment == nil || assignment === current else { return }
        change(tp) { $0.finished(offset) }
    }

    /// Partitions whose commit point moved since the last commit, with the offset to commit;
    /// marks them committed.
    mutating func takeCommits(only: Set<TopicPartition>? = nil) -> [(TopicPartition, Int64)] {
        var out: [(TopicPartition, Int64)] = []
        for (tp, state) in partitions where only == nil || only!.contains(tp) {
            guard let offset = state.committable, offset != state.committed else { continue }
            out.append((tp, offset))
            partitions[tp]!.committed = offset
        }
        return out
    }

    /// The cluster confirmed `offset` committed for this partition (of its current assignment:
    /// a confirmation arriving after a revocation is of no partition this member reads).
    mutating func confirmed(_ tp: TopicPartition, offset: Int64) {
        guard partitions[tp] != nil, offset >= 0 else { return }
        partitions[tp]!.confirmed = offset
    }

    /// A commit of this partition failed: send its commit point again next round.
    mutating func forgetCommitted(_ list: [TopicPartition]) {
        for tp in list { partitions[tp]?.committed = nil }
    }
}
