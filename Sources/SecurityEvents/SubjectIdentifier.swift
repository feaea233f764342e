/// A subject identifier: RFC 9493 formats, SSF's additions, and Google's legacy RISC spellings
/// (SPEC §1.3, §2.4, §3.1). Parsing accepts `format` or `subject_type`, `iss_sub` or `iss-sub`,
/// `phone_number` or `phone`; `json` always writes the standard spelling.
public enum SubjectIdentifier: Sendable, Hashable {
    case email(String)
    case phoneNumber(String)
    case issSub(iss: String, sub: String)
    case opaque(String)
    case account(uri: String)
    case did(url: String)
    case uri(String)
    case aliases([SubjectIdentifier])
    /// SSF complex subject: member name (`user`, `device`, `session`, …) → simple identifier.
    case complex([ComplexMember: SubjectIdentifier])
    case jwtID(iss: String, jti: String)
    case samlAssertionID(issuer: String, assertionID: String)
    case ipAddresses([String])
    /// Google's `id_token_claims`: the account (`iss`, `sub`) and possibly its email.
    case idTokenClaims(iss: String, sub: String, email: String?)
    /// An OAuth token (`oauth_token`): the subject of `token-revoked` and `token-issued`.
    case oauthToken(TokenReference)
    /// An OAuth client (`oauth_client`).
    case oauthClient(clientID: String)
    /// A format Warden does not know; kept whole so nothing is lost.
    case other(format: String, members: JSONObject)

    public enum ComplexMember: String, Sendable, Hashable, CaseIterable, Comparable {
        case user, device, session, application, tenant
        case orgUnit = "org_unit"
        case group

        public static func < (a: Self, b: Self) -> Bool { a.rawValue < b.rawValue }
    }

    /// The RFC 9493 / SSF format name.
    public var format: String {
        switch self {
        case .email: "email"
        case .phoneNumber: "phone_number"
        case .issSub: "iss_sub"
        case .opaque: "opaque"
        case .account: "account"
        case .did: "did"
        case .uri: "uri"
        case .aliases: "aliases"
        case .complex: "complex"
        case .jwtID: "jwt_id"
        case .samlAssertionID: "saml_assertion_id"
        case .ipAddresses: "ip-addresses"
        case .idTokenClaims: "id_token_claims"
        case .oauthToken: "oauth_token"
        case .oauthClient: "oauth_client"
        case .other(let format, _): format
        }
    }

    /// The account's (`iss`, `sub`) pair when the identifier names one, directly or inside an
    /// alias or complex `user` member.
    public var issuerSubject: (iss: String, sub: String)? {
        switch self {
        case .issSub(let iss, let sub), .idTokenClaims(let iss, let sub, _): return (iss, sub)
        case .aliases(let list):
            for id in list { if let pair = id.issuerSubject { return pair } }
            return nil
        case .complex(let members): return members[.user]?.issuerSubject
        default: return nil
        }
    }

    /// The email address when the identifier carries one.
    public var emailAddress: String? {
        switch self {
        case .email(let e): return e
        case .idTokenClaims(_, _, let e): return e
        case .aliases(let list): return list.lazy.compactMap(\.emailAddress).first
        case .complex(let members): return members[.user]?.emailAddress
        default: return nil
        }
    }

    /// The standard JSON form as compact text: the same text as `json.jsonText`, written
    /// directly for the single-member formats (the intake writes one for every event).
    public var jsonText: String {
        var out: [UInt8] = []
        out.reserveCapacity(128)
        func simple(_ members: KeyValuePairs<String, String>) {
            out += #"{"format":"#.utf8
            JSONValue.writeString(format, to: &out)
            for (name, value) in members {
                out.append(UInt8(ascii: ","))
                JSONValue.writeString(name, to: &out)
                out.append(UInt8(ascii: ":"))
                JSONValue.writeString(value, to: &out)
            }
            out.append(UInt8(ascii: "}"))
        }
        switch self {
        case .issSub(let iss, let sub): simple(["iss": iss, "sub": sub])
        case .email(let e): simple(["email": e])
        case .phoneNumber(let p): simple(["phone_number": p])
        case .opaque(let id): simple(["id": id])
        case .account(let uri), .uri(let uri): simple(["uri": uri])
        default: json.write(to: &out)
        }
        return String(decoding: out, as: UTF8.self)
    }

    /// The standard JSON form.
    public var json: JSONValue {
        var o = JSONObject()
        o["format"] = .string(format)
        switch self {
        case .email(let e): o["email"] = .string(e)
        case .phoneNumber(let p): o["phone_number"] = .string(p)
        case .issSub(let iss, let sub): o["iss"] = .string(iss); o["sub"] = .string(sub)
        case .opaque(let id): o["id"] = .string(id)
        case .account(let uri): o["uri"] = .string(uri)
        case .did(let url): o["url"] = .string(url)
        case .uri(let uri): o["uri"] = .string(uri)
        case .aliases(let list): o["identifiers"] = .array(list.map(\.json))
        case .complex(let members):
            for (name, id) in members.sorted(by: { $0.key < $1.key }) { o[name.rawValue] = id.json }
        case .jwtID(let iss, let jti): o["iss"] = .string(iss); o["jti"] = .string(jti)
        case .samlAssertionID(let issuer, let id): o["issuer"] = .string(issuer); o["assertion_id"] = .string(id)
        case .ipAddresses(let list): o["ip-addresses"] = .array(list.map { .string($0) })
        case .idTokenClaims(let iss, let sub, let email):
            o["iss"] = .string(iss); o["sub"] = .string(sub)
            if let email { o["email"] = .string(email) }
        case .oauthToken(let token):
            o["token_type"] = .string(token.tokenType)
            o["token_identifier_alg"] = .string(token.identifierAlgorithm.rawValue)
            // The token (or its prefix/hash) is a secret-bearing value: kept for matching, shown
            // only as a short fingerprint in the normalised form.
            o["token"] = .string(token.redacted)
        case .oauthClient(let id): o["client_id"] = .string(id)
        case .other(_, let members):
            for member in members where member.name != "format" && member.name != "subject_type" {
                o[member.name] = member.value
            }
        }
        return .object(o)
    }
}

/// Why a subject identifier was refused.
public struct SubjectError: Error, Sendable, Equatable, CustomStringConvertible {
    public var path: String
    public var message: String
    public var description: String { "\(path): \(message)" }
}

extension SubjectIdentifier {
    /// Parses a subject identifier found at `path` (used in error messages).
    public static func parse(_ value: JSONValue, path makePath: @autoclosure () -> String, allowAliases: Bool = true,
                             allowComplex: Bool = true) throws(SubjectError) -> SubjectIdentifier {
        guard let o = value.objectValue else {
            throw SubjectError(path: makePath(), message: "a subject identifier must be a JSON object, not \(value.typeName)")
        }
        let formatValue: JSONValue
        let formatKey: String
        switch (o["format"], o["subject_type"]) {
        case (let f?, nil): formatValue = f; formatKey = "format"
        case (nil, let t?): formatValue = t; formatKey = "subject_type"
        case (nil, nil): throw SubjectError(path: makePath(), message: "the subject identifier has no \"format\" (or legacy \"subject_type\")")
        case (.some, .some): throw SubjectError(path: makePath(), message: "the subject identifier has both \"format\" and \"subject_type\"")
        }
        guard let format = formatValue.stringValue, !format.isEmpty else {
            throw SubjectError(path: makePath(), message: "\"\(formatKey)\" must be a non-empty string")
        }

        func string(_ name: String, required: Bool = true) throws(SubjectError) -> String? {
            guard let member = o[name] else {
                if required { throw SubjectError(path: makePath(), message: "format \"\(format)\" requires the member \"\(name)\"") }
                return nil
            }
            guard let s = member.stringValue, !s.isEmpty else {
                throw SubjectError(path: makePath(), message: "\"\(name)\" must be a non-empty string")
            }
            return s
        }
        /// RFC 9493 §3: no members the format does not describe.
        func only(_ names: [String]) throws(SubjectError) {
            for member in o.members where member.name != formatKey && !names.contains(member.name) {
                let name = member.name
                throw SubjectError(path: makePath(), message: "format \"\(format)\" does not allow the member \"\(name)\"")
            }
        }

        switch format {
        case "email":
            try only(["email"])
            return .email(try string("email")!)
        case "phone_number", "phone":
            // RISC 1.0 writes "phone"; RFC 9493 "phone_number". The member is phone_number in both.
            try only(["phone_number"])
            return .phoneNumber(try string("phone_number")!)
        case "iss_sub", "iss-sub":
            try only(["iss", "sub"])
            return .issSub(iss: try string("iss")!, sub: try string("sub")!)
        case "opaque":
            try only(["id"])
            return .opaque(try string("id")!)
        case "account":
            try only(["uri"])
            let uri = try string("uri")!
            guard uri.hasPrefix("acct:") else {
                throw SubjectError(path: makePath(), message: "an account identifier's uri must be an acct: URI")
            }
            return .account(uri: uri)
        case "did":
            try only(["url"])
            let url = try string("url")!
            guard url.hasPrefix("did:") else { throw SubjectError(path: makePath(), message: "a did identifier's url must start with did:") }
            return .did(url: url)
        case "uri":
            try only(["uri"])
            return .uri(try string("uri")!)
        case "aliases":
            guard allowAliases else { throw SubjectError(path: makePath(), message: "aliases may not be nested") }
            try only(["identifiers"])
            guard let list = o["identifiers"]?.arrayValue, !list.isEmpty else {
                throw SubjectError(path: makePath(), message: "aliases requires a non-empty array \"identifiers\"")
            }
            var ids: [SubjectIdentifier] = []
            for (i, item) in list.enumerated() {
                ids.append(try parse(item, path: "\(makePath()).identifiers[\(i)]", allowAliases: false, allowComplex: allowComplex))
            }
            return .aliases(ids)
        case "complex":
            guard allowComplex else { throw SubjectError(path: makePath(), message: "complex subjects may not be nested") }
            var members: [ComplexMember: SubjectIdentifier] = [:]
            for (name, value) in o where name != formatKey {
                guard let member = ComplexMember(rawValue: name) else {
                    throw SubjectError(path: makePath(), message: "a complex subject may not have the member \"\(name)\"")
                }
                // Each member is a simple identifier (SSF §3.1): no aliases, so none nest.
                members[member] = try parse(value, path: "\(makePath()).\(name)", allowAliases: false, allowComplex: false)
            }
            guard !members.isEmpty else { throw SubjectError(path: makePath(), message: "a complex subject needs at least one member") }
            return .complex(members)
        case "jwt_id":
            try only(["iss", "jti"])
            return .jwtID(iss: try string("iss")!, jti: try string("jti")!)
        case "saml_assertion_id":
            try only(["issuer", "assertion_id"])
            return .samlAssertionID(issuer: try string("issuer")!, assertionID: try string("assertion_id")!)
        case "ip-addresses":
            try only(["ip-addresses"])
            guard let list = o["ip-addresses"]?.arrayValue, !list.isEmpty,
                  list.allSatisfy({ $0.stringValue?.isEmpty == false })
            else { throw SubjectError(path: makePath(), message: "ip-addresses requires a non-empty array of strings") }
            return .ipAddresses(list.compactMap(\.stringValue))
        case "id_token_claims":
            try only(["iss", "sub", "email"])
            return .idTokenClaims(iss: try string("iss")!, sub: try string("sub")!, email: try string("email", required: false))
        case "oauth_token":
            try only(["token_type", "token_identifier_alg", "token"])
            let type = try string("token_type")!
            let algName = try string("token_identifier_alg")!
            let token = try string("token")!
            guard let alg = TokenReference.IdentifierAlgorithm(rawValue: algName) else {
                throw SubjectError(path: makePath(), message: "token_identifier_alg \"\(algName.prefix(40))\" is not one of plain, prefix, hash_base64_sha512_sha512")
            }
            return .oauthToken(TokenReference(tokenType: type, identifierAlgorithm: alg, value: token))
        case "oauth_client":
            try only(["client_id"])
            return .oauthClient(clientID: try string("client_id")!)
        default:
            return .other(format: format, members: o)
        }
    }
}
