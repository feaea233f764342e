import Foundation
import Testing
import WardenTestSupport
@testable import WardenCLI

/// The push receiver listens as soon as the process starts, while its ledger may still be
/// opening (a PostgreSQL server not reachable yet): its requests are answered 503 within their
/// deadline all the same, and SIGTERM ends the process.
@Suite("Push while the ledger cannot be opened")
struct PushLedgerDownTests {
    @Test func aPushIsAnswered503AndSIGTERMEndsTheProcess() async throws {
        let directory = try WorkerTests.keyFolder()
        defer { try? FileManager.default.removeItem(at: directory) }
        try "\(PushReceiverTests.bearer)\n".write(to: directory.appendingPathComponent("push-tokens"), atomically: true, encoding: .utf8)
        let config = directory.appendingPathComponent("warden.yaml")
        // A port that takes connections and never answers: opening the ledger hangs (a
        // PostgreSQL server not up yet, behind a load balancer), for longer than the test.
        let silent = try SilentListener()
        defer { withExtendedLifetime(silent) {} }
        let port = silent.port
        try """
        \(WorkerTests.issuerSection("jwks-file: jwks.json"))
        receiver:
          listen: 127.0.0.1:0
          path: /events
          bearer-tokens-file: push-tokens
        http:
          listen: 127.0.0.1:0
        ledger: postgres://warden@127.0.0.1:\(port)/warden
        """.write(to: config, atomically: true, encoding: .utf8)
        let worker = try WorkerProcess(config: config)
        let receiver = try await worker.announcedPort("receiver")
        let answer = try await PushReceiverTests.send(receiver, try WorkerTests.token(subject: "user-1"))
        #expect(answer.status == 503, "\(answer.status) \(answer.body)")

        worker.signal(SIGTERM)
        for _ in 0..<600 where worker.isRunning { try await Task.sleep(for: .milliseconds(100)) }
        #expect(!worker.isRunning, "warden run still runs 60 s after SIGTERM: \(worker.standardError.suffix(2000))")
        if worker.isRunning { await worker.kill() }
    }
}
