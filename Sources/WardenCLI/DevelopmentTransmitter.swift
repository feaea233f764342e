public import ArgumentParser
import AsyncHTTPClient
import Foundation
import Hummingbird
import Kafka
import Logging
import NIOCore
import SETMinting
import SecurityEvents
import ServiceLifecycle
import Synchronization
import TokenVerification

/// The development transmitter's key and who it signs as, kept in one file of its folder
/// (`dev-keys.json`, readable by its owner only) beside the public `jwks.json`.
struct DevelopmentKeys {
    static let fileName = "dev-keys.json"
    static let defaultIssuer = "https://dev-transmitter.warden.localhost/"
    static let defaultAudience = "warden-dev"

    var issuer: String
    var audience: String
    var key: SigningKey

    var jwks: String { SETMinter.jwks([key]) }

    /// Reads the folder's keys; nil when it has none yet.
    static func load(from directory: URL) throws(ConfigError) -> DevelopmentKeys? {
        let file = directory.appendingPathComponent(fileName)
        guard let data = FileManager.default.contents(atPath: file.path) else { return nil }
        guard let object = (try? JSONParser.parse(Array(data)))?.objectValue,
              let issuer = object["issuer"]?.stringValue, let audience = object["audience"]?.stringValue,
              let keyID = object["kid"]?.stringValue, let pem = object["private_key"]?.stringValue,
              let key = try? SigningKey.rsa(keyID: keyID, pkcs8PEM: pem) else {
            throw ConfigError(path: "", "\(file.path) is not a development key file (remove it to make a new one)")
        }
        return DevelopmentKeys(issuer: issuer, audience: audience, key: key)
    }

    /// The folder's keys, made (RSA 2048, RS256) and written when it has none.
    static func loadOrCreate(in directory: URL, issuer: String, audience: String) throws -> (keys: DevelopmentKeys, created: Bool) {
        if let existing = try load(from: directory) { return (existing, false) }
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let keys = DevelopmentKeys(issuer: issuer, audience: audience,
                                   key: try SigningKey.rsa(keyID: "dev-" + UUID().uuidString.prefix(8).lowercased()))
        let secret: JSONValue = .object([
            "issuer": .string(issuer), "audience": .string(audience), "kid": .string(keys.key.keyID),
            "private_key": .string(keys.key.privateKeyPEM!),
        ])
        let file = directory.appendingPathComponent(fileName)
        // Created readable by its owner only, from the start.
        let descriptor = open(file.path, O_WRONLY | O_CREAT | O_EXCL, 0o600)
        guard descriptor >= 0 else { throw ConfigError(path: "", "cannot create \(file.path): \(String(cString: strerror(errno)))") }
        let bytes = Array(secret.jsonText.utf8)
        let written = bytes.withUnsafeBytes { write(descriptor, $0.baseAddress, $0.count) }
        close(descriptor)
        guard written == bytes.count else { throw ConfigError(path: "", "cannot write \(file.path)") }
        try (keys.jwks + "\n").write(to: directory.appendingPathComponent("jwks.json"), atomically: true, encoding: .utf8)
        return (keys, true)
    }
}

extension WardenCommand {
    /// `warden dev-keys`: a development transmitter's key pair, and its JWKS and discovery
    /// documents served on loopback.
    public struct DevKeys: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            commandName: "dev-keys",
            abstract: "Makes a development transmitter's key pair (kept in --dir) and serves its JWKS and discovery on loopback.",
            discussion: """
            Writes DIR/dev-keys.json (the private key, readable by its owner only) and DIR/jwks.json (the public key) \
            unless they exist; a configuration names the issuer it prints with jwks-file: DIR/jwks.json, or, while this \
            command serves, discovery: or jwks-uri: at the printed address. With --no-serve it exits once the files exist. \
            For development only: these keys must never be trusted in production.
            """
        )

        @Option(name: .long, help: "Where the key files are kept.")
        var dir: String = ".warden/dev-keys"

        @Option(name: .long, help: "The issuer the tokens name (only when the keys are made).")
        var issuer: String = DevelopmentKeys.defaultIssuer

        @Option(name: .long, help: "The audience the tokens name (only when the keys are made).")
        var audience: String = DevelopmentKeys.defaultAudience

        @Option(name: .long, help: "host:port to serve on (loopback only; port 0 picks a free one).")
        var listen: String = "127.0.0.1:0"

        @Flag(name: .long, help: "Make the files and exit, serving nothing.")
        var noServe = false

        public init() {}

        public func run() async throws {
            let keys: DevelopmentKeys
            do {
                let directory = URL(fileURLWithPath: dir)
                let (loaded, created) = try DevelopmentKeys.loadOrCreate(in: directory, issuer: issuer, audience: audience)
                keys = loaded
                announce("dev-keys: \(created ? "made" : "kept") \(directory.appendingPathComponent(DevelopmentKeys.fileName).path) (kid \(keys.key.keyID))")
                announce("dev-keys: issuer \(keys.issuer), audience \(keys.audience), jwks-file \(directory.appendingPathComponent("jwks.json").path)")
            } catch {
                standardError("warden: \(error)\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            guard !noServe else { return }
            guard let (host, port) = HTTPSettings.parseListen(listen), URLRule.isLoopback(host) || host == "localhost" else {
                standardError("warden: --listen \(listen) is not a loopback host:port\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            let router = Router()
            let jwks = keys.jwks
            router.get("jwks.json") { _, _ in
                Response(status: .ok, headers: [.contentType: "application/json"], body: .init(byteBuffer: ByteBuffer(string: jwks)))
            }
            var logger = Logger(label: "warden")
            logger.logLevel = .error
            let boundPort = PortBox()
            for name in ["risc-configuration", "ssf-configuration"] {
                router.get(RouterPath(".well-known/" + name)) { _, _ in
                    let base = "http://\(host):\(boundPort.value)"
                    let document: JSONValue = .object([
                        "issuer": .string(keys.issuer), "jwks_uri": .string(base + "/jwks.json"),
                        "delivery_methods_supported": ["urn:ietf:rfc:8935"],
                    ])
                    return Response(status: .ok, headers: [.contentType: "application/json"],
                                    body: .init(byteBuffer: ByteBuffer(string: document.jsonText)))
                }
            }
            let app = Application(router: router, configuration: .init(address: .hostname(host, port: port)),
                                  onServerRunning: { channel in
                                      let bound = channel.localAddress?.port ?? 0
                                      boundPort.value = bound
                                      announce("dev-keys: serving http://\(host):\(bound)/jwks.json and /.well-known/risc-configuration (Ctrl-C stops)")
                                  }, logger: logger)
            try await ServiceGroup(configuration: .init(services: [app], gracefulShutdownSignals: [.sigterm, .sigint], logger: logger)).run()
        }
    }

    /// `warden emit`: signs a SET with the development key and delivers it, as a transmitter would.
    public struct Emit: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            abstract: "Signs a SET with the development key (warden dev-keys) and pushes it to a receiver or produces it to a topic.",
            discussion: """
            Types: sessions-revoked, tokens-revoked, token-revoked (--subject is the refresh token; its prefix is sent), \
            account-disabled (--reason hijacking|bulk-account), account-enabled, account-purged, \
            account-credential-change-required, verification (--state). Exit status: 0 accepted (202, or delivered to \
            the topic), 1 refused or not delivered, 2 usage error.
            """
        )

        @Option(name: .long, help: "A configuration: its receiver is the default --url.")
        var config: String?

        @Option(name: .long, help: "The event type (short name).")
        var type: String

        @Option(name: .long, help: "The subject: the account's sub (token-revoked: the refresh token).")
        var subject: String?

        @Option(name: .long, help: "account-disabled: the reason.")
        var reason: String?

        @Option(name: .long, help: "verification: the state to echo.")
        var state: String?

        @Option(name: .long, help: "The receiver's URL (RFC 8935 push).")
        var url: String?

        @Option(name: .long, help: "A Kafka topic to produce to instead (with --brokers).")
        var topic: String?

        @Option(name: .long, help: "The Kafka bootstrap servers, with --topic.")
        var brokers: String?

        @Option(name: .long, help: "A bearer token the receiver asks for.")
        var bearerToken: String?

        @Option(name: .long, help: "Where warden dev-keys keeps the key.")
        var keys: String = ".warden/dev-keys"

        public init() {}

        public func run() async throws {
            let developmentKeys: DevelopmentKeys
            let claims: JSONObject
            let target: Target
            do {
                guard let loaded = try DevelopmentKeys.load(from: URL(fileURLWithPath: keys)) else {
                    throw ConfigError(path: "", "no development key in \(keys): run warden dev-keys first")
                }
                developmentKeys = loaded
                claims = try Self.claims(type: type, subject: subject, reason: reason, state: state, keys: loaded)
                target = try resolveTarget()
            } catch {
                standardError("warden: \(error)\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            let token = try SETMinter.token(claims: claims, key: developmentKeys.key)
            let jti = claims["jti"]?.stringValue ?? ""
            switch target {
            case .push(let url): try await push(token, to: url, jti: jti)
            case .topic(let name, let brokers): try await produce(token, topic: name, brokers: brokers, jti: jti, keys: developmentKeys)
            }
        }

        enum Target { case push(String), topic(String, String) }

        private func resolveTarget() throws(ConfigError) -> Target {
            if let topic {
                guard url == nil else { throw ConfigError(path: "", "give --url or --topic, not both") }
                guard let brokers else { throw ConfigError(path: "", "--topic needs --brokers (the address warden run printed for an embedded cluster)") }
                return .topic(topic, brokers)
            }
            if let url { return .push(url) }
            if let config {
                let configuration = try WardenConfiguration.load(path: config)
                if let receiver = configuration.receiver {
                    let host = receiver.host == "0.0.0.0" || receiver.host == "::" ? "127.0.0.1" : receiver.host
                    return .push("http://\(host.contains(":") ? "[\(host)]" : host):\(receiver.port)\(receiver.path)")
                }
            }
            throw ConfigError(path: "", "give --url (the receiver's URL), --topic with --brokers, or --config with a receiver section")
        }

        static func claims(type: String, subject: String?, reason: String?, state: String?, keys: DevelopmentKeys) throws(ConfigError) -> JSONObject {
            let risc = "https://schemas.openid.net/secevent/risc/event-type/", oauth = "https://schemas.openid.net/secevent/oauth/event-type/"
            let uris: [String: String] = [
                "sessions-revoked": risc + "sessions-revoked", "tokens-revoked": oauth + "tokens-revoked",
                "token-revoked": oauth + "token-revoked", "account-disabled": risc + "account-disabled",
                "account-enabled": risc + "account-enabled", "account-purged": risc + "account-purged",
                "account-credential-change-required": risc + "account-credential-change-required",
                "verification": risc + "verification",
            ]
            guard let uri = uris[type] else {
                throw ConfigError(path: "", "--type \(type) is not one of \(uris.keys.sorted().joined(separator: ", "))")
            }
            var payload = JSONObject()
            switch type {
            case "verification":
                if let state { payload["state"] = .string(state) }
            case "token-revoked":
                guard let subject, !subject.isEmpty else { throw ConfigError(path: "", "--subject (the refresh token) is required for token-revoked") }
                payload["subject"] = .object(["subject_type": "oauth_token", "token_type": "refresh_token",
                                              "token_identifier_alg": "prefix", "token": .string(String(subject.prefix(16)))])
            default:
                guard let subject, !subject.isEmpty else { throw ConfigError(path: "", "--subject (the account's sub) is required for \(type)") }
                payload["subject"] = .object(["subject_type": "iss-sub", "iss": .string(keys.issuer), "sub": .string(subject)])
            }
            if let reason {
                guard type == "account-disabled" else { throw ConfigError(path: "", "--reason is for account-disabled") }
                payload["reason"] = .string(reason)
            }
            return ["iss": .string(keys.issuer), "aud": .string(keys.audience), "iat": .number(Date().timeIntervalSince1970.rounded(.down)),
                    "jti": .string(UUID().uuidString.lowercased()), "events": .object([uri: .object(payload)])]
        }

        private func push(_ token: String, to url: String, jti: String) async throws {
            let client = HTTPClient(eventLoopGroupProvider: .singleton, configuration: .init(redirectConfiguration: .disallow))
            var request = HTTPClientRequest(url: url)
            request.method = .POST
            request.headers.add(name: "Content-Type", value: "application/secevent+jwt")
            request.headers.add(name: "Accept", value: "application/json")
            if let bearerToken { request.headers.add(name: "Authorization", value: "Bearer " + bearerToken) }
            request.body = .bytes(ByteBuffer(string: token))
            let result: Result<(Int, String), any Error>
            do {
                let response = try await client.execute(request, timeout: .seconds(30))
                let body = try await response.body.collect(upTo: 64 * 1024)
                result = .success((Int(response.status.code), String(buffer: body)))
            } catch {
                result = .failure(error)
            }
            try? await client.shutdown()
            switch result {
            case .success((202, _)):
                print("{\"delivered\":true,\"status\":202,\"jti\":\(JSONValue.string(jti).jsonText)}")
            case .success((let status, let body)):
                standardError("warden: the receiver answered \(status)\(body.isEmpty ? "" : ": " + body.prefix(500))\n")
                throw ExitCode(1)
            case .failure(let error):
                standardError("warden: cannot reach \(url): \(error)\n")
                throw ExitCode(1)
            }
        }

        private func produce(_ token: String, topic: String, brokers: String, jti: String, keys: DevelopmentKeys) async throws {
            var logger = Logger(label: "warden")
            logger.logLevel = .error
            do {
                let producer = try KafkaProducer(bootstrapServers: brokers, properties: ["message.timeout.ms": "15000"], logger: logger)
                defer { producer.close() }
                let key = TokenFingerprint.fingerprint(Array((keys.issuer + "\n" + (subject ?? "")).utf8))
                let report = try await producer.send(topic: topic, key: Array(key.utf8), value: Array(token.utf8), headers: [
                    KafkaHeader("content-type", "application/secevent+jwt"), KafkaHeader("source", "emit"),
                ])
                print("{\"delivered\":true,\"topic\":\(JSONValue.string(topic).jsonText),\"partition\":\(report.partition),\"offset\":\(report.offset),\"jti\":\(JSONValue.string(jti).jsonText)}")
            } catch {
                standardError("warden: not produced to \(topic): \(error)\n")
                throw ExitCode(1)
            }
        }
    }
}

/// The port the development key server bound (known once it listens).
final class PortBox: Sendable {
    private let port = Mutex(0)
    var value: Int {
        get { port.withLock { $0 } }
        set { port.withLock { $0 = newValue } }
    }
}
