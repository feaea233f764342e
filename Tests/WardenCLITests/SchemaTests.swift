import Foundation
import SecurityEvents
import Testing
import WardenTestSupport

/// The JSON Schemas in schemas/: generated event schemas match the catalog, and examples (the
/// protocol documents' own, plus `warden verify`'s real output) validate — or fail — as they should.
@Suite("JSON Schemas")
struct SchemaTests {
    let schemas = Warden.packageRoot.appendingPathComponent("schemas")

    @Test func eventSchemasMatchTheCatalog() throws {
        let write = ProcessInfo.processInfo.environment["WARDEN_WRITE_SCHEMAS"] == "1"
        for definition in EventCatalog.all {
            let url = schemas.appendingPathComponent("events/" + PayloadSchemas.relativePath(for: definition))
            let generated = PayloadSchemas.schema(for: definition).prettyText
            if write {
                try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
                try generated.write(to: url, atomically: true, encoding: .utf8)
            }
            let committed = try? String(contentsOf: url, encoding: .utf8)
            #expect(committed == generated, "schemas/events/\(definition.name).schema.json is out of date: run make schemas")
        }
        // Every file there belongs to an event type.
        let files = FileManager.default.enumerator(atPath: schemas.appendingPathComponent("events").path)?
            .compactMap { $0 as? String }.filter { $0.hasSuffix(".schema.json") } ?? []
        #expect(files.count == EventCatalog.all.count)
    }

    struct Case {
        var schema: String
        var instance: String
        var valid: Bool
    }

    func validate(_ cases: [Case]) async throws -> (status: Int32, output: String) {
        var list: [JSONValue] = []
        for c in cases {
            list.append(.object(["schema": .string(c.schema), "instance": try JSONParser.parse(c.instance), "valid": .bool(c.valid)]))
        }
        let dir = try Warden.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: dir) }
        let file = dir.appendingPathComponent("cases.json")
        try JSONValue.array(list).jsonText.write(to: file, atomically: true, encoding: .utf8)
        let result = try await runToEnd(URL(fileURLWithPath: "/usr/bin/python3"), [schemas.appendingPathComponent("validate.py").path, file.path])
        return (result.status, result.stdout + result.stderr)
    }

    static let envelope = "https://schemas.warden.invalid/set-envelope.schema.json"
    static let subject = "https://schemas.warden.invalid/subject-identifier.schema.json"
    static func event(_ path: String) -> String { "https://schemas.warden.invalid/events/\(path).schema.json" }

    @Test func protocolExamplesValidate() async throws {
        let cases: [Case] = [
            // SPEC §1.2, §3.1, §3.2 examples.
            Case(schema: Self.envelope, instance: #"{"iss":"https://accounts.google.com/","aud":"1234-abc.apps.googleusercontent.com","iat":1700000000,"jti":"e3b0c44298fc1c14","events":{"https://schemas.openid.net/secevent/risc/event-type/account-disabled":{"subject":{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"10987654321"},"reason":"hijacking"}}}"#, valid: true),
            Case(schema: Self.envelope, instance: #"{"iss":"https://tr.example.com","aud":"rcv-42","iat":1700000100,"jti":"v-77","sub_id":{"format":"opaque","id":"strm-9f2"},"events":{"https://schemas.openid.net/secevent/ssf/event-type/verification":{"state":"n0nce-123"}}}"#, valid: true),
            Case(schema: Self.envelope, instance: #"{"iss":"https://idp.example.org/","aud":"https://app.example.net/caep","iat":1700000200,"jti":"c-19","sub_id":{"format":"complex","session":{"format":"opaque","id":"sess-abc"},"user":{"format":"iss_sub","iss":"https://idp.example.org/","sub":"u-1"}},"events":{"https://schemas.openid.net/secevent/caep/event-type/session-revoked":{"initiating_entity":"admin","reason_admin":{"en":"Offboarded"},"event_timestamp":1700000190}}}"#, valid: true),
            Case(schema: Self.envelope, instance: #"{"iss":"i","iat":1,"events":{"e":{}}}"#, valid: false),
            Case(schema: Self.envelope, instance: #"{"iss":"i","iat":1,"jti":"j","events":{}}"#, valid: false),
            Case(schema: Self.envelope, instance: #"{"iss":"i","iat":1,"jti":"j","aud":7,"events":{"e":{}}}"#, valid: false),
            // Subject identifiers.
            Case(schema: Self.subject, instance: #"{"format":"email","email":"a@example.com"}"#, valid: true),
            Case(schema: Self.subject, instance: #"{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"1"}"#, valid: true),
            Case(schema: Self.subject, instance: #"{"subject_type":"oauth_token","token_type":"refresh_token","token_identifier_alg":"prefix","token":"1//0gAbCdEfGhIjK"}"#, valid: true),
            Case(schema: Self.subject, instance: #"{"format":"aliases","identifiers":[{"format":"email","email":"a@x"},{"format":"phone_number","phone_number":"+1"}]}"#, valid: true),
            Case(schema: Self.subject, instance: #"{"format":"complex","user":{"format":"iss_sub","iss":"https://i","sub":"u"},"device":{"format":"opaque","id":"d"}}"#, valid: true),
            Case(schema: Self.subject, instance: #"{"format":"email"}"#, valid: false),
            Case(schema: Self.subject, instance: #"{"format":"email","email":"a@x","sub":"1"}"#, valid: false),
            Case(schema: Self.subject, instance: #"{"format":"email","subject_type":"email","email":"a@x"}"#, valid: false),
            Case(schema: Self.subject, instance: #"{"format":"aliases","identifiers":[{"format":"aliases","identifiers":[{"format":"opaque","id":"1"}]}]}"#, valid: false),
            Case(schema: Self.subject, instance: #"{"format":"complex","planet":{"format":"opaque","id":"1"}}"#, valid: false),
            Case(schema: Self.subject, instance: #"{"format":"account","uri":"mailto:a@x"}"#, valid: false),
            // Event payloads.
            Case(schema: Self.event("risc/account-disabled"), instance: #"{"subject":{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"1"},"reason":"bulk-account"}"#, valid: true),
            Case(schema: Self.event("caep/credential-change"), instance: #"{"credential_type":"fido2-roaming","change_type":"create"}"#, valid: true),
            Case(schema: Self.event("caep/credential-change"), instance: #"{"credential_type":"password"}"#, valid: false),
            Case(schema: Self.event("oauth/token-revoked"), instance: #"{"reason":"user"}"#, valid: false),
            Case(schema: Self.event("ssf/stream-updated"), instance: #"{"reason":"maintenance"}"#, valid: false),
            Case(schema: Self.event("caep/session-revoked"), instance: #"{"reason_admin":{"en":7}}"#, valid: false),
        ]
        let result = try await validate(cases)
        #expect(result.status == 0, "\(result.output)")
        #expect(result.output.contains("\(cases.count) passed, 0 failed"))
    }

    @Test func verifyOutputMatchesItsSchema() async throws {
        let config = Warden.packageRoot.appendingPathComponent("examples/warden.yaml").path
        var cases: [Case] = []
        for (name, valid) in [("sessions-revoked", true), ("token-revoked", true), ("verification", true), ("forged", false)] {
            let token = try String(contentsOf: Warden.packageRoot.appendingPathComponent("examples/tokens/\(name).jwt"), encoding: .utf8)
            let out = try await Warden.run(["verify", "--config", config, "-"], stdin: token)
            #expect((out.status == 0) == valid)
            cases.append(Case(schema: "https://schemas.warden.invalid/verify-output.schema.json", instance: out.stdout, valid: true))
        }
        // And the schema is not vacuous: a made-up output fails it.
        cases.append(Case(schema: "https://schemas.warden.invalid/verify-output.schema.json", instance: #"{"valid":false,"err":"teapot","description":"x"}"#, valid: false))
        let result = try await validate(cases)
        #expect(result.status == 0, "\(result.output)")
    }
}
