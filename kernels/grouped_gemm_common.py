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
    k_aligned_extent(m, num_groups, align)       # static token extent of `align_k_groups`' output
    align_k_groups(a_data, b_data, offs, align)  # MODE_K data with 16-aligned group starts

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
    if p.b_block_rows not in (1, 32, 128):  # 128: the 1x128 recipe's 128x128 weight tiles
        raise ValueError(f"b.block_rows must be 1, 32 or 128, got {p.b_block_rows}")
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
# MODE_K token alignment: re-lay the fp8 data so that every group starts on a multiple of 16
# ---------------------------------------------------------------------------------------------

# Why it is exact with the SAME packed scales (tests/kernels/test_align_k_groups.py checks each
# point): padding group g from m_g to round_up(m_g, a) tokens, a | 32, keeps
#   ceil(round_up(m, a) / 32) == ceil(m / 32)    (blocks per group: dense scale columns) and
#   ceil(round_up(m, a) / 128) == ceil(m / 128)  (KBp_g / 4: the group's packed-scale base),
# the new tokens fall in the group's last (already virtually zero-padded) 32-block, and a zero
# token adds exactly 0 to every dot product. So only the data and offs change.
K_GROUP_ALIGN = 16  # tokens: TMA needs 16-byte aligned coordinates; fp8 is 1 byte a token


def k_aligned_extent(m: int, num_groups: int, align: int = K_GROUP_ALIGN) -> int:
    """Static token extent ``Mp`` of `align_k_groups`' output, from shapes only.

    ``sum_g round_up(m_g, align) <= m + (align - 1) * G``; rounded up to 16 so that the row
    stride of the ``(rows, Mp)`` fp8 output is 16-byte aligned for TMA. Equals
    ``moe_mxfp8.moe._padded_extent(m, G)`` for ``align = 16``.
    """
    if align <= 0 or L.BLOCK_SIZE % align:
        raise ValueError(f"align must divide {L.BLOCK_SIZE} (scale blocks stay the same only "
                         f"then), got {align}")
    return L.round_up(m + (align - 1) * num_groups, max(align, TMA_ALIGN_BYTES))


def _k_align_indices(offs: torch.Tensor, m: int, mp: int, align: int):
    """(source column of each of the ``mp`` output columns, ``mp - m`` gap columns, new offs).

    All on ``offs``' device, sizes from ``m``/``mp``/``E`` only (no host sync). Group g holds
    ``max(offs[g] - offs[g-1], 0)`` tokens (as the kernels read it) and is placed at
    ``pstart_g = sum_{h<g} round_up(m_h, align)``. Output columns that hold no token ("gaps":
    each group's pad, then the tail past the last group) get source column 0 in the gather
    and are zeroed afterwards through the gap list.
    """
    dev = offs.device
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = (ends - starts).clamp(min=0)
    padded = (sizes + (align - 1)) // align * align
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    last = offs.numel() - 1

    # gather index: output column j -> source token, or 0 (zeroed later) for a gap column
    j = torch.arange(mp, device=dev, dtype=torch.int64)
    g = torch.searchsorted(pend, j, right=True).clamp(max=last)  # empty groups own no column
    local = j - pstart[g]
    real = local < sizes[g]  # past pend[-1]: g = last group and local >= padded[last]
    # clamp: a malformed offs (offs[-1] > m) must not index out of bounds (device assert)
    src = torch.where(real, starts[g] + local, 0).clamp(max=max(m - 1, 0))

    # gap list, static length mp - m: each group's pad columns in order, then the tail from
    # pend[-1]. With offs[-1] == m there are exactly mp - m gap columns, so the list is all of
    # them; the clamp only matters for offs[-1] != m (duplicates are harmless for a fill).
    pad = padded - sizes
    pad_end = torch.cumsum(pad, 0)
    k = torch.arange(mp - m, device=dev, dtype=torch.int64)
    h = torch.searchsorted(pad_end, k, right=True)
    hc = h.clamp(max=last)
    in_pad = pstart[hc] + sizes[hc] + (k - (pad_end[hc] - pad[hc]))
    in_tail = pend[-1] + (k - pad_end[-1])
    gaps = torch.where(h <= last, in_pad, in_tail).clamp(max=mp - 1)
    return src, gaps, pend.to(torch.int32)


def align_k_groups(a_data: torch.Tensor, b_data: torch.Tensor, offs: torch.Tensor,
                   align: int = K_GROUP_ALIGN):
    """Re-lay MODE_K (wgrad) fp8 operands so that every group starts on a multiple of ``align``.

    ``a_data (N, M)`` and ``b_data (K, M)`` (float8_e4m3fn or uint8, tokens along the last dim)
    -> ``(a_aligned (N, Mp), b_aligned (K, Mp), offs_aligned (E,) int32)`` with
    ``Mp = k_aligned_extent(M, E, align)`` (a static multiple of 16). Group g's ``m_g`` tokens
    move to columns ``[P_g, P_g + m_g)``, ``P_g = sum_{h<g} round_up(m_h, align)``; the pad
    columns up to ``offs_aligned[g] = P_g + round_up(m_g, align)`` are zero, and so is every
    column past ``offs_aligned[-1] <= Mp`` when ``offs[-1] == M`` (the project's convention;
    with ``offs[-1] < M`` the first ``Mp - M`` of them are zero and the rest hold the
    ungrouped tokens, which no group reads).

    The packed scales of both operands are used UNCHANGED with ``offs_aligned``: ``align`` must
    divide 32, and then every group keeps its 32-blocks and its packed-scale base (see
    `K_GROUP_ALIGN`'s comment). The GEMM result is bit-identical. Note: ``describe_k`` sizes the
    scale buffers from the data width, so check the ORIGINAL operands, not ``Mp``
    (``grouped_k_scale_bytes(rows, Mp, E)`` exceeds the buffer by up to ``ceil((Mp - M) / 128)``
    128-token tile sets: 1 at dsv3; the bytes actually read are the same).

    No host sync and static shapes (CUDA graphs, ``torch.compile(fullgraph=True)``): one
    index computation (O(Mp + E) int64, shared by both operands), then per operand one
    ``index_select`` along the tokens (reads the ``M`` source columns once, writes ``Mp``) and an
    ``index_fill_`` of the ``Mp - M`` gap columns. fp8 moves as uint8.

    Cost at the dsv3 wgrad shape (N=4096, K=7168, M=131072, E=8, align 16): Mp = 131200;
    read 11264 x 131072 = 1.476 GB, write 11264 x 131200 = 1.478 GB (+ ~1 MB index, 1.4 MB
    gap fill) = 2.95 GB -> 1.21 ms at the measured 2.44 TB/s copy rate. Measured on the H100
    (2026-11-22, docs/NOTES.md): ~2.5 ms (byte-wise ``index_select`` is instruction-bound);
    dsv3 wgrad 23.8 ms with it vs 447 ms on the kernel's unaligned slow path.
    """
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"align_k_groups needs (N, M) and (K, M) data, got "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    if offs.dim() != 1 or offs.numel() == 0:
        raise ValueError("offs must be a 1D tensor of cumulative group ends with >= 1 group")
    m = a_data.shape[1]
    mp = k_aligned_extent(m, offs.numel(), align)
    src, gaps, offs_aligned = _k_align_indices(offs, m, mp, align)
    outs = []
    for t in (a_data, b_data):
        u8 = t.view(torch.uint8)  # same element size: a view, any strides
        if m == 0:  # nothing to gather (static shape); every column is a gap
            out = u8.new_zeros(u8.shape[0], mp)
        else:
            out = u8.index_select(1, src).index_fill_(1, gaps, 0)
        outs.append(out.view(t.dtype))
    return outs[0], outs[1], offs_aligned


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
