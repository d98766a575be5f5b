"""Layer benchmark: `MXFP8MoE` vs its BF16 twin, forward and forward+backward.

Same weights, same input, same routed tokens for both precisions (the routing is drawn once per
shape and distribution and imposed on both). Balanced and skewed routing. CUDA-graph replays
where the path is capturable, CUDA events, warm-up, medians, rotating inputs (cold L2).

    source tools/device_env.sh && python -m benchmarks.bench_moe_layer --json $OUT/layer.json \
        --png $OUT/layer.png

Prints a table (ms, TFLOP/s counting the expert-GEMM FLOPs, speedup over BF16, peak memory, bytes
saved for backward per token) and, for both precisions, a breakdown of the forward+backward step
by phase from the torch profiler's CUDA kernels, with the time outside the expert GEMMs.

``--determinism``: whether two forward+backward steps of each layer on the same input are bit
for bit equal (output, input and parameter gradients). ``--host-time``: the host time of one
forward+backward per layer, launched while the GPU is kept busy ahead of it (`host_time`), so
the number is the CPU's alone; ``--host-profile N`` adds the top N functions of a cProfile of
those launches, ``--host-parts`` the host time inside the launch entry points
(`launch_parts`). ``--cache-weights 0,1`` measures the MXFP8 layers without and with
``cache_weights=True``; ``--accumulate N`` makes a step N micro-batches (gradient accumulation)
after an optimizer-step boundary (the weight cache is dropped at its start, as an optimizer step
drops it). ``--quantizer-stages none``: the data path's quantized stages on the Triton kernels
instead of the quantizer tile (an A/B of `stages.QUANTIZER_STAGES`).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import re
import statistics
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from benchmarks.timing import Rotating, bench_us, device_info
from moe_mxfp8 import MXFP8MoE
from moe_mxfp8 import stages as ST
from moe_mxfp8.dispatcher import Routing


@dataclass(frozen=True)
class LayerShape:
    name: str
    num_experts: int
    routed_rows: int  # tokens * top_k
    dim: int
    hidden: int
    top_k: int

    @property
    def tokens(self) -> int:
        return self.routed_rows // self.top_k

    def gemm_flops(self, backward: bool) -> float:
        fwd = 2 * self.routed_rows * self.dim * 3 * self.hidden  # gate+up (2H) and down (H)
        return fwd * (3 if backward else 1)


SHAPES = {
    "dsv3": LayerShape("dsv3", 8, 131072, 7168, 2048, 2),
    "qwen3": LayerShape("qwen3", 128, 131072, 2048, 768, 8),
    "mixtral": LayerShape("mixtral", 8, 32768, 4096, 14336, 2),
    # many small experts and few tokens: a step short enough for the host to be the limit
    "small": LayerShape("small", 64, 4096 * 4, 1024, 512, 4),
    # one layer of the training example's GPU preset (train_example/model.py, "gpu"): 16 x 1024
    # tokens a step, D 768, H 1536, 8 experts, top-2
    "preset": LayerShape("preset", 8, 16384 * 2, 768, 1536, 2),
}


def make_routing(shape: LayerShape, skew: float, gen: torch.Generator):
    """Expert ids ``(T, k)`` and weights ``(T, k)``: experts drawn without replacement from a
    distribution with ``p_e ∝ exp(-skew * e / E)`` (skew 0 = balanced)."""
    e = shape.num_experts
    p = torch.exp(-skew * torch.arange(e, dtype=torch.float64) / e)
    ids = torch.multinomial(p.expand(shape.tokens, e), shape.top_k, generator=gen)
    w = torch.rand(shape.tokens, shape.top_k, generator=gen).softmax(-1)
    return ids.cuda(), w.float().cuda()


def impose_routing(module: MXFP8MoE, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """Run the module's real router (its cost counts) but route by ``ids``/``weights``. The
    override holds the module weakly: a bound method would make a module -> override -> module
    cycle that outlives ``del`` until the cyclic collector runs (it kept a finished shape's
    layers, gradients and saved router input alive into the next shape's memory numbers)."""
    ref = weakref.ref(module)
    route_of = type(module).route
    e = module.num_experts

    def route(x):
        w, _, _, aux = route_of(ref(), x)
        counts = torch.zeros(e, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
        return Routing(weights + 0 * w, ids, counts, aux)

    module.route = route


# Kernel name -> phase (first match wins). "expert gemm" is what the issue's "time outside the
# expert GEMMs" excludes: the MXFP8 CuTeDSL grouped GEMMs and torch._grouped_mm's CUTLASS kernels.
PHASES = [
    ("dispatch", r"_dispatch_kernel|_gather_sum_kernel|GatherQuantizer"),
    ("swiglu", r"_swiglu_|SwigluQuantizer|SwigluGradQuantizer"),
    ("combine", r"_combine_|CombineGradQuantizer"),
    ("quantize", r"quant|mxfp8_q|Quantize"),
    ("expert gemm", r"grouped_gemm|GroupedGemm|gemm_sm90|kernel_cutlass|PtrArray|Grouped|grouped"
                    r"|GroupProblem"),
    ("router gemm", r"sm90_xmma|cutlass|nvjet|gemm|Gemm"),
    ("old permute/combine", r"index|gather|scatter|Index|copy|sort|Sort|cumsum|Scan|radix"),
    ("old swiglu", r"silu|mul_kernel|MulFunctor|SiLU"),
]


def phase_breakdown(fn, steps: int = 3) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """CUDA kernel time per phase (ms per step) from the torch profiler, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    kernels = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t <= 0:
            continue
        phase = next((p for p, pat in PHASES if re.search(pat, ev.key)), "other")
        out[phase] += t / 1e3 / steps
        kernels.append((f"[{phase}] {ev.key[:110]}", t / 1e3 / steps))
    out["outside expert gemm"] = sum(v for k, v in out.items() if k != "expert gemm")
    return dict(out), sorted(kernels, key=lambda kv: -kv[1])[:14]


def _gpu_sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms`` (measured)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))


class _OpCounter:
    """Counts the torch (aten and custom) ops dispatched while active, by name."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = defaultdict(int)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        self.counts, self.mode = counts, Mode()


def bitwise_twice(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> bool:
    """Whether two forward + backward passes of ``model`` on the same ``x`` and output gradient
    ``dy`` give bit-identical outputs, input gradients and parameter gradients (the weight cache
    dropped before each, as after an optimizer step)."""
    runs = []
    for _ in range(2):
        model.invalidate_weight_cache()
        model.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        y = model(xi)
        y.backward(dy)
        runs.append([y.detach(), xi.grad, *(p.grad for p in model.parameters())])
    return all(a is None and b is None or a is not None and b is not None and torch.equal(a, b)
               for a, b in zip(*runs, strict=True))


# The launch entry points `launch_parts` times inside a step: (owner, attribute, part).
def _entry_points() -> list[tuple[object, str, str]]:
    from moe_mxfp8.kernels.native import NativeKernel

    points: list[tuple[object, str, str]] = [
        (NativeKernel, "__call__", "CuTeDSL launches (native)"),
        (torch, "mm", "torch.mm"),
        (torch, "_grouped_mm", "torch._grouped_mm"),
    ]
    try:
        from triton.runtime.jit import JITFunction

        points.append((JITFunction, "run", "Triton launches"))
    except ImportError:  # a CPU install without Triton launches none
        pass
    points += [(torch, n, "allocations") for n in ("empty", "empty_like", "zeros")]
    points += [(torch.Tensor, n, "allocations") for n in ("new_empty", "new_zeros", "new_full")]
    return points


class launch_parts:
    """While entered, the host time spent inside each launch entry point (`_entry_points`:
    CuTeDSL and Triton launches, the GEMMs torch launches itself, output allocations), summed
    per part: inclusive, a call inside another timed call counted once (in the outer)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple[object, str, object]] = []
        self._depth = 0

    def _timed(self, fn, part: str):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1
                self._depth -= 1
        return timed

    def __enter__(self):
        for owner, name, part in _entry_points():
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._timed(fn, part))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()


def host_time(step, reps: int = 7, profile_top: int = 0, count_ops: bool = False,
              parts: bool = False) -> dict:
    """Host time of one ``step()`` while the GPU is busy ahead of it: a long GPU sleep is
    queued first, so no launch waits for the GPU and the time is the CPU's (Python, torch
    dispatch, custom ops, Triton's and the ctypes launchers, the driver's launch calls).
    ``wall_ms``: median wall time of the launching thread (autograd's backward runs on its
    device thread; the caller waits for it); ``cpu_ms``: median CPU time of the process (every
    thread); ``gpu_busy``: the sleep was still running when every step's launches had
    returned (else the sleep was too short and a launch may have waited). ``profile_top``:
    also a cProfile of the launches (backward in the calling thread for it), top functions
    by own time and by cumulative time. ``count_ops``: also the torch ops one step dispatches
    (``ops`` total, ``op_counts`` by name), each a kernel launch, an allocation or a view.
    ``parts``: also where the host time of a step goes (`launch_parts`; backward in the
    calling thread, ``reps`` steps): ``parts_ms`` per part (calls and ms per step), and
    ``parts_step_ms``, the timed steps' mean wall time, whose remainder is Python, autograd and
    the other torch ops."""
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    rough_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    cycles = _gpu_sleep_cycles(3 * rough_ms + 50)
    wall, cpu, busy = [], [], True
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        sleeping = torch.cuda.Event()
        sleeping.record()
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        busy = busy and not sleeping.query()
        torch.cuda.synchronize()
    res = {"wall_ms": statistics.median(wall), "cpu_ms": statistics.median(cpu),
           "gpu_busy": busy}
    if profile_top:
        prof = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):
            for _ in range(3):
                torch.cuda._sleep(cycles)
                prof.enable()
                step()
                prof.disable()
                torch.cuda.synchronize()
        out = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(profile_top)
        res["profile"] = out.getvalue()
    if parts:
        with torch.autograd.set_multithreading_enabled(False), launch_parts() as timers:
            step()  # the wrappers' own first calls
            torch.cuda.synchronize()
            timers.seconds.clear()
            timers.calls.clear()
            total = 0.0
            for _ in range(reps):
                torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                step()
                total += time.perf_counter() - t0
                torch.cuda.synchronize()
        res["parts_step_ms"] = total / reps * 1e3
        res["parts_ms"] = {k: {"calls": timers.calls[k] / reps, "ms": v / reps * 1e3}
                           for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])}
    if count_ops:
        counter = _OpCounter()
        with torch.autograd.set_multithreading_enabled(False), counter.mode:
            step()
        torch.cuda.synchronize()
        res["ops"] = sum(counter.counts.values())
        res["op_counts"] = dict(sorted(counter.counts.items(), key=lambda kv: -kv[1]))
    return res


def saved_bytes(module, x) -> int:
    """Bytes the forward keeps for backward (distinct storages packed by autograd), parameters
    excluded."""
    params = {p.data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    del y
    return sum(seen.values())


def _site(frames, depth: int = 4) -> str:
    """The allocating Python lines of this project (innermost first, up to ``depth``), or the
    innermost frame (``<...>``) where none is ours: C++ autograd nodes have no Python frame."""
    ours = [f for f in frames if re.search(r"moe_mxfp8/|kernels/|benchmarks/", f["filename"])]
    if not ours:
        return f"<{frames[0]['name']}>" if frames else "<no python frame>"
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                      for f in ours[:depth])


def _live_at_peak(trace) -> tuple[int, dict[str, list[int]]]:
    """Replay an allocator trace: (peak bytes above the trace's start, bytes and count of the
    trace's own allocations alive at that peak, by allocation site)."""
    cur = peak = 0
    peak_i = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            cur += ev["size"]
        elif ev["action"] == "free_completed":
            cur -= ev["size"]
        if cur > peak:
            peak, peak_i = cur, i
    live: dict[int, dict] = {}
    for ev in trace[: peak_i + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ev in live.values():
        site = sites[_site(ev.get("frames", []))]
        site[0] += ev["size"]
        site[1] += 1
    return peak, dict(sites)


def memory_profile(module, xs, dy, top: int = 12) -> dict:
    """One forward+backward step after two warm ones: peak memory of the forward and of the
    backward (``max_memory_allocated`` reset between them), what the forward leaves alive, and
    what is alive at the step's peak by allocating line (``torch.cuda.memory`` history)."""
    def fwd():
        x = xs.next()
        x.grad = None
        module.zero_grad(set_to_none=True)  # as the timed step
        return module(x)

    for _ in range(2):
        fwd().backward(dy)
    torch.cuda.synchronize()
    gib = 2**30
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    out = fwd()
    torch.cuda.synchronize()
    res = {"base_gib": base / gib, "fwd_peak_gib": torch.cuda.max_memory_allocated() / gib,
           "after_fwd_gib": torch.cuda.memory_allocated() / gib}
    torch.cuda.reset_peak_memory_stats()
    out.backward(dy)
    del out
    torch.cuda.synchronize()
    res["bwd_peak_gib"] = torch.cuda.max_memory_allocated() / gib
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, sites = _live_at_peak(snap["device_traces"][torch.cuda.current_device()])
    res["trace_peak_gib"] = (base + peak) / gib
    res["at_peak"] = sorted(([s, b / gib, n] for s, (b, n) in sites.items()),
                            key=lambda r: -r[1])[:top]
    return res


def print_memory(shape: str, name: str, r: dict) -> None:
    print(f"  memory {shape} {name}: base {r['base_gib']:.2f} | forward peak "
          f"{r['fwd_peak_gib']:.2f}, alive after forward {r['after_fwd_gib']:.2f} | backward "
          f"peak {r['bwd_peak_gib']:.2f} (trace {r['trace_peak_gib']:.2f}) GiB; alive at the "
          f"step's peak, by allocating line:", flush=True)
    for site, g, n in r["at_peak"]:
        print(f"      {g:7.3f} GiB x{n:<3d} {site}")


def fresh_memory(*modules) -> None:
    """The same starting point for every peak-memory number: no parameter gradients and no
    router graph (``aux_loss``) left by the other precision's or an earlier step, garbage
    collected, peak counter reset. (Without it the second precision's peak included the first
    one's weight gradients: +1.2 GiB at qwen3, +2.6 GiB at mixtral, against MXFP8.) No layer
    keeps a weight cache either."""
    for m in modules:
        m.zero_grad(set_to_none=True)
        m.aux_loss = None
        m.invalidate_weight_cache()  # another layer's cached FP8 weights are not this one's
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_shape(shape: LayerShape, skew: float, args) -> list[dict]:
    """One shape and routing: the BF16 twin and the MXFP8 layer of each recipe in
    ``args.scale_blocks`` (comma-separated; the twin measured once, the baseline of each row)."""
    gen = torch.Generator().manual_seed(0)
    ids, weights = make_routing(shape, skew, gen)
    bf16 = MXFP8MoE(shape.dim, shape.hidden, shape.num_experts, shape.top_k, precision="bf16",
                    device="cuda")
    models = {"bf16": bf16}
    for recipe in args.scale_blocks.split(",") if args.scale_blocks else [None]:
        for cache in map(int, args.cache_weights.split(",")):
            extra: dict = {"scale_blocks": recipe} if recipe else {}
            if not args.save_colwise:  # the layer's deprecated options, only when asked for
                extra["save_colwise"] = False
            if args.weight_blocks != "1x32":
                extra["weight_blocks"] = args.weight_blocks
            mx = MXFP8MoE(shape.dim, shape.hidden, shape.num_experts, shape.top_k,
                          precision="mxfp8", backend=args.backend, device="cuda",
                          wgrad=args.wgrad, cache_weights=bool(cache), **extra)
            mx.load_state_dict(bf16.state_dict())
            models[f"mxfp8 {mx.resolved_scale_blocks()}" + (" cached" if cache else "")] = mx
    for m in models.values():
        impose_routing(m, ids, weights)
    xs = Rotating([torch.randn(shape.tokens, shape.dim, device="cuda", dtype=torch.bfloat16)
                   .requires_grad_() for _ in range(2)])
    dy = torch.randn(shape.tokens, shape.dim, device="cuda", dtype=torch.bfloat16)
    saved = {name: saved_bytes(m, xs.next()) / shape.tokens for name, m in models.items()}
    mem = {}
    if args.memory:
        for name, m in models.items():
            fresh_memory(*models.values())
            mem[name] = memory_profile(m, xs, dy)
            print_memory(shape.name, name, mem[name])
    if args.compile:
        # saved bytes and memory above are eager; the timed steps run the same modules (the
        # same parameters) behind torch.compile, the twin and the MXFP8 layers in one mode
        models = {name: torch.compile(m, mode=None if args.compile == "default" else args.compile)
                  for name, m in models.items()}
    rows = []
    for backward in [p == "fwd+bwd" for p in args.passes.split(",")]:
        res = {}
        for name, m in models.items():
            def step(m=m, backward=backward):
                # an optimizer step's boundary: the weight cache starts empty, as after a step
                m.invalidate_weight_cache()
                if backward:
                    # a training step: fresh gradients (optimizer.zero_grad(set_to_none=True)),
                    # no accumulation into the last step's (an add per weight that is no part
                    # of the layer's cost); --accumulate micro-batches accumulate into them
                    m.zero_grad(set_to_none=True)
                    for _ in range(args.accumulate):
                        x = xs.next()
                        x.grad = None
                        m(x).backward(dy)
                else:
                    for _ in range(args.accumulate):
                        with torch.no_grad():
                            m(xs.next())

            fresh_memory(*models.values())
            us = bench_us(step, warmup=2, reps=args.reps, rounds=3, use_graph=args.graphs)
            res[name] = (us, torch.cuda.max_memory_allocated() / 2**30)
            if backward and args.breakdown:
                res[name + "_breakdown"] = phase_breakdown(step)
            if backward and args.determinism:
                res[name + "_deterministic"] = bitwise_twice(m, xs.next(), dy)
            if backward and args.host_time:
                res[name + "_host"] = host_time(step, profile_top=args.host_profile,
                                                count_ops=args.host_ops, parts=args.host_parts)
                h = res[name + "_host"]
                print(f"  host {shape.name} {name}: {h['wall_ms']:.2f} ms wall, {h['cpu_ms']:.2f} "
                      f"ms CPU per step of {args.accumulate} fwd+bwd (GPU busy throughout: "
                      f"{h['gpu_busy']})", flush=True)
                if "ops" in h:
                    top = ", ".join(f"{k} {v}" for k, v in list(h["op_counts"].items())[:40])
                    print(f"    {h['ops']} torch ops per step: {top}", flush=True)
                if "parts_ms" in h:
                    rest = h["parts_step_ms"] - sum(v["ms"] for v in h["parts_ms"].values())
                    top = ", ".join(f"{k} {v['ms']:.2f} ({v['calls']:.0f} calls)"
                                    for k, v in h["parts_ms"].items())
                    print(f"    host ms per step by part: {top}; the rest {rest:.2f} of "
                          f"{h['parts_step_ms']:.2f}", flush=True)
                if "profile" in h:
                    print(h.pop("profile"))
        flops = shape.gemm_flops(backward)
        for name, mx in models.items():
            if name == "bf16":
                continue
            row = {
                "shape": shape.name, "routing": "balanced" if skew == 0 else f"skew{skew:g}",
                "weight_blocks": mx.weight_blocks, "scale_blocks": mx.resolved_scale_blocks(),
                "wgrad": args.wgrad, "save_colwise": bool(args.save_colwise),
                "pass": "fwd+bwd" if backward else "fwd", **asdict(shape),
                "bf16_ms": res["bf16"][0] / 1e3, "mxfp8_ms": res[name][0] / 1e3,
                "bf16_tflops": flops / res["bf16"][0] / 1e6,
                "mxfp8_tflops": flops / res[name][0] / 1e6,
                "speedup": res["bf16"][0] / res[name][0],
                "bf16_peak_gib": res["bf16"][1], "mxfp8_peak_gib": res[name][1],
                "bf16_saved_bytes_per_token": saved["bf16"],
                "mxfp8_saved_bytes_per_token": saved[name],
                "cache_weights": mx.cache_weights, "accumulate": args.accumulate,
                "mxfp8_weight_cache_gib": mx.weight_cache_bytes() / 2**30,
            }
            for key, src in (("bf16", "bf16"), ("mxfp8", name)):
                if src + "_host" in res:
                    row[key + "_host"] = res[src + "_host"]
                if src + "_deterministic" in res:
                    row[key + "_deterministic"] = res[src + "_deterministic"]
            if mem and backward:
                row["memory"] = {"bf16": mem["bf16"], "mxfp8": mem[name]}
            for key, src in (("bf16", "bf16"), ("mxfp8", name)):
                if src + "_breakdown" in res:
                    row[key + "_breakdown_ms"], row[key + "_top_kernels"] = res[src + "_breakdown"]
            rows.append(row)
            print(f"{row['shape']:>8} {row['routing']:>9} {row['pass']:>8} {name[6:]:>5} | "
                  f"bf16 {row['bf16_ms']:8.2f} ms {row['bf16_tflops']:6.0f} TF | mxfp8 "
                  f"{row['mxfp8_ms']:8.2f} ms {row['mxfp8_tflops']:6.0f} TF | "
                  f"x{row['speedup']:.2f} | peak "
                  f"{row['bf16_peak_gib']:.2f}/{row['mxfp8_peak_gib']:.2f} GiB | saved/token "
                  f"{saved['bf16']:.0f}/{saved[name]:.0f} B", flush=True)
            for key in ("bf16", "mxfp8"):
                for kname, ms in row.get(key + "_top_kernels", []):
                    print(f"    {key} {ms:8.3f} ms  {kname}")
    fresh_memory(*models.values())
    del bf16, mx, models
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['routing']}\n{r['pass']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="tab:green")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("MXFP8MoE speedup over BF16 twin")
    ax.set_title(f"{rows[0].get('gpu', '')} {rows[0].get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3,qwen3,mixtral")
    ap.add_argument("--skews", default="0,2", help="0 = balanced; s: p_e ∝ exp(-s e / E)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--save-colwise", type=int, default=1, choices=(0, 1),
                    help="MXFP8MoE save_colwise (module default 1)")
    ap.add_argument("--weight-blocks", default="1x32", choices=("1x32", "32x32"))
    ap.add_argument("--scale-blocks", default=None,
                    help="MXFP8MoE scale_blocks, comma-separated for several layers against one "
                         "BF16 twin (1x32, 32x32, 1x128; default: the module's)")
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both")
    ap.add_argument("--wgrad", default="mxfp8", choices=("mxfp8", "bf16"))
    # Eager by default: a whole layer step is 10-150 ms, so launch gaps matter little, and a
    # failed capture leaks its private memory pool (seen: OOM at dsv3 on an 80 GB H100).
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    ap.add_argument("--memory", action="store_true",
                    help="per precision: forward / backward peaks and what is alive at the peak")
    ap.add_argument("--cache-weights", default="0",
                    help="MXFP8MoE cache_weights, comma-separated (0, 1 or 0,1: both layers)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--host-time", action="store_true",
                    help="host time per fwd+bwd step, launched while the GPU is busy")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="with --host-time: the top N functions of a cProfile of the launches")
    ap.add_argument("--host-parts", action="store_true",
                    help="with --host-time: host ms per step in launches, allocations and GEMMs")
    ap.add_argument("--determinism", action="store_true",
                    help="with fwd+bwd: whether two steps on the same input are bitwise equal")
    ap.add_argument("--host-ops", action="store_true",
                    help="with --host-time: count the torch ops one step dispatches")
    ap.add_argument("--compile", default=None,
                    choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                    help="time torch.compile(layer, mode=...) for the twin and the MXFP8 layers")
    ap.add_argument("--quantizer-stages", default=None,
                    help="the data-path stages on the quantizer tile, comma-separated, 'none' "
                         "for all on the Triton kernels (default: stages.QUANTIZER_STAGES)")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    if args.quantizer_stages is not None:
        names = args.quantizer_stages
        ST.QUANTIZER_STAGES = ({} if names == "none"
                               else dict.fromkeys(names.split(","), ST.QUANTIZER_BLOCKS))
    info = device_info()
    print(info)
    rows = []
    for name in args.shapes.split(","):
        for skew in map(float, args.skews.split(",")):
            rows += [{**r, **info} for r in run_shape(SHAPES[name], skew, args)]
    print("\nshape    routing   pass     blocks |  bf16 ms  mxfp8 ms | speedup")
    for r in rows:
        cached = " cached" if r["cache_weights"] else ""
        print(f"{r['shape']:8} {r['routing']:9} {r['pass']:8} {r['scale_blocks']:6}{cached} | "
              f"{r['bf16_ms']:8.2f} {r['mxfp8_ms']:8.2f} | {r['speedup']:.2f}")
        if "mxfp8_host" in r:
            print(f"{'':28}host ms per step (wall / CPU): bf16 {r['bf16_host']['wall_ms']:.2f} / "
                  f"{r['bf16_host']['cpu_ms']:.2f}, mxfp8 {r['mxfp8_host']['wall_ms']:.2f} / "
                  f"{r['mxfp8_host']['cpu_ms']:.2f}")
        if "mxfp8_deterministic" in r:
            print(f"{'':28}bitwise equal twice: bf16 {r['bf16_deterministic']}, mxfp8 "
                  f"{r['mxfp8_deterministic']}")
        if r["cache_weights"]:
            print(f"{'':28}weight cache {r['mxfp8_weight_cache_gib']:.3f} GiB")
        print(f"{'':28}peak GiB bf16 {r['bf16_peak_gib']:.2f} mxfp8 {r['mxfp8_peak_gib']:.2f}; "
              f"saved for backward B/token bf16 {r['bf16_saved_bytes_per_token']:.0f} mxfp8 "
              f"{r['mxfp8_saved_bytes_per_token']:.0f}")
        for name in ("bf16", "mxfp8"):
            if name + "_breakdown_ms" in r:
                parts = ", ".join(f"{k} {v:.2f}"
                                  for k, v in sorted(r[name + "_breakdown_ms"].items()))
                print(f"{'':28}{name} fwd+bwd kernels (ms): {parts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
