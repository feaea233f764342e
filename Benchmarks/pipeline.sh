#!/usr/bin/env bash
# End-to-end SETs/s through `warden run` beside the machine's two-core RSA verify limit.
# Usage: Benchmarks/pipeline.sh BIN_DIR [TOKENS] [redis]
set -euo pipefail
bin=$1
tokens=${2:-64000}
limit=$(openssl speed -multi 2 -seconds 3 rsa2048 2>/dev/null | awk '/^rsa 2048 bits/ {print $NF}')
echo "openssl speed -multi 2 -seconds 3 rsa2048: ${limit} verify/s"
"$bin/PipelineBenchmark" "$tokens" "$limit" ${3:-}
