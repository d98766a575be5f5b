#!/usr/bin/env bash
# The device runner: one call runs the named suites in order, each under its own time limit (a
# slow suite cannot hide the others' results); logs and JSON land in $OUT (default /tmp/out).
#   run  carry=[".devsite"]  command: bash tools/gpu.sh gemm layer   (a call holds ~600 s)
#   run  kind="nvidia-h100-x4"  carry=[".devsite"]  command: bash tools/gpu.sh ep
# Suites (benchmarks print the GPU, and measure their baselines in the same process):
#   gemm layer datapath quant rest  the GPU tests (pytest -m gpu), feature by feature (each
#                     suite fits one call: layer and datapath about 250 s each, quant about 360 s
#                     on an H100, 2026-11-27); `tests` = all five
#   bench-quant       quantizer kernels vs copy and torch.compile, then both recipes side by side
#   bench-gemm        grouped GEMMs vs bf16 torch._grouped_mm and fp8 rowwise, per shape
#   bench-layer       MXFP8MoE vs its BF16 twin, both recipes: time, per-phase time, host time,
#                     peak memory, determinism
#   bench-rowkernels  the 1x128 data-path row kernels at other tilings, with their ceilings
#   first-step        a second process's first forward+backward against the BF16 twin's
#   ep                expert parallelism over NCCL: tests at EP = 1, 2, 4 as the GPUs allow, then
#                     the all-to-all and step timing at each P (benchmarks.bench_ep)
#   parity            the GPU parity preset (train_example.parity --preset gpu)
#   determinism       one forward+backward twice, bitwise, at the three benchmark shapes
#   tune-gemm         the Hopper GEMM's tuning sweep (benchmarks.tune_grouped_gemm_sm90)
#   ncu-gemm          Nsight Compute of one warm Hopper GEMM launch (fprop and wgrad, 1x128;
#                     NCU_OPS="wgrad:1 wgrad": the wgrad with per-feature activation scales,
#                     then with 128 x 128 tiles)
#   ncu-rowkernels    Nsight Compute of the 1x128 SwiGLU kernels
#   bench-peers       grouped GEMMs vs bf16 and torchao's FP8-rowwise op, incl. quantization
#                     (tools/gpu_bench_gemm_peers.sh; carry ".devwheels" too)
#   host-time         the layer's host time per step and the weight cache (tools/gpu_host_time.sh)
#   parity-seeds      the multi-seed parity protocol (tools/gpu_parity_seeds.sh)
#   several-gpus      two GPUs: a layer on cuda:1, FSDP2 over NCCL (tests, 2+ GPUs)
# Env: OUT; LIMIT (seconds per suite, else the suite's default); SHAPES (benchmark shapes, comma
# separated); GEMM_MODES (bench-gemm, default 1x128); PARITY_ARGS (default --bf16-repeat 1); NCU_OPS;
# WORKERS (pytest-xdist processes for the test suites, where the image has xdist; default 6 for
# the single-process suites gemm, layer, datapath and quant, which then take 40-80 s each on an
# H100 instead of running past their limits; 0 turns it off).
set -uo pipefail
[ $# -gt 0 ] || { sed -n '2,34p' "$0"; exit 2; }
source tools/device_prelude.sh name,driver_version,clocks.max.sm
python -c "import torch; print('torch', torch.__version__)"
SHAPES=${SHAPES:-dsv3,mixtral,qwen3}
FILTER="Warn\|range_constexpr"  # CuTeDSL's compile-time notes

declare -A TESTS=(
  [gemm]="tests/kernels/test_grouped_gemm.py tests/kernels/test_grouped_gemm_sm90.py tests/test_1x128_recipe.py tests/kernels/test_grouped_gemm_sm100.py tests/kernels/test_selfcheck.py tests/test_bench_grouped_gemm.py"
  [layer]="tests/test_routing_kernels.py tests/test_router.py tests/test_moe.py tests/test_autograd.py tests/test_auto_scale_blocks.py"
  [datapath]="tests/test_quantizer_stages.py tests/test_datapath.py tests/test_grouped_experts.py tests/test_swiglu_kernels.py tests/test_host_path.py tests/kernels/test_align_k_groups.py tests/test_weight_cache.py"
  [quant]="tests/kernels/test_quantize_kernels.py tests/test_domain.py"
  [rest]="tests/test_fsdp_mxfp8.py tests/test_compile_cache.py tests/test_expert_parallel.py tests/test_module_object.py tests/test_checkpoint.py tests/test_errors_and_backend.py tests/test_hf.py"
  [several-gpus]="tests/test_device_placement.py tests/test_fsdp.py tests/test_expert_parallel.py"
)
declare -A LIMITS=([gemm]=240 [layer]=300 [datapath]=300 [quant]=400 [rest]=180 [bench-quant]=300
  [bench-gemm]=360 [bench-layer]=220 [bench-rowkernels]=270 [first-step]=85 [ep]=540
  [parity]=420 [determinism]=200 [several-gpus]=400 [tune-gemm]=400 [ncu-gemm]=240 [ncu-rowkernels]=240)

limit() { echo "${LIMIT:-${LIMITS[$1]}}"; }

run_tests() {  # suite
  local xdist="" workers=${WORKERS:-}
  case "$1" in gemm|layer|datapath|quant) workers=${workers:-6} ;; esac
  [ -n "$workers" ] && [ "$workers" != 0 ] && python -c "import xdist" 2>/dev/null \
    && xdist="-n $workers"
  # shellcheck disable=SC2086
  timeout "$(limit "$1")" python -m pytest -q -m gpu -p no:cacheprovider -rfE $xdist \
    ${TESTS[$1]} > "$OUT/tests_$1.txt" 2>&1
  echo "rc=$?"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests_$1.txt" | tail -15
}

bench_gemm() {
  local per=$(( $(limit bench-gemm) / 3 ))
  for sh in ${SHAPES//,/ }; do
    timeout "$per" python -m benchmarks.bench_grouped_gemm --shapes "$sh" \
      --ops fprop,dgrad,wgrad16 --modes "${GEMM_MODES:-1x128}" --reps 10 --rounds 3 \
      --json "$OUT/gemm_$sh.json" 2>&1 | grep -v "$FILTER" | tee -a "$OUT/gemm.txt"
  done
}

first_step() {  # benchmarks.first_step, one process per row (caches filled by the first)
  local w; w=$(mktemp -d)
  local start=$EPOCHSECONDS deadline
  deadline=$(limit first-step)
  # The bytecode cache a pip install writes once (an image without one compiles every module
  # from source in every process: the last row measures that).
  export MOE_MXFP8_CACHE_DIR=$w/kernels TRITON_CACHE_DIR=$w/triton PYTHONPYCACHEPREFIX=$w/pyc
  unset PYTHONDONTWRITEBYTECODE
  probe() {  # name timeout steps [env...]  (skipped when less than half its timeout is left)
    local name=$1 want=$2 steps=$3 t; shift 3
    t=$((deadline - (EPOCHSECONDS - start))); ((t > want)) && t=$want
    if ((2 * t < want)); then echo "== $name skipped (no time left)"; return; fi
    env "$@" timeout "$t" python -m benchmarks.first_step "$steps" --json "$w/$name.json" \
      > "$w/$name.out" 2> "$w/$name.err" || { echo "$name failed rc=$?"; tail -5 "$w/$name.err"; }
  }
  probe fill 55 cuda,layer,precompile,mxfp8,bf16
  probe mxfp8 20 cuda,layer,mxfp8,mxfp8_2
  probe bf16 15 cuda,layer,bf16,bf16_2
  probe mxfp8+opt 15 cuda,layer,optim,mxfp8
  probe bf16+opt 15 cuda,layer,optim,bf16
  probe "mxfp8 nopyc" 28 cuda,layer,mxfp8 PYTHONDONTWRITEBYTECODE=1 PYTHONPYCACHEPREFIX="$w/none"
  python -m benchmarks.first_step --table "$w" 2>&1 | tee "$OUT/first_step.txt"
}

ep() {
  local ngpu; ngpu=$(nvidia-smi -L | wc -l)
  timeout $(( $(limit ep) * 2 / 5 )) python -m pytest -q -m gpu -s -p no:cacheprovider \
    tests/test_expert_parallel.py > "$OUT/tests_ep.txt" 2>&1
  echo "rc=$?"; grep -E "passed|failed|host sync|FAILED|ERROR" "$OUT/tests_ep.txt" | tail -15
  for p in 1 2 4; do
    [ "$p" -le "$ngpu" ] || continue
    echo "-- P = $p"
    # world size 1: the EP path's own overhead (NCCL loopback) at 8192 tokens
    local tokens=""; [ "$p" = 1 ] && tokens="--tokens ${EP_TOKENS:-8192}"
    # shellcheck disable=SC2086
    timeout $(( $(limit ep) / 5 )) torchrun --nproc-per-node "$p" -m benchmarks.bench_ep \
      --shapes "${EP_SHAPES:-qwen3,dsv3}" $tokens --profile --json "$OUT/ep_$p.json" 2>&1 \
      | grep -v "^W1" | tee "$OUT/ep_$p.txt"
  done
}

parity() {
  rm -rf /tmp/parity
  timeout "$(limit parity)" python -m train_example.parity --device cuda --preset gpu \
    ${PARITY_ARGS:---bf16-repeat 1} --out /tmp/parity 2>&1 | tr '\r' '\n' \
    | grep -v "^step\|^ *$" | tail -40 | tee "$OUT/parity.txt"
  # one archive: the runs' logs, loss.csv/png and summary.json (checkpoints left out)
  (cd /tmp/parity && tar -czf "$OUT/parity.tar.gz" --exclude='*.safetensors' --exclude='*.pt' .)
}

determinism() {  # tokens D H E k of bench_moe_layer's dsv3, mixtral, qwen3
  for s in "65536 7168 2048 8 2" "16384 4096 14336 8 2" "16384 2048 768 128 8"; do
    read -r t d h e k <<< "$s"
    timeout $(( $(limit determinism) / 3 )) python -m benchmarks.determinism --tokens "$t" \
      --dim "$d" --hidden "$h" --experts "$e" --top-k "$k" 2>&1 | grep -v "$FILTER"
  done | tee "$OUT/determinism.txt"
}

ncu_gemm() {
  local m='sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed'
  m="$m,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed"
  m="$m,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum"
  m="$m,smsp__inst_executed.sum"
  m="$m,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  # NCU_OPS: "op[:act_rows]" ... (wgrad:1 = the activation operand with per-feature scales)
  for spec in ${NCU_OPS:-fprop wgrad}; do
    local op=${spec%%:*} rows=128; [ "$spec" != "$op" ] && rows=${spec#*:}
    timeout $(( $(limit ncu-gemm) / 3 )) ncu --clock-control none --launch-skip 1 \
      --launch-count 1 -k regex:GroupedGemm --metrics "$m" python tools/ncu_gemm.py "$op" \
      --act-rows "$rows" > "$OUT/ncu_gemm_${op}_$rows.txt" 2>&1
    echo "-- $op act_rows $rows rc=$?"
    grep -E "GroupedGemm|pct|ratio|duration|inst_executed" "$OUT/ncu_gemm_${op}_$rows.txt" \
      | awk '$NF+0 > 0.05 || /GroupedGemm|pct|duration|inst_executed/' | head -40
  done
}

ncu_rowkernels() {
  local m='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
  m="$m,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum"
  m="$m,smsp__issue_active.avg.pct_of_peak_sustained_active"
  m="$m,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread"
  m="$m,launch__occupancy_limit_registers,smsp__inst_executed.sum"
  timeout "$(limit ncu-rowkernels)" ncu --clock-control none -k "regex:_swiglu_(fwd|bwd)_kernel" \
    --metrics "$m" python -m benchmarks.bench_rowkernels --once --kernels swiglu --variants tile \
    --shapes mixtral > "$OUT/ncu_rowkernels.txt" 2>&1
  echo "rc=$?"
  grep -E "_kernel|\.ratio|pct|duration|registers|occupancy|inst_executed" \
    "$OUT/ncu_rowkernels.txt" | awk '$NF+0 > 0.05 || /kernel|pct|duration|registers/' | head -80
}

for suite in "$@"; do
  echo "== $suite ($(date -u +%T))"
  case $suite in
    gemm|layer|datapath|quant|rest|several-gpus) run_tests "$suite" ;;
    bench-peers) bash tools/gpu_bench_gemm_peers.sh ;;
    host-time) bash tools/gpu_host_time.sh ;;
    parity-seeds) bash tools/gpu_parity_seeds.sh ;;
    tests) for s in gemm layer datapath quant rest; do echo "== $s"; run_tests "$s"; done ;;
    bench-quant)
      timeout $(( $(limit bench-quant) / 2 )) python -m benchmarks.bench_quantize \
        --json "$OUT/quant.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/quant.txt"
      timeout $(( $(limit bench-quant) / 2 )) python -m benchmarks.bench_quantize_recipes \
        --json "$OUT/quant_recipes.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/quant_recipes.txt" ;;
    bench-gemm) bench_gemm ;;
    bench-layer)
      timeout "$(limit bench-layer)" python -m benchmarks.bench_moe_layer --shapes "$SHAPES" \
        --skews 0 --passes fwd+bwd --scale-blocks 1x32,1x128 --memory --determinism \
        --host-time --json "$OUT/layer.json" \
        2>&1 | grep -v "$FILTER" | tee "$OUT/layer.txt" ;;
    bench-rowkernels)
      timeout "$(limit bench-rowkernels)" python -m benchmarks.bench_rowkernels --parts \
        --kernels "${KERNELS:-swiglu,dispatch,combine}" --shapes mixtral,dsv3 2>&1 \
        | tee "$OUT/rowkernels.txt" ;;
    first-step) first_step ;;
    ep) ep ;;
    parity) parity ;;
    determinism) determinism ;;
    tune-gemm)
      timeout "$(limit tune-gemm)" python -m benchmarks.tune_grouped_gemm_sm90 \
        --json "$OUT/tune.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/tune.txt" ;;
    ncu-gemm) ncu_gemm ;;
    ncu-rowkernels) ncu_rowkernels ;;
    *) echo "unknown suite: $suite (bash tools/gpu.sh with no argument lists them)" >&2 ;;
  esac
done
