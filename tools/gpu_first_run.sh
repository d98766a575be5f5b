#!/usr/bin/env bash
# One device call, one GPU: what a fresh process's first MXFP8MoE forward+backward is made of,
# then the expert-parallel run at world size 1 (tools/gpu_ep.sh).
#   run  carry=[".devsite"]  timeout_s=240  command: bash tools/gpu_first_run.sh
# Model: MXFP8MoE(2048, 768, 32, 4), 4096 tokens (tools/first_run_probe.py). Processes, in order:
#   cold    empty kernel cache: precompile, MXFP8 steps, BF16 twin steps (fills both the kernel
#           cache and Triton's own cache, as a first training launch would)
#   warm    a second process: MXFP8 first step alone (the issue's number), attributed
#   prof    the same under cProfile and -X importtime
#   bf16    a fresh process: the BF16 twin's first step (torch + Triton first use, no CuTeDSL)
#   ep      bash tools/gpu_ep.sh (EP tests over NCCL, world size 1; dispatch / step timing)
#   split   CuTeDSL import, Triton import, BF16 first step, then the MXFP8 first step
# Every process has its own timeout, cut to what is left of DEADLINE_S (default 228 s).
set -uo pipefail
START=$EPOCHSECONDS
DEADLINE_S=${DEADLINE_S:-228}
source tools/device_prelude.sh name,driver_version
LOG="$OUT/log.txt"
W=$(mktemp -d)  # JSON, stderr, profiles: only a few files come back from $OUT
CACHE=$W/kernels
export MOE_MXFP8_CACHE_DIR=$CACHE
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  2>&1 | tee -a "$LOG"

left() {  # seconds left for a step wanting $1 s
  local l=$((DEADLINE_S - (EPOCHSECONDS - START)))
  ((l > $1)) && l=$1
  ((l < 1)) && l=1
  echo $l
}
probe() {  # name timeout python-args...
  local name=$1 want=$2; shift 2
  echo "== $name ($(date -u +%T))" | tee -a "$LOG"
  timeout "$(left "$want")" python "$@" --json "$W/$name.json" 2> "$W/stderr_$name.txt" \
    | tee -a "$LOG"
  echo "rc=$? $name" | tee -a "$LOG"
  grep -v "CUTE_DSL\|^import time:" "$W/stderr_$name.txt" | grep -v "^\s*$" | tail -4
}
P=tools/first_run_probe.py
probe cold 90 $P cuda,layer,precompile,mxfp8,mxfp8_2,bf16,bf16_2
probe warm 30 $P cuda,layer,mxfp8,mxfp8_2
probe prof 35 -X importtime $P cuda,layer,mxfp8 --profile "$W/warm.prof"
probe bf16 25 $P cuda,layer,bf16,bf16_2
echo "== ep ($(date -u +%T))" | tee -a "$LOG"
mkdir -p "$W/ep"
OUT="$W/ep" EP_TEST_TIMEOUT=70 EP_BENCH_TIMEOUT=45 timeout "$(left 125)" \
  bash tools/gpu_ep.sh 2>&1 | tail -40 | tee -a "$LOG"
probe split 30 $P cuda,layer,cutedsl,triton,bf16,mxfp8,bf16_2,mxfp8_2
du -sh "$CACHE" ~/.triton/cache 2>/dev/null | tee -a "$LOG"
cat "$W"/ep/*.txt > "$OUT/ep.txt" 2>/dev/null; cp "$W/ep/ep.json" "$OUT/" 2>/dev/null

python - "$OUT" "$W" <<'EOF' 2>&1 | tee "$OUT/table.txt"
import json, os, pstats, re, sys
out, w = sys.argv[1], sys.argv[2]
res = {}
for n in ("cold", "warm", "prof", "bf16", "split"):
    try:
        res[n] = json.load(open(f"{w}/{n}.json"))
    except (OSError, ValueError):
        print(n, "no result")
if os.path.exists(f"{w}/warm.prof"):
    with open(f"{out}/profile.txt", "w") as f:
        s = pstats.Stats(f"{w}/warm.prof", stream=f)
        s.sort_stats("cumulative").print_stats(70)
        s.sort_stats("tottime").print_stats(40)
try:
    imp = []
    for line in open(f"{w}/stderr_prof.txt"):
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            imp.append((int(m[2]), len(m[3]), m[4]))
    with open(f"{out}/importtime_top.txt", "w") as f:
        for us, depth, name in sorted(imp, reverse=True)[:60]:
            f.write(f"{us / 1e6:8.3f} s  {'.' * (depth // 2)}{name}\n")
    top = [(us, n) for us, d, n in imp if d <= 3]
    print("prof: top-level imports (s):",
          ", ".join(f"{n} {us / 1e6:.2f}" for us, n in sorted(top, reverse=True)[:8]))
except OSError:
    pass
steps = ["import torch", "import moe_mxfp8", "cuda", "layer", "precompile", "cutedsl",
         "triton", "bf16", "mxfp8", "bf16_2", "mxfp8_2"]
print(f"{'process':8}" + "".join(f"{s[:10]:>11}" for s in steps) + "   kernels   total")
for n, r in res.items():
    st = r["steps"]
    print(f"{n:8}" + "".join(f"{st[s]:11.3f}" if s in st else f"{'-':>11}" for s in steps)
          + f"   {dict(r['kernels'])}  {r['total']:.1f}  triton+{r['triton_cache_files_added']}")
for n in ("warm", "split", "bf16"):
    if n in res:
        acc = sorted(res[n]["acc"].items(), key=lambda kv: -kv[1][1])
        print(f"{n} attributed (calls, s):", "; ".join(f"{k} {v[0]} {v[1]:.3f}" for k, v in acc))
        print(f"{n} first calls:", " ".join(f"{k}={s:.3f}" for k, s in res[n]["first_calls"][:24]))
EOF
echo "elapsed $((EPOCHSECONDS - START)) s"
