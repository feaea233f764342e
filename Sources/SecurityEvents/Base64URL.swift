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
        let count = buffer.count
        if count % 4 == 1 { return nil }
        let outputCount = count / 4 * 3 + (count % 4 == 0 ? 0 : count % 4 - 1)
        var valid = true
        let out = decodeTable.withUnsafeBufferPointer { table in
            [UInt8](unsafeUninitializedCapacity: outputCount) { output, initialized in
                var i = 0, o = 0
                while i + 4 <= count {
                    let a = table[Int(buffer[i])], b = table[Int(buffer[i + 1])]
                    let c = table[Int(buffer[i + 2])], d = table[Int(buffer[i + 3])]
                    if (a | b | c | d) & 0xC0 != 0 { valid = false; break }
                    output[o] = a << 2 | b >> 4
                    output[o + 1] = (b & 0x0F) << 4 | c >> 2
                    output[o + 2] = (c & 0x03) << 6 | d
                    i += 4
                    o += 3
                }
                let rest = count - i
                if valid && rest == 2 {
                    let a = table[Int(buffer[i])], b = table[Int(buffer[i + 1])]
                    if (a | b) & 0xC0 != 0 || b & 0x0F != 0 { valid = false } else { output[o] = a << 2 | b >> 4; o += 1 }
                } else if valid && rest == 3 {
                    let a = table[Int(buffer[i])], b = table[Int(buffer[i + 1])], c = table[Int(buffer[i + 2])]
                    if (a | b | c) & 0xC0 != 0 || c & 0x03 != 0 {
                        valid = false
                    } else {
                        output[o] = a << 2 | b >> 4
                        output[o + 1] = (b & 0x0F) << 4 | c >> 2
                        o += 2
                    }
                }
                // Unused slots (only when invalid) are zero-filled so the array is fully initialised.
                for k in o..<outputCount { output[k] = 0 }
                initialized = outputCount
            }
        }
        return valid ? out : nil
    }
}
