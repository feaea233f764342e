/// Unpadded base64url (RFC 4648 §5) as JWS uses it (RFC 7515 §2): no padding, no whitespace,
/// and unused trailing bits must be zero, so every value has exactly one encoding.
public enum Base64URL {
    private static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".utf8)

    private static let decodeTable: [UInt8] = {
        var table = [UInt8](repeating: 0xFF, count: 256)
        for (i, c) in alphabet.enumerated() { table[Int(c)] = UInt8(i) }
        return table
    }()

    public static func encode(_ bytes: some Sequence<UInt8>) -> String {
        let input = Array(bytes)
        var out = [UInt8]()
        out.reserveCapacity((input.count * 4 + 2) / 3)
        var i = 0
        while i + 3 <= input.count {
            let v = UInt32(input[i]) << 16 | UInt32(input[i + 1]) << 8 | UInt32(input[i + 2])
            out.append(alphabet[Int(v >> 18 & 63)])
            out.append(alphabet[Int(v >> 12 & 63)])
            out.append(alphabet[Int(v >> 6 & 63)])
            out.append(alphabet[Int(v & 63)])
            i += 3
        }
        let rest = input.count - i
        if rest == 1 {
            let v = UInt32(input[i]) << 16
            out.append(alphabet[Int(v >> 18 & 63)])
            out.append(alphabet[Int(v >> 12 & 63)])
        } else if rest == 2 {
            let v = UInt32(input[i]) << 16 | UInt32(input[i + 1]) << 8
            out.append(alphabet[Int(v >> 18 & 63)])
            out.append(alphabet[Int(v >> 12 & 63)])
            out.append(alphabet[Int(v >> 6 & 63)])
        }
        return String(decoding: out, as: UTF8.self)
    }

    public static func encode(_ string: String) -> String { encode(Array(string.utf8)) }

    /// Returns nil for any character outside the alphabet, padding, an impossible length, or
    /// non-zero unused bits.
    public static func decode(_ text: some Collection<UInt8>) -> [UInt8]? {
        if let result = text.withContiguousStorageIfAvailable({ decode(buffer: $0) }) { return result }
        return Array(text).withUnsafeBufferPointer { decode(buffer: $0) }
    }

    public static func decode(_ text: String) -> [UInt8]? {
        var text = text
        return text.withUTF8 { decode(buffer: $0) }
    }

    public static func decode(buffer: UnsafeBufferPointer<UInt8>) -> [UInt8]? {
        guard let outputCount = decodedCount(buffer.count) else { return nil }
        var valid = true
        let out = [UInt8](unsafeUninitializedCapacity: outputCount) { output, initialized in
            valid = decode(buffer: buffer, into: output) != nil
            if !valid { output.initialize(repeating: 0) }
            initialized = outputCount
        }
        return valid ? out : nil
    }

    /// Whether the text is canonical unpadded base64url, checked without decoding it.
    public static func isValid(buffer: UnsafeBufferPointer<UInt8>) -> Bool {
        guard decodedCount(buffer.count) != nil, let last = buffer.last else { return buffer.isEmpty }
        return decodeTable.withUnsafeBufferPointer { table -> Bool in
            var bad: UInt8 = 0
            for byte in buffer { bad |= table[Int(byte)] }
            guard bad & 0xC0 == 0 else { return false }
            // Unused trailing bits must be zero.
            switch buffer.count % 4 {
            case 2: return table[Int(last)] & 0x0F == 0
            case 3: return table[Int(last)] & 0x03 == 0
            default: return true
            }
        }
    }

    /// How many bytes `count` characters decode to, or nil for an impossible length.
    public static func decodedCount(_ count: Int) -> Int? {
        count % 4 == 1 ? nil : count / 4 * 3 + (count % 4 == 0 ? 0 : count % 4 - 1)
    }

    /// Decodes into `output` (at least `decodedCount` bytes) without allocating; returns the
    /// number of bytes written, or nil if the text is not canonical unpadded base64url.
    public static func decode(buffer: UnsafeBufferPointer<UInt8>, into output: UnsafeMutableBufferPointer<UInt8>) -> Int? {
        let count = buffer.count
        guard let outputCount = decodedCount(count), output.count >= outputCount else { return nil }
        return decodeTable.withUnsafeBufferPointer { table -> Int? in
            var i = 0, o = 0
            while i + 4 <= count {
                let a = table[Int(buffer[i])], b = table[Int(buffer[i + 1])]
                let c = table[Int(buffer[i + 2])], d = table[Int(buffer[i + 3])]
                if (a | b | c | d) & 0xC0 != 0 { return nil }
                output[o] = a << 2 | b >> 4
                output[o + 1] = (b & 0x0F) << 4 | c >> 2
                output[o + 2] = (c & 0x03) << 6 | d
                i += 4
                o += 3
            }
            switch count - i {
            case 2:
                let a = table[Int(buffer[i])], b = table[Int(buffer[i + 1])]
                if (a | b) & 0xC0 != 0 || b & 0x0F != 0 { return nil }
                output[o] = a << 2 | b >> 4
                o += 1
            case 3:
                let a = table[Int(buffer[i])], b = table[Int(buffer[i + 1])], c = table[Int(buffer[i + 2])]
                if (a | b | c) & 0xC0 != 0 || c & 0x03 != 0 { return nil }
                output[o] = a << 2 | b >> 4
                output[o + 1] = (b & 0x0F) << 4 | c >> 2
                o += 2
            default:
                break
            }
            return o
        }
    }
}

/// A token as received less the ASCII whitespace around it (a trailing newline from a file or a
/// shell is not part of a compact JWS). The one trimmer every door and the ledger's digests use.
public func trimmedASCIIWhitespace(_ bytes: [UInt8]) -> ArraySlice<UInt8> {
    let isSpace: (UInt8) -> Bool = { $0 == 0x20 || $0 == 0x09 || $0 == 0x0A || $0 == 0x0D }
    guard let start = bytes.firstIndex(where: { !isSpace($0) }), let end = bytes.lastIndex(where: { !isSpace($0) }) else {
        return []
    }
    return bytes[start...end]
}

/// The claims a token says it has, read without verifying anything: to find what the ledger
/// made of a token that does not verify (now), and where to put it on a timeline. Nothing read
/// here is to be trusted.
public struct UnverifiedClaims: Sendable {
    public var issuer: String?
    public var jti: String?
    public var issuedAt: Double?

    public init(_ token: [UInt8]) {
        let parts = token.split(separator: UInt8(ascii: "."), maxSplits: 3, omittingEmptySubsequences: false)
        guard parts.count == 3, let payload = Base64URL.decode(parts[1]),
              case .object(let claims)? = try? JSONParser.parse(payload) else { return }
        issuer = claims["iss"]?.stringValue
        jti = claims["jti"]?.stringValue
        issuedAt = claims["iat"]?.numberValue
    }
}
