public import Foundation
public import AsyncHTTPClient
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A URL's text as logs and errors show it, parsed or not (a configured value refused): what
/// may be a user and password (before an `@` in the authority) is left out, and the query and
/// fragment (a `?token=…`, an `?api_key=…`) are only said to be there.
public func shownURL(_ text: String) -> String {
    var rest = Substring(text)
    var hidden = ""
    if let end = rest.firstIndex(where: { $0 == "?" || $0 == "#" }) {
        hidden = rest[end] == "?" ? "?…" : ""
        rest = rest[..<end]
    }
    let authorityStart = rest.range(of: "://")?.upperBound ?? rest.startIndex
    let authority = rest[authorityStart...].prefix { $0 != "/" }
    if let at = authority.lastIndex(of: "@") {
        rest = rest[..<authorityStart] + rest[rest.index(after: at)...]
    }
    return String(rest.prefix(200)) + hidden
}

/// `shownURL` of a parsed URL.
public func shownURL(_ url: URL) -> String { shownURL(url.absoluteString) }

/// What sends an outgoing request and reads its whole answer: a plain `HTTPClient`, or
/// `OutboundHTTP`, which chooses a direct or a proxied client by each request's host.
public protocol HTTPExchanging: Sendable {
    func exchange(_ request: HTTPClientRequest, timeout: Double, maximumBodyBytes: Int) async throws(HTTPExchangeError)
        -> HTTPExchange
}

extension HTTPClient: HTTPExchanging {}

/// Every outgoing call Warden makes (keys, discovery, revoke, webhook, stream, poll, credentials):
/// direct, or through the environment's HTTPS proxy unless `NO_PROXY` (or loopback) exempts its
/// host. One client per route, each with the same TLS and redirect
/// settings, so connection pools never mix a proxied and a direct connection.
public final class OutboundHTTP: HTTPExchanging {
    public let proxies: ProxySettings
    private let direct: HTTPClient
    /// Through `proxies.https`; nil without one.
    private let proxied: HTTPClient?

    public init(configuration: HTTPClient.Configuration, proxies: ProxySettings) {
        self.proxies = proxies
        direct = HTTPClient(eventLoopGroupProvider: .singleton, configuration: configuration)
        proxied = proxies.https.map { proxy in
            var viaProxy = configuration
            viaProxy.proxy = .server(host: proxy.host, port: proxy.port,
                                     authorization: proxy.username.map { .basic(username: $0, password: proxy.password ?? "") })
            return HTTPClient(eventLoopGroupProvider: .singleton, configuration: viaProxy)
        }
    }

    /// The client a request to `url` goes through.
    public func client(for url: String) -> HTTPClient {
        proxies.proxy(for: url) != nil ? proxied ?? direct : direct
    }

    public func exchange(_ request: HTTPClientRequest, timeout: Double, maximumBodyBytes: Int) async throws(HTTPExchangeError)
        -> HTTPExchange
    {
        try await client(for: request.url).exchange(request, timeout: timeout, maximumBodyBytes: maximumBodyBytes)
    }

    /// Closes every client's connections; the first failure is thrown after all were asked.
    public func shutdown() async throws {
        var failure: (any Error)?
        for client in [direct] + [proxied].compactMap({ $0 }) {
            do { try await client.shutdown() } catch { failure = failure ?? error }
        }
        if let failure { throw failure }
    }
}

/// The proxy the environment names for `https:` URLs, `HTTPS_PROXY` (or `https_proxy`; the
/// upper-case name wins), and the hosts `NO_PROXY` (or `no_proxy`) exempts. Plain `http:` is
/// accepted only for loopback endpoints, which never go through a proxy, so `HTTP_PROXY` is not
/// read.
///
/// A proxy is spoken to in plain HTTP (`http://[user:password@]host:port`, or `host:port`): an
/// `https:` request goes through it in a `CONNECT` tunnel, TLS end to end with the endpoint, so
/// the endpoint's certificate is checked as without a proxy. Loopback hosts never go through a
/// proxy: the proxy's own loopback is never the one meant.
public struct ProxySettings: Sendable, Equatable {
    public struct Proxy: Sendable, Hashable, CustomStringConvertible {
        public var host: String
        public var port: Int
        public var username: String?
        public var password: String?

        public init(host: String, port: Int, username: String? = nil, password: String? = nil) {
            self.host = host
            self.port = port
            self.username = username
            self.password = password
        }

        /// Host and port; credentials are never shown.
        public var description: String {
            (host.contains(":") ? "[\(host)]" : host) + ":\(port)" + (username == nil ? "" : " (with credentials)")
        }
    }

    /// A variable that could not be used, with why (never its credentials).
    public struct Invalid: Error, Sendable, CustomStringConvertible {
        public var variable: String
        public var message: String
        public var description: String { "\(variable): \(message)" }
    }

    public var https: Proxy?
    public var bypass: NoProxy

    public init(https: Proxy? = nil, bypass: NoProxy = NoProxy()) {
        self.https = https
        self.bypass = bypass
    }

    /// No proxy at all.
    public static let direct = ProxySettings()

    public init(environment: [String: String]) throws(Invalid) {
        func value(_ name: String) -> (name: String, value: String)? {
            for candidate in [name, name.lowercased()] {
                if let text = environment[candidate]?.trimmingCharacters(in: .whitespaces), !text.isEmpty { return (candidate, text) }
            }
            return nil
        }
        self.init()
        if let (name, text) = value("HTTPS_PROXY") { https = try Self.proxy(text, variable: name) }
        if let (name, text) = value("NO_PROXY") {
            do { bypass = try NoProxy(text) } catch { throw Invalid(variable: name, message: error.message) }
        }
    }

    /// The proxy a request to `url` goes through; nil: direct.
    public func proxy(for url: String) -> Proxy? {
        guard let https else { return nil }
        // A URL whose host cannot be read goes to the proxy, never around it.
        guard let components = URLComponents(string: url), let host = components.host, !host.isEmpty else { return https }
        guard components.scheme?.lowercased() == "https" else { return nil }
        return bypass.exempts(host: host, port: components.port ?? 443) ? nil : https
    }

    /// `http://[user:password@]host[:port][/]` or `host:port`.
    static func proxy(_ text: String, variable: String) throws(Invalid) -> Proxy {
        let withScheme = text.contains("://") ? text : "http://" + text
        guard let components = URLComponents(string: withScheme), let scheme = components.scheme?.lowercased() else {
            throw Invalid(variable: variable, message: "not a proxy URL; give http://host:port")
        }
        guard scheme == "http" else {
            let why = scheme == "https"
                ? "a proxy reached over TLS (https://) is not supported; give http://host:port — requests to https endpoints still go through it in a CONNECT tunnel, TLS end to end"
                : "\(scheme):// proxies are not supported; give http://host:port"
            throw Invalid(variable: variable, message: why)
        }
        guard let host = components.host, !host.isEmpty else {
            throw Invalid(variable: variable, message: "no proxy host; give http://host:port")
        }
        guard components.path.isEmpty || components.path == "/", components.query == nil, components.fragment == nil else {
            throw Invalid(variable: variable, message: "a proxy URL has no path, query or fragment; give http://host:port")
        }
        let port = components.port ?? 80
        guard (1...65535).contains(port) else { throw Invalid(variable: variable, message: "port \(port) is out of range") }
        let bare = host.hasPrefix("[") && host.hasSuffix("]") ? String(host.dropFirst().dropLast()) : host
        // `user` and `password` are already percent-decoded.
        return Proxy(host: bare, port: port, username: components.user, password: components.password)
    }
}

/// `NO_PROXY`: hosts reached directly, as a comma-separated list — `*` (every host), a domain
/// (`example.com` and `.example.com` both match the domain and every name under it; `*.` is
/// read as `.`), an IP address or a CIDR block (`10.0.0.0/8`, `fd00::/8`), each optionally with
/// `:port` (`[v6]:port` for IPv6) to exempt that port alone. Loopback (`HTTPRules.isLoopback`)
/// is always exempt.
public struct NoProxy: Sendable, Equatable {
    enum Rule: Sendable, Equatable {
        case everything
        case domain(String, port: Int?)
        case network(address: [UInt8], prefix: Int, port: Int?)
    }

    public struct Invalid: Error, Sendable {
        public var message: String
    }

    var rules: [Rule]

    public init() { rules = [] }

    public init(_ text: String) throws(Invalid) {
        rules = []
        for raw in text.split(separator: ",") {
            let entry = raw.trimmingCharacters(in: .whitespaces).lowercased()
            if entry.isEmpty { continue }
            if entry == "*" { rules.append(.everything); continue }
            guard !entry.contains(where: \.isWhitespace) else { throw Invalid(message: "\"\(entry)\" is not a host, domain or address") }
            rules.append(try Self.rule(entry))
        }
    }

    private static func rule(_ entry: String) throws(Invalid) -> Rule {
        var host = entry
        var port: Int?
        if entry.hasPrefix("[") {
            guard let close = entry.firstIndex(of: "]") else { throw Invalid(message: "\"\(entry)\": no closing ]") }
            host = String(entry[entry.index(after: entry.startIndex)..<close])
            let rest = entry[entry.index(after: close)...]
            if !rest.isEmpty {
                guard rest.hasPrefix(":"), let number = Int(rest.dropFirst()) else { throw Invalid(message: "\"\(entry)\": a port must follow ]:") }
                port = number
            }
        } else if entry.filter({ $0 == ":" }).count == 1, let colon = entry.firstIndex(of: ":") {
            guard let number = Int(entry[entry.index(after: colon)...]) else { throw Invalid(message: "\"\(entry)\": the port is not a number") }
            host = String(entry[..<colon])
            port = number
        }
        if let port, !(1...65535).contains(port) { throw Invalid(message: "\"\(entry)\": port \(port) is out of range") }
        if let slash = host.firstIndex(of: "/") {
            guard let address = ipAddress(String(host[..<slash])), let prefix = Int(host[host.index(after: slash)...]),
                  (0...(address.count * 8)).contains(prefix)
            else { throw Invalid(message: "\"\(entry)\" is not a CIDR block (address/prefix)") }
            return .network(address: address, prefix: prefix, port: port)
        }
        if let address = ipAddress(host) { return .network(address: address, prefix: address.count * 8, port: port) }
        var domain = host
        if domain.hasPrefix("*.") { domain.removeFirst() }
        guard !domain.contains("*") else { throw Invalid(message: "\"\(entry)\": * stands alone or begins *.domain") }
        while domain.hasPrefix(".") { domain.removeFirst() }
        while domain.hasSuffix(".") { domain.removeLast() }
        guard !domain.isEmpty else { throw Invalid(message: "\"\(entry)\" names no domain") }
        return .domain(domain, port: port)
    }

    /// Whether a request to `host` on `port` goes direct.
    public func exempts(host rawHost: String, port: Int) -> Bool {
        var host = rawHost.lowercased()
        if host.hasPrefix("["), host.hasSuffix("]") { host = String(host.dropFirst().dropLast()) }
        while host.hasSuffix(".") { host.removeLast() }
        if HTTPRules.isLoopback(host) { return true }
        let address = Self.ipAddress(host)
        return rules.contains { rule in
            switch rule {
            case .everything:
                return true
            case .domain(let domain, let rulePort):
                guard rulePort == nil || rulePort == port, address == nil else { return false }
                return host == domain || host.hasSuffix("." + domain)
            case .network(let network, let prefix, let rulePort):
                guard rulePort == nil || rulePort == port, let address, address.count == network.count else { return false }
                return Self.prefix(of: address, matches: network, bits: prefix)
            }
        }
    }

    static func prefix(of address: [UInt8], matches network: [UInt8], bits: Int) -> Bool {
        var remaining = bits
        for (a, n) in zip(address, network) where remaining > 0 {
            let mask: UInt8 = remaining >= 8 ? 0xFF : ~(0xFF >> UInt8(remaining))
            if a & mask != n & mask { return false }
            remaining -= 8
        }
        return true
    }

    /// The bytes of an IPv4 or IPv6 address in text; nil when the text is not one.
    static func ipAddress(_ text: String) -> [UInt8]? {
        var v4 = in_addr()
        if inet_pton(AF_INET, text, &v4) == 1 { return withUnsafeBytes(of: &v4) { Array($0) } }
        var v6 = in6_addr()
        if inet_pton(AF_INET6, text, &v6) == 1 { return withUnsafeBytes(of: &v6) { Array($0) } }
        return nil
    }
}
