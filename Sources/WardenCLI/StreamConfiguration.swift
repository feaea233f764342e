public import HTTPExchange
import Foundation
public import StreamManagement
import SecurityEvents
import TokenVerification

/// An issuer's `stream:` section: how Warden manages the issuer's stream at its transmitter
/// (`warden stream …`) and, for `delivery: {method: poll}`, polls it in `warden run`.
public struct StreamConfiguration: Sendable {
    public enum Credentials: Sendable {
        /// Google: a service account's key file.
        case serviceAccount(ServiceAccountKey)
        /// SSF: a bearer token from a file.
        case bearer(String)
        /// SSF: OAuth 2.0 client credentials.
        case oauth(OAuthClientCredentials.Settings)
    }

    public var settings: StreamSettings
    public var credentials: Credentials
    /// What the section says, credentials' contents included, as one number of this process:
    /// a reload compares it to tell a changed stream (a rotated token file) from the same one.
    var fingerprint = 0

    public var issuer: String { settings.issuer }

    static let keys = ["api", "endpoint", "credentials-file", "oauth", "delivery", "events", "stream-id", "description"]

    /// The credentials, ready to present (tokens minted or fetched when first needed, reused).
    public func makeCredentials(http: any HTTPExchanging) -> any StreamCredentials {
        switch credentials {
        case .serviceAccount(let key): ServiceAccountTokens(key: key)
        case .bearer(let token): StaticBearer(token: token)
        case .oauth(let settings): OAuthClientCredentials(settings: settings, http: http)
        }
    }

    static func parse(_ r: ConfigReader, issuer: String) throws(ConfigError) -> StreamConfiguration? {
        guard r.isPresent else { return nil }
        try r.requireOnly(keys)
        let apiName = try r.child("api").requiredString()
        guard let api = StreamSettings.API(rawValue: apiName) else {
            throw r.child("api").error("\"\(apiName)\" is not google (Google's RISC API) or ssf (SSF 1.0 stream management)")
        }

        var endpoint = URL(string: "https://risc.googleapis.com")!
        if r.child("endpoint").isPresent {
            guard api == .google else {
                throw r.child("endpoint").error("is for api: google; an SSF transmitter's endpoints come from its /.well-known/ssf-configuration")
            }
            endpoint = try WardenConfiguration.url(r.child("endpoint"))
        }

        let credentials: Credentials
        var fingerprint = Hasher()
        let file = r.child("credentials-file"), oauth = r.child("oauth")
        switch api {
        case .google:
            if oauth.isPresent { throw oauth.error("is for api: ssf; Google's RISC API takes a service account's key (credentials-file)") }
            guard let (contents, path) = try file.fileContents() else {
                throw file.error("is required for api: google (the service account's JSON key file)")
            }
            fingerprint.combine(contents)
            do {
                credentials = .serviceAccount(try ServiceAccountKey(json: contents))
            } catch {
                throw file.error("\(path): \(error)")
            }
        case .ssf:
            // The transmitter is found at the issuer's /.well-known/ssf-configuration and sent the
            // credentials: never in clear (http only on a loopback host, for local transmitters).
            guard let issuerURL = URL(string: issuer), URLRule.isAcceptableForKeys(issuerURL) else {
                throw r.error("an ssf stream is managed at its issuer, and \(issuer) is not an https URL (http only on a loopback host): the credentials would go in clear")
            }
            if file.isPresent, oauth.isPresent { throw oauth.error("give either credentials-file (a bearer token) or oauth, not both") }
            if let (contents, path) = try file.fileContents() {
                let token = String(decoding: contents, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
                guard !token.isEmpty, !token.contains(where: \.isWhitespace) else {
                    throw file.error("\(path) must hold one bearer token")
                }
                // Printable ASCII only (RFC 6750's token characters are a part of it): a control
                // byte would be refused in the header, in an error quoting the header whole.
                guard token.utf8.allSatisfy({ (0x21...0x7E).contains($0) }) else {
                    throw file.error("\(path) must hold one bearer token of printable ASCII characters (it holds another byte)")
                }
                credentials = .bearer(token)
                fingerprint.combine(token)
            } else if oauth.isPresent {
                try oauth.requireOnly(["token-endpoint", "client-id", "client-secret", "client-secret-file", "scope"])
                guard let secret = try oauth.secret("client-secret") else {
                    throw oauth.child("client-secret-file").error("is required (or client-secret)")
                }
                let settings = OAuthClientCredentials.Settings(
                    tokenEndpoint: try WardenConfiguration.url(oauth.child("token-endpoint")),
                    clientID: try oauth.child("client-id").requiredString(), clientSecret: secret, scope: try oauth.child("scope").string())
                credentials = .oauth(settings)
                for part in [settings.tokenEndpoint.absoluteString, settings.clientID, secret, settings.scope ?? "\u{0}"] { fingerprint.combine(part) }
            } else {
                throw r.error("an ssf stream needs credentials: credentials-file (a bearer token) or oauth (client credentials)")
            }
        }

        var delivery: StreamDelivery? = nil
        let d = r.child("delivery")
        if d.isPresent {
            try d.requireOnly(["method", "endpoint-url"])
            let method = try d.child("method").requiredString()
            let url: String? = try d.child("endpoint-url").isPresent ? WardenConfiguration.url(d.child("endpoint-url")).absoluteString : nil
            switch method {
            case "push":
                guard let url else { throw d.child("endpoint-url").error("is required for push (the receiver's https URL, e.g. https://warden.example.com/events)") }
                delivery = .push(endpointURL: url)
            case "poll":
                guard api == .ssf else { throw d.child("method").error("Google delivers RISC events only by push") }
                delivery = .poll(endpointURL: url)
            default:
                throw d.child("method").error("\"\(method)\" is not push or poll")
            }
        }

        var events: [String] = []
        for (i, name) in (try r.child("events").stringList() ?? []).enumerated() {
            let definitions = EventCatalog.definitions(named: name)
            let preferred = definitions.filter { api == .ssf ? $0.family == .ssf : $0.family != .ssf && $0.family != .googleLegacy }
            guard let chosen = preferred.first ?? definitions.first(where: { $0.aliasOf == nil }) ?? definitions.first else {
                throw ConfigError(path: "\(r.child("events").pathText)[\(i)]", "\"\(name)\" is not a known event type (a short name such as sessions-revoked, or a full URI)")
            }
            if !events.contains(chosen.uri) { events.append(chosen.uri) }
        }
        if events.isEmpty {
            throw r.child("events").error("name the events to ask for (e.g. [sessions-revoked, tokens-revoked, token-revoked, account-disabled, verification])")
        }

        let streamID = try r.child("stream-id").string()
        if streamID != nil, api == .google { throw r.child("stream-id").error("is for api: ssf (a Google project has one stream)") }
        let settings = StreamSettings(issuer: issuer, api: api, endpoint: endpoint, delivery: delivery, events: events,
                                      streamID: streamID, description: try r.child("description").string())
        for part in [issuer, api.rawValue, endpoint.absoluteString, "\(String(describing: delivery))", events.joined(separator: " "),
                     streamID ?? "\u{0}", settings.description ?? "\u{0}"] {
            fingerprint.combine(part)
        }
        return StreamConfiguration(settings: settings, credentials: credentials, fingerprint: fingerprint.finalize())
    }
}
