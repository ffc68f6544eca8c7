#!/usr/bin/env bash
# RM-R1 (Chen et al. 2025, arXiv:2505.02387): train a generative reward model, a judge that reasons in
# <think>...</think> and ends with <answer>[[A]]</answer> or <answer>[[B]]</answer>, with GRPO and the rule reward
# judge_match on judge-pairwise rows (context_messages + winner). Optionally a cold-start SFT on distilled judge
# completions first (rows that also carry a `response`), and `dschat eval --judge` before and after on held-out rows.
#
#   MODEL=Qwen/Qwen2.5-7B-Instruct DATA=judge_train.jsonl EVAL_DATA=judge_test.jsonl NUM_GPUS=8 \
#       launch/rm_r1_judge.sh --actor-zero-stage 3 --save-interval 50
#   MODEL=qwen2.5-7b SFT_DATA=distilled.jsonl DATA=judge_train.jsonl launch/rm_r1_judge.sh   # cold start first
#   launch/rm_r1_judge.sh --tiny          # the same recipe scaled down to the tiny demo: a CPU, minutes
#
# The recipe (RM-R1's RL stage): GRPO, judge_match, 7 completions per prompt, KL to the reference as a loss term
# with the k3 estimator and beta 0.001, actor learning rate 1e-6, temperature 1, long completions.
#
# Environment:
#   MODEL       the judge's starting model (any --model value); with SFT_DATA the SFT starts from it
#   DATA        judge-pairwise rows for GRPO, comma-separated for several files
#   SFT_DATA    cold-start rows (judge rows with a `response`, or any SFT rows), comma-separated; unset: no SFT
#   EVAL_DATA   held-out judge rows, comma-separated; unset: no before/after evaluation
#   OUTPUT_DIR  default output/rm_r1_judge (sft/, grpo/, judge_eval_before.json, judge_eval_after.json)
#   NUM_GPUS    ranks under the deepspeed launcher (default: every GPU nvidia-smi lists; 0 or none: one process)
#   TINY        set to 1 for --tiny
#   PYTHON      interpreter (default: python3, else python)
#   DRY_RUN     set to 1 to print the commands instead of running them
# Every other argument goes to the GRPO stage (`dschat train --step 3 --help`) and wins over the recipe's values.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
TINY="${TINY:-0}"
if [[ "${1:-}" == "--tiny" ]]; then TINY=1; shift; fi
OUTPUT_DIR="${OUTPUT_DIR:-output/rm_r1_judge}"
dschat=("$PYTHON" -c 'import sys; sys.argv[0] = "dschat"; from dschat.cli.main import cli; cli()')

if [[ "$TINY" == 1 ]]; then
  # The demo files and settings of `dschat pipeline judge` (its measured run is in the README): the model is 1.4M
  # parameters trained from scratch, so it takes a toy learning rate, short prompts and completions, 4 completions
  # per prompt instead of 7, and 100 steps; and the format rule weighed in beside judge_match, without which GRPO
  # wore the tiny judge's reasoning down (well-formed completions became rare).
  mapfile -t demo < <("$PYTHON" -c 'from dschat.demo import demo_files as d; f = d()
print(f["judge"]); print(f["judge_sft"]); print(f["judge_eval"])')
  MODEL=tiny DATA="${demo[0]}" SFT_DATA="${demo[1]}" EVAL_DATA="${demo[2]}" NUM_GPUS=0
  OUTPUT_DIR="${OUTPUT_DIR/%rm_r1_judge/rm_r1_judge_tiny}"
  sft_flags=(--data-split 1,0,0 --num-train-epochs 1 --per-device-train-batch-size 8 --max-seq-len 320)
  scale=(--max-steps 100 --num-generations 4 --per-device-generation-batch-size 16 --per-device-train-batch-size 16
         --max-prompt-seq-len 256 --max-answer-seq-len 40 --actor-learning-rate 1e-4 --eval-fraction 0.1
         --max-eval-rows 100 --per-device-eval-batch-size 50 --reward-funcs format --reward-weights 1
         --reward-weights 1)
  eval_flags=(--max-new-tokens 40 --batch-size 50)
else
  if [[ -z "${MODEL:-}" || -z "${DATA:-}" ]]; then
    echo "$(basename "$0"): set MODEL (the judge's starting model) and DATA (judge-pairwise rows), or pass --tiny" >&2
    exit 2
  fi
  sft_flags=(--data-split 1,0,0 --num-train-epochs 1 --max-seq-len 8192)
  scale=(--max-prompt-seq-len 4096 --max-answer-seq-len 4096 --per-device-generation-batch-size 8
         --per-device-train-batch-size 8 --eval-fraction 0.01 --max-eval-rows 256)
  eval_flags=(--max-new-tokens 4096 --batch-size 8)
fi
if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
launch=()
if [[ "$NUM_GPUS" =~ ^[1-9][0-9]*$ ]]; then launch=(--num-gpus "$NUM_GPUS"); fi

data_flags() {  # "a,b" -> --data a --data b
  local IFS=,
  for d in $1; do printf '%s\n' --data "$d"; done
}

run() {
  echo "+ dschat$(printf " %q" "$@")" >&2
  if [[ "${DRY_RUN:-0}" != 1 ]]; then "${dschat[@]}" "$@"; fi
}

actor="$MODEL"
if [[ -n "${SFT_DATA:-}" ]]; then
  mapfile -t sft_data < <(data_flags "$SFT_DATA")
  run train --step 1 "${launch[@]}" --model "$MODEL" "${sft_data[@]}" --output-dir "$OUTPUT_DIR/sft" \
    "${sft_flags[@]}"
  actor="$OUTPUT_DIR/sft/model"
fi

mapfile -t grpo_data < <(data_flags "$DATA")
recipe=(--algo grpo --reward-funcs judge_match --data-split 0,0,1 --num-generations 7 --beta 0.001
        --kl-estimator k3 --actor-learning-rate 1e-6 --temperature 1.0 --loss-type grpo)
run train --step 3 "${launch[@]}" --actor-model "$actor" "${grpo_data[@]}" --output-dir "$OUTPUT_DIR/grpo" \
  "${recipe[@]}" "${scale[@]}" "$@"

if [[ -n "${EVAL_DATA:-}" ]]; then
  mapfile -t eval_data < <(data_flags "$EVAL_DATA")
  run eval --judge --model "$actor" "${eval_data[@]}" --output "$OUTPUT_DIR/judge_eval_before.json" "${eval_flags[@]}"
  run eval --judge --model "$OUTPUT_DIR/grpo/actor" "${eval_data[@]}" --output "$OUTPUT_DIR/judge_eval_after.json" \
    "${eval_flags[@]}"
fi
