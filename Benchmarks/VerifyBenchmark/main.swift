// Verified RS256 SETs per second on one core, beside `openssl speed rsa2048`'s verify/s on the
// same machine. Build and run: `make bench` (release build, pinned to one CPU).
// Arguments: [seconds per measurement] [openssl verify/s reference].
import CBenchReference
import Foundation
import Logging
import SETMinting
import SecurityEvents
import TokenVerification

let arguments = CommandLine.arguments
let seconds = arguments.count > 1 ? Double(arguments[1]) ?? 5 : 5
// `openssl speed rsa2048`'s verify/s on this machine, measured by `make bench` just before.
let referenceArgument = arguments.count > 2 ? Double(arguments[2]) : nil

let issuer = "https://accounts.google.com/"
let audience = "1234-abc.apps.googleusercontent.com"
let key = try SigningKey.rsa(keyID: "bench-key", algorithm: "RS256", bits: 2048)
let jwks = SETMinter.jwks([key])
var logger = Logger(label: "bench")
logger.logLevel = .critical
let policy = IssuerPolicy(issuer: issuer, keySource: .pinned(document: Array(jwks.utf8), origin: "bench"),
                          audiences: [audience], algorithms: [.rs256], profile: .risc)
let cache = IssuerKeyCache(issuer: issuer, source: policy.keySource, settings: policy.keyCache, fetcher: OfflineKeyFetcher(reason: "the benchmark uses pinned keys"),
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

let allTokens = tokens
let usable = cache.currentSnapshot()!.keys.usableKeys[0]
let token0 = tokens[0]
let dot = token0.lastIndex(of: UInt8(ascii: "."))!
let signingInput = Array(token0[..<dot])
let signature = Base64URL.decode(Array(token0[(dot + 1)...]))!

/// `openssl speed rsa2048`'s verify operation, in-process.
///
/// `@unchecked Sendable`: the OpenSSL context is used by one measuring task at a time.
struct Reference: @unchecked Sendable {
    let pointer: OpaquePointer
}
guard let referencePointer = bench_reference_new() else { fatalError("OpenSSL could not make the reference key") }
let reference = Reference(pointer: referencePointer)

/// Runs `body` for about `seconds`; returns (calls, seconds taken). Nonisolated, so the loop
/// and the verifier run on the same executor without hopping threads per call.
nonisolated func slice(seconds: Double, _ body: @Sendable (Int) async -> Bool) async -> (Int, Double) {
    let clock = ContinuousClock()
    let start = clock.now
    var count = 0
    let limit = Duration.milliseconds(Int64(seconds * 1000))
    while clock.now - start < limit {
        for _ in 0..<20 {
            guard await body(count) else { fatalError("verification failed at \(count)") }
            count += 1
        }
    }
    let elapsed = clock.now - start
    return (count, Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18)
}

/// Calls per second of `body` over about `seconds`, after a short warm-up.
nonisolated func measure(seconds: Double, _ body: @Sendable (Int) async -> Bool) async -> Double {
    _ = await slice(seconds: 0.05, body)
    let (count, elapsed) = await slice(seconds: seconds, body)
    return Double(count) / elapsed
}

// This machine's speed drifts from one second to the next, so the three measurements are
// interleaved in 30 ms slices and each rate is its total calls over its total time.
let verifyWhole: @Sendable (Int) async -> Bool = { i in
    if case .success = await verifier.verify(allTokens[i % allTokens.count]) { return true }
    return false
}
let signatureOnly: @Sendable (Int) async -> Bool = { _ in
    signature.withUnsafeBytes { sig in signingInput.withUnsafeBytes { usable.isValidSignature(sig, for: $0, algorithm: .rs256) } }
}
let opensslOperation: @Sendable (Int) async -> Bool = { _ in bench_reference_verify(reference.pointer) == 1 }
if let profileSeconds = ProcessInfo.processInfo.environment["BENCH_PROFILE_VERIFY"].flatMap(Double.init) {
    _ = await slice(seconds: profileSeconds, verifyWhole)  // only the whole verification, for a profiler
    exit(0)
}
for body in [verifyWhole, signatureOnly, opensslOperation] { _ = await slice(seconds: 0.2, body) }  // warm-up
var totals = [(0, 0.0), (0, 0.0), (0, 0.0)]
let slices = max(1, Int(seconds / 0.09))
for _ in 0..<slices {
    for (k, body) in [verifyWhole, signatureOnly, opensslOperation].enumerated() {
        let (n, t) = await slice(seconds: 0.03, body)
        totals[k].0 += n
        totals[k].1 += t
    }
}
let fullRate = Double(totals[0].0) / totals[0].1
let signatureRate = Double(totals[1].0) / totals[1].1
let inProcessReference = Double(totals[2].0) / totals[2].1

// Breakdown of the parsing side, on the first token's parts.
let parts = token0.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false).map { Array($0) }
let payloadJSON = Base64URL.decode(parts[1])!
let decodeRate = await measure(seconds: 0.5) { @Sendable _ in
    Base64URL.decode(parts[0]) != nil && Base64URL.decode(parts[1]) != nil && Base64URL.decode(parts[2]) != nil
}
let jsonRate = await measure(seconds: 0.5) { @Sendable _ in (try? JSONParser.parse(payloadJSON)) != nil }
let claimsObject = try JSONParser.parse(payloadJSON).objectValue!
let envelopeRate = await measure(seconds: 0.5) { @Sendable _ in (try? SecurityEventToken.parse(claims: claimsObject)) != nil }

func format(_ x: Double) -> String { String(format: "%.0f", x) }
func micros(_ rate: Double) -> String { String(format: "%.1f µs", 1e6 / rate) }
print("warden verify (parse, header, key, RS256, claims): \(format(fullRate)) SETs/s on one core (\(micros(fullRate)) each)")
print("  of which the signature check (SHA-256 + RSA on \(usable.usesIFMA ? "AVX-512 IFMA" : "libcrypto")): \(format(signatureRate)) /s (\(micros(signatureRate)))")
print("  the rest: \(String(format: "%.1f µs", 1e6 / fullRate - 1e6 / signatureRate)); base64url of 3 parts \(micros(decodeRate)), JSON claims \(micros(jsonRate)), SET envelope \(micros(envelopeRate))")
print("openssl speed rsa2048's verify operation, in-process, interleaved: \(format(inProcessReference)) /s")
print(String(format: "ratio warden verify / openssl operation (interleaved): %.2f (target ≥ 0.85)", fullRate / inProcessReference))
if let figure = referenceArgument {
    print("openssl speed rsa2048 verify, run just before: \(format(figure)) /s (ratio %.2f)".replacingOccurrences(of: "%.2f", with: String(format: "%.2f", fullRate / figure)))
}
