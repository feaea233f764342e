#!/usr/bin/env bash
# The ledger's size on disk per event: `warden run` (embedded Kafka, SQLite ledger, every event
# purging a user's sessions on a real redis-server) takes TOKENS pre-minted SETs produced by
# kcat, then sqlite3's dbstat gives the bytes of each table and index per event.
# Usage: Benchmarks/ledger-size.sh WARDEN_BINARY TOKENS.tsv JWKS.json
# (TOKENS.tsv: key<TAB>compact SET per line, as PipelineBenchmark caches them in BENCH_TOKENS_DIR.)
set -euo pipefail
warden=$1; tokens=$2; jwks=$3
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
count=$(wc -l < "$tokens")
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --loglevel warning > /dev/null &
cp "$jwks" "$dir/jwks.json"
cat > "$dir/warden.yaml" <<YAML
issuers:
  - issuer: https://accounts.google.com/
    jwks-file: jwks.json
    audiences: [1234-abc.apps.googleusercontent.com]
kafka: {brokers: embedded, embedded-partitions: 16}  # a mock partition keeps only ~5 MiB
http: {listen: "127.0.0.1:0"}
ledger: sqlite:ledger.sqlite
targets:
  sessions: {redis: "redis://127.0.0.1:$port/0"}
YAML
WARDEN_LOG_LEVEL=warning "$warden" run --config "$dir/warden.yaml" > "$dir/out" 2> "$dir/err" &
for _ in $(seq 200); do grep -q "embedded Kafka cluster" "$dir/out" 2>/dev/null && break; sleep 0.1; done
brokers=$(sed -n 's/^warden: embedded Kafka cluster: \([^ ]*\) .*/\1/p' "$dir/out")
kcat -P -b "$brokers" -t security-events -K $'\t' -l "$tokens"
# Until every event is finished, or nothing has moved for 30 s.
previous=-1; still=0
for _ in $(seq 2400); do
    n=$(sqlite3 "$dir/ledger.sqlite" "SELECT count(*) FROM events WHERE outcome <> 'pending'" 2>/dev/null || echo "$previous")
    [ "$n" -ge "$count" ] && break
    if [ "$n" = "$previous" ]; then still=$((still + 1)); else still=0; fi
    [ "$still" -ge 60 ] && { echo "only $n of $count events finished"; break; }
    previous=$n
    sleep 0.5
done
echo "rejected deliveries: $(sqlite3 "$dir/ledger.sqlite" "SELECT count(*) FROM deliveries WHERE verdict = 'invalid'"); dead letters and errors in the worker's log: $(grep -c '"level":"error"\|dead-lettered' "$dir/err" || true)"
kill -TERM %2; wait %2 || true
events=$(sqlite3 "$dir/ledger.sqlite" "SELECT count(*) FROM events")
echo "events: $events, steps: $(sqlite3 "$dir/ledger.sqlite" "SELECT count(*) FROM steps"), audit records: $(sqlite3 "$dir/ledger.sqlite" "SELECT count(*) FROM audit_records")"
sqlite3 "$dir/ledger.sqlite" "PRAGMA wal_checkpoint(TRUNCATE);" > /dev/null
sqlite3 -separator ' ' "$dir/ledger.sqlite" "SELECT name, sum(pgsize), round(sum(pgsize) * 1.0 / $events) FROM dbstat GROUP BY name HAVING sum(pgsize) > 65536 ORDER BY 2 DESC" |
    awk '{printf "  %-28s %10d bytes  %6d bytes/event\n", $1, $2, $3}'
size=$(stat -c %s "$dir/ledger.sqlite")
awk -v s="$size" -v n="$events" 'BEGIN {printf "ledger file: %d bytes for %d events: %.0f bytes/event, %.2f GB per million events\n", s, n, s/n, s/n*1e6/1e9}'
