#!/usr/bin/env bash
# Stage 1 on the embedded demo: the tiny preset, one process (CPU or one GPU), about a minute on a laptop CPU.
#
#   step1_sft/training_scripts/single_gpu/run_tiny.sh [OUTPUT_DIR] [extra flags...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTPUT="${1:-output/step1_sft}"
shift $(( $# > 0 ? 1 : 0 ))
STEP=1 exec "$HERE/../../../launch/single_process.sh" --model tiny --data-split 2,4,4 \
  --per-device-train-batch-size 8 --max-steps 150 --learning-rate 1e-3 --output-dir "$OUTPUT" "$@"
