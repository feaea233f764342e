// Soak: millions of events through `warden run` (release build) with ledger retention short
// enough that pruning runs the whole time: Kafka (the embedded mock cluster, over TCP) → verify
// (ES256) → ledger claim with plan (SQLite) → purge the user's sessions on a real redis-server →
// record → commit, while the pruner drops what is older than the retention.
//
// Tokens are minted while the run goes (ES256, both cores, in batches) and produced by kcat (an
// independent client) from its standard input, kept at most LEAD events ahead of the worker:
// a token must be younger than the issuer's max-age when it is verified, and max-age may not
// exceed the retention. The lead is minted before the worker starts, so the minting the run
// pays for is the same at its start and its end.
//
// Reported: the rate of each million (goal: the last ≥ 0.9 of the first), the worker's RSS at
// each million (goal: flat), the ledger's size on disk and its rows at the end, what the pruner
// dropped, and every refused or failed event (must be none).
// Run: `make bench-soak` (EVENTS=n RETENTION=seconds to change).
// Arguments: [events (5,000,000)] [retention seconds (60)] [lead (100,000)].
import Foundation
import Kafka
import Ledger
import Logging
import SETMinting
import SecurityEvents
import WardenTestSupport

let arguments = CommandLine.arguments
let total = arguments.count > 1 ? Int(arguments[1]) ?? 5_000_000 : 5_000_000
let retention = arguments.count > 2 ? Int(arguments[2]) ?? 60 : 60
let lead = arguments.count > 3 ? Int(arguments[3]) ?? 100_000 : 100_000
let step = 1_000_000 <= total / 2 ? 1_000_000 : max(1, total / 5)
// The mock cluster keeps ~5 MiB per partition: 64 partitions hold ~400k tokens of ~750 bytes,
// several times the lead.
let partitions = 64
let issuer = "https://accounts.google.com/"
let audience = "1234-abc.apps.googleusercontent.com"
let logger: Logger = {
    var logger = Logger(label: "soak")
    logger.logLevel = .critical
    return logger
}()

/// One line on standard output, written at once (progress shows in a file too).
func say(_ line: String) { FileHandle.standardOutput.write(Data((line + "\n").utf8)) }
func now() -> Double { Date().timeIntervalSince1970 }
func formatted(_ value: Double, _ digits: Int = 0) -> String { String(format: "%.\(digits)f", value) }

let key = SigningKey.ec(keyID: "soak-key", algorithm: "ES256")
let cluster = try EmbeddedKafkaCluster(topics: [("security-events", partitions), ("security-events.dlq", 1)], logger: logger)
let directory = try Scratch.directory("soak")
defer { try? FileManager.default.removeItem(at: directory) }
try SETMinter.jwks([key]).write(to: directory.appendingPathComponent("jwks.json"), atomically: true, encoding: .utf8)
let redis = try await RedisServer()
let metricsPort = try freeLoopbackPort()
let ledgerPath = directory.appendingPathComponent("ledger.sqlite").path
let config = directory.appendingPathComponent("warden.yaml")
try """
issuers:
  - issuer: \(issuer)
    jwks-file: jwks.json
    audiences: [\(audience)]
    algorithms: [ES256]
    max-age: \(retention)s
kafka:
  brokers: \(cluster.bootstrapServers)
  topic: security-events
  group: soak
  properties: {session.timeout.ms: "6000"}
http: {listen: "127.0.0.1:\(metricsPort)"}
ledger: {url: "sqlite:ledger.sqlite", retention: \(retention)s}
targets: {sessions: {redis: "redis://127.0.0.1:\(redis.port)/0"}}
""".write(to: config, atomically: true, encoding: .utf8)

/// Mints tokens `range` (ES256, on both cores; one of 5,000 users each), as kcat input lines.
func mint(_ range: Range<Int>) -> Data {
    let lines = UnsafeMutableBufferPointer<String>.allocate(capacity: range.count)
    defer { lines.deallocate() }
    let issuedAt = now()
    // Each iteration initializes its own slots of the buffer, never another's.
    nonisolated(unsafe) let slots = lines
    DispatchQueue.concurrentPerform(iterations: 2) { worker in
        for i in stride(from: worker, to: range.count, by: 2) {
            let n = range.lowerBound + i
            let subject = "user-\(n % 5000)"
            let claims = SETMinter.riscClaims(issuer: issuer, audience: audience, event: .sessionsRevoked, subject: subject,
                                              jti: "soak-\(n)", issuedAt: issuedAt)
            (slots.baseAddress! + i).initialize(to: subject + "\t" + (try! SETMinter.token(claims: claims, key: key)) + "\n")
        }
    }
    defer { _ = lines.deinitialize() }
    return Data(lines.joined().utf8)
}

// kcat produces whatever is written to its standard input, keyed by subject.
let kcat = Process()
kcat.executableURL = URL(fileURLWithPath: "/usr/bin/kcat")
kcat.arguments = ["-P", "-b", cluster.bootstrapServers, "-t", "security-events", "-K", "\t", "-z", "none"]
let kcatInput = Pipe()
kcat.standardInput = kcatInput
try kcat.run()

let batch = 10_000
var produced = 0
let mintingStarted = now()
while produced < min(lead, total) {
    let count = min(batch, total - produced)
    kcatInput.fileHandleForWriting.write(mint(produced..<produced + count))
    produced += count
}
// Everything minted already: kcat's input ends here.
if produced == total { try kcatInput.fileHandleForWriting.close() }
say("soak: \(total) events, retention and max-age \(retention) s, \(partitions) partitions, lead \(lead)")
say("minted the first \(produced) ES256 SETs in \(formatted(now() - mintingStarted, 1)) s")

/// The worker's metrics text (curl, an independent client).
func scrapeMetrics() -> String { curlText("http://127.0.0.1:\(metricsPort)/metrics") }

/// The sum of a metric's samples whose line starts with `prefix` and contains `label`.
func metric(_ text: String, _ prefix: String, _ label: String = "") -> Double {
    text.split(separator: "\n").filter { $0.hasPrefix(prefix) && (label.isEmpty || $0.contains(label)) }
        .compactMap { Double($0.split(separator: " ").last ?? "") }.reduce(0, +)
}

/// Resident memory of a process, MiB.
func rss(_ pid: Int32) -> Double {
    guard let status = try? String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8),
          let line = status.split(separator: "\n").first(where: { $0.hasPrefix("VmRSS:") }),
          let kib = Double(line.split(separator: " ").dropFirst().first ?? "") else { return 0 }
    return kib / 1024
}

func ledgerBytes() -> Int {
    ["", "-wal", "-shm"].compactMap { try? FileManager.default.attributesOfItem(atPath: ledgerPath + $0)[.size] as? Int }.reduce(0, +)
}

let worker = Process()
worker.executableURL = URL(fileURLWithPath: arguments[0]).deletingLastPathComponent().appendingPathComponent("warden")
worker.arguments = ["run", "--config", config.path]
worker.currentDirectoryURL = directory
var environment = ProcessInfo.processInfo.environment
environment["WARDEN_LOG_LEVEL"] = "warning"
worker.environment = environment
worker.standardOutput = FileHandle.nullDevice
let workerLog = directory.appendingPathComponent("worker.log")
_ = FileManager.default.createFile(atPath: workerLog.path, contents: nil)
worker.standardError = try FileHandle(forWritingTo: workerLog)
try worker.run()

var reader: SQLiteLedgerReader? = nil
struct Mark {
    var events: Int
    var time: Double
    var rss: Double
    var ledgerBytes: Int
    /// Events in the ledger at that moment (finished ones older than the retention are pruned).
    var kept: Int
}
@MainActor func mark(_ events: Int, at time: Double) -> Mark {
    Mark(events: events, time: time, rss: rss(worker.processIdentifier), ledgerBytes: ledgerBytes(), kept: (try? reader?.eventCount()) ?? 0)
}
var marks: [Mark] = []
var first: Double? = nil
var done = 0
var lastMove = now()
var nextMark = step
var lastLine = now()
while done < total {
    // Keep the lead: mint and produce the next batch once the worker is close enough behind.
    while produced < total, produced - done < lead {
        let count = min(batch, total - produced)
        kcatInput.fileHandleForWriting.write(mint(produced..<produced + count))
        produced += count
        // The end of kcat's input: it produces what it still holds, and exits.
        if produced == total { try kcatInput.fileHandleForWriting.close() }
    }
    try await Task.sleep(for: .milliseconds(250))
    if reader == nil, FileManager.default.fileExists(atPath: ledgerPath) { reader = try? SQLiteLedgerReader(path: ledgerPath) }
    // Events whose last step is done, from the worker's own count: the ledger's rows come and go.
    let finished = Int(metric(scrapeMetrics(), "warden_event_to_done_seconds_count"))
    let t = now()
    if Int(finished) > done { lastMove = t }
    done = Int(finished)
    if first == nil, done > 0 {
        first = t
        marks.append(mark(done, at: t))
    }
    while done >= nextMark {
        marks.append(mark(nextMark, at: t))
        nextMark += step
    }
    if t - lastLine >= 30 {
        lastLine = t
        say("  \(done) events done, \(formatted(Double(done - marks[0].events) / (t - marks[0].time))) /s so far, worker RSS \(formatted(rss(worker.processIdentifier))) MiB, ledger \(formatted(Double(ledgerBytes()) / 1e6)) MB")
    }
    guard t - lastMove < 120, worker.isRunning else {
        say("stopped: \(done) of \(total) events done, nothing moved for \(formatted(t - lastMove)) s (worker running: \(worker.isRunning))")
        break
    }
}
if produced < total { try kcatInput.fileHandleForWriting.close() }
kcat.waitUntilExit()

let metrics = scrapeMetrics()
let events = (try? reader?.eventCount()) ?? 0
let processed = (try? reader?.eventCount(outcome: .processed)) ?? 0
worker.terminate()
worker.waitUntilExit()

say("")
say("per million (events finished, from the first finished event):")
say("  events          seconds   events/s   worker RSS   ledger on disk   events kept")
for (previous, mark) in zip(marks, marks.dropFirst()) {
    let seconds = mark.time - previous.time
    say("  \(String(mark.events).padding(toLength: 14, withPad: " ", startingAt: 0))  \(formatted(seconds).leftPadded(7))  \(formatted(Double(mark.events - previous.events) / seconds).leftPadded(9))  \(formatted(mark.rss).leftPadded(7)) MiB  \(formatted(Double(mark.ledgerBytes) / 1e6).leftPadded(8)) MB   \(String(mark.kept).leftPadded(11))")
}
if marks.count >= 3 {
    let rate = { (i: Int) in Double(marks[i].events - marks[i - 1].events) / (marks[i].time - marks[i - 1].time) }
    let firstRate = rate(1), lastRate = rate(marks.count - 1)
    say("last ÷ first: \(formatted(lastRate / firstRate, 2)) (goal ≥ 0.90)")
    say("worker RSS: \(formatted(marks[1].rss)) MiB after the first \(marks[1].events), \(formatted(marks.last!.rss)) MiB at the end")
}
say("ledger at the end: \(formatted(Double(ledgerBytes()) / 1e6)) MB on disk, \(events) events kept (\(processed) processed) of \(done) finished")
say("pruned: \(Int(metric(metrics, #"warden_ledger_pruned_total{what="events"}"#))) events, \(Int(metric(metrics, #"warden_ledger_pruned_total{what="audit_records"}"#))) audit records")
say("refused deliveries: \(Int(metric(metrics, "warden_verify_failures_total"))), failed steps: \(Int(metric(metrics, "warden_steps_total{", #"result="failed""#))), dead letters: \(Int(metric(metrics, "warden_dead_letters_total")))")
let errors = ((try? String(contentsOf: workerLog, encoding: .utf8)) ?? "").split(separator: "\n").filter { $0.contains(#""level":"error""#) || $0.contains(#""level":"critical""#) }
say("errors in the worker's log: \(errors.count)\(errors.first.map { " (first: \($0.prefix(300)))" } ?? "")")
await redis.stop()

extension String {
    func leftPadded(_ width: Int) -> String { count >= width ? self : String(repeating: " ", count: width - count) + self }
}
