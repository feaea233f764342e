#!/usr/bin/env bash
# Verified RS256 SETs/s on one core (CPU 0) beside openssl's RSA-2048 verify/s.
# `openssl speed rsa2048` runs first, for the record; the benchmark then times, interleaved in
# 30 ms slices, Warden's whole verification, its signature check alone, and the very operation
# `openssl speed` times (EVP_PKEY_verify, 2048-bit key), so drift in this machine's speed from
# one second to the next affects all three alike.
# Usage: Benchmarks/verify-vs-openssl.sh BENCHMARK_BINARY [SECONDS]
set -euo pipefail
bin=$1
seconds=${2:-10}
ref=$(taskset -c 0 openssl speed -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}')
echo "openssl speed -seconds 3 rsa2048 (CPU 0): ${ref} verify/s"
taskset -c 0 "$bin" "$seconds" "$ref"
