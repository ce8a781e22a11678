#!/usr/bin/env bash
# The wheels the GPU machine lacks, for benchmarks/device_check.sh, into one ignored folder
# (.device-wheels/, or $1): that machine has Python 3.12, CUDA builds of torch and jax, flax and
# optax, but no Keras and no network. Run here, where the package index is reachable:
#
#     bash benchmarks/fetch_device_wheels.sh            # then prints the kit's size (limit 64 MiB)
#
# Fetched for CPython 3.12 on manylinux x86-64, --no-deps, one version of each: Keras and every
# package that Keras, keras-hub (the scaling part's model), dp_core, torch_dp and jax_dp name in
# their Requires-Dist that the image may lack (their own needs too: rich's markdown-it-py and
# pygments, markdown-it-py's mdurl, optree's typing-extensions). Not fetched, as the image has
# them and they are large or compiled against it: numpy, torch, jax, jaxlib, flax, optax, and
# keras-hub's tokenizer and download packages (keras_hub imports without them). device_check.sh
# installs a wheel only where the image lacks its distribution, except Keras, keras-hub and ours.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
folder=${1:-$root/.device-wheels}
python=${PYTHON:-python3}

# what runs there: Keras 3.15.1 is the newest release the index serves within the packages'
# range (keras>=3.10,<4), the one the default test sessions run; keras-hub as noxfile's parity pins it
pinned=(keras==3.15.1 "keras-hub>=0.32,<0.33")
# Keras's Requires-Dist (absl-py, numpy, rich, namex, h5py, optree, ml-dtypes, packaging), less
# numpy; rich's and optree's; keras-hub's regex; torch_dp's cloudpickle
needs=(absl-py rich namex h5py optree ml-dtypes packaging markdown-it-py mdurl pygments typing-extensions regex cloudpickle)

rm -rf "$folder"
mkdir -p "$folder"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
for requirement in "${pinned[@]}" "${needs[@]}"; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$folder" "$requirement"
done
# the three packages as this checkout has them
"$python" -m pip wheel -q --no-deps -w "$folder" "$root/packages/core" "$root/packages/torch_dp" "$root/packages/jax_dp"

"$python" - "$root" "$folder" <<'EOF'
"""Each wheel's size, and the kit's: the wheels plus the working tree that travels with them."""
import subprocess
import sys
from pathlib import Path

root, folder = Path(sys.argv[1]), Path(sys.argv[2])
wheels = sorted(folder.glob("*.whl"))
for wheel in wheels:
    print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=root, capture_output=True, check=True,
).stdout.split(b"\0")
tree = sum(path.stat().st_size for name in listed if name and (path := root / name.decode()).is_file())
carried = sum(wheel.stat().st_size for wheel in wheels)
print(f"wheels: {len(wheels)} files, {carried / 2**20:.1f} MiB; working tree that travels: {tree / 2**20:.1f} MiB")
print(f"kit: {(carried + tree) / 2**20:.1f} MiB of the 64 MiB a device call carries")
sys.exit(0 if carried + tree < 64 * 2**20 else 1)
EOF
