"""Pure-PyTorch reference of everything the kernels compute. Runs on CPU and GPU.

These functions *define* the bytes the quantizer kernels must produce and the values the GEMM
kernels are tested against (``docs/numerics.md``). They validate nothing: the public
entry points in `moe_mxfp8.quantize` / `moe_mxfp8.ops` check arguments and then call these.

Scale exponents come from the integer bits of ``amax`` (never ``log2``/``ceil`` in floating
point, which are wrong a few ulp above a power of two)::

    RCEIL: e = E - 135 + (m > 0x600000)    # smallest e with amax <= 448 * 2^e
    FLOOR: e = E - 135                     # floor(log2(amax)) - 8, OCP MX v1.0

for the biased exponent ``E`` and mantissa field ``m`` of ``amax`` as float32, clamped to
``[-127, 127]``; a block holding NaN or Inf gets the NaN scale byte 0xFF.
"""

from __future__ import annotations

import torch

from . import layout as L
from .mx_tensor import MXFP8Tensor

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_EMAX_BIASED = 135  # 127 (fp32 bias) + 8 (log2 of 448's octave: 448 = 1.75 * 2^8)
RCEIL_MANTISSA_THRESHOLD = 0x600000  # mantissa field of 1.75: above it, amax > 448 * 2^e
FP32_EXP_INF = 0xFF
# Scale-block recipes (one name for the quantizers, grouped_mm and MXFP8MoE): activations and
# gradients x weights. "1x32": exact MXFP8 everywhere (default). "32x32": weights one scale per
# 32x32 tile. "1x128": one scale per 128 elements along the reduced axis for activations and
# gradients, one per 128x128 weight tile; every 32-block carries its 128-block's scale, so each
# tensor is a valid MXFP8 tensor (docs/numerics.md, "The 1x128 recipe").
SCALE_BLOCKS = ("1x32", "32x32", "1x128")
ACT_BLOCK = {"1x32": 32, "32x32": 32, "1x128": 128}  # activation/gradient block length
WEIGHT_BLOCK_ROWS = {"1x32": 1, "32x32": 32, "1x128": 128}  # weight tile rows (1: 1x32 blocks)
BLOCK_128 = 128


def e8m0_to_float32(b: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> float32 ``2^(b-127)``; 0xFF -> NaN. Exact (built from the bits)."""
    bi = b.to(torch.int32)
    # b = 0 is 2^-127, an fp32 subnormal: bit pattern 0x00400000.
    normal = (bi << 23).view(torch.float32)
    val = torch.where(bi == 0, torch.tensor(0x00400000, dtype=torch.int32, device=b.device)
                      .view(torch.float32), normal)
    return torch.where(bi == E8M0_NAN, torch.full_like(val, float("nan")), val)


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as float32 bit patterns (int32). NaN > Inf > every finite value in this order."""
    return x.to(torch.float32).view(torch.int32) & 0x7FFFFFFF


def scale_exponent_from_amax_bits(amax_bits: torch.Tensor, rounding: str) -> torch.Tensor:
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


def quantize_blocks(
    x: torch.Tensor, rounding: str, amax_bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x (..., nblocks, 32)`` block by block along the last dim.

    Returns (``(..., nblocks, 32)`` float8_e4m3fn, ``(..., nblocks)`` uint8 scale bytes).
    ``amax_bits`` (``(..., nblocks)`` int32 ``|amax|`` bits) overrides each block's own amax:
    the 1x128 recipe passes the amax of the 128-block that contains the 32-block.
    """
    if amax_bits is None:
        amax_bits = _abs_bits(x).amax(dim=-1)
    byte, e = scale_exponent_from_amax_bits(amax_bits, rounding)
    # 2^-e built from the bits: e is in [-127, 120] for finite input, so 127 - e is a normal
    # fp32 exponent and the multiply below is exact wherever the result is representable.
    inv_scale = ((E8M0_BIAS - e) << 23).view(torch.float32)
    scaled = x.to(torch.float32) * inv_scale[..., None]
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # RNE, satfinite
    return q, byte.to(torch.uint8)


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
    k = x.shape[-1]
    kp = L.round_up(k, BLOCK_128)
    if kp != k:
        x = torch.nn.functional.pad(x, (0, kp - k))
    amax128 = _abs_bits(x).reshape(*x.shape[:-1], kp // BLOCK_128, BLOCK_128).amax(dim=-1)
    per32 = BLOCK_128 // L.BLOCK_SIZE
    q, s = quantize_blocks(x.reshape(*x.shape[:-1], kp // L.BLOCK_SIZE, L.BLOCK_SIZE), rounding,
                           amax128.repeat_interleave(per32, dim=-1))
    return q.reshape(*x.shape[:-1], kp)[..., :k], s[..., : L.ceil_div(k, L.BLOCK_SIZE)]


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
        scale = L.pack_scales_grouped_rows(dense, offs)
    else:
        scale = L.pack_scales(dense)
    group_axis = "rows" if offs is not None else None
    return MXFP8Tensor(q.contiguous(), scale, scale_layout, offs, group_axis)


def quantize_colwise_ref(
    x: torch.Tensor, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, scale_blocks: str = "1x32",
) -> MXFP8Tensor:
    """``x (M, K)`` -> MXFP8 of ``x.T`` ``(K, M)``, blocks of 32 along M.

    With ``offs`` (groups along M), blocks restart at each group's first token and each group's
    last block is virtually zero-padded; scales are packed per group (contract, "Grouped layouts").
    ``scale_blocks="1x128"``: 128-blocks restart at each group's first token too, and each of
    their 32-blocks carries the 128-block's scale.
    """
    xt = x.t()
    b128 = _act_block(scale_blocks) == BLOCK_128
    if offs is None:
        q, dense = _quantize_lastdim_128(xt, rounding) if b128 else _quantize_lastdim(xt, rounding)
        scale = dense if scale_layout == "dense" else L.pack_scales(dense)
        return MXFP8Tensor(q.contiguous(), scale, scale_layout)

    k, m = xt.shape
    g, block_id, _ = L.grouped_k_block_index(offs, m)
    pos = (torch.arange(m, device=x.device) - L.group_starts(offs)[g]) % L.BLOCK_SIZE
    # Static bound on the number of blocks: sum_g ceil(m_g/32) <= (M + 31 G) // 32.
    nb_bound = (m + (L.BLOCK_SIZE - 1) * offs.numel()) // L.BLOCK_SIZE
    col = block_id * L.BLOCK_SIZE + pos
    padded = xt.new_zeros(k, nb_bound * L.BLOCK_SIZE)
    padded[:, col] = xt
    blocks = padded.reshape(k, nb_bound, L.BLOCK_SIZE)
    amax = None
    if b128:
        amax = _abs_bits(blocks).amax(dim=-1)
        key = _grouped_k_block128_key(offs, nb_bound)
        amax128 = amax.new_zeros(k, nb_bound + 1)  # |amax| bits >= 0: zeros are neutral
        amax128.scatter_reduce_(1, key[None, :].expand(k, -1), amax, "amax")
        amax = amax128[:, key]
    qb, dense_all = quantize_blocks(blocks, rounding, amax)
    q = qb.reshape(k, -1)[:, col]
    if scale_layout == "dense":
        scale = dense_all[:, : L.grouped_k_num_blocks(offs)].contiguous()
    else:
        nbytes = L.grouped_k_scale_bytes(k, m, offs.numel())
        off, valid = L.grouped_k_offsets(offs, k, nb_bound)
        # Blocks past the last real one are routed to a dummy byte (no host sync).
        off = torch.where(valid[None, :], off, torch.full_like(off, nbytes))
        scale = torch.zeros(nbytes + 1, dtype=torch.uint8, device=x.device)
        scale[off.reshape(-1)] = dense_all.reshape(-1)
        scale = scale[:nbytes]
    return MXFP8Tensor(q.contiguous(), scale, scale_layout, offs, "k")


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
    src = w if axis == "K" else w.transpose(-2, -1)
    e, rows, cols = src.shape
    if block_rows == 1:
        q, dense = _quantize_lastdim(src, rounding)
    else:
        t = block_rows
        rp, cp = L.round_up(rows, t), L.round_up(cols, t)
        srcp = torch.nn.functional.pad(src, (0, cp - cols, 0, rp - rows))
        tiles = srcp.reshape(e, rp // t, t, cp // t, t).permute(0, 1, 3, 2, 4)
        # each 32-element piece of a tile row is quantized with the tile's amax
        amax = _abs_bits(tiles).amax(dim=(-2, -1))
        pieces = tiles.reshape(e, rp // t, cp // t, t * t // L.BLOCK_SIZE, L.BLOCK_SIZE)
        qt, st = quantize_blocks(pieces, rounding, amax[..., None].expand(pieces.shape[:-1]))
        q = qt.reshape(e, rp // t, cp // t, t, t).permute(0, 1, 3, 2, 4)
        q = q.reshape(e, rp, cp)[:, :rows, :cols]
        dense = st[..., 0].repeat_interleave(t, dim=1)[:, :rows]
        dense = dense.repeat_interleave(t // L.BLOCK_SIZE, dim=2)[..., : L.ceil_div(cols, 32)]
    scale = dense if scale_layout == "dense" else L.pack_scales_experts(dense)
    return MXFP8Tensor(q.contiguous(), scale, scale_layout, None, "experts", block_rows)


def grouped_mm(
    a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Reference grouped GEMM on MXFP8 operands: dequantize, multiply and accumulate in fp32.

    * 2D x 3D (M-grouped, fprop/dgrad): ``a`` rowwise ``(M, K)``, ``b`` expert weights
      ``(E, N, K)`` quantized along K -> ``(M, N)``; rows of group g use expert g.
    * 2D x 2D (K-grouped, wgrad): ``a`` ``(N, M)`` and ``b`` ``(K, M)``, both quantized along M
      with per-group blocks -> ``(E, N, K)``; ``out[g] = a[:, group g] @ b[:, group g].T``, an
      empty group gives zeros.
    """
    bounds = [0] + offs.detach().cpu().tolist()  # reference: host sync is fine here
    a32 = a.dequantize(torch.float32)
    b32 = b.dequantize(torch.float32)
    if b.data.dim() == 3:
        out = a32.new_empty(a32.shape[0], b32.shape[1])
        for g in range(len(bounds) - 1):
            s, t = bounds[g], bounds[g + 1]
            out[s:t] = a32[s:t] @ b32[g].t()
        return out.to(out_dtype)
    out = a32.new_zeros(len(bounds) - 1, a32.shape[0], b32.shape[0])
    for g in range(len(bounds) - 1):
        s, t = bounds[g], bounds[g + 1]
        if t > s:
            out[g] = a32[:, s:t] @ b32[:, s:t].t()
    return out.to(out_dtype)
