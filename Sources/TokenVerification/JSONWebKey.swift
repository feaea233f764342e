import CWardenCrypto
import Crypto
public import SecurityEvents
import Synchronization

/// A public key from an issuer's JWKS, held by OpenSSL and bound to the algorithms it may
/// verify. Immutable after construction.
///
/// `@unchecked Sendable`: the OpenSSL key (`warden_key`) is never modified after it is built and
/// OpenSSL allows concurrent read-only use of an `EVP_PKEY`. The per-algorithm checkers, which
/// hold mutable OpenSSL contexts, are only ever used by one thread at a time: they are taken
/// from and returned to `checkers` under its mutex.
public final class VerificationKey: @unchecked Sendable, CustomStringConvertible {
    public let keyID: String
    public let family: JOSEAlgorithm.Family
    /// The algorithms this key may verify: the JWK's `alg` if it names one, else those of its type.
    public let algorithms: Set<JOSEAlgorithm>
    /// `algorithms` as a bit mask.
    let algorithmMask: UInt32
    /// Key size in bits (RSA modulus; EC field).
    public let bits: Int
    /// RFC 7638 JWK thumbprint (SHA-256, base64url): a stable name for audits.
    public let thumbprint: String
    /// The JWK's public members, as published (for the key archive).
    public let jwk: JSONObject

    private let key: OpaquePointer
    /// Idle checkers, one list per algorithm (indexed by `JOSEAlgorithm.ordinal`).
    private let checkers: Mutex<[[CheckerHandle]]>
    private static let pooledCheckersPerAlgorithm = 16

    init(keyID: String, family: JOSEAlgorithm.Family, algorithms: Set<JOSEAlgorithm>, key: OpaquePointer,
         thumbprint: String, jwk: JSONObject) {
        self.keyID = keyID
        self.family = family
        self.algorithms = algorithms
        self.algorithmMask = JOSEAlgorithm.mask(algorithms)
        self.key = key
        self.bits = Int(warden_key_bits(key))
        self.thumbprint = thumbprint
        self.jwk = jwk
        self.checkers = Mutex(Array(repeating: [], count: JOSEAlgorithm.allCases.count))
    }

    deinit {
        for list in checkers.withLock({ $0 }) {
            for checker in list { warden_checker_free(checker.pointer) }
        }
        warden_key_free(key)
    }

    public var description: String { "\(family.rawValue) key \(quoted(keyID)) (\(bits) bits)" }

    /// Whether this RSA key's public operation runs on AVX-512 IFMA (this CPU has it and the
    /// modulus has at most 2048 bits) rather than on libcrypto.
    package var usesIFMA: Bool { warden_rsa_key_is_fast(key) == 1 }

    /// RSAVP1, s^e mod n, on the IFMA path (`ifma`) or libcrypto's, to check one against the
    /// other; nil when refused (s not below n, or not as long as the modulus).
    package func rsaPublicOperation(_ s: [UInt8], ifma: Bool) -> [UInt8]? {
        var m = [UInt8](repeating: 0, count: s.count)
        let done = s.withUnsafeBufferPointer { sb in m.withUnsafeMutableBufferPointer { mb in
            warden_rsa_public(key, ifma ? 1 : 0, sb.baseAddress, sb.count, mb.baseAddress, mb.count) } }
        return done == 1 ? m : nil
    }

    /// Whether `signature` is a valid signature by this key over `message` with `algorithm`.
    /// Also false when the algorithm is not one this key is bound to.
    public func isValidSignature(_ signature: UnsafeRawBufferPointer, for message: UnsafeRawBufferPointer,
                                 algorithm: JOSEAlgorithm) -> Bool {
        guard algorithmMask & algorithm.bit != 0 else { return false }
        let slot = algorithm.ordinal
        let pooled = checkers.withLock { pool -> CheckerHandle? in pool[slot].popLast() }
        guard let checker = pooled?.pointer ?? warden_checker_new(key, algorithm.cValue) else { return false }
        let valid = warden_checker_verify(
            checker,
            message.baseAddress?.assumingMemoryBound(to: UInt8.self), message.count,
            signature.baseAddress?.assumingMemoryBound(to: UInt8.self), signature.count) == 1
        let kept = checkers.withLock { pool -> Bool in
            if pool[slot].count < Self.pooledCheckersPerAlgorithm {
                pool[slot].append(CheckerHandle(pointer: checker))
                return true
            }
            return false
        }
        if !kept { warden_checker_free(checker) }
        return valid
    }
}

/// An OpenSSL checker (`warden_checker`) parked in a key's pool.
///
/// `@unchecked Sendable`: a checker holds mutable OpenSSL contexts, so it is used by one thread
/// at a time. It is only ever in the pool (under the mutex) or in the hands of exactly one
/// caller of `isValidSignature`, never both.
struct CheckerHandle: @unchecked Sendable {
    let pointer: OpaquePointer
}

/// An entry of a JWKS: a usable key, or the reason it cannot be used (kept so a token that
/// names it gets a precise error).
public enum KeySetEntry: Sendable {
    case usable(VerificationKey)
    case unusable(keyID: String, reason: String)

    public var keyID: String {
        switch self {
        case .usable(let key): key.keyID
        case .unusable(let keyID, _): keyID
        }
    }
}

/// The keys of one JWKS document, by `kid`.
public struct KeySet: Sendable {
    public private(set) var entries: [String: KeySetEntry]
    /// Keys that have no `kid` (tokens must name their key, so these are never used).
    public private(set) var keysWithoutID: Int

    public init(entries: [String: KeySetEntry] = [:], keysWithoutID: Int = 0) {
        self.entries = entries
        self.keysWithoutID = keysWithoutID
    }

    public subscript(keyID: String) -> KeySetEntry? { entries[keyID] }

    public var usableKeys: [VerificationKey] {
        entries.values.compactMap { if case .usable(let k) = $0 { return k } else { return nil } }
    }

    /// Longest `kid` kept; longer ones cannot be looked up.
    public static let maximumKeyIDLength = 256
    public static let minimumRSABits = 2048
    public static let maximumRSABits = 8192

    /// Reads a JWKS document (RFC 7517 §5). Individual bad keys are kept as unusable with their
    /// reason; a document that is not a JWKS at all is an error.
    public static func parse(jwks bytes: some Collection<UInt8>) throws(KeySetError) -> KeySet {
        let value: JSONValue
        do {
            value = try JSONParser.parse(bytes)
        } catch {
            throw KeySetError(message: "the JWKS is not valid JSON: \(error)")
        }
        guard let keys = value.objectValue?["keys"]?.arrayValue else {
            throw KeySetError(message: "the JWKS has no \"keys\" array")
        }
        var set = KeySet()
        // Key ids whose entry so far is a key not meant for verifying signatures (`use` other
        // than `sig`, `key_ops` without `verify`): a provider may publish its encryption key
        // under the id of its signing key. Such a key gives way to a signing key of the same id
        // and never makes it ambiguous; two signing keys under one id do.
        var notForSignatures: Set<String> = []
        for (index, item) in keys.enumerated() {
            guard let jwk = item.objectValue else { continue }
            guard let kid = jwk["kid"]?.stringValue, !kid.isEmpty, kid.utf8.count <= maximumKeyIDLength else {
                set.keysWithoutID += 1
                continue
            }
            let forSignatures = isForSignatures(jwk)
            if set.entries[kid] != nil {
                if !forSignatures { continue }
                if notForSignatures.remove(kid) == nil {
                    set.entries[kid] = .unusable(keyID: kid, reason: "the JWKS lists the key id \(quoted(kid)) more than once")
                    continue
                }
            } else if !forSignatures {
                notForSignatures.insert(kid)
            }
            switch makeKey(jwk, keyID: kid) {
            case .success(let key): set.entries[kid] = .usable(key)
            case .failure(let error): set.entries[kid] = .unusable(keyID: kid, reason: "key #\(index) \(quoted(kid)): \(error.message)")
            }
        }
        return set
    }

    /// Whether a JWK may be meant for verifying signatures: its `use`, if any, is `sig`, and its
    /// `key_ops`, if any, include `verify`.
    static func isForSignatures(_ jwk: JSONObject) -> Bool {
        if let use = jwk["use"], use.stringValue != "sig" { return false }
        if let ops = jwk["key_ops"], ops.arrayValue?.contains(.string("verify")) != true { return false }
        return true
    }

    /// Builds one key from its JWK members.
    public static func makeKey(_ jwk: JSONObject, keyID: String) -> Result<VerificationKey, KeySetError> {
        func fail(_ message: String) -> Result<VerificationKey, KeySetError> { .failure(KeySetError(message: message)) }
        func bytes(_ name: String) -> [UInt8]? {
            guard let text = jwk[name]?.stringValue else { return nil }
            return Base64URL.decode(text)
        }

        if let use = jwk["use"] {
            guard use.stringValue == "sig" else { return fail("its \"use\" is not \"sig\"") }
        }
        if let ops = jwk["key_ops"] {
            guard ops.arrayValue?.contains(.string("verify")) == true else { return fail("its \"key_ops\" does not include \"verify\"") }
        }
        guard let kty = jwk["kty"]?.stringValue else { return fail("it has no \"kty\"") }
        var declared: JOSEAlgorithm? = nil
        if let algValue = jwk["alg"] {
            guard let name = algValue.stringValue, let alg = JOSEAlgorithm(rawValue: name) else {
                return fail(JOSEAlgorithm.refusal(for: jwk["alg"]?.stringValue ?? "?"))
            }
            declared = alg
        }

        let family: JOSEAlgorithm.Family
        let handle: OpaquePointer?
        var thumbprintMembers: [(String, JSONValue)]
        var algorithms: Set<JOSEAlgorithm>

        switch kty {
        case "RSA":
            family = .rsa
            guard var n = bytes("n"), let e = bytes("e"), !n.isEmpty, !e.isEmpty else {
                return fail("an RSA key needs base64url members \"n\" and \"e\"")
            }
            // Leading zero bytes dropped in one step (one at a time, a modulus padded with most of
            // a megabyte of them took seconds).
            n = Array(n.drop { $0 == 0 })
            let bits = n.isEmpty ? 0 : (n.count - 1) * 8 + (8 - n[0].leadingZeroBitCount)
            guard bits >= minimumRSABits else { return fail("the RSA modulus has \(bits) bits; at least \(minimumRSABits) are required") }
            guard bits <= maximumRSABits else { return fail("the RSA modulus has \(bits) bits; at most \(maximumRSABits) are accepted") }
            // e must be odd and at least 3 (e = 1 would make every message its own signature).
            guard e.count <= 8, e.last! & 1 == 1, e.reduce(UInt64(0), { $0 << 8 | UInt64($1) }) >= 3 else {
                return fail("the RSA public exponent is not an odd number of at least 3")
            }
            handle = n.withUnsafeBufferPointer { nb in e.withUnsafeBufferPointer { eb in
                warden_rsa_key_new(nb.baseAddress, nb.count, eb.baseAddress, eb.count) } }
            thumbprintMembers = [("e", jwk["e"]!), ("kty", .string("RSA")), ("n", jwk["n"]!)]
            algorithms = [.rs256, .rs384, .rs512, .ps256, .ps384, .ps512]
        case "EC":
            family = .ec
            guard let crv = jwk["crv"]?.stringValue else { return fail("an EC key needs \"crv\"") }
            let curveBits: Int32
            let alg: JOSEAlgorithm
            switch crv {
            case "P-256": curveBits = 256; alg = .es256
            case "P-384": curveBits = 384; alg = .es384
            case "P-521": curveBits = 521; alg = .es512
            default: return fail("the curve \(quoted(crv)) is not supported")
            }
            guard let x = bytes("x"), let y = bytes("y") else { return fail("an EC key needs base64url members \"x\" and \"y\"") }
            handle = x.withUnsafeBufferPointer { xb in y.withUnsafeBufferPointer { yb in
                warden_ec_key_new(curveBits, xb.baseAddress, xb.count, yb.baseAddress, yb.count) } }
            thumbprintMembers = [("crv", .string(crv)), ("kty", .string("EC")), ("x", jwk["x"]!), ("y", jwk["y"]!)]
            algorithms = [alg]
        case "OKP":
            family = .okp
            guard jwk["crv"]?.stringValue == "Ed25519" else { return fail("only the Ed25519 curve is supported for OKP keys") }
            guard let x = bytes("x") else { return fail("an OKP key needs a base64url member \"x\"") }
            handle = x.withUnsafeBufferPointer { warden_ed25519_key_new($0.baseAddress, $0.count) }
            thumbprintMembers = [("crv", .string("Ed25519")), ("kty", .string("OKP")), ("x", jwk["x"]!)]
            algorithms = [.edDSA]
        case "oct":
            return fail("symmetric (oct) keys are never accepted")
        default:
            return fail("the key type \(quoted(kty)) is not supported")
        }

        if let declared {
            guard algorithms.contains(declared) else {
                return fail("its \"alg\" \(declared.rawValue) does not fit a \(kty) key\(kty == "EC" ? " on this curve" : "")")
            }
            algorithms = [declared]
        }
        guard let handle else { return fail("OpenSSL refused the key material (not a valid \(kty) public key)") }

        let canonical = JSONValue.object(JSONObject(thumbprintMembers)).jsonText
        let thumbprint = Base64URL.encode(Array(SHA256.hash(data: Array(canonical.utf8))))
        var publicMembers = JSONObject()
        for (name, value) in jwk where ["kty", "kid", "use", "alg", "n", "e", "crv", "x", "y", "key_ops"].contains(name) {
            publicMembers[name] = value
        }
        return .success(VerificationKey(keyID: keyID, family: family, algorithms: algorithms, key: handle,
                                        thumbprint: thumbprint, jwk: publicMembers))
    }
}

public struct KeySetError: Error, Sendable, Equatable, CustomStringConvertible {
    public var message: String
    public var description: String { message }
    public init(message: String) { self.message = message }
}
