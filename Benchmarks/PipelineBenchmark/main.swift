// End-to-end SETs per second through `warden run` (release build): Kafka (the embedded mock
// cluster, over TCP) → verify (RS256) → ledger claim and record (SQLite) → offset commit, with
// no actions beyond recording. Beside it: verification alone on one core, and the machine's
// two-core RSA verify limit from `openssl speed -multi 2 rsa2048` (passed in by the script).
// Run: `make bench-pipeline` (three runs, RUNS=n to change; see Benchmarks/pipeline.sh). With `redis`
// as third argument (`make bench-engine`) every event also acts: the built-in policy purges the
// user's session set on a real redis-server (each of the users holds two sessions), and the
// time runs until every event's step is done.
// Arguments: [tokens] [two-core openssl verify/s] [redis].
// A ledger in service, not a fresh one: BENCH_RANDOM_JTI=1 (random jtis, as providers send) with
// BENCH_PREFILL=1000000 (the ledger already holds a million events); BENCH_PAGE_SIZE=P makes
// that ledger with pages of P bytes.
import Foundation
import Kafka
import Ledger
import Logging
import SETMinting
import SecurityEvents
import TokenVerification
import WardenTestSupport

let arguments = CommandLine.arguments
let count = arguments.count > 1 ? Int(arguments[1]) ?? 64_000 : 64_000
let limit = arguments.count > 2 ? Double(arguments[2]).flatMap { $0 > 0 ? $0 : nil } : nil
let withRedis = arguments.count > 3 && arguments[3] == "redis"
// BENCH_RANDOM_JTI=1: each token's jti is a random UUID, as providers' are, instead of
// `bench-N`. The ledger's (issuer, jti) index then takes each claim at a random leaf.
let randomJTI = ProcessInfo.processInfo.environment["BENCH_RANDOM_JTI"] == "1"
// The mock cluster keeps ~5 MiB per partition: 16 partitions hold 64k tokens of ~830 bytes.
let partitions = max(16, count / 4000)
let issuer = "https://accounts.google.com/"
let audience = "1234-abc.apps.googleusercontent.com"
let logger: Logger = {
    var logger = Logger(label: "bench")
    logger.logLevel = .critical
    return logger
}()

// Tokens: each with its own jti, 5,000 subjects, signed on both cores. With BENCH_TOKENS_DIR,
// the tokens and their JWKS are kept there and reused by later runs of the same size (minting
// takes longer than the runs themselves).
final class TokenStore: @unchecked Sendable {
    // `@unchecked Sendable`: each index is written by exactly one concurrentPerform iteration.
    var lines = [String](repeating: "", count: count)
}
let store = TokenStore()
let cacheDirectory = ProcessInfo.processInfo.environment["BENCH_TOKENS_DIR"].map { URL(fileURLWithPath: $0) }
let cacheName = "\(count)\(withRedis ? "-redis" : "")\(randomJTI ? "-random-jti" : "")"
let cachedTokens = cacheDirectory?.appendingPathComponent("tokens-\(cacheName).tsv")
let cachedJWKS = cacheDirectory?.appendingPathComponent("jwks-\(cacheName).json")
let jwks: String
if let cachedTokens, let cachedJWKS, let lines = try? String(contentsOf: cachedTokens, encoding: .utf8),
   let document = try? String(contentsOf: cachedJWKS, encoding: .utf8) {
    store.lines = lines.split(separator: "\n").map(String.init)
    guard store.lines.count == count else { fatalError("\(cachedTokens.path) holds \(store.lines.count) tokens, not \(count)") }
    jwks = document
    print("reusing \(count) RS256 SETs minted earlier (\(cachedTokens.path))")
} else {
    let key = try SigningKey.rsa(keyID: "bench-key", algorithm: "RS256", bits: 2048)
    let signingStarted = Date()
    DispatchQueue.concurrentPerform(iterations: 2) { worker in
        for i in stride(from: worker, to: count, by: 2) {
            // With Redis, one user per event, so every purge has sessions to delete.
            let subject = withRedis ? "user-\(i)" : "user-\(i % 5000)"
            let claims = SETMinter.riscClaims(issuer: issuer, audience: audience, event: .sessionsRevoked, subject: subject,
                                              jti: randomJTI ? UUID().uuidString.lowercased() : "bench-\(i)")
            store.lines[i] = subject + "\t" + (try! SETMinter.token(claims: claims, key: key))
        }
    }
    print("minted \(count) RS256 SETs in \(String(format: "%.0f", Date().timeIntervalSince(signingStarted))) s")
    jwks = SETMinter.jwks([key])
    if let cachedTokens, let cachedJWKS {
        try FileManager.default.createDirectory(at: cachedTokens.deletingLastPathComponent(), withIntermediateDirectories: true)
        try (store.lines.joined(separator: "\n") + "\n").write(to: cachedTokens, atomically: true, encoding: .utf8)
        try jwks.write(to: cachedJWKS, atomically: true, encoding: .utf8)
    }
}

// Verification alone, one core, on these tokens.
let policy = IssuerPolicy(issuer: issuer, keySource: .pinned(document: Array(jwks.utf8), origin: "bench"),
                          audiences: [audience], algorithms: [.rs256], profile: .risc)
let cache = IssuerKeyCache(issuer: issuer, source: policy.keySource, settings: policy.keyCache, fetcher: OfflineKeyFetcher(reason: "the benchmark uses pinned keys"), logger: logger)
let verifier = SETVerifier(issuers: [.init(policy: policy, keys: cache)])
let sample = store.lines.prefix(2000).map { Array($0.split(separator: "\t")[1].utf8) }
nonisolated func verifyOnly(seconds: Double) async -> Double {
    var n = 0
    let start = Date()
    while Date().timeIntervalSince(start) < seconds {
        for token in sample {
            guard case .success = await verifier.verify(token) else { fatalError("a benchmark token did not verify") }
            n += 1
        }
    }
    return Double(n) / Date().timeIntervalSince(start)
}
let verifyRate = await verifyOnly(seconds: 3)

/// An event as the ledger benchmarks claim it: `jti`, from offset `i` of one partition.
nonisolated func benchEvent(_ jti: String, _ i: Int, token: String) -> LedgerEvent {
    LedgerEvent(issuer: issuer, jti: jti, token: token, source: "kafka:t/0/\(i)",
                eventTypes: [EventType.sessionsRevoked.uri], subject: #"{"format":"opaque","id":"x"}"#,
                keyID: "bench-key", algorithm: "RS256", keyThumbprint: "tp",
                issuedAt: 1_800_000_000, receivedAt: 1_800_000_000)
}

// The ledger alone: claim and record, from as many concurrent callers as the worker has lanes.
nonisolated func ledgerOnly(events: Int, callers: Int) async throws -> Double {
    let path = Scratch.path("bench-ledger", extension: "sqlite")
    let ledger = try SQLiteLedger(path: path)
    let token = String(store.lines[0].split(separator: "\t")[1])
    let start = Date()
    try await withThrowingTaskGroup(of: Void.self) { group in
        for c in 0..<callers {
            group.addTask {
                for i in stride(from: c, to: events, by: callers) {
                    guard case .new = try await ledger.claim(benchEvent("ledger-\(i)", i, token: token), outcome: .pending, steps: []) else {
                        fatalError("duplicate in the ledger benchmark")
                    }
                }
            }
        }
        try await group.waitForAll()
    }
    let rate = Double(events) / Date().timeIntervalSince(start)
    await ledger.close()
    for suffix in ["", "-wal", "-shm"] { try? FileManager.default.removeItem(atPath: path + suffix) }
    return rate
}
let ledgerRate = try await ledgerOnly(events: 20_000, callers: 64)
print("ledger alone (claim with plan, 64 concurrent callers): \(Int(ledgerRate)) events/s")

// The ledger alone recording steps' outcomes, as the step runner does while acting: events with
// one step each are claimed first (untimed), then their outcomes are recorded, each write
// finishing 96 events, from 8 callers at once: the rate at which the ledger records what
// acting adds to every event's ledger work.
nonisolated func outcomesOnly(events: Int, callers: Int, perWrite: Int) async throws -> Double {
    let path = Scratch.path("bench-outcomes", extension: "sqlite")
    let ledger = try SQLiteLedger(path: path)
    let token = String(store.lines[0].split(separator: "\t")[1])
    var ids: [Int64] = []
    for start in stride(from: 0, to: events, by: perWrite) {
        let claims = try await ledger.record((start..<min(start + perWrite, events)).map { i in
            .event(benchEvent("outcome-\(i)", i, token: token), outcome: .pending, steps: [OutboxStep(index: 0, kind: "purge-set", action: #"{"purgeSet":{"set":"user-sessions:u-\#(i)"}}"#)])
        })
        for claim in claims { guard case .new(let id)? = claim else { fatalError("duplicate in the outcome benchmark") }; ids.append(id) }
    }
    let writes = stride(from: 0, to: ids.count, by: perWrite).map { Array(ids[$0..<min($0 + perWrite, ids.count)]) }
    let start = Date()
    try await withThrowingTaskGroup(of: Void.self) { group in
        for c in 0..<callers {
            group.addTask {
                for w in stride(from: c, to: writes.count, by: callers) {
                    let written = try await ledger.recordSteps(writes[w].map {
                        RecordedStep(eventID: $0, index: 0, status: .done, detail: "2 listed, 2 keys deleted from user-sessions:u-\($0)",
                                     finishing: .processed)
                    })
                    guard written.refusals.allSatisfy({ $0 == nil }) else { fatalError("an outcome was refused in the outcome benchmark") }
                }
            }
        }
        try await group.waitForAll()
    }
    let rate = Double(events) / Date().timeIntervalSince(start)
    await ledger.close()
    for suffix in ["", "-wal", "-shm"] { try? FileManager.default.removeItem(atPath: path + suffix) }
    return rate
}
let outcomeRate = try await outcomesOnly(events: 40_000, callers: 8, perWrite: 96)
print("ledger alone (steps' outcomes, 96 a write, 8 concurrent callers): \(Int(outcomeRate)) outcomes/s")

// The cluster and the worker's configuration.
let cluster = try EmbeddedKafkaCluster(topics: [("security-events", partitions), ("security-events.dlq", 1)], logger: logger)
let directory = try Scratch.directory("bench")
defer { try? FileManager.default.removeItem(at: directory) }
try jwks.write(to: directory.appendingPathComponent("jwks.json"), atomically: true, encoding: .utf8)
let tokensFile = directory.appendingPathComponent("tokens.tsv")
try (store.lines.joined(separator: "\n") + "\n").write(to: tokensFile, atomically: true, encoding: .utf8)
// With Redis: a server, and two sessions listed in each user's set.
let redis: RedisServer? = withRedis ? try await RedisServer() : nil
let redisTarget = redis.map { "targets: {sessions: {redis: \"redis://127.0.0.1:\($0.port)/0\"}}" } ?? ""
if let redis {
    let commands = (0..<count).map { "SET session:user-\($0):a 1\r\nSET session:user-\($0):b 1\r\nSADD user-sessions:user-\($0) session:user-\($0):a session:user-\($0):b\r\n" }.joined()
    let seed = directory.appendingPathComponent("seed.txt")
    try commands.write(to: seed, atomically: true, encoding: .utf8)
    let pipe = Process()
    pipe.executableURL = URL(fileURLWithPath: "/bin/sh")
    pipe.arguments = ["-c", "redis-cli -p \(redis.port) --pipe < '\(seed.path)' > /dev/null"]
    try pipe.run()
    pipe.waitUntilExit()
    print("redis-server seeded: \(try await redis.cli(["DBSIZE"])) keys (two sessions and a set per user)")
}
// BENCH_KAFKA_PROPERTIES='name: "value", …' adds librdkafka properties to the worker's.
let kafkaProperties = ProcessInfo.processInfo.environment["BENCH_KAFKA_PROPERTIES"].map { ", " + $0 } ?? ""

/// A free loopback port for the worker's metrics, read at the end of a run.
let metricsPort: Int = {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    defer { close(fd) }
    var address = sockaddr_in()
    address.sin_family = sa_family_t(AF_INET)
    address.sin_addr.s_addr = inet_addr("127.0.0.1")
    var length = socklen_t(MemoryLayout<sockaddr_in>.size)
    _ = withUnsafeMutablePointer(to: &address) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) } }
    _ = withUnsafeMutablePointer(to: &address) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) } }
    return Int(UInt16(bigEndian: address.sin_port))
}()

/// The worker's metrics text (curl, an independent client).
func scrapeMetrics() -> String { curlText("http://127.0.0.1:\(metricsPort)/metrics") }

/// A Prometheus histogram's cumulative buckets, smallest bound first.
func histogramBuckets(_ text: String, _ name: String) -> [(bound: Double, label: String, count: Double)] {
    var buckets: [(bound: Double, label: String, count: Double)] = []
    for line in text.split(separator: "\n") where line.hasPrefix(name + "_bucket{") {
        guard let le = line.range(of: "le=\""), let end = line[le.upperBound...].firstIndex(of: "\""),
              let count = Double(line.split(separator: " ").last ?? "") else { continue }
        let label = String(line[le.upperBound..<end])
        buckets.append((label == "+Inf" ? .infinity : Double(label) ?? .infinity, label, count))
    }
    return buckets.sorted { $0.bound < $1.bound }
}

/// The smallest bucket bound of a Prometheus histogram holding the quantile `q` of its
/// observations, and the count; nil without observations.
func histogramQuantile(_ text: String, _ name: String, _ q: Double) -> (bound: String, count: Int)? {
    let buckets = histogramBuckets(text, name)
    guard let total = buckets.last?.count, total > 0 else { return nil }
    let bucket = buckets.first { $0.count >= q * total }!
    return (bucket.label, Int(total))
}

/// A worker configuration of its own (consumer group, ledger) for each run.
func writeConfig(run: Int) throws -> (config: URL, ledger: String) {
    let config = directory.appendingPathComponent("warden-\(run).yaml")
    try """
    issuers:
      - issuer: \(issuer)
        jwks-file: jwks.json
        audiences: [\(audience)]
    kafka:
      brokers: \(cluster.bootstrapServers)
      topic: security-events
      group: bench-\(run)
      properties: {session.timeout.ms: "6000"\(kafkaProperties)}
    http: {listen: "127.0.0.1:\(metricsPort)"}
    ledger: sqlite:ledger-\(run).sqlite
    \(redisTarget)
    """.write(to: config, atomically: true, encoding: .utf8)
    return (config, directory.appendingPathComponent("ledger-\(run).sqlite").path)
}

// Produce everything first with kcat (an independent client), keyed by subject.
let kcat = Process()
kcat.executableURL = URL(fileURLWithPath: "/usr/bin/kcat")
kcat.arguments = ["-P", "-b", cluster.bootstrapServers, "-t", "security-events", "-K", "\t", "-z", "none", "-l", tokensFile.path]
try kcat.run()
kcat.waitUntilExit()
guard kcat.terminationStatus == 0 else { fatalError("kcat could not produce the tokens") }

// For reference: kcat reading everything (no group, no commits).
do {
    let reader = Process()
    reader.executableURL = URL(fileURLWithPath: "/usr/bin/kcat")
    reader.arguments = ["-C", "-b", cluster.bootstrapServers, "-t", "security-events", "-o", "beginning", "-e", "-q", "-f", "%o\\n"]
    reader.standardOutput = FileHandle.nullDevice
    let started = Date()
    try reader.run()
    reader.waitUntilExit()
    print("kcat alone (consume everything): \(Int(Double(count) / Date().timeIntervalSince(started))) messages/s")
}

// Kafka alone: our consumer reads every message and finishes it at once (off the main actor).
nonisolated func kafkaOnly() async throws {
    let consumer = try KafkaConsumer(configuration: .init(bootstrapServers: cluster.bootstrapServers, groupID: "kafka-only",
                                                          topics: ["security-events"], properties: ["session.timeout.ms": "6000"]),
                                     logger: logger)
    async let run: Void = consumer.run()
    var n = 0
    var start: Date? = nil
    for await message in consumer.messages {
        if start == nil { start = Date() }
        consumer.finished(message)
        n += 1
        if n == count { break }
    }
    let rate = Double(n - 1) / Date().timeIntervalSince(start!)
    consumer.close()
    try await run
    print("Kafka alone (consume and commit, no work): \(Int(rate)) messages/s")
}
try await kafkaOnly()

/// Idle and total jiffies of the whole machine so far, from /proc/stat.
func machineIdle() -> (idle: Double, total: Double)? {
    guard let stat = try? String(contentsOfFile: "/proc/stat", encoding: .utf8),
          let line = stat.split(separator: "\n").first, line.hasPrefix("cpu ") else { return nil }
    let fields = line.split(separator: " ").dropFirst().compactMap { Double($0) }
    guard fields.count >= 5 else { return nil }
    return (fields[3] + fields[4], fields.prefix(8).reduce(0, +))
}
// CPU time (user + system, all threads) of a process so far, from /proc.
func cpuSeconds(_ pid: String) -> Double? {
    guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
          let close = stat.lastIndex(of: ")") else { return nil }
    let fields = stat[stat.index(after: close)...].split(separator: " ")
    guard fields.count > 13, let user = Double(fields[11]), let system = Double(fields[12]) else { return nil }
    return (user + system) / Double(sysconf(Int32(_SC_CLK_TCK)))
}
// Bytes a process has passed to write system calls so far (`wchar` in /proc/PID/io): for the
// worker, its ledger's WAL and checkpoints and, far smaller, what it writes to sockets with
// write/writev (librdkafka's sendmsg is not counted). It depends on how the writes fell into
// transactions and checkpoints, so on timing too, but far less than CPU time does on the
// machine's speed of the moment: runs of one build agree within about a tenth. What the last
// checkpoint has not copied yet when it is read is not counted.
func bytesWritten(_ pid: String) -> Double? {
    guard let io = try? String(contentsOfFile: "/proc/\(pid)/io", encoding: .utf8) else { return nil }
    for line in io.split(separator: "\n") where line.hasPrefix("wchar:") {
        return Double(line.dropFirst("wchar:".count).trimmingCharacters(in: .whitespaces))
    }
    return nil
}

/// A process's CPU seconds by thread, its threads grouped by the name the kernel shows
/// (`/proc/PID/task/TID/comm`): the ledger's writer, its WAL copier and syncer, the signature
/// checks, Swift's pool (the pipeline's tasks), librdkafka's threads, SwiftNIO's; the rest as
/// "other". Read while the worker runs: a thread that has exited is not counted.
func cpuSecondsByThread(_ pid: String) -> [(group: String, seconds: Double)] {
    let groups = [("warden-ledger", "ledger writer"), ("warden-checkpts", "WAL copier"), ("warden-walsync", "WAL sync"),
                  ("warden-verify", "verification"), ("qos", "tasks"), ("rdk:", "librdkafka"), ("NIO-", "SwiftNIO")]
    var seconds: [String: Double] = [:]
    let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")) ?? []
    for task in tasks {
        guard let comm = try? String(contentsOfFile: "/proc/\(pid)/task/\(task)/comm", encoding: .utf8),
              let cpu = cpuSeconds("\(pid)/task/\(task)") else { continue }
        let group = groups.first { comm.contains($0.0) }?.1 ?? "other"
        seconds[group, default: 0] += cpu
    }
    return (groups.map(\.1) + ["other"]).compactMap { group in seconds[group].map { (group, $0) } }
}

struct WorkerRun {
    /// Events per second from the first recorded event to the last.
    var rate: Double
    /// The worker's CPU time (all threads, start-up included) per event, seconds.
    var cpuPerEvent: Double?
    /// The worker's CPU time per event by thread (`cpuSecondsByThread`), seconds.
    var cpuPerEventByThread: [(group: String, seconds: Double)] = []
    /// The worker's bytes written (all write system calls, start-up included) per event.
    var bytesPerEvent: Double?
    /// This process's CPU per event meanwhile: the mock cluster serving the worker, and the
    /// ledger polling that finds the window.
    var clusterCPUPerEvent: Double?
    /// Share of the machine idle between the first recorded event and the last.
    var idle: Double?
    var pid: Int32
    /// The worker's metrics at the end of the run.
    var metrics: String
}

/// Runs `warden run` at `path` on the whole topic with a group and ledger of its own, and times
/// it from its first recorded event to its last.
// BENCH_PREFILL=N: the ledger already holds N events with random jtis when the worker starts,
// as a ledger in service does (the (issuer, jti) index then has far more leaves than one write
// touches). That ledger is made by this benchmark's own build of the ledger, with its page size,
// whichever `warden` then runs on it; BENCH_PAGE_SIZE=P makes it with pages of P bytes.
let prefill = Int(ProcessInfo.processInfo.environment["BENCH_PREFILL"] ?? "") ?? 0
let prefillPageSize = ProcessInfo.processInfo.environment["BENCH_PAGE_SIZE"].map { value -> Int in
    guard let size = Int(value), size >= 512, size <= 65536, size & (size - 1) == 0 else {
        fatalError("BENCH_PAGE_SIZE must be a power of two from 512 to 65536, not \(value)")
    }
    guard prefill > 0 else { fatalError("BENCH_PAGE_SIZE applies to the ledger BENCH_PREFILL makes: set both") }
    return size
}

/// Makes the ledger at `path` with `prefill` events in it (their outcome `failed`, so that the
/// run's own `processed` events are counted apart).
nonisolated func prefillLedger(_ path: String) async throws {
    if let prefillPageSize {
        try await runProgram("/usr/bin/sqlite3", [path, "PRAGMA page_size = \(prefillPageSize); PRAGMA journal_mode = WAL;"])
        let made = try await runProgram("/usr/bin/sqlite3", [path, "PRAGMA page_size"])
        guard made == "\(prefillPageSize)" else { fatalError("the prefilled ledger has pages of \(made) bytes, not \(prefillPageSize)") }
    }
    await (try SQLiteLedger(path: path)).close()
    try await runProgram("/usr/bin/sqlite3", [path, """
        WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < \(prefill))
        INSERT INTO events (issuer, jti, token, source, event_types, subject, key_id, algorithm, key_thumbprint,
                            issued_at, received_at, outcome, steps, updated_at, token_sha256)
        SELECT '\(issuer)', lower(hex(randomblob(16))), '', 'prefill', '[]', NULL, 'k', 'RS256', 'tp', 0, 0, 'failed', '[]', 0, ''
        FROM n;
        PRAGMA wal_checkpoint(TRUNCATE);
        """])
}

nonisolated func runWorker(_ path: String, run: Int) async throws -> WorkerRun {
    let (config, ledgerPath) = try writeConfig(run: run)
    if prefill > 0 { try await prefillLedger(ledgerPath) }
    let worker = Process()
    worker.executableURL = URL(fileURLWithPath: path)
    worker.arguments = ["run", "--config", config.path]
    var environment = ProcessInfo.processInfo.environment
    environment["WARDEN_LOG_LEVEL"] = "warning"
    worker.environment = environment
    worker.standardOutput = FileHandle.nullDevice
    // BENCH_WORKER_STDERR=1 shows the worker's log.
    if ProcessInfo.processInfo.environment["BENCH_WORKER_STDERR"] == nil { worker.standardError = FileHandle.nullDevice }
    let clusterCPUBefore = cpuSeconds("self") ?? 0
    try worker.run()
    var idleAtFirst: (idle: Double, total: Double)? = nil
    var firstSeen: (Date, Int)? = nil
    var last: (Date, Int) = (Date(), 0)
    let deadline = Date().addingTimeInterval(600)
    // The record-only run lasts about a second and a half: the ledger is read every 10 ms, or
    // each end of the window could be off by a tenth of the run. Both reads are index lookups
    // (the newest id; with Redis, also the events with a step pending, through the partial index
    // of pending steps): a scan of the events here, on the worker's cores, would slow it down.
    let pollInterval = 10
    var ledgerReader: SQLiteLedgerReader? = nil
    while Date() < deadline {
        try await Task.sleep(for: .milliseconds(pollInterval))
        if ledgerReader == nil, FileManager.default.fileExists(atPath: ledgerPath) { ledgerReader = try? SQLiteLedgerReader(path: ledgerPath) }
        guard let reader = ledgerReader,
              let latest = try? (withRedis ? reader.eventsWithoutPendingSteps() : reader.latestEventID()) else { continue }
        let n = Int(latest) - prefill
        if n > 0, firstSeen == nil {
            firstSeen = (Date(), n)
            idleAtFirst = machineIdle()
        }
        last = (Date(), n)
        if n >= count { break }
    }
    // The worker's CPU per event is the figure that does not drift with the machine's speed of
    // the moment. This process meanwhile serves the worker's fetches (the mock cluster) on the
    // same cores.
    let idleAtLast = machineIdle()
    // Every event's steps finished: each of them done, not failed.
    if withRedis, let reader = ledgerReader {
        let processed = try reader.eventCount(outcome: .processed)
        guard processed == count else { fatalError("\(processed) of \(count) events processed: the others' steps failed") }
    }
    let workerCPU = cpuSeconds("\(worker.processIdentifier)")
    let workerThreads = cpuSecondsByThread("\(worker.processIdentifier)")
    let workerBytes = bytesWritten("\(worker.processIdentifier)")
    let clusterCPU = cpuSeconds("self").map { $0 - clusterCPUBefore }
    let metrics = scrapeMetrics()
    worker.terminate()
    worker.waitUntilExit()
    for suffix in ["", "-wal", "-shm"] { try? FileManager.default.removeItem(atPath: ledgerPath + suffix) }
    guard let (t0, n0) = firstSeen, last.1 >= count else { fatalError("the worker recorded \(last.1) of \(count) events") }
    var idle: Double? = nil
    if let a = idleAtFirst, let b = idleAtLast, b.total > a.total { idle = (b.idle - a.idle) / (b.total - a.total) }
    return WorkerRun(rate: Double(last.1 - n0) / last.0.timeIntervalSince(t0), cpuPerEvent: workerCPU.map { $0 / Double(count) },
                     cpuPerEventByThread: workerThreads.map { ($0.group, $0.seconds / Double(count)) },
                     bytesPerEvent: workerBytes.map { $0 / Double(count) },
                     clusterCPUPerEvent: clusterCPU.map { $0 / Double(count) }, idle: idle,
                     pid: worker.processIdentifier, metrics: metrics)
}

/// "ledger writer 18.2 µs, verification 12.9 µs, …"
func byThread(_ run: WorkerRun) -> String {
    run.cpuPerEventByThread.map { "\($0.group) \(String(format: "%.1f", $0.seconds * 1e6)) µs" }.joined(separator: ", ")
}

func median(_ values: [Double]) -> Double {
    let sorted = values.sorted()
    return sorted.count % 2 == 1 ? sorted[sorted.count / 2] : (sorted[sorted.count / 2 - 1] + sorted[sorted.count / 2]) / 2
}

let wardenPath = URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent().appendingPathComponent("warden").path

// BENCH_COMPARE="A B …" (paths to `warden` builds) with BENCH_ROUNDS=N (default 5): each build
// runs once per round, in turn, on the same tokens and cluster, so builds are compared in the
// same minutes of this machine's drifting speed. Prints each build's median.
if let compare = ProcessInfo.processInfo.environment["BENCH_COMPARE"] {
    guard !withRedis else { fatalError("BENCH_COMPARE runs record-only: the Redis run purges what it measures") }
    let builds = compare.split(separator: " ").map(String.init)
    let rounds = Int(ProcessInfo.processInfo.environment["BENCH_ROUNDS"] ?? "") ?? 5
    var results = [[WorkerRun]](repeating: [], count: builds.count)
    var run = 0
    for round in 1...rounds {
        for (b, build) in builds.enumerated() {
            run += 1
            let r = try await runWorker(build, run: run)
            results[b].append(r)
            print("round \(round) build \(b): \(Int(r.rate)) SETs/s, worker \(Int((r.cpuPerEvent ?? 0) * 1e6)) µs CPU and \(Int(r.bytesPerEvent ?? 0)) B written per event (pid \(r.pid))")
            print("  \(byThread(r))")
        }
    }
    for (b, build) in builds.enumerated() {
        let rates = results[b].map(\.rate), cpus = results[b].compactMap(\.cpuPerEvent), bytes = results[b].compactMap(\.bytesPerEvent)
        print("build \(b) (\(build)): median \(Int(median(rates))) SETs/s, \(String(format: "%.1f", median(cpus) * 1e6)) µs CPU and \(Int(bytes.isEmpty ? 0 : median(bytes))) B written per event")
    }
    try? FileManager.default.removeItem(at: directory)
    exit(0)
}

// The run: a fresh consumer group reading the whole topic into a fresh ledger.
let result = try await runWorker(wardenPath, run: 0)
let rate = result.rate
if let redis {
    print("warden run end to end (Kafka → verify → SQLite ledger with outbox → Redis purge-set → step recorded → commit), \(count) SETs, \(partitions) partitions: \(Int(rate)) SETs/s")
    print("redis-server keys left after the run: \(try await redis.cli(["DBSIZE"])) (0 = every session purged)")
    if let p99 = histogramQuantile(result.metrics, "warden_step_record_seconds", 0.99) {
        print("step answered → outcome durable in the ledger, p99 over \(p99.count) steps: ≤ \(p99.bound) s (warden_step_record_seconds)")
        let quantiles = [0.5, 0.9].compactMap { q in histogramQuantile(result.metrics, "warden_step_record_seconds", q).map { "p\(Int(q * 100)) ≤ \($0.bound) s" } }
        print("  and \(quantiles.joined(separator: ", "))")
        let buckets = histogramBuckets(result.metrics, "warden_step_record_seconds")
        if let total = buckets.last?.count, total > 0 {
            let within = buckets.map { "≤ \($0.label) s \(String(format: "%.2f", 100 * $0.count / total))%" }
            print("  share of steps durable within: \(within.joined(separator: ", "))")
        }
    } else {
        print("step answered → outcome durable: no observations (was the metrics port reachable?)")
    }
} else {
    print("warden run end to end (Kafka → verify → SQLite ledger → commit), \(count) SETs, \(partitions) partitions: \(Int(rate)) SETs/s")
}
if let cpu = result.cpuPerEvent {
    print("worker CPU time per event (whole run, start-up included): \(Int(cpu * 1e6)) µs; verification alone: \(Int(1e6 / verifyRate)) µs")
}
if !result.cpuPerEventByThread.isEmpty {
    print("worker CPU time per event by thread: \(byThread(result))")
}
if let bytes = result.bytesPerEvent {
    print("worker bytes written per event (write system calls: the ledger's WAL and checkpoints, sockets): \(Int(bytes)) B")
}
if let cpu = result.clusterCPUPerEvent {
    print("mock cluster serving the worker, with this process polling the ledger (same cores): \(Int(cpu * 1e6)) µs of CPU per event")
}
if let idle = result.idle {
    print("machine idle from the first recorded event to the last: \(Int(100 * idle))%")
}
print("verification alone, one core: \(Int(verifyRate)) SETs/s; end to end is \(String(format: "%.2f", rate / (2 * verifyRate))) of twice that")
if let limit {
    print("two-core RSA-2048 verify limit (openssl speed -multi 2): \(Int(limit)) /s; end to end is \(String(format: "%.2f", rate / limit)) of it\(withRedis ? "" : " (goal ≥ 0.5)")")
}
// Globals are never released: stop the server here rather than leave it running.
await redis?.stop()
