public import ArgumentParser
import AsyncHTTPClient
import HTTPExchange
import Foundation
import Invalidation
import Ledger
import Logging
import Metrics
import Pipeline
import Redis
import SecurityEvents
import TokenVerification

extension WardenCommand {
    /// `warden replay`: re-verifies a log with the keys of the time, plans it with today's
    /// policy, compares it with the ledger, and with --apply does what is missing.
    public struct Replay: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            abstract: "Re-verifies a log of SETs, compares it with the ledger, and with --apply does what is missing.",
            discussion: """
            Sources: --file PATH (one compact SET per line, or JSON Lines with a "token" member and optionally \
            "received_at"; gzip accepted) or --topic NAME [--from T] [--to T] (T: RFC 3339), read by a consumer of \
            its own that commits nothing. Tokens are verified with every key the ledger archived, then the live keys. \
            A dry run (the default) touches no target and writes nothing to the ledger. \
            Exit status: 0 no discrepancy (with --apply: every one repaired), 1 discrepancies (or an audit chain that does not \
            check, which --apply cannot mend: warden audit verify names it), \
            2 usage or configuration error, 3 keys (or the ledger) unavailable.
            """
        )

        @Option(name: .long, help: ArgumentHelp("The configuration file (YAML); default: WARDEN_CONFIG.", valueName: "file"))
        var config: String = WardenConfiguration.environmentConfigPath

        @Option(name: .long, help: "A log file: one compact SET per line, or JSON Lines with a \"token\" member; .gz accepted.")
        var file: String?

        @Option(name: .long, help: "A Kafka topic of the configured cluster.")
        var topic: String?

        @Option(name: .long, help: "With --topic: from this time on (RFC 3339).")
        var from: String?

        @Option(name: .long, help: "With --topic: before this time (RFC 3339).")
        var to: String?

        @Flag(name: .long, help: "Do what the ledger says is missing (claim, plan and act; run failed steps again).")
        var apply = false

        @Option(name: .long, help: "Write one JSON object per entry here (JSON Lines).")
        var report: String?

        @Option(name: .long, help: "Write a self-contained HTML report here.")
        var html: String?

        public init() {}

        public func validate() throws {
            guard (file == nil) != (topic == nil) else { throw ValidationError("give exactly one of --file and --topic") }
            if file != nil, from != nil || to != nil { throw ValidationError("--from and --to apply to --topic only") }
            try Audit.validateTimes(from: from, to: to)
        }

        public func run() async throws {
            let configuration: WardenConfiguration
            do {
                configuration = try WardenConfiguration.load(path: config)
                if topic != nil, configuration.kafka == nil { throw ConfigError(path: "kafka", "is required by warden replay --topic") }
                if topic != nil, configuration.kafka?.isEmbedded == true {
                    throw ConfigError(path: "kafka", "is the embedded cluster, which lives only inside warden run: replay needs brokers")
                }
            } catch {
                standardError("warden: \(error)\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            var source: any ReplaySource
            do {
                if let file {
                    source = try FileReplaySource(path: file, maximumTokenBytes: configuration.maximumTokenBytes)
                } else {
                    source = try KafkaReplaySource(kafka: configuration.kafka!, topic: topic!,
                                                   from: from.flatMap(RFC3339.parse), to: to.flatMap(RFC3339.parse))
                }
            } catch {
                standardError("warden: \(error)\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            var reportFile: FileHandle? = nil
            if let report {
                guard FileManager.default.createFile(atPath: report, contents: nil), let handle = FileHandle(forWritingAtPath: report) else {
                    standardError("warden: cannot write the report to \(report)\n")
                    throw ExitCode(VerifyExit.usage.rawValue)
                }
                reportFile = handle
            }
            defer {
                try? reportFile?.close()
                source.close()
            }
            let opened = try await CommandLedger.open(config: config, command: "replay")
            var logger = Logger(label: "warden")
            logger.logLevel = ProcessInfo.processInfo.environment["WARDEN_LOG_LEVEL"].flatMap(Logger.Level.init(rawValue:)) ?? .error
            let client = configuration.makeHTTPClient()
            let status: Int32
            do {
                status = try await replay(&source, configuration: configuration, ledger: opened.ledger, client: client, logger: logger,
                                          reportFile: reportFile)
            } catch {
                try? await client.shutdown()
                await opened.close()
                throw error
            }
            try? await client.shutdown()
            await opened.close()
            if status != 0 { throw ExitCode(status) }
        }

        /// Entries read, verified and compared at a time.
        static let batchSize = 1024
        /// Batches read and verified ahead of the one compared with the ledger.
        static let batchesAhead = 2

        private func replay(_ source: inout any ReplaySource, configuration: WardenConfiguration, ledger: any AuditingLedger,
                            client: any HTTPExchanging, logger: Logger, reportFile: FileHandle?) async throws -> Int32 {
            // Only archived keys a record of the intact audit chain attests: a key added to the
            // archive by hand (or the archive of a ledger whose chain is broken) is not trusted.
            let archived: [ArchivedKey]
            // A broken chain is itself a discrepancy: the replay goes on (with no archived key the
            // chain does not attest) and exits 1 however the entries compare.
            let chainBroken: String?
            do {
                let (attested, finding) = try await ledger.attestedArchivedKeys()
                if case .broken(let seq, let reason) = finding {
                    let broken = "the audit log is broken at record \(seq): \(reason)"
                    standardError("warden: \(broken); archived keys no intact record attests are not used (warden audit verify)\n")
                    chainBroken = broken
                } else {
                    chainBroken = nil
                }
                archived = attested
            } catch {
                standardError("warden: cannot read the key archive: \(error)\n")
                return 3
            }
            let verifier = configuration.makeVerifier(client: client, logger: logger, archived: archived)
            // A dry run makes no engine at all: no target is connected to.
            var engine = InvalidationEngine.recordOnly
            var targets: ReloadableTargets.Generation? = nil
            if apply {
                do {
                    let made = try configuration.invalidation.makeTargets(http: client, logger: logger)
                    engine = InvalidationEngine(planner: Planner(policy: configuration.invalidation.policy),
                                                resolver: made.resolver, executor: made.executor)
                    targets = made
                } catch {
                    standardError("warden: \(error)\n")
                    return VerifyExit.usage.rawValue
                }
            }
            // SQL targets' connection pools run as long as the replay.
            let pools = (targets?.pools ?? []).map { pool in Task { await pool() } }
            defer {
                pools.forEach { $0.cancel() }
                targets?.close()
            }
            var door: ReplayDoor? = nil
            if apply {
                let processor = EventProcessor(verifier: verifier, ledger: ledger, deadLetters: LedgerOnlyDeadLetters(),
                                               metrics: WardenMetrics(factory: NOOPMetricsHandler.instance), logger: logger,
                                               stop: StopSignal(), engine: engine)
                door = ReplayDoor(processor: processor)
                door!.start()
            }
            let cutoff: Double?
            do {
                cutoff = try await Replayer.retentionCutoff(ledger: ledger, retention: configuration.ledgerRetention)
            } catch {
                standardError("warden: cannot read what the ledger's retention dropped: \(error)\n")
                return 3
            }
            let planner = Planner(policy: configuration.invalidation.policy)
            let replayer = Replayer(ledger: ledger, door: door,
                                    retentionCutoff: cutoff)
            var progress = ReplayProgress()
            var reportBuffer = ""
            func write(_ findings: [ReplayFinding]) {
                guard let reportFile else { return }
                for finding in findings {
                    reportBuffer += finding.reportLine
                    reportBuffer += "\n"
                }
                if reportBuffer.utf8.count > 1 << 16 {
                    reportFile.write(Data(reportBuffer.utf8))
                    reportBuffer = ""
                }
            }
            do {
                // A log that cannot be read on: what was read before is still compared, then
                // the replay stops with the error.
                var readFailure: (any Error)? = nil
                func read() -> [ReplayEntry] {
                    guard readFailure == nil else { return [] }
                    do {
                        return try source.next(limit: Self.batchSize)
                    } catch {
                        readFailure = error
                        return []
                    }
                }
                // Batches are read and verified ahead while the oldest is compared with the
                // ledger: two of them, so the verification threads are never left without work
                // while this task compares (a batch's last tokens run on one core alone).
                var ahead: [(batch: [ReplayEntry], verifying: Task<[Replayer.Verdict?], Never>)] = []
                func readAhead() {
                    let batch = read()
                    guard !batch.isEmpty else { return }
                    ahead.append((batch, Task { await Replayer.verify(batch, with: verifier, planner: planner) }))
                }
                // What is verified ahead is not needed once the replay stops early.
                defer { for (_, verifying) in ahead { verifying.cancel() } }
                for _ in 0..<Self.batchesAhead { readAhead() }
                while !ahead.isEmpty {
                    let (batch, verifying) = ahead.removeFirst()
                    let results = await verifying.value
                    readAhead()
                    write(try await replayer.classify(batch, results))
                    progress.update(entries: replayer.statistics.entries, source: source.progress)
                }
                if let readFailure { throw readFailure }
                if let topic {
                    try await replayer.eventsNotInLog(topic: topic, from: from.flatMap(RFC3339.parse) ?? 0,
                                                      to: min(to.flatMap(RFC3339.parse) ?? .infinity, source.readsUntil),
                                                      outsideTheRange: source.isOutsideTheRange) { write([$0]) }
                }
            } catch let error as Replayer.KeysUnavailable {
                write(error.findings)
                await door?.finish()
                progress.finish()
                // What was found before the stop is kept.
                if let reportFile, !reportBuffer.isEmpty { reportFile.write(Data(reportBuffer.utf8)) }
                standardError("warden: keys unavailable at \(error.position), replay stopped: \(error.reason)\n")
                return VerifyExit.keysUnavailable.rawValue
            } catch {
                // The ledger, the log or the cluster failed: what was found so far is kept.
                await door?.finish()
                progress.finish()
                if let reportFile, !reportBuffer.isEmpty { reportFile.write(Data(reportBuffer.utf8)) }
                let what = error is LedgerError ? "the ledger cannot be read" : "the log cannot be read"
                standardError("warden: \(what), replay stopped after \(replayer.statistics.entries) entries: \(error)\n")
                return 3
            }
            await door?.finish()
            progress.finish()
            if let reportFile, !reportBuffer.isEmpty { reportFile.write(Data(reportBuffer.utf8)) }
            let statistics = replayer.statistics
            print(statistics.summary)
            if statistics.entries == 0, let file {
                // Nothing to compare is no finding that nothing is missing.
                standardError("warden: \(file) holds no entries; nothing was compared — is this the right log?\n")
            }
            if statistics.untokened > 0 {
                FileHandle.standardError.write(Data(("warden: \(statistics.untokened) of \(statistics.entries) entries held no token "
                    + "(the first at \(statistics.firstUntokened ?? "?")); they are reported invalid — is this the right log?\n").utf8))
            }
            if let html {
                do {
                    try ReplayHTML.render(statistics, title: file ?? "topic \(topic!)", applied: apply)
                        .write(toFile: html, atomically: true, encoding: .utf8)
                } catch {
                    standardError("warden: cannot write the HTML report to \(html): \(error)\n")
                    return VerifyExit.usage.rawValue
                }
            }
            if let chainBroken {
                // Said again after the summary, where a reader of the output looks for the verdict.
                standardError("warden: \(chainBroken); the replay exits 1 (warden audit verify names it)\n")
                return 1
            }
            // With --apply, 0 only when every discrepancy was repaired: none left undone, and none
            // that cannot be (a token acted on that is refused today, an event gone from the topic).
            if apply { return statistics.unrepaired == 0 && statistics.unrepairable == 0 ? 0 : 1 }
            return statistics.discrepancyCount == 0 ? 0 : 1
        }
    }
}

/// Progress on standard error: a bar with rate and ETA on a terminal, a plain line every ten
/// seconds otherwise.
struct ReplayProgress {
    let started = Date()
    let terminal = isatty(STDERR_FILENO) == 1
    var lastShown = Date.distantPast
    var shown = false

    mutating func update(entries: Int, source: (done: Double, total: Double?)) {
        let now = Date()
        guard now.timeIntervalSince(lastShown) >= (terminal ? 0.2 : 10) else { return }
        lastShown = now
        let elapsed = max(now.timeIntervalSince(started), 0.001)
        let rate = Double(entries) / elapsed
        var fraction: Double? = nil
        if let total = source.total, total > 0 { fraction = min(1, source.done / total) }
        let eta = fraction.flatMap { f in f > 0 ? elapsed * (1 - f) / f : nil }
        let rateText = "\(Int(rate.rounded()))/s"
        if terminal {
            let width = 30
            let filled = Int((fraction ?? 0) * Double(width))
            let bar = fraction.map { _ in "[" + String(repeating: "#", count: filled) + String(repeating: "-", count: width - filled) + "] " } ?? ""
            let percent = fraction.map { "\(Int(($0 * 100).rounded(.down)))% " } ?? ""
            let etaText = eta.map { " ETA \(Self.clock($0))" } ?? ""
            FileHandle.standardError.write(Data("\r\(bar)\(percent)\(entries) SETs \(rateText)\(etaText)   ".utf8))
            shown = true
        } else {
            let percent = fraction.map { " (\(Int(($0 * 100).rounded(.down)))%)" } ?? ""
            let etaText = eta.map { ", ETA \(Self.clock($0))" } ?? ""
            standardError("warden replay: \(entries) SETs\(percent), \(rateText)\(etaText)\n")
        }
    }

    func finish() {
        if terminal, shown { standardError("\n") }
    }

    static func clock(_ seconds: Double) -> String {
        let s = Int(seconds.rounded())
        return s >= 3600 ? String(format: "%d:%02d:%02d", s / 3600, s / 60 % 60, s % 60) : String(format: "%d:%02d", s / 60, s % 60)
    }
}
