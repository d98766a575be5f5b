"""MXFP8 quantizer kernels (kernels/quantize.py).

CPU: every kernel variant compiles for sm_90a and sm_100a (fake pointers, a subprocess per arch,
since CuTeDSL reads ``CUTE_DSL_ARCH`` once when it is imported).
GPU: bit-exact against `moe_mxfp8.reference` on random and adversarial data, outputs poisoned
first; for NaN/Inf blocks only the scale byte (0xFF) is compared.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R

ROOT = Path(__file__).resolve().parents[2]
POISON = 0xAB
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUNDINGS = ("rceil", "floor")

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------
# CPU: compile every variant for both archs
# ---------------------------------------------------------------------------------------------

COMPILE_SCRIPT = textwrap.dedent(
    """
    import itertools
    from moe_mxfp8.kernels import quantize as Q
    C = Q.QuantConfig
    n = 0
    for dt, rnd in itertools.product(("bfloat16", "float16", "float32"), ("rceil", "floor")):
        variants = [
            ("quantize_rowwise", C(dt, rnd, 7168, True, False)),
            ("quantize_rowwise", C(dt, rnd, 2080, True, False, grouping="offs")),
            ("quantize_colwise", C(dt, rnd, 2048, False, True, col_aligned=True)),
            ("quantize_colwise", C(dt, rnd, 96, False, True)),
            ("quantize_colwise", C(dt, rnd, 2048, False, True, grouping="offs")),
            # a columnwise K that is no multiple of 32 or of the vector: element loads
            ("quantize_colwise", C(dt, rnd, 19, False, True)),
            ("quantize_colwise", C(dt, rnd, 100, False, True, grouping="offs")),
            ("quantize_dual", C(dt, rnd, 2048, True, True, col_aligned=True)),
            ("quantize_dual", C(dt, rnd, 160, True, True)),
            ("quantize_dual", C(dt, rnd, 4096, True, True, grouping="offs")),
        ]
        for axis_rows, br in itertools.product((True, False), (1, 32)):
            variants.append(("quantize_weights", C(
                dt, rnd, 2048, axis_rows, not axis_rows, grouping="uniform", group_rows=1536,
                col_layout="experts", block_rows=br, col_aligned=True)))
        variants.append(("quantize_weights", C(  # axis N with K = 19 (the non-reduced extent)
            dt, rnd, 19, False, True, grouping="uniform", group_rows=64, col_layout="experts",
            col_aligned=True)))
        for op, cfg in variants:
            Q.compile_quantizer(op, cfg)
            n += 1
    print("compiled", n)
    """
)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_all_variants(arch):
    env = dict(os.environ, CUTE_DSL_ARCH=arch)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "compiled 90" in res.stdout


SASS_SCRIPT = textwrap.dedent(
    """
    import glob, os, shutil, sys
    from moe_mxfp8.kernels import quantize as Q
    C = Q.QuantConfig
    out = sys.argv[1]
    for name, cfg in [("odd_k", C("bfloat16", "rceil", 19, False, True)),
                      ("vec_k", C("bfloat16", "rceil", 96, False, True))]:
        Q.compile_quantizer("quantize_colwise", cfg)
        os.makedirs(os.path.join(out, name))
        for f in glob.glob(os.path.join(out, "*.cubin")):
            shutil.move(f, os.path.join(out, name))
    """
)


def test_element_loads_only_where_rows_are_unaligned(tmp_path):
    """A columnwise K = 19 (rows 38 bytes apart) loads 16-bit elements; K = 96 keeps the 16-byte
    vector loads. The vector count per thread is the same (8), so 64 element loads."""
    import shutil

    nvdisasm = shutil.which("nvdisasm")
    if nvdisasm is None:
        import glob

        try:
            import nvidia
        except ImportError:
            pytest.skip("nvdisasm not found")
        hits = [h for r in nvidia.__path__ for h in glob.glob(f"{r}/*/bin/nvdisasm")]
        if not hits:
            pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
        nvdisasm = hits[0]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path),
               CUTE_DSL_KEEP="cubin")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", SASS_SCRIPT, str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    sass = {}
    for name in ("odd_k", "vec_k"):
        (cubin,) = (tmp_path / name).glob("*.cubin")
        sass[name] = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True,
                                    text=True, check=True).stdout
    vec = re.compile(r"LDG\.E(\.NA)?\.128")
    assert sass["odd_k"].count("LDG.E.U16") == 64 and not vec.search(sass["odd_k"])
    assert "LDG.E.U16" not in sass["vec_k"] and len(vec.findall(sass["vec_k"])) == 8


def test_can_implement_explains_refusals():
    from moe_mxfp8.kernels import quantize as Q

    bad = Q.RowwiseQuantizer(Q.QuantConfig("bfloat16", "rceil", 48, True, False))
    assert "multiple of 32" in bad.can_implement()
    bad = Q.WeightQuantizer(Q.QuantConfig("bfloat16", "rceil", 64, False, True,
                                          grouping="uniform", group_rows=40,
                                          col_layout="experts"))
    assert "N % 32" in bad.can_implement()
    ok = Q.DualQuantizer(Q.QuantConfig("float32", "floor", 64, True, True, grouping="offs"))
    assert ok.can_implement() is None
    # K is not reduced by the columnwise output: any K >= 1, element loads when K % 8 != 0
    for k, vec in ((19, False), (40, True), (100, False)):
        col = Q.ColwiseQuantizer(Q.QuantConfig("bfloat16", "rceil", k, False, True))
        assert col.can_implement() is None and col.vec_loads == vec
    assert Q.ColwiseQuantizer(Q.QuantConfig("float32", "rceil", 100, False, True)).vec_loads


# ---------------------------------------------------------------------------------------------
# GPU: bit-exact vs the reference
# ---------------------------------------------------------------------------------------------


def _poisoned(shape, dtype, device):
    return torch.full(shape, POISON, dtype=torch.uint8, device=device).view(dtype)


def _per_element_scales(t) -> torch.Tensor:
    """Scale byte of every element of ``t.data`` (from the reference's own unpacking)."""
    dense = t.dense_scales()
    if t.group_axis == "k":
        _, block_id, _ = L.grouped_k_block_index(t.offs, t.data.shape[-1])
        return dense[:, block_id]
    return dense.repeat_interleave(L.BLOCK_SIZE, dim=-1)[..., : t.data.shape[-1]]


def assert_bit_exact(got, ref, what=""):
    assert got.data.shape == ref.data.shape, what
    assert got.scale.shape == ref.scale.shape, (what, got.scale.shape, ref.scale.shape)
    assert got.group_axis == ref.group_axis and got.block_rows == ref.block_rows, what
    gs, rs = got.scale.view(torch.uint8), ref.scale.view(torch.uint8)
    if not torch.equal(gs, rs):
        bad = (gs != rs).nonzero().flatten()
        raise AssertionError(f"{what}: {bad.numel()} scale bytes differ, first at {bad[:8]}: "
                             f"got {gs[bad[:8]].tolist()} want {rs[bad[:8]].tolist()}")
    finite = _per_element_scales(ref) != R.E8M0_NAN
    gd = got.data.view(torch.uint8)[finite]
    rd = ref.data.view(torch.uint8)[finite]
    if not torch.equal(gd, rd):
        bad = (gd != rd).nonzero().flatten()
        raise AssertionError(f"{what}: {bad.numel()} data bytes differ: got {gd[bad[:8]].tolist()}"
                             f" want {rd[bad[:8]].tolist()}")


def _ulp_up(v: torch.Tensor) -> torch.Tensor:
    """Next representable value away from zero, in v's dtype."""
    ity = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return (v.view(ity[v.dtype]) + 1).view(v.dtype)


def make_input(m, k, dtype, kind, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device)
    # Per-row and per-column magnitudes over many octaves (scales far from 0x7F).
    x = x * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g, device=device).float())
    x = x * torch.exp2(torch.randint(-6, 6, (1, k), generator=g, device=device).float())
    x = x.to(dtype)
    if kind == "random" or x.numel() == 0:
        return x
    info = torch.finfo(dtype)
    pw = torch.randint(-10, 8, (1,), generator=g, device=device).item()
    edge = torch.tensor(448.0 * 2.0**pw, dtype=dtype, device=device)
    specials = torch.stack([
        torch.tensor(0.0, dtype=dtype, device=device),
        torch.tensor(-0.0, dtype=dtype, device=device),
        edge, -edge, _ulp_up(edge), -_ulp_up(edge),
        torch.tensor(info.max, dtype=dtype, device=device),
        torch.tensor(-info.max, dtype=dtype, device=device),
        torch.tensor(info.smallest_normal, dtype=dtype, device=device) / 4,  # subnormal
        -torch.tensor(info.smallest_normal, dtype=dtype, device=device) / 8,
        torch.tensor(2.0**-12, dtype=dtype, device=device) * 1.5,
        torch.tensor(float("nan"), dtype=dtype, device=device),
        torch.tensor(float("inf"), dtype=dtype, device=device),
        torch.tensor(float("-inf"), dtype=dtype, device=device),
    ])
    flat = x.view(-1)
    n = flat.numel()
    # Sprinkle specials (a few per thousand elements, NaN/Inf rarer) ...
    idx = torch.randint(0, n, (max(1, n // 200),), generator=g, device=device)
    which = torch.randint(0, len(specials) - 3, idx.shape, generator=g, device=device)
    flat[idx] = specials[which]
    idx = torch.randint(0, n, (max(1, n // 3000),), generator=g, device=device)
    which = torch.randint(len(specials) - 3, len(specials), idx.shape, generator=g, device=device)
    flat[idx] = specials[which]
    # ... and whole regions: zero rows/columns, tiny (subnormal-only) and huge rows.
    if m > 3:
        x[1] = 0
        x[2] = specials[8]
        x[3] = specials[6]
    if k > 40:
        x[:, 33] = 0
    return x


def offs_from_sizes(sizes, device="cuda"):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


ACT_SHAPES = [(1, 32), (127, 96), (129, 160), (256, 2080), (272, 64), (1000, 256)]
GROUP_SIZES = [
    [1],
    [0, 5, 130, 0, 33, 1],
    [127, 129, 0, 0, 256, 31, 3],
    [300, 0],
    [0, 0, 0],
]


def _kernels():
    from moe_mxfp8.kernels import quantize as Q

    return Q


def _row_out(m, k, offs, dev):
    nb = k // 32
    g = 1 if offs is None else offs.numel()
    nbytes = L.packed_scale_bytes(m, nb) if offs is None else L.grouped_rows_scale_bytes(m, nb, g)
    return {"q_row": _poisoned((m, k), torch.float8_e4m3fn, dev),
            "s_row": _poisoned((nbytes,), torch.uint8, dev)}


def _col_out(m, k, offs, dev):
    g = 1 if offs is None else offs.numel()
    nbytes = (L.packed_scale_bytes(k, L.ceil_div(m, 32)) if offs is None
              else L.grouped_k_scale_bytes(k, m, g))
    return {"q_col": _poisoned((k, m), torch.float8_e4m3fn, dev),
            "s_col": _poisoned((nbytes,), torch.uint8, dev)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", ["random", "adversarial"])
@pytest.mark.parametrize("m,k", ACT_SHAPES)
def test_activation_modes_bit_exact(dtype, rounding, kind, m, k):
    Q = _kernels()
    x = make_input(m, k, dtype, kind, seed=m * 7 + k)
    out = _row_out(m, k, None, x.device)
    got = Q.quantize_rowwise(x, rounding=rounding, out=out)
    assert_bit_exact(got, R.quantize_rowwise_ref(x, rounding), "rowwise")
    out = _col_out(m, k, None, x.device)
    got = Q.quantize_colwise(x, rounding=rounding, out=out)
    assert_bit_exact(got, R.quantize_colwise_ref(x, rounding), "colwise")
    out = {**_row_out(m, k, None, x.device), **_col_out(m, k, None, x.device)}
    row, col = Q.quantize_dual(x, rounding=rounding, out=out)
    assert_bit_exact(row, R.quantize_rowwise_ref(x, rounding), "dual/row")
    assert_bit_exact(col, R.quantize_colwise_ref(x, rounding), "dual/col")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("k", [64, 416])
def test_grouped_bit_exact(dtype, rounding, sizes, k):
    Q = _kernels()
    m = sum(sizes)
    offs = offs_from_sizes(sizes)
    for kind in ("random", "adversarial"):
        x = make_input(m, k, dtype, kind, seed=m + k + len(sizes))
        got = Q.quantize_rowwise(x, rounding=rounding, offs=offs, out=_row_out(m, k, offs, "cuda"))
        assert_bit_exact(got, R.quantize_rowwise_ref(x, rounding, offs=offs), "rowwise/offs")
        got = Q.quantize_colwise(x, rounding=rounding, offs=offs, out=_col_out(m, k, offs, "cuda"))
        assert_bit_exact(got, R.quantize_colwise_ref(x, rounding, offs=offs), "colwise/offs")
        out = {**_row_out(m, k, offs, "cuda"), **_col_out(m, k, offs, "cuda")}
        row, col = Q.quantize_dual(x, rounding=rounding, offs=offs, out=out)
        assert_bit_exact(row, R.quantize_rowwise_ref(x, rounding, offs=offs), "dual/row/offs")
        assert_bit_exact(col, R.quantize_colwise_ref(x, rounding, offs=offs), "dual/col/offs")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("e,n,k", [(1, 96, 64), (3, 160, 96), (128, 64, 32), (2, 256, 2080)])
@pytest.mark.parametrize("axis", ["K", "N"])
@pytest.mark.parametrize("block_rows", [1, 32])
def test_weights_bit_exact(dtype, rounding, e, n, k, axis, block_rows):
    Q = _kernels()
    for kind in ("random", "adversarial"):
        w = make_input(e * n, k, dtype, kind, seed=e + n + k).view(e, n, k)
        shape = (e, n, k) if axis == "K" else (e, k, n)
        rows, nb = (n, k // 32) if axis == "K" else (k, n // 32)
        out = {"q": _poisoned(shape, torch.float8_e4m3fn, "cuda"),
               "s": _poisoned((e * L.expert_scale_stride(rows, nb),), torch.uint8, "cuda")}
        got = Q.quantize_weights(w, axis=axis, rounding=rounding, block_rows=block_rows, out=out)
        ref = R.quantize_weights_ref(w, axis, rounding, block_rows=block_rows)
        assert_bit_exact(got, ref, f"weights axis={axis} br={block_rows}")


@pytest.mark.gpu
@gpu
def test_public_api_dispatch_and_no_sync():
    """moe_mxfp8.quantize reaches the kernels; the grouped path runs under CUDA-graph capture
    (which fails on any host synchronisation)."""
    from moe_mxfp8 import quantize as P

    x = make_input(300, 256, torch.bfloat16, "random")
    offs = offs_from_sizes([100, 0, 200])
    row, col = P.quantize_dual(x, offs=offs)
    assert_bit_exact(row, R.quantize_rowwise_ref(x, offs=offs), "api/row")
    assert_bit_exact(col, R.quantize_colwise_ref(x, offs=offs), "api/col")
    Q = _kernels()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        Q.quantize_dual(x, offs=offs)  # warm (compile) outside capture
        with torch.cuda.graph(graph, stream=s):
            r2, c2 = Q.quantize_dual(x, offs=offs)
    graph.replay()
    torch.cuda.synchronize()
    assert_bit_exact(r2, row, "graph/row")
    assert_bit_exact(c2, col, "graph/col")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,k", [(524288, 4128), (2**26 + 64, 32)])
def test_more_than_2_31_elements(m, k):
    """Element offsets are 64-bit: 524288 tokens (a DeepSeek-V3-sized step) x 4128 features, and
    2^26 + 64 tokens x 32 (524289 token tiles: more than a grid's y dimension holds). Compared
    with the reference in chunks (~16M elements) that map to contiguous packed-scale ranges."""
    Q = _kernels()
    assert m * k >= 2**31
    need = m * k * 4 + (1 << 30)  # bf16 input, two e4m3 outputs, chunk temporaries
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    x[-1] *= 2.0**20  # the last row and column differ in magnitude from the rest
    x[:, -1] *= 2.0**-20
    row, col = Q.quantize_dual(x)
    u8 = torch.uint8
    step = 128 * max(1, 2**24 // (128 * k))  # rows per chunk, a multiple of the 128-row tile
    row_tile_bytes = 128 * L.round_up(k // 32, 4)
    for r0 in range(0, m, step):
        ref = R.quantize_rowwise_ref(x[r0:r0 + step])
        s0 = r0 // 128 * row_tile_bytes
        assert torch.equal(row.data[r0:r0 + step].view(u8), ref.data.view(u8)), r0
        assert torch.equal(row.scale[s0:s0 + ref.scale.numel()], ref.scale), r0
    if k <= 128:  # one feature tile: chunks of tokens are contiguous 4-block scale columns
        for r0 in range(0, m, step):
            ref = R.quantize_colwise_ref(x[r0:r0 + step])
            s0 = r0 // 128 * L.TILE_BYTES
            assert torch.equal(col.data[:, r0:r0 + step].view(u8), ref.data.view(u8)), r0
            assert torch.equal(col.scale[s0:s0 + ref.scale.numel()], ref.scale), r0
    else:  # chunks of 128 features: one row tile of the packed (K, M/32) scale matrix each
        feat_tile_bytes = 128 * L.round_up(L.ceil_div(m, 32), 4)
        for f0 in range(0, k, 128):
            ref = R.quantize_colwise_ref(x[:, f0:f0 + 128])
            s0 = f0 // 128 * feat_tile_bytes
            assert torch.equal(col.data[f0:f0 + 128].view(u8), ref.data.view(u8)), f0
            assert torch.equal(col.scale[s0:s0 + ref.scale.numel()], ref.scale), f0
