public import ArgumentParser
import Foundation
import Ledger
import Logging
import SecurityEvents

extension WardenCommand {
    /// `warden audit verify|export`: the ledger's hash-chained audit records.
    public struct Audit: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            abstract: "Checks the audit log's hash chain, or exports it as JSON Lines.",
            discussion: """
            verify: exit 0 printing the number of records and the chain's head (SEQ:HASH) when every record is intact; \
            keep the head away from the ledger and pass it back with --anchor: a tail rewritten since, head and all, is named; \
            exit 1 naming the first record that was changed, removed or reordered. \
            export: one JSON object per line on standard output (schemas/audit-record.schema.json), \
            records recorded in [--from, --to). \
            Exit 2: usage or configuration error; 3: the ledger cannot be read (retry later).
            """
        )

        enum Action: String, ExpressibleByArgument, CaseIterable {
            case verify, export
        }

        @Argument(help: "verify or export.")
        var action: Action

        @Option(name: .long, help: ArgumentHelp("The configuration file (YAML); default: WARDEN_CONFIG.", valueName: "file"))
        var config: String = WardenConfiguration.environmentConfigPath

        @Option(name: .long, help: ArgumentHelp("verify: a head an earlier verify printed (SEQ:HASH), kept away from the ledger; the chain must still hold it. Repeatable.", valueName: "seq:hash"))
        var anchor: [String] = []

        @Option(name: .long, help: "export: only records recorded at or after this time (RFC 3339).")
        var from: String?

        @Option(name: .long, help: "export: only records recorded before this time (RFC 3339).")
        var to: String?

        public init() {}

        public func validate() throws {
            try Self.validateTimes(from: from, to: to)
            if action == .verify, from != nil || to != nil {
                throw ValidationError("--from and --to apply to export only: verify checks the whole chain")
            }
            if action == .export, !anchor.isEmpty { throw ValidationError("--anchor applies to verify only") }
            for text in anchor where AuditAnchor(text) == nil {
                throw ValidationError("--anchor \(text.prefix(100).debugDescription) is not SEQ:HASH (a record number and 64 lowercase hex digits, as verify prints the head)")
            }
        }

        public func run() async throws {
            let opened = try await CommandLedger.open(config: config, command: "audit \(action.rawValue)")
            let status: Int32
            do {
                switch action {
                case .verify: status = try await verify(opened.ledger)
                case .export: status = try await export(opened.ledger)
                }
            } catch {
                await opened.close()
                standardError("warden: cannot read the audit log: \(error)\n")
                throw ExitCode(3)
            }
            await opened.close()
            if status != 0 { throw ExitCode(status) }
        }

        /// `--from` and `--to` are RFC 3339 times, the first before the second.
        static func validateTimes(from: String?, to: String?) throws {
            for (name, value) in [("--from", from), ("--to", to)] {
                if let value, RFC3339.parse(value) == nil {
                    throw ValidationError("\(name) \(value.debugDescription) is not an RFC 3339 time (e.g. 2026-11-26T09:00:00Z)")
                }
            }
            if let from = from.flatMap(RFC3339.parse), let to = to.flatMap(RFC3339.parse), from >= to {
                throw ValidationError("--from must be before --to")
            }
        }

        private func verify(_ ledger: any AuditingLedger) async throws -> Int32 {
            switch try await ledger.checkAuditChain(anchors: anchor.compactMap(AuditAnchor.init)) {
            case .intact(let count, let seq, let hash):
                // The last record checked, as an anchor for the next check (`--anchor SEQ:HASH`),
                // even when the worker appended records since.
                print("audit log intact: \(count) records, head \(seq):\(hash)")
                return 0
            case .broken(let seq, let reason):
                print("audit log broken at record \(seq): \(reason)")
                return 1
            }
        }

        private func export(_ ledger: any AuditingLedger) async throws -> Int32 {
            let from = from.flatMap(RFC3339.parse) ?? -.infinity
            let to = to.flatMap(RFC3339.parse) ?? .infinity
            // From the chain's start: nothing at or before it is part of the chain (verify names
            // such a record).
            var after = try await ledger.auditStart().seq
            var buffer = ""
            while true {
                let page = try await ledger.auditRecords(afterSeq: after, limit: 1000)
                for record in page {
                    after = record.seq
                    if from > -.infinity || to < .infinity {
                        let recordedAt = (try? JSONParser.parse(record.record))?.objectValue?["recorded_at"]?.stringValue
                            .flatMap(RFC3339.parse)
                        guard let recordedAt, recordedAt >= from, recordedAt < to else { continue }
                    }
                    buffer += record.exportLine
                    buffer += "\n"
                }
                if !buffer.isEmpty {
                    FileHandle.standardOutput.write(Data(buffer.utf8))
                    buffer = ""
                }
                if page.count < 1000 { break }
            }
            return 0
        }
    }
}

/// The ledger a command other than `run` reads: configured, and (for SQLite) already there —
/// a command that only reads never creates an empty ledger. Exits 2 when it cannot be had.
enum CommandLedger {
    static func open(config: String, command: String) async throws -> OpenedLedger {
        let configuration: WardenConfiguration
        do {
            configuration = try WardenConfiguration.load(path: config)
            guard let location = configuration.ledger else { throw ConfigError(path: "ledger", "is required by warden \(command)") }
            if case .sqlite(let path) = location, !FileManager.default.fileExists(atPath: path) {
                throw ConfigError(path: "ledger", "no ledger at \(path)")
            }
        } catch {
            standardError("warden: \(error)\n")
            throw ExitCode(VerifyExit.usage.rawValue)
        }
        var logger = Logger(label: "warden")
        logger.logLevel = ProcessInfo.processInfo.environment["WARDEN_LOG_LEVEL"].flatMap(Logger.Level.init(rawValue:)) ?? .error
        do {
            return try await OpenedLedger(configuration.ledger!, logger: logger)
        } catch {
            standardError("warden: cannot open the ledger: \(error)\n")
            throw ExitCode(3)
        }
    }
}
