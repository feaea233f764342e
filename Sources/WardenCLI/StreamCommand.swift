public import ArgumentParser
import AsyncHTTPClient
import HTTPExchange
import Foundation
import Ledger
import Logging
import SecurityEvents
import StreamManagement
import TokenVerification

extension WardenCommand {
    /// `warden stream …`: the issuer's stream at its transmitter.
    public struct Stream: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            abstract: "Manages an issuer's stream at its transmitter (Google's RISC API, or SSF 1.0 stream management).",
            discussion: """
            Actions: create, update (register the configured delivery and events), get, status (print JSON), \
            enable, disable, delete (SSF only), verify (ask for a verification event and wait until a running \
            warden run on the same ledger has recorded it). \
            Exit status: 0 done, 1 the transmitter refused or did not answer (the call and the status are named), \
            or the verification event did not arrive in time, 2 usage or configuration error.
            """
        )

        enum Action: String, ExpressibleByArgument, CaseIterable {
            case create, delete, status, get, update, enable, disable, verify
        }

        @Argument(help: "create, delete, status, get, update, enable, disable or verify.")
        var action: Action

        @Option(name: .long, help: ArgumentHelp("The configuration file (YAML); default: WARDEN_CONFIG.", valueName: "file"))
        var config: String = WardenConfiguration.environmentConfigPath

        @Option(name: .long, help: "The issuer whose stream to manage (needed only when several issuers have a stream: section).")
        var issuer: String?

        @Option(name: .long, help: "Seconds for each call to the transmitter, and for verify, to wait for the event (default 30).")
        var timeout: Double = 30

        public init() {}

        public func validate() throws {
            // Bounded: a figure of years is a mistake, and one past 2^63 ms would trap.
            guard timeout > 0, timeout <= 86_400 else { throw ValidationError("--timeout must be more than 0 and at most 86400 seconds") }
        }

        public func run() async throws {
            let configuration: WardenConfiguration
            let stream: StreamConfiguration
            do {
                configuration = try WardenConfiguration.load(path: config)
                stream = try Self.chosenStream(configuration, issuer: issuer)
                if action == .verify || stream.settings.api == .ssf, configuration.ledger == nil {
                    throw ConfigError(path: "ledger", "is required by warden stream \(action.rawValue) (\(action == .verify ? "the verification event is found there" : "the stream id is kept there"))")
                }
            } catch {
                standardError("warden: \(error)\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            var logger = Logger(label: "warden")
            logger.logLevel = ProcessInfo.processInfo.environment["WARDEN_LOG_LEVEL"].flatMap(Logger.Level.init(rawValue:)) ?? .error
            let client = configuration.makeHTTPClient()
            var opened: OpenedLedger? = nil
            do {
                if let location = configuration.ledger { opened = try await OpenedLedger(location, logger: logger) }
            } catch {
                try? await client.shutdown()
                standardError("warden: cannot open the ledger: \(error)\n")
                throw ExitCode(1)
            }
            let status = await perform(stream, client: client, ledger: opened?.ledger)
            await opened?.close()
            try? await client.shutdown()
            if status != 0 { throw ExitCode(status) }
        }

        /// Runs the action; its exit status.
        private func perform(_ stream: StreamConfiguration, client: any HTTPExchanging, ledger: (any Ledger)?) async -> Int32 {
            let manager = Self.manager(stream, client: client, ledger: ledger, timeout: timeout)
            do {
                switch action {
                case .create: print(try await manager.create().jsonText)
                case .update: print(try await manager.update().jsonText)
                case .get: print(try await manager.get().jsonText)
                case .status: print(try await manager.status().jsonText)
                case .enable: print(try await manager.setStatus(enabled: true).jsonText)
                case .disable: print(try await manager.setStatus(enabled: false).jsonText)
                case .delete:
                    try await manager.delete()
                    print("{\"deleted\":true}")
                case .verify:
                    return try await verify(manager, issuer: stream.issuer, ledger: ledger!)
                }
                return 0
            } catch {
                standardError("warden: \(error)\n")
                return error.kind == .configuration && action == .delete ? VerifyExit.usage.rawValue : 1
            }
        }

        /// Asks for a verification event with a fresh random state, recorded first in the ledger
        /// (so the receiver takes it), and waits until the receiver has recorded its arrival.
        private func verify(_ manager: any StreamManager, issuer: String, ledger: any Ledger) async throws(StreamError) -> Int32 {
            let state = Self.randomState()
            let askedAt = Date().timeIntervalSince1970
            do {
                try await ledger.requestVerification(issuer: issuer, state: state, at: askedAt)
            } catch {
                throw StreamError(.unavailable, "cannot record the verification's state in the ledger: \(error)")
            }
            let started = ContinuousClock.now
            try await manager.verify(state: state)
            let deadline = started + .milliseconds(Int(timeout * 1000))
            while ContinuousClock.now < deadline {
                if let arrived = try? await ledger.verificationArrival(issuer: issuer, state: state) {
                    let roundTrip = started.duration(to: .now)
                    let milliseconds = Double(roundTrip.components.seconds) * 1000 + Double(roundTrip.components.attoseconds) / 1e15
                    print("{\"verified\":true,\"issuer\":\(JSONValue.string(issuer).jsonText),\"round_trip_ms\":\(Int(milliseconds.rounded())),\"arrived_at\":\(arrived)}")
                    return 0
                }
                try? await Task.sleep(for: .milliseconds(100))
            }
            FileHandle.standardError.write(Data("""
                warden: the verification event did not arrive within \(Int(timeout)) s: is warden run receiving this stream \
                (push to the configured endpoint-url, or polling it) on the same ledger?\n
                """.utf8))
            return 1
        }

        /// 128 random bits, base64url.
        static func randomState() -> String {
            var generator = SystemRandomNumberGenerator()
            return Base64URL.encode((0..<16).map { _ in UInt8.random(in: .min ... .max, using: &generator) })
        }

        static func chosenStream(_ configuration: WardenConfiguration, issuer: String?) throws(ConfigError) -> StreamConfiguration {
            if let issuer {
                guard let stream = configuration.streams.first(where: { $0.issuer == issuer }) else {
                    throw ConfigError(path: "issuers", "no issuer \(issuer) with a stream: section (those with one: \(configuration.streams.map(\.issuer).joined(separator: ", ")))")
                }
                return stream
            }
            switch configuration.streams.count {
            case 0: throw ConfigError(path: "issuers", "no issuer has a stream: section")
            case 1: return configuration.streams[0]
            default:
                throw ConfigError(path: "issuers", "several issuers have a stream: section; choose one with --issuer (\(configuration.streams.map(\.issuer).joined(separator: ", ")))")
            }
        }

        static func manager(_ stream: StreamConfiguration, client: any HTTPExchanging, ledger: (any Ledger)?, timeout: Double) -> any StreamManager {
            let credentials = stream.makeCredentials(http: client)
            switch stream.settings.api {
            case .google:
                return GoogleRISCStream(settings: stream.settings, credentials: credentials, http: client, timeout: timeout)
            case .ssf:
                let issuer = stream.issuer
                return SSFStream(
                    settings: stream.settings, credentials: credentials, http: client, timeout: timeout,
                    storedStreamID: { () async throws(StreamError) -> String? in
                        do { return try await ledger?.streamID(issuer: issuer) } catch { throw StreamError(.unavailable, "cannot read the stream id from the ledger: \(error)") }
                    },
                    keepStreamID: { (id: String?) async throws(StreamError) in
                        do { try await ledger?.keepStreamID(id, issuer: issuer) } catch { throw StreamError(.unavailable, "cannot keep the stream id in the ledger: \(error)") }
                    },
                    allowsHTTP: { URLRule.isLoopback($0.host) })
            }
        }
    }
}

/// A ledger opened for one command: SQLite, or PostgreSQL with its pool running until closed.
struct OpenedLedger {
    let ledger: any AuditingLedger
    private let pool: Task<Void, Never>?

    init(_ location: LedgerLocation, logger: Logger) async throws {
        switch location {
        case .sqlite(let path):
            ledger = try SQLiteLedger(path: path)
            pool = nil
        case .postgres(let location):
            let postgres = PostgresLedger(location, logger: logger)
            let pool = Task { await postgres.run() }
            do {
                try await postgres.open()
            } catch {
                pool.cancel()
                await pool.value
                throw error
            }
            ledger = postgres
            self.pool = pool
        }
    }

    func close() async {
        await ledger.close()
        pool?.cancel()
        await pool?.value
    }
}
