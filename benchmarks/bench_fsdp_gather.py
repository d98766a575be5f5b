"""FSDP2 expert weights all-gathered as MXFP8 vs BF16 (``fully_shard_moe(mxfp8_all_gather=...)``)
on the GPUs of one host (NCCL).

    torchrun --nproc-per-node 2 -m benchmarks.bench_fsdp_gather [--tokens 8192,16384] [--json f]
    python -m benchmarks.bench_fsdp_gather ...   # spawns --nproc ranks itself (default 2)
    python -m benchmarks.bench_fsdp_gather --cpu-dry-run   # gloo, reference backend, tiny shape

One `MXFP8MoE` (mixtral-like by default: E 8, D 4096, H 14336, top-2, ``scale_blocks="1x128"``)
as its own FSDP unit inside a root unit, as in a model: it reshards after forward, so every
step all-gathers it twice (forward, backward). Per token count (per rank) it prints from rank 0
one JSON row with, for the BF16 and the MXFP8 all-gather:

* ``gather_bytes_per_step_*``: bytes this rank sends into the layer's all-gathers in one step
  (counted by `moe_mxfp8.fsdp_mxfp8.AllGatherBytes`; router and shared experts included, BF16
  in both), and ``expert_bytes_per_gather_*``: the expert weights' share
  (`moe_mxfp8.fsdp_mxfp8.expert_gather_bytes`);
* ``gather_ms_*``: median time of one unshard + reshard of the layer (MXFP8: the quantizer
  before the all-gather included);
* ``step_ms_*``: median forward + backward (CUDA events, after warm-up; no optimizer step);
* ``identical``: the MXFP8 run's output, input gradient and local gradient shards equal the
  BF16 run's bit for bit on the first step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.timing import collective_ms
from moe_mxfp8 import MXFP8MoE
from moe_mxfp8 import fsdp as FS
from moe_mxfp8 import fsdp_mxfp8 as FM

BF16 = torch.bfloat16
MIXTRAL = {"experts": 8, "dim": 4096, "hidden": 14336, "top_k": 2}
DRY_RUN = {"experts": 8, "dim": 128, "hidden": 256, "top_k": 2}


class Env:
    """Where the benchmark runs: CUDA + NCCL + the GPU kernels, or the CPU dry run."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.device = "cpu" if cpu else "cuda"
        self.backend = "reference" if cpu else "auto"

    def time_ms(self, fn, warmup: int, reps: int) -> float:
        return collective_ms(fn, warmup, reps, cuda=not self.cpu)


def _model(env: Env, shape: dict, state: dict, mxfp8: bool, mesh):
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    layer = MXFP8MoE(shape["dim"], shape["hidden"], shape["experts"], shape["top_k"],
                     device=env.device, backend=env.backend, scale_blocks="1x128")
    layer.load_state_dict(state)
    model = torch.nn.Sequential(layer)
    FS.fully_shard_moe(model, mesh, mxfp8_all_gather=mxfp8)
    fully_shard(model, mesh=mesh)
    counter = FM.AllGatherBytes()
    layer.set_custom_all_gather(counter)
    return model, layer, counter


def bench_tokens(env: Env, shape: dict, tokens: int, mesh, args) -> dict:
    ws = mesh.size()
    torch.manual_seed(0)  # the same layer on every rank
    state = MXFP8MoE(shape["dim"], shape["hidden"], shape["experts"], shape["top_k"],
                     device=env.device, backend=env.backend, scale_blocks="1x128").state_dict()
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(tokens, shape["dim"], device=env.device).to(BF16)
    dy = torch.randn(tokens, shape["dim"], device=env.device).to(BF16)
    res = {**shape, "world_size": ws, "tokens_per_rank": tokens, "recipe": "1x128"}
    first = {}
    for name, mxfp8 in (("bf16", False), ("mxfp8", True)):
        if not env.cpu:  # peak memory of this variant alone, above what exists before it
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        model, layer, counter = _model(env, shape, state, mxfp8, mesh)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            xa = x.clone().requires_grad_()
            model(xa).backward(dy)
            return xa

        xa = step()
        # kept on the host: the next variant's peak must not hold this one's gradients
        first[name] = [t.cpu() for t in (xa.grad, *(p.grad.to_local() for p in model.parameters()))]
        counter.sent = 0
        res[f"step_ms_{name}"] = env.time_ms(step, args.warmup, args.reps)
        res[f"gather_bytes_per_step_{name}"] = counter.sent // (args.warmup + args.reps)

        def gather(layer=layer):
            layer.unshard()
            layer.reshard()

        res[f"gather_ms_{name}"] = env.time_ms(gather, args.warmup, args.reps)
        res[f"expert_bytes_per_gather_{name}"] = FM.expert_gather_bytes(layer, ws, mxfp8)
        del model, layer, counter, xa
        if not env.cpu:
            res[f"peak_gib_{name}"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    same = all(torch.equal(a, b) for a, b in zip(first["bf16"], first["mxfp8"], strict=True))
    flags = torch.tensor([float(same)], device=env.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    res["identical"] = bool(flags.item())
    res["expert_bytes_ratio"] = (res["expert_bytes_per_gather_mxfp8"]
                                 / res["expert_bytes_per_gather_bf16"])
    return res


def run(rank: int, ws: int, args) -> None:
    env = Env(args.cpu_dry_run)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    if env.cpu:
        dist.init_process_group("gloo", rank=rank, world_size=ws)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", rank=rank, world_size=ws,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    mesh = init_device_mesh(env.device, (ws,))
    shape = DRY_RUN if env.cpu else MIXTRAL
    tokens = [64] if env.cpu else [int(t) for t in args.tokens.split(",")]
    rows = [bench_tokens(env, shape, t, mesh, args) for t in tokens]
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
        if args.json:
            gpu = "cpu" if env.cpu else torch.cuda.get_device_name()
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "gpu": gpu, "torch": torch.__version__}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,16384", help="tokens per rank, comma-separated")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    ap.add_argument("--port", type=int, default=29573)
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    if args.cpu_dry_run:
        args.warmup, args.reps = 1, 2
    if "RANK" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        mp.spawn(run, args=(args.nproc, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
