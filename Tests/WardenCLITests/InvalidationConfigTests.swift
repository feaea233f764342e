import Foundation
import Invalidation
import Redis
import SecurityEvents
import Testing
import WardenTestSupport
@testable import WardenCLI

@Suite("Targets, token stores, subjects and policy in the configuration")
struct InvalidationConfigTests {
    static let issuer = """
        issuers:
          - issuer: https://accounts.google.com/
            jwks-uri: https://www.googleapis.com/oauth2/v3/certs
            audiences: [app]

        """

    func parse(_ yaml: String, files: [String: String] = [:]) throws(ConfigError) -> InvalidationConfiguration {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("warden-config-\(UUID().uuidString)")
        try? FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        for (name, contents) in files { try? contents.write(to: directory.appendingPathComponent(name), atomically: true, encoding: .utf8) }
        return try WardenConfiguration.parse(yaml: Self.issuer + yaml, baseDirectory: directory).invalidation
    }

    func error(_ yaml: String, files: [String: String] = [:]) -> String {
        do {
            _ = try parse(yaml, files: files)
            return "no error"
        } catch {
            return error.description
        }
    }

    @Test func theDesignSketchParses() throws {
        let c = try parse("""
            subjects:
              resolve: {redis: sessions, key: "user-by-sub:{iss}|{sub}"}
            targets:
              sessions: {redis: "redis://127.0.0.1:6379/2"}
              google-revoke: {revoke: {endpoint: "https://oauth2.googleapis.com/revoke", auth: none}}
              app-revoke: {revoke: {endpoint: "https://auth.internal/oauth/revoke", auth: client_secret_basic,
                           client-id: warden, client-secret-file: revoke.secret}}
              app: {webhook: {url: "http://127.0.0.1:9000/hooks/security", hmac-secret-file: hook.secret}}
            token-stores:
              google-tokens: {redis: sessions, hash: "oauth-tokens:{user}", index: "oauth-token-index"}
            policy:
              sessions-revoked:
                - purge-set: {target: sessions, set: "user-sessions:{user}"}
              tokens-revoked:
                - purge-set: {target: sessions, set: "user-sessions:{user}"}
                - revoke-tokens: {store: google-tokens, target: google-revoke}
              token-revoked:
                - delete-token: {store: google-tokens}
              account-disabled:
                - when: {reason: hijacking}
                  purge-set: {target: sessions, set: "user-sessions:{user}"}
                - when: {reason: none}
                  set-flag: {target: sessions, key: "signin-disabled:{user}", ttl: 30d}
                - notify: {target: app}
            """, files: ["revoke.secret": "s3cret\n", "hook.secret": "hook-key"])
        #expect(c.targets["sessions"] == .redis(RedisConnectionSettings(host: "127.0.0.1", port: 6379, database: 2)))
        guard case .revoke(let appRevoke)? = c.targets["app-revoke"] else { Issue.record("app-revoke"); return }
        #expect(appRevoke.authentication == .clientSecretBasic(clientID: "warden", secret: "s3cret"))
        guard case .webhook(let hook)? = c.targets["app"] else { Issue.record("app"); return }
        #expect(hook.hmacSecret == Array("hook-key".utf8))
        #expect(c.subjects == .redis(target: "sessions", key: "user-by-sub:{iss}|{sub}"))
        #expect(c.tokenStores["google-tokens"] == TokenStoreSettings(redisTarget: "sessions", hash: "oauth-tokens:{user}",
                                                                      index: "oauth-token-index"))
        #expect(c.policy.rules(for: .tokensRevoked) == [
            PolicyRule(.purgeSet(target: "sessions", set: "user-sessions:{user}")),
            PolicyRule(.revokeTokens(store: "google-tokens", target: "google-revoke", tokenTypeHint: nil)),
        ])
        #expect(c.policy.rules(for: .accountDisabled)?[1] == PolicyRule(
            when: Condition([("reason", .absent)]), .setFlag(target: "sessions", key: "signin-disabled:{user}", value: "1", ttl: 30 * 86_400)))
        // Not configured here: the built-in default stays, with its targets present.
        #expect(c.policy.rules(for: .accountEnabled) == Policy.builtIn.rules(for: .accountEnabled))
        // The built-in default's "tokens" store does not exist: its steps are left out, and said so.
        #expect(c.leftOut.contains { $0.rule.action == .deleteTokens(store: "tokens") })
        #expect(!c.planDescription.contains("s3cret"))
    }

    /// The design's own example: a webhook to an app inside the network over plain http (its
    /// body is signed); keys and revoke endpoints stay https-only.
    @Test func aWebhookMayUsePlainHTTPARevokeEndpointMayNot() throws {
        let c = try parse("targets: {app: {webhook: {url: http://app.internal/hooks/security, hmac-secret: k}}}")
        guard case .webhook(let hook)? = c.targets["app"] else { Issue.record("app"); return }
        #expect(hook.url.absoluteString == "http://app.internal/hooks/security")
        #expect(error("targets: {app: {webhook: {url: ftp://app.internal/hooks, hmac-secret: k}}}").contains("must be an http or https URL"))
        // A password or a query token in the URL is not shown (check-config, start-up lines).
        let secretive = try parse(#"targets: {app: {webhook: {url: "https://hook:hunter2@app.internal/h?token=s3cret", hmac-secret: k}}}"#)
        let summary = try #require(secretive.targets["app"]).summary
        #expect(summary == "webhook https://app.internal/h?…", "\(summary)")
        #expect(error("targets: {r: {revoke: {endpoint: http://auth.internal/revoke, auth: none}}}").contains("must use https"))
    }

    @Test func verificationNamesBothTheRISCAndTheSSFEvent() throws {
        let c = try parse("""
            targets: {app: {webhook: {url: "https://app.example/hook", hmac-secret: k}}}
            policy:
              verification: [{notify: {target: app}}]
            """)
        #expect(c.policy.rules(for: .riscVerification) == [PolicyRule(.notify(target: "app"))])
        #expect(c.policy.rules(for: .ssfVerification) == [PolicyRule(.notify(target: "app"))])
    }

    // TLS files beside the URL, or inside the map form; relative to the configuration file.
    @Test func redisOverTLS() async throws {
        let certificates = try await TestCertificates.shared()
        let client = try await certificates.issue("redis-config-client-\(UUID().uuidString.prefix(6))", subjectAlternativeNames: [], client: true)
        func contents(_ path: String) throws -> String { try String(contentsOfFile: path, encoding: .utf8) }
        let pem = ["ca.pem": try contents(certificates.caFile), "client.pem": try contents(client.certificateFile),
                   "client-key.pem": try contents(client.keyFile)]
        let c = try parse("""
            targets:
              sessions: {redis: "rediss://cache.internal:6380/0", ca-file: ca.pem, cert-file: client.pem, key-file: client-key.pem}
              tokens: {redis: {url: "rediss://:pw@tokens.internal/3", ca-file: ca.pem, pool-size: 2}}
              system: {redis: "rediss://managed.example"}
              plain: {redis: "redis://127.0.0.1"}
            """, files: pem)
        guard case .redis(let sessions)? = c.targets["sessions"], case .redis(let tokens)? = c.targets["tokens"],
              case .redis(let system)? = c.targets["system"], case .redis(let plain)? = c.targets["plain"]
        else { Issue.record("four redis targets expected"); return }
        #expect(sessions.port == 6380 && sessions.host == "cache.internal")
        #expect(sessions.tls?.caFile?.hasSuffix("/ca.pem") == true)
        #expect(sessions.tls?.certificateFile?.hasSuffix("/client.pem") == true)
        #expect(sessions.tls?.keyFile?.hasSuffix("/client-key.pem") == true)
        #expect(tokens.tls?.caFile?.hasSuffix("/ca.pem") == true && tokens.tls?.certificateFile == nil)
        #expect(tokens.database == 3 && tokens.password == "pw" && tokens.poolSize == 2)
        #expect(system.tls == RedisTLSSettings())  // the system's authorities
        #expect(plain.tls == nil)
        #expect(sessions.summary == "rediss://cache.internal:6380/0")
        // Files that are no PEM (a renewal cut short) are refused now, not by every step later.
        let broken = "targets: {s: {redis: \"rediss://h:6380\", ca-file: ca.pem}}"
        #expect(error(broken, files: ["ca.pem": "-----BEGIN CERTIFICATE-----\nMIIB"]).contains("targets.s: Redis at h:6380: cannot read"))
        #expect(error("targets: {s: {redis: \"rediss://h:6380\", cert-file: c.pem, key-file: k.pem}}",
                      files: ["c.pem": pem["client.pem"]!, "k.pem": "not a key"]).contains("cannot read"))
    }

    @Test func errorsNameTheKeyAtFault() {
        let sessions = "targets: {sessions: {redis: \"redis://127.0.0.1/0\"}}\n"
        #expect(error("policy: {session-revoked-typo: []}").contains("policy.session-revoked-typo: unknown event type"))
        #expect(error(sessions + "policy: {sessions-revoked: [{purge-set: {target: cache, set: x}}]}")
            .contains("policy.sessions-revoked[0].purge-set.target: no target named \"cache\""))
        #expect(error(sessions + "policy: {sessions-revoked: [{notify: {target: sessions}}]}")
            .contains("notify needs a webhook target; \"sessions\" is redis"))
        #expect(error(sessions + "policy: {sessions-revoked: [{purge-set: {target: sessions, set: \"s:{usr}\"}}]}")
            .contains("policy.sessions-revoked[0].purge-set.set: unknown placeholder {usr}"))
        #expect(error(sessions + "policy: {sessions-revoked: [{purge-pattern: {target: sessions, pattern: \"s:*\"}}]}")
            .contains("without a placeholder"))
        #expect(error(sessions + "policy: {sessions-revoked: [{purge-set: {target: sessions, set: x}, notify: {target: app}}]}")
            .contains("each policy entry is one step"))
        #expect(error(sessions + "policy: {sessions-revoked: [{purge-sets: {target: sessions, set: x}}]}")
            .contains("unknown key (did you mean \"purge-set\"?)"))
        #expect(error("targets: {s: {redis: \"redis://h:6380\", ca-file: ca.pem}}", files: ["ca.pem": "x"])
            .contains("targets.s.ca-file: needs a rediss:// URL"))
        #expect(error("targets: {s: {redis: \"rediss://h:6380\", ca-file: missing.pem}}").contains("targets.s.ca-file: cannot read the file"))
        #expect(error("targets: {s: {redis: \"rediss://h:6380\", cert-file: c.pem}}", files: ["c.pem": "x"])
            .contains("targets.s.key-file: is required with cert-file"))
        #expect(error("targets: {s: {redis: \"rediss://h:6380?ssl_cert_reqs=none\"}}").contains("targets.s.redis: Redis URL parameters are not read"))
        // A parameter is named, its value (perhaps a password) never quoted.
        let parameter = error("targets: {s: {redis: \"redis://h?password=s3cret-value\"}}")
        #expect(parameter.contains("\"password\"") && !parameter.contains("s3cret"), "\(parameter)")
        // A duration past 100 years (here past any number: 1e305 days) is refused, not trapped on.
        #expect(error(sessions + "policy: {account-disabled: [{set-flag: {target: sessions, key: \"f:{user}\", ttl: 1e305d}}]}")
            .contains("is not a duration of at most 100 years"))
        #expect(error("targets: {s: {redis: \"rediss://h\", ca-fil: x}}").contains("targets.s.ca-fil: unknown key (did you mean \"ca-file\"?)"))
        #expect(error("targets: {s: {redis: \"redis://h/zero\"}}").contains("targets.s.redis: the database number"))
        #expect(error("targets: {s: {memcached: x}}").contains("targets.s.memcached: unknown key"))
        #expect(error("targets: {r: {revoke: {endpoint: \"http://auth.example/revoke\"}}}")
            .contains("targets.r.revoke.endpoint: \"http://auth.example/revoke\" must use https"))
        #expect(error("targets: {r: {revoke: {endpoint: \"https://a/r\", auth: client_secret_post, client-id: w}}}")
            .contains("targets.r.revoke.client-secret-file: is required with auth client_secret_post"))
        let both = error("targets: {r: {revoke: {endpoint: \"https://a/r\", auth: client_secret_basic, client-id: w, client-secret: hunter2, client-secret-file: f}}}")
        #expect(both.contains("give either client-secret or client-secret-file") && !both.contains("hunter2"))
        #expect(error("targets: {r: {revoke: {endpoint: \"https://a/r\", auth: private_key_jwt}}}")
            .contains("\"private_key_jwt\" is not one of none, client_secret_basic, client_secret_post"))
        #expect(error(sessions + "token-stores: {t: {redis: nope}}").contains("token-stores.t.redis: \"nope\" is not a redis target"))
        // One hash per user: without {user} it would be every user's; another placeholder would stay unfilled.
        for hash in ["oauth-tokens", "oauth-tokens:{iss}:{user}", "t:{user}:{user}"] {
            #expect(error(sessions + "token-stores: {t: {redis: sessions, hash: \"\(hash)\"}}")
                .contains("token-stores.t.hash: a token store keeps one hash per user: the key must hold {user} once and no other placeholder"),
                    "\(hash)")
        }
        #expect(error(sessions + "subjects: {resolve: {redis: sessions, key: \"u:{user}\"}}")
            .contains("subjects.resolve.key: unknown placeholder {user}"))
        #expect(error("subjects: {resolve: lookup}").contains("subjects.resolve: expected identity"))
    }

    /// With several issuers a subject is scoped to the issuer that signed the token: two issuers
    /// may give one `sub` (or email, phone, session id) to different people, so the identity
    /// resolver, which takes `sub` as the user id, is refused, and every lookup or step text
    /// naming a subject must name `{iss}` too. Back-channel logout's built-in `session:{sid}`
    /// becomes "every session of the resolved user".
    @Test func withSeveralIssuersEveryTextNamingASubjectNamesItsIssuer() throws {
        let two = """
            issuers:
              - issuer: https://accounts.google.com/
                jwks-uri: https://www.googleapis.com/oauth2/v3/certs
                audiences: [app]
              - issuer: https://idp.example/
                jwks-uri: https://idp.example/jwks
                audiences: [app]
            targets:
              sessions: {redis: "redis://127.0.0.1:6379/0"}
              local: {sql: "sqlite:app.sqlite"}

            """
        func result(_ yaml: String, issuers: String = two) -> String {
            do {
                let c = try WardenConfiguration.parse(yaml: issuers + yaml, baseDirectory: FileManager.default.temporaryDirectory).invalidation
                return c.planDescription
            } catch {
                return error.description
            }
        }
        // The identity resolver, by default and written, when a step acts on the user (here the
        // built-in purge of the user's sessions).
        #expect(result("").contains("subjects.resolve: identity (the default) takes each issuer's sub as the local user id"))
        #expect(result("subjects: {resolve: identity}")
            .contains(": purge-set user-sessions:{user} on sessions acts on it)"))
        // …but not when no step needs a user (no target of the built-in policy configured).
        #expect(result("policy: {sessions-revoked: [{purge-pattern: {target: cache, pattern: \"s:{iss}|{sub}:*\"}}]}",
                       issuers: two.replacingOccurrences(of: "sessions: {redis", with: "cache: {redis"))
            .contains("purge-pattern s:{iss}|{sub}:* on cache"))
        // Lookups: the key, or the statement's parameters taken together.
        #expect(result("subjects: {resolve: {redis: sessions, key: \"user-by-sub:{sub}\"}}")
            .contains("subjects.resolve.key: {sub} names a subject without its issuer"))
        #expect(result("subjects: {resolve: {sql: \"SELECT id FROM users WHERE sub = ?\", target: local}}")
            .contains("subjects.resolve.parameters: {sub} names a subject without its issuer"))
        // {iss} and the subject apart by a character no issuer holds: else issuer https://kc/a
        // with subject b1 spells issuer https://kc/ab with subject 1.
        for key in ["u:{iss}{sub}", "u:{iss}:{sub}", "u:{sub}/{iss}"] {
            #expect(result("subjects: {resolve: {redis: sessions, key: \"\(key)\"}}")
                .contains("subjects.resolve.key: {iss} must be followed by a character no issuer holds"), "\(key)")
        }
        #expect(!result("subjects: {resolve: {redis: sessions, key: \"u:{sub}|{iss}\"}}").contains("{iss} must be followed"))
        let lookup = "subjects: {resolve: {sql: \"SELECT id FROM users WHERE iss = ? AND email = ?\", target: local, parameters: [\"{iss}\", \"{email}\"]}}\n"
        // Policy texts: each Redis key on its own, a statement's parameters together.
        #expect(result(lookup + "policy: {sessions-revoked: [{purge-keys: {target: sessions, keys: [\"sess:{iss}\", \"sess:{sid}\"]}}]}")
            .contains("policy.sessions-revoked[0].purge-keys: {sid} names a subject without its issuer"))
        #expect(result(lookup + "policy: {sessions-revoked: [{set-flag: {target: sessions, key: \"f:{phone}\", value: \"{iss}\"}}]}")
            .contains("policy.sessions-revoked[0].set-flag: {phone} names a subject without its issuer"))
        #expect(result(lookup + "policy: {sessions-revoked: [{sql: {target: local, statement: \"UPDATE u SET x = 1 WHERE email = ?\", parameters: [\"{email}\"]}}]}")
            .contains("policy.sessions-revoked[0].sql: {email} names a subject without its issuer"))
        let scoped = result(lookup + """
            policy:
              sessions-revoked:
                - purge-pattern: {target: sessions, pattern: "sess:{iss}|{sub}:*"}
                - sql: {target: local, statement: "UPDATE users SET locked = 1 WHERE iss = ? AND sub = ?", parameters: ["{iss}", "{sub}"]}
                - purge-set: {target: sessions, set: "user-sessions:{user}"}
                - set-flag: {target: sessions, key: "f:{user}", value: "{phone}"}
            """)
        #expect(scoped.contains("sessions-revoked"), "\(scoped)")
        // The built-in logout: every session of the user, whether or not a sid is named.
        let logout = scoped.components(separatedBy: "\n").drop { !$0.hasSuffix("backchannel-logout") }.dropFirst().prefix { $0.hasPrefix("    ") }
        #expect(Array(logout) == ["    1. purge-set user-sessions:{user} on sessions"], "\(scoped)")
        // One issuer: all of it stands, and logout purges the named session.
        let one = try parse("""
            targets: {sessions: {redis: "redis://127.0.0.1:6379/0"}}
            policy: {sessions-revoked: [{purge-keys: {target: sessions, keys: ["sess:{sid}"]}}]}
            """)
        #expect(one.subjects == .identity)
        #expect(one.policy.rules(for: .backchannelLogout)?.count == 2)
    }

    @Test func checkConfigPrintsThePlanAndExitsZero() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("warden-check-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let config = directory.appendingPathComponent("warden.yaml")
        try (Self.issuer + """
            targets:
              sessions: {redis: "redis://127.0.0.1:6379/0"}
            """).write(to: config, atomically: true, encoding: .utf8)
        let out = try await Warden.run(["check-config", "--config", config.path])
        #expect(out.status == 0)
        #expect(out.stdout.contains("risc:sessions-revoked\n    1. purge-set user-sessions:{user} on sessions"))
        #expect(out.stdout.contains("risc:account-disabled\n    1. purge-set user-sessions:{user} on sessions  when reason: hijacking\n    2. set-flag signin-disabled:{user}=1 on sessions  when reason: none"))
        #expect(out.stdout.contains("risc:sessions-revoked: notify app  — needs target \"app\""))

        try (Self.issuer + "policy: {sessions-revoked: [{notify: {target: app}}]}").write(to: config, atomically: true, encoding: .utf8)
        let bad = try await Warden.run(["check-config", "--config", config.path])
        #expect(bad.status == 2)
        #expect(bad.stderr.contains("policy.sessions-revoked[0].notify.target: no target named \"app\""))
    }

    /// The configurations README's commands start pass `check-config` (`make run`'s once
    /// `warden dev-keys` has made its key, as `make run` does first).
    @Test func theExampleConfigurationsPassCheckConfig() async throws {
        let root = try Warden.temporaryDirectory()
        let examples = root.appendingPathComponent("examples")
        try FileManager.default.copyItem(at: Warden.packageRoot.appendingPathComponent("examples"), to: examples)
        let keys = try await Warden.run(["dev-keys", "--dir", root.appendingPathComponent(".warden/dev-keys").path, "--no-serve"])
        #expect(keys.status == 0, "\(keys.stderr)")
        for name in ["dev.yaml", "warden.yaml"] {
            let out = try await Warden.run(["check-config", "--config", examples.appendingPathComponent(name).path])
            #expect(out.status == 0, "\(name): \(out.stderr)")
        }
    }
}

extension InvalidationConfigTests {
    // A misspelt librdkafka property is refused by check-config and by warden run, with
    // librdkafka's words and the key's path (exit 2, not a crash); a PostgreSQL URL parameter
    // is honoured or refused, never dropped.
    @Test func refusesMisspeltKafkaPropertiesAndUnhonouredURLParameters() async throws {
        let directory = try Warden.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: directory) }
        let config = directory.appendingPathComponent("warden.yaml")
        let kafka = """
            kafka:
              brokers: embedded
              properties: {sesion.timeout.ms: 6000}
            ledger: sqlite:ledger.sqlite
            """
        try (Self.issuer + kafka).write(to: config, atomically: true, encoding: .utf8)
        for command in ["check-config", "run"] {
            let out = try await Warden.run([command, "--config", config.path])
            #expect(out.status == 2, "\(command): \(out.stderr)")
            #expect(out.stderr.contains("kafka.properties.sesion.timeout.ms"), "\(command): \(out.stderr)")
            #expect(out.stderr.contains("No such configuration property"), "\(command): \(out.stderr)")
        }
        // Properties each valid on its own that librdkafka refuses together, or only when a client
        // is made (a key file it cannot read): refused by both before anything starts, exit 2.
        for (properties, words) in [("{fetch.max.bytes: 1000, message.max.bytes: 100000}", "`fetch.max.bytes` must be >= `message.max.bytes`"),
                                    ("{security.protocol: ssl, ssl.key.location: /nonexistent/key.pem, ssl.key.password: hunter2secret}",
                                     "ssl.key.location failed"),
                                    // Each producer's own delivery timeout (the dead letters' 30 s) is checked with it.
                                    ("{linger.ms: 40000}", "(dead-letter producer)")] {
            try (Self.issuer + kafka.replacingOccurrences(of: "{sesion.timeout.ms: 6000}", with: properties))
                .write(to: config, atomically: true, encoding: .utf8)
            for command in ["check-config", "run"] {
                let out = try await Warden.run([command, "--config", config.path])
                #expect(out.status == 2, "\(command): \(out.stderr)")
                #expect(out.stderr.contains("kafka.properties: librdkafka refuses the properties together") && out.stderr.contains(words),
                        "\(command): \(out.stderr)")
                #expect(!out.stderr.contains("hunter2secret") && !out.stdout.contains("hunter2secret"))
            }
        }
        for (url, words) in [("postgres://warden@127.0.0.1/w?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
                              "sslrootcert: cannot read the file /nonexistent/ca.pem"),
                             ("postgres://warden@127.0.0.1/w?sslmode=on", "sslmode=on is not an sslmode"),
                             ("postgres://warden@127.0.0.1/w?sslrootcert=/etc/hostname", "sslrootcert needs an sslmode that makes TLS"),
                             ("postgres://warden@127.0.0.1/w?sslmod=disable", "\"sslmod\" is not supported")] {
            try (Self.issuer + "ledger: \"\(url)\"").write(to: config, atomically: true, encoding: .utf8)
            let out = try await Warden.run(["check-config", "--config", config.path])
            #expect(out.status == 2)
            #expect(out.stderr.contains("ledger: ") && out.stderr.contains(words), "\(out.stderr)")
            #expect(error("targets: {db: {sql: \"\(url)\"}}").contains(words))
        }
        try (Self.issuer + "ledger: \"postgres://warden@127.0.0.1/w?sslmode=disable\"").write(to: config, atomically: true, encoding: .utf8)
        #expect(try await Warden.run(["check-config", "--config", config.path]).status == 0)
    }

    @Test func sqlTargetsStepsAndLookups() throws {
        let c = try parse("""
            targets:
              appdb: {sql: "postgres://warden@127.0.0.1:5432/app"}
              local: {sql: "sqlite:app.sqlite"}
            subjects:
              resolve: {sql: "SELECT id FROM users WHERE google_sub = $1", target: appdb}
            policy:
              account-disabled:
                - sql: {target: local, statement: "UPDATE users SET google_signin = 0 WHERE id = ?", parameters: ["{user}"]}
            """)
        #expect(c.subjects == .sql(target: "appdb", query: "SELECT id FROM users WHERE google_sub = $1", parameters: ["{sub}"]))
        #expect(c.policy.rules(for: .accountDisabled) == [PolicyRule(.sql(target: "local",
            statement: "UPDATE users SET google_signin = 0 WHERE id = ?", parameters: ["{user}"]))])
        guard case .sql(let location)? = c.targets["local"] else { Issue.record("local"); return }
        #expect(location.hasPrefix("sqlite:/") && location.hasSuffix("/app.sqlite"))
        #expect(error("targets: {db: {sql: \"mysql://x/y\"}}").contains("targets.db.sql: expected sqlite:PATH or postgres://"))
        let noUser = error("targets: {db: {sql: \"postgres://:hunter2@db.internal/app\"}}")
        #expect(noUser.contains("targets.db.sql: expected postgres://user[:password]@host[:port]/database") && !noUser.contains("hunter2"))
        #expect(error("targets: {db: {sql: \"sqlite:a.db\"}}\nsubjects: {resolve: {sql: \"SELECT 1\", target: nope}}")
            .contains("subjects.resolve.target: \"nope\" is not a sql target"))
    }
}
