@testable import Pipeline
import Synchronization
import Testing

@Suite("Write queue between verification and the ledger")
struct WriteQueueTests {
    typealias WriteQueue = BatchQueue<Int64>
    func item(_ offsets: Range<Int64>) -> [Int64] { Array(offsets) }

    @Test func takesEverythingWaitingInOrder() async {
        let queue = WriteQueue(limit: 100)
        await queue.push(item(0..<3))
        await queue.push(item(3..<5))
        await queue.push(item(5..<9))
        let taken = await queue.takeAll()
        #expect(taken?.flatMap { $0 } == Array(0..<9))
        queue.close()
        #expect(await queue.takeAll() == nil)
    }

    /// A wake-up with nothing to take returns an empty take, also when no reader waited yet.
    @Test func aWakeUpIsNotLost() async {
        let queue = WriteQueue(limit: 100)
        queue.wake()
        #expect(await queue.takeAll() == [])
        await queue.push(item(0..<1))
        #expect(await queue.takeAll() == [[0]])
    }

    @Test func aWaitingWriterGetsTheNextBatchAtOnce() async {
        let queue = WriteQueue(limit: 100)
        async let taken = queue.takeAll()
        try? await Task.sleep(for: .milliseconds(50))
        await queue.push(item(0..<2))
        #expect(await taken?.flatMap { $0 } == [0, 1])
    }

    @Test func verificationWaitsWhileTheLimitIsReachedAndResumesAfterATake() async {
        let queue = WriteQueue(limit: 10)
        let pushed = Mutex(0)
        await queue.push(item(0..<6))
        pushed.withLock { $0 += 1 }
        let second = Task {
            await queue.push(item(6..<12))  // reaches the limit: waits for a take
            pushed.withLock { $0 += 1 }
            await queue.push(item(12..<13))
            pushed.withLock { $0 += 1 }
        }
        try? await Task.sleep(for: .milliseconds(100))
        #expect(pushed.withLock { $0 } == 1)
        let first = await queue.takeAll()
        #expect(first?.flatMap { $0 } == Array(0..<12))
        await second.value
        #expect(pushed.withLock { $0 } == 3)
        queue.close()
        // What was pushed before closing is still handed out, then nothing.
        #expect(await queue.takeAll()?.flatMap { $0 } == [12])
        #expect(await queue.takeAll() == nil)
    }
}
