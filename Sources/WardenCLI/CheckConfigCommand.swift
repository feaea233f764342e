public import ArgumentParser
import Foundation
import Invalidation
import TokenVerification

extension WardenCommand {
    /// `warden check-config`: validates a configuration and prints what would run.
    public struct CheckConfig: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            commandName: "check-config",
            abstract: "Validates a configuration and prints what would run, with the plan for each event type.",
            discussion: "Exit status: 0 valid, 2 the configuration has an error (the message names the key)."
        )

        @Option(name: .long, help: ArgumentHelp("The configuration file (YAML); default: WARDEN_CONFIG.", valueName: "file"))
        var config: String = WardenConfiguration.environmentConfigPath

        public init() {}

        public func run() async throws {
            let configuration = try WardenConfiguration.load(path: config)
            try configuration.kafka?.checkClients(pushing: configuration.isPushing)
            print(Self.report(configuration, path: config))
        }

        static func report(_ c: WardenConfiguration, path: String) -> String {
            var lines = ["configuration \(path): valid", "", "issuers:"]
            for issuer in c.issuers {
                lines.append("  \(issuer.issuer) (profile \(issuer.profile), audiences \(issuer.audiences.joined(separator: ", ")), "
                    + "algorithms \(issuer.algorithms.map(\.rawValue).sorted().joined(separator: ", ")))")
            }
            if let kafka = c.kafka {
                lines.append("kafka: \(kafka.isEmbedded ? "embedded mock cluster" : kafka.brokers), topic \(kafka.topic), "
                    + "group \(kafka.group), dead letters \(kafka.deadLetterTopic)")
            } else {
                lines.append("kafka: not configured (warden run needs it)")
            }
            switch c.ledger {
            case .sqlite(let path)?: lines.append("ledger: sqlite \(path)")
            case .postgres(let location)?: lines.append("ledger: \(location)")
            case nil: lines.append("ledger: not configured (warden run needs it)")
            }
            lines.append("http: \(c.http.host):\(c.http.port) (/healthz, /readyz, /metrics)")
            let inv = c.invalidation
            lines.append("targets:" + (inv.targets.isEmpty ? " none" : ""))
            for (name, target) in inv.targets.sorted(by: { $0.key < $1.key }) { lines.append("  \(name): \(target.summary)") }
            lines.append("token stores:" + (inv.tokenStores.isEmpty ? " none" : ""))
            for (name, store) in inv.tokenStores.sorted(by: { $0.key < $1.key }) {
                lines.append("  \(name): hash \(store.hash) on \(store.redisTarget)"
                    + (store.index.map { ", index \($0)" } ?? ", no index (token-revoked scans the store's hashes)"))
            }
            switch inv.subjects {
            case .identity: lines.append("subjects: identity (the provider's sub is the local user id)")
            case .redis(let target, let key): lines.append("subjects: redis key \(key) on \(target)")
            case .sql(let target, let query, let parameters):
                lines.append("subjects: sql on \(target): \(query) [\(parameters.joined(separator: ", "))]")
            }
            lines.append("")
            lines.append("policy (event type → steps, in order):")
            lines.append(inv.planDescription)
            if !inv.leftOut.isEmpty {
                lines.append("")
                lines.append("built-in steps left out (their target or token store is not configured):")
                for (type, rule) in inv.leftOut {
                    let needs = rule.action.targets.map { "target \"\($0)\"" } + (rule.action.store.map { ["token store \"\($0)\""] } ?? [])
                    lines.append("  \(InvalidationConfiguration.shortName(type)): \(InvalidationConfiguration.describe(rule.action))"
                        + "  — needs \(needs.joined(separator: " and "))")
                }
            }
            return lines.joined(separator: "\n")
        }
    }
}
