#!/usr/bin/env bash
# Build a folder that runs benchmarks/gpu_check.py on a CUDA host without network access, from a machine that has
# it (docs/speed.md, GPU section). The host needs python with a CUDA torch; everything else dschat requires comes
# along as wheels (pure-Python ones for any Linux, binary ones for the host's python version), plus DeepSpeed
# installed as plain Python (no ops are built: dschat uses none of its compiled kernels).
#
#   bash benchmarks/gpu_carry.sh DEST [PYTHON_VERSION]        # e.g. DEST=.gpu (git-ignored), 3.12
#   # copy DEST to the GPU host, then there:
#   bash DEST/run.sh --out gpu_check.json [gpu_check flags]
set -euo pipefail
DEST=${1:?usage: gpu_carry.sh DEST [PYTHON_VERSION]}
PYV=${2:-3.12}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
rm -rf "$DEST/dschat" "$DEST/wheels" "$DEST/site"
mkdir -p "$DEST/dschat" "$DEST/wheels" "$DEST/site"
git -C "$ROOT" archive HEAD | tar -x -C "$DEST/dschat"
plat=(--only-binary=:all: --python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# requirements.txt without torch (the host's CUDA build stays), DeepSpeed's and datasets' own needs; on the host
# run.sh installs only those it lacks
python3 -m pip download -q --no-deps "${plat[@]}" -d "$DEST/wheels" \
    "transformers>=5.0,<6" "peft>=0.21" "datasets>=3.0" "sentencepiece>=0.2" "protobuf>=4" "tensorboard>=2.15" \
    "click>=8.1" pyyaml tqdm safetensors numpy "matplotlib>=3.8,<4" \
    hjson pydantic pydantic-core annotated-types typing-inspection py-cpuinfo msgpack ninja einops \
    dill multiprocess xxhash pyarrow fsspec tensorboard-data-server absl-py markdown werkzeug grpcio
# TRL, for the check's TRL row (optional: without it the row is left out)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$DEST/wheels" "trl>=1.16" || echo "(no trl wheel: no TRL row)"
DS=$(python3 -c 'from importlib.metadata import version; print(version("deepspeed"))' 2>/dev/null || echo 0.19.8)
DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --target "$DEST/site" "deepspeed==$DS"
find "$DEST/site" -name __pycache__ -prune -exec rm -rf {} +
cat > "$DEST/run.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU host: the carried wheels into a private folder, then the check. Arguments go to gpu_check.py.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${DSCHAT_CARRY_SITE:-/tmp/dschat-carry-site}
# only what the host lacks: its own numpy, transformers, ... stay in charge where it has them
MISSING=$(python3 - "$HERE"/wheels/*.whl <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for wheel in sys.argv[1:]:
    name = wheel.rsplit("/", 1)[-1].split("-")[0]
    try:
        version(name)
    except PackageNotFoundError:
        print(wheel)
PY
)
[ -n "$MISSING" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $MISSING
export PYTHONPATH="$HERE/dschat:$HERE/site:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
cd "$HERE/dschat"
exec python3 benchmarks/gpu_check.py "$@"
EOF
chmod +x "$DEST/run.sh"
du -sh "$DEST"
