public import ArgumentParser
import AsyncHTTPClient
import Foundation
import Logging
import SecurityEvents
import TokenVerification

/// The `warden` command line.
public struct WardenCommand: AsyncParsableCommand {
    public static let configuration = CommandConfiguration(
        commandName: "warden",
        abstract: "Verifies Security Event Tokens and acts on them.",
        version: WardenVersion.current,
        subcommands: [Run.self, Verify.self, CheckConfig.self, Stream.self, DevKeys.self, Emit.self, Audit.self, Replay.self]
    )

    public init() {}

    /// Runs the command line and exits with Warden's exit codes: 0 success, 1 invalid token,
    /// 2 usage or configuration error, 3 keys unavailable.
    public static func runMain(arguments: [String]? = nil) async -> Never {
        do {
            var command = try parseAsRoot(arguments)
            if var asyncCommand = command as? any AsyncParsableCommand {
                try await asyncCommand.run()
            } else {
                try command.run()
            }
            Foundation.exit(0)
        } catch let code as ExitCode {
            Foundation.exit(code.rawValue)
        } catch {
            let exitCode = Self.exitCode(for: error)
            if exitCode.rawValue == 0 {
                // --help, --version
                print(fullMessage(for: error))
                Foundation.exit(0)
            }
            standardError(fullMessage(for: error) + "\n")
            if exitCode == .validationFailure || error is ConfigError { Foundation.exit(2) }
            Foundation.exit(exitCode.rawValue == 1 ? 2 : exitCode.rawValue)
        }
    }
}

/// Exit codes of `warden verify`.
public enum VerifyExit: Int32 {
    case valid = 0, invalid = 1, usage = 2, keysUnavailable = 3
}

extension WardenCommand {
    public struct Verify: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            abstract: "Verifies one SET and prints one JSON object.",
            discussion: """
            Exit status: 0 valid, 1 invalid (the object names the RFC 8935 error code), \
            2 usage or configuration error, 3 the issuer's keys are unavailable (retry later).
            """
        )

        @Option(name: .long, help: ArgumentHelp("The configuration file (YAML); default: WARDEN_CONFIG.", valueName: "file"))
        var config: String = WardenConfiguration.environmentConfigPath

        @Argument(help: "The compact SET, a file holding it, or - to read it from standard input.")
        var token: String = "-"

        public init() {}

        public func run() async throws {
            let configuration: WardenConfiguration
            do {
                configuration = try WardenConfiguration.load(path: config)
            } catch {
                standardError("warden: \(error)\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            let raw: [UInt8]
            if token == "-" {
                let input = FileHandle.standardInput.readDataToEndOfFile()
                raw = Array(trimmedASCIIWhitespace(Array(input)))
            } else if let contents = Self.regularFileContents(token) {
                raw = Array(trimmedASCIIWhitespace(Array(contents)))
            } else {
                raw = Array(trimmedASCIIWhitespace(Array(token.utf8)))
            }
            var logger = Logger(label: "warden")
            logger.logLevel = ProcessInfo.processInfo.environment["WARDEN_LOG_LEVEL"].flatMap(Logger.Level.init(rawValue:)) ?? .critical
            let client = configuration.makeHTTPClient()
            let verifier = configuration.makeVerifier(client: client, logger: logger)
            let result = await verifier.verify(raw)
            try? await client.shutdown()
            print(VerificationReport.json(result).jsonText)
            switch result {
            case .success: return
            case .failure(let error) where error.isRetryable: throw ExitCode(VerifyExit.keysUnavailable.rawValue)
            case .failure: throw ExitCode(VerifyExit.invalid.rawValue)
            }
        }

        /// The contents of `path` if it names a regular file (a compact JWS never does).
        static func regularFileContents(_ path: String) -> Data? {
            var isDirectory: ObjCBool = false
            guard FileManager.default.fileExists(atPath: path, isDirectory: &isDirectory), !isDirectory.boolValue else {
                return nil
            }
            return FileManager.default.contents(atPath: path)
        }

    }
}

/// Writes text for a person to standard error, each control character but newline and tab
/// written `\u{…}`: an error may quote what a transmitter, a log line or a token chose, and
/// must not drive the terminal (escape sequences that retitle it, write the clipboard, hide text).
func standardError(_ text: String) {
    FileHandle.standardError.write(Data(escapingControlCharacters(text, keeping: ["\n", "\t"]).utf8))
}
