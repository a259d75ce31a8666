#!/usr/bin/env bash
# One GPU session: the GPU tests that matter now, logs and JSON under $OUT (or ./gpu-out).
#   bash tests/gpu/session.sh [zoo,zoob,cudagraphs,sharding,...]      (default: zoo,zoob,cudagraphs)
# Every step runs under its own timeout; a failing step does not stop the next one.
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "[session] pip install -e . failed"
{
  echo "commit ${BENCH_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} dirty=$(git status --porcelain 2>/dev/null | wc -l) (the device copy's git metadata can lag its tree: pass BENCH_GIT_COMMIT)"
  nvidia-smi -L
  python -c "import torch, transformers; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/env.txt"
STEPS=${1:-zoo,zoob,cudagraphs}
# the smoke check first (about 15 s): a broken capture path would fail every step
if [ "${SMOKE:-1}" = 1 ]; then
  t0=$SECONDS
  if ! timeout 180 python tests/gpu/smoke.py "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1; then
    echo "[session] smoke FAILED in $((SECONDS - t0)) s: nothing else runs (SMOKE=0 skips the check)"
    tail -n 40 "$OUT/smoke.log"
    exit 1
  fi
  echo "[session] smoke ok in $((SECONDS - t0)) s"
fi
run() {  # name timeout_s cmd...
  local name=$1 t=$2; shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return ;; esac
  echo "[session] $name (timeout ${t}s): $*"
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "[session] $name rc=$? in $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
}
# the zoo in two halves of benchmarks/hf_models.py's FAMILIES (test_hf_zoo_gpu.HALVES), one device call each
ZOO_A=$(python -c "import sys; sys.path.insert(0, 'tests/gpu'); from test_hf_zoo_gpu import HALVES; print(','.join(HALVES[0]))")
ZOO_B=$(python -c "import sys; sys.path.insert(0, 'tests/gpu'); from test_hf_zoo_gpu import HALVES; print(','.join(HALVES[1]))")
GC_ZOO_FAMILIES=$ZOO_A GC_ZOO_OUT="$OUT/zoo" run zoo ${ZOO_T:-330} python -m pytest -q -p no:cacheprovider tests/gpu/test_hf_zoo_gpu.py -k 1gpu
GC_ZOO_FAMILIES=$ZOO_B GC_ZOO_OUT="$OUT/zoob" run zoob ${ZOO_T:-330} python -m pytest -q -p no:cacheprovider tests/gpu/test_hf_zoo_gpu.py -k 1gpu
GC_ZOO_FAMILIES=$ZOO_A GC_ZOO_OUT="$OUT/zoo2" run zoo2 ${ZOO_T:-330} python -m pytest -q -p no:cacheprovider tests/gpu/test_hf_zoo_gpu.py -k "2gpu and not exchange and not deep"
GC_ZOO_FAMILIES=$ZOO_B GC_ZOO_OUT="$OUT/zoo2b" run zoo2b ${ZOO_T:-330} python -m pytest -q -p no:cacheprovider tests/gpu/test_hf_zoo_gpu.py -k "2gpu and not exchange and not deep"
GC_ZOO_OUT="$OUT/deep2" run deep2 ${DEEP2_T:-400} python -m pytest -q -p no:cacheprovider tests/gpu/test_hf_zoo_gpu.py -k deep
GC_ZOO_OUT="$OUT/exch2" run exch2 ${EXCH2_T:-240} python -m pytest -q -p no:cacheprovider tests/gpu/test_hf_zoo_gpu.py -k exchange
run cudagraphs ${CG_T:-480} python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py
run cg2 ${CG2_T:-240} python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k "2] and not compile_regions"
run sharding 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_sharding_nccl.py
run capfail 120 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k "capture_failure or item_model"
run bn 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k batchnorm
run upcast 150 python -m pytest -q -p no:cacheprovider -s tests/gpu/test_grad_upcast_gpu.py
GRAPHCOMP_LOG=INFO GRAPHCOMP_GPU_RESULTS="$OUT" run regions2 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k compile_regions
GRAPHCOMP_GPU_RESULTS="$OUT" run defer2 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k defer_weight_grads
GRAPHCOMP_GPU_RESULTS="$OUT" run avg2 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k avg_reduce_scatter
GRAPHCOMP_GPU_RESULTS="$OUT" run exchange2 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k embedding_auto
GRAPHCOMP_GPU_RESULTS="$OUT" run prefetch2 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k cross_step_prefetch
run ckpt 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k checkpointed
GRAPHCOMP_GPU_RESULTS="$OUT" run optim1 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_optim_gpu.py -k 1gpu
GRAPHCOMP_GPU_RESULTS="$OUT" run clipfold 240 python -m pytest -q -p no:cacheprovider -s tests/gpu/test_clip_fold_gpu.py
GRAPHCOMP_GPU_RESULTS="$OUT" run optim2 ${OPT2_T:-150} python -m pytest -q -p no:cacheprovider tests/gpu/test_optim_gpu.py -k "torchrun and 2"
GRAPHCOMP_GPU_RESULTS="$OUT" run optimw1 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_optim_gpu.py -k w1
run chunk 240 python -m pytest -q -p no:cacheprovider -s tests/gpu/test_chunk_lm_loss_gpu.py
run memory 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k memory
GRAPHCOMP_GPU_RESULTS="$OUT" run soak 560 python -m pytest -q -p no:cacheprovider "tests/gpu/test_soak_gpu.py::test_soak_1000_steps_varying_lengths[1]"
GRAPHCOMP_GPU_RESULTS="$OUT" run ranklocal2 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_soak_gpu.py -k different_steps
# (soak: the test's own limit is GC_SOAK_TIMEOUT, default 540 s; keep SOAK*_T above it)
GRAPHCOMP_GPU_RESULTS="$OUT" run soak2 ${SOAK2_T:-560} python -m pytest -q -p no:cacheprovider "tests/gpu/test_soak_gpu.py::test_soak_1000_steps_varying_lengths[2]"
GRAPHCOMP_GPU_RESULTS="$OUT" run trainer ${TRAINER_T:-600} python -m pytest -q -p no:cacheprovider tests/gpu/test_hf_trainer_gpu.py
GRAPHCOMP_GPU_RESULTS="$OUT" run diverge 300 python -m pytest -q -p no:cacheprovider tests/gpu/test_divergence_gpu.py
GRAPHCOMP_GPU_RESULTS="$OUT" run wholestep ${WS_T:-540} python -m pytest -q -p no:cacheprovider tests/gpu/test_step_capture_gpu.py
GRAPHCOMP_GPU_RESULTS="$OUT" run tp ${TP_T:-600} python -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py -k tp2
GRAPHCOMP_GPU_RESULTS="$OUT" run tp4 ${TP4_T:-600} python -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py -k 2x2
for z in zoo zoob zoo2 zoo2b exch2 deep2; do [ -d "$OUT/$z" ] && tar czf "$OUT/$z.tgz" -C "$OUT" "$z" && rm -rf "$OUT/$z"; done
# the device tool returns a limited number of files: one archive for the JSON and the archives
( cd "$OUT" && f=$(ls *.json *.tgz 2>/dev/null; true) && [ -n "$f" ] && tar czf results.tar.gz $f && rm -f $f )
ls -la "$OUT"
