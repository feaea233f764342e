import AsyncHTTPClient
import Foundation
import Logging
import SETMinting
import SecurityEvents
import Synchronization
import Testing
@testable import TokenVerification
import WardenTestSupport

/// The key cache against a real local HTTP server: discovery, JWKS, rotation, outages, floods.
@Suite("Key cache over HTTP", .serialized)
struct KeyCacheTests {
    let issuerPath = "/.well-known/risc-configuration"
    let jwksPath = "/oauth2/v3/certs"

    struct Setup {
        let server: KeyServer
        let client: HTTPClient
        let clock: ManualClock
        let verifier: SETVerifier
        let cache: IssuerKeyCache
        let issuer: String

        func shutdown() async {
            await server.stop()
            try? await client.shutdown()
        }
    }

    /// The issuer is the server's own origin, so the discovery document can name it.
    func setUp(keys: [SigningKey] = [Keys.rsa], settings: KeyCacheSettings = KeyCacheSettings(),
               discoveryIssuer: String? = nil, useDiscovery: Bool = true) async throws -> Setup {
        let server = try await KeyServer.start()
        let issuer = server.baseURL + "/"
        server.serve(issuerPath, json: JSONValue.object(["issuer": .string(discoveryIssuer ?? issuer),
                                                         "jwks_uri": .string(server.url(jwksPath))]).jsonText)
        server.serve(jwksPath, json: SETMinter.jwks(keys))
        let clock = ManualClock()
        let client = HTTPClient(eventLoopGroupProvider: .singleton)
        let source: KeySource = useDiscovery ? .discovery(URL(string: server.url(issuerPath))!) : .jwks(URL(string: server.url(jwksPath))!)
        let policy = IssuerPolicy(issuer: issuer, keySource: source, audiences: [Fixture.audience], keyCache: settings)
        let cache = IssuerKeyCache(issuer: issuer, source: source, settings: settings, fetcher: HTTPKeyFetcher(client: client),
                                   clock: clock.wall, logger: Fixture.quietLogger)
        let verifier = SETVerifier(issuers: [.init(policy: policy, keys: cache)], clock: clock.wall)
        return Setup(server: server, client: client, clock: clock, verifier: verifier, cache: cache, issuer: issuer)
    }

    func token(_ s: Setup, key: SigningKey = Keys.rsa) throws -> String {
        try SETMinter.token(claims: SETMinter.riscClaims(issuer: s.issuer, audience: Fixture.audience, issuedAt: s.clock.now), key: key)
    }

    @Test func discoversAndVerifies() async throws {
        let s = try await setUp()
        #expect(await s.verifier.verify(try token(s)).value != nil)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        #expect(s.server.requests(issuerPath) == 1)
        #expect(s.server.requests(jwksPath) == 1)
        await s.shutdown()
    }

    @Test func derivesTheWellKnownDiscoveryURLWithTheIssuerPath() {
        #expect(KeySource.wellKnownDiscovery(issuer: "https://tr.example.com/t1/", profile: .ssf)?.absoluteString
                == "https://tr.example.com/.well-known/ssf-configuration/t1")
        #expect(KeySource.wellKnownDiscovery(issuer: "https://accounts.google.com/", profile: .risc)?.absoluteString
                == "https://accounts.google.com/.well-known/risc-configuration")
        #expect(KeySource.wellKnownDiscovery(issuer: "https://op.example.com/tenant", profile: .logout)?.absoluteString
                == "https://op.example.com/tenant/.well-known/openid-configuration")
    }

    @Test func refusesADiscoveryDocumentForAnotherIssuer() async throws {
        let s = try await setUp(discoveryIssuer: "https://accounts.google.com")
        let result = await s.verifier.verify(try token(s))
        #expect(result.error?.kind == .keysUnavailable)
        #expect(result.error?.description.contains("names the issuer") == true)
        #expect(s.server.requests(jwksPath) == 0)
        await s.shutdown()
    }

    // A provider may publish its encryption key under its signing key's id: the signing key
    // is used whichever comes first. Two signing keys under one id stay ambiguous, refused.
    @Test func anEncryptionKeyUnderTheSigningKeysIDDoesNotHideIt() async throws {
        var encryption = Keys.rsaRotated.publicJWK
        encryption["kid"] = .string(Keys.rsa.keyID)
        encryption["use"] = "enc"
        var withoutVerify = Keys.rsaRotated.publicJWK
        withoutVerify["kid"] = .string(Keys.rsa.keyID)
        withoutVerify["key_ops"] = .array(["encrypt"])
        let after = SETMinter.jwks([Keys.rsa], extra: [encryption, withoutVerify])
        let before = JSONValue.object(["keys": .array([.object(encryption), .object(Keys.rsa.publicJWK)])]).jsonText
        for document in [after, before] {
            let set = try KeySet.parse(jwks: Array(document.utf8))
            guard case .usable = set[Keys.rsa.keyID] else {
                Issue.record("\(String(describing: set[Keys.rsa.keyID]))")
                continue
            }
        }
        var twin = Keys.rsaRotated.publicJWK
        twin["kid"] = .string(Keys.rsa.keyID)
        let ambiguous = try KeySet.parse(jwks: Array(SETMinter.jwks([Keys.rsa], extra: [encryption, twin]).utf8))
        guard case .unusable(_, let reason) = ambiguous[Keys.rsa.keyID] else {
            Issue.record("two signing keys under one id: \(String(describing: ambiguous[Keys.rsa.keyID]))")
            return
        }
        #expect(reason.contains("more than once"))
        // An encryption key alone under an id still says why it is not used.
        let alone = try KeySet.parse(jwks: Array(JSONValue.object(["keys": .array([.object(encryption)])]).jsonText.utf8))
        guard case .unusable(_, let why) = alone[Keys.rsa.keyID] else {
            Issue.record("\(String(describing: alone[Keys.rsa.keyID]))")
            return
        }
        #expect(why.contains("\"use\""), "\(why)")
    }

    // A key source URL may carry a credential (a user and password, an `api_key` query): a
    // failure names the URL without it, in what reaches the ledger, dead letters and logs.
    @Test func aFailedFetchDoesNotShowTheURLsCredentials() async throws {
        let s = try await setUp()
        let secretURL = URL(string: s.server.url("/missing").replacingOccurrences(of: "://", with: "://user:hunter2@") + "?api_key=s3cr3t")!
        let cache = IssuerKeyCache(issuer: s.issuer, source: .jwks(secretURL), settings: KeyCacheSettings(),
                                   fetcher: HTTPKeyFetcher(client: s.client), clock: s.clock.wall, logger: Fixture.quietLogger)
        let policy = IssuerPolicy(issuer: s.issuer, keySource: .jwks(secretURL), audiences: [Fixture.audience])
        let verifier = SETVerifier(issuers: [.init(policy: policy, keys: cache)], clock: s.clock.wall)
        let result = await verifier.verify(try token(s))
        let description = result.error?.description ?? ""
        #expect(result.error?.kind == .keysUnavailable)
        #expect(description.contains("/missing?…"), "\(description)")
        #expect(!description.contains("hunter2") && !description.contains("s3cr3t") && !description.contains("user:"), "\(description)")
        await s.shutdown()
    }

    @Test func followsKeyRotation() async throws {
        var settings = KeyCacheSettings()
        settings.unknownKeyCooldown = 60
        let s = try await setUp(settings: settings)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        // The provider rotates to a new key.
        s.server.serve(jwksPath, json: SETMinter.jwks([Keys.rsaRotated]))
        // Within the cooldown after the last fetch, an unknown kid is refused without a request.
        #expect(await s.verifier.verify(try token(s, key: Keys.rsaRotated)).error?.kind == .unknownKeyID)
        #expect(s.server.requests(jwksPath) == 1)
        s.clock.advance(by: 61)
        #expect(await s.verifier.verify(try token(s, key: Keys.rsaRotated)).value != nil)
        #expect(s.server.requests(jwksPath) == 2)
        // The retired key is gone.
        #expect(await s.verifier.verify(try token(s)).error?.kind == .unknownKeyID)
        await s.shutdown()
    }

    @Test func floodOfUnknownKeyIDsCostsOneRequestPerCooldown() async throws {
        let s = try await setUp()
        #expect(await s.verifier.verify(try token(s)).value != nil)
        s.clock.advance(by: 120)  // past the cooldown: one refresh is allowed
        let before = s.server.requests(jwksPath)
        let tokens = try (0..<300).map { i in
            var key = Keys.rsa
            key.keyID = "random-\(i)-\(UUID().uuidString)"
            return try token(s, key: key)
        }
        let kinds = await withTaskGroup(of: VerificationError.Kind?.self) { group in
            for t in tokens { group.addTask { await s.verifier.verify(t).error?.kind } }
            var kinds: [VerificationError.Kind?] = []
            for await k in group { kinds.append(k) }
            return kinds
        }
        #expect(kinds.allSatisfy { $0 == .unknownKeyID })
        #expect(s.server.requests(jwksPath) - before == 1)
        // Still within the cooldown: another flood costs nothing.
        for t in tokens.prefix(50) { _ = await s.verifier.verify(t) }
        #expect(s.server.requests(jwksPath) - before == 1)
        await s.shutdown()
    }

    @Test func servesCachedKeysWhileTheProviderIsDownThenFailsClosed() async throws {
        var settings = KeyCacheSettings()
        settings.maximumStaleness = 3_600
        let s = try await setUp(settings: settings)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        await s.server.stop()
        // Past the keys' lifetime (1 h default) but within the staleness bound: still verified.
        s.clock.advance(by: 3_700)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        #expect(s.cache.failureCount >= 1)
        // Past the bound: no keys, no verdict.
        s.clock.advance(by: 3_600)
        let result = await s.verifier.verify(try token(s))
        #expect(result.error?.kind == .keysUnavailable)
        #expect(result.error?.isRetryable == true)
        #expect(result.error?.code == nil)
        // The provider comes back: verification resumes.
        try await s.server.restart()
        s.clock.advance(by: 10)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        await s.shutdown()
    }

    @Test func failsClosedWhenKeysWereNeverLoaded() async throws {
        let s = try await setUp()
        await s.server.stop()
        let result = await s.verifier.verify(try token(s))
        #expect(result.error?.kind == .keysUnavailable)
        await s.shutdown()
    }

    @Test func unknownKeyWhileTheProviderIsDownIsRefusedWhileTheKeysAreFresh() async throws {
        let s = try await setUp()
        #expect(await s.verifier.verify(try token(s)).value != nil)
        await s.server.stop()
        s.clock.advance(by: 120)
        // A forged kid while the JWKS cannot be fetched: the keys are still fresh, so they are
        // the provider's current set, and the token is refused — not held as "keys unavailable",
        // which would let anyone who can write to the topic stop its partition.
        let forged = await s.verifier.verify(try token(s, key: Keys.rsaRotated))
        #expect(forged.error?.kind == .unknownKeyID)
        #expect(forged.error?.code == .invalidKey)
        // Past the keys' freshness (1 h) the cached set may predate a rotation we missed: then
        // an unknown kid is not a verdict.
        s.clock.advance(by: 3_600)
        #expect(await s.verifier.verify(try token(s, key: Keys.rsaRotated)).error?.kind == .keysUnavailable)
        // The known key still verifies from the stale keys.
        #expect(await s.verifier.verify(try token(s)).value != nil)
        await s.shutdown()
    }

    @Test func honoursCacheControlWithinBounds() async throws {
        let s = try await setUp(useDiscovery: false)
        s.server.serve(jwksPath, json: SETMinter.jwks([Keys.rsa]), cacheControl: "public, max-age=600")
        #expect(await s.verifier.verify(try token(s)).value != nil)
        s.clock.advance(by: 500)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        #expect(s.server.requests(jwksPath) == 1)
        s.clock.advance(by: 200)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        #expect(s.server.requests(jwksPath) == 2)
        // A max-age of a year is cut to the 24 h maximum.
        s.server.serve(jwksPath, json: SETMinter.jwks([Keys.rsa]), cacheControl: "max-age=31536000")
        s.clock.advance(by: 700)
        _ = await s.verifier.verify(try token(s))
        #expect(s.server.requests(jwksPath) == 3)
        s.clock.advance(by: 86_401)
        _ = await s.verifier.verify(try token(s))
        #expect(s.server.requests(jwksPath) == 4)
        await s.shutdown()
    }

    @Test func timesOutOnAHangingProvider() async throws {
        var settings = KeyCacheSettings()
        settings.fetchTimeout = 0.3
        let s = try await setUp(settings: settings, useDiscovery: false)
        s.server.serve(jwksPath, .init(body: SETMinter.jwks([Keys.rsa]), delay: 5))
        let result = await s.verifier.verify(try token(s))
        #expect(result.error?.kind == .keysUnavailable)
        await s.shutdown()
    }

    // A provider that sends its head and then stalls in the body: the deadline covers the body
    // too, so the refresh (and the verifications waiting on it) ends.
    @Test func timesOutOnAProviderThatStallsAfterItsHead() async throws {
        var settings = KeyCacheSettings()
        settings.fetchTimeout = 0.5
        let s = try await setUp(settings: settings, useDiscovery: false)
        s.server.serve(jwksPath, .init(body: SETMinter.jwks([Keys.rsa]), headers: ["Content-Type": "application/json"],
                                       stallAfterHead: 600))
        let result = await s.verifier.verify(try token(s))
        #expect(result.error?.kind == .keysUnavailable)
        #expect(await s.cache.lastFetchFailure?.contains("no complete answer within") == true)
        await s.shutdown()
    }

    @Test func aJWKSWithoutUsableKeysKeepsThePreviousKeys() async throws {
        let s = try await setUp(useDiscovery: false)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        s.server.serve(jwksPath, json: SETMinter.jwks([Keys.rsa1024]))
        s.clock.advance(by: 3_601)
        #expect(await s.verifier.verify(try token(s)).value != nil)
        #expect(await s.cache.lastFetchFailure?.contains("no usable key") == true)
        await s.shutdown()
    }

    /// Counts warnings, whoever logs them.
    struct WarningCounter: LogHandler {
        final class Count: Sendable { let value = Mutex(0) }
        let count: Count
        var metadata: Logger.Metadata = [:]
        var logLevel: Logger.Level = .trace
        subscript(metadataKey key: String) -> Logger.Metadata.Value? {
            get { metadata[key] }
            set { metadata[key] = newValue }
        }
        func log(event: LogEvent) {
            if event.level == .warning { count.value.withLock { $0 += 1 } }
        }
    }

    /// A JWKS of thousands of unusable entries beside a good key: the key is used, and the
    /// unusable ones are a few lines of log at each load, not one each.
    @Test func thousandsOfUnusableEntriesAreAFewLinesOfLog() async throws {
        let s = try await setUp(useDiscovery: false)
        var keys = (try JSONParser.parse(SETMinter.jwks([Keys.rsa])).objectValue?["keys"]?.arrayValue) ?? []
        for i in 0..<2_000 { keys.append(.object(["kty": "oct", "kid": .string("junk-\(i)"), "k": "AAAA"])) }
        s.server.serve(jwksPath, json: JSONValue.object(["keys": .array(keys)]).jsonText)
        let count = WarningCounter.Count()
        let logger = Logger(label: "key-cache-test") { _ in WarningCounter(count: count) }
        let source = KeySource.jwks(URL(string: s.server.url(jwksPath))!)
        let cache = IssuerKeyCache(issuer: s.issuer, source: source, settings: KeyCacheSettings(), fetcher: HTTPKeyFetcher(client: s.client),
                                   clock: s.clock.wall, logger: logger)
        let policy = IssuerPolicy(issuer: s.issuer, keySource: source, audiences: [Fixture.audience])
        let verifier = SETVerifier(issuers: [.init(policy: policy, keys: cache)], clock: s.clock.wall)
        #expect(await verifier.verify(try token(s)).value != nil)
        let warnings = count.value.withLock { $0 }
        #expect(warnings >= 1 && warnings <= IssuerKeyCache.unusableKeysNamed + 1, "\(warnings) warnings")
        await s.shutdown()
    }

    @Test func neverFetchesHeaderKeyURLs() async throws {
        let s = try await setUp()
        s.server.serve("/attacker-keys", json: SETMinter.jwks([Keys.rsaImpostor]))
        var header = SETMinter.header(for: Keys.rsaImpostor)
        header["jku"] = .string(s.server.url("/attacker-keys"))
        let forged = try SETMinter.token(header: header, claims: SETMinter.riscClaims(issuer: s.issuer, audience: Fixture.audience,
                                                                                     issuedAt: s.clock.now), key: Keys.rsaImpostor)
        #expect(await s.verifier.verify(forged).error?.kind == .headerKeyMaterial)
        #expect(s.server.requests("/attacker-keys") == 0)
        await s.shutdown()
    }

    @Test func refusesPlainHTTPOutsideLoopback() {
        #expect(URLRule.isAcceptableForKeys(URL(string: "https://accounts.google.com/x")!))
        #expect(URLRule.isAcceptableForKeys(URL(string: "http://127.0.0.1:8080/x")!))
        #expect(URLRule.isAcceptableForKeys(URL(string: "http://localhost/x")!))
        #expect(URLRule.isAcceptableForKeys(URL(string: "http://[::1]:9/x")!))
        #expect(!URLRule.isAcceptableForKeys(URL(string: "http://accounts.google.com/x")!))
        #expect(!URLRule.isAcceptableForKeys(URL(string: "http://127.0.0.1.evil.example/x")!))
        #expect(!URLRule.isAcceptableForKeys(URL(string: "ftp://127.0.0.1/x")!))
    }
}
