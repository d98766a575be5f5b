"""Hopper grouped MXFP8 GEMM (kernels/grouped_gemm/sm90.py).

CPU: every variant compiles for sm_90a with fake tensors (in a subprocess, since the DSL reads
CUTE_DSL_ARCH), its SASS holds QGMMA and no local memory; argument errors are clear.
GPU (@pytest.mark.gpu): fprop / dgrad / wgrad vs `moe_mxfp8.reference.grouped_mm` on fresh
random data, outputs NaN-poisoned first so that every element must be written.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gemm_cases import (  # noqa: E402  (tests/kernels is on sys.path under pytest)
    GROUPINGS,
    _check,
    _check_wgrad,
    _e128_sizes,
    _offs,
    _sizes,
    _wgrad_operands,
    fprop_case,
)

from moe_mxfp8 import reference as R

ROOT = Path(__file__).resolve().parents[2]
BF16_TOL = 5e-3
FP32_TOL = 1e-3

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs an sm_90 GPU")


# ---------------------------------------------------------------------------------------------
# CPU: compile for sm_90a, inspect SASS
# ---------------------------------------------------------------------------------------------

# (mode, out dtype, scale-block choice, CTAs per cluster, output tile width)
VARIANTS = [("m", "bfloat16", "1x32", 1, 128), ("m", "float32", "1x32", 1, 128),
            ("m", "bfloat16", "32x32", 1, 128), ("k", "bfloat16", "1x32", 1, 128),
            ("k", "float32", "1x32", 1, 128), ("m", "bfloat16", "32x32", 2, 128),
            ("k", "bfloat16", "1x32", 2, 128),
            # the 1x128 recipe: 128x128 weight tiles / 1x128 token blocks, promotion per k=128
            ("m", "bfloat16", "1x128", 1, 128), ("m", "float32", "1x128", 2, 128),
            ("k", "bfloat16", "1x128", 1, 128),
            # 256-column tiles (the 1x128 default for more than 128 output columns)
            ("m", "bfloat16", "1x128", 1, 256), ("m", "float32", "1x128", 1, 256),
            ("k", "bfloat16", "1x128", 2, 256), ("k", "float32", "1x128", 1, 256)]


def _nvdisasm() -> str | None:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia.cu13  # type: ignore

        for base in nvidia.cu13.__path__:
            cand = os.path.join(base, "bin", "nvdisasm")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return None


_COMPILE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm.sm90 import GroupedGemmSm90, GroupedGemmSm90Config
    mode, out_dtype, blocks, cl, tn = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                       int(sys.argv[5]))
    tma_store = len(sys.argv) > 6 and sys.argv[6] == "tma_store"
    cfg = GroupedGemmSm90Config(mode, 256, 512, getattr(torch, out_dtype), blocks, cluster_n=cl,
                                tile_n=tn, tma_store=tma_store)
    launcher.compile_config(GroupedGemmSm90, cfg, options="--keep-cubin")
    print("OK")
""")


def _mm(mode, a, b, offs, out_dtype=torch.bfloat16, **launch):
    """The Hopper kernel through the shared launcher (`kernels.grouped_gemm.launcher`)."""
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm.sm90 import GroupedGemmSm90

    return launcher.grouped_mm(GroupedGemmSm90, mode, a, b, offs, out_dtype, **launch)


def _sm90a_sass(tmp_path, *argv: str) -> str:
    """`_COMPILE_SCRIPT` with ``argv`` compiled for sm_90a in a subprocess, its cubin's SASS
    (the test skips where nvdisasm is not installed)."""
    pytest.importorskip("cutlass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-4000:]
    cubins = glob.glob(str(tmp_path / "*.cubin"))
    assert cubins, "no cubin kept"
    exe = _nvdisasm()
    if exe is None:
        pytest.skip("nvdisasm not installed")
    return subprocess.run([exe, "-c", cubins[0]], capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode,out_dtype,scale_blocks,cluster_n,tile_n", VARIANTS)
def test_compiles_for_sm90a_with_qgmma_and_no_spills(tmp_path, mode, out_dtype, scale_blocks,
                                                     cluster_n, tile_n):
    sass = _sm90a_sass(tmp_path, mode, out_dtype, scale_blocks, str(cluster_n), str(tile_n))
    assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass
    assert "LDL" not in sass and "STL" not in sass, "local-memory spill"
    assert "UTMALDG" in sass
    # a cluster's A tile arrives by multicast (each CTA loads its half for both)
    assert ("MULTICAST" in sass) == (cluster_n > 1)
    if tile_n == 256:
        # per k-tile: 4 wgmmas per column half, each half waited for on its own (one
        # temporary), and the B tile arrives as two TMA boxes
        assert sass.count("QGMMA.64x128x32") == 8
        assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode,cluster_n,tile_n", [("m", 1, 256), ("m", 1, 128),
                                                   ("k", 2, 256), ("k", 2, 128)])
def test_tma_store_epilogue_compiles(tmp_path, mode, cluster_n, tile_n):
    """The TMA-store epilogue (``tma_store``, bf16 output): one TMA store per 64 x 64 box of
    a warpgroup's rows (tile_n / 64 of them), the warpgroup's own named barrier, the bulk
    wait before the buffer is rewritten, no spills. M-grouped keeps the direct stores for
    the rows that cross a group's end; K-grouped has none left in its epilogue."""
    sass = _sm90a_sass(tmp_path, mode, "bfloat16", "1x128", str(cluster_n), str(tile_n),
                       "tma_store")
    assert sass.count("UTMASTG") == tile_n // 64
    assert "LDL" not in sass and "STL" not in sass, "local-memory spill"
    assert re.search(r"BAR\.SYNC\S* R\d+, 0x80", sass), "no warpgroup barrier"
    assert "DEPBAR.LE SB0, 0x0" in sass, "no bulk-store wait"
    # the direct stores of the epilogue: one per column pair per half (M-grouped) or none
    stg = len(re.findall(r"\bSTG\.E", sass))
    assert (stg >= tile_n // 4) == (mode == "m"), stg


@pytest.mark.slow
def test_promotion_instruction_mix(tmp_path):
    """tools/sass_mix.py on the k-loop's SASS: per k-tile per consumer warp, 4 QGMMA and one
    FFMA per accumulator element per k=32 step (64 x 4 = 256) -- in 32x32 mode no FMUL (the
    scale warps precompute the products), in 1x32 mode one FMUL each (the scale product).
    The 1x128 recipe promotes once per k-tile: 64 FFMA (4x fewer), plus 64 FMUL in wgrad
    (row x column scale) unless B comes in 128 x 128 tiles (the layer's wgrad: the scale warps
    write the row x tile products, as M-grouped); the 256-column tiles the same per 128x128x128
    of work, in fewer instructions. More instructions here is a regression of the promotion,
    the kernel's bottleneck."""
    pytest.importorskip("cutlass")
    if _nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    out = tmp_path / "mix.json"
    env = dict(os.environ, PATH=f"{os.path.dirname(_nvdisasm())}{os.pathsep}"
               f"{os.environ.get('PATH', '')}")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "sass_mix.py"), "--configs",
                          "m 1x32,m 32x32,m 1x128,k 1x128,m 1x128 wide,k 1x128 wide,"
                          "k 1x128 tiles,k 1x128 wide tiles", "--json",
                          str(out)], cwd=tmp_path,
                         env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    mix = json.loads(out.read_text())
    for name, ffma, fmul, budget in (("m 1x32", 256, 256, 640), ("m 32x32", 256, 0, 340),
                                     ("m 1x128", 64, 0, 130), ("k 1x128", 64, 64, 200),
                                     # 256-column tiles, per 128x128x128 of work (one half)
                                     ("m 1x128 wide", 64, 0, 110),
                                     ("k 1x128 wide", 64, 64, 190),
                                     ("k 1x128 tiles", 64, 0, 140),
                                     ("k 1x128 wide tiles", 64, 0, 120)):
        r = mix[name]
        assert (r["QGMMA"], r["FFMA"], r["FMUL"]) == (4, ffma, fmul), (name, r)
        assert r["instrs"] <= budget and r["spills"] == 0, (name, r)


# ---------------------------------------------------------------------------------------------
# CPU: clear errors for shapes the kernel cannot run (checked before any compile)
# ---------------------------------------------------------------------------------------------


def _fprop_operands(m, n, k, sizes, block_rows=1, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    assert int(offs[-1]) == m
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(len(sizes), n, k, generator=g) * 0.05).to(device, torch.bfloat16)
    a = R.quantize_rowwise_ref(x, offs=offs)
    b = R.quantize_weights_ref(w, axis="K", block_rows=block_rows)
    return a, b, offs


def test_rejects_n_not_multiple_of_32():
    pytest.importorskip("cutlass")
    from moe_mxfp8.kernels.grouped_gemm import problem as P

    a, b, offs = _fprop_operands(64, 48, 64, [30, 34])
    p = P.describe_m(a, b, offs, torch.bfloat16)
    ok, why = P.can_implement(p, n_multiple=32, k_multiple=32)
    assert not ok and "N = 48" in why and "multiple of 32" in why
    with pytest.raises(ValueError, match="multiple of 32"):
        _mm("m", a, b, offs, torch.bfloat16)


def test_rejects_k_grouped_tokens_not_multiple_of_16():
    pytest.importorskip("cutlass")
    x = torch.randn(40, 64).to(torch.bfloat16)
    dy = torch.randn(40, 32).to(torch.bfloat16)
    offs = torch.tensor([17, 40], dtype=torch.int32)
    a = R.quantize_colwise_ref(dy, offs=offs)
    b = R.quantize_colwise_ref(x, offs=offs)
    # the caller promising aligned groups must also give a 16-byte row stride; without the
    # promise the entry point re-lays the groups out (any M; tested on the GPU)
    with pytest.raises(ValueError, match="M = 40 must be a multiple of 16"):
        _mm("k", a, b, offs, torch.bfloat16, aligned_groups=True)


def test_rejects_ungrouped_a_with_several_experts():
    pytest.importorskip("cutlass")
    from moe_mxfp8.kernels.grouped_gemm import problem as P

    a, b, offs = _fprop_operands(64, 64, 64, [30, 34])
    a_plain = R.quantize_rowwise_ref(a.dequantize(torch.float32))
    with pytest.raises(ValueError, match="group_axis='rows'"):
        P.describe_m(a_plain, b, offs, torch.bfloat16)


def test_cluster_falls_back_when_tiles_do_not_pair():
    """cluster_n=2 needs an even tile count along the fast axis (M-grouped: N, K-grouped: K);
    otherwise the entry point runs the 1-CTA kernel (odd-count shapes stay correct)."""
    pytest.importorskip("cutlass")
    from moe_mxfp8.kernels.grouped_gemm import problem as P
    from moe_mxfp8.kernels.grouped_gemm import sm90

    assert sm90.can_cluster("m", 512, 96, 2) and not sm90.can_cluster("m", 384, 512, 2)
    assert sm90.can_cluster("m", 160, 512, 2)  # 2 n-tiles (the second partial) pair up
    assert sm90.can_cluster("k", 96, 256, 2) and not sm90.can_cluster("k", 512, 288, 2)
    a, b, offs = _fprop_operands(64, 384, 64, [30, 34])
    p = P.describe_m(a, b, offs, torch.bfloat16)
    assert sm90.GroupedGemmSm90.select_config(p, {"cluster_n": 2}).cluster_n == 1
    with pytest.raises(ValueError, match="cluster_n"):
        sm90.GroupedGemmSm90Config("m", 384, 64, cluster_n=4)


def test_tile_bounds():
    from moe_mxfp8.kernels.mx_format import tiles_bound

    for sizes in ([0, 1, 31, 129, 300], [128] * 4, [0, 0, 5], [1000]):
        m = sum(sizes)
        real = sum(-(-s // 128) for s in sizes)
        assert real <= tiles_bound(m, len(sizes), 128)


@pytest.mark.parametrize("mode,rows,cols", [("k", 32, 384), ("k", 64, 256), ("k", 96, 256),
                                             ("k", 160, 288), ("m", 300, 256)])
def test_output_boxes_name_their_own_rows(mode, rows, cols):
    """The TMA-store epilogue's boxes (`GroupedGemmSm90.store_boxes`, run on the host on a
    coordinate tensor of the output's shape): each warpgroup's box ``bx`` starts at its own
    row and column ``64 bx`` of its own group, never at another warpgroup's rows. With
    K-grouped N <= 64 the second warpgroup's boxes once named row 0 (a tile index along a
    mode of one tile; CuTe gives it stride 0) and its zero rows raced the first warpgroup's
    results there (H100, 2026-11-27: a 128-column half of a tile zero now and then)."""
    cutlass = pytest.importorskip("cutlass")
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack
    from moe_mxfp8.kernels.grouped_gemm import sm90

    groups = 3
    kern = sm90.GroupedGemmSm90(sm90.GroupedGemmSm90Config(
        mode, rows if mode == "k" else cols, cols if mode == "k" else 128,
        scale_blocks="1x128", tile_n=256))
    # every (row tile, warpgroup) of every group: rows 128 t + 64 w, for t up to one tile past
    # the last (whole tiles past the end are not walked, but their rows must not alias)
    starts = [(g, 64 * s) for g in range(groups) for s in range(2 * (-(-rows // 128)))]
    got = torch.full((len(starts), 4, 3), -1, dtype=torch.int32)
    shape = (rows, cols, groups) if mode == "k" else (rows, cols)

    @cute.jit
    def run(out):  # a cute.Tensor (annotation strings resolve in module globals)
        coords = cute.make_identity_tensor(shape)
        for i in cutlass.range_constexpr(len(starts)):
            g, row = starts[i]
            boxes = kern.store_boxes(coords, cutlass.Int32(row), cutlass.Int32(g))
            for bx in cutlass.range_constexpr(4):
                c = boxes[(0, 0, bx)]
                for j in cutlass.range_constexpr(len(shape)):
                    out[i, bx, j] = cutlass.Int32(c[j])

    cute.compile(run, from_dlpack(got))(from_dlpack(got))
    for i, (g, row) in enumerate(starts):
        for bx in range(4):
            want = [row, 64 * bx, g][: len(shape)]
            assert got[i, bx, : len(shape)].tolist() == want, (g, row, bx)


@pytest.mark.parametrize("mode,n,k,tile_n", [("m", 96, 256, 256), ("m", 160, 384, 256),
                                             ("m", 384, 256, 128), ("k", 64, 128, 256),
                                             ("k", 96, 384, 256), ("k", 160, 256, 128)])
def test_operand_tiles_start_where_they_should(mode, n, k, tile_n):
    """The TMA tiles the producer loads (`GroupedGemmSm90.operand_tiles`, run on the host on
    coordinate tensors of the kernel's views, `GroupedGemmBase.views`): A's k-tile ``kt``
    starts at its own token row / output row and column ``128 kt``, B's column half ``h`` at
    row ``128 (halves * bidx + h)`` of its own expert, also where that lies past the end
    (B rows 0..127 again would be a silent reload; past the end the TMA unit loads zeros)."""
    cutlass = pytest.importorskip("cutlass")
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack
    from moe_mxfp8.kernels.grouped_gemm import sm90

    kern = sm90.GroupedGemmSm90(sm90.GroupedGemmSm90Config(
        mode, n, k, scale_blocks="1x128", tile_n=tile_n))
    halves, m, groups = tile_n // 128, 1024, 3
    # (row0, bidx, bidy, grp): token row starts, x tiles (some past the end), y tiles
    x_tiles = -(-(n if mode == "m" else k) // tile_n) + 1
    units = [(r, bx, by, g) for r in (0, 256) for bx in range(x_tiles)
             for by in ((0,) if mode == "m" else range(-(-n // 128))) for g in range(groups)]
    got = torch.full((len(units), 1 + halves, 2, 3), -1, dtype=torch.int32)
    a_shape = (m, k) if mode == "m" else (n, m)
    b_shape = (n, k, groups) if mode == "m" else (k, m)

    @cute.jit
    def run(out):  # a cute.Tensor (annotation strings resolve in module globals)
        ta = cute.make_identity_tensor(a_shape)
        tb = cute.make_identity_tensor(b_shape)
        for i in cutlass.range_constexpr(len(units)):
            row0, bx, by, g = units[i]
            ga, gbs = kern.operand_tiles(ta, tb, cutlass.Int32(row0), cutlass.Int32(bx),
                                         cutlass.Int32(by), cutlass.Int32(g))
            for kt in cutlass.range_constexpr(2):
                for t, tile in enumerate([ga, *gbs]):
                    c = tile[(0, 0, kt)]
                    for j in cutlass.range_constexpr(len(b_shape) if t else 2):
                        out[i, t, kt, j] = cutlass.Int32(c[j])

    cute.compile(run, from_dlpack(got))(from_dlpack(got))
    for i, (row0, bx, by, g) in enumerate(units):
        for kt in range(2):
            if mode == "m":
                want_a = [row0, 128 * kt]
                want_b = [[(bx * halves + h) * 128, 128 * kt, g] for h in range(halves)]
            else:
                want_a = [128 * by, row0 + 128 * kt]
                want_b = [[(bx * halves + h) * 128, row0 + 128 * kt] for h in range(halves)]
            assert got[i, 0, kt, :2].tolist() == want_a, (row0, bx, by, g, kt)
            for h in range(halves):
                assert got[i, 1 + h, kt, : len(want_b[h])].tolist() == want_b[h], (
                    row0, bx, by, g, kt, h)


# ---------------------------------------------------------------------------------------------
# GPU: what only the Hopper kernel has (clusters, its slow copy path, the 1x128 scale check);
# the numerics every backend shares are in test_grouped_gemm.py
# ---------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@needs_hopper
@pytest.mark.parametrize("max_ctas", [2, 6, None])
@pytest.mark.parametrize("op", ["fprop", "fprop32", "fprop_e128", "wgrad", "wgrad_unaligned"])
def test_cluster_of_two_matches_reference(op, max_ctas):
    """cluster_n=2: paired CTAs multicast the shared A tile; every tile is still written once
    and right, with the persistent loop walking several cluster tiles (max_ctas 2, 6) or one
    (None: the grid the GPU fits), 9 k-tiles per tile (> the stages), empty / partial groups,
    and wgrad's unaligned groups on the slow copy path (each CTA copies its own A)."""
    dev = "cuda"
    torch.manual_seed(11 + (max_ctas or 0))
    sizes = _sizes("E128" if op == "fprop_e128" else "E8_edge", 5)
    offs = _offs(sizes, dev)
    m = sum(sizes)
    launch = {"tuning": {"cluster_n": 2}}
    if max_ctas:
        launch["max_clusters"] = max_ctas // 2
    if op in ("fprop", "fprop32", "fprop_e128"):
        n, k = (512, 1056) if op != "fprop_e128" else (256, 288)  # 4 / 2 n-tiles: pairs
        a, b, out = fprop_case(offs, n, k, 32 if op == "fprop32" else 1)
        _mm("m", a, b, offs, out=out, **launch)
    else:
        n, k = 160, 1024  # 8 k-tiles along the fast axis
        a, b = _wgrad_operands(m, n, k, offs)
        out = torch.full((len(sizes), n, k), float("nan"), device=dev, dtype=torch.bfloat16)
        # aligned_groups=True on unaligned starts (E8_edge) takes the slow copy path; the
        # default re-lays the groups out for TMA
        _mm("k", a, b, offs, torch.bfloat16, out=out, **launch,
            aligned_groups=op == "wgrad_unaligned")
    _check(out, R.grouped_mm(a, b, offs, torch.float32), torch.bfloat16)


@gpu
@needs_cuda
@needs_hopper
@pytest.mark.parametrize("grouping", ["E8_edge", "E128"])
def test_wgrad_unaligned_groups_relayout_equals_slow_path(grouping):
    """Unaligned group starts: the default entry point (re-layout to 16-aligned starts, TMA
    path) gives bit-identical output to the kernel's own slow copy path (aligned_groups=True
    on the original layout), and odd M (not a multiple of 16) is accepted."""
    dev = "cuda"
    torch.manual_seed(11)
    sizes = _e128_sizes(5) if grouping == "E128" else list(GROUPINGS[grouping])
    m = sum(sizes)
    offs = _offs(sizes, dev)
    n, k = 96, 160
    a, b = _wgrad_operands(m, n, k, offs)
    out = torch.full((len(sizes), n, k), float("nan"), device=dev, dtype=torch.float32)
    _mm("k", a, b, offs, torch.float32, out=out)
    _check(out, R.grouped_mm(a, b, offs, torch.float32), torch.float32)
    if m % 16 == 0:
        slow = torch.full_like(out, float("nan"))
        _mm("k", a, b, offs, torch.float32, out=slow, aligned_groups=True)
        assert torch.equal(out, slow)


# ---------------------------------------------------------------------------------------------
# the 1x128 recipe (promotion once per k=128): GPU numerics vs the fp32 reference
# ---------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@needs_hopper
def test_1x128_kernel_turns_1x32_operands_into_nan():
    """Operands that are not 1x128 (their 32-blocks' scales differ) must not give plausible
    numbers from the once-per-k-tile promotion: the scale check makes those outputs NaN."""
    dev = "cuda"
    torch.manual_seed(3)
    sizes = [200, 56]
    offs = _offs(sizes, dev)
    x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    x[:, 32:64] *= 1000  # block 1 of every row gets another scale than blocks 0, 2, 3
    w = torch.randn(2, 128, 256, device=dev, dtype=torch.bfloat16)
    a32 = R.quantize_rowwise_ref(x, offs=offs)
    b = R.quantize_weights_ref(w, axis="K", block_rows=128)
    assert torch.isnan(_mm("m", a32, b, offs)).all()
    xk = x.clone()
    xk[32:64] *= 1000  # tokens 32..63: block 1 of group 0 along the tokens
    t = R.quantize_colwise_ref(xk, offs=offs)
    assert torch.isnan(_mm("k", t, t, offs, scale_blocks="1x128")[0]).all()
    # the same data quantized 1x128 is finite and right
    a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks="1x128")
    _check(_mm("m", a, b, offs), R.grouped_mm(a, b, offs, torch.float32), torch.bfloat16)


@gpu
@needs_cuda
@needs_hopper
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_wgrad_leaving_sms_free_is_bitwise_the_same(scale_blocks):
    """``leave_sms`` (the expert-parallel input-gradient return runs beside the weight
    gradients): a smaller persistent grid walks more tiles per CTA, each tile still computed
    whole by one CTA, so the output is the full grid's bit for bit."""
    dev = "cuda"
    torch.manual_seed(7)
    sizes = [640, 0, 384, 128, 1024]
    offs = _offs(sizes, dev)
    m, n, k = sum(sizes), 512, 1024
    a = R.quantize_colwise_ref(torch.randn(m, n, device=dev), offs=offs, scale_blocks=scale_blocks)
    b = R.quantize_colwise_ref(torch.randn(m, k, device=dev), offs=offs, scale_blocks=scale_blocks)
    outs = [_mm("k", a, b, offs, aligned_groups=True, scale_blocks=scale_blocks, leave_sms=sms,
                out=torch.full((len(sizes), n, k), float("nan"), device=dev, dtype=torch.bfloat16))
            for sms in (0, 16, 120)]
    _check_wgrad(outs[0], R.grouped_mm(a, b, offs, torch.float32), sizes, torch.bfloat16)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@needs_hopper
@pytest.mark.parametrize("op", ["m", "k"])
def test_1x128_cluster_and_persistent_loop(op):
    """2-CTA clusters and a 3-CTA persistent grid over many k-tiles, 1x128 recipe."""
    dev = "cuda"
    torch.manual_seed(5)
    sizes = [512, 0, 384, 128]
    offs = _offs(sizes, dev)
    m, n, k = sum(sizes), 256, 1152
    for launch in ({"tuning": {"cluster_n": 2}}, {"max_clusters": 3}):
        if op == "m":
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(len(sizes), n, k, device=dev, dtype=torch.bfloat16) * 0.05
            a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks="1x128")
            b = R.quantize_weights_ref(w, axis="K", block_rows=128)
            out = _mm("m", a, b, offs, **launch)
        else:
            a = R.quantize_colwise_ref(torch.randn(m, n, device=dev), offs=offs,
                                       scale_blocks="1x128")
            b = R.quantize_colwise_ref(torch.randn(m, k, device=dev), offs=offs,
                                       scale_blocks="1x128")
            out = _mm("k", a, b, offs, **launch, aligned_groups=True,
                                 scale_blocks="1x128")
        _check(out, R.grouped_mm(a, b, offs, torch.float32), torch.bfloat16)


@gpu
@needs_cuda
@needs_hopper
@pytest.mark.parametrize("grouping", ["E8_edge", "E128"])
@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad", "wgrad_slow_copy"])
def test_1x128_wide_tile_equals_narrow_tile(op, grouping):
    """The 256-column tile computes every output element exactly as the 128-column tile does
    (the same 4 wgmmas per k-tile and half, the same promotion order): bit-identical outputs,
    both right; and each stores the same bytes directly or through shared memory and TMA
    stores (M-grouped, a warpgroup's rows that cross the group's end store directly; boxes
    past the output's end are clipped or skipped). Output widths 384 / 320 / 288 leave a tile
    whose second half lies past the end (no scale read) and partial scale tiles; a 3-CTA
    persistent grid walks many tiles per CTA (the TMA-store buffer reused tile after tile);
    wgrad with and without 2-CTA clusters, its groups re-laid out for TMA or (slow copy)
    copied by the producer warp from unaligned starts."""
    dev = "cuda"
    torch.manual_seed(21 + len(grouping) + len(op))
    sizes = _sizes(grouping, 3)
    offs = _offs(sizes, dev)
    m = sum(sizes)
    launch, variants = {}, [dict(max_clusters=None), dict(max_clusters=3)]
    if op in ("fprop", "dgrad"):
        # fprop X (M, K) x W (E, N, K)^T -> (M, N); dgrad dY (M, N) x W (E, N, K) -> (M, K),
        # the weights quantized along N
        n, k, axis = (384, 352, "K") if op == "fprop" else (640, 320, "N")
        x = torch.randn(m, k if op == "fprop" else n, device=dev, dtype=torch.bfloat16)
        w = torch.randn(len(sizes), n, k, device=dev, dtype=torch.bfloat16) * 0.05
        a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks="1x128")
        b = R.quantize_weights_ref(w, axis=axis, block_rows=128)
        mode, shape = "m", (m, n if op == "fprop" else k)
    else:
        n, k = 160, 288
        a = R.quantize_colwise_ref(torch.randn(m, n, device=dev), offs=offs,
                                   scale_blocks="1x128")
        b = R.quantize_colwise_ref(torch.randn(m, k, device=dev), offs=offs,
                                   scale_blocks="1x128")
        mode, shape = "k", (len(sizes), n, k)
        launch = dict(scale_blocks="1x128", aligned_groups=op == "wgrad_slow_copy")
        variants += [dict(max_clusters=None, cluster_n=2), dict(max_clusters=2, cluster_n=2)]
    outs = {}
    for tile_n, tma_store in ((128, False), (128, True), (256, False), (256, True)):
        for v in variants:
            out = torch.full(shape, float("nan"), device=dev, dtype=torch.bfloat16)
            tuning = {"tile_n": tile_n, "cluster_n": v.get("cluster_n", 1),
                      "tma_store": tma_store}
            _mm(mode, a, b, offs, out=out, tuning=tuning, max_clusters=v["max_clusters"],
                **launch)
            outs[tile_n, tma_store, tuple(sorted(v.items(), key=str))] = out
    first = next(iter(outs.values()))
    _check(first, R.grouped_mm(a, b, offs, torch.float32), torch.bfloat16)
    for key, out in outs.items():
        assert torch.equal(out, first), key


def test_select_config_tile_width():
    """The 1x128 kernels take 256-column tiles when the output has more than 128 columns and a
    tile reduces over at least WIDE_TILE_MIN_REDUCTION elements (``k`` M-grouped, the mean
    tokens per group K-grouped), raster bands, K-grouped 2-CTA clusters where the tiles pair
    up; the other recipes 128-column tiles row by row; bad widths and bands are refused."""
    from moe_mxfp8.kernels.grouped_gemm import problem as P
    from moe_mxfp8.kernels.grouped_gemm import sm90_config as sm90

    long = sm90.WIDE_TILE_MIN_REDUCTION

    def cfg(mode, cols, blocks, tuning=None, red=long, groups=2):
        # cols: output columns (the tiles' x extent); red: the reduction per tile
        n, k = (cols, red) if mode == "m" else (512, cols)
        m = 256 if mode == "m" else red * groups
        p = P.GroupedProblem(mode=mode, m=m, n=n, k=k, num_groups=groups,
                             out_dtype=torch.bfloat16, scale_blocks=blocks,
                             device=torch.device("cpu"))
        return sm90.GroupedGemmSm90Host.select_config(p, tuning)

    def shape(c):
        return c.tile_n, c.band_m, c.cluster_n

    assert shape(cfg("m", 4096, "1x128")) == (256, sm90.RASTER_BAND, 1)
    assert shape(cfg("m", 128, "1x128")) == (128, sm90.RASTER_BAND, 1)
    assert shape(cfg("m", 4096, "1x32")) == (128, 1, 1)
    assert shape(cfg("k", 4096, "1x128")) == (256, sm90.RASTER_BAND, 2)
    assert shape(cfg("k", 128, "1x128")) == (128, sm90.RASTER_BAND, 1)  # nothing to pair
    assert shape(cfg("k", 384, "1x128")) == (256, sm90.RASTER_BAND, 2)  # 2 tiles: 1 pair
    assert shape(cfg("k", 640, "1x128")) == (256, sm90.RASTER_BAND, 1)  # 3 tiles: no pairs
    assert shape(cfg("m", 4096, "1x128", {"cluster_n": 2})) == (256, sm90.RASTER_BAND, 2)
    assert shape(cfg("m", 4096, "1x128", {"tile_n": 128})) == (128, sm90.RASTER_BAND, 1)
    # Qwen3-30B-A3B (dgrad over 1536, wgrad over 1024 tokens per expert): wide; shorter: not
    assert shape(cfg("m", 2048, "1x128", red=1536)) == (256, sm90.RASTER_BAND, 1)
    assert shape(cfg("k", 2048, "1x128", red=1024, groups=128)) == (256, sm90.RASTER_BAND, 2)
    assert shape(cfg("m", 2048, "1x128", red=long // 2)) == (128, sm90.RASTER_BAND, 1)
    assert shape(cfg("k", 2048, "1x128", red=long // 2, groups=128)) == (128, sm90.RASTER_BAND,
                                                                           2)
    assert shape(cfg("m", 2048, "1x128", {"tile_n": 256}, red=768)) == (256, sm90.RASTER_BAND, 1)
    with pytest.raises(ValueError, match="band_m"):
        sm90.GroupedGemmSm90Config("k", 256, 256, scale_blocks="1x128", band_m=0)
    with pytest.raises(ValueError, match="tile_n must be one of"):
        sm90.GroupedGemmSm90Config("m", 256, 256, scale_blocks="1x128", tile_n=192)
    with pytest.raises(ValueError, match="256-column tiles"):
        sm90.GroupedGemmSm90Config("m", 256, 256, scale_blocks="1x32", tile_n=256)
    with pytest.raises(ValueError, match="256-column tiles"):
        sm90.GroupedGemmSm90Config("k", 256, 256, scale_blocks="1x32", tile_n=256)


def test_kernel_refuses_operands_of_another_scale_block_choice():
    """A configuration compiled for one scale-block choice must not run operands of another
    (its promotion would apply the wrong scales): `can_implement` says why."""
    pytest.importorskip("cutlass")
    from moe_mxfp8.kernels.grouped_gemm import problem as P
    from moe_mxfp8.kernels.grouped_gemm import sm90

    a, b, offs = _fprop_operands(64, 128, 128, [30, 34], block_rows=32)
    p = P.describe_m(a, b, offs, torch.bfloat16)
    assert p.scale_blocks == "32x32"
    assert sm90.GroupedGemmSm90(sm90.GroupedGemmSm90.select_config(p)).can_implement(p)[0]
    other = sm90.GroupedGemmSm90(sm90.GroupedGemmSm90Config("m", 128, 128))
    ok, why = other.can_implement(p)
    assert not ok and "1x32 scale blocks" in why and "32x32" in why


# ---------------------------------------------------------------------------------------------
# the 1x128 weight gradient with its activation operand in 128 x 128 tiles (the layer's wgrad)
# ---------------------------------------------------------------------------------------------


def _as_rows(t, block_rows: int):
    """The same MXFP8 bytes and scales described with another ``block_rows``."""
    return type(t)(t.data, t.scale, t.scale_layout, t.offs, t.group_axis, block_rows)


def test_k_grouped_tiles_are_described_and_configured():
    """`describe_k` carries B's ``block_rows`` into the problem (and its compile key); the
    config takes it; tiles are refused for 1x32 operands, for an A operand and M-grouped."""
    from moe_mxfp8.kernels.grouped_gemm import problem as P
    from moe_mxfp8.kernels.grouped_gemm import sm90_config as sm90

    sizes = [128, 0, 256]
    offs = _offs(sizes, "cpu")
    m = sum(sizes)
    x, dy = torch.randn(m, 256).bfloat16(), torch.randn(m, 128).bfloat16()
    a = R.quantize_colwise_ref(dy, offs=offs, scale_blocks="1x128")
    b = R.quantize_colwise_ref(x, offs=offs, scale_blocks="1x128", block_rows=128)
    p = P.describe_k(a, b, offs, torch.bfloat16, "1x128")
    assert p.b_block_rows == 128 and p.static_key()[-1] == 128
    assert P.describe_k(a, _as_rows(b, 1), offs, torch.bfloat16, "1x128").b_block_rows == 1
    cfg = sm90.GroupedGemmSm90Host.select_config(p)
    assert cfg.b_block_rows == 128
    host = sm90.GroupedGemmSm90Host(cfg)
    ok, why = host.can_implement(dataclasses.replace(p, b_block_rows=1))
    assert not ok and "rows sharing a scale" in why
    with pytest.raises(ValueError, match="block_rows must be 1, or 128 with 1x128"):
        P.describe_k(a, b, offs, torch.bfloat16, "1x32")
    with pytest.raises(ValueError, match="one scale per row"):
        P.describe_k(_as_rows(a, 128), b, offs, torch.bfloat16, "1x128")
    with pytest.raises(ValueError, match="K-grouped 1x128 only"):
        sm90.GroupedGemmSm90Config("m", 256, 256, torch.bfloat16, "1x128", b_block_rows=128)


@gpu
@needs_cuda
@needs_hopper
@pytest.mark.parametrize("grouping", ["E8_edge", "E128"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_1x128_wgrad_with_activation_tiles(grouping, out_dtype):
    """B (K, M) in 128 x 128 tiles (``block_rows=128``): the kernel promotes with the scale
    warps' row x tile products (one FFMA per element). Against the fp32 reference of the
    dequantized operands, NaN-poisoned outputs, uneven and empty groups, K past a 128 tile
    (288), 128- and 256-column tiles, clusters, a 3-CTA persistent grid, aligned starts and
    the slow copy path; and bit-identical to the row x column promotion of the same bytes (the
    products of powers of two are exact)."""
    dev = "cuda"
    torch.manual_seed(31 + len(grouping))
    sizes = _sizes(grouping, 3)
    offs = _offs(sizes, dev)
    m, n, k = sum(sizes), 160, 288
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    x[:, 7] *= 300  # an outlier feature: the first tile's scale is its, the second's not
    a = R.quantize_colwise_ref(dy, offs=offs, scale_blocks="1x128")
    b = R.quantize_colwise_ref(x, offs=offs, scale_blocks="1x128", block_rows=128)
    ref = R.grouped_mm(a, b, offs, torch.float32)
    shape = (len(sizes), n, k)
    for aligned in (False, True):
        launch = dict(scale_blocks="1x128", aligned_groups=aligned)
        per_column = _mm("k", a, _as_rows(b, 1), offs, out_dtype, **launch)
        for tuning, clusters in (({"tile_n": 256, "cluster_n": 2}, None),
                                 ({"tile_n": 128, "cluster_n": 1}, 3),
                                 ({"tile_n": 256, "cluster_n": 1}, 3)):
            out = torch.full(shape, float("nan"), device=dev, dtype=out_dtype)
            _mm("k", a, b, offs, out_dtype, out=out, tuning=tuning, max_clusters=clusters,
                **launch)
            _check_wgrad(out, ref, sizes, out_dtype)
            assert torch.equal(out, per_column), (aligned, tuning)


@gpu
@needs_cuda
@needs_hopper
def test_1x128_tiles_kernel_turns_per_column_scales_into_nan():
    """A per-column operand described as 128 x 128 tiles cannot give plausible numbers: the
    tile's bytes disagree and the scale check makes the output NaN."""
    dev = "cuda"
    torch.manual_seed(4)
    sizes = [256, 128]
    offs = _offs(sizes, dev)
    x = torch.randn(384, 128, device=dev, dtype=torch.bfloat16)
    x[:, 3] *= 1000  # feature 3's scale differs from the other features'
    a = R.quantize_colwise_ref(torch.randn(384, 128, device=dev), offs=offs,
                               scale_blocks="1x128")
    b = R.quantize_colwise_ref(x, offs=offs, scale_blocks="1x128")
    out = _mm("k", a, _as_rows(b, 128), offs, scale_blocks="1x128", aligned_groups=True)
    assert torch.isnan(out).all()
