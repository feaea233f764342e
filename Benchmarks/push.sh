#!/usr/bin/env bash
# The RFC 8935 push receiver under load (wrk, Debian's package) on loopback: SETs/s at
# saturation, then p50/p99 at a fixed rate of about 2,000 requests/s, and the worker's peak RSS.
# Each request is a distinct RS256 SET, taken into the SQLite ledger before its 202.
# Usage: Benchmarks/push.sh BIN_DIR [TOKENS] (BENCH_TOKENS_DIR keeps the minted tokens between runs).
set -euo pipefail
bin=$1
tokens=${2:-80000}
here=$(cd "$(dirname "$0")" && pwd)
work=${BENCH_TOKENS_DIR:-$(mktemp -d)}
mkdir -p "$work"
"$bin/PushBenchmark" "$work" "$tokens"
rm -f "$work/ledger.sqlite" "$work/ledger.sqlite-wal" "$work/ledger.sqlite-shm"
# Per-event log lines off, as make bench-pipeline runs the worker.
WARDEN_LOG_LEVEL=warning "$bin/warden" run --config "$work/push.yaml" > "$work/warden.out" 2> "$work/warden.err" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  port=$(sed -n 's/^warden: receiver: 127.0.0.1:\([0-9]*\).*/\1/p' "$work/warden.out")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "the receiver did not start"; cat "$work/warden.err"; exit 1; }
url="http://127.0.0.1:$port/events"
file="$work/tokens-$tokens.txt"
echo "openssl speed -multi 2 -seconds 3 rsa2048: $(openssl speed -multi 2 -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}') verify/s (the machine's two-core limit)"
echo "--- saturation: wrk -t2 -c64 -d5s"
wrk -t2 -c64 -d5s --latency -s "$here/push.lua" "$url" -- "$file" 2 | tee "$work/saturation.txt"
# The fixed-rate run takes its tokens from the last quarter of the file, which the saturation
# run (up to 10,000/s for 5 s) does not reach: every request is a new event.
first=$((tokens * 3 / 4))
echo "--- fixed rate: about 2,000 requests/s (wrk -t2 -c25, each connection pausing 10 ms), 10 s, tokens from #$first"
wrk -t2 -c25 -d10s --latency -s "$here/push.lua" "$url" -- "$file" 2 10 $first | tee "$work/fixed.txt"
rss=$(awk '/VmHWM/ {print $2, $3}' /proc/$pid/status)
events=$(sqlite3 "$work/ledger.sqlite" 'SELECT count(*) FROM events')
answered=$(( $(awk '/requests in/ {print $1}' "$work/saturation.txt") + $(awk '/requests in/ {print $1}' "$work/fixed.txt") ))
echo "=== saturation: $(awk '/Requests\/sec/ {print $2}' "$work/saturation.txt") SETs/s; \
fixed rate: $(awk '/Requests\/sec/ {print $2}' "$work/fixed.txt") requests/s, \
p50 $(awk '$1 == "50%" {print $2}' "$work/fixed.txt"), p99 $(awk '$1 == "99%" {print $2}' "$work/fixed.txt"); \
worker peak RSS $rss; requests answered: $answered, events in the ledger: $events"
