"""Host emulation of the sm_100a grouped GEMM (kernels/grouped_gemm/sm100.py) from its own code.

No Blackwell GPU ran the kernel. This module runs the kernel's index code -- not re-typed
formulas -- on the host through CuTeDSL host functions (`cute.jit` compiles them for the CPU),
and composes the results into the GEMM the kernel would compute:

* the persistent tile walk over ``offs`` (`_start_cursor`/`_seek`/`_group_end`, `_tile_coords`,
  `_k_tiles`, `_sf_tiles`, `_out_tile`), per cluster, in the order each CTA runs it;
* the TMA box origins of A and B: `_operand_tiles` applied to coordinate (identity) tensors and
  partitioned by the MMA slice of each CTA, exactly as the TMA warp does;
* the shared-memory address of every operand byte of every ring stage, from the CuTeDSL layouts
  the kernel builds in `_setup` (`a_smem_layout`/`b_smem_layout`, 128-byte swizzle included), and
  of every scale byte (`sfa_smem_layout`/`sfb_smem_layout`);
* the K-grouped tail zeroing: `_kblock_bytes` + `_zero_block_tail` run for all 32 lanes on a
  1024-byte aligned host copy of the A/B stage ring, addressed exactly as the kernel addresses
  shared memory (swizzled pointer + outer layout);
* the epilogue: `_epi_partition` (every thread's accumulator coordinates) and
  `_store_predicated` run on a host output tile, for the partial tiles of M-grouped groups.

What it takes as given (hardware semantics, not kernel code): TMA boxes place element ``(r, c)``
of a box at the smem address the operand layout gives (and zero-fill outside the tensor); the
MMA reads through the same layout; the scale bytes at the scale layout's address scale row
``r`` / k-block ``kb``; full tiles leave by a TMA store clipped to the tensor.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from unittest import mock

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack
from moe_mxfp8.kernels.grouped_gemm import problem as P
from moe_mxfp8.kernels.grouped_gemm import sm100 as K


@contextlib.contextmanager
def sm100_target():
    """Pin the DSL's target to sm_100a (tcgen05 layouts refuse another arch; a GPU of another
    arch would otherwise be detected), restoring the DSL's own choice afterwards."""
    from cutlass.cutlass_dsl import CuTeDSL

    with mock.patch.object(CuTeDSL._get_dsl().envar, "arch", "sm_100a"):
        yield


WALK_COLS = ("cluster", "g", "mt", "nt", "v", "b_l", "k_tiles", "sfa", "sfb", "sfb_step",
             "row0", "col0", "c_l", "valid_rows", "t0", "t1",
             "a_r", "a_c", "a_r1", "a_c1", "a_rl", "a_cl",
             "b_r", "b_c", "b_r1", "b_c1", "b_rl", "b_cl")
WALK_CAP = 8192


def _aligned_u8(n: int, align: int = 1024) -> torch.Tensor:
    """A zeroed uint8 host buffer of ``n`` bytes whose address is a multiple of ``align`` (the
    kernel's operand buffers are 1024-aligned; a swizzled pointer XORs address bits 4-9)."""
    raw = torch.zeros(n + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off:off + n]


@dataclass
class Facts:
    """Static per-configuration facts, evaluated from the kernel's layouts."""

    stages: int
    rows_a: int  # operand rows per CTA stage (A: cta tile M; B: N / CTAs)
    rows_b: int
    stage_bytes_a: int
    stage_bytes_b: int
    a_off: torch.Tensor  # (stages, rows_a, 128): smem byte of A element (r, c) of a stage
    b_off: torch.Tensor
    sfa_off: torch.Tensor  # (rows_a, 4): byte of row r's k-block scale inside a stage's SFA
    sfb_off: torch.Tensor  # (mma_n, 4)
    sf_stage_bytes: tuple[int, int]
    epi_rc: torch.Tensor  # (128 threads, elems, 2): CTA-tile (row, col) of each register


@functools.cache
def make_kernel(cfg) -> K.GroupedGemmSm100:
    return K.GroupedGemmSm100(cfg)


def _dyn(t: torch.Tensor):
    """A host tensor argument whose extents stay dynamic (one compile serves every size)."""
    return from_dlpack(t).mark_layout_dynamic()


_COMPILED: dict = {}


def _call(kern, name, fn, *args):
    """Compile ``fn`` once per (kernel object, name), then run it on ``args``."""
    key = (id(kern), name)
    if key not in _COMPILED:
        _COMPILED[key] = (kern, cute.compile(fn, *args))
    return _COMPILED[key][1](*args)


@functools.cache
def facts(cfg) -> Facts:
    return facts_of(make_kernel(cfg))


def layout_swizzles(cfg) -> list[str]:
    """The swizzles (``S<B,M,S>``) of the A, B and output staging layouts the kernel builds."""
    kern = K.GroupedGemmSm100(cfg)
    found = []

    @cute.jit
    def probe():  # traced only: the layouts are static
        kern._setup()
        for layout in (kern.a_smem_layout, kern.b_smem_layout, kern.c_smem_layout):
            found.append(str(layout.inner))

    probe()
    return found


def facts_of(kern) -> Facts:
    """Evaluate the kernel's smem and epilogue layouts on the host (one host function)."""

    @cute.jit
    def sizes(out):
        kern._setup()
        out[0] = kern.num_ab_stage
        out[1] = cute.size(kern.a_smem_layout, mode=[0, 0])
        out[2] = cute.size(kern.b_smem_layout, mode=[0, 0])
        out[3] = cute.cosize(kern.a_smem_layout.outer) // kern.num_ab_stage
        out[4] = cute.cosize(kern.b_smem_layout.outer) // kern.num_ab_stage
        out[5] = cute.crd2idx((0, 0, 0, 1), kern.sfa_smem_layout)
        out[6] = cute.crd2idx((0, 0, 0, 1), kern.sfb_smem_layout)
        out[7] = cute.size(kern.sfb_smem_layout, mode=[0, 0, 0])

    sz = torch.zeros(8, dtype=torch.int32)
    sizes(from_dlpack(sz))
    stages, rows_a, rows_b, sba, sbb, sfa_st, sfb_st, sfb_rows = sz.tolist()
    a_off = torch.zeros(stages, rows_a, K.TILE_K, dtype=torch.int32)
    b_off = torch.zeros(stages, rows_b, K.TILE_K, dtype=torch.int32)
    sfa_off = torch.zeros(rows_a, K.K_BLOCKS_PER_TILE, dtype=torch.int32)
    sfb_off = torch.zeros(sfb_rows, K.K_BLOCKS_PER_TILE, dtype=torch.int32)
    epi_rc = torch.full((128, 256, 2), -1, dtype=torch.int32)
    epi_n = torch.zeros(1, dtype=torch.int32)

    @cute.jit
    def layouts(a_o, b_o, sfa_o, sfb_o, epi_o, epi_cnt):
        kern._setup()
        for s in cutlass.range(kern.num_ab_stage, unroll=1):
            for kb in cutlass.range_constexpr(K.K_BLOCKS_PER_TILE):
                for r in cutlass.range(cute.size(kern.a_smem_layout, mode=[0, 0]), unroll=1):
                    for c in cutlass.range(K.MMA_K, unroll=1):
                        a_o[s, r, kb * K.MMA_K + c] = cute.crd2idx(((r, c), 0, kb, s),
                                                                   kern.a_smem_layout)
                for r in cutlass.range(cute.size(kern.b_smem_layout, mode=[0, 0]), unroll=1):
                    for c in cutlass.range(K.MMA_K, unroll=1):
                        b_o[s, r, kb * K.MMA_K + c] = cute.crd2idx(((r, c), 0, kb, s),
                                                                   kern.b_smem_layout)
        # Scale layouts: mode 0 is ((rows), (32 elements of a block, stride 0)), mode 2 the
        # k-block; the linear index r of mode 0 is row r, element 0 of its block.
        for kb in cutlass.range_constexpr(K.K_BLOCKS_PER_TILE):
            for r in cutlass.range(cute.size(kern.sfa_smem_layout, mode=[0, 0, 0]), unroll=1):
                sfa_o[r, kb] = cute.crd2idx((r, 0, kb, 0), kern.sfa_smem_layout)
            for r in cutlass.range(cute.size(kern.sfb_smem_layout, mode=[0, 0, 0]), unroll=1):
                sfb_o[r, kb] = cute.crd2idx((r, 0, kb, 0), kern.sfb_smem_layout)
        # Epilogue: every thread's register -> CTA-tile coordinate map (a stand-in TMEM
        # pointer: the partition is layout algebra).
        acc_shape = kern.tiled_mma.partition_shape_C(kern.mma_tiler[:2])
        tCtAcc_fake = kern.tiled_mma.make_fragment_C(cute.append(acc_shape, kern.num_acc_stage))
        acc_ptr = cute.make_ptr(kern.acc_dtype, 0, cute.AddressSpace.tmem, assumed_align=16)
        for tidx in cutlass.range(32 * len(K.EPI_WARPS), unroll=1):
            _, _, tTR_cC = kern._epi_partition(tidx, acc_ptr, tCtAcc_fake)
            for i in cutlass.range(cute.size(tTR_cC), unroll=1):
                r, c = tTR_cC[i]
                epi_o[tidx, i, 0] = r
                epi_o[tidx, i, 1] = c
            epi_cnt[0] = cute.size(tTR_cC)

    layouts(*(from_dlpack(t) for t in (a_off, b_off, sfa_off, sfb_off, epi_rc, epi_n)))
    return Facts(stages, rows_a, rows_b, sba, sbb, a_off.long(), b_off.long(), sfa_off.long(),
                 sfb_off.long(), (sfa_st, sfb_st), epi_rc[:, : int(epi_n)].long())


def walk(kern, offs: torch.Tensor, m: int, clusters: int, extents):
    """The kernel's persistent schedule on the host: one record per (work unit, CTA of the
    pair), in each cluster's order. ``extents``: ((A rows, A cols, A batch), (B ...)) of the
    GEMM views (`GroupedGemmBase.views`)."""
    rec = torch.full((WALK_CAP, len(WALK_COLS)), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    (ar, ac, al), (br, bc, bl) = extents

    @cute.jit
    def run(offs_t, rec_t, cnt, n_clusters, m_tok, ar_, ac_, al_, br_, bc_, bl_):
        kern._setup()
        kern.sched.bind(m_tok)
        cA = cute.make_identity_tensor((ar_, ac_, al_))
        cB = cute.make_identity_tensor((br_, bc_, bl_))
        r = Int32(0)
        for c in cutlass.range(n_clusters, unroll=1):
            unit = c
            cur = kern.sched.start(offs_t)
            cur = kern.sched.seek(offs_t, unit, cur)
            while cur[0] < cute.size(offs_t):
                mt, nt = kern.sched.tile_coords(unit, cur)
                _, _, b_l, _ = kern.sched.origins(mt, nt, cur)
                gA, gB = kern._operand_tiles(cA, cB, mt, nt, cur)
                for v in cutlass.range_constexpr(kern.atom_thr):
                    thr = kern.tiled_mma.get_slice(v)
                    tA = thr.partition_A(gA)  # ((rows, 32), 1, 4, k-tile)
                    tB = thr.partition_B(gB)
                    ra = cute.size(tA, mode=[0, 0]) - 1
                    rb = cute.size(tB, mode=[0, 0]) - 1
                    a0 = tA[((0, 0), 0, 0, 0)]
                    a1 = tA[((0, 0), 0, 0, 1)]
                    al_c = tA[((ra, K.MMA_K - 1), 0, K.K_BLOCKS_PER_TILE - 1, 0)]
                    b0 = tB[((0, 0), 0, 0, 0)]
                    b1 = tB[((0, 0), 0, 0, 1)]
                    bl_c = tB[((rb, K.MMA_K - 1), 0, K.K_BLOCKS_PER_TILE - 1, 0)]
                    sfa, sfb, step = kern.sched.scale_tiles(mt, nt, Int32(v), cur)
                    row0, col0, c_l, valid = kern._out_tile(unit, Int32(v), cur)
                    vals = (c, cur[0], mt, nt, Int32(v), b_l, kern.sched.k_tiles(cur), sfa, sfb,
                            step, row0, col0, c_l, valid, cur[2], cur[3],
                            a0[0], a0[1], a1[0], a1[1], al_c[0], al_c[1],
                            b0[0], b0[1], b1[0], b1[1], bl_c[0], bl_c[1])
                    for j in cutlass.range_constexpr(len(vals)):
                        rec_t[r, j] = Int32(vals[j])
                    r = r + 1
                unit = unit + n_clusters
                cur = kern.sched.seek(offs_t, unit, cur)
        cnt[0] = r

    _call(kern, "walk", run, _dyn(offs), _dyn(rec), _dyn(count), Int32(clusters), Int32(m),
          *(Int32(x) for x in (ar, ac, al, br, bc, bl)))
    n = int(count)
    assert n < WALK_CAP, "walk record buffer too small"
    return [dict(zip(WALK_COLS, row, strict=True)) for row in rec[:n].tolist()]


def zero_masks(kern, f: Facts, combos):
    """Run the kernel's tail zeroing (`_kblock_bytes` + `_zero_block_tail`, lanes 0..31) on a
    ring of ones for each ``(stage, kb, tail)``; returns per combo and operand the bool mask of
    zeroed bytes over the whole ring."""
    n = len(combos)
    combo_t = torch.tensor(combos, dtype=torch.int32).reshape(n, 3)
    ring_a = _aligned_u8(f.stages * f.stage_bytes_a)
    ring_b = _aligned_u8(f.stages * f.stage_bytes_b)
    out_a = torch.zeros(n, ring_a.numel(), dtype=torch.uint8)
    out_b = torch.zeros(n, ring_b.numel(), dtype=torch.uint8)

    @cute.jit
    def run(ra, rb, cmb, oa, ob, count):
        kern._setup()
        fp8 = kern.a_dtype
        sA = cute.make_tensor(cute.recast_ptr(ra.iterator, kern.a_smem_layout.inner, dtype=fp8),
                              kern.a_smem_layout.outer)
        sB = cute.make_tensor(cute.recast_ptr(rb.iterator, kern.b_smem_layout.inner, dtype=fp8),
                              kern.b_smem_layout.outer)
        for i in cutlass.range(count, unroll=1):
            for j in cutlass.range(cute.size(ra), unroll=1):
                ra[j] = cutlass.Uint8(1)
            for j in cutlass.range(cute.size(rb), unroll=1):
                rb[j] = cutlass.Uint8(1)
            s, kb, tail = cmb[i, 0], cmb[i, 1], cmb[i, 2]
            for lane in cutlass.range(32, unroll=1):
                kern._zero_block_tail(kern._kblock_bytes(sA, kern.a_smem_layout, kb, s), tail,
                                      lane, 32)
                kern._zero_block_tail(kern._kblock_bytes(sB, kern.b_smem_layout, kb, s), tail,
                                      lane, 32)
            for j in cutlass.range(cute.size(ra), unroll=1):
                oa[i, j] = ra[j]
            for j in cutlass.range(cute.size(rb), unroll=1):
                ob[i, j] = rb[j]

    _call(kern, "zero", run, _dyn(ring_a), _dyn(ring_b), _dyn(combo_t), _dyn(out_a),
          _dyn(out_b), Int32(n))
    return {c: (out_a[i] == 0, out_b[i] == 0) for i, c in enumerate(combos)}


def store_masks(kern, cases):
    """Run the kernel's `_store_predicated` for every thread and subtile into a host CTA tile
    (of the output dtype) for each ``(valid_rows, columns left in N)``. Each register holds
    ``1 + r`` (first pass) or ``1 + c`` (second pass) of its own coordinate (exact in bf16).
    Returns ``(cases, rows, cols, 2)`` float64 of the written markers (NaN: not written)."""
    n = len(cases)
    tm, tn = kern.cta_tile_mnk[0], kern.cta_tile_mnk[1]
    dt = kern.cfg.out_dtype
    tiles = [torch.full((n, tm, tn), float("nan"), dtype=dt) for _ in range(2)]
    case_t = torch.tensor(cases, dtype=torch.int32).reshape(n, 2)

    @cute.jit
    def run(out, cs, count, which):
        kern._setup()
        acc_shape = kern.tiled_mma.partition_shape_C(kern.mma_tiler[:2])
        tCtAcc_fake = kern.tiled_mma.make_fragment_C(cute.append(acc_shape, kern.num_acc_stage))
        acc_ptr = cute.make_ptr(kern.acc_dtype, 0, cute.AddressSpace.tmem, assumed_align=16)
        for i in cutlass.range(count, unroll=1):
            valid, ncols = cs[i, 0], cs[i, 1]
            mC = out[(i, None, None)]
            mC3 = cute.make_tensor(mC.iterator, cute.append(mC.layout, cute.make_layout(1)))
            for tidx in cutlass.range(32 * len(K.EPI_WARPS), unroll=1):
                _, tTR_tAcc, tTR_cC = kern._epi_partition(tidx, acc_ptr, tCtAcc_fake)
                rC = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0, 0)].shape,
                                           kern.c_dtype)
                for em in cutlass.range_constexpr(cute.size(tTR_cC, mode=[3])):
                    for en in cutlass.range_constexpr(cute.size(tTR_cC, mode=[4])):
                        sub = tTR_cC[(None, None, None, em, en)]
                        for j in cutlass.range_constexpr(cute.size(rC)):
                            r, c = sub[j]
                            rC[j] = kern.c_dtype(cutlass.Float32(1 + r + (c - r) * which))
                        kern._store_predicated(rC, sub, mC3, Int32(0), Int32(0), Int32(0),
                                               valid, ncols)

    for which in (0, 1):
        _call(kern, "store", run, _dyn(tiles[which]), _dyn(case_t), Int32(n), Int32(which))
    return torch.stack([t.double() for t in tiles], -1)


def _box(src: torch.Tensor, r0: int, c0: int, nr: int, nc: int) -> torch.Tensor:
    """TMA boxes of a 2D uint8 tensor: zero-filled outside the tensor."""
    out = torch.zeros(nr, nc, dtype=torch.uint8)
    rs, re_ = max(r0, 0), min(r0 + nr, src.shape[0])
    cs, ce = max(c0, 0), min(c0 + nc, src.shape[1])
    if rs < re_ and cs < ce:
        out[rs - r0:re_ - r0, cs - c0:ce - c0] = src[rs:re_, cs:ce]
    return out


def _scales(buf: torch.Tensor, first_tiles, off: torch.Tensor) -> torch.Tensor:
    """E8M0 scales ``(rows, 4 * k_tiles)`` read through the scale smem layout ``off`` from the
    packed tiles ``first_tiles[t]`` (TMA: a tile past the buffer reads zeros)."""
    idx = torch.as_tensor(first_tiles, dtype=torch.int64).view(-1, 1, 1) * K.TILE_BYTES + off
    padded = torch.cat([buf.flatten(), torch.zeros(K.TILE_BYTES, dtype=torch.uint8)])
    ok = (idx >= 0) & (idx < buf.numel())
    vals = padded[torch.where(ok, idx, buf.numel())]  # (k_tiles, rows, 4)
    return torch.exp2(vals.permute(1, 0, 2).reshape(off.shape[0], -1).to(torch.float64) - 127)


def _fp8(u8: torch.Tensor) -> torch.Tensor:
    return u8.view(torch.float8_e4m3fn).to(torch.float64)


def _through_smem(slab, off_s, mask):
    """One k-tile through its ring stage: the TMA box lands at the layout's addresses, the
    tail zeroing clears ``mask`` (ring bytes), the MMA reads through the layout again."""
    ring = torch.zeros(mask.numel(), dtype=torch.uint8)
    ring[off_s] = slab
    ring[mask] = 0
    return ring[off_s]


def emulate(cfg, a, b, offs: torch.Tensor, clusters: int, kern=None, stats=None):
    """The kernel's result for MXFP8 operands ``a``, ``b`` (host tensors) and ``offs``, as
    `grouped_gemm.launcher.run` would launch it (operands already as the kernel reads them:
    K-grouped data with the group starts it is given). ``kern``: a kernel object whose methods
    may be patched (mutation tests). Output poisoned with NaN: unwritten elements stay NaN.

    A k-tile without tail zeroing passes through shared memory unchanged (the operand layout is
    a bijection of the box onto its stage: `test_layouts_are_bijections`), so only tail tiles
    are routed through the emulated ring."""
    kern = kern or make_kernel(cfg)
    f = facts(cfg)
    mode = cfg.mode
    if mode == P.MODE_M:
        m = a.data.shape[0]
        e = b.data.shape[0]
        out = torch.full((m, cfg.n), float("nan"), dtype=torch.float64)
        extents = ((m, cfg.k, 1), (cfg.n, cfg.k, e))
        a_src = a.data.view(torch.uint8)
        b_src = [t.view(torch.uint8) for t in b.data]
    else:
        m = a.data.shape[1]
        e = offs.numel()
        out = torch.full((e, cfg.n, cfg.k), float("nan"), dtype=torch.float64)
        extents = ((cfg.n, m, 1), (cfg.k, m, 1))
        a_src = a.data.view(torch.uint8)
        b_src = [b.data.view(torch.uint8)]
    recs = walk(kern, offs.to(torch.int32).cpu(), m, clusters, extents)
    n_total = cfg.n if mode == P.MODE_M else cfg.k
    tm = kern.cta_tile_mnk[0]
    atom = 2 if cfg.two_cta else 1
    tk = K.TILE_K

    # Ring stage of every k-tile and accumulator stage of every unit: per CTA, in walk order.
    stage_of, acc_of, per_cta = {}, {}, {}
    for i, r in enumerate(recs):
        key = (r["cluster"], r["v"])
        kt_base, units = per_cta.get(key, (0, 0))
        stage_of[i], acc_of[i] = kt_base, units % kern.num_acc_stage
        per_cta[key] = (kt_base + r["k_tiles"], units + 1)
        # TMA boxes: one k-tile further is TILE_K further along the reduced axis, and a box
        # spans (rows, TILE_K) from its origin (the coordinate tensors' first/last elements).
        if r["k_tiles"] > 1:
            assert (r["a_r1"] - r["a_r"], r["a_c1"] - r["a_c"]) == (0, tk), r
            assert (r["b_r1"] - r["b_r"], r["b_c1"] - r["b_c"]) == (0, tk), r
        assert (r["a_rl"] - r["a_r"], r["a_cl"] - r["a_c"]) == (f.rows_a - 1, tk - 1), r
        assert (r["b_rl"] - r["b_r"], r["b_cl"] - r["b_c"]) == (f.rows_b - 1, tk - 1), r

    def tail_of(i, r):
        """(stage, k-block, tail, k-blocks issued) of the group's last k-tile (K-grouped)."""
        valid = r["t1"] - r["t0"] - (r["k_tiles"] - 1) * tk
        s = (stage_of[i] + r["k_tiles"] - 1) % f.stages
        return s, valid // K.MMA_K, valid % K.MMA_K, (valid + K.MMA_K - 1) // K.MMA_K

    combos = set()
    if mode == P.MODE_K:
        for i, r in enumerate(recs):
            if r["k_tiles"] > 0:
                s, kb, tail, _ = tail_of(i, r)
                if tail:
                    combos.add((s, kb, tail))
    masks = zero_masks(kern, f, sorted(combos)) if combos else {}
    for (s, _, _), (ma, mb) in masks.items():
        # The zeroing must stay inside its own stage: other stages hold k-tiles in flight.
        for mk, sb in ((ma, f.stage_bytes_a), (mb, f.stage_bytes_b)):
            hit = torch.nonzero(mk).flatten()
            assert hit.numel() == 0 or (s * sb <= hit.min() and hit.max() < (s + 1) * sb)
    if stats is not None:
        stats.update(records=len(recs), tail_combos=len(combos))

    # TMEM accumulators (2 stages per CTA) persist across units: a stale stage must be
    # overwritten by the first k-block of the next unit that uses it.
    tmem = {}
    partial_cases, results = set(), []
    for i in range(0, len(recs), atom):
        pair = recs[i:i + atom]
        r0 = pair[0]
        kt_n = r0["k_tiles"]
        slabs_a, slabs_b = [], []
        issued = torch.ones(kt_n * K.K_BLOCKS_PER_TILE, dtype=torch.float64)
        for r in pair:
            sa_ = _box(a_src, r["a_r"], r["a_c"], f.rows_a, kt_n * tk)
            sb_ = _box(b_src[r["b_l"]], r["b_r"], r["b_c"], f.rows_b, kt_n * tk)
            if mode == P.MODE_K and kt_n > 0:
                s, kb, tail, n_kb = tail_of(i, r)
                issued[(kt_n - 1) * K.K_BLOCKS_PER_TILE + n_kb:] = 0  # MMAs not issued
                if tail:
                    ma, mb = masks[(s, kb, tail)]
                    last = slice((kt_n - 1) * tk, kt_n * tk)
                    sa_[:, last] = _through_smem(sa_[:, last], f.a_off[s], ma)
                    sb_[:, last] = _through_smem(sb_[:, last], f.b_off[s], mb)
            slabs_a.append(_fp8(sa_))
            slabs_b.append(_fp8(sb_))
        b_all = torch.cat(slabs_b, 0)  # a cta_group::2 MMA reads the B halves of both CTAs
        for v, r in enumerate(pair):
            key = (r["cluster"], r["v"], acc_of[i + v])
            if kt_n > 0:
                tiles = torch.arange(kt_n)
                sa = _scales(a.scale, r["sfa"] + tiles, f.sfa_off) * issued
                sb = torch.cat([_scales(b.scale, r["sfb"] + j * r["sfb_step"] + tiles,
                                        f.sfb_off) for j in range(kern.sfb_row_tiles)], 0)
                aa = slabs_a[v] * sa.repeat_interleave(K.MMA_K, 1)
                bb = b_all * sb.repeat_interleave(K.MMA_K, 1)
                # k-block 0 of k-tile 0 is issued with ACCUMULATE off: it overwrites the stage.
                tmem[key] = aa @ bb.t()
                acc = tmem[key].to(torch.float32).to(cfg.out_dtype).to(torch.float64)
            else:  # no MMA: the epilogue stores zeros without reading TMEM
                acc = torch.zeros(tm, cfg.mma_n, dtype=torch.float64)
            results.append((r, acc))
            if r["valid_rows"] < tm:
                partial_cases.add((r["valid_rows"], n_total - r["col0"]))

    cases = sorted(partial_cases)
    stores = store_masks(kern, cases) if cases else None
    for r, acc in results:
        rows = slice(r["row0"], r["row0"] + tm)
        cols = slice(r["col0"], r["col0"] + cfg.mma_n)
        if mode == P.MODE_M:
            if r["valid_rows"] == tm:  # TMA store of the whole tile, clipped to (M, N)
                dst = out[rows, cols]
                dst.copy_(acc[: dst.shape[0], : dst.shape[1]])
            elif r["valid_rows"] > 0:  # the kernel's predicated stores
                marks = stores[cases.index((r["valid_rows"], n_total - r["col0"]))]
                written = ~torch.isnan(marks[..., 0])
                assert torch.equal(written, ~torch.isnan(marks[..., 1]))
                rr, cc = torch.nonzero(written, as_tuple=True)
                assert torch.equal(marks[rr, cc, 0].long(), rr + 1), "stored a foreign row"
                assert torch.equal(marks[rr, cc, 1].long(), cc + 1), "stored a foreign column"
                out[r["row0"] + rr, r["col0"] + cc] = acc[rr, cc]
        else:
            dst = out[r["c_l"], rows, cols]
            dst.copy_(acc[: dst.shape[0], : dst.shape[1]])
    return out


class _Patched(K.GroupedGemmSm100):
    """A kernel object with some methods replaced (mutation tests)."""


def patched(cfg, **methods) -> K.GroupedGemmSm100:
    """``methods``: kernel method names, or ``sched__<name>`` for a method of its schedule."""
    kern = _Patched(cfg)
    for name, fn in methods.items():
        owner = kern
        if name.startswith("sched__"):
            owner, name = kern.sched, name.removeprefix("sched__")
        setattr(owner, name, types.MethodType(fn, owner))
    return kern
