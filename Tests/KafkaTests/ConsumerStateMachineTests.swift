import Dispatch
@testable import Kafka
import Testing

/// The consumer's lifecycle: what the poll thread is told to do in each state.
@Suite("Consumer state machine")
struct ConsumerStateMachineTests {
    @Test func backpressureWaitsThenPausesAndResumesAtHalf() {
        var machine = ConsumerStateMachine(maximumInFlight: 10, pauseAfter: 5)
        #expect(machine.next(inFlight: 0, now: 0) == .poll(deliver: true))
        // Full: wait for room without polling, until the wait has lasted `pauseAfter`.
        #expect(machine.next(inFlight: 10, now: 100) == .waitForRoom)
        #expect(machine.next(inFlight: 10, now: 104) == .waitForRoom)
        #expect(machine.next(inFlight: 10, now: 105) == .pause)
        #expect(machine.isPaused)
        // Paused: polling goes on (the member stays in its group) until half is finished.
        #expect(machine.next(inFlight: 10, now: 106) == .poll(deliver: true))
        #expect(machine.next(inFlight: 6, now: 107) == .poll(deliver: true))
        let pauseAssigned = machine.assigned()
        #expect(pauseAssigned)  // partitions assigned now are paused too
        #expect(machine.next(inFlight: 5, now: 108) == .resume)
        #expect(!machine.isPaused)
        // A wait that ends before `pauseAfter` starts the count again next time.
        #expect(machine.next(inFlight: 10, now: 200) == .waitForRoom)
        #expect(machine.next(inFlight: 9, now: 201) == .poll(deliver: true))
        #expect(machine.next(inFlight: 10, now: 204) == .waitForRoom)
        #expect(machine.next(inFlight: 10, now: 208) == .waitForRoom)
    }

    @Test func stoppingEndsTheStreamOnceThenPollsPausedUntilClosed() {
        var machine = ConsumerStateMachine(maximumInFlight: 10)
        #expect(!machine.joined)
        let pauseAssigned = machine.assigned()
        #expect(!pauseAssigned)
        #expect(machine.joined)
        machine.stopFetching()
        #expect(machine.next(inFlight: 3, now: 0) == .finishStream)
        #expect(machine.next(inFlight: 3, now: 0) == .pause)
        #expect(machine.next(inFlight: 3, now: 0) == .poll(deliver: false))
        machine.stopFetching()  // twice is once
        #expect(machine.next(inFlight: 2, now: 1) == .poll(deliver: false))
        machine.close()
        #expect(machine.next(inFlight: 0, now: 2) == .leave(finishStream: false))
        #expect(machine.next(inFlight: 0, now: 2) == .exit)
        machine.close()
        #expect(machine.state == .closed)
    }

    @Test func closingWhileFetchingEndsTheStreamAsItLeaves() {
        var machine = ConsumerStateMachine(maximumInFlight: 10)
        machine.close()
        machine.stopFetching()  // too late to matter
        #expect(machine.next(inFlight: 0, now: 0) == .leave(finishStream: true))
        #expect(machine.next(inFlight: 0, now: 0) == .exit)
    }

    @Test func aFatalErrorEndsEverything() {
        var machine = ConsumerStateMachine(maximumInFlight: 10)
        machine.failed()
        #expect(machine.next(inFlight: 0, now: 0) == .exit)
        machine.stopFetching()
        #expect(machine.state == .closed)
    }
}

@Suite("Consumer backpressure wake-ups")
struct ConsumerRoomTests {
    // A poll thread waiting for room is woken once there is room for a poll round, not by
    // every message finished (each wake is two thread switches).
    @Test func thePollThreadIsWokenOnceThereIsRoomForARound() {
        let state = ConsumerState(maximumInFlight: 4096, revocationGrace: .seconds(1))
        #expect(state.roomAt == 4096 - KafkaConsumer.maximumBatch)
        state.waitingForRoom.store(true, ordering: .sequentiallyConsistent)
        state.madeRoom(inFlight: 4095)
        state.madeRoom(inFlight: state.roomAt + 1)
        #expect(state.room.wait(timeout: .now()) == .timedOut)
        state.madeRoom(inFlight: state.roomAt)
        #expect(state.room.wait(timeout: .now()) == .success)
        // Once: the flag is down until the thread waits again.
        state.madeRoom(inFlight: 0)
        #expect(state.room.wait(timeout: .now()) == .timedOut)
        // A small limit still leaves room for at least one message.
        #expect(ConsumerState(maximumInFlight: 4, revocationGrace: .seconds(1)).roomAt == 3)
    }
}
