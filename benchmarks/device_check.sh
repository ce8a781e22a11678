#!/usr/bin/env bash
# The GPU check on the lent machine, in one command, offline (docs/benchmarks.md, "GPU check"):
#
#     bash benchmarks/device_check.sh [gpu_check.py's options, e.g. --only torch_float32]
#     bash benchmarks/device_check.sh --install-only     # the install and the versions alone
#
# 1. installs the wheels that benchmarks/fetch_device_wheels.sh put in .device-wheels/ (carried
#    with the working tree) with `pip install --no-index --no-deps --target`, on top of the
#    image's torch and jax: Keras, keras-hub and the three packages always, any other only where
#    the image lacks its distribution (a second numpy-built copy of, say, ml-dtypes would shadow
#    the one jax was tested with);
# 2. prints the versions and the GPU;
# 3. runs benchmarks/gpu_check.py under `timeout 360` (6 minutes; its own budget ends its last
#    part sooner), writing gpu_check.json, gpu_check.md and gpu_check.log into $OUT (or
#    ./gpu-check-results), each part bounded and independent.
#
# Environment: PYTHON (python3), DEVICE_WHEELS (.device-wheels), DEVICE_SITE (/tmp/keras-dp-site).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
wheels=${DEVICE_WHEELS:-$root/.device-wheels}
site=${DEVICE_SITE:-/tmp/keras-dp-site}
out=${OUT:-$root/gpu-check-results}
mkdir -p "$out"
cd "$root" || exit 1

if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "device_check: no wheels in $wheels: run benchmarks/fetch_device_wheels.sh where the index is reachable, and carry the folder" >&2
    exit 2
fi
# the wheels to install: ours and Keras's always, the rest where the image has no such distribution
mapfile -t chosen < <("$python" - "$wheels" <<'EOF'
import importlib.metadata
import re
import sys
from pathlib import Path

ALWAYS = {"keras", "keras_hub", "dp_core", "torch_dp", "jax_dp"}
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        importlib.metadata.distribution(re.sub(r"[-_.]+", "-", name))
        present = name.lower() not in ALWAYS
    except importlib.metadata.PackageNotFoundError:
        present = False
    print(f"# kept the image's {name}" if present else wheel, file=sys.stderr if present else sys.stdout)
EOF
)
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${chosen[@]}" || exit 3
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
echo "device_check: installed ${#chosen[@]} wheels into $site: ${chosen[*]##*/}"

# what a part would fail on shows here first; the check runs regardless and reports each part
report_imports() {  # $1: the Keras backend; then the modules to import under it
    KERAS_BACKEND=$1 "$python" - "${@:2}" <<'EOF'
import importlib
import sys

for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
        print(f"device_check: import {module}: ok")
    except Exception as error:  # reported, not fatal: the parts that need it report it too
        print(f"device_check: import {module} failed: {type(error).__name__}: {error}")
EOF
}
"$python" - <<'EOF'
import importlib.metadata as metadata

names = ["keras", "keras-hub", "dp-core", "torch-dp", "jax-dp", "torch", "jax", "jaxlib", "flax", "optax", "numpy"]
found = []
for name in names:
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        found.append(f"{name} MISSING")
print("device_check: " + ", ".join(found))
try:
    import torch

    gpu = f" ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})" if torch.cuda.is_available() else ""
    print(f"device_check: torch sees {torch.cuda.device_count()} CUDA device(s){gpu}")
    import jax

    print(f"device_check: jax devices {jax.devices()}")
except Exception as error:
    print(f"device_check: {type(error).__name__}: {error}")
EOF
report_imports jax keras dp_core jax_dp keras_hub
report_imports torch torch_dp
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi

PYTHONUNBUFFERED=1 timeout --kill-after=15 360 "$python" benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/device_check.log"
status=${PIPESTATUS[0]}
echo "device_check: gpu_check.py exited $status (124: its 6 minutes ran out); results in $out"
exit "$status"
