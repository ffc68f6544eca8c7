#!/usr/bin/env bash
# Stage 1, full fine-tuning of a 13B LLaMA-2-family model on several nodes from a hostfile (see
# launch/README.md for the hostfile, ssh/pdsh and the shared data cache). ZeRO-3, gradient checkpointing.
#
#   HOSTFILE=launch/hostfile step1_sft/training_scripts/multi_node/run_llama2_13b.sh MODEL OUTPUT_DIR \
#       --data my_sft.jsonl --data-cache-dir /mnt/nfs/dschat-data
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -lt 2 ]]; then
  echo "usage: $(basename "$0") MODEL OUTPUT_DIR [flags...]   (MODEL: a local folder or cached HF id)" >&2
  exit 2
fi
MODEL="$1" OUTPUT="$2"
shift 2
STEP=1 exec "$HERE/../../../launch/multi_node_hostfile.sh" \
  --model "$MODEL" --data-split 2,4,4 --max-seq-len 512 \
  --per-device-train-batch-size 4 --num-train-epochs 3 --learning-rate 9.65e-6 --weight-decay 0 \
  --zero-stage 3 --gradient-checkpointing --dtype bf16 --save-interval 500 --output-dir "$OUTPUT" "$@"
