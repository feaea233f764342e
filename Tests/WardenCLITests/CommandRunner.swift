import Foundation
import WardenTestSupport

/// Runs the built `warden` executable as a user would.
enum Warden {
    static let packageRoot = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent()

    static var executable: URL {
        let besideTests = URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent().appendingPathComponent("warden")
        if FileManager.default.isExecutableFile(atPath: besideTests.path) { return besideTests }
        return packageRoot.appendingPathComponent(".build/debug/warden")
    }

    /// Runs `warden` to its end (off the cooperative pool: see `onOwnThread`).
    static func run(_ arguments: [String], stdin: String? = nil, environment: [String: String] = [:],
                    currentDirectory: URL? = nil) async throws -> ProgramOutput {
        try await runToEnd(executable, arguments, environment: environment, stdin: stdin, currentDirectory: currentDirectory)
    }

    /// A scratch folder, removed when the test process exits.
    static func temporaryDirectory() throws -> URL {
        try Scratch.directory("test")
    }
}
