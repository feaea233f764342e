import Dispatch
import Foundation
import Invalidation
import Logging
import SecurityEvents
import ServiceLifecycle
import Synchronization

/// SIGHUP: reads the configuration file again and applies what can change safely in a running
/// worker — the policy, the log level, and the targets' settings and credentials (read again
/// from their files), token stores and subjects, as long as every target keeps its name and
/// kind — and logs what changed but needs a restart. A file that no longer parses changes
/// nothing and is logged. The signal never ends the process.
struct ConfigurationReload: Service {
    let path: String
    let running: WardenConfiguration
    let planner: Planner
    let logger: Logger
    /// The running targets and how to connect to a configuration's; nil: targets need a restart.
    var targets: TargetReload? = nil

    struct TargetReload: Sendable {
        let reloadable: ReloadableTargets
        let make: @Sendable (InvalidationConfiguration) throws(ConfigError) -> ReloadableTargets.Generation
    }

    func run() async throws {
        signal(SIGHUP, SIG_IGN)  // the default action ends the process
        let (signals, continuation) = AsyncStream.makeStream(of: Void.self, bufferingPolicy: .bufferingNewest(1))
        let source = DispatchSource.makeSignalSource(signal: SIGHUP, queue: .global())
        source.setEventHandler { continuation.yield() }
        source.resume()
        defer { source.cancel() }
        let applied = Mutex(running)
        await withGracefulShutdownHandler {
            for await _ in signals { reload(into: applied) }
        } onGracefulShutdown: {
            continuation.finish()
        }
    }

    /// One reload; `applied` is the configuration in force, updated with what was applied.
    func reload(into applied: borrowing Mutex<WardenConfiguration>) {
        let fresh: WardenConfiguration
        do {
            fresh = try WardenConfiguration.load(path: path)
        } catch {
            logger.error("configuration reload refused: the running configuration stays", metadata: [
                "warden.config": "\(path)", "warden.reason": "\(error)"])
            return
        }
        let (done, needsRestart) = applied.withLock { current in Self.apply(fresh, to: &current, planner: planner, targets: targets) }
        logger.notice("configuration reloaded", metadata: [
            "warden.config": "\(path)",
            "warden.applied": "\(done.isEmpty ? "nothing changed that can be applied" : done.joined(separator: "; "))",
            "warden.needs_restart": "\(needsRestart.isEmpty ? "nothing" : needsRestart.joined(separator: "; "))",
        ])
    }

    /// Applies what can change while running; returns what was applied and what was not.
    static func apply(_ fresh: WardenConfiguration, to current: inout WardenConfiguration, planner: Planner,
                      targets: TargetReload? = nil) -> (applied: [String], needsRestart: [String])
    {
        var applied: [String] = [], needsRestart: [String] = []
        let level = LogLevelControl.level(configured: fresh.logLevel)
        if level != LogLevelControl.current {
            LogLevelControl.current = level
            applied.append("log level \(level.rawValue)")
        } else if fresh.logLevel != current.logLevel, ProcessInfo.processInfo.environment["WARDEN_LOG_LEVEL"] != nil {
            needsRestart.append("logging.level (WARDEN_LOG_LEVEL in the environment wins over it)")
        }
        current.logLevel = fresh.logLevel
        let old = current.invalidation, new = fresh.invalidation
        let sameTargets = new.targets == old.targets && new.tokenStores == old.tokenStores && new.subjects == old.subjects
            && new.targetFileDigests == old.targetFileDigests
        if fresh.issuers != current.issuers {
            // The new policy and lookups were checked against issuers that run only after a
            // restart: with one issuer fewer, `identity` or `session:{sid}` would pass the check
            // while several issuers still run, and let one act on another's users.
            if !sameTargets || new.policy != old.policy {
                needsRestart.append("targets, token stores, subjects and policy (checked against the new issuers, which need a restart)")
            }
        } else if sameTargets {
            if new.policy != old.policy {
                planner.replace(new.policy)
                current.invalidation = new
                applied.append("policy (events planned from now on)")
            }
        } else if let targets, old.canReloadTargets(as: new) {
            // New connections for what changed; steps under way finish on the old ones, which
            // close once the last of them ends.
            do {
                targets.reloadable.replace(with: try targets.make(new))
                let changed = new.targets.keys.filter { name in
                    old.targets[name] != new.targets[name]
                        || new.targets[name].map(InvalidationConfiguration.certificateFiles(of:))?
                            .contains { new.targetFileDigests[$0] != old.targetFileDigests[$0] } == true
                }.sorted().map { "targets.\($0)" }
                    + new.tokenStores.keys.filter { old.tokenStores[$0] != new.tokenStores[$0] }.sorted().map { "token-stores.\($0)" }
                    + (new.subjects == old.subjects ? [] : ["subjects"])
                applied.append("\(changed.joined(separator: ", ")) (settings and credentials; steps from now on, those under way finish on the old connections)")
                if new.policy != old.policy {
                    planner.replace(new.policy)
                    applied.append("policy (events planned from now on)")
                }
                current.invalidation = new
            } catch {
                needsRestart.append("targets, token stores or subjects: \(error.message)")
            }
        } else if targets == nil {
            needsRestart.append("targets, token stores or subjects (and the policy with them)")
        } else {
            needsRestart.append("targets or token stores added, removed or renamed, or a target's kind changed (and the policy with them)")
        }
        let sections: [(String, Bool)] = [
            ("issuers", fresh.issuers != current.issuers), ("kafka", fresh.kafka != current.kafka),
            ("http", fresh.http != current.http), ("receiver", fresh.receiver != current.receiver),
            ("ledger", fresh.ledger != current.ledger), ("ledger.retention", fresh.ledgerRetention != current.ledgerRetention),
            ("http-client", fresh.outboundCAFile != current.outboundCAFile),
            ("max-token-size", fresh.maximumTokenBytes != current.maximumTokenBytes),
            // A stream's settings and credentials (a rotated bearer-token file) are read at start.
            ("issuers[].stream", fresh.streams.map(\.fingerprint) != current.streams.map(\.fingerprint)),
        ]
        needsRestart += sections.filter(\.1).map(\.0)
        return (applied, needsRestart)
    }
}

/// The level every log handler of `warden run` follows, changed by SIGHUP. `WARDEN_LOG_LEVEL`
/// wins over the file's `logging.level`.
enum LogLevelControl {
    private static let raw = Atomic<Int>(Logger.Level.info.index)

    static var current: Logger.Level {
        get { Logger.Level.allCases[raw.load(ordering: .relaxed)] }
        set { raw.store(newValue.index, ordering: .relaxed) }
    }

    static func level(configured: Logger.Level?, environment: [String: String] = ProcessInfo.processInfo.environment) -> Logger.Level {
        environment["WARDEN_LOG_LEVEL"].flatMap(Logger.Level.init(rawValue:)) ?? configured ?? .info
    }
}

extension Logger.Level {
    fileprivate var index: Int { Logger.Level.allCases.firstIndex(of: self)! }
}

/// A handler whose level is the shared one, unless a logger sets its own.
struct SharedLevelLogHandler: LogHandler {
    var inner: any LogHandler
    private var own: Logger.Level?

    init(_ inner: any LogHandler) { self.inner = inner }

    var logLevel: Logger.Level {
        get { own ?? LogLevelControl.current }
        set { own = newValue }
    }

    var metadata: Logger.Metadata {
        get { inner.metadata }
        set { inner.metadata = newValue }
    }

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { inner[metadataKey: key] }
        set { inner[metadataKey: key] = newValue }
    }

    /// The message and metadata with control characters written `\u{…}`: values may quote what
    /// a token's signer or a transmitter chose (a `jti` holding a line break forges a log line; an
    /// escape sequence drives the terminal the log is read on).
    func log(event: LogEvent) {
        var event = event
        let message = event.message.description
        if hasControlCharacters(message) { event.message = "\(escapingControlCharacters(message))" }
        if let metadata = event.metadata, metadata.values.contains(where: Self.needsEscaping) {
            event.metadata = metadata.mapValues(Self.escaped)
        }
        inner.log(event: event)
    }

    static func needsEscaping(_ value: Logger.Metadata.Value) -> Bool {
        switch value {
        case .string(let s): hasControlCharacters(s)
        case .stringConvertible(let c): hasControlCharacters(c.description)
        case .array(let items): items.contains(where: needsEscaping)
        case .dictionary(let d): d.values.contains(where: needsEscaping)
        }
    }

    static func escaped(_ value: Logger.Metadata.Value) -> Logger.Metadata.Value {
        switch value {
        case .string(let s): .string(escapingControlCharacters(s))
        case .stringConvertible(let c): .string(escapingControlCharacters(c.description))
        case .array(let items): .array(items.map(escaped))
        case .dictionary(let d): .dictionary(d.mapValues(escaped))
        }
    }
}
