import Dispatch
import Synchronization

/// Whether intake is moving: how many messages wait to be finished, and when one was last
/// finished. `/healthz` fails when work has waited with nothing finished for the stall timeout
/// (a wedged ledger disk, a Redis that accepts connections and never answers).
public final class IntakeProgress: Sendable {
    private let waiting = Atomic<Int>(0)
    /// Monotonic nanoseconds when a message was last finished, or when waiting began.
    private let moved = Atomic<UInt64>(DispatchTime.now().uptimeNanoseconds)

    public init() {}

    /// The record, with an acknowledgement that reports to this watch when it is settled.
    func track(_ record: IntakeRecord) -> IntakeRecord {
        // From idle to busy, the clock starts now: a quiet hour is not a stall.
        if waiting.add(1, ordering: .relaxed).oldValue == 0 { moved.store(DispatchTime.now().uptimeNanoseconds, ordering: .relaxed) }
        return IntakeRecord(record.message, acknowledgement: Tracked(inner: record.acknowledgement, progress: self))
    }

    fileprivate func settled(_ disposition: Disposition) {
        if disposition != .abandoned { moved.store(DispatchTime.now().uptimeNanoseconds, ordering: .relaxed) }
        waiting.subtract(1, ordering: .relaxed)
    }

    /// A record waiting aside for its issuer's keys is not stalled work: `/readyz` reports keys
    /// that cannot be had, and restarting the process would not bring them.
    fileprivate func setAside(_ aside: Bool) {
        if aside {
            waiting.subtract(1, ordering: .relaxed)
        } else if waiting.add(1, ordering: .relaxed).oldValue == 0 {
            moved.store(DispatchTime.now().uptimeNanoseconds, ordering: .relaxed)
        }
    }

    /// nil while intake moves (or nothing waits); otherwise why it is stalled.
    public func stall(after seconds: Double) -> String? {
        let count = waiting.load(ordering: .relaxed)
        guard count > 0 else { return nil }
        // `moved` first: read after now, a message finished in between would make it later.
        let last = moved.load(ordering: .relaxed)
        let now = DispatchTime.now().uptimeNanoseconds
        let idle = now > last ? Double(now - last) / 1e9 : 0
        guard idle > seconds else { return nil }
        return "intake stalled: \(count) message(s) waiting, none finished for \(Int(idle)) s (stall-timeout \(Int(seconds)) s)"
    }

    private struct Tracked: Acknowledgement {
        let inner: any Acknowledgement
        let progress: IntakeProgress

        func settle(_ disposition: Disposition) {
            inner.settle(disposition)
            progress.settled(disposition)
        }
        func durable(_ disposition: Disposition) { inner.durable(disposition) }
        var waitsForKeys: Bool { inner.waitsForKeys }
        func setAside(_ aside: Bool) {
            inner.setAside(aside)
            progress.setAside(aside)
        }
        func beginAction() -> Bool { inner.beginAction() }
        func endAction() { inner.endAction() }
    }
}
