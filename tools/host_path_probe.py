"""Where the layer's host time goes, on a CPU: the GPU host path with its launches as no-ops.

    PYTHONPATH=$PWD python tools/host_path_probe.py [--shape small|dsv3|...] [--tokens N]
        [--steps N] [--profile] [--ops]

Runs `MXFP8MoE` forward + backward (both recipes and the BF16 twin) through exactly the code a
GPU runs -- the Triton host wrappers of the data path (`kernels.datapath_triton`, imported
against a stand-in ``triton`` whose kernels launch nothing), the quantizer and grouped GEMM
launchers with their ctypes argument packing (`native.NativeKernel.__call__`, the C entry a
no-op), the backend choice (``"auto"``; every device answers as an H100 with CuTeDSL, so the
quantized SwiGLU stages run on the quantizer as there), the operand checks (their
value reads, which run only for CPU tensors, answered as on a GPU: skipped), the custom ops and
autograd -- on CPU tensors of the shape's widths (D, H, E, k) and a few tokens,
so that the torch ops' own CPU compute stays small (it still grows with the padded row count:
the 1x128 recipe pads every group to 128 rows). ``torch._grouped_mm`` (the twin's GEMMs)
returns an empty output.

Prints the host milliseconds per step, the count of torch (aten) ops per step (on a GPU each
is a kernel launch or an allocation, a few microseconds of host time each) and, with
``--profile``, the cProfile table of one step sorted by own time. What it cannot show: the
CUDA launch cost of each op, Triton's launcher (a few microseconds a launch), the driver, and
the CUDA queries it answers itself (current stream, device switch, compute capability, the
compile cache's lookup).
`benchmarks.bench_moe_layer --host-time` measures the whole on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import pstats
import sys
import time
import types
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_mxfp8 import MXFP8MoE

SHAPES = {  # (E, D, H, k), as benchmarks.bench_moe_layer
    "small": (64, 1024, 512, 4),
    "dsv3": (8, 7168, 2048, 2),
    "qwen3": (128, 2048, 768, 8),
    "mixtral": (8, 4096, 14336, 2),
}


class _Launcher:
    """A Triton kernel: ``kernel[grid](*args, **meta)`` launches nothing."""

    def __init__(self, fn=None, **_):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        if self.fn is None and args and callable(args[0]):  # @triton.jit(...) form
            return _Launcher(args[0])
        return None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _fake_triton() -> dict[str, types.ModuleType]:
    """Modules ``triton``, ``triton.language`` and the libdevice path, just enough for
    `kernels.datapath_triton` to import and launch nothing."""
    tl = types.ModuleType("triton.language")
    tl.constexpr = lambda v=None: v
    tl.__getattr__ = lambda name: object()
    extra = types.ModuleType("triton.language.extra")
    extra.libdevice = types.SimpleNamespace()
    tl.extra = extra
    triton = types.ModuleType("triton")
    triton.jit = _Launcher
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << max(n - 1, 0).bit_length()
    triton.language = tl
    return {"triton": triton, "triton.language": tl, "triton.language.extra": extra}


class _ZeroFillLauncher(_Launcher):
    """A router or routing-layout kernel (`kernels.router_triton`, `kernels.routing_triton`):
    its launch zero-fills its integer tensor arguments (uncounted), so that the expert ids and
    index tensors it makes are in range for the torch ops that read them (an index op of the
    combine backward) -- a valid routing, though not the step's."""

    def __getitem__(self, grid):
        super().__getitem__(grid)  # a launch as any other (the tests count them there)

        def launch(*args, **kwargs):
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                for a in args:
                    if isinstance(a, torch.Tensor) and a.dtype in (torch.int32, torch.int64):
                        a.data.zero_()  # .data: no version bump (autograd saved some)
        return launch


def _native_noop():
    """A `native.NativeKernel` whose C entry does nothing: its argument packing still runs."""
    from moe_mxfp8.kernels import native

    k = object.__new__(native.NativeKernel)
    k._loaded = True
    k._entry = lambda args, n: None
    return k


def _grouped_mm_stub(a, b, offs=None, **_):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.numel(), a.shape[0], b.shape[-1])


@contextlib.contextmanager
def gpu_host_path():
    """The GPU host path on CPU tensors with every device launch a no-op (see the module doc).
    Restores everything on exit."""
    from moe_mxfp8.kernels import native, quantize_launch
    from moe_mxfp8.kernels.grouped_gemm import launcher, problem

    from moe_mxfp8 import backend as B
    from moe_mxfp8 import checks
    from moe_mxfp8 import router as RTR
    from moe_mxfp8 import routing as RT
    from moe_mxfp8 import stages as ST

    dpt = _triton_module("moe_mxfp8.kernels.datapath_triton")
    rtt = _triton_module("moe_mxfp8.kernels.routing_triton")
    for name in ("_hist_kernel", "_scan_kernel", "_place_kernel"):
        setattr(rtt, name, _ZeroFillLauncher(getattr(rtt, name).fn))
    rtr = _triton_module("moe_mxfp8.kernels.router_triton")
    for name in ("_route_fwd_kernel", "_route_reduce_kernel", "_route_bwd_kernel"):
        setattr(rtr, name, _ZeroFillLauncher(getattr(rtr, name).fn))
    kern = _native_noop()
    stream = native.Stream(0)
    patches = [
        (ST, "use_triton", lambda t, backend: backend != "reference"),
        (ST, "_triton_kernels", lambda: dpt),
        (RT, "_layout_kernels", lambda: rtt),
        (RTR, "_kernels", lambda: rtr),
        # every device answers as an H100 with CuTeDSL: backend="auto" resolves to sm90 and the
        # quantized SwiGLU stages run on the quantizer (`stages._swiglu_on_quantizer`)
        (B, "device_capability", lambda device: (9, 0)),
        (B, "cutedsl_available", lambda: True),
        (ST, "cutedsl_available", lambda: True),
        (quantize_launch, "compile_quantizer", lambda op, config, arch=None, stream=None: kern),
        (quantize_launch, "current_stream", lambda device: stream),
        (launcher, "compile_config", lambda cls, config, options=None, stream=None, arch=None:
         kern),
        (launcher, "current_stream", lambda device: stream),
        (launcher, "_max_active_clusters", lambda index, size: 132),
        (torch.cuda, "current_device", lambda: 0),
        (torch, "_grouped_mm", _grouped_mm_stub),
        # index and offs values are read only on the CPU (no device sync): as on a GPU, not here
        (problem, "values_on_host", lambda t: False),
        (checks, "values_on_host", lambda t: False),
    ]
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in old:
            setattr(obj, name, value)


def _triton_module(name: str) -> types.ModuleType:
    """A private copy of the Triton kernel module ``name`` imported against the stand-in
    ``triton`` (which is in ``sys.modules`` only while it imports: torch's own imports look for
    the real one). Every module that import brought in leaves ``sys.modules`` again and the
    packages' attributes stay what they were, so later imports get the real modules."""
    fake = _fake_triton()
    saved = {n: sys.modules.get(n) for n in (*fake, name)}
    before = set(sys.modules)
    attrs = {}
    for mod in (name, *[n for n in sys.modules if n.startswith("moe_mxfp8.kernels.")]):
        package, _, leaf = mod.rpartition(".")
        parent = importlib.import_module(package)
        attrs[(package, leaf)] = parent.__dict__.get(leaf)
    sys.modules.update(fake)
    sys.modules.pop(name, None)
    try:
        return importlib.import_module(name)
    finally:
        for n in set(sys.modules) - before - set(fake) - {name}:
            del sys.modules[n]  # brought in by this import, against the stand-in
            package, _, leaf = n.rpartition(".")
            attrs.setdefault((package, leaf), None)
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
        for (package, leaf), value in attrs.items():
            parent = sys.modules.get(package)
            if parent is None:
                continue
            if value is None:
                parent.__dict__.pop(leaf, None)
            else:
                setattr(parent, leaf, value)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the backends (each a launch or allocation on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name.startswith("moe_mxfp8."):  # count the ops inside the custom ops too
            keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
            with self:
                return func.redispatch(keys, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def make_layers(shape: str, recipes: list[str]):
    e, d, h, k = SHAPES[shape]
    torch.manual_seed(0)
    layers = {"bf16": MXFP8MoE(d, h, e, k, precision="bf16")}
    for r in recipes:
        m = MXFP8MoE(d, h, e, k, scale_blocks=r)  # backend "auto", resolved as on a GPU
        m.load_state_dict(layers["bf16"].state_dict())
        layers[f"mxfp8 {r}"] = m
    return layers


def step_fn(m, x, dy):
    def step():
        xi = x.detach().requires_grad_()
        m.zero_grad(set_to_none=True)
        m(xi).backward(dy)
    return step


def _thread_ms(step, n: int) -> float:
    """CPU milliseconds of this thread per ``step()`` (steadier than wall time on a shared
    machine; CPU autograd runs in the calling thread)."""
    t0 = time.thread_time()
    for _ in range(n):
        step()
    return (time.thread_time() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--recipes", default="1x32,1x128")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile table per layer")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--ops", action="store_true", help="aten ops per step, by name")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with gpu_host_path():
        layers = make_layers(args.shape, args.recipes.split(","))
        d = SHAPES[args.shape][1]
        x = torch.randn(args.tokens, d).to(torch.bfloat16)
        dy = torch.randn(args.tokens, d).to(torch.bfloat16)
        for name, m in layers.items():
            step = step_fn(m, x, dy)
            for _ in range(3):
                step()
            ms = min(_thread_ms(step, args.steps) for _ in range(args.rounds))
            with OpCounter() as counter:
                step()
            print(f"{args.shape} T={args.tokens} {name:12s}: host {ms:7.3f} ms/step (CPU time "
                  f"of this thread, best of {args.rounds}), {sum(counter.ops.values())} aten "
                  f"ops/step", flush=True)
            if args.ops:
                print("   ", ", ".join(f"{k} {v}" for k, v in counter.ops.most_common()))
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.steps):
                    step()
                prof.disable()
                stats = pstats.Stats(prof)
                stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
