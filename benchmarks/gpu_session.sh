#!/usr/bin/env bash
# One GPU session of benchmarks inside a time budget; results under $OUT.
#
#   bash benchmarks/gpu_session.sh                 # runs W1:2 W2:4 W1:1 W2:2, most important first
#   bash benchmarks/gpu_session.sh W1:1 W1:2       # RUN = WORKLOAD:NGPU, in the order given
#   bash benchmarks/gpu_session.sh hf-llama,hf-gpt2:2 hf-all:2   # several workloads, one process each RUN
#
# Every run is `torchrun --nproc-per-node NGPU -m benchmarks.run` inside `timeout`, with
# the time left of BUDGET_S; a run that no longer fits is skipped (said so), and a run
# cut short keeps the systems it finished (the JSON is rewritten after each system).
#
# env:
#   OUT               where results land (the device tool sets it; default: benchmarks/results)
#   BUDGET_S          seconds for the whole call (default 540, under the tool's 600 s per command)
#   WARMUP, STEPS     warmup and measured steps (default 10 and 20)
#   SYSTEMS           systems for every run (default: per run, below)
#   ABLATION=1        add the graphcomp per-pass ablation to W1 runs on 2 GPUs
#   PROFILE=0         no profiler idle share (default: 3 extra profiled steps per system)
#   TRACE=sys1,sys2   also write rank 0's Chrome trace of the profiled steps for these systems
#   TRACE_RANKS=0,1   the ranks whose traces TRACE writes (default 0; rank R > 0 files end -rankR)
#   HF_SIZE           hf-* runs: --hf-size (default: the workloads' own, small)
#   TP                tensor-parallel degree for every run (--tp; default 1): W2:2 with TP=2 is
#                     graphcomp vs FSDP2 + TP + compile on a (1, 2) mesh
#   FRESH_CACHE=1     every system compiles with an empty Inductor cache (--fresh-cache: cold compile)
#   MEMORY_CAP        GiB per GPU for every system (--memory-cap; graphcomp gets it as memory_budget)
#   STACKS=S          sample rank 0's main-thread stack every S seconds (benchmarks/stack_sampler) into
#                     stacks/ beside the results; `python -m benchmarks.stack_summary FILE` reads one
#   BENCH_GIT_COMMIT  the commit to record (the GPU machine's copy has no .git)
#   BENCH_NGPU        pretend this many GPUs (dry run on a CPU machine: smoke:2 runs on gloo)
#
# With $OUT set: raw results go to /tmp/bench_results and $OUT gets three files, kept
# current after every run: bench_results.tgz (every .json/.md/.png), summary.md (all
# tables) and session.log.
set -uo pipefail
cd "$(dirname "$0")/.."

T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
WARMUP=${WARMUP:-10}
STEPS=${STEPS:-20}
PROFILE=${PROFILE:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

if [ -n "${OUT:-}" ]; then RES=${BENCH_RES:-/tmp/bench_results}; else OUT=benchmarks/results; RES=$OUT; fi
mkdir -p "$OUT" "$RES"
OUT=$(cd "$OUT" && pwd); RES=$(cd "$RES" && pwd)
LOG="$OUT/session.log"

say() { echo "[session +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

# Rough seconds per system on H200 (compile dominates; guesses until a first session
# measures them: each run prints "system=X done in N s", use those to update this table)
est() {
  case "$1:$2" in
    W1:fsdp2) echo 15 ;;        W2:fsdp2) echo 25 ;;
    W1:fsdp2_compile) echo 45 ;; W2:fsdp2_compile) echo 60 ;;
    W1:ddp) echo 10 ;;          W2:ddp) echo 20 ;;
    W1:ddp_compile) echo 60 ;;  W2:ddp_compile) echo 80 ;;
    W1:inductor) echo 60 ;;     W2:inductor) echo 80 ;;
    W1:graphcomp*) echo 60 ;;   W2:graphcomp*) echo 95 ;;   # 2xH100, eighth session: W1 47-54 s, W2 61-96 s per row
    W3:graphcomp*|W3c:graphcomp*) echo 240 ;;  W3:fsdp2_compile*) echo 180 ;;  # guesses: cold compile 115-123 s (issue 14) + ~1 s steps
    W1:deepspeed_z3) echo 30 ;; W2:deepspeed_z3) echo 45 ;;
    W1:deepcompile) echo 150 ;; W2:deepcompile) echo 180 ;;  # + ~60 s JIT build of its op, first time
    W1:simplefsdp) echo 90 ;;   W2:simplefsdp) echo 130 ;;  # guesses: one Inductor compile of the whole model
    *:graph_trainer) echo 2 ;;                               # reports "not run" (torchtitan_systems.py)
    hf-*:graphcomp*) echo 60 ;; hf-*:fsdp2_compile) echo 20 ;; hf-*:fsdp2) echo 12 ;;
    hf-*:ddp_compile|hf-*:inductor) echo 40 ;; hf-*:ddp) echo 12 ;;
    *) echo 60 ;;
  esac
}

# number of workloads in a RUN's WORKLOAD part (a comma list; hf-all = every hf-* workload)
n_workloads() {
  local n=0 w
  for w in ${1//,/ }; do
    if [ "$w" = "hf-all" ]; then n=$(( n + $(python3 -c 'from benchmarks import hf_models; print(len(hf_models.FAMILIES))' 2>/dev/null || echo 8) ))
    else n=$(( n + 1 )); fi
  done
  echo "$n"
}

default_systems() {
  case "$1:$2" in
    W1:1) echo "graphcomp,inductor" ;;
    W1:2) echo "graphcomp,graphcomp-pieces,fsdp2_compile,fsdp2,ddp_compile,simplefsdp,graph_trainer,deepspeed_z3,deepcompile" ;;
    W2:2) echo "graphcomp,fsdp2_compile,ddp_compile,simplefsdp,graph_trainer,deepcompile" ;;
    W3:*|W3c:*) echo "graphcomp,fsdp2_compile,fsdp2_compile-noac" ;;  # BENCHMARKS.md: fsdp2_compile with and without checkpointing
    hf-*:1) echo "graphcomp,inductor" ;;
    hf-*) echo "graphcomp,fsdp2_compile,fsdp2" ;;
    *)    echo "graphcomp,fsdp2_compile,fsdp2,ddp_compile,simplefsdp,deepspeed_z3,deepcompile" ;;
  esac
}

pack() {
  [ "$RES" = "$OUT" ] && return 0
  ( cd "$RES" && tar czf "$OUT/bench_results.tgz.tmp" . ) 2>/dev/null \
    && mv "$OUT/bench_results.tgz.tmp" "$OUT/bench_results.tgz"
  cat "$RES"/*.md > "$OUT/summary.md" 2>/dev/null || true
}

# ---------------------------------------------------------------- environment
NGPU=${BENCH_NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}
say "GPUs: $NGPU; budget ${BUDGET_S}s; warmup $WARMUP + $STEPS measured steps; results -> $RES"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | head -8 | tee -a "$LOG"
if [ -d .whl ]; then
  if bash benchmarks/install_offline.sh >>"$LOG" 2>&1; then
    export PYTHONPATH="${BENCH_SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}"
    say "DeepSpeed installed offline from .whl ($(python3 -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null)); torchtitan $(python3 -c 'import torchtitan; print(torchtitan.__version__)' 2>/dev/null || echo 'NOT importable')"
  else
    say "DeepSpeed offline install FAILED (see session.log); deepspeed systems will report 'not run'"
  fi
else
  say "no .whl/ carried: deepspeed and simplefsdp systems will report 'not run' (see benchmarks/README.md)"
fi

if [ -n "${STACKS:-}" ]; then
  export STACKS_DIR="$RES/stacks" STACKS_S="$STACKS" PYTHONPATH="$PWD/benchmarks/stack_sampler${PYTHONPATH:+:$PYTHONPATH}"
  say "sampling rank 0's stack every ${STACKS}s into $STACKS_DIR"
fi

RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=(W1:2 W2:4 W1:1 W2:2)

# ---------------------------------------------------------------- runs
for run in "${RUNS[@]}"; do
  W=${run%%:*}; N=${run##*:}
  if [ "$N" -gt "$NGPU" ]; then say "SKIP $run: needs $N GPUs, this machine has $NGPU"; continue; fi
  S=${SYSTEMS:-$(default_systems "$W" "$N")}
  if [ "${ABLATION:-0}" = "1" ] && [ "$W:$N" = "W1:2" ]; then S="$S,graphcomp-ablation"; fi
  total=25
  NW=$(n_workloads "$W")
  say "run $run systems=$S; estimated seconds per system$([ "$NW" -gt 1 ] && echo " and workload, x $NW workloads"):"
  for s in ${S//,/ }; do e=$(est "$W" "$s"); total=$(( total + NW * e )); say "    $s ~${e}s"; done
  L=$(left)
  say "    estimated total ~${total}s (25 s start-up); time left ${L}s"
  if [ "$L" -lt 60 ]; then say "SKIP $run: under 60 s left"; continue; fi
  [ "$total" -gt "$L" ] && say "    WARNING: may not fit; systems finished before the timeout are kept"
  devs=$(seq -s, 0 $(( N - 1 )))
  extra=()
  [ "$PROFILE" = "1" ] && extra+=(--profile --profile-steps 3)
  [ "$PROFILE" = "1" ] && [ -n "${TRACE:-}" ] && extra+=(--trace "$TRACE" --trace-ranks "${TRACE_RANKS:-0}")
  [ -n "${HF_SIZE:-}" ] && [[ "$W" == hf-* ]] && extra+=(--hf-size "$HF_SIZE")
  [ "${TP:-1}" -gt 1 ] && extra+=(--tp "$TP")
  [ "${FRESH_CACHE:-0}" = "1" ] && extra+=(--fresh-cache)
  [ -n "${MEMORY_CAP:-}" ] && extra+=(--memory-cap "$MEMORY_CAP")
  CUDA_VISIBLE_DEVICES=$devs timeout -k 20 $(( L - 10 )) \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$N" -m benchmarks.run \
      --workload "$W" --warmup "$WARMUP" --steps "$STEPS" --systems "$S" --out-dir "$RES" \
      --log-every 10 --tag "w${WARMUP}s${STEPS}${MEMORY_CAP:+-cap$MEMORY_CAP}" "${extra[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && say "run $run hit the time limit (rc $rc): partial results kept"
  say "run $run finished rc=$rc"
  pack
done
pack
say "done; $(ls "$RES" | wc -l) files in $RES$([ "$RES" != "$OUT" ] && echo ", packed into $OUT/bench_results.tgz")"
