public import Foundation
import Synchronization

/// Runs blocking work — waiting for a child process, reading its pipes — on a thread of its
/// own. Swift's cooperative pool has one thread per core (two here); a test that blocked one of
/// them while the program it waits for talks to an in-process server (the key server answers on
/// that pool) could starve the server until the program gives up.
public func onOwnThread<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        Thread { continuation.resume(with: Result { try body() }) }.start()
    }
}

/// What a program printed and how it ended.
public struct ProgramOutput: Sendable {
    public var status: Int32
    /// Standard output as bytes (some programs print binary).
    public var output: Data
    public var stderr: String

    /// Standard output as text.
    public var stdout: String { String(decoding: output, as: UTF8.self) }
}

/// Runs a program to its end, off the cooperative pool, and collects both of its outputs (read
/// at the same time, so a program that fills one pipe while the other is being read never
/// stalls).
public func runToEnd(_ executable: URL, _ arguments: [String], environment: [String: String] = [:],
                     stdin: String? = nil, currentDirectory: URL? = nil) async throws -> ProgramOutput {
    try await onOwnThread {
        let p = Process()
        p.executableURL = executable
        p.arguments = arguments
        p.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 }
        if let currentDirectory { p.currentDirectoryURL = currentDirectory }
        let out = Pipe(), err = Pipe(), input = Pipe()
        p.standardOutput = out
        p.standardError = err
        p.standardInput = input
        try p.run()
        // Both outputs are read on threads of their own while the input is written here, so a
        // program that writes much before it reads its input cannot stall.
        let output = PipeContents(), errors = PipeContents()
        Thread { output.read(out.fileHandleForReading) }.start()
        Thread { errors.read(err.fileHandleForReading) }.start()
        if let stdin { try? input.fileHandleForWriting.write(contentsOf: Data(stdin.utf8)) }
        try? input.fileHandleForWriting.close()
        p.waitUntilExit()
        return ProgramOutput(status: p.terminationStatus, output: output.wait(),
                             stderr: String(decoding: errors.wait(), as: UTF8.self))
    }
}

/// Runs a program to its end and returns its standard output, trimmed; a non-zero exit is an
/// error carrying its standard error.
@discardableResult
public func runProgram(_ program: String, _ arguments: [String], environment: [String: String] = [:]) async throws -> String {
    let result = try await runToEnd(URL(fileURLWithPath: program), arguments, environment: environment)
    guard result.status == 0 else { throw TestServerError("\(program) failed (\(result.status)): \(result.stderr)") }
    return result.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
}

/// One pipe read to its end on another thread.
private final class PipeContents: Sendable {
    private let data = Mutex(Data())
    private let finished = DispatchSemaphore(value: 0)

    func read(_ handle: FileHandle) {
        let read = handle.readDataToEndOfFile()
        data.withLock { $0 = read }
        finished.signal()
    }

    func wait() -> Data {
        finished.wait()
        return data.withLock { $0 }
    }
}

extension ProgramOutput {
    /// Standard output read as one JSON object.
    public var json: [String: Any]? {
        (try? JSONSerialization.jsonObject(with: Data(stdout.utf8))) as? [String: Any]
    }
}

/// Whether `condition` holds within `attempts` looks, 5 ms apart.
public func eventually(attempts: Int = 2000, _ condition: () -> Bool) async -> Bool {
    for _ in 0..<attempts {
        if condition() { return true }
        try? await Task.sleep(for: .milliseconds(5))
    }
    return condition()
}

/// The body at `url` as text, fetched by curl (an independent client) within `timeout` seconds;
/// empty when nothing could be read. Blocks: for benchmarks' and scripts' polling loops.
public func curlText(_ url: String, timeout: Int = 5) -> String {
    let curl = Process()
    curl.executableURL = URL(fileURLWithPath: "/usr/bin/curl")
    curl.arguments = ["-s", "--max-time", String(timeout), url]
    let pipe = Pipe()
    curl.standardOutput = pipe
    guard (try? curl.run()) != nil else { return "" }
    let data = pipe.fileHandleForReading.readDataToEndOfFile()
    curl.waitUntilExit()
    return String(decoding: data, as: UTF8.self)
}
