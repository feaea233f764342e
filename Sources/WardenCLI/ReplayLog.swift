import CZlib
import Kafka
import Logging
import Foundation
import SecurityEvents
import TokenVerification

/// One entry of a log being replayed.
struct ReplayEntry: Sendable {
    /// Where it is in the log, for the report: `line 12`, `partition 0 offset 44`.
    var position: String
    /// The compact SET (or whatever bytes the log holds there).
    var token: [UInt8]
    /// When it was first received, if the log says (a JSON line's `received_at`, a Kafka
    /// message's timestamp): its claims are judged as of then.
    var receivedAt: Double?
    /// Why the entry holds no token at all (a JSON line without `token`).
    var malformed: String?
}

/// Where a replay's entries come from.
protocol ReplaySource {
    /// Up to `limit` entries; empty at the end.
    mutating func next(limit: Int) throws -> [ReplayEntry]
    /// How far the source is read: done and total in the source's own units (bytes of the
    /// file, messages of the range); total nil when unknown.
    var progress: (done: Double, total: Double?) { get }
    /// Releases the file or the consumer.
    func close()
    /// For a topic: whether its message at `partition`/`offset` is still on it but outside the
    /// time range (a ledger event recorded from it is not missing from the range).
    func isOutsideTheRange(partition: Int32, offset: Int64) -> Bool
    /// For a topic: when the ends of what it reads were taken. A ledger event received later
    /// may come from past them (a worker goes on consuming while the replay reads): no event
    /// missing from the range.
    var readsUntil: Double { get }
}

extension ReplaySource {
    func isOutsideTheRange(partition: Int32, offset: Int64) -> Bool { false }
    var readsUntil: Double { .infinity }
}

struct ReplayLogError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}

/// A log file, gzip-compressed (`.gz`, or any file that starts with gzip's magic bytes) or
/// plain, read line by line in bounded memory: one compact SET per line, or JSON Lines whose
/// objects carry the SET as `token` (and optionally `received_at`, RFC 3339 or seconds).
struct FileReplaySource: ReplaySource {
    /// Longest line taken: longer ones are reported as malformed, not held whole.
    static let maximumLineBytes = 1 << 20

    private let file: gzFile
    private let size: Double
    private var chunk = [UInt8](repeating: 0, count: 1 << 16)
    private var chunkStart = 0
    private var chunkEnd = 0
    private var line: [UInt8] = []
    private var lineTooLong = false
    private var lineNumber = 0
    private var ended = false
    /// A read error met after some entries of a batch: thrown by the next call.
    private var failure: (any Error)? = nil
    /// Tokens longer than this are refused for their size alone, and not kept: a batch of long
    /// lines holds little.
    private let maximumTokenBytes: Int

    init(path: String, maximumTokenBytes: Int = SETVerifier.defaultMaximumTokenBytes) throws {
        self.maximumTokenBytes = maximumTokenBytes
        guard let attributes = try? FileManager.default.attributesOfItem(atPath: path),
              (attributes[.type] as? FileAttributeType) == .typeRegular else {
            throw ReplayLogError("\(path): no such file")
        }
        // zlib reads a plain file as it is, and a gzip file uncompressed.
        guard let file = gzopen(path, "rb") else { throw ReplayLogError("\(path): cannot be opened") }
        gzbuffer(file, 1 << 17)
        self.file = file
        size = Double((attributes[.size] as? NSNumber)?.int64Value ?? 0)
    }

    func close() { gzclose(file) }

    var progress: (done: Double, total: Double?) { (Double(gzoffset(file)), size > 0 ? size : nil) }

    mutating func next(limit: Int) throws -> [ReplayEntry] {
        if let failure {
            self.failure = nil
            throw failure
        }
        var entries: [ReplayEntry] = []
        while entries.count < limit {
            let line: (Int, [UInt8], Bool)?
            do {
                line = try nextLine()
            } catch {
                // What was read whole before the damage is replayed; the error comes next.
                guard entries.isEmpty else {
                    failure = error
                    return entries
                }
                throw error
            }
            guard let (number, bytes, tooLong) = line else { break }
            let trimmed = trimmedASCIIWhitespace(bytes)
            if trimmed.isEmpty, !tooLong { continue }
            let position = "line \(number)"
            if tooLong {
                entries.append(ReplayEntry(position: position, token: [], malformed: "the line is longer than \(Self.maximumLineBytes) bytes"))
                continue
            }
            let entry = Self.entry(trimmed, position: position)
            guard entry.token.count <= maximumTokenBytes else {
                entries.append(ReplayEntry(position: position, token: [],
                                           malformed: "the token is \(entry.token.count) bytes, more than the \(maximumTokenBytes) allowed"))
                continue
            }
            entries.append(entry)
        }
        return entries
    }

    /// A line's entry: a compact SET, or a JSON object holding one as `token`.
    static func entry(_ line: ArraySlice<UInt8>, position: String) -> ReplayEntry {
        guard line.first == UInt8(ascii: "{") else { return ReplayEntry(position: position, token: Array(line)) }
        guard case .object(let object)? = try? JSONParser.parse(line) else {
            return ReplayEntry(position: position, token: [], malformed: "the line starts with { but is not a JSON object")
        }
        guard let token = object["token"]?.stringValue else {
            return ReplayEntry(position: position, token: [], malformed: "the JSON line has no \"token\" string")
        }
        var receivedAt: Double? = nil
        switch object["received_at"] {
        case .string(let text)?: receivedAt = RFC3339.parse(text)
        case .number(let seconds)?: receivedAt = seconds
        default: break
        }
        return ReplayEntry(position: position, token: Array(token.utf8), receivedAt: receivedAt)
    }

    /// The next line (without its line feed), its number, and whether it was cut for length.
    private mutating func nextLine() throws -> (Int, [UInt8], Bool)? {
        line.removeAll(keepingCapacity: true)
        lineTooLong = false
        while true {
            if chunkStart == chunkEnd {
                guard !ended else { break }
                let read = chunk.withUnsafeMutableBytes { gzread(file, $0.baseAddress, UInt32($0.count)) }
                if read < 0 {
                    var code: Int32 = 0
                    let message = gzerror(file, &code).map { String(cString: $0) } ?? "read error"
                    throw ReplayLogError("the log cannot be read: \(message)")
                }
                if read == 0 {
                    // zlib tells a gzip file cut short only through its error state: the
                    // read just returns nothing, as at the end of a whole file.
                    var code: Int32 = 0
                    let message = gzerror(file, &code).map { String(cString: $0) } ?? "read error"
                    if code != 0 { throw ReplayLogError("the log cannot be read: \(message) (the file is cut short or damaged)") }
                    ended = true
                    break
                }
                chunkStart = 0
                chunkEnd = Int(read)
            }
            let newline = chunk.withUnsafeBufferPointer { buffer -> Int? in
                let base = UnsafeRawPointer(buffer.baseAddress!)
                return memchr(base + chunkStart, Int32(UInt8(ascii: "\n")), chunkEnd - chunkStart).map { UnsafeRawPointer($0) - base }
            }
            let end = newline ?? chunkEnd
            if !lineTooLong {
                if line.count + (end - chunkStart) > Self.maximumLineBytes {
                    lineTooLong = true
                    line.removeAll()
                } else {
                    line.append(contentsOf: chunk[chunkStart..<end])
                }
            }
            chunkStart = newline.map { $0 + 1 } ?? chunkEnd
            if newline != nil {
                lineNumber += 1
                return (lineNumber, line, lineTooLong)
            }
        }
        guard !line.isEmpty || lineTooLong else { return nil }
        lineNumber += 1
        return (lineNumber, line, lineTooLong)
    }
}

/// A Kafka topic over a time range, read by a consumer of its own that commits nothing.
struct KafkaReplaySource: ReplaySource {
    let reader: KafkaTopicReader

    init(kafka: KafkaSettings, topic: String, from: Double?, to: Double?) throws {
        var logger = Logger(label: "warden")
        logger.logLevel = .error
        reader = try KafkaTopicReader(bootstrapServers: kafka.brokers, properties: KafkaProperties(kafka.properties), topic: topic,
                                      from: from, to: to, logger: logger)
    }

    var progress: (done: Double, total: Double?) { (Double(reader.consumed), Double(reader.total)) }

    mutating func next(limit: Int) throws -> [ReplayEntry] {
        try reader.next(limit: limit).map { message in
            ReplayEntry(position: "partition \(message.partition) offset \(message.offset)",
                        token: message.deliveryError == nil ? Array(trimmedASCIIWhitespace(message.value)) : [],
                        receivedAt: message.timestamp.map { Double($0) / 1000 },
                        malformed: message.deliveryError.map { "the message could not be read whole: \($0)" })
        }
    }

    func close() { reader.close() }

    func isOutsideTheRange(partition: Int32, offset: Int64) -> Bool { reader.isOutsideTheRange(partition: partition, offset: offset) }

    var readsUntil: Double { reader.endsTakenAt }
}
