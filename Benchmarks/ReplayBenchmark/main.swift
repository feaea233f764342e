// Mints what Benchmarks/replay.sh needs: N distinct RS256 SETs, one per line, gzip-compressed,
// the JWKS that verifies them, and a configuration with a SQLite ledger. Arguments: DIR [N].
// The files are kept in DIR and reused when they are there for the same N (minting a million
// RS256 signatures takes minutes; the replay takes seconds).
import Foundation
import Ledger
import SETMinting

let arguments = CommandLine.arguments
guard arguments.count > 1 else {
    FileHandle.standardError.write(Data("usage: ReplayBenchmark DIR [N]\n".utf8))
    exit(2)
}
let directory = URL(fileURLWithPath: arguments[1])
let count = arguments.count > 2 ? Int(arguments[2]) ?? 1_000_000 : 1_000_000
let issuer = "https://accounts.google.com/"
let audience = "1234-abc.apps.googleusercontent.com"
let logFile = directory.appendingPathComponent("replay-\(count).log")
let gzFile = directory.appendingPathComponent("replay-\(count).log.gz")
let jwksFile = directory.appendingPathComponent("replay-jwks-\(count).json")
try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)

if FileManager.default.fileExists(atPath: gzFile.path), FileManager.default.fileExists(atPath: jwksFile.path) {
    print("reusing \(gzFile.path)")
} else {
    let key = try SigningKey.rsa(keyID: "replay-bench", algorithm: "RS256", bits: 2048)
    let started = Date()
    // Written in slices, so memory stays small however many are minted.
    _ = FileManager.default.createFile(atPath: logFile.path, contents: nil)
    let output = try FileHandle(forWritingTo: logFile)
    let slice = 20_000
    final class Lines: @unchecked Sendable {
        // `@unchecked Sendable`: each index is written by exactly one concurrentPerform iteration.
        var values: [String]
        init(_ n: Int) { values = [String](repeating: "", count: n) }
    }
    for start in stride(from: 0, to: count, by: slice) {
        let n = min(slice, count - start)
        let lines = Lines(n)
        DispatchQueue.concurrentPerform(iterations: 2) { worker in
            for i in stride(from: worker, to: n, by: 2) {
                let claims = SETMinter.riscClaims(issuer: issuer, audience: audience, event: .sessionsRevoked,
                                                  subject: "user-\((start + i) % 50_000)", jti: "replay-\(start + i)")
                lines.values[i] = try! SETMinter.token(claims: claims, key: key)
            }
        }
        try output.write(contentsOf: Data((lines.values.joined(separator: "\n") + "\n").utf8))
        if start / slice % 10 == 9 { print("minted \(start + n) of \(count)") }
    }
    try output.close()
    let gzip = Process()
    gzip.executableURL = URL(fileURLWithPath: "/usr/bin/gzip")
    gzip.arguments = ["-f", "-1", logFile.path]
    try gzip.run()
    gzip.waitUntilExit()
    try SETMinter.jwks([key]).write(to: jwksFile, atomically: true, encoding: .utf8)
    print("minted \(count) RS256 SETs in \(String(format: "%.0f", Date().timeIntervalSince(started))) s")
}

let config = """
issuers:
  - issuer: \(issuer)
    jwks-file: \(jwksFile.path)
    audiences: [\(audience)]
    algorithms: [RS256]
    max-age: 3650d
ledger: sqlite:\(directory.appendingPathComponent("replay-ledger.sqlite").path)

"""
try config.write(to: directory.appendingPathComponent("replay.yaml"), atomically: true, encoding: .utf8)
let ledger = try SQLiteLedger(path: directory.appendingPathComponent("replay-ledger.sqlite").path)
await ledger.close()
print("log: \(gzFile.path)")
