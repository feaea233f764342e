import Logging
import Synchronization
import Testing
@testable import WardenCLI

/// What a token's signer or a transmitter chose (a `jti` with a line break, a stream-updated
/// `reason` with an escape sequence) reaches a log line with its control characters written
/// `\u{…}`: it can neither forge a line nor drive the terminal the log is read on.
@Suite("Log lines")
struct LogSafetyTests {
    final class Capture: LogHandler, @unchecked Sendable {
        // `@unchecked Sendable`: `logged` is behind a Mutex; the rest is set once by the test.
        let logged = Mutex<[(message: String, metadata: Logger.Metadata)]>([])
        var metadata: Logger.Metadata = [:]
        var logLevel: Logger.Level = .trace
        subscript(metadataKey key: String) -> Logger.Metadata.Value? {
            get { metadata[key] }
            set { metadata[key] = newValue }
        }
        func log(event: LogEvent) { logged.withLock { $0.append((event.message.description, event.metadata ?? [:])) } }
    }

    @Test func controlCharactersInMessagesAndMetadataAreEscaped() {
        let capture = Capture()
        let logger = Logger(label: "test") { _ in SharedLevelLogHandler(capture) }
        logger.critical("event \("j\n2026-01-01T00:00:00Z critical warden : ledger wiped") recorded", metadata: [
            "warden.jti": "a\u{1b}]52;c;x\u{07}",
            "warden.reason": .array(["\u{9b}2J", "fine"]),
            "warden.plain": "nothing to escape",
        ])
        let (message, metadata) = capture.logged.withLock { $0[0] }
        #expect(message == #"event j\u{a}2026-01-01T00:00:00Z critical warden : ledger wiped recorded"#)
        #expect(metadata["warden.jti"] == .string(#"a\u{1b}]52;c;x\u{7}"#))
        #expect(metadata["warden.reason"] == .array([.string(#"\u{9b}2J"#), .string("fine")]))
        #expect(metadata["warden.plain"] == .string("nothing to escape"))
    }
}
