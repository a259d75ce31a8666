#!/usr/bin/env bash
# Step time of graphcomp at two commits, alternated in one GPU call (issue 17: "W1/W2
# step times within noise of before, same run, before/after commits").
#
#   # here, once: export the earlier commit's tree next to this checkout (not committed;
#   # ignored by git, so carry it to the device machine)
#   bash benchmarks/before_after.sh --prepare 8af8e3a            # -> .before/ (git archive)
#   # on the device (run tool, carry [".before"]):
#   OUT=$OUT bash benchmarks/before_after.sh W1:2 W2:2
#
# For each RUN (WORKLOAD:NGPU) it runs the `graphcomp` system REPEAT times (default 2)
# in each tree, before and after alternating, each in its own process with the tree's
# own harness (`python -m benchmarks.run` from that tree, so each commit imports its own
# graphcomp), and writes <OUT>/before_after.md: the median step ms of every run. Each
# run is under `timeout`; a run that does not fit the budget (BUDGET_S, default 560) is
# skipped and said so.
#
# env: OUT (default ./before-after-out), BUDGET_S, WARMUP/STEPS (default 10/20), REPEAT,
#      SYSTEM (default graphcomp), BEFORE_DIR (default .before)
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd)
BEFORE_DIR=${BEFORE_DIR:-.before}

if [ "${1:-}" = "--prepare" ]; then
  rev=${2:?usage: before_after.sh --prepare COMMIT}
  sha=$(git rev-parse --short "$rev") || exit 1
  rm -rf "$BEFORE_DIR" && mkdir -p "$BEFORE_DIR"
  # the tree without its results (they are not needed to run it, and the carry limit is 64 MiB)
  git archive "$sha" | tar -x -C "$BEFORE_DIR" --exclude=benchmarks/results
  echo "$sha" > "$BEFORE_DIR/.commit"
  grep -qxF "/$BEFORE_DIR/" .git/info/exclude 2>/dev/null || echo "/$BEFORE_DIR/" >> .git/info/exclude
  echo "prepared $BEFORE_DIR at $sha ($(du -sh "$BEFORE_DIR" | cut -f1)); carry [\"$BEFORE_DIR\"] to the device"
  exit 0
fi

[ $# -ge 1 ] || { echo "usage: before_after.sh --prepare COMMIT | before_after.sh RUN [RUN...] (RUN = W1:2)" >&2; exit 2; }
[ -d "$BEFORE_DIR/graphcomp" ] || { echo "no $BEFORE_DIR/graphcomp: run --prepare first and carry $BEFORE_DIR" >&2; exit 2; }
OUT=${OUT:-./before-after-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BUDGET_S=${BUDGET_S:-560}; WARMUP=${WARMUP:-10}; STEPS=${STEPS:-20}; REPEAT=${REPEAT:-2}; SYSTEM=${SYSTEM:-graphcomp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
before_sha=$(cat "$BEFORE_DIR/.commit" 2>/dev/null || echo before)
after_sha=${BENCH_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo after)}
LOG="$OUT/before_after.log"
say() { echo "[before-after +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
ROWS="$OUT/rows.tsv"; : > "$ROWS"

one() {  # label tree workload ngpu i
  local label=$1 tree=$2 w=$3 n=$4 i=$5 left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt 90 ]; then say "SKIP $label $w:$n #$i: ${left}s left"; return; fi
  local res="$OUT/$label-$w-$n-$i"; mkdir -p "$res"
  say "$label ($( [ "$label" = before ] && echo "$before_sha" || echo "$after_sha")) $w:$n #$i"
  ( cd "$tree" && CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(( n - 1 ))) BENCH_GIT_COMMIT=$( [ "$label" = before ] && echo "$before_sha" || echo "$after_sha") \
      timeout -k 20 $(( left - 10 )) python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m benchmarks.run \
      --workload "$w" --warmup "$WARMUP" --steps "$STEPS" --systems "$SYSTEM" --out-dir "$res" --no-png ) >> "$LOG" 2>&1
  local ms
  ms=$(python3 - "$res" "$SYSTEM" <<'EOF'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/*.json"):
    m = json.load(open(f)).get("systems", {}).get(sys.argv[2], {}).get("metrics") or {}
    if m.get("step_time_ms_median") is not None:
        print(f"{m['step_time_ms_median']:.2f}\t{m.get('peak_mem_allocated_gib') or float('nan'):.2f}")
        raise SystemExit
print("failed\t-")
EOF
)
  printf '%s\t%s\t%s\t%s\n' "$w:$n" "$label" "$i" "$ms" >> "$ROWS"
  say "    -> $ms"
}

for run in "$@"; do
  W=${run%%:*}; N=${run##*:}
  for i in $(seq 1 "$REPEAT"); do
    one before "$BEFORE_DIR" "$W" "$N" "$i"
    one after "$HERE" "$W" "$N" "$i"
  done
done
{
  echo "# $SYSTEM step time before ($before_sha) and after ($after_sha), alternated in one call"
  echo
  echo "$(date -u +%FT%TZ) · $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) · warmup $WARMUP + $STEPS measured steps per run"
  echo
  echo "| run | tree | repeat | median step ms | peak alloc GiB |"
  echo "|---|---|---|---|---|"
  awk -F'\t' '{printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5}' "$ROWS"
} > "$OUT/before_after.md"
cat "$OUT/before_after.md"
