public import SecurityEvents

/// What running a step came to.
public enum StepOutcome: Sendable, Hashable {
    /// The step's effect holds (also when there was nothing to do: idempotent steps).
    case done(String)
    /// The target could not be reached or asked to wait: run the step again later,
    /// not before `after` seconds when the target said so (`Retry-After`).
    case retry(String, after: Double?)
    /// The step can never succeed as configured (refused credentials, unsupported token type):
    /// it goes to the dead-letter topic with its reason, and operators are alerted.
    case failed(String)

    public var result: String {
        switch self {
        case .done: "done"
        case .retry: "retry"
        case .failed: "failed"
        }
    }
}

/// What a step may need to know about its event.
public struct StepContext: Sendable {
    public var token: SecurityEventToken
    /// The local user the subject resolved to, if it did.
    public var user: String?
    /// The event type (canonical URI) the step is for.
    public var eventType: String

    public init(token: SecurityEventToken, user: String?, eventType: String? = nil) {
        self.token = token
        self.user = user
        self.eventType = eventType ?? token.events.first.map { Policy.key(for: $0.type) } ?? ""
    }

    /// The token a `token-revoked` event names.
    public var namedToken: TokenReference? { token.events.lazy.compactMap(\.token).first }
}

/// Runs the steps of one kind of target. Every executor is idempotent: a step whose outcome was
/// not recorded before a crash runs again, and running it twice has the effect of running it once.
public protocol StepExecutor: Sendable {
    func execute(_ action: StepAction, context: StepContext) async -> StepOutcome
    /// Runs steps of several events at once; their outcomes, in order. Calls to a target that
    /// allows it share round trips (Redis: one pipeline). By default each runs in a task of its own.
    func execute(_ calls: [StepCall]) async -> [StepOutcome]
    /// Whether steps like this one gain from running with other events' (`execute(_ calls:)`):
    /// the step runner then gathers them. Others run on their own, so a slow call (a webhook
    /// near its deadline) holds up no other event's. By default, none.
    func runsTogether(_ action: StepAction) -> Bool
}

/// One step to run for one event.
public struct StepCall: Sendable {
    public var action: StepAction
    public var context: StepContext

    public init(action: StepAction, context: StepContext) {
        self.action = action
        self.context = context
    }
}

extension StepExecutor {
    public func execute(_ calls: [StepCall]) async -> [StepOutcome] { await executeEach(calls) }
    public func runsTogether(_ action: StepAction) -> Bool { false }

    /// Each call on its own, all at once.
    public func executeEach(_ calls: [StepCall]) async -> [StepOutcome] {
        await concurrently(calls) { await execute($0.action, context: $0.context) }
    }
}

/// `body` applied to every item at once, a task each (none for a single item); the results in
/// the items' order.
func concurrently<Item: Sendable, Result: Sendable>(_ items: [Item], _ body: @escaping @Sendable (Item) async -> Result) async
    -> [Result]
{
    if items.count == 1 { return [await body(items[0])] }
    return await withTaskGroup(of: (Int, Result).self) { group in
        for (i, item) in items.enumerated() { group.addTask { (i, await body(item)) } }
        var results = [Result?](repeating: nil, count: items.count)
        for await (i, result) in group { results[i] = result }
        return results.map { $0! }
    }
}

/// Runs any planned step on the target it names: Redis steps, RFC 7009 revocation of a token
/// store's tokens, webhooks, SQL statements.
public struct TargetExecutor: StepExecutor {
    public let redis: RedisStepExecutor
    public let revocation: RevocationClient
    public let webhooks: WebhookNotifier
    public let sql: SQLStepExecutor
    public let targets: [String: TargetSettings]

    public init(redis: RedisStepExecutor, revocation: RevocationClient, webhooks: WebhookNotifier,
                sql: SQLStepExecutor = SQLStepExecutor(targets: [:]), targets: [String: TargetSettings]) {
        self.redis = redis
        self.revocation = revocation
        self.webhooks = webhooks
        self.sql = sql
        self.targets = targets
    }

    public func execute(_ action: StepAction, context: StepContext) async -> StepOutcome {
        switch action {
        case .purgeSet, .purgeKeys, .purgePattern, .setFlag, .deleteToken, .deleteTokens:
            return await redis.execute(action, context: context)
        case .revokeTokens(let store, let target, let hint, let planned):
            guard case .revoke(let endpoint)? = targets[target] else { return .failed("no revoke target named \"\(target)\"") }
            guard let user = planned ?? context.user else { return .failed("the subject resolved to no local user") }
            return await revokeTokens(of: user, store: store, hint: hint, at: endpoint)
        case .notify(let target, let planned):
            guard case .webhook(let endpoint)? = targets[target] else { return .failed("no webhook target named \"\(target)\"") }
            var context = context
            if let planned { context.user = planned }
            return await webhooks.notify(context, eventType: context.eventType, at: endpoint)
        case .sql:
            return await sql.execute(action, context: context)
        }
    }

    /// Redis steps go to the Redis executor together (the step runner gathers one target's
    /// steps); any other mix runs each call on its own.
    public func execute(_ calls: [StepCall]) async -> [StepOutcome] {
        calls.allSatisfy({ Self.isRedis($0.action) }) ? await redis.execute(calls) : await executeEach(calls)
    }

    public func runsTogether(_ action: StepAction) -> Bool { Self.isRedis(action) && redis.runsTogether(action) }

    static func isRedis(_ action: StepAction) -> Bool {
        switch action {
        case .purgeSet, .purgeKeys, .purgePattern, .setFlag, .deleteToken, .deleteTokens: true
        case .revokeTokens, .notify, .sql: false
        }
    }

    /// Revokes each token the store holds for the user, deleting each one once revoked, so a
    /// retry after a failure part-way revokes only what is left. A token the endpoint refuses
    /// (another client's, a stale value) is kept and fails the step, after the others were
    /// revoked: one refusal must not leave the rest valid.
    func revokeTokens(of user: String, store name: String, hint: String?, at endpoint: RevocationEndpoint) async -> StepOutcome {
        do throws(RedisStepExecutor.StepFailure) {
            let held = try await redis.heldTokens(of: user, store: name)
            var refused: [String] = []
            for (id, token) in held {
                switch await revocation.revoke(token, hint: hint, at: endpoint) {
                case .done: try await redis.forgetHeldToken(id: id, token: token, of: user, store: name)
                case .retry(let reason, let after): return .retry(reason, after: after)
                case .failed(let reason): refused.append(reason)
                }
            }
            let host = endpoint.url.host ?? "the endpoint"
            if let first = refused.first {
                return .failed("\(refused.count) of \(held.count) held token(s) refused at \(host) and kept, the others revoked and deleted: \(first)")
            }
            return .done("\(held.count) held token(s) revoked at \(host) and deleted")
        } catch {
            return error.outcome
        }
    }
}
