// swift-tools-version:6.1
import PackageDescription

let strict: [SwiftSetting] = [
    .enableUpcomingFeature("ExistentialAny"),
    .enableUpcomingFeature("InternalImportsByDefault"),
]

let testSettings: [SwiftSetting] = [.enableUpcomingFeature("ExistentialAny")]

let package = Package(
    name: "warden",
    platforms: [.macOS(.v15)],
    products: [
        .executable(name: "warden", targets: ["warden"]),
        .library(name: "SecurityEvents", targets: ["SecurityEvents"]),
        .library(name: "TokenVerification", targets: ["TokenVerification"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.8.2"),
        .package(url: "https://github.com/apple/swift-log", from: "1.16.2"),
        .package(url: "https://github.com/apple/swift-crypto", from: "4.0.0"),
        .package(url: "https://github.com/apple/swift-nio", from: "2.101.3"),
        .package(url: "https://github.com/apple/swift-nio-ssl", from: "2.37.6"),
        .package(url: "https://github.com/swift-server/async-http-client", from: "1.37.0"),
        .package(url: "https://github.com/jpsim/Yams", from: "6.2.2"),
        .package(url: "https://github.com/hummingbird-project/hummingbird", from: "2.28.1"),
        .package(url: "https://github.com/apple/swift-http-types", from: "1.8.0"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle", from: "2.13.0"),
        .package(url: "https://github.com/apple/swift-metrics", from: "2.13.0"),
        .package(url: "https://github.com/swift-server/swift-prometheus", from: "2.4.1"),
        .package(url: "https://github.com/groue/GRDB.swift", from: "7.10.0"),
        .package(url: "https://github.com/vapor/postgres-nio", from: "1.33.2"),
    ],
    targets: [
        // Thin C layer over Debian's OpenSSL libcrypto: public keys from JWK members and
        // signature checks, with the RSA public operation on AVX-512 IFMA where the CPU has it
        // (functions with a target attribute, chosen at run time). Everything above it is Swift.
        .target(
            name: "CWardenCrypto",
            linkerSettings: [.linkedLibrary("crypto")]
        ),
        // Linux file calls Swift's Glibc module does not declare, and the SQLite VFS that
        // gathers the ledger writer's WAL writes into one per commit.
        .target(name: "CWardenFiles", linkerSettings: [.linkedLibrary("sqlite3")]),
        .target(
            name: "SecurityEvents",
            dependencies: [.product(name: "Crypto", package: "swift-crypto")],
            swiftSettings: strict
        ),
        // One HTTP request and its whole answer under one deadline, for every outgoing call.
        .target(
            name: "HTTPExchange",
            dependencies: [
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ],
            swiftSettings: strict
        ),
        .target(
            name: "TokenVerification",
            dependencies: [
                "SecurityEvents",
                "CWardenCrypto",
                "HTTPExchange",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ],
            swiftSettings: strict
        ),
        // Debian's librdkafka-dev: the client and its in-process mock cluster.
        .systemLibrary(
            name: "CRdkafka",
            pkgConfig: "rdkafka",
            providers: [.apt(["librdkafka-dev"])]
        ),
        // A thin Swift layer over librdkafka. Knows nothing about security events.
        .target(
            name: "Kafka",
            dependencies: ["CRdkafka", .product(name: "Logging", package: "swift-log")],
            swiftSettings: strict
        ),
        // Database URLs, parsed once for the ledger and for SQL targets.
        .target(
            name: "DatabaseLocations",
            dependencies: [
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: strict
        ),
        // Durable state: de-duplication claims, event records, outcomes.
        .target(
            name: "Ledger",
            dependencies: [
                "SecurityEvents", "DatabaseLocations", "CWardenFiles",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "GRDBSQLite", package: "GRDB.swift"),
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: strict
        ),
        // One Redis client on SwiftNIO (pool, pipelining, AUTH, database, reconnect, TLS by
        // swift-nio-ssl). Knows nothing about security events.
        .target(
            name: "Redis",
            dependencies: [
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
            ],
            swiftSettings: strict
        ),
        // Policy (event type → steps), the pure planner, and the executors that act on targets.
        .target(
            name: "Invalidation",
            dependencies: [
                "SecurityEvents", "Redis", "DatabaseLocations", "HTTPExchange",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: strict
        ),
        // Intake → verify → claim → record → commit, with metrics and health endpoints.
        .target(
            name: "Pipeline",
            dependencies: [
                "Kafka", "Ledger", "SecurityEvents", "TokenVerification", "Invalidation",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdCore", package: "hummingbird"),
                .product(name: "NIOCore", package: "swift-nio"),
            ],
            swiftSettings: strict
        ),
        // Managing an issuer's stream at its transmitter (Google's RISC API, SSF 1.0) and the
        // credentials those calls carry.
        .target(
            name: "StreamManagement",
            dependencies: [
                "SecurityEvents", "SETMinting", "HTTPExchange",
                .product(name: "_CryptoExtras", package: "swift-crypto"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ],
            swiftSettings: strict
        ),
        // Debian's zlib1g-dev: gzip logs read by warden replay, streamed.
        .systemLibrary(
            name: "CZlib",
            providers: [.apt(["zlib1g-dev"])]
        ),
        .target(
            name: "WardenCLI",
            dependencies: [
                "CZlib",
                "SecurityEvents",
                "TokenVerification",
                "Kafka", "Ledger", "Pipeline", "Invalidation", "Redis", "StreamManagement", "SETMinting", "HTTPExchange",
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "Yams", package: "Yams"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
            ],
            swiftSettings: strict
        ),
        .executableTarget(
            name: "warden",
            dependencies: ["WardenCLI"],
            swiftSettings: strict,
            // jemalloc (Debian's libjemalloc-dev) replaces glibc's malloc in the binary: the
            // pipeline allocates on the verifying threads and frees on the ledger's, and glibc's
            // arena locks then cost more than a tenth of the worker's CPU (make bench-pipeline).
            linkerSettings: [.linkedLibrary("jemalloc", .when(platforms: [.linux]))]
        ),
        // Signing side used by tests and benchmarks: throwaway keys, JWKS documents, SETs.
        .target(
            name: "SETMinting",
            dependencies: [
                "SecurityEvents",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "_CryptoExtras", package: "swift-crypto"),
            ],
            swiftSettings: strict
        ),
        // A real HTTP server for tests: serves discovery and JWKS documents, counts requests.
        .target(
            name: "WardenTestSupport",
            dependencies: [
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HTTPTypes", package: "swift-http-types"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strict
        ),
        // The operation openssl speed rsa2048 times, for interleaved comparison in benchmarks.
        .target(
            name: "CBenchReference",
            path: "Benchmarks/CBenchReference",
            linkerSettings: [.linkedLibrary("crypto")]
        ),
        .executableTarget(
            name: "VerifyBenchmark",
            dependencies: ["TokenVerification", "SETMinting", "SecurityEvents", "CBenchReference"],
            path: "Benchmarks/VerifyBenchmark",
            swiftSettings: strict
        ),
        .executableTarget(
            name: "PushBenchmark",
            dependencies: ["SETMinting"],
            path: "Benchmarks/PushBenchmark",
            swiftSettings: strict
        ),
        .executableTarget(
            name: "ReplayBenchmark",
            dependencies: ["SETMinting", "Ledger"],
            path: "Benchmarks/ReplayBenchmark",
            swiftSettings: strict
        ),
        .executableTarget(
            name: "PipelineBenchmark",
            dependencies: ["TokenVerification", "SETMinting", "SecurityEvents", "Kafka", "Ledger", "WardenTestSupport",
                           .product(name: "Logging", package: "swift-log")],
            path: "Benchmarks/PipelineBenchmark",
            swiftSettings: strict
        ),
        // `make bench-soak`: millions of events through `warden run` with retention pruning.
        .executableTarget(
            name: "SoakBenchmark",
            dependencies: ["SETMinting", "SecurityEvents", "Kafka", "Ledger", "WardenTestSupport",
                           .product(name: "Logging", package: "swift-log")],
            path: "Benchmarks/SoakBenchmark",
            swiftSettings: strict
        ),
        .testTarget(
            name: "SecurityEventsTests",
            dependencies: ["SecurityEvents", "SETMinting"],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "TokenVerificationTests",
            dependencies: [
                "TokenVerification", "SecurityEvents", "SETMinting", "WardenTestSupport",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "_CryptoExtras", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "KafkaTests",
            dependencies: ["Kafka", "CRdkafka", "WardenTestSupport", .product(name: "Logging", package: "swift-log")],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "RedisTests",
            dependencies: ["Redis", "WardenTestSupport", .product(name: "NIOCore", package: "swift-nio")],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "InvalidationTests",
            dependencies: [
                "Invalidation", "SecurityEvents", "Redis", "WardenTestSupport",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "Crypto", package: "swift-crypto"),
            ],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "PipelineTests",
            dependencies: ["Pipeline", "Kafka", "Ledger", "TokenVerification", "Invalidation", "SETMinting", "SecurityEvents",
                           "WardenTestSupport",
                           .product(name: "Logging", package: "swift-log"), .product(name: "Metrics", package: "swift-metrics"),
                           .product(name: "Prometheus", package: "swift-prometheus")],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "StreamManagementTests",
            dependencies: ["StreamManagement", "HTTPExchange", "SecurityEvents", "SETMinting", "WardenTestSupport",
                           .product(name: "AsyncHTTPClient", package: "async-http-client")],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "LedgerTests",
            dependencies: ["Ledger", "CWardenFiles", "WardenTestSupport", "DatabaseLocations", .product(name: "Logging", package: "swift-log"),
                           .product(name: "GRDB", package: "GRDB.swift"), .product(name: "GRDBSQLite", package: "GRDB.swift")],
            swiftSettings: testSettings
        ),
        .testTarget(
            name: "WardenCLITests",
            dependencies: [
                "WardenCLI", "TokenVerification", "SETMinting", "SecurityEvents", "WardenTestSupport", "warden", "Kafka", "Ledger", "Invalidation", "Redis",
                "HTTPExchange", .product(name: "AsyncHTTPClient", package: "async-http-client"),
            ],
            swiftSettings: testSettings
        ),
    ],
    swiftLanguageModes: [.v6]
)
