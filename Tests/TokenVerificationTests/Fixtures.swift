import Foundation
import Logging
import SETMinting
import SecurityEvents
import Synchronization
import TokenVerification

/// Time that only moves when a test moves it.
final class ManualClock: Sendable {
    private let seconds: Mutex<Double>

    init(_ start: Double = 1_800_000_000) { seconds = Mutex(start) }

    var now: Double { seconds.withLock { $0 } }
    func advance(by delta: Double) { seconds.withLock { $0 += delta } }
    var wall: WallClock { WallClock { [self] in self.now } }
}

/// Throwaway keys, made once per test process (RSA generation is slow in debug builds).
enum Keys {
    static let rsa = try! SigningKey.rsa(keyID: "rsa-1", algorithm: "RS256")
    static let rsaRotated = try! SigningKey.rsa(keyID: "rsa-2", algorithm: "RS256")
    static let rsaImpostor = try! SigningKey.rsa(keyID: "rsa-1", algorithm: "RS256")
    static let rsa1024 = try! SigningKey.rsa(keyID: "weak", algorithm: "RS256", bits: 1024)
    static let rsa3072 = try! SigningKey.rsa(keyID: "rsa-3072", algorithm: "RS256", bits: 3072)
}

enum Fixture {
    static let issuer = "https://accounts.google.com/"
    static let audience = "1234-abc.apps.googleusercontent.com"

    static var quietLogger: Logger {
        var logger = Logger(label: "test")
        logger.logLevel = .critical
        return logger
    }

    /// A verifier with keys pinned from a JWKS document (no network).
    static func pinnedVerifier(keys: [SigningKey], extraJWKs: [JSONObject] = [], profile: TokenProfile = .risc,
                               algorithms: Set<JOSEAlgorithm> = [.rs256], issuer: String = Fixture.issuer,
                               audiences: [String] = [Fixture.audience], maximumAge: Double? = nil,
                               clock: ManualClock, maximumTokenBytes: Int = SETVerifier.defaultMaximumTokenBytes) -> SETVerifier {
        let jwks = SETMinter.jwks(keys, extra: extraJWKs)
        let policy = IssuerPolicy(issuer: issuer, keySource: .pinned(document: Array(jwks.utf8), origin: "test"),
                                  audiences: audiences, algorithms: algorithms, profile: profile, maximumAge: maximumAge)
        let cache = IssuerKeyCache(issuer: issuer, source: policy.keySource, settings: policy.keyCache,
                                   fetcher: OfflineKeyFetcher(reason: "no network in this test"), clock: clock.wall, logger: quietLogger)
        return SETVerifier(issuers: [.init(policy: policy, keys: cache)], maximumTokenBytes: maximumTokenBytes,
                           clock: clock.wall)
    }

    static func riscClaims(_ clock: ManualClock, event: EventType = .sessionsRevoked, extra: JSONObject = [:]) -> JSONObject {
        SETMinter.riscClaims(issuer: issuer, audience: audience, event: event, extra: extra, issuedAt: clock.now)
    }
}

extension Result where Failure == VerificationError {
    var error: VerificationError? {
        if case .failure(let e) = self { return e }
        return nil
    }

    var value: Success? {
        if case .success(let v) = self { return v }
        return nil
    }
}
