@testable import Pipeline
import Synchronization
import Testing

/// The push receiver's per-client token buckets, on a clock the test moves.
@Suite("Client rate limiter")
struct RateLimiterTests {
    final class Clock: Sendable {
        let now = Mutex(100.0)
        func advance(_ seconds: Double) { now.withLock { $0 += seconds } }
    }

    @Test func eachClientHasItsBurstThenItsRate() {
        let clock = Clock()
        let limiter = ClientRateLimiter(settings: .init(perSecond: 2, burst: 3), now: { clock.now.withLock { $0 } })
        for _ in 0..<3 { #expect(throws: Never.self) { try limiter.admit("10.0.0.1").get() } }
        guard case .failure(let limited) = limiter.admit("10.0.0.1") else {
            Issue.record("a fourth request at once was let in")
            return
        }
        #expect(limited.retryAfter > 0 && limited.retryAfter <= 0.5)
        // Another client is not slowed by the first.
        #expect(throws: Never.self) { try limiter.admit("10.0.0.2").get() }
        // Half a second later, one more (2 a second).
        clock.advance(0.5)
        #expect(throws: Never.self) { try limiter.admit("10.0.0.1").get() }
        #expect(throws: RateLimited.self) { try limiter.admit("10.0.0.1").get() }
        // A long pause refills the bucket only up to its burst.
        clock.advance(60)
        for _ in 0..<3 { #expect(throws: Never.self) { try limiter.admit("10.0.0.1").get() } }
        #expect(throws: RateLimited.self) { try limiter.admit("10.0.0.1").get() }
    }

    @Test func aFloodOfAddressesDoesNotGrowItWithoutBound() {
        let clock = Clock()
        let limiter = ClientRateLimiter(settings: .init(perSecond: 1, burst: 2), maximumClients: 100, now: { clock.now.withLock { $0 } })
        // One client that has used its burst is remembered while others come and go.
        _ = limiter.admit("busy")
        _ = limiter.admit("busy")
        for i in 0..<10_000 { _ = limiter.admit("client-\(i)") }
        #expect(limiter.clientCount <= 100)
        #expect(throws: RateLimited.self) { try limiter.admit("busy").get() }
    }
}
