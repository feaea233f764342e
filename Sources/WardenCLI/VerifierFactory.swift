public import HTTPExchange
public import Ledger
public import Logging
import SecurityEvents
public import TokenVerification

extension WardenConfiguration {
    /// A verifier for every configured issuer, fetching keys with `client`. With `archive`, every
    /// key fetched is kept in it; with `archived`, those keys are used before the live ones.
    public func makeVerifier(client: any HTTPExchanging, logger: Logger, clock: WallClock = .system,
                             archive: (any KeyArchiving)? = nil, archived: [ArchivedKey] = []) -> SETVerifier {
        let fetcher = HTTPKeyFetcher(client: client)
        let issuers = issuers.map { policy in
            SETVerifier.Issuer(policy: policy,
                               keys: IssuerKeyCache(issuer: policy.issuer, source: policy.keySource,
                                                    settings: policy.keyCache, fetcher: fetcher, clock: clock,
                                                    logger: logger, archive: archive),
                               archived: Self.entries(archived.filter { $0.issuer == policy.issuer }, grace: Self.archivedKeyGrace(policy),
                                                      logger: logger))
        }
        return SETVerifier(issuers: issuers, maximumTokenBytes: maximumTokenBytes, clock: clock)
    }

    /// How long after a key was last seen published a token signed with it is still trusted
    /// (its `iat`): as long as the worker itself goes on using a fetched key — its lifetime
    /// (`max-key-lifetime` at most), then `max-staleness` while the provider cannot be reached —
    /// and the clock skew allowed; at least a day. A token issued later came after the issuer
    /// retired the key, or was never seen by a worker.
    static func archivedKeyGrace(_ policy: IssuerPolicy) -> Double {
        max(86_400, policy.keyCache.maximumLifetime + policy.keyCache.maximumStaleness + policy.clockSkew)
    }

    /// Archived keys by `kid` (the most recently seen, when a `kid` was reused with other key
    /// material). A key that no longer parses, or no longer matches its thumbprint, is an unusable
    /// entry: its tokens are refused rather than sent to the live keys.
    static func entries(_ keys: [ArchivedKey], grace: Double, logger: Logger) -> [String: ArchivedKeyEntry] {
        var entries: [String: ArchivedKeyEntry] = [:]
        for key in keys.sorted(by: { $0.lastSeen < $1.lastSeen }) {
            let entry: KeySetEntry
            if case .object(let jwk)? = try? JSONParser.parse(key.jwk) {
                switch KeySet.makeKey(jwk, keyID: key.keyID) {
                case .success(let made) where made.thumbprint == key.thumbprint:
                    entry = .usable(made)
                case .success:
                    entry = .unusable(keyID: key.keyID, reason: "the archived key does not match its thumbprint")
                case .failure(let error):
                    entry = .unusable(keyID: key.keyID, reason: "the archived key is unusable: \(error.message)")
                }
            } else {
                entry = .unusable(keyID: key.keyID, reason: "the archived key is not a JSON object")
            }
            if case .unusable(_, let reason) = entry {
                logger.warning("archived key refused", metadata: ["warden.issuer": "\(key.issuer)", "warden.kid": "\(key.keyID)",
                                                                  "warden.reason": "\(reason)"])
            }
            entries[key.keyID] = ArchivedKeyEntry(entry: entry, issuedNotAfter: key.lastSeen + grace)
        }
        return entries
    }
}

/// Keeps fetched keys in the ledger's archive; a failed write is logged, and the next fetch
/// offers the keys again.
struct LedgerKeyArchive: KeyArchiving {
    let ledger: any AuditingLedger
    let logger: Logger

    func keep(_ keys: [VerificationKey], issuer: String, seenAt time: Double) async {
        let archived = keys.map {
            ArchivedKey(issuer: issuer, keyID: $0.keyID, thumbprint: $0.thumbprint, jwk: JSONValue.object($0.jwk).jsonText,
                        firstSeen: time, lastSeen: time)
        }
        do {
            try await ledger.archive(keys: archived, issuer: issuer, seenAt: time)
        } catch {
            logger.error("cannot archive the issuer's keys; the next fetch tries again",
                         metadata: ["warden.issuer": "\(issuer)", "warden.error": "\(error)"])
        }
    }
}
