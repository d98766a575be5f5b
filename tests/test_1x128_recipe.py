"""The 1x128 scale-block recipe (docs/numerics.md, "The 1x128 recipe").

* The quantizers, byte for byte against the scalar oracle: one RCEIL scale per 128 elements
  along the reduced axis (restarting at each group's first token for K groups), one per
  128x128 weight tile, every 32-block carrying its 128-block's scale; on the GPU, the kernels
  against the CPU reference (every edge: tests/kernels/test_quantize_kernels.py).
* Each 1x128 tensor *is* an MXFP8 tensor: its packed scales are the MXFP8 packing of the
  replicated dense scales, and the Blackwell (sm_100a) path takes it as it takes 1x32 operands
  (same kernel configuration; its block32 arithmetic equals the 1x128 arithmetic).
* SQNR of 1x32 and 1x128 side by side for the grouped GEMM's three products on four kinds of
  data, and `grouped_mm(..., scale_blocks="1x128")` through autograd.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_mxfp8 import grouped_mm, quantize_colwise, quantize_rowwise, quantize_weights
from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R
from tests import oracle

ROOT = Path(__file__).resolve().parents[1]


def _offs(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def _oracle_1x128_rows(x: torch.Tensor, starts_ends):
    """(element bytes, scale bytes per 32-block) of each row of ``x`` (R, M) quantized with one
    scale per 128 elements inside each [start, end) segment, by the scalar oracle."""
    rows = x.shape[0]
    data = [[0] * x.shape[1] for _ in range(rows)]
    scales = [[] for _ in range(rows)]
    xs = x.double().tolist()
    for r in range(rows):
        for s, e in starts_ends:
            for b0 in range(s, e, 128):
                vals = xs[r][b0:min(b0 + 128, e)]
                ex = oracle.scale_exponent(max(abs(v) for v in vals), "rceil")
                for j, v in enumerate(vals):
                    data[r][b0 + j] = oracle.e4m3_rne_satfinite(v * 2.0 ** -ex)
                scales[r] += [ex + 127] * math.ceil(len(vals) / 32)
    return torch.tensor(data, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


@pytest.mark.parametrize("k", [128, 160, 416])
def test_rowwise_1x128_matches_oracle(k, gen):
    x = torch.randn(6, k, generator=gen) * torch.logspace(-4, 4, k)  # ranges differ per block
    got = quantize_rowwise(x, scale_layout="dense", backend="reference", scale_blocks="1x128")
    data, scales = _oracle_1x128_rows(x, [(0, k)])
    assert torch.equal(got.data.view(torch.uint8), data)
    assert torch.equal(got.scale, scales)


@pytest.mark.parametrize("sizes", [[0, 1, 31, 33, 127, 129, 0, 300], [5], [0, 0, 256]])
def test_grouped_colwise_1x128_matches_oracle(sizes, gen):
    """Blocks of 128 restart at each group's first token; a group's last block is partial."""
    m = sum(sizes)
    x = (torch.randn(m, 40, generator=gen) * torch.logspace(-3, 3, m)[:, None]).bfloat16()
    offs = _offs(sizes)
    got = quantize_colwise(x, offs=offs, scale_layout="dense", backend="reference",
                           scale_blocks="1x128")
    bounds = [0] + offs.tolist()
    segs = [(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]
    data, scales = _oracle_1x128_rows(x.t(), segs)
    assert torch.equal(got.data.view(torch.uint8), data)
    assert torch.equal(got.scale, scales)


@pytest.mark.parametrize("sizes", [[0, 1, 31, 33, 127, 129, 0, 300], [200, 0, 56]])
def test_1x128_tensor_is_the_mxfp8_tensor_with_replicated_scales(sizes, gen):
    """The packed bytes are the MXFP8 packing of the replicated dense scales (rows and K
    groups), and the data bytes are E4M3(x / 2^scale) of each element's 32-block scale, i.e.
    exactly what an MXFP8 consumer (dequantize / sm_100a block32 MMA) computes with."""
    m = sum(sizes)
    offs = _offs(sizes)
    x = torch.randn(m, 352, generator=gen) * torch.logspace(-2, 2, 352)
    row = quantize_rowwise(x, offs=offs, backend="reference", scale_blocks="1x128")
    col = quantize_colwise(x, offs=offs, backend="reference", scale_blocks="1x128")
    dense_r = row.dense_scales()
    assert torch.equal(row.scale, L.pack_scales_grouped_rows(dense_r, offs))
    assert torch.equal(col.scale, L.pack_scales_grouped_k(col.dense_scales(), offs, m))
    # every 32-block carries its 128-block's scale (K = 352: 2 full 128-blocks + 3 blocks)
    blk = dense_r.reshape(m, -1)
    assert torch.equal(blk[:, :8], blk[:, ::4][:, :2].repeat_interleave(4, dim=1))
    assert torch.equal(blk[:, 8:], blk[:, 8:9].expand(-1, 3))
    # element bytes from the replicated scales alone
    per_elem = R.e8m0_to_float32(dense_r).repeat_interleave(32, dim=1)
    want = (x / per_elem).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(row.data.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("shape", [(2, 256, 384), (1, 160, 352)])
def test_weights_128x128_one_quantization_serves_both_axes(shape, gen):
    e, n, k = shape
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, k)
    qk = quantize_weights(w, axis="K", block_rows=128, backend="reference")
    qn = quantize_weights(w, axis="N", block_rows=128, backend="reference")
    assert qk.block_rows == qn.block_rows == 128
    assert torch.equal(qk.data.transpose(1, 2).view(torch.uint8), qn.data.view(torch.uint8))
    sk, sn = qk.dense_scales(), qn.dense_scales()  # (E, N, K/32), (E, K, N/32)
    tn, tk = -(-n // 128), -(-k // 128)
    amax = torch.nn.functional.pad(w.abs(), (0, tk * 128 - k, 0, tn * 128 - n))
    amax = amax.reshape(e, tn, 128, tk, 128).amax(dim=(2, 4))
    tiles = torch.tensor([[[oracle.scale_exponent(float(a), "rceil") + 127 for a in row]
                           for row in ex] for ex in amax])
    want_k = tiles.repeat_interleave(128, 1)[:, :n].repeat_interleave(4, 2)[..., : k // 32]
    want_n = tiles.transpose(1, 2).repeat_interleave(128, 1)[:, :k]
    want_n = want_n.repeat_interleave(4, 2)[..., : n // 32]
    assert torch.equal(sk.long(), want_k)
    assert torch.equal(sn.long(), want_n)
    want = (w / R.e8m0_to_float32(sk).repeat_interleave(32, dim=2)).clamp(-448, 448)
    assert torch.equal(qk.data.view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("sizes", [None, [0, 1, 31, 33, 127, 129, 0, 300], [200, 0, 56]])
def test_colwise_tiles_share_each_128_block_scale_over_128_features(sizes, gen):
    """``block_rows=128``: the columnwise copy's scale of (feature f, 128-token block) is the
    RCEIL exponent of the amax over features [128 (f // 128), +128) x that block (features past
    K and pad tokens count as 0), replicated over its four 32-blocks; the bytes are E4M3(x /
    scale). Where no element of a tile falls below E4M3's normal range under the tile's scale
    the dequantized values equal the per-column copy's (rounding is scale-invariant there)."""
    m = 300 if sizes is None else sum(sizes)
    offs = None if sizes is None else _offs(sizes)
    k = 300  # two full 128-feature tiles and a partial one
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)
    col = quantize_colwise(x, offs=offs, backend="reference", scale_blocks="1x128",
                           block_rows=128)
    per = quantize_colwise(x, offs=offs, backend="reference", scale_blocks="1x128")
    assert col.block_rows == 128 and per.block_rows == 1
    dense, dper = col.dense_scales().long(), per.dense_scales().long()  # (K, blocks)
    segs = ([(0, m)] if sizes is None else
            [(s, e) for s, e in zip([0, *offs.tolist()[:-1]], offs.tolist(), strict=True)])
    c = 0  # dense column of the segment's first 32-block
    for s, e in segs:
        for b0 in range(s, e, 128):
            b1 = min(b0 + 128, e)
            for f0 in range(0, k, 128):
                amax = float(x[b0:b1, f0:f0 + 128].abs().max())
                want = oracle.scale_exponent(amax, "rceil") + 127
                nb = -(-(b1 - b0) // 32)
                assert (dense[f0:f0 + 128, c:c + nb] == want).all(), (s, b0, f0)
                # the tile's scale is the largest of its features' 1x128 scales
                assert want == int(dper[f0:f0 + 128, c:c + nb].max())
            c += -(-(b1 - b0) // 32)
    per_elem = R.e8m0_to_float32(col.dense_scales()).repeat_interleave(32, dim=1)[:, :m]
    if sizes is None:
        want = (x.t() / per_elem).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(col.data.view(torch.uint8), want.view(torch.uint8))
    # a tile of values within 2^6 of each other: nothing subnormal, the same values
    y = torch.rand(256, 128, generator=gen) + 0.02
    a = R.quantize_colwise_ref(y, scale_blocks="1x128", block_rows=128).dequantize(torch.float32)
    b = R.quantize_colwise_ref(y, scale_blocks="1x128").dequantize(torch.float32)
    assert torch.equal(a, b)


def test_colwise_tiles_need_the_1x128_blocks():
    x = torch.randn(64, 128)
    with pytest.raises(ValueError, match="need scale_blocks='1x128'"):
        quantize_colwise(x, backend="reference", block_rows=128)
    with pytest.raises(ValueError, match="block_rows of a columnwise copy must be one of"):
        quantize_colwise(x, backend="reference", scale_blocks="1x128", block_rows=32)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[0, 1, 31, 33, 127, 129, 0, 300], [200, 0, 56], [0, 0, 0]])
@pytest.mark.parametrize("col_block_rows", [1, 128])
def test_gpu_1x128_kernels_match_the_cpu_reference(sizes, col_block_rows, gen):
    """The CuTeDSL quantizers of the recipe (``backend="auto"`` on the GPU) give the bytes of
    the CPU reference on the same values: rows and K groups of any size, a K with a partial
    128-block (352 = 2 x 128 + 3 x 32), 128x128 weight tiles cut by N and K; the columnwise
    copy per feature or in 128 x 128 tiles (``col_block_rows``), grouped and not."""
    from moe_mxfp8 import quantize_dual

    m = sum(sizes)
    offs = _offs(sizes)
    x = (torch.randn(m, 352, generator=gen) * torch.logspace(-3, 3, 352)).bfloat16()
    got = quantize_dual(x.cuda(), offs=offs.cuda(), scale_blocks="1x128",
                        col_block_rows=col_block_rows)
    want = quantize_dual(x, offs=offs, backend="reference", scale_blocks="1x128",
                         col_block_rows=col_block_rows)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.scale.cpu(), w.scale)
        assert torch.equal(g.data.cpu().view(torch.uint8), w.data.view(torch.uint8))
    assert got[1].block_rows == col_block_rows
    got = quantize_colwise(x.cuda(), scale_blocks="1x128", block_rows=col_block_rows)
    want = quantize_colwise(x, backend="reference", scale_blocks="1x128",
                            block_rows=col_block_rows)
    assert torch.equal(got.scale.cpu(), want.scale)
    assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    w = torch.randn(2, 200, 352, generator=gen) * torch.logspace(-3, 3, 352)
    for axis, src in (("K", w), ("N", w[:, :192, :100])):
        got = quantize_weights(src.cuda(), axis=axis, block_rows=128)
        want = quantize_weights(src, axis=axis, block_rows=128, backend="reference")
        assert torch.equal(got.scale.cpu(), want.scale), axis
        assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8)), axis


def test_bad_scale_blocks_is_one_line_error():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="scale_blocks must be one of"):
        quantize_rowwise(x, backend="reference", scale_blocks="1x64")
    with pytest.raises(ValueError, match="block_rows must be"):
        quantize_weights(torch.randn(1, 64, 64), block_rows=64, backend="reference")


# ---------------------------------------------------------------------------------------------
# SQNR: 1x32 vs 1x128 for the grouped GEMM's three products
# ---------------------------------------------------------------------------------------------


def _data(kind: str, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    if kind == "gaussian":
        return torch.randn(rows, cols, generator=g)
    if kind == "heavy_tailed":  # Student t, 3 degrees of freedom
        z = torch.randn(rows, cols, generator=g)
        chi2 = (torch.randn(rows, cols, 3, generator=g) ** 2).sum(-1)
        return z / (chi2 / 3).sqrt()
    if kind == "outlier_channels":  # a few features 50-100x larger (LLM activations)
        x = torch.randn(rows, cols, generator=g)
        idx = torch.randperm(cols, generator=g)[: max(cols // 64, 1)]
        x[:, idx] *= 50 + 50 * torch.rand(idx.numel(), generator=g)
        return x
    if kind == "swiglu":  # silu(gate) * up, the down projection's input
        a, b = torch.randn(2, rows, cols, generator=g)
        return torch.nn.functional.silu(a) * b
    raise ValueError(kind)


def _sqnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.detach().double()
    out = out.detach()
    return float(10 * torch.log10(ref.pow(2).sum() / (out.double() - ref).pow(2).sum()))


KINDS = ("gaussian", "heavy_tailed", "outlier_channels", "swiglu")
SIZES = [300, 0, 37, 700, 1, 129, 64, 200]  # E = 8, unbalanced, empty, partial blocks


def sqnr_table(seed: int = 0) -> dict:
    """{(kind, gemm): (sqnr 1x32, sqnr 1x128)} in dB vs the fp64 GEMM of the bf16 inputs."""
    g = torch.Generator().manual_seed(seed)
    m, n, k = sum(SIZES), 256, 512
    offs = _offs(SIZES)
    bounds = [0] + offs.tolist()
    res = {}
    for kind in KINDS:
        x = _data(kind, m, k, g).bfloat16()
        dy = _data(kind, m, n, g).bfloat16() * 1e-3
        w = (torch.randn(len(SIZES), n, k, generator=g) * k**-0.5).bfloat16()
        spans = list(enumerate(zip(bounds[:-1], bounds[1:], strict=True)))
        exact = {
            "fprop": torch.cat([x[s:t].double() @ w[i].double().t() for i, (s, t) in spans]),
            "dgrad": torch.cat([dy[s:t].double() @ w[i].double() for i, (s, t) in spans]),
            "wgrad": torch.stack([dy[s:t].double().t() @ x[s:t].double() for _, (s, t) in spans]),
        }
        for recipe in ("1x32", "1x128"):
            br = R.WEIGHT_BLOCK_ROWS[recipe]
            outs = {
                "fprop": R.grouped_mm(R.quantize_rowwise_ref(x, offs=offs, scale_blocks=recipe),
                                      R.quantize_weights_ref(w, "K", block_rows=br), offs,
                                      torch.float32),
                "dgrad": R.grouped_mm(R.quantize_rowwise_ref(dy, offs=offs, scale_blocks=recipe),
                                      R.quantize_weights_ref(w, "N", block_rows=br), offs,
                                      torch.float32),
                # the activation operand as the layer makes it (128 x 128 tiles for 1x128)
                "wgrad": R.grouped_mm(
                    R.quantize_colwise_ref(dy, offs=offs, scale_blocks=recipe),
                    R.quantize_colwise_ref(x, offs=offs, scale_blocks=recipe,
                                           block_rows=R.WGRAD_ACT_BLOCK_ROWS[recipe]), offs,
                    torch.float32),
            }
            for op, out in outs.items():
                res.setdefault((kind, op), []).append(_sqnr(out, exact[op]))
    return res


# Measured (CPU, seed 0, 2026-11-23; printed by this test with -s): see docs/numerics.md.
SQNR_FLOORS = {"fprop": 27.0, "dgrad": 25.0, "wgrad": 24.0}  # torchao's MXFP8 floors
SQNR_MAX_LOSS_DB = 0.15  # 1x128 may lose at most this much against 1x32


def test_sqnr_1x128_equals_1x32():
    table = sqnr_table()
    print("\nkind              gemm   1x32 dB  1x128 dB  diff")
    for (kind, op), (s32, s128) in table.items():
        print(f"{kind:17s} {op:6s} {s32:7.2f}  {s128:7.2f}  {s128 - s32:+.3f}")
        assert s128 >= SQNR_FLOORS[op] and s32 >= SQNR_FLOORS[op], (kind, op, s32, s128)
        assert s128 >= s32 - SQNR_MAX_LOSS_DB, (kind, op, s32, s128)


# ---------------------------------------------------------------------------------------------
# grouped_mm(scale_blocks="1x128") and the sm_100a path
# ---------------------------------------------------------------------------------------------


def test_grouped_mm_1x128_uses_1x128_operands(gen):
    """Forward and both gradients equal the reference GEMMs of the 1x128-quantized operands
    (bit for bit: same reference path), and differ from the 1x32 recipe's."""
    sizes = [40, 0, 130, 86]
    offs = _offs(sizes)
    m, k, n = sum(sizes), 256, 128
    x = torch.randn(m, k, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(4, n, k, generator=gen) * 0.05).bfloat16().requires_grad_()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    y = grouped_mm(x, w.transpose(-2, -1), offs, backend="reference", scale_blocks="1x128")
    y.backward(dy)
    xq = R.quantize_rowwise_ref(x.detach(), offs=offs, scale_blocks="1x128")
    wq = R.quantize_weights_ref(w.detach(), "K", block_rows=128)
    assert torch.equal(y, R.grouped_mm(xq, wq, offs, torch.bfloat16))
    dyq = R.quantize_rowwise_ref(dy, offs=offs, scale_blocks="1x128")
    wnq = R.quantize_weights_ref(w.detach(), "N", block_rows=128)
    assert torch.equal(x.grad, R.grouped_mm(dyq, wnq, offs, torch.bfloat16))
    dytq = R.quantize_colwise_ref(dy, offs=offs, scale_blocks="1x128")
    xtq = R.quantize_colwise_ref(x.detach(), offs=offs, scale_blocks="1x128", block_rows=128)
    assert torch.equal(w.grad, R.grouped_mm(dytq, xtq, offs, torch.bfloat16))
    # the operands are not the 1x32 ones (scales differ; the dequantized values mostly do not:
    # E4M3 rounding is scale-invariant above its subnormal range)
    x32 = R.quantize_rowwise_ref(x.detach(), offs=offs)
    assert not torch.equal(x32.scale, xq.scale)


def test_scale_blocks_vocabulary_and_alias(gen):
    from moe_mxfp8.autograd import resolve_scale_blocks

    assert resolve_scale_blocks("1x128", None) == "1x128"
    assert resolve_scale_blocks("1x32", "32x32") == "32x32"  # the older name still works
    assert resolve_scale_blocks("1x128", "1x32") == "1x128"
    with pytest.raises(ValueError, match="not both"):
        resolve_scale_blocks("1x128", "32x32")
    with pytest.raises(ValueError, match="scale_blocks must be one of"):
        resolve_scale_blocks("128x128", None)


def test_sm100_block32_arithmetic_equals_1x128_arithmetic(gen):
    """What the sm_100a kernel computes from a 1x128 operand -- per 32-block products scaled
    by that block's packed E8M0 scales (`reference.grouped_mm` dequantizes exactly so) --
    equals the 1x128 recipe's own arithmetic: one scale per 128 elements times one per
    128x128 weight tile, applied once per 128-wide k-step (fp64, to rounding)."""
    sizes = [100, 0, 156]
    offs = _offs(sizes)
    m, n, k = sum(sizes), 256, 384
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)
    w = torch.randn(3, n, k, generator=gen)
    a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks="1x128")
    b = R.quantize_weights_ref(w, "K", block_rows=128)
    block32 = R.grouped_mm(a, b, offs, torch.float32).double()
    sa = R.e8m0_to_float32(a.dense_scales()[:, ::4]).double()  # (M, K/128)
    sb = R.e8m0_to_float32(b.dense_scales()[:, ::128, ::4]).double()  # (E, N/128, K/128)
    qa, qb = a.data.double(), b.data.double()
    bounds = [0] + offs.tolist()
    out = torch.zeros(m, n, dtype=torch.float64)
    for g, (s, t) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        for kt in range(k // 128):
            part = qa[s:t, kt * 128:(kt + 1) * 128] @ qb[g, :, kt * 128:(kt + 1) * 128].t()
            out[s:t] += part * sa[s:t, kt:kt + 1] * sb[g, :, kt].repeat_interleave(128)[None]
    assert torch.allclose(block32, out, rtol=1e-5, atol=1e-5 * float(out.abs().max()))


_SM100_SCRIPT = textwrap.dedent("""
    import glob, json, os, sys
    import torch
    from moe_mxfp8 import reference as R
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm import problem as P
    from moe_mxfp8.kernels.grouped_gemm.sm100 import GroupedGemmSm100
    offs = torch.tensor([100, 100, 356], dtype=torch.int32)
    x = torch.randn(356, 512)
    w = torch.randn(3, 256, 512)
    res = {}
    for recipe in ("1x32", "1x128"):
        a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks=recipe)
        b = R.quantize_weights_ref(w, "K", block_rows=R.WEIGHT_BLOCK_ROWS[recipe])
        p = P.describe_m(a, b, offs, torch.bfloat16)
        cfg = GroupedGemmSm100.select_config(p)
        res[recipe] = [repr(cfg), list(GroupedGemmSm100(cfg).can_implement(p))]
    launcher.compile_config(GroupedGemmSm100, GroupedGemmSm100.select_config(p))
    print(json.dumps(res))
""")


@pytest.mark.slow
def test_sm100_path_accepts_1x128_operands_and_compiles(tmp_path):
    """The sm_100a entry point describes a 1x128-recipe problem, picks the same kernel
    configuration as for 1x32 operands (the Blackwell MMA reads the replicated block32 scales
    as they are), accepts it, and that kernel compiles for sm_100a with the block-scaled MMA
    (UTCQMMA) in its SASS."""
    pytest.importorskip("cutlass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", CUTE_DSL_DUMP_DIR=str(tmp_path),
               CUTE_DSL_KEEP="cubin", PYTHONPATH=f"{ROOT}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _SM100_SCRIPT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["1x128"] == res["1x32"] and res["1x128"][1] == [True, ""], res
    from tests.kernels.test_grouped_gemm_sm100 import _nvdisasm

    exe = _nvdisasm()
    cubins = glob.glob(str(tmp_path / "**" / "*.cubin"), recursive=True)
    if exe is None or not cubins:
        pytest.skip("nvdisasm or the kept cubin not available")
    sass = subprocess.run([exe, "-c", cubins[0]], capture_output=True, text=True).stdout
    assert "UTCQMMA" in sass


# ---------------------------------------------------------------------------------------------
# MXFP8MoE(scale_blocks="1x128")
# ---------------------------------------------------------------------------------------------


def test_moe_1x128_pads_groups_to_128():
    from moe_mxfp8 import MXFP8MoE

    layer = MXFP8MoE(64, 64, 4, 2, scale_blocks="1x128", backend="reference")
    assert layer.scale_blocks == "1x128" and layer.group_align_rows == 128
    assert "scale_blocks='1x128'" in repr(layer)
    assert MXFP8MoE(64, 64, 4, 2, backend="reference").group_align_rows == 16
    counts = torch.tensor([5, 0, 130, 7])
    from moe_mxfp8 import routing as RT

    ids = torch.repeat_interleave(torch.arange(4), counts).view(71, 2)
    rows, _, offs = RT.route_layout(ids, counts, layer.group_align_rows)
    assert offs.tolist()[:3] == [128, 128, 384] and offs[-1] % 128 == 0
    assert rows.unique().numel() == 142 and int(rows.max()) < int(offs[-1])
    with pytest.raises(ValueError, match="not both"):
        MXFP8MoE(64, 64, 4, 2, scale_blocks="1x128", weight_blocks="32x32")


@pytest.mark.parametrize("recipe,b_rows", [("1x128", 128), ("1x32", 1)])
def test_layer_weight_gradients_take_tiled_activation_operands(recipe, b_rows, monkeypatch):
    """`MXFP8MoE`'s two weight-gradient GEMMs get the gradient operand with one scale per row
    and the saved activation operand (x, then SwiGLU's a) in 128 x 128 tiles for the 1x128
    recipe -- every feature of a 128-feature tile carries the same scale per 128-token block,
    which an outlier feature makes different from per-feature scales -- and per row for 1x32."""
    from moe_mxfp8 import MXFP8MoE
    from moe_mxfp8 import datapath as DP

    seen = []
    real = DP.grouped_mm_k

    def spy(a, b, offs, **kw):
        seen.append((a.block_rows, b.block_rows))
        dense = b.dense_scales()  # (features, 32-token blocks)
        shared = all(bool((dense[f:f + 128] == dense[f:f + 1]).all())
                     for f in range(0, dense.shape[0], 128))
        assert shared == (b.block_rows == 128)
        return real(a, b, offs, **kw)

    monkeypatch.setattr(DP, "grouped_mm_k", spy)
    torch.manual_seed(0)
    layer = MXFP8MoE(256, 192, 4, 2, backend="reference", scale_blocks=recipe)
    x = torch.randn(96, 256, requires_grad=True)
    x[:, 5].data.mul_(40)  # an outlier feature: its tile's scale differs from the others'
    layer(x).sum().backward()
    assert seen == [(1, b_rows), (1, b_rows)]


def _module_sqnr(recipe: str, seed: int = 0) -> dict:
    from moe_mxfp8 import MXFP8MoE

    torch.manual_seed(seed)
    mx = MXFP8MoE(256, 128, 8, 2, backend="reference", scale_blocks=recipe)
    bf = MXFP8MoE(256, 128, 8, 2, precision="bf16")
    bf.load_state_dict(mx.state_dict())
    x = torch.randn(512, 256)
    dy = torch.randn(512, 256)
    res = {}
    outs = []
    for m in (mx, bf):
        xa = x.clone().requires_grad_()
        y = m(xa)
        (y.float() * dy).sum().backward()
        outs.append((y, xa.grad, m.w_gate_up.grad, m.w_down.grad))
    for name, a, b in zip(("out", "dx", "dw_gate_up", "dw_down"), *outs, strict=True):
        res[name] = _sqnr(a, b)
    return res


def test_moe_sqnr_1x128_equals_1x32():
    """The module against its BF16 twin, both recipes side by side (CPU, reference backend)."""
    s32, s128 = _module_sqnr("1x32"), _module_sqnr("1x128")
    print("\nMXFP8MoE vs BF16 twin, SQNR dB (1x32 / 1x128):",
          {k: (round(s32[k], 2), round(s128[k], 2)) for k in s32})
    for k in s32:
        assert s128[k] >= s32[k] - SQNR_MAX_LOSS_DB, (k, s32[k], s128[k])
        assert s128[k] >= 20.0, (k, s128[k])
