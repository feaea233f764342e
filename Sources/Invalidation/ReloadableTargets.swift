public import SecurityEvents
import Synchronization

/// The engine's connections to its targets — its subject resolver and step executor — which a
/// running worker can replace (SIGHUP after a credential file changed). Calls begun before a
/// replacement finish on the generation they began on; that generation's connections are
/// closed, and its connection pools stopped, only when its last call has ended. Calls begun
/// after go to the new one.
public final class ReloadableTargets: StepExecutor, SubjectResolver {
    /// One set of connections.
    public struct Generation: Sendable {
        public var resolver: any SubjectResolver
        public var executor: any StepExecutor
        /// What must run while the generation is in use (PostgreSQL targets' connection pools);
        /// cancelled once it is retired and drained.
        public var pools: [@Sendable () async -> Void]
        /// Closes its connections, after its last call ended.
        public var close: @Sendable () -> Void

        public init(resolver: any SubjectResolver, executor: any StepExecutor, pools: [@Sendable () async -> Void] = [],
                    close: @escaping @Sendable () -> Void = {}) {
            self.resolver = resolver
            self.executor = executor
            self.pools = pools
            self.close = close
        }
    }

    /// A generation with the count of calls under way on it.
    final class Slot: Sendable {
        let generation: Generation
        private let state = Mutex(State())
        private let drained: AsyncStream<Void>
        private let drainedContinuation: AsyncStream<Void>.Continuation

        struct State {
            var calls = 0
            var retired = false
        }

        init(_ generation: Generation) {
            self.generation = generation
            (drained, drainedContinuation) = AsyncStream.makeStream(of: Void.self)
        }

        func enter() { state.withLock { $0.calls += 1 } }

        func leave() {
            let last = state.withLock { state in
                state.calls -= 1
                return state.retired && state.calls == 0
            }
            if last { drainedContinuation.finish() }
        }

        func retire() {
            let idle = state.withLock { state in
                state.retired = true
                return state.calls == 0
            }
            if idle { drainedContinuation.finish() }
        }

        /// Returns once retired with no call under way, or when the task is cancelled.
        func untilDrained() async { for await _ in drained {} }
    }

    private let current: Mutex<Slot>
    private let arrivals: AsyncStream<Slot>
    private let arrivalsContinuation: AsyncStream<Slot>.Continuation

    public init(_ generation: Generation) {
        let slot = Slot(generation)
        current = Mutex(slot)
        (arrivals, arrivalsContinuation) = AsyncStream.makeStream(of: Slot.self)
        arrivalsContinuation.yield(slot)
    }

    /// Makes `generation` the one new calls go to; the previous one is closed once its calls end.
    public func replace(with generation: Generation) {
        let fresh = Slot(generation)
        let old = current.withLock { slot in
            defer { slot = fresh }
            return slot
        }
        arrivalsContinuation.yield(fresh)
        old.retire()
    }

    /// Runs every generation's pools and closes each retired generation once drained; when the
    /// task is cancelled (shutdown), closes them all. Run it once, for as long as the targets
    /// are used: a generation replaced while it does not run is closed only when it runs.
    public func run() async {
        await withDiscardingTaskGroup { group in
            for await slot in arrivals {
                group.addTask {
                    await withTaskGroup(of: Void.self) { pools in
                        for pool in slot.generation.pools { pools.addTask { await pool() } }
                        await slot.untilDrained()
                        slot.generation.close()
                        pools.cancelAll()
                    }
                }
            }
        }
    }

    private func entered() -> Slot {
        current.withLock { slot in
            slot.enter()
            return slot
        }
    }

    public func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
        let slot = entered()
        defer { slot.leave() }
        return await slot.generation.executor.execute(action, context: context)
    }

    public func execute(_ calls: [StepCall]) async -> [StepOutcome] {
        let slot = entered()
        defer { slot.leave() }
        return await slot.generation.executor.execute(calls)
    }

    public func runsTogether(_ action: StepAction) -> Bool {
        current.withLock { $0 }.generation.executor.runsTogether(action)
    }

    public func resolve(_ token: SecurityEventToken) async -> ResolutionOutcome {
        let slot = entered()
        defer { slot.leave() }
        return await slot.generation.resolver.resolve(token)
    }
}
