#!/usr/bin/env bash
# One stage on several machines, started from ONE of them: the deepspeed launcher reads a hostfile and starts
# every node over ssh (pdsh by default). Needs passwordless ssh from here to every host, pdsh installed, and
# the same paths everywhere: this checkout, the Python interpreter, and the directory you run from (each node
# does `cd` to it; relative --output-dir / --data paths resolve there). See launch/README.md.
#
#   HOSTFILE=launch/hostfile STEP=1 launch/multi_node_hostfile.sh --model chinese-llama-2-7b \
#       --zero-stage 3 --output-dir /shared/out/step1 --data-cache-dir /shared/dschat-data
#
# Environment:
#   HOSTFILE     hostfile, one `host slots=N` line per node (default: launch/hostfile; see hostfile.example)
#   STEP         stage to run: 1 SFT (default), 2 reward model, 3 RLHF
#   MASTER_ADDR  address of the first host that the others can reach (default: the launcher asks that host
#                for `hostname -I` over ssh)
#   MASTER_PORT  rendezvous port on MASTER_ADDR (default 29500)
#   NUM_NODES    use only the first N hosts of the hostfile      NUM_GPUS  use only GPUs [0, N) on each host
#   INCLUDE      deepspeed --include filter, e.g. 'worker-0@worker-1:0,2' (not with NUM_NODES/NUM_GPUS)
#   BACKEND      deepspeed --launcher: pdsh (default), openmpi, mpich, impi, mvapich, slurm
#   SSH_PORT     ssh port for pdsh
#   PYTHON       interpreter (default: python3, else python)
#   DRY_RUN      set to 1 to print the command instead of running it
#
# Environment on the other nodes: the launcher exports only a few variables (NCCL_*, PYTHON*, ...) plus the
# lines of `.deepspeed_env` (KEY=VALUE). This script gathers ~/.deepspeed_env, ./.deepspeed_env (later wins;
# blank lines and # comments allowed) and the variables in FORWARD_VARS that are set here (these win) into one
# file and hands it to the launcher through DS_ENV_FILE, so DSCHAT_CACHE, HF_HOME, ... reach every node.
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
HOSTFILE="${HOSTFILE:-$ROOT/launch/hostfile}"
[[ -f "$HOSTFILE" ]] || { echo "$(basename "$0"): hostfile '$HOSTFILE' not found (see launch/hostfile.example)" >&2; exit 2; }
FORWARD_VARS="${FORWARD_VARS:-DSCHAT_CACHE HF_HOME HF_HUB_CACHE HF_DATASETS_CACHE HF_HUB_OFFLINE HF_DATASETS_OFFLINE
  TRANSFORMERS_OFFLINE TOKENIZERS_PARALLELISM OMP_NUM_THREADS GLOO_SOCKET_IFNAME}"

cmd=("$PYTHON" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --launcher "${BACKEND:-pdsh}"
     --master_port "${MASTER_PORT:-29500}")
if [[ -n "${MASTER_ADDR:-}" ]]; then cmd+=(--master_addr "$MASTER_ADDR"); fi
if [[ -n "${NUM_NODES:-}" ]]; then cmd+=(--num_nodes "$NUM_NODES"); fi
if [[ -n "${NUM_GPUS:-}" ]]; then cmd+=(--num_gpus "$NUM_GPUS"); fi
if [[ -n "${INCLUDE:-}" ]]; then cmd+=(--include "$INCLUDE"); fi
if [[ -n "${SSH_PORT:-}" ]]; then cmd+=(--ssh_port "$SSH_PORT"); fi
cmd+=("$SCRIPT" "$@")

env_file="$(mktemp "${TMPDIR:-/tmp}/dschat-deepspeed-env.XXXXXX")"
trap 'rm -f "$env_file"' EXIT
for f in "$HOME/.deepspeed_env" "$PWD/.deepspeed_env"; do
  if [[ -f "$f" ]]; then grep -Ev '^[[:space:]]*(#|$)' "$f" >>"$env_file" || true; fi
done
for var in $FORWARD_VARS; do
  if [[ -n "${!var:-}" ]]; then printf '%s=%q\n' "$var" "${!var}" >>"$env_file"; fi
done

echo "+$(printf " %q" "${cmd[@]}")" >&2
if [[ -s "$env_file" ]]; then sed 's/^/  exported to every node: /' "$env_file" >&2; fi
if [[ "${DRY_RUN:-0}" == 1 ]]; then exit 0; fi
# An absolute DS_ENV_FILE replaces the launcher's ~/.deepspeed_env and ./.deepspeed_env look-up.
DS_ENV_FILE="$env_file" "${cmd[@]}"
