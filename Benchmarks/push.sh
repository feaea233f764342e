#!/usr/bin/env bash
# The RFC 8935 push receiver under load (wrk, Debian's package) on loopback: SETs/s at
# saturation, then p50/p99 at a fixed rate of about 2,000 requests/s, and the worker's peak RSS.
# Each request is a distinct RS256 SET, taken into the SQLite ledger before its 202.
#
# Saturation is where adding clients no longer adds throughput: wrk runs with 64, 128, 256 and 512
# connections in turn and the highest rate is the figure. Each connection has one request in
# flight, so with too few the receiver waits for its clients (the machine is left partly idle)
# and the figure would be the clients' limit, not the receiver's. Every run starts a fresh
# worker on an empty ledger, so no token is ever a duplicate (a duplicate is answered sooner).
# Usage: Benchmarks/push.sh BIN_DIR [TOKENS] (BENCH_TOKENS_DIR keeps the minted tokens between runs).
set -euo pipefail
bin=$1
tokens=${2:-100000}
here=$(cd "$(dirname "$0")" && pwd)
work=${BENCH_TOKENS_DIR:-$(mktemp -d)}
mkdir -p "$work"
"$bin/PushBenchmark" "$work" "$tokens"
file="$work/tokens-$tokens.txt"
pid=""
trap 'if [ -n "$pid" ]; then kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; fi' EXIT
peak=0
start_worker() {
    rm -f "$work/ledger.sqlite" "$work/ledger.sqlite-wal" "$work/ledger.sqlite-shm"
    # Per-event log lines off, as make bench-pipeline runs the worker.
    WARDEN_LOG_LEVEL=warning "$bin/warden" run --config "$work/push.yaml" > "$work/warden.out" 2> "$work/warden.err" &
    pid=$!
    port=""
    for _ in $(seq 100); do
        port=$(sed -n 's/^warden: receiver: 127.0.0.1:\([0-9]*\).*/\1/p' "$work/warden.out")
        [ -n "$port" ] && break
        sleep 0.1
    done
    [ -n "$port" ] || { echo "the receiver did not start"; cat "$work/warden.err"; exit 1; }
    url="http://127.0.0.1:$port/events"
}
# Every answer must be a 202 (wrk counts the others apart), and no token may be sent twice.
check_run() { # WRK_OUTPUT
    if grep -q "Non-2xx" "$1"; then echo "some requests were not answered 202:"; grep "Non-2xx" "$1"; exit 1; fi
    local sent
    sent=$(awk '/requests in/ {print $1}' "$1")
    [ "$sent" -le "$tokens" ] || { echo "$sent requests but $tokens tokens: some were duplicates; mint more (Benchmarks/push.sh BIN_DIR TOKENS)"; exit 1; }
}
# Stops the worker; checks that every answered request left its event in the ledger.
stop_worker() { # ANSWERED
    local rss
    rss=$(awk '/VmHWM/ {print $2}' /proc/$pid/status)
    [ "$rss" -gt "$peak" ] && peak=$rss
    kill -TERM $pid; wait $pid || true; pid=""
    local events
    events=$(sqlite3 "$work/ledger.sqlite" 'SELECT count(*) FROM events')
    echo "requests answered: $1, events in the ledger: $events"
    [ "$events" -ge "$1" ] || { echo "fewer events in the ledger than requests answered"; exit 1; }
}
cpu_idle() { awk '/^cpu / {print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat; }
echo "openssl speed -multi 2 -seconds 3 rsa2048: $(openssl speed -multi 2 -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}') verify/s (the machine's two-core limit)"
best=0; best_connections=0
for connections in 64 128 256 512; do
    start_worker
    echo "--- saturation: wrk -t2 -c$connections -d5s"
    read -r i0 t0 < <(cpu_idle)
    wrk -t2 -c$connections -d5s --latency -s "$here/push.lua" "$url" -- "$file" 2 | tee "$work/saturation.txt"
    read -r i1 t1 < <(cpu_idle)
    echo "machine idle during the run: $(( 100 * (i1 - i0) / (t1 - t0) ))%"
    check_run "$work/saturation.txt"
    rate=$(awk '/Requests\/sec/ {print $2}' "$work/saturation.txt")
    if awk -v r="$rate" -v b="$best" 'BEGIN {exit !(r > b)}'; then best=$rate; best_connections=$connections; fi
    stop_worker "$(awk '/requests in/ {print $1}' "$work/saturation.txt")"
done
start_worker
echo "--- fixed rate: about 2,000 requests/s (wrk -t2 -c25, each connection pausing 10 ms), 10 s"
wrk -t2 -c25 -d10s --latency -s "$here/push.lua" "$url" -- "$file" 2 10 | tee "$work/fixed.txt"
check_run "$work/fixed.txt"
stop_worker "$(awk '/requests in/ {print $1}' "$work/fixed.txt")"
echo "=== saturation: $best SETs/s (with $best_connections connections); \
fixed rate: $(awk '/Requests\/sec/ {print $2}' "$work/fixed.txt") requests/s, \
p50 $(awk '$1 == "50%" {print $2}' "$work/fixed.txt"), p99 $(awk '$1 == "99%" {print $2}' "$work/fixed.txt"); \
worker peak RSS $peak kB"
