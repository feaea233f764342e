public import CoreMetrics
import Synchronization

/// The metrics operators' dashboards rely on, made from an injected factory (never the global
/// one). Names follow DESIGN.md.
public final class WardenMetrics: Sendable {
    let factory: any MetricsFactory
    private let counters = MetricCache<Counter>()
    private let gauges = MetricCache<Gauge>()
    private let timers = MetricCache<Timer>()
    /// From an event's arrival to its last step done.
    let eventToDone: Timer
    let verifySeconds: Timer
    /// From a target's answer to a step until its outcome is durable in the ledger.
    let stepRecordSeconds: Timer
    // The per-event ones, made once.
    private let receivedFromKafka: Counter
    private let outcomes: [String: Counter]
    private let deadLetters: Counter
    /// Messages waiting and when one was last finished, for `/healthz`.
    public let progress = IntakeProgress()
    // The per-step ones, by their label values: looked up for every step answered without an
    // array of labels built for the lookup.
    private let stepCounters = LabelledMetrics<StepLabels, Counter>()
    private let stepTimers = LabelledMetrics<String, Timer>()
    private let breakerGauges = LabelledMetrics<String, Gauge>()

    private struct StepLabels: Hashable {
        var kind: String
        var result: String
    }

    public init(factory: any MetricsFactory) {
        self.factory = factory
        self.verifySeconds = Timer(label: "warden_verify_seconds", dimensions: [], factory: factory)
        self.stepRecordSeconds = Timer(label: "warden_step_record_seconds", dimensions: [], factory: factory)
        self.eventToDone = Timer(label: "warden_event_to_done_seconds", dimensions: [], factory: factory)
        self.receivedFromKafka = Counter(label: "warden_events_received_total", dimensions: [("source", "kafka")], factory: factory)
        self.outcomes = Dictionary(uniqueKeysWithValues: ["pending", "processed", "duplicate", "invalid", "failed"].map {
            ($0, Counter(label: "warden_events_total", dimensions: [("outcome", $0)], factory: factory))
        })
        self.deadLetters = Counter(label: "warden_dead_letters_total", dimensions: [], factory: factory)
    }

    /// Buckets for `warden_step_record_seconds`, around the promise that an outcome is
    /// durable within 20 ms of the target's answer.
    public static let stepRecordBuckets: [Duration] = [1, 2, 5, 10, 20, 50, 100, 250, 1000].map { .milliseconds($0) }

    public func counter(_ name: String, _ dimensions: [(String, String)] = []) -> Counter {
        counters.get(name, dimensions) { Counter(label: name, dimensions: dimensions, factory: factory) }
    }

    func timer(_ name: String, _ dimensions: [(String, String)]) -> Timer {
        timers.get(name, dimensions) { Timer(label: name, dimensions: dimensions, factory: factory) }
    }

    /// Buckets for `warden_event_to_done_seconds` and `warden_step_duration_seconds`: from a
    /// few milliseconds to half an hour (a target resting behind its breaker, retries).
    public static let latencyBuckets: [Duration] = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 300_000, 1_800_000]
        .map { .milliseconds($0) }

    func gauge(_ name: String, _ dimensions: [(String, String)]) -> Gauge {
        gauges.get(name, dimensions) { Gauge(label: name, dimensions: dimensions, factory: factory) }
    }

    /// Stops exporting a gauge (of a partition no longer read here): a frozen value would read
    /// as current.
    func dropGauge(_ name: String, _ dimensions: [(String, String)]) {
        gauges.remove(name, dimensions)?.destroy()
    }

    public func received(source: String, count: Int = 1) {
        (source == "kafka" ? receivedFromKafka : counter("warden_events_received_total", [("source", source)])).increment(by: count)
    }
    func outcome(_ outcome: String, count: Int = 1) {
        (outcomes[outcome] ?? counter("warden_events_total", [("outcome", outcome)])).increment(by: count)
    }
    func verifyFailure(_ code: String) { counter("warden_verify_failures_total", [("err", code)]).increment() }
    public func deadLettered() { deadLetters.increment() }

    /// `warden_stream_status{issuer,status}`: 1 for the stream's current status, 0 for the others.
    /// A status other than enabled, paused or disabled (a transmitter's own word) is `other`:
    /// a label value a sender chooses would make a new series every time.
    func streamStatus(issuer: String, status: String) {
        let status = ["enabled", "paused", "disabled"].contains(status) ? status : "other"
        for known in ["enabled", "paused", "disabled", "other"] {
            gauge("warden_stream_status", [("issuer", issuer), ("status", known)]).record(known == status ? 1 : 0)
        }
    }
    func step(kind: String, result: String) {
        stepCounters.get(StepLabels(kind: kind, result: result)) {
            Counter(label: "warden_steps_total", dimensions: [("kind", kind), ("result", result)], factory: factory)
        }.increment()
    }
    /// `warden_step_duration_seconds{kind}`.
    func stepDuration(kind: String) -> Timer {
        stepTimers.get(kind) { Timer(label: "warden_step_duration_seconds", dimensions: [("kind", kind)], factory: factory) }
    }
    /// `warden_circuit_breaker_open{target}`.
    func breakerOpen(target: String) -> Gauge {
        breakerGauges.get(target) { Gauge(label: "warden_circuit_breaker_open", dimensions: [("target", target)], factory: factory) }
    }
    /// Push requests answered, by status (`warden_push_requests_total{status}`).
    func pushAnswered(_ status: Int) { counter("warden_push_requests_total", [("status", "\(status)")]).increment() }
    /// Bytes of pushed bodies taken (`warden_push_bytes_total`).
    func pushBytes(_ count: Int) { counter("warden_push_bytes_total").increment(by: count) }
    /// `warden_jwks_fetches_total{issuer,result}` brought up to the key cache's own counts
    /// (this adds what is new since the last call).
    public func jwksFetches(issuer: String, successes ok: Int, failures: Int) {
        let (newOK, newErrors) = jwksSeen.withLock { seen -> (Int, Int) in
            let before = seen[issuer] ?? (0, 0)
            seen[issuer] = (max(ok, before.0), max(failures, before.1))
            return (max(0, ok - before.0), max(0, failures - before.1))
        }
        let ok = counter("warden_jwks_fetches_total", [("issuer", issuer), ("result", "ok")])
        let error = counter("warden_jwks_fetches_total", [("issuer", issuer), ("result", "error")])
        if newOK > 0 { ok.increment(by: newOK) }
        if newErrors > 0 { error.increment(by: newErrors) }
    }
    private let jwksSeen = Mutex<[String: (Int, Int)]>([:])

    /// `warden_build_info{version} 1`.
    public func buildInfo(version: String) { gauge("warden_build_info", [("version", version)]).record(1) }
    /// `warden_keys_age_seconds{issuer}`: since the issuer's keys were last fetched.
    public func keysAge(issuer: String, seconds: Double) { gauge("warden_keys_age_seconds", [("issuer", issuer)]).record(seconds) }
    public func retried(_ reason: String) { counter("warden_retries_total", [("reason", reason)]).increment() }
}

/// Metrics made once per name and labels, looked up without building a key text.
final class MetricCache<Metric: Sendable>: Sendable {
    private struct Key: Hashable {
        var name: String
        /// Label names and values, in turn.
        var labels: [String]
    }

    private let made = LabelledMetrics<Key, Metric>()

    private static func key(_ name: String, _ dimensions: [(String, String)]) -> Key {
        var labels: [String] = []
        labels.reserveCapacity(dimensions.count * 2)
        for (label, value) in dimensions { labels += [label, value] }
        return Key(name: name, labels: labels)
    }

    /// The metric, forgotten: the next `get` makes a new one.
    func remove(_ name: String, _ dimensions: [(String, String)]) -> Metric? { made.remove(Self.key(name, dimensions)) }

    func get(_ name: String, _ dimensions: [(String, String)], make: () -> Metric) -> Metric {
        made.get(Self.key(name, dimensions), make: make)
    }
}

/// Metrics made once per key: for one metric, its label values (`Labels`).
final class LabelledMetrics<Labels: Hashable & Sendable, Metric: Sendable>: Sendable {
    private let made = Mutex<[Labels: Metric]>([:])

    func get(_ labels: Labels, make: () -> Metric) -> Metric {
        made.withLock { cache in
            if let metric = cache[labels] { return metric }
            let metric = make()
            cache[labels] = metric
            return metric
        }
    }

    /// The metric, forgotten: the next `get` makes a new one.
    func remove(_ labels: Labels) -> Metric? { made.withLock { $0.removeValue(forKey: labels) } }
}

extension Timer {
    /// Records the time elapsed since `start`.
    func recordElapsed(since start: ContinuousClock.Instant) { record(ContinuousClock.now - start) }

    func record(_ duration: Duration) {
        let parts = duration.components
        recordNanoseconds(max(0, parts.seconds * 1_000_000_000 + parts.attoseconds / 1_000_000_000))
    }
}
