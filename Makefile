# Warden — set-up and everyday commands. `make run` and `make test` are all a newcomer needs.
SHELL := /bin/bash
SWIFT ?= swift
# Debian packages the build and the tests use.
APT_PACKAGES := libssl-dev openssl python3-jsonschema librdkafka-dev libsqlite3-dev sqlite3 kcat python3-confluent-kafka redis-server postgresql libjemalloc-dev zlib1g-dev

.PHONY: deps build run test bench bench-pipeline bench-engine bench-push bench-replay bench-soak schemas clean

deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

build: deps
	$(SWIFT) build

# The whole product on embedded defaults: the worker on librdkafka's in-process Kafka cluster,
# the push receiver on 127.0.0.1:8080, a SQLite ledger and a redis-server session store in
# .warden/ (stopped with the worker), and a development transmitter's key (warden dev-keys).
# See README for sending it events with warden emit.
DEV_REDIS_PORT := 6399
run: deps
	$(SWIFT) build --product warden
	@mkdir -p .warden
	@bin=$$($(SWIFT) build --show-bin-path); \
	$$bin/warden dev-keys --dir .warden/dev-keys --no-serve || exit 2; \
	redis-cli -p $(DEV_REDIS_PORT) ping >/dev/null 2>&1 || \
	  redis-server --port $(DEV_REDIS_PORT) --bind 127.0.0.1 --save "" --appendonly no --dir $(CURDIR)/.warden \
	    --daemonize yes --pidfile $(CURDIR)/.warden/redis.pid --logfile $(CURDIR)/.warden/redis.log; \
	echo "warden: redis-server: 127.0.0.1:$(DEV_REDIS_PORT) (session store, stopped with the worker)"; \
	trap 'redis-cli -p $(DEV_REDIS_PORT) shutdown nosave >/dev/null 2>&1' EXIT; \
	$$bin/warden run --config examples/dev.yaml

test: deps
	$(SWIFT) test

# Release-built benchmark, pinned to one CPU: verified RS256 SETs/s beside openssl speed rsa2048
# and beside the same OpenSSL operation timed interleaved in-process.
bench: deps
	$(SWIFT) build -c release --product VerifyBenchmark
	Benchmarks/verify-vs-openssl.sh $$($(SWIFT) build -c release --show-bin-path)/VerifyBenchmark 10

# Release-built end-to-end benchmark: `warden run` over the embedded cluster and a SQLite ledger.
bench-pipeline: deps
	$(SWIFT) build -c release --product warden
	$(SWIFT) build -c release --product PipelineBenchmark
	Benchmarks/pipeline.sh $$($(SWIFT) build -c release --show-bin-path)

# With actions beside record-only, in the same run: every event purges a user's sessions on a
# real redis-server; also the p99 time from a step's answer to its outcome being durable.
bench-engine: deps
	$(SWIFT) build -c release --product warden
	$(SWIFT) build -c release --product PipelineBenchmark
	Benchmarks/engine.sh $$($(SWIFT) build -c release --show-bin-path) 64000

# Release-built push receiver under wrk on loopback: SETs/s at saturation, p50/p99 at about
# 2,000 requests/s, peak RSS (each request a distinct RS256 SET into the SQLite ledger).
bench-push: deps
	@dpkg-query -W -f='$${Status}' wrk 2>/dev/null | grep -q "install ok installed" || \
	  { SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq wrk; }
	$(SWIFT) build -c release --product warden
	$(SWIFT) build -c release --product PushBenchmark
	Benchmarks/push.sh $$($(SWIFT) build -c release --show-bin-path)

# Release-built soak: EVENTS (default 5,000,000) through `warden run` with every event purging a
# user's sessions on a real redis-server and ledger retention (RETENTION seconds, default 60)
# pruning all along: events/s of each million, the worker's RSS, the ledger's size on disk.
EVENTS ?= 5000000
RETENTION ?= 60
bench-soak: deps
	$(SWIFT) build -c release --product warden
	$(SWIFT) build -c release --product SoakBenchmark
	$$($(SWIFT) build -c release --show-bin-path)/SoakBenchmark $(EVENTS) $(RETENTION)

# Release-built dry-run replay of 1,000,000 distinct RS256 SETs from a gzip log: SETs/s beside
# openssl speed -multi 2 rsa2048 (same run), and peak RSS.
bench-replay: deps
	$(SWIFT) build -c release --product warden
	$(SWIFT) build -c release --product ReplayBenchmark
	Benchmarks/replay.sh $$($(SWIFT) build -c release --show-bin-path)

clean:
	rm -rf .build

# Regenerate schemas/events/ from the event catalog.
schemas:
	WARDEN_WRITE_SCHEMAS=1 $(SWIFT) test --filter eventSchemasMatchTheCatalog || true
	$(SWIFT) test --filter SchemaTests
