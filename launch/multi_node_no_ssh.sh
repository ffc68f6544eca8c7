#!/usr/bin/env bash
# One stage on several machines without ssh: run this script once on EVERY node, each with its own NODE_RANK
# (0 on the node at MASTER_ADDR). All nodes use the same HOSTFILE content: its line order defines the node
# ranks and its slots the processes per node. The deepspeed launcher on each node starts that node's ranks
# (`deepspeed --no_ssh --node_rank R --master_addr A --master_port P --hostfile H`).
#
#   # on node 0 (10.0.0.1) and node 1, the same command with NODE_RANK=0 and NODE_RANK=1:
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 HOSTFILE=launch/hostfile STEP=1 launch/multi_node_no_ssh.sh \
#       --model chinese-llama-2-7b --output-dir /shared/out/step1 --data-cache-dir /shared/dschat-data
#
# Environment:
#   NODE_RANK    this node's index in the hostfile (default: SLURM_NODEID when run under srun)
#   MASTER_ADDR  address of node 0, reachable from every node (required)
#   MASTER_PORT  rendezvous port on MASTER_ADDR (default 29500)
#   HOSTFILE     hostfile, one `host slots=N` line per node (default: launch/hostfile); host names are only
#                labels here, nothing connects to them
#   NUM_GPUS     use only GPUs [0, N) on this node (default: the hostfile's slots)
#   STEP         stage to run: 1 SFT (default), 2 reward model, 3 RLHF
#   PYTHON       interpreter (default: python3, else python)
#   DRY_RUN      set to 1 to print the command instead of running it
# Environment of the ranks: this node's own. For the same setup as multi_node_hostfile.sh, KEY=VALUE lines of
# ~/.deepspeed_env and ./.deepspeed_env are exported too, except variables already set here.
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
die() { echo "$(basename "$0"): $*" >&2; exit 2; }
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] || die "set NODE_RANK to this node's index in the hostfile (0 on MASTER_ADDR)"
[[ -n "${MASTER_ADDR:-}" ]] || die "set MASTER_ADDR to the address of node 0"
HOSTFILE="${HOSTFILE:-$ROOT/launch/hostfile}"
[[ -f "$HOSTFILE" ]] || die "hostfile '$HOSTFILE' not found (see launch/hostfile.example)"

for f in "$HOME/.deepspeed_env" "$PWD/.deepspeed_env"; do
  [[ -f "$f" ]] || continue
  while IFS= read -r line || [[ -n "$line" ]]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    key="${line%%=*}"
    key="${key//[[:space:]]/}"
    if [[ "$key" =~ ^[A-Za-z_][A-Za-z0-9_]*$ && -z "${!key+set}" ]]; then export "$key=${line#*=}"; fi
  done <"$f"
done

cmd=("$PYTHON" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK"
     --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}")
if [[ -n "${NUM_GPUS:-}" ]]; then cmd+=(--num_gpus "$NUM_GPUS"); fi
cmd+=("$SCRIPT" "$@")
echo "+$(printf " %q" "${cmd[@]}")" >&2
if [[ "${DRY_RUN:-0}" == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
