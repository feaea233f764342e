/// JSON Schema (2020-12) documents derived from the event catalog, so the published schemas and
/// the rules the parser enforces cannot drift apart. `schemas/events/` holds their output.
public enum PayloadSchemas {
    public static let dialect = "https://json-schema.org/draft/2020-12/schema"
    public static let subjectIdentifierID = "https://schemas.warden.invalid/subject-identifier.schema.json"

    public static func id(for definition: EventDefinition) -> String {
        "https://schemas.warden.invalid/events/" + relativePath(for: definition)
    }

    /// Where the schema lives below `schemas/events/`: one folder per family.
    public static func relativePath(for definition: EventDefinition) -> String {
        "\(definition.family.rawValue)/\(definition.name).schema.json"
    }

    /// The schema of one event type's payload. Unknown members are allowed (receivers must
    /// ignore them); listed values are documented, not enforced.
    public static func schema(for definition: EventDefinition) -> JSONValue {
        var properties = JSONObject()
        var required: [JSONValue] = []
        for rule in definition.claims {
            var property: JSONObject
            switch rule.type {
            case .languageMap:
                property = ["type": "object", "additionalProperties": ["type": "string"]]
            default:
                property = ["type": .string(rule.type.rawValue)]
            }
            if !rule.knownValues.isEmpty {
                property["examples"] = .array(rule.knownValues.map { .string($0) })
            }
            properties[rule.name] = .object(property)
            if rule.required { required.append(.string(rule.name)) }
        }
        if definition.subject != .none {
            properties["subject"] = ["$ref": .string(subjectIdentifierID)]
        }
        if definition.subject == .tokenInEvent {
            required.append("subject")
        }
        var schema: JSONObject = [
            "$schema": .string(dialect),
            "$id": .string(id(for: definition)),
            "title": .string("\(definition.name) event payload"),
            "description": .string(definition.uri + (definition.aliasOf.map { " (alias of \($0))" } ?? "")),
            "type": "object",
            "properties": .object(properties),
        ]
        if !required.isEmpty { schema["required"] = .array(required) }
        return .object(schema)
    }
}

extension JSONValue {
    /// Indented JSON text (two spaces), for files people read.
    public var prettyText: String {
        var out: [UInt8] = []
        writePretty(to: &out, indent: 0)
        out.append(UInt8(ascii: "\n"))
        return String(decoding: out, as: UTF8.self)
    }

    private func writePretty(to out: inout [UInt8], indent: Int) {
        let pad = String(repeating: "  ", count: indent + 1)
        let closing = String(repeating: "  ", count: indent)
        switch self {
        case .array(let items) where !items.isEmpty && items.contains(where: { $0.objectValue != nil || $0.arrayValue != nil }):
            out += "[\n".utf8
            for (i, item) in items.enumerated() {
                out += pad.utf8
                item.writePretty(to: &out, indent: indent + 1)
                out += (i == items.count - 1 ? "\n" : ",\n").utf8
            }
            out += (closing + "]").utf8
        case .object(let object) where !object.isEmpty:
            out += "{\n".utf8
            for (i, member) in object.members.enumerated() {
                out += pad.utf8
                JSONValue.writeString(member.name, to: &out)
                out += ": ".utf8
                member.value.writePretty(to: &out, indent: indent + 1)
                out += (i == object.count - 1 ? "\n" : ",\n").utf8
            }
            out += (closing + "}").utf8
        default:
            write(to: &out)
        }
    }
}
