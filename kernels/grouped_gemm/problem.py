"""The grouped GEMM problem: vocabulary, operand description and the only operand checks.

Two groupings, both written ``out = a . b^T`` over the reduced axis (all GEMMs are "TN"):

* **M-grouped** (``MODE_M``, fprop/dgrad): ``a (m, k)`` rowwise with row groups, ``b (E, n, k)``
  expert weights -> ``out (m, n)``; rows of group g use expert g. Reduced axis ``k`` (static).
* **K-grouped** (``MODE_K``, wgrad): ``a (n, m)`` and ``b (k, m)``, both quantized along the
  tokens ``m`` per group -> ``out (E, n, k)``; an empty group gives zeros. Reduced axis ``m``.

``m`` (tokens) stays symbolic in compiled kernels; ``n``, ``k``, the output dtype and the
**scale-block choice** (``scale_blocks``: "1x32", "32x32" or "1x128", docs/numerics.md) are
static. Operands are duck-typed MXFP8 tensors (``data``, ``scale``, ``scale_layout``,
``group_axis``, ``block_rows``): this module imports nothing of the API above it, and neither
CuTeDSL nor Triton. The API (`moe_mxfp8.grouped_gemm`) and every backend -- the reference
included -- check operands here, so every backend accepts the same domain.

Packed scale addressing (docs/numerics.md, "Groups (Mixture of Experts)"): a kernel tile of
128 rows x 128 reduced elements (4 scale blocks) reads exactly one 512-byte packed tile per
operand; its index is `scale_tile_index`, the one copy of that arithmetic (host tests and both
arch kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import mx_format as F

MODE_M = "m"  # M-grouped: 2D x 3D (fprop, dgrad)
MODE_K = "k"  # K-grouped: 2D x 2D (wgrad)
MODES = (MODE_M, MODE_K)


def output_columns(mode: str, n: int, k: int) -> int:
    """The output tiles' fast axis: M-grouped N, K-grouped K (per group)."""
    return n if mode == MODE_M else k
OUT_DTYPES = (torch.bfloat16, torch.float32)
# weight tile rows (MXFP8Tensor.block_rows of an M-grouped `b`) -> the scale-block choice
SCALE_BLOCKS_OF_WEIGHT_ROWS = {rows: name for name, rows in F.WEIGHT_BLOCK_ROWS.items()}
TMA_ALIGN_BYTES = 16  # TMA: 16-byte aligned global strides and base addresses


@dataclass(frozen=True)
class GroupedProblem:
    """One grouped GEMM call. ``m`` is the dynamic token count; the rest shape the compile key."""

    mode: str  # MODE_M or MODE_K
    m: int  # tokens: rows of `a` (MODE_M) or the reduced axis (MODE_K)
    n: int  # output columns (MODE_M: b rows) / output rows per group (MODE_K: a rows)
    k: int  # reduced axis (MODE_M) / output columns per group (MODE_K: b rows)
    num_groups: int  # E = offs.numel()
    out_dtype: torch.dtype
    scale_blocks: str  # "1x32" | "32x32" | "1x128" (mx_format.SCALE_BLOCKS)
    device: torch.device
    # K-grouped: rows of `b` sharing a scale, 1 or 128 (1x128 tiles of 128 x 128: the
    # weight-gradient GEMM's activation operand, mx_format.WGRAD_ACT_BLOCK_ROWS)
    b_block_rows: int = 1

    @property
    def out_shape(self) -> tuple[int, ...]:
        if self.mode == MODE_M:
            return (self.m, self.n)
        return (self.num_groups, self.n, self.k)

    def static_key(self) -> tuple:
        """The part of the problem that a compiled kernel bakes in (m and E stay dynamic)."""
        return (self.mode, self.n, self.k, self.out_dtype, self.scale_blocks, self.b_block_rows)

    def flops(self) -> int:
        """2 * sum_g m_g * n * k = 2 * m * n * k in both modes (groups partition the tokens)."""
        return 2 * self.m * self.n * self.k


# ---------------------------------------------------------------------------------------------
# operand checks (host-side metadata; the values of offs only where they live on the host)
# ---------------------------------------------------------------------------------------------


def check_offs(offs, extent: int, *, name: str = "offs", values: bool | None = None,
               end: str = "equal") -> None:
    """The one check of an ``offs`` argument (GEMMs, quantizers, `align_k_groups`): a non-empty
    1D int32 tensor of cumulative group ends, non-negative, non-decreasing, its last value
    ``== extent`` (``end="equal"``, the contract of every public entry) or ``<= extent``
    (``end="at_most"``: `align_k_groups` leaves the tokens past it ungrouped).

    Any stride is accepted (`kernel_offs` gives the kernels a dense copy). The values are read
    only when ``values`` is true -- by default when ``offs`` lives on the CPU and is no fake
    or traced tensor -- so a CUDA ``offs`` costs no host sync (CUDA graphs, compile). The rule
    depends on where ``offs`` lives, never on the backend: every backend answers alike.
    """
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 (cumulative group ends), "
                        f"got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (cumulative group ends), got {offs.dtype}")
    if offs.dim() != 1 or offs.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1D tensor, got shape {tuple(offs.shape)}")
    if not (values_on_host(offs) if values is None else values):
        return
    o = offs.detach().to("cpu", torch.int64)
    if bool((o[1:] < o[:-1]).any()) or int(o[0]) < 0:
        shown = o.tolist() if o.numel() <= 16 else f"{o[:16].tolist()} ..."
        raise ValueError(f"{name} must be non-decreasing and non-negative, got {shown}")
    last = int(o[-1])
    if last != extent and (end == "equal" or last > extent):
        want = "equal" if end == "equal" else "be at most"
        raise ValueError(f"{name}[-1] must {want} the grouped extent {extent}, got {last}")


def values_on_host(offs: torch.Tensor) -> bool:
    """Whether reading ``offs``' values costs no device sync and is possible at all (not
    under ``torch.compile`` or a fake-tensor trace, where tensors have no values)."""
    if offs.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(offs)


def kernel_offs(offs: torch.Tensor) -> torch.Tensor:
    """``offs`` as a kernel reads it: ``E`` consecutive int32 from its data pointer (a strided
    view, e.g. a column of an ``(E, 2)`` tensor, is copied; a dense one is returned as is)."""
    return offs if offs.is_contiguous() else offs.contiguous()


def check_scale_bytes(name: str, nbytes: int) -> None:
    """Kernels take scale buffer sizes and offsets as 32-bit integers: bound them here, where
    every backend's problem is described, so that no size wraps."""
    if nbytes > F.MAX_EXTENT:
        raise ValueError(f"grouped GEMM: {name} needs {nbytes} scale bytes, above the largest "
                         f"supported 2^31 - 1 (fewer tokens per call)")


def _check_group_count(name: str, t, offs: torch.Tensor) -> None:
    """An operand quantized with groups must be read with as many groups (its packed scales
    are laid out per group)."""
    own = getattr(t, "offs", None)
    if own is not None and own.numel() != offs.numel():
        raise ValueError(f"offs has {offs.numel()} groups but {name} was quantized with "
                         f"{own.numel()}")


def _check_common(a, b, offs, out_dtype) -> None:
    if a.scale_layout != "packed" or b.scale_layout != "packed":
        raise ValueError("grouped GEMM operands need packed scales (scale_layout='packed')")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    devs = {a.data.device, b.data.device, a.scale.device, b.scale.device}
    if isinstance(offs, torch.Tensor):
        devs.add(offs.device)
    if len(devs) != 1:
        raise ValueError(f"a, b and offs must share one device, got {sorted(map(str, devs))}")
    check_offs(offs, 0, values=False)  # the values once the extent is known (describe_*)
    for name, t in (("a", a), ("b", b)):
        _check_group_count(name, t, offs)
    for name, t in (("a.data", a.data), ("b.data", b.data), ("a.scale", a.scale),
                    ("b.scale", b.scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def describe_m(a, b, offs: torch.Tensor, out_dtype: torch.dtype) -> GroupedProblem:
    """Check the operands of a 2D x 3D M-grouped GEMM and describe it. The scale-block choice
    comes from ``b``: 128x128 weight tiles mark the 1x128 recipe (``a`` quantized 1x128)."""
    _check_common(a, b, offs, out_dtype)
    if a.data.dim() != 2 or b.data.dim() != 3 or b.group_axis != "experts":
        raise ValueError("M-grouped GEMM needs a 2D rowwise `a` and 3D expert weights `b`")
    m, k = a.data.shape
    e, n, kb = b.data.shape
    if kb != k:
        raise ValueError(f"K mismatch: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if offs.numel() != e:
        raise ValueError(f"offs has {offs.numel()} groups but b has {e} experts")
    check_offs(offs, m)
    if a.group_axis != "rows" and not (a.group_axis is None and e == 1):
        raise ValueError("`a` must be quantized rowwise with offs (group_axis='rows'): each "
                         "group's scale rows start on a 128-row packed tile")
    if a.block_rows != 1:
        raise ValueError("`a` must use 1xK blocks (block_rows=1)")
    if b.block_rows not in SCALE_BLOCKS_OF_WEIGHT_ROWS:
        raise ValueError(f"b.block_rows must be one of {sorted(SCALE_BLOCKS_OF_WEIGHT_ROWS)}, "
                         f"got {b.block_rows}")
    nb = F.ceil_div(k, F.BLOCK_SIZE)
    need_a = F.grouped_rows_scale_bytes(m, nb, e)
    need_b = e * F.expert_scale_stride(n, nb)
    check_scale_bytes("a", need_a)
    check_scale_bytes("b", need_b)
    if a.scale.numel() < need_a:
        raise ValueError(f"a.scale holds {a.scale.numel()} bytes, the grouped-rows layout "
                         f"needs {need_a}")
    if b.scale.numel() < need_b:
        raise ValueError(f"b.scale holds {b.scale.numel()} bytes, {e} experts need {need_b}")
    return GroupedProblem(MODE_M, m, n, k, e, out_dtype, SCALE_BLOCKS_OF_WEIGHT_ROWS[b.block_rows],
                          a.data.device)


def describe_k(a, b, offs: torch.Tensor, out_dtype: torch.dtype,
               scale_blocks: str = "1x32") -> GroupedProblem:
    """Check the operands of a 2D x 2D K-grouped (wgrad) GEMM and describe it.
    ``scale_blocks="1x128"``: both operands come from the 1x128 quantizers."""
    _check_common(a, b, offs, out_dtype)
    if scale_blocks not in F.SCALE_BLOCKS:
        raise ValueError(f"scale_blocks must be one of {F.SCALE_BLOCKS}, got {scale_blocks!r}")
    if a.group_axis != "k" or b.group_axis != "k" or a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError("K-grouped GEMM needs 2D operands quantized along M per group (offs=)")
    n, m = a.data.shape
    k, mb = b.data.shape
    if mb != m:
        raise ValueError(f"M mismatch: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    check_offs(offs, m)
    e = offs.numel()
    for name, t, rows in (("a", a, n), ("b", b, k)):
        need = F.grouped_k_scale_bytes(rows, m, e)
        check_scale_bytes(name, need)
        if t.scale.numel() < need:
            raise ValueError(f"{name}.scale holds {t.scale.numel()} bytes, needs {need}")
    # the activation side decides the kernel (weights do not enter a K-grouped GEMM)
    blocks = "1x128" if F.ACT_BLOCK[scale_blocks] == F.BLOCK_128 else "1x32"
    if a.block_rows != 1:
        raise ValueError("K-grouped `a` must have one scale per row (block_rows=1)")
    if b.block_rows not in F.COLWISE_BLOCK_ROWS or (b.block_rows != 1 and blocks != "1x128"):
        raise ValueError(f"K-grouped `b`: block_rows must be 1, or 128 with 1x128 blocks "
                         f"(128 x 128 tiles), got {b.block_rows} with {scale_blocks}")
    return GroupedProblem(MODE_K, m, n, k, e, out_dtype, blocks, a.data.device, b.block_rows)


def check_implementable(problem: GroupedProblem, *, n_multiple: int = 32, k_multiple: int = 32,
                        m_multiple: int = 1) -> None:
    """Raise ValueError saying why a kernel with these divisibility needs cannot run ``problem``.

    ``n_multiple``/``k_multiple`` apply to the static ``n``/``k``; ``m_multiple`` to the token
    count (K-grouped reads tokens along rows with TMA: 16-byte row strides need m % 16 == 0).
    """
    p = problem
    if p.mode not in MODES:
        raise ValueError(f"unknown grouped GEMM mode {p.mode!r}")
    for name, val, mult in (("N", p.n, n_multiple), ("K", p.k, k_multiple), ("M", p.m, m_multiple)):
        if val % mult:
            raise ValueError(f"grouped GEMM ({p.mode.upper()}-grouped): {name} = {val} must be a "
                             f"multiple of {mult} for this kernel")
    if p.n == 0 or p.k == 0:
        raise ValueError("grouped GEMM: N and K must be positive")
    if p.m >= 2**31 or p.m * max(p.n, p.k) >= 2**40:
        raise ValueError("grouped GEMM: problem too large for 32-bit tile indices")


def can_implement(problem: GroupedProblem, **limits) -> tuple[bool, str]:
    """(True, "") or (False, reason); see `check_implementable`."""
    try:
        check_implementable(problem, **limits)
    except ValueError as err:
        return False, str(err)
    return True, ""


def output(problem: GroupedProblem, out: torch.Tensor | None = None) -> torch.Tensor:
    """The output buffer: ``out`` checked, or a new uninitialised one (kernels write every
    element; K-grouped: zeros for empty groups)."""
    if out is None:
        return torch.empty(problem.out_shape, dtype=problem.out_dtype, device=problem.device)
    if (out.shape != problem.out_shape or out.dtype != problem.out_dtype
            or not out.is_contiguous() or out.device != problem.device):
        raise ValueError(f"out must be a contiguous {problem.out_dtype} tensor of shape "
                         f"{problem.out_shape} on {problem.device}")
    return out


# ---------------------------------------------------------------------------------------------
# packed scale tiles of a tile (host and device arithmetic)
# ---------------------------------------------------------------------------------------------


def scale_tile_index(mode, n, k, tile_m, tile_n, mt, nt, v, g, m_g, tiles128_before):
    """Packed scale tiles of one output tile: (SFA tile of its 128-row slice ``v`` at k-tile 0,
    SFB tile of its first 128-row tile at k-tile 0, tile step between SFB row tiles); k-tile
    ``t`` adds ``t`` to both.

    Plain arithmetic: runs on Python ints (tests) and on device integers (both arch kernels).
    ``mt``/``nt``: the tile's coordinates inside its group (``tile_m x tile_n`` tiles);
    ``m_g``: the group's tokens; ``tiles128_before``: ``sum_{h<g} ceil(m_h/128)``.

    * M-grouped: ``a``'s group g starts at packed row ``P_g = 128 * tiles128_before``;
      weights: expert g's scales start ``g * ceil(n/128) * T_k`` tiles in, with
      ``T_k = ceil(ceil(k/32)/4)`` tiles per 128-row tile.
    * K-grouped: an operand of R rows starts group g at tile ``ceil(R/128) * tiles128_before``
      and has ``ceil(m_g/128)`` tiles per 128-row tile (``KBp_g / 4``).
    """
    a_rt = mt * (tile_m // F.TILE_ROWS) + v
    b_rt = nt * (tile_n // F.TILE_ROWS)
    if mode == MODE_M:
        kt = F.scale_tiles_per_row_tile(k)
        n128 = (n + F.TILE_ROWS - 1) // F.TILE_ROWS
        return (tiles128_before + a_rt) * kt, (g * n128 + b_rt) * kt, kt
    kt_g = (m_g + F.TILE_ROWS - 1) // F.TILE_ROWS
    a128 = (n + F.TILE_ROWS - 1) // F.TILE_ROWS
    b128 = (k + F.TILE_ROWS - 1) // F.TILE_ROWS
    return a128 * tiles128_before + a_rt * kt_g, b128 * tiles128_before + b_rt * kt_g, kt_g


# ---------------------------------------------------------------------------------------------
# K-grouped token alignment: re-lay the fp8 data so that every group starts on a multiple of 16
# ---------------------------------------------------------------------------------------------

# Why it is exact with the SAME packed scales (tests/kernels/test_align_k_groups.py checks each
# point): padding group g from m_g to round_up(m_g, a) tokens, a | 32, keeps
#   ceil(round_up(m, a) / 32) == ceil(m / 32)    (blocks per group: dense scale columns) and
#   ceil(round_up(m, a) / 128) == ceil(m / 128)  (KBp_g / 4: the group's packed-scale base),
# the new tokens fall in the group's last (already virtually zero-padded) 32-block, and a zero
# token adds exactly 0 to every dot product. So only the data and offs change.


def k_aligned_extent(m: int, num_groups: int, align: int = F.K_GROUP_ALIGN) -> int:
    """Static token extent ``Mp`` of `align_k_groups`' output, from shapes only:
    `mx_format.padded_extent` rounded up to 16 so that the ``(rows, Mp)`` fp8 output's row
    stride is 16-byte aligned for TMA."""
    if align <= 0 or F.BLOCK_SIZE % align:
        raise ValueError(f"align must divide {F.BLOCK_SIZE} (scale blocks stay the same only "
                         f"then), got {align}")
    return F.round_up(F.padded_extent(m, num_groups, align), TMA_ALIGN_BYTES)


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
                   align: int = F.K_GROUP_ALIGN):
    """Re-lay K-grouped (wgrad) fp8 operands so that every group starts on a multiple of
    ``align``.

    ``a_data (N, M)`` and ``b_data (K, M)`` (float8_e4m3fn or uint8, tokens along the last dim)
    -> ``(a_aligned (N, Mp), b_aligned (K, Mp), offs_aligned (E,) int32)`` with
    ``Mp = k_aligned_extent(M, E, align)`` (a static multiple of 16). Group g's ``m_g`` tokens
    move to columns ``[P_g, P_g + m_g)``, ``P_g = sum_{h<g} round_up(m_h, align)``; the pad
    columns up to ``offs_aligned[g] = P_g + round_up(m_g, align)`` are zero, and so is every
    column past ``offs_aligned[-1] <= Mp`` when ``offs[-1] == M`` (the project's convention;
    with ``offs[-1] < M`` the first ``Mp - M`` of them are zero and the rest hold the
    ungrouped tokens, which no group reads).

    The packed scales of both operands are used UNCHANGED with ``offs_aligned``: ``align`` must
    divide 32, and then every group keeps its 32-blocks and its packed-scale base (see the
    comment above). The GEMM result is bit-identical. Check the ORIGINAL operands
    (`describe_k` sizes the scale buffers from the data width; the bytes read are the same).

    No host sync and static shapes (CUDA graphs, ``torch.compile(fullgraph=True)``): one
    index computation (O(Mp + E) int64, shared by both operands), then per operand one
    ``index_select`` along the tokens (reads the ``M`` source columns once, writes ``Mp``) and an
    ``index_fill_`` of the ``Mp - M`` gap columns. fp8 moves as uint8. Its cost:
    docs/design/hopper_gemm.md ("K-grouped alignment").
    """
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"align_k_groups needs (N, M) and (K, M) data, got "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    m = a_data.shape[1]
    check_offs(offs, m, end="at_most")
    if offs.device != a_data.device or b_data.device != a_data.device:
        raise ValueError(f"a_data, b_data and offs must share one device, got {a_data.device}, "
                         f"{b_data.device} and {offs.device}")
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
