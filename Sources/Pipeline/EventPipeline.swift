import Foundation
import Invalidation
import Ledger
import Logging
import SecurityEvents
import Synchronization
import TokenVerification

/// The stages every door feeds: verification (on every core) → admission (subject, plan, dead
/// letters) → the ledger writer (one atomic write for all that is ready) → the step runner (one
/// subject's events in order, different subjects at once). A door feeds batches of records in
/// and hears about each through the record's acknowledgement; it knows nothing else.
///
/// A record waiting for its issuer's keys does not hold the others: it waits aside, with the
/// later records of its subject (which must not act before it), while everything else flows;
/// it holds back only what its acknowledgement holds back (for Kafka, its partition's commit
/// point). At most `maximumWaitingForKeys` records wait so; beyond that, admission waits too.
/// With a `maximumKeyWait` (Kafka's), a record still without keys after that long (in this
/// process) is refused (`keys_unavailable`), recorded and dead-lettered like an invalid token,
/// and the commit point it held moves on; one whose token the ledger already holds as an
/// event (a redelivery after a crash, its steps maybe pending) keeps waiting.
public struct EventPipeline: Sendable {
    public let processor: EventProcessor
    /// Records that may wait for keys aside at once (`warden_waiting_for_keys`).
    public let maximumWaitingForKeys: Int
    /// How long a record may wait aside for its issuer's keys before it is given up on
    /// (`kafka.max-key-wait`); nil: as long as it takes (a resumed event's pending steps must
    /// not be given up). An issuer whose keys never come back must not hold its partitions'
    /// commit points, and what a restart fetches again, for ever; what is given up is in the
    /// ledger and the dead-letter topic, and `warden replay --apply` acts on it once the keys
    /// are back.
    public let maximumKeyWait: Duration?
    /// For how long after a record arrived its claims (`max-age`, `iat` ahead of the clock) are
    /// still judged as of its arrival when it is verified again after waiting for its issuer's
    /// keys (`KafkaIntake.arrivalWindow`: while the ledger must still hold the claim of any copy
    /// acted on before); 0: judged when verified again. A genuine revocation must not turn too
    /// old for `max-age` only because its issuer's keys could not be had for a while.
    public let arrivalWindow: Double
    /// Verified records that may wait for the ledger at once; verification pauses beyond it.
    public let maximumUnwritten: Int
    /// Most records one ledger write holds.
    public let maximumWrite: Int
    /// Most records one ledger write holds while events' steps are running. Their outcomes are
    /// written between two intake writes, so each waits for at most the one under way: kept
    /// short, an answered revocation is durable within milliseconds (`warden_step_record_seconds`).
    /// Records with steps to run are written this many at most even before any step runs: the
    /// new events of one write act together, and their outcomes are recorded in one write.
    public let maximumWriteWhileActing: Int
    /// Ledger writes under way at once. One at a time, the ledger would wait after each for
    /// this pipeline to take its result and start the next: with short writes while steps run,
    /// that wait, not the disk, bounded the intake.
    public let maximumWritesInFlight: Int

    public init(processor: EventProcessor, maximumWaitingForKeys: Int = 10_000, maximumKeyWait: Duration? = nil,
                arrivalWindow: Double = 0, maximumUnwritten: Int = 16_384, maximumWrite: Int = 1024, maximumWriteWhileActing: Int = 96,
                maximumWritesInFlight: Int = 4) {
        self.processor = processor
        self.maximumWaitingForKeys = maximumWaitingForKeys
        self.maximumKeyWait = maximumKeyWait
        self.arrivalWindow = arrivalWindow
        self.maximumUnwritten = maximumUnwritten
        self.maximumWrite = maximumWrite
        self.maximumWriteWhileActing = maximumWriteWhileActing
        self.maximumWritesInFlight = max(1, maximumWritesInFlight)
    }

    var metrics: WardenMetrics { processor.metrics }
    var logger: Logger { processor.logger }

    /// Runs every record of `input` through the stages; returns once each is settled. On stop
    /// (`processor.stop`), what is not durable yet is settled `.abandoned`.
    public func run(_ input: some AsyncSequence<[IntakeRecord], Never> & Sendable) async {
        let processor = self.processor, maximumWrite = max(1, self.maximumWrite)
        let maximumWriteWhileActing = max(1, min(self.maximumWriteWhileActing, maximumWrite))
        let writeQueue = BatchQueue<EventProcessor.Admitted>(limit: maximumUnwritten)
        let checkedQueue = BatchQueue<EventProcessor.Checked>(limit: 1)
        let waiting = WaitingRoom(limit: maximumWaitingForKeys, maximumWait: maximumKeyWait, arrivalWindow: arrivalWindow)
        let lanes = SubjectLanes()
        await withTaskGroup(of: Void.self) { group in
            // Verification runs one batch ahead of admission, so the cores are not left to one
            // task meanwhile.
            group.addTask {
                for await batch in input {
                    let progress = processor.metrics.progress
                    await checkedQueue.push(await processor.check(batch.map { progress.track($0) }))
                }
                checkedQueue.close()
            }
            // Records waiting for keys are verified again now and then; whatever then has a
            // verdict goes back to admission, in its lane's order.
            group.addTask {
                await waiting.retry(processor: processor, wake: { checkedQueue.wake() })
            }
            // Admission.
            group.addTask {
                await admit(from: checkedQueue, waiting: waiting, into: writeQueue)
                waiting.close()
                writeQueue.close()
            }
            // The ledger writer: it takes every batch admitted since it last looked and writes
            // them in order, in atomic writes of at most `maximumWrite` records, or
            // `maximumWriteWhileActing` while steps run or when the records have steps to run
            // (a step's outcome, written between two of them, waits for one short write at
            // most). Written long while nothing acted yet, the new events of a write acted
            // together and each of their outcomes waited for one long write of them all, behind
            // the long intake writes cut meanwhile. Up to `maximumWritesInFlight` writes
            // are under way at once, so the ledger goes from one to the next without waiting
            // for this task to run again; while they wait for the disk, verification and
            // admission go on.
            let writes = WritesInOrder<[EventProcessor.Work]>(limit: maximumWritesInFlight)
            group.addTask {
                await withDiscardingTaskGroup { writers in
                    while let ready = await writeQueue.takeAll() {
                        let records = Array(ready.joined())
                        var start = 0
                        while start < records.count {
                            let ticket = await writes.start()
                            let long = min(start + maximumWrite, records.count)
                            let short = !processor.inSteps.isEmpty || !records[start..<long].allSatisfy(\.recordOnly)
                            let end = short ? min(start + maximumWriteWhileActing, records.count) : long
                            let part = Array(records[start..<end])
                            start = end
                            writers.addTask { writes.finish(ticket, await processor.record(part)) }
                        }
                    }
                }
                writes.close()
            }
            // The step lanes: written events with steps, taken in the order their writes
            // started, so a subject's events enter its lane in arrival order whichever write
            // committed first.
            @Sendable func settle(_ work: EventProcessor.Work, _ turn: SubjectLanes.Turn, _ disposition: Disposition) {
                // Durable, its steps left for the next delivery (`pending`).
                if disposition == .abandoned { processor.metrics.outcome("pending") }
                work.record.acknowledgement.settle(disposition)
                turn.mine.open(passed: disposition != .abandoned)
                lanes.leave(work.subjectKey, turn.mine)
                processor.inSteps.leave(work.eventID)
            }
            group.addTask {
                // Discarding: a long-running worker does not keep a result per finished event.
                await withDiscardingTaskGroup { steps in
                    while let written = await writes.next() {
                        // New events (their steps known, none run yet) with nothing of their
                        // subject's before them run together: one executor call per target for
                        // their steps, one ledger write for the outcomes.
                        var together: [(work: EventProcessor.Work, turn: SubjectLanes.Turn)] = []
                        for work in written {
                            // A resume pass's copy of an event this process holds (the pass
                            // read it between its claim and its entry here) is its holder's to
                            // finish: settled at once, not queued behind it in its lane, where
                            // the pass's page, and every later pass, would wait on it.
                            if !work.isNew, work.record.message.source == PendingStepsResume.source,
                               processor.inSteps.contains(work.eventID) {
                                work.record.acknowledgement.settle(.duplicate(eventID: work.eventID))
                                continue
                            }
                            let turn = lanes.enter(work.subjectKey)
                            processor.inSteps.take(work.eventID)
                            if turn.previous == nil, work.isNew {
                                together.append((work, turn))
                                continue
                            }
                            steps.addTask {
                                // A later event of this subject must not act before this
                                // one: when the process stops, the subject's later ones stop too.
                                let previousPassed = await turn.previous?.wait() ?? true
                                let disposition: Disposition =
                                    !previousPassed && processor.stop.isStopping ? .abandoned : await processor.run(work)
                                settle(work, turn, disposition)
                            }
                        }
                        guard !together.isEmpty else { continue }
                        steps.addTask { [together] in
                            await processor.run(together: together.map(\.work)) { i, disposition in
                                settle(together[i].work, together[i].turn, disposition)
                            }
                        }
                    }
                }
            }
        }
    }

    /// Admission: each batch in order, the records waiting for keys put aside with their lanes'
    /// later records. After a stop, everything not admitted is abandoned.
    private func admit(from checkedQueue: BatchQueue<EventProcessor.Checked>, waiting: WaitingRoom,
                       into writeQueue: BatchQueue<EventProcessor.Admitted>) async {
        let processor = self.processor
        var stopped = false
        func pass(_ batch: [EventProcessor.Checked]) async {
            guard !stopped else {
                for checked in batch { checked.record.acknowledgement.settle(.abandoned) }
                return
            }
            let (admitted, rest) = await processor.admit(batch)
            if !admitted.isEmpty { await writeQueue.push(admitted) }
            if !rest.isEmpty {
                stopped = true
                logger.info("left for redelivery", metadata: ["warden.messages": "\(rest.count)"])
                for checked in rest { checked.record.acknowledgement.settle(.abandoned) }
            }
        }
        var ready: [EventProcessor.Checked] = []
        /// Puts a record aside when it waits for keys or is behind one of its subject's that
        /// does; otherwise it is ready for admission.
        func place(_ checked: EventProcessor.Checked) async {
            while true {
                // A verified record's lane is looked up only while something waits: the common case
                // builds no lane key.
                guard let lane = checked.waitingLane
                    ?? (waiting.count > 0 ? checked.lane.flatMap({ waiting.holds($0) ? $0 : nil }) : nil) else {
                    ready.append(checked)
                    return
                }
                // A door whose sender can try again later (push) does not wait aside.
                guard checked.record.acknowledgement.waitsForKeys else {
                    checked.record.acknowledgement.settle(.abandoned)
                    return
                }
                if waiting.put(checked, lane: lane) { return }
                // The waiting room is full: admission waits for it to drain.
                await pass(ready)
                ready = []
                let released = waiting.takeReleased()
                if !released.isEmpty {
                    await pass(released)
                    continue
                }
                if stopped || processor.stop.isStopping || waiting.isClosed || Task.isCancelled {
                    checked.record.acknowledgement.settle(.abandoned)
                    return
                }
                await waiting.released()
            }
        }
        while let batches = await checkedQueue.takeAll() {
            // What came back from waiting goes first: later records of its lanes were held
            // behind it, and records still arriving for those lanes come after it.
            await pass(waiting.takeReleased())
            for batch in batches {
                for checked in batch { await place(checked) }
                await pass(ready)
                ready = []
            }
            metrics.gauge("warden_waiting_for_keys", []).record(waiting.count)
        }
        // The input ended: what still waits for keys keeps waiting until it has a verdict or
        // the process stops.
        while waiting.count > 0, !processor.stop.isStopping, !waiting.isClosed, !Task.isCancelled {
            await waiting.released()
            await pass(waiting.takeReleased())
            metrics.gauge("warden_waiting_for_keys", []).record(waiting.count)
        }
        for checked in waiting.takeAll() { checked.record.acknowledgement.settle(.abandoned) }
        metrics.gauge("warden_waiting_for_keys", []).record(0)
    }
}

/// Records waiting for their issuer's keys, each with the lane (subject) it holds back, and the
/// later records of those lanes queued behind them, in order.
final class WaitingRoom: Sendable {
    private struct Entry {
        let id: Int
        var checked: EventProcessor.Checked
        /// When it was put aside.
        let since: ContinuousClock.Instant
    }

    private struct State {
        /// Lanes in the order they began waiting; each lane's records in arrival order.
        var lanes: [String: [Entry]] = [:]
        var order: [String] = []
        var count = 0
        var nextID = 0
        var closed = false
        var releasedWaiters: [CheckedContinuation<Void, Never>] = []
        /// The retry loop, waiting for a record to be put aside.
        var emptyWaiter: CheckedContinuation<Void, Never>? = nil
    }

    private let state = Mutex(State())
    let limit: Int
    /// How long a record may wait for its keys before it is refused; nil: no limit.
    let maximumWait: Duration?

    /// See `EventPipeline.arrivalWindow`.
    let arrivalWindow: Double

    init(limit: Int, maximumWait: Duration? = nil, arrivalWindow: Double = 0) {
        self.limit = max(1, limit)
        self.maximumWait = maximumWait
        self.arrivalWindow = arrivalWindow
    }

    var count: Int { state.withLock { $0.count } }

    /// Closed: its retry loop has ended (the process is stopping, or the pipeline is done).
    var isClosed: Bool { state.withLock { $0.closed } }

    func holds(_ lane: String) -> Bool { state.withLock { $0.lanes[lane] != nil } }

    /// Queues a record in its lane; false when the room is full.
    func put(_ checked: EventProcessor.Checked, lane: String) -> Bool {
        let (put, waiter) = state.withLock { s -> (Bool, CheckedContinuation<Void, Never>?) in
            guard s.count < limit else { return (false, nil) }
            if s.lanes[lane] == nil { s.order.append(lane) }
            s.lanes[lane, default: []].append(Entry(id: s.nextID, checked: checked, since: .now))
            s.nextID += 1
            s.count += 1
            defer { s.emptyWaiter = nil }
            return (true, s.emptyWaiter)
        }
        // Before anyone can take it up: records leave the room only through admission, the
        // caller of `put`.
        if put { checked.record.acknowledgement.setAside(true) }
        waiter?.resume()
        return put
    }

    /// Returns once some record waits here, or the room closes (one caller: the retry loop).
    private func occupied() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let now = state.withLock { s -> Bool in
                if s.closed || s.count > 0 { return true }
                s.emptyWaiter = continuation
                return false
            }
            if now { continuation.resume() }
        }
    }

    /// The records at the head of their lanes that now have a verdict (or a verified token),
    /// in order; a lane whose records have all gone stops being held.
    func takeReleased() -> [EventProcessor.Checked] {
        takenUp(state.withLock { s in
            var out: [EventProcessor.Checked] = []
            for lane in s.order {
                guard var queue = s.lanes[lane] else { continue }
                let ready = queue.prefix { $0.checked.waitingLane == nil }
                guard !ready.isEmpty else { continue }
                out += ready.map(\.checked)
                queue.removeFirst(ready.count)
                s.lanes[lane] = queue.isEmpty ? nil : queue
            }
            if !out.isEmpty { s.order.removeAll { s.lanes[$0] == nil } }
            s.count -= out.count
            return out
        })
    }

    func takeAll() -> [EventProcessor.Checked] {
        takenUp(state.withLock { s in
            defer {
                s.lanes = [:]
                s.order = []
                s.count = 0
            }
            return s.order.flatMap { (s.lanes[$0] ?? []).map(\.checked) }
        })
    }

    /// Records leaving the room are their door's again.
    private func takenUp(_ records: [EventProcessor.Checked]) -> [EventProcessor.Checked] {
        for checked in records { checked.record.acknowledgement.setAside(false) }
        return records
    }

    /// Waits until a retry round has given some record a verdict, or the room closes.
    func released() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let resumeNow = state.withLock { s -> Bool in
                // Also when a retry round released records before anyone waited: no wake-up is lost.
                if s.closed || s.count == 0 || s.order.contains(where: { s.lanes[$0]?.first?.checked.waitingLane == nil }) {
                    return true
                }
                s.releasedWaiters.append(continuation)
                return false
            }
            if resumeNow { continuation.resume() }
        }
    }

    func close() {
        let waiter = state.withLock { s -> CheckedContinuation<Void, Never>? in
            s.closed = true
            defer { s.emptyWaiter = nil }
            return s.emptyWaiter
        }
        waiter?.resume()
        wakeWaiters()
    }

    private func wakeWaiters() {
        let waiters = state.withLock { s -> [CheckedContinuation<Void, Never>] in
            defer { s.releasedWaiters = [] }
            return s.releasedWaiters
        }
        for waiter in waiters { waiter.resume() }
    }

    /// The records waiting for keys (not those queued behind them), lane by lane.
    private func waitingEntries() -> [Entry] {
        state.withLock { s in s.order.flatMap { (s.lanes[$0] ?? []).filter { $0.checked.waitingLane != nil } } }
    }

    /// Waiting records whose door took them back (their Kafka partition went to another member,
    /// which reads them again) leave the room, settled `.abandoned`: neither verified again nor
    /// given up. Staying, one would hold its lane for as long as its issuer's keys cannot be had,
    /// and the copy read again if the partition comes back, behind it, would never leave.
    /// Whether any left.
    private func leaveTakenBack(processor: EventProcessor) -> Bool {
        let takenBack = Set(waitingEntries().filter { $0.checked.record.acknowledgement.refusesActions }.map(\.id))
        guard !takenBack.isEmpty else { return false }
        let left = state.withLock { s -> [EventProcessor.Checked] in
            var left: [EventProcessor.Checked] = []
            for lane in s.order {
                guard let queue = s.lanes[lane] else { continue }
                let kept = queue.filter { !takenBack.contains($0.id) }
                guard kept.count != queue.count else { continue }
                left += queue.filter { takenBack.contains($0.id) }.map(\.checked)
                s.lanes[lane] = kept.isEmpty ? nil : kept
            }
            s.order.removeAll { s.lanes[$0] == nil }
            s.count -= left.count
            return left
        }
        for checked in left {
            processor.logger.info("a message waiting for its issuer's keys was taken back by its door; it is left to be read again",
                                  metadata: ["warden.source": "\(checked.record.message.source)"])
            checked.record.acknowledgement.setAside(false)
            checked.record.acknowledgement.settle(.abandoned)
        }
        return !left.isEmpty
    }

    /// A record that waited `wait` for its keys, refused: admission then records it and
    /// dead-letters it (`keys_unavailable`, counted as a permanent failure), and its lane's
    /// later records go on. Nil, and it keeps waiting, when its door took it back (its Kafka
    /// partition went to another member, which reads it again) or when the ledger holds this
    /// very token as an event (a redelivery after a crash: refused, the event's pending steps
    /// would be left with nothing to run them), or cannot tell.
    private func giveUp(_ checked: EventProcessor.Checked, after wait: Duration,
                        processor: EventProcessor) async -> EventProcessor.Checked? {
        guard !checked.record.acknowledgement.refusesActions else { return nil }
        guard let stored = try? await processor.storedEvents(holding: [checked.record.message]), stored.isEmpty else { return nil }
        let reason = if case .failure(let error) = checked.result { error.description } else { "" }
        processor.logger.error("issuer keys unavailable for too long; the message is refused and dead-lettered", metadata: [
            "warden.source": "\(checked.record.message.source)", "warden.reason": "\(reason)", "warden.waited": "\(Self.words(wait))",
        ])
        return EventProcessor.Checked(record: checked.record, result: .failure(VerificationError(
            .keysUnavailableTooLong, "the issuer's keys could not be obtained in \(Self.words(wait)) (the last attempt: \(reason))")))
    }

    /// A wait in words: `24 h`, `90 s`, `0.5 s`.
    static func words(_ wait: Duration) -> String {
        let seconds = wait.timeInterval
        if seconds >= 3600, seconds.truncatingRemainder(dividingBy: 3600) == 0 { return "\(Int(seconds / 3600)) h" }
        if seconds >= 1, seconds.truncatingRemainder(dividingBy: 1) == 0 { return "\(Int(seconds)) s" }
        return "\(seconds) s"
    }

    /// Verifies the waiting records again, backing off between rounds, until closed or the
    /// process stops; wakes admission when some record has a verdict. A record still without
    /// keys after `maximumWait` is refused (`giveUp`).
    func retry(processor: EventProcessor, wake: @Sendable () -> Void) async {
        defer {
            close()
            wake()
        }
        var attempt = 0
        while true {
            let (closed, empty) = state.withLock { ($0.closed, $0.count == 0) }
            if closed { return }
            if empty {
                attempt = 0
                await occupied()
                continue
            }
            guard await processor.stop.pause(processor.backoff(attempt)) else { return }
            attempt += 1
            var changed = leaveTakenBack(processor: processor)
            let waiting = waitingEntries()
            for entry in waiting {
                var again = await processor.checkAgain(entry.checked, arrivalWindow: arrivalWindow)
                if again.waitingLane != nil, let maximumWait, entry.since.duration(to: .now) >= maximumWait,
                   let refused = await giveUp(again, after: maximumWait, processor: processor) {
                    again = refused
                }
                guard again.waitingLane == nil else { continue }
                changed = true
                state.withLock { s in
                    for lane in s.order {
                        guard let i = s.lanes[lane]?.firstIndex(where: { $0.id == entry.id }) else { continue }
                        s.lanes[lane]![i].checked = again
                        break
                    }
                }
            }
            processor.metrics.retried("keys_unavailable")
            if changed {
                attempt = 0
                wakeWaiters()
                wake()
            } else if let first = waiting.first, case .failure(let error) = first.checked.result {
                processor.logger.warning("issuer keys unavailable; will retry", metadata: [
                    "warden.waiting": "\(waiting.count)", "warden.source": "\(first.checked.record.message.source)",
                    "warden.reason": "\(error.description)", "warden.attempt": "\(attempt)",
                ])
            }
        }
    }
}
