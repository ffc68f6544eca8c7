#!/usr/bin/env bash
# One stage in one plain Python process: CPU, or one GPU. No launcher, no hostfile, no ports.
#
#   STEP=1 launch/single_process.sh --model tiny --output-dir output/step1_sft --max-steps 50
#   CUDA_VISIBLE_DEVICES=0 STEP=3 launch/single_process.sh --actor-model output/step1_sft/model ...
#
# Environment:
#   STEP     stage to run: 1 SFT (default), 2 reward model, 3 RLHF
#   PYTHON   interpreter (default: python3, else python)
#   DRY_RUN  set to 1 to print the command instead of running it
# Every other argument goes to the stage script unchanged (`python stepN_*/main.py --help` lists them).
# Works from any directory: relative paths in the arguments are relative to where you run it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEP="${STEP:-1}"
case "$STEP" in
  1) SCRIPT="$ROOT/step1_sft/main.py" ;;
  2) SCRIPT="$ROOT/step2_reward/main.py" ;;
  3) SCRIPT="$ROOT/step3_rlhf/main.py" ;;
  *) echo "$(basename "$0"): STEP must be 1, 2 or 3, not '$STEP'" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"

cmd=("$PYTHON" "$SCRIPT" "$@")
echo "+$(printf " %q" "${cmd[@]}")" >&2
if [[ "${DRY_RUN:-0}" == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
