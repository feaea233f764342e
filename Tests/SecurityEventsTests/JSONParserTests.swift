import Testing
@testable import SecurityEvents

@Suite("Strict JSON parser")
struct JSONParserTests {
    @Test func parsesAllValueKinds() throws {
        let value = try JSONParser.parse(#"{"a":1,"b":-2.5e1,"c":"x\u00e9\n","d":[true,false,null],"e":{}}"#)
        let o = try #require(value.objectValue)
        #expect(o["a"] == .number(1))
        #expect(o["b"] == .number(-25))
        #expect(o["c"] == .string("xé\n"))
        #expect(o["d"] == .array([.bool(true), .bool(false), .null]))
        #expect(o["e"] == .object(JSONObject()))
        #expect(o.names == ["a", "b", "c", "d", "e"])
    }

    @Test func rejectsDuplicateMemberNames() {
        #expect(throws: JSONParseError.self) { try JSONParser.parse(#"{"alg":"RS256","alg":"none"}"#) }
        // Also when the duplicate hides behind an escape.
        #expect {
            try JSONParser.parse(#"{"kid":"a","k\u0069d":"b"}"#)
        } throws: { error in
            (error as? JSONParseError)?.kind == .duplicateMember("kid")
        }
        // And in objects large enough to use the hashed check.
        var members = (0..<40).map { "\"m\($0)\":\($0)" }
        members.append("\"m7\":0")
        #expect(throws: JSONParseError.self) { try JSONParser.parse("{" + members.joined(separator: ",") + "}") }
    }

    @Test(arguments: [
        "", "{", "{\"a\":1,}", "[1,]", "01", "1.", "-", "1e", "{\"a\" 1}", "\"\u{01}\"", "tru", "{} {}",
        "\"\\ud800\"", "\"\\udc00\"", "\"\\x\"", "NaN", "{'a':1}",
    ])
    func rejectsMalformedText(_ text: String) {
        #expect(throws: JSONParseError.self) { try JSONParser.parse(text) }
    }

    @Test func rejectsInvalidUTF8() {
        #expect(throws: JSONParseError.self) { try JSONParser.parse([0x22, 0xC3, 0x28, 0x22]) }
        #expect(throws: JSONParseError.self) { try JSONParser.parse([0x22, 0xED, 0xA0, 0x80, 0x22]) }  // encoded surrogate
    }

    @Test func limitsNesting() {
        let deep = String(repeating: "[", count: 200) + String(repeating: "]", count: 200)
        #expect(throws: JSONParseError.self) { try JSONParser.parse(deep) }
    }

    @Test func decodesSurrogatePairs() throws {
        #expect(try JSONParser.parse(#""\ud83d\ude00""#) == .string("😀"))
    }

    /// Names are the same only byte for byte, short (stored inline) or long, whether the
    /// difference is at the start, the end, or in a canonically equivalent character.
    @Test func namesAreTheSameOnlyByteForByte() {
        let long = "https://accounts.example.com/" + String(repeating: "a", count: 40)
        #expect(sameName(long, String(decoding: Array(long.utf8), as: UTF8.self)))
        #expect(sameName("kid", "kid"))
        #expect(sameName("", ""))
        #expect(!sameName(long, String(long.dropLast()) + "b"))
        #expect(!sameName(long, "b" + String(long.dropFirst())))
        #expect(!sameName(long, String(long.dropLast())))
        #expect(!sameName("K", "\u{212A}"))
        #expect(!sameName("\u{E9}", "e\u{301}"))
        #expect(!sameName(long + "\u{E9}", long + "e\u{301}"))
        // Canonically equivalent, of one length and one first byte: only the bytes after differ.
        #expect(!sameName(long + "\u{212B}", long + "A\u{30A}"))
        #expect(!sameName("a\u{301}\u{316}", "a\u{316}\u{301}"))
        // A string made from a substring, and one made from a character view, compare the same way.
        #expect(sameName(String(long.prefix(30)), String(Array(long.prefix(30)))))
    }

    @Test func serialisesRoundTrip() throws {
        let text = #"{"iat":1700000000,"x":0.5,"s":"a\"b\\c\u0001","l":[1,{"k":null}]}"#
        let value = try JSONParser.parse(text)
        #expect(value.jsonText == #"{"iat":1700000000,"x":0.5,"s":"a\"b\\c\u0001","l":[1,{"k":null}]}"#)
        #expect(try JSONParser.parse(value.jsonText) == value)
    }
}

@Suite("base64url")
struct Base64URLTests {
    @Test func roundTrips() {
        for length in 0..<40 {
            let bytes = (0..<length).map { UInt8(truncatingIfNeeded: $0 &* 37 &+ 11) }
            let text = Base64URL.encode(bytes)
            #expect(!text.contains("=") && !text.contains("+") && !text.contains("/"))
            #expect(Base64URL.decode(text) == bytes)
            #expect(Array(text.utf8).withUnsafeBufferPointer { Base64URL.isValid(buffer: $0) })
        }
    }

    @Test(arguments: ["ab=", "a", "ab+c", "ab/c", "ab c", "abc=", "YQ==", "YR", "YWF"])
    func rejectsNonCanonicalOrForeignText(_ text: String) {
        // Padding, the standard alphabet, whitespace, impossible lengths and non-zero unused bits.
        #expect(Base64URL.decode(text) == nil)
        #expect(!Array(text.utf8).withUnsafeBufferPointer { Base64URL.isValid(buffer: $0) })
    }
}

/// Strings written as JSON: eight bytes are looked at together for one to escape, so every byte
/// that needs an escape is tried at every place of strings longer than a few words.
@Suite("JSON strings written")
struct JSONStringWritingTests {
    /// The escapes, one byte at a time, as JSON's grammar has them.
    static func reference(_ bytes: [UInt8]) -> [UInt8] {
        var out: [UInt8] = [UInt8(ascii: "\"")]
        for byte in bytes {
            switch byte {
            case UInt8(ascii: "\""): out += Array(#"\""#.utf8)
            case UInt8(ascii: "\\"): out += Array(#"\\"#.utf8)
            case UInt8(ascii: "\n"): out += Array(#"\n"#.utf8)
            case UInt8(ascii: "\r"): out += Array(#"\r"#.utf8)
            case UInt8(ascii: "\t"): out += Array(#"\t"#.utf8)
            case 0x08: out += Array(#"\b"#.utf8)
            case 0x0C: out += Array(#"\f"#.utf8)
            case ..<0x20: out += Array(String(format: "\\u%04x", byte).utf8)
            default: out.append(byte)
            }
        }
        out.append(UInt8(ascii: "\""))
        return out
    }

    static func written(_ text: String) -> [UInt8] {
        var out: [UInt8] = []
        JSONValue.writeString(text, to: &out)
        return out
    }

    @Test func everyByteToEscapeIsEscapedWhereverItIs() throws {
        let plain = Array("abcdefghijklmnopqrstuvwxyz0123".utf8)
        let special: [UInt8] = Array(0x00..<0x20) + [0x22, 0x5C]
        for length in [1, 7, 8, 9, 15, 16, 17, 24, 30] {
            for place in 0..<length {
                for byte in special {
                    var bytes = Array(plain.prefix(length))
                    bytes[place] = byte
                    let text = String(decoding: bytes, as: UTF8.self)
                    #expect(Self.written(text) == Self.reference(bytes), "byte \(byte) at \(place) of \(length)")
                }
            }
        }
    }

    /// Bytes just above the ones to escape, and UTF-8 of several bytes, go in as they are; the
    /// text read back is the text written.
    @Test func everythingElseGoesInAsItIs() throws {
        let texts = ["", " ", "!#$%&'()*+,-./", "[]^_`{|}~\u{7F}", "é«»日本語🙂", String(repeating: "é\u{1F}🙂\"", count: 9),
                     "\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}", String(repeating: "x", count: 1000) + "\\"]
        for text in texts {
            let bytes = Self.written(text)
            #expect(bytes == Self.reference(Array(text.utf8)), "\(text.debugDescription)")
            #expect(try JSONParser.parse(bytes) == .string(text))
        }
    }
}
