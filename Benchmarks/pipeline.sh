#!/usr/bin/env bash
# End-to-end SETs/s through `warden run` beside the machine's two-core RSA verify limit.
# Usage: Benchmarks/pipeline.sh BIN_DIR [TOKENS] [redis]
# This machine's speed drifts by ±15% from one minute to the next (openssl speed itself gives
# 86k-103k), so the run is made RUNS times (default 3), each right after its own openssl
# measurement, and the median of the end-to-end ratios is printed last. The tokens are minted
# by the first run and reused by the others (BENCH_TOKENS_DIR).
set -euo pipefail
bin=$1
tokens=${2:-64000}
runs=${RUNS:-3}
ratios=()
if [ -z "${BENCH_TOKENS_DIR:-}" ]; then
    export BENCH_TOKENS_DIR=$(mktemp -d)
    trap 'rm -rf "$BENCH_TOKENS_DIR"' EXIT
fi
for run in $(seq "$runs"); do
    echo "--- run $run of $runs"
    limit=$(openssl speed -multi 2 -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}')
    echo "openssl speed -multi 2 -seconds 3 rsa2048: ${limit} verify/s"
    out=$("$bin/PipelineBenchmark" "$tokens" "$limit" ${3:-})
    echo "$out"
    ratio=$(echo "$out" | sed -n 's/^two-core RSA-2048 verify limit.*end to end is \([0-9.]*\) of it.*/\1/p')
    [ -n "$ratio" ] && ratios+=("$ratio")
done
if [ "${#ratios[@]}" -gt 0 ]; then
    sorted=$(printf '%s\n' "${ratios[@]}" | sort -n | tr '\n' ' ')
    median=$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}')
    echo "=== end to end ÷ two-core RSA verify limit, each run: ${sorted}→ median ${median}"
fi
