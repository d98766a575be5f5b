#!/usr/bin/env bash
# One device call, one GPU: a new process's first MXFP8MoE forward+backward with the kernels
# loaded from the compile cache (issue: < 2 s), and the GPU tests of the cache and the data path.
#   run  carry=[".devsite"]  timeout_s=420  command: bash tools/gpu_first_step.sh
# Processes (tools/first_run_probe.py, MXFP8MoE(2048, 768, 32, 4), 4096 tokens), in order:
#   cold      empty cache: precompile, MXFP8 steps, BF16 twin steps (fills the kernel cache)
#   warm      a second process: the MXFP8 first step alone, attributed
#   warm_opt  the same with an AdamW built first, as a training script does
#   bf16      a new process: the BF16 twin's first step
# SEED: a data-path test seed to replay first (MOE_MXFP8_TEST_SEED).
set -uo pipefail
source tools/device_prelude.sh name,driver_version
W=$(mktemp -d)
export MOE_MXFP8_CACHE_DIR=$W/kernels
echo "C compiler: $(command -v cc || command -v gcc || echo none)"
if [ -n "${SEED:-}" ]; then
  echo "== seed replay $SEED"
  MOE_MXFP8_TEST_SEED=$SEED timeout 150 python -m pytest -q -m gpu -p no:cacheprovider -rfE \
    tests/test_datapath.py -k routed_experts_kernels_equal 2>&1 | tail -4
fi
echo "== GPU tests: compile cache, data path"
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider -rfE -s tests/test_compile_cache.py \
  tests/test_datapath.py > "$OUT/tests_first_step.txt" 2>&1
echo "rc=$?"; grep -E "passed|failed|FAILED|ERROR|first process" "$OUT/tests_first_step.txt" | tail -12
P=tools/first_run_probe.py
probe() {  # name steps
  timeout 120 python $P "$2" --json "$W/$1.json" > /dev/null 2> "$W/err_$1.txt"
  echo "rc=$? $1"; grep -v "CUTE_DSL\|Warning\|warn" "$W/err_$1.txt" | grep -v "^\s*$" | tail -3
}
probe cold cuda,layer,precompile,mxfp8,mxfp8_2,bf16,bf16_2
probe warm cuda,layer,mxfp8,mxfp8_2
probe warm2 cuda,layer,mxfp8,mxfp8_2
probe warm_opt cuda,layer,optim,mxfp8,mxfp8_2
probe bf16 cuda,layer,bf16,bf16_2
probe bf16_opt cuda,layer,optim,bf16,bf16_2
python - "$W" <<'PY' 2>&1 | tee "$OUT/first_step.txt"
import json, sys
w = sys.argv[1]
for n in ("cold", "warm", "warm2", "warm_opt", "bf16", "bf16_opt"):
    try:
        r = json.load(open(f"{w}/{n}.json"))
    except (OSError, ValueError):
        print(n, "no result"); continue
    st = " ".join(f"{k}={v:.3f}" for k, v in r["steps"].items())
    print(f"{n:9} {st} | kernels {dict(r['kernels'])} cutlass={r['cutlass_imported']}"
          f" total={r['total']:.2f}")
    if n in ("warm", "warm_opt"):
        acc = sorted(r["acc"].items(), key=lambda kv: -kv[1][1])[:10]
        print("   attributed:", "; ".join(f"{k} {c} {s:.3f}" for k, (c, s) in acc))
        print("   first calls:", " ".join(f"{k}={s:.3f}" for k, s in r["first_calls"][:16]))
PY
ls "$MOE_MXFP8_CACHE_DIR"/kernels-v1 | sed 's/-[0-9a-f]*\././' | sort | uniq -c | head
