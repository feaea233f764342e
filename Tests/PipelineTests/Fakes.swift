import Foundation
import Invalidation
import Ledger
@testable import Pipeline
import SecurityEvents
import Synchronization
import TokenVerification

/// An in-memory ledger with the rules the SQL back ends keep: one claim per (issuer, jti), a
/// batch written atomically, a step recorded only while pending, one lease holder at a time.
/// Failures are injected: `unavailableWrites` transient failures, and events whose jti is in
/// `refusedJTIs` refused for good.
final class MemoryLedger: Ledger {
    struct Event {
        var id: Int64
        var issuer: String
        var jti: String
        var outcome: EventOutcome
        var steps: [OutboxStep]
        var leaseOwner: String? = nil
        var leaseUntil: Double = 0
        var token: [UInt8] = []
        var source = ""
        var receivedAt: Double = 0
    }

    struct State {
        var events: [Event] = []
        var rejections: [Rejection] = []
        var unavailableWrites = 0
        var refusedJTIs: Set<String> = []
        /// Verification states asked for, by issuer and state, with when each arrived.
        var verifications: [String: Double?] = [:]
        var streams: [String: String] = [:]
        var writes = 0
        /// How many entries each `record(_:)` call held (the intake's writes).
        var intakeWrites: [Int] = []
        /// How many outcomes each `recordSteps(_:)` call held.
        var stepWrites: [Int] = []
        /// How long each lease write takes (a ledger busy with other writes).
        var leaseDelay: Duration? = nil
        /// Reads of pending events fail (transiently) while set.
        var pendingReadsFail = false
    }

    let state = Mutex(State())

    func event(_ jti: String) -> Event? { state.withLock { $0.events.first { $0.jti == jti } } }
    var rejections: [Rejection] { state.withLock { $0.rejections } }

    private func write<T>(_ body: (inout State) throws(LedgerError) -> T) throws(LedgerError) -> T {
        try state.withLock { (s: inout State) throws(LedgerError) -> T in
            s.writes += 1
            if s.unavailableWrites > 0 {
                s.unavailableWrites -= 1
                throw LedgerError(.unavailable, "the test ledger is unavailable")
            }
            var copy = s
            let result = try body(&copy)
            s = copy  // atomic: nothing of a failed write remains
            return result
        }
    }

    private static func claim(_ event: LedgerEvent, _ outcome: EventOutcome, _ steps: [OutboxStep], in s: inout State)
        throws(LedgerError) -> Claim
    {
        if s.refusedJTIs.contains(event.jti) { throw LedgerError(.refused, "the test ledger refuses \(event.jti)") }
        if let existing = s.events.first(where: { $0.issuer == event.issuer && $0.jti == event.jti }) {
            return .duplicate(eventID: existing.id)
        }
        let id = Int64(s.events.count + 1)
        // The lease taken with the claim, as the SQL ledgers take it.
        s.events.append(Event(id: id, issuer: event.issuer, jti: event.jti, outcome: outcome, steps: steps,
                              leaseOwner: event.leaseOwner, leaseUntil: event.leaseUntil ?? 0, token: event.tokenBytes,
                              source: event.source, receivedAt: event.receivedAt))
        return .new(eventID: id)
    }

    func claim(_ event: LedgerEvent, outcome: EventOutcome, steps: [OutboxStep]) async throws(LedgerError) -> Claim {
        try write { (s: inout State) throws(LedgerError) in try Self.claim(event, outcome, steps, in: &s) }
    }

    /// Intake writes, by number from 0, that wait for `releaseIntakeWrite` before writing.
    private let heldWrites = Mutex<(numbers: Set<Int>, waiting: [Int: CheckedContinuation<Void, Never>])>(([], [:]))

    func holdIntakeWrite(_ number: Int) { heldWrites.withLock { _ = $0.numbers.insert(number) } }

    func releaseIntakeWrite(_ number: Int) {
        let waiter = heldWrites.withLock { h -> CheckedContinuation<Void, Never>? in
            h.numbers.remove(number)
            return h.waiting.removeValue(forKey: number)
        }
        waiter?.resume()
    }

    func record(_ entries: [LedgerEntry]) async throws(LedgerError) -> [Claim?] {
        let number = state.withLock { s in
            s.intakeWrites.append(entries.count)
            return s.intakeWrites.count - 1
        }
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let wait = heldWrites.withLock { h -> Bool in
                guard h.numbers.contains(number) else { return false }
                h.waiting[number] = continuation
                return true
            }
            if !wait { continuation.resume() }
        }
        return try write { (s: inout State) throws(LedgerError) -> [Claim?] in
            var claims: [Claim?] = []
            for entry in entries {
                switch entry {
                case .event(let event, let outcome, let steps): claims.append(try Self.claim(event, outcome, steps, in: &s))
                case .rejection(let rejection):
                    s.rejections.append(rejection)
                    claims.append(nil)
                }
            }
            return claims
        }
    }

    func record(outcome: EventOutcome, forEvent eventID: Int64) async throws(LedgerError) {
        try write { (s: inout State) throws(LedgerError) in
            guard let i = s.events.firstIndex(where: { $0.id == eventID }) else { throw LedgerError(.conflict, "no event \(eventID)") }
            s.events[i].outcome = outcome
        }
    }

    func recordSteps(_ records: [RecordedStep]) async throws(LedgerError) -> RecordedSteps {
        RecordedSteps(refusals: try write { (s: inout State) throws(LedgerError) -> [LedgerError?] in
            s.stepWrites.append(records.count)
            return records.map { record -> LedgerError? in
                guard let i = s.events.firstIndex(where: { $0.id == record.eventID }),
                      let j = s.events[i].steps.firstIndex(where: { $0.index == record.index })
                else { return LedgerError(.conflict, "event \(record.eventID) has no step \(record.index)") }
                guard s.events[i].steps[j].status == .pending else {
                    return LedgerError(.conflict, "step \(record.index) of event \(record.eventID) is already recorded \(s.events[i].steps[j].status)")
                }
                s.events[i].steps[j].status = record.status
                s.events[i].steps[j].detail = record.detail
                if let finishing = record.finishing { s.events[i].outcome = finishing }
                return nil
            }
        })
    }

    func pendingEvents(receivedBefore: Double, afterID: Int64, limit: Int, unleasedAt: Double?) async throws(LedgerError) -> [PendingEvent] {
        if state.withLock({ $0.pendingReadsFail }) { throw LedgerError(.unavailable, "the test ledger cannot be read") }
        return state.withLock { s in
            s.events.filter { e in
                e.id > afterID && e.receivedAt < receivedBefore && e.steps.contains { $0.status == .pending }
                    && (unleasedAt.map { e.leaseOwner == nil || e.leaseUntil < $0 } ?? true)
            }
                .prefix(limit).map { PendingEvent(id: $0.id, token: $0.token, source: $0.source, receivedAt: $0.receivedAt) }
        }
    }

    func requestVerification(issuer: String, state: String, at time: Double) async throws(LedgerError) {
        try write { (s: inout State) throws(LedgerError) in
            if s.verifications[issuer + "\n" + state] == nil { s.verifications[issuer + "\n" + state] = .some(nil) }
        }
    }

    func verificationArrived(issuer: String, state: String, at time: Double) async throws(LedgerError) -> Bool {
        try write { (s: inout State) throws(LedgerError) -> Bool in
            guard let arrived = s.verifications[issuer + "\n" + state] else { return false }
            s.verifications[issuer + "\n" + state] = .some(arrived ?? time)
            return true
        }
    }

    func verificationArrival(issuer: String, state: String) async throws(LedgerError) -> Double? {
        self.state.withLock { $0.verifications[issuer + "\n" + state] ?? nil }
    }

    func streamID(issuer: String) async throws(LedgerError) -> String? { state.withLock { $0.streams[issuer] } }

    func keepStreamID(_ id: String?, issuer: String) async throws(LedgerError) {
        try write { (s: inout State) throws(LedgerError) in s.streams[issuer] = id }
    }

    func lease(event eventID: Int64, owner: String, seconds: Double) async throws(LedgerError) -> Bool {
        if let delay = state.withLock({ $0.leaseDelay }) { try? await Task.sleep(for: delay) }
        return try write { (s: inout State) throws(LedgerError) -> Bool in
            guard let i = s.events.firstIndex(where: { $0.id == eventID }) else { throw LedgerError(.conflict, "no event \(eventID)") }
            let now = Date().timeIntervalSince1970
            guard s.events[i].leaseOwner == nil || s.events[i].leaseOwner == owner || s.events[i].leaseUntil < now else { return false }
            s.events[i].leaseOwner = owner
            s.events[i].leaseUntil = now + seconds
            return true
        }
    }

    func steps(ofEvent eventID: Int64) async throws(LedgerError) -> [OutboxStep] {
        state.withLock { s in s.events.first { $0.id == eventID }?.steps ?? [] }
    }

    func recordRejection(_ rejection: Rejection) async throws(LedgerError) {
        try write { (s: inout State) throws(LedgerError) in s.rejections.append(rejection) }
    }

    // Read through `state` in these tests; the stored-row types belong to the SQL back ends.
    func events() async throws(LedgerError) -> [StoredEvent] { [] }
    func deliveries() async throws(LedgerError) -> [StoredDelivery] { [] }
    func isReachable() async -> Bool { true }
    func close() async {}
}

/// Dead letters kept in memory; the first `unavailable` attempts fail with a retryable error.
final class MemoryDeadLetters: DeadLetterSink {
    let sent = Mutex<[(code: String, source: String)]>([])
    let unavailable = Mutex(0)

    func deadLetter(value: [UInt8], key: [UInt8]?, headers: [MessageHeader], code: String, description: String,
                    source: String) async throws(DeadLetterError) {
        let fail = unavailable.withLock { n -> Bool in
            defer { n = max(0, n - 1) }
            return n > 0
        }
        if fail { throw DeadLetterError("the test topic is unavailable", isRetryable: true) }
        sent.withLock { $0.append((code, source)) }
    }
}

/// Runs steps by script: each call for a user takes the next outcome scripted for that user
/// (done when none is left), and every call is counted. A user put on hold has its calls wait
/// until `release` is called for it.
final class ScriptedExecutor: StepExecutor {
    let script = Mutex<[String: [StepOutcome]]>([:])
    let calls = Mutex<[String]>([])
    /// The `jti` of each call's event, in call order.
    let jtis = Mutex<[String]>([])
    private let holds = Mutex<(users: Set<String>, waiting: [String: [CheckedContinuation<Void, Never>]])>(([], [:]))

    func hold(_ user: String) { holds.withLock { _ = $0.users.insert(user) } }

    func release(_ user: String) {
        let waiters = holds.withLock { h -> [CheckedContinuation<Void, Never>] in
            h.users.remove(user)
            return h.waiting.removeValue(forKey: user) ?? []
        }
        for waiter in waiters { waiter.resume() }
    }

    /// Calls now waiting for `release`.
    func waiting(_ user: String) -> Int { holds.withLock { $0.waiting[user]?.count ?? 0 } }

    func calls(for user: String) -> Int { calls.withLock { $0.filter { $0 == user }.count } }

    /// The size of each call for several events' steps at once.
    let batches = Mutex<[Int]>([])

    func execute(_ calls: [StepCall]) async -> [StepOutcome] {
        batches.withLock { $0.append(calls.count) }
        return await executeEach(calls)
    }

    /// Purge-set steps (the first step of each event) run together.
    func runsTogether(_ action: StepAction) -> Bool {
        if case .purgeSet = action { return true }
        return false
    }

    func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
        let user = context.user ?? "?"
        calls.withLock { $0.append(user) }
        jtis.withLock { $0.append(context.token.jti) }
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let wait = holds.withLock { h -> Bool in
                guard h.users.contains(user) else { return false }
                h.waiting[user, default: []].append(continuation)
                return true
            }
            if !wait { continuation.resume() }
        }
        return script.withLock { s -> StepOutcome in
            guard var list = s[user], !list.isEmpty else { return .done("ok") }
            defer { s[user] = list }
            return list.removeFirst()
        }
    }
}

/// Serves a JWKS document, or fails while `failing` is set.
final class SwitchableKeyFetcher: KeyDocumentFetching {
    let document = Mutex<String>("")
    let failing = Mutex(false)

    /// The name of the thread of each fetch.
    let threads = Mutex<[String]>([])

    func fetch(_ url: URL, timeout: Double, maximumBytes: Int) async throws -> FetchedDocument {
        threads.withLock { $0.append(currentThreadName()) }
        if failing.withLock({ $0 }) { throw KeyFetchError("the test provider is down") }
        return FetchedDocument(body: Array(document.withLock { $0 }.utf8), maxAge: 60)
    }
}

/// Waits until `condition` holds (checking every few milliseconds); false if it did not within
/// `attempts` checks. Used to observe a state, never to measure time.

/// The calling thread's name, as the kernel keeps it (`Thread.current` is not for async code).
func currentThreadName() -> String {
    ((try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8)) ?? "").trimmingCharacters(in: .newlines)
}
