import Foundation
@testable import Invalidation
import SecurityEvents
import Testing

/// Tokens as a provider sends them (Google's legacy spellings included), parsed by the real parser.
func token(_ event: String, _ payload: String = "{}", subject: String? = #"{"subject_type":"iss-sub","iss":"https://accounts.google.com/","sub":"1234"}"#,
           extra: String = "") -> SecurityEventToken {
    let uri = event.contains("://") ? event : EventURIPrefix.risc + event
    var body = payload
    if let subject { body = body == "{}" ? #"{"subject":\#(subject)}"# : String(body.dropLast()) + #","subject":\#(subject)}"# }
    let json = #"{"iss":"https://accounts.google.com/","aud":"app","iat":1700000000,"jti":"j-1"\#(extra),"events":{"\#(uri)":\#(body)}}"#
    return try! SecurityEventToken.parse(claims: try! JSONParser.parse(json).objectValue!)
}

let planner = Planner(policy: .builtIn)

@Suite("Planner with the built-in policy")
struct PlannerTests {
    @Test func everyBuiltInEntryIsAKnownCanonicalEventType() {
        for key in Policy.builtIn.rules.keys {
            let type = EventType(key)
            #expect(type.isKnown, "\(key)")
            #expect(Policy.key(for: type) == key, "\(key) is not the canonical URI")
        }
    }

    // Issuer A (the signer) names an account of issuer B: {iss} stays A, no {sub} is taken
    // from B's account, and the identity resolver finds no local user.
    @Test func aSubjectIsScopedToTheIssuerThatSignedTheToken() async {
        let foreign = #"{"subject_type":"iss-sub","iss":"https://other-issuer.example/","sub":"victim"}"#
        let forged = token("sessions-revoked", subject: foreign)
        let values = Planner.values(for: forged.events[0], in: forged, resolution: .unresolved)
        #expect(values["iss"] == "https://accounts.google.com/")
        #expect(values["sub"] == nil)
        #expect(await IdentityResolver().resolve(forged) == .resolved(.unresolved))
        let scoped = Planner(policy: Policy(rules: [EventURIPrefix.risc + "sessions-revoked":
            [PolicyRule(.purgeSet(target: "sessions", set: "sessions:{iss}|{sub}"))]]))
        #expect(scoped.plan(forged, subject: .unresolved).steps.isEmpty)
        // The signer's own account resolves as before.
        let own = token("sessions-revoked")
        #expect(await IdentityResolver().resolve(own) == .resolved(.user("1234")))
        #expect(scoped.plan(own, subject: .unresolved).steps.map(\.action)
                == [.purgeSet(target: "sessions", set: "sessions:https://accounts.google.com/|1234")])
    }

    @Test func sessionsRevokedPurgesTheUsersSessionSet() {
        let plan = planner.plan(token("sessions-revoked"), subject: .user("u-42"))
        #expect(plan.steps.map(\.action) == [.purgeSet(target: "sessions", set: "user-sessions:u-42"), .notify(target: "app", user: "u-42")])
        #expect(plan.skipped.isEmpty && plan.unknownTypes.isEmpty)
    }

    @Test func googlesLegacyURIGetsTheCanonicalTypesSteps() {
        let plan = planner.plan(token("https://accounts.google.com/risc/event/sessions-revoked"), subject: .user("u-1"))
        #expect(plan.steps.first?.action == .purgeSet(target: "sessions", set: "user-sessions:u-1"))
        #expect(plan.steps.first?.eventType == EventURIPrefix.risc + "sessions-revoked")
    }

    @Test func tokensRevokedEndsSessionsAndDeletesHeldTokens() {
        let plan = planner.plan(token(EventURIPrefix.oauth + "tokens-revoked"), subject: .user("u-7"))
        #expect(plan.steps.map(\.action) == [.purgeSet(target: "sessions", set: "user-sessions:u-7"),
                                              .deleteTokens(store: "tokens", user: "u-7"), .notify(target: "app", user: "u-7")])
    }

    @Test func tokenRevokedDeletesTheNamedToken() {
        let subject = #"{"subject_type":"oauth_token","token_type":"refresh_token","token_identifier_alg":"prefix","token":"1/abcdefghijklmnop"}"#
        let plan = planner.plan(token(EventURIPrefix.oauth + "token-revoked", subject: subject), subject: .unresolved)
        #expect(plan.steps.map(\.action) == [.deleteToken(store: "tokens"), .notify(target: "app")])
        #expect(!plan.isUnresolved)
    }

    @Test func accountDisabledDependsOnTheReason() {
        let hijacked = planner.plan(token("account-disabled", #"{"reason":"hijacking"}"#), subject: .user("u"))
        #expect(hijacked.steps.map(\.action) == [.purgeSet(target: "sessions", set: "user-sessions:u"), .notify(target: "app", user: "u")])
        let noReason = planner.plan(token("account-disabled"), subject: .user("u"))
        #expect(noReason.steps.map(\.action) == [.setFlag(target: "sessions", key: "signin-disabled:u", value: "1", ttl: nil),
                                                  .notify(target: "app", user: "u")])
        let bulk = planner.plan(token("account-disabled", #"{"reason":"bulk-account"}"#), subject: .user("u"))
        #expect(bulk.steps.map(\.action) == [.notify(target: "app", user: "u")])
    }

    @Test func accountEnabledClearsTheSignInFlag() {
        let plan = planner.plan(token("account-enabled"), subject: .user("u"))
        #expect(plan.steps.first?.action == .purgeKeys(target: "sessions", keys: ["signin-disabled:u"]))
    }

    @Test func verificationHasNoSteps() {
        let plan = planner.plan(token("verification", #"{"state":"abc"}"#, subject: nil), subject: .unresolved)
        #expect(plan.steps.isEmpty && plan.skipped.isEmpty && plan.unknownTypes.isEmpty)
    }

    @Test func unknownEventTypesAreListedWithoutSteps() {
        let plan = planner.plan(token("https://example.com/event/something-new"), subject: .user("u"))
        #expect(plan.steps.isEmpty)
        #expect(plan.unknownTypes == [EventType("https://example.com/event/something-new")])
    }

    @Test func anUnresolvedSubjectSkipsUserStepsButStillNotifies() {
        let plan = planner.plan(token("sessions-revoked"), subject: .unresolved)
        #expect(plan.steps.map(\.action) == [.notify(target: "app")])
        #expect(plan.isUnresolved)
        #expect(plan.skipped.map(\.reason) == [.unresolvedSubject])
    }

    @Test func backChannelLogoutPurgesTheNamedSessionOrAllOfThem() {
        let uri = EventURIPrefix.backchannelLogout
        let withSID = planner.plan(token(uri, subject: nil, extra: #","sub":"s-1","sid":"08a5019c""#), subject: .user("u"))
        #expect(withSID.steps.map(\.action) == [.purgeKeys(target: "sessions", keys: ["session:08a5019c"])])
        let withoutSID = planner.plan(token(uri, subject: nil, extra: #","sub":"s-1""#), subject: .user("u"))
        #expect(withoutSID.steps.map(\.action) == [.purgeSet(target: "sessions", set: "user-sessions:u")])
    }

    @Test func caepSessionRevokedWithAComplexSubject() {
        let subject = #"{"format":"complex","session":{"format":"opaque","id":"sess-abc"},"user":{"format":"iss_sub","iss":"https://idp/","sub":"u-1"}}"#
        let plan = planner.plan(token(EventURIPrefix.caep + "session-revoked", subject: subject), subject: .user("local-1"))
        #expect(plan.steps.first?.action == .purgeSet(target: "sessions", set: "user-sessions:local-1"))
        let caep = token(EventURIPrefix.caep + "session-revoked", subject: subject)
        let values = Planner.values(for: caep.events[0], in: caep, resolution: .user("local-1"))
        // The user member names another issuer's account: {iss} stays the signer's, and no
        // {sub} is taken from it.
        #expect(values["sid"] == "sess-abc" && values["sub"] == nil && values["iss"] == "https://accounts.google.com/")
        let own = token(EventURIPrefix.caep + "session-revoked",
                        subject: subject.replacingOccurrences(of: "https://idp/", with: "https://accounts.google.com/"))
        #expect(Planner.values(for: own.events[0], in: own, resolution: .unresolved)["sub"] == "u-1")
        // A canonically equivalent spelling of the signer (U+212A for "K") is another issuer.
        func signed(by issuer: String, subjectIssuer: String) -> SecurityEventToken {
            let json = #"{"iss":"\#(issuer)","aud":"app","iat":1700000000,"jti":"j-2","events":{"\#(EventURIPrefix.caep)session-revoked":"#
                + #"{"subject":{"format":"iss_sub","iss":"\#(subjectIssuer)","sub":"u-1"}}}}"#
            return try! SecurityEventToken.parse(claims: try! JSONParser.parse(json).objectValue!)
        }
        let kelvin = signed(by: "https://K.example/", subjectIssuer: #"https://\u212A.example/"#)
        #expect(kelvin.events[0].subject?.issuerSubject?.iss == "https://K.example/", "Swift's == holds them equal")
        #expect(Planner.values(for: kelvin.events[0], in: kelvin, resolution: .unresolved)["sub"] == nil)
        let same = signed(by: "https://K.example/", subjectIssuer: "https://K.example/")
        #expect(Planner.values(for: same.events[0], in: same, resolution: .unresolved)["sub"] == "u-1")
    }
}

@Suite("Planner with a configured policy")
struct ConfiguredPolicyTests {
    @Test func placeholdersAreFilledFromTheEventAndTheSubject() {
        let policy = Policy(rules: [EventURIPrefix.risc + "sessions-revoked": [
            PolicyRule(.purgeKeys(target: "cache", keys: ["by-sub:{iss}|{sub}", "by-mail:{email}", "{event}/{jti}"])),
        ]])
        let subject = #"{"subject_type":"id_token_claims","iss":"https://accounts.google.com/","sub":"99","email":"a@example.com"}"#
        let plan = Planner(policy: policy).plan(token("sessions-revoked", subject: subject), subject: .user("u"))
        #expect(plan.steps.map(\.action) == [.purgeKeys(target: "cache", keys: [
            "by-sub:https://accounts.google.com/|99", "by-mail:a@example.com", "sessions-revoked/j-1",
        ])])
    }

    @Test func aMissingValueSkipsTheStepAndSaysWhich() {
        let policy = Policy(rules: [EventURIPrefix.risc + "sessions-revoked": [
            PolicyRule(.purgeKeys(target: "cache", keys: ["by-mail:{email}"])),
            PolicyRule(.notify(target: "app")),
        ]])
        let plan = Planner(policy: policy).plan(token("sessions-revoked"), subject: .user("u"))
        #expect(plan.steps.map(\.action) == [.notify(target: "app", user: "u")])
        #expect(plan.steps.map(\.index) == [0])
        #expect(plan.skipped.map(\.reason) == [.missingValue("email")])
    }

    @Test func aSubjectCannotWidenAPurgePattern() {
        let policy = Policy(rules: [EventURIPrefix.risc + "sessions-revoked": [
            PolicyRule(.purgePattern(target: "sessions", pattern: "session:{user}:*")),
        ]])
        let plan = Planner(policy: policy).plan(token("sessions-revoked"), subject: .user("*"))
        #expect(plan.steps.map(\.action) == [.purgePattern(target: "sessions", pattern: #"session:\*:*"#)])
    }

    /// An empty value is no value: `sess:{sub}*` with an empty `sub` would be `sess:*`, every
    /// user's sessions. An empty `sub` or `sid` claim (subject members are refused empty by the
    /// parser) and a lookup that answered an empty user id all skip the step that needs them.
    @Test func anEmptyValueNeverWidensAStepToEveryone() {
        let policy = Policy(rules: [EventURIPrefix.risc + "sessions-revoked": [
            PolicyRule(.purgePattern(target: "sessions", pattern: "sess:{sub}*")),
            PolicyRule(.purgePattern(target: "sessions", pattern: "sid:{sid}*")),
            PolicyRule(.purgeSet(target: "sessions", set: "user-sessions:{user}")),
            PolicyRule(.deleteTokens(store: "tokens")),
            PolicyRule(.notify(target: "app")),
        ]])
        let email = #"{"subject_type":"email","email":"a@b.example"}"#
        let empty = token("sessions-revoked", subject: email, extra: #","sub":"","sid":"""#)
        let plan = Planner(policy: policy).plan(empty, subject: .user(""))
        #expect(plan.steps.map(\.action) == [.notify(target: "app")])
        #expect(plan.skipped.map(\.reason) == [.missingValue("sub"), .missingValue("sid"), .unresolvedSubject, .unresolvedSubject])
        // The same rules with values: every step planned.
        let full = token("sessions-revoked", subject: email, extra: #","sub":"s1","sid":"x""#)
        #expect(Planner(policy: policy).plan(full, subject: .user("u")).steps.count == 5)
    }

    /// Redis matches a pattern byte by byte: a wildcard that Swift sees as part of a larger
    /// character (followed by a combining mark) is escaped all the same.
    @Test func aWildcardFollowedByACombiningMarkIsEscapedToo() throws {
        let policy = Policy(rules: [EventURIPrefix.risc + "sessions-revoked": [
            PolicyRule(.purgePattern(target: "sessions", pattern: "session:{user}:*")),
        ]])
        let user = "a*\u{301}b?\u{308}[x]\\é"
        let plan = Planner(policy: policy).plan(token("sessions-revoked"), subject: .user(user))
        #expect(plan.steps.map(\.action) == [.purgePattern(target: "sessions",
                                                           pattern: "session:a\\*\u{301}b\\?\u{308}\\[x\\]\\\\é:*")])
        // Outside patterns a value is put in as it is, and a brace without its pair is kept.
        #expect(try Planner.substitute("k:{user}:{", values: ["user": user], escapeGlob: false) == "k:\(user):{")
        #expect(try Planner.substitute("{x}{user}", values: ["x": "é", "user": "*"], escapeGlob: false) == "é*")
    }

    @Test func conditionsMatchListedValuesPresenceAndAbsence() {
        let event = token("account-disabled", #"{"reason":"bulk-account"}"#)
        #expect(Condition([("reason", .oneOf(["hijacking", "bulk-account"]))]).matches(event.events[0], in: event))
        #expect(!Condition([("reason", .oneOf(["hijacking"]))]).matches(event.events[0], in: event))
        #expect(Condition([("reason", .present)]).matches(event.events[0], in: event))
        #expect(!Condition([("reason", .absent)]).matches(event.events[0], in: event))
        #expect(!Condition([("reason", .present), ("state", .present)]).matches(event.events[0], in: event))
    }

    @Test func anOverrideReplacesOneEventTypeOnly() {
        let policy = Policy.builtIn.overridden(by: [EventURIPrefix.risc + "sessions-revoked": [PolicyRule(.notify(target: "x"))]])
        #expect(policy.rules(for: .sessionsRevoked) == [PolicyRule(.notify(target: "x"))])
        #expect(policy.rules(for: .accountDisabled) == Policy.builtIn.rules(for: .accountDisabled))
    }

    @Test func rulesForMissingTargetsAreLeftOutAndReported() {
        let (kept, dropped) = Policy.builtIn.keepingOnly(targets: ["sessions"], stores: [])
        #expect(kept.rules(for: .sessionsRevoked) == [PolicyRule(.purgeSet(target: "sessions", set: "user-sessions:{user}"))])
        #expect(dropped.contains { $0.1.action == .notify(target: "app") })
        #expect(dropped.contains { $0.1.action == .deleteTokens(store: "tokens") })
    }

    @Test func placeholderNamesAreFound() {
        #expect(Planner.placeholderNames(in: "a:{user}:{sid}") == ["user", "sid"])
        #expect(Planner.placeholderNames(in: "plain") == [])
        #expect(Planner.placeholderNames(in: "broken:{user") == ["{user"])
    }
}

@Suite("A planned step's text in the journal")
struct PlannedStepTextTests {
    static let actions: [StepAction] = [
        .purgeSet(target: "sessions", set: "sessions:\"quoted\"\\back\u{1}ctl:é"),
        .purgeKeys(target: "sessions", keys: ["a", "b\nc", ""]),
        .purgeKeys(target: "sessions", keys: []),
        .purgePattern(target: "sessions", pattern: "sess:*:u[1]"),
        .setFlag(target: "flags", key: "blocked:u", value: "1", ttl: nil),
        .setFlag(target: "flags", key: "blocked:u", value: "1", ttl: 3600),
        .setFlag(target: "flags", key: "blocked:u", value: "1", ttl: 1.5),
        .deleteToken(store: "tokens"),
        .deleteTokens(store: "tokens"),
        .deleteTokens(store: "tokens", user: "u1"),
        .revokeTokens(store: "tokens", target: "google", tokenTypeHint: nil),
        .revokeTokens(store: "tokens", target: "google", tokenTypeHint: "refresh_token", user: "u\"1"),
        .revokeTokens(store: "tokens", target: "google", tokenTypeHint: "refresh_token"),
        .notify(target: "app"),
        .notify(target: "app", user: "u1"),
        .sql(target: "db", statement: "UPDATE users SET locked = true WHERE id = $1", parameters: ["u1", "x"]),
    ]

    // Written by hand for speed, the text is the form Codable gives a step, and reads back as
    // the same step (a resumed event's steps are read from it).
    @Test(arguments: actions) func isItsCodableFormAndReadsBack(action: StepAction) throws {
        let step = PlannedStep(index: 3, eventType: EventType.sessionsRevoked.uri, action: action)
        let codable = try JSONParser.parse(Array(JSONEncoder().encode(step)))
        #expect(try JSONParser.parse(step.encoded) == codable)
        #expect(PlannedStep(encoded: step.encoded) == step)
    }
}
