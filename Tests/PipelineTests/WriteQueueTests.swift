import Kafka
@testable import Pipeline
import Synchronization
import Testing

@Suite("Write queue between verification and the ledger")
struct WriteQueueTests {
    func item(_ offsets: Range<Int64>) -> PreparedBatch {
        let messages = offsets.map { KafkaMessage(topic: "t", partition: 0, offset: $0, key: nil, value: []) }
        return .init(messages: messages, intake: [], prepared: .init(count: 0, entries: [], verdicts: []))
    }

    @Test func takesEverythingWaitingInOrder() async {
        let queue = WriteQueue(limit: 100)
        await queue.push(item(0..<3))
        await queue.push(item(3..<5))
        await queue.push(item(5..<9))
        let taken = await queue.takeAll()
        #expect(taken?.flatMap { $0.messages.map(\.offset) } == Array(0..<9))
        queue.close()
        #expect(await queue.takeAll() == nil)
    }

    @Test func aWaitingWriterGetsTheNextBatchAtOnce() async {
        let queue = WriteQueue(limit: 100)
        async let taken = queue.takeAll()
        try? await Task.sleep(for: .milliseconds(50))
        await queue.push(item(0..<2))
        #expect(await taken?.flatMap { $0.messages.map(\.offset) } == [0, 1])
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
        #expect(first?.flatMap { $0.messages.map(\.offset) } == Array(0..<12))
        await second.value
        #expect(pushed.withLock { $0 } == 3)
        queue.close()
        // What was pushed before closing is still handed out, then nothing.
        #expect(await queue.takeAll()?.flatMap { $0.messages.map(\.offset) } == [12])
        #expect(await queue.takeAll() == nil)
    }
}
