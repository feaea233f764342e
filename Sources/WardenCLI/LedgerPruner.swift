import Foundation
import Ledger
import Logging
import Pipeline
import ServiceLifecycle

/// Ledger retention while the worker runs: every pass drops, in batches with a pause between
/// them, what was received longer than `retention` ago and is finished (see
/// `AuditingLedger.prune`). A failed batch is logged and the next pass tries again.
///
/// Batches start small (one short write) and double, up to `maximumBatch`, while a pass finds
/// more to drop than one batch holds: at full intake speed small batches fell behind (measured
/// by the soak benchmark: 4,800 events/s pruned against 6,400/s arriving) and the ledger grew
/// without bound.
struct LedgerPruner: Service {
    let ledger: any AuditingLedger
    let retention: Double
    let metrics: WardenMetrics
    let logger: Logger
    /// Events, rejections and audit records the first batch of a pass drops at most: one short write.
    var batch = 500
    /// The most a batch grows to while a pass is behind: a write of a few tenths of a second.
    var maximumBatch = 4000

    /// Seconds between passes: a tenth of the retention, between 1 s and a minute.
    var interval: Double { min(60, max(1, retention / 10)) }

    func run() async throws {
        // Shutdown cancels the wait between passes: that ends the service, not as a failure.
        try? await cancelWhenGracefulShutdown {
            while !Task.isCancelled {
                await pass()
                try await Task.sleep(for: .seconds(interval))
            }
        }
    }

    /// One pass over the ledger, batch by batch.
    func pass() async {
        var after: Int64 = 0
        var size = batch
        while !Task.isCancelled {
            let cutoff = Date().timeIntervalSince1970 - retention
            do {
                let result = try await ledger.prune(before: cutoff, limit: size, afterEventID: after)
                for (what, count) in [("events", result.events), ("rejections", result.rejections), ("audit_records", result.auditRecords)]
                    where count > 0 {
                    metrics.counter("warden_ledger_pruned_total", [("what", what)]).increment(by: count)
                }
                if result.events + result.rejections + result.auditRecords > 0 {
                    logger.debug("ledger pruned", metadata: ["warden.events": "\(result.events)", "warden.rejections": "\(result.rejections)",
                                                            "warden.audit_records": "\(result.auditRecords)"])
                }
                guard result.more else { return }
                after = result.lastEventID
                size = min(size * 2, max(batch, maximumBatch))
                // The worker's own writes go between two batches.
                try await Task.sleep(for: .milliseconds(5))
            } catch let error as LedgerError {
                logger.error("ledger retention failed; the next pass tries again", metadata: ["warden.reason": "\(error)"])
                return
            } catch {
                return  // cancelled
            }
        }
    }
}
