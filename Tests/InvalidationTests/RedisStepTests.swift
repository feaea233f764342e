import Foundation
@testable import Invalidation
@testable import Redis
import SecurityEvents
import Testing
import WardenTestSupport

@Suite("Redis steps against a real redis-server")
struct RedisStepTests {
    let server: RedisServer
    let client: RedisClient
    let executor: RedisStepExecutor

    init() async throws {
        server = try await RedisServer()
        client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, timeout: 2))
        executor = RedisStepExecutor(clients: ["sessions": client], stores: [
            "indexed": TokenStoreSettings(redisTarget: "sessions", hash: "oauth-tokens:{user}", index: "oauth-token-index"),
            "plain": TokenStoreSettings(redisTarget: "sessions", hash: "oauth-tokens:{user}"),
        ])
    }

    func cli(_ arguments: String...) async throws -> String { try await server.cli(arguments) }
    var context: StepContext { StepContext(token: token("sessions-revoked"), user: "u1") }

    @Test func purgeSetDeletesEveryListedSessionAndEmptiesTheSet() async throws {
        for i in 0..<1_200 { _ = try await client.pipeline([["SET", "session:\(i)", "data"], ["SADD", "user-sessions:u1", "session:\(i)"]]) }
        _ = try await client.send(["SET", "session:other-user", "data"])
        let outcome = await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:u1"), context: context)
        #expect(outcome == .done("1200 listed, 1200 keys deleted from user-sessions:u1"))
        #expect(try await cli("EXISTS", "user-sessions:u1") == "0")
        #expect(try await cli("DBSIZE") == "1")
        #expect(try await cli("EXISTS", "session:other-user") == "1")
        // Again: nothing left to do, and that is success.
        #expect(await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:u1"), context: context)
            == .done("0 listed, 0 keys deleted from user-sessions:u1"))
    }

    /// A page of a purge-set (SSCAN, UNLINK, SREM) is one round trip: a script the server
    /// caches, sent whole only the first time.
    @Test func aPurgeSetPageIsOneRoundTrip() async throws {
        for user in ["u1", "u2"] {
            _ = try await client.pipeline([["SET", "session:\(user):a", "1"], ["SET", "session:\(user):b", "1"],
                                           ["SADD", "user-sessions:\(user)", "session:\(user):a", "session:\(user):b"]])
        }
        let before = client.roundTrips.load(ordering: .relaxed)
        #expect(await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:u1"), context: context)
            == .done("2 listed, 2 keys deleted from user-sessions:u1"))
        let first = client.roundTrips.load(ordering: .relaxed) - before
        #expect(first <= 2, "by digest, then whole once: \(first)")
        #expect(await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:u2"), context: context)
            == .done("2 listed, 2 keys deleted from user-sessions:u2"))
        #expect(client.roundTrips.load(ordering: .relaxed) - before - first == 1)
        #expect(try await cli("DBSIZE") == "0")
    }

    /// The purge-set steps of many events go to the server together: the first page of every
    /// set in one round trip, a script call per 32 sets. A set with more pages goes on alone; a
    /// key that is not a set fails its own step only, and the sets after it in the same call are
    /// purged. A mix with steps of other kinds runs each on its own.
    @Test func purgeSetsOfManyEventsShareOneRoundTrip() async throws {
        for user in 0..<40 {
            _ = try await client.pipeline([["SET", "session:\(user):a", "1"], ["SET", "session:\(user):b", "1"],
                                           ["SADD", "user-sessions:\(user)", "session:\(user):a", "session:\(user):b"]])
        }
        for i in 0..<1_200 { _ = try await client.pipeline([["SET", "session:big:\(i)", "1"], ["SADD", "user-sessions:big", "session:big:\(i)"]]) }
        _ = try await client.send(["SET", "user-sessions:not-a-set", "x"])
        _ = try await client.send(["SET", "flag:u1", "1"])
        // The script is cached on the server by a first batch: by digest, then once with its text.
        let none = StepCall(action: .purgeSet(target: "sessions", set: "user-sessions:none"), context: context)
        var before = client.roundTrips.load(ordering: .relaxed)
        #expect(await executor.execute([none, none]) == Array(repeating: .done("0 listed, 0 keys deleted from user-sessions:none"), count: 2))
        #expect(client.roundTrips.load(ordering: .relaxed) - before == 2)
        _ = try await cli("CONFIG", "RESETSTAT")
        var calls = (0..<40).map { StepCall(action: .purgeSet(target: "sessions", set: "user-sessions:\($0)"), context: context) }
        calls.insert(StepCall(action: .purgeSet(target: "sessions", set: "user-sessions:not-a-set"), context: context), at: 20)
        before = client.roundTrips.load(ordering: .relaxed)
        var outcomes = await executor.execute(calls)
        // Every one of the 41 in one round trip (steps sent each on its own take two or more),
        // in two script calls.
        #expect(client.roundTrips.load(ordering: .relaxed) - before == 1)
        #expect(try await cli("INFO", "commandstats").contains("cmdstat_evalsha:calls=2,"))
        guard case .failed(let reason) = outcomes.remove(at: 20) else {
            Issue.record("a key that is not a set: \(calls[20])")
            return
        }
        #expect(reason.contains("WRONGTYPE"))
        outcomes += await executor.execute([StepCall(action: .purgeSet(target: "sessions", set: "user-sessions:big"), context: context), none])
        outcomes += await executor.execute([StepCall(action: .purgeKeys(target: "sessions", keys: ["flag:u1"]), context: context), none])
        #expect(outcomes[..<40] == ArraySlice((0..<40).map { .done("2 listed, 2 keys deleted from user-sessions:\($0)") }))
        #expect(outcomes[40] == .done("1200 listed, 1200 keys deleted from user-sessions:big"))
        #expect(outcomes[41] == .done("0 listed, 0 keys deleted from user-sessions:none"))
        #expect(outcomes[42] == .done("1 of 1 keys deleted"))
        #expect(outcomes[43] == .done("0 listed, 0 keys deleted from user-sessions:none"))
        #expect(try await cli("DBSIZE") == "1")  // only the value that is not a set is left
    }

    /// A server that lost its cached scripts (restarted, or `SCRIPT FLUSH`) is sent the script's
    /// text once more, in one more round trip, and every purge of the batch is made.
    @Test func purgeSetsAfterTheServerForgotItsScriptsAreMade() async throws {
        for user in 0..<3 {
            _ = try await client.pipeline([["SET", "session:\(user)", "1"], ["SADD", "user-sessions:\(user)", "session:\(user)"]])
        }
        let calls = (0..<3).map { StepCall(action: .purgeSet(target: "sessions", set: "user-sessions:\($0)"), context: context) }
        #expect(await executor.execute(Array(calls[..<1])) == [.done("1 listed, 1 keys deleted from user-sessions:0")])
        _ = try await cli("SCRIPT", "FLUSH")
        let before = client.roundTrips.load(ordering: .relaxed)
        #expect(await executor.execute(Array(calls[1...])) == (1..<3).map { .done("1 listed, 1 keys deleted from user-sessions:\($0)") })
        #expect(client.roundTrips.load(ordering: .relaxed) - before == 2)
        #expect(try await cli("DBSIZE") == "0")
    }

    /// A set the server keeps compact (`set-max-intset-entries` raised) is listed whole by one
    /// SSCAN, whatever the COUNT: more members than Lua's `unpack` takes at once (about 8,000)
    /// are deleted all the same, alone and in a batch.
    @Test func aSetListedWholeBeyondWhatLuaUnpacksIsPurged() async throws {
        _ = try await cli("CONFIG", "SET", "set-max-intset-entries", "20000")
        for (set, first) in [("user-sessions:alone", 1), ("user-sessions:batched", 100_001)] {
            let members = (first..<first + 9_000).map(String.init)
            for part in stride(from: 0, to: members.count, by: 1_000) {
                let slice = Array(members[part..<min(part + 1_000, members.count)])
                _ = try await client.pipeline([["SADD", set] + slice, ["MSET"] + slice.flatMap { [$0, "1"] }])
            }
        }
        #expect(try await cli("OBJECT", "ENCODING", "user-sessions:alone") == "intset")
        #expect(await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:alone"), context: context)
            == .done("9000 listed, 9000 keys deleted from user-sessions:alone"))
        let batch = ["user-sessions:batched", "user-sessions:none"].map { StepCall(action: .purgeSet(target: "sessions", set: $0), context: context) }
        #expect(await executor.execute(batch) == [.done("9000 listed, 9000 keys deleted from user-sessions:batched"),
                                                  .done("0 listed, 0 keys deleted from user-sessions:none")])
        #expect(try await cli("DBSIZE") == "0")
    }

    /// A server that stopped taking writes (a replica after a failover) refuses a batch's
    /// deletions from inside the script: the call ends with `READONLY` as its own reply, so the
    /// client replaces its connection (as for any command answered so), every set's step is
    /// retried rather than done, and once writes are taken again the purges are made.
    @Test func aBatchRefusedByAServerTurnedReplicaIsRetriedOnANewConnection() async throws {
        for user in 0..<2 {
            _ = try await client.pipeline([["SET", "session:\(user)", "1"], ["SADD", "user-sessions:\(user)", "session:\(user)"]])
        }
        let calls = (0..<2).map { StepCall(action: .purgeSet(target: "sessions", set: "user-sessions:\($0)"), context: context) }
        // No primary there: the server stays a read-only replica, with its data.
        _ = try await cli("REPLICAOF", "127.0.0.1", "1")
        let connection = try await client.send(["CLIENT", "ID"]).integer
        #expect(await executor.execute(calls).map(\.result) == ["retry", "retry"])
        #expect(try await cli("DBSIZE") == "4")
        _ = try await cli("REPLICAOF", "NO", "ONE")
        #expect(try await client.send(["CLIENT", "ID"]).integer != connection)
        #expect(await executor.execute(calls) == (0..<2).map { .done("1 listed, 1 keys deleted from user-sessions:\($0)") })
        #expect(try await cli("DBSIZE") == "0")
    }

    /// A server whose user may not run scripts (an ACL, or scripting renamed away) gets the
    /// same purge in plain commands.
    @Test func aServerRefusingScriptsGetsThePurgeInPlainCommands() async throws {
        _ = try await cli("ACL", "SETUSER", "default", "-@scripting")
        for i in 0..<700 { _ = try await client.pipeline([["SET", "session:\(i)", "1"], ["SADD", "user-sessions:u1", "session:\(i)"]]) }
        #expect(await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:u1"), context: context)
            == .done("700 listed, 700 keys deleted from user-sessions:u1"))
        #expect(try await cli("DBSIZE") == "0")
        #expect(executor.refusingScripts.contains("sessions"))
    }

    @Test func purgeKeysAndPurgePattern() async throws {
        for key in ["s:u1:a", "s:u1:b", "s:u10:a", "s:*:x", "flag:u1"] { _ = try await client.send(["SET", key, "1"]) }
        #expect(await executor.execute(.purgeKeys(target: "sessions", keys: ["flag:u1", "flag:missing"]), context: context)
            == .done("1 of 2 keys deleted"))
        // The pattern a planner makes for user "*": the escaped star matches only itself.
        let escaped = Planner(policy: Policy(rules: [EventURIPrefix.risc + "sessions-revoked": [
            PolicyRule(.purgePattern(target: "sessions", pattern: "s:{user}:*")),
        ]])).plan(token("sessions-revoked"), subject: .user("*")).steps[0].action
        #expect(await executor.execute(escaped, context: context) == .done(#"1 keys matching s:\*:* deleted"#))
        #expect(try await cli("EXISTS", "s:u1:a") == "1")
        #expect(await executor.execute(.purgePattern(target: "sessions", pattern: "s:u1:*"), context: context)
            == .done("2 keys matching s:u1:* deleted"))
        #expect(try await cli("EXISTS", "s:u10:a") == "1")
    }

    @Test func setFlagWithAndWithoutExpiry() async throws {
        _ = await executor.execute(.setFlag(target: "sessions", key: "signin-disabled:u1", value: "1", ttl: nil), context: context)
        #expect(try await cli("GET", "signin-disabled:u1") == "1")
        #expect(try await cli("TTL", "signin-disabled:u1") == "-1")
        _ = await executor.execute(.setFlag(target: "sessions", key: "blocked:u1", value: "hijacked", ttl: 3600), context: context)
        #expect(try await cli("GET", "blocked:u1") == "hijacked")
        let ttl = Int(try await cli("TTL", "blocked:u1")) ?? -1
        #expect(ttl > 3500 && ttl <= 3600)
        // A ttl past what Redis takes (a plan stored under an old configuration) fails the step.
        let huge = await executor.execute(.setFlag(target: "sessions", key: "huge:u1", value: "1", ttl: 1e19), context: context)
        #expect(huge.result == "failed", "\(huge)")
        #expect(try await cli("EXISTS", "huge:u1") == "0")
    }

    /// A lookup the server refuses is not "no token there": the step fails (WRONGTYPE) instead of
    /// being recorded done while the revoked token stays held.
    @Test func aRefusedLookupFailsTheStepInsteadOfFindingNothing() async throws {
        _ = try await client.send(["SET", "oauth-token-index", "not a hash"])
        let indexed = await executor.execute(.deleteToken(store: "indexed"), context: revoked(.prefix, "1//0gAAAAAAAAAAAA"))
        guard case .failed(let reason) = indexed else { Issue.record("expected failed, got \(indexed)"); return }
        #expect(reason.contains("WRONGTYPE"))
        _ = try await client.send(["DEL", "oauth-token-index"])
        try await hold("1//0gAAAAAAAAAAAA-held", user: "u1", id: "t-a", indexed: false)
        _ = try await client.send(["SET", "oauth-tokens:u2", "not a hash"])
        let scanned = await executor.execute(.deleteToken(store: "plain"), context: revoked(.plain, "1//0gAAAAAAAAAAAA-held"))
        #expect(scanned.result == "failed", "\(scanned)")
        let user = await executor.execute(.deleteTokens(store: "plain"), context: StepContext(token: token("sessions-revoked"), user: "u2"))
        #expect(user.result == "failed", "\(user)")
    }

    /// Stores tokens the way DESIGN.md says the app does: a hash per user, and an index from
    /// `prefix:`/`sha512:` identifiers to `<user>/<token id>`.
    func hold(_ token: String, user: String, id: String, indexed: Bool = true) async throws {
        _ = try await client.send(["HSET", "oauth-tokens:\(user)", id, token])
        if indexed {
            for key in HeldTokenIdentifiers(token: token).indexKeys { _ = try await client.send(["HSET", "oauth-token-index", key, "\(user)/\(id)"]) }
        }
    }

    func revoked(_ alg: TokenReference.IdentifierAlgorithm, _ value: String) -> StepContext {
        let subject = #"{"subject_type":"oauth_token","token_type":"refresh_token","token_identifier_alg":"\#(alg.rawValue)","token":"\#(value)"}"#
        return StepContext(token: token(EventURIPrefix.oauth + "token-revoked", subject: subject), user: nil)
    }

    @Test func deleteTokenByPrefixAndByHashThroughTheIndex() async throws {
        let a = "1//0gAAAAAAAAAAAA-first-refresh-token", b = "1//0gBBBBBBBBBBBB-second-refresh-token"
        try await hold(a, user: "u1", id: "t-a")
        try await hold(b, user: "u1", id: "t-b")
        try await hold("ya29.other-user-token-value", user: "u2", id: "t-c")

        let byPrefix = await executor.execute(.deleteToken(store: "indexed"), context: revoked(.prefix, String(a.prefix(16))))
        #expect(byPrefix.result == "done")
        #expect(try await cli("HKEYS", "oauth-tokens:u1") == "t-b")
        #expect(try await cli("HEXISTS", "oauth-token-index", "prefix:" + String(a.prefix(16))) == "0")

        let hash = HeldTokenIdentifiers(token: b).hash
        #expect(await executor.execute(.deleteToken(store: "indexed"), context: revoked(.hashBase64SHA512SHA512, hash)).result == "done")
        #expect(try await cli("EXISTS", "oauth-tokens:u1") == "0")
        #expect(try await cli("HLEN", "oauth-token-index") == "2")  // only u2's token's two entries remain
        #expect(try await cli("HGET", "oauth-tokens:u2", "t-c") == "ya29.other-user-token-value")

        // A token nobody holds: done, nothing deleted.
        let none = await executor.execute(.deleteToken(store: "indexed"), context: revoked(.prefix, "1//0gZZZZZZZZZZZZ"))
        guard case .done(let text) = none else { Issue.record("expected done, got \(none)"); return }
        #expect(text.hasPrefix("no held token matches prefix:"))
        #expect(!text.contains("1//0gZZZZZZZZZZZZ"))  // the identifier is not written whole
        #expect(try await cli("HLEN", "oauth-token-index") == "2")
    }

    @Test func deleteTokenWithoutAnIndexScansTheStore() async throws {
        try await hold("1//0gAAAAAAAAAAAA-first", user: "u1", id: "t-a", indexed: false)
        try await hold("1//0gCCCCCCCCCCCC-third", user: "u3", id: "t-x", indexed: false)
        let outcome = await executor.execute(.deleteToken(store: "plain"), context: revoked(.plain, "1//0gCCCCCCCCCCCC-third"))
        #expect(outcome.result == "done")
        #expect(try await cli("EXISTS", "oauth-tokens:u3") == "0")
        #expect(try await cli("HGET", "oauth-tokens:u1", "t-a") == "1//0gAAAAAAAAAAAA-first")
    }

    @Test func deleteTokensRemovesTheUsersHashAndIndexEntries() async throws {
        try await hold("1//0gAAAAAAAAAAAA-one", user: "u1", id: "t-1")
        try await hold("1//0gBBBBBBBBBBBB-two", user: "u1", id: "t-2")
        try await hold("1//0gCCCCCCCCCCCC-keep", user: "u2", id: "t-3")
        #expect(await executor.execute(.deleteTokens(store: "indexed"), context: context) == .done("2 held token(s) of the user deleted"))
        #expect(try await cli("EXISTS", "oauth-tokens:u1") == "0")
        #expect(try await cli("HLEN", "oauth-token-index") == "2")
        // A step keeps the user it was planned for: run later (redelivered, replayed) while the
        // subject now resolves to u1, it deletes u2's tokens, not u1's.
        try await hold("1//0gDDDDDDDDDDDD-new", user: "u1", id: "t-4")
        #expect(await executor.execute(.deleteTokens(store: "indexed", user: "u2"), context: context) == .done("1 held token(s) of the user deleted"))
        #expect(try await cli("EXISTS", "oauth-tokens:u2") == "0")
        #expect(try await cli("HGET", "oauth-tokens:u1", "t-4") == "1//0gDDDDDDDDDDDD-new")
    }

    @Test func unreachableRedisIsRetryAndAWrongTypeIsAPermanentFailure() async throws {
        _ = try await client.send(["SET", "user-sessions:u9", "not a set"])
        let wrongType = await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:u9"), context: context)
        guard case .failed(let reason) = wrongType else { Issue.record("expected failed, got \(wrongType)"); return }
        #expect(reason.contains("WRONGTYPE"))

        await server.stop()
        let down = await executor.execute(.purgeKeys(target: "sessions", keys: ["k"]), context: context)
        #expect(down.result == "retry")
        try await server.start()
        var back = await executor.execute(.purgeKeys(target: "sessions", keys: ["k"]), context: context)
        if back.result == "retry" { back = await executor.execute(.purgeKeys(target: "sessions", keys: ["k"]), context: context) }
        #expect(back == .done("0 of 1 keys deleted"))
    }

    /// What a step recorded done; "" otherwise.
    func detail(_ outcome: StepOutcome) -> String {
        if case .done(let text) = outcome { return text }
        return ""
    }

    /// A key that is not UTF-8 is deleted as the server named it, not as a text with its bytes
    /// replaced (which names another key, deletes nothing, and was reported done).
    @Test func keysThatAreNotUTF8AreDeletedAsNamed() async throws {
        let key: [UInt8] = Array("s:u1:".utf8) + [0xFF, 0xFE]
        _ = try await client.pipeline([[Array("SET".utf8), key, Array("1".utf8)]])
        #expect(await executor.execute(.purgePattern(target: "sessions", pattern: "s:u1:*"), context: context)
            == .done("1 keys matching s:u1:* deleted"))
        #expect(try await client.pipeline([[Array("EXISTS".utf8), key]])[0] == .integer(0))
        // The purge-set of a server refusing scripts lists, deletes and forgets members as bytes.
        _ = try await cli("ACL", "SETUSER", "default", "-@scripting")
        _ = try await client.pipeline([[Array("SET".utf8), key, Array("1".utf8)], [Array("SADD".utf8), Array("user-sessions:u1".utf8), key]])
        #expect(await executor.execute(.purgeSet(target: "sessions", set: "user-sessions:u1"), context: context)
            == .done("1 listed, 1 keys deleted from user-sessions:u1"))
        #expect(try await cli("DBSIZE") == "0")
    }

    /// `<user>/<token id>`: a user id holding a slash is still found, and its token deleted.
    @Test func aUserIDWithASlashIsFoundThroughTheIndex() async throws {
        let token = "1//0gSSSSSSSSSSSS-slashed-user-token"
        try await hold(token, user: "org/alice", id: "t1")
        let outcome = await executor.execute(.deleteToken(store: "indexed"), context: revoked(.plain, token))
        #expect(detail(outcome).hasPrefix("held token"), "\(outcome)")
        #expect(try await cli("HEXISTS", "oauth-tokens:org/alice", "t1") == "0")
        #expect(try await cli("HLEN", "oauth-token-index") == "0")
    }

    /// A `prefix:` entry is shared by every token that starts alike: deleting one user's token
    /// leaves an entry that points to another user's, so that one is still found.
    @Test func anIndexEntryOfAnotherUsersTokenIsKept() async throws {
        let a = "1//0gPPPPPPPPPPPP-token-of-u1", b = "1//0gPPPPPPPPPPPP-token-of-u2"
        try await hold(a, user: "u1", id: "t-a")
        try await hold(b, user: "u2", id: "t-b")  // the shared prefix entry now points to u2's
        #expect(await executor.execute(.deleteTokens(store: "indexed"), context: context) == .done("1 held token(s) of the user deleted"))
        #expect(try await cli("HGET", "oauth-token-index", "prefix:" + String(b.prefix(16))) == "u2/t-b")
        let second = await executor.execute(.deleteToken(store: "indexed"), context: revoked(.prefix, String(b.prefix(16))))
        #expect(detail(second).hasPrefix("held token"), "\(second)")
        #expect(try await cli("EXISTS", "oauth-tokens:u2") == "0")
        // Through a scan of the store, the same.
        try await hold(a, user: "u1", id: "t-a")
        try await hold(b, user: "u2", id: "t-b")
        // base64url is not the index's form: the store is scanned.
        let scanned = await executor.execute(.deleteToken(store: "indexed"),
                                             context: revoked(.hashBase64SHA512SHA512, HeldTokenIdentifiers(token: a).hash
                                                .replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
                                                .replacingOccurrences(of: "=", with: "")))
        #expect(detail(scanned).hasPrefix("1 held token(s)"), "\(scanned)")
        #expect(try await cli("EXISTS", "oauth-tokens:u1") == "0")
        #expect(try await cli("HGET", "oauth-token-index", "prefix:" + String(b.prefix(16))) == "u2/t-b")
    }

    /// A server at `maxmemory` that does not evict refuses writes with OOM for now, not for good.
    @Test func aServerOutOfMemoryIsRetriedNotFailed() async throws {
        _ = try await cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        _ = try await cli("CONFIG", "SET", "maxmemory", "1")
        let outcome = await executor.execute(.setFlag(target: "sessions", key: "signin-disabled:u1", value: "1", ttl: nil), context: context)
        _ = try await cli("CONFIG", "SET", "maxmemory", "0")
        #expect(outcome.result == "retry", "\(outcome)")
    }

    /// The Redis subject lookup: a string is the user, a missing key is no one, and a key the
    /// server refuses to read (wrong type, no permission) is a refusal, not "no such user".
    @Test func theRedisSubjectLookup() async throws {
        let resolver = RedisResolver(client: client, key: "user-by-sub:{sub}")
        let event = token("sessions-revoked")
        #expect(await resolver.resolve(event) == .resolved(.unresolved))
        _ = try await client.send(["SET", "user-by-sub:1234", "local-7"])
        #expect(await resolver.resolve(event) == .resolved(.user("local-7")))
        _ = try await client.send(["DEL", "user-by-sub:1234"])
        _ = try await client.send(["HSET", "user-by-sub:1234", "id", "local-7"])
        guard case .refused(let reason) = await resolver.resolve(event) else { Issue.record("a WRONGTYPE lookup must be refused"); return }
        #expect(reason.contains("WRONGTYPE"))
    }
}
