"""Expert-parallel dispatch and layer step on the GPUs of one host (NCCL), payload MXFP8 vs BF16.

    torchrun --nproc-per-node N -m benchmarks.bench_ep [--shapes dsv3,qwen3] [--tokens T] [--json f]
    python -m benchmarks.bench_ep ...      # one GPU: world size 1 (NCCL loopback)

Per shape (benchmarks.bench_moe_layer.SHAPES; ``--tokens`` tokens per rank, default the shape's
tokens / world size) it prints, from rank 0:

* dispatch bytes per rank (T k rows of D + D/32 bytes vs 2 D bytes) and the median time of the
  dispatch (quantize + gather + all-to-all + dequantize for MXFP8; gather + all-to-all for
  BF16; the landing is the expert block's own dispatch), and of the all-to-all alone;
* the layer's forward+backward step: `MXFP8MoE` with ``ep_group`` (token payload MXFP8 or BF16
  with a BF16 ``dy`` payload, and MXFP8 for both)
  against the same layer without EP holding every expert, on one GPU with the same tokens --
  at world size 1 that measures the EP path's overhead; at N > 1 the EP step per rank vs one
  GPU doing the rank's share of tokens with all experts.

Routing is the layer's own router on random tokens (about balanced). CUDA events around eager
calls (the EP path reads its split sizes on the host, so no CUDA graphs), medians of 5.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from benchmarks.bench_moe_layer import SHAPES
from benchmarks.timing import collective_ms
from moe_mxfp8 import MXFP8MoE
from moe_mxfp8 import expert_parallel as EP

BF16 = torch.bfloat16
DEV = "cuda"  # --cpu-dry-run: gloo on the CPU, reference backend, tiny shapes (checks the script)
BACKEND = "auto"


def time_ms(fn, warmup: int = 2, reps: int = 5) -> float:
    return collective_ms(fn, warmup, reps, cuda=DEV == "cuda")


def bench_shape(shape, tokens: int, group) -> dict:
    ws = dist.get_world_size(group)
    d, e, k = shape.dim, shape.num_experts, shape.top_k
    torch.manual_seed(0)  # same router and experts on every rank
    full = MXFP8MoE(d, shape.hidden, e, k, device=DEV, backend=BACKEND)
    sd = full.state_dict()
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(tokens, d, device=DEV).to(BF16)
    dy = torch.randn(tokens, d, device=DEV).to(BF16)
    res = {"shape": shape.name, "world_size": ws, "tokens_per_rank": tokens, "dim": d,
           "hidden": shape.hidden, "experts": e, "top_k": k}
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
            y = layer(x)
            y.backward(dy)
        return fn

    res["step_ms_one_gpu_all_experts"] = time_ms(step(full))
    del full
    for payload, grad_payload in (("mxfp8", "bf16"), ("bf16", "bf16"), ("mxfp8", "mxfp8")):
        ep = MXFP8MoE(d, shape.hidden, e, k, device=DEV, backend=BACKEND, ep_group=group,
                      ep_payload=payload, ep_grad_payload=grad_payload)
        ep.load_state_dict(sd)
        key = payload if grad_payload == "bf16" else f"{payload}_grad_{grad_payload}"
        res[f"step_ms_ep_{key}"] = time_ms(step(ep))
        del ep
    if DEV == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3,qwen3")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per rank (0: shape / ws)")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    global DEV, BACKEND
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
        shape = SHAPES[name]
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
        if args.json:
            gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "gpu": gpu}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
