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

    // An event the target keeps refusing (a 503 for that user alone) must not take every trial:
    // each failed trial doubles the cooldown while the events the target would serve wait.
    // After a cooldown, the event whose trial failed gives the others the first turn; alone, it
    // may try again a moment later.
    @Test func theEventWhoseTrialFailedGivesTheOthersTheNextTrial() {
        let clock = Clock()
        let breakers = CircuitBreakers(settings: .init(threshold: 2, cooldown: .seconds(5), maximumCooldown: .seconds(300)), now: { clock.now })
        let refused: Int64 = 7, served: Int64 = 8
        for _ in 0..<2 {
            #expect(breakers.allow("revoke", for: refused))
            breakers.record("revoke", reachable: false, calledAt: clock.now)
        }
        #expect(breakers.isOpen("revoke"))
        clock.advance(5)
        #expect(breakers.allow("revoke", for: refused))  // the first trial: nobody's failed yet
        breakers.record("revoke", reachable: false, calledAt: clock.now)
        clock.advance(10)  // the doubled cooldown
        #expect(!breakers.allow("revoke", for: refused), "the event whose trial failed took the next one first")
        #expect(breakers.allow("revoke", for: served))
        breakers.record("revoke", reachable: true, calledAt: clock.now)
        #expect(!breakers.isOpen("revoke"))
        #expect(breakers.allow("revoke", for: refused))

        // Alone, it waits the grace out and then tries again.
        breakers.record("revoke", reachable: false, calledAt: clock.now)
        breakers.record("revoke", reachable: false, calledAt: clock.now)
        clock.advance(5)
        #expect(breakers.allow("revoke", for: refused))
        breakers.record("revoke", reachable: false, calledAt: clock.now)
        clock.advance(10)
        #expect(!breakers.allow("revoke", for: refused))
        clock.advance(CircuitBreakers.trialGrace)
        #expect(breakers.allow("revoke", for: refused))
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
