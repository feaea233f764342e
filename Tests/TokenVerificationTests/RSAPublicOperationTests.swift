import Foundation
import SecurityEvents
import Testing
import TokenVerification

/// The RSA public operation (s^e mod n) on AVX-512 IFMA against libcrypto's, number by number:
/// moduli at the edges of 2048 bits, exponents from 3 to 2^64 - 1, and signature
/// representatives at the edges of [0, n).
@Suite("RSA public operation")
struct RSAPublicOperationTests {
    /// What the kernel reports, independently of the library's own check.
    static let cpuHasIFMA: Bool = {
        guard let info = try? String(contentsOfFile: "/proc/cpuinfo", encoding: .utf8) else { return false }
        let flags = info.split(separator: "\n").first { $0.hasPrefix("flags") }?.split(separator: " ") ?? []
        return flags.contains("avx512f") && flags.contains("avx512ifma")
    }()

    static func key(modulus: [UInt8], exponent: UInt64) throws -> VerificationKey {
        var e = [UInt8](), rest = exponent
        while rest > 0 { e.insert(UInt8(rest & 0xFF), at: 0); rest >>= 8 }
        let jwk: JSONObject = ["kty": "RSA", "alg": "RS256", "n": .string(Base64URL.encode(modulus)), "e": .string(Base64URL.encode(e))]
        return try KeySet.makeKey(jwk, keyID: "m").get()
    }

    static func random(_ count: Int) -> [UInt8] {
        var generator = SystemRandomNumberGenerator()
        return (0..<count).map { _ in UInt8.random(in: 0...255, using: &generator) }
    }

    /// Big-endian a - b for a >= b, as long as a.
    static func subtract(_ a: [UInt8], _ b: [UInt8]) -> [UInt8] {
        var result = a, borrow = 0
        for i in stride(from: a.count - 1, through: 0, by: -1) {
            var t = Int(a[i]) - Int(b[i]) - borrow
            borrow = t < 0 ? 1 : 0
            if t < 0 { t += 256 }
            result[i] = UInt8(t)
        }
        return result
    }

    @Test func aKeyUsesIFMAExactlyWhenTheCPUHasIt() throws {
        let n2048 = [0xC0] + Self.random(254) + [0x01]
        #expect(try Self.key(modulus: n2048, exponent: 65537).usesIFMA == Self.cpuHasIFMA)
        // Beyond 2048 bits, libcrypto alone.
        let n3072 = [0xC0] + Self.random(382) + [0x01]
        #expect(try Self.key(modulus: n3072, exponent: 65537).usesIFMA == false)
    }

    static let moduli: [(String, [UInt8])] = [
        ("random", [0x80 | random(1)[0]] + random(254) + [random(1)[0] | 1]),
        ("all ones", [UInt8](repeating: 0xFF, count: 256)),
        ("2^2047 + 1", [0x80] + [UInt8](repeating: 0, count: 254) + [0x01]),
        ("sparse", [0x80] + (0..<254).map { $0 % 37 == 0 ? 0xFF : 0 } + [0x01]),
        ("dense top, zero bottom", [UInt8](repeating: 0xFF, count: 128) + [UInt8](repeating: 0, count: 127) + [0x01]),
    ]

    /// Runs where the CPU has AVX-512 IFMA (elsewhere every key is on libcrypto, which the
    /// signature tests cover, and the test above checks no key takes the other path).
    @Test(.enabled(if: RSAPublicOperationTests.cpuHasIFMA, "this CPU has no AVX-512 IFMA"),
          arguments: [UInt64(3), 17, 65537, 65539, 0x8000_0000_0000_0001, UInt64.max])
    func theIFMAPathAgreesWithLibcrypto(_ exponent: UInt64) throws {
        for (name, modulus) in Self.moduli {
            let key = try Self.key(modulus: modulus, exponent: exponent)
            #expect(key.usesIFMA, "\(name)")
            let one = [UInt8](repeating: 0, count: 255) + [1]
            let nMinusOne = Self.subtract(modulus, one)
            var inputs: [[UInt8]] = [
                [UInt8](repeating: 0, count: 256), one, [UInt8](repeating: 0, count: 255) + [2],
                nMinusOne, Self.subtract(nMinusOne, one),
                // Every limb full where n allows it.
                Self.subtract(modulus, [0] + [UInt8](repeating: 0, count: 254) + [2]),
            ]
            for _ in 0..<150 {
                var s = Self.random(256)
                s[0] %= modulus[0] // below n's top byte, so below n
                inputs.append(s)
            }
            for s in inputs {
                let expected = try #require(key.rsaPublicOperation(s, ifma: false), "libcrypto refused a value below n (\(name))")
                let got = key.rsaPublicOperation(s, ifma: true)
                #expect(got == expected, "\(name), e = \(exponent), s = \(s.prefix(8).map { String($0, radix: 16) })…")
            }
            // Not below n: refused on both paths.
            let above = [UInt8](repeating: 0xFF, count: 256)
            for s in [modulus] + (modulus == above ? [] : [above]) {
                #expect(key.rsaPublicOperation(s, ifma: false) == nil, "\(name)")
                #expect(key.rsaPublicOperation(s, ifma: true) == nil, "\(name)")
            }
            // Not as long as the modulus: refused.
            #expect(key.rsaPublicOperation(Array(one.dropFirst()), ifma: true) == nil)
        }
    }
}
