public import AsyncHTTPClient
public import Logging
public import TokenVerification

extension WardenConfiguration {
    /// A verifier for every configured issuer, fetching keys with `client`.
    public func makeVerifier(client: HTTPClient, logger: Logger, clock: WallClock = .system) -> SETVerifier {
        let fetcher = HTTPKeyFetcher(client: client)
        let issuers = issuers.map { policy in
            SETVerifier.Issuer(policy: policy,
                               keys: IssuerKeyCache(issuer: policy.issuer, source: policy.keySource,
                                                    settings: policy.keyCache, fetcher: fetcher, clock: clock,
                                                    logger: logger))
        }
        return SETVerifier(issuers: issuers, maximumTokenBytes: maximumTokenBytes, clock: clock)
    }
}
