import Foundation
import SETMinting
import SecurityEvents
import Testing
import TokenVerification

/// Replay's archive of keys: used before the live keys, only for tokens issued while the key
/// was published, and never a way around a signature check.
@Suite("Archived keys")
struct ArchivedKeyTests {
    /// A verifier whose live keys hold only the rotated key, with `Keys.rsa` archived.
    func verifier(_ clock: ManualClock, archivedUntil: Double) throws -> SETVerifier {
        let policy = IssuerPolicy(issuer: Fixture.issuer, keySource: .pinned(document: Array(SETMinter.jwks([Keys.rsaRotated]).utf8), origin: "test"),
                                  audiences: [Fixture.audience], algorithms: [.rs256], profile: .risc)
        let cache = IssuerKeyCache(issuer: Fixture.issuer, source: policy.keySource, settings: policy.keyCache,
                                   fetcher: OfflineKeyFetcher(), clock: clock.wall, logger: Fixture.quietLogger)
        let jwk = try #require(try JSONParser.parse(SETMinter.jwks([Keys.rsa])).objectValue?["keys"]?.arrayValue?.first?.objectValue)
        let key = try KeySet.makeKey(jwk, keyID: Keys.rsa.keyID).get()
        return SETVerifier(issuers: [.init(policy: policy, keys: cache,
                                           archived: [Keys.rsa.keyID: ArchivedKeyEntry(entry: .usable(key), issuedNotAfter: archivedUntil)])],
                           clock: clock.wall)
    }

    @Test func aRetiredKeyVerifiesTokensIssuedWhileItWasPublished() async throws {
        let clock = ManualClock()
        let verifier = try verifier(clock, archivedUntil: clock.now + 60)
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa)
        #expect(await verifier.verify(token).value != nil)
        // The live keys still serve their own kid.
        #expect(await verifier.verify(try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsaRotated)).value != nil)
    }

    @Test func aTokenForgedUnderAnArchivedKidIsRefused() async throws {
        let clock = ManualClock()
        let verifier = try verifier(clock, archivedUntil: clock.now + 60)
        let forged = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsaImpostor)
        #expect(await verifier.verify(forged).error?.reportedCode == "invalid_key")
    }

    @Test func aTokenIssuedAfterItsKeyWasRetiredIsRefused() async throws {
        let clock = ManualClock()
        let verifier = try verifier(clock, archivedUntil: clock.now - 1)
        let token = try SETMinter.token(claims: Fixture.riscClaims(clock), key: Keys.rsa)
        let error = try #require(await verifier.verify(token).error)
        #expect(error.reportedCode == "invalid_key")
        #expect(error.description.contains("retired"))
    }
}
