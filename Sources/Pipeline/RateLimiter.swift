import Foundation
import Synchronization

/// A token bucket per client (its IP address): each client may make `burst` requests at once
/// and `perSecond` a second after that. A client over its rate is refused (`429`) without
/// slowing anyone else. Buckets of clients gone quiet are forgotten, so a flood of addresses
/// cannot grow it without bound.
public final class ClientRateLimiter: Sendable {
    public struct Settings: Sendable, Equatable {
        public var perSecond: Double
        public var burst: Int

        public init(perSecond: Double, burst: Int) {
            self.perSecond = max(0.001, perSecond)
            self.burst = max(1, burst)
        }
    }

    private struct Bucket {
        var tokens: Double
        var updated: Double
    }

    private struct State {
        var buckets: [String: Bucket] = [:]
    }

    public let settings: Settings
    /// Clients remembered at most; past it, full buckets (clients that would be let in anyway)
    /// are forgotten first.
    let maximumClients: Int
    private let now: @Sendable () -> Double
    private let state = Mutex(State())

    public init(settings: Settings, maximumClients: Int = 65_536, now: @escaping @Sendable () -> Double = { monotonicSeconds() }) {
        self.settings = settings
        self.maximumClients = max(1, maximumClients)
        self.now = now
    }

    /// Takes one request's token; when none is left, how many seconds until one is.
    public func admit(_ client: String) -> Result<Void, RateLimited> {
        let t = now()
        let perSecond = settings.perSecond, burst = Double(settings.burst)
        return state.withLock { s -> Result<Void, RateLimited> in
            if s.buckets.count >= maximumClients { Self.sweep(&s, at: t, perSecond: perSecond, burst: burst, keep: maximumClients / 2) }
            var bucket = s.buckets[client] ?? Bucket(tokens: burst, updated: t)
            bucket.tokens = min(burst, bucket.tokens + max(0, t - bucket.updated) * perSecond)
            bucket.updated = t
            defer { s.buckets[client] = bucket }
            guard bucket.tokens >= 1 else { return .failure(RateLimited(retryAfter: (1 - bucket.tokens) / perSecond)) }
            bucket.tokens -= 1
            return .success(())
        }
    }

    /// Gives back a token `admit` took (the request it was taken for did not need it).
    public func giveBack(_ client: String) {
        let burst = Double(settings.burst)
        state.withLock { s in
            guard var bucket = s.buckets[client] else { return }
            bucket.tokens = min(burst, bucket.tokens + 1)
            s.buckets[client] = bucket
        }
    }

    /// Clients remembered now.
    var clientCount: Int { state.withLock { $0.buckets.count } }

    /// Forgets the buckets that have refilled; if that is not enough, the fullest ones.
    private static func sweep(_ s: inout State, at t: Double, perSecond: Double, burst: Double, keep: Int) {
        s.buckets = s.buckets.filter { min(burst, $0.value.tokens + (t - $0.value.updated) * perSecond) < burst }
        if s.buckets.count > keep {
            let kept = s.buckets.sorted { $0.value.tokens < $1.value.tokens }.prefix(keep)
            s.buckets = Dictionary(uniqueKeysWithValues: kept.map { ($0.key, $0.value) })
        }
    }
}

/// A request refused for its client's rate, and when to try again.
public struct RateLimited: Error, Sendable, Equatable {
    public var retryAfter: Double
}

/// Seconds on a clock that never goes back (from an arbitrary start).
public func monotonicSeconds() -> Double {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
}
