@testable import Invalidation
import Synchronization
import Testing

@Suite("Circuit breakers per target")
struct CircuitBreakerTests {
    final class Clock: Sendable {
        let time = Mutex<Double>(1000)
        func advance(_ seconds: Double) { time.withLock { $0 += seconds } }
        var now: Double { time.withLock { $0 } }
    }

    @Test func opensAfterRepeatedFailuresTriesOnceAfterTheCooldownAndClosesOnSuccess() {
        let clock = Clock()
        let breakers = CircuitBreakers(settings: .init(threshold: 3, cooldown: .seconds(10), maximumCooldown: .seconds(25)), now: { clock.now })
        for _ in 0..<2 {
            #expect(breakers.allow("redis"))
            breakers.record("redis", reachable: false)
        }
        #expect(!breakers.isOpen("redis"))
        breakers.record("redis", reachable: false)
        #expect(breakers.isOpen("redis"))
        #expect(!breakers.allow("redis"))
        #expect(breakers.allow("webhook"))  // other targets are not affected
        clock.advance(10)
        #expect(breakers.allow("redis"))    // one trial call
        #expect(!breakers.allow("redis"))   // and only one
        breakers.record("redis", reachable: false)
        clock.advance(10)
        #expect(!breakers.allow("redis"))   // the cooldown doubled to 20
        clock.advance(10)
        #expect(breakers.allow("redis"))
        breakers.record("redis", reachable: false)
        clock.advance(24)
        #expect(!breakers.allow("redis"))   // capped at 25
        clock.advance(1)
        #expect(breakers.allow("redis"))
        breakers.record("redis", reachable: true)
        #expect(!breakers.isOpen("redis"))
        #expect(breakers.allow("redis") && breakers.allow("redis"))
    }

    // 76 calls in flight when the target starts refusing: their failures open the breaker
    // once; they do not push its cooldown towards the cap.
    @Test func failuresOfCallsInFlightWhenItOpenedDoNotLengthenTheCooldown() {
        let clock = Clock()
        let breakers = CircuitBreakers(settings: .init(threshold: 5, cooldown: .seconds(5), maximumCooldown: .seconds(300)), now: { clock.now })
        let calledAt = clock.now
        for _ in 0..<76 { #expect(breakers.allow("revoke")) }
        clock.advance(0.2)
        for _ in 0..<76 { breakers.record("revoke", reachable: false, calledAt: calledAt) }
        #expect(breakers.isOpen("revoke"))
        #expect(!breakers.allow("revoke"))
        clock.advance(5)
        // The first cooldown, not 300 s: the trial call goes out after 5 s.
        #expect(breakers.allow("revoke"))
        let trialAt = clock.now
        breakers.record("revoke", reachable: true, calledAt: trialAt)
        #expect(!breakers.isOpen("revoke"))
        #expect(breakers.allow("revoke"))
        #expect(breakers.retryDelay("revoke") == 0)
    }

    @Test func tellsWhetherATargetSucceededSinceAMoment() {
        let clock = Clock()
        let breakers = CircuitBreakers(now: { clock.now })
        #expect(!breakers.succeeded("app", since: 0))
        let before = clock.now
        clock.advance(1)
        breakers.record("app", reachable: true)
        #expect(breakers.succeeded("app", since: before))
        #expect(!breakers.succeeded("app", since: clock.now))
    }
}
