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

    public init(token: SecurityEventToken, user: String?) {
        self.token = token
        self.user = user
    }

    /// The token a `token-revoked` event names.
    public var namedToken: TokenReference? { token.events.lazy.compactMap(\.token).first }
}

/// Runs the steps of one kind of target. Every executor is idempotent: a step whose outcome was
/// not recorded before a crash runs again, and running it twice has the effect of running it once.
public protocol StepExecutor: Sendable {
    func execute(_ action: StepAction, context: StepContext) async -> StepOutcome
}
