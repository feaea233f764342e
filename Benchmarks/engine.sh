#!/usr/bin/env bash
# Acting beside recording, in the same minutes: each run measures openssl's two-core RSA verify
# limit, then `warden run` record-only, then `warden run` with every event purging a user's
# sessions on a real redis-server (SQLite ledger with outbox). Prints both rates, their ratio,
# and the p99 time from a step's answer to its outcome being durable; medians over RUNS runs.
# Usage: Benchmarks/engine.sh BIN_DIR [TOKENS]
set -euo pipefail
bin=$1
tokens=${2:-64000}
runs=${RUNS:-3}
if [ -z "${BENCH_TOKENS_DIR:-}" ]; then
    export BENCH_TOKENS_DIR=$(mktemp -d)
    trap 'rm -rf "$BENCH_TOKENS_DIR"' EXIT
fi
rate() { sed -n 's/^warden run end to end .*: \([0-9]*\) SETs\/s$/\1/p'; }
# The worker's CPU seconds per event drift less with the machine's speed of the moment than
# rates do: their ratio is printed beside the rates' ratio.
cpu() { sed -n 's/^worker CPU time per event[^:]*: \([0-9]*\) µs.*/\1/p'; }
# The bytes the worker wrote per event (its ledger's WAL and checkpoints, mostly) drift far less
# with the speed of the moment than its CPU time: runs agree within about a tenth.
written() { sed -n 's/^worker bytes written per event.*: \([0-9]*\) B$/\1/p'; }
acting=(); ofrecord=(); ofopenssl=(); cpuratio=(); recordbytes=(); enginebytes=()
for run in $(seq "$runs"); do
    echo "--- run $run of $runs"
    limit=$(openssl speed -multi 2 -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}')
    echo "openssl speed -multi 2 -seconds 3 rsa2048: ${limit} verify/s"
    record=$("$bin/PipelineBenchmark" "$tokens" "$limit")
    echo "$record" | grep -E "^warden run|^two-core|^worker CPU|^worker bytes"
    engine=$("$bin/PipelineBenchmark" "$tokens" "$limit" redis)
    echo "$engine" | grep -E "^warden run|^redis-server keys left|^step answered|^  and p50|^  share|^worker CPU|^worker bytes"
    r=$(echo "$record" | rate); e=$(echo "$engine" | rate)
    [ -n "$r" ] && [ -n "$e" ] || { echo "a run printed no rate"; exit 1; }
    acting+=("$(awk -v e="$e" -v r="$r" 'BEGIN {printf "%.2f", e / r}')")
    ofrecord+=("$(awk -v r="$r" -v l="$limit" 'BEGIN {printf "%.2f", r / l}')")
    ofopenssl+=("$(awk -v e="$e" -v l="$limit" 'BEGIN {printf "%.2f", e / l}')")
    echo "with actions ÷ record-only: ${acting[-1]}; record-only ÷ openssl: ${ofrecord[-1]}; with actions ÷ openssl: ${ofopenssl[-1]}"
    rc=$(echo "$record" | cpu); ec=$(echo "$engine" | cpu)
    if [ -n "$rc" ] && [ -n "$ec" ]; then
        cpuratio+=("$(awk -v e="$ec" -v r="$rc" 'BEGIN {printf "%.2f", r / e}')")
        echo "worker CPU per event: record-only ${rc} µs, with actions ${ec} µs; record-only ÷ with actions: ${cpuratio[-1]}"
    fi
    rb=$(echo "$record" | written); eb=$(echo "$engine" | written)
    if [ -n "$rb" ] && [ -n "$eb" ]; then recordbytes+=("$rb"); enginebytes+=("$eb"); fi
done
med() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
echo "=== medians over $runs runs: with actions ÷ record-only $(med "${acting[@]}"), record-only ÷ openssl -multi 2 $(med "${ofrecord[@]}"), with actions ÷ openssl $(med "${ofopenssl[@]}")"
if [ ${#cpuratio[@]} -gt 0 ]; then echo "=== worker CPU per event, record-only ÷ with actions: median $(med "${cpuratio[@]}")"; fi
if [ ${#recordbytes[@]} -gt 0 ]; then echo "=== worker bytes written per event: record-only median $(med "${recordbytes[@]}") B, with actions median $(med "${enginebytes[@]}") B"; fi
