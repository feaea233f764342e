import AsyncHTTPClient
import Foundation
public import HTTPExchange
public import Logging
import NIOCore
import NIOHTTP1
import SecurityEvents
import Synchronization

/// What became of one polled SET.
public enum PolledOutcome: Sendable, Equatable {
    /// Persisted (or known already): acknowledged in the next request.
    case persisted
    /// It failed parsing or validation: reported in `setErrs` (RFC 8935 code and description).
    case refused(code: String, description: String)
    /// It cannot be persisted now: neither acknowledged nor reported; the transmitter sends it again.
    case notNow
}

/// The RFC 8936 poll door: long polls with `maxEvents`, hands each SET to `persist`, and
/// acknowledges in the next request only what was durably persisted (a redelivered SET again,
/// every time), reporting invalid ones in `setErrs`. Loops at once while the transmitter says
/// `moreAvailable`; backs off after failures, honouring `Retry-After` on 429 and 503.
public final class PollClient: Sendable {
    public struct Settings: Sendable {
        public var endpoint: String
        /// SETs asked for per request.
        public var maximumEvents: Int
        /// Seconds a request may take, a long poll's wait included.
        public var requestTimeout: Double
        /// Backoff bounds after a failed request.
        public var initialBackoff: Double
        public var maximumBackoff: Double
        /// After an answer with no SETs and nothing to acknowledge: the pause before the next
        /// request, so a transmitter that answers at once (no long poll) is not asked in a tight loop.
        public var idlePause: Double

        public init(endpoint: String, maximumEvents: Int = 100, requestTimeout: Double = 60, initialBackoff: Double = 1,
                    maximumBackoff: Double = 60, idlePause: Double = 1) {
            self.endpoint = endpoint
            self.maximumEvents = max(1, maximumEvents)
            self.requestTimeout = requestTimeout
            self.initialBackoff = initialBackoff
            self.maximumBackoff = maximumBackoff
            self.idlePause = idlePause
        }
    }

    /// Acknowledgements and errors not yet sent, kept across failed requests.
    private struct Pending {
        var acks: [String] = []
        var errors: [(jti: String, code: String, description: String)] = []
    }

    let settings: Settings
    let call: TransmitterCall
    /// Persists one answer's SETs, in their order; an outcome for each.
    let persist: @Sendable ([[UInt8]]) async -> [PolledOutcome]
    let logger: Logger
    /// Told of each request's answer (`"200"`, `"429"`, `"error"`): a metric.
    let observe: @Sendable (String) -> Void
    private let pending = Mutex(Pending())

    public init(settings: Settings, credentials: any StreamCredentials, http: any HTTPExchanging, logger: Logger,
                observe: @escaping @Sendable (String) -> Void = { _ in },
                persist: @escaping @Sendable ([[UInt8]]) async -> [PolledOutcome]) {
        self.settings = settings
        var call = TransmitterCall(http: http, credentials: credentials, timeout: settings.requestTimeout)
        // Room for `maxEvents` SETs of the largest size verified (64 KiB) with their jti: a
        // queue of large SETs must not make every answer too large, and the stream stall.
        call.maximumAnswerBytes = max(1 << 20, settings.maximumEvents * Self.answerBytesPerSET + (64 << 10))
        self.call = call
        self.persist = persist
        self.logger = logger
        self.observe = observe
    }

    /// Polls until the task is cancelled; then `flush()` sends what is left to acknowledge.
    public func poll() async {
        var failures = 0
        var immediately = false
        while !Task.isCancelled {
            switch await round(returnImmediately: immediately) {
            case .more:
                failures = 0
                immediately = true
            case .done:
                failures = 0
                immediately = false
            case .idle:
                failures = 0
                immediately = false
                try? await Task.sleep(for: .milliseconds(Int(settings.idlePause * 1000)))
            case .failed(let wait):
                failures += 1
                immediately = false
                let backoff = min(settings.maximumBackoff, settings.initialBackoff * pow(2, Double(min(failures - 1, 16))))
                let seconds = max(wait ?? 0, backoff * Double.random(in: 0.5...1.0))
                try? await Task.sleep(for: .milliseconds(Int(seconds * 1000)))
            }
        }
    }

    /// Sends the acknowledgements and errors still pending, asking for no SETs.
    public func flush() async {
        let (acks, errors) = pending.withLock { ($0.acks, $0.errors) }
        guard !acks.isEmpty || !errors.isEmpty else { return }
        _ = await request(maximumEvents: 0, returnImmediately: true, acks: acks, errors: errors)
    }

    enum Round { case more, done, idle, failed(retryAfter: Double?) }

    /// One request: what is pending is acknowledged, and the SETs answered are persisted.
    func round(returnImmediately: Bool) async -> Round {
        let (acks, errors) = pending.withLock { ($0.acks, $0.errors) }
        guard let sets = await request(maximumEvents: settings.maximumEvents, returnImmediately: returnImmediately,
                                       acks: acks, errors: errors) else {
            return .failed(retryAfter: lastRetryAfter.withLock { $0 })
        }
        guard case .object(let object) = sets else { return .failed(retryAfter: nil) }
        // At most what was asked for: entries past `maxEvents` (a transmitter's fault, or an
        // answer of a million junk entries) are neither persisted nor reported — the
        // transmitter sends them again — so one answer cannot hold the stream or the ledger.
        let answered = object["sets"]?.objectValue ?? [:]
        let delivered = JSONObject(Array(answered.members.prefix(settings.maximumEvents)))
        let more = (object["moreAvailable"]?.boolValue ?? false) || answered.count > delivered.count
        // The SETs persisted together, in the order the transmitter gave them (one subject's
        // events keep it); the acknowledgements go with the next request.
        var outcomes: [(String, PolledOutcome)] = []
        var tokens: [(jti: String, token: [UInt8])] = []
        for (jti, value) in delivered {
            if let token = value.stringValue {
                tokens.append((jti, Array(token.utf8)))
            } else {
                outcomes.append((jti, .refused(code: "invalid_request", description: "the value is not a compact SET string")))
            }
        }
        if !tokens.isEmpty {
            let persisted = await persist(tokens.map(\.token))
            outcomes += zip(tokens.map(\.jti), persisted).map { ($0, $1) }
        }
        pending.withLock { p in
            for (jti, outcome) in outcomes {
                switch outcome {
                case .persisted: p.acks.append(jti)
                case .refused(let code, let description): p.errors.append((jti, code, description))
                case .notNow: break
                }
            }
        }
        let notNow = outcomes.filter { $0.1 == .notNow }.count
        if notNow > 0 {
            logger.warning("polled SETs not persisted now; the transmitter sends them again", metadata: ["warden.sets": "\(notNow)"])
            // Backing off only when nothing moved: one SET that cannot be had now (its issuer's
            // keys are down) must not slow the others it is redelivered with.
            if notNow == outcomes.count { return .failed(retryAfter: nil) }
        }
        // Only SETs this very request acknowledged or reported in error: the transmitter did not
        // take them (or sends them again at once). Asked again after the idle pause, not in a
        // tight loop that writes a duplicate delivery, or a rejection, per answer.
        let reported = Set(acks).union(errors.map(\.jti))
        if !delivered.isEmpty, delivered.allSatisfy({ reported.contains($0.name) }) {
            logger.warning("the transmitter sent again only SETs just acknowledged or reported; pausing before the next poll",
                           metadata: ["warden.sets": "\(delivered.count)"])
            return .idle
        }
        // More, but none given: asked again after the idle pause, not in a tight loop.
        if more, !delivered.isEmpty { return .more }
        // Nothing came and nothing waits to be acknowledged: pause before asking again.
        return delivered.count == 0 && pending.withLock({ $0.acks.isEmpty && $0.errors.isEmpty }) ? .idle : .done
    }

    /// An answer's bytes per SET asked for: a SET of at most 64 KiB, its jti and punctuation.
    static let answerBytesPerSET = 66 << 10

    private let lastRetryAfter = Mutex<Double?>(nil)
    /// Requests refused in a row with a status no retry mends (a 4xx other than 429).
    private let refusedInARow = Mutex(0)
    /// After this many, what is pending is dropped: the transmitter sends unacknowledged SETs
    /// again, so nothing is lost, and one entry it will not take cannot stop the stream.
    static let refusalsBeforeDropping = 3

    /// Sends one poll request; the answer's JSON, or nil when it failed (logged, counted). What
    /// was acknowledged is no longer pending once the transmitter answered 200.
    private func request(maximumEvents: Int, returnImmediately: Bool, acks: [String],
                         errors: [(jti: String, code: String, description: String)]) async -> JSONValue? {
        var body: JSONObject = ["maxEvents": .number(Double(maximumEvents)), "returnImmediately": .bool(returnImmediately)]
        if !acks.isEmpty { body["ack"] = .array(acks.map { .string($0) }) }
        if !errors.isEmpty {
            var setErrs = JSONObject()
            for error in errors { setErrs[error.jti] = .object(["err": .string(error.code), "description": .string(error.description)]) }
            body["setErrs"] = .object(setErrs)
        }
        lastRetryAfter.withLock { $0 = nil }
        let answer: TransmitterCall.Answer
        do {
            // The descriptions in setErrs are English.
            answer = try await call.send("poll", .POST, settings.endpoint, json: .object(body), language: errors.isEmpty ? nil : "en")
        } catch {
            observe("error")
            if !Task.isCancelled {
                logger.warning("poll request failed; will retry", metadata: ["warden.endpoint": "\(settings.endpoint)", "warden.reason": "\(error)"])
            }
            return nil
        }
        observe("\(answer.status)")
        guard answer.status == 200 else {
            // Waiting is bounded whatever the transmitter asks.
            lastRetryAfter.withLock { $0 = retryAfter(answer.headers).map { min($0, 5 * settings.maximumBackoff) } }
            if (400..<500).contains(answer.status), answer.status != 429, !acks.isEmpty || !errors.isEmpty {
                let refusals = refusedInARow.withLock { n -> Int in n += 1; return n }
                if refusals >= Self.refusalsBeforeDropping {
                    refusedInARow.withLock { $0 = 0 }
                    pending.withLock { p in
                        p.acks.removeFirst(min(acks.count, p.acks.count))
                        p.errors.removeFirst(min(errors.count, p.errors.count))
                    }
                    logger.error("the transmitter keeps refusing this poll request; its acknowledgements and errors are dropped (it sends those SETs again)", metadata: [
                        "warden.endpoint": "\(settings.endpoint)", "warden.status": "\(answer.status)",
                        "warden.acks": "\(acks.count)", "warden.errors": "\(errors.count)",
                    ])
                }
            }
            logger.warning("poll refused; will retry", metadata: [
                "warden.endpoint": "\(settings.endpoint)", "warden.status": "\(answer.status)",
                "warden.retry_after": "\(retryAfter(answer.headers).map { "\($0)" } ?? "-")",
            ])
            return nil
        }
        refusedInARow.withLock { $0 = 0 }
        // Sent and taken: what was acknowledged or reported is no longer pending (nothing is
        // added meanwhile: `round` persists only after its request, and `flush` runs after `poll`).
        pending.withLock { p in
            p.acks.removeFirst(min(acks.count, p.acks.count))
            p.errors.removeFirst(min(errors.count, p.errors.count))
        }
        guard let json = answer.json, json.objectValue != nil else {
            logger.warning("poll answer is not a JSON object", metadata: ["warden.endpoint": "\(settings.endpoint)"])
            return .object([:])
        }
        return json
    }
}
