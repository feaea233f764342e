import Foundation

/// `# HELP` for every metric Warden exports, added to the registry's text beside its `# TYPE`
/// lines. A metric without an entry here is reported by the tests (`/metrics` must describe
/// everything it shows).
enum MetricHelp {
    static let texts: [String: String] = [
        "warden_build_info": "Always 1; the labels say which build runs.",
        "warden_events_received_total": "Messages taken in, by door (kafka, push, poll, replay).",
        "warden_events_total": "Messages finished, by outcome (processed, duplicate, invalid, failed, pending).",
        "warden_events_resumed_total": "Events whose pending steps were resumed from the ledger at start.",
        "warden_resume_failures_total": "Events that could not be resumed from the ledger.",
        "warden_verify_failures_total": "Tokens refused, by RFC 8935 error code.",
        "warden_verify_seconds": "Time to verify one token.",
        "warden_steps_total": "Steps answered, by kind and result (done, retry, failed).",
        "warden_step_record_seconds": "From a target's answer to the step's outcome being durable in the ledger.",
        "warden_dead_letters_total": "Messages dead-lettered.",
        "warden_permanent_failures_total": "Failures no retry can mend, by reason.",
        "warden_retries_total": "Retries, by reason.",
        "warden_unknown_event_types_total": "Events of types no policy names.",
        "warden_waiting_for_keys": "Messages set aside while their issuer's keys cannot be had.",
        "warden_kafka_committed_offset": "Offset the cluster last confirmed committed, by topic and partition.",
        "warden_kafka_commit_failures_total": "Offset commits that failed, one per partition of each (retried next round).",
        "warden_kafka_in_flight": "Messages fetched and not finished, by topic and partition.",
        "warden_kafka_consumer_lag": "High watermark minus committed offset, by topic and partition.",
        "warden_keys_age_seconds": "Seconds since the issuer's keys were last fetched.",
        "warden_push_requests_total": "Push requests answered, by HTTP status.",
        "warden_push_refusals_not_kept_total": "Push requests refused past their address's budget of refusals kept in the ledger: answered 400, not kept.",
        "warden_push_bytes_total": "Bytes of pushed bodies taken.",
        "warden_push_produce_failures_total": "Pushed SETs Kafka did not confirm.",
        "warden_poll_requests_total": "Poll requests made, by issuer and result.",
        "warden_ledger_pruned_total": "Rows dropped by ledger retention, by what (events, rejections, audit_records).",
        "warden_event_to_done_seconds": "From an event's arrival to its last step done.",
        "warden_step_duration_seconds": "From a step's call to its target's answer, by kind.",
        "warden_circuit_breaker_open": "1 while the target rests behind its open circuit breaker, 0 otherwise.",
        "warden_jwks_fetches_total": "Key set fetches, by issuer and result (ok, error).",
        "warden_stream_status": "1 for the stream's current status at its transmitter, 0 for the others.",
    ]

    /// The exposition text with a `# HELP` line before each `# TYPE` line that has none.
    static func annotate(_ text: [UInt8]) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(text.count + 2048)
        var previous: Substring = ""
        for line in String(decoding: text, as: UTF8.self).split(separator: "\n", omittingEmptySubsequences: false) {
            if line.hasPrefix("# TYPE "), !previous.hasPrefix("# HELP ") {
                let name = line.dropFirst("# TYPE ".count).prefix { $0 != " " }
                if let help = texts[String(name)] { out += Array("# HELP \(name) \(help)\n".utf8) }
            }
            out += Array(line.utf8)
            out.append(10)
            previous = line
        }
        if !out.isEmpty { out.removeLast() }  // the split's last piece had no line end after it
        return out
    }
}
