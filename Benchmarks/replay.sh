#!/usr/bin/env bash
# warden replay (dry run) of a gzip log of N distinct RS256 SETs (default 1,000,000) against a
# SQLite ledger: events/s beside the machine's two-core RSA verify limit measured in the same
# run, and peak RSS. Usage: Benchmarks/replay.sh BIN_DIR [N]
# (BENCH_TOKENS_DIR keeps the minted log between runs; minting takes minutes.)
set -euo pipefail
bin=$1
count=${2:-1000000}
work=${BENCH_TOKENS_DIR:-$(mktemp -d)}
mkdir -p "$work"
ledger="$work/replay-ledger.sqlite"
rm -f "$ledger" "$ledger-wal" "$ledger-shm"
# It makes an empty ledger: every SET is then never-processed, and each is looked up among the
# events and the rejections (the most lookups a SET can cost).
"$bin/ReplayBenchmark" "$work" "$count"
limit=$(openssl speed -multi 2 -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}')
echo "openssl speed -multi 2 -seconds 3 rsa2048: $limit verify/s (the machine's two-core limit)"
start=$(date +%s.%N)
set +e
/usr/bin/time -f "%M" -o "$work/rss.txt" "$bin/warden" replay --config "$work/replay.yaml" --file "$work/replay-$count.log.gz" \
  > "$work/replay.out" 2> "$work/replay.err"
status=$?
set -e
end=$(date +%s.%N)
tail -n 12 "$work/replay.out"
[ $status -le 1 ] || { echo "warden replay exited $status"; cat "$work/replay.err"; exit 1; }
rate=$(echo "$count / ($end - $start)" | bc -l)
echo "=== replay: $count SETs in $(printf '%.1f' "$(echo "$end - $start" | bc -l)") s = $(printf '%.0f' "$rate") SETs/s = \
$(printf '%.2f' "$(echo "$rate / $limit" | bc -l)") of the two-core limit; peak RSS $(( $(tail -n 1 "$work/rss.txt") / 1024 )) MB"
after=$(openssl speed -multi 2 -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}')
echo "openssl speed -multi 2 rsa2048 after the run: $after verify/s"
