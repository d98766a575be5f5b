"""The reference quantizers against the contract, byte for byte.

Hand-worked cases at every edge of the contract, then property tests against the independent
scalar oracle in `tests/oracle.py` on random shapes, dtypes and value ranges.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_mxfp8 import quantize_colwise, quantize_dual, quantize_rowwise, quantize_weights
from moe_mxfp8.reference import e8m0_to_float32
from tests import oracle

# Property tests need hypothesis (the `test` extra); a bare GPU image without it skips this file.
hypothesis = pytest.importorskip("hypothesis")
given, settings, st = hypothesis.given, hypothesis.settings, hypothesis.strategies


def _block(values, dtype=torch.float32):
    """A (1, 32) tensor: `values` first, then zeros."""
    x = torch.zeros(1, 32, dtype=dtype)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float64).to(dtype)
    return x


def _q(x, rounding="rceil"):
    t = quantize_rowwise(x, rounding=rounding, scale_layout="dense", backend="reference")
    return t.data.view(torch.uint8)[0].tolist(), int(t.scale[0, 0])


# ---- hand-worked cases --------------------------------------------------------------------


def test_amax_zero_gives_scale_byte_0_and_zero_data():
    data, s = _q(torch.zeros(1, 32))
    assert s == 0x00 and data == [0] * 32


def test_negative_zero_keeps_its_sign():
    data, s = _q(torch.full((1, 32), -0.0))
    assert s == 0x00 and data == [0x80] * 32


@pytest.mark.parametrize("k", [-20, -3, 0, 5, 30])
def test_amax_exactly_448_times_power_of_two(k):
    # 448 * 2^k needs no larger scale: e = k, byte 127 + k, element 448 = 0x7E.
    data, s = _q(_block([448.0 * 2.0**k, -448.0 * 2.0**k, 2.0**k]))
    assert s == 127 + k
    assert data[:3] == [0x7E, 0xFE, 0x38]  # 448, -448, 1.0 (exp field 7, mantissa 0)


def test_one_ulp_above_448_bumps_the_exponent_under_rceil():
    # bf16 ulp at 448 is 2: 450 > 448 -> e = 1; 450 / 2 = 225 rounds to 224 = 1.75 * 2^7 -> 0x76.
    data, s = _q(_block([450.0], torch.bfloat16))
    assert s == 128 and data[0] == 0x76
    # fp32 one ulp above 448 (448 + 2^-15): still e = 1, and the element rounds to 224.
    data, s = _q(_block([float(torch.nextafter(torch.tensor(448.0), torch.tensor(1e9)))]))
    assert s == 128 and data[0] == 0x76


def test_floor_saturates_what_rceil_scales_up():
    # mantissa 1.875 > 1.75: RCEIL takes e = 1 (480 / 2 = 240 = 0x77), FLOOR keeps e = 0 and
    # 480 saturates to 448 (0x7E).
    data, s = _q(_block([480.0]), "rceil")
    assert (s, data[0]) == (128, 0x77)
    data, s = _q(_block([480.0]), "floor")
    assert (s, data[0]) == (127, 0x7E)
    # Exactly 1.75 * 2^k: both modes agree, no saturation.
    assert _q(_block([448.0]), "floor") == _q(_block([448.0]), "rceil")


def test_saturation_under_floor_is_satfinite_not_nan():
    data, s = _q(_block([511.0, -500.0]), "floor")
    assert s == 127 and data[:2] == [0x7E, 0xFE]


def test_subnormal_amax():
    # fp32 subnormal 2^-134: e clamps to -127 (byte 0), 2^-134 * 2^127 = 2^-7 is an E4M3
    # subnormal (mantissa 4 of 2^-9 units) -> 0x04.
    data, s = _q(_block([2.0**-134]))
    assert s == 0 and data[0] == 0x04
    # bf16 subnormal 2^-130 -> 2^-3 = 0x20.
    data, s = _q(_block([2.0**-130], torch.bfloat16))
    assert s == 0 and data[0] == 0x20


def test_negative_value_rounding_to_zero_gives_0x80():
    data, s = _q(_block([1.0, -(2.0**-20)]))
    assert s == 127 - 8 and data[1] == 0x80


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_block_gets_nan_scale_others_untouched(bad):
    x = torch.ones(2, 64)
    x[0, 5] = bad
    t = quantize_rowwise(x, scale_layout="dense", backend="reference")
    assert t.scale.tolist() == [[0xFF, 127 - 8], [127 - 8, 127 - 8]]
    assert torch.isnan(t.dequantize(torch.float32)[0, :32]).all()
    assert torch.equal(t.dequantize(torch.float32)[0, 32:], x[0, 32:])


def test_huge_values_fp32():
    big = 3.0e38
    data, s = _q(_block([big, -big / 3]))
    assert s == oracle.quantize_block([big], "rceil")[1] < 0xFF


def test_e8m0_decode_is_exact():
    b = torch.arange(255, dtype=torch.uint8)
    got = e8m0_to_float32(b).to(torch.float64)
    want = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(got, want)
    assert torch.isnan(e8m0_to_float32(torch.tensor([0xFF], dtype=torch.uint8))).all()


# ---- against the independent oracle ------------------------------------------------------


def _check_against_oracle(x: torch.Tensor, rounding: str) -> None:
    t = quantize_rowwise(x, rounding=rounding, scale_layout="dense", backend="reference")
    data = t.data.view(torch.uint8)
    xs = x.to(torch.float64)
    for r in range(x.shape[0]):
        for c in range(x.shape[1] // 32):
            vals = xs[r, c * 32 : (c + 1) * 32].tolist()
            want_q, want_s = oracle.quantize_block(vals, rounding)
            assert int(t.scale[r, c]) == want_s, (r, c, vals)
            got_q = data[r, c * 32 : (c + 1) * 32].tolist()
            for g, w in zip(got_q, want_q, strict=True):
                if w is not None:
                    assert g == w, (r, c, vals)


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3),
    blocks=st.integers(1, 3),
    dtype=st.sampled_from(sorted(_DTYPES)),
    rounding=st.sampled_from(["rceil", "floor"]),
    log2_range=st.integers(-140, 120),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_oracle_on_random_data(rows, blocks, dtype, rounding, log2_range, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 32, generator=g, dtype=torch.float64)
    x = x * 2.0 ** (log2_range if dtype == "fp32" else max(min(log2_range, 14), -20))
    x = x.to(_DTYPES[dtype])
    _check_against_oracle(x, rounding)


@settings(max_examples=25, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=32, max_size=64),
    rounding=st.sampled_from(["rceil", "floor"]),
)
def test_reference_matches_oracle_on_arbitrary_fp32_bit_patterns(bits, rounding):
    n = len(bits) // 32 * 32
    x = torch.tensor(bits[:n], dtype=torch.int64).to(torch.int32).view(torch.float32)
    _check_against_oracle(x.reshape(1, n), rounding)


def test_powers_of_two_and_neighbours_match_oracle():
    vals = []
    for k in range(-12, 14):
        base = 448.0 * 2.0**k
        vals += [base, float(torch.nextafter(torch.tensor(base), torch.tensor(1e30)))]
        vals += [float(torch.nextafter(torch.tensor(base), torch.tensor(0.0)))]
        vals += [1.875 * 2.0**k, 1.75 * 2.0**k]
    vals = vals[: len(vals) // 32 * 32]
    x = torch.tensor(vals, dtype=torch.float32).reshape(-1, 32)
    for rounding in ("rceil", "floor"):
        # One value per block too, so each value is its block's amax.
        _check_against_oracle(x, rounding)
        single = torch.zeros(len(vals), 32)
        single[:, 0] = torch.tensor(vals)
        single[:, 1] = -torch.tensor(vals) / 3
        _check_against_oracle(single, rounding)


# ---- orientations and groups agree with each other ---------------------------------------


def test_colwise_equals_rowwise_of_transpose(gen):
    x = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    col = quantize_colwise(x, scale_layout="dense", backend="reference")
    row_t = quantize_rowwise(x.t().contiguous(), scale_layout="dense", backend="reference")
    assert col.data.shape == (64, 96) and col.data.is_contiguous()
    assert torch.equal(col.data.view(torch.uint8), row_t.data.view(torch.uint8))
    assert torch.equal(col.scale, row_t.scale)


def test_colwise_partial_last_block_is_zero_padded(gen):
    x = torch.randn(45, 32, generator=gen)
    col = quantize_colwise(x, scale_layout="dense", backend="reference")
    padded = torch.cat([x, torch.zeros(19, 32)])
    ref = quantize_rowwise(padded.t().contiguous(), scale_layout="dense", backend="reference")
    assert col.scale.shape == (32, 2)
    assert torch.equal(col.scale, ref.scale)
    assert torch.equal(col.data.view(torch.uint8), ref.data.view(torch.uint8)[:, :45])


GROUP_SIZES = [[0, 1, 31, 33, 127, 129, 0], [5], [0, 0, 64], [300, 0]]


def _offs(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("sizes", GROUP_SIZES)
def test_grouped_colwise_equals_per_group_quantization(sizes, gen):
    m = sum(sizes)
    x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
    offs = _offs(sizes)
    got = quantize_colwise(x, offs=offs, backend="reference")
    dense = quantize_colwise(x, offs=offs, scale_layout="dense", backend="reference")
    start, packed_parts, dense_parts = 0, [], []
    for s in sizes:
        part = x[start : start + s]
        if s:
            q = quantize_colwise(part, backend="reference")
            assert torch.equal(got.data[:, start : start + s].view(torch.uint8),
                               q.data.view(torch.uint8))
            packed_parts.append(q.scale)
            dense_parts.append(quantize_colwise(part, scale_layout="dense",
                                                backend="reference").scale)
        start += s
    want = torch.cat(packed_parts)
    assert torch.equal(got.scale[: want.numel()], want)
    assert not got.scale[want.numel():].any()  # padding to the static bound is zero
    assert torch.equal(dense.scale, torch.cat(dense_parts, dim=1))
    assert torch.equal(got.dense_scales(), dense.scale)


@pytest.mark.parametrize("sizes", GROUP_SIZES)
def test_grouped_rowwise_equals_per_group_quantization(sizes, gen):
    m = sum(sizes)
    x = torch.randn(m, 96, generator=gen)
    offs = _offs(sizes)
    got = quantize_rowwise(x, offs=offs, backend="reference")
    plain = quantize_rowwise(x, backend="reference")
    assert torch.equal(got.data.view(torch.uint8), plain.data.view(torch.uint8))
    start, parts = 0, []
    for s in sizes:
        if s:
            parts.append(quantize_rowwise(x[start : start + s], backend="reference").scale)
        start += s
    want = torch.cat(parts)
    assert torch.equal(got.scale[: want.numel()], want)
    assert not got.scale[want.numel():].any()
    assert torch.equal(got.dense_scales(), plain.dense_scales())


def test_dual_is_rowwise_and_colwise(gen):
    x = torch.randn(200, 64, generator=gen).to(torch.bfloat16)
    offs = _offs([70, 0, 130])
    row, col = quantize_dual(x, offs=offs, backend="reference")
    row2 = quantize_rowwise(x, offs=offs, backend="reference")
    col2 = quantize_colwise(x, offs=offs, backend="reference")
    for a, b in ((row, row2), (col, col2)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("axis", ["K", "N"])
def test_weights_each_expert_packed_separately(axis, gen):
    w = torch.randn(3, 64, 96, generator=gen).to(torch.bfloat16)
    q = quantize_weights(w, axis=axis, backend="reference")
    stride = q.scale.numel() // 3
    for e in range(3):
        src = w[e] if axis == "K" else w[e].t().contiguous()
        ref = quantize_rowwise(src, backend="reference")
        assert torch.equal(q.data[e].view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(q.scale[e * stride : (e + 1) * stride], ref.scale)


def test_weights_32x32_mode_one_quantization_serves_both_axes(gen):
    w = torch.randn(2, 64, 96, generator=gen) * torch.logspace(-3, 3, 96)
    qk = quantize_weights(w, axis="K", block_rows=32, backend="reference")
    qn = quantize_weights(w, axis="N", block_rows=32, backend="reference")
    assert torch.equal(qk.data.transpose(1, 2).view(torch.uint8), qn.data.view(torch.uint8))
    sk, sn = qk.dense_scales(), qn.dense_scales()  # (E, N, K/32) and (E, K, N/32)
    tiles = sk[:, ::32, :]  # (E, N/32, K/32): one scale per 32x32 tile
    assert torch.equal(sk, tiles.repeat_interleave(32, dim=1))
    assert torch.equal(sn, tiles.transpose(1, 2).repeat_interleave(32, dim=1))
    # and each tile's scale is the tile's amax exponent
    amax = w.abs().reshape(2, 2, 32, 3, 32).amax(dim=(2, 4))
    e = torch.tensor([[[oracle.scale_exponent(float(a), "rceil") for a in row] for row in ex]
                      for ex in amax])
    assert torch.equal(tiles.to(torch.int64), e + 127)


def test_dequantize_roundtrip_error_is_small(gen):
    x = torch.randn(64, 256, generator=gen)
    t = quantize_rowwise(x, backend="reference")
    err = (t.dequantize(torch.float32) - x).norm() / x.norm()
    assert err < 0.04  # E4M3 has 3 mantissa bits: relative RMS error ~2.5e-2
    assert math.isfinite(float(err))
