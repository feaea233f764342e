import Foundation
@testable import Pipeline
import Testing

/// The watch behind `/healthz`'s stall check: stalled only while work waits and nothing is
/// finished; an abandoned message is no progress; a quiet time with nothing waiting is not a stall.
@Suite("Intake progress")
struct IntakeProgressTests {
    static func record(_ settled: Settled, _ index: Int) -> IntakeRecord {
        IntakeRecord(IntakeMessage(value: [], source: "test", receivedAt: 0),
                     acknowledgement: Settled.Door(settled: settled, index: index, take: { true }))
    }

    @Test func stalledOnlyWhileWorkWaitsUnfinished() async throws {
        let progress = IntakeProgress(), settled = Settled()
        #expect(progress.stall(after: 0) == nil)  // nothing waits
        let first = progress.track(Self.record(settled, 0)), second = progress.track(Self.record(settled, 1))
        try await Task.sleep(for: .milliseconds(20))
        let stall = try #require(progress.stall(after: 0.01))
        #expect(stall.contains("2 message(s) waiting"))
        #expect(progress.stall(after: 3600) == nil)
        // Taken back is not progress.
        first.acknowledgement.settle(.abandoned)
        #expect(progress.stall(after: 0.01)?.contains("1 message(s) waiting") == true)
        // The settlement reaches the door's own acknowledgement too.
        second.acknowledgement.settle(.duplicate(eventID: 7))
        #expect(settled.all == [.abandoned, .duplicate(eventID: 7)])
        #expect(progress.stall(after: 0) == nil)
        // Busy again after a quiet spell: the clock starts when waiting begins.
        try await Task.sleep(for: .milliseconds(30))
        _ = progress.track(Self.record(settled, 2))
        #expect(progress.stall(after: 0.025) == nil)
    }
}
