"""Expert-parallel dispatch and layer step on the GPUs of one host (NCCL), payload MXFP8 vs BF16.

    torchrun --nproc-per-node N -m benchmarks.bench_ep [--shapes dsv3,qwen3] [--tokens T] [--json f]
             [--shared S] [--profile [--trace DIR]] [--reps R]
    python -m benchmarks.bench_ep ...      # one GPU: world size 1 (NCCL loopback)

Per shape (benchmarks.bench_moe_layer.SHAPES; ``--tokens`` tokens per rank, default the shape's
tokens / world size) it prints, from rank 0:

* dispatch bytes per rank (T k rows of D + D/32 bytes vs 2 D bytes) and the median time of the
  dispatch (quantize + gather + all-to-all + dequantize for MXFP8; gather + all-to-all for
  BF16; the landing is the expert block's own dispatch), and of the all-to-all alone;
* the layer's forward+backward step, the input's gradient included: `MXFP8MoE` with
  ``ep_group`` (token payload MXFP8 or BF16 with a BF16 ``dy`` payload, and MXFP8 for both;
  the input gradients' return after the expert block or beside its weight gradients, leaving
  them 0-48 SMs) against the same layer without EP holding every expert, on one GPU with the
  same tokens -- at world size 1 that measures the EP path's overhead; at N > 1 the EP step per
  rank vs one GPU doing the rank's share of tokens with all experts.

Routing is the layer's own router on random tokens (about balanced). CUDA events around eager
calls (the EP path reads its split sizes on the host, so no CUDA graphs), medians of 5, the
peak memory of each step; ``--profile``: each step's top GPU kernels and its NCCL kernel time.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from benchmarks.bench_moe_layer import SHAPES, LayerShape
from benchmarks.timing import collective_ms
from moe_mxfp8 import MXFP8MoE
from moe_mxfp8 import expert_parallel as EP

BF16 = torch.bfloat16
DEV = "cuda"  # --cpu-dry-run: gloo on the CPU, reference backend, tiny shapes (checks the script)
BACKEND = "auto"
PROFILE = False  # --profile: each step's top GPU kernels
WARMUP, REPS = 2, 5  # calls before timing, timed calls (the median)
TRACE_DIR = ""  # --trace DIR: each profiled step's Chrome trace, per rank
SHARED = 0  # --shared S: shared experts in every layer (DeepSeek-V3 has one)
# --cpu-dry-run's own shape (checks the script in seconds; 128: a whole 1x128 block)
DRY_RUN_SHAPES = {"tiny": LayerShape("tiny", 8, 256, 128, 128, 2)}
RETURN_SMS_SWEEP = (0, 16, 24, 32, 48)  # SMs the weight gradients leave the early input-grad return


def time_ms(fn) -> float:
    return collective_ms(fn, WARMUP, REPS, cuda=DEV == "cuda")


def bench_shape(shape, tokens: int, group) -> dict:
    ws = dist.get_world_size(group)
    d, e, k = shape.dim, shape.num_experts, shape.top_k
    torch.manual_seed(0)  # same router and experts on every rank
    full = MXFP8MoE(d, shape.hidden, e, k, device=DEV, backend=BACKEND,
                    num_shared_experts=SHARED)
    sd = full.state_dict()
    torch.manual_seed(1 + dist.get_rank())
    # the input needs its gradient, as every MoE layer's but a first layer's does: the step
    # includes the gate/up dgrad and, with EP, the input gradients' return
    xg = torch.randn(tokens, d, device=DEV).to(BF16).requires_grad_()
    x = xg.detach()
    dy = torch.randn(tokens, d, device=DEV).to(BF16)
    res = {"shape": shape.name, "world_size": ws, "tokens_per_rank": tokens, "dim": d,
           "hidden": shape.hidden, "experts": e, "top_k": k, "shared_experts": SHARED}
    res["bytes_mxfp8"] = tokens * k * (d + d // 32)
    res["bytes_bf16"] = tokens * k * 2 * d

    with torch.no_grad():
        _, ids, counts, _ = full.route(x)
    order = torch.argsort(ids.reshape(-1), stable=True)
    src = order // k
    for payload in ("mxfp8", "bf16"):
        plan = EP.make_plan(counts, group, 16)
        res[f"dispatch_ms_{payload}"] = time_ms(
            lambda p=payload, pl=plan: EP.PairsToExperts.apply(x, order, k, pl, p, BACKEND))
        send = (EP.pack_mxfp8_rows(x, src, BACKEND) if payload == "mxfp8"
                else x[src].contiguous())
        res[f"a2a_ms_{payload}"] = time_ms(
            lambda s=send, pl=plan: EP._all_to_all(s, sum(pl.recv_splits), pl.recv_splits,
                                                   pl.send_splits, group))
        del plan, send

    def step(layer):
        def fn():
            layer.zero_grad(set_to_none=True)
            xg.grad = None
            y = layer(xg)
            y.backward(dy)
        return fn

    def timed(key, layer):
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res[f"step_ms_{key}"] = time_ms(step(layer))
        if DEV == "cuda":
            res[f"peak_gib_{key}"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if PROFILE:
            trace = (f"{TRACE_DIR}/{shape.name}_{key}_rank{dist.get_rank()}.json" if TRACE_DIR
                     else "")
            res[f"profile_{key}"] = kernel_profile(step(layer), trace=trace)

    timed("one_gpu_all_experts", full)
    del full
    for payload, grad_payload in (("mxfp8", "bf16"), ("bf16", "bf16"), ("mxfp8", "mxfp8")):
        ep = MXFP8MoE(d, shape.hidden, e, k, device=DEV, backend=BACKEND, ep_group=group,
                      ep_payload=payload, ep_grad_payload=grad_payload,
                      num_shared_experts=SHARED)
        ep.load_state_dict(sd)
        key = payload if grad_payload == "bf16" else f"{payload}_grad_{grad_payload}"
        timed(f"ep_{key}", ep)
        if (payload, grad_payload) == ("mxfp8", "bf16"):
            # the input-gradient return beside the weight gradients, with the SMs they leave
            # it; "after": the return waits for the whole expert block's backward
            for sms in (None, *RETURN_SMS_SWEEP):
                ep.dispatcher.return_sms = sms
                timed(f"ep_{key}_return_{'after' if sms is None else sms}", ep)
            ep.dispatcher.return_sms = EP.RETURN_SMS
            if SHARED:  # the shared experts after the routed ones, on the same stream
                ep.dispatcher.overlap_shared = False
                timed(f"ep_{key}_shared_inline", ep)
                ep.dispatcher.overlap_shared = True
        del ep
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return res


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def timeline(spans: list[tuple[float, float, bool]]) -> dict:
    """GPU kernels ``(start, end, is NCCL)`` (any one unit) -> ``busy`` (time any kernel runs),
    ``nccl`` (time an NCCL kernel runs) and ``nccl_hidden`` (time an NCCL kernel runs while
    another kernel does: the exchange overlapped with compute)."""
    nccl = _union([(a, b) for a, b, is_nccl in spans if is_nccl])
    other = _union([(a, b) for a, b, is_nccl in spans if not is_nccl])
    hidden, j = 0.0, 0
    for a, b in nccl:
        while j < len(other) and other[j][1] <= a:
            j += 1
        k = j
        while k < len(other) and other[k][0] < b:
            hidden += min(b, other[k][1]) - max(a, other[k][0])
            k += 1
    return {"busy": sum(b - a for a, b in _union([(a, b) for a, b, _ in spans])),
            "nccl": sum(b - a for a, b in nccl), "nccl_hidden": hidden}


def kernel_profile(fn, top: int = 12, trace: str = "") -> dict:
    """One call of ``fn`` under the profiler: ``kernels``, ``[name, total ms, calls]`` of its
    ``top`` GPU kernels by total time (CPU ops on the CPU), then the NCCL kernels' sum
    (``"nccl (all)"``) and every kernel's (``"all kernels"``); on a GPU also ``timeline``:
    `timeline` of its kernels in ms. ``trace``: also write the profile there (Chrome trace)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = DEV == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    if trace:
        prof.export_chrome_trace(trace)
    rows = [(e.key, (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3, e.count)
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    nccl = sum(r[1] for r in rows if "nccl" in r[0].lower())
    total = sum(r[1] for r in rows)
    out: dict = {"kernels": [[r[0][:80], round(r[1], 3), r[2]] for r in rows[:top]]
                 + [["nccl (all)", round(nccl, 3), 0], ["all kernels", round(total, 3), 0]]}
    if cuda:
        spans = [(e.time_range.start / 1e3, e.time_range.end / 1e3, "nccl" in e.name.lower())
                 for e in prof.events() if e.device_type == DeviceType.CUDA]
        out["timeline"] = {k: round(v, 3) for k, v in timeline(spans).items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3,qwen3")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per rank (0: shape / ws)")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one call of each step: its top GPU kernels (JSON)")
    ap.add_argument("--trace", default="", help="with --profile: write each profiled step's "
                    "Chrome trace into this folder, per rank")
    ap.add_argument("--shared", type=int, default=0,
                    help="shared experts in every layer (DeepSeek-V3: 1); the EP layer then is "
                    "also timed with them after the routed experts on one stream")
    ap.add_argument("--reps", type=int, default=5, help="timed calls (median)")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    global DEV, BACKEND, PROFILE, WARMUP, REPS, TRACE_DIR, SHARED
    PROFILE, WARMUP, REPS, TRACE_DIR = args.profile, args.warmup, args.reps, args.trace
    SHARED = args.shared
    if TRACE_DIR:
        os.makedirs(TRACE_DIR, exist_ok=True)
    if args.cpu_dry_run:
        DEV, BACKEND = "cpu", "reference"
    if "RANK" not in os.environ:  # plain python: world size 1
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29571"))
    rank = int(os.environ["RANK"])
    if DEV == "cpu":
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    rows = []
    for name in args.shapes.split(","):
        shape = {**SHAPES, **DRY_RUN_SHAPES}[name]
        tokens = args.tokens or shape.tokens // dist.get_world_size()
        r = bench_shape(shape, tokens, group)
        rows.append(r)
        if rank == 0:
            print(json.dumps(r), flush=True)
    if rank == 0:
        print(f"{'shape':6} {'ws':>2} {'tokens':>6} {'MB mx/bf':>11} {'disp ms mx/bf':>14} "
              f"{'a2a ms mx/bf':>13} {'step ms 1gpu/ep-mx/ep-bf/ep-mx+dy-mx':>36}")
        for r in rows:
            print(f"{r['shape']:6} {r['world_size']:>2} {r['tokens_per_rank']:>6} "
                  f"{r['bytes_mxfp8'] / 1e6:5.0f}/{r['bytes_bf16'] / 1e6:<5.0f} "
                  f"{r['dispatch_ms_mxfp8']:6.2f}/{r['dispatch_ms_bf16']:<7.2f} "
                  f"{r['a2a_ms_mxfp8']:6.2f}/{r['a2a_ms_bf16']:<6.2f} "
                  f"{r['step_ms_one_gpu_all_experts']:8.1f}/{r['step_ms_ep_mxfp8']:.1f}/"
                  f"{r['step_ms_ep_bf16']:.1f}/{r['step_ms_ep_mxfp8_grad_mxfp8']:.1f}")
        print("EP step (MXFP8 tokens) with the input-gradient return after the expert block / "
              "beside its weight gradients leaving N SMs: ms (x one GPU)")
        for r in rows:
            one = r["step_ms_one_gpu_all_experts"]
            cells = [f"{n}: {r[f'step_ms_ep_mxfp8_return_{n}']:.1f} "
                     f"({r[f'step_ms_ep_mxfp8_return_{n}'] / one:.2f}x)"
                     for n in ("after", *RETURN_SMS_SWEEP)]
            print(f"{r['shape']:6} one GPU {one:.1f} | " + " | ".join(cells))
            if "step_ms_ep_mxfp8_shared_inline" in r:
                print(f"{r['shape']:6} {r['shared_experts']} shared expert(s): on a second stream "
                      f"{r['step_ms_ep_mxfp8']:.1f} ({r['step_ms_ep_mxfp8'] / one:.2f}x), after "
                      f"the routed experts {r['step_ms_ep_mxfp8_shared_inline']:.1f} "
                      f"({r['step_ms_ep_mxfp8_shared_inline'] / one:.2f}x)")
        if args.json:
            gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "gpu": gpu}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
