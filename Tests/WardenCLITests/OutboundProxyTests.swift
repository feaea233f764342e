import AsyncHTTPClient
import Foundation
import HTTPExchange
import SETMinting
import Testing
import WardenCLI
import WardenTestSupport

@Suite("Outgoing calls through an HTTPS proxy")
struct OutboundProxyTests {
    // MARK: The environment's variables

    @Test func proxyURLsAreReadWithTheirCredentials() throws {
        let full = try ProxySettings(environment: ["HTTPS_PROXY": "http://warden:p%40ss@proxy.corp.example:3128/"])
        #expect(full.https == ProxySettings.Proxy(host: "proxy.corp.example", port: 3128, username: "warden", password: "p@ss"))
        #expect(full.https?.description == "proxy.corp.example:3128 (with credentials)")
        let bare = try ProxySettings(environment: ["https_proxy": "proxy.corp.example:8080"])
        #expect(bare.https == ProxySettings.Proxy(host: "proxy.corp.example", port: 8080))
        let upperWins = try ProxySettings(environment: ["HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2"])
        #expect(upperWins.https?.host == "upper")
        let v6 = try ProxySettings(environment: ["HTTPS_PROXY": "http://[fd00::5]:3128"])
        #expect(v6.https?.host == "fd00::5" && v6.https?.description == "[fd00::5]:3128")
        #expect(try ProxySettings(environment: ["HTTPS_PROXY": "  ", "HTTP_PROXY": "http://ignored:1"]) == .direct)
    }

    @Test func unusableProxyVariablesAreRefusedWithoutTheirSecrets() throws {
        for (value, expected) in [("https://warden:hunter2@proxy:3128", "reached over TLS"),
                                  ("socks5://warden:hunter2@proxy:1080", "socks5:// proxies are not supported"),
                                  ("http://warden:hunter2@proxy:3128/path", "no path"),
                                  ("http://warden:hunter2@:3128", "no proxy host"),
                                  ("http://proxy:99999", "out of range")] {
            #expect {
                _ = try ProxySettings(environment: ["https_proxy": value])
            } throws: { error in
                let text = "\(error)"
                return text.hasPrefix("https_proxy: ") && text.contains(expected) && !text.contains("hunter2")
            }
        }
        #expect(throws: ProxySettings.Invalid.self) { _ = try ProxySettings(environment: ["NO_PROXY": "10.0.0.0/33"]) }
        #expect(throws: ProxySettings.Invalid.self) { _ = try ProxySettings(environment: ["no_proxy": "example.com:http"]) }
        #expect(throws: ProxySettings.Invalid.self) { _ = try ProxySettings(environment: ["NO_PROXY": "*example.com"]) }
        #expect(throws: ProxySettings.Invalid.self) { _ = try ProxySettings(environment: ["NO_PROXY": "*:443"]) }
        // Decoded once: %2541 is a literal %41.
        #expect(try ProxySettings(environment: ["HTTPS_PROXY": "http://u:a%2541b@proxy:1"]).https?.password == "a%41b")
    }

    @Test func noProxyChoosesWhichHostsGoDirect() throws {
        func route(_ noProxy: String, _ url: String) throws -> String {
            let settings = try ProxySettings(environment: ["HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": noProxy])
            return settings.proxy(for: url) == nil ? "direct" : "proxy"
        }
        // Without an exemption, every https host goes through the proxy; loopback never does,
        // and plain http (loopback only in a configuration) never does.
        #expect(try route("", "https://risc.googleapis.com/v1beta/stream") == "proxy")
        #expect(try route("", "https://127.0.0.1:8443/certs") == "direct")
        #expect(try route("", "https://[::1]:8443/certs") == "direct")
        #expect(try route("", "https://localhost/certs") == "direct")
        #expect(try route("", "https://[0:0:0:0:0:0:0:1]/certs") == "direct")
        #expect(try route("", "https://localhost.example.com/certs") == "proxy")
        #expect(try route("", "http://127.0.0.1:8080/hook") == "direct")
        // Domains, with or without a leading dot or *., match the name and what is under it.
        for entry in ["example.com", ".example.com", "*.example.com", "EXAMPLE.COM."] {
            #expect(try route("internal, \(entry)", "https://example.com/x") == "direct", "\(entry)")
            #expect(try route(entry, "https://keys.example.com/x") == "direct", "\(entry)")
            #expect(try route(entry, "https://notexample.com/x") == "proxy", "\(entry)")
            #expect(try route(entry, "https://example.com.evil.net/x") == "proxy", "\(entry)")
        }
        // Addresses and blocks, IPv4 and IPv6; a name never matches an address rule.
        #expect(try route("10.0.0.0/8", "https://10.20.30.40/x") == "direct")
        #expect(try route("10.0.0.0/8", "https://11.0.0.1/x") == "proxy")
        #expect(try route("10.0.0.0/8", "https://10.example.com/x") == "proxy")
        #expect(try route("192.168.1.7", "https://192.168.1.7/x") == "direct")
        #expect(try route("192.168.1.7", "https://192.168.1.8/x") == "proxy")
        #expect(try route("fd00::/8", "https://[fd12::1]/x") == "direct")
        #expect(try route("fd00::/8", "https://[fe80::1]/x") == "proxy")
        #expect(try route("[fd00::1]:8443", "https://[fd00::1]:8443/x") == "direct")
        #expect(try route("[fd00::1]:8443", "https://[fd00::1]/x") == "proxy")
        // A port narrows an entry to that port; the default port is 443.
        #expect(try route("keys.example.com:8443", "https://keys.example.com:8443/x") == "direct")
        #expect(try route("keys.example.com:8443", "https://keys.example.com/x") == "proxy")
        #expect(try route("keys.example.com:443", "https://keys.example.com/x") == "direct")
        #expect(try route("*", "https://anything.example/x") == "direct")
    }

    @Test func theClientChosenFollowsTheRoute() async throws {
        let settings = try ProxySettings(environment: ["HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "corp.example"])
        let outbound = OutboundHTTP(configuration: .init(), proxies: settings)
        let proxied = outbound.client(for: "https://risc.googleapis.com/")
        let direct = outbound.client(for: "https://keys.corp.example/")
        #expect(proxied !== direct)
        #expect(outbound.client(for: "https://127.0.0.1/") === direct)
        #expect(outbound.client(for: "https://accounts.google.com/") === proxied)
        try await outbound.shutdown()
        let none = OutboundHTTP(configuration: .init(), proxies: .direct)
        #expect(none.client(for: "https://risc.googleapis.com/") === none.client(for: "https://127.0.0.1/"))
        try await none.shutdown()
    }

    // MARK: Through a real tunnel

    /// Keys published at `https://keys.warden.test/…`, a name no resolver knows: the proxy
    /// tunnels it to an `openssl s_server` whose certificate the test CA issued for that name.
    @Test func keysAreFetchedThroughTheProxyUnlessNoProxyExemptsTheirHost() async throws {
        let key = try SigningKey.rsa(keyID: "proxied", algorithm: "RS256")
        let certificates = try await TestCertificates.shared()
        let pair = try await certificates.issue("keys-warden-test-\(UUID().uuidString.prefix(6))",
                                                subjectAlternativeNames: ["DNS:keys.warden.test"])
        let dir = try Warden.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: dir) }
        try SETMinter.jwks([key]).write(to: dir.appendingPathComponent("certs.json"), atomically: true, encoding: .utf8)
        let server = try await StaticHTTPSServer.start(serving: dir, certificate: pair)
        defer { server.stop() }
        let port = server.port

        let open = try await ConnectProxy.start(routes: ["keys.warden.test:443": port])
        defer { open.stop() }
        let guarded = try await ConnectProxy.start(routes: ["keys.warden.test:443": port], credentials: ("warden", "s3cret-pass"))
        defer { guarded.stop() }

        let issuer = "https://keys.warden.test/"
        let audience = "proxy-test-audience"
        let token = try SETMinter.token(claims: SETMinter.riscClaims(issuer: issuer, audience: audience, event: .sessionsRevoked), key: key)
        let config = dir.appendingPathComponent("warden.yaml")
        try """
        issuers:
          - issuer: \(issuer)
            jwks-uri: https://keys.warden.test/certs.json
            audiences: [\(audience)]
            fetch-timeout: 3s
        http-client: {ca-file: \(certificates.caFile)}
        """.write(to: config, atomically: true, encoding: .utf8)
        func verify(_ environment: [String: String]) async throws -> ProgramOutput {
            try await Warden.run(["verify", "--config", config.path, token],
                                 environment: ["HTTPS_PROXY": "", "https_proxy": "", "NO_PROXY": "", "no_proxy": ""].merging(environment) { $1 })
        }

        // Through the proxy: the name resolves nowhere else, and the proxy saw the tunnel.
        let proxied = try await verify(["HTTPS_PROXY": open.url])
        #expect(proxied.status == 0, "\(proxied.stdout) \(proxied.stderr)")
        #expect(open.requests == ["CONNECT keys.warden.test:443 auth=no"])

        // NO_PROXY exempts the domain: the call goes direct, finds no such host, and the proxy
        // sees nothing more.
        let exempt = try await verify(["HTTPS_PROXY": open.url, "NO_PROXY": "localhost,.warden.test"])
        #expect(exempt.status == 3, "\(exempt.stdout) \(exempt.stderr)")
        #expect(open.requests.count == 1)

        // A proxy that asks for credentials: given in the URL, they are sent; wrong, refused.
        let authorized = try await verify(["https_proxy": "http://warden:s3cret-pass@127.0.0.1:\(guarded.port)"])
        #expect(authorized.status == 0, "\(authorized.stdout) \(authorized.stderr)")
        let refused = try await verify(["https_proxy": "http://warden:Wr0ng-x9q@127.0.0.1:\(guarded.port)"])
        #expect(refused.status == 3, "\(refused.stdout) \(refused.stderr)")
        #expect(!refused.stdout.contains("Wr0ng-x9q") && !refused.stderr.contains("Wr0ng-x9q"))
        #expect(guarded.requests.allSatisfy { $0 == "CONNECT keys.warden.test:443 auth=yes" } && guarded.requests.count >= 2)

        // A proxy Warden cannot use is a configuration error at start, without its password.
        let unusable = try await verify(["HTTPS_PROXY": "https://warden:s3cret-pass@proxy.example:3128"])
        #expect(unusable.status == 2 && unusable.stderr.contains("HTTPS_PROXY") && !unusable.stderr.contains("s3cret"), "\(unusable.stderr)")
    }
}
