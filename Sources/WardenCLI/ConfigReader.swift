import Foundation
import Synchronization
import Yams

/// A configuration problem, naming the key at fault.
public struct ConfigError: Error, Sendable, CustomStringConvertible {
    public var path: String
    public var message: String

    public init(path: String, _ message: String) {
        self.path = path
        self.message = message
    }

    public var description: String { path.isEmpty ? "config: \(message)" : "config: \(path): \(message)" }
}

/// The YAML document as a plain tree, so every value can be read with its path and be
/// overridden by an environment variable.
indirect enum ConfigTree: Sendable {
    case scalar(String)
    case list([ConfigTree])
    case map([(String, ConfigTree)])
    case null

    static func parse(yaml: String) throws(ConfigError) -> ConfigTree {
        let node: Node?
        do {
            node = try Yams.compose(yaml: yaml)
        } catch {
            throw ConfigError(path: "", "the file is not valid YAML: \(yamlProblem(error))")
        }
        guard let node else { return .map([]) }
        return try convert(node, path: "")
    }

    /// Where and what the YAML problem is, in the parser's own words, without the file's text:
    /// the line at fault may hold a secret (`client-secret: @…` is not a plain scalar).
    static func yamlProblem(_ error: any Error) -> String {
        guard let error = error as? YamlError else { return "it cannot be read" }
        func within(_ context: YamlError.Context?) -> String {
            context.map { "\($0.text) (line \($0.mark.line), column \($0.mark.column)): " } ?? ""
        }
        switch error {
        case let .scanner(context, problem, mark, _), let .parser(context, problem, mark, _), let .composer(context, problem, mark, _):
            return "line \(mark.line), column \(mark.column): \(within(context))\(problem)"
        case let .reader(problem, offset, _, _):
            return offset.map { "byte \($0): \(problem)" } ?? problem
        case .duplicatedKeysInMapping(_, let context):
            return "line \(context.mark.line): a key appears twice"
        case .dataCouldNotBeDecoded:
            return "it is not UTF-8 text"
        default:
            return "it cannot be read"
        }
    }

    private static func convert(_ node: Node, path: String) throws(ConfigError) -> ConfigTree {
        switch node {
        case .scalar(let scalar):
            if scalar.style == .plain, ["", "~", "null", "Null", "NULL"].contains(scalar.string) { return .null }
            return .scalar(scalar.string)
        case .sequence(let sequence):
            var items: [ConfigTree] = []
            for (i, item) in sequence.enumerated() { items.append(try convert(item, path: "\(path)[\(i)]")) }
            return .list(items)
        case .mapping(let mapping):
            var members: [(String, ConfigTree)] = []
            for (key, value) in mapping {
                guard let name = key.string else { throw ConfigError(path: path, "mapping keys must be strings") }
                let child = path.isEmpty ? name : "\(path).\(name)"
                if members.contains(where: { $0.0 == name }) { throw ConfigError(path: child, "the key appears twice") }
                members.append((name, try convert(value, path: child)))
            }
            return .map(members)
        case .alias:
            throw ConfigError(path: path, "YAML aliases are not supported")
        }
    }
}

/// Reads one section of the configuration. Each value at path `a.b[0].c-d` may be replaced by
/// the environment variable `WARDEN_A_B_0_C_D`; a key `x-file` reads the value of `x` from a
/// file (for secrets).
struct ConfigReader {
    let tree: ConfigTree
    let path: [String]
    let environment: [String: String]
    let baseDirectory: URL
    /// The environment variables every reader of this configuration looked up, so that one
    /// matching no key can be refused.
    let consulted: ConsultedNames

    final class ConsultedNames: Sendable {
        let names = Mutex<Set<String>>([])
    }

    init(tree: ConfigTree, path: [String] = [], environment: [String: String], baseDirectory: URL,
         consulted: ConsultedNames = ConsultedNames()) {
        self.tree = tree
        self.path = path
        self.environment = environment
        self.baseDirectory = baseDirectory
        self.consulted = consulted
    }

    /// The override for this key, noting that it was looked for.
    private var override: String? {
        let name = environmentName
        consulted.names.withLock { _ = $0.insert(name) }
        return environment[name]
    }

    var pathText: String {
        var out = ""
        for part in path {
            if Int(part) != nil { out += "[\(part)]" } else { out += out.isEmpty ? part : ".\(part)" }
        }
        return out
    }

    func error(_ message: String) -> ConfigError { ConfigError(path: pathText, message) }

    func child(_ key: String) -> ConfigReader {
        var value: ConfigTree = .null
        if case .map(let members) = tree, let found = members.first(where: { $0.0 == key }) { value = found.1 }
        return ConfigReader(tree: value, path: path + [key], environment: environment, baseDirectory: baseDirectory, consulted: consulted)
    }

    var environmentName: String {
        "WARDEN_" + path.map { $0.uppercased().replacingOccurrences(of: "-", with: "_").replacingOccurrences(of: ".", with: "_") }
            .joined(separator: "_")
    }

    /// Keys present in this mapping; an error if this is not a mapping.
    func keys() throws(ConfigError) -> [String] {
        switch tree {
        case .map(let members):
            // A section's own variable would be read as nothing: refused, not ignored.
            if override != nil { throw error("is a section in the file: set its keys (\(environmentName)_…), not \(environmentName)") }
            return members.map(\.0)
        case .null: return []
        default: throw error("expected a mapping")
        }
    }

    /// Refuses keys that are not in `known`, naming the closest known one.
    func requireOnly(_ known: [String]) throws(ConfigError) {
        for key in try keys() where !known.contains(key) {
            let suggestion = known.min { Self.distance($0, key) < Self.distance($1, key) }
            let hint = suggestion.map { Self.distance($0, key) <= 3 ? " (did you mean \"\($0)\"?)" : "" } ?? ""
            throw child(key).error("unknown key\(hint)")
        }
    }

    /// Whether the YAML or the environment gives this key (a section is present when a
    /// variable for one of its keys is set).
    var isPresent: Bool {
        if isGiven { return true }
        let prefix = environmentName + "_"
        return environment.keys.contains { $0.hasPrefix(prefix) }
    }

    /// Whether this very key is given (in the YAML or by its own variable).
    /// Whether the YAML itself gives this key.
    var isInFile: Bool {
        if case .null = tree { return false }
        return true
    }

    var isGiven: Bool {
        if override != nil { return true }
        if case .null = tree { return false }
        return true
    }

    /// The value as a string, from the environment, the YAML, or a `-file` sibling.
    func string() throws(ConfigError) -> String? {
        if let value = override { return value }
        switch tree {
        case .scalar(let s): return s
        case .null: return nil
        default: throw error("expected a single value")
        }
    }

    func requiredString() throws(ConfigError) -> String {
        guard let s = try string(), !s.isEmpty else { throw error("is required") }
        return s
    }

    /// A list of strings: a YAML sequence, a single value, or a comma-separated environment value.
    func stringList() throws(ConfigError) -> [String]? {
        if let value = override {
            return value.split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
        }
        switch tree {
        case .null: return nil
        case .scalar(let s): return [s]
        case .list(let items):
            var out: [String] = []
            for (i, item) in items.enumerated() {
                guard case .scalar(let s) = item else {
                    throw ConfigError(path: "\(pathText)[\(i)]", "expected a single value")
                }
                out.append(s)
            }
            return out
        case .map: throw error("expected a list")
        }
    }

    func list() throws(ConfigError) -> [ConfigReader] {
        switch tree {
        case .null: return []
        case .list(let items):
            return items.indices.map { i in
                ConfigReader(tree: items[i], path: path + [String(i)], environment: environment, baseDirectory: baseDirectory,
                             consulted: consulted)
            }
        default: throw error("expected a list")
        }
    }

    /// A duration in seconds: `250ms`, `5s`, `10m`, `2h`, `7d`, or a bare number of seconds.
    func duration() throws(ConfigError) -> Double? {
        guard let text = try string()?.trimmingCharacters(in: .whitespaces) else { return nil }
        guard let seconds = Self.parseDuration(text) else {
            throw error("\"\(text)\" is not a duration of at most 100 years (examples: 250ms, 5s, 10m, 2h, 7d)")
        }
        return seconds
    }

    static func parseDuration(_ text: String) -> Double? {
        let units: [(String, Double)] = [("ms", 0.001), ("s", 1), ("m", 60), ("h", 3600), ("d", 86_400)]
        for (suffix, scale) in units where text.hasSuffix(suffix) {
            if let n = Double(text.dropLast(suffix.count)), n >= 0, n * scale <= longestDuration { return n * scale }
        }
        if let n = Double(text), n >= 0, n <= longestDuration { return n }
        return nil
    }

    /// The longest duration any key takes: 100 years. Past it a figure is a mistake, and one
    /// past 2^63 nanoseconds or seconds would trap wherever it becomes a whole number.
    static let longestDuration: Double = 100 * 365.25 * 86_400

    /// A size in bytes: `65536`, `64KiB`, `1MiB`.
    func byteSize() throws(ConfigError) -> Int? {
        guard let text = try string()?.trimmingCharacters(in: .whitespaces) else { return nil }
        let units: [(String, Int)] = [("KiB", 1024), ("MiB", 1024 * 1024), ("KB", 1000), ("MB", 1_000_000), ("B", 1)]
        for (suffix, scale) in units where text.hasSuffix(suffix) {
            if let n = Int(text.dropLast(suffix.count).trimmingCharacters(in: .whitespaces)), n > 0 {
                let (bytes, overflow) = n.multipliedReportingOverflow(by: scale)
                guard !overflow else { throw error("\"\(text)\" is more bytes than this machine can count") }
                return bytes
            }
        }
        if let n = Int(text), n > 0 { return n }
        throw error("\"\(text)\" is not a size (examples: 65536, 64KiB, 1MiB)")
    }

    /// Reads a file named by this value, relative to the configuration file's folder.
    func fileContents() throws(ConfigError) -> (contents: [UInt8], path: String)? {
        guard let name = try string() else { return nil }
        let url = name.hasPrefix("/") ? URL(fileURLWithPath: name) : baseDirectory.appendingPathComponent(name)
        guard let data = FileManager.default.contents(atPath: url.path) else {
            throw error("cannot read the file \(url.path)")
        }
        return (Array(data), url.path)
    }

    /// A secret given inline as `key` or, better, read from the file `key-file` (a trailing
    /// newline is dropped). Errors never show the secret.
    func secret(_ key: String) throws(ConfigError) -> String? {
        let inline = child(key), file = child(key + "-file")
        if inline.isGiven, file.isGiven { throw file.error("give either \(key) or \(key)-file, not both") }
        if inline.isGiven { return try inline.requiredString() }
        guard let (contents, path) = try file.fileContents() else { return nil }
        guard var text = String(bytes: contents, encoding: .utf8) else { throw file.error("the file \(path) is not UTF-8 text") }
        // "\r\n" is one Character to Swift: trim scalars, or a CRLF file keeps its "\r\n".
        while let last = text.unicodeScalars.last, last == "\n" || last == "\r" { text.unicodeScalars.removeLast() }
        guard !text.isEmpty else { throw file.error("the file \(path) is empty") }
        return text
    }

    static func distance(_ a: String, _ b: String) -> Int {
        let a = Array(a), b = Array(b)
        var row = Array(0...b.count)
        for i in 1...max(a.count, 1) where !a.isEmpty {
            var previous = row[0]
            row[0] = i
            for j in stride(from: 1, through: b.count, by: 1) {
                let current = row[j]
                row[j] = min(row[j] + 1, row[j - 1] + 1, previous + (a[i - 1] == b[j - 1] ? 0 : 1))
                previous = current
            }
        }
        return a.isEmpty ? b.count : row[b.count]
    }
}
