public import Foundation
public import Logging
import SecurityEvents
import Synchronization

/// One JSON object per line on standard error: `ts`, `level`, `label`, `msg`, then metadata.
/// Used when standard error is not a terminal (containers, log shippers).
public struct JSONLogHandler: LogHandler {
    public var metadata: Logger.Metadata = [:]
    public var logLevel: Logger.Level = .info
    let label: String

    private static let output = Mutex(FileHandle.standardError)
    /// UTC, with milliseconds: `2026-11-22T00:54:55.963Z`.
    private static let timestamp = Date.ISO8601FormatStyle(includingFractionalSeconds: true)

    public init(label: String) { self.label = label }

    public subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    public func log(event: LogEvent) {
        var object = JSONObject()
        object["ts"] = .string(Date().formatted(Self.timestamp))
        object["level"] = .string(event.level.rawValue)
        object["label"] = .string(label)
        object["msg"] = .string(event.message.description)
        var merged = metadata
        if let extra = event.metadata { merged.merge(extra) { $1 } }
        for (key, value) in merged.sorted(by: { $0.key < $1.key }) { object[key] = Self.json(value) }
        let line = JSONValue.object(object).jsonText + "\n"
        Self.output.withLock { $0.write(Data(line.utf8)) }
    }

    static func json(_ value: Logger.MetadataValue) -> JSONValue {
        switch value {
        case .string(let s): .string(s)
        case .stringConvertible(let c): .string(c.description)
        case .array(let items): .array(items.map(json))
        case .dictionary(let d): .object(JSONObject(d.sorted { $0.key < $1.key }.map { ($0.key, json($0.value)) }))
        }
    }

    /// The values of `WARDEN_LOG_FORMAT`; anything else is a configuration error.
    public static let formats = ["json", "text"]

    /// JSON lines when standard error is not a terminal, swift-log's text otherwise, unless
    /// `WARDEN_LOG_FORMAT` says which (`json` or `text`). The level
    /// comes from `WARDEN_LOG_LEVEL`, else the configuration's `logging.level` (default info),
    /// and follows a reload (SIGHUP).
    public static func bootstrap(level configured: Logger.Level? = nil,
                                 environment: [String: String] = ProcessInfo.processInfo.environment) {
        LogLevelControl.current = LogLevelControl.level(configured: configured, environment: environment)
        let json = switch environment["WARDEN_LOG_FORMAT"] {
        case "json": true
        case "text": false
        default: isatty(FileHandle.standardError.fileDescriptor) == 0
        }
        LoggingSystem.bootstrap { label in
            var handler: any LogHandler = json ? JSONLogHandler(label: label) : StreamLogHandler.standardError(label: label)
            handler.logLevel = .trace  // the shared level decides
            return SharedLevelLogHandler(handler)
        }
    }
}
