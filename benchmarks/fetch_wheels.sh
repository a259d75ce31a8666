#!/usr/bin/env bash
# Download HERE (a machine with PyPI access) everything the GPU machines lack to run
# the DeepSpeed baselines (deepspeed_z3, deepcompile) and torchtitan's SimpleFSDP
# (simplefsdp), into .whl/ (git-ignored):
#
#   deepspeed 0.19.8      PyPI ships only an sdist: built here into a pure-Python wheel
#                         with DS_BUILD_OPS=0 (no op compiled; DeepSpeed JIT-builds the
#                         ops it needs, e.g. DeepCompile's "dc" op, on the GPU machine)
#   pydantic 2.13.4, pydantic-core 2.46.4 (cp312 manylinux), annotated-types 0.7.0,
#   typing-inspection 0.4.2, typing-extensions 4.15.0 (pydantic needs >= 4.14.1; the
#   image's version is not recorded), hjson 3.1.0
#   torchtitan 0.2.2      pure-Python wheel from PyPI: the last release whose code imports
#                         on torch 2.11 (0.3.0 needs torch.distributed.fsdp.DataParallelMeshDims
#                         and other APIs newer than 2.11); its experiments/simple_fsdp is the
#                         simplefsdp system (benchmarks/torchtitan_systems.py)
#   tyro 1.0.17, docstring-parser 0.18.0, typeguard 4.6.1: what `import torchtitan` needs
#                         beyond the image (tyro: torchtitan.config; typeguard: tyro's
#                         requirement, needs typing-extensions >= 4.14.0, carried above).
#                         torchtitan's other requirements are not needed by SimpleFSDP
#                         (torchdata, datasets: its data loaders) or are on the image
#                         (tokenizers, fsspec, tensorboard, einops, pillow, triton)
#
# Already on the GPU image (KINDS.md, "Python packages already there"), so NOT fetched:
#   einops msgpack ninja numpy packaging psutil py-cpuinfo tqdm nvidia-ml-py scipy torch
#   tokenizers fsspec tensorboard pillow triton
#
# Then on the GPU machine: carry ".whl" and run benchmarks/install_offline.sh.
# Size: about 7.3 MiB (the device tool carries at most 64 MiB per call).
set -euo pipefail
cd "$(dirname "$0")/.."

DS_VERSION=${DS_VERSION:-0.19.8}
W=.whl
PLAT=(--python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
TT_VERSION=${TT_VERSION:-0.2.2}
DEPS=(hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
      typing-inspection==0.4.2 typing-extensions==4.15.0
      "torchtitan==$TT_VERSION" tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)

grep -qxF '/.whl/' .gitignore 2>/dev/null || grep -qxF '/.whl/' .git/info/exclude 2>/dev/null \
  || echo '/.whl/' >> .git/info/exclude

mkdir -p "$W/sdist"
echo "[fetch] dependencies: ${DEPS[*]}"
python3 -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$W" "${DEPS[@]}"

echo "[fetch] deepspeed==$DS_VERSION sdist"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$W/sdist" "deepspeed==$DS_VERSION"

if ! ls "$W"/deepspeed-"$DS_VERSION"-py3-none-any.whl >/dev/null 2>&1; then
  echo "[fetch] building a pure-Python deepspeed wheel (DS_BUILD_OPS=0; needs torch importable here)"
  DS_BUILD_OPS=0 DS_ACCELERATOR=cuda python3 -m pip wheel -q --no-deps --no-build-isolation \
    -w "$W" "$W/sdist/deepspeed-$DS_VERSION.tar.gz"
fi

# one version of each package, or the offline install stops
dups=$(ls "$W"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then echo "[fetch] ERROR: several versions of: $dups (remove the extra ones from $W)"; exit 1; fi
ls -la "$W" "$W/sdist"
du -sh "$W"
