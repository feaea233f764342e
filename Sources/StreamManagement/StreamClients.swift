import AsyncHTTPClient
public import Foundation
public import HTTPExchange
import NIOCore
import NIOHTTP1
public import SecurityEvents

/// How a transmitter should deliver a stream's events.
public enum StreamDelivery: Sendable, Equatable {
    /// RFC 8935: the transmitter POSTs to our receiver at this URL.
    case push(endpointURL: String)
    /// RFC 8936: we poll the transmitter (at the URL it gives, or this one).
    case poll(endpointURL: String?)
}

/// One issuer's stream, as the configuration describes it.
public struct StreamSettings: Sendable {
    public enum API: String, Sendable { case google, ssf }

    public var issuer: String
    public var api: API
    /// Google: the RISC API's base URL (default `https://risc.googleapis.com`).
    public var endpoint: URL
    public var delivery: StreamDelivery?
    /// Event-type URIs to ask for.
    public var events: [String]
    /// SSF: a stream id pinned in the configuration (otherwise the one kept in the ledger).
    public var streamID: String?
    public var description: String?

    public init(issuer: String, api: API, endpoint: URL = URL(string: "https://risc.googleapis.com")!, delivery: StreamDelivery?,
                events: [String], streamID: String? = nil, description: String? = nil) {
        self.issuer = issuer
        self.api = api
        self.endpoint = endpoint
        self.delivery = delivery
        self.events = events
        self.streamID = streamID
        self.description = description
    }
}

/// One authenticated JSON call to a transmitter: the credentials' token, a deadline for the
/// whole exchange, and one retry with a new token when the transmitter says the token is invalid.
struct TransmitterCall: Sendable {
    let http: any HTTPExchanging
    let credentials: any StreamCredentials
    let timeout: Double
    /// The largest answer taken; a larger one is a failed call.
    var maximumAnswerBytes = 1 << 20

    struct Answer: Sendable {
        var status: Int
        var body: [UInt8]
        var headers: HTTPHeaders
        var json: JSONValue? { try? JSONParser.parse(body) }
    }

    /// `name` says which call this is, in errors ("stream:update", "read the stream status").
    /// `language`: the body's natural language (`Content-Language`), for one that holds text
    /// for people (RFC 8936 asks it with `setErrs`).
    func send(_ name: String, _ method: HTTPMethod, _ url: String, json: JSONValue? = nil, language: String? = nil) async throws(StreamError)
        -> Answer
    {
        var (answer, presented) = try await once(name, method, url, json: json, language: language)
        if answer.status == 401 {
            // A token the transmitter no longer takes (revoked, expired early): one new token, once.
            if await credentials.invalidate(presented) { answer = try await once(name, method, url, json: json, language: language).answer }
        }
        return answer
    }

    /// The answer, and the authorization it was asked with.
    private func once(_ name: String, _ method: HTTPMethod, _ url: String, json: JSONValue?, language: String?) async throws(StreamError)
        -> (answer: Answer, presented: String)
    {
        var request = HTTPClientRequest(url: url)
        request.method = method
        let presented = try await credentials.authorization()
        request.headers.add(name: "Authorization", value: presented)
        request.headers.add(name: "Accept", value: "application/json")
        if let json {
            request.headers.add(name: "Content-Type", value: "application/json")
            if let language { request.headers.add(name: "Content-Language", value: language) }
            request.body = .bytes(ByteBuffer(string: json.jsonText))
        }
        do {
            let exchange = try await http.exchange(request, timeout: timeout, maximumBodyBytes: maximumAnswerBytes)
            return (Answer(status: Int(exchange.status.code), body: Array(exchange.body.readableBytesView), headers: exchange.headers), presented)
        } catch {
            throw StreamError(.unavailable, "\(name): \(url) could not be reached: \(error)")
        }
    }
}

/// The seconds a `Retry-After` header asks to wait.
func retryAfter(_ headers: HTTPHeaders) -> Double? {
    headers.first(name: "Retry-After").flatMap(HTTPRules.retryAfter)
}

/// The error of a call the transmitter refused: the call, the status, what it means, and the
/// transmitter's own message when it gave one (never the request's token).
func refusal(_ name: String, _ answer: TransmitterCall.Answer, meaning: String) -> StreamError {
    var message = "\(name) failed: HTTP \(answer.status) — \(meaning)"
    if let object = answer.json?.objectValue {
        let detail = object["error"]?.objectValue?["message"]?.stringValue ?? object["error_description"]?.stringValue
            ?? object["description"]?.stringValue ?? object["error"]?.stringValue
        if let detail { message += " (the transmitter says: \(detail.prefix(300)))" }
    }
    return StreamError(.refused, message, status: answer.status, retryAfter: retryAfter(answer.headers))
}

/// What `warden stream` does to a stream, whichever API manages it.
public protocol StreamManager: Sendable {
    /// Creates the stream (Google: configures it), asking for the configured events and delivery.
    func create() async throws(StreamError) -> JSONValue
    /// Registers the configured events and delivery on the existing stream.
    func update() async throws(StreamError) -> JSONValue
    func get() async throws(StreamError) -> JSONValue
    func delete() async throws(StreamError)
    func status() async throws(StreamError) -> JSONValue
    func setStatus(enabled: Bool) async throws(StreamError) -> JSONValue
    /// Asks the transmitter to send a verification event carrying `state`.
    func verify(state: String) async throws(StreamError)
}

/// Google's RISC API (v1beta), with a service account's JWT on every call.
public struct GoogleRISCStream: StreamManager {
    public static let pushMethod = "https://schemas.openid.net/secevent/risc/delivery-method/push"

    let settings: StreamSettings
    let call: TransmitterCall

    public init(settings: StreamSettings, credentials: any StreamCredentials, http: any HTTPExchanging, timeout: Double) {
        self.settings = settings
        self.call = TransmitterCall(http: http, credentials: credentials, timeout: timeout)
    }

    private func url(_ path: String) -> String {
        var base = settings.endpoint.absoluteString
        while base.hasSuffix("/") { base.removeLast() }
        return base + path
    }

    /// Google's status table, in words a person can act on.
    static func meaning(_ status: Int) -> String {
        switch status {
        case 400: "a required field is missing or the body could not be parsed"
        case 401: "the service-account token was refused (missing, invalid or expired): check the key file and that the key is not deleted"
        case 403: """
            not allowed: the delivery URL must be https on one of the project's authorized domains; the service account needs \
            the roles/riscconfigs.admin role and the RISC API must be enabled; the project needs an OAuth client; \
            a Firebase-managed project cannot have a custom stream
            """
        case 404: "the project has no RISC configuration yet: run warden stream create first"
        case 429: "too many requests: try again later"
        default: status >= 500 ? "the RISC API failed: try again later" : "the RISC API refused the call"
        }
    }

    private func expect(_ name: String, _ answer: TransmitterCall.Answer) throws(StreamError) -> JSONValue {
        guard (200..<300).contains(answer.status) else { throw refusal(name, answer, meaning: Self.meaning(answer.status)) }
        return answer.body.isEmpty ? .object([:]) : (answer.json ?? .object([:]))
    }

    private func configuration() throws(StreamError) -> JSONValue {
        guard case .push(let endpointURL)? = settings.delivery else {
            throw StreamError(.configuration, "Google delivers RISC events only by push: give stream.delivery {method: push, endpoint-url: https://…}")
        }
        return .object([
            "delivery": .object(["delivery_method": .string(Self.pushMethod), "url": .string(endpointURL)]),
            "events_requested": .array(settings.events.map { .string($0) }),
        ])
    }

    public func create() async throws(StreamError) -> JSONValue {
        try expect("stream:update", try await call.send("stream:update", .POST, url("/v1beta/stream:update"), json: try configuration()))
    }

    public func update() async throws(StreamError) -> JSONValue { try await create() }

    public func get() async throws(StreamError) -> JSONValue {
        try expect("read the stream", try await call.send("read the stream", .GET, url("/v1beta/stream")))
    }

    public func delete() async throws(StreamError) {
        throw StreamError(.configuration, """
            the RISC API has no call that deletes a stream: use warden stream disable to stop deliveries \
            (nothing is sent or kept while disabled), or remove the configuration in the Google Cloud console
            """)
    }

    public func status() async throws(StreamError) -> JSONValue {
        try expect("read the stream status", try await call.send("read the stream status", .GET, url("/v1beta/stream/status")))
    }

    public func setStatus(enabled: Bool) async throws(StreamError) -> JSONValue {
        try expect("stream/status:update", try await call.send("stream/status:update", .POST, url("/v1beta/stream/status:update"),
                                                               json: .object(["status": .string(enabled ? "enabled" : "disabled")])))
    }

    public func verify(state: String) async throws(StreamError) {
        _ = try expect("stream:verify", try await call.send("stream:verify", .POST, url("/v1beta/stream:verify"),
                                                           json: .object(["state": .string(state)])))
    }
}

/// OpenID SSF 1.0 stream management: endpoints from the transmitter's
/// `/.well-known/ssf-configuration`, whose `issuer` must be the configured one; a stream whose
/// `iss` differs is refused and not used.
public struct SSFStream: StreamManager {
    public static let pushMethod = "urn:ietf:rfc:8935"
    public static let pollMethod = "urn:ietf:rfc:8936"

    /// The transmitter's metadata, as far as stream management uses it.
    public struct Metadata: Sendable {
        public var configurationEndpoint: String?
        public var statusEndpoint: String?
        public var verificationEndpoint: String?
    }

    let settings: StreamSettings
    let call: TransmitterCall
    /// The stream id to use when the configuration pins none (kept in the ledger).
    let storedStreamID: @Sendable () async throws(StreamError) -> String?
    /// Keeps the id of a stream just created (or forgets it: nil).
    let keepStreamID: @Sendable (String?) async throws(StreamError) -> Void
    /// Which http (not https) URLs the deployment allows at all (loopback hosts, for tests).
    let allowsHTTP: @Sendable (URL) -> Bool

    /// Whether the transmitter's credentials may be sent to `url`: https; http only to a host
    /// `allowsHTTP` accepts, named by a transmitter whose issuer is such a host itself. An https
    /// transmitter's answer naming `http://127.0.0.1:…` must not have the credentials sent in
    /// clear to whatever local process holds that port.
    func mayCarryCredentials(_ url: URL) -> Bool {
        guard url.host != nil else { return false }
        switch url.scheme?.lowercased() {
        case "https": return true
        case "http":
            guard let issuer = URL(string: settings.issuer), issuer.host != nil else { return false }
            return allowsHTTP(url) && allowsHTTP(issuer)
        default: return false
        }
    }

    public init(settings: StreamSettings, credentials: any StreamCredentials, http: any HTTPExchanging, timeout: Double,
                storedStreamID: @escaping @Sendable () async throws(StreamError) -> String?,
                keepStreamID: @escaping @Sendable (String?) async throws(StreamError) -> Void,
                allowsHTTP: @escaping @Sendable (URL) -> Bool) {
        self.settings = settings
        self.call = TransmitterCall(http: http, credentials: credentials, timeout: timeout)
        self.storedStreamID = storedStreamID
        self.keepStreamID = keepStreamID
        self.allowsHTTP = allowsHTTP
    }

    /// `GET host/.well-known/ssf-configuration` + the issuer's path (trailing `/` removed).
    public static func discoveryURL(issuer: String) -> URL? {
        guard var components = URLComponents(string: issuer), components.host != nil else { return nil }
        var path = components.path
        while path.hasSuffix("/") { path.removeLast() }
        components.path = "/.well-known/ssf-configuration" + path
        components.query = nil
        components.fragment = nil
        return components.url
    }

    public func metadata() async throws(StreamError) -> Metadata {
        guard let url = Self.discoveryURL(issuer: settings.issuer) else {
            throw StreamError(.configuration, "cannot derive the SSF discovery URL from the issuer \(settings.issuer)")
        }
        guard mayCarryCredentials(url) else {
            throw StreamError(.configuration, "the issuer \(settings.issuer) is not an https URL: the transmitter's credentials go only over https")
        }
        let answer = try await call.send("read the transmitter's configuration", .GET, url.absoluteString)
        guard answer.status == 200, let object = answer.json?.objectValue else {
            throw refusal("read the transmitter's configuration (\(url.absoluteString))", answer,
                          meaning: answer.status == 200 ? "the answer is not a JSON object" : "no SSF configuration there")
        }
        guard object["issuer"]?.stringValue == settings.issuer else {
            throw StreamError(.invalidAnswer, "the transmitter's configuration names the issuer \(object["issuer"]?.stringValue ?? "(none)"), not \(settings.issuer): not used")
        }
        func endpoint(_ name: String) throws(StreamError) -> String? {
            guard let text = object[name]?.stringValue else { return nil }
            guard let url = URL(string: text), mayCarryCredentials(url) else {
                throw StreamError(.invalidAnswer, "the transmitter's \(name) \(text) is not an https URL: not used")
            }
            return text
        }
        return Metadata(configurationEndpoint: try endpoint("configuration_endpoint"), statusEndpoint: try endpoint("status_endpoint"),
                        verificationEndpoint: try endpoint("verification_endpoint"))
    }

    static func meaning(_ status: Int) -> String {
        switch status {
        case 400: "the request was not understood"
        case 401: "the credentials were refused"
        case 403: "not allowed for these credentials"
        case 404: "no such stream (create one with warden stream create, or check stream-id)"
        case 409: "the transmitter allows one stream per receiver, and one exists: pin its id with stream-id, or delete it first"
        case 429: "too many requests: try again later"
        default: status >= 500 ? "the transmitter failed: try again later" : "the transmitter refused the call"
        }
    }

    private func endpoint(_ url: String?, _ name: String) throws(StreamError) -> String {
        guard let url else { throw StreamError(.configuration, "the transmitter's configuration has no \(name)") }
        return url
    }

    private func streamID() async throws(StreamError) -> String {
        if let pinned = settings.streamID { return pinned }
        guard let stored = try await storedStreamID() else {
            throw StreamError(.configuration, "no stream id: create the stream with warden stream create, or pin one with stream-id")
        }
        return stored
    }

    private func withID(_ url: String, _ id: String) -> String {
        var components = URLComponents(string: url)!
        components.queryItems = (components.queryItems ?? []) + [URLQueryItem(name: "stream_id", value: id)]
        return components.url!.absoluteString
    }

    /// A stream configuration from the transmitter, checked: an object whose `iss` is the issuer.
    /// `requiresIssuer`: a stream configuration (SSF 1.0 §8.1.1) names its `iss`; a status answer need not.
    private func checkedStream(_ name: String, _ answer: TransmitterCall.Answer, ok: Set<Int>,
                               requiresIssuer: Bool = false) throws(StreamError) -> JSONValue {
        guard ok.contains(answer.status) else { throw refusal(name, answer, meaning: Self.meaning(answer.status)) }
        guard let object = answer.json?.objectValue else { throw StreamError(.invalidAnswer, "\(name): the answer is not a JSON object") }
        guard let value = object["iss"] else {
            if requiresIssuer { throw StreamError(.invalidAnswer, "\(name): the answer has no iss: refused and not used") }
            return .object(object)
        }
        // Present, it is the issuer's, byte for byte: a number or a list is no issuer.
        guard let iss = value.stringValue, sameName(iss, settings.issuer) else {
            throw StreamError(.invalidAnswer, "\(name): the stream's iss is \(value.jsonText.prefix(200)), not \(settings.issuer): refused and not used")
        }
        return .object(object)
    }

    private func deliveryObject() -> JSONValue {
        switch settings.delivery {
        case .push(let endpointURL)?: .object(["method": .string(Self.pushMethod), "endpoint_url": .string(endpointURL)])
        case .poll?, nil: .object(["method": .string(Self.pollMethod)])
        }
    }

    public func create() async throws(StreamError) -> JSONValue {
        let configuration = try endpoint(try await metadata().configurationEndpoint, "configuration_endpoint")
        var body: JSONObject = ["events_requested": .array(settings.events.map { .string($0) }), "delivery": deliveryObject()]
        if let description = settings.description { body["description"] = .string(description) }
        let answer = try await call.send("create the stream", .POST, configuration, json: .object(body))
        let stream = try checkedStream("create the stream", answer, ok: [200, 201], requiresIssuer: true)
        guard let id = stream.objectValue?["stream_id"]?.stringValue, !id.isEmpty else {
            throw StreamError(.invalidAnswer, "create the stream: the answer has no stream_id")
        }
        if settings.streamID == nil {
            // The stream exists at the transmitter now: its id must reach the operator even when
            // the ledger cannot keep it (creating it again is refused with 409).
            do throws(StreamError) {
                try await keepStreamID(id)
            } catch {
                throw StreamError(error.kind, "the transmitter created the stream \(id.prefix(200).debugDescription), but the ledger could not keep "
                                  + "its id (\(error.message)); set stream-id: \(id.prefix(200).debugDescription) in the configuration to use it")
            }
        }
        return stream
    }

    public func update() async throws(StreamError) -> JSONValue {
        let configuration = try endpoint(try await metadata().configurationEndpoint, "configuration_endpoint")
        let body: JSONObject = ["stream_id": .string(try await streamID()), "events_requested": .array(settings.events.map { .string($0) }),
                                "delivery": deliveryObject()]
        let answer = try await call.send("update the stream", .PATCH, configuration, json: .object(body))
        // 202: accepted, to take effect later (SSF); the answer need not hold the configuration.
        if answer.status == 202, answer.body.allSatisfy({ [0x20, 0x09, 0x0A, 0x0D].contains($0) }) { return .object([:]) }
        return try checkedStream("update the stream", answer, ok: [200, 202])
    }

    public func get() async throws(StreamError) -> JSONValue {
        let configuration = try endpoint(try await metadata().configurationEndpoint, "configuration_endpoint")
        let url = withID(configuration, try await streamID())
        return try checkedStream("read the stream", try await call.send("read the stream", .GET, url), ok: [200], requiresIssuer: true)
    }

    public func delete() async throws(StreamError) {
        let configuration = try endpoint(try await metadata().configurationEndpoint, "configuration_endpoint")
        let answer = try await call.send("delete the stream", .DELETE, withID(configuration, try await streamID()))
        guard (200..<300).contains(answer.status) else { throw refusal("delete the stream", answer, meaning: Self.meaning(answer.status)) }
        if settings.streamID == nil { try await keepStreamID(nil) }
    }

    public func status() async throws(StreamError) -> JSONValue {
        let statusEndpoint = try endpoint(try await metadata().statusEndpoint, "status_endpoint")
        let answer = try await call.send("read the stream status", .GET, withID(statusEndpoint, try await streamID()))
        return try checkedStream("read the stream status", answer, ok: [200])
    }

    public func setStatus(enabled: Bool) async throws(StreamError) -> JSONValue {
        let statusEndpoint = try endpoint(try await metadata().statusEndpoint, "status_endpoint")
        let body: JSONObject = ["stream_id": .string(try await streamID()), "status": .string(enabled ? "enabled" : "disabled")]
        let answer = try await call.send("set the stream status", .POST, statusEndpoint, json: .object(body))
        guard (200..<300).contains(answer.status) else { throw refusal("set the stream status", answer, meaning: Self.meaning(answer.status)) }
        return answer.json ?? .object(body)
    }

    public func verify(state: String) async throws(StreamError) {
        let verification = try endpoint(try await metadata().verificationEndpoint, "verification_endpoint")
        let body: JSONObject = ["stream_id": .string(try await streamID()), "state": .string(state)]
        let answer = try await call.send("request a verification event", .POST, verification, json: .object(body))
        guard (200..<300).contains(answer.status) else {
            throw refusal("request a verification event", answer, meaning: Self.meaning(answer.status))
        }
    }

    /// Where to poll this stream's events (RFC 8936): the configured URL, else the one the
    /// transmitter gave in the stream's delivery.
    public func pollEndpoint() async throws(StreamError) -> String {
        if case .poll(let configured?)? = settings.delivery { return configured }
        let stream = try await get()
        guard let delivery = stream.objectValue?["delivery"]?.objectValue, let url = delivery["endpoint_url"]?.stringValue else {
            throw StreamError(.invalidAnswer, "the stream's delivery names no endpoint_url to poll")
        }
        // The credentials go with every poll: only over https (http on loopback, for tests).
        guard let parsed = URL(string: url), mayCarryCredentials(parsed) else {
            throw StreamError(.invalidAnswer, "the stream's poll endpoint \(url) is not an https URL: not used")
        }
        return url
    }
}
