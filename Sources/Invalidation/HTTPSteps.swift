import AsyncHTTPClient
import Crypto
import Foundation
public import HTTPExchange
import NIOCore
import NIOHTTP1
import SecurityEvents

/// RFC 7009 token revocation: one token per request, client authentication as configured.
public struct RevocationClient: Sendable {
    public let http: any HTTPExchanging

    public init(http: any HTTPExchanging) { self.http = http }

    /// 200 is done (also for a token the server does not know); 429, 503 and other 5xx are
    /// retried (honouring `Retry-After`); `unsupported_token_type`, 400 and 401 are permanent
    /// failures — never read as "the token is gone".
    public func revoke(_ token: String, hint: String?, at endpoint: RevocationEndpoint) async -> StepOutcome {
        var form: [(String, String)] = [("token", token)]
        if let hint { form.append(("token_type_hint", hint)) }
        var request = HTTPClientRequest(url: endpoint.url.absoluteString)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/x-www-form-urlencoded")
        request.headers.add(name: "Accept", value: "application/json")
        switch endpoint.authentication {
        case .none(let clientID):
            if let clientID { form.append(("client_id", clientID)) }
        case .clientSecretBasic(let clientID, let secret):
            // RFC 6749 §2.3.1: each part form-encoded, then joined and base64-encoded.
            let credentials = HTTPRules.formEncoded(clientID) + ":" + HTTPRules.formEncoded(secret)
            request.headers.add(name: "Authorization", value: "Basic " + Data(credentials.utf8).base64EncodedString())
        case .clientSecretPost(let clientID, let secret):
            form += [("client_id", clientID), ("client_secret", secret)]
        }
        request.body = .bytes(ByteBuffer(string: form.map { HTTPRules.formEncoded($0.0) + "=" + HTTPRules.formEncoded($0.1) }
            .joined(separator: "&")))
        let where_ = endpoint.url.host ?? endpoint.url.absoluteString
        let response: HTTPExchange
        do throws(HTTPExchangeError) {
            response = try await http.exchange(request, timeout: endpoint.timeout, maximumBodyBytes: 64 * 1024)
        } catch {
            // An answer too large to read is judged by its status all the same.
            guard let head = error.head else {
                guard error.isRetryable else { return .failed("revocation endpoint \(where_): \(error)") }
                return .retry("revocation endpoint \(where_) unreachable: \(error)", after: nil)
            }
            response = head
        }
        let body = response.body
        let status = Int(response.status.code)
        switch status {
        case 200..<300: return .done("revoked at \(where_)")
        // 408: a proxy or load balancer gave up waiting, not the endpoint refusing.
        case 408, 429, 500..<600:
            return .retry("revocation endpoint \(where_) answered \(status)",
                          after: response.headers.first(name: "Retry-After").flatMap(HTTPRules.retryAfter))
        default:
            let error = Self.oauthError(body)
            if error == "unsupported_token_type" {
                return .failed("revocation endpoint \(where_) does not revoke this token type (unsupported_token_type)")
            }
            return .failed("revocation endpoint \(where_) refused the request: \(status)\(error.map { " \($0)" } ?? "")"
                + (status == 401 || error == "invalid_client" ? " — check the client credentials" : ""))
        }
    }

    static func oauthError(_ body: ByteBuffer) -> String? {
        guard let value = try? JSONParser.parse(Array(body.readableBytesView)), let error = value.objectValue?["error"]?.stringValue,
              error.utf8.allSatisfy({ $0 >= 0x20 && $0 < 0x7F }), error.count <= 64 else { return nil }
        return error
    }

}

/// `notify`: POSTs the normalized event to the app as JSON, signed:
/// `Warden-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">` — the timestamp
/// lets the app refuse replays. `Warden-Event-ID` (`<iss> <jti>`) lets it ignore a repeat.
public struct WebhookNotifier: Sendable {
    public let http: any HTTPExchanging
    public let now: @Sendable () -> Double

    public init(http: any HTTPExchanging, now: (@Sendable () -> Double)? = nil) {
        self.http = http
        self.now = now ?? { Date().timeIntervalSince1970 }
    }

    public func notify(_ context: StepContext, eventType: String, at endpoint: WebhookEndpoint) async -> StepOutcome {
        let body = Self.body(context, eventType: eventType)
        let timestamp = String(Int(now()))
        let mac = HMAC<SHA256>.authenticationCode(for: Array((timestamp + "." + body).utf8), using: SymmetricKey(data: endpoint.hmacSecret))
        var request = HTTPClientRequest(url: endpoint.url.absoluteString)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        request.headers.add(name: "Warden-Signature", value: "t=\(timestamp),v1=" + mac.map { String(format: "%02x", $0) }.joined())
        request.headers.add(name: "Warden-Event-ID", value: Self.eventID(context.token))
        request.body = .bytes(ByteBuffer(string: body))
        let where_ = endpoint.url.host ?? endpoint.url.absoluteString
        let response: HTTPExchange
        do throws(HTTPExchangeError) {
            response = try await http.exchange(request, timeout: endpoint.timeout, maximumBodyBytes: 64 * 1024)
        } catch {
            // An answer too large to read is judged by its status all the same.
            guard let head = error.head else {
                guard error.isRetryable else { return .failed("webhook \(where_): \(error)") }
                return .retry("webhook \(where_) unreachable: \(error)", after: nil)
            }
            response = head
        }
        let status = Int(response.status.code)
        switch status {
        case 200..<300: return .done("webhook \(where_) answered \(status)")
        case 408, 429, 500..<600:
            return .retry("webhook \(where_) answered \(status)",
                          after: response.headers.first(name: "Retry-After").flatMap(HTTPRules.retryAfter))
        default: return .failed("webhook \(where_) refused the event: \(status)")
        }
    }

    /// `<iss> <jti>`, each with its bytes outside printable ASCII (and `%`) written `%XX`: a jti
    /// holding a line break is the signer's to choose, and the HTTP client refuses such a header
    /// before sending — a step that could never be sent, retried while the app waits.
    static func eventID(_ token: SecurityEventToken) -> String {
        func escaped(_ text: String) -> String { text.addingPercentEncoding(withAllowedCharacters: eventIDCharacters) ?? text }
        return escaped(token.issuer) + " " + escaped(token.jti)
    }

    /// Printable ASCII but `%` (space is the separator, so it is escaped too).
    static let eventIDCharacters = CharacterSet(charactersIn: Unicode.Scalar(0x21)...Unicode.Scalar(0x7E)).subtracting(CharacterSet(charactersIn: "%"))

    /// The normalized event: what happened, to whom, from whom. Never the raw token.
    static func body(_ context: StepContext, eventType: String) -> String {
        let token = context.token
        let event = token.events.first { Policy.key(for: $0.type) == eventType } ?? token.events.first
        var object = JSONObject()
        object["iss"] = .string(token.issuer)
        object["jti"] = .string(token.jti)
        object["iat"] = .number(token.issuedAt)
        object["event_type"] = .string(eventType)
        object["event"] = .string(event?.type.name ?? eventType)
        if let user = context.user { object["user"] = .string(user) }
        if let subject = event?.subject ?? token.primarySubject {
            // A token subject names a secret: only its redacted form leaves Warden.
            if case .oauthToken(let reference) = subject {
                object["subject"] = .object(["format": "oauth_token", "token_type": .string(reference.tokenType),
                                             "token_identifier_alg": .string(reference.identifierAlgorithm.rawValue),
                                             "token": .string(reference.redacted)])
            } else {
                object["subject"] = subject.json
            }
        }
        if let payload = event?.payload {
            var attributes = JSONObject()
            for member in payload.members where member.name != "subject" { attributes[member.name] = member.value }
            object["attributes"] = .object(attributes)
        }
        return JSONValue.object(object).jsonText
    }
}
