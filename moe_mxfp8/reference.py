"""Pure-PyTorch reference of everything the kernels compute. Runs on CPU and GPU.

These functions *define* the bytes the quantizer kernels must produce and the values the GEMM
kernels are tested against (``docs/numerics.md``). They validate nothing: the public
entry points in `moe_mxfp8.quantize` / `moe_mxfp8.autograd` check arguments and then call these.

Scale exponents come from the integer bits of ``amax`` (never ``log2``/``ceil`` in floating
point, which are wrong a few ulp above a power of two)::

    RCEIL: e = E - 135 + (m > 0x600000)    # smallest e with amax <= 448 * 2^e
    FLOOR: e = E - 135                     # floor(log2(amax)) - 8, OCP MX v1.0

for the biased exponent ``E`` and mantissa field ``m`` of ``amax`` as float32, clamped to
``[-127, 127]``; a block holding NaN or Inf gets the NaN scale byte 0xFF.

Written for speed on CPU (the CI and ``train_example`` backend) without changing a bit: each
pass is a whole-tensor op with the same per-element float32 arithmetic as the plain
formulation (widen, multiply by ``2^-e``, saturate, round), in place where it can be; columnwise
blocks are formed down the rows of ``x`` and transposed once, in FP8; scales are packed and read
through strided views of the tile layout; the GEMMs dequantize each operand once (FP8 widened
by bit manipulation) and keep one float32 ``mm`` per group on the same operands as ever.
``tests/test_reference_speed.py`` checks all of it bit for bit against the plain formulation.
"""

from __future__ import annotations

import math

import torch

from . import layout as L
from .kernels.mx_format import (  # noqa: F401  (the format's constants, re-exported here)
    ACT_BLOCK,
    BLOCK_128,
    COLWISE_BLOCK_ROWS,
    E4M3_EMAX_BIASED,
    E4M3_MAX,
    E8M0_BIAS,
    E8M0_NAN,
    FP32_EXP_INF,
    RCEIL_MANTISSA_THRESHOLD,
    SCALE_BLOCKS,
    WEIGHT_BLOCK_ROWS,
    WGRAD_ACT_BLOCK_ROWS,
    group_blocks_bound,
)
from .mx_tensor import MXFP8Tensor, e8m0_to_float32  # noqa: F401  (part of the reference)


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as float32 bit patterns (int32). NaN > Inf > every finite value in this order."""
    return x.to(torch.float32).view(torch.int32) & 0x7FFFFFFF


# Dtypes quantized as they are (anything else is first rounded to float32, as it always was).
_INT_VIEW = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF),
             torch.float16: (torch.int16, 0x7FFF)}


def _as_quantizable(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in _INT_VIEW else x.to(torch.float32)


def _amax_bits(x: torch.Tensor, dim) -> torch.Tensor:
    """``_abs_bits(x).amax(dim)`` without a float32 copy of ``x``: the amax of the sign-cleared
    bit patterns in x's own width (the same order: NaN > Inf > finite), then widened. Every
    bf16/fp16 value is exact in float32, so a finite amax has the same float32 bits; a
    NaN/Inf amax keeps the exponent field 0xFF, all that `scale_exponent_from_amax_bits` reads
    of a non-finite block."""
    iv, mask = _INT_VIEW[x.dtype]
    a = (x.view(iv) & mask).amax(dim)
    if x.dtype == torch.float32:
        return a
    return a.view(x.dtype).to(torch.float32).view(torch.int32)


def scale_exponent_from_amax_bits(
    amax_bits: torch.Tensor, rounding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 |amax| bits -> (scale byte as int32 in 0..255, unbiased exponent e as int32).

    For non-finite blocks the byte is 0xFF and e is 0 (elements are then unspecified).
    """
    exp_field = amax_bits >> 23
    e = exp_field - E4M3_EMAX_BIASED
    if rounding == "rceil":
        e = e + ((amax_bits & 0x7FFFFF) > RCEIL_MANTISSA_THRESHOLD).to(torch.int32)
    e = e.clamp(-E8M0_BIAS, E8M0_BIAS)
    nonfinite = exp_field == FP32_EXP_INF
    byte = torch.where(nonfinite, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS)
    return byte, torch.where(nonfinite, torch.zeros_like(e), e)


def _quantize_with_amax(
    x: torch.Tensor, amax_bits: torch.Tensor, rounding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (bf16/fp16/fp32) quantized with ``amax_bits`` broadcast against it (a size-1 dim
    where a block spans x). Returns (e4m3 of x's shape, uint8 bytes of amax_bits' shape)."""
    byte, e = scale_exponent_from_amax_bits(amax_bits, rounding)
    # 2^-e built from the bits: e is in [-127, 120] for finite input, so 127 - e is a normal
    # fp32 exponent and the multiply below is exact wherever the result is representable.
    inv_scale = ((E8M0_BIAS - e) << 23).view(torch.float32)
    # float32(x) * 2^-e, saturated, in one buffer (x's float32 copy, or for float32 input the
    # product): the values of widening, multiplying and clamping out of place.
    if x.dtype == torch.float32:
        scaled = x * inv_scale
    else:
        scaled = x.to(torch.float32)
        scaled.mul_(inv_scale)
    q = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # RNE, satfinite
    return q, byte.to(torch.uint8)


def quantize_blocks(
    x: torch.Tensor, rounding: str, amax_bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x (..., nblocks, 32)`` block by block along the last dim.

    Returns (``(..., nblocks, 32)`` float8_e4m3fn, ``(..., nblocks)`` uint8 scale bytes).
    ``amax_bits`` (``(..., nblocks)`` int32 ``|amax|`` bits) overrides each block's own amax:
    the 1x128 recipe passes the amax of the 128-block that contains the 32-block.
    """
    x = _as_quantizable(x)
    if amax_bits is None:
        amax_bits = _amax_bits(x, -1)
    q, s = _quantize_with_amax(x, amax_bits[..., None], rounding)
    return q, s[..., 0]


def _quantize_lastdim(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(..., K)`` -> e4m3 ``(..., K)`` and dense scales ``(..., ceil(K/32))``.

    A K that is not a multiple of 32 has a last block virtually padded with zeros.
    """
    k = x.shape[-1]
    kp = L.round_up(k, L.BLOCK_SIZE)
    if kp != k:
        x = torch.nn.functional.pad(x, (0, kp - k))
    q, s = quantize_blocks(x.reshape(*x.shape[:-1], kp // L.BLOCK_SIZE, L.BLOCK_SIZE), rounding)
    return q.reshape(*x.shape[:-1], kp)[..., :k], s


def _quantize_lastdim_128(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 recipe along the last dim: each 32-block is quantized with the amax of the
    128-block (from the row's start) that contains it. Returns what `_quantize_lastdim` does."""
    x = _as_quantizable(x)
    k = x.shape[-1]
    kp = L.round_up(k, BLOCK_128)
    if kp != k:
        x = torch.nn.functional.pad(x, (0, kp - k))
    per32 = BLOCK_128 // L.BLOCK_SIZE
    # (..., K/128, 4, 32): each 32-block reads its 128-block's amax through a broadcast
    blocks = x.reshape(*x.shape[:-1], kp // BLOCK_128, per32, L.BLOCK_SIZE)
    amax128 = _amax_bits(blocks, (-2, -1))
    q, s = _quantize_with_amax(blocks, amax128[..., None, None], rounding)
    s = s[..., 0].expand(*s.shape[:-3], kp // BLOCK_128, per32)
    s = s.reshape(*x.shape[:-1], kp // L.BLOCK_SIZE)
    return q.reshape(*x.shape[:-1], kp)[..., :k], s[..., : L.ceil_div(k, L.BLOCK_SIZE)]


def _quantize_rows_dim0(
    xp: torch.Tensor, rounding: str, block: int, tiles: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``xp (..., P, K)``, ``P`` a multiple of ``block`` (32 or 128): blocks of ``block``
    consecutive rows per column. Returns e4m3 ``(..., P, K)`` and dense scales
    ``(..., P/32, K)`` (a 128-block's byte repeated for its four 32-blocks). ``tiles``: each
    block's scale shared over 128 columns (`_feature_tile_amax`)."""
    *lead, p, k = xp.shape
    per32 = block // L.BLOCK_SIZE
    blocks = xp.reshape(*lead, p // block, per32, L.BLOCK_SIZE, k)
    amax = _amax_bits(blocks, (-3, -2))  # (..., P/block, K)
    if tiles:
        amax = _feature_tile_amax(amax)
    q, s = _quantize_with_amax(blocks, amax[..., None, None, :], rounding)
    s = s[..., 0, :].expand(*lead, p // block, per32, k).reshape(*lead, p // L.BLOCK_SIZE, k)
    return q.reshape(*lead, p, k), s


def _transpose_bytes(q: torch.Tensor) -> torch.Tensor:
    """e4m3 ``(..., M, K)`` -> contiguous ``(..., K, M)`` (a byte copy)."""
    return q.view(torch.uint8).transpose(-2, -1).contiguous().view(torch.float8_e4m3fn)


def _tiles(buf: torch.Tensor, lead: tuple, rows_p: int, blocks_p: int) -> torch.Tensor:
    """A flat packed buffer as its padded dense matrix ``(*lead, rows_p, blocks_p)``, a strided
    view (``rows_p`` a multiple of 128, ``blocks_p`` of 4): bytes ``[row tile][block tile]
    [r % 32][(r % 128) // 32][c % 4]`` -- `layout.packed_scale_offset`, read as a shape."""
    v = buf.view(*lead, rows_p // L.TILE_ROWS, blocks_p // L.TILE_BLOCKS, 32,
                 L.TILE_ROWS // 32, L.TILE_BLOCKS)
    n = len(lead)
    v = v.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return v  # (*lead, row tiles, (r % 128) // 32, r % 32, block tiles, c % 4)


def _pack_plain(dense: torch.Tensor) -> torch.Tensor:
    """`layout.pack_scales` / `layout.pack_scales_experts` (``(R, C)`` or ``(E, R, C)``), as one
    strided copy into the tile view instead of a scatter."""
    *lead, rows, nb = dense.shape
    rp, cp = L.round_up(rows, L.TILE_ROWS), L.round_up(nb, L.TILE_BLOCKS)
    out = torch.zeros(math.prod(lead) * rp * cp, dtype=torch.uint8, device=dense.device)
    dp = torch.nn.functional.pad(dense, (0, cp - nb, 0, rp - rows))
    _tiles(out, tuple(lead), rp, cp).copy_(
        dp.reshape(*lead, rp // L.TILE_ROWS, L.TILE_ROWS // 32, 32, cp // L.TILE_BLOCKS,
                   L.TILE_BLOCKS))
    return out


def _unpack_plain(buf: torch.Tensor, lead: tuple, rows: int, nb: int) -> torch.Tensor:
    """Inverse of `_pack_plain`: dense ``(*lead, rows, nb)``."""
    rp, cp = L.round_up(rows, L.TILE_ROWS), L.round_up(nb, L.TILE_BLOCKS)
    d = _tiles(buf[: math.prod(lead) * rp * cp], lead, rp, cp).reshape(*lead, rp, cp)
    return d[..., :rows, :nb]


def _pack_grouped_rows(dense: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`layout.pack_scales_grouped_rows`: each data row gathered to its padded row (the rows of
    group g start on tile ``P_g``; others stay zero), then one strided copy into the tiles."""
    m, nb = dense.shape
    cp = L.round_up(nb, L.TILE_BLOCKS)
    tiles = L.grouped_row_tiles_bound(m, offs.numel())
    prow = L.grouped_rows_packed_row(offs, m)
    src = torch.full((tiles * L.TILE_ROWS,), m, dtype=torch.int64, device=dense.device)
    src[prow] = torch.arange(m, device=dense.device)
    dp = torch.nn.functional.pad(dense, (0, cp - nb, 0, 1))  # row m: the zero row
    padded = dp.index_select(0, src)
    out = torch.zeros(tiles * L.TILE_ROWS * cp, dtype=torch.uint8, device=dense.device)
    _tiles(out, (), tiles * L.TILE_ROWS, cp).copy_(
        padded.view(tiles, L.TILE_ROWS // 32, 32, cp // L.TILE_BLOCKS, L.TILE_BLOCKS))
    return out


def _act_block(scale_blocks: str) -> int:
    if scale_blocks not in ACT_BLOCK:
        raise ValueError(f"scale_blocks must be one of {SCALE_BLOCKS}, got {scale_blocks!r}")
    return ACT_BLOCK[scale_blocks]


def quantize_rowwise_ref(
    x: torch.Tensor, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, scale_blocks: str = "1x32",
) -> MXFP8Tensor:
    """``x (M, K)`` -> MXFP8 ``(M, K)``, blocks along K; ``offs``: row groups on 128-row tiles.

    ``scale_blocks="1x128"``: one scale per 128 elements along K, replicated over its 32-blocks.
    """
    if _act_block(scale_blocks) == BLOCK_128:
        q, dense = _quantize_lastdim_128(x, rounding)
    else:
        q, dense = _quantize_lastdim(x, rounding)
    if scale_layout == "dense":
        scale = dense
    elif offs is not None:
        scale = _pack_grouped_rows(dense, offs)
    else:
        scale = _pack_plain(dense)
    group_axis = "rows" if offs is not None else None
    return MXFP8Tensor(q.contiguous(), scale, scale_layout, offs, group_axis)


def quantize_colwise_ref(
    x: torch.Tensor, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, scale_blocks: str = "1x32", block_rows: int = 1,
) -> MXFP8Tensor:
    """``x (M, K)`` -> MXFP8 of ``x.T`` ``(K, M)``, blocks of 32 along M.

    With ``offs`` (groups along M), blocks restart at each group's first token and each group's
    last block is virtually zero-padded; scales are packed per group (docs/numerics.md,
    "Groups (Mixture of Experts)").
    ``scale_blocks="1x128"``: 128-blocks restart at each group's first token too, and each of
    their 32-blocks carries the 128-block's scale. ``block_rows=128`` (1x128 only): one scale
    per 128 x 128 tile -- 128 consecutive rows of ``x.T`` (features ``[128 i, 128 i + 128)``)
    share each 128-block's scale, their joint amax's (the weight-gradient GEMM's activation
    operand, docs/numerics.md "The 1x128 recipe").

    Computed in x's own (M, K) layout, blocks running down the rows (whole rows move, no
    strided gathers), and transposed once at the end, in FP8.
    """
    x = _as_quantizable(x)
    b128 = _act_block(scale_blocks) == BLOCK_128
    tiles = colwise_tiles(scale_blocks, block_rows)
    m, k = x.shape
    if offs is None:
        block = BLOCK_128 if b128 else L.BLOCK_SIZE
        mp = L.round_up(m, block)
        xp = torch.nn.functional.pad(x, (0, 0, 0, mp - m)) if mp != m else x
        q, dense = _quantize_rows_dim0(xp, rounding, block, tiles)
        q = _transpose_bytes(q[:m])
        dense = dense[: L.ceil_div(m, L.BLOCK_SIZE)].t().contiguous()
        scale = dense if scale_layout == "dense" else _pack_plain(dense)
        return MXFP8Tensor(q, scale, scale_layout, block_rows=block_rows)

    # Static bound on the number of blocks: sum_g ceil(m_g/32) <= (M + 31 G) // 32.
    nb_bound = group_blocks_bound(m, offs.numel(), L.BLOCK_SIZE)
    p = nb_bound * L.BLOCK_SIZE
    # Row of the padded (P, K) buffer holding token t: group g's blocks start at padded row
    # 32 * sum_{h<g} ceil(m_h/32), so token t of group g moves down by that minus offs[g-1].
    sizes = L.group_sizes(offs)
    nblocks = (sizes + (L.BLOCK_SIZE - 1)) // L.BLOCK_SIZE
    shift = (torch.cumsum(nblocks, 0) - nblocks) * L.BLOCK_SIZE - (offs.to(torch.int64) - sizes)
    t = torch.arange(m, device=x.device)
    row = t + shift[torch.searchsorted(offs.to(torch.int64), t, right=True)]
    # Gather whole rows into the padded buffer (index_select: a row copy each), then zero the
    # P - M pad rows (their positions, in order: a stable sort of the pad flags, no host sync).
    src = torch.zeros(p, dtype=torch.int64, device=x.device)
    src[row] = t
    if m:
        padded = x.index_select(0, src)
        is_pad = torch.ones(p, dtype=torch.int8, device=x.device)
        is_pad[row] = 0
        pad_rows = torch.sort(is_pad, descending=True, stable=True).indices[: p - m]
        padded.index_fill_(0, pad_rows, 0)
    else:
        padded = x.new_zeros(p, k)
    blocks = padded.view(nb_bound, L.BLOCK_SIZE, k)
    amax = _amax_bits(blocks, 1)  # (nb_bound, K)
    if b128:
        key = _grouped_k_block128_key(offs, nb_bound)
        amax128 = amax.new_zeros(nb_bound + 1, k)  # |amax| bits >= 0: zeros are neutral
        amax128.scatter_reduce_(0, key[:, None].expand(-1, k), amax, "amax")
        amax = amax128.index_select(0, key)
    if tiles:
        amax = _feature_tile_amax(amax)
    qb, dense_all = _quantize_with_amax(blocks, amax[:, None, :], rounding)
    dense_all = dense_all[:, 0]  # (nb_bound, K)
    q = _transpose_bytes(qb.reshape(p, k).view(torch.uint8).index_select(0, row))
    if scale_layout == "dense":
        scale = dense_all[: L.grouped_k_num_blocks(offs)].t().contiguous()
    else:
        nbytes = L.grouped_k_scale_bytes(k, m, offs.numel())
        off, valid = L.grouped_k_offsets(offs, k, nb_bound)
        # Blocks past the last real one are routed to a dummy byte (no host sync).
        off = torch.where(valid[None, :], off, torch.full_like(off, nbytes))
        scale = torch.zeros(nbytes + 1, dtype=torch.uint8, device=x.device)
        scale[off.t().reshape(-1)] = dense_all.reshape(-1)
        scale = scale[:nbytes]
    return MXFP8Tensor(q, scale, scale_layout, offs, "k", block_rows)


def colwise_tiles(scale_blocks: str, block_rows: int) -> bool:
    """Whether a columnwise copy shares its 128-blocks' scales over 128 features (the
    ``block_rows`` of `quantize_colwise_ref`, checked)."""
    if block_rows not in COLWISE_BLOCK_ROWS:
        raise ValueError(f"block_rows of a columnwise copy must be one of "
                         f"{COLWISE_BLOCK_ROWS}, got {block_rows}")
    if block_rows != 1 and _act_block(scale_blocks) != BLOCK_128:
        raise ValueError("128 x 128 columnwise tiles (block_rows=128) need scale_blocks='1x128'")
    return block_rows != 1


def _feature_tile_amax(amax: torch.Tensor) -> torch.Tensor:
    """``amax (..., K)`` |amax| bits per feature -> each feature's 128-feature tile maximum
    (features past K count as 0, neutral)."""
    k = amax.shape[-1]
    kp = L.round_up(k, BLOCK_128)
    padded = torch.nn.functional.pad(amax, (0, kp - k)) if kp != k else amax
    tiles = padded.view(*amax.shape[:-1], kp // BLOCK_128, BLOCK_128).amax(-1, keepdim=True)
    return tiles.expand(*amax.shape[:-1], kp // BLOCK_128, BLOCK_128).reshape(
        *amax.shape[:-1], kp)[..., :k]


def _grouped_k_block128_key(offs: torch.Tensor, nb_bound: int) -> torch.Tensor:
    """For each global 32-block id ``j < nb_bound`` of a K-grouped axis, the global id of the
    1x128 block holding it (group g's local 32-block c lies in its 128-block c // 4); block ids
    past the last group map to ``nb_bound`` (a dummy)."""
    sizes = L.group_sizes(offs)
    nblocks = (sizes + L.BLOCK_SIZE - 1) // L.BLOCK_SIZE
    n128 = (sizes + BLOCK_128 - 1) // BLOCK_128
    ends = torch.cumsum(nblocks, 0)
    j = torch.arange(nb_bound, device=offs.device, dtype=torch.int64)
    g = torch.searchsorted(ends, j, right=True)
    valid = g < offs.numel()
    g = g.clamp(max=offs.numel() - 1)
    local = j - (ends - nblocks)[g]
    key = (torch.cumsum(n128, 0) - n128)[g] + local // (BLOCK_128 // L.BLOCK_SIZE)
    return torch.where(valid, key, torch.full_like(key, nb_bound))


def quantize_dual_ref(
    x: torch.Tensor, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, scale_blocks: str = "1x32",
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Both orientations of ``x (M, K)``: (rowwise ``(M, K)``, columnwise ``(K, M)``)."""
    return (
        quantize_rowwise_ref(x, rounding, scale_layout, offs, scale_blocks),
        quantize_colwise_ref(x, rounding, scale_layout, offs, scale_blocks),
    )


def quantize_weights_ref(
    w: torch.Tensor, axis: str = "K", rounding: str = "rceil", scale_layout: str = "packed",
    block_rows: int = 1,
) -> MXFP8Tensor:
    """Expert weights ``w (E, N, K)`` -> MXFP8, each expert its own packed matrix.

    ``axis="K"``: data ``(E, N, K)``, blocks along K (fprop). ``axis="N"``: data ``(E, K, N)``
    (``w`` transposed), blocks along N (dgrad). ``block_rows=32`` (128): one scale per 32x32
    (128x128) tile of ``w``, so both orientations carry the same FP8 bytes (transposed) and the
    same scale values. Partial 128x128 tiles at the edges are tiles of what is there (zero pad).
    """
    w = _as_quantizable(w)
    e, n, k = w.shape
    if block_rows == 1 and axis == "K":
        q, dense = _quantize_lastdim(w, rounding)
    elif block_rows == 1:
        # blocks along N: quantized down the rows of w's own layout, then transposed in FP8
        npad = L.round_up(n, L.BLOCK_SIZE)
        wp = torch.nn.functional.pad(w, (0, 0, 0, npad - n)) if npad != n else w
        q, dense = _quantize_rows_dim0(wp, rounding, L.BLOCK_SIZE)
        q = _transpose_bytes(q[:, :n])
        dense = dense.transpose(-2, -1).contiguous()
    else:
        src = w if axis == "K" else w.transpose(-2, -1)
        rows, cols = src.shape[1:]
        t = block_rows
        rp, cp = L.round_up(rows, t), L.round_up(cols, t)
        srcp = torch.nn.functional.pad(src, (0, cp - cols, 0, rp - rows))
        tiles = srcp.reshape(e, rp // t, t, cp // t, t).permute(0, 1, 3, 2, 4)
        # each 32-element piece of a tile row is quantized with the tile's amax
        amax = _amax_bits(tiles, (-2, -1))
        pieces = tiles.reshape(e, rp // t, cp // t, t * t // L.BLOCK_SIZE, L.BLOCK_SIZE)
        qt, st = _quantize_with_amax(pieces, amax[..., None, None], rounding)
        q = qt.reshape(e, rp // t, cp // t, t, t).permute(0, 1, 3, 2, 4)
        q = q.reshape(e, rp, cp)[:, :rows, :cols]
        dense = st[..., 0, 0].repeat_interleave(t, dim=1)[:, :rows]
        dense = dense.repeat_interleave(t // L.BLOCK_SIZE, dim=2)[..., : L.ceil_div(cols, 32)]
    scale = dense if scale_layout == "dense" else _pack_plain(dense)
    return MXFP8Tensor(q.contiguous(), scale, scale_layout, None, "experts", block_rows)


# float32 value of every E4M3 byte, built by the same conversion dequantization always used
_E4M3_TO_F32: dict[torch.device, torch.Tensor] = {}
_E4M3_NAN_BITS = 0x07F00000  # |bits| of the NaN code 0x7F below (before the 2^120 factor)
_FACTOR_B_MAX = 134  # 2^(b - 7) is a finite float32 up to b = 134


def _e4m3_lut(device: torch.device) -> torch.Tensor:
    if device not in _E4M3_TO_F32:
        codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
        _E4M3_TO_F32[device] = codes.view(torch.float8_e4m3fn).to(torch.float32)
    return _E4M3_TO_F32[device]


def _dense_scales(t: MXFP8Tensor) -> torch.Tensor:
    """``t.dense_scales()`` (not K groups) read through the tile view: the same bytes."""
    if t.scale_layout != "packed":
        return t.scale
    nb = t.num_blocks
    if t.group_axis == "experts":
        e, rows, _ = t.data.shape
        return _unpack_plain(t.scale, (e,), rows, nb)
    rows = t.data.shape[0]
    if t.group_axis == "rows":
        cp = L.round_up(nb, L.TILE_BLOCKS)
        prow = L.grouped_rows_packed_row(t.offs, rows)
        tiles = t.scale.numel() // (L.TILE_ROWS * cp)
        padded = _unpack_plain(t.scale, (), tiles * L.TILE_ROWS, cp)
        return padded.index_select(0, prow)[:, :nb]
    return _unpack_plain(t.scale, (), rows, nb)


def _dequantize_f32(t: MXFP8Tensor) -> torch.Tensor:
    """``t.dequantize(torch.float32)``, bit for bit, in a few fast passes.

    The E4M3 byte ``s eeee mmm`` is widened to the float32 bit pattern ``s 0000eeee mmm 0...``
    (the sign-extended byte shifted left by 20, bits 27-30 cleared), whose value is exactly
    ``q * 2^-120`` (subnormal codes included); multiplying by ``2^(b - 7)`` then gives
    ``q * 2^(b - 127)`` with the single rounding of the plain ``float(q) * 2^(b - 127)``. Scale
    bytes above 134 (whose ``2^(b - 7)`` is not a float32) and NaN scales take the plain route
    (``* 2^120``, exact, then ``* 2^(b - 127)``), and NaN codes get the float32 NaN that the
    plain conversion gives them. Per-group scales (K groups) multiply in place per group.
    """
    data = t.data
    if not data.is_contiguous() or data.dim() < 2:
        return t.dequantize(torch.float32)
    bits = data.view(torch.int8).to(torch.int32)
    bits.bitwise_left_shift_(20).bitwise_and_(-0x78000001)  # & 0x87FFFFFF as int32
    x = bits.view(torch.float32)
    if x.numel() == 0:
        return x
    lo, hi = torch.aminmax(x)  # NaN codes are the extremes: +-0x07F00000
    nan_bits = torch.tensor(_E4M3_NAN_BITS, dtype=torch.int32, device=x.device).view(torch.float32)
    if bool((hi >= nan_bits) | (lo <= -nan_bits)):
        u = data.view(torch.uint8)
        x.copy_(torch.where((u & 0x7F) == 0x7F, _e4m3_lut(x.device)[u.long()] * 2.0**-120, x))
    blk = L.BLOCK_SIZE
    if t.group_axis == "k":
        bounds = [0] + t.offs.detach().cpu().tolist()
        rows = x.shape[0]
        rp = L.round_up(rows, L.TILE_ROWS)
        if t.scale_layout == "packed":  # group g: its own packed (Rp, KBp_g) matrix, in order
            parts, byte = [], 0
            for s, e in zip(bounds[:-1], bounds[1:], strict=True):
                kb = L.ceil_div(e - s, blk)
                kbp = L.round_up(kb, L.TILE_BLOCKS)
                parts.append(_unpack_plain(t.scale[byte:], (), rows, kb))
                byte += rp * kbp
            dense = torch.cat(parts, dim=1) if parts else t.scale.new_empty(rows, 0)
        else:
            dense = t.scale
    else:
        dense = _dense_scales(t)
    dense = dense.to(torch.int32)
    if bool((dense > _FACTOR_B_MAX).any()):
        x.mul_(2.0**120)
        factor = e8m0_to_float32(dense.to(torch.uint8))
    else:
        factor = ((dense + (E8M0_BIAS - 7)) << 23).view(torch.float32)
    if t.group_axis == "k":
        base = 0
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            full, rem = divmod(e - s, blk)
            if full:
                x[:, s : s + full * blk].unflatten(1, (full, blk)).mul_(
                    factor[:, base : base + full, None])
            if rem:
                x[:, s + full * blk : e].mul_(factor[:, base + full : base + full + 1])
            base += full + (rem > 0)
        return x
    k = x.shape[-1]
    full, rem = divmod(k, blk)
    if full:
        x[..., : full * blk].unflatten(-1, (full, blk)).mul_(factor[..., :full, None])
    if rem:
        x[..., full * blk :].mul_(factor[..., full : full + 1])
    return x


def grouped_mm(
    a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Reference grouped GEMM on MXFP8 operands: dequantize, multiply and accumulate in fp32.

    * 2D x 3D (M-grouped, fprop/dgrad): ``a`` rowwise ``(M, K)``, ``b`` expert weights
      ``(E, N, K)`` quantized along K -> ``(M, N)``; rows of group g use expert g.
    * 2D x 2D (K-grouped, wgrad): ``a`` ``(N, M)`` and ``b`` ``(K, M)``, both quantized along M
      with per-group blocks -> ``(E, N, K)``; ``out[g] = a[:, group g] @ b[:, group g].T``, an
      empty group gives zeros.

    Each operand is dequantized once, whole, into a fresh contiguous float32 tensor, and each
    group is one ``mm`` of slices of those tensors (the same operands, hence the same sums, as
    ever); the float32 products land straight in the ``out_dtype`` result (one rounding).
    """
    bounds = [0] + offs.detach().cpu().tolist()  # reference: host sync is fine here
    a32 = _dequantize_f32(a)
    b32 = _dequantize_f32(b)
    if b.data.dim() == 3:
        out = a32.new_empty(a32.shape[0], b32.shape[1], dtype=out_dtype)
        for g in range(len(bounds) - 1):
            s, t = bounds[g], bounds[g + 1]
            out[s:t] = a32[s:t] @ b32[g].t()
        return out
    out = a32.new_zeros(len(bounds) - 1, a32.shape[0], b32.shape[0], dtype=out_dtype)
    for g in range(len(bounds) - 1):
        s, t = bounds[g], bounds[g + 1]
        if t > s:
            out[g] = a32[:, s:t] @ b32[:, s:t].t()
    return out
