import Foundation
public import Logging
import Synchronization

/// Tells long waits (retries, backoffs) that the process is stopping: a wait ends when the
/// signal is given or its task is cancelled, not by looking at a flag now and then.
public final class StopSignal: Sendable {
    private struct State {
        var stopping = false
        var waiters: [Int: CheckedContinuation<Void, Never>] = [:]
        var next = 0
    }

    private let state = Mutex(State())
    public init() {}

    public func stop() {
        let waiters = state.withLock { s -> [CheckedContinuation<Void, Never>] in
            s.stopping = true
            defer { s.waiters = [:] }
            return Array(s.waiters.values)
        }
        for waiter in waiters { waiter.resume() }
    }

    public var isStopping: Bool { state.withLock { $0.stopping } }

    /// Returns once `stop()` is called, or at once when the task is cancelled.
    public func stopped() async {
        let id = state.withLock { s -> Int in
            defer { s.next += 1 }
            return s.next
        }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { s -> Bool in
                    if s.stopping || Task.isCancelled { return true }
                    s.waiters[id] = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            state.withLock { $0.waiters.removeValue(forKey: id) }?.resume()
        }
    }

    /// Sleeps up to `seconds`, ending early when stopping (or cancelled). Returns false when
    /// stopping or cancelled.
    public func pause(_ seconds: Double) async -> Bool {
        if isStopping || Task.isCancelled { return false }
        let slept = await withTaskGroup(of: Bool.self) { group in
            group.addTask { (try? await Task.sleep(for: .seconds(seconds))) != nil }
            group.addTask {
                await self.stopped()
                return false
            }
            let first = await group.next() ?? false
            group.cancelAll()
            return first
        }
        return slept && !isStopping && !Task.isCancelled
    }
}

/// What the pipeline's retries and an event's steps report, for metrics.
public protocol StepObserver: Sendable {
    /// A call failed in a way a retry may mend, and will be made again (`what`: `ledger`,
    /// `dead-letter`, `step`, `circuit_open`, `lease`, …).
    func retried(_ what: String)
    /// A call failed in a way no retry can mend.
    func failedForGood(_ what: String)
    /// A target answered a step: `done`, `retry` or `failed`.
    func stepAnswered(kind: String, result: String)
    /// A dead letter was produced.
    func deadLettered()
    /// A step's outcome became durable this long after its target answered.
    func outcomeDurable(after wait: Duration)
    /// A target answered a step of `kind` this many seconds after it was called.
    func stepTook(kind: String, seconds: Double)
    /// Every step of an event is done, this many seconds after the event arrived.
    func eventDone(afterArrival seconds: Double)
    /// Whether the target's breaker is open (the target resting) after its last answer.
    func breaker(target: String, open: Bool)
}

extension StepObserver {
    public func stepTook(kind: String, seconds: Double) {}
    public func eventDone(afterArrival seconds: Double) {}
    public func breaker(target: String, open: Bool) {}
}

/// Calls something until it succeeds: backing off between failures a retry may mend, giving up
/// at once on one that no retry can mend, and when the process stops. Nothing is retried for ever
/// that can never succeed.
public struct Persistence: Sendable {
    /// Backoff bounds: the first pause, doubling up to `maximumBackoff` (each with jitter).
    public struct Timing: Sendable {
        public var initialBackoff: Duration
        public var maximumBackoff: Duration

        public init(initialBackoff: Duration = .milliseconds(500), maximumBackoff: Duration = .seconds(30)) {
            self.initialBackoff = initialBackoff
            self.maximumBackoff = maximumBackoff
        }
    }

    public let timing: Timing
    public let stop: StopSignal
    let observer: any StepObserver
    let logger: Logger
    /// Whether a retry may mend an error: each error type says so.
    let isRetryable: @Sendable (any Error) -> Bool

    public init(timing: Timing, stop: StopSignal, observer: any StepObserver, logger: Logger,
                isRetryable: @escaping @Sendable (any Error) -> Bool) {
        self.timing = timing
        self.stop = stop
        self.observer = observer
        self.logger = logger
        self.isRetryable = isRetryable
    }

    /// What calling something until it succeeds came to.
    public enum Attempted<T> {
        case done(T)
        /// It failed in a way no retry can mend (a value the ledger cannot hold, a dead letter
        /// the cluster will never take, a step recorded by another owner).
        case refused(any Error)
        /// The process is stopping (or the attempts a caller allowed ran out): leave it for later.
        case stopped
    }

    /// Runs `body` until it succeeds, backing off between failures a retry may mend; a failure
    /// that no retry can mend is returned at once, and counted. With `maximumAttempts` (a caller
    /// that must answer soon), `.stopped` once that many attempts failed.
    public func attempting<T>(_ what: String, maximumAttempts: Int? = nil, _ body: () async throws -> T) async -> Attempted<T> {
        var attempt = 0
        while true {
            do {
                return .done(try await body())
            } catch {
                guard isRetryable(error) else {
                    observer.failedForGood(what)
                    logger.critical("\(what) failed for good; not retried", metadata: ["warden.reason": "\(error)"])
                    return .refused(error)
                }
                if let maximumAttempts, attempt + 1 >= maximumAttempts {
                    logger.error("\(what) failed; left for later", metadata: ["warden.reason": "\(error)", "warden.attempt": "\(attempt)"])
                    return .stopped
                }
                observer.retried(what)
                logger.error("\(what) failed; will retry", metadata: ["warden.reason": "\(error)", "warden.attempt": "\(attempt)"])
                guard await stop.pause(backoff(attempt)) else { return .stopped }
                attempt += 1
            }
        }
    }

    /// `attempting`, for callers to whom a refusal and a stop mean the same: leave the work for
    /// later (nil).
    public func retrying<T>(_ what: String, _ body: () async throws -> T) async -> T? {
        if case .done(let value) = await attempting(what, body) { return value }
        return nil
    }

    /// The pause before retry number `attempt` (from 0), in seconds, with jitter.
    public func backoff(_ attempt: Int) -> Double {
        let base = min(timing.maximumBackoff.timeInterval, timing.initialBackoff.timeInterval * pow(2, Double(min(attempt, 16))))
        return base * Double.random(in: 0.5...1.0)
    }
}

/// Where messages that cannot be acted on go (invalid tokens, steps failed for good), with the
/// error as headers. Returns once the dead letter is durable.
public protocol DeadLetterSink: Sendable {
    /// `key` and `headers`: the original message's, when its door had them (Kafka), so that the
    /// dead letter lands on the same partition key and can be re-driven as it came.
    func deadLetter(value: [UInt8], key: [UInt8]?, headers: [MessageHeader], code: String, description: String,
                    source: String) async throws(DeadLetterError)
}

extension DeadLetterSink {
    /// A message with neither key nor headers (an event resumed from the ledger, a push).
    public func deadLetter(value: [UInt8], code: String, description: String, source: String) async throws(DeadLetterError) {
        try await deadLetter(value: value, key: nil, headers: [], code: code, description: description, source: source)
    }
}

/// A header of a message as it arrived (Kafka's: a name and an optional value).
public struct MessageHeader: Sendable, Equatable {
    public var name: String
    public var value: [UInt8]?

    public init(name: String, value: [UInt8]?) {
        self.name = name
        self.value = value
    }
}

/// Why a dead letter could not be sent, and whether sending it again can help.
public struct DeadLetterError: Error, Sendable, CustomStringConvertible {
    public var description: String
    public var isRetryable: Bool

    public init(_ description: String, isRetryable: Bool) {
        self.description = description
        self.isRetryable = isRetryable
    }
}

extension Duration {
    /// The duration in seconds, as a `Double`.
    public var timeInterval: Double {
        let (s, attoseconds) = components
        return Double(s) + Double(attoseconds) / 1e18
    }
}
