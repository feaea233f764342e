# Warden — set-up and everyday commands. `make run` and `make test` are all a newcomer needs.
SHELL := /bin/bash
SWIFT ?= swift
# Debian packages the build and the tests use.
APT_PACKAGES := libssl-dev openssl python3-jsonschema

.PHONY: deps build run test bench schemas clean

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

# The main job on embedded defaults: verify the bundled example SET against the bundled keys.
run: deps
	$(SWIFT) build --product warden
	$$($(SWIFT) build --show-bin-path)/warden verify --config examples/warden.yaml examples/tokens/sessions-revoked.jwt

test: deps
	$(SWIFT) test

# Release-built benchmark, pinned to one CPU: verified RS256 SETs/s beside openssl speed rsa2048
# and beside the same OpenSSL operation timed interleaved in-process.
bench: deps
	$(SWIFT) build -c release --product VerifyBenchmark
	Benchmarks/verify-vs-openssl.sh $$($(SWIFT) build -c release --show-bin-path)/VerifyBenchmark 10

clean:
	rm -rf .build

# Regenerate schemas/events/ from the event catalog.
schemas:
	WARDEN_WRITE_SCHEMAS=1 $(SWIFT) test --filter eventSchemasMatchTheCatalog || true
	$(SWIFT) test --filter SchemaTests
