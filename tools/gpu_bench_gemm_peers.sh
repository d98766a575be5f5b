#!/usr/bin/env bash
# One device call (<= 9 min on an H100, compiles included): the grouped GEMMs against their
# peers in one run -- bf16 torch._grouped_mm, torchao 0.18's FP8-rowwise MoE training op and
# moe_mxfp8 (1x128) -- kernel only and incl. quantization, with the ceilings measured first,
# then every 1x128 Hopper kernel configuration forced in turn at the Qwen3 shapes.
# Here, once:  bash tools/make_devwheels.sh   (torchao into .devwheels/, 0.7 MiB)
#   run  carry=[".devsite", ".devwheels"]  timeout_s=540  command: bash tools/gpu_bench_gemm_peers.sh
#   (where the two and the tree pass the 64 MiB a call carries, carry ".devwheels" alone on a
#   machine still warm from a call that carried ".devsite": it keeps that folder)
# Out: $OUT/peers.md + peers.json (everything), ceilings.json, gpu.txt and steps.tar.gz (per
# step peers_<shape>.json, sweep_<shape>.json and the logs log_*.txt). Each step is its own
# process under a time limit cut to what is left of BUDGET_S, so a slow step costs the later
# ones, never the report.
# Env: SHAPES (default "dsv3 qwen3 mixtral mixtral_down"), SWEEP_SHAPES (default "qwen3", ""
# skips the sweep), BUDGET_S (default 500), REPS / ROUNDS (default 10 / 5), ROUTING (balanced).
set -uo pipefail
T0=$SECONDS
BUDGET_S=${BUDGET_S:-500}
source tools/device_env.sh || exit 1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

# torchao: Python + Triton only (its CUDA extensions are neither carried nor loaded)
TAO=/tmp/torchao
if [ ! -d "$TAO/torchao" ]; then
  tarball=$(ls .devwheels/torchao-*.tar.xz 2>/dev/null | head -1)
  wheel=$(ls .devwheels/torchao-*.whl 2>/dev/null | head -1)
  if [ -n "$tarball" ]; then mkdir -p "$TAO" && tar -xJf "$tarball" -C "$TAO"
  elif [ -n "$wheel" ]; then python -m pip install -q --no-deps --target "$TAO" "$wheel"
  else echo "no torchao in .devwheels/ (bash tools/make_devwheels.sh): its rows are skipped"; fi
fi
export PYTHONPATH="$TAO:$PYTHONPATH" TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1

BENCH="python -m benchmarks.bench_grouped_gemm --reps ${REPS:-10} --rounds ${ROUNDS:-5} --routing ${ROUTING:-balanced}"
MERGE_S=25  # kept back for the final report
# step NAME MAX_S CMD...: CMD under min(MAX_S, what is left), its output in log_NAME.txt
step() {
  local name=$1 max=$2; shift 2
  local left=$(( BUDGET_S - (SECONDS - T0) - MERGE_S ))
  local lim=$(( max < left ? max : left ))
  if [ "$lim" -lt 20 ]; then echo "== $name: skipped (${left}s left)"; return; fi
  echo "== $name (limit ${lim}s, t=$(( SECONDS - T0 ))s)"
  local t=$SECONDS
  timeout --kill-after=10 "$lim" "$@" > "$OUT/log_$name.txt" 2>&1
  echo "   rc=$? in $(( SECONDS - t ))s"
  grep -E "FAILED|Error|error:|torchao:" "$OUT/log_$name.txt" | grep -v "Warn" | head -5
}

step ceilings 60 python -m benchmarks.ceilings --json "$OUT/ceilings.json"
CEIL=""; [ -f "$OUT/ceilings.json" ] && CEIL="--ceilings-json $OUT/ceilings.json"
# the headline shape first, then the small experts and their sweep, then mixtral
# (a sweep runs right after its shape's peers step; limits: the first process also compiles
# torchao's autotuned Triton kernels, ~36 configurations)
lim=170
for sh in ${SHAPES-dsv3 qwen3 mixtral mixtral_down}; do
  step "peers_$sh" $lim $BENCH --peers --shapes "$sh" $CEIL --json "$OUT/peers_$sh.json"
  for sw in ${SWEEP_SHAPES-qwen3}; do
    if [ "$sw" = "$sh" ]; then
      step "sweep_$sw" 150 $BENCH --sweep-configs --shapes "$sw" --json "$OUT/sweep_$sw.json"
    fi
  done
  lim=120
done

echo "== report (t=$(( SECONDS - T0 ))s)"
parts=()  # in the order the shapes ran
for sh in ${SHAPES-dsv3 qwen3 mixtral mixtral_down}; do
  for f in "$OUT/peers_$sh.json" "$OUT/sweep_$sh.json"; do [ -f "$f" ] && parts+=("$f"); done
done
[ ${#parts[@]} -gt 0 ] && timeout 30 python -m benchmarks.bench_grouped_gemm --merge "${parts[@]}" \
  $CEIL --json "$OUT/peers.json" --md "$OUT/peers.md" > /dev/null 2> "$OUT/log_report.txt"
cat "$OUT/peers.md" 2>/dev/null || { echo "no report"; tail -20 "$OUT"/log_*.txt; }
# at most 8 files come back from the device: the per-step JSON and logs as one archive, next to
# the report, the merged JSON, the ceilings and the GPU line
(cd "$OUT" && tar -czf steps.tar.gz log_*.txt peers_*.json sweep_*.json 2>/dev/null \
  && rm -f log_*.txt peers_*.json sweep_*.json)
echo "== done in $(( SECONDS - T0 ))s"
