import CoreMetrics
import Foundation
import Invalidation
import Ledger
import Logging
@testable import Pipeline
import Prometheus
import SETMinting
import SecurityEvents
import Synchronization
import Testing
import WardenTestSupport
import TokenVerification

/// The pipeline's core in-process, with fakes of the ledger, the dead-letter sink and the
/// executor, and real verification of tokens minted here with throwaway keys.
@Suite("Pipeline core, in-process", .timeLimit(.minutes(2)))
struct CoreTests {
    static let issuerA = "https://a.example/"
    static let issuerB = "https://b.example/"
    static let audience = "warden-test"
    static let keyA = try! SigningKey.rsa(keyID: "a1", bits: 2048)
    static let keyB1 = try! SigningKey.rsa(keyID: "b1", bits: 2048)
    static let keyB2 = try! SigningKey.rsa(keyID: "b2", bits: 2048)

    static var logger: Logger {
        var logger = Logger(label: "core-test")
        logger.logLevel = .critical
        return logger
    }

    /// Two steps for every sessions-revoked event (the executor only counts and scripts them).
    static let policy = Policy(rules: [
        EventType.sessionsRevoked.uri: [
            PolicyRule(.purgeSet(target: "sessions", set: "sessions:{user}")),
            PolicyRule(.setFlag(target: "sessions", key: "blocked:{user}", value: "1", ttl: nil)),
        ],
    ])

    /// The world of one test: issuer A with pinned keys; issuer B whose keys come from a
    /// fetcher that can fail, under a clock that can be moved forward.
    final class World: Sendable {
        let ledger: MemoryLedger
        let deadLetters = MemoryDeadLetters()
        let executor = ScriptedExecutor()
        let fetcherB = SwitchableKeyFetcher()
        let clockOffset = ClockOffset()
        let stop = StopSignal()
        let processor: EventProcessor

        /// A process; `ledger` shared with another one, when given; `realLedger` in place of
        /// the fake, when given (`ledger` is then unused).
        init(ledger: MemoryLedger = MemoryLedger(), steps: StepRunner.Configuration = .init(),
             metrics: any MetricsFactory = NOOPMetricsHandler.instance, resolver: any SubjectResolver = IdentityResolver(),
             maximumAge: Double? = nil, realLedger: (any Ledger)? = nil) {
            self.ledger = ledger
            let offset = clockOffset
            let clock = WallClock { Date().timeIntervalSince1970 + offset.seconds.withLock { $0 } }
            let policyA = IssuerPolicy(issuer: CoreTests.issuerA, keySource: .pinned(document: Array(SETMinter.jwks([CoreTests.keyA]).utf8), origin: "test"),
                                       audiences: [CoreTests.audience], profile: .risc, maximumAge: maximumAge)
            var policyB = IssuerPolicy(issuer: CoreTests.issuerB, keySource: .jwks(URL(string: "https://b.example/jwks")!),
                                       audiences: [CoreTests.audience], profile: .risc, maximumAge: maximumAge)
            policyB.keyCache.failureRetryInterval = 0
            policyB.keyCache.unknownKeyCooldown = 0
            let cacheA = IssuerKeyCache(issuer: CoreTests.issuerA, source: policyA.keySource, settings: policyA.keyCache,
                                        fetcher: OfflineKeyFetcher(), clock: clock, logger: CoreTests.logger)
            let cacheB = IssuerKeyCache(issuer: CoreTests.issuerB, source: policyB.keySource, settings: policyB.keyCache,
                                        fetcher: fetcherB, clock: clock, logger: CoreTests.logger)
            let verifier = SETVerifier(issuers: [.init(policy: policyA, keys: cacheA), .init(policy: policyB, keys: cacheB)], clock: clock)
            self.processor = EventProcessor(
                verifier: verifier, ledger: realLedger ?? ledger, deadLetters: deadLetters, metrics: WardenMetrics(factory: metrics),
                logger: CoreTests.logger, stop: stop,
                engine: InvalidationEngine(planner: Planner(policy: CoreTests.policy), resolver: resolver, executor: executor),
                configuration: .init(retry: .init(initialBackoff: .milliseconds(10), maximumBackoff: .milliseconds(50)), steps: steps))
        }

        var pipeline: EventPipeline { EventPipeline(processor: processor) }
    }

    final class ClockOffset: Sendable {
        let seconds = Mutex(0.0)
    }

    static func token(_ issuer: String, _ subject: String, jti: String, key: SigningKey, event: EventType = .sessionsRevoked) -> IntakeMessage {
        let claims = SETMinter.riscClaims(issuer: issuer, audience: audience, event: event, subject: subject, jti: jti)
        return IntakeMessage(value: Array(try! SETMinter.token(claims: claims, key: key).utf8), source: "test:\(jti)", receivedAt: 1)
    }

    /// A door fed by hand: records are settled into `settled`, fed as batches while the
    /// pipeline runs.
    final class HandDoor: Sendable {
        let settled = Settled()
        let takenBack = Mutex<Set<Int>>([])
        private let next = Mutex(0)
        let stream: AsyncStream<[IntakeRecord]>
        let continuation: AsyncStream<[IntakeRecord]>.Continuation

        init() { (stream, continuation) = AsyncStream.makeStream(of: [IntakeRecord].self) }

        func feed(_ messages: [IntakeMessage]) {
            let records = messages.map { message in
                let i = next.withLock { n -> Int in
                    defer { n += 1 }
                    return n
                }
                return IntakeRecord(message, acknowledgement: Settled.Door(settled: settled, index: i,
                                                                           take: { [self] in !self.takenBack.withLock { $0.contains(i) } }))
            }
            continuation.yield(records)
        }

        func disposition(_ i: Int) -> Disposition? { settled.all.count > i ? settled.all[i] : nil }
    }

    /// Refuses the lookup of one subject (as Redis refuses a key of the wrong type), resolves
    /// the others as themselves.
    struct RefusingResolver: SubjectResolver {
        let refused: String
        func resolve(_ token: SecurityEventToken) async -> ResolutionOutcome {
            guard case .issSub(_, let sub)? = token.primarySubject else { return .resolved(.unresolved) }
            return sub == refused ? .refused("WRONGTYPE Operation against a key holding the wrong kind of value") : .resolved(.user(sub))
        }
    }

    /// A lookup the target refuses is not "no such user" (recorded with no steps, never acted
    /// on): the event is refused and dead-lettered, visible, and the others go on.
    @Test func aRefusedSubjectLookupIsDeadLetteredNotTakenForNoSuchUser() async throws {
        let world = World(resolver: RefusingResolver(refused: "u-refused"))
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([Self.token(Self.issuerA, "u-refused", jti: "r1", key: Self.keyA), Self.token(Self.issuerA, "u-fine", jti: "r2", key: Self.keyA)])
        #expect(await eventually { door.disposition(0) != nil && door.disposition(1) != nil })
        guard case .rejected(let code, let description) = door.disposition(0) else {
            Issue.record("\(String(describing: door.disposition(0)))"); return
        }
        #expect(code == "subject_lookup_refused" && description.contains("WRONGTYPE"))
        #expect(world.deadLetters.sent.withLock { $0.map(\.code) } == ["subject_lookup_refused"])
        #expect(world.ledger.rejections.map(\.code) == ["subject_lookup_refused"])
        guard case .recorded = door.disposition(1) else { Issue.record("\(String(describing: door.disposition(1)))"); return }
        door.continuation.finish()
        await running.value
    }

    /// Pushed (or polled) into the ledger, such a SET is answered "try again later", not 400:
    /// the refusal is this receiver's, and a 400 would have the sender drop a genuine SET.
    @Test func aPushedSETWhoseLookupIsRefusedIsAnsweredTryAgainLater() async throws {
        let world = World(resolver: RefusingResolver(refused: "u-refused"))
        let destination = LedgerPushDestination(answerWithin: CoreTests.pushAnswerWithin)
        let running = Task { await world.pipeline.run(destination.records) }
        var pushed = Self.token(Self.issuerA, "u-refused", jti: "pushed-refused", key: Self.keyA)
        pushed.receivedAt = Date().timeIntervalSince1970
        #expect(await destination.persist(pushed) == .unavailable)
        world.stop.stop()
        destination.records.close()
        await running.value
    }

    /// The same for a SET the ledger refuses to store for good: the refusal is the ledger's,
    /// and a 400 would have the sender drop a genuine SET.
    @Test func aPushedSETTheLedgerRefusesIsAnsweredTryAgainLater() async throws {
        let world = World()
        world.ledger.state.withLock { $0.refusedJTIs = ["pushed-unstorable"] }
        let destination = LedgerPushDestination(answerWithin: CoreTests.pushAnswerWithin)
        let running = Task { await world.pipeline.run(destination.records) }
        var pushed = Self.token(Self.issuerA, "u", jti: "pushed-unstorable", key: Self.keyA)
        pushed.receivedAt = Date().timeIntervalSince1970
        #expect(await destination.persist(pushed) == .unavailable)
        #expect(world.ledger.rejections.map(\.code) == ["ledger_refused"])
        world.stop.stop()
        destination.records.close()
        await running.value
    }

    static func verification(_ issuer: String, state: String?, jti: String, key: SigningKey) -> IntakeMessage {
        let payload: JSONObject = state.map { ["state": .string($0)] } ?? [:]
        let claims: JSONObject = ["iss": .string(issuer), "aud": .string(audience), "iat": .number(Date().timeIntervalSince1970.rounded(.down)),
                                  "jti": .string(jti), "events": .object([EventType.riscVerification.uri: .object(payload)])]
        return IntakeMessage(value: Array(try! SETMinter.token(claims: claims, key: key).utf8), source: "test:\(jti)", receivedAt: 1)
    }

    // A verification (test) event is taken when its state is one Warden asked its issuer for,
    // or when it has none (sent unasked); any other state is refused with invalid_state, and a
    // state asked of one issuer does not let another's through.
    @Test func aVerificationEventIsTakenOnlyWithAStateAskedOfItsIssuer() async throws {
        let world = World()
        world.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        try await world.ledger.requestVerification(issuer: Self.issuerA, state: "asked-of-a", at: 1)
        try await world.ledger.requestVerification(issuer: Self.issuerB, state: "asked-of-b", at: 1)
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([
            Self.verification(Self.issuerA, state: "asked-of-a", jti: "v-asked", key: Self.keyA),
            Self.verification(Self.issuerA, state: nil, jti: "v-unasked", key: Self.keyA),
            Self.verification(Self.issuerA, state: "never-asked", jti: "v-unknown", key: Self.keyA),
            Self.verification(Self.issuerA, state: "asked-of-b", jti: "v-other-issuer", key: Self.keyA),
            Self.verification(Self.issuerA, state: "asked-of-a", jti: "v-asked-again", key: Self.keyA),
        ])
        #expect(await eventually { (0..<5).allSatisfy { door.disposition($0) != nil } })
        for i in [0, 1, 4] {
            guard case .recorded(_, .processed) = door.disposition(i) else {
                Issue.record("verification \(i): \(String(describing: door.disposition(i)))")
                continue
            }
        }
        for i in [2, 3] {
            guard case .rejected(let code, let description) = door.disposition(i) else {
                Issue.record("verification \(i): \(String(describing: door.disposition(i)))")
                continue
            }
            #expect(code == "invalid_state")
            #expect(!description.contains("asked-of"))
        }
        #expect(world.ledger.event("v-unknown") == nil && world.ledger.event("v-other-issuer") == nil)
        #expect(world.ledger.rejections.map(\.code) == ["invalid_state", "invalid_state"])
        #expect(try await world.ledger.verificationArrival(issuer: Self.issuerA, state: "asked-of-a") != nil)
        #expect(try await world.ledger.verificationArrival(issuer: Self.issuerB, state: "asked-of-b") == nil)
        world.stop.stop()
        door.continuation.finish()
        await running.value
    }

    // A door that answers at persistence (push) hears of its event once it is claimed with its
    // plan, while its steps still run; a pushed token whose keys cannot be had is answered at
    // once (try again later), and waits nowhere.
    @Test func aPushedEventIsAnsweredOnceDurableAndOneWithoutKeysAtOnce() async throws {
        let world = World()
        world.executor.script.withLock { $0["p"] = [.retry("later", after: 30)] }
        world.fetcherB.failing.withLock { $0 = true }
        let (stream, continuation) = AsyncStream.makeStream(of: [IntakeRecord].self)
        let running = Task { await world.pipeline.run(stream) }
        let durable = PushAcknowledgement(), noKeys = PushAcknowledgement()
        continuation.yield([
            IntakeRecord(Self.token(Self.issuerA, "p", jti: "pushed", key: Self.keyA), acknowledgement: durable),
            IntakeRecord(Self.token(Self.issuerB, "q", jti: "no-keys", key: Self.keyB1), acknowledgement: noKeys),
        ])
        let eventID = try #require(await eventually { world.ledger.event("pushed") != nil } ? world.ledger.event("pushed")?.id : nil)
        #expect(await durable.answer() == .recorded(eventID: eventID, outcome: .pending))
        #expect(world.ledger.event("pushed")?.steps.map(\.status) == [.pending, .pending])
        #expect(await noKeys.answer() == .abandoned)
        #expect(world.ledger.event("no-keys") == nil)
        world.stop.stop()
        continuation.finish()
        await running.value
    }

    /// A push door into a ledger shared with other replicas: the whole intake (with its resume
    /// passes every 200 ms) or, `resuming: false`, the pipeline alone.
    final class PushReplica: Sendable {
        let world: World
        let destination = LedgerPushDestination(answerWithin: CoreTests.pushAnswerWithin)
        private let running: Task<Void, Never>

        init(_ world: World, resuming: Bool) {
            self.world = world
            let destination = self.destination
            running = resuming
                ? Task { await PushIntake(destination: destination, pipeline: world.pipeline, resumeEvery: .milliseconds(200)).run() }
                : Task { await world.pipeline.run(destination.records) }
        }

        /// Pushes a SET of issuer A for `subject`, received now (a resumed token is judged as of
        /// its arrival).
        func push(_ subject: String, jti: String) async -> PushOutcome {
            var pushed = CoreTests.token(CoreTests.issuerA, subject, jti: jti, key: CoreTests.keyA)
            pushed.receivedAt = Date().timeIntervalSince1970
            return await destination.persist(pushed)
        }

        func stop() async {
            world.stop.stop()
            destination.records.close()
            await running.value
        }
    }

    /// How long a push waits for its answer in these tests, none of which is about that
    /// deadline: long, because on a machine busy with every other suite a push's verification
    /// (on threads beneath the rest in priority) took more than 5 s in a full CI run.
    static let pushAnswerWithin: Duration = .seconds(60)

    /// Two replicas on one ledger, each with its own lease length.
    static func replicas(lease a: Duration, _ b: Duration,
                         breakers: CircuitBreakers.Settings = .init()) -> (ledger: MemoryLedger, a: World, b: World) {
        let ledger = MemoryLedger()
        return (ledger, World(ledger: ledger, steps: .init(lease: a, owner: "replica-a", breakers: breakers)),
                World(ledger: ledger, steps: .init(lease: b, owner: "replica-b", breakers: breakers)))
    }

    // Replicas of the push door share a ledger: an event one of them left pending (stopped while
    // its step waited for a retry) is taken up by another that keeps running, once no process
    // holds its lease, without waiting for a restart.
    @Test func aReplicaTakesUpStepsAnotherLeftPending() async throws {
        let (ledger, a, b) = Self.replicas(lease: .seconds(2), .seconds(2))
        a.executor.script.withLock { $0["u1"] = [.retry("the target is down", after: 30)] }
        let replicaB = PushReplica(b, resuming: true)
        // A takes a pushed SET; its first step is answered "later", and A stops meanwhile.
        let replicaA = PushReplica(a, resuming: false)
        #expect(await replicaA.push("u1", jti: "left-by-a") == .accepted)
        #expect(await eventually { a.executor.calls(for: "u1") == 1 })
        await replicaA.stop()
        // B finds it (it may have already: A's lease ran out while A waited for its retry),
        // takes its lease, and runs both steps.
        #expect(await eventually(attempts: 4000) { ledger.event("left-by-a")?.outcome == .processed })
        #expect(b.executor.calls(for: "u1") == 2)
        #expect(a.executor.calls(for: "u1") == 1)
        await replicaB.stop()
    }

    // A lease runs out while its holder waits to retry a step; another owner takes the event up
    // and records every step. When the first wakes and takes the lease again, it reads what
    // was recorded meanwhile and calls nothing again: neither the step it was to retry nor
    // the later one.
    @Test func aStepRecordedByAnotherOwnerDuringARetryPauseIsNotCalledAgain() async throws {
        let (ledger, a, b) = Self.replicas(lease: .seconds(1), .seconds(1))
        // B takes the event up once A's lease has run out (after 1 s; B looks every 200 ms),
        // and must have done so before A's pause ends: 6 s leaves a machine busy with every
        // other suite time for it (with 3 s, A once woke first and ran both steps itself).
        a.executor.script.withLock { $0["u1"] = [.retry("the target is busy", after: 6)] }
        let replicaB = PushReplica(b, resuming: true)
        let replicaA = PushReplica(a, resuming: false)
        let pushed = ContinuousClock.now
        #expect(await replicaA.push("u1", jti: "retried-by-a") == .accepted)
        #expect(await eventually(attempts: 4000) { ledger.event("retried-by-a")?.outcome == .processed })
        #expect(b.executor.calls(for: "u1") == 2)
        // A's pause ends (6 s after its call): it must find both steps recorded.
        try await Task.sleep(until: pushed + .seconds(7))
        #expect(a.executor.calls(for: "u1") == 1, "the step was called again after another owner recorded it")
        await replicaA.stop()
        await replicaB.stop()
    }

    // A resume pass may read an event this process has just claimed, before its steps start
    // (the moment between the claim and its entry into its subject's lane). That copy is
    // settled at once, a duplicate: queued behind the event, it would hold the pass's page,
    // and every later pass with it, for as long as the event's steps take.
    @Test func aResumedCopyOfAnEventInHandIsSettledAtOnce() async throws {
        let world = World()
        world.executor.hold("u1")
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        let original = Self.token(Self.issuerA, "u1", jti: "in-hand", key: Self.keyA)
        door.feed([original])
        #expect(await eventually { world.executor.waiting("u1") == 1 })
        var copy = original
        copy.source = PendingStepsResume.source
        door.feed([copy])
        let id = try #require(world.ledger.event("in-hand")?.id)
        #expect(await eventually { door.disposition(1) != nil }, "the copy waited behind the event it copies")
        #expect(door.disposition(1) == .duplicate(eventID: id))
        #expect(door.disposition(0) == nil, "the event itself is still in its first step")
        world.executor.release("u1")
        #expect(await eventually { door.disposition(0) != nil })
        door.continuation.finish()
        await running.value
        #expect(door.disposition(0) == .recorded(eventID: id, outcome: .processed))
        #expect(world.executor.calls(for: "u1") == 2, "each step once: the copy ran none")
    }

    // A process's own event waiting out retries (its lease runs out between them) is its own to
    // finish: the resume passes leave it, and do not stall behind it while another replica's
    // event waits.
    @Test func resumePassesLeaveThisProcesssOwnRetryingEvents() async throws {
        // Without breakers: the own event's endless retries would otherwise open B's breaker for
        // the shared target, and when B's call for the other event comes late (a loaded machine),
        // it waits out cooldowns that the own event's failed trials keep doubling.
        let (ledger, a, b) = Self.replicas(lease: .seconds(2), .seconds(1), breakers: .init(threshold: 1_000_000))
        b.executor.script.withLock { $0["u1"] = Array(repeating: .retry("busy", after: 1.5), count: 1000) }
        let replicaB = PushReplica(b, resuming: true)
        #expect(await replicaB.push("u1", jti: "bs-own") == .accepted)
        // Its lease runs out during the first pause; passes come meanwhile.
        try await Task.sleep(for: .seconds(2))
        // Another replica leaves an event pending.
        a.executor.script.withLock { $0["u2"] = [.retry("down", after: 30)] }
        let replicaA = PushReplica(a, resuming: false)
        #expect(await replicaA.push("u2", jti: "left-by-a") == .accepted)
        #expect(await eventually { a.executor.calls(for: "u2") == 1 })
        await replicaA.stop()
        #expect(await eventually(attempts: 2000) { ledger.event("left-by-a")?.outcome == .processed }, "a pass stalled behind the process's own event")
        #expect(b.executor.calls(for: "u2") == 2, "B ran both steps of the event A left")
        await replicaB.stop()
    }

    // A stored event whose token no longer verifies is left pending and counted once, not
    // verified and refused again by every pass.
    @Test func aStoredEventThatNoLongerVerifiesIsNotTriedEveryPass() async throws {
        let world = World()
        let forged = Self.token(Self.issuerA, "u3", jti: "no-longer", key: Self.keyB1)  // not A's key
        let event = LedgerEvent(issuer: Self.issuerA, jti: "no-longer", tokenBytes: forged.value, source: "push", eventTypes: [EventType.sessionsRevoked.uri],
                                subject: nil, keyID: "a1", algorithm: "RS256", keyThumbprint: "t", issuedAt: 0,
                                receivedAt: Date().timeIntervalSince1970 - 10)
        _ = try await world.ledger.claim(event, outcome: .pending, steps: [OutboxStep(index: 0, kind: "purge-set", action: "{}")])
        let destination = LedgerPushDestination(answerWithin: CoreTests.pushAnswerWithin)
        let intake = Task { await PushIntake(destination: destination, pipeline: world.pipeline, resumeEvery: .milliseconds(100)).run() }
        #expect(await eventually { world.ledger.rejections.count >= 1 })
        try await Task.sleep(for: .seconds(1.5))
        #expect(world.ledger.rejections.count == 1, "\(world.ledger.rejections.count) rejections of one stored event")
        world.stop.stop()
        destination.records.close()
        await intake.value
    }

    // Requests are taken and answered from the start, whatever reading the events left pending
    // meets: a ledger that cannot be read must not leave pushes unanswered (nor hang shutdown).
    @Test func pushesAreAnsweredWhileWhatWasLeftCannotBeRead() async throws {
        let world = World()
        world.ledger.state.withLock { $0.pendingReadsFail = true }
        let destination = LedgerPushDestination(answerWithin: CoreTests.pushAnswerWithin)
        let intake = Task { await PushIntake(destination: destination, pipeline: world.pipeline).run() }
        var message = Self.token(Self.issuerA, "u4", jti: "while-unreadable", key: Self.keyA)
        message.receivedAt = Date().timeIntervalSince1970
        let pushed = message
        // Not awaited: a request nobody answers must fail this test, not hang it.
        let answered = Mutex<PushOutcome?>(nil)
        _ = Task { let answer = await destination.persist(pushed); answered.withLock { $0 = answer } }
        #expect(await eventually(attempts: 3000) { answered.withLock { $0 } != nil }, "the push was never answered")
        // Answered once recorded (or, on a machine too busy for the deadline, "try again later"
        // while it is recorded all the same): the pipeline runs.
        #expect(await eventually { world.ledger.event("while-unreadable") != nil })
        world.stop.stop()
        destination.records.close()
        await intake.value
    }

    // While the ledger is down a push is answered "try again later" once its deadline passes:
    // the request does not hang (nor does shutdown, which waits for requests). The record, kept
    // by the pipeline, is recorded once the ledger is back, and the sender's retry is then a
    // duplicate, answered 202.
    @Test func aPushWhileTheLedgerIsDownIsAnsweredUnavailableWithinItsDeadline() async throws {
        let world = World()
        world.ledger.state.withLock { $0.unavailableWrites = .max }
        let destination = LedgerPushDestination(answerWithin: .milliseconds(500))
        let running = Task { await world.pipeline.run(destination.records) }
        let sweeping = Task { await destination.sweep() }
        let message = Self.token(Self.issuerA, "u1", jti: "while-down", key: Self.keyA)
        #expect(await destination.persist(message) == .unavailable)
        #expect(world.ledger.event("while-down") == nil)
        world.ledger.state.withLock { $0.unavailableWrites = 0 }
        #expect(await eventually { world.ledger.event("while-down") != nil })
        // The sender sends it again (until answered: a busy machine may take longer than the
        // deadline): a duplicate, accepted.
        var answer = PushOutcome.unavailable
        for _ in 0..<20 where answer != .accepted { answer = await destination.persist(message) }
        #expect(answer == .accepted)
        world.stop.stop()
        destination.records.close()
        await running.value
        await sweeping.value
    }

    // Records from requests wait for the pipeline up to a bound; beyond it they are refused
    // (answered 503 at once), so memory stays bounded while the pipeline takes nothing.
    @Test func requestsBeyondTheWaitingBoundAreRefusedAtOnce() async {
        let feed = RecordFeed(maximumWaiting: 2)
        func record(_ jti: String) -> IntakeRecord {
            IntakeRecord(Self.token(Self.issuerA, "u", jti: jti, key: Self.keyA), acknowledgement: PushAcknowledgement())
        }
        #expect(feed.submit([record("1"), record("2")]))
        #expect(!feed.submit(record("3")))
        #expect(feed.submitFront([record("resumed")]), "the process's own records are taken whatever waits")
        var iterator = feed.makeAsyncIterator()
        #expect(await iterator.next()?.count == 3)
        #expect(feed.submit(record("4")))
    }

    // A token whose issuer's keys cannot be fetched waits aside with the later events of its
    // subject; other subjects and issuers are recorded meanwhile; once the keys come, the
    // waiting ones are recorded in their order.
    @Test func aTokenWaitingForKeysHoldsOnlyItsSubject() async throws {
        let world = World()
        // B's keys: b1 fetched now; then the provider goes down, and the keys go stale.
        world.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        _ = await world.processor.verifier.verify(Array(Self.token(Self.issuerB, "x", jti: "warm-up", key: Self.keyB1).value))
        world.fetcherB.failing.withLock { $0 = true }
        world.clockOffset.seconds.withLock { $0 = 120 }

        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([
            Self.token(Self.issuerB, "x", jti: "x-1", key: Self.keyB2),  // b2: unknown, keys stale, provider down: waits
            Self.token(Self.issuerA, "y", jti: "y-1", key: Self.keyA),   // another issuer: flows
            Self.token(Self.issuerB, "x", jti: "x-2", key: Self.keyB1),  // verifies with stale b1, but behind x-1
            Self.token(Self.issuerB, "z", jti: "z-1", key: Self.keyB1),  // same issuer, another subject: flows
        ])
        #expect(await eventually { door.disposition(1) != nil && door.disposition(3) != nil })
        #expect(door.disposition(0) == nil)
        #expect(door.disposition(2) == nil)
        #expect(world.ledger.event("x-1") == nil && world.ledger.event("x-2") == nil)
        #expect(world.executor.calls(for: "x") == 0)

        // The provider is back, with b2.
        world.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1, Self.keyB2]) }
        world.fetcherB.failing.withLock { $0 = false }
        #expect(await eventually { door.disposition(0) != nil && door.disposition(2) != nil })
        door.continuation.finish()
        await running.value
        let first = try #require(world.ledger.event("x-1")), second = try #require(world.ledger.event("x-2"))
        #expect(first.id < second.id)
        #expect(first.outcome == .processed && second.outcome == .processed)
        if case .recorded = door.disposition(0) {} else { Issue.record("x-1: \(String(describing: door.disposition(0)))") }
        #expect(world.deadLetters.sent.withLock { $0.isEmpty })
    }

    // The input ends (a replay file, say) while tokens still wait for keys: they keep waiting
    // until the keys come, then are recorded, and the pipeline ends with every record settled.
    @Test func tokensWaitingForKeysWhenTheInputEndsAreRecordedOnceTheKeysCome() async throws {
        let world = World()
        world.fetcherB.failing.withLock { $0 = true }
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([
            Self.token(Self.issuerB, "w", jti: "w-1", key: Self.keyB1),
            Self.token(Self.issuerA, "v", jti: "v-1", key: Self.keyA),
        ])
        door.continuation.finish()
        #expect(await eventually { door.disposition(1) != nil })
        #expect(door.disposition(0) == nil)
        world.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        world.fetcherB.failing.withLock { $0 = false }
        await running.value
        #expect(world.ledger.event("w-1")?.outcome == .processed)
        if case .recorded = door.disposition(0) {} else { Issue.record("w-1: \(String(describing: door.disposition(0)))") }
    }

    // A token whose issuer's keys do not come back within the pipeline's longest wait is
    // refused (`keys_unavailable`), recorded and dead-lettered, counted as a permanent failure;
    // the later event of its subject that waited behind it then goes on. Nothing waits for ever.
    @Test func aTokenWaitingForKeysTooLongIsRefusedAndItsSubjectGoesOn() async throws {
        let registry = PrometheusCollectorRegistry()
        let world = World(metrics: PrometheusMetricsFactory(registry: registry))
        // B's keys: b1 fetched now; then the provider goes down for good, and the keys go stale.
        world.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        _ = await world.processor.verifier.verify(Array(Self.token(Self.issuerB, "x", jti: "warm-up", key: Self.keyB1).value))
        world.fetcherB.failing.withLock { $0 = true }
        world.clockOffset.seconds.withLock { $0 = 120 }

        let door = HandDoor()
        let pipeline = EventPipeline(processor: world.processor, maximumKeyWait: .milliseconds(1500))
        let running = Task { await pipeline.run(door.stream) }
        door.feed([
            Self.token(Self.issuerB, "x", jti: "x-1", key: Self.keyB2),  // b2: unknown, provider down: waits, then refused
            Self.token(Self.issuerB, "x", jti: "x-2", key: Self.keyB1),  // verifies with stale b1, behind x-1
            Self.token(Self.issuerA, "y", jti: "y-1", key: Self.keyA),   // another issuer: flows at once
        ])
        #expect(await eventually { door.disposition(2) != nil })
        #expect(door.disposition(0) == nil, "still waiting for its keys")
        #expect(door.disposition(1) == nil, "held behind it")
        let settled = await eventually { door.disposition(0) != nil && door.disposition(1) != nil }
        #expect(settled)
        // Without a verdict the pipeline would wait for the keys for ever.
        if !settled { world.stop.stop() }
        door.continuation.finish()
        await running.value

        guard case .rejected(let code, let description) = door.disposition(0) else {
            Issue.record("x-1: \(String(describing: door.disposition(0)))")
            return
        }
        #expect(code == "keys_unavailable")
        #expect(description.contains("could not be obtained in"), "\(description)")
        #expect(world.ledger.event("x-1") == nil)
        #expect(world.ledger.rejections.map(\.code) == ["keys_unavailable"])
        #expect(world.ledger.rejections.first?.source == "test:x-1")
        #expect(world.deadLetters.sent.withLock { $0.map(\.source) } == ["test:x-1"])
        // The subject's later event was held behind it, and is recorded after it.
        #expect(world.ledger.event("x-2")?.outcome == .processed)
        if case .recorded = door.disposition(1) {} else { Issue.record("x-2: \(String(describing: door.disposition(1)))") }
        var text: [UInt8] = []
        registry.emit(into: &text)
        let metrics = String(decoding: text, as: UTF8.self)
        #expect(metrics.contains(#"warden_permanent_failures_total{what="keys_unavailable"} 1"#), "\(metrics)")
    }

    // A token the ledger holds, delivered again once older than max-age (a Kafka message read
    // again after a long stop, a push retried after its answer was lost), is that event's
    // duplicate, judged as of its first arrival; a token signed anew under the same jti, or one
    // the ledger never held, is still refused as too old.
    @Test func aStoredTokenDeliveredAgainPastItsMaximumAgeIsADuplicate() async throws {
        let path = Scratch.path("redelivered-past-max-age", extension: "sqlite")
        let ledger = try SQLiteLedger(path: path)
        let world = World(maximumAge: 300, realLedger: ledger)
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        let first = Self.token(Self.issuerA, "u", jti: "again-1", key: Self.keyA)
        var copy = first
        copy.receivedAt = Date().timeIntervalSince1970
        door.feed([copy])
        #expect(await eventually { door.disposition(0) != nil })
        guard case .recorded(let eventID, _) = door.disposition(0) else {
            Issue.record("first delivery: \(String(describing: door.disposition(0)))")
            door.continuation.finish()
            await running.value
            return
        }
        // An hour later: the same bytes; other claims signed under the same jti; a token the
        // ledger never saw.
        world.clockOffset.seconds.withLock { $0 = 3600 }
        door.feed([first, Self.token(Self.issuerA, "v", jti: "again-1", key: Self.keyA), Self.token(Self.issuerA, "u", jti: "never-seen", key: Self.keyA)])
        #expect(await eventually { door.disposition(3) != nil })
        door.continuation.finish()
        await running.value
        #expect(door.disposition(1) == .duplicate(eventID: eventID))
        for i in [2, 3] {
            guard case .rejected(let code, let description) = door.disposition(i) else {
                Issue.record("\(i): \(String(describing: door.disposition(i)))")
                continue
            }
            #expect(code == "invalid_request")
            #expect(description.contains("maximum age"), "\(description)")
        }
        #expect(world.deadLetters.sent.withLock { $0.count } == 2)
        await ledger.close()
    }

    // The same, for a copy that first waited for its issuer's keys (another process, whose
    // keys cannot be had at first, reads the topic again past max-age): once the keys are back
    // it is the stored event's duplicate, not refused.
    @Test func aStoredTokenThatWaitedForKeysPastItsMaximumAgeIsADuplicate() async throws {
        let path = Scratch.path("waited-past-max-age", extension: "sqlite")
        let ledger = try SQLiteLedger(path: path)
        let first = World(maximumAge: 300, realLedger: ledger)
        first.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        let token = Self.token(Self.issuerB, "x", jti: "waited-1", key: Self.keyB1)
        var copy = token
        copy.receivedAt = Date().timeIntervalSince1970
        let dispositions = await Settled.run(first.pipeline, [[copy]])
        guard case .recorded(let eventID, _)? = dispositions.first else {
            Issue.record("first delivery: \(dispositions)")
            return
        }
        // Another process: its issuer's keys cannot be had; an hour later they can.
        let second = World(maximumAge: 300, realLedger: ledger)
        second.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        second.fetcherB.failing.withLock { $0 = true }
        let door = HandDoor()
        let running = Task { await second.pipeline.run(door.stream) }
        door.feed([token])
        #expect(await eventually { second.fetcherB.threads.withLock { $0.count } >= 2 })
        second.clockOffset.seconds.withLock { $0 = 3600 }
        second.fetcherB.failing.withLock { $0 = false }
        let settled = await eventually { door.disposition(0) != nil }
        if !settled { second.stop.stop() }
        door.continuation.finish()
        await running.value
        #expect(door.disposition(0) == .duplicate(eventID: eventID))
        #expect(second.deadLetters.sent.withLock { $0.isEmpty })
        await ledger.close()
    }

    // After a wait, a record's claims are judged at its received-at, its fetch, or now: the
    // first of them still within the arrival window.
    @Test func aWaitedRecordsClaimsTimeStaysWithinTheArrivalWindow() {
        func judged(_ claims: SETVerifier.ClaimsTime, now: Double) -> String {
            var message = IntakeMessage(value: [], source: "test", receivedAt: 1000, claimsTime: claims)
            message.receivedAt = 1000
            return switch EventProcessor.claimsTime(afterWaiting: message, now: now, window: 100) {
            case .now: "now"
            case .at(let time): "at \(Int(time))"
            case .issuedAt: "iat"
            }
        }
        #expect(judged(.now, now: 1050) == "at 1000")
        #expect(judged(.now, now: 1200) == "now")
        #expect(judged(.at(950), now: 1040) == "at 950")
        #expect(judged(.at(900), now: 1050) == "at 1000", "its received-at is past the window, its fetch is not")
        #expect(judged(.at(900), now: 1200) == "now")
        #expect(judged(.issuedAt, now: 5000) == "iat")
    }

    // A record its door took back (its Kafka partition went to another member, which reads it
    // again) is never given up for keys: the refusal would be recorded and dead-lettered by a
    // process that no longer owns it, while the new owner may still verify it. Nor does it stay:
    // it would hold its lane while the keys cannot be had, and a later record of its subject
    // behind it would never leave, even once refused itself.
    @Test func aWaitingTokenItsDoorTookBackLeavesWithoutBeingGivenUp() async throws {
        let world = World()
        world.fetcherB.failing.withLock { $0 = true }
        let door = HandDoor()
        let pipeline = EventPipeline(processor: world.processor, maximumKeyWait: .milliseconds(100))
        let running = Task { await pipeline.run(door.stream) }
        // Taken back from the start: taken back after it began to wait, a loaded machine could
        // let the limit pass first.
        door.takenBack.withLock { _ = $0.insert(0) }
        door.feed([Self.token(Self.issuerB, "x", jti: "x-1", key: Self.keyB1),
                   Self.token(Self.issuerB, "x", jti: "x-2", key: Self.keyB1)])
        let settled = await eventually { door.disposition(0) != nil && door.disposition(1) != nil }
        #expect(settled)
        #expect(door.disposition(0) == .abandoned)
        // The later one, kept, is refused once it waited too long.
        #expect(door.disposition(1).map { if case .rejected(code: "keys_unavailable", _) = $0 { true } else { false } } == true,
                "\(String(describing: door.disposition(1)))")
        #expect(world.ledger.rejections.count == 1)
        #expect(world.deadLetters.sent.withLock { $0.count } == 1)
        world.stop.stop()
        door.continuation.finish()
        await running.value
        #expect(door.disposition(0) == .abandoned)
        #expect(world.ledger.rejections.count == 1)
    }

    // A token that waited for its issuer's keys is judged as of when it arrived, within the
    // arrival window: a genuine revocation does not turn too old for `max-age` while its
    // issuer's keys cannot be had. Past the window it is judged when verified again.
    @Test(arguments: [(Double.infinity, true), (0, false), (60, false)])
    func aTokenThatWaitedForItsKeysIsJudgedAsOfItsArrival(window: Double, accepted: Bool) async throws {
        let world = World(maximumAge: 300)
        world.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        world.fetcherB.failing.withLock { $0 = true }
        let door = HandDoor()
        let pipeline = EventPipeline(processor: world.processor, arrivalWindow: window)
        let running = Task { await pipeline.run(door.stream) }
        var message = Self.token(Self.issuerB, "x", jti: "late-1", key: Self.keyB1)
        // Arrived two minutes ago (within max-age, outside the 60 s window).
        message.receivedAt = Date().timeIntervalSince1970 - 120
        door.feed([message])
        // Its keys are tried again, and again...
        #expect(await eventually { world.fetcherB.threads.withLock { $0.count } >= 3 })
        #expect(door.disposition(0) == nil, "waiting for its keys")
        // ...for an hour: the token is now older than max-age; then its keys are back.
        world.clockOffset.seconds.withLock { $0 = 3600 }
        world.fetcherB.failing.withLock { $0 = false }
        let settled = await eventually { door.disposition(0) != nil }
        #expect(settled)
        if !settled { world.stop.stop() }
        door.continuation.finish()
        await running.value
        if accepted {
            guard case .recorded = door.disposition(0) else {
                Issue.record("\(String(describing: door.disposition(0)))")
                return
            }
            #expect(world.ledger.event("late-1")?.outcome == .processed)
        } else {
            guard case .rejected(let code, let description) = door.disposition(0) else {
                Issue.record("\(String(describing: door.disposition(0)))")
                return
            }
            #expect(code == "invalid_request")
            #expect(description.contains("maximum age"), "\(description)")
        }
    }

    // While events' steps run, the intake's ledger writes are short, so a step's outcome
    // (written between two of them) waits for little; with no step running they may be long.
    // Signatures are checked on threads of their own, beneath the ledger's writer and the
    // steps in priority: a key fetched for the first token of a batch is fetched from there.
    @Test func signaturesAreCheckedOnTheVerificationThreadsAtALowerPriority() async throws {
        let world = World()
        world.fetcherB.document.withLock { $0 = SETMinter.jwks([Self.keyB1]) }
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed((0..<32).map { Self.token(Self.issuerB, "u\($0)", jti: "b-\($0)", key: Self.keyB1) })
        #expect(await eventually { door.settled.all.compactMap { $0 }.count == 32 })
        door.continuation.finish()
        await running.value
        let threads = world.fetcherB.threads.withLock { $0 }
        #expect(!threads.isEmpty && threads.allSatisfy { $0.hasPrefix("warden-verify-") }, "\(threads)")
        let which = __priority_which_t(PRIO_PROCESS.rawValue)
        let (name, niceness) = await withTaskExecutorPreference(VerificationExecutor.shared) {
            (currentThreadName(), getpriority(which, 0))
        }
        #expect(name.hasPrefix("warden-verify-"))
        // Lower than the process's own, unless the process is at the bottom already.
        #expect(niceness == min(19, getpriority(which, 0) + VerificationExecutor.niceness))
    }

    @Test func whileStepsRunTheIntakesWritesAreShort() async throws {
        let world = World()
        let pipeline = EventPipeline(processor: world.processor, maximumWrite: 1024, maximumWriteWhileActing: 8)
        let door = HandDoor()
        let running = Task { await pipeline.run(door.stream) }
        // Events with nothing to run (the policy has no rule for their type): one long write.
        door.feed((0..<40).map { Self.token(Self.issuerA, "r\($0)", jti: "r-\($0)", key: Self.keyA, event: .accountDisabled) })
        #expect(await eventually { door.settled.all.compactMap { $0 }.count == 40 })
        #expect(world.ledger.state.withLock { $0.intakeWrites } == [40])
        #expect(world.executor.batches.withLock { $0 }.isEmpty)
        // Events with steps, while none run yet: short writes too. The new events of one write
        // act together (their first steps in one call, their outcomes in one ledger write): a
        // long write of them had every one of its outcomes wait for one long outcome write,
        // and the first to act for the long intake writes cut before them.
        door.feed((0..<40).map { Self.token(Self.issuerA, "u\($0)", jti: "u-\($0)", key: Self.keyA) })
        #expect(await eventually { door.settled.all.compactMap { $0 }.count == 80 })
        #expect(world.ledger.state.withLock { $0.intakeWrites } == [40, 8, 8, 8, 8, 8])
        #expect(world.executor.batches.withLock { $0 } == [8, 8, 8, 8, 8])
        let stepWrites = world.ledger.state.withLock { $0.stepWrites }
        #expect(!stepWrites.isEmpty && stepWrites.allSatisfy { $0 <= 8 }, "\(stepWrites)")

        world.executor.hold("held")
        door.feed([Self.token(Self.issuerA, "held", jti: "held", key: Self.keyA)])
        #expect(await eventually { world.executor.waiting("held") == 1 })
        door.feed((0..<40).map { Self.token(Self.issuerA, "v\($0)", jti: "v-\($0)", key: Self.keyA) })
        #expect(await eventually { world.ledger.event("v-39") != nil })
        #expect(world.ledger.state.withLock { $0.intakeWrites } == [40, 8, 8, 8, 8, 8, 1, 8, 8, 8, 8, 8])

        world.executor.release("held")
        door.continuation.finish()
        await running.value
        let settled = door.settled.all
        #expect(settled.count == 121)
        #expect(settled.allSatisfy { if case .recorded(_, .processed)? = $0 { true } else { false } })
    }

    /// The next intake write starts while one is under way (the ledger never waits for the
    /// pipeline between two), and a subject's events still act in arrival order when a later
    /// write is done first.
    @Test func theNextWriteStartsWhileOneIsUnderWayAndASubjectsEventsKeepTheirOrder() async throws {
        let world = World()
        let pipeline = EventPipeline(processor: world.processor, maximumWrite: 2, maximumWriteWhileActing: 2, maximumWritesInFlight: 4)
        world.ledger.holdIntakeWrite(0)
        let door = HandDoor()
        let running = Task { await pipeline.run(door.stream) }
        door.feed([Self.token(Self.issuerA, "s", jti: "s-1", key: Self.keyA), Self.token(Self.issuerA, "x", jti: "x-1", key: Self.keyA),
                   Self.token(Self.issuerA, "s", jti: "s-2", key: Self.keyA), Self.token(Self.issuerA, "y", jti: "y-1", key: Self.keyA)])
        // The second write, of s-2 and y-1, is done while the first still waits.
        #expect(await eventually { world.ledger.event("y-1") != nil })
        #expect(world.ledger.state.withLock { $0.intakeWrites } == [2, 2])
        #expect(world.executor.jtis.withLock { $0 }.isEmpty, "nothing acts before the writes started before it are done")
        world.ledger.releaseIntakeWrite(0)
        #expect(await eventually { door.settled.all.compactMap { $0 }.count == 4 })
        let order = world.executor.jtis.withLock { $0 }
        // Every step of s-1 before any of s-2.
        #expect(order.lastIndex(of: "s-1")! < order.firstIndex(of: "s-2")!, "\(order)")
        #expect(Set(order) == ["s-1", "x-1", "s-2", "y-1"])
        door.continuation.finish()
        await running.value
    }

    // Failures a retry can mend (the ledger, the dead-letter topic unavailable for a moment)
    // are retried; every record ends recorded or rejected, none abandoned.
    @Test func transientLedgerAndDeadLetterFailuresAreRetried() async {
        let world = World()
        world.ledger.state.withLock { $0.unavailableWrites = 3 }
        world.deadLetters.unavailable.withLock { $0 = 2 }
        let settled = await Settled.run(world.pipeline, [[
            Self.token(Self.issuerA, "u1", jti: "t-1", key: Self.keyA),
            IntakeMessage(value: Array("junk".utf8), source: "test:junk", receivedAt: 1),
            Self.token(Self.issuerA, "u2", jti: "t-2", key: Self.keyA),
        ]])
        #expect(settled[1].code == "invalid_request")
        for i in [0, 2] {
            guard case .recorded(_, let outcome) = settled[i] else { Issue.record("record \(i): \(settled[i])"); continue }
            #expect(outcome == .processed)
        }
        #expect(world.deadLetters.sent.withLock { $0.map(\.source) } == ["test:junk"])
        #expect(world.ledger.rejections.count == 1)
    }

    // A message its door could not read whole (Kafka skipped a corrupt record) is refused as
    // malformed, whatever its bytes: recorded as a rejection and dead-lettered, never verified
    // (here its bytes are even a valid token), and the messages beside it go on.
    @Test func aMessageTheDoorCouldNotReadIsRejectedAndDeadLettered() async throws {
        let world = World()
        var unreadable = Self.token(Self.issuerA, "u9", jti: "looks-valid", key: Self.keyA)
        unreadable.source = "test:skipped"
        unreadable.unreadable = "_BAD_MSG: Message at offset 41 failed CRC check"
        let settled = await Settled.run(world.pipeline, [[unreadable, Self.token(Self.issuerA, "u1", jti: "after", key: Self.keyA)]])
        #expect(settled[0].code == "invalid_request")
        guard case .rejected(_, let description) = settled[0] else { Issue.record("\(settled[0])"); return }
        #expect(description.contains("could not be read whole: _BAD_MSG"), "\(description)")
        if case .recorded = settled[1] {} else { Issue.record("\(settled[1])") }
        #expect(world.deadLetters.sent.withLock { $0.map(\.source) } == ["test:skipped"])
        #expect(world.ledger.rejections.map(\.source) == ["test:skipped"])
        #expect(world.ledger.event("looks-valid") == nil)
    }

    // An event the ledger can never hold is rejected (dead-lettered, recorded as a rejection);
    // the others of its batch are recorded.
    @Test func anEventTheLedgerRefusesForGoodDoesNotStopTheOthers() async {
        let world = World()
        world.ledger.state.withLock { $0.refusedJTIs = ["bad"] }
        let settled = await Settled.run(world.pipeline, [[
            Self.token(Self.issuerA, "u1", jti: "ok-1", key: Self.keyA),
            Self.token(Self.issuerA, "u2", jti: "bad", key: Self.keyA),
            Self.token(Self.issuerA, "u3", jti: "ok-2", key: Self.keyA),
        ]])
        #expect(settled[1].code == "ledger_refused")
        #expect(world.ledger.event("ok-1")?.outcome == .processed && world.ledger.event("ok-2")?.outcome == .processed)
        #expect(world.ledger.event("bad") == nil)
        #expect(world.deadLetters.sent.withLock { $0.map(\.source) } == ["test:bad"])
    }

    // A step the target refuses for good fails the event (dead-lettered, recorded failed) and
    // the other steps still run; a step the target asks to retry is run again until done.
    @Test func permanentAndTransientStepFailures() async {
        let world = World()
        world.executor.script.withLock {
            $0["flaky"] = [.retry("busy", after: nil), .done("purged")]
            $0["broken"] = [.failed("WRONGTYPE")]
        }
        let settled = await Settled.run(world.pipeline, [[
            Self.token(Self.issuerA, "flaky", jti: "f", key: Self.keyA),
            Self.token(Self.issuerA, "broken", jti: "b", key: Self.keyA),
        ]])
        #expect(settled[0] == .recorded(eventID: world.ledger.event("f")!.id, outcome: .processed))
        #expect(settled[1] == .recorded(eventID: world.ledger.event("b")!.id, outcome: .failed))
        #expect(world.executor.calls(for: "flaky") == 3)  // the retried step twice, then the second step
        #expect(world.executor.calls(for: "broken") == 2)  // the failed step once, and the second step still runs
        #expect(world.ledger.event("b")?.steps.map(\.status) == [.failed, .done])
        #expect(world.deadLetters.sent.withLock { $0.map(\.code) } == ["step-failed"])
    }

    // A redelivered event runs only the steps still pending in its outbox, and is a duplicate.
    @Test func aRedeliveryRunsOnlyPendingSteps() async throws {
        let world = World()
        // The first step is done; the second waits on a retry when the process stops: the
        // message is abandoned with its second step pending.
        world.executor.script.withLock { $0["r"] = [.done("first"), .retry("later", after: 30)] }
        let door = HandDoor()
        let first = Task { await world.pipeline.run(door.stream) }
        let message = Self.token(Self.issuerA, "r", jti: "again", key: Self.keyA)
        door.feed([message])
        #expect(await eventually { world.executor.calls(for: "r") == 2 })
        world.stop.stop()
        door.continuation.finish()
        await first.value
        #expect(door.disposition(0) == .abandoned)
        #expect(world.ledger.event("again")?.steps.map(\.status) == [.done, .pending])

        // Delivered again to a new process over the same ledger: only the second step runs.
        let restarted = World(ledger: world.ledger)
        let settled = await Settled.run(restarted.pipeline, [[message]])
        #expect(settled == [.duplicate(eventID: world.ledger.event("again")!.id)])
        #expect(restarted.executor.calls(for: "r") == 1)
        #expect(world.ledger.event("again")?.steps.map(\.status) == [.done, .done])
        #expect(world.ledger.event("again")?.outcome == .processed)
    }

    // Stopping while a subject's event waits on a retry abandons it and the subject's later
    // events, which must not act before it; events already durable stay settled.
    @Test func stoppingAbandonsWhatIsNotDurableAndKeepsASubjectsOrder() async {
        let registry = PrometheusCollectorRegistry()
        let world = World(metrics: PrometheusMetricsFactory(registry: registry))
        world.executor.script.withLock { $0["slow"] = Array(repeating: .retry("down", after: 30), count: 5) }
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([
            Self.token(Self.issuerA, "slow", jti: "s-1", key: Self.keyA),
            Self.token(Self.issuerA, "fast", jti: "f-1", key: Self.keyA),
            Self.token(Self.issuerA, "slow", jti: "s-2", key: Self.keyA),
        ])
        #expect(await eventually { door.disposition(1) != nil && world.executor.calls(for: "slow") == 1 })
        world.stop.stop()
        door.continuation.finish()
        await running.value
        #expect(door.disposition(0) == .abandoned)
        #expect(door.disposition(2) == .abandoned)
        if case .recorded = door.disposition(1) {} else { Issue.record("f-1: \(String(describing: door.disposition(1)))") }
        #expect(world.executor.calls(for: "slow") == 1)  // s-2 never acted before s-1
        #expect(world.ledger.event("s-2")?.steps.allSatisfy { $0.status == .pending } == true)
        // The two events left with steps pending are counted so.
        var text: [UInt8] = []
        registry.emit(into: &text)
        let metrics = String(decoding: text, as: UTF8.self)
        #expect(metrics.contains(#"warden_events_total{outcome="pending"} 2"#), "\(metrics)")
        #expect(metrics.contains(#"warden_events_total{outcome="processed"} 1"#), "\(metrics)")
    }

    // A message its door takes back (its partition revoked) while a step is under way: the
    // step's outcome is recorded, no further step starts, the lease is given up, and the
    // message is abandoned for its next owner.
    @Test func aMessageTakenBackMidStepStartsNoFurtherStep() async throws {
        let world = World()
        world.executor.hold("moved")
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([Self.token(Self.issuerA, "moved", jti: "m", key: Self.keyA)])
        #expect(await eventually { world.executor.waiting("moved") == 1 })
        door.takenBack.withLock { _ = $0.insert(0) }
        world.executor.release("moved")
        #expect(await eventually { door.disposition(0) != nil })
        door.continuation.finish()
        await running.value
        #expect(door.disposition(0) == .abandoned)
        #expect(world.executor.calls(for: "moved") == 1)
        let event = try #require(world.ledger.event("m"))
        #expect(event.steps.map(\.status) == [.done, .pending])
        #expect(event.leaseUntil <= Date().timeIntervalSince1970)
    }

    // A stream status a transmitter makes up is counted as `other`: a label value the sender
    // chooses would add a series to /metrics every time.
    @Test func aStreamStatusOutsideTheKnownOnesIsOther() {
        let registry = PrometheusCollectorRegistry()
        let metrics = WardenMetrics(factory: PrometheusMetricsFactory(registry: registry))
        for i in 0..<3 { metrics.streamStatus(issuer: Self.issuerA, status: "made-up-\(i)") }
        metrics.streamStatus(issuer: Self.issuerA, status: "paused")
        var text: [UInt8] = []
        registry.emit(into: &text)
        let lines = String(decoding: text, as: UTF8.self).split(separator: "\n").filter { $0.hasPrefix("warden_stream_status{") }
        #expect(lines.count == 4, "\(lines)")
        #expect(!lines.contains { $0.contains("made-up") })
        #expect(lines.contains { $0.contains(#"status="paused"} 1"#) })
        #expect(lines.contains { $0.contains(#"status="other"} 0"#) })
    }

    // A partition moved to another member: its gauges stop being exported (a frozen value
    // would read as current), and come back if it is assigned here again.
    @Test func aDroppedGaugeLeavesMetricsAndCanComeBack() {
        let registry = PrometheusCollectorRegistry()
        let metrics = WardenMetrics(factory: PrometheusMetricsFactory(registry: registry))
        let labels = [("topic", "security-events"), ("partition", "3")]
        func exported() -> String {
            var text: [UInt8] = []
            registry.emit(into: &text)
            return String(decoding: text, as: UTF8.self)
        }
        metrics.gauge("warden_kafka_in_flight", labels).record(7)
        metrics.gauge("warden_kafka_in_flight", [("topic", "security-events"), ("partition", "4")]).record(1)
        #expect(exported().contains(#"warden_kafka_in_flight{topic="security-events",partition="3"} 7"#))
        metrics.dropGauge("warden_kafka_in_flight", labels)
        #expect(!exported().contains(#"partition="3""#), "\(exported())")
        #expect(exported().contains(#"warden_kafka_in_flight{topic="security-events",partition="4"} 1"#))
        metrics.gauge("warden_kafka_in_flight", labels).record(2)
        #expect(exported().contains(#"warden_kafka_in_flight{topic="security-events",partition="3"} 2"#))
    }

    // A call that lasts longer than the event's lease (a slow webhook): the lease is kept
    // renewed while the call is under way, so another process cannot take the event's steps
    // up and run the same step again meanwhile.
    @Test func aLeaseIsKeptWhileALongCallIsUnderWay() async throws {
        let world = World(steps: StepRunner.Configuration(lease: .seconds(3)))
        world.executor.hold("slow")
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([Self.token(Self.issuerA, "slow", jti: "long", key: Self.keyA)])
        #expect(await eventually { world.executor.waiting("slow") == 1 })
        let id = try #require(world.ledger.event("long")).id
        // Two leases' time, the call still under way.
        for _ in 0..<2 {
            try await Task.sleep(for: .seconds(3))
            #expect(try await !world.ledger.lease(event: id, owner: "another-process", seconds: 60))
        }
        world.executor.release("slow")
        #expect(await eventually { door.disposition(0) != nil })
        door.continuation.finish()
        await running.value
        if case .recorded = door.disposition(0) {} else { Issue.record("\(String(describing: door.disposition(0)))") }
        #expect(world.executor.calls(for: "slow") == 2)  // both steps, each once
        #expect(world.ledger.event("long")?.steps.map(\.status) == [.done, .done])
    }

    // A burst of events whose calls all outlast their leases, on a ledger where each lease
    // write takes 50 ms: renewed one after another (5 s for all) the last would run out; every
    // one of them stays held.
    @Test func theLeasesOfABurstAreAllKeptOnASlowLedger() async throws {
        let world = World(steps: StepRunner.Configuration(lease: .seconds(4)))
        world.ledger.state.withLock { $0.leaseDelay = .milliseconds(50) }
        let users = (0..<100).map { "burst-\($0)" }
        for user in users { world.executor.hold(user) }
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed(users.map { Self.token(Self.issuerA, $0, jti: $0, key: Self.keyA) })
        #expect(await eventually { users.allSatisfy { world.executor.waiting($0) == 1 } })
        let ids = try users.map { try #require(world.ledger.event($0)).id }
        for _ in 0..<2 {
            try await Task.sleep(for: .seconds(4))
            var taken = 0
            for id in ids where try await world.ledger.lease(event: id, owner: "another-process", seconds: 0.001) { taken += 1 }
            #expect(taken == 0, "leases that ran out")
        }
        for user in users { world.executor.release(user) }
        #expect(await eventually { (0..<users.count).allSatisfy { door.disposition($0) != nil } })
        door.continuation.finish()
        await running.value
    }

    // Refusal counting: a step its target keeps refusing (retry) while it serves other events
    // is failed after `maximumAttempts` such refusals and dead-lettered; a target that refuses
    // everyone (down) counts nothing against an event, which waits until the target is back.
    @Test func aStepRefusedWhileItsTargetServesOthersFailsAndOneThatIsDownWaits() async throws {
        let steps = StepRunner.Configuration(maximumAttempts: 3, breakers: .init(threshold: 5, cooldown: .milliseconds(20),
                                                                                 maximumCooldown: .milliseconds(40)))
        let world = World(steps: steps)
        world.executor.script.withLock { $0["picky"] = Array(repeating: .retry("not this one", after: nil), count: 1000) }
        let door = HandDoor()
        let running = Task { await world.pipeline.run(door.stream) }
        door.feed([Self.token(Self.issuerA, "picky", jti: "picky", key: Self.keyA)])
        // Others are served meanwhile, one event every few milliseconds.
        var served = 0
        while door.disposition(0) == nil, served < 2000 {
            door.feed([Self.token(Self.issuerA, "other-\(served)", jti: "other-\(served)", key: Self.keyA)])
            served += 1
            try await Task.sleep(for: .milliseconds(5))
        }
        let picky = try #require(world.ledger.event("picky"))
        #expect(door.disposition(0) == .recorded(eventID: picky.id, outcome: .failed))
        // Both of its steps were refused while others were served: each failed for good and
        // was dead-lettered, after three counted refusals (so at least four calls each), far
        // fewer than the target would have refused.
        #expect(picky.steps.map(\.status) == [.failed, .failed])
        #expect(picky.steps.allSatisfy { $0.detail?.contains("gave up after 3 attempts") == true })
        #expect(world.deadLetters.sent.withLock { $0.map(\.source) } == ["test:picky", "test:picky"])
        #expect((8..<1000).contains(world.executor.calls(for: "picky")))
        // The others were all served, and nothing else was dead-lettered.
        #expect(await eventually { door.settled.all.count == served + 1 && door.settled.all.allSatisfy { $0 != nil } })
        #expect(door.settled.all.dropFirst().allSatisfy { if case .recorded(_, .processed)? = $0 { true } else { false } })

        // Down for everyone: eight refusals in a row count nothing, and the event is done once
        // the target answers.
        world.executor.script.withLock { $0["alone"] = Array(repeating: .retry("down", after: nil), count: 8) }
        door.feed([Self.token(Self.issuerA, "alone", jti: "alone", key: Self.keyA)])
        let index = served + 1
        #expect(await eventually { door.disposition(index) != nil })
        #expect(door.disposition(index) == .recorded(eventID: try #require(world.ledger.event("alone")).id, outcome: .processed))
        #expect(world.executor.calls(for: "alone") == 10)  // eight refusals, then both steps
        door.continuation.finish()
        await running.value
    }
}
