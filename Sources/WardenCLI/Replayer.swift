import Foundation
import Invalidation
import Ledger
import Pipeline
import SecurityEvents
import TokenVerification

/// What a replay found for one entry of the log.
struct ReplayFinding: Sendable {
    enum Status: String, CaseIterable, Sendable {
        /// Valid, and every planned step is done.
        case ok
        /// Invalid now, and was not acted on: consistent.
        case invalid
        /// A later copy of an event already in this log.
        case duplicate
        /// Valid, and unknown to the ledger.
        case neverProcessed = "never-processed"
        /// Known to the ledger with steps pending or failed.
        case plannedNotDone = "planned-not-done"
        /// The ledger's verdict differs from today's.
        case verdictChanged = "verdict-changed"
        /// In the ledger from the replayed range, absent from the log (topic only).
        case notInLog = "not-in-log"
        /// Valid and unknown to the ledger, but received before what the ledger's retention has
        /// dropped: whether it was processed cannot be told, and it is not acted on.
        case beyondRetention = "beyond-retention"

        var isDiscrepancy: Bool { self == .neverProcessed || self == .plannedNotDone || self == .verdictChanged || self == .notInLog }
    }

    var position: String
    var jti: String?
    var issuer: String?
    var valid: Bool
    var error: (code: String, description: String)?
    var types: [String]
    var status: Status
    var eventID: Int64?
    /// The step kinds today's policy plans for it.
    var planned: [String]
    /// The steps the ledger holds for it.
    var ledgerSteps: [OutboxStep]?
    /// When it happened, for the timeline: when received if known, else its `iat`.
    var time: Double?
    /// With --apply: what doing the missing part came to.
    var applied: String?
    /// For an event that lifts a restriction: its subject's JSON text and `iat`, to find a
    /// later event of the subject before acting on it.
    var restoring: (subject: String, issuedAt: Double)?
    /// For a valid entry of the log: the key it verified with (`kid`, thumbprint), so that the
    /// keys never-processed events rest on can be checked before `--apply`.
    var key: (id: String?, thumbprint: String)?

    /// One line of the JSON Lines report.
    var reportLine: String {
        var object = JSONObject()
        object["position"] = .string(position)
        object["jti"] = jti.map(JSONValue.string) ?? .null
        object["iss"] = issuer.map(JSONValue.string) ?? .null
        object["verdict"] = .string(valid ? "valid" : "invalid")
        if let error {
            object["err"] = .string(error.code)
            object["description"] = .string(error.description)
        }
        object["types"] = .array(types.map(JSONValue.string))
        object["status"] = .string(status.rawValue)
        if let eventID { object["event_id"] = .number(Double(eventID)) }
        if valid { object["planned"] = .array(planned.map(JSONValue.string)) }
        if let key {
            if let id = key.id { object["kid"] = .string(id) }
            object["key_thumbprint"] = .string(key.thumbprint)
        }
        if let ledgerSteps {
            object["ledger_steps"] = .array(ledgerSteps.map { .object(["kind": .string($0.kind), "status": .string($0.status.rawValue)]) })
        }
        if let time { object["time"] = .string(RFC3339.string(from: time)) }
        if let applied { object["applied"] = .string(applied) }
        return JSONValue.object(object).jsonText
    }
}

/// Compares a log with the ledger, entry by entry, in bounded memory: today's verdict (with the
/// archived keys), today's plan, and what the ledger holds; with `apply`, does what is missing
/// through the pipeline, as the worker would.
final class Replayer {
    struct KeysUnavailable: Error, CustomStringConvertible {
        var position: String
        var reason: String
        /// What the entries of its batch before it came to: compared, and applied with `--apply`.
        var findings: [ReplayFinding] = []
        var description: String { "\(position): \(reason)" }
    }

    let ledger: any AuditingLedger
    let door: ReplayDoor?
    var statistics = ReplayStatistics()
    /// (issuer, jti) pairs met so far: a later copy is a duplicate.
    private let seen = SeenPairs()
    /// (issuer, jti) pairs that invalid entries claimed: the ledger's events they name are in
    /// the log (reported verdict-changed when it is this very token), not missing from it. Kept
    /// apart from `seen`: a forgery first in the log must not make the genuine token a duplicate.
    private let claimedSeen = SeenPairs()

    /// What was received before this (seconds since 1970) the ledger's retention may have
    /// dropped; nil when it keeps everything.
    let retentionCutoff: Double?
    /// An entry's time (its Kafka timestamp, a log's `received_at`, or its `iat`) may be a little
    /// earlier than when the worker received it: entries this close to the cutoff count as
    /// beyond it.
    static let retentionMargin: Double = 600

    init(ledger: any AuditingLedger, door: ReplayDoor?, retentionCutoff: Double? = nil) {
        self.ledger = ledger
        self.door = door
        self.retentionCutoff = retentionCutoff
    }

    /// The cutoff replay must respect: the newest one retention recorded in the ledger, or what
    /// the configured retention drops by now, whichever is later.
    static func retentionCutoff(ledger: any AuditingLedger, retention: Double?) async throws -> Double? {
        let recorded = try await ledger.retentionCutoff()
        let configured = retention.map { Date().timeIntervalSince1970 - $0 }
        return [recorded, configured].compactMap { $0 }.max()
    }

    /// What the comparison needs of a valid token: taken on the verification thread that
    /// verified it, where the parsed token is then freed, so that the comparison copies and
    /// frees little on the one task that compares.
    struct Valid: Sendable {
        var issuer: String
        var jti: String
        /// Its events' short names.
        var types: [String]
        /// The step kinds today's policy plans for it.
        var planned: [String]
        var issuedAt: Double
        /// For a token that lifts a restriction (`account-enabled`), which acted on after a later
        /// event of its subject would undo that one: its subject's JSON text, as the ledger
        /// keeps it, and its `iat`.
        var restoring: (subject: String, issuedAt: Double)?
        /// The key it verified with: its `kid` and RFC 7638 thumbprint.
        var key: (id: String?, thumbprint: String)
    }

    /// Event types whose steps lift what earlier ones imposed: applied out of order, they undo
    /// a later restriction (the built-in policy answers `account-enabled` by deleting the
    /// sign-in flag a later `account-disabled` set).
    static let restoringTypes: Set<String> = [EventType.accountEnabled.uri, EventURIPrefix.oauth + "client-enabled"]

    enum Verdict: Sendable {
        case valid(Valid)
        case invalid(VerificationError)
    }

    /// Verifies a batch on every core, on the verification threads the worker uses, and plans
    /// each valid token with today's policy. Nil for an entry that holds no token.
    static func verify(_ entries: [ReplayEntry], with verifier: SETVerifier, planner: Planner) async -> [Verdict?] {
        await onVerificationThreads(entries.count, workers: ProcessInfo.processInfo.activeProcessorCount) { i -> Verdict? in
            guard entries[i].malformed == nil else { return nil }
            switch await verifier.verify(entries[i].token, claimsTime: claimsTime(entries[i])) {
            case .success(let verified):
                let token = verified.token
                // The kinds only: no subject lookup is made (a dry run touches no target).
                let lifts = token.events.contains { (event: SecurityEvent) in restoringTypes.contains(event.type.canonical?.uri ?? event.type.uri) }
                return .valid(Valid(issuer: token.issuer, jti: token.jti, types: token.events.map { $0.type.name },
                                    planned: planner.plan(token, subject: .user("-")).steps.map { $0.action.kind },
                                    issuedAt: token.issuedAt,
                                    restoring: lifts ? token.primarySubject.map { ($0.jsonText, token.issuedAt) } : nil,
                                    key: (verified.header.keyID, verified.keyThumbprint)))
            case .failure(let error):
                return .invalid(error)
            }
        }
    }

    /// When a logged token's claims are judged: when it was received, if the log says; else as
    /// of its own `iat` (as it would have been judged when it was sent).
    static func claimsTime(_ entry: ReplayEntry) -> SETVerifier.ClaimsTime {
        entry.receivedAt.map { .at($0) } ?? .issuedAt
    }

    /// Classifies one verified batch against the ledger; with a door, does what is missing.
    func classify(_ entries: [ReplayEntry], _ results: [Verdict?]) async throws -> [ReplayFinding] {
        // Keys unavailable stop the replay there: every entry of the batch before it is still
        // compared (and repaired), and its findings go with the stop.
        for (cut, result) in results.enumerated() {
            guard case .invalid(let error)? = result, error.isRetryable else { continue }
            var stop = KeysUnavailable(position: entries[cut].position, reason: error.description)
            if cut > 0 { stop.findings = try await classify(Array(entries[..<cut]), Array(results[..<cut])) }
            throw stop
        }
        var findings: [ReplayFinding] = []
        findings.reserveCapacity(entries.count)
        var lookups: [EventKey] = []
        // Which valid entries are the first copy of their event, in one pass over the batch.
        let validKeys = results.compactMap { result -> Int? in
            guard case .valid(let valid)? = result else { return nil }
            return SeenPairs.hash(EventKey(issuer: valid.issuer, jti: valid.jti))
        }
        var firsts = try seen.insert(validKeys).makeIterator()
        // An invalid entry that is the very token the ledger took as valid (reported
        // verdict-changed) counts as met: that event is in the log, not missing from it. One
        // that only claims the event's issuer and jti (a forged or corrupted copy) does not.
        var claimedKeys: [Int] = []
        for (entry, result) in zip(entries, results) {
            switch result {
            case nil:
                statistics.noteUntokened(at: entry.position)
                findings.append(ReplayFinding(position: entry.position, jti: nil, issuer: nil, valid: false,
                                              error: ("invalid_request", entry.malformed ?? "not a token"), types: [], status: .invalid,
                                              planned: [], time: entry.receivedAt))
            case .invalid(let error):
                // Not even shaped as a compact token: as good as no token.
                if error.kind == .malformed || error.kind == .tooLarge {
                    statistics.noteUntokened(at: entry.position)
                }
                // What it claims to be, unverified: to find what the ledger made of this very token.
                let claimed = UnverifiedClaims(entry.token)
                findings.append(ReplayFinding(position: entry.position, jti: claimed.jti, issuer: claimed.issuer, valid: false,
                                              error: (error.reportedCode, error.description), types: [], status: .invalid,
                                              planned: [], time: entry.receivedAt ?? claimed.issuedAt))
                if let iss = claimed.issuer, let jti = claimed.jti { lookups.append(EventKey(issuer: iss, jti: jti)) }
            case .valid(let valid):
                let first = firsts.next() ?? true
                var finding = ReplayFinding(position: entry.position, jti: valid.jti, issuer: valid.issuer, valid: true,
                                            types: valid.types, status: first ? .ok : .duplicate,
                                            planned: valid.planned, time: entry.receivedAt ?? valid.issuedAt)
                finding.restoring = valid.restoring
                finding.key = valid.key
                findings.append(finding)
                if first { lookups.append(EventKey(issuer: valid.issuer, jti: valid.jti)) }
            }
        }
        let states = lookups.isEmpty ? [:] : try await ledger.eventStates(lookups)
        var unknownValid: [Int] = []
        for i in findings.indices {
            let entry = entries[i]
            guard let iss = findings[i].issuer, let jti = findings[i].jti else { continue }
            let state = states[EventKey(issuer: iss, jti: jti)]
            if findings[i].valid {
                guard findings[i].status == .ok else { continue }
                guard let state else {
                    unknownValid.append(i)
                    continue
                }
                findings[i].eventID = state.id
                findings[i].ledgerSteps = state.steps
                if state.steps.contains(where: { $0.status != .done }) || state.outcome == .failed || state.outcome == .pending
                    || state.outcome == .claimed {
                    findings[i].status = .plannedNotDone
                }
            } else if let state, state.tokenSHA256 == AuditChain.sha256Hex(entry.token) {
                // This very token was taken as valid, and is refused today.
                findings[i].eventID = state.id
                findings[i].ledgerSteps = state.steps
                findings[i].status = .verdictChanged
                claimedKeys.append(SeenPairs.hash(EventKey(issuer: iss, jti: jti)))
            }
        }
        if !claimedKeys.isEmpty { _ = try claimedSeen.insert(claimedKeys) }
        if !unknownValid.isEmpty {
            let digests = unknownValid.map { AuditChain.sha256Hex(entries[$0].token) }
            let rejected = try await ledger.rejectedDigests(digests)
            for (i, digest) in zip(unknownValid, digests) {
                if rejected.contains(digest) {
                    findings[i].status = .verdictChanged
                } else if let cutoff = retentionCutoff, (findings[i].time ?? 0) < cutoff + Self.retentionMargin {
                    // Its claim (or refusal) may have been dropped by retention: acting on it
                    // could act a second time.
                    findings[i].status = .beyondRetention
                } else {
                    findings[i].status = .neverProcessed
                }
            }
        }
        if let door { try await apply(entries, &findings, door: door) }
        for finding in findings { statistics.add(finding) }
        return findings
    }

    /// Does what the ledger says is missing: never-processed events (and those refused then and
    /// valid now) are claimed, planned and acted on; failed steps are made pending again, and
    /// pending ones run, through the pipeline as the worker runs them.
    private func apply(_ entries: [ReplayEntry], _ findings: inout [ReplayFinding], door: ReplayDoor) async throws {
        var chosen: [Int] = []
        for i in findings.indices where findings[i].valid {
            let status = findings[i].status
            guard status == .neverProcessed || status == .verdictChanged || status == .plannedNotDone else { continue }
            // Lifting a restriction after a later event of the subject would undo that one (its
            // own steps, or steps it left failed, made now): left to the operator, a discrepancy
            // still.
            if let (subject, issuedAt) = findings[i].restoring, let issuer = findings[i].issuer,
               let later = try await ledger.laterEvent(issuer: issuer, subject: subject, issuedAfter: issuedAt) {
                findings[i].applied = "not applied: it lifts a restriction, and ledger event \(later) of its subject came after it"
                statistics.unrepaired += 1
                continue
            }
            if status == .plannedNotDone, let id = findings[i].eventID,
               findings[i].ledgerSteps?.contains(where: { $0.status == .failed }) == true {
                _ = try await ledger.reopenFailedSteps(ofEvent: id, reason: "warden replay --apply (\(entries[i].position))")
            }
            chosen.append(i)
        }
        guard !chosen.isEmpty else { return }
        let now = Date().timeIntervalSince1970
        let messages = chosen.map { i in
            IntakeMessage(value: entries[i].token, source: ReplayDoor.source, receivedAt: now, claimsTime: Self.claimsTime(entries[i]))
        }
        let dispositions = await door.apply(messages)
        for (i, disposition) in zip(chosen, dispositions) {
            findings[i].applied = switch disposition {
            case .recorded(_, let outcome): outcome.rawValue
            case .duplicate: "steps-run"
            case .rejected(let code, _): "rejected: \(code)"
            case .abandoned: "abandoned"
            }
        }
        // What the ledger holds now, for the exit status: every repaired event is done.
        let keys = chosen.compactMap { i in findings[i].issuer.flatMap { iss in findings[i].jti.map { EventKey(issuer: iss, jti: $0) } } }
        let states = try await ledger.eventStates(keys)
        for i in chosen {
            // Not in the ledger after applying (the store refused it, it was dead-lettered, the
            // replay stopped first): not repaired.
            guard let iss = findings[i].issuer, let jti = findings[i].jti, let state = states[EventKey(issuer: iss, jti: jti)] else {
                statistics.unrepaired += 1
                continue
            }
            findings[i].eventID = state.id
            findings[i].ledgerSteps = state.steps
            let done = !state.steps.contains(where: { $0.status != .done }) && state.outcome != .failed && state.outcome != .pending
            statistics.repaired += done ? 1 : 0
            statistics.unrepaired += done ? 0 : 1
        }
    }

    /// For a topic: the ledger's events from that topic received in the range that the log did
    /// not hold, page by page.
    /// `outsideTheRange`: whether the topic's message at a partition and offset is still on it
    /// but outside the time range — the ledger's times are when the worker consumed a message,
    /// the range's are the messages' own: one produced just before `from` and consumed after it
    /// is not missing from the range.
    func eventsNotInLog(topic: String, from: Double, to: Double, outsideTheRange: (Int32, Int64) -> Bool,
                        each: (ReplayFinding) throws -> Void) async throws {
        var after: Int64 = 0
        let prefix = "kafka:\(topic)/"
        while true {
            let page = try await ledger.events(sourcePrefix: prefix, receivedFrom: from, to: to, afterID: after, limit: 1000)
            for event in page {
                after = event.id
                let hash = SeenPairs.hash(EventKey(issuer: event.issuer, jti: event.jti))
                guard try !seen.contains(hash), try !claimedSeen.contains(hash) else { continue }
                // kafka:<topic>/<partition>/<offset>
                let place = event.source.dropFirst(prefix.count).split(separator: "/")
                if place.count == 2, let partition = Int32(place[0]), let offset = Int64(place[1]), outsideTheRange(partition, offset) { continue }
                let finding = ReplayFinding(position: "ledger event \(event.id)", jti: event.jti, issuer: event.issuer, valid: true,
                                            types: event.eventTypes.map { EventType($0).name }, status: .notInLog,
                                            eventID: event.id, planned: [], time: event.receivedAt)
                statistics.add(finding)
                try each(finding)
            }
            if page.count < 1000 { break }
        }
    }
}

/// Counts for the summary and the HTML report, in memory bounded by the log's time span (one
/// bucket per hour), not its size; the first discrepancies are kept to list.
struct ReplayStatistics {
    static let listedDiscrepancies = 1000

    var entries = 0
    var byStatus: [ReplayFinding.Status: Int] = [:]
    var byType: [String: [ReplayFinding.Status: Int]] = [:]
    /// Hour since 1970 → counts by status.
    var timeline: [Int: [ReplayFinding.Status: Int]] = [:]
    var discrepancies: [ReplayFinding] = []
    var discrepancyCount = 0
    static let maximumHours = 100_000
    /// Entries whose hour found no bucket left.
    var unchartedEntries = 0
    var repaired = 0
    var unrepaired = 0
    /// Discrepancies no replay can repair: a token acted on that is refused today, an event the
    /// ledger holds that is gone from the topic.
    var unrepairable = 0
    /// Entries that held no token at all (not JSON with a "token", a line too long), and where
    /// the first was: reported invalid, and said on stderr — a log of the wrong file must not
    /// pass for one with nothing to repair.
    var untokened = 0
    var firstUntokened: String? = nil

    mutating func noteUntokened(at position: String) {
        untokened += 1
        if firstUntokened == nil { firstUntokened = position }
    }

    mutating func add(_ finding: ReplayFinding) {
        entries += 1
        byStatus[finding.status, default: 0] += 1
        for type in finding.types.isEmpty ? ["(none)"] : finding.types { byType[type, default: [:]][finding.status, default: 0] += 1 }
        if let time = finding.time, time.isFinite, abs(time) < 1e11 {
            let hour = Int((time / 3600).rounded(.down))
            // At most `maximumHours` buckets (11 years of hours), whatever times a log claims;
            // entries past that are counted, not charted.
            if timeline[hour] != nil || timeline.count < Self.maximumHours {
                timeline[hour, default: [:]][finding.status, default: 0] += 1
            } else {
                unchartedEntries += 1
            }
        }
        if finding.status == .notInLog || (finding.status == .verdictChanged && !finding.valid) { unrepairable += 1 }
        if finding.status.isDiscrepancy {
            discrepancyCount += 1
            if discrepancies.count < Self.listedDiscrepancies { discrepancies.append(finding) }
        }
    }

    /// The human summary: counts by event type and by status.
    var summary: String {
        var lines = ["replayed \(entries) entries"]
        lines.append("by status:")
        for status in ReplayFinding.Status.allCases where byStatus[status, default: 0] > 0 {
            lines.append("  \(status.rawValue.padding(toLength: 18, withPad: " ", startingAt: 0)) \(byStatus[status]!)")
        }
        lines.append("by event type:")
        for type in byType.keys.sorted() {
            let counts = byType[type]!
            let detail = ReplayFinding.Status.allCases.compactMap { s in counts[s].map { "\(s.rawValue) \($0)" } }.joined(separator: ", ")
            lines.append("  \(type): \(counts.values.reduce(0, +)) (\(detail))")
        }
        lines.append(discrepancyCount == 0 ? "no discrepancies" : "\(discrepancyCount) discrepancies")
        if repaired + unrepaired > 0 { lines.append("applied: \(repaired) repaired, \(unrepaired) not (see the report)") }
        return lines.joined(separator: "\n")
    }
}
