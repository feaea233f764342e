import Synchronization

/// Batches handed from one stage of the pipeline to the next, in arrival order. `push` waits
/// while `limit` messages are already waiting; `takeAll` waits for at least one batch.
final class BatchQueue<Element: Sendable>: Sendable {
    typealias Item = [Element]
    private struct State {
        var items: [Item] = []
        var waiting = 0
        var closed = false
        /// A wake-up no reader was waiting for: the next `takeAll` returns at once.
        var woken = false
        var reader: CheckedContinuation<[Item]?, Never>? = nil
        var writers: [CheckedContinuation<Void, Never>] = []
    }

    private let limit: Int
    private let state = Mutex(State())

    init(limit: Int) { self.limit = limit }

    func push(_ item: Item) async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let (reader, items, proceed) = state.withLock { s -> (CheckedContinuation<[Item]?, Never>?, [Item], Bool) in
                s.items.append(item)
                s.waiting += item.count
                if let reader = s.reader {
                    s.reader = nil
                    let items = s.items
                    s.items = []
                    s.waiting = 0
                    return (reader, items, true)
                }
                if s.waiting < limit { return (nil, [], true) }
                s.writers.append(continuation)
                return (nil, [], false)
            }
            reader?.resume(returning: items)
            if proceed { continuation.resume() }
        }
    }

    func takeAll() async -> [Item]? {
        await withCheckedContinuation { (continuation: CheckedContinuation<[Item]?, Never>) in
            let (taken, released) = state.withLock { s -> ([Item]??, [CheckedContinuation<Void, Never>]) in
                if s.items.isEmpty {
                    if s.closed { return (.some(nil), []) }
                    if s.woken {
                        s.woken = false
                        return (.some([]), [])
                    }
                    s.reader = continuation
                    return (nil, [])
                }
                let items = s.items
                s.items = []
                s.waiting = 0
                defer { s.writers = [] }
                return (.some(items), s.writers)
            }
            for writer in released { writer.resume() }
            if let taken { continuation.resume(returning: taken) }
        }
    }

    /// Wakes a reader waiting in `takeAll` with no batches (something else is ready for it).
    func wake() {
        let reader = state.withLock { s -> CheckedContinuation<[Item]?, Never>? in
            defer { s.reader = nil }
            if s.reader == nil { s.woken = true }
            return s.reader
        }
        reader?.resume(returning: [])
    }

    func close() {
        let reader = state.withLock { s -> CheckedContinuation<[Item]?, Never>? in
            s.closed = true
            defer { s.reader = nil }
            return s.items.isEmpty ? s.reader : nil
        }
        reader?.resume(returning: nil)
    }
}



/// Writes under way at once, at most `limit`, whose results are handed on in the order the
/// writes started, whichever finishes first.
final class WritesInOrder<Result: Sendable>: Sendable {
    private struct State {
        var started = 0
        /// The ticket whose result is handed on next.
        var next = 0
        var results: [Int: Result] = [:]
        var closed = false
        var reader: CheckedContinuation<Result?, Never>? = nil
        var starter: CheckedContinuation<Int, Never>? = nil
    }

    private let limit: Int
    private let state = Mutex(State())

    init(limit: Int) { self.limit = max(1, limit) }

    /// A ticket for the next write, once fewer than `limit` are under way or waiting to be
    /// handed on (one caller: the stage starting writes).
    func start() async -> Int {
        await withCheckedContinuation { (continuation: CheckedContinuation<Int, Never>) in
            let ticket = state.withLock { s -> Int? in
                guard s.started - s.next < limit else {
                    s.starter = continuation
                    return nil
                }
                defer { s.started += 1 }
                return s.started
            }
            if let ticket { continuation.resume(returning: ticket) }
        }
    }

    /// The result of the write `ticket` started.
    func finish(_ ticket: Int, _ result: Result) {
        let (reader, handed) = state.withLock { s -> (CheckedContinuation<Result?, Never>?, Result?) in
            guard ticket == s.next, let reader = s.reader else {
                s.results[ticket] = result
                return (nil, nil)
            }
            s.reader = nil
            return (reader, result)
        }
        guard let reader, let handed else { return }
        handOn(reader, handed)
    }

    /// The next result in ticket order; nil once closed and every result was handed on (one
    /// caller: the stage taking results).
    func next() async -> Result? {
        await withCheckedContinuation { (continuation: CheckedContinuation<Result?, Never>) in
            let (ready, done) = state.withLock { s -> (Result?, Bool) in
                if let result = s.results.removeValue(forKey: s.next) { return (result, false) }
                if s.closed, s.next == s.started { return (nil, true) }
                s.reader = continuation
                return (nil, false)
            }
            if let ready { handOn(continuation, ready) } else if done { continuation.resume(returning: nil) }
        }
    }

    /// No write starts after this one.
    func close() {
        let reader = state.withLock { s -> CheckedContinuation<Result?, Never>? in
            s.closed = true
            guard s.next == s.started, s.results.isEmpty else { return nil }
            defer { s.reader = nil }
            return s.reader
        }
        reader?.resume(returning: nil)
    }

    /// Counts `result` as handed on (its write's slot is free) and gives it to the reader.
    private func handOn(_ reader: CheckedContinuation<Result?, Never>, _ result: Result) {
        let starter = state.withLock { s -> (CheckedContinuation<Int, Never>, Int)? in
            s.next += 1
            guard let starter = s.starter else { return nil }
            s.starter = nil
            defer { s.started += 1 }
            return (starter, s.started)
        }
        reader.resume(returning: result)
        if let (starter, ticket) = starter { starter.resume(returning: ticket) }
    }
}

/// Keeps one subject's events in order while different subjects' run at once: each event
/// waits for the gate of the subject's previous event, which opens when that one is done.
final class SubjectLanes: Sendable {
    struct Turn: Sendable {
        let previous: Gate?
        let mine: Gate
    }

    private let last = Mutex<[String: Gate]>([:])

    func enter(_ key: String) -> Turn {
        let gate = Gate()
        let previous = last.withLock { lanes -> Gate? in
            defer { lanes[key] = gate }
            return lanes[key]
        }
        return Turn(previous: previous, mine: gate)
    }

    /// Forgets the subject's lane when `gate` is still its last one.
    func leave(_ key: String, _ gate: Gate) {
        last.withLock { lanes in if lanes[key] === gate { lanes[key] = nil } }
    }
}

/// Opens once, telling whether the event before passed (its steps done) or was abandoned;
/// `wait` returns that once it is open.
final class Gate: Sendable {
    private let state = Mutex<(passed: Bool?, waiters: [CheckedContinuation<Bool, Never>])>((nil, []))

    func open(passed: Bool) {
        let waiters = state.withLock { s -> [CheckedContinuation<Bool, Never>] in
            s.passed = passed
            defer { s.waiters = [] }
            return s.waiters
        }
        for waiter in waiters { waiter.resume(returning: passed) }
    }

    func wait() async -> Bool {
        await withCheckedContinuation { (continuation: CheckedContinuation<Bool, Never>) in
            let passed = state.withLock { s -> Bool? in
                if s.passed == nil { s.waiters.append(continuation) }
                return s.passed
            }
            if let passed { continuation.resume(returning: passed) }
        }
    }
}
