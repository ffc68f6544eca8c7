#!/usr/bin/env bash
# Build the folder that runs benchmarks/gpu_check.py on a CUDA host without network (docs/speed.md, GPU section).
# The host has python with a CUDA torch, transformers, peft and accelerate and what those pull in; the folder
# carries the code (this working tree, with its commit and `git describe --dirty` in dschat/COMMIT, since the host
# has no git) and wheels for the rest of what dschat runs on, for the host's python. On the host, run.sh unpacks
# only the wheels whose distribution the host lacks, then starts the check.
#
#   bash benchmarks/gpu_carry.sh DEST [PYTHON_VERSION]      # e.g. DEST=.gpu (git-ignored), 3.12 (the host's)
#   # copy DEST to the GPU host, then there:
#   bash DEST/run.sh --out-dir gpu_check_out [gpu_check flags]
#
# The folder must stay within DSCHAT_CARRY_LIMIT_MIB (64): larger, the script exits 1 with one line naming the size.
set -euo pipefail
DEST=${1:?usage: gpu_carry.sh DEST [PYTHON_VERSION]}
PYV=${2:-3.12}
LIMIT_MIB=${DSCHAT_CARRY_LIMIT_MIB:-64}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
rm -rf "$DEST/dschat" "$DEST/wheels" "$DEST/site" "$DEST/run.sh"
mkdir -p "$DEST/dschat" "$DEST/wheels"

# the code: the working tree's tracked files and the untracked ones git does not ignore
(cd "$ROOT" && git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
    if [ -f "$f" ]; then printf '%s\0' "$f"; fi
done | tar --null -T - -cf -) | tar -x -C "$DEST/dschat"
printf 'commit %s\ndescribe %s\n' "$(git -C "$ROOT" rev-parse HEAD)" "$(git -C "$ROOT" describe --always --dirty)" \
    > "$DEST/dschat/COMMIT"

plat=(--only-binary=:all: --python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$DEST/wheels" "$@"; }
pins() {  # the requirements the wheel $1 states for the names that follow (versions coupled to it)
    "$PY" - "$@" <<'PY'
import re
import sys
import zipfile

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

wheel, names = sys.argv[1], {norm(n) for n in sys.argv[2:]}
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = line.split(":", 1)[1].split(";")[0].replace(" ", "")
            if norm(re.split(r"[<>=!~\[(]", req, maxsplit=1)[0]) in names:
                print(req)
PY
}

# DeepSpeed as a pure-Python wheel (no ops built: dschat uses torch's AdamW and none of DeepSpeed's kernels), the
# version installed here; its needs at run time (ninja and py-cpuinfo serve op builds only, which dschat never does)
DS=$("$PY" -c 'from importlib.metadata import version; print(version("deepspeed"))' 2>/dev/null || echo 0.19.8)
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST/wheels" "deepspeed==$DS"
get hjson msgpack einops "pydantic>=2"
get $(pins "$DEST"/wheels/pydantic-[0-9]*.whl pydantic-core annotated-types typing-inspection)
# the tiny tokenizer's conversion to a fast tokenizer (sentencepiece, protobuf) and dschat's command line (click)
get "sentencepiece>=0.2" "protobuf>=4" "click>=8.1"
# TRL's row: trl and datasets with datasets' small needs; pyarrow and pandas (about 60 MiB) stay the host's own
get "trl>=1.16" "datasets>=3.0"
get $(pins "$DEST"/wheels/datasets-[0-9]*.whl dill multiprocess xxhash)

cat > "$DEST/run.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU host: the carried wheels whose distribution the host lacks, unpacked into site/ (a wheel is a zip of
# its files: nothing to build, no pip needed), then the check; arguments go to gpu_check.py.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
rm -rf "$HERE/site"
"$PY" - "$HERE/site" "$HERE"/wheels/*.whl <<'PY'
import shutil
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

site = Path(sys.argv[1])
site.mkdir()
for wheel in map(Path, sys.argv[2:]):
    try:
        version(wheel.name.split("-")[0])
        continue  # the host's own stays in charge
    except PackageNotFoundError:
        pass
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for data in site.glob("*.data"):  # a wheel's purelib/platlib go beside its packages; nothing else is needed
        for sub in ("purelib", "platlib"):
            for item in (data / sub).glob("*"):
                shutil.move(str(item), str(site / item.name))
        shutil.rmtree(data)
    print(f"run.sh: unpacked {wheel.name}")
PY
export PYTHONPATH="$HERE/dschat:$HERE/site${PYTHONPATH:+:$PYTHONPATH}"
export DSCHAT_CARRY_SITE="$HERE/site"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" "$HERE/dschat/benchmarks/gpu_check.py" "$@"
EOF
chmod +x "$DEST/run.sh"

# the size, against the limit, with the largest items
"$PY" - "$DEST" "$LIMIT_MIB" <<'PY'
import os
import sys
from pathlib import Path

dest, limit = Path(sys.argv[1]), float(sys.argv[2])

def size(p):
    if p.is_file():
        return p.stat().st_size
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)

mib = size(dest) / 2**20
if mib > limit:
    sys.exit(f"gpu_carry.sh: {dest} is {mib:.1f} MiB, over the {limit:g} MiB limit")
items = sorted(((size(p) / 2**20, p.name) for p in [dest / "dschat", *(dest / "wheels").iterdir()]), reverse=True)
print(f"gpu_carry.sh: {dest}: {mib:.1f} MiB (limit {limit:g}); largest: "
      + ", ".join(f"{name} {m:.1f}" for m, name in items[:6]))
PY
