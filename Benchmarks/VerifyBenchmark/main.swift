// Verified RS256 SETs per second on one core, beside `openssl speed rsa2048`'s verify/s on the
// same machine. Build and run: `make bench` (release build, pinned to one CPU).
// Arguments: [seconds per measurement] [openssl verify/s reference].
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

/// Runs `body` repeatedly for `seconds` and returns calls per second. Nonisolated, so the loop
/// and the verifier run on the same executor without hopping threads per call.
nonisolated func measure(seconds: Double, _ body: @Sendable (Int) async -> Bool) async -> Double {
    for i in 0..<200 { _ = await body(i) }  // warm-up
    let clock = ContinuousClock()
    let start = clock.now
    var count = 0
    let limit = Duration.milliseconds(Int64(seconds * 1000))
    while clock.now - start < limit {
        for _ in 0..<200 {
            guard await body(count) else { fatalError("verification failed at \(count)") }
            count += 1
        }
    }
    let elapsed = clock.now - start
    return Double(count) / (Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18)
}

let allTokens = tokens
let fullRate = await measure(seconds: seconds) { @Sendable i in
    if case .success = await verifier.verify(allTokens[i % allTokens.count]) { return true }
    return false
}

// The signature check alone, through the same OpenSSL path, for the breakdown.
let usable = cache.currentSnapshot()!.keys.usableKeys[0]
let token0 = tokens[0]
let dot = token0.lastIndex(of: UInt8(ascii: "."))!
let signingInput = Array(token0[..<dot])
let signature = Base64URL.decode(Array(token0[(dot + 1)...]))!
let signatureRate = ProcessInfo.processInfo.environment["BENCH_FULL_ONLY"] != nil ? 1 : await measure(seconds: seconds) { @Sendable _ in
    signature.withUnsafeBytes { sig in signingInput.withUnsafeBytes { usable.isValidSignature(sig, for: $0, algorithm: .rs256) } }
}

// Breakdown of the parsing side, on the first token's parts.
let parts = token0.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false).map { Array($0) }
let payloadJSON = Base64URL.decode(parts[1])!
let decodeRate = await measure(seconds: min(seconds, 1)) { @Sendable _ in
    Base64URL.decode(parts[0]) != nil && Base64URL.decode(parts[1]) != nil && Base64URL.decode(parts[2]) != nil
}
let jsonRate = await measure(seconds: min(seconds, 1)) { @Sendable _ in
    (try? JSONParser.parse(payloadJSON)) != nil
}
let claimsObject = try JSONParser.parse(payloadJSON).objectValue!
let envelopeRate = await measure(seconds: min(seconds, 1)) { @Sendable _ in
    (try? SecurityEventToken.parse(claims: claimsObject)) != nil
}

func format(_ x: Double) -> String { String(format: "%.0f", x) }
print("warden verify (parse + header + key + RS256 + claims): \(format(fullRate)) SETs/s on one core")
print("warden signature check only (OpenSSL via CWardenCrypto): \(format(signatureRate)) /s")
func micros(_ rate: Double) -> String { String(format: "%.2f µs", 1e6 / rate) }
print("per token: base64url decode of 3 parts \(micros(decodeRate)), JSON parse of the claims \(micros(jsonRate)), SET envelope \(micros(envelopeRate))")
if let reference = referenceArgument {
    print("openssl speed rsa2048 verify:                           \(format(reference)) /s")
    print(String(format: "ratio warden verify / openssl: %.2f (target ≥ 0.85)", fullRate / reference))
} else {
    print("no openssl reference given (make bench measures it)")
}
