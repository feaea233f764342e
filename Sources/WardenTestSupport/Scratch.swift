public import Foundation

/// Where tests and benchmarks keep their files: one folder per process, removed when the process
/// exits. Servers and ledgers held by globals or statics are never deinitialised, so removing
/// each folder when its owner goes away left hundreds behind in the system's temporary folder.
public enum Scratch {
    /// This process's folder, made on first use; its removal is registered with `atexit`.
    public static let root: URL = {
        let root = FileManager.default.temporaryDirectory
            .appendingPathComponent("warden-scratch-\(ProcessInfo.processInfo.processIdentifier)-\(UUID().uuidString.prefix(8))")
        try? FileManager.default.createDirectory(at: root, withIntermediateDirectories: true)
        atexit { Scratch.removeRoot() }
        return root
    }()

    /// A new, empty folder named after `prefix`.
    public static func directory(_ prefix: String) throws -> URL {
        let url = root.appendingPathComponent("\(prefix)-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
        return url
    }

    /// A path for a file named after `prefix` that does not exist yet (its folder does).
    public static func path(_ prefix: String, extension suffix: String) -> String {
        root.appendingPathComponent("\(prefix)-\(UUID().uuidString).\(suffix)").path
    }

    private static func removeRoot() {
        try? FileManager.default.removeItem(at: root)
    }
}
