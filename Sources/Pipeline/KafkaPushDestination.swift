import Foundation
public import Kafka
import Ledger
import SecurityEvents
import TokenVerification

/// Pushed SETs onto the topic the workers read (`warden run` with both `receiver:` and
/// `kafka:`). Each is verified first: one that fails is answered `400` and kept in the ledger as
/// a rejection (it never reaches the topic). A valid one is produced as the Kafka message
/// contract says — value the SET, headers `content-type`, `source` (`push` or `poll`) and `received-at`, key
/// a stable hash of its issuer and subject, so one subject's events keep their order — and
/// answered `202` only once the cluster confirms delivery. Keys or a cluster that cannot be had:
/// `503`, and the sender tries again. A duplicate is produced again and answered `202`; the
/// worker that reads it finds it known.
public struct KafkaPushDestination: PushDestination {
    let processor: EventProcessor
    let producer: KafkaProducer
    let topic: String

    /// Tries of the ledger a request makes before its sender is told to come back (`503`): a
    /// request must not wait for a ledger outage to end.
    static let ledgerAttempts = 3

    /// The header that tells where a message on the topic came from.
    public static let sourceHeader = "source"

    public init(processor: EventProcessor, producer: KafkaProducer, topic: String) {
        self.processor = processor
        self.producer = producer
        self.topic = topic
    }

    public func persist(_ message: IntakeMessage) async -> PushOutcome {
        await persist(all: [message])[0]
    }

    /// Verified together, then produced in their order, all in flight at once: one subject's
    /// events keep their order on its partition, and a cluster that cannot be reached costs one
    /// delivery timeout for the whole poll answer, not one per SET.
    public func persist(all messages: [IntakeMessage]) async -> [PushOutcome] {
        let checked = await processor.check(messages.map { IntakeRecord($0, acknowledgement: Unanswered()) })
        guard checked.count == messages.count else { return messages.map { _ in .unavailable } }
        var outcomes: [PushOutcome?] = []
        var outgoing: [(index: Int, jti: String, message: KafkaProducer.Outgoing)] = []
        for (i, (message, checked)) in zip(messages, checked).enumerated() {
            switch await prepare(message, checked) {
            case .answered(let outcome):
                outcomes.append(outcome)
            case .produce(let jti, let produced):
                outcomes.append(nil)
                outgoing.append((i, jti, produced))
            }
        }
        let reports = await producer.send(all: outgoing.map(\.message))
        for (sent, report) in zip(outgoing, reports) {
            switch report {
            case .success:
                outcomes[sent.index] = .accepted
            case .failure(let error):
                processor.metrics.counter("warden_push_produce_failures_total").increment()
                processor.logger.warning("pushed token not produced; its sender is told to try again", metadata: [
                    "warden.topic": "\(topic)", "warden.reason": "\(error.description)", "warden.jti": "\(sent.jti)",
                ])
                outcomes[sent.index] = .unavailable
            }
        }
        return outcomes.map { $0 ?? .unavailable }
    }

    private enum Prepared {
        case answered(PushOutcome)
        case produce(jti: String, KafkaProducer.Outgoing)
    }

    /// What a checked SET comes to before producing: refused, unavailable, or the message to produce.
    private func prepare(_ message: IntakeMessage, _ checked: EventProcessor.Checked) async -> Prepared {
        switch checked.result {
        case .failure(let error) where error.isRetryable:
            return .answered(.unavailable)
        case .failure(let error):
            return .answered(await refuse(message, code: error.reportedCode, description: error.description))
        case .success(let verified):
            let token = verified.set.token
            // A verification event's state is checked here: its sender hears invalid_state.
            switch await processor.verificationState(of: token, maximumAttempts: Self.ledgerAttempts) {
            case .taken: break
            case .refused(let description):
                return .answered(await refuse(message, code: SETErrorCode.invalidState.rawValue, description: description))
            case .stopped: return .answered(.unavailable)
            }
            let headers = [
                KafkaHeader("content-type", "application/secevent+jwt"),
                // The door it came by: push, or poll.
                KafkaHeader(Self.sourceHeader, message.source),
                KafkaHeader(KafkaIntake.receivedAtHeader, Self.timestamp(message.receivedAt)),
            ]
            return .produce(jti: token.jti, KafkaProducer.Outgoing(topic: topic, key: Array(Self.key(token).utf8),
                                                                   value: Array(trimmedASCIIWhitespace(message.value)), headers: headers))
        }
    }

    /// Refused: kept in the ledger as a rejection from its door, and counted.
    private func refuse(_ message: IntakeMessage, code: String, description: String) async -> PushOutcome {
        processor.metrics.verifyFailure(code)
        processor.logger.warning("pushed token refused", metadata: [
            "warden.source": "\(message.source)", "warden.err": "\(code)", "warden.reason": "\(description)",
            "warden.token": "\(TokenDigest.short(message.value))",
        ])
        let rejection = Rejection(token: message.value, source: message.source, code: code, description: description,
                                  receivedAt: message.receivedAt)
        if case .stopped = await processor.attempting("ledger", maximumAttempts: Self.ledgerAttempts, {
            try await processor.ledger.recordRejection(rejection)
        }) {
            return .unavailable
        }
        processor.metrics.outcome("invalid")
        return .refused(code: code)
    }

    /// The message key: a stable hash of the token's issuer and subject (its lane).
    static func key(_ token: SecurityEventToken) -> String {
        TokenFingerprint.fingerprint(Array(token.laneKey.utf8))
    }

    /// RFC 3339, UTC, with milliseconds.
    static func timestamp(_ seconds: Double) -> String { RFC3339.string(from: seconds) }
}

/// A record verified outside the stages (a push checked before it is produced): nobody hears
/// of it through an acknowledgement.
struct Unanswered: Acknowledgement {
    func settle(_ disposition: Disposition) {}
}
