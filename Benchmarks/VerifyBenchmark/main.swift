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
let usable = cache.currentSnapshot()!.keys.usableKeys[0]
let token0 = tokens[0]
let dot = token0.lastIndex(of: UInt8(ascii: "."))!
let signingInput = Array(token0[..<dot])
let signature = Base64URL.decode(Array(token0[(dot + 1)...]))!

// This machine's speed drifts between seconds, so the two measurements are interleaved in
// short rounds and each is reported as the median of its rounds.
let rounds = 7
var fullRates: [Double] = [], signatureRates: [Double] = []
if let profileSeconds = ProcessInfo.processInfo.environment["BENCH_PROFILE_FULL"].flatMap(Double.init) {
    // Only the whole verification, for a profiler.
    _ = await measure(seconds: profileSeconds) { @Sendable i in
        if case .success = await verifier.verify(allTokens[i % allTokens.count]) { return true }
        return false
    }
    exit(0)
}
for _ in 0..<rounds {
    fullRates.append(await measure(seconds: seconds / Double(rounds)) { @Sendable i in
        if case .success = await verifier.verify(allTokens[i % allTokens.count]) { return true }
        return false
    })
    // The signature check alone, through the same OpenSSL path.
    signatureRates.append(await measure(seconds: seconds / Double(rounds)) { @Sendable _ in
        signature.withUnsafeBytes { sig in signingInput.withUnsafeBytes { usable.isValidSignature(sig, for: $0, algorithm: .rs256) } }
    })
}
func median(_ xs: [Double]) -> Double { xs.sorted()[xs.count / 2] }
let fullRate = median(fullRates), signatureRate = median(signatureRates)

// Breakdown of the parsing side, on the first token's parts.
let parts = token0.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false).map { Array($0) }
let payloadJSON = Base64URL.decode(parts[1])!
let decodeRate = await measure(seconds: 0.5) { @Sendable _ in
    Base64URL.decode(parts[0]) != nil && Base64URL.decode(parts[1]) != nil && Base64URL.decode(parts[2]) != nil
}
let jsonRate = await measure(seconds: 0.5) { @Sendable _ in (try? JSONParser.parse(payloadJSON)) != nil }
let claimsObject = try JSONParser.parse(payloadJSON).objectValue!
let envelopeRate = await measure(seconds: 0.5) { @Sendable _ in (try? SecurityEventToken.parse(claims: claimsObject)) != nil }

// Everything before the key lookup: a token from an issuer that is not configured.
var strangerClaims = SETMinter.riscClaims(issuer: "https://stranger.example/", audience: audience)
strangerClaims["pad"] = .string(String(repeating: "p", count: 20))
let stranger = Array(try SETMinter.token(claims: strangerClaims, key: key).utf8)
let frontRate = await measure(seconds: 0.5) { @Sendable _ in
    if case .failure(let e) = await verifier.verify(stranger), e.kind == .unknownIssuer { return true }
    return false
}

func format(_ x: Double) -> String { String(format: "%.0f", x) }
func micros(_ rate: Double) -> String { String(format: "%.1f µs", 1e6 / rate) }
print("warden verify (parse, header, key, RS256, claims): \(format(fullRate)) SETs/s on one core (\(micros(fullRate)) each)")
print("  of which the signature check (SHA-256 + OpenSSL RSA): \(format(signatureRate)) /s (\(micros(signatureRate)))")
print("  the rest: \(String(format: "%.1f µs", 1e6 / fullRate - 1e6 / signatureRate)); base64url of 3 parts \(micros(decodeRate)), JSON claims \(micros(jsonRate)), SET envelope \(micros(envelopeRate)); verify up to the issuer check \(micros(frontRate))")
if let reference = referenceArgument {
    print("openssl speed rsa2048 verify: \(format(reference)) /s")
    print(String(format: "ratio warden verify / openssl: %.2f (target ≥ 0.85)", fullRate / reference))
} else {
    print("no openssl reference given (make bench measures it)")
}
