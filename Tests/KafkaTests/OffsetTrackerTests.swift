@testable import Kafka
import Testing

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
        tracker.finished(p0, offset: 12)
        tracker.finished(p0, offset: 13)
        #expect(tracker.takeCommits().isEmpty)  // 10 is still in flight
        tracker.finished(p0, offset: 10)
        #expect(tracker.takeCommits().map(\.1) == [11])
        tracker.finished(p0, offset: 11)
        #expect(tracker.takeCommits().map(\.1) == [14])
        tracker.finished(p0, offset: 14)
        #expect(tracker.takeCommits().map(\.1) == [15])
        #expect(tracker.inFlight == 0)
        #expect(tracker.takeCommits().isEmpty)
    }

    @Test func partitionsAreIndependentAndRevocationForgets() {
        var tracker = OffsetTracker()
        tracker.assigned([p0, p1])
        _ = tracker.handedOut(p0, offset: 0)
        _ = tracker.handedOut(p1, offset: 5)
        tracker.finished(p1, offset: 5)
        let commits = Dictionary(uniqueKeysWithValues: tracker.takeCommits().map { ($0.0, $0.1) })
        #expect(commits == [p0: 0, p1: 6])
        tracker.revoked([p0])
        tracker.finished(p0, offset: 0)  // late: ignored
        #expect(tracker.takeCommits().isEmpty)
        #expect(tracker.inFlight == 0)
        // A message of a revoked partition is not handed out and creates no state to commit.
        let revokedOne = tracker.handedOut(p0, offset: 1)
        #expect(revokedOne == false)
        #expect(tracker.takeCommits().isEmpty)
        let assignedOne = tracker.handedOut(p1, offset: 6)
        #expect(assignedOne)
    }

    @Test func failedCommitIsSentAgain() {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        _ = tracker.handedOut(p0, offset: 3)
        tracker.finished(p0, offset: 3)
        #expect(tracker.takeCommits().map(\.1) == [4])
        tracker.forgetCommitted([p0])
        #expect(tracker.takeCommits().map(\.1) == [4])
    }

    @Test func longRunsStayCorrectAcrossCompaction() {
        var tracker = OffsetTracker()
        tracker.assigned([p0])
        for offset in Int64(0)..<5000 { _ = tracker.handedOut(p0, offset: offset) }
        // Finish everything but 4000, in a scrambled order.
        for offset in (Int64(0)..<5000).shuffled() where offset != 4000 { tracker.finished(p0, offset: offset) }
        #expect(tracker.takeCommits().map(\.1) == [4000])
        #expect(tracker.inFlight == 1)
        tracker.finished(p0, offset: 4000)
        #expect(tracker.takeCommits().map(\.1) == [5000])
    }
}
