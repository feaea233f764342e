import Foundation
public import Ledger
public import Logging
import SecurityEvents
public import TokenVerification
import Synchronization

/// A message from any door (Kafka, push, poll, replay), not yet verified.
public struct IntakeMessage: Sendable {
    public var value: [UInt8]
    /// Where it came from, for the ledger and the dead letter: `kafka:topic/partition/offset`, `push`, …
    public var source: String
    public var receivedAt: Double

    public init(value: [UInt8], source: String, receivedAt: Double) {
        self.value = value
        self.source = source
        self.receivedAt = receivedAt
    }
}

/// What happened to a message, once it is durable.
public enum Disposition: Sendable, Equatable {
    /// A new event, claimed and recorded with its outcome.
    case recorded(eventID: Int64, outcome: EventOutcome)
    /// The (issuer, jti) was already in the ledger.
    case duplicate(eventID: Int64)
    /// The token failed verification: dead-lettered and recorded.
    case rejected(code: String)
    /// Shutting down before the outcome was durable; the message must be delivered again.
    case abandoned
}

/// Where invalid messages go, with the error as headers. Returns once the dead letter is durable.
public protocol DeadLetterSink: Sendable {
    func deadLetter(value: [UInt8], code: String, description: String, source: String) async throws
}

/// Tells long waits (retries) that the process is stopping.
public final class StopSignal: Sendable {
    private let flag = Mutex(false)
    public init() {}
    public func stop() { flag.withLock { $0 = true } }
    public var isStopping: Bool { flag.withLock { $0 } }

    /// Sleeps up to `seconds`, waking early when stopping. Returns false when stopping.
    func pause(_ seconds: Double) async -> Bool {
        var left = seconds
        while left > 0 {
            if isStopping || Task.isCancelled { return false }
            let step = min(left, 0.1)
            try? await Task.sleep(for: .seconds(step))
            left -= step
        }
        return !isStopping
    }
}

/// The core of the pipeline: verify → claim → plan → record. Returns only when the outcome is
/// durable (or the process is stopping), so the caller may then commit the message.
public struct EventProcessor: Sendable {
    public let verifier: SETVerifier
    public let ledger: any Ledger
    public let deadLetters: any DeadLetterSink
    public let metrics: WardenMetrics
    public let logger: Logger
    public let stop: StopSignal
    /// Backoff bounds for retries (keys unavailable, ledger or dead-letter failures), seconds.
    public var initialBackoff: Double = 0.5
    public var maximumBackoff: Double = 30

    public init(verifier: SETVerifier, ledger: any Ledger, deadLetters: any DeadLetterSink, metrics: WardenMetrics,
                logger: Logger, stop: StopSignal) {
        self.verifier = verifier
        self.ledger = ledger
        self.deadLetters = deadLetters
        self.metrics = metrics
        self.logger = logger
        self.stop = stop
    }

    public func process(_ message: IntakeMessage) async -> Disposition {
        var attempt = 0
        while true {
            let started = ContinuousClock.now
            // Whitespace around a compact JWS (a trailing newline from a file or a shell) is not
            // part of it; the dead letter and the ledger keep the value as received.
            let result = await verifier.verify(trimmedASCIIWhitespace(message.value))
            let elapsed = (ContinuousClock.now - started).components
            metrics.verifySeconds.recordNanoseconds(elapsed.seconds * 1_000_000_000 + elapsed.attoseconds / 1_000_000_000)
            switch result {
            case .success(let verified):
                return await record(verified, message)
            case .failure(let error) where error.isRetryable:
                metrics.retried("keys_unavailable")
                logger.warning("issuer keys unavailable; will retry", metadata: [
                    "warden.source": "\(message.source)", "warden.reason": "\(error.description)", "warden.attempt": "\(attempt)",
                ])
                guard await stop.pause(backoff(attempt)) else { return .abandoned }
                attempt += 1
            case .failure(let error):
                return await reject(message, code: error.reportedCode, description: error.description)
            }
        }
    }

    private func record(_ verified: VerifiedSET, _ message: IntakeMessage) async -> Disposition {
        let token = verified.token
        let event = LedgerEvent(
            issuer: token.issuer, jti: token.jti, token: String(decoding: trimmedASCIIWhitespace(message.value), as: UTF8.self),
            source: message.source,
            eventTypes: token.events.map(\.type.uri), subject: token.primarySubject.map { $0.json.jsonText },
            keyID: verified.header.keyID, algorithm: verified.header.algorithm.rawValue, keyThumbprint: verified.keyThumbprint,
            issuedAt: token.issuedAt, receivedAt: message.receivedAt)
        // Until the invalidation engine plans steps, a verified event waits as pending.
        let outcome: EventOutcome = .pending
        let steps: [String] = []
        guard let claim = await retrying("claim", { try await ledger.claim(event, outcome: outcome, steps: steps) }) else {
            return .abandoned
        }
        switch claim {
        case .duplicate(let id):
            metrics.outcome("duplicate")
            logger.info("duplicate event", metadata: metadata(token, message, eventID: id))
            return .duplicate(eventID: id)
        case .new(let id):
            metrics.outcome(outcome.rawValue)
            logger.info("event recorded", metadata: metadata(token, message, eventID: id).merging(["warden.outcome": "\(outcome.rawValue)"]) { $1 })
            return .recorded(eventID: id, outcome: outcome)
        }
    }

    private func reject(_ message: IntakeMessage, code: String, description: String) async -> Disposition {
        metrics.verifyFailure(code)
        guard await retrying("dead-letter", { () async throws -> Bool in
            try await deadLetters.deadLetter(value: message.value, code: code, description: description, source: message.source)
            return true
        }) != nil else { return .abandoned }
        metrics.deadLettered()
        let rejection = Rejection(token: message.value, source: message.source, code: code, description: description,
                                  receivedAt: message.receivedAt)
        guard await retrying("record-rejection", { () async throws -> Bool in
            try await ledger.recordRejection(rejection)
            return true
        }) != nil else {
            return .abandoned
        }
        metrics.outcome("invalid")
        logger.warning("invalid token dead-lettered", metadata: [
            "warden.source": "\(message.source)", "warden.err": "\(code)", "warden.reason": "\(description)",
            "warden.token": "\(TokenDigest.short(message.value))",
        ])
        return .rejected(code: code)
    }

    /// Runs `body` until it succeeds, backing off between failures; nil when stopping first.
    private func retrying<T>(_ what: String, _ body: () async throws -> T) async -> T? {
        var attempt = 0
        while true {
            do {
                return try await body()
            } catch {
                metrics.retried(what)
                logger.error("\(what) failed; will retry", metadata: ["warden.reason": "\(error)", "warden.attempt": "\(attempt)"])
                guard await stop.pause(backoff(attempt)) else { return nil }
                attempt += 1
            }
        }
    }

    func backoff(_ attempt: Int) -> Double {
        let base = min(maximumBackoff, initialBackoff * pow(2, Double(min(attempt, 16))))
        return base * Double.random(in: 0.5...1.0)
    }

    private func metadata(_ token: SecurityEventToken, _ message: IntakeMessage, eventID: Int64) -> Logger.Metadata {
        [
            "warden.source": "\(message.source)", "warden.iss": "\(token.issuer)", "warden.jti": "\(token.jti)",
            "warden.events": "\(token.events.map(\.type.name).joined(separator: ","))", "warden.event_id": "\(eventID)",
        ]
    }
}

func trimmedASCIIWhitespace(_ bytes: [UInt8]) -> ArraySlice<UInt8> {
    let isSpace: (UInt8) -> Bool = { $0 == 0x20 || $0 == 0x09 || $0 == 0x0A || $0 == 0x0D }
    guard let start = bytes.firstIndex(where: { !isSpace($0) }), let end = bytes.lastIndex(where: { !isSpace($0) }) else {
        return []
    }
    return bytes[start...end]
}

/// Tokens never appear whole in logs: a short digest identifies one.
enum TokenDigest {
    static func short(_ bytes: [UInt8]) -> String {
        // FNV-1a, 64 bits: enough to tell tokens apart in logs, useless for recovering them.
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in bytes { hash = (hash ^ UInt64(b)) &* 0x100_0000_01b3 }
        return "fnv1a:" + String(hash, radix: 16) + " (\(bytes.count) bytes)"
    }
}
