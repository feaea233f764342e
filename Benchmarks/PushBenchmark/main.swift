// Mints what Benchmarks/push.sh needs to load the push receiver with wrk: N RS256 SETs (one per
// line, each with its own jti), the JWKS that verifies them, and a configuration whose only door
// is the receiver (into a SQLite ledger, the rate limit off). Arguments: DIR [N].
// The files are kept in DIR and reused when they are there for the same N (minting takes longer
// than the runs).
import Foundation
import SETMinting

let arguments = CommandLine.arguments
guard arguments.count > 1 else {
    FileHandle.standardError.write(Data("usage: PushBenchmark DIR [N]\n".utf8))
    exit(2)
}
let directory = URL(fileURLWithPath: arguments[1])
let count = arguments.count > 2 ? Int(arguments[2]) ?? 80_000 : 80_000
let issuer = "https://accounts.google.com/"
let audience = "1234-abc.apps.googleusercontent.com"
let tokensFile = directory.appendingPathComponent("tokens-\(count).txt")
let jwksFile = directory.appendingPathComponent("jwks-\(count).json")
try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)

if let existing = try? String(contentsOf: tokensFile, encoding: .utf8), existing.split(separator: "\n").count == count,
   FileManager.default.fileExists(atPath: jwksFile.path) {
    print("reusing \(count) RS256 SETs in \(tokensFile.path)")
} else {
    final class Lines: @unchecked Sendable {
        // `@unchecked Sendable`: each index is written by exactly one concurrentPerform iteration.
        var values: [String]
        init(_ n: Int) { values = [String](repeating: "", count: n) }
    }
    let key = try SigningKey.rsa(keyID: "push-bench", algorithm: "RS256", bits: 2048)
    let lines = Lines(count)
    let started = Date()
    DispatchQueue.concurrentPerform(iterations: 2) { worker in
        for i in stride(from: worker, to: count, by: 2) {
            let claims = SETMinter.riscClaims(issuer: issuer, audience: audience, event: .sessionsRevoked, subject: "user-\(i % 5000)",
                                              jti: "push-\(i)-\(UUID().uuidString.prefix(8))")
            lines.values[i] = try! SETMinter.token(claims: claims, key: key)
        }
    }
    try (lines.values.joined(separator: "\n") + "\n").write(to: tokensFile, atomically: true, encoding: .utf8)
    try SETMinter.jwks([key]).write(to: jwksFile, atomically: true, encoding: .utf8)
    print("minted \(count) RS256 SETs in \(String(format: "%.0f", Date().timeIntervalSince(started))) s")
}

let config = """
issuers:
  - issuer: \(issuer)
    jwks-file: \(jwksFile.path)
    audiences: [\(audience)]
    algorithms: [RS256]
receiver:
  listen: 127.0.0.1:0
  rate-limit: off
http:
  listen: 127.0.0.1:0
ledger: sqlite:ledger.sqlite

"""
try config.write(to: directory.appendingPathComponent("push.yaml"), atomically: true, encoding: .utf8)
print("tokens: \(tokensFile.path)")
