# Builds the `warden` executable on Debian bookworm and ships it with the C libraries it links.
FROM swift:6.3-bookworm AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        librdkafka-dev libssl-dev libsqlite3-dev libjemalloc-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Package.swift ./
COPY Sources ./Sources
COPY Benchmarks ./Benchmarks
COPY Tests ./Tests
RUN swift build -c release --product warden --static-swift-stdlib \
    && cp "$(swift build -c release --show-bin-path)/warden" /usr/local/bin/warden

FROM debian:bookworm-slim
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        librdkafka1 libssl3 libsqlite3-0 libjemalloc2 ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/warden /usr/local/bin/warden
USER nobody
ENTRYPOINT ["/usr/local/bin/warden"]
CMD ["run", "--config", "/etc/warden/warden.yaml"]
