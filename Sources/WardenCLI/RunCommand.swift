public import ArgumentParser
import AsyncHTTPClient
import HTTPExchange
import Foundation
import Invalidation
import Kafka
import Ledger
import Logging
import Metrics
import Pipeline
import Prometheus
import Hummingbird
import ServiceLifecycle
import Synchronization
import StreamManagement
import TokenVerification

extension WardenCommand {
    public struct Run: AsyncParsableCommand {
        public static let configuration = CommandConfiguration(
            abstract: "Runs the worker: consumes SETs from Kafka, verifies, de-duplicates and records them.",
            discussion: """
            Serves /healthz, /readyz and /metrics on http.listen (default 127.0.0.1:9464). \
            With kafka.brokers: embedded, starts librdkafka's in-process mock cluster and prints its address. \
            SIGTERM or SIGINT: stop fetching, finish in-flight events, commit, exit 0.
            """
        )

        @Option(name: .long, help: ArgumentHelp("The configuration file (YAML); default: WARDEN_CONFIG.", valueName: "file"))
        var config: String = WardenConfiguration.environmentConfigPath

        public init() {}

        public func run() async throws {
            let configuration: WardenConfiguration
            do {
                configuration = try WardenConfiguration.load(path: config)
                guard configuration.kafka != nil || configuration.receiver != nil || !configuration.pollStreams.isEmpty else {
                    throw ConfigError(path: "kafka", "or receiver, or a stream polled (delivery: {method: poll}), is required by warden run (where SETs come from)")
                }
                guard configuration.ledger != nil else { throw ConfigError(path: "ledger", "is required by warden run (e.g. sqlite:///var/lib/warden/ledger.sqlite)") }
                try configuration.kafka?.checkClients(pushing: configuration.isPushing)
            } catch {
                standardError("warden: \(error)\n")
                throw ExitCode(VerifyExit.usage.rawValue)
            }
            JSONLogHandler.bootstrap(level: configuration.logLevel)
            let logger = Logger(label: "warden")
            logger.info("starting", metadata: ["warden.version": "\(WardenVersion.current)",
                                               "warden.config": "\(URL(fileURLWithPath: config).standardizedFileURL.path)",
                                               "warden.outbound": "\(configuration.outboundRoute)"])
            do {
                try await Worker(configuration: configuration, configPath: config, logger: logger).run()
            } catch let error as ConfigError {
                logger.critical("configuration refused", metadata: ["warden.reason": "\(error)"])
                throw ExitCode(VerifyExit.usage.rawValue)
            } catch {
                logger.critical("warden run stopped", metadata: ["warden.reason": "\(error)"])
                throw ExitCode(1)
            }
        }
    }
}

/// The worker's parts, wired into one service group.
struct Worker {
    let configuration: WardenConfiguration
    /// Read again on SIGHUP.
    let configPath: String
    let logger: Logger

    func run() async throws {
        // A SIGHUP while starting (the embedded cluster, the ledger) is ignored rather than
        // ending the process: the reload service takes the signal once it runs.
        signal(SIGHUP, SIG_IGN)
        var cluster: EmbeddedKafkaCluster? = nil
        var brokers = configuration.kafka?.brokers ?? ""
        if let kafka = configuration.kafka, kafka.isEmbedded {
            let created = try EmbeddedKafkaCluster(
                topics: [(kafka.topic, kafka.embeddedPartitions), (kafka.deadLetterTopic, kafka.embeddedPartitions)],
                logger: logger)
            brokers = created.bootstrapServers
            cluster = created
            announce("embedded Kafka cluster: \(brokers) (topic \(kafka.topic), \(kafka.embeddedPartitions) partitions; dead letters: \(kafka.deadLetterTopic))")
        }
        // The cluster lives as long as this function.
        defer { withExtendedLifetime(cluster) {} }

        let ledger: any AuditingLedger
        // A PostgreSQL ledger's pool runs in the service group; the intake starts once it is migrated.
        var ledgerService: Background? = nil
        var openLedger: @Sendable () async throws -> Void = {}
        switch configuration.ledger! {
        case .sqlite(let path):
            ledger = try SQLiteLedger(path: path)
            announce("ledger: sqlite \(path)")
            if !SQLiteLedger.pageCacheInstalled {
                logger.warning("SQLite was initialised before Warden's page cache was installed: after a swap of two pages' numbers, the ledger's commits walk every page of its cache")
            }
        case .postgres(let location):
            let postgres = PostgresLedger(location, logger: logger)
            ledger = postgres
            ledgerService = Background { await postgres.run() }
            openLedger = { try await postgres.open() }
            announce("ledger: \(location)")
        }
        let client = configuration.makeHTTPClient()
        let group: ServiceGroup
        do {
            group = try makeGroup(ledger: ledger, ledgerService: ledgerService, openLedger: openLedger, brokers: brokers, client: client)
        } catch {
            // Whatever refused to start (a Kafka property, a target), the HTTP client is shut
            // down before it is released, and the ledger closed: the error is what is reported.
            try? await client.shutdown()
            await ledger.close()
            throw error
        }
        try await group.run()
        logger.info("stopped")
    }

    /// The worker's services; throws, starting nothing, when a part refuses its settings.
    private func makeGroup(ledger: any AuditingLedger, ledgerService: Background?, openLedger: @escaping @Sendable () async throws -> Void,
                           brokers: String, client: OutboundHTTP) throws -> ServiceGroup {
        // Every key fetched is kept in the ledger's archive, for replays after the issuer removes it.
        let verifier = configuration.makeVerifier(client: client, logger: logger, archive: LedgerKeyArchive(ledger: ledger, logger: logger))
        let registry = PrometheusCollectorRegistry()
        var factory = PrometheusMetricsFactory(registry: registry)
        factory.durationHistogramBuckets["warden_step_record_seconds"] = WardenMetrics.stepRecordBuckets
        factory.durationHistogramBuckets["warden_event_to_done_seconds"] = WardenMetrics.latencyBuckets
        factory.durationHistogramBuckets["warden_step_duration_seconds"] = WardenMetrics.latencyBuckets
        let metrics = WardenMetrics(factory: factory)
        metrics.buildInfo(version: WardenVersion.current)

        // The doors: a Kafka topic, and the push receiver — onto the topic with kafka, into the
        // ledger alone without.
        let intake: any Service
        var intakeChecks: [HealthServer.Check] = []
        var closers: [ServiceGroupConfiguration.ServiceConfiguration] = []
        let destination: (any PushDestination)?
        let processor: EventProcessor
        // The targets' connections, replaced by SIGHUP when their settings or credentials change.
        let targets = ReloadableTargets(try configuration.invalidation.makeTargets(http: client, logger: logger))
        let engine = InvalidationEngine(planner: Planner(policy: configuration.invalidation.policy), resolver: targets, executor: targets)
        if let kafka = configuration.kafka {
            let producer = try KafkaProducer(bootstrapServers: brokers, properties: kafka.deadLetterProperties, logger: logger)
            let consumer = try KafkaConsumer(configuration: kafka.consumerConfiguration(brokers: brokers), logger: logger)
            processor = EventProcessor(verifier: verifier, ledger: ledger,
                                           deadLetters: KafkaDeadLetters(producer: producer, topic: kafka.deadLetterTopic),
                                           metrics: metrics, logger: logger, stop: StopSignal(), engine: engine,
                                           configuration: .init(parallelism: kafka.concurrency))
            intake = KafkaIntake(consumer: consumer, processor: processor, maximumKeyWait: .seconds(kafka.maximumKeyWait),
                                 metrics: metrics, logger: logger, arrivalWindow: KafkaIntake.arrivalWindow(retention: configuration.ledgerRetention, issuers: configuration.issuers))
            intakeChecks = [.init("kafka") { consumer.hasJoinedGroup }, .init("dead-letters") { producer.fatalError == nil }]
            closers = [ProducerService.configuration(producer, "the dead-letter producer")]
            if configuration.isPushing {
                // A producer of its own for pushed SETs (see `KafkaSettings.pushProperties`).
                let pushProducer = try KafkaProducer(bootstrapServers: brokers, properties: kafka.pushProperties, logger: logger)
                destination = KafkaPushDestination(processor: processor, producer: pushProducer, topic: kafka.topic)
                intakeChecks.append(.init("push-producer") { pushProducer.fatalError == nil })
                closers.append(ProducerService.configuration(pushProducer, "the producer of pushed SETs"))
            } else {
                destination = nil
            }
        } else {
            // A refused SET is answered 400 to its sender and kept in the ledger as a rejection:
            // there is no dead-letter topic without Kafka.
            processor = EventProcessor(verifier: verifier, ledger: ledger, deadLetters: LedgerOnlyDeadLetters(),
                                           metrics: metrics, logger: logger, stop: StopSignal(), engine: engine)
            let ledgerDestination = LedgerPushDestination()
            intake = PushIntake(destination: ledgerDestination, pipeline: EventPipeline(processor: processor))
            destination = ledgerDestination
        }
        var pollServices: [any Service] = []
        if let destination {
            for stream in configuration.pollStreams {
                pollServices.append(PollService(stream: stream, client: client, ledger: ledger, destination: destination,
                                                metrics: metrics, logger: logger))
                announce("polling: \(stream.issuer) (\(stream.settings.api.rawValue) stream)")
            }
        }
        var receiverService: (any Service)? = nil
        var receiverRoutes: (Router<WardenRequestContext>) -> Void = { _ in }
        // When the receiver shares the health server's address: it listens when that one does.
        var onSharedListening: @Sendable () -> Void = {}
        var sharedReceiverIdleTimeout: Double? = nil
        var sharedReceiverConnections: Int? = nil
        if let settings = configuration.receiver, let destination {
            let receiver = PushReceiver(
                settings: .init(host: settings.host, port: settings.port, path: settings.path, bearerTokens: settings.bearerTokens,
                                maximumBodyBytes: settings.maximumBodyBytes, rateLimit: settings.rateLimit,
                                idleTimeout: settings.idleTimeout, maximumConnections: settings.maximumConnections),
                destination: destination, metrics: metrics, logger: logger, judge: processor)
            let listening = ListeningFlag()
            intakeChecks.append(.init("receiver") { listening.isListening })
            let summary = "(POST \(settings.path)\(settings.bearerTokens.isEmpty ? "" : ", bearer tokens: \(settings.bearerTokens.count)")"
                + (configuration.kafka.map { ", onto topic \($0.topic)" } ?? ", into the ledger") + ")"
            if settings.host == configuration.http.host, settings.port == configuration.http.port, settings.port != 0 {
                receiverRoutes = receiver.addRoutes
                sharedReceiverIdleTimeout = settings.idleTimeout
                sharedReceiverConnections = settings.maximumConnections
                onSharedListening = {
                    listening.listened = true
                    announce("receiver: \(settings.host):\(settings.port) \(summary), with /healthz, /readyz and /metrics")
                }
            } else {
                receiverService = receiver.service { port in
                    listening.listened = true
                    announce("receiver: \(settings.host):\(port) \(summary)")
                }
            }
        }
        for target in configuration.invalidation.targets.keys.sorted() {
            announce("target \(target): \(configuration.invalidation.targets[target]!.summary)")
        }
        // One warning for all of them: without a sessions target, events are recorded but no
        // session is ended. `warden check-config` lists every step left out.
        let sessionSteps = configuration.invalidation.leftOut.filter { $0.rule.action.targets.contains(Policy.sessionsTarget) }
        if !sessionSteps.isEmpty {
            logger.warning("no redis target named sessions: built-in steps that end sessions are left out (warden check-config lists them)", metadata: [
                "warden.steps": "\(sessionSteps.count)",
                "warden.event_types": "\(Set(sessionSteps.map { InvalidationConfiguration.shortName($0.eventType) }).sorted().joined(separator: ","))",
            ])
        }
        let issuers = verifier.configuredIssuers
        let health = HealthServer(
            host: configuration.http.host, port: configuration.http.port,
            checks: [.init("keys") { issuers.allSatisfy { $0.keys.currentSnapshot() != nil } }] + intakeChecks
                + [.init("ledger") { await ledger.isReachable() }],
            metricsText: {
                let now = Date().timeIntervalSince1970
                for issuer in issuers {
                    metrics.jwksFetches(issuer: issuer.policy.issuer, successes: issuer.keys.successCount, failures: issuer.keys.failureCount)
                    // Pinned keys (fetchedAt 0) are never fetched: no age to show.
                    if let snapshot = issuer.keys.currentSnapshot(), snapshot.fetchedAt > 0 {
                        metrics.keysAge(issuer: issuer.policy.issuer, seconds: max(0, now - snapshot.fetchedAt))
                    }
                }
                return MetricHelp.annotate(registry.emitToBuffer())
            },
            liveness: { [stallTimeout = configuration.http.stallTimeout] in metrics.progress.stall(after: stallTimeout) },
            // Sharing its address, the receiver's idle timeout is this server's.
            idleTimeout: sharedReceiverIdleTimeout ?? PushReceiver.Settings.defaultIdleTimeout,
            maximumConnections: sharedReceiverConnections ?? HealthServer.defaultMaximumConnections)
        let http = health.service(logger: logger, routes: receiverRoutes) { [onSharedListening] port in
            announce("http: \(configuration.http.host):\(port) (/healthz, /readyz, /metrics)")
            onSharedListening()
        }

        // Shut down in reverse order: intake first, the ledger last. Connection pools run as
        // services of their own, and end when the group reaches them.
        let pools: [ServiceGroupConfiguration.ServiceConfiguration] =
            ([ledgerService].compactMap { $0 } + [Background { await cancelWhenGracefulShutdown { await targets.run() } }])
            .map { .init(service: $0, successTerminationBehavior: .ignore) }
        return ServiceGroup(configuration: .init(
            services: pools + [
                .init(service: CloseOnShutdown { await ledger.close() }),
            ] + closers + [
                .init(service: CloseOnShutdown { try? await client.shutdown() }),
                .init(service: KeyPreload(issuers: issuers, logger: logger)),
                .init(service: ConfigurationReload(
                    path: configPath, running: configuration, planner: engine.planner, logger: logger,
                    targets: .init(reloadable: targets) { [client, logger] fresh throws(ConfigError) in
                        try fresh.makeTargets(http: client, logger: logger)
                    })),
            ] + (configuration.ledgerRetention.map { retention in
                [.init(service: Prepared(prepare: openLedger,
                                         service: LedgerPruner(ledger: ledger, retention: retention, metrics: metrics, logger: logger)))]
            } ?? []) + [
                .init(service: http),
                .init(service: Prepared(prepare: openLedger, service: intake), successTerminationBehavior: .gracefullyShutdownGroup,
                      failureTerminationBehavior: .gracefullyShutdownGroup),
                // Last, so it stops first: it answers the requests under way while the intake
                // behind it still runs.
            ] + (pollServices + [receiverService].compactMap { $0 }).map { .init(service: $0) },
            gracefulShutdownSignals: [.sigterm, .sigint],
            logger: logger))
    }
}

/// Whether the push receiver is taking requests (for `/readyz`).
final class ListeningFlag: Sendable {
    private let flag = Atomic<Bool>(false)
    var isListening: Bool { flag.load(ordering: .acquiring) }
    var listened: Bool {
        get { isListening }
        set { flag.store(newValue, ordering: .releasing) }
    }
}

/// Prints one line for people and scripts (the embedded cluster's address, the HTTP port).
func announce(_ line: String) {
    FileHandle.standardOutput.write(Data(("warden: " + line + "\n").utf8))
}

/// Runs `body` as a service: a connection pool that runs until the group shuts down.
struct Background: Service {
    let body: @Sendable () async -> Void
    init(_ body: @escaping @Sendable () async -> Void) { self.body = body }
    func run() async { await body() }
}

/// Runs `service` once `prepare` succeeded (a ledger migrated); a failure of `prepare` is the
/// service's.
struct Prepared: Service {
    let prepare: @Sendable () async throws -> Void
    let service: any Service
    func run() async throws {
        // A preparation that does not end (a ledger whose server takes connections and never
        // answers) ends on graceful shutdown, and the service then never starts.
        do {
            try await cancelWhenGracefulShutdown { try await prepare() }
        } catch where Task.isShuttingDownGracefully {
            return
        }
        try await service.run()
    }
}

/// Runs `close` when the group shuts down.
struct CloseOnShutdown: Service {
    let close: @Sendable () async -> Void
    init(_ close: @escaping @Sendable () async -> Void) { self.close = close }

    func run() async throws {
        try? await gracefulShutdown()
        await close()
    }
}

/// Closes a producer when the group shuts down. A fatal error of the producer (an idempotent
/// producer whose sequence the cluster lost: it can never send again) fails the service, and
/// the group shuts down gracefully: in-flight events finish, what could not be dead-lettered or
/// produced stays uncommitted (read again after the restart), and `warden run` exits 1 for its
/// supervisor to start a fresh process — rather than run on, unable to dead-letter or take a
/// push.
struct ProducerService: Service {
    let producer: KafkaProducer
    let name: String

    static func configuration(_ producer: KafkaProducer, _ name: String) -> ServiceGroupConfiguration.ServiceConfiguration {
        .init(service: ProducerService(producer: producer, name: name), failureTerminationBehavior: .gracefullyShutdownGroup)
    }

    func run() async throws {
        let failure = await cancelWhenGracefulShutdown { await producer.failure() }
        producer.close()
        // Failed while the group was shutting down: still not a clean exit.
        if let failure = failure ?? producer.fatalError { throw KafkaError(.fatal, "\(name) failed: \(failure)") }
    }
}

/// Loads every issuer's keys at start, so readiness reflects them before the first event.
struct KeyPreload: Service {
    let issuers: [SETVerifier.Issuer]
    let logger: Logger

    func run() async throws {
        for issuer in issuers {
            if case .unavailable(let reason) = await issuer.keys.keys() {
                logger.warning("issuer keys not loaded yet", metadata: ["warden.iss": "\(issuer.policy.issuer)", "warden.reason": "\(reason)"])
            }
        }
        try? await gracefulShutdown()
    }
}

/// The RFC 8936 poll door for one issuer's stream (`delivery: {method: poll}`): polls its
/// transmitter and hands each SET to the same destination as a pushed one (the ledger, or the
/// Kafka topic). On graceful shutdown the long poll under way is cancelled and what was persisted
/// is acknowledged in one last request.
struct PollService: Service {
    let stream: StreamConfiguration
    let client: any HTTPExchanging
    let ledger: any Ledger
    let destination: any PushDestination
    let metrics: WardenMetrics
    let logger: Logger

    func run() async {
        let credentials = stream.makeCredentials(http: client)
        let poller = Mutex<PollClient?>(nil)
        await cancelWhenGracefulShutdown {
            guard let endpoint = await resolveEndpoint() else { return }
            logger.info("polling the stream", metadata: ["warden.iss": "\(stream.issuer)", "warden.endpoint": "\(endpoint)"])
            let issuer = stream.issuer, metrics = self.metrics, destination = self.destination
            let client = PollClient(
                settings: .init(endpoint: endpoint), credentials: credentials, http: self.client, logger: logger,
                observe: { status in metrics.counter("warden_poll_requests_total", [("issuer", issuer), ("status", status)]).increment() }
            ) { tokens in
                metrics.received(source: "poll", count: tokens.count)
                let now = Date().timeIntervalSince1970
                // A SET must come from the stream's own issuer (SSF): another's is refused.
                let messages = tokens.map { token in
                    var message = IntakeMessage(value: token, source: "poll", receivedAt: now)
                    message.expectedIssuer = issuer
                    return message
                }
                return await destination.persist(all: messages).map {
                    switch $0 {
                    case .accepted: .persisted
                    case .refused(let code): .refused(code: code, description: PushReceiver.publicDescription(code))
                    case .unavailable: .notNow
                    }
                }
            }
            poller.withLock { $0 = client }
            await client.poll()
        }
        await poller.withLock { $0 }?.flush()
    }

    /// The poll endpoint: configured, or the one the transmitter gave the stream (asked again
    /// after a failure, until it answers or the process stops).
    private func resolveEndpoint() async -> String? {
        if case .poll(let configured?)? = stream.settings.delivery { return configured }
        let manager = WardenCommand.Stream.manager(stream, client: client, ledger: ledger, timeout: 30)
        while !Task.isCancelled {
            do {
                guard let ssf = manager as? SSFStream else { return nil }
                return try await ssf.pollEndpoint()
            } catch where !error.isRetryable && error.kind != .refused {
                // Settings that cannot work (no stream id, an endpoint that is not https): said
                // once, not retried for ever.
                logger.critical("this stream cannot be polled; fix its configuration", metadata: [
                    "warden.iss": "\(stream.issuer)", "warden.reason": "\(error)",
                ])
                metrics.counter("warden_permanent_failures_total", [("what", "poll")]).increment()
                return nil
            } catch {
                logger.warning("cannot find the stream's poll endpoint; will retry", metadata: [
                    "warden.iss": "\(stream.issuer)", "warden.reason": "\(error)",
                ])
                try? await Task.sleep(for: .seconds(5))
            }
        }
        return nil
    }
}
