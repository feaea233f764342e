/// Text an attacker may have chosen (a token's `iss` or `jti`, a transmitter's stream-updated
/// `reason`), made safe for a log line or a terminal: each C0 control character (but those in
/// `keeping`), DEL and each C1 control character (U+0080–U+009F: CSI, OSC and the like drive a
/// terminal as their ESC forms do) written `\u{…}`. Text without any is returned as it is.
public func escapingControlCharacters(_ text: String, keeping: Set<Unicode.Scalar> = []) -> String {
    guard hasControlCharacters(text) else { return text }
    var out = ""
    out.reserveCapacity(text.utf8.count + 8)
    for scalar in text.unicodeScalars {
        if isControl(scalar), !keeping.contains(scalar) {
            out += "\\u{\(String(scalar.value, radix: 16))}"
        } else {
            out.unicodeScalars.append(scalar)
        }
    }
    return out
}

/// A C0 control character, DEL, or a C1 control character.
@inline(__always) public func isControl(_ scalar: Unicode.Scalar) -> Bool {
    scalar.value < 0x20 || (0x7F..<0xA0).contains(scalar.value)
}

/// Whether `text` holds a control character `isControl` names, read in its UTF-8 (a C1
/// character is 0xC2 followed by 0x80…0x9F).
public func hasControlCharacters(_ text: String) -> Bool {
    var previous: UInt8 = 0
    for byte in text.utf8 {
        if byte < 0x20 || byte == 0x7F || (previous == 0xC2 && byte < 0xA0 && byte >= 0x80) { return true }
        previous = byte
    }
    return false
}
