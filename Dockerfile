# Builds the `warden` executable on Debian bookworm and ships it with the C libraries it links.
# The build context is cut down by .dockerignore to what this file copies.
FROM swift:6.3-bookworm AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        librdkafka-dev libssl-dev libsqlite3-dev libjemalloc-dev zlib1g-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Package.swift declares targets under Sources/, Benchmarks/ and Tests/: every one of those
# folders must exist for the manifest to load, even though only `warden` is built.
COPY Package.swift ./
COPY Sources ./Sources
COPY Benchmarks ./Benchmarks
COPY Tests ./Tests
RUN swift build -c release --product warden --static-swift-stdlib \
    && cp "$(swift build -c release --show-bin-path)/warden" /usr/local/bin/warden

FROM debian:bookworm-slim
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        librdkafka1 libssl3 libsqlite3-0 libjemalloc2 zlib1g ca-certificates && rm -rf /var/lib/apt/lists/*
# A numeric non-root user (Kubernetes' runAsNonRoot can only check a numeric USER). Its state
# directory is owned by it, so a named volume mounted there (Docker copies the directory's
# ownership into a new volume) is writable: a SQLite ledger goes in /var/lib/warden.
RUN groupadd --system --gid 10001 warden \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/warden --no-create-home \
        --shell /usr/sbin/nologin warden \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/warden \
    && install -d -o 0 -g 0 -m 0755 /etc/warden
COPY --from=build /usr/local/bin/warden /usr/local/bin/warden
USER 10001:10001
WORKDIR /var/lib/warden
# 9464: http.listen (/healthz, /readyz, /metrics); 8080: receiver.listen when a receiver is configured.
EXPOSE 9464 8080
# `warden run` stops intake on SIGTERM, finishes what is in flight, commits and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/warden"]
CMD ["run", "--config", "/etc/warden/warden.yaml"]
