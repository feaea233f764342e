public import Redis
public import SecurityEvents

/// What subject resolution came to.
public enum ResolutionOutcome: Sendable, Hashable {
    case resolved(SubjectResolution)
    /// The lookup could not be made now (Redis down): the event waits and is tried again.
    case retry(String)
    /// The lookup was refused and will be again (no permission, a key of the wrong type, an
    /// answer that is not an id): not "no such user", which would record the event with no
    /// steps. The event is refused with `subject_lookup_refused` and dead-lettered;
    /// `warden replay --apply` acts on it once the lookup is mended.
    case refused(String)
}

/// Turns a provider subject into the local user id.
public protocol SubjectResolver: Sendable {
    func resolve(_ token: SecurityEventToken) async -> ResolutionOutcome
}

/// The provider's `sub` is the local user id: the `sub` of the issuer that signed the token
/// (a subject naming another issuer's account resolves to no one).
public struct IdentityResolver: SubjectResolver {
    public init() {}

    public func resolve(_ token: SecurityEventToken) async -> ResolutionOutcome {
        if let sub = Planner.scopedSubject(token.primarySubject, in: token) { return .resolved(.user(sub)) }
        return .resolved(.unresolved)
    }
}

/// A Redis string key, filled from the subject (`user-by-sub:{iss}|{sub}`), holds the local id.
public struct RedisResolver: SubjectResolver {
    public let client: RedisClient
    public let key: String

    public init(client: RedisClient, key: String) {
        self.client = client
        self.key = key
    }

    public func resolve(_ token: SecurityEventToken) async -> ResolutionOutcome {
        guard let event = token.events.first else { return .resolved(.unresolved) }
        let values = Planner.values(for: event, in: token, resolution: .unresolved)
        guard let filled = try? Planner.substitute(key, values: values, escapeGlob: false) else { return .resolved(.unresolved) }
        do {
            let reply = try await client.send(["GET", filled])
            switch reply {
            case .string(let bytes) where !bytes.isEmpty: return .resolved(.user(String(decoding: bytes, as: UTF8.self)))
            case .error(let message) where reply.isTransientError:
                return .retry("Redis cannot answer the subject lookup yet: \(message)")
            case .error(let message): return .refused("Redis refused the subject lookup: \(message)")
            default: return .resolved(.unresolved)
            }
        } catch {
            return .retry("subject lookup: \(error.message)")
        }
    }
}
