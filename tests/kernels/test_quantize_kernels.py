"""MXFP8 quantizer kernels (kernels/quantize.py; entry points in kernels/quantize_launch.py).

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
from moe_mxfp8.mx_tensor import MXFP8Tensor

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
    from moe_mxfp8.kernels import quantize_launch as Q
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
            # the 1x128 recipe: 128-element blocks along K (rows) and along tokens (columns)
            ("quantize_rowwise", C(dt, rnd, 7168, True, False, act_block=128)),
            ("quantize_rowwise", C(dt, rnd, 2080, True, False, grouping="offs", act_block=128)),
            ("quantize_colwise", C(dt, rnd, 2048, False, True, col_aligned=True, act_block=128)),
            ("quantize_colwise", C(dt, rnd, 100, False, True, grouping="offs", act_block=128)),
            ("quantize_dual", C(dt, rnd, 160, True, True, act_block=128)),
            ("quantize_dual", C(dt, rnd, 4096, True, True, grouping="offs", act_block=128)),
        ]
        for axis_rows, br in itertools.product((True, False), (1, 32, 128)):
            variants.append(("quantize_weights", C(
                dt, rnd, 2048, axis_rows, not axis_rows, grouping="uniform", group_rows=1536,
                col_layout="experts", block_rows=br, col_aligned=True)))
        for br in (1, 128):  # axis N with K = 19 (the non-reduced extent)
            variants.append(("quantize_weights", C(
                dt, rnd, 19, False, True, grouping="uniform", group_rows=64,
                col_layout="experts", block_rows=br, col_aligned=True)))
        variants.append(("quantize_weights", C(  # 128x128 tiles along K, N = 100 (partial)
            dt, rnd, 96, True, False, grouping="uniform", group_rows=100, col_layout="experts",
            block_rows=128)))
        if dt == "bfloat16":  # both axes from one read (the layer's weights, BF16)
            for br in (1, 32, 128):
                variants.append(("quantize_weights", C(
                    dt, rnd, 2048, True, True, grouping="uniform", group_rows=1536,
                    col_layout="experts", block_rows=br, col_aligned=True)))
        if (dt, rnd) == ("bfloat16", "rceil"):  # the data path's SwiGLU on the tile
            for ab, (src, k), grouped in itertools.product(
                    (32, 128), (("swiglu", 2048), ("swiglu", 96), ("swiglu_grad", 4096),
                                ("swiglu_grad", 192)), (True, False)):
                op = "quantize_" + src
                variants.append((op, C(dt, rnd, k, True, True, act_block=ab, source=src,
                                       grouping="offs" if grouped else "none",
                                       col_aligned=not grouped)))
            variants.append(("quantize_swiglu_grad", C(dt, rnd, 4096, True, False,
                                                       grouping="offs", source="swiglu_grad",
                                                       act_block=128, load_batch=2,
                                                       ctas_per_sm=3)))
            variants.append(("quantize_swiglu", C(dt, rnd, 2048, False, True, grouping="offs",
                                                  source="swiglu", ctas_per_sm=3)))
            for ab in (32, 128):  # dh with joint gate/up tiles (the shipped backward)
                variants.append(("quantize_swiglu_grad", C(
                    dt, rnd, 4096, True, True, act_block=ab, grouping="offs", col_aligned=True,
                    source="swiglu_grad", load_batch=2, joint_halves=True)))
            for ab in (32, 128):  # the dispatch and the combine's backward
                variants.append(("quantize_gather", C(dt, rnd, 7168, True, True, act_block=ab,
                                                      grouping="offs", col_aligned=True,
                                                      source="gather", top_k=2)))
                variants.append(("quantize_combine_grad", C(
                    dt, rnd, 160, True, True, act_block=ab, grouping="offs",
                    source="combine_grad", top_k=3, with_part=True)))
            # the shipped tunings (loads a batch ahead, unpredicated SwiGLU rows, rows guessed
            # for 1x128 with aligned groups) as the launcher builds them
            for (src, k, top_k), ab in itertools.product(
                    (("swiglu", 2048, 1), ("swiglu_grad", 4096, 1), ("gather", 7168, 2),
                     ("combine_grad", 160, 3)), (32, 128)):
                variants.append(("quantize_" + src, Q._activation_config(
                    dt, rnd, k, True, True, True, True, ab, src, top_k, src == "combine_grad",
                    Q._source_tuning(src, ab, True))))
            # the forward stages' columnwise copies in 128 x 128 tiles (the 1x128 layer's)
            for src, k, top_k in (("swiglu", 2048, 1), ("gather", 7168, 2)):
                variants.append(("quantize_" + src, Q._activation_config(
                    dt, rnd, k, True, True, True, True, 128, src, top_k, False,
                    Q._source_tuning(src, 128, True), True)))
            variants.append(("quantize_colwise", C(dt, rnd, 100, False, True, grouping="offs",
                                                   act_block=128, col_tile=True)))
            variants.append(("quantize_dual", C(dt, rnd, 160, True, True, act_block=128,
                                                col_tile=True)))
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
    assert "compiled 192" in res.stdout


SASS_SCRIPT = textwrap.dedent(
    """
    import glob, os, shutil, sys
    from moe_mxfp8.kernels import quantize_launch as Q
    C = Q.QuantConfig
    out = sys.argv[1]
    for name, op, cfg in [
        ("odd_k", "quantize_colwise", C("bfloat16", "rceil", 19, False, True)),
        ("vec_k", "quantize_colwise", C("bfloat16", "rceil", 96, False, True)),
        ("row32", "quantize_rowwise", C("bfloat16", "rceil", 7168, True, False)),
        ("row128", "quantize_rowwise", C("bfloat16", "rceil", 7168, True, False, act_block=128)),
        ("col32", "quantize_colwise", C("bfloat16", "rceil", 2048, False, True,
                                        grouping="offs")),
        ("col128", "quantize_colwise", C("bfloat16", "rceil", 2048, False, True,
                                         grouping="offs", act_block=128)),
        ("col128t", "quantize_colwise", C("bfloat16", "rceil", 2048, False, True,
                                          grouping="offs", act_block=128, col_tile=True)),
    ]:
        Q.compile_quantizer(op, cfg)
        os.makedirs(os.path.join(out, name))
        for f in glob.glob(os.path.join(out, "*.cubin")):
            shutil.move(f, os.path.join(out, name))
    """
)
SASS_NAMES = ("odd_k", "vec_k", "row32", "row128", "col32", "col128", "col128t")


def _nvdisasm():
    import glob
    import shutil

    exe = shutil.which("nvdisasm")
    if exe is None:
        try:
            import nvidia
        except ImportError:
            return None
        hits = [h for r in nvidia.__path__ for h in glob.glob(f"{r}/*/bin/nvdisasm")]
        exe = hits[0] if hits else None
    return exe


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    """SASS (sm_90a) of a few quantizer variants, by name."""
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    tmp_path = tmp_path_factory.mktemp("quant_sass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path),
               CUTE_DSL_KEEP="cubin")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", SASS_SCRIPT, str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = {}
    for name in SASS_NAMES:
        (cubin,) = (tmp_path / name).glob("*.cubin")
        out[name] = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
    return out


def test_element_loads_only_where_rows_are_unaligned(sass):
    """A columnwise K = 19 (rows 38 bytes apart) loads 16-bit elements; K = 96 keeps the 16-byte
    vector loads. The vector count per thread is the same (8), so 64 element loads."""
    vec = re.compile(r"LDG\.E(\.NA)?\.128")
    assert sass["odd_k"].count("LDG.E.U16") == 64 and not vec.search(sass["odd_k"])
    assert "LDG.E.U16" not in sass["vec_k"] and len(vec.findall(sass["vec_k"])) == 8


def test_1x128_instruction_mix(sass):
    """1x128 rowwise (bf16): the row amax's butterfly spans 16 lanes instead of 4 (4 steps
    instead of 2 for each of the 8 vectors), and one 32-bit store writes a row's four scale
    bytes instead of four byte stores; the same 32 E4M3 conversions. 1x128 columnwise: one more
    CTA barrier (the four 32-token amaxes of a feature meet in shared memory); in 128 x 128
    tiles (``col_tile``) a warp butterfly (5 steps) before that barrier instead (the warps'
    maxima meet there), and the same stores."""
    def count(name, op):  # instructions with exactly this opcode (modifiers included)
        return len(re.findall(rf"{re.escape(op)}(?=\s)", sass[name]))

    assert count("row32", "SHFL.BFLY") == 16 and count("row128", "SHFL.BFLY") == 32
    assert count("row32", "STG.E.U8") == 8 and count("row128", "STG.E.U8") == 0
    assert count("row128", "STG.E") == 8
    cvt = "F2FP.SATFINITE.E4M3"
    assert sass["row32"].count(cvt) == sass["row128"].count(cvt) == 32
    assert sass["col128"].count("BAR.SYNC") == sass["col32"].count("BAR.SYNC") + 1
    assert sass["col128t"].count("BAR.SYNC") == sass["col128"].count("BAR.SYNC")
    assert count("col128t", "SHFL.BFLY") == count("col128", "SHFL.BFLY") + 5
    assert sass["col128t"].count("STG.E") == sass["col128"].count("STG.E")


def test_source_tuning_guesses_rows_only_where_groups_start_on_tiles():
    """The computed sources' shipped tunings: rows are guessed only for 1x128 blocks with
    aligned groups (the 1x128 layer's layout, where the guess holds); an explicit tuning wins;
    unknown fields are refused."""
    from moe_mxfp8.kernels import quantize_launch as QL

    def fields(*args, **kw):
        return dict(QL._source_tuning(*args, **kw))

    for src in ("swiglu_grad", "gather", "combine_grad"):
        assert fields(src, 128, True)["speculate_rows"]
        assert not fields(src, 32, True)["speculate_rows"]
        assert not fields(src, 128, False)["speculate_rows"]
    assert not fields("swiglu", 128, True)["speculate_rows"]  # no faster there (measured)
    assert fields("gather", 32, False, {"speculate_rows": True})["speculate_rows"]
    assert fields("x", 128, True) == {"load_batch": 4, "ctas_per_sm": 0,
                                      "speculate_rows": False}
    with pytest.raises(ValueError, match="tuning may only set"):
        QL._source_tuning("swiglu", 128, True, {"load_depth": 2})
    cfg = QL._activation_config("bfloat16", "rceil", 256, True, True, False, False, 128,
                                "gather", 2, False, QL._source_tuning("gather", 128, True))
    assert not cfg.speculate_rows, "ungrouped rows have nothing to guess"


def test_can_implement_explains_refusals():
    from moe_mxfp8.kernels import quantize as Q

    C = Q.QuantConfig
    bad = Q.SwigluQuantizer(C("bfloat16", "rceil", 256, True, True, source="swiglu",
                              load_batch=2, load_ahead=4))
    assert "load_ahead 4 must be below the 4 batches" in bad.can_implement()
    bad = Q.GatherQuantizer(C("bfloat16", "rceil", 256, True, True, source="gather",
                              unpredicated=True))
    assert "SwiGLU sources" in bad.can_implement()
    bad = Q.GatherQuantizer(C("bfloat16", "rceil", 256, True, True, source="gather",
                              speculate_rows=True))
    assert "grouping 'offs'" in bad.can_implement()

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
    # the 1x128 recipe: activation blocks of 32 or 128; 128x128 tiles only for weights
    bad = Q.RowwiseQuantizer(Q.QuantConfig("bfloat16", "rceil", 256, True, False, act_block=64))
    assert "activation block 64" in bad.can_implement()
    bad = Q.RowwiseQuantizer(Q.QuantConfig("bfloat16", "rceil", 256, True, False,
                                           block_rows=128))
    assert "expert weights" in bad.can_implement()
    bad = Q.WeightQuantizer(Q.QuantConfig("bfloat16", "rceil", 256, True, False,
                                          grouping="uniform", group_rows=64,
                                          col_layout="experts", act_block=128))
    assert "block_rows" in bad.can_implement()
    # 128x128 tiles along K take any N (partial tiles); along N, any K
    for rows, k, n in ((True, 96, 100), (False, 19, 64)):
        ok = Q.WeightQuantizer(Q.QuantConfig("float32", "rceil", k, rows, not rows,
                                             grouping="uniform", group_rows=n,
                                             col_layout="experts", block_rows=128))
        assert ok.can_implement() is None
    # the computed sources: each refusal names its source or knob
    C = Q.QuantConfig
    bad = Q.GatherQuantizer(C("float32", "rceil", 256, True, True, grouping="offs",
                              source="gather"))
    assert "'gather' source takes BF16" in bad.can_implement()
    bad = Q.CombineGradQuantizer(C("bfloat16", "rceil", 100, False, True, grouping="offs",
                                   source="combine_grad"))  # columnwise only: any K, not here
    assert "'combine_grad' source needs a multiple of 32" in bad.can_implement()
    bad = Q.GatherQuantizer(C("bfloat16", "rceil", 256, True, True, grouping="offs",
                              source="gather", top_k=0))
    assert "top_k" in bad.can_implement()
    bad = Q.GatherQuantizer(C("bfloat16", "rceil", 256, True, True, grouping="offs",
                              source="gather", with_part=True))
    assert "with_part" in bad.can_implement()
    ok = Q.CombineGradQuantizer(C("bfloat16", "rceil", 256, True, True, grouping="offs",
                                  source="combine_grad", top_k=8, with_part=True))
    assert ok.can_implement() is None


def test_kernel_modules_do_not_import_the_api():
    """kernels/ sits below moe_mxfp8/: the quantizer kernels take their format facts from
    kernels/mx_format.py, never from moe_mxfp8.* (no upward import, no cycle)."""
    import ast

    for name in ("quantize.py", "ptx.py", "mx_format.py"):
        tree = ast.parse((ROOT / "kernels" / name).read_text())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            level = getattr(node, "level", 0)
            for mod in mods:
                assert not mod.startswith("moe_mxfp8") and not (level > 1), (name, mod)


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
    from moe_mxfp8.kernels import quantize_launch as Q

    return Q


def _row(data_scale, offs=None) -> MXFP8Tensor:
    """A rowwise kernel result as the API wraps it."""
    return MXFP8Tensor(*data_scale, "packed", offs, "rows" if offs is not None else None)


def _col(data_scale, offs=None) -> MXFP8Tensor:
    return MXFP8Tensor(*data_scale, "packed", offs, "k" if offs is not None else None)


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


# scale_blocks recipe -> the kernels' activation block length (docs/numerics.md)
RECIPES = {"1x32": 32, "1x128": 128}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", ["random", "adversarial"])
@pytest.mark.parametrize("m,k", ACT_SHAPES)
def test_activation_modes_bit_exact(dtype, rounding, kind, m, k, recipe):
    Q = _kernels()
    blk = RECIPES[recipe]
    x = make_input(m, k, dtype, kind, seed=m * 7 + k)
    want_row = R.quantize_rowwise_ref(x, rounding, scale_blocks=recipe)
    want_col = R.quantize_colwise_ref(x, rounding, scale_blocks=recipe)
    out = _row_out(m, k, None, x.device)
    got = Q.quantize_rowwise(x, rounding=rounding, act_block=blk, out=out)
    assert_bit_exact(_row(got), want_row, "rowwise")
    out = _col_out(m, k, None, x.device)
    got = Q.quantize_colwise(x, rounding=rounding, act_block=blk, out=out)
    assert_bit_exact(_col(got), want_col, "colwise")
    out = {**_row_out(m, k, None, x.device), **_col_out(m, k, None, x.device)}
    row, col = Q.quantize_dual(x, rounding=rounding, act_block=blk, out=out)
    assert_bit_exact(_row(row), want_row, "dual/row")
    assert_bit_exact(_col(col), want_col, "dual/col")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("k", [64, 416])
def test_grouped_bit_exact(dtype, rounding, sizes, k, recipe):
    Q = _kernels()
    blk = RECIPES[recipe]
    m = sum(sizes)
    offs = offs_from_sizes(sizes)
    for kind in ("random", "adversarial"):
        x = make_input(m, k, dtype, kind, seed=m + k + len(sizes))
        want_row = R.quantize_rowwise_ref(x, rounding, offs=offs, scale_blocks=recipe)
        want_col = R.quantize_colwise_ref(x, rounding, offs=offs, scale_blocks=recipe)
        got = Q.quantize_rowwise(x, rounding=rounding, offs=offs, act_block=blk,
                                 out=_row_out(m, k, offs, "cuda"))
        assert_bit_exact(_row(got, offs), want_row, "rowwise/offs")
        got = Q.quantize_colwise(x, rounding=rounding, offs=offs, act_block=blk,
                                 out=_col_out(m, k, offs, "cuda"))
        assert_bit_exact(_col(got, offs), want_col, "colwise/offs")
        out = {**_row_out(m, k, offs, "cuda"), **_col_out(m, k, offs, "cuda")}
        row, col = Q.quantize_dual(x, rounding=rounding, offs=offs, act_block=blk, out=out)
        assert_bit_exact(_row(row, offs), want_row, "dual/row/offs")
        assert_bit_exact(_col(col, offs), want_col, "dual/col/offs")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("e,n,k", [(1, 96, 64), (3, 160, 96), (128, 64, 32), (2, 256, 2080)])
@pytest.mark.parametrize("axis", ["K", "N"])
@pytest.mark.parametrize("block_rows", [1, 32, 128], ids=lambda b: f"br{b}")
def test_weights_bit_exact(dtype, rounding, e, n, k, axis, block_rows):
    Q = _kernels()
    for kind in ("random", "adversarial"):
        w = make_input(e * n, k, dtype, kind, seed=e + n + k).view(e, n, k)
        shape = (e, n, k) if axis == "K" else (e, k, n)
        rows, nb = (n, k // 32) if axis == "K" else (k, n // 32)
        out = {"q": _poisoned(shape, torch.float8_e4m3fn, "cuda"),
               "s": _poisoned((e * L.expert_scale_stride(rows, nb),), torch.uint8, "cuda")}
        q, s = Q.quantize_weights(w, axis=axis, rounding=rounding, block_rows=block_rows, out=out)
        got = MXFP8Tensor(q, s, "packed", None, "experts", block_rows)
        ref = R.quantize_weights_ref(w, axis, rounding, block_rows=block_rows)
        assert_bit_exact(got, ref, f"weights axis={axis} br={block_rows}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("e,n,k", [(1, 96, 64), (3, 160, 96), (8, 64, 32), (2, 256, 2080)])
@pytest.mark.parametrize("block_rows", [1, 32, 128], ids=lambda b: f"br{b}")
def test_weights_dual_bit_exact(e, n, k, block_rows):
    """Both axes from one read: each output equal to its single-axis reference, every byte of
    every (poisoned) output buffer written."""
    Q = _kernels()
    for dtype, kind in ((torch.bfloat16, "random"), (torch.bfloat16, "adversarial"),
                        (torch.float32, "adversarial")):
        w = make_input(e * n, k, dtype, kind, seed=e + n + k).view(e, n, k)
        out = {"qk": _poisoned((e, n, k), torch.float8_e4m3fn, "cuda"),
               "sk": _poisoned((e * L.expert_scale_stride(n, k // 32),), torch.uint8, "cuda"),
               "qn": _poisoned((e, k, n), torch.float8_e4m3fn, "cuda"),
               "sn": _poisoned((e * L.expert_scale_stride(k, n // 32),), torch.uint8, "cuda")}
        (qk, sk), (qn, sn) = Q.quantize_weights_dual(w, block_rows=block_rows, out=out)
        for axis, q, s in (("K", qk, sk), ("N", qn, sn)):
            got = MXFP8Tensor(q, s, "packed", None, "experts", block_rows)
            ref = R.quantize_weights_ref(w, axis, block_rows=block_rows)
            assert_bit_exact(got, ref, f"dual {dtype} {kind} axis={axis} br={block_rows}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("e,n,k,axis", [(2, 100, 64, "K"), (3, 200, 352, "K"), (2, 96, 19, "N"),
                                        (1, 352, 200, "N"), (0, 128, 64, "K"), (2, 0, 64, "N")])
def test_weights_128x128_partial_tiles(e, n, k, axis):
    """128x128 weight tiles where N or K ends inside a tile (the reduced axis % 32 == 0, the
    other one any), through the public API."""
    from moe_mxfp8 import quantize as P

    for dtype in DTYPES:
        w = make_input(e * n, k, dtype, "adversarial", seed=e + n + k).view(e, n, k)
        got = P.quantize_weights(w, axis=axis, block_rows=128)
        assert_bit_exact(got, R.quantize_weights_ref(w, axis, block_rows=128),
                         f"{dtype} {axis}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_public_api_dispatch_and_no_sync(recipe):
    """moe_mxfp8.quantize reaches the kernels; the grouped path runs under CUDA-graph capture
    (which fails on any host synchronisation)."""
    from moe_mxfp8 import quantize as P

    x = make_input(300, 256, torch.bfloat16, "random")
    offs = offs_from_sizes([100, 0, 200])
    row, col = P.quantize_dual(x, offs=offs, scale_blocks=recipe)
    assert_bit_exact(row, R.quantize_rowwise_ref(x, offs=offs, scale_blocks=recipe), "api/row")
    assert_bit_exact(col, R.quantize_colwise_ref(x, offs=offs, scale_blocks=recipe), "api/col")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        P.quantize_dual(x, offs=offs, scale_blocks=recipe)  # warm (compile) outside capture
        with torch.cuda.graph(graph, stream=s):
            r2, c2 = P.quantize_dual(x, offs=offs, scale_blocks=recipe)
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
    row, col = _row(row), _col(col)
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
