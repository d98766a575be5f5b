#!/usr/bin/env bash
# One device call: kernel compile time of a fresh process and the persistent kernel cache.
#   run  carry=[".devsite"]  command: source tools/device_env.sh && bash tools/gpu_compile_cache.sh
# Model: MXFP8MoE(dim 2048, hidden 768, E 32, top_k 4), 4096 tokens, forward+backward.
#   before: cache off (MOE_MXFP8_DISABLE_CACHE=1): every process traces and compiles
#   cold:   empty cache: moe_mxfp8.precompile(...) compiles and stores, then forward+backward
#   warm:   a second process on that cache: first forward+backward loads every kernel
#   split:  like warm, but imports CuTeDSL and runs the BF16 twin's first forward+backward first
#           (torch's own first-use costs), to show what the warm first step is made of
# then the GPU test (tests/test_compile_cache.py -m gpu). Logs and a table land in $OUT.
# MODES="cold split" bash tools/gpu_compile_cache.sh runs a subset (the test with "test").
# The finer split of a second process's first step (imports, torch/Triton first use, profiles)
# is tools/gpu_first_run.sh; its short re-check with bytecode caches, gpu_first_run_verify.sh.
set -uo pipefail
source tools/device_prelude.sh name,driver_version
CACHE=$(mktemp -d)

cat > /tmp/first_step.py <<'EOF'
import json, sys, time
t0 = time.perf_counter()
import torch
import moe_mxfp8
mode, out = sys.argv[1], sys.argv[2]
t_import = time.perf_counter() - t0
torch.manual_seed(0)
layer = moe_mxfp8.MXFP8MoE(2048, 768, 32, 4, device="cuda")
x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
torch.cuda.synchronize()
t_pre = t_dsl = t_bf16 = None
if mode == "split":
    t = time.perf_counter()
    import moe_mxfp8.kernels.grouped_gemm_sm90, moe_mxfp8.kernels.quantize  # noqa: E401,F401
    t_dsl = time.perf_counter() - t
    twin = moe_mxfp8.MXFP8MoE(2048, 768, 32, 4, precision="bf16", device="cuda")
    t = time.perf_counter()
    twin(x).backward(dy)
    torch.cuda.synchronize()
    t_bf16 = time.perf_counter() - t
if mode == "cold":
    t = time.perf_counter()
    moe_mxfp8.precompile(layer, tokens=4096)
    t_pre = time.perf_counter() - t
times = []
for _ in range(2):
    x.grad = None
    t = time.perf_counter()
    y = layer(x)
    y.backward(dy)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
from moe_mxfp8.kernels import compile_cache
ev = compile_cache.compile_events()
fam = {}
for name, key, how, sec in ev:
    fam.setdefault(f"{name}/{how}", [0, 0.0])
    fam[f"{name}/{how}"][0] += 1
    fam[f"{name}/{how}"][1] += sec
torch.save({"y": y.detach().cpu(), "dx": x.grad.cpu()}, out)
print("RESULT " + json.dumps({
    "mode": mode, "import_s": t_import, "precompile_s": t_pre, "first_s": times[0],
    "dsl_import_s": t_dsl, "bf16_first_s": t_bf16,
    "second_s": times[1], "compiled": sum(h == "compiled" for _, _, h, _ in ev),
    "loaded": sum(h == "loaded" for _, _, h, _ in ev),
    "kernel_s": sum(s for *_, s in ev), "families": fam}))
EOF

run() {  # mode, extra env...
  local mode=$1; shift
  local t=$EPOCHREALTIME
  env "$@" MOE_MXFP8_CACHE_DIR=$CACHE timeout 150 python /tmp/first_step.py $mode /tmp/r_$mode.pt \
    2> "$OUT/stderr_$mode.txt" | tee -a "$OUT/log.txt"
  echo "PROCESS $mode $(awk -v a="$t" -v b="$EPOCHREALTIME" 'BEGIN{print b-a}')" | tee -a "$OUT/log.txt"
  grep -v "CUTE_DSL" "$OUT/stderr_$mode.txt" | grep -v "^\s*$" | tail -3
}
MODES=${MODES:-before cold warm test}
for m in $MODES; do
  case $m in
    before) echo "== before (cache off; CuTeDSL JIT timer on)"
      run before MOE_MXFP8_DISABLE_CACHE=1 CUTE_DSL_JIT_TIME_PROFILING=1 \
        CUTE_DSL_LOG_TO_CONSOLE=1 CUTE_DSL_LOG_LEVEL=20 ;;
    cold) echo "== cold (empty cache, precompile)"; run cold ;;
    warm|split) echo "== $m (second process)"; run $m ;;
    test) echo "== GPU test"
      timeout 200 python -m pytest -q -m gpu -x -p no:cacheprovider -s tests/test_compile_cache.py \
        2>&1 | tail -15 | tee "$OUT/test.txt" ;;
  esac
done
du -sh $CACHE

python - "$OUT" <<'EOF'
import json, re, sys, torch
out = sys.argv[1]
log = open(f"{out}/log.txt").read()
res = {json.loads(l[7:])["mode"]: json.loads(l[7:]) for l in log.splitlines() if l.startswith("RESULT ")}
proc = dict(re.findall(r"PROCESS (\w+) ([\d.]+)", log))
jit = open(f"{out}/stderr_before.txt").read() if "before" in res else ""
for what in ("build_ir_module", "compile_and_jit"):
    us = [float(v) for v in re.findall(rf"Function: {what} \| Execution Time: ([\d.]+)", jit)]
    print(f"before: CuTeDSL {what}: {len(us)} calls, {sum(us) / 1e6:.2f} s")
ref = torch.load(f"/tmp/r_{next(iter(res))}.pt")
print(f"{'process':8} {'import':>7} {'precomp':>8} {'1st f+b':>8} {'2nd f+b':>8} {'kernels':>9}"
      f" {'kern s':>7} {'proc s':>7} y==first")
for m in res:
    r = res.get(m)
    if not r:
        print(m, "FAILED"); continue
    y = torch.load(f"/tmp/r_{m}.pt")["y"]
    pre = f"{r['precompile_s']:.2f}" if r["precompile_s"] is not None else "-"
    print(f"{m:8} {r['import_s']:7.2f} {pre:>8} {r['first_s']:8.2f} {r['second_s']:8.3f} "
          f"{r['compiled']:>3}c/{r['loaded']:>2}l {r['kernel_s']:7.2f} {float(proc.get(m, 0)):7.1f}"
          f" {torch.equal(y, ref['y'])}")
    print("   ", {k: (n, round(s, 2)) for k, (n, s) in r["families"].items()},
          {k: round(r[k], 2) for k in ("dsl_import_s", "bf16_first_s") if r.get(k)})
EOF
