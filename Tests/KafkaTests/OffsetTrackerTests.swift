@testable import Kafka
import Synchronization
import Testing
import WardenTestSupport

/// The commit point never passes a message whose outcome is not durable.
@Suite("Offset tracker")
struct OffsetTrackerTests {
    let p0 = TopicPartition("t", 0)
    let p1 = TopicPartition("t", 1)

    @Test func commitPointStopsAtTheFirstUnfinishedMessage() {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        for offset in Int64(10)..<15 { _ = tracker.handedOut(p0, offset: offset) }
        #expect(tracker.takeCommits().map(\.1) == [10])  // nothing finished yet: commit the start
        tracker.finished(p0, offset: 12, assignment: nil)
        tracker.finished(p0, offset: 13, assignment: nil)
        #expect(tracker.takeCommits().isEmpty)  // 10 is still in flight
        tracker.finished(p0, offset: 10, assignment: nil)
        #expect(tracker.takeCommits().map(\.1) == [11])
        tracker.finished(p0, offset: 11, assignment: nil)
        #expect(tracker.takeCommits().map(\.1) == [14])
        tracker.finished(p0, offset: 14, assignment: nil)
        #expect(tracker.takeCommits().map(\.1) == [15])
        #expect(tracker.inFlight == 0)
        #expect(tracker.takeCommits().isEmpty)
    }

    // librdkafka resets a partition's position (an offset out of range: the topic re-created or
    // truncated) and hands out lower offsets under the same assignment: the commit point follows
    // the new position, no finish is lost in a search that assumes increasing offsets, and
    // nothing stays counted in flight for ever.
    @Test func aPartitionThatGoesBackStartsItsCommitPointAgain() {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        let first = tracker.handedOut(p0, offset: 0)
        for offset in Int64(1)..<10 { _ = tracker.handedOut(p0, offset: offset) }
        for offset in Int64(0)..<10 where offset != 5 { tracker.finished(p0, offset: offset, assignment: first) }
        #expect(tracker.takeCommits().map(\.1) == [5])
        let again = tracker.handedOut(p0, offset: 3)
        #expect(again != nil && again !== first)
        // A revocation waits for the work of both.
        #expect(tracker.partitions[p0]?.superseded.map(ObjectIdentifier.init) == [ObjectIdentifier(first!)])
        #expect(tracker.inFlight == 1)
        tracker.finished(p0, offset: 3, assignment: again)
        tracker.finished(p0, offset: 5, assignment: first)  // of what was handed out before: ignored
        #expect(tracker.takeCommits().map(\.1) == [4])
        #expect(tracker.inFlight == 0)
        for offset in Int64(4)..<12 {
            _ = tracker.handedOut(p0, offset: offset)
            tracker.finished(p0, offset: offset, assignment: again)
        }
        #expect(tracker.takeCommits().map(\.1) == [12])
        #expect(tracker.load(budget: 1) == 0)
    }

    @Test func partitionsAreIndependentAndRevocationForgets() {
        var tracker = OffsetTracker()
        tracker.assigned([p0, p1])
        _ = tracker.handedOut(p0, offset: 0)
        _ = tracker.handedOut(p1, offset: 5)
        tracker.finished(p1, offset: 5, assignment: nil)
        let commits = Dictionary(uniqueKeysWithValues: tracker.takeCommits().map { ($0.0, $0.1) })
        #expect(commits == [p0: 0, p1: 6])
        tracker.revoked([p0])
        tracker.finished(p0, offset: 0, assignment: nil)  // late: ignored
        #expect(tracker.takeCommits().isEmpty)
        #expect(tracker.inFlight == 0)
        // A message of a revoked partition is not handed out and creates no state to commit.
        let revokedOne = tracker.handedOut(p0, offset: 1)
        #expect(revokedOne == nil)
        #expect(tracker.takeCommits().isEmpty)
        let assignedOne = tracker.handedOut(p1, offset: 6)
        #expect(assignedOne != nil)
    }

    @Test func failedCommitIsSentAgain() {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        _ = tracker.handedOut(p0, offset: 3)
        tracker.finished(p0, offset: 3, assignment: nil)
        #expect(tracker.takeCommits().map(\.1) == [4])
        tracker.forgetCommitted([p0])
        #expect(tracker.takeCommits().map(\.1) == [4])
    }

    @Test func longRunsStayCorrectAcrossCompaction() {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        for offset in Int64(0)..<5000 { _ = tracker.handedOut(p0, offset: offset) }
        // Finish everything but 4000, in a scrambled order.
        for offset in (Int64(0)..<5000).shuffled() where offset != 4000 { tracker.finished(p0, offset: offset, assignment: nil) }
        #expect(tracker.takeCommits().map(\.1) == [4000])
        #expect(tracker.inFlight == 1)
        tracker.finished(p0, offset: 4000, assignment: nil)
        #expect(tracker.takeCommits().map(\.1) == [5000])
    }

    /// After a revoke and a reassignment of the same partition, the redelivered message has the
    /// same offset as the one the earlier assignment handed out: a late finish of the earlier one
    /// must not move the commit point past the redelivery, which is still in flight.
    @Test func aLateFinishFromAnEarlierAssignmentDoesNotCommitItsRedelivery() {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        let first = tracker.handedOut(p0, offset: 7)
        let revoked = tracker.revoked([p0])
        #expect(revoked.map(\.generation) == [first?.generation])
        tracker.assigned([p0])
        let second = tracker.handedOut(p0, offset: 7)
        #expect(second != nil && second !== first)
        #expect(tracker.takeCommits().map(\.1) == [7])
        tracker.finished(p0, offset: 7, assignment: first)  // late, from before the revoke
        #expect(tracker.takeCommits().isEmpty)
        #expect(tracker.inFlight == 1)
        tracker.finished(p0, offset: 7, assignment: second)
        #expect(tracker.takeCommits().map(\.1) == [8])
    }

    /// A revocation waits for the work under way on its messages, and lets none begin after.
    @Test func revocationWaitsForWorkUnderWayAndRefusesNewWork() async throws {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        let assignment = tracker.handedOut(p0, offset: 0)!
        #expect(assignment.beginWork())
        let ended = Atomic(false)
        let revoking = Task { try await onOwnThread {
            defer { ended.store(true, ordering: .sequentiallyConsistent) }
            return assignment.revoke(waitingUpTo: .seconds(30))
        } }
        // The revocation is under way once new work is refused; it cannot end while work is.
        while !assignment.isRevoked { await Task.yield() }
        #expect(assignment.beginWork() == false)
        #expect(ended.load(ordering: .sequentiallyConsistent) == false)
        assignment.endWork()
        #expect(try await revoking.value == 0)
        // A grace period that runs out reports what is still under way.
        let other = PartitionAssignment(partition: p1, generation: 99)
        #expect(other.beginWork())
        #expect(other.revoke(waitingUpTo: .milliseconds(10)) == 1)
    }

    /// One revocation of several partitions stops new work on all of them before it waits for
    /// any, and waits for all of them against one deadline.
    @Test(.timeLimit(.minutes(1))) func aRevocationOfSeveralPartitionsStopsNewWorkOnAllBeforeWaiting() async throws {
        let busy = PartitionAssignment(partition: p0, generation: 1)
        let idle = PartitionAssignment(partition: p1, generation: 2)
        #expect(busy.beginWork())
        let revoking = Task { try await onOwnThread { PartitionAssignment.revoke([busy, idle], waitingUpTo: .seconds(30)) } }
        // Both are marked before the wait for the busy one begins.
        while !idle.isRevoked { await Task.yield() }
        #expect(busy.isRevoked)
        #expect(idle.beginWork() == false && busy.beginWork() == false)
        busy.endWork()
        #expect(try await revoking.value == 0)
    }
}

