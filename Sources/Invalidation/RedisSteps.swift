import Crypto
public import Redis
import SecurityEvents
import Synchronization

/// Runs the Redis steps: purge-set, purge-keys, purge-pattern, set-flag, and the token-store
/// steps delete-token and delete-tokens. Connection problems are `.retry`; a server that
/// refuses a command (wrong type, no permission) is `.failed`.
public struct RedisStepExecutor: StepExecutor {
    /// Redis targets by name.
    public let clients: [String: RedisClient]
    public let stores: [String: TokenStoreSettings]
    /// Keys deleted per UNLINK, members read per SSCAN/SCAN round.
    public var chunk = 500
    /// Targets that refused the purge-set script (scripting disabled or denied by ACL): they
    /// get the same purge in two round trips per page.
    let refusingScripts = TargetSet()

    public init(clients: [String: RedisClient], stores: [String: TokenStoreSettings]) {
        self.clients = clients
        self.stores = stores
    }

    public func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
        do throws(StepFailure) {
            switch action {
            case .purgeSet(let target, let set): return try await purgeSet(try client(target), target: target, set)
            case .purgeKeys(let target, let keys):
                let removed = try await unlink(try client(target), keys.map { Array($0.utf8) })
                return .done("\(removed) of \(keys.count) keys deleted")
            case .purgePattern(let target, let pattern): return try await purgePattern(try client(target), pattern)
            case .setFlag(let target, let key, let value, let ttl):
                var command = ["SET", key, value]
                if let ttl {
                    // Redis takes at most 2^63 - 1 ms; a figure beyond (a stored plan of an old
                    // configuration) fails the step rather than trapping the process on every start.
                    guard ttl.isFinite, ttl >= 0, ttl < 9.2e15 else { return .failed("the flag's ttl \(ttl) s is beyond what Redis takes") }
                    command += ["EX", String(max(1, Int(ttl.rounded(.up))))]
                }
                try check(try await send(try client(target), [command]))
                return .done("\(key) set" + (ttl.map { " for \(Int($0)) s" } ?? ""))
            case .deleteToken(let storeName):
                guard let reference = context.namedToken else { return .failed("the event names no token to delete") }
                return try await deleteToken(reference, in: try store(storeName))
            case .deleteTokens(let storeName, let planned):
                guard let user = planned ?? context.user else { return .failed("the subject resolved to no local user") }
                return try await deleteTokens(of: user, in: try store(storeName))
            case .revokeTokens, .notify, .sql:
                return .failed("\(action.kind) is not a Redis step")
            }
        } catch {
            return error.outcome
        }
    }

    /// Purge-set steps: their first pages share one round trip.
    public func runsTogether(_ action: StepAction) -> Bool {
        if case .purgeSet = action { return true }
        return false
    }

    /// Purge-set steps on one target (as the step runner gathers them) share one round trip;
    /// any other mix runs each call on its own.
    public func execute(_ calls: [StepCall]) async -> [StepOutcome] {
        var target: String? = nil
        var sets: [String] = []
        for call in calls {
            guard case .purgeSet(let named, let set) = call.action, target == nil || named == target else { break }
            target = named
            sets.append(set)
        }
        guard sets.count == calls.count, let target, let client = clients[target], !refusingScripts.contains(target) else {
            return await executeEach(calls)
        }
        return await purgeSets(client, target: target, sets)
    }

    // MARK: - Steps

    /// Deletes every key the set lists, then removes those members from the set (so a session
    /// added meanwhile, after the event, stays listed rather than becoming untracked). A crash
    /// in between leaves members whose keys are gone: running again deletes nothing new and
    /// removes them.
    ///
    /// Each page (SSCAN, UNLINK, SREM) is one round trip: a script run by the server
    /// (`purgePagesScript`), which also makes the page atomic. A server that refuses scripts gets
    /// the page in two round trips instead.
    ///
    /// `page`: where an earlier call left off (a purge whose first page was read with other
    /// events' steps, in `execute(_:)`).
    func purgeSet(_ client: RedisClient, target: String, _ set: String, continuing page: PurgeProgress = PurgeProgress())
        async throws(StepFailure) -> StepOutcome
    {
        var page = page
        repeat {
            if !refusingScripts.contains(target), try await purgePageByScript(client, target: target, set, &page) { continue }
            try await purgePage(client, set, &page)
        } while page.cursor != "0"
        // SSCAN may return a member twice; SREM of the ones already removed is harmless.
        return page.done(set)
    }

    struct PurgeProgress {
        var cursor = "0"
        var members = 0
        var deleted: Int64 = 0

        func done(_ set: String) -> StepOutcome { .done("\(members) listed, \(deleted) keys deleted from \(set)") }
    }

    /// A script's SHA-1 in hex, as EVALSHA names it.
    static func digest(_ script: String) -> String {
        Insecure.SHA1.hash(data: Array(script.utf8)).map { byte in
            let digits = Array("0123456789abcdef".utf8)
            return String(decoding: [digits[Int(byte >> 4)], digits[Int(byte & 0xF)]], as: UTF8.self)
        }.joined()
    }

    /// One page by script; false, with nothing done, when the server refuses scripts (the
    /// target is then remembered as refusing them).
    func purgePageByScript(_ client: RedisClient, target: String, _ set: String, _ page: inout PurgeProgress)
        async throws(StepFailure) -> Bool
    {
        try take(try await purgePages(client, [(set, page.cursor)])[0], target: target, &page)
    }

    static func isUncachedScript(_ reply: RedisReply) -> Bool {
        if case .error(let message) = reply, message.hasPrefix("NOSCRIPT") { return true }
        return false
    }

    /// Reads the script's reply for one page into `page`; false, with nothing done, when the
    /// server refuses scripts (the target is then remembered as refusing them).
    func take(_ reply: RedisReply, target: String, _ page: inout PurgeProgress) throws(StepFailure) -> Bool {
        if case .error(let message) = reply, Self.refusesScripts(message) {
            refusingScripts.insert(target)
            return false
        }
        guard case .array(let parts) = reply, parts.count == 3, let next = parts[0].text,
              let members = parts[1].integer, let deleted = parts[2].integer else {
            throw StepFailure.refused(try describe(reply, "the purge-set script"))
        }
        page.cursor = next
        page.members += Int(members)
        page.deleted += deleted
        return true
    }

    /// One page of each set in `KEYS`, from its cursor (`ARGV[1 + i]` for `KEYS[i]`; about
    /// `ARGV[1]` members): the members SSCAN lists, their keys unlinked, then the members
    /// removed from the set. For each set, the next cursor, how many members were listed and how
    /// many keys existed. Many events' first pages go in one call: for sets of a few sessions,
    /// that costs the server about two thirds of one call each.
    ///
    /// Each set's reply is its own: a command refused for one set's keys (`WRONGTYPE`, a key the
    /// user may not touch) is that set's error, and the other sets are purged. Any other error
    /// (`READONLY` after a failover, `OOM`) ends the call and is its reply, as the error of a
    /// command would be: the client sees it, and the sets purged before it are purged again,
    /// with nothing left to delete, when their steps are retried.
    ///
    /// The members go to UNLINK and SREM a thousand at a time: Lua's `unpack` takes at most
    /// about 8,000, and a set the server keeps compact (`set-max-intset-entries` raised) is
    /// listed whole by one SSCAN whatever the COUNT.
    static let purgePagesScript = """
        local function refusesTheKey(reply)
          return string.find(reply.err, '^WRONGTYPE') or string.find(reply.err, '^NOPERM')
        end
        local out = {}
        for i = 1, #KEYS do
          local page = redis.pcall('SSCAN', KEYS[i], ARGV[1 + i], 'COUNT', ARGV[1])
          if page.err then
            if not refusesTheKey(page) then return page end
            out[i] = page
          else
            local members = page[2]
            local deleted = 0
            for j = 1, #members, 1000 do
              local last = math.min(j + 999, #members)
              local unlinked = redis.pcall('UNLINK', unpack(members, j, last))
              if type(unlinked) == 'table' then
                if not refusesTheKey(unlinked) then return unlinked end
                out[i] = unlinked
                break
              end
              deleted = deleted + unlinked
              local removed = redis.pcall('SREM', KEYS[i], unpack(members, j, last))
              if type(removed) == 'table' then
                if not refusesTheKey(removed) then return removed end
                out[i] = removed
                break
              end
            end
            if out[i] == nil then out[i] = {page[1], #members, deleted} end
          end
        end
        return out
        """
    static let purgePagesDigest = digest(purgePagesScript)

    /// Sets per call of `purgePagesScript`: a call holds the server while it runs, so a batch
    /// of hundreds of events is sent as several calls (in one round trip) rather than one.
    static let setsPerScriptCall = 32

    /// The command that runs `purgePagesScript` on `pages`: by digest, or with the script's text
    /// (which the server then caches).
    func pagesCommand(_ pages: ArraySlice<(set: String, cursor: String)>, withText: Bool) -> [String] {
        var command = withText ? ["EVAL", Self.purgePagesScript] : ["EVALSHA", Self.purgePagesDigest]
        command.reserveCapacity(pages.count * 2 + 4)
        command.append(String(pages.count))
        for page in pages { command.append(page.set) }
        command.append(String(chunk))
        for page in pages { command.append(page.cursor) }
        return command
    }

    /// One page of each set, from its cursor, in one round trip (a script call per
    /// `setsPerScriptCall` sets): each set's reply, as `take` reads it. A call refused whole
    /// (scripts refused, or an error of the server's) is each of its sets' reply.
    func purgePages(_ client: RedisClient, _ pages: [(set: String, cursor: String)]) async throws(StepFailure) -> [RedisReply] {
        let calls = stride(from: 0, to: pages.count, by: Self.setsPerScriptCall).map { $0..<min($0 + Self.setsPerScriptCall, pages.count) }
        var answers = try await send(client, calls.map { pagesCommand(pages[$0], withText: false) })
        // Not in the server's script cache yet (or flushed): those calls again with the text.
        let uncached = answers.indices.filter { Self.isUncachedScript(answers[$0]) }
        if !uncached.isEmpty {
            let again = try await send(client, uncached.map { pagesCommand(pages[calls[$0]], withText: true) })
            for (call, answer) in zip(uncached, again) { answers[call] = answer }
        }
        var replies: [RedisReply] = []
        replies.reserveCapacity(pages.count)
        for (call, answer) in zip(calls, answers) {
            if case .array(let each) = answer, each.count == call.count {
                replies.append(contentsOf: each)
            } else {
                replies.append(contentsOf: repeatElement(answer, count: call.count))
            }
        }
        return replies
    }

    /// Purge-set steps of many events on one target: the first page of every set in one round
    /// trip (`purgePages`). A purge with more pages goes on alone, as does every purge when the
    /// server does not run scripts.
    func purgeSets(_ client: RedisClient, target: String, _ sets: [String]) async -> [StepOutcome] {
        let replies: [RedisReply]
        do throws(StepFailure) {
            replies = try await purgePages(client, sets.map { ($0, "0") })
        } catch {
            return Array(repeating: error.outcome, count: sets.count)
        }
        var outcomes = [StepOutcome?](repeating: nil, count: sets.count)
        var alone: [Int: PurgeProgress] = [:]
        for (i, reply) in replies.enumerated() {
            var page = PurgeProgress()
            do throws(StepFailure) {
                if try !take(reply, target: target, &page) {
                    alone[i] = PurgeProgress()
                } else if page.cursor != "0" {
                    alone[i] = page
                } else {
                    outcomes[i] = page.done(sets[i])
                }
            } catch {
                outcomes[i] = error.outcome
            }
        }
        let pending = Array(alone)
        let rest = await concurrently(pending) { i, page in
            do throws(StepFailure) {
                return try await purgeSet(client, target: target, sets[i], continuing: page)
            } catch {
                return error.outcome
            }
        }
        for ((i, _), outcome) in zip(pending, rest) { outcomes[i] = outcome }
        return outcomes.map { $0! }
    }

    /// Scripting turned off, renamed away or denied to this user by an ACL. (A denial of the
    /// keys themselves comes back again from the plain commands, and fails the step there.)
    static func refusesScripts(_ message: String) -> Bool {
        message.hasPrefix("NOPERM") || message.hasPrefix("ERR unknown command") || message.hasPrefix("ERR unknown or disabled command")
    }

    /// One page in two round trips: SSCAN, then UNLINK and SREM.
    func purgePage(_ client: RedisClient, _ set: String, _ page: inout PurgeProgress) async throws(StepFailure) {
        let reply = try await send(client, [["SSCAN", set, page.cursor, "COUNT", String(chunk)]])[0]
        guard case .array(let parts) = reply, parts.count == 2, let next = parts[0].text, let listed = parts[1].array else {
            throw StepFailure.refused(try describe(reply, "SSCAN"))
        }
        page.cursor = next
        // The members' bytes as listed: a key that is not UTF-8 is deleted as it is named.
        let keys = listed.compactMap(\.bytes)
        page.members += keys.count
        if !keys.isEmpty { page.deleted += try await unlinkAndForget(client, set: set, keys) }
    }

    func unlinkAndForget(_ client: RedisClient, set: String, _ keys: [[UInt8]]) async throws(StepFailure) -> Int64 {
        let replies = try await send(client, [[Array("UNLINK".utf8)] + keys, [Array("SREM".utf8), Array(set.utf8)] + keys])
        try check(replies)
        return replies[0].integer ?? 0
    }

    /// UNLINKs keys (their bytes) in chunks; returns how many existed.
    func unlink(_ client: RedisClient, _ keys: [[UInt8]]) async throws(StepFailure) -> Int64 {
        var removed: Int64 = 0
        for start in stride(from: 0, to: keys.count, by: chunk) {
            let replies = try await send(client, [[Array("UNLINK".utf8)] + keys[start..<min(start + chunk, keys.count)]])
            try check(replies)
            removed += replies[0].integer ?? 0
        }
        return removed
    }

    /// SCAN with MATCH (never KEYS, which blocks the server), UNLINK what matches.
    func purgePattern(_ client: RedisClient, _ pattern: String) async throws(StepFailure) -> StepOutcome {
        var cursor = "0", deleted: Int64 = 0
        repeat {
            let reply = try await send(client, [["SCAN", cursor, "MATCH", pattern, "COUNT", String(chunk)]])[0]
            guard case .array(let parts) = reply, parts.count == 2, let next = parts[0].text, let page = parts[1].array else {
                throw StepFailure.refused(try describe(reply, "SCAN"))
            }
            cursor = next
            let keys = page.compactMap(\.bytes)
            if !keys.isEmpty { deleted += try await unlink(client, keys) }
        } while cursor != "0"
        return .done("\(deleted) keys matching \(pattern) deleted")
    }

    /// Deletes the held token the event names. With an index: looked up there, confirmed
    /// against the held value (constant-time), deleted with its index entries. Without one, or
    /// when the identifier is not in the index's standard form: every hash of the store is scanned.
    func deleteToken(_ reference: TokenReference, in store: (TokenStoreSettings, RedisClient)) async throws(StepFailure)
        -> StepOutcome
    {
        let (settings, client) = store
        if let index = settings.index, let keys = Self.indexKeys(for: reference) {
            var deleted = 0
            for key in keys {
                let location = try await checked(client, ["HGET", index, key])
                guard let text = location.text else { continue }
                // `<user>/<token id>`: either may hold a slash, so each split is tried; the held
                // value decides which is the token.
                var found = false
                for (user, tokenID) in Self.splits(text) {
                    let hash = settings.hash(of: user)
                    guard let held = try await checked(client, ["HGET", hash, tokenID]).text else { continue }
                    found = true
                    let identifiers = HeldTokenIdentifiers(token: held)
                    guard reference.match(identifiers) != nil else { continue }
                    try check(try await send(client, [["HDEL", hash, tokenID]]))
                    try await forgetIndexEntries(client, index: index, identifiers.indexKeys, pointingTo: text)
                    deleted += 1
                }
                // A stale index entry: the token is gone already.
                if !found { try await forgetIndexEntries(client, index: index, [key], pointingTo: text) }
            }
            return .done(deleted > 0 ? "held token \(reference) deleted" : "no held token matches \(reference)")
        }
        // Scan every hash of the store.
        let pattern = settings.hashPattern
        var cursor = "0", deleted = 0
        repeat {
            let reply = try await send(client, [["SCAN", cursor, "MATCH", pattern, "COUNT", String(chunk)]])[0]
            guard case .array(let parts) = reply, parts.count == 2, let next = parts[0].text, let page = parts[1].array else {
                throw StepFailure.refused(try describe(reply, "SCAN"))
            }
            cursor = next
            for hash in page.compactMap(\.bytes) {
                let fields = try await checked(client, [Array("HGETALL".utf8), hash]).array ?? []
                for i in stride(from: 0, to: fields.count - 1, by: 2) {
                    guard let tokenID = fields[i].bytes, let held = fields[i + 1].text else { continue }
                    let identifiers = HeldTokenIdentifiers(token: held)
                    guard reference.match(identifiers) != nil else { continue }
                    try check(try await send(client, [[Array("HDEL".utf8), hash, tokenID]]))
                    if let index = settings.index, let user = settings.user(ofHash: hash) {
                        try await forgetIndexEntries(client, index: index, identifiers.indexKeys,
                                                     pointingTo: user + "/" + String(decoding: tokenID, as: UTF8.self))
                    }
                    deleted += 1
                }
            }
        } while cursor != "0"
        return .done(deleted > 0 ? "\(deleted) held token(s) matching \(reference) deleted" : "no held token matches \(reference)")
    }

    /// The ways to read an index value `<user>/<token id>` when either may hold a slash: each
    /// slash in turn (at most 16).
    static func splits(_ location: String) -> [(user: String, tokenID: String)] {
        var splits: [(user: String, tokenID: String)] = []
        var index = location.startIndex
        while let slash = location[index...].firstIndex(of: "/"), splits.count < 16 {
            splits.append((String(location[..<slash]), String(location[location.index(after: slash)...])))
            index = location.index(after: slash)
        }
        return splits
    }

    /// Removes the index entries among `keys` that still point to `location` (`<user>/<token id>`):
    /// a `prefix:` entry is shared by every token that starts alike, and may point to another
    /// user's token, which must stay findable.
    func forgetIndexEntries(_ client: RedisClient, index: String, _ keys: [String], pointingTo location: String)
        async throws(StepFailure)
    {
        guard !keys.isEmpty else { return }
        let current = try await checked(client, ["HMGET", index] + keys).array ?? []
        let owned = zip(keys, current).compactMap { key, value in value.text == location ? key : nil }
        if !owned.isEmpty { try check(try await send(client, [["HDEL", index] + owned])) }
    }

    /// The index keys to look up, or nil when only a scan can find the token.
    static func indexKeys(for reference: TokenReference) -> [String]? {
        switch reference.identifierAlgorithm {
        case .plain: HeldTokenIdentifiers(token: reference.value).indexKeys
        case .prefix: ["prefix:" + reference.value]
        case .hashBase64SHA512SHA512:
            // The standard form is padded base64 of 64 bytes; other encodings are matched by scanning.
            reference.value.count == 88 && reference.value.hasSuffix("==") ? ["sha512:" + reference.value] : nil
        }
    }

    /// Deletes the user's whole token hash and its index entries.
    func deleteTokens(of user: String, in store: (TokenStoreSettings, RedisClient)) async throws(StepFailure) -> StepOutcome {
        let (settings, client) = store
        let hash = settings.hash(of: user)
        let fields = try await checked(client, ["HGETALL", hash]).array ?? []
        let held = stride(from: 0, to: fields.count - 1, by: 2).compactMap { i in
            fields[i].text.flatMap { id in fields[i + 1].text.map { (id: id, token: $0) } }
        }
        try check(try await send(client, [["UNLINK", hash]]))
        if let index = settings.index {
            for (id, token) in held {
                try await forgetIndexEntries(client, index: index, HeldTokenIdentifiers(token: token).indexKeys, pointingTo: user + "/" + id)
            }
        }
        return .done("\(held.count) held token(s) of the user deleted")
    }

    /// The tokens a store holds for the user: (token id, token).
    func heldTokens(of user: String, store name: String) async throws(StepFailure) -> [(id: String, token: String)] {
        let (settings, client) = try store(name)
        let fields = try await checked(client, ["HGETALL", settings.hash(of: user)])
        let items = fields.array ?? []
        var held: [(id: String, token: String)] = []
        for i in stride(from: 0, to: items.count - 1, by: 2) {
            if let id = items[i].text, let token = items[i + 1].text { held.append((id, token)) }
        }
        return held
    }

    /// Deletes one held token and its index entries.
    func forgetHeldToken(id: String, token: String, of user: String, store name: String) async throws(StepFailure) {
        let (settings, client) = try store(name)
        try check(try await send(client, [["HDEL", settings.hash(of: user), id]]))
        if let index = settings.index {
            try await forgetIndexEntries(client, index: index, HeldTokenIdentifiers(token: token).indexKeys, pointingTo: user + "/" + id)
        }
    }

    // MARK: - Plumbing

    enum StepFailure: Error {
        case unreachable(String)
        case refused(String)
        case misconfigured(String)

        var outcome: StepOutcome {
            switch self {
            case .unreachable(let m): .retry(m, after: nil)
            case .refused(let m), .misconfigured(let m): .failed(m)
            }
        }
    }

    func client(_ target: String) throws(StepFailure) -> RedisClient {
        guard let client = clients[target] else { throw .misconfigured("no Redis target named \"\(target)\"") }
        return client
    }

    func store(_ name: String) throws(StepFailure) -> (TokenStoreSettings, RedisClient) {
        guard let settings = stores[name] else { throw .misconfigured("no token store named \"\(name)\"") }
        return (settings, try client(settings.redisTarget))
    }

    func send(_ client: RedisClient, _ commands: [[String]]) async throws(StepFailure) -> [RedisReply] {
        try await Self.replies { () async throws(RedisError) in try await client.pipeline(commands) }
    }

    /// `send`, for commands whose arguments are bytes (keys as the server listed them).
    func send(_ client: RedisClient, _ commands: [[[UInt8]]]) async throws(StepFailure) -> [RedisReply] {
        try await Self.replies { () async throws(RedisError) in try await client.pipeline(commands) }
    }

    /// A round trip's replies; a connection problem is `unreachable` (retried), anything else `refused`.
    private static func replies(_ roundTrip: () async throws(RedisError) -> [RedisReply]) async throws(StepFailure) -> [RedisReply] {
        do {
            return try await roundTrip()
        } catch {
            throw error.isRetryable ? .unreachable(error.message) : .refused(error.message)
        }
    }

    /// One command's reply, an error reply failing the step (`check`): a lookup the server
    /// refused is not "nothing there", or a revoked token would be recorded done and kept.
    func checked(_ client: RedisClient, _ command: [String]) async throws(StepFailure) -> RedisReply {
        try await checked(client, command.map { Array($0.utf8) })
    }

    func checked(_ client: RedisClient, _ command: [[UInt8]]) async throws(StepFailure) -> RedisReply {
        let reply = try await send(client, [command])[0]
        try check([reply])
        return reply
    }

    /// An error reply fails the step: the server refused it and will again (`WRONGTYPE`,
    /// `NOPERM`); `LOADING`/`BUSY`/`TRYAGAIN` mean later.
    func check(_ replies: [RedisReply]) throws(StepFailure) {
        for reply in replies {
            if case .error(let message) = reply {
                throw reply.isTransientError ? .unreachable("Redis: \(message)") : .refused("Redis refused the step: \(message)")
            }
        }
    }

    func describe(_ reply: RedisReply, _ command: String) throws(StepFailure) -> String {
        try check([reply])
        return "unexpected reply to \(command)"
    }
}

/// Names of targets, shared by every copy of an executor.
final class TargetSet: Sendable {
    private let names = Mutex<Set<String>>([])
    func contains(_ name: String) -> Bool { names.withLock { $0.contains(name) } }
    func insert(_ name: String) { names.withLock { _ = $0.insert(name) } }
}
