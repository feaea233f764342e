import AsyncHTTPClient
public import Foundation
public import Logging
public import HTTPExchange
import NIOCore
import NIOHTTP1
import SecurityEvents
import Synchronization

/// A document fetched over HTTP for the key cache.
public struct FetchedDocument: Sendable {
    public var body: [UInt8]
    /// `Cache-Control: max-age` in seconds; 0 for `no-cache`/`no-store`; nil when absent.
    public var maxAge: Double?

    public init(body: [UInt8], maxAge: Double?) {
        self.body = body
        self.maxAge = maxAge
    }
}

/// Fetches discovery and JWKS documents.
public protocol KeyDocumentFetching: Sendable {
    func fetch(_ url: URL, timeout: Double, maximumBytes: Int) async throws -> FetchedDocument
}

public struct KeyFetchError: Error, Sendable, CustomStringConvertible {
    public var description: String
    public init(_ description: String) { self.description = description }
}

/// Fetches over async-http-client: no redirects followed, a deadline per request, a size cap.
/// Refuses every fetch: for key caches whose keys are pinned (tests, benchmarks, air-gapped use).
public struct OfflineKeyFetcher: KeyDocumentFetching {
    let reason: String
    public init(reason: String = "key fetching is disabled") { self.reason = reason }
    public func fetch(_ url: URL, timeout: Double, maximumBytes: Int) async throws -> FetchedDocument {
        throw KeyFetchError(reason)
    }
}

public struct HTTPKeyFetcher: KeyDocumentFetching {
    let client: any HTTPExchanging

    public init(client: any HTTPExchanging) { self.client = client }

    public func fetch(_ url: URL, timeout: Double, maximumBytes: Int) async throws -> FetchedDocument {
        guard URLRule.isAcceptableForKeys(url) else {
            throw KeyFetchError("refusing to fetch \(shownURL(url)): keys and metadata are fetched over https (http only on loopback)")
        }
        var request = HTTPClientRequest(url: url.absoluteString)
        request.headers.add(name: "Accept", value: "application/json")
        request.headers.add(name: "User-Agent", value: "warden")
        let exchange: HTTPExchange
        do {
            exchange = try await client.exchange(request, timeout: timeout, maximumBodyBytes: maximumBytes)
        } catch {
            throw KeyFetchError("GET \(shownURL(url)) failed: \(error)")
        }
        guard exchange.status == .ok else {
            throw KeyFetchError("GET \(shownURL(url)) answered \(exchange.status.code)")
        }
        return FetchedDocument(body: Array(exchange.body.readableBytesView),
                               maxAge: CacheControl.maxAge(exchange.headers["Cache-Control"]))
    }
}

enum CacheControl {
    /// `max-age` from Cache-Control header values; 0 when caching is forbidden.
    static func maxAge(_ values: [String]) -> Double? {
        var result: Double? = nil
        for value in values {
            for directive in value.split(separator: ",") {
                let d = directive.trimmingCharacters(in: .whitespaces).lowercased()
                if d == "no-store" || d == "no-cache" { return 0 }
                if d.hasPrefix("max-age="), let seconds = Double(d.dropFirst("max-age=".count)), seconds >= 0 {
                    result = seconds
                }
            }
        }
        return result
    }
}

/// Keeps every key an issuer's JWKS published (the ledger's key archive), so tokens signed by a
/// key the issuer has since removed can be verified again later.
public protocol KeyArchiving: Sendable {
    /// Called after each successful fetch with the usable keys it brought. Must not throw: a
    /// failure is the archive's to report (the next fetch offers the keys again).
    func keep(_ keys: [VerificationKey], issuer: String, seenAt time: Double) async
}

/// The keys of one issuer as last fetched, readable without waiting for the cache.
public struct KeySnapshot: Sendable {
    public var keys: KeySet
    public var fetchedAt: Double
    /// Until then the keys are fresh.
    public var expiresAt: Double
    /// After this the keys are no longer used at all.
    public var usableUntil: Double
}

/// Keeps one issuer's signing keys: discovery, JWKS fetch, `Cache-Control` within bounds,
/// one shared refresh at a time, a cooldown on refreshes caused by unknown `kid`s, cached keys
/// served while the provider is down (up to `maximumStaleness`), and no keys at all after that.
///
/// The newest snapshot is also published behind a mutex so verification reads it without
/// hopping onto the actor; only refreshes go through the actor.
public actor IssuerKeyCache {
    public nonisolated let issuer: String
    /// Unusable JWKS entries logged by name at each load; the rest are counted in one line.
    static let unusableKeysNamed = 3
    let source: KeySource
    let settings: KeyCacheSettings
    let fetcher: any KeyDocumentFetching
    let clock: WallClock
    let logger: Logger
    let archive: (any KeyArchiving)?

    private nonisolated let published = Mutex<KeySnapshot?>(nil)
    private var inFlight: Task<Void, Never>?
    private var lastAttempt: Double?
    private var lastFailure: String?
    private var discoveredJWKS: (url: URL, expiresAt: Double)?
    /// Counts of fetch outcomes, for metrics and tests.
    /// Fetches made and failed so far, readable without waiting for the actor (metrics).
    private let fetches = Atomic<Int>(0), failures = Atomic<Int>(0), successes = Atomic<Int>(0)
    public nonisolated var fetchCount: Int { fetches.load(ordering: .relaxed) }
    public nonisolated var successCount: Int { successes.load(ordering: .relaxed) }
    public nonisolated var failureCount: Int { failures.load(ordering: .relaxed) }

    public init(issuer: String, source: KeySource, settings: KeyCacheSettings, fetcher: any KeyDocumentFetching,
                clock: WallClock = .system, logger: Logger, archive: (any KeyArchiving)? = nil) {
        self.archive = archive
        self.issuer = issuer
        self.source = source
        self.settings = settings
        self.fetcher = fetcher
        self.clock = clock
        self.logger = logger
        if case .pinned(let document, _) = source, let keys = try? KeySet.parse(jwks: document) {
            published.withLock { $0 = KeySnapshot(keys: keys, fetchedAt: 0, expiresAt: .infinity, usableUntil: .infinity) }
        }
    }

    /// The newest keys, if any are still usable, without waiting.
    public nonisolated func currentSnapshot() -> KeySnapshot? { currentSnapshot(at: clock.now()) }

    /// The newest keys still usable at `now` (seconds since 1970).
    public nonisolated func currentSnapshot(at now: Double) -> KeySnapshot? {
        published.withLock { snapshot in
            guard let snapshot, now <= snapshot.usableUntil else { return nil }
            return snapshot
        }
    }

    /// The key named `keyID` if the published keys are fresh at `now` and hold it; looked up
    /// under the lock, so nothing but the entry is copied.
    public nonisolated func freshEntry(keyID: String, at now: Double) -> KeySetEntry? {
        published.withLock { snapshot -> KeySetEntry? in
            // Optional chaining reads in place; binding the snapshot would copy (and release) it.
            guard let expiresAt = snapshot?.expiresAt, now < expiresAt else { return nil }
            return snapshot?.keys[keyID]
        }
    }

    /// Whether keys are published and still fresh at `now` (not merely usable while stale).
    public nonisolated func isFresh(at now: Double) -> Bool {
        published.withLock { snapshot in snapshot.map { now < $0.expiresAt } ?? false }
    }

    /// What a verification should use.
    public enum Lookup: Sendable {
        case keys(KeySet)
        /// No usable keys: never fetched, or stale beyond the bound, and the provider failed.
        case unavailable(String)
    }

    /// Keys that are fresh, or, if a refresh is due but fails, still within their staleness bound.
    public func keys() async -> Lookup {
        if let snapshot = currentSnapshot(), clock.now() < snapshot.expiresAt { return .keys(snapshot.keys) }
        await refresh(minimumInterval: settings.failureRetryInterval)
        return lookup()
    }

    /// Called when a token names a `kid` the current keys lack: refreshes at most once per
    /// cooldown, shared by every caller.
    public func keysAfterUnknownKeyID() async -> Lookup {
        await refresh(minimumInterval: settings.unknownKeyCooldown)
        return lookup()
    }

    /// The reason the last fetch failed, if it did.
    public var lastFetchFailure: String? { lastFailure }

    private func lookup() -> Lookup {
        if let snapshot = currentSnapshot() { return .keys(snapshot.keys) }
        return .unavailable(lastFailure.map { "the keys of issuer \(quoted(issuer)) are unavailable: \($0)" }
                            ?? "the keys of issuer \(quoted(issuer)) have not been loaded")
    }

    private func refresh(minimumInterval: Double) async {
        if case .pinned = source { return }
        if let task = inFlight {
            await task.value
            return
        }
        let now = clock.now()
        if let last = lastAttempt, now - last < minimumInterval, now >= last { return }
        lastAttempt = now
        let task = Task { await self.performFetch() }
        inFlight = task
        await task.value
        inFlight = nil
    }

    private func performFetch() async {
        fetches.add(1, ordering: .relaxed)
        do {
            let jwksURL = try await currentJWKSURL()
            let document = try await fetcher.fetch(jwksURL, timeout: settings.fetchTimeout,
                                                   maximumBytes: settings.maximumDocumentBytes)
            let keys: KeySet
            do {
                keys = try KeySet.parse(jwks: document.body)
            } catch {
                throw KeyFetchError("the JWKS at \(shownURL(jwksURL)) is unusable: \(error)")
            }
            guard !keys.usableKeys.isEmpty else {
                let reasons = keys.entries.values.compactMap { entry -> String? in
                    if case .unusable(_, let reason) = entry { return reason } else { return nil }
                }
                throw KeyFetchError("the JWKS at \(shownURL(jwksURL)) has no usable key"
                                    + (reasons.isEmpty ? "" : " (\(reasons.prefix(3).joined(separator: "; ")))"))
            }
            let now = clock.now()
            let lifetime = min(max(document.maxAge ?? settings.defaultLifetime, settings.minimumLifetime),
                               settings.maximumLifetime)
            let snapshot = KeySnapshot(keys: keys, fetchedAt: now, expiresAt: now + lifetime,
                                       usableUntil: now + lifetime + settings.maximumStaleness)
            published.withLock { $0 = snapshot }
            successes.add(1, ordering: .relaxed)
            lastFailure = nil
            if let archive {
                // Beside the verifications waiting for these keys, never in their way.
                let usable = keys.usableKeys, issuer = self.issuer
                Task { await archive.keep(usable, issuer: issuer, seenAt: now) }
            }
            // A few named, the rest counted: a JWKS of thousands of unusable entries (its size is
            // the provider's, or an attacker's on the path, to choose) is not thousands of lines
            // at every refresh.
            var unusable = 0
            for entry in keys.entries.values {
                guard case .unusable(let kid, let reason) = entry else { continue }
                unusable += 1
                if unusable <= Self.unusableKeysNamed {
                    logger.warning("unusable key in JWKS", metadata: ["warden.issuer": "\(issuer)", "warden.kid": "\(kid.prefix(64))",
                                                                     "warden.reason": "\(reason)"])
                }
            }
            if unusable > Self.unusableKeysNamed {
                logger.warning("more unusable keys in JWKS", metadata: ["warden.issuer": "\(issuer)",
                                                                       "warden.keys": "\(unusable - Self.unusableKeysNamed)"])
            }
            logger.debug("keys loaded", metadata: ["warden.issuer": "\(issuer)", "warden.keys": "\(keys.usableKeys.count)",
                                                   "warden.lifetime_s": "\(Int(lifetime))"])
        } catch {
            failures.add(1, ordering: .relaxed)
            lastFailure = "\(error)"
            let stale = currentSnapshot() != nil
            logger.error("key refresh failed", metadata: ["warden.issuer": "\(issuer)", "warden.error": "\(error)",
                                                          "warden.serving_cached_keys": "\(stale)"])
        }
    }

    private func currentJWKSURL() async throws -> URL {
        switch source {
        case .jwks(let url):
            return url
        case .pinned:
            throw KeyFetchError("pinned keys are not fetched")
        case .discovery(let discoveryURL):
            let now = clock.now()
            if let known = discoveredJWKS, now < known.expiresAt { return known.url }
            let document = try await fetcher.fetch(discoveryURL, timeout: settings.fetchTimeout,
                                                   maximumBytes: settings.maximumDocumentBytes)
            let metadata: JSONObject
            do {
                guard let object = try JSONParser.parse(document.body).objectValue else {
                    throw KeyFetchError("not a JSON object")
                }
                metadata = object
            } catch {
                throw KeyFetchError("the discovery document at \(shownURL(discoveryURL)) is not valid JSON: \(error)")
            }
            guard let documentIssuer = metadata["issuer"]?.stringValue else {
                throw KeyFetchError("the discovery document at \(shownURL(discoveryURL)) has no \"issuer\"")
            }
            guard sameName(documentIssuer, issuer) else {
                throw KeyFetchError("the discovery document at \(shownURL(discoveryURL)) names the issuer \(quoted(documentIssuer)), not the configured \(quoted(issuer)); its keys are not used")
            }
            guard let jwksText = metadata["jwks_uri"]?.stringValue, let jwksURL = URL(string: jwksText) else {
                throw KeyFetchError("the discovery document at \(shownURL(discoveryURL)) has no usable \"jwks_uri\"")
            }
            guard URLRule.isAcceptableForKeys(jwksURL) else {
                throw KeyFetchError("the discovery document's jwks_uri \(shownURL(jwksText)) is not https")
            }
            let lifetime = min(max(document.maxAge ?? settings.defaultLifetime, settings.minimumLifetime),
                               settings.maximumLifetime)
            discoveredJWKS = (jwksURL, now + lifetime)
            return jwksURL
        }
    }
}
