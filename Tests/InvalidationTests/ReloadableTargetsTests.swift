import Foundation
import Invalidation
import SecurityEvents
import Synchronization
import Testing

@Suite("Targets replaced while running")
struct ReloadableTargetsTests {
    /// An executor that answers with its name, holding each call until `release()`.
    final class Gate: StepExecutor, SubjectResolver {
        let name: String
        private let waiting = Mutex<[CheckedContinuation<Void, Never>]>([])
        private let held: Bool
        let calls = Atomic<Int>(0)

        init(_ name: String, holding: Bool = false) {
            self.name = name
            held = holding
        }

        func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
            calls.add(1, ordering: .relaxed)
            if held { await withCheckedContinuation { continuation in waiting.withLock { $0.append(continuation) } } }
            return .done(name)
        }

        func resolve(_ token: SecurityEventToken) async -> ResolutionOutcome { .resolved(.user(name)) }

        var waitingCount: Int { waiting.withLock { $0.count } }

        func release() { waiting.withLock { list in list.forEach { $0.resume() }; list = [] } }
    }

    /// What a generation's close and pools did.
    final class Events: Sendable {
        let log = Mutex<[String]>([])
        func add(_ line: String) { log.withLock { $0.append(line) } }
        var lines: [String] { log.withLock { $0 } }
    }

    static func generation(_ gate: Gate, events: Events) -> ReloadableTargets.Generation {
        .init(resolver: gate, executor: gate,
              pools: [{ [name = gate.name] in
                  events.add("\(name) pool started")
                  while !Task.isCancelled { try? await Task.sleep(for: .milliseconds(5)) }
                  events.add("\(name) pool stopped")
              }],
              close: { [name = gate.name] in events.add("\(name) closed") })
    }

    static func until(_ what: String, _ condition: () -> Bool) async throws {
        for _ in 0..<2000 where !condition() { try await Task.sleep(for: .milliseconds(5)) }
        #expect(condition(), "\(what)")
    }

    static let context = StepContext(token: token("sessions-revoked"), user: "u")

    @Test func callsUnderWayFinishOnTheOldGenerationWhichClosesOnlyThen() async throws {
        let events = Events()
        let old = Gate("old", holding: true), new = Gate("new")
        let targets = ReloadableTargets(Self.generation(old, events: events))
        let runner = Task { await targets.run() }
        try await Self.until("the old pool started") { events.lines.contains("old pool started") }

        let action = StepAction.notify(target: "app")
        let underWay = Task { await targets.execute(action, context: Self.context) }
        try await Self.until("the call is under way") { old.waitingCount == 1 }

        targets.replace(with: Self.generation(new, events: events))
        // New calls go to the new generation at once; the old one stays open for its call.
        #expect(await targets.execute(action, context: Self.context) == .done("new"))
        #expect(await targets.resolve(Self.context.token) == .resolved(.user("new")))
        try await Self.until("the new pool started") { events.lines.contains("new pool started") }
        try await Task.sleep(for: .milliseconds(50))
        #expect(!events.lines.contains("old closed"))
        #expect(!events.lines.contains("old pool stopped"))

        old.release()
        #expect(await underWay.value == .done("old"))
        try await Self.until("the old generation closed") { events.lines.contains("old pool stopped") }
        #expect(events.lines.filter { $0.hasPrefix("old") } == ["old pool started", "old closed", "old pool stopped"])
        #expect(!events.lines.contains("new closed"))

        // Shutdown closes the generation in use.
        runner.cancel()
        await runner.value
        #expect(events.lines.contains("new closed") && events.lines.contains("new pool stopped"))
    }

    @Test func anIdleGenerationClosesAsSoonAsItIsReplaced() async throws {
        let events = Events()
        let targets = ReloadableTargets(Self.generation(Gate("first"), events: events))
        let runner = Task { await targets.run() }
        targets.replace(with: Self.generation(Gate("second"), events: events))
        targets.replace(with: Self.generation(Gate("third"), events: events))
        try await Self.until("both replaced generations closed") {
            events.lines.contains("first closed") && events.lines.contains("second closed")
        }
        #expect(!events.lines.contains("third closed"))
        #expect(await targets.execute(.notify(target: "app"), context: Self.context) == .done("third"))
        runner.cancel()
        await runner.value
        #expect(events.lines.contains("third closed"))
    }
}
