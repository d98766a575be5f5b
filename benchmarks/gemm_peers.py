"""The grouped GEMMs against their peers, in one process: shapes, FLOP and byte counts, the
tables, torchao's FP8-rowwise training op, the op-level timing (quantization included) and the
list of Hopper kernel configurations that `bench_grouped_gemm --sweep-configs` forces in turn.

Peers: bf16 ``torch._grouped_mm`` (the baseline); torchao's FP8-rowwise MoE training op
(``torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm``: dynamic rowwise
quantization in Triton, then ``torch._scaled_grouped_mm`` with fast accumulation, for fprop,
dgrad and wgrad); and the public `moe_mxfp8.grouped_mm`.

Two sections per shape:

* **incl. quantization**: the public ops with autograd, forward (grad enabled, as in training)
  and forward + backward (``torch.autograd.grad`` of both inputs), every quantization inside
  the timed region;
* **kernel only**: one GEMM on operands quantized beforehand (fprop, dgrad, wgrad;
  `bench_grouped_gemm.bench_op`), torchao's GEMM call being ``torch._scaled_grouped_mm`` on
  rowwise FP8 with ``use_fast_accum=True``.

Counting (`gemm_flops`, `kernel_bytes`, `op_bytes`): 2 T N K FLOPs per GEMM (forward one GEMM,
forward + backward three). Kernel-only bytes are the operands as that implementation stores
them (bf16 2 B per element; FP8 rowwise 1 B plus a 4-byte scale per row, per group in wgrad;
MXFP8 1 B plus one scale byte per 32) and the bf16 output; op-level bytes are the bf16 tensors
at the op's boundary -- forward reads x and w and writes y, backward reads dy, x and w and
writes dx and dw -- the same count for every implementation (an effective bandwidth).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from moe_mxfp8.kernels.grouped_gemm.problem import MODE_K, MODE_M, GroupedProblem
from moe_mxfp8.kernels.grouped_gemm.sm90_config import (
    RASTER_BAND,
    TILE_N,
    TILE_NS,
    GroupedGemmSm90Host,
    output_columns,
)
from moe_mxfp8.kernels.mx_format import BLOCK_SIZE


@dataclass(frozen=True)
class GemmShape:
    """One MoE expert GEMM: E experts, T routed rows, reduced K, output N (fprop (T, K) x
    (E, N, K) -> (T, N))."""

    e: int
    t: int
    k: int
    n: int


GEMM_SHAPES = {
    "dsv3": GemmShape(8, 131072, 7168, 4096),  # DeepSeek-V3 gate+up projection
    "qwen3": GemmShape(128, 131072, 2048, 1536),  # Qwen3-30B-A3B: 16384 tokens x top-8, gate+up
    "mixtral": GemmShape(8, 32768, 4096, 28672),  # Mixtral 8x22B-like gate+up (f = 14336)
    "mixtral_down": GemmShape(8, 32768, 14336, 4096),  # its down projection
}

KERNEL_OPS = ("fprop", "dgrad", "wgrad")
OP_PASSES = ("fwd", "fwd+bwd")
GEMMS_PER_PASS = {"fwd": 1, "fwd+bwd": 3}
BF16_BYTES = 2
FP8_SCALE_BYTES = 4  # one fp32 scale per row (per group in wgrad)
FORMATS = ("bf16", "fp8row", "mxfp8")
# torchao's FP8-rowwise training op (torchao 0.18); module and name, imported on the device only
TORCHAO_MODULE = "torchao.prototype.moe_training"
TORCHAO_OP = "_to_fp8_rowwise_then_scaled_grouped_mm"
# impl names in result rows (kernel only: bench_op's keys; incl. quantization: `op_impls`)
BASELINE = "bf16"
TORCHAO = "torchao"
IMPL_LABELS = {
    "bf16": "bf16 torch._grouped_mm",
    "fp8row": "fp8 rowwise torch._scaled_grouped_mm",
    "torchao": "torchao fp8 rowwise",
}


def impl_label(impl: str) -> str:
    """Table name of an impl: the peers by name, ``mx_<mode>`` as "moe_mxfp8 <mode>"."""
    return IMPL_LABELS.get(impl) or f"moe_mxfp8 {impl.removeprefix('mx_')}"


def impl_format(impl: str) -> str:
    """Storage format of an impl's GEMM operands (the bytes it moves, the peak it runs at)."""
    if impl == BASELINE:
        return "bf16"
    if impl.startswith("mx_"):
        return "mxfp8"
    if impl in ("fp8row", TORCHAO):
        return "fp8row"
    raise ValueError(f"unknown impl {impl!r}")


# ------------------------------------------------------------------------------- counting


def gemm_flops(s: GemmShape) -> float:
    """FLOPs of one of the shape's GEMMs (fprop, dgrad and wgrad alike)."""
    return 2.0 * s.t * s.n * s.k


def pass_flops(s: GemmShape, pass_: str) -> float:
    """FLOPs of a forward (one GEMM) or forward + backward (three GEMMs) pass."""
    return GEMMS_PER_PASS[pass_] * gemm_flops(s)


def stored_bytes(fmt: str, rows: int, cols: int, scale_sets: int = 1) -> int:
    """Bytes of a (rows, cols) operand quantized along cols, as ``fmt`` stores it;
    ``scale_sets``: independent row-scale sets (fp8 rowwise wgrad: one per group)."""
    if fmt == "bf16":
        return BF16_BYTES * rows * cols
    if fmt == "fp8row":
        return rows * cols + FP8_SCALE_BYTES * rows * scale_sets
    if fmt == "mxfp8":
        return rows * cols + rows * -(-cols // BLOCK_SIZE)
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def kernel_operands(op: str, s: GemmShape) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(A rows, cols), (B rows, cols) -- each quantized along its cols, the reduced axis --
    and the output's element count of one kernel-only GEMM."""
    op = op.removesuffix("16")  # wgrad16: wgrad with 16-aligned groups, same counts
    if op == "fprop":
        return (s.t, s.k), (s.e * s.n, s.k), s.t * s.n
    if op == "dgrad":
        return (s.t, s.n), (s.e * s.k, s.n), s.t * s.k
    if op == "wgrad":
        return (s.n, s.t), (s.k, s.t), s.e * s.n * s.k
    raise ValueError(f"op must be one of {KERNEL_OPS}, got {op!r}")


def kernel_bytes(op: str, s: GemmShape, fmt: str) -> int:
    """Bytes one kernel-only GEMM moves at least: both operands as ``fmt`` stores them and the
    bf16 output."""
    (ar, ac), (br, bc), out = kernel_operands(op, s)
    sets = s.e if op.startswith("wgrad") else 1
    return (stored_bytes(fmt, ar, ac, sets) + stored_bytes(fmt, br, bc, sets)
            + BF16_BYTES * out)


def op_bytes(s: GemmShape, pass_: str) -> int:
    """The bf16 tensors at the op's boundary: forward reads x (T, K) and w (E, N, K) and writes
    y (T, N); backward reads dy, x and w and writes dx and dw."""
    x, w, y = s.t * s.k, s.e * s.n * s.k, s.t * s.n
    fwd = x + w + y
    if pass_ == "fwd":
        return BF16_BYTES * fwd
    if pass_ == "fwd+bwd":
        return BF16_BYTES * (fwd + (y + x + w) + (x + w))
    raise ValueError(f"pass must be one of {OP_PASSES}, got {pass_!r}")


# ------------------------------------------------------------------------------- rows


def make_row(section: str, shape: str, gemm: str, impl: str, us: float | None, flops: float,
             nbytes: int, **extra) -> dict:
    """One result row: ``section`` "op" (incl. quantization) or "kernel"; ``gemm`` a pass
    (fwd, fwd+bwd) or a kernel op; ``us`` None where it failed (``extra["error"]``)."""
    row = {"section": section, "shape": shape, "gemm": gemm, "impl": impl, "us": us,
           "flops": flops, "bytes": nbytes, **extra}
    if us:
        row["tflops"] = flops / us / 1e6
        row["gbps"] = nbytes / us / 1e3
    return row


def kernel_rows(res: dict, shape: str, s: GemmShape, recipe_of: dict[str, str]) -> list[dict]:
    """Result rows of one `bench_grouped_gemm.bench_op` result ``res``: its times
    ``bf16_us``, ``fp8_rowwise_us``, ``fp8_rowwise_fast_us`` (torchao's GEMM call) and
    ``mx_<mode>_us`` (``mx_<mode>_err`` where a mode failed); ``recipe_of``: mode -> its
    scale-block recipe (whose ``sqnr_<recipe>`` the row carries)."""
    op = res["op"]
    impls = {"bf16": BASELINE, "fp8_rowwise": "fp8row", "fp8_rowwise_fast": TORCHAO}
    impls.update({k.rsplit("_", 1)[0]: k.rsplit("_", 1)[0] for k in res
                  if k.startswith("mx_") and k.endswith(("_us", "_err"))})
    rows = []
    for key, impl in impls.items():
        fmt = impl_format(impl)
        extra = {}
        if fmt == "fp8row" and "fp8_sqnr" in res:
            extra["sqnr"] = res["fp8_sqnr"]
        if fmt == "mxfp8" and f"sqnr_{recipe_of.get(impl[3:])}" in res:
            extra["sqnr"] = res[f"sqnr_{recipe_of[impl[3:]]}"]
        # (bench_op reports one error for both fp8 rowwise calls: "fp8_err")
        err = res.get(f"{key}_err") or (res.get("fp8_err") if fmt == "fp8row" else None)
        if f"{key}_us" in res:
            us = res[f"{key}_us"]
        elif err:
            us, extra["error"] = None, err
        else:
            continue
        rows.append(make_row("kernel", shape, op, impl, us, gemm_flops(s),
                             kernel_bytes(op, s, fmt), **extra))
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's speed-up over bf16 (``x_bf16``) and over torchao (``x_torchao``) of the same
    (section, shape, gemm) -- in place; rows without a time get none."""
    base = {}
    for r in rows:
        if r.get("us") and r["impl"] in (BASELINE, TORCHAO):
            base[(r["section"], r["shape"], r["gemm"], r["impl"])] = r["us"]
    for r in rows:
        for impl, key in ((BASELINE, "x_bf16"), (TORCHAO, "x_torchao")):
            ref = base.get((r["section"], r["shape"], r["gemm"], impl))
            if ref and r.get("us"):
                r[key] = ref / r["us"]
    return rows


def peak_tflops(fmt: str, ceilings: dict | None) -> float | None:
    """The dense-matmul ceiling an impl of ``fmt`` is held against (bf16 or fp8)."""
    if not ceilings:
        return None
    return ceilings.get("bf16_matmul_TFLOPs" if fmt == "bf16" else "fp8_matmul_TFLOPs")


# ------------------------------------------------------------------------------- tables


def _num(v, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ratio(v) -> str:
    return _num(v, "{:.2f}")


def ceilings_line(ceilings: dict | None) -> str:
    if not ceilings:
        return "Ceilings: not measured."
    return (f"Ceilings (same run): bf16 dense mm {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s, "
            f"fp8 `torch._scaled_mm` {ceilings['fp8_matmul_TFLOPs']:.0f} TFLOP/s, copy "
            f"{ceilings['copy_TBps']:.2f} TB/s (read + write).")


SECTION_TITLES = {"op": "incl. quantization", "kernel": "kernel only"}
DETAIL_HEADER = ("| GEMM | impl | µs | TFLOP/s | GB/s | × bf16 | × torchao | % of peak | "
                 "SQNR dB |")


def detail_table(rows: list[dict], ceilings: dict | None) -> list[str]:
    """Markdown lines: one row per (section, GEMM, impl) of one shape."""
    out = [DETAIL_HEADER, "|" + "---|" * (DETAIL_HEADER.count("|") - 1)]
    for r in rows:
        what = f"{r['gemm']}, {SECTION_TITLES[r['section']]}"
        if r.get("us") is None:
            out.append(f"| {what} | {impl_label(r['impl'])} | failed: "
                       f"{str(r.get('error', ''))[:80]} | | | | | | |")
            continue
        peak = peak_tflops(impl_format(r["impl"]), ceilings)
        pct = 100 * r["tflops"] / peak if peak else None
        graph = "" if r.get("graphed", True) else " (eager)"
        out.append(
            f"| {what} | {impl_label(r['impl'])}{graph} | {r['us']:.0f} | {r['tflops']:.0f} | "
            f"{r['gbps']:.0f} | {_ratio(r.get('x_bf16'))} | {_ratio(r.get('x_torchao'))} | "
            f"{_num(pct)} | {_num(r.get('sqnr'), '{:.1f}')} |")
    return out


SUMMARY_COLUMNS = tuple(("op", p) for p in OP_PASSES) + tuple(
    ("kernel", op) for op in ("fprop", "dgrad", "wgrad16"))


def summary_table(rows: list[dict], shapes: list[str]) -> list[str]:
    """Markdown lines: × bf16 per (shape, impl), one column per pass (incl. quantization) and
    per kernel-only GEMM."""
    cols = [f"{g} ({'incl. quant.' if sec == 'op' else 'kernel'})" for sec, g in SUMMARY_COLUMNS]
    out = ["| shape | impl | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for shape in shapes:
        mine = [r for r in rows if r["shape"] == shape]
        impls = list(dict.fromkeys(r["impl"] for r in mine if r["impl"] != BASELINE))
        for impl in impls:
            cells = []
            for sec, g in SUMMARY_COLUMNS:
                hit = [r for r in mine if (r["section"], r["gemm"], r["impl"]) == (sec, g, impl)]
                cells.append(_ratio(hit[0].get("x_bf16")) if hit else "-")
            out.append(f"| {shape} | {impl_label(impl)} | " + " | ".join(cells) + " |")
    return out


def markdown(rows: list[dict], ceilings: dict | None = None, device: dict | None = None,
             routing: str = "", sweep: list[dict] | None = None) -> str:
    """The report: device and ceilings, the × bf16 summary, then per shape the detail table,
    then the configuration sweep (if any)."""
    add_ratios(rows)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    dev = device or {}
    lines = [f"# Grouped GEMMs vs peers: {dev.get('gpu', '?')}, torch {dev.get('torch', '?')}, "
             f"{dev.get('date', '?')}", "", ceilings_line(ceilings), ""]
    if routing:
        lines += [f"Groups: {routing}.", ""]
    if rows:
        lines += ["## × bf16 `torch._grouped_mm`", ""] + summary_table(rows, shapes) + [""]
    for shape in shapes:
        s = GEMM_SHAPES.get(shape)
        dims = f" (E {s.e}, T {s.t}, K {s.k}, N {s.n})" if s else ""
        lines += [f"## {shape}{dims}", ""]
        lines += detail_table([r for r in rows if r["shape"] == shape], ceilings) + [""]
    if sweep:
        lines += ["## Hopper kernel configurations (1x128, kernel only)", ""]
        lines += sweep_table(sweep) + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- config sweep


def kernel_problem(op: str, s: GemmShape, scale_blocks: str = "1x128") -> GroupedProblem:
    """The grouped-GEMM problem of a kernel-only op in the launcher's terms (M-grouped fprop
    and dgrad: n output columns, k reduced; K-grouped wgrad: n = N rows of dY^T, k = K rows
    of X^T)."""
    op = op.removesuffix("16")
    mode, n, k = {"fprop": (MODE_M, s.n, s.k), "dgrad": (MODE_M, s.k, s.n),
                  "wgrad": (MODE_K, s.n, s.k)}[op]
    return GroupedProblem(mode, s.t, n, k, s.e, torch.bfloat16, scale_blocks,
                          torch.device("cpu"))


def effective(cfg) -> tuple:
    """What the kernel does with a configuration: (tile_n, overlapped promotion (128-column
    tiles only; None leaves it to the grouping), band_m, cluster_n, stages)."""
    overlap = None
    if cfg.tile_n == TILE_N:
        overlap = cfg.mode == MODE_M if cfg.overlap_promotion is None else cfg.overlap_promotion
    return cfg.tile_n, overlap, cfg.band_m, cfg.cluster_n, cfg.stages


def config_name(cfg) -> str:
    tile_n, overlap, band, cluster, stages = effective(cfg)
    prom = "" if overlap is None else (" overlap" if overlap else " seq")
    st = f" stages {stages}" if stages else ""
    return f"128x{tile_n}{prom} band {band} cluster {cluster}{st}"


def sweep_tunings(op: str, s: GemmShape, bands: tuple[int, ...] = (1, RASTER_BAND),
                  stages: tuple[int, ...] = (0,)) -> list[dict]:
    """Every distinct configuration of the 1x128 kernel for ``op`` at ``s`` that the launcher
    can be forced to (``tuning`` overrides of `GroupedGemmSm90Host.select_config`): tile width,
    overlapped promotion (128-column tiles), raster band, cluster, pipeline stages (0: as many
    as fit). Entries ``{"name", "tuning", "default"}``, the heuristic's own choice first."""
    prob = kernel_problem(op, s)
    select = GroupedGemmSm90Host.select_config
    default = select(prob)
    wide_ok = output_columns(prob.mode, prob.n, prob.k) > TILE_N
    seen, out = set(), []
    for tile_n in TILE_NS:
        if tile_n != TILE_N and not wide_ok:
            continue
        for overlap in ((None,) if tile_n != TILE_N else (False, True)):
            for band in bands:
                for cluster in (1, 2):
                    for st in stages:
                        tuning = {"tile_n": tile_n, "band_m": band, "cluster_n": cluster,
                                  "stages": st}
                        if overlap is not None:
                            tuning["overlap_promotion"] = overlap
                        cfg = select(prob, tuning)  # cluster_n 2 falls back where tiles do not pair
                        key = effective(cfg)
                        if key in seen:
                            continue
                        seen.add(key)
                        out.append({"name": config_name(cfg), "tuning": tuning,
                                    "default": key == effective(default)})
    out.sort(key=lambda c: not c["default"])
    return out


SWEEP_HEADER = "| shape | GEMM | config | µs | TFLOP/s | × default | × bf16 | rel err |"
# a configuration's output vs the bf16 GEMM of its dequantized operands: bf16 rounding is
# ~2e-3 relative; a wrong tile walk or scale gives O(1)
SWEEP_REL_TOL = 1e-2


def sweep_ok(row: dict) -> bool:
    """Timed and correct (rel err within `SWEEP_REL_TOL`; False for nan)."""
    return bool(row.get("us")) and row.get("rel_err", float("nan")) <= SWEEP_REL_TOL


def sweep_table(rows: list[dict]) -> list[str]:
    """Markdown lines of sweep rows (``shape, gemm, name, default, us, bf16_us, rel_err``):
    × default against the heuristic's choice of the same GEMM; the fastest correct one per
    GEMM in bold, wrong results marked."""
    out = [SWEEP_HEADER, "|---|---|---|---|---|---|---|---|"]
    groups = list(dict.fromkeys((r["shape"], r["gemm"]) for r in rows))
    for shape, gemm in groups:
        mine = [r for r in rows if (r["shape"], r["gemm"]) == (shape, gemm)]
        dflt = next((r["us"] for r in mine if r["default"] and r.get("us")), None)
        timed = [r["us"] for r in mine if sweep_ok(r)]
        best = min(timed) if timed else None
        for r in mine:
            name = r["name"] + (" (default)" if r["default"] else "")
            if not r.get("us"):
                out.append(f"| {shape} | {gemm} | {name} | failed: "
                           f"{str(r.get('error', ''))[:80]} | | | | |")
                continue
            us = f"**{r['us']:.0f}**" if r["us"] == best else f"{r['us']:.0f}"
            out.append(
                f"| {shape} | {gemm} | {name} | {us} | {r['flops'] / r['us'] / 1e6:.0f} | "
                f"{_ratio(dflt / r['us'] if dflt else None)} | "
                f"{_ratio(r['bf16_us'] / r['us'] if r.get('bf16_us') else None)} | "
                f"{_num(r.get('rel_err'), '{:.1e}')}{'' if sweep_ok(r) else ' WRONG'} |")
    return out


# ------------------------------------------------------------------------------- peers on a GPU


def bind_torchao(op: Callable) -> Callable:
    """torchao's op as ``f(x, w_t, offs)``: bf16 output, and no token-group padding where the
    signature has the switch (the groups are 16-aligned already; torchao 0.18 supports only
    ``pad_token_groups_for_grouped_mm=False``)."""
    kwargs = {"out_dtype": torch.bfloat16}
    if "pad_token_groups_for_grouped_mm" in inspect.signature(op).parameters:
        kwargs["pad_token_groups_for_grouped_mm"] = False
    return functools.partial(op, **kwargs)


def torchao_fp8_rowwise() -> tuple[Callable | None, str]:
    """(torchao's op bound by `bind_torchao`, its version) or (None, why it is missing)."""
    import importlib

    try:
        mod = importlib.import_module(TORCHAO_MODULE)
        op = getattr(mod, TORCHAO_OP)
    except Exception as err:  # noqa: BLE001  (missing, or it fails to import here: no rows)
        return None, f"torchao unavailable: {err!r}"[:200]
    import torchao

    return bind_torchao(op), getattr(torchao, "__version__", "?")


def op_impls(recipes: list[str], torchao_op: Callable | None) -> dict[str, Callable]:
    """The ops with autograd timed "incl. quantization", as ``f(x, w_t, offs) -> y``: bf16,
    `moe_mxfp8.grouped_mm` per scale-block recipe (16-aligned groups: ``aligned_groups``, as
    `MXFP8MoE` calls it) and torchao's op."""
    import moe_mxfp8

    impls = {BASELINE: lambda x, w_t, offs: torch._grouped_mm(x, w_t, offs=offs)}
    for r in recipes:
        impls[f"mx_{r}"] = functools.partial(moe_mxfp8.grouped_mm, scale_blocks=r,
                                             aligned_groups=True)
    if torchao_op is not None:
        impls[TORCHAO] = torchao_op
    return impls


def _inputs(s: GemmShape, seed: int, dev: str):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(s.t, s.k, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(s.e, s.n, s.k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    dy = torch.randn(s.t, s.n, device=dev, generator=g).to(torch.bfloat16)
    return x, w.requires_grad_(), dy


def run_pass(fn: Callable, pass_: str, x, w, dy, offs):
    """One pass of ``fn``: forward with grad enabled (-> (y,)), or forward + backward
    (-> (y, dx, dw)). ``w`` (E, N, K) enters as ``w_t = w.transpose(-2, -1)`` (column-major,
    as torchao requires)."""
    y = fn(x, w.transpose(-2, -1), offs)
    if pass_ == "fwd":
        return (y,)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


@torch.no_grad()
def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |out - ref|^2) (torchao's measure)."""
    ref = ref.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (out.float() - ref).pow(2).sum()))


def bench_passes(shape: str, s: GemmShape, sizes: list[int], impls: dict[str, Callable],
                 bench_us: Callable, dev: str = "cuda") -> Iterator[dict]:
    """Rows "incl. quantization", one at a time: every impl, forward and forward + backward, on
    two rotating input sets (cold L2), CUDA-graph replays (eager where capture fails:
    ``graphed`` False). SQNR (dB, the worst of y, dx, dw) against the bf16 op on the same
    inputs, measured first (which also compiles and autotunes every impl)."""
    from benchmarks.timing import Rotating

    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    sets = [_inputs(s, seed, dev) for seed in (1, 2)]
    ref = run_pass(impls[BASELINE], "fwd+bwd", *sets[0], offs)
    sqnr, errors = {}, {}
    for name, fn in impls.items():
        if name == BASELINE:
            continue
        try:
            got = run_pass(fn, "fwd+bwd", *sets[0], offs)
            sqnr[name] = min(sqnr_db(o, r) for o, r in zip(got, ref, strict=True))
            del got
        except Exception as err:  # noqa: BLE001  (report and go on)
            errors[name] = repr(err)[:300]
    del ref
    for pass_ in OP_PASSES:
        for name, fn in impls.items():
            extra = {"sqnr": sqnr[name]} if name in sqnr else {}
            flops, nbytes = pass_flops(s, pass_), op_bytes(s, pass_)
            if name in errors:
                yield make_row("op", shape, pass_, name, None, flops, nbytes, error=errors[name])
                continue
            rot = Rotating(sets)

            def step(fn=fn, pass_=pass_, rot=rot):
                return run_pass(fn, pass_, *rot.next(), offs)

            us, graphed, err = _time(step, bench_us)
            print(f"{shape} {pass_} {name}: {us} us graphed={graphed}", flush=True)
            yield make_row("op", shape, pass_, name, us, flops, nbytes, graphed=graphed,
                           **extra, **({"error": err} if err else {}))
    del sets
    torch.cuda.empty_cache()


def _time(step: Callable, bench_us: Callable) -> tuple[float | None, bool, str]:
    """(median us, CUDA-graphed, error): graph replays, else eager replays."""
    try:
        return bench_us(step), True, ""
    except Exception as err:  # noqa: BLE001  (capture failed: time it eagerly)
        first = repr(err)[:200]
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    try:
        return bench_us(step, use_graph=False), False, f"graph capture failed: {first}"
    except Exception as err:  # noqa: BLE001
        return None, False, repr(err)[:300]


def sweep_row(shape: str, op: str, s: GemmShape, cfg: dict, **measured) -> dict:
    return {"shape": shape, "gemm": op, "name": cfg["name"], "tuning": cfg["tuning"],
            "default": cfg["default"], "flops": gemm_flops(s), **measured}

