import Foundation
import Synchronization

/// Threads of their own for signature checks, one per core, at a lower scheduling priority
/// than the rest of the process.
///
/// Verification is the bulk of the work and is always ready to run ahead; on Swift's shared
/// pool it took its share of the cores from the threads every event waits for in turn — the
/// ledger's writer, which commits claims and steps' outcomes, and the tasks that act — and the
/// writer, with a third of a core, became the pipeline's limit while steps ran. Here the
/// scheduler runs those first whenever both are ready, and verification takes every cycle
/// they leave.
///
/// Tasks run here by preference (`addTask(executorPreference:)`); a task that suspends (a key
/// fetch) resumes here.
final class VerificationExecutor: TaskExecutor {
    /// How much lower its threads run than the process: Linux `nice` +5, about a third of a
    /// normal thread's share of a busy core.
    static let niceness: Int32 = 5

    static let shared = VerificationExecutor(threads: ProcessInfo.processInfo.activeProcessorCount)

    /// Jobs waiting, first in first out: `jobs[head...]`.
    private let queue = Mutex<(jobs: [UnownedJob], head: Int)>(([], 0))
    private let ready = DispatchSemaphore(value: 0)

    init(threads: Int) {
        for n in 0..<max(1, threads) {
            let name = "warden-verify-\(n)"
            let thread = Thread { [self] in
                // The name the kernel shows (`top -H`, `perf`): Foundation's `Thread.name` does
                // not reach it on Linux.
                try? name.write(toFile: "/proc/thread-self/comm", atomically: false, encoding: .utf8)
                // On Linux a thread's niceness is its own: this lowers this thread's alone.
                // Raising niceness needs no privilege; should it fail, the thread runs as others do.
                let which = __priority_which_t(PRIO_PROCESS.rawValue)
                _ = setpriority(which, 0, getpriority(which, 0) + Self.niceness)
                while true {
                    ready.wait()
                    let job = queue.withLock { q -> UnownedJob? in
                        guard q.head < q.jobs.count else { return nil }
                        defer {
                            q.head += 1
                            if q.head == q.jobs.count {
                                q.jobs.removeAll(keepingCapacity: true)
                                q.head = 0
                            } else if q.head >= 1024, q.head * 2 >= q.jobs.count {
                                q.jobs.removeFirst(q.head)
                                q.head = 0
                            }
                        }
                        return q.jobs[q.head]
                    }
                    job?.runSynchronously(on: asUnownedTaskExecutor())
                }
            }
            thread.name = name
            thread.start()
        }
    }

    func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        queue.withLock { $0.jobs.append(job) }
        ready.signal()
    }
}

/// Runs `body` for every index below `count` on the threads of `VerificationExecutor`, with
/// `workers` tasks at once: each task takes the next index not yet taken, so a task slowed by
/// another thread on its core does not leave the others idle at the end. Results in index order.
public func onVerificationThreads<Result: Sendable>(_ count: Int, workers: Int,
                                                     _ body: @escaping @Sendable (Int) async -> Result) async -> [Result] {
    if workers <= 1 || count <= 1 {
        return await withTaskExecutorPreference(VerificationExecutor.shared) {
            var results: [Result] = []
            results.reserveCapacity(count)
            for i in 0..<count { results.append(await body(i)) }
            return results
        }
    }
    let next = SharedCount()
    return await withTaskGroup(of: [(Int, Result)].self) { group in
        for _ in 0..<min(workers, count) {
            group.addTask(executorPreference: VerificationExecutor.shared) {
                var part: [(Int, Result)] = []
                while case let i = next.take(), i < count {
                    part.append((i, await body(i)))
                }
                return part
            }
        }
        var results = [Result?](repeating: nil, count: count)
        for await part in group { for (i, result) in part { results[i] = result } }
        return results.map { $0! }
    }
}
