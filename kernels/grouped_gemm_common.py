"""Host-side pieces shared by the grouped MXFP8 GEMM kernels (``grouped_gemm_sm90``, ``_sm100``).

Stable API (append-only: kernels of both archs import it)::

    MODE_M, MODE_K                     # "m": 2D x 3D M-grouped (fprop/dgrad); "k": 2D x 2D (wgrad)
    GroupedProblem                     # frozen description of one call (static + dynamic sizes)
    describe_m(a, b, offs, out_dtype)  # -> GroupedProblem, raising clear errors on bad operands
    describe_k(a, b, offs, out_dtype)
    check_implementable(problem, **limits)  # raises ValueError(reason) if a kernel cannot run it
    can_implement(problem, **limits)   # -> (bool, reason)
    alloc_output(problem)              # (M, N) or (E, N, K) torch.empty (kernels write every byte)
    m_tiles_bound(m, num_groups, tile_m)         # static bound of sum_g ceil(m_g / tile_m)
    k_tiles_bound(m, num_groups, tile_k)         # same bound, for the reduced axis of wgrad
    scale_tiles_per_row_tile(k)                  # ceil(ceil(k/32)/4): packed tiles per 128 rows
    expert_scale_stride_bytes(rows, k)           # bytes between experts' packed scales (weights)

Shapes (``GroupedProblem`` fields), both modes written as ``out = a . b^T`` over the reduced axis:

* ``MODE_M``: ``a`` ``(m, k)`` rowwise (groups along rows), ``b`` ``(E, n, k)`` expert weights
  -> ``out (m, n)``; rows of group g use expert g. Reduced axis: ``k`` (static).
* ``MODE_K``: ``a`` ``(n, m)``, ``b`` ``(k, m)``, both quantized along ``m`` per group ->
  ``out (E, n, k)``. Reduced axis: ``m`` (the token count, dynamic).

``m`` (tokens) stays symbolic in compiled kernels; ``n``, ``k`` and the scale mode are static.

Packed scale addressing (contract, "Grouped layouts"), for a kernel that tiles 128 rows x 128
reduced elements (4 scale blocks): one such tile of scales is one contiguous 512-byte packed tile.

* ``a`` of MODE_M, group g, m-tile j (128 rows from the group start), k-tile t:
  byte ``((P_g / 128 + j) * T_k + t) * 512`` with ``P_g = sum_{h<g} ceil(m_h/128)*128`` and
  ``T_k = scale_tiles_per_row_tile(k)``.
* ``b`` of MODE_M (expert e, n-tile i, k-tile t): ``e * expert_scale_stride_bytes(n, k)
  + (i * T_k + t) * 512``.
* MODE_K operands (``R`` rows, group g, its local k-tile t of 128 tokens, row tile i):
  ``Rp * sum_{h<g} KBp_h + (i * ceil(KB_g/4) + t) * 512`` with ``Rp = ceil(R/128)*128``,
  ``KB_g = ceil(m_g/32)``, ``KBp_g = 4*ceil(m_g/128)``; note ``Rp * KBp_h = 512 * (Rp/128) *
  ceil(m_h/128)``, so group g begins at tile ``(Rp/128) * sum_{h<g} ceil(m_h/128)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_mxfp8 import layout as L
from moe_mxfp8.gemm import check_grouped_operands
from moe_mxfp8.mx_tensor import MXFP8Tensor

MODE_M = "m"
MODE_K = "k"
MODES = (MODE_M, MODE_K)

# TMA needs 16-byte aligned global strides: fp8 rows need a multiple of 16 elements; the scale
# blocks need 32. Kernels may ask for more through `check_implementable(..., n_multiple=...)`.
TMA_ALIGN_BYTES = 16


@dataclass(frozen=True)
class GroupedProblem:
    """One grouped GEMM call. ``m`` is the dynamic token count; the rest shape the compile key."""

    mode: str  # MODE_M or MODE_K
    m: int  # tokens: rows of `a` (MODE_M) or the reduced axis (MODE_K)
    n: int  # output columns (MODE_M: b rows) / output rows per group (MODE_K: a rows)
    k: int  # reduced axis (MODE_M) / output columns per group (MODE_K: b rows)
    num_groups: int  # E = offs.numel()
    out_dtype: torch.dtype
    b_block_rows: int  # 1 (1x32 blocks) or 32 (32x32 weight tiles; MODE_M only)
    device: torch.device

    @property
    def out_shape(self) -> tuple[int, ...]:
        if self.mode == MODE_M:
            return (self.m, self.n)
        return (self.num_groups, self.n, self.k)

    def static_key(self) -> tuple:
        """The part of the problem that a compiled kernel bakes in (m and E stay dynamic)."""
        return (self.mode, self.n, self.k, self.out_dtype, self.b_block_rows)

    def flops(self) -> int:
        """2 * sum_g m_g * n * k = 2 * m * n * k in both modes (groups partition the tokens)."""
        return 2 * self.m * self.n * self.k


def _check_common(a, b, offs, out_dtype) -> None:
    """The API's operand checks (`moe_mxfp8.gemm.check_grouped_operands`), plus what TMA needs."""
    check_grouped_operands(a, b, offs, out_dtype)
    for name, t in (("a.data", a.data), ("b.data", b.data), ("a.scale", a.scale),
                    ("b.scale", b.scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def describe_m(a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor,
               out_dtype: torch.dtype) -> GroupedProblem:
    """Check the operands of a 2D x 3D M-grouped GEMM and describe it."""
    _check_common(a, b, offs, out_dtype)
    if a.data.dim() != 2 or b.data.dim() != 3 or b.group_axis != "experts":
        raise ValueError("M-grouped GEMM needs a 2D rowwise `a` and 3D expert weights `b`")
    m, k = a.data.shape
    e, n, kb = b.data.shape
    if kb != k:
        raise ValueError(f"K mismatch: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if offs.numel() != e:
        raise ValueError(f"offs has {offs.numel()} groups but b has {e} experts")
    if a.group_axis != "rows" and not (a.group_axis is None and e == 1):
        raise ValueError("`a` must be quantized rowwise with offs (group_axis='rows'): each "
                         "group's scale rows start on a 128-row packed tile")
    if a.block_rows != 1:
        raise ValueError("`a` must use 1x32 blocks")
    nb = L.ceil_div(k, L.BLOCK_SIZE)
    need_a = L.grouped_rows_scale_bytes(m, nb, e)
    if a.scale.numel() < need_a:
        raise ValueError(f"a.scale holds {a.scale.numel()} bytes, the grouped-rows layout "
                         f"needs {need_a}")
    need_b = e * L.expert_scale_stride(n, nb)
    if b.scale.numel() < need_b:
        raise ValueError(f"b.scale holds {b.scale.numel()} bytes, {e} experts need {need_b}")
    return GroupedProblem(MODE_M, m, n, k, e, out_dtype, b.block_rows, a.data.device)


def describe_k(a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor,
               out_dtype: torch.dtype) -> GroupedProblem:
    """Check the operands of a 2D x 2D K-grouped (wgrad) GEMM and describe it."""
    _check_common(a, b, offs, out_dtype)
    if a.group_axis != "k" or b.group_axis != "k" or a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError("K-grouped GEMM needs 2D operands quantized along M per group (offs=)")
    n, m = a.data.shape
    k, mb = b.data.shape
    if mb != m:
        raise ValueError(f"M mismatch: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    e = offs.numel()
    for name, t, rows in (("a", a, n), ("b", b, k)):
        need = L.grouped_k_scale_bytes(rows, m, e)
        if t.scale.numel() < need:
            raise ValueError(f"{name}.scale holds {t.scale.numel()} bytes, needs {need}")
    return GroupedProblem(MODE_K, m, n, k, e, out_dtype, 1, a.data.device)


def check_implementable(problem: GroupedProblem, *, n_multiple: int = 32, k_multiple: int = 32,
                        m_multiple: int = 1) -> None:
    """Raise ValueError saying why a kernel with these divisibility needs cannot run ``problem``.

    ``n_multiple``/``k_multiple`` apply to the static ``n``/``k``; ``m_multiple`` to the token
    count (MODE_K reads tokens along rows with TMA: 16-byte row strides need m % 16 == 0).
    """
    p = problem
    if p.mode not in MODES:
        raise ValueError(f"unknown grouped GEMM mode {p.mode!r}")
    for name, val, mult in (("N", p.n, n_multiple), ("K", p.k, k_multiple), ("M", p.m, m_multiple)):
        if val % mult:
            raise ValueError(f"grouped GEMM ({p.mode}-grouped): {name} = {val} must be a "
                             f"multiple of {mult} for this kernel")
    if p.n == 0 or p.k == 0:
        raise ValueError("grouped GEMM: N and K must be positive")
    if p.b_block_rows not in (1, 32):
        raise ValueError(f"b.block_rows must be 1 or 32, got {p.b_block_rows}")
    if p.mode == MODE_K and p.b_block_rows != 1:
        raise ValueError("K-grouped GEMM operands use 1x32 blocks only")
    if p.m >= 2**31 or p.m * max(p.n, p.k) >= 2**40:
        raise ValueError("grouped GEMM: problem too large for 32-bit tile indices")


def can_implement(problem: GroupedProblem, **limits) -> tuple[bool, str]:
    """(True, "") or (False, reason); see `check_implementable`."""
    try:
        check_implementable(problem, **limits)
    except ValueError as err:
        return False, str(err)
    return True, ""


def alloc_output(problem: GroupedProblem) -> torch.Tensor:
    """Uninitialised output; kernels write every element (MODE_K: zeros for empty groups)."""
    return torch.empty(problem.out_shape, dtype=problem.out_dtype, device=problem.device)


def m_tiles_bound(m: int, num_groups: int, tile_m: int) -> int:
    """Static bound of ``sum_g ceil(m_g / tile_m)`` for any split of ``m`` rows into groups.

    ``sum_g ceil(m_g/T) = sum_g floor((m_g + T - 1)/T) <= floor((m + (T-1) G) / T)``.
    """
    return (m + (tile_m - 1) * num_groups) // tile_m


def k_tiles_bound(m: int, num_groups: int, tile_k: int) -> int:
    """Static bound of ``sum_g ceil(m_g / tile_k)`` along a K-grouped (token) axis."""
    return m_tiles_bound(m, num_groups, tile_k)


def scale_tiles_per_row_tile(k: int) -> int:
    """Packed 512-byte tiles per 128-row tile for a reduced extent ``k``: ``ceil(ceil(k/32)/4)``."""
    return L.ceil_div(L.ceil_div(k, L.BLOCK_SIZE), L.TILE_BLOCKS)


def expert_scale_stride_bytes(rows: int, k: int) -> int:
    """Bytes between consecutive experts' packed scales of ``(E, rows, k)`` weights."""
    return L.expert_scale_stride(rows, L.ceil_div(k, L.BLOCK_SIZE))


# ---------------------------------------------------------------------------------------------
# Device-side helpers (CuTeDSL, @cute.jit): group lookup from `offs` without a host sync.
# Call them from every thread of a full warp (they use warp shuffles / ballots).
# ---------------------------------------------------------------------------------------------

import cutlass  # noqa: E402  (the host-side part above needs no CuTeDSL)
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

WARP = 32


@cute.jit
def _warp_inclusive_sum(val: Int32) -> Int32:
    lane = cute.arch.lane_idx()
    for i in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(val, offset=1 << i, mask_and_clamp=0)
        if lane >= (1 << i):
            val = val + other
    return val


@cute.jit
def find_m_tile_group(offs: cute.Tensor, num_groups: Int32, tile_idx: Int32,
                      tile_m: cutlass.Constexpr[int]):
    """Group of global m-tile ``tile_idx`` when each group g owns ``ceil(m_g / tile_m)`` tiles.

    Returns ``(g, row_start, row_end, tiles_before)``; ``g = -1`` when ``tile_idx`` is past the
    real tile count (the grid is a static bound). Warp-parallel: 32 groups per step.
    """
    lane = cute.arch.lane_idx()
    found = Int32(-1)
    row_start = Int32(0)
    row_end = Int32(0)
    tiles_before = Int32(0)
    carry = Int32(0)
    for base in range(0, num_groups, WARP):
        g = base + lane
        start = Int32(0)
        end = Int32(0)
        if g < num_groups:
            end = offs[g]
            if g > 0:
                start = offs[g - 1]
        nt = cutlass.max(end - start + (tile_m - 1), 0) // tile_m
        incl = _warp_inclusive_sum(nt)
        excl = incl - nt
        hit = found < 0 and nt > 0 and tile_idx >= carry + excl and tile_idx < carry + incl
        ballot = Int32(cute.arch.vote_ballot_sync(hit))
        if ballot != 0:
            src = Int32(31) - Int32(cute.arch.clz(Int32(ballot) & (0 - Int32(ballot))))
            found = base + src
            row_start = cute.arch.shuffle_sync(start, src)
            row_end = cute.arch.shuffle_sync(end, src)
            tiles_before = carry + cute.arch.shuffle_sync(excl, src)
        carry = carry + cute.arch.shuffle_sync(incl, 31)
    return found, row_start, row_end, tiles_before


@cute.jit
def sum_tiles_before(offs: cute.Tensor, g: Int32, tile: cutlass.Constexpr[int]) -> Int32:
    """``sum_{h<g} ceil(m_h / tile)`` (K-grouped packed-scale base, in 128-token tiles)."""
    lane = cute.arch.lane_idx()
    total = Int32(0)
    for base in range(0, g, WARP):
        h = base + lane
        nt = Int32(0)
        if h < g:
            end = offs[h]
            start = Int32(0)
            if h > 0:
                start = offs[h - 1]
            nt = cutlass.max(end - start + (tile - 1), 0) // tile
        total = total + cute.arch.warp_redux_sync(nt, "add")
    return total
