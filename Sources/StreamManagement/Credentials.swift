import _CryptoExtras
import AsyncHTTPClient
public import Foundation
public import HTTPExchange
import NIOCore
import NIOHTTP1
import SETMinting
import SecurityEvents

/// Why a stream call could not be made, and whether making it again can help.
public struct StreamError: Error, Sendable, CustomStringConvertible {
    public enum Kind: Sendable, Hashable {
        /// The settings or credentials cannot work (a key that does not parse, a missing stream id).
        case configuration
        /// The transmitter answered with an error status.
        case refused
        /// The transmitter could not be reached, or did not answer in time.
        case unavailable
        /// The transmitter answered something that is not what the protocol says.
        case invalidAnswer
    }

    public var kind: Kind
    public var message: String
    /// The HTTP status the transmitter answered, when it did.
    public var status: Int?
    /// Seconds the transmitter asked to wait (`Retry-After`).
    public var retryAfter: Double?

    public init(_ kind: Kind, _ message: String, status: Int? = nil, retryAfter: Double? = nil) {
        self.kind = kind
        self.message = message
        self.status = status
        self.retryAfter = retryAfter
    }

    public var isRetryable: Bool {
        switch kind {
        case .unavailable: true
        case .refused: status.map { $0 == 429 || $0 >= 500 } ?? false
        case .configuration, .invalidAnswer: false
        }
    }

    public var description: String { message }
}

/// A Google service account's key file (the JSON the Cloud console gives).
public struct ServiceAccountKey: Sendable {
    public var clientEmail: String
    public var privateKeyID: String
    let signingKey: SigningKey

    /// Parses the key file; the error never quotes the private key.
    public init(json: [UInt8]) throws(StreamError) {
        guard case .object(let object)? = try? JSONParser.parse(json) else {
            throw StreamError(.configuration, "the service-account key file is not a JSON object")
        }
        guard let email = object["client_email"]?.stringValue, !email.isEmpty else {
            throw StreamError(.configuration, "the service-account key file has no client_email")
        }
        guard let keyID = object["private_key_id"]?.stringValue, !keyID.isEmpty else {
            throw StreamError(.configuration, "the service-account key file has no private_key_id")
        }
        guard let pem = object["private_key"]?.stringValue,
              let key = try? _RSA.Signing.PrivateKey(pemRepresentation: pem) else {
            throw StreamError(.configuration, "the service-account key file's private_key is not an RSA private key in PEM form")
        }
        clientEmail = email
        privateKeyID = keyID
        signingKey = SigningKey(keyID: keyID, algorithm: "RS256", material: .rsa(key))
    }
}

/// Bearer tokens a transmitter accepts, fetched or minted when needed and reused until shortly
/// before they expire; never presented once known expired.
public protocol StreamCredentials: Sendable {
    /// The `Authorization` header value for the next call.
    func authorization() async throws(StreamError) -> String
    /// The transmitter refused the token as invalid: the next call gets a new one (when one can
    /// be made). Returns whether it will.
    func invalidate(_ presented: String) async -> Bool
}

/// A token that is used as it is (an SSF bearer token from a file).
public struct StaticBearer: StreamCredentials {
    let token: String
    public init(token: String) { self.token = token }
    public func authorization() async throws(StreamError) -> String { "Bearer " + token }
    public func invalidate(_ presented: String) async -> Bool { false }
}

/// How long before its expiry a reused token is replaced: the lesser of 60 s and a fifth of its
/// lifetime, so a short-lived token is still reused, and never presented expired.
public func renewalMargin(lifetime: Double) -> Double { min(60, max(0, lifetime) / 5) }

/// A cached token and when to stop presenting it.
struct CachedToken: Sendable {
    var value: String
    var renewAt: Double
}

/// JWTs signed with a Google service account's key, as the RISC API takes them: RS256, `kid` the
/// key's id, `iss` = `sub` = the account's email, the API's audience, valid one hour; one is
/// minted and reused until shortly before it expires.
public actor ServiceAccountTokens: StreamCredentials {
    public static let audience = "https://risc.googleapis.com/google.identity.risc.v1beta.RiscManagementService"
    public static let lifetime: Double = 3600

    let key: ServiceAccountKey
    let now: @Sendable () -> Double
    private var cached: CachedToken?

    public init(key: ServiceAccountKey, now: @escaping @Sendable () -> Double = { Date().timeIntervalSince1970 }) {
        self.key = key
        self.now = now
    }

    public func authorization() async throws(StreamError) -> String {
        let t = now()
        if let cached, t < cached.renewAt { return "Bearer " + cached.value }
        let issuedAt = t.rounded(.down)
        let claims: JSONObject = [
            "iss": .string(key.clientEmail), "sub": .string(key.clientEmail), "aud": .string(Self.audience),
            "iat": .number(issuedAt), "exp": .number(issuedAt + Self.lifetime),
        ]
        let token: String
        do {
            token = try SETMinter.token(header: ["alg": "RS256", "typ": "JWT", "kid": .string(key.privateKeyID)], claims: claims,
                                        key: key.signingKey)
        } catch {
            throw StreamError(.configuration, "cannot sign with the service-account key: \(error)")
        }
        cached = CachedToken(value: token, renewAt: issuedAt + Self.lifetime - renewalMargin(lifetime: Self.lifetime))
        return "Bearer " + token
    }

    public func invalidate(_ presented: String) async -> Bool {
        if let cached, "Bearer " + cached.value == presented { self.cached = nil }
        return true
    }
}

/// OAuth 2.0 client credentials (RFC 6749 §4.4): an access token fetched from the token
/// endpoint with the client's id and secret (`client_secret_basic`), cached and reused until
/// shortly before it expires, fetched anew when the transmitter says it is invalid.
public actor OAuthClientCredentials: StreamCredentials {
    public struct Settings: Sendable, Equatable {
        public var tokenEndpoint: URL
        public var clientID: String
        public var clientSecret: String
        public var scope: String?

        public init(tokenEndpoint: URL, clientID: String, clientSecret: String, scope: String?) {
            self.tokenEndpoint = tokenEndpoint
            self.clientID = clientID
            self.clientSecret = clientSecret
            self.scope = scope
        }
    }

    let settings: Settings
    let http: any HTTPExchanging
    let timeout: Double
    let now: @Sendable () -> Double
    private var cached: CachedToken?

    public init(settings: Settings, http: any HTTPExchanging, timeout: Double = 10,
                now: @escaping @Sendable () -> Double = { Date().timeIntervalSince1970 }) {
        self.settings = settings
        self.http = http
        self.timeout = timeout
        self.now = now
    }

    /// The fetch under way: callers meanwhile wait for it rather than each asking for a token.
    private var fetching: Task<Result<CachedToken, StreamError>, Never>?

    public func authorization() async throws(StreamError) -> String {
        if let cached, now() < cached.renewAt { return "Bearer " + cached.value }
        let task: Task<Result<CachedToken, StreamError>, Never>
        if let fetching {
            task = fetching
        } else {
            task = Task { await self.fetched() }
            fetching = task
        }
        let result = await task.value
        if fetching == task { fetching = nil }
        return "Bearer " + (try result.get()).value
    }

    private func fetched() async -> Result<CachedToken, StreamError> {
        do throws(StreamError) {
            let token = try await fetch()
            cached = token
            return .success(token)
        } catch {
            return .failure(error)
        }
    }

    private func fetch() async throws(StreamError) -> CachedToken {
        let requestedAt = now()
        var request = HTTPClientRequest(url: settings.tokenEndpoint.absoluteString)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/x-www-form-urlencoded")
        request.headers.add(name: "Accept", value: "application/json")
        let credentials = Data((HTTPRules.formEncoded(settings.clientID) + ":" + HTTPRules.formEncoded(settings.clientSecret)).utf8)
            .base64EncodedString()
        request.headers.add(name: "Authorization", value: "Basic " + credentials)
        var form = "grant_type=client_credentials"
        if let scope = settings.scope { form += "&scope=" + HTTPRules.formEncoded(scope) }
        request.body = .bytes(ByteBuffer(string: form))
        let answer: HTTPExchange
        do {
            answer = try await http.exchange(request, timeout: timeout, maximumBodyBytes: 64 * 1024)
        } catch {
            throw StreamError(.unavailable, "the token endpoint \(settings.tokenEndpoint.absoluteString) could not be reached: \(error)")
        }
        let body = Array(answer.body.readableBytesView)
        guard answer.status.code == 200 else {
            let detail = (try? JSONParser.parse(body)).flatMap { $0.objectValue?["error"]?.stringValue } ?? "no error code"
            throw StreamError(.refused, "the token endpoint refused the client credentials: HTTP \(answer.status.code) (\(detail))",
                              status: Int(answer.status.code))
        }
        guard let object = (try? JSONParser.parse(body))?.objectValue, let token = object["access_token"]?.stringValue, !token.isEmpty
        else {
            throw StreamError(.invalidAnswer, "the token endpoint's answer has no access_token")
        }
        // Without expires_in the token is used for the calls waiting for it only. Some servers
        // send it as a string ("3600").
        let expiresIn = object["expires_in"]
        let lifetime = max(0, expiresIn?.numberValue ?? expiresIn?.stringValue.flatMap { Double($0) } ?? 0)
        return CachedToken(value: token, renewAt: requestedAt + lifetime - renewalMargin(lifetime: lifetime))
    }

    public func invalidate(_ presented: String) async -> Bool {
        if let cached, "Bearer " + cached.value == presented { self.cached = nil }
        return true
    }
}

