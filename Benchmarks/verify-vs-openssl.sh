#!/usr/bin/env bash
# Verified RS256 SETs/s on one core (CPU 0) beside `openssl speed rsa2048`'s verify/s, measured
# in alternating rounds so that drift in the machine's speed affects both alike. Prints each
# round and the medians. Usage: Benchmarks/verify-vs-openssl.sh BENCHMARK_BINARY [ROUNDS]
set -euo pipefail
bin=$1
rounds=${2:-5}
refs=(); fulls=(); sigs=()
for ((i = 1; i <= rounds; i++)); do
  ref=$(taskset -c 0 openssl speed -seconds 2 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}')
  out=$(taskset -c 0 "$bin" 2 "$ref")
  full=$(sed -n 's/^warden verify .*: \([0-9]*\) SETs\/s.*/\1/p' <<<"$out")
  sig=$(sed -n 's/^  of which the signature check .*: \([0-9]*\) \/s.*/\1/p' <<<"$out")
  printf 'round %d: openssl speed rsa2048 verify %s/s, warden verify %s SETs/s, signature check alone %s/s, ratio %s\n' \
    "$i" "$ref" "$full" "$sig" "$(awk -v a="$full" -v b="$ref" 'BEGIN {printf "%.2f", a / b}')"
  refs+=("$ref"); fulls+=("$full"); sigs+=("$sig")
  [ "$i" -eq 1 ] && grep -E '^  the rest' <<<"$out" || true
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
mr=$(median "${refs[@]}"); mf=$(median "${fulls[@]}"); ms=$(median "${sigs[@]}")
echo "median over $rounds rounds: openssl speed rsa2048 verify ${mr}/s; warden verify ${mf} SETs/s (signature check alone ${ms}/s)"
awk -v a="$mf" -v b="$mr" 'BEGIN {printf "ratio of medians warden verify / openssl: %.2f (target >= 0.85)\n", a / b}'
