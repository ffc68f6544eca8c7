#!/usr/bin/env bash
# One stage on N local devices of this machine, under the deepspeed launcher (via `dschat train`).
#
#   NUM_GPUS=8 STEP=1 launch/single_node.sh --model chinese-llama-2-7b --zero-stage 3 --output-dir out/step1
#   NUM_GPUS=2 STEP=1 launch/single_node.sh --model tiny --max-steps 20    # no GPU: 2 CPU ranks (gloo)
#
# Environment:
#   STEP         stage to run: 1 SFT (default), 2 reward model, 3 RLHF
#   NUM_GPUS     ranks on this machine (default: every GPU nvidia-smi lists, else 1);
#                CUDA_VISIBLE_DEVICES picks which GPUs
#   MASTER_PORT  rendezvous port (default: a free one)
#   PYTHON       interpreter (default: python3, else python)
#   DRY_RUN      set to 1 to print the command instead of running it
# Every other argument goes to `dschat train --step $STEP` and from there to the stage script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEP="${STEP:-1}"
case "$STEP" in
  1 | 2 | 3) ;;
  *) echo "$(basename "$0"): STEP must be 1, 2 or 3, not '$STEP'" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
  [[ "$NUM_GPUS" =~ ^[1-9][0-9]*$ ]] || NUM_GPUS=1
fi
[[ "$NUM_GPUS" =~ ^[1-9][0-9]*$ ]] || { echo "$(basename "$0"): NUM_GPUS must be a positive number" >&2; exit 2; }

# The checkout first on the path, so the script runs this tree even where dschat is not installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cmd=("$PYTHON" -c 'import sys; sys.argv[0] = "dschat"; from dschat.cli.main import cli; cli()'
     train --step "$STEP" --num-gpus "$NUM_GPUS")
if [[ -n "${MASTER_PORT:-}" ]]; then cmd+=(--master-port "$MASTER_PORT"); fi
cmd+=("$@")
echo "+ dschat$(printf " %q" "${cmd[@]:3}")" >&2
if [[ "${DRY_RUN:-0}" == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
