import Foundation
import Synchronization

/// One circuit breaker per target. After `threshold` retryable failures in a row the target is
/// left alone for `cooldown` seconds (doubling while it stays down, up to `maximumCooldown`);
/// then one call is let through to try it. Events meanwhile wait — nothing is dropped. The event
/// whose trial failed gives the others the first turn at the next trial: an event the target keeps
/// refusing while it would serve others could otherwise take every trial, doubling the cooldown
/// each time while the others wait. The
/// breaker also tells whether a target has succeeded since a moment, so an event the target
/// keeps refusing while serving others can be told from a target that is down.
public final class CircuitBreakers: Sendable {
    public struct Settings: Sendable {
        /// Retryable failures in a row that open a target's breaker.
        public var threshold: Int
        /// How long an open breaker first rests its target, and the longest it rests it.
        public var cooldown: Duration
        public var maximumCooldown: Duration

        public init(threshold: Int = 5, cooldown: Duration = .seconds(5), maximumCooldown: Duration = .seconds(300)) {
            self.threshold = threshold
            self.cooldown = cooldown
            self.maximumCooldown = maximumCooldown
        }
    }

    private struct Breaker {
        var failures = 0
        var openUntil: Double? = nil
        /// When it last opened (or its cooldown last grew): failures of calls made before then
        /// are already accounted for.
        var openedAt: Double = 0
        var cooldown: Double
        var trialInFlight = false
        /// The event making the trial call under way, and the one whose trial failed last.
        var trialBy: Int64? = nil
        var failedTrialBy: Int64? = nil
        var lastSuccess: Double = 0

        init(cooldown: Double, lastSuccess: Double = 0) {
            self.cooldown = cooldown
            self.lastSuccess = lastSuccess
        }
    }

    let threshold: Int
    let cooldown: Double
    let maximumCooldown: Double
    private let now: @Sendable () -> Double
    private let breakers = Mutex<[String: Breaker]>([:])

    init(settings: Settings = Settings(), now: @escaping @Sendable () -> Double = { Date().timeIntervalSince1970 }) {
        self.threshold = settings.threshold
        self.cooldown = settings.cooldown.timeInterval
        self.maximumCooldown = settings.maximumCooldown.timeInterval
        self.now = now
    }

    /// How long after a cooldown the event whose trial failed last waits for another to make
    /// the next trial (events waiting ask again at the cooldown's end, or within a second).
    static let trialGrace: Double = 1

    /// Whether a call to `target` may be made now, for `event` (the event the call is for).
    func allow(_ target: String, for event: Int64? = nil) -> Bool {
        let t = now()
        return breakers.withLock { all in
            var b = all[target] ?? Breaker(cooldown: cooldown)
            defer { all[target] = b }
            guard let until = b.openUntil else { return true }
            if t < until || b.trialInFlight { return false }
            if let event, event == b.failedTrialBy, t < until + Self.trialGrace { return false }
            b.trialInFlight = true  // half-open: one trial call
            b.trialBy = event
            return true
        }
    }

    /// Records a call's result: `reachable` is false for retryable failures (down, 5xx, 429).
    /// `calledAt` is when the call was made (`currentTime` then): a failure of a call already in
    /// flight when the breaker opened tells nothing new and does not lengthen the cooldown —
    /// only a call let through after it opened (the half-open trial) does.
    func record(_ target: String, reachable: Bool, calledAt: Double? = nil) {
        let t = now()
        breakers.withLock { all in
            var b = all[target] ?? Breaker(cooldown: cooldown)
            defer { all[target] = b }
            if reachable {
                b = Breaker(cooldown: cooldown, lastSuccess: t)
                return
            }
            if b.openUntil != nil {
                if let calledAt, calledAt < b.openedAt { return }
                b.trialInFlight = false
                b.failedTrialBy = b.trialBy
                b.trialBy = nil
                b.cooldown = min(maximumCooldown, b.cooldown * 2)
                b.openUntil = t + b.cooldown
                b.openedAt = t
                return
            }
            b.failures += 1
            if b.failures >= threshold {
                b.openUntil = t + b.cooldown
                b.openedAt = t
            }
        }
    }

    /// How long to wait before asking `allow` again: until the cooldown ends, or, while a
    /// trial call is out, a short while (it may close the breaker any moment).
    func retryDelay(_ target: String) -> Double {
        let t = now()
        return breakers.withLock { all -> Double in
            guard let b = all[target], let until = b.openUntil else { return 0 }
            if b.trialInFlight || until <= t { return 0.25 }
            return min(until - t, 1)
        }
    }

    func isOpen(_ target: String) -> Bool { breakers.withLock { $0[target]?.openUntil != nil } }

    /// Whether `target` answered a call successfully after `moment`.
    func succeeded(_ target: String, since moment: Double) -> Bool {
        breakers.withLock { ($0[target]?.lastSuccess ?? 0) > moment }
    }

    var currentTime: Double { now() }
}
