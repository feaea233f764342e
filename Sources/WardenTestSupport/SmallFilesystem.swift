import Foundation

/// A tmpfs of a few megabytes mounted on a scratch folder, to fill up: a real full disk under a
/// file Warden writes. Mounting needs the privilege to (root, as on the CI machine); tests that
/// need one are enabled only where `canMount` holds.
public final class SmallFilesystem {
    public let path: String
    private var filler: String { path + "/filler" }

    public static let canMount: Bool = {
        guard let probe = try? SmallFilesystem(megabytes: 1) else { return false }
        probe.unmount()
        return true
    }()

    public init(megabytes: Int) throws {
        path = try Scratch.directory("tmpfs").path
        let result = try Self.run("/bin/mount", ["-t", "tmpfs", "-o", "size=\(megabytes)m", "tmpfs", path])
        guard result == 0 else { throw TestServerError("cannot mount a tmpfs on \(path)") }
    }

    /// Takes every free byte with a file of zeros.
    public func fill() {
        guard let handle = FileHandle(forWritingAtPath: filler) ?? {
            _ = FileManager.default.createFile(atPath: filler, contents: nil)
            return FileHandle(forWritingAtPath: filler)
        }() else { return }
        let block = Data(count: 64 * 1024)
        while (try? handle.write(contentsOf: block)) != nil {}
        let small = Data(count: 512)
        while (try? handle.write(contentsOf: small)) != nil {}
        try? handle.close()
    }

    /// Gives the space back.
    public func free() { try? FileManager.default.removeItem(atPath: filler) }

    public func unmount() { _ = try? Self.run("/bin/umount", ["-l", path]) }

    private static func run(_ program: String, _ arguments: [String]) throws -> Int32 {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: program)
        process.arguments = arguments
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        process.waitUntilExit()
        return process.terminationStatus
    }
}
