"""The sm_100a grouped GEMM emulated on the host from its own index code (CPU CI).

`sm100_emu` runs the kernel's schedule, TMA box, shared-memory layout, tail-zeroing and epilogue
code through CuTeDSL host functions and composes the GEMM the kernel would compute; these tests
compare it with `moe_mxfp8.reference.grouped_mm` on fresh random operands for many group
configurations, and check the pieces on their own (layouts are bijections, the tail zeroing
hits exactly the tail, partial tiles are written exactly once).

`test_emulation_catches_unswizzled_tail_zeroing` keeps the K-grouped tail-zeroing bug of the
first version (its byte view dropped the 128-byte swizzle: ``cute.recast_tensor``) as a mutant
and shows that the emulation rejects it with O(1) errors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_mxfp8 import reference as R
from moe_mxfp8 import selfcheck

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
import sm100_emu as E  # noqa: E402  (tests/kernels is on sys.path under pytest)
from moe_mxfp8.kernels.grouped_gemm import problem as P  # noqa: E402
from moe_mxfp8.kernels.grouped_gemm import sm100 as K  # noqa: E402

# Group sizes the issue asks for; the E = 128 problems cycle through them.
SIZES = (0, 1, 15, 16, 17, 31, 48, 129, 1000)

# One configuration per (mode, CTA mode, output dtype): every emulation compiles its host
# functions once per configuration. N and K not multiples of 128 (K-grouped: K = token axis).
CFG_M1 = K.GroupedGemmSm100Config("m", 160, 288, torch.bfloat16, 128, 128)
CFG_M2 = K.GroupedGemmSm100Config("m", 96, 160, torch.float32, 256, 128)
CFG_K32 = K.GroupedGemmSm100Config("k", 96, 160, torch.float32, 128, 128)
CFG_K16 = K.GroupedGemmSm100Config("k", 64, 96, torch.bfloat16, 128, 128)


@pytest.fixture(autouse=True, scope="module")
def _sm100_target():
    """Host functions build tcgen05 layouts: pin the DSL's target to sm_100a for this module
    (a GPU of another arch would otherwise be detected), restored afterwards. The emulation
    runs thousands of small tensor ops: one intra-op thread is several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with E.sm100_target():
            yield
    finally:
        torch.set_num_threads(threads)


def _seed(gen) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def _operands(mode, sizes, cfg, seed, aligned=True):
    """Random MXFP8 operands, the reference (fp64 of the fp32 reference), and the operands as
    the kernel receives them (K-grouped: `align_k_groups` as `grouped_mm_k` does)."""
    prob = selfcheck.CheckProblem(tuple(sizes), n=cfg.n, k=cfg.k, out_dtype=cfg.out_dtype)
    a, b, offs = selfcheck.make_operands(mode, prob, "cpu", seed=seed)
    ref = R.grouped_mm(a, b, offs, torch.float32).double()
    if mode == "k" and aligned:
        ad, bd, offs = P.align_k_groups(a.data, b.data, offs)
        a, b = dataclasses.replace(a, data=ad), dataclasses.replace(b, data=bd)
    return a, b, offs, ref


def _check(out, ref, dt, what):
    assert not torch.isnan(out).any(), f"{what}: {int(torch.isnan(out).sum())} unwritten"
    # bf16 output: one rounding (2^-9 relative); fp32: summation order only.
    rtol = 2**-8 if dt == torch.bfloat16 else 1e-5
    bound = rtol * ref.abs() + 1e-6 * ref.abs().max()
    bad = (out - ref).abs() > bound
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, relative error {rel:.3g}"


def _cycle(e):
    return tuple((SIZES * (e // len(SIZES) + 1))[:e])


CASES = [
    # (mode, cfg, sizes, clusters): few clusters so that each CTA runs several tiles and its
    # stage ring and both accumulator stages wrap.
    ("m", CFG_M1, (1000,), 3),
    ("m", CFG_M1, SIZES[1:] + (0,), 4),
    ("m", CFG_M1, _cycle(128), 7),
    ("m", CFG_M2, (1000,), 2),
    ("m", CFG_M2, (300, 0, 531, 17, 129, 1000, 48, 1), 3),
    ("k", CFG_K32, (1000,), 2),
    ("k", CFG_K32, SIZES[1:] + (0,), 3),
    ("k", CFG_K16, _cycle(128), 5),
]


@pytest.mark.parametrize("mode,cfg,sizes,clusters", CASES,
                         ids=[f"{c[0]}-{'2cta' if c[1].two_cta else '1cta'}-E{len(c[2])}"
                              for c in CASES])
def test_emulated_kernel_matches_reference(gen, mode, cfg, sizes, clusters):
    seed = _seed(gen)
    a, b, offs, ref = _operands(mode, sizes, cfg, seed)
    stats = {}
    out = E.emulate(cfg, a, b, offs, clusters, stats=stats)
    _check(out, ref, cfg.out_dtype, f"seed {seed} {stats}")


@pytest.mark.parametrize("sizes", [(1000,), SIZES[1:] + (0,)], ids=["E1", "E9"])
def test_emulated_k_grouped_1x128_with_tiled_activation_operand(gen, sizes):
    """The 1x128 recipe's weight gradient on sm_100a: the gradient operand with one scale per
    row and 128-token block, the activation operand in 128 x 128 tiles (``block_rows=128``,
    what `MXFP8MoE` and `grouped_mm` hand the K-grouped GEMM); the kernel reads their replicated
    block32 scales as any MXFP8 operand, and its index math (emulated) gives the reference."""
    seed = _seed(gen)
    g = torch.Generator().manual_seed(seed)
    cfg = CFG_K32
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    m = int(offs[-1])
    x = torch.randn(m, cfg.k, generator=g) * torch.logspace(-1, 1, cfg.k)
    a = R.quantize_colwise_ref(torch.randn(m, cfg.n, generator=g), offs=offs,
                               scale_blocks="1x128")
    b = R.quantize_colwise_ref(x, offs=offs, scale_blocks="1x128", block_rows=128)
    p = P.describe_k(a, b, offs, cfg.out_dtype, "1x128")
    assert p.b_block_rows == 128
    ref = R.grouped_mm(a, b, offs, torch.float32).double()
    ad, bd, offs_k = P.align_k_groups(a.data, b.data, offs)  # as the launcher does
    a, b = dataclasses.replace(a, data=ad), dataclasses.replace(b, data=bd)
    p = dataclasses.replace(p, m=ad.shape[1])
    ok, why = K.GroupedGemmSm100(K.GroupedGemmSm100.select_config(p)).can_implement(p)
    assert ok, why
    stats = {}
    out = E.emulate(cfg, a, b, offs_k, 3, stats=stats)
    _check(out, ref, cfg.out_dtype, f"seed {seed} {stats}")


def test_emulated_tails_of_every_length(gen):
    """Unaligned group starts (``aligned_groups=True`` with raw offs): the last k-tile of a
    group ends at every offset mod 32, so the tail zeroing runs with every tail length."""
    seed = _seed(gen)
    sizes = (1, 15, 17, 31, 33, 47, 63, 95, 127, 129, 255, 3, 7, 64, 97)
    a, b, offs, ref = _operands("k", sizes, CFG_K32, seed, aligned=False)
    stats = {}
    out = E.emulate(CFG_K32, a, b, offs, 4, stats=stats)
    assert stats["tail_combos"] >= 10, stats
    _check(out, ref, CFG_K32.out_dtype, f"seed {seed} {stats}")


@cute.jit
def _kblock_bytes_unswizzled(self, s_op, smem_layout, kb, stage):
    """The first version's byte view (a mutant): `recast_tensor` drops the pointer's swizzle."""
    return cute.recast_tensor(s_op[(None, 0, kb, stage)], cutlass.Uint8)


def test_emulation_catches_unswizzled_tail_zeroing():
    """The self-check's own wgrad problems, with the first version's tail zeroing: the
    emulation gives O(1) errors (the fixed kernel passes `test_emulated_kernel_matches_...`)."""
    for i, prob in enumerate(selfcheck.DEFAULT_PROBLEMS["k"]):
        cfg = K.GroupedGemmSm100Config("k", prob.n, prob.k, prob.out_dtype, 128, 128)
        a, b, offs, ref = _operands("k", prob.sizes, cfg, seed=i)
        good = E.emulate(cfg, a, b, offs, 3)
        _check(good, ref, cfg.out_dtype, f"fixed kernel, problem {i}")
        bad = E.emulate(cfg, a, b, offs, 3,
                        kern=E.patched(cfg, _kblock_bytes=_kblock_bytes_unswizzled))
        rel = float((bad - ref).norm() / ref.norm())
        assert rel > 0.1, f"problem {i}: the mutant passed (relative error {rel:.3g})"


@cute.jit
def _zero_tail_off_by_one(self, blk, tail, first_row, row_step):
    for r in cutlass.range(first_row, cute.size(blk, mode=[0, 0]), row_step, unroll=1):
        for c in cutlass.range(tail + 1, K.MMA_K, unroll=1):
            blk[((r, c),)] = cutlass.Uint8(0)


@cute.jit
def _scale_tiles_without_group_base(self, mt, nt, v, cur):
    g, _, t0, t1, _ = cur
    return P.scale_tile_index(self.mode, self.n, self.k, self.tile_m, self.tile_n, mt, nt, v, g,
                              t1 - t0, 0)


@pytest.mark.parametrize("name,method,fn", [
    ("tail zeroing leaves one foreign token", "_zero_block_tail", _zero_tail_off_by_one),
    ("scale tiles miss the group base", "sched__scale_tiles", _scale_tiles_without_group_base),
])
def test_emulation_catches_index_mutants(name, method, fn):
    """The emulation is sensitive to single slips in the kernel's index code."""
    prob = selfcheck.DEFAULT_PROBLEMS["k"][0]
    cfg = K.GroupedGemmSm100Config("k", prob.n, prob.k, prob.out_dtype, 128, 128)
    a, b, offs, ref = _operands("k", prob.sizes, cfg, seed=3)
    bad = E.emulate(cfg, a, b, offs, 3, kern=E.patched(cfg, **{method: fn}))
    with pytest.raises(AssertionError, match="elements off"):
        _check(bad, ref, cfg.out_dtype, name)


# ---------------------------------------------------------------------------------------------
# the pieces
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG_M1, CFG_M2, CFG_K32], ids=["m1cta", "m2cta", "k"])
def test_layouts_are_bijections(cfg):
    """Each ring stage of A/B is a bijection of the tile onto its own bytes; the scale layout
    gives 512 distinct bytes per packed tile; every element of a CTA output tile belongs to
    exactly one epilogue thread register (so a predicated store writes it at most once)."""
    f = E.facts(cfg)
    for off, sb in ((f.a_off, f.stage_bytes_a), (f.b_off, f.stage_bytes_b)):
        for s in range(f.stages):
            got = off[s].flatten().sort().values
            assert torch.equal(got, torch.arange(s * sb, (s + 1) * sb)), s
    assert f.sfa_off.unique().numel() == f.sfa_off.numel() == 512
    assert int(f.sfa_off.max()) < 512 and f.sf_stage_bytes[0] == 512
    rows, cols = K.GroupedGemmSm100(cfg).cta_tile_mnk[:2]
    rc = f.epi_rc.reshape(-1, 2)
    assert int(rc.min()) >= 0 and int(rc[:, 0].max()) < rows and int(rc[:, 1].max()) < cols
    flat = rc[:, 0] * cols + rc[:, 1]
    assert torch.equal(flat.sort().values, torch.arange(rows * cols))
    # `_store_predicated` stores registers [i, i + vec) as one 16-byte vector at (r, c): they
    # must be one row's consecutive columns with c % vec == 0 (16-byte aligned in memory).
    vec = K.STORE_VECTOR_BYTES // cfg.out_dtype.itemsize
    chunks = f.epi_rc.reshape(f.epi_rc.shape[0], -1, vec, 2)
    assert (chunks[..., 0] == chunks[..., :1, 0]).all()
    assert (chunks[..., 1] - chunks[..., :1, 1] == torch.arange(vec)).all()
    assert (chunks[..., 0, 1] % vec == 0).all()


def test_tail_zeroing_hits_exactly_the_tail():
    """The kernel's `_kblock_bytes` + `_zero_block_tail` (32 lanes), for every k-block and tail
    length, in the first and the last ring stage, zero exactly the bytes that the operand
    layout puts at tokens ``[kb*32 + tail, kb*32 + 32)`` of every row (A and B)."""
    f = E.facts(CFG_K32)
    kern = E.make_kernel(CFG_K32)
    combos = [(s, kb, t) for s in (0, f.stages - 1) for kb in range(4) for t in (1, 5, 16, 31)]
    masks = E.zero_masks(kern, f, combos)
    for (s, kb, t), (ma, mb) in masks.items():
        for mask, off in ((ma, f.a_off), (mb, f.b_off)):
            want = torch.zeros_like(mask)
            want[off[s][:, kb * 32 + t:(kb + 1) * 32].flatten()] = True
            assert torch.equal(mask, want), (s, kb, t)


@pytest.mark.parametrize("cfg", [CFG_M1, CFG_M2], ids=["bf16", "f32_2cta"])
def test_partial_tile_stores(cfg):
    """The kernel's `_store_predicated` (every thread, every subtile) writes exactly the rows
    inside the group and the columns inside N, each with its own register's value."""
    kern = E.make_kernel(cfg)
    cases = [(v, c) for v in (1, 15, 16, 17, 64, 127) for c in (32, 96, 128)]
    marks = E.store_masks(kern, cases)
    rows, cols = kern.cta_tile_mnk[:2]
    r = torch.arange(rows).view(-1, 1).expand(rows, cols)
    c = torch.arange(cols).view(1, -1).expand(rows, cols)
    for i, (valid, ncols) in enumerate(cases):
        inside = (r < valid) & (c < ncols)
        written = ~torch.isnan(marks[i, ..., 0])
        assert torch.equal(written, inside), (valid, ncols)
        assert torch.equal(marks[i, ..., 0][inside].long(), r[inside] + 1)
        assert torch.equal(marks[i, ..., 1][inside].long(), c[inside] + 1)


def test_walk_clamps_malformed_offs():
    """Group ends past M or negative are clamped on the device (`_group_end`): the walk never
    produces a row, k-range or output tile outside the operands (no out-of-bounds store)."""
    cfg = CFG_M1
    kern = E.make_kernel(cfg)
    m = 300
    offs = torch.tensor([100, -5, 5000, 250], dtype=torch.int32)
    recs = E.walk(kern, offs, m, 3, ((m, cfg.k, 1), (cfg.n, cfg.k, 4)))
    assert recs
    for r in recs:
        assert 0 <= r["t0"] <= m and 0 <= r["t1"] <= m, r
        assert r["row0"] + min(r["valid_rows"], 128) <= m, r
    kcfg = CFG_K32
    recs = E.walk(E.make_kernel(kcfg), torch.tensor([64, 10**6, 32], dtype=torch.int32), 128,
                  2, ((kcfg.n, 128, 1), (kcfg.k, 128, 1)))
    for r in recs:
        assert max(r["t0"], r["t1"]) <= 128 and r["k_tiles"] <= 1, r
