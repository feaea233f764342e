/// A JSON value as it appeared in a token: objects keep their members' order, numbers are
/// IEEE doubles (JWT NumericDates fit), strings are valid UTF-8.
public enum JSONValue: Sendable, Hashable {
    case null
    case bool(Bool)
    case number(Double)
    case string(String)
    case array([JSONValue])
    case object(JSONObject)

    public var stringValue: String? {
        if case .string(let s) = self { return s }
        return nil
    }

    public var numberValue: Double? {
        if case .number(let n) = self { return n }
        return nil
    }

    public var boolValue: Bool? {
        if case .bool(let b) = self { return b }
        return nil
    }

    public var objectValue: JSONObject? {
        if case .object(let o) = self { return o }
        return nil
    }

    public var arrayValue: [JSONValue]? {
        if case .array(let a) = self { return a }
        return nil
    }

    /// The JSON type's name, for error messages.
    public var typeName: String {
        switch self {
        case .null: "null"
        case .bool: "boolean"
        case .number: "number"
        case .string: "string"
        case .array: "array"
        case .object: "object"
        }
    }
}

/// A JSON object whose member names are unique (the parser rejects duplicates) and whose
/// members keep the order in which they were written.
public struct JSONObject: Sendable, Hashable, Sequence {
    public private(set) var members: [(name: String, value: JSONValue)]

    public init() { self.members = [] }

    public init(_ members: [(String, JSONValue)]) {
        self.members = []
        self.members.reserveCapacity(members.count)
        for (name, value) in members { self[name] = value }
    }

    public var count: Int { members.count }
    public var isEmpty: Bool { members.isEmpty }
    public var names: [String] { members.map(\.name) }

    public subscript(name: String) -> JSONValue? {
        get {
            for member in members where sameName(member.name, name) { return member.value }
            return nil
        }
        set {
            if let index = members.firstIndex(where: { sameName($0.name, name) }) {
                if let newValue { members[index].value = newValue } else { members.remove(at: index) }
            } else if let newValue {
                members.append((name, newValue))
            }
        }
    }

    public func contains(_ name: String) -> Bool { self[name] != nil }

    public func makeIterator() -> IndexingIterator<[(name: String, value: JSONValue)]> {
        members.makeIterator()
    }

    mutating func reserve(_ capacity: Int) { members.reserveCapacity(capacity) }

    /// Appends without looking for an existing member; the caller has checked uniqueness.
    mutating func appendUnique(_ name: String, _ value: JSONValue) {
        members.append((name, value))
    }

    public static func == (lhs: JSONObject, rhs: JSONObject) -> Bool {
        guard lhs.count == rhs.count else { return false }
        for (name, value) in lhs.members where rhs[name] != value { return false }
        return true
    }

    public func hash(into hasher: inout Hasher) {
        // Order-independent: combine per-member hashes commutatively.
        var combined = 0
        for (name, value) in members {
            var h = Hasher()
            h.combine(name)
            h.combine(value)
            combined ^= h.finalize()
        }
        hasher.combine(count)
        hasher.combine(combined)
    }
}

/// Whether two names are the same name: compared code point by code point (RFC 8259 §8.3), not
/// by Swift's `==`, which takes canonically equivalent strings as equal — "K" (U+004B) and the
/// Kelvin sign (U+212A) are two names, and a member must not pass for another. The same holds
/// for a token's issuer, audience and key id against what is configured or published.
///
/// Byte-identical strings are canonically equivalent, so `==` (a byte comparison for the ASCII
/// names tokens hold) rules out nearly every pair at its own speed; only a pair it takes as
/// equal has its bytes compared.
@inline(__always)
public func sameName(_ a: String, _ b: String) -> Bool {
    a == b && sameBytes(a, b)
}

/// Whether two strings hold the same UTF-8 bytes, compared in their contiguous storage (native
/// strings, small or large, have it; the generic walk over the views is several times slower).
func sameBytes(_ a: String, _ b: String) -> Bool {
    let (x, y) = (a.utf8, b.utf8)
    guard x.count == y.count else { return false }
    let compared: Bool?? = x.withContiguousStorageIfAvailable { p in
        y.withContiguousStorageIfAvailable { q in p.elementsEqual(q) }
    }
    if let compared, let compared { return compared }
    return x.elementsEqual(y)
}

/// A member name hashed and compared by its code points, for the parser's duplicate check.
struct CodePointName: Hashable {
    let text: String

    static func == (lhs: CodePointName, rhs: CodePointName) -> Bool { sameName(lhs.text, rhs.text) }

    func hash(into hasher: inout Hasher) {
        for byte in text.utf8 { hasher.combine(byte) }
    }
}

extension JSONObject: ExpressibleByDictionaryLiteral {
    public init(dictionaryLiteral elements: (String, JSONValue)...) {
        self.init(elements)
    }
}

extension JSONValue: ExpressibleByStringLiteral, ExpressibleByIntegerLiteral, ExpressibleByBooleanLiteral,
    ExpressibleByArrayLiteral, ExpressibleByDictionaryLiteral, ExpressibleByFloatLiteral, ExpressibleByNilLiteral
{
    public init(stringLiteral value: String) { self = .string(value) }
    public init(integerLiteral value: Int) { self = .number(Double(value)) }
    public init(floatLiteral value: Double) { self = .number(value) }
    public init(booleanLiteral value: Bool) { self = .bool(value) }
    public init(arrayLiteral elements: JSONValue...) { self = .array(elements) }
    public init(dictionaryLiteral elements: (String, JSONValue)...) { self = .object(JSONObject(elements)) }
    public init(nilLiteral: ()) { self = .null }
}

// MARK: - Parsing

/// Why a JSON text was refused, with the byte offset where the problem was found.
public struct JSONParseError: Error, Sendable, Equatable, CustomStringConvertible {
    public enum Kind: Sendable, Equatable {
        case syntax
        case duplicateMember(String)
        case invalidUTF8
        case tooDeep
        case trailingData
    }

    public var kind: Kind
    public var offset: Int

    public var description: String {
        switch kind {
        case .syntax: "malformed JSON at byte \(offset)"
        case .duplicateMember(let name): "duplicate member name \"\(name.prefix(64))\" at byte \(offset)"
        case .invalidUTF8: "invalid UTF-8 at byte \(offset)"
        case .tooDeep: "JSON nested too deeply at byte \(offset)"
        case .trailingData: "unexpected data after the JSON value at byte \(offset)"
        }
    }
}

/// A strict RFC 8259 parser: duplicate member names, invalid UTF-8, lone surrogates, leading
/// zeros, trailing commas and trailing data are all errors.
public enum JSONParser {
    public static let maximumDepth = 64

    /// Non-zero for bytes that end the fast scan of a string: `"`, `\`, controls, non-ASCII.
    static let stringStops: [UInt8] = (0..<256).map { b in
        b == 0x22 || b == 0x5C || b < 0x20 || b >= 0x80 ? 1 : 0
    }

    public static func parse(_ bytes: some Collection<UInt8>) throws(JSONParseError) -> JSONValue {
        if let result = bytes.withContiguousStorageIfAvailable({ buffer in
            Result { () throws(JSONParseError) -> JSONValue in try parse(buffer: buffer) }
        }) {
            return try result.get()
        }
        let copy = Array(bytes)
        return try copy.withUnsafeBufferPointer { buffer throws(JSONParseError) in try parse(buffer: buffer) }
    }

    public static func parse(_ text: String) throws(JSONParseError) -> JSONValue {
        var text = text
        return try text.withUTF8 { buffer in
            Result { () throws(JSONParseError) -> JSONValue in try parse(buffer: buffer) }
        }.get()
    }

    public static func parse(buffer: UnsafeBufferPointer<UInt8>) throws(JSONParseError) -> JSONValue {
        var reader = Reader(buffer: buffer)
        reader.skipWhitespace()
        let value = try reader.parseValue(depth: 0)
        reader.skipWhitespace()
        if reader.index != buffer.count { throw JSONParseError(kind: .trailingData, offset: reader.index) }
        return value
    }

    struct Reader {
        let buffer: UnsafeBufferPointer<UInt8>
        var index = 0

        init(buffer: UnsafeBufferPointer<UInt8>) { self.buffer = buffer }

        func fail(_ kind: JSONParseError.Kind = .syntax) -> JSONParseError {
            JSONParseError(kind: kind, offset: index)
        }

        mutating func skipWhitespace() {
            while index < buffer.count {
                switch buffer[index] {
                case 0x20, 0x09, 0x0A, 0x0D: index += 1
                default: return
                }
            }
        }

        mutating func expect(_ literal: StaticString) throws(JSONParseError) {
            let count = literal.utf8CodeUnitCount
            guard index + count <= buffer.count else { throw fail() }
            let start = literal.utf8Start
            for offset in 0..<count where buffer[index + offset] != start[offset] { throw fail() }
            index += count
        }

        mutating func parseValue(depth: Int) throws(JSONParseError) -> JSONValue {
            guard index < buffer.count else { throw fail() }
            switch buffer[index] {
            case UInt8(ascii: "{"): return .object(try parseObject(depth: depth + 1))
            case UInt8(ascii: "["): return .array(try parseArray(depth: depth + 1))
            case UInt8(ascii: "\""): return .string(try parseString())
            case UInt8(ascii: "t"): try expect("true"); return .bool(true)
            case UInt8(ascii: "f"): try expect("false"); return .bool(false)
            case UInt8(ascii: "n"): try expect("null"); return .null
            case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): return .number(try parseNumber())
            default: throw fail()
            }
        }

        mutating func parseObject(depth: Int) throws(JSONParseError) -> JSONObject {
            guard depth <= JSONParser.maximumDepth else { throw fail(.tooDeep) }
            index += 1  // {
            var object = JSONObject()
            skipWhitespace()
            if index < buffer.count, buffer[index] == UInt8(ascii: "}") {
                index += 1
                return object
            }
            // Only for an object with members: `[{},{},…]` allocates nothing per empty object.
            object.reserve(8)
            var seen: Set<CodePointName>? = nil
            while true {
                skipWhitespace()
                guard index < buffer.count, buffer[index] == UInt8(ascii: "\"") else { throw fail() }
                let nameOffset = index
                let name = try parseString()
                // Small objects: a linear scan is cheaper than hashing; large ones use a set.
                if object.count < 16 {
                    for member in object.members where sameName(member.name, name) {
                        throw JSONParseError(kind: .duplicateMember(name), offset: nameOffset)
                    }
                    if object.count == 15 { seen = Set(object.members.map { CodePointName(text: $0.name) }); seen!.insert(CodePointName(text: name)) }
                } else if seen!.insert(CodePointName(text: name)).inserted == false {
                    throw JSONParseError(kind: .duplicateMember(name), offset: nameOffset)
                }
                skipWhitespace()
                guard index < buffer.count, buffer[index] == UInt8(ascii: ":") else { throw fail() }
                index += 1
                skipWhitespace()
                let value = try parseValue(depth: depth)
                object.appendUnique(name, value)
                skipWhitespace()
                guard index < buffer.count else { throw fail() }
                if buffer[index] == UInt8(ascii: ",") {
                    index += 1
                    continue
                }
                if buffer[index] == UInt8(ascii: "}") {
                    index += 1
                    return object
                }
                throw fail()
            }
        }

        mutating func parseArray(depth: Int) throws(JSONParseError) -> [JSONValue] {
            guard depth <= JSONParser.maximumDepth else { throw fail(.tooDeep) }
            index += 1  // [
            var array: [JSONValue] = []
            skipWhitespace()
            if index < buffer.count, buffer[index] == UInt8(ascii: "]") {
                index += 1
                return array
            }
            while true {
                skipWhitespace()
                array.append(try parseValue(depth: depth))
                skipWhitespace()
                guard index < buffer.count else { throw fail() }
                if buffer[index] == UInt8(ascii: ",") {
                    index += 1
                    continue
                }
                if buffer[index] == UInt8(ascii: "]") {
                    index += 1
                    return array
                }
                throw fail()
            }
        }

        mutating func parseString() throws(JSONParseError) -> String {
            index += 1  // opening quote
            let start = index
            // Fast path: no escapes. Plain ASCII bytes are skipped with one table lookup each;
            // the table flags the quote, the backslash, control characters and non-ASCII bytes.
            var nonASCII = false
            let stops = JSONParser.stringStops
            while index < buffer.count {
                while index < buffer.count, stops[Int(buffer[index])] == 0 { index += 1 }
                guard index < buffer.count else { break }
                let byte = buffer[index]
                if byte == UInt8(ascii: "\"") {
                    let slice = UnsafeBufferPointer(rebasing: buffer[start..<index])
                    index += 1
                    // ASCII (the common case) needs no further validation.
                    if !nonASCII { return String(decoding: slice, as: UTF8.self) }
                    return try makeString(slice, offset: start)
                }
                if byte == UInt8(ascii: "\\") { break }
                if byte < 0x20 { throw fail() }
                nonASCII = true
                index += 1
            }
            guard index < buffer.count else { throw fail() }
            // Slow path: unescape into a byte array.
            var bytes = Array(UnsafeBufferPointer(rebasing: buffer[start..<index]))
            while index < buffer.count {
                let byte = buffer[index]
                if byte == UInt8(ascii: "\"") {
                    index += 1
                    return try bytes.withUnsafeBufferPointer { b throws(JSONParseError) in try makeString(b, offset: start) }
                }
                if byte < 0x20 { throw fail() }
                if byte != UInt8(ascii: "\\") {
                    bytes.append(byte)
                    index += 1
                    continue
                }
                index += 1
                guard index < buffer.count else { throw fail() }
                let escape = buffer[index]
                index += 1
                switch escape {
                case UInt8(ascii: "\""): bytes.append(0x22)
                case UInt8(ascii: "\\"): bytes.append(0x5C)
                case UInt8(ascii: "/"): bytes.append(0x2F)
                case UInt8(ascii: "b"): bytes.append(0x08)
                case UInt8(ascii: "f"): bytes.append(0x0C)
                case UInt8(ascii: "n"): bytes.append(0x0A)
                case UInt8(ascii: "r"): bytes.append(0x0D)
                case UInt8(ascii: "t"): bytes.append(0x09)
                case UInt8(ascii: "u"):
                    var scalar = try hex4()
                    if (0xD800...0xDBFF).contains(scalar) {
                        // A high surrogate must be followed by an escaped low surrogate.
                        guard index + 1 < buffer.count, buffer[index] == UInt8(ascii: "\\"),
                            buffer[index + 1] == UInt8(ascii: "u")
                        else { throw fail(.invalidUTF8) }
                        index += 2
                        let low = try hex4()
                        guard (0xDC00...0xDFFF).contains(low) else { throw fail(.invalidUTF8) }
                        scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
                    } else if (0xDC00...0xDFFF).contains(scalar) {
                        throw fail(.invalidUTF8)
                    }
                    guard let unicode = Unicode.Scalar(scalar) else { throw fail(.invalidUTF8) }
                    bytes.append(contentsOf: UTF8.encode(unicode)!)
                default:
                    throw fail()
                }
            }
            throw fail()
        }

        mutating func hex4() throws(JSONParseError) -> UInt32 {
            guard index + 4 <= buffer.count else { throw fail() }
            var value: UInt32 = 0
            for _ in 0..<4 {
                let byte = buffer[index]
                let digit: UInt8
                switch byte {
                case UInt8(ascii: "0")...UInt8(ascii: "9"): digit = byte - UInt8(ascii: "0")
                case UInt8(ascii: "a")...UInt8(ascii: "f"): digit = byte - UInt8(ascii: "a") + 10
                case UInt8(ascii: "A")...UInt8(ascii: "F"): digit = byte - UInt8(ascii: "A") + 10
                default: throw fail()
                }
                value = value << 4 | UInt32(digit)
                index += 1
            }
            return value
        }

        func makeString(_ bytes: UnsafeBufferPointer<UInt8>, offset: Int) throws(JSONParseError) -> String {
            guard let string = String(validating: bytes, as: UTF8.self) else {
                throw JSONParseError(kind: .invalidUTF8, offset: offset)
            }
            return string
        }

        mutating func parseNumber() throws(JSONParseError) -> Double {
            let start = index
            var negative = false
            if buffer[index] == UInt8(ascii: "-") {
                negative = true
                index += 1
            }
            guard index < buffer.count else { throw fail() }
            var integer: UInt64 = 0
            var digits = 0
            if buffer[index] == UInt8(ascii: "0") {
                index += 1
                digits = 1
                if index < buffer.count, isDigit(buffer[index]) { throw fail() }  // leading zero
            } else {
                while index < buffer.count, isDigit(buffer[index]) {
                    if digits < 18 { integer = integer * 10 + UInt64(buffer[index] - UInt8(ascii: "0")) }
                    digits += 1
                    index += 1
                }
            }
            guard digits > 0 else { throw fail() }
            var simple = digits <= 15
            if index < buffer.count, buffer[index] == UInt8(ascii: ".") {
                simple = false
                index += 1
                let fractionStart = index
                while index < buffer.count, isDigit(buffer[index]) { index += 1 }
                guard index > fractionStart else { throw fail() }
            }
            if index < buffer.count, buffer[index] == UInt8(ascii: "e") || buffer[index] == UInt8(ascii: "E") {
                simple = false
                index += 1
                if index < buffer.count, buffer[index] == UInt8(ascii: "+") || buffer[index] == UInt8(ascii: "-") {
                    index += 1
                }
                let exponentStart = index
                while index < buffer.count, isDigit(buffer[index]) { index += 1 }
                guard index > exponentStart else { throw fail() }
            }
            if simple {
                let value = Double(integer)
                return negative ? -value : value
            }
            let text = String(decoding: UnsafeBufferPointer(rebasing: buffer[start..<index]), as: UTF8.self)
            guard let value = Double(text), value.isFinite else { throw JSONParseError(kind: .syntax, offset: start) }
            return value
        }

        func isDigit(_ byte: UInt8) -> Bool { byte >= UInt8(ascii: "0") && byte <= UInt8(ascii: "9") }
    }
}

// MARK: - Serialising

extension JSONValue {
    /// Compact JSON text. Integral numbers within ±2^53 are written without a fraction.
    public var jsonText: String {
        var out: [UInt8] = []
        out.reserveCapacity(64)
        write(to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    /// Appends the compact JSON text as UTF-8.
    public func write(to out: inout [UInt8]) {
        switch self {
        case .null: out += "null".utf8
        case .bool(let b): out += (b ? "true" : "false").utf8
        case .number(let n):
            if n.rounded() == n, abs(n) < 9_007_199_254_740_992 {
                out += String(Int64(n)).utf8
            } else {
                out += "\(n)".utf8
            }
        case .string(let s): JSONValue.writeString(s, to: &out)
        case .array(let a):
            out.append(UInt8(ascii: "["))
            for (i, element) in a.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                element.write(to: &out)
            }
            out.append(UInt8(ascii: "]"))
        case .object(let o):
            out.append(UInt8(ascii: "{"))
            for (i, member) in o.members.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                JSONValue.writeString(member.name, to: &out)
                out.append(UInt8(ascii: ":"))
                member.value.write(to: &out)
            }
            out.append(UInt8(ascii: "}"))
        }
    }

    /// Appends `s` as a JSON string: quotes, backslashes and control characters escaped.
    public static func writeString(_ s: String, to out: inout [UInt8]) {
        var s = s
        s.withUTF8 { utf8 in
            // The usual case, nothing to escape: the string goes in whole.
            if firstEscaped(in: utf8, from: 0) == utf8.count {
                out.append(UInt8(ascii: "\""))
                out.append(contentsOf: utf8)
                out.append(UInt8(ascii: "\""))
                return
            }
            withUnsafeTemporaryAllocation(of: UInt8.self, capacity: escapedCapacity(utf8.count)) { buffer in
                let count = writeString(utf8, at: buffer.baseAddress!)
                out.append(contentsOf: UnsafeBufferPointer(rebasing: buffer[..<count]))
            }
        }
    }

    /// The index of the first byte from `start` on that a JSON string escapes (a control
    /// character, `"` or `\`), or `utf8.count`. Eight bytes are looked at together: one
    /// byte at a time, the look took most of an audit record's making.
    @inline(__always)
    static func firstEscaped(in utf8: UnsafeBufferPointer<UInt8>, from start: Int) -> Int {
        var i = start
        if let base = utf8.baseAddress {
            let ones: UInt64 = 0x0101_0101_0101_0101, highs: UInt64 = 0x8080_8080_8080_8080
            // A word holds such a byte exactly when one of these has a high bit set (which
            // byte is not told: borrows may mark the bytes above it too).
            while i + 8 <= utf8.count {
                let word = UnsafeRawPointer(base + i).loadUnaligned(as: UInt64.self)
                let quote = word ^ (ones &* 0x22), backslash = word ^ (ones &* 0x5C)
                let control = (word &- ones &* 0x20) & ~word
                let found = (control | ((quote &- ones) & ~quote) | ((backslash &- ones) & ~backslash)) & highs
                if found != 0 { break }
                i += 8
            }
        }
        while i < utf8.count {
            let byte = utf8[i]
            if byte < 0x20 || byte == 0x22 || byte == 0x5C { return i }
            i += 1
        }
        return utf8.count
    }

    /// The most bytes `writeString` makes of `count` bytes of UTF-8: quotes, and six for each
    /// byte (`\u001f`).
    @inline(__always)
    public static func escapedCapacity(_ count: Int) -> Int { 2 + 6 * count }

    /// Writes `utf8` (valid UTF-8) as a JSON string at `out`, which has room for
    /// `escapedCapacity(utf8.count)` bytes; returns the bytes written.
    public static func writeString(_ utf8: UnsafeBufferPointer<UInt8>, at out: UnsafeMutablePointer<UInt8>) -> Int {
        var n = 0
        @inline(__always) func put(_ byte: UInt8) {
            out[n] = byte
            n += 1
        }
        @inline(__always) func put(_ run: Slice<UnsafeBufferPointer<UInt8>>) {
            guard !run.isEmpty else { return }
            (out + n).update(from: utf8.baseAddress! + run.startIndex, count: run.count)
            n += run.count
        }
        put(UInt8(ascii: "\""))
        // Runs of bytes that need no escape go in whole, between the escapes (a subject's JSON
        // text is mostly such runs, between quotes). UTF-8 goes in as it is.
        var run = 0
        while true {
            let i = firstEscaped(in: utf8, from: run)
            put(utf8[run..<i])
            guard i < utf8.count else { break }
            let byte = utf8[i]
            run = i + 1
            put(UInt8(ascii: "\\"))
            switch byte {
            case UInt8(ascii: "\""), UInt8(ascii: "\\"): put(byte)
            case UInt8(ascii: "\n"): put(UInt8(ascii: "n"))
            case UInt8(ascii: "\r"): put(UInt8(ascii: "r"))
            case UInt8(ascii: "\t"): put(UInt8(ascii: "t"))
            case 0x08: put(UInt8(ascii: "b"))
            case 0x0C: put(UInt8(ascii: "f"))
            default:
                put(UInt8(ascii: "u"))
                put(UInt8(ascii: "0"))
                put(UInt8(ascii: "0"))
                put(hexDigits[Int(byte >> 4)])
                put(hexDigits[Int(byte & 0xF)])
            }
        }
        put(UInt8(ascii: "\""))
        return n
    }
}

private let hexDigits = Array("0123456789abcdef".utf8)
