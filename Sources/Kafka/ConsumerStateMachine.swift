/// The consumer's lifecycle, one state at a time. The poll thread asks it what to do next;
/// `stopFetching` and `close` (from any task) and the group's assignments move it on.
///
///     fetching ──stopFetching──▶ draining ──close──▶ closing ──▶ closed
///        └───────────────────close──────────────────────▲
struct ConsumerStateMachine: Sendable {
    enum State: Sendable, Equatable {
        /// Handing out messages. `paused`: the assigned partitions are paused because too much
        /// is in flight; `blockedSince`: since when fetching has waited for room.
        case fetching(paused: Bool, blockedSince: Double?)
        /// Handing out nothing more (the stream of messages ends), but still in the group and
        /// polling with its partitions paused, so work in flight can finish and be committed.
        case draining(streamFinished: Bool, paused: Bool)
        /// Commit what is finished and leave the group.
        case closing(streamFinished: Bool)
        /// Left the group (or failed).
        case closed
    }

    /// What the poll thread does next.
    enum Action: Sendable, Equatable {
        /// Poll once; hand out what arrives when `deliver`.
        case poll(deliver: Bool)
        /// Wait a moment for a message to finish (too much is in flight), committing meanwhile.
        case waitForRoom
        case pause
        case resume
        /// End the stream of messages.
        case finishStream
        /// Commit what is finished and leave the group (ending the stream first if `finishStream`).
        case leave(finishStream: Bool)
        /// Nothing more: `run()` returns.
        case exit
    }

    private(set) var state: State = .fetching(paused: false, blockedSince: nil)
    /// Whether the group has given this member an assignment (possibly empty).
    private(set) var joined = false
    let maximumInFlight: Int
    /// How long fetching may wait for room before the partitions are paused (seconds). A short
    /// wait does not poll (librdkafka keeps what it prefetched); a long one pauses, which drops
    /// the prefetched messages but lets polling go on, so the member stays in its group.
    let pauseAfter: Double

    init(maximumInFlight: Int, pauseAfter: Double = 5) {
        self.maximumInFlight = max(1, maximumInFlight)
        self.pauseAfter = pauseAfter
    }

    /// Whether the assigned partitions are paused (newly assigned ones are paused too).
    var isPaused: Bool {
        switch state {
        case .fetching(let paused, _), .draining(_, let paused): paused
        case .closing, .closed: false
        }
    }

    mutating func stopFetching() {
        if case .fetching(let paused, _) = state { state = .draining(streamFinished: false, paused: paused) }
    }

    mutating func close() {
        switch state {
        case .fetching: state = .closing(streamFinished: false)
        case .draining(let streamFinished, _): state = .closing(streamFinished: streamFinished)
        case .closing, .closed: break
        }
    }

    /// The group gave this member an assignment. Returns whether its partitions are to be paused.
    mutating func assigned() -> Bool {
        joined = true
        return isPaused
    }

    /// librdkafka reported a fatal error: the stream ends and the member leaves.
    mutating func failed() { state = .closed }

    /// What to do next, with `inFlight` messages handed out and not finished, at time `now`.
    mutating func next(inFlight: Int, now: Double) -> Action {
        switch state {
        case .closed:
            return .exit
        case .closing(let streamFinished):
            state = .closed
            return .leave(finishStream: !streamFinished)
        case .draining(let streamFinished, let paused):
            if !streamFinished {
                state = .draining(streamFinished: true, paused: paused)
                return .finishStream
            }
            if !paused {
                state = .draining(streamFinished: true, paused: true)
                return .pause
            }
            return .poll(deliver: false)
        case .fetching(let paused, let blockedSince):
            if inFlight >= maximumInFlight {
                let since = blockedSince ?? now
                if !paused, now - since >= pauseAfter {
                    state = .fetching(paused: true, blockedSince: since)
                    return .pause
                }
                state = .fetching(paused: paused, blockedSince: since)
                return paused ? .poll(deliver: true) : .waitForRoom
            }
            if paused, inFlight <= maximumInFlight / 2 {
                state = .fetching(paused: false, blockedSince: nil)
                return .resume
            }
            state = .fetching(paused: paused, blockedSince: nil)
            return .poll(deliver: true)
        }
    }
}
