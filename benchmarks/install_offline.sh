#!/usr/bin/env bash
# On the GPU machine (no network): install the wheels that benchmarks/fetch_wheels.sh
# put in .whl/ (DeepSpeed, torchtitan and their missing dependencies) into a separate
# folder (default /tmp/site), without touching the image's own packages.
# Afterwards:  export PYTHONPATH=/tmp/site:$PYTHONPATH
#
#   bash benchmarks/install_offline.sh            # install + import check
#   DS_PREBUILD_DC=1 bash benchmarks/install_offline.sh
#                                                 # also JIT-build DeepCompile's "dc" op now
#                                                 # (~1 min with ninja; cached in
#                                                 # ~/.cache/torch_extensions for later runs)
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=${BENCH_SITE:-/tmp/site}
W=.whl
if [ ! -d "$W" ]; then
  echo "[install] no $W/ here: run benchmarks/fetch_wheels.sh on a networked machine and carry .whl"; exit 1
fi

if ! ls "$W"/deepspeed-*.whl >/dev/null 2>&1; then
  # only the sdist came along: build it here, offline (pure Python with DS_BUILD_OPS=0)
  echo "[install] building deepspeed from $W/sdist (DS_BUILD_OPS=0, offline)"
  DS_BUILD_OPS=0 DS_ACCELERATOR=cuda python3 -m pip wheel -q --no-index --no-deps --no-build-isolation \
    -w "$W" "$W"/sdist/deepspeed-*.tar.gz
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$W"/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import deepspeed, pydantic, torch; print(f'[install] deepspeed {deepspeed.__version__}, pydantic {pydantic.__version__}, torch {torch.__version__} (from $SITE)')"
# torchtitan's SimpleFSDP (the simplefsdp system); not fatal: the system reports the reason itself
python3 -c "import torchtitan; from torchtitan.experiments.simple_fsdp import simple_fsdp, backend; print(f'[install] torchtitan {torchtitan.__version__}: experiments.simple_fsdp imports')" \
  || echo "[install] torchtitan's SimpleFSDP does NOT import (simplefsdp will report 'not run' with the reason)"

if [ "${DS_PREBUILD_DC:-0}" = "1" ]; then
  t0=$(date +%s)
  python3 -c "from deepspeed.ops.op_builder import DeepCompileBuilder; DeepCompileBuilder().load()" \
    && echo "[install] DeepCompile op built in $(( $(date +%s) - t0 )) s" \
    || echo "[install] DeepCompile op build FAILED (deepcompile will report it)"
fi
echo "export PYTHONPATH=$PYTHONPATH"
