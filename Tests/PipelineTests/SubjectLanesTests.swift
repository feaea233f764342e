@testable import Pipeline
import Synchronization
import Testing

@Suite("One subject's events in order, different subjects at once")
struct SubjectLanesTests {
    @Test func aSubjectsEventsWaitForTheOneBeforeAndOthersDoNot() async {
        let lanes = SubjectLanes()
        let log = Log()
        let a1 = lanes.enter("a"), a2 = lanes.enter("a"), b1 = lanes.enter("b")
        #expect(a1.previous == nil && b1.previous == nil)
        #expect(a2.previous === a1.mine)
        await withTaskGroup(of: Void.self) { group in
            group.addTask {
                if await a2.previous?.wait() == true { log.append("a2") }
            }
            group.addTask {
                log.append("b1")  // not held back by subject a
                b1.mine.open(passed: true)
            }
            try? await Task.sleep(for: .milliseconds(100))
            #expect(log.entries == ["b1"])  // a2 still waits for a1
            log.append("a1")
            a1.mine.open(passed: true)
        }
        #expect(log.entries == ["b1", "a1", "a2"])
    }

    @Test func anAbandonedEventHoldsBackItsSubjectsLaterOnes() async {
        let lanes = SubjectLanes()
        let first = lanes.enter("a"), second = lanes.enter("a")
        first.mine.open(passed: false)
        #expect(await second.previous?.wait() == false)
        lanes.leave("a", first.mine)
        // The lane still ends at the second event: a third waits for it.
        #expect(lanes.enter("a").previous === second.mine)
    }
}

final class Log: Sendable {
    private let lines = Mutex<[String]>([])
    func append(_ line: String) { lines.withLock { $0.append(line) } }
    var entries: [String] { lines.withLock { $0 } }
}
