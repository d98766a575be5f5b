"""The fast reference (`moe_mxfp8.reference`) against straightforward formulations, bit for bit.

The reference computes its bytes and GEMMs in few, mostly in-place passes (blocks reduced in
the input's own width, columnwise blocks formed down the rows and transposed once in FP8, FP8
widened by bit manipulation, one ``mm`` per group straight into the output dtype). Here each
result is recomputed the plain way -- widen to float32 first, one group at a time, dequantize
with `MXFP8Tensor.dequantize`, accumulate in a float32 buffer -- on random data (new every run),
including NaN/Inf, empty and uneven groups, ragged K and arbitrary FP8/scale bytes, and must
match exactly: quantized bytes and scale bytes, and the GEMM outputs' bits.
"""

from __future__ import annotations

import pytest
import torch

from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R
from moe_mxfp8.mx_tensor import MXFP8Tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- straightforward formulations -------------------------------------------------------------


def _plain_blocks(x32: torch.Tensor, amax: torch.Tensor, rounding: str):
    """``x32 (..., n, 32)`` float32 with per-block ``amax (..., n)`` float32 -> (e4m3, bytes)."""
    bits = amax.view(torch.int32) & 0x7FFFFFFF
    exp = bits >> 23
    e = exp - 135
    if rounding == "rceil":
        e = e + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = e.clamp(-127, 127)
    bad = exp == 0xFF
    e = torch.where(bad, torch.zeros_like(e), e)
    byte = torch.where(bad, torch.full_like(e, 0xFF), e + 127).to(torch.uint8)
    inv = ((127 - e) << 23).view(torch.float32)
    q = (x32 * inv[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, byte


def _plain_amax(x32: torch.Tensor, dims) -> torch.Tensor:
    """Largest |x| (NaN wins, then Inf) as float32, from the float32 bit patterns."""
    return (x32.view(torch.int32) & 0x7FFFFFFF).amax(dims).view(torch.float32)


def _plain_rows(x: torch.Tensor, rounding: str, block: int):
    """Row-wise ``x (R, K)`` -> e4m3 ``(R, K)`` and dense ``(R, ceil(K/32))``: 32-blocks along K
    scaled by the amax of their ``block``-long block (32 or 128), zero-padded at the end."""
    x32 = x.to(torch.float32)
    r, k = x32.shape
    kp = L.round_up(k, block)
    xp = torch.cat([x32, x32.new_zeros(r, kp - k)], dim=1)
    amax = _plain_amax(xp.reshape(r, kp // block, block), -1)
    amax = amax.repeat_interleave(block // 32, dim=1)
    q, byte = _plain_blocks(xp.reshape(r, kp // 32, 32), amax, rounding)
    return q.reshape(r, kp)[:, :k], byte[:, : L.ceil_div(k, 32)]


def _plain_colwise(x, rounding, offs, block):
    """Column-wise ``x (M, K)``: each group's tokens quantized on their own (transposed)."""
    m, k = x.shape
    bounds = [0] + (offs.tolist() if offs is not None else [m])
    datas, scales = [], []
    for s, t in zip(bounds[:-1], bounds[1:], strict=True):
        if t > s:
            q, byte = _plain_rows(x[s:t].t(), rounding, block)
            datas.append(q.view(torch.uint8))
            scales.append(byte)
    if not datas:
        return x.new_empty(k, 0, dtype=torch.uint8), x.new_empty(k, 0, dtype=torch.uint8)
    return torch.cat(datas, dim=1), torch.cat(scales, dim=1)


def _plain_grouped_mm(a: MXFP8Tensor, b: MXFP8Tensor, offs, out_dtype):
    bounds = [0] + offs.tolist()
    a32, b32 = a.dequantize(torch.float32), b.dequantize(torch.float32)
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


# ---- random data ------------------------------------------------------------------------------


def _rand(shape, dtype, gen, special=True):
    """Gaussian rows over ~50 binades, some rows zero, and (optionally) a few NaN/+-Inf."""
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.randint(-25, 25, (*shape[:-1], 1), generator=gen).float())
    if x.numel():
        flat = x.view(-1)
        n = max(1, x.numel() // 997)
        idx = torch.randint(0, x.numel(), (n,), generator=gen)
        flat[idx] = 0.0
        if special:
            vals = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
            flat[idx[: len(vals)]] = vals[: min(len(vals), n)]
    return x.to(dtype)


def _offs(m, groups, gen):
    cuts = torch.randint(0, m + 1, (groups - 1,), generator=gen).sort().values
    return torch.cat([cuts, torch.tensor([m])]).to(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor):
    assert a.shape == b.shape and a.dtype == b.dtype
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    assert torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


SHAPES = [(0, 64), (1, 32), (33, 64), (96, 40), (300, 128), (517, 96)]


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_quantizers_match_plain_formulation(m, k, dtype, scale_blocks, gen):
    x = _rand((m, k), dtype, gen)
    block = R.ACT_BLOCK[scale_blocks]
    for rounding in ("rceil", "floor"):
        row = R.quantize_rowwise_ref(x, rounding, "dense", None, scale_blocks)
        q, s = _plain_rows(x, rounding, block)
        _same(row.data.view(torch.uint8), q.view(torch.uint8))
        _same(row.scale, s)
        assert row.data.is_contiguous()
        for groups in (None, 1, 3, 8):
            offs = None if groups is None else _offs(m, groups, gen)
            col = R.quantize_colwise_ref(x, rounding, "dense", offs, scale_blocks)
            qd, sd = _plain_colwise(x, rounding, offs, block)
            _same(col.data.view(torch.uint8), qd)
            _same(col.scale, sd)
            assert col.data.is_contiguous() and col.data.shape == (k, m)
            if offs is not None:
                packed = R.quantize_colwise_ref(x, rounding, "packed", offs, scale_blocks)
                _same(packed.data.view(torch.uint8), qd)
                _same(packed.scale, L.pack_scales_grouped_k(sd, offs, m))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_rows", [1, 32, 128])
def test_weight_quantizer_matches_plain_formulation(dtype, block_rows, gen):
    for e, n, k in [(1, 32, 32), (3, 96, 40), (8, 200, 128)]:
        w = _rand((e, n, k), dtype, gen)
        for axis in ("K", "N"):
            got = R.quantize_weights_ref(w, axis, "rceil", "dense", block_rows)
            src = (w if axis == "K" else w.transpose(-2, -1)).to(torch.float32)
            rows, cols = src.shape[1:]
            if block_rows == 1:
                q, s = _plain_rows(src.reshape(e * rows, cols), "rceil", 32)
            else:  # one amax per tile, every 32-block of the tile scaled by it
                t = block_rows
                rp, cp = L.round_up(rows, t), L.round_up(cols, t)
                sp = torch.zeros(e, rp, cp)
                sp[:, :rows, :cols] = src
                amax = _plain_amax(sp.reshape(e, rp // t, t, cp // t, t), (2, 4))
                amax = amax.repeat_interleave(t, 1).repeat_interleave(t // 32, 2)
                q, s = _plain_blocks(sp.reshape(e, rp, cp // 32, 32), amax, "rceil")
                q = q.reshape(e, rp, cp)[:, :rows, :cols]
                s = s[:, :rows, : L.ceil_div(cols, 32)]
            _same(got.data.view(torch.uint8), q.reshape(e, rows, cols).view(torch.uint8))
            _same(got.scale, s.reshape(e, rows, -1))
            packed = R.quantize_weights_ref(w, axis, "rceil", "packed", block_rows)
            _same(packed.scale, L.pack_scales_experts(got.scale))


def _scramble(t: MXFP8Tensor, gen, scales=True):
    """Arbitrary element bytes (NaN codes included) and, optionally, scale bytes 100..255
    (2^(b-127) up to 2^127 and the NaN scale): inputs no quantizer writes, same GEMM contract."""
    t.data.view(torch.uint8).copy_(torch.randint(0, 256, t.data.shape, dtype=torch.uint8,
                                                 generator=gen))
    if scales:
        t.scale.copy_(torch.randint(100, 256, t.scale.shape, dtype=torch.uint8, generator=gen))


def _same_out(got, want):
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    _same(got.masked_fill(nan, 0), want.masked_fill(nan, 0))


@pytest.mark.parametrize("m", [0, 1, 33, 200, 517])
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
@pytest.mark.parametrize("scramble", [False, True])
def test_grouped_mm_matches_plain_formulation(m, scale_blocks, scramble, gen):
    for groups, n, k in [(1, 64, 32), (3, 96, 128), (8, 32, 96)]:
        offs = _offs(m, groups, gen)
        x = _rand((m, k), torch.bfloat16, gen, special=False)
        dy = _rand((m, n), torch.bfloat16, gen, special=False)
        w = _rand((groups, n, k), torch.bfloat16, gen, special=False)
        a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks=scale_blocks)
        wq = R.quantize_weights_ref(w, "K", block_rows=R.WEIGHT_BLOCK_ROWS[scale_blocks])
        dyc = R.quantize_colwise_ref(dy, offs=offs, scale_blocks=scale_blocks)
        xc = R.quantize_colwise_ref(x, offs=offs, scale_blocks=scale_blocks)
        if scramble:
            _scramble(a, gen)
            _scramble(wq, gen, scales=False)
            _scramble(dyc, gen, scales=False)
        for out_dtype in (torch.bfloat16, torch.float32):
            _same_out(R.grouped_mm(a, wq, offs, out_dtype),
                      _plain_grouped_mm(a, wq, offs, out_dtype))
            _same_out(R.grouped_mm(dyc, xc, offs, out_dtype),
                      _plain_grouped_mm(dyc, xc, offs, out_dtype))


def test_e4m3_widening_matches_the_conversion():
    """Every E4M3 byte under every scale byte: the bit-built dequantization is the plain one."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    # scale bytes up to 134 take the one-multiply route, larger ones (and NaN) the two-step one
    for bmax in (R._FACTOR_B_MAX, 255):
        data = codes.repeat(bmax + 1, 1)  # row r: all 256 codes under scale byte r
        dense = torch.arange(bmax + 1, dtype=torch.int32).to(torch.uint8)[:, None].expand(-1, 8)
        t = MXFP8Tensor(data.view(torch.float8_e4m3fn), L.pack_scales(dense.contiguous()))
        _same(R._dequantize_f32(t), t.dequantize(torch.float32))  # NaNs too, bit for bit
