"""The MXFP8 quantizer kernels' configuration, compile cache and entry points, without CuTeDSL.

The kernel classes are in `quantize` (CuTeDSL, imported only where a kernel is compiled), the
configuration in `quantize_config`; a kernel loaded from the compile cache is launched from
here alone (`native`). The entry points
return plain ``(data, scale)`` tensors; `moe_mxfp8.quantize` checks the arguments before and
wraps the result into an ``MXFP8Tensor`` after.
"""

from __future__ import annotations

import functools

import torch

from . import mx_format as F
from .compile_cache import CompileCache, launch_arch, target_arch
from .device import on_device
from .native import Ptr, current_stream
from .quantize_config import DTYPE_NAMES, TILE_FEATURES, VEC_BYTES, QuantConfig

_cache = CompileCache("quantize", cute=True)

# `QuantConfig`'s tuning fields of the computed sources, 1x128 and 1x32 blocks alike
# (`benchmarks.bench_rowkernels --quantizer-tunings`; docs/design/datapath.md, "Stages on the
# quantizer tile"). H100, 2026-11-27: the SwiGLU forward at 3 CTAs an SM (80 registers, no
# spills; 1.13-1.17x 2 CTAs) with 2 vectors an input a batch; the backward with joint gate/up
# tiles at the compiler's 2 CTAs (128 registers; 1.06-1.12x one half a CTA). The next batch's
# loads ahead of this one's arithmetic, the SwiGLU rows read without waiting for their ``src``
# entries and the rows guessed before the group search (where groups start on tile
# boundaries): forward 1.05-1.07x, backward 1.10-1.11x, combine backward 1.00-1.07x; the
# dispatch with guessed rows 1.03-1.07x (and 1.11-1.22x the Triton kernel it replaced), all
# bit-identical. Guessing is on only for 1x128 blocks with aligned groups
# (`_source_tuning`): elsewhere a tile's rows are seldom the guessed ones and it would read
# twice.
SOURCE_TUNING = {
    "swiglu": dict(load_batch=2, ctas_per_sm=3, load_ahead=1, unpredicated=True),
    "swiglu_grad": dict(load_batch=2, ctas_per_sm=0, joint_halves=True, load_ahead=1,
                        unpredicated=True, speculate_rows=True),
    "gather": dict(load_batch=2, ctas_per_sm=3, speculate_rows=True),
    "combine_grad": dict(load_batch=2, ctas_per_sm=3, load_ahead=1, speculate_rows=True),
}
PLAIN_TUNING = dict(load_batch=4, ctas_per_sm=0)  # source "x": the tile's own loads
TUNING_FIELDS = ("load_batch", "ctas_per_sm", "joint_halves", "load_ahead", "unpredicated",
                 "speculate_rows")


def _source_tuning(source: str, act_block: int, aligned: bool,
                   tuning: dict | None = None) -> tuple:
    """The tuning fields of ``source`` (``tuning``: overrides), as hashable items; rows are
    guessed only where that pays (1x128 blocks, aligned groups) unless ``tuning`` says."""
    if tuning is None:
        return _default_tuning(source, act_block, aligned)
    fields = {**SOURCE_TUNING.get(source, PLAIN_TUNING), **tuning}
    if bad := sorted(set(fields) - set(TUNING_FIELDS)):
        raise ValueError(f"quantizer tuning may only set {TUNING_FIELDS}, got {bad}")
    if "speculate_rows" not in tuning:
        fields["speculate_rows"] = (fields.get("speculate_rows", False)
                                    and act_block == F.BLOCK_128 and aligned)
    return tuple(sorted(fields.items()))


@functools.lru_cache(maxsize=64)
def _default_tuning(source: str, act_block: int, aligned: bool) -> tuple:
    return _source_tuning(source, act_block, aligned, {})


def compile_quantizer(op: str, config: QuantConfig, arch: str | None = None, stream=None):
    """Compile (cached per op, config and arch) and return the callable; M stays symbolic.
    A kernel in the disk cache loads without CuTeDSL; `quantize.build_quantizer` compiles.
    ``arch``: the arch CuTeDSL compiles for (default `compile_cache.target_arch`; a launch
    passes `compile_cache.launch_arch`); ``stream``: the launch's."""
    arch = arch or target_arch()

    def build():
        from .quantize import build_quantizer

        return build_quantizer(op, config, stream)

    return _cache.get((op, config, arch), build)


# ---------------------------------------------------------------------------------------------
# Entry points (called by moe_mxfp8.quantize after its argument checks: x is a contiguous,
# 16-byte aligned CUDA tensor of a supported dtype, offs a dense int32 array on its device)
# ---------------------------------------------------------------------------------------------


def group_tile_ends(offs: torch.Tensor) -> torch.Tensor:
    """The grouped quantizers' tile table: int32 ``(E,)`` cumulative counts of the 128-row
    tiles of the groups ending at ``offs`` (each group's tiles start a new tile). Only device
    ops: nothing reads ``offs``' values on the host."""
    o = offs.to(torch.int32)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    return torch.cumsum((sizes + (F.TILE_ROWS - 1)) // F.TILE_ROWS, 0, dtype=torch.int32)


def _group_tables(offs: torch.Tensor | None, m: int, tile_ends: torch.Tensor | None = None):
    """(number of groups, int32 cumulative tile ends on the device, search steps, tiles bound);
    ``tile_ends``: `group_tile_ends` of ``offs`` where the caller has it (one per step)."""
    if offs is None:
        return 1, None, 0, F.ceil_div(m, F.TILE_ROWS)
    g = offs.numel()
    if tile_ends is None:
        tile_ends = group_tile_ends(offs)
    elif tile_ends.dtype != torch.int32 or tile_ends.shape != (g,) or not tile_ends.is_contiguous():
        raise ValueError(f"tile_ends must be a contiguous int32 tensor of shape ({g},) "
                         f"(group_tile_ends of offs), got {tile_ends.dtype} "
                         f"{tuple(tile_ends.shape)}")
    return g, tile_ends, g.bit_length(), F.grouped_row_tiles_bound(m, g)


def _launch(op, config, x, q_row, s_row, q_col, s_col, offs, tile_ends, m, n_groups, steps,
            n_vtiles, aux=None, src=None, wts=None, part=None):
    ctas = n_vtiles * F.ceil_div(config.k, TILE_FEATURES)
    if ctas == 0:  # no tokens and no pad tiles, or K == 0: every output is empty
        return
    if ctas > F.MAX_EXTENT:
        raise ValueError(f"moe_mxfp8 {op}: {ctas} tiles exceed the grid limit (2^31 - 1)")
    dummy = x.data_ptr()

    def p(t, dt):
        return Ptr(dt, t.data_ptr() if t is not None else dummy)

    f8, u8, i32 = "float8_e4m3fn", "uint8", "int32"
    with on_device(x.device):  # the operands' GPU and its stream, whichever is current
        stream = current_stream(x.device)
        fn = compile_quantizer(op, config, launch_arch(x.device), stream)
        fn(p(x, config.dtype), p(aux, config.dtype), p(src, i32), p(wts, "float32"),
           p(part, "float32"), p(q_row, f8), p(s_row, u8), p(q_col, f8), p(s_col, u8),
           p(offs, i32), p(tile_ends, i32), m, n_groups, steps, n_vtiles, stream)


def _buffer(out, name, shape, dtype, device):
    """``out[name]`` (a preallocated buffer, tests poison them) or a fresh one."""
    t = None if out is None else out.get(name)
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"out[{name!r}] must be a contiguous {dtype} tensor of shape {shape}")
    return t


@functools.lru_cache(maxsize=256)
def _activation_config(dtype: str, rounding: str, k: int, rows: bool, cols: bool, grouped: bool,
                       col_aligned: bool, act_block: int, source: str, top_k: int,
                       with_part: bool, tuning: tuple, col_tile: bool = False) -> QuantConfig:
    """An activation quantizer's configuration, made once per shape (see `_weights_config`);
    ``tuning``: `_source_tuning`'s items; ``col_tile``: the columnwise copy in 128 x 128
    tiles."""
    fields = dict(tuning)
    fields["joint_halves"] = fields.get("joint_halves", False) and source == "swiglu_grad"
    fields["speculate_rows"] = fields.get("speculate_rows", False) and grouped
    return QuantConfig(dtype=dtype, rounding=rounding, k=k, rows=rows, cols=cols,
                       grouping="offs" if grouped else "none", col_aligned=col_aligned,
                       act_block=act_block, source=source, top_k=top_k, with_part=with_part,
                       col_tile=col_tile, **fields)


def _alloc_outputs(m, k, device, offs, rows: bool, cols: bool, out=None):
    """Row data/scales and col data/scales of an ``(m, k)`` tile source, by name."""
    g = 1 if offs is None else offs.numel()
    nb = k // F.BLOCK_SIZE
    res = {}
    if rows:
        res["q_row"] = _buffer(out, "q_row", (m, k), torch.float8_e4m3fn, device)
        nbytes = (F.packed_scale_bytes(m, nb) if offs is None
                  else F.grouped_rows_scale_bytes(m, nb, g))
        res["s_row"] = _buffer(out, "s_row", (nbytes,), torch.uint8, device)
    if cols:
        res["q_col"] = _buffer(out, "q_col", (k, m), torch.float8_e4m3fn, device)
        nbytes = (F.packed_scale_bytes(k, F.ceil_div(m, F.BLOCK_SIZE)) if offs is None
                  else F.grouped_k_scale_bytes(k, m, g))
        res["s_col"] = _buffer(out, "s_col", (nbytes,), torch.uint8, device)
    return res


def _activation_quant(op, x, rounding, offs, act_block, rows, cols, out, source="x",
                      k=None, aux=None, src=None, aligned_groups=False, tuning=None,
                      tile_ends=None, m=None, top_k=1, wts=None, part=None, col_tile=False):
    """``x (M, K)`` (or, for the other sources, ``m`` rows of ``k`` output features computed
    from ``x``, ``aux``, ``src``, ``wts``) quantized by ``op``; ``aligned_groups``: every
    ``offs`` group starts on a multiple of 16 rows; ``tuning``: `QuantConfig` tuning fields
    overriding `SOURCE_TUNING`'s; ``tile_ends``: `group_tile_ends` of ``offs``, or None to
    build it here; ``col_tile``: the columnwise copy in 128 x 128 tiles (1x128 blocks)."""
    m = x.shape[0] if m is None else m
    k = x.shape[1] if k is None else k
    n_groups, tile_ends, steps, n_vtiles = _group_tables(offs, m, tile_ends)
    bufs = _alloc_outputs(m, k, x.device, offs, rows, cols, out)
    aligned = m % VEC_BYTES == 0 and (offs is None or aligned_groups)
    config = _activation_config(DTYPE_NAMES[x.dtype], rounding, k, rows, cols,
                                offs is not None, cols and aligned, act_block, source, top_k,
                                part is not None,
                                _source_tuning(source, act_block, aligned, tuning),
                                col_tile and cols)
    _launch(op, config, x, bufs.get("q_row"), bufs.get("s_row"), bufs.get("q_col"),
            bufs.get("s_col"), offs, tile_ends, m, n_groups, steps, n_vtiles, aux, src, wts,
            part)
    res = []
    if rows:
        res.append((bufs["q_row"], bufs["s_row"]))
    if cols:
        res.append((bufs["q_col"], bufs["s_col"]))
    return res


def quantize_rowwise(x: torch.Tensor, *, rounding: str = "rceil",
                     offs: torch.Tensor | None = None, act_block: int = F.BLOCK_SIZE,
                     out: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (M, K)`` -> (e4m3 ``(M, K)``, packed scales); row groups from device ``offs``;
    ``act_block`` 32 or 128 elements per scale along K."""
    return _activation_quant("quantize_rowwise", x, rounding, offs, act_block, True, False,
                             out)[0]


def quantize_colwise(x: torch.Tensor, *, rounding: str = "rceil",
                     offs: torch.Tensor | None = None, act_block: int = F.BLOCK_SIZE,
                     out: dict | None = None,
                     col_tile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (M, K)`` -> (e4m3 ``x.T (K, M)``, packed scales); with ``offs``, blocks restart at
    each group start (the "k" layout); ``col_tile``: 128 x 128 tiles (1x128 blocks)."""
    return _activation_quant("quantize_colwise", x, rounding, offs, act_block, False, True,
                             out, col_tile=col_tile)[0]


def quantize_dual(x: torch.Tensor, *, rounding: str = "rceil",
                  offs: torch.Tensor | None = None, act_block: int = F.BLOCK_SIZE,
                  out: dict | None = None, col_tile: bool = False):
    """One read of ``x``: ((rowwise data, scales), (columnwise data, scales)); ``col_tile``:
    the columnwise copy in 128 x 128 tiles."""
    row, col = _activation_quant("quantize_dual", x, rounding, offs, act_block, True, True, out,
                                 col_tile=col_tile)
    return row, col


def quantize_swiglu(h: torch.Tensor, src: torch.Tensor, offs: torch.Tensor, *,
                    rows: bool = True, cols: bool = True, act_block: int = F.BLOCK_SIZE,
                    aligned_groups: bool = False, out: dict | None = None,
                    tuning: dict | None = None,
                    tile_ends: torch.Tensor | None = None, col_tile: bool = False) -> list:
    """``a = silu(gate) * up`` of ``h = [gate | up] (M, 2H)`` (BF16, PyTorch's roundings; zero
    where ``src < 0``) quantized in the same pass, rows grouped by ``offs``: [(rowwise data,
    scales)] and/or [(columnwise data, scales)] -- `moe_mxfp8.stages.swiglu_ref`'s MXFP8
    copies. ``aligned_groups``: every group starts on a multiple of 16 rows; ``tuning``:
    `QuantConfig` tuning fields overriding `SOURCE_TUNING`'s (benchmarks); ``tile_ends``:
    `group_tile_ends` of ``offs`` where the caller has it (built once per step for the row
    stages), else built here; ``col_tile``: the columnwise copy in 128 x 128 tiles."""
    return _activation_quant("quantize_swiglu", h, "rceil", offs, act_block, rows, cols, out,
                             "swiglu", h.shape[1] // 2, None, src, aligned_groups,
                             tuning, tile_ends, col_tile=col_tile)


def quantize_swiglu_grad(da: torch.Tensor, h: torch.Tensor, src: torch.Tensor,
                         offs: torch.Tensor, *, rows: bool = True, cols: bool = True,
                         act_block: int = F.BLOCK_SIZE, aligned_groups: bool = False,
                         out: dict | None = None, tuning: dict | None = None,
                         tile_ends: torch.Tensor | None = None) -> list:
    """``dh = [dgate | dup] (M, 2H)``, the gradient of `quantize_swiglu`'s ``a`` for ``dA (M,
    H)`` (BF16, as PyTorch's autograd rounds it; zero where ``src < 0``), quantized in the same
    pass: `moe_mxfp8.stages.swiglu_backward_ref`'s MXFP8 copies (``tuning``, ``tile_ends``: as
    there)."""
    return _activation_quant("quantize_swiglu_grad", h, "rceil", offs, act_block, rows, cols,
                             out, "swiglu_grad", h.shape[1], da, src, aligned_groups,
                             tuning, tile_ends)


def quantize_gather(x: torch.Tensor, src: torch.Tensor, offs: torch.Tensor, top_k: int, *,
                    rows: bool = True, cols: bool = True, act_block: int = F.BLOCK_SIZE,
                    aligned_groups: bool = False, out: dict | None = None,
                    tile_ends: torch.Tensor | None = None, tuning: dict | None = None,
                    col_tile: bool = False) -> list:
    """The dispatch: row r of the sorted buffer (``M = src.numel()`` rows) is token ``src[r] //
    top_k`` of ``x (T, D)`` (BF16; zero where ``src < 0``), quantized in the same pass:
    `moe_mxfp8.stages.dispatch_ref`'s MXFP8 copies (``tuning``, ``col_tile``: as
    `quantize_swiglu`'s)."""
    return _activation_quant("quantize_gather", x, "rceil", offs, act_block, rows, cols, out,
                             "gather", x.shape[1], None, src, aligned_groups,
                             tuning, tile_ends, src.numel(), top_k, col_tile=col_tile)


def quantize_combine_grad(dout: torch.Tensor, y: torch.Tensor, src: torch.Tensor,
                          weights: torch.Tensor, offs: torch.Tensor, top_k: int, *,
                          rows: bool = True, cols: bool = True, act_block: int = F.BLOCK_SIZE,
                          aligned_groups: bool = False, part: torch.Tensor | None = None,
                          out: dict | None = None, tile_ends: torch.Tensor | None = None,
                          tuning: dict | None = None) -> list:
    """The combine's backward: row r is ``bf16(dout[t] * bf16(weights[p]))`` for its pair ``p
    = src[r]`` of token ``t = p // top_k`` (zero where ``src < 0``), quantized in the same pass
    (`moe_mxfp8.stages.combine_backward_ref`'s MXFP8 copies); ``weights``: fp32, one per pair.
    ``part`` (fp32 ``(ceil(D / 128), M)``, or None): filled with each row's sum over each
    128-feature tile of ``bf16(dout[t] * y[r])``, the routing weight's gradient by parts
    (``tuning``: as `quantize_swiglu`'s)."""
    return _activation_quant("quantize_combine_grad", dout, "rceil", offs, act_block, rows, cols,
                             out, "combine_grad", dout.shape[1], y, src, aligned_groups,
                             tuning, tile_ends, src.numel(), top_k, weights, part)


# one GEMM operand of the weight quantizer: (e4m3 data, packed scales), or None where not wanted
WeightOperand = tuple[torch.Tensor, torch.Tensor] | None


def _weight_operand(out: dict | None, names: tuple[str, str], w: torch.Tensor,
                    axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One GEMM operand of expert weights ``w (E, N, K)``: e4m3 ``(E, N, K)`` (axis K) or
    ``(E, K, N)`` (axis N) and its packed scales, from ``out[names]`` or fresh."""
    e, n, k = w.shape
    rows, last = (n, k) if axis == "K" else (k, n)
    q = _buffer(out, names[0], (e, rows, last), torch.float8_e4m3fn, w.device)
    s = _buffer(out, names[1], (e * F.expert_scale_stride(rows, last // F.BLOCK_SIZE),),
                torch.uint8, w.device)
    return q, s


@functools.lru_cache(maxsize=256)
def _weights_config(dtype: str, rounding: str, n: int, k: int, block_rows: int, rows: bool,
                    cols: bool) -> QuantConfig:
    """The weight quantizer's configuration for experts of ``(n, k)``: made once per shape (the
    launch path hashes it; building the dataclass every step cost as much as the lookup)."""
    return QuantConfig(dtype=dtype, rounding=rounding, k=k, rows=rows, cols=cols,
                       grouping="uniform", group_rows=n, col_layout="experts",
                       block_rows=block_rows, col_aligned=n % VEC_BYTES == 0)


def _launch_weights(w: torch.Tensor, rounding: str, block_rows: int, along_k: WeightOperand,
                    along_n: WeightOperand) -> None:
    """The weight quantizer over ``w (E, N, K)`` viewed as ``(E*N, K)`` in groups of N: writes
    ``along_k`` and/or ``along_n`` (each a `_weight_operand` pair, or None) from one read."""
    e, n, k = w.shape
    config = _weights_config(DTYPE_NAMES[w.dtype], rounding, n, k, block_rows,
                             along_k is not None, along_n is not None)
    q_row, s_row = along_k or (None, None)
    q_col, s_col = along_n or (None, None)
    # ``w`` is contiguous: its address is that of the (E*N, K) matrix (no view op needed)
    _launch("quantize_weights", config, w, q_row, s_row, q_col, s_col, None, None, e * n, e, 0,
            e * F.ceil_div(n, F.TILE_ROWS))


def quantize_weights_dual(w: torch.Tensor, *, rounding: str = "rceil", block_rows: int = 1,
                          out: dict | None = None):
    """Expert weights ``(E, N, K)``, one read -> ((e4m3 ``(E, N, K)``, packed scales) along K,
    (e4m3 ``(E, K, N)``, packed scales) along N): `quantize_weights`' two axes at once."""
    along_k = _weight_operand(out, ("qk", "sk"), w, "K")
    along_n = _weight_operand(out, ("qn", "sn"), w, "N")
    _launch_weights(w, rounding, block_rows, along_k, along_n)
    return along_k, along_n


def quantize_weights(w: torch.Tensor, *, axis: str = "K", rounding: str = "rceil",
                     block_rows: int = 1, out: dict | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights ``(E, N, K)`` -> (e4m3 ``(E, N, K)`` (axis K) or ``(E, K, N)`` (axis N),
    packed scales, one matrix per expert); ``block_rows`` 1, 32 or 128 (scale tiles)."""
    operand = _weight_operand(out, ("q", "s"), w, axis)
    _launch_weights(w, rounding, block_rows, operand if axis == "K" else None,
                    operand if axis == "N" else None)
    return operand
