"""Grouped MXFP8 GEMM (sm90 kernel, every scale-block recipe) vs torch._grouped_mm bf16 and
torch._scaled_grouped_mm fp8 rowwise, for the MoE gate+up GEMM (N = 2f) of three models.

    python -m benchmarks.bench_grouped_gemm [--json out.json] [--shapes dsv3,qwen3,mixtral]
    python -m benchmarks.bench_grouped_gemm --check-baselines   # seconds: every baseline call
                                                                 # at E=4, 256 rows/group, vs fp32
    python -m benchmarks.bench_grouped_gemm --peers [--shapes dsv3,...] [--ceilings] --json x.json
        --md x.md   # vs bf16 and torchao's FP8-rowwise op: incl. quantization and kernel only
    python -m benchmarks.bench_grouped_gemm --sweep-configs --shapes qwen3   # every 1x128 config
    python -m benchmarks.bench_grouped_gemm --merge a.json b.json --md all.md   # one report, no GPU

(--peers, --sweep-configs and the counting, tables and torchao call behind them:
`benchmarks.gemm_peers`; the device run: tools/gpu_bench_gemm_peers.sh.)

GEMMs per shape (E experts, T routed rows, hidden d, expert width f):
  fprop  Y  (T, 2f) = X (T, d) . W_g^T,  W (E, 2f, d)
  dgrad  dX (T, d)  = dY (T, 2f) . W_g
  wgrad  dW (E, 2f, d) = dY_g^T . X_g
FLOPs = 2 * T * 2f * d each. Times: CUDA-graph replays (benchmarks.timing.bench_us), two
rotating input sets. Inputs are random; group sizes are random around T/E (+-25%).
fp8row: rowwise e4m3 with fp32 scales (amax / 448, prepared outside the timed region); for wgrad
one scale per row per token group. Its rel. error vs the bf16 grouped GEMM is printed too.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks import gemm_peers as GP
from benchmarks.timing import Rotating, bench_us, device_info
from moe_mxfp8 import reference as R

# name: (E, T, d, f), the gate+up view of `gemm_peers.GEMM_SHAPES` (K = d, N = 2f; mixtral_down:
# K = 14336, N = 4096)
SHAPES = {name: (s.e, s.t, s.k, s.n // 2) for name, s in GP.GEMM_SHAPES.items()}
# wgrad16: wgrad with group sizes that are multiples of 16 tokens (every group start is 16-byte
# aligned, so the kernel's TMA path runs; other starts take its slow copy path)
OPS = ("fprop", "dgrad", "wgrad", "wgrad16")



def _sm90(mode: str):
    """The Hopper kernel through the shared launcher, for ``mode`` "m" or "k"."""
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm.sm90 import GroupedGemmSm90

    return functools.partial(launcher.grouped_mm, GroupedGemmSm90, mode)

def group_sizes(e: int, t: int, seed: int = 0, align: int = 1,
                balanced: bool = False) -> list[int]:
    """``e`` group sizes summing to ``t``, multiples of ``align`` but the last: random around
    t/e (+-25%), or all equal (``balanced``)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.ones(e) if balanced else 0.75 + 0.5 * torch.rand(e, generator=g)
    sizes = (w / w.sum() * t / align).floor().to(torch.int64) * align
    sizes[-1] += t - int(sizes.sum())
    return sizes.tolist()


def _offs(sizes, dev):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# torch._scaled_grouped_mm 2D x 2D (K-grouped) asserts *on the device* that every group but the
# last spans a multiple of 16 bytes = 16 fp8 elements along the token dim (TMA alignment;
# prepare_grouped_gemm_data in aten/src/ATen/native/cuda/GroupMMCommon.cuh). A device assert
# poisons the CUDA context for the rest of the run, so such calls are refused on the host.
FP8_GROUP_ALIGN = 16


def _fp8_rowwise(x: torch.Tensor):
    """Per-row fp32 scale + e4m3 (baseline inputs only). The scale is the dequantization
    multiplier (x ~= q * s), which is what torch._scaled_grouped_mm takes."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    s = amax / E4M3_MAX
    return (x.float() / s).to(torch.float8_e4m3fn), s.squeeze(-1)


def _fp8_rowwise_grouped(x: torch.Tensor, sizes: list[int]):
    """Rowwise e4m3 of x (rows, T) with one scale per row *per token group* (amax over that
    group's tokens), as a real rowwise fp8 wgrad quantizes. Returns q (rows, T) row-major and the
    scales flattened group-major, (E * rows,): group g's scales are s[g * rows:(g + 1) * rows]."""
    rows, t = x.shape
    q = torch.empty(rows, t, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.ones(len(sizes), rows, device=x.device, dtype=torch.float32)
    start = 0
    for g, n in enumerate(sizes):
        if n:  # an empty group keeps scale 1 (it multiplies nothing)
            qg, sg = _fp8_rowwise(x[:, start:start + n])
            q[:, start:start + n] = qg
            s[g] = sg
        start += n
    return q, s.reshape(-1)


# MXFP8 kernel modes timed per GEMM: name -> (scale_blocks recipe, tuning overrides).
# "1x128r"/"1x128b16"/"1x128n": raster bands and tile widths (below); "1x128o"/"1x128seq":
# (128-column tiles) the promotion of k-tile 2p under the wgmmas of 2p+1, or not;
# "1x128c2"/"1x128c1": 2-CTA clusters with TMA multicast of A, or not.
MODES = {
    "1x32": ("1x32", None),
    "32x32": ("32x32", None),
    # the defaults (256-column tiles when the output has more than 128 columns; M-grouped in
    # raster bands of 16 m-tiles; K-grouped in 2-CTA clusters)
    "1x128": ("1x128", None),
    "1x128r": ("1x128", {"band_m": 1}),  # M-grouped: row-by-row raster
    "1x128b8": ("1x128", {"band_m": 8}),  # M-grouped: bands of 8 m-tiles
    # 128-column tiles, row-by-row raster (M-grouped: overlapped promotion by default, or not /
    # forced on): the kernels before wide tiles and bands
    "1x128n": ("1x128", {"tile_n": 128, "band_m": 1}),
    "1x128seq": ("1x128", {"overlap_promotion": False, "tile_n": 128, "band_m": 1}),
    "1x128o": ("1x128", {"overlap_promotion": True, "tile_n": 128, "band_m": 1}),
    "1x128c1": ("1x128", {"cluster_n": 1}),
    "1x128c2": ("1x128", {"cluster_n": 2}),
    "1x128oc2": ("1x128", {"overlap_promotion": True, "cluster_n": 2}),
    # the same pipeline, tiles and wgmmas without any promotion (results wrong on purpose): the
    # feed + tensor-core limit of the 128x128-tile design, in the same run
    "skel": ("1x32", {"diag": "no_promote"}),
    # the epilogue through shared memory and TMA stores, or storing directly from registers;
    # "1x128s3": the defaults at the TMA-store epilogue's 3 stages of 256-column tiles
    "1x128tma": ("1x128", {"tma_store": True}),
    "1x128direct": ("1x128", {"tma_store": False}),
    "1x128s3": ("1x128", {"stages": 3, "tma_store": False}),
    "1x32tma": ("1x32", {"tma_store": True}),
    "1x128w": ("1x128", {"tile_n": 256}),  # 256-column tiles whatever the reduction's length
    "1x128wc1": ("1x128", {"tile_n": 256, "cluster_n": 1}),
    "1x128nc1": ("1x128", {"tile_n": 128, "cluster_n": 1}),
    "1x128noc2": ("1x128", {"tile_n": 128, "overlap_promotion": True, "cluster_n": 2}),
    # the defaults without the output's stores (wrong on purpose): what writing the output costs
    "1x128nostore": ("1x128", {"diag": "no_store", "tma_store": False}),
}
DEFAULT_MODES = "1x32,32x32,1x128,1x128o"
REPS = {"reps": 30, "rounds": 5}  # bench_us arguments (--reps, --rounds)


def _sqnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |out - ref|^2) in dB (torchao's measure, vs the bf16 GEMM)."""
    ref = ref.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (out.float() - ref).pow(2).sum()))


def _operands(op, recipe, x, dy, w, offs):
    """(a, b) of one GEMM quantized by the reference quantizers in ``recipe``."""
    if op in ("fprop", "dgrad"):
        src, axis = (x, "K") if op == "fprop" else (dy, "N")
        a = R.quantize_rowwise_ref(src, offs=offs, scale_blocks=recipe)
        return a, R.quantize_weights_ref(w, axis=axis, block_rows=R.WEIGHT_BLOCK_ROWS[recipe])
    # the activation operand as the layer and grouped_mm quantize it (1x128: 128 x 128 tiles)
    return (R.quantize_colwise_ref(dy, offs=offs, scale_blocks=recipe),
            R.quantize_colwise_ref(x, offs=offs, scale_blocks=recipe,
                                   block_rows=R.WGRAD_ACT_BLOCK_ROWS[recipe]))


def _gemm_inputs(op: str, e: int, t: int, d: int, n: int, dev: str):
    """bf16 inputs of one GEMM, (x, dy, w, (a, b) of torch._grouped_mm): x (t, d) unless dgrad,
    dy (t, n) unless fprop, w (E, n, d)."""
    torch.manual_seed(1)
    w = torch.randn(e, n, d, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(t, d, device=dev, dtype=torch.bfloat16) if op != "dgrad" else None
    dy = torch.randn(t, n, device=dev, dtype=torch.bfloat16) if op != "fprop" else None
    bf16 = {"fprop": (x, w.transpose(-2, -1)), "dgrad": (dy, w)}.get(op) or (dy.t(), x)
    return x, dy, w, bf16


def _kernel_fn(op: str, recipe: str):
    """The Hopper kernel of ``op`` as ``fn(a, b, offs, out_dtype, tuning=...)``."""
    if op in ("fprop", "dgrad"):
        return _sm90("m")
    # wgrad16: 16-aligned groups as MXFP8MoE gives them (no re-layout gather); the "wgrad"
    # row has unaligned groups and includes the gather
    return functools.partial(_sm90("k"), aligned_groups=op == "wgrad16", scale_blocks=recipe)


def _dequant_ref(a, b, offs):
    """bf16 grouped GEMM of the dequantized operands (what the kernel must match)."""
    da, db = a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16)
    return torch._grouped_mm(da, db.transpose(-2, -1) if db.dim() == 3 else db.t(), offs=offs)


def _clone_mx(b):
    """A second copy of an MXFP8 operand (rotating inputs: cold L2)."""
    return type(b)(b.data.clone(), b.scale.clone(), b.scale_layout, b.offs, b.group_axis,
                   b.block_rows)


def bench_op(op: str, e: int, t: int, d: int, f: int, dev="cuda",
             modes: str = DEFAULT_MODES, sizes: list[int] | None = None,
             fast_accum: bool = False) -> dict:
    """One GEMM on pre-quantized operands: every MXFP8 mode of ``modes``, bf16 and fp8
    rowwise. ``sizes``: the groups (default: random, 16-aligned for wgrad16); ``fast_accum``:
    fp8 rowwise once more with ``use_fast_accum=True``, the call torchao's op makes."""
    n2 = 2 * f
    if sizes is None:
        sizes = group_sizes(e, t, align=16 if op == "wgrad16" else 1)
    offs = _offs(sizes, dev)
    flops = 2.0 * t * n2 * d
    res = {"op": op, "E": e, "T": t, "d": d, "f": f, "flops": flops}
    x, dy, w, bf16 = _gemm_inputs(op, e, t, d, n2, dev)
    recipes = sorted({MODES[m][0] for m in modes.split(",")})
    if op == "wgrad":
        recipes = ["1x32"]  # unaligned groups: the 1x32 kernel incl. its re-layout gather
    if op in ("fprop", "dgrad", "wgrad16"):
        bf16_out = torch._grouped_mm(*bf16, offs=offs)
    for recipe in recipes:
        if op == "wgrad" and SYNTHETIC_K:
            a, b = _synthetic_k(dy.t().contiguous(), offs), _synthetic_k(x.t().contiguous(), offs)
        else:
            a, b = _operands(op, recipe, x, dy, w, offs)
        fn = _kernel_fn(op, recipe)
        real = [m for m in modes.split(",") if MODES[m][0] == recipe
                and "diag" not in (MODES[m][1] or {})]
        if op != "wgrad" and real:
            # at scale: vs a bf16 grouped GEMM of the dequantized operands, and SQNR vs the
            # bf16 GEMM of the unquantized inputs
            out = fn(a, b, offs, torch.bfloat16)
            ref = _dequant_ref(a, b, offs)
            res[f"rel_err_{recipe}"] = _rel(out, ref)
            res[f"sqnr_{recipe}"] = _sqnr(out, bf16_out)
            del out, ref
        b2 = _clone_mx(b)
        rot = Rotating([(a, b), (a, b2)])
        for mode in modes.split(","):
            r, tuning = MODES[mode]
            if r != recipe:
                continue

            def run(rot=rot, tuning=tuning, fn=fn):
                aa, bb = rot.next()
                return fn(aa, bb, offs, torch.bfloat16, tuning=tuning)

            try:
                res[f"mx_{mode}_us"] = bench_us(run, **REPS)
            except Exception as err:  # noqa: BLE001
                res[f"mx_{mode}_err"] = repr(err)[:200]
        del a, b, b2, rot
    del w

    rot = Rotating([bf16, (bf16[0].clone(), bf16[1].clone())])
    try:
        res["bf16_us"] = bench_us(lambda: torch._grouped_mm(*rot.next(), offs=offs), **REPS)
    except Exception as err:  # noqa: BLE001
        res["bf16_err"] = repr(err)[:200]
    del rot

    try:
        fp8 = _scaled_args(op, bf16, sizes)  # quantization: outside the timed region
        out = _fp8_mm(fp8, offs)
        ref = torch._grouped_mm(*bf16, offs=offs)
        res["fp8_rel_err_vs_bf16"] = _rel(out, ref)
        res["fp8_sqnr"] = _sqnr(out, ref)
        del out, ref
        rot = Rotating([fp8, _clone_fp8(fp8)])
        res["fp8_rowwise_us"] = bench_us(lambda: _fp8_mm(rot.next(), offs), **REPS)
        if fast_accum:
            res["fp8_rowwise_fast_us"] = bench_us(lambda: _fp8_mm(rot.next(), offs, fast=True),
                                                  **REPS)
    except Exception as err:  # noqa: BLE001
        res["fp8_err"] = repr(err)[:200]
    torch.cuda.empty_cache()
    return res


SYNTHETIC_K = False


def _synthetic_k(xt: torch.Tensor, offs: torch.Tensor):
    from moe_mxfp8 import layout as L
    from moe_mxfp8.mx_tensor import MXFP8Tensor

    rows, m = xt.shape
    nbytes = L.grouped_k_scale_bytes(rows, m, offs.numel())
    scale = torch.randint(120, 134, (nbytes,), device=xt.device, dtype=torch.uint8)
    return MXFP8Tensor(xt.to(torch.float8_e4m3fn), scale, "packed", offs, "k")


def _scaled_args(op, bf16, sizes: list[int]):
    """(mat_a, mat_b, scale_a, scale_b) for torch._scaled_grouped_mm, rowwise fp8.

    API facts (torch 2.11 / main; fp32 scales are dequantization multipliers, out[i, j] =
    acc[i, j] * scale_a[i] * scale_b[j]):
    - mat_a row-major, mat_b column-major in the last two dims, both e4m3, 16-byte aligned
      strides; mat_a.size(-1) and mat_b.size(-2), mat_b.size(-1) multiples of 16; offs int32
      cumulative ends (aten/src/ATen/native/cuda/GroupedBlas.cpp `_scaled_grouped_mm_cuda`,
      meta twin `_meta_grouped_mm_common` in torch/_meta_registrations.py).
    - 2D x 3D: scale_a (T,) per token row, scale_b (E, N) (`_check_scales_fp8_rowwise`).
    - 2D x 2D (K grouped): mat_a (M, T), mat_b (T, N), out (E, M, N); scale_a (E * M,), scale_b
      (E * N,), group-major: group g reads scale_a[g * M:(g + 1) * M] and scale_b[g * N:...]
      (GroupMMCommon.cuh `prepare_grouped_gemm_data`, K < 0 branch; test/test_scaled_matmul_cuda.py
      `test_scaled_grouped_gemm_2d_2d` slices the scales the same way). Every group but the last
      must be a multiple of 16 tokens (device assert, same file).
    torchao's fp8 rowwise MoE wgrad (torchao/prototype/moe_training/scaled_grouped_mm.py) calls
    it the same way: grad_output^T row-major + input column-major, per-group rowwise scales.
    """
    a, b = bf16
    if op in ("fprop", "dgrad"):
        # a (T, K) row-major; b (E, K, N) must be column-major (i.e. (E, N, K) contiguous)
        qa, sa = _fp8_rowwise(a.contiguous())
        bt = b.transpose(-2, -1).contiguous()  # (E, N, K)
        qb, sb = _fp8_rowwise(bt)
        return qa, qb.transpose(-2, -1), sa, sb
    bad = [n for n in sizes[:-1] if n % FP8_GROUP_ALIGN]
    if bad:
        raise ValueError(f"fp8 2D x 2D needs groups that are multiples of {FP8_GROUP_ALIGN} "
                         f"tokens (torch device-asserts otherwise); got {bad[:4]}...")
    # wgrad: a = dY^T (N, T) -> row-major; b = X (T, K) -> column-major, i.e. X^T (K, T)
    # contiguous. Both are quantized along T with one scale per row per group.
    qa, sa = _fp8_rowwise_grouped(a.contiguous(), sizes)
    qbt, sb = _fp8_rowwise_grouped(b.t().contiguous(), sizes)  # (K, T)
    return qa, qbt.t(), sa, sb


def _fp8_mm(fp8, offs, fast: bool = False):
    return torch._scaled_grouped_mm(*fp8, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)


def _clone_fp8(fp8):
    """Second input set for the rotation: copies of the operands (clone keeps the column-major
    strides of mat_b), shared scales."""
    qa, qb, sa, sb = fp8
    return qa.clone(), qb.clone(), sa, sb


def _grouped_ref(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """fp32 grouped GEMM by loops: 2D x 3D (rows of a grouped) or 2D x 2D (a's columns and b's
    rows grouped, output (E, M, N))."""
    outs, start = [], 0
    for g, n in enumerate(sizes):
        if b.dim() == 3:
            outs.append(a[start:start + n].float() @ b[g].float())
        else:
            outs.append(a[:, start:start + n].float() @ b[start:start + n].float())
        start += n
    return torch.cat(outs) if b.dim() == 3 else torch.stack(outs)


def _fp8_dequant_ref(fp8, sizes: list[int]) -> torch.Tensor:
    """fp32 reference of what torch._scaled_grouped_mm should return for these operands, from
    the documented scale semantics (independent of the kernel)."""
    qa, qb, sa, sb = fp8
    if qb.dim() == 3:
        return _grouped_ref(qa.float() * sa[:, None], qb.float() * sb[:, None, :], sizes)
    e = len(sizes)
    sa, sb = sa.view(e, -1), sb.view(e, -1)
    outs, start = [], 0
    for g, n in enumerate(sizes):
        a_g = qa[:, start:start + n].float() * sa[g][:, None]
        b_g = qb[start:start + n].float() * sb[g][None, :]
        outs.append(a_g @ b_g)
        start += n
    return torch.stack(outs)


# --check-baselines tolerances: bf16 output rounding is ~2e-3 relative; fp8 e4m3 input rounding
# (3 mantissa bits) gives ~3-5e-2 vs the unquantized inputs. A wrong layout or a scale applied to
# the wrong row/group gives O(1).
CHECK_TOL_EXACT = 1e-2
CHECK_TOL_FP8_VS_INPUTS = 0.1


def check_baselines(e: int = 4, rows: int = 256, n: int = 256, k: int = 256,
                    dev: str = "cuda") -> bool:
    """Every baseline call of the benchmark at a small shape vs fp32 loop references. Inputs
    have per-group and per-row/column magnitudes spread over ~2**6 so misplaced scales show."""
    sizes = [rows] * e
    t = e * rows
    offs = _offs(sizes, dev)
    torch.manual_seed(0)
    grp = torch.repeat_interleave(2.0 ** torch.arange(e), torch.tensor(sizes)).to(dev)[:, None]

    def spread(m):
        return torch.exp2(torch.randint(-3, 4, (m,), device=dev).float())

    x = (torch.randn(t, k, device=dev) * grp * spread(k)).to(torch.bfloat16)
    dy = (torch.randn(t, n, device=dev) / grp * spread(n)).to(torch.bfloat16)
    w = (torch.randn(e, n, k, device=dev) * spread(e)[:, None, None] * 0.05).to(torch.bfloat16)
    cases = {"fprop": (x, w.transpose(-2, -1)), "dgrad": (dy, w), "wgrad": (dy.t(), x)}
    ok = True
    for op, bf16 in cases.items():
        ref = _grouped_ref(bf16[0], bf16[1], sizes)
        checks = []
        try:
            out = torch._grouped_mm(*bf16, offs=offs)
            checks.append(("bf16 _grouped_mm vs fp32", _rel(out, ref), CHECK_TOL_EXACT))
        except Exception as err:  # noqa: BLE001
            checks.append((f"bf16 _grouped_mm raised {err!r}"[:200], float("nan"), 0.0))
        try:
            fp8 = _scaled_args(op, bf16, sizes)
            out = _fp8_mm(fp8, offs)
            checks.append(("fp8 _scaled_grouped_mm vs fp32 of its fp8 operands",
                           _rel(out, _fp8_dequant_ref(fp8, sizes)), CHECK_TOL_EXACT))
            checks.append(("fp8 _scaled_grouped_mm vs fp32 of the bf16 inputs", _rel(out, ref),
                           CHECK_TOL_FP8_VS_INPUTS))
        except Exception as err:  # noqa: BLE001
            checks.append((f"fp8 _scaled_grouped_mm raised {err!r}"[:200], float("nan"), 0.0))
        for what, rel, tol in checks:
            good = rel <= tol  # False for nan
            ok &= good
            print(f"check {op:5s} {what}: rel {rel:.2e} (tol {tol:.0e}) "
                  f"{'OK' if good else 'FAIL'}", flush=True)
    # the host-side guard: an unaligned 2D x 2D fp8 call must be refused before the device
    try:
        _scaled_args("wgrad", cases["wgrad"], [rows + 8] + [rows] * (e - 2) + [rows - 8])
        print("check wgrad unaligned groups refused on the host: FAIL", flush=True)
        ok = False
    except ValueError:
        print("check wgrad unaligned groups refused on the host: OK", flush=True)
    print("check-baselines:", "PASS" if ok else "FAIL", flush=True)
    return ok


def debug_k(sizes: list[int], n=256, k=256):
    """One small K-grouped problem vs the reference (device triage, one process per case)."""
    offs = _offs(sizes, "cuda")
    m = sum(sizes)
    a = R.quantize_colwise_ref(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), offs=offs)
    b = R.quantize_colwise_ref(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), offs=offs)
    out = _sm90("k")(a, b, offs, torch.float32)
    torch.cuda.synchronize()
    ref = R.grouped_mm(a, b, offs, torch.float32)
    per_group = [_rel(out[g], ref[g]) if sizes[g] else float(out[g].abs().max())
                 for g in range(len(sizes))]
    print("debug_k", sizes, "rel", _rel(out, ref), "per group", per_group, flush=True)


def profile(op: str, shape: str, block_rows: int, rows: int):
    """Prepare one problem, then run the kernel once between cudaProfilerStart/Stop (for ncu
    --profile-from-start off)."""
    e, _, d, f = SHAPES[shape]
    sizes = group_sizes(e, rows, align=16 if op == "wgrad16" else 1)
    offs = _offs(sizes, "cuda")
    n2 = 2 * f
    if op in ("wgrad", "wgrad16"):
        a = R.quantize_colwise_ref(torch.randn(rows, n2, device="cuda", dtype=torch.bfloat16),
                                   offs=offs)
        b = R.quantize_colwise_ref(torch.randn(rows, d, device="cuda", dtype=torch.bfloat16),
                                   offs=offs)
        fn = _sm90("k")
    else:
        kk, nn = (d, n2) if op == "fprop" else (n2, d)
        a = R.quantize_rowwise_ref(torch.randn(rows, kk, device="cuda", dtype=torch.bfloat16),
                                   offs=offs)
        w = torch.randn(e, nn, kk, device="cuda", dtype=torch.bfloat16) * 0.02
        b = R.quantize_weights_ref(w, axis="K", block_rows=block_rows)
        fn = _sm90("m")
    fn(a, b, offs, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(a, b, offs, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Speed-up over bf16 ``torch._grouped_mm`` per (shape, op): fp8 rowwise and every MXFP8
    mode timed in ``rows`` (one bar each), the 1.0 line = bf16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for r in rows for k in r if k.startswith("mx_") and k.endswith("_us")})
    names = {"1x32": "1x32 (exact MXFP8)", "1x128": "1x128 (defaults)",
             "1x128n": "1x128, 128x128 tiles", "1x128r": "1x128, row-by-row raster",
             "1x128c1": "1x128, no clusters"}
    series = [("fp8_rowwise_us", "fp8 rowwise (cuBLAS)")] + [
        (k, names.get(k[3:-3], k[3:-3])) for k in keys]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, len(rows) * 1.1), 4))
    for j, (key, label) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))]
        ys = [r["bf16_us"] / r[key] if r.get(key) else 0.0 for r in rows]
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['shape']}\n{r['op']}" for r in rows], fontsize=8)
    ax.set_ylabel("speed-up over bf16 torch._grouped_mm")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PEER_OPS = "fprop,dgrad,wgrad16"
PEER_MODES = "1x128"
LEGACY_SHAPES = "dsv3,qwen3,mixtral"


def peer_sizes(name: str, balanced: bool) -> list[int]:
    """The groups of the peer runs: 16-token multiples (torchao's op and the fp8 wgrad need
    them; `MXFP8MoE` pads to them), balanced or random around T/E."""
    s = GP.GEMM_SHAPES[name]
    return group_sizes(s.e, s.t, align=FP8_GROUP_ALIGN, balanced=balanced)


def run_peers(name: str, ops: list[str], modes: str, recipes: list[str], balanced: bool,
              torchao_op) -> Iterator[dict]:
    """Rows of one shape as they are measured: incl. quantization first
    (`gemm_peers.bench_passes`), then kernel only per op (`bench_op`; fp8 rowwise also with
    torchao's fast accumulation)."""
    s, sizes = GP.GEMM_SHAPES[name], peer_sizes(name, balanced)
    try:
        yield from GP.bench_passes(name, s, sizes, GP.op_impls(recipes, torchao_op),
                                   functools.partial(bench_us, **REPS))
    except Exception as err:  # noqa: BLE001  (report and go on with the kernel rows)
        print(f"{name} incl. quantization FAILED: {err!r}"[:300], flush=True)
    torch.cuda.empty_cache()
    recipe_of = {m: MODES[m][0] for m in MODES}
    for op in ops:
        try:
            res = bench_op(op, *SHAPES[name], modes=modes, sizes=sizes, fast_accum=True)
        except Exception as err:  # noqa: BLE001  (report and go on with the next op)
            print(f"{name} {op} FAILED: {err!r}"[:300], flush=True)
            continue
        print(json.dumps(res), flush=True)
        yield from GP.kernel_rows(res, name, s, recipe_of)


def sweep_op(op: str, name: str, sizes: list[int], bands: tuple[int, ...],
             stages: tuple[int, ...] = (0,), dev: str = "cuda") -> list[dict]:
    """Every configuration of `gemm_peers.sweep_tunings` forced in turn on one 1x128 GEMM
    (kernel only): checked against the bf16 GEMM of its dequantized operands, then timed; bf16
    ``torch._grouped_mm`` timed once in the same process."""
    s = GP.GEMM_SHAPES[name]
    e, t, d, f = SHAPES[name]
    offs = _offs(sizes, dev)
    x, dy, w, bf16 = _gemm_inputs(op, e, t, d, 2 * f, dev)
    rot = Rotating([bf16, (bf16[0].clone(), bf16[1].clone())])
    bf16_us = bench_us(lambda: torch._grouped_mm(*rot.next(), offs=offs), **REPS)
    a, b = _operands(op, "1x128", x, dy, w, offs)
    del x, dy, w, bf16, rot
    ref = _dequant_ref(a, b, offs)
    b2 = _clone_mx(b)
    fn = _kernel_fn(op, "1x128")
    rows = []
    for cfg in GP.sweep_tunings(op, s, bands, stages):
        got = {"bf16_us": bf16_us}
        try:
            out = fn(a, b, offs, torch.bfloat16, tuning=cfg["tuning"])
            got["rel_err"] = _rel(out, ref)
            del out
            rot = Rotating([(a, b), (a, b2)])
            got["us"] = bench_us(lambda rot=rot, tuning=cfg["tuning"]: fn(
                *rot.next(), offs, torch.bfloat16, tuning=tuning), **REPS)
        except Exception as err:  # noqa: BLE001  (report and go on with the sweep)
            got["error"] = repr(err)[:300]
        rows.append(GP.sweep_row(name, op, s, cfg, **got))
        print(json.dumps(rows[-1]), flush=True)
    del a, b, b2, ref
    torch.cuda.empty_cache()
    return rows


def merge(paths: list[str]) -> dict:
    """One report from several saved ``--peers`` / ``--sweep-configs`` JSON files (device,
    ceilings, routing from the first that has them; rows and sweep rows concatenated)."""
    out = {"rows": [], "sweep": []}
    for p in paths:
        saved = json.loads(Path(p).read_text())
        for key in ("device", "ceilings", "routing", "torchao"):
            if saved.get(key) and not out.get(key):
                out[key] = saved[key]
        out["rows"] += saved.get("rows", [])
        out["sweep"] += saved.get("sweep", [])
    return out


def write_report(report: dict, json_path: str | None, md_path: str | None) -> str:
    text = GP.markdown(report["rows"], report.get("ceilings"), report.get("device"),
                       report.get("routing", ""), report.get("sweep"))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    if md_path:
        Path(md_path).write_text(text + "\n")
    return text


def main_peers(args) -> None:
    """``--peers`` / ``--sweep-configs``: one report (JSON, markdown) of this process, written
    again after each row or swept GEMM (a run cut short keeps what it measured)."""
    names = (args.shapes or ",".join(GP.GEMM_SHAPES)).split(",")
    balanced = args.routing == "balanced"
    report = {"device": device_info(), "rows": [], "sweep": [],
              "routing": f"{args.routing}, multiples of {FP8_GROUP_ALIGN} tokens"}
    if args.ceilings_json:
        report["ceilings"] = json.loads(Path(args.ceilings_json).read_text())
    elif args.ceilings:
        from benchmarks.ceilings import measure

        report["ceilings"] = measure()
    ops = (args.ops or PEER_OPS).split(",")
    bands = tuple(int(v) for v in args.sweep_bands.split(","))
    stages = tuple(int(v) for v in args.sweep_stages.split(","))
    if args.peers:
        torchao_op, report["torchao"] = GP.torchao_fp8_rowwise()
        print("torchao:", report["torchao"], flush=True)
    for name in names:
        if args.peers:
            for row in run_peers(name, ops, args.modes or PEER_MODES,
                                 args.op_recipes.split(","), balanced, torchao_op):
                report["rows"].append(row)
                write_report(report, args.json, args.md)
        if args.sweep_configs:
            for op in ops:
                try:
                    report["sweep"] += sweep_op(op, name, peer_sizes(name, balanced), bands,
                                                stages)
                except Exception as err:  # noqa: BLE001  (report and go on)
                    print(f"sweep {name} {op} FAILED: {err!r}"[:300], flush=True)
                write_report(report, args.json, args.md)
    print(write_report(report, args.json, args.md), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic-k", action="store_true",
                    help="wgrad operands from random bytes (no reference quantizer)")
    ap.add_argument("--check-baselines", action="store_true",
                    help="run every baseline call at a small shape vs fp32 (seconds), then exit")
    ap.add_argument("--debug-k", default=None, help="comma-separated group sizes")
    ap.add_argument("--profile", default=None, help="op:shape:block_rows:rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=None,
                    help=f"of {','.join(SHAPES)} (default {LEGACY_SHAPES}; --peers: all)")
    ap.add_argument("--ops", default=None,
                    help=f"of {','.join(OPS)} (default all; --peers: {PEER_OPS})")
    ap.add_argument("--modes", default=None,
                    help=f"of {','.join(MODES)} (default {DEFAULT_MODES}; --peers: {PEER_MODES})")
    peers = ap.add_argument_group("peers: bf16, torchao fp8 rowwise and moe_mxfp8 in one run")
    peers.add_argument("--peers", action="store_true",
                       help="kernel-only and incl.-quantization rows (16-aligned groups)")
    peers.add_argument("--sweep-configs", action="store_true",
                       help="force every admissible 1x128 Hopper kernel configuration in turn")
    peers.add_argument("--sweep-bands", default=f"1,{GP.RASTER_BAND}",
                       help="raster bands the sweep tries")
    peers.add_argument("--sweep-stages", default="0",
                       help="pipeline stages the sweep tries (0: as many as fit)")
    peers.add_argument("--routing", choices=("balanced", "random"), default="balanced",
                       help="group sizes of --peers / --sweep-configs")
    peers.add_argument("--op-recipes", default="1x128",
                       help="scale_blocks recipes of moe_mxfp8.grouped_mm timed incl. quantization")
    peers.add_argument("--ceilings", action="store_true", help="measure the ceilings here")
    peers.add_argument("--ceilings-json", default=None,
                       help="ceilings measured earlier (benchmarks.ceilings --json)")
    peers.add_argument("--md", default=None, help="write the markdown report here")
    peers.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                       help="one report (--json, --md) from saved --peers/--sweep JSONs (no GPU)")
    ap.add_argument("--reps", type=int, default=30, help="calls per timed CUDA-graph replay")
    ap.add_argument("--rounds", type=int, default=5, help="timed replays (median)")
    ap.add_argument("--png", default=None, help="bar chart of the speed-ups")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="draw --png from a --json file written earlier (no GPU), then exit")
    args = ap.parse_args()
    if args.merge:
        report = merge(args.merge)
        if args.ceilings_json:
            report["ceilings"] = json.loads(Path(args.ceilings_json).read_text())
        print(write_report(report, args.json, args.md))
        return
    if args.peers or args.sweep_configs:
        REPS.update(reps=args.reps, rounds=args.rounds)
        main_peers(args)
        return
    args.shapes = args.shapes or LEGACY_SHAPES
    args.ops = args.ops or ",".join(OPS)
    args.modes = args.modes or DEFAULT_MODES
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        dev = saved.get("device", {})
        plot(saved["rows"], args.png or "gemm.png", f"{dev.get('gpu', '')} {dev.get('date', '')}")
        return
    global SYNTHETIC_K
    SYNTHETIC_K = args.synthetic_k
    if args.check_baselines:
        raise SystemExit(0 if check_baselines() else 1)
    if args.debug_k:
        debug_k([int(v) for v in args.debug_k.split(",")])
        return
    if args.profile:
        op, shape, br, rows = args.profile.split(":")
        profile(op, shape, int(br), int(rows))
        return
    info = device_info()
    REPS.update(reps=args.reps, rounds=args.rounds)
    modes = [m for m in args.modes.split(",") if m]
    rows = []
    for name in args.shapes.split(","):
        e, t, d, f = SHAPES[name]
        for op in args.ops.split(","):
            try:
                r = bench_op(op, e, t, d, f, modes=",".join(modes))
            except Exception as err:  # noqa: BLE001
                print(f"{name} {op} FAILED: {err!r}"[:300], flush=True)
                continue
            r["shape"] = name
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{info['gpu']} {info['date']} torch {info['torch']}")
    print("us (x bf16) per kernel mode; SQNR dB vs the bf16 GEMM of the unquantized inputs")
    hdr = ["shape", "op", "bf16 us", "fp8row us (x)"] + [f"{m} us (x)" for m in modes] + [
        "SQNR 1x32/1x128/fp8row", "relerr 1x128"]
    print(" | ".join(hdr))
    for r in rows:
        bf = r.get("bf16_us")

        def cell(key, r=r, bf=bf):
            if key not in r:
                return "-"
            return f"{r[key]:.0f} ({bf / r[key]:.2f})" if bf else f"{r[key]:.0f}"

        sq = "/".join(f"{r[k]:.1f}" if k in r else "-"
                      for k in ("sqnr_1x32", "sqnr_1x128", "fp8_sqnr"))
        print(" | ".join([r["shape"], r["op"], f"{bf:.0f}" if bf else "-",
                          cell("fp8_rowwise_us")] + [cell(f"mx_{m}_us") for m in modes]
                         + [sq, f"{r.get('rel_err_1x128', float('nan')):.1e}"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": info, "rows": rows}, fh, indent=1)
    if args.png and rows:
        plot(rows, args.png, f"{info['gpu']} {info['date']}")


if __name__ == "__main__":
    main()
