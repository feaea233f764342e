import Foundation
import Kafka
import Ledger
import Pipeline
import SecurityEvents
import SETMinting
import Testing
import TokenVerification
import WardenTestSupport
@testable import Pipeline

/// A SET the push receiver answered 202 and produced to the topic must not be refused as too
/// old because the workers read it late: the transmitter will not send it again. Its claims are
/// judged when it arrived (the `received-at` header), within what the ledger's retention keeps safe.
@Suite("Claims judged at a produced SET's arrival")
struct ArrivalTimeTests {
    static func header(_ seconds: Double) -> [KafkaHeader] {
        [KafkaHeader(KafkaIntake.receivedAtHeader, Array(RFC3339.string(from: seconds).utf8))]
    }

    @Test func theHeaderIsHonouredOnlyWithinTheWindow() {
        let now = 1_800_000_000.0
        func judged(_ headers: [KafkaHeader], window: Double) -> Double? {
            if case .at(let t) = KafkaIntake.claimsTime(of: headers, now: now, window: window) { return t }
            return nil
        }
        #expect(judged(Self.header(now - 3600), window: .infinity) == now - 3600)
        #expect(judged(Self.header(now - 3600), window: 7200) == now - 3600)
        #expect(judged(Self.header(now - 3600), window: 1800) == nil)
        #expect(judged(Self.header(now - 3600), window: 0) == nil)
        // Ahead of this host's clock by more than a second: not believed.
        #expect(judged(Self.header(now + 30), window: .infinity) == nil)
        #expect(judged([KafkaHeader(KafkaIntake.receivedAtHeader, Array("yesterday".utf8))], window: .infinity) == nil)
        #expect(judged([], window: .infinity) == nil)
    }

    @Test func theWindowIsWhatRetentionLeavesAfterTheLongestMaxAge() {
        let a = IssuerPolicy(issuer: "https://a.example/", keySource: .jwks(URL(string: "https://a.example/k")!), audiences: ["x"],
                             clockSkew: 300, maximumAge: 86_400)
        let b = IssuerPolicy(issuer: "https://b.example/", keySource: .jwks(URL(string: "https://b.example/k")!), audiences: ["x"],
                             clockSkew: 60, maximumAge: 3 * 86_400)
        #expect(KafkaIntake.arrivalWindow(retention: nil, issuers: [a, b]) == .infinity)
        #expect(KafkaIntake.arrivalWindow(retention: 30 * 86_400, issuers: [a, b]) == 27 * 86_400 - 60)
        #expect(KafkaIntake.arrivalWindow(retention: 86_400, issuers: [a, b]) == 0)
    }

    // Through the worker: an old token produced with its arrival a moment after it was issued
    // is recorded; the same kind of token without the header is refused as too old.
    @Test func aTokenReadLateIsJudgedAtItsArrival() async throws {
        let setup = try WorkerTests.Setup(keySource: "jwks-file: jwks.json\n    max-age: 60s")
        defer { setup.cleanUp() }
        let worker = try WorkerProcess(config: setup.config)
        _ = try await worker.httpPort()
        let issued = Date().timeIntervalSince1970 - 600
        func old(_ jti: String) throws -> String {
            try SETMinter.token(claims: SETMinter.riscClaims(issuer: WorkerTests.issuer, audience: WorkerTests.audience,
                                                             subject: "late-user", jti: jti, issuedAt: issued), key: WorkerTests.ec)
        }
        let script = """
        import sys
        from confluent_kafka import Producer
        p = Producer({'bootstrap.servers': sys.argv[1]})
        failed = []
        for line in sys.stdin:
            key, value, arrived = line.rstrip('\\n').split('\\t')
            headers = {'content-type': 'application/secevent+jwt'}
            if arrived: headers['received-at'] = arrived
            p.produce('security-events', value=value.encode(), key=key.encode(), headers=headers,
                      on_delivery=lambda err, msg: failed.append(err) if err else None)
        p.flush(30)
        sys.exit(1 if failed else 0)
        """
        let lines = [
            "late-user\t\(try old("pushed-before"))\t\(RFC3339.string(from: issued + 5))\n",
            "late-user\t\(try old("never-pushed"))\t\n",
        ]
        let produced = try await runToEnd(URL(fileURLWithPath: "/usr/bin/python3"), ["-c", script, setup.cluster.bootstrapServers],
                                          stdin: lines.joined())
        #expect(produced.status == 0, "\(produced.stderr.suffix(2000))")
        try await WorkerTests.waitFor("an event and a refusal in the ledger") {
            let reader = try SQLiteLedgerReader(path: setup.ledgerPath)
            return try reader.eventCount() >= 1 && reader.deliveries().count >= 1
        }
        let ledger = try SQLiteLedgerReader(path: setup.ledgerPath)
        #expect(try ledger.events().map(\.jti) == ["pushed-before"])
        let refused = try ledger.deliveries()
        #expect(refused.count == 1 && refused.first?.verdict == "invalid" && refused.first?.errorCode == "invalid_request",
                "\(refused)")
        #expect(refused.first?.errorDescription?.contains("maximum age") == true)
        #expect(await worker.terminate() == 0)
    }
}
