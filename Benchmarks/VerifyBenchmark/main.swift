// Verified RS256 SETs per second on one core, beside `openssl speed rsa2048`'s verify/s on the
// same machine. Build and run: `make bench` (release build, pinned to one CPU).
import Foundation
import Logging
import SETMinting
import SecurityEvents
import TokenVerification

struct NoFetch: KeyDocumentFetching {
    func fetch(_ url: URL, timeout: Double, maximumBytes: Int) async throws -> FetchedDocument {
        throw KeyFetchError("the benchmark uses pinned keys")
    }
}

func opensslVerifyPerSecond(seconds: Int) -> Double? {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
    process.arguments = ["openssl", "speed", "-seconds", String(seconds), "rsa2048"]
    let pipe = Pipe()
    process.standardOutput = pipe
    process.standardError = FileHandle.nullDevice
    do { try process.run() } catch { return nil }
    let data = pipe.fileHandleForReading.readDataToEndOfFile()
    process.waitUntilExit()
    let text = String(decoding: data, as: UTF8.self)
    // "rsa 2048 bits 0.000359s 0.000020s   2788.3  50604.7": verify/s is the last column.
    guard let line = text.split(separator: "\n").last(where: { $0.hasPrefix("rsa 2048 bits") }),
          let last = line.split(separator: " ").last else { return nil }
    return Double(last)
}

let arguments = CommandLine.arguments
let seconds = arguments.count > 1 ? Double(arguments[1]) ?? 5 : 5

let issuer = "https://accounts.google.com/"
let audience = "1234-abc.apps.googleusercontent.com"
let key = try SigningKey.rsa(keyID: "bench-key", algorithm: "RS256", bits: 2048)
let jwks = SETMinter.jwks([key])
var logger = Logger(label: "bench")
logger.logLevel = .critical
let policy = IssuerPolicy(issuer: issuer, keySource: .pinned(document: Array(jwks.utf8), origin: "bench"),
                          audiences: [audience], algorithms: [.rs256], profile: .risc)
let cache = IssuerKeyCache(issuer: issuer, source: policy.keySource, settings: policy.keyCache, fetcher: NoFetch(),
                           logger: logger)
let verifier = SETVerifier(issuers: [.init(policy: policy, keys: cache)])

// Google-shaped tokens, each with its own jti and subject.
let events: [EventType] = [.sessionsRevoked, .accountDisabled, .tokensRevoked, .accountCredentialChangeRequired]
var tokens: [[UInt8]] = []
for i in 0..<1000 {
    let extra: JSONObject = events[i % 4] == .accountDisabled ? ["reason": "hijacking"] : [:]
    let claims = SETMinter.riscClaims(issuer: issuer, audience: audience, event: events[i % 4],
                                      subject: String(100_000_000_000 + i), extra: extra)
    tokens.append(Array(try SETMinter.token(claims: claims, key: key).utf8))
}
print("token size: \(tokens[0].count) bytes (RS256, 2048-bit key, Google RISC shape)")

func measure(_ label: String, seconds: Double, _ body: (Int) async -> Bool) async -> Double {
    // Warm-up
    for i in 0..<200 { _ = await body(i) }
    let clock = ContinuousClock()
    let start = clock.now
    var count = 0
    let limit = Duration.milliseconds(Int64(seconds * 1000))
    while clock.now - start < limit {
        for _ in 0..<200 {
            guard await body(count) else { fatalError("\(label): verification failed at \(count)") }
            count += 1
        }
    }
    let elapsed = clock.now - start
    let rate = Double(count) / (Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18)
    return rate
}

let fullRate = await measure("verify", seconds: seconds) { i in
    if case .success = await verifier.verify(tokens[i % tokens.count]) { return true }
    return false
}

// The signature check alone, through the same OpenSSL path, for the breakdown.
let usable = cache.currentSnapshot()!.keys.usableKeys[0]
let token0 = tokens[0]
let dot = token0.lastIndex(of: UInt8(ascii: "."))!
let signingInput = Array(token0[..<dot])
let signature = Base64URL.decode(Array(token0[(dot + 1)...]))!
let signatureRate = await measure("signature", seconds: seconds) { _ in
    signature.withUnsafeBytes { sig in signingInput.withUnsafeBytes { usable.isValidSignature(sig, for: $0, algorithm: .rs256) } }
}

let reference = opensslVerifyPerSecond(seconds: Int(max(seconds, 1)))
func format(_ x: Double) -> String { String(format: "%.0f", x) }
print("warden verify (parse + header + key + RS256 + claims): \(format(fullRate)) SETs/s on one core")
print("warden signature check only (OpenSSL via CWardenCrypto): \(format(signatureRate)) /s")
if let reference {
    print("openssl speed rsa2048 verify:                           \(format(reference)) /s")
    print(String(format: "ratio warden verify / openssl: %.2f (target ≥ 0.85)", fullRate / reference))
} else {
    print("openssl speed could not be run; no reference figure")
}
