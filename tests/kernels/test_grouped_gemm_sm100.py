"""Blackwell grouped MXFP8 GEMM (kernels/grouped_gemm_sm100.py) -- CPU CI.

No Blackwell GPU ran this kernel. CI checks what can be checked without one:

* every variant compiles for sm_100a (fake pointers, in a subprocess with CUTE_DSL_ARCH set
  before CuTeDSL is imported) and its SASS holds the block-scaled MMA (UTCQMMA, .2CTA for the
  CTA-pair variant), the SMEM->TMEM scale copy (UTCCP), TMA loads/stores and no local memory
  (LDL/STL: register spills or stack arrays), and partial output tiles leave by 16-byte stores;
* its PTX: every generic-proxy ``st.shared`` (the K-grouped tail zeroing, the epilogue
  staging) carries the swizzle of the buffer's CuTeDSL layout, and the descriptor immediates
  (instruction descriptor, scale-factor ids, TMEM columns, scale copy shape, smem descriptors,
  transaction bytes, CTA-pair barrier masks) are the ones the PTX ISA derivation gives;
* the packed-scale tile indices the kernel computes match `moe_mxfp8.layout` byte for byte,
  and the kernel's device-side schedule code, run on the host by a CuTeDSL host function,
  visits every output tile exactly once with the right origins, k-tile counts and scale tiles;
* the dispatcher picks this kernel on compute capability 10.x;
* the first-use self-check (`moe_mxfp8.selfcheck`) accepts a correct kernel, refuses a wrong,
  hanging or faulting one with a clear error naming the configuration, caches its verdict per
  compiled configuration, guards both sm100 entry points, and its problems make every cluster
  wrap the stage ring and both accumulator stages (walked by the kernel's schedule code).

The full GEMM is emulated from the kernel's index code in test_sm100_emulation.py.
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
import time
from pathlib import Path

import pytest
import torch

from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R
from moe_mxfp8 import selfcheck

REPO = Path(__file__).resolve().parents[2]

# (name, mode, mma_m, n, k, out dtype): both modes, both tile configurations, both output
# dtypes, N and K that are and are not multiples of the 128 tiles.
VARIANTS = [
    ("m_1cta_bf16", "m", 128, 512, 1024, "bfloat16"),
    ("m_2cta_f32", "m", 256, 2880, 2880, "float32"),
    ("k_1cta_bf16", "k", 128, 768, 1440, "bfloat16"),
    ("k_1cta_f32", "k", 128, 160, 96, "float32"),
]


def _nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if hits:
            return hits[0]
    return None


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import glob, json, os, shutil, sys, time
    import torch
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {here!r})
    from moe_mxfp8.kernels import grouped_gemm_sm100 as K
    from sm100_emu import layout_swizzles
    out_dir, variants = sys.argv[1], json.loads(sys.argv[2])
    times, swizzles = {{}}, {{}}
    for name, mode, mma_m, n, k, dt in variants:
        cfg = K.Sm100GroupedConfig(mode, n, k, getattr(torch, dt), mma_m, 128)
        t = time.time()
        K.compile_kernel(cfg)  # the persistent grid is a launch argument
        times[name] = round(time.time() - t, 2)
        swizzles[name] = layout_swizzles(cfg)
        # cubin and PTX land in CUTE_DSL_DUMP_DIR under names that do not tell variants apart.
        os.makedirs(os.path.join(out_dir, name))
        for f in glob.glob(os.path.join(out_dir, "*.cubin")) + glob.glob(
                os.path.join(out_dir, "*.ptx")):
            shutil.move(f, os.path.join(out_dir, name))
    print(json.dumps(times))
    print(json.dumps(swizzles))
    """
)


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    """SASS text of every variant, compiled for sm_100a in one subprocess (one DSL import)."""
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    pytest.importorskip("cutlass")
    out = tmp_path_factory.mktemp("sm100_cubins")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", CUTE_DSL_DUMP_DIR=str(out),
               CUTE_DSL_KEEP="cubin,ptx")
    script = _COMPILE_SCRIPT.format(repo=str(REPO), here=str(Path(__file__).parent))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(out), json.dumps(VARIANTS)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"sm_100a compile failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    print("sm_100a compile seconds:", proc.stdout.strip().splitlines()[-2])
    result = {"swizzles": json.loads(proc.stdout.strip().splitlines()[-1])}
    for name, *_ in VARIANTS:
        cubins = glob.glob(str(out / name / "*.cubin"))
        assert len(cubins) == 1, f"{name}: expected one cubin, found {cubins}"
        dis = subprocess.run([nvdisasm, "-c", cubins[0]], capture_output=True, text=True,
                             check=True)
        ptx = glob.glob(str(out / name / "*.ptx"))
        assert len(ptx) == 1, f"{name}: expected one PTX file, found {ptx}"
        result[name] = dis.stdout
        result[name + ".ptx"] = Path(ptx[0]).read_text()
    return result


def _opcodes(text: str) -> set[str]:
    """Opcodes (with modifiers) of nvdisasm output lines."""
    ops = set()
    for line in text.splitlines():
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops.add(m.group(1))
    return ops


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_sm100_sass(sass, variant):
    name, mma_m = variant[0], variant[2]
    ops = _opcodes(sass[name])
    two_cta = mma_m == 256
    mma = {op for op in ops if op.startswith("UTCQMMA")}
    utccp = {op for op in ops if op.startswith("UTCCP")}
    assert mma, f"{name}: no block-scaled tcgen05.mma (UTCQMMA) in SASS"
    assert utccp, f"{name}: no tcgen05.cp SMEM->TMEM scale copy (UTCCP) in SASS"
    if two_cta:
        assert all(".2CTA" in op for op in mma | utccp), (name, mma, utccp)
    else:
        assert not any(".2CTA" in op for op in mma | utccp), (name, mma, utccp)
    assert any(op.startswith("UTMALDG") for op in ops), f"{name}: no TMA load"
    assert any(op.startswith("UTMASTG") for op in ops), f"{name}: no TMA store"
    spills = sorted(op for op in ops if op.split(".")[0] in ("LDL", "STL"))
    assert not spills, f"{name}: local memory traffic (spills?) {spills}"


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_sm100_ptx_is_mxfp8_block32(sass, variant):
    """The MMA is the MXFP8 form: kind::mxf8f6f4 with block_scale.block32 (E8M0, 32-vectors),
    on cta_group::2 for the CTA-pair variant; scales reach TMEM by tcgen05.cp."""
    name, mma_m = variant[0], variant[2]
    ptx = sass[name + ".ptx"]
    group = "cta_group::2" if mma_m == 256 else "cta_group::1"
    mmas = re.findall(r"tcgen05\.mma\.[\w:.]+", ptx)
    assert mmas and all(
        op.startswith(f"tcgen05.mma.{group}.kind::mxf8f6f4.block_scale.block32") for op in mmas
    ), mmas
    assert re.search(rf"tcgen05\.cp\.{group}\.", ptx), "no tcgen05.cp of the scales"


def test_sm100_sass_counts(sass):
    """One MMA instruction per 32-wide k-block of the 128-wide k-tile (4), and one scale copy
    each for SFA and SFB per k-tile."""
    for name, *_ in VARIANTS:
        text = sass[name]
        assert len(re.findall(r"\bUTCQMMA", text)) == 4, name
        assert len(re.findall(r"\bUTCCP", text)) == 2, name


# ---------------------------------------------------------------------------------------------
# static PTX checks: generic-proxy stores into swizzled buffers; descriptor facts
# ---------------------------------------------------------------------------------------------

# The first version's K-grouped tail zeroing as compiled (its byte view dropped the swizzle):
# the address is base + 17408 (A buffer) + stage * 16384 + r * 128 + kb * 32 + c, no XOR.
_UNSWIZZLED_TAIL_PTX = """
	cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r13+17408], [%rd23, {%r12, %r8}], [%r11];
	cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r13+115712], [%rd25, {%r12, %r7}], [%r11];
	cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r14+214016], [%rd27, {%r122, %r121}], [%r11];
	cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r14+217088], [%rd29, {%r126, %r125}], [%r11];
	shl.b32 	%r229, %r445, 14;
	add.s32 	%r44, %r229, %r42;
	shl.b32 	%r230, %r440, 7;
	add.s32 	%r45, %r230, %r44;
	add.s32 	%r231, %r45, %r441;
	add.s32 	%r232, %r4, %r231;
	st.shared.b8 	[%r232+17408], 0;
	cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%rd65, {%r486, %r60, %r506}], [%r438+1024];
"""  # noqa: E501


def _check_shared_stores(ptx: str, swizzles) -> list[str]:
    """Problems with the generic-proxy shared stores of one kernel's PTX: each must write a
    known buffer (operands A/B or the output staging C; never the scale buffers, which the
    MMA reads through unswizzled descriptors) and carry that buffer's swizzle."""
    from sm100_ptx import shared_stores, swizzle_signature

    want = {"a": swizzle_signature(swizzles[0]), "b": swizzle_signature(swizzles[1]),
            "c": swizzle_signature(swizzles[2])}
    problems = []
    for line, op, buf, swz in shared_stores(ptx):
        if buf not in want:
            problems.append(f"line {line}: {op} into {buf or 'an unidentified buffer'}")
        elif swz != want[buf]:
            problems.append(f"line {line}: {op} into {buf} carries swizzle {swz}, the layout "
                            f"has {want[buf]}")
    return problems


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_sm100_ptx_shared_stores_carry_the_swizzle(sass, variant):
    """Every generic-proxy ``st.shared`` into an operand stage (the K-grouped tail zeroing) or
    the output staging buffer computes its address with the swizzle of the buffer's CuTeDSL
    layout (the TMA and the MMA descriptors use the same swizzle, so any other addressing
    writes bytes the MMA reads for other elements)."""
    name = variant[0]
    swz = sass["swizzles"][name]
    assert _check_shared_stores(sass[name + ".ptx"], swz) == []
    from sm100_ptx import shared_stores

    stores = shared_stores(sass[name + ".ptx"])
    operand = [s for s in stores if s[2] in ("a", "b")]
    # K-grouped: the tail zeroing of A and of B; M-grouped: no generic store to operands.
    assert len(operand) == (2 if variant[1] == "k" else 0), operand
    # The check itself fails on the first version's unswizzled tail zeroing.
    bad = _check_shared_stores(_UNSWIZZLED_TAIL_PTX, swz)
    assert len(bad) == 1 and "into a carries swizzle None" in bad[0], bad


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_sm100_partial_tile_stores_are_16_bytes(sass, variant):
    """M-grouped partial tiles leave by 16-byte vector stores (a thread's 32-column subtile row:
    64 B in bf16 = 4 stores, 128 B in fp32 = 8); K-grouped tiles all leave by TMA."""
    name, mode, dt = variant[0], variant[1], variant[5]
    stores = re.findall(r"\bst\.global\.[\w.]+", sass[name + ".ptx"])
    if mode == "k":
        assert stores == [], stores
    else:
        per_subtile = 32 * (2 if dt == "bfloat16" else 4) // 16
        assert len(stores) == per_subtile, stores
        assert set(stores) <= {"st.global.v4.b32", "st.global.v2.b64", "st.global.v4.f32"}
        stg = [op for op in _opcodes(sass[name]) if op.startswith("STG")]
        assert stg and all(op.split(".")[1] == "E" and op.endswith("128") for op in stg), stg


def _u32(x: int) -> int:
    return x & 0xFFFFFFFF


def _s32(x: int) -> int:
    x = _u32(x)
    return x - (1 << 32) if x >= 1 << 31 else x


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_sm100_ptx_descriptor_facts(sass, variant):
    """The descriptor immediates of the compiled PTX, each derived from the PTX ISA."""
    name, mma_m = variant[0], variant[2]
    ptx = sass[name + ".ptx"]
    two = mma_m == 256
    group = 2 if two else 1
    mma_n = 128

    # Instruction descriptor, PTX ISA "Instruction descriptor format for .kind::mxf8f6f4":
    # bits 0-1 reserved, 2 dense (0), 4-5 B scale-factor id (runtime), 7-9 / 10-12 atype /
    # btype E4M3 = 0, 13 / 14 negate A / B (runtime MMA fields, off), 15 / 16 transpose A / B
    # (K-major: 0), 17-22 N >> 3, 23 scale type UE8M0 = 1, 27-28 M >> 7, 29-30 A scale-factor
    # id (runtime). The compiler selects between idesc and idesc | negate-A.
    idesc = ((mma_n >> 3) << 17) | (1 << 23) | ((mma_m >> 7) << 27)
    assert idesc == (0x08A00000 if not two else 0x10A00000)
    pairs = re.findall(r"selp\.b32\s+%r\d+, (-?\d+), (-?\d+), %p\d+;", ptx)
    assert (str(_s32(idesc | 1 << 13)), str(_s32(idesc))) in pairs, "MMA instruction descriptor"
    assert (str(1 << 14), "0") in pairs, "negate-B field"
    n_mma = len(re.findall(r"tcgen05\.mma\.", ptx))
    assert n_mma == 4, n_mma  # one per 32-wide k-block of a 128-wide k-tile

    # Scale-factor ids: the DSL carries k-block kb's scale column byte in bits 30-31 of the
    # TMEM scale address; the idesc takes it at bits 29-30 (A: address >> 1, mask 0x60000000)
    # and bits 4-5 (B: address >> 26, mask 0x30).
    assert re.search(r"and\.b32\s+%r\d+, %r\d+, 1610612736;", ptx), "A scale-factor id field"
    assert re.search(r"shr\.u32\s+%r\d+, %r\d+, 26;", ptx) and re.search(
        r"and\.b32\s+%r\d+, %r\d+, 48;", ptx), "B scale-factor id field"

    # TMEM columns: accumulators 2 stages x 128 columns (fp32, one lane per row), then SFA,
    # then SFB. tcgen05.cp .32x128b.warpx4 copies 32 lanes x 128 bits (one 512-byte packed
    # tile: lane r % 32 holds the 16 bytes of rows r, r + 32, r + 64, r + 96 x 4 blocks) into
    # all four 32-lane quadrants (block scaling needs the scales in every lane quadrant), so a
    # tile takes 4 columns; 16 are reserved per 128 rows (the DSL's SF layout).
    acc_cols = 2 * mma_n
    sfa_col = acc_cols
    sfb_col = acc_cols + 16 * (mma_m // group // 128)
    adds = {int(v) for v in re.findall(r"add\.s32\s+%r\d+, %r\d+, (-?\d+);", ptx)}
    for kb in range(4):  # column, plus the k-block's scale byte in address bits 30-31
        assert _s32(sfa_col + (kb << 30)) in adds, ("SFA TMEM address", kb)
        assert _s32(sfb_col + (kb << 30)) in adds, ("SFB TMEM address", kb)
    cps = re.findall(r"tcgen05\.cp\.[\w:.]+", ptx)
    assert cps == [f"tcgen05.cp.cta_group::{group}.32x128b.warpx4"] * 2, cps

    # Shared-memory matrix descriptors (PTX ISA "Shared memory descriptor"): bits 16-29 LBO
    # >> 4, 32-45 SBO >> 4, 46-48 fixed 0b001, 61-63 swizzle mode (2 = 128-byte swizzle).
    # Operands (K-major, 128-byte swizzle): LBO unused (1), SBO = 8 rows x 128 B = 1024.
    # Scales (no swizzle): LBO 16 B, SBO = 128 B between the 8-row groups of the 32x128b copy.
    def sdesc(lbo, sbo, swz):
        return ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 46) | (swz << 61)

    ors = {int(v) for v in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (-?\d+);", ptx)}
    assert sdesc(16, 1024, 2) in ors, "operand smem descriptor"
    assert sdesc(16, 128, 0) in ors, "scale smem descriptor"

    # Transaction bytes per stage (mbarrier expect_tx, on the leader CTA for a pair): per CTA
    # A 128 x 128 + B (128 / CTAs) x 128 fp8 bytes + one 512-byte SFA tile + one SFB tile.
    per_cta = 128 * 128 + (mma_n // group) * 128 + 2 * 512
    tx = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    assert [int(v) for _, v in tx] == [per_cta * group], tx

    commits = re.findall(r"tcgen05\.commit\.[\w:.]+", ptx)
    if two:
        # Pair: TMA copies complete on the leader CTA's barrier (shared::cluster address with
        # the peer-CTA bit 24 cleared; low 3 bits cleared, 8-byte mbarrier): mask 0xFEFFFFF8.
        assert re.search(rf"and\.b32\s+%r\d+, %r\d+, {_s32(0xFEFFFFF8)};", ptx)
        # MMA completion is multicast to the barriers of both CTAs (cta mask 0b11): the
        # accumulator-full commit with an immediate mask, the stage-free commit with
        # (1 << rank) | (1 << (rank ^ 1)).
        assert commits == ["tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::"
                           "cluster.multicast::cluster.b64"] * 2, commits
        assert re.search(r"mov\.b16\s+%rs\d+, 3;\s*\n\s*tcgen05\.commit", ptx)
        assert re.search(r"xor\.b32\s+%r\d+, %r\d+, 1;", ptx)
    else:
        assert commits == ["tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::"
                           "cluster.b64"] * 2, commits


# ---------------------------------------------------------------------------------------------
# host logic (no compile)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def K():
    pytest.importorskip("cutlass")
    from moe_mxfp8.kernels import grouped_gemm_sm100
    from sm100_emu import sm100_target

    # Host functions that build the kernel's tcgen05 layouts (stage count, check problems)
    # need the sm_100a target even where another GPU is present.
    with sm100_target():
        yield grouped_gemm_sm100


def _m_offsets(sizes, n, k):
    """Expected tile indices of M-mode scales from the layout module (the contract)."""
    nb = L.ceil_div(k, L.BLOCK_SIZE)
    return nb, L.expert_scale_stride(n, nb)


@pytest.mark.parametrize("mma_m", [128, 256])
def test_scale_tile_index_mode_m(K, mma_m):
    sizes, n, k = [300, 0, 37, 531], 2880, 2880 + 64
    nb, stride = _m_offsets(sizes, n, k)
    p_start, tb = 0, 0
    for g, m_g in enumerate(sizes):
        for mt in range(L.ceil_div(m_g, mma_m)):
            for nt in range(L.ceil_div(n, 128)):
                for v in range(mma_m // 128):
                    sfa, sfb, step = K.scale_tile_index("m", n, k, mma_m, 128, mt, nt, v, g,
                                                        m_g, tb)
                    for kt in (0, 1, L.ceil_div(k, 128) - 1):
                        row = p_start + mt * mma_m + v * 128
                        want_a = L.packed_scale_offset(row, 4 * kt, nb)
                        assert (sfa + kt) * 512 == want_a
                        want_b = g * stride + L.packed_scale_offset(nt * 128, 4 * kt, nb)
                        assert (sfb + kt) * 512 == want_b
                        assert step == L.ceil_div(nb, 4)
        p_start += L.round_up(m_g, 128)
        tb += L.ceil_div(m_g, 128)


def test_scale_tile_index_mode_k(K):
    sizes, n, k = [100, 0, 33, 171, 300], 288, 160
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    tb = 0
    for rows, which in ((n, "a"), (k, "b")):
        tb = 0
        nbt = L.grouped_k_num_blocks(offs)
        byte_off, _ = L.grouped_k_offsets(offs, rows, nbt)
        _, block_id, local = L.grouped_k_block_index(offs, int(offs[-1]))
        starts = L.group_starts(offs)
        for g, m_g in enumerate(sizes):
            if m_g == 0:
                continue
            for rt in range(L.ceil_div(rows, 128)):
                if which == "a":
                    sfa, _, _ = K.scale_tile_index("k", n, k, 128, 128, rt, 0, 0, g, m_g, tb)
                    first = sfa
                else:
                    _, sfb, _ = K.scale_tile_index("k", n, k, 128, 128, 0, rt, 0, g, m_g, tb)
                    first = sfb
                for kt in range(L.ceil_div(m_g, 128)):
                    tok = int(starts[g]) + kt * 128  # first token of the k-tile
                    j = int(block_id[tok])
                    assert int(local[tok]) == 4 * kt
                    assert (first + kt) * 512 == int(byte_off[rt * 128, j]) // 512 * 512
            tb += L.ceil_div(m_g, 128)


_WALK_COLS = ("cluster", "g", "mt", "nt", "v", "a_row", "b_row", "b_l", "k0", "k_tiles", "sfa",
              "sfb", "sfb_step", "row0", "col0", "c_l", "valid_rows")


def _walk(K, mode, sizes, n, k, mma_m, clusters):
    """Run the kernel's own schedule code (its @cute.jit cursor/tile methods) on the host:
    the persistent walk of every cluster, one record per (work unit, CTA of the pair)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    kern = K.Sm100GroupedBlockScaledGemm(K.Sm100GroupedConfig(mode, n, k, torch.bfloat16,
                                                              mma_m, 128))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rec = torch.full((16384, len(_WALK_COLS)), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)

    @cute.jit
    def walk(offs_t, rec_t, cnt, n_clusters):  # (annotations: see `from __future__`)
        kern.num_tokens = Int32(offs_t[cute.size(offs_t) - 1])  # group ends clamp to it
        r = Int32(0)
        for c in cutlass.range(n_clusters, unroll=1):
            unit = c
            cur = kern._start_cursor(offs_t)
            cur = kern._seek(offs_t, unit, cur)
            while cur[0] < cute.size(offs_t):
                mt, nt = kern._tile_coords(unit, cur)
                a_row, b_row, b_l, k0 = kern._a_rows(mt, nt, cur)
                for v in cutlass.range_constexpr(kern.atom_thr):
                    sfa, sfb, step = kern._sf_tiles(mt, nt, Int32(v), cur)
                    row0, col0, c_l, valid = kern._out_tile(unit, Int32(v), cur)
                    vals = (c, cur[0], mt, nt, Int32(v), a_row, b_row, b_l, k0,
                            kern._k_tiles(cur), sfa, sfb, step, row0, col0, c_l, valid)
                    for j in cutlass.range_constexpr(len(vals)):
                        rec_t[r, j] = Int32(vals[j])
                    r = r + 1
                unit = unit + n_clusters
                cur = kern._seek(offs_t, unit, cur)
        cnt[0] = r

    walk(from_dlpack(offs), from_dlpack(rec), from_dlpack(count), Int32(clusters))
    assert int(count) < rec.shape[0]
    return [dict(zip(_WALK_COLS, row, strict=True)) for row in rec[: int(count)].tolist()]


def _expected_walk(mode, sizes, n, k, mma_m, clusters):
    """The same schedule from the contract: tiles numbered group by group (m-tile, then
    n-tile), unit u on cluster u % clusters; scale tiles from `moe_mxfp8.layout`."""
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    starts = [0, *offs.tolist()[:-1]]
    rows = []
    unit = 0
    if mode == "m":
        nb = L.ceil_div(k, 32)
        p_start = 0
        for g, m_g in enumerate(sizes):
            for mt in range(L.ceil_div(m_g, mma_m)):
                for nt in range(L.ceil_div(n, 128)):
                    for v in range(mma_m // 128):
                        a_row = starts[g] + mt * mma_m
                        row0 = a_row + v * 128
                        rows.append(dict(
                            cluster=unit % clusters, g=g, mt=mt, nt=nt, v=v, a_row=a_row,
                            b_row=nt * 128, b_l=g, k0=0, k_tiles=L.ceil_div(k, 128),
                            sfa=L.packed_scale_offset(p_start + mt * mma_m + v * 128, 0, nb)
                            // 512,
                            sfb=(g * L.expert_scale_stride(n, nb)
                                 + L.packed_scale_offset(nt * 128, 0, nb)) // 512,
                            sfb_step=L.ceil_div(nb, 4), row0=row0, col0=nt * 128, c_l=0,
                            valid_rows=min(starts[g] + m_g - row0, 128)))
                    unit += 1
            p_start += L.round_up(m_g, 128)
        return rows
    nbt = L.grouped_k_num_blocks(offs)
    off_a, _ = L.grouped_k_offsets(offs, n, nbt)
    off_b, _ = L.grouped_k_offsets(offs, k, nbt)
    _, block_id, _ = L.grouped_k_block_index(offs, int(offs[-1]))
    for g, m_g in enumerate(sizes):
        for mt in range(L.ceil_div(n, 128)):
            for nt in range(L.ceil_div(k, 128)):
                row = dict(cluster=unit % clusters, g=g, mt=mt, nt=nt, v=0, a_row=mt * 128,
                           b_row=nt * 128, b_l=0, k0=starts[g], k_tiles=L.ceil_div(m_g, 128),
                           sfb_step=L.ceil_div(m_g, 128), row0=mt * 128, col0=nt * 128, c_l=g,
                           valid_rows=128)
                if m_g:  # an empty group loads no scales
                    j = int(block_id[starts[g]])
                    row["sfa"] = int(off_a[mt * 128, j]) // 512
                    row["sfb"] = int(off_b[nt * 128, j]) // 512
                rows.append(row)
                unit += 1
    return rows


@pytest.mark.parametrize(
    "mode,sizes,n,k,mma_m,clusters",
    [
        ("m", (130, 0, 37, 133, 0), 160, 288, 128, 3),
        ("m", (300, 0, 531, 1), 96, 2880, 256, 4),
        ("m", (0, 0, 5), 128, 128, 128, 7),
        ("k", (100, 0, 33, 171, 0), 160, 96, 128, 5),
        ("k", (16, 129, 0, 207), 288, 160, 128, 2),
    ],
)
def test_device_schedule_covers_every_tile_once(K, mode, sizes, n, k, mma_m, clusters):
    """Each output tile is visited by exactly one cluster, with the right operand origins,
    k-tile count, packed-scale tiles and stored rows (the kernel's code, run on the host)."""
    got = _walk(K, mode, sizes, n, k, mma_m, clusters)
    want = _expected_walk(mode, sizes, n, k, mma_m, clusters)

    def key(r):
        return (r["g"], r["mt"], r["nt"], r["v"])

    got, want = sorted(got, key=key), sorted(want, key=key)
    assert [key(r) for r in got] == [key(r) for r in want]
    for g_row, w_row in zip(got, want, strict=True):
        for col, val in w_row.items():
            assert g_row[col] == val, (col, g_row, w_row)


def test_select_config(K):
    from moe_mxfp8.kernels import grouped_gemm_common as ggc

    def prob(mode, m, e):
        return ggc.GroupedProblem(mode, m, 256, 512, e, torch.bfloat16, 1, torch.device("cpu"))

    assert K.select_config(prob("m", 4096, 8)).two_cta  # mean group 512 rows
    assert not K.select_config(prob("m", 1000, 8)).two_cta
    assert not K.select_config(prob("k", 1 << 16, 2)).two_cta  # tail fix-up needs one CTA
    kern = K.Sm100GroupedBlockScaledGemm(K.select_config(prob("k", 1000, 2)))
    ok, why = kern.can_implement(prob("k", 1000, 2))
    assert not ok and "multiple of 16" in why
    assert kern.can_implement(prob("k", 1024, 2))[0]


def test_selfcheck_problems_fit_the_kernel(K):
    """The first-use check must be runnable by the sm100 kernel (else it would refuse to run
    for the wrong reason) and must cover both M-grouped tile configurations."""
    from moe_mxfp8.kernels import grouped_gemm_common as ggc

    configs = set()
    for mode, probs in selfcheck.DEFAULT_PROBLEMS.items():
        for prob in probs:
            m = sum(prob.sizes)
            p = ggc.GroupedProblem(mode, m, prob.n, prob.k, len(prob.sizes), prob.out_dtype, 1,
                                   torch.device("cpu"))
            cfg = K.select_config(p)
            ok, why = K.Sm100GroupedBlockScaledGemm(cfg).can_implement(p)
            assert ok, (prob, why)
            assert 0 in prob.sizes
            configs.add((mode, cfg.two_cta))
    assert configs == {("m", False), ("m", True), ("k", False)}


# ---------------------------------------------------------------------------------------------
# dispatch on compute capability 10.x
# ---------------------------------------------------------------------------------------------


def test_dispatch_selects_sm100(monkeypatch):
    pytest.importorskip("cutlass")
    from moe_mxfp8.kernels import lookup

    from moe_mxfp8 import backend

    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    dev = torch.device("cuda", 0)
    assert backend.resolve_backend("auto", dev) == "sm100"
    assert backend.resolve_backend("sm100", dev) == "sm100"
    from moe_mxfp8.kernels import grouped_gemm_sm100

    assert lookup("grouped_mm_m", "sm100") is grouped_gemm_sm100.grouped_mm_m
    assert lookup("grouped_mm_k", "sm100") is grouped_gemm_sm100.grouped_mm_k
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 3))
    assert backend.resolve_backend("auto", dev) == "sm100"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(RuntimeError, match="sm100 needs 10.x"):
        backend.resolve_backend("sm100", dev)


# ---------------------------------------------------------------------------------------------
# first-use self-check (CPU, stand-in kernels)
# ---------------------------------------------------------------------------------------------

# Smaller than the defaults (fast on CPU) but with the same traps: empty groups, partial tiles.
SMALL = {
    "m": (selfcheck.CheckProblem((40, 0, 70), n=64, k=96),),
    "k": (selfcheck.CheckProblem((48, 0, 35), n=64, k=32, out_dtype=torch.float32),),
}


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    selfcheck.reset()
    yield
    selfcheck.reset()


def _counting(fn):
    calls = []

    def kernel(a, b, offs, out_dtype, *unused, **launch):  # (groups_aligned, max_clusters)
        calls.append(launch)
        return fn(a, b, offs, out_dtype)

    return kernel, calls


@pytest.mark.parametrize("mode", ["m", "k"])
def test_selfcheck_accepts_reference_default_problems(mode):
    assert selfcheck.run_selfcheck(R.grouped_mm, mode, "cpu") is None


def _scaled(a, b, offs, dt):
    return (R.grouped_mm(a, b, offs, torch.float32) * 1.05).to(dt)


def _last_group_zero(a, b, offs, dt):
    out = R.grouped_mm(a, b, offs, dt)
    if out.dim() == 2:
        out[int(offs[-2]):] = 0  # forgot the rows of the last group
    else:
        out[-1] = 0
    return out


def _empty_group_garbage(a, b, offs, dt):
    out = R.grouped_mm(a, b, offs, dt)
    out[1] = 1.0  # mode k: group 1 is empty and must be zeros
    return out


def _unwritten(a, b, offs, dt):
    out = R.grouped_mm(a, b, offs, dt)
    out.view(-1)[-5:] = float("nan")  # a few elements never stored
    return out


def _raises(a, b, offs, dt):
    raise RuntimeError("CUDA error: illegal instruction")


def _wrong_dtype(a, b, offs, dt):
    return R.grouped_mm(a, b, offs, torch.float16)


@pytest.mark.parametrize(
    "mode,bad,expect",
    [
        ("m", _scaled, "error"),
        ("m", _last_group_zero, "error"),
        ("m", _unwritten, "NaN"),
        ("m", _raises, "illegal instruction"),
        ("k", _empty_group_garbage, "empty group 1"),
        ("k", _last_group_zero, "error"),
        ("k", _wrong_dtype, "float16"),
    ],
)
def test_selfcheck_rejects_wrong_kernels(mode, bad, expect):
    why = selfcheck.run_selfcheck(bad, mode, "cpu", SMALL[mode])
    assert why is not None and expect in why


def test_ensure_verified_caches_pass():
    kernel, calls = _counting(R.grouped_mm)
    selfcheck.ensure_verified("test.op_m", kernel, "cpu", problems=SMALL["m"])
    n = len(calls)
    assert n == len(SMALL["m"])
    selfcheck.ensure_verified("test.op_m", kernel, "cpu", problems=SMALL["m"])
    assert len(calls) == n  # cached: the kernel is not run again
    assert selfcheck.verdict("test.op_m", "cpu") is None


def test_ensure_verified_refuses_and_caches_failure():
    kernel, calls = _counting(_scaled)
    for _ in range(2):
        with pytest.raises(selfcheck.KernelSelfCheckError) as err:
            selfcheck.ensure_verified("test.op_k", kernel, "cpu", problems=SMALL["k"])
        assert "backend='reference'" in str(err.value)
        assert "test.op_k" in str(err.value)
    assert len(calls) == 1  # the failing verdict is cached; the kernel never runs again


def test_ensure_verified_needs_a_mode():
    with pytest.raises(ValueError, match="mode"):
        selfcheck.ensure_verified("test.op", R.grouped_mm, "cpu")


@pytest.mark.parametrize("op", ["grouped_mm_m", "grouped_mm_k"])
def test_sm100_entry_points_are_guarded(K, monkeypatch, op):
    """The sm100 entry points run the self-check first, with the unchecked kernel."""
    mode = op[-1]
    bad, bad_calls = _counting(_scaled)
    monkeypatch.setattr(K, f"_{op}_unchecked", bad)
    monkeypatch.setattr(selfcheck, "DEFAULT_PROBLEMS", {**selfcheck.DEFAULT_PROBLEMS, **SMALL})
    a, b, offs = selfcheck.make_operands(mode, SMALL[mode][0], "cpu", seed=7)
    with pytest.raises(selfcheck.KernelSelfCheckError, match="backend='reference'"):
        getattr(K, op)(a, b, offs, torch.bfloat16)
    assert len(bad_calls) == 1  # ran in the check only; the real call was refused

    selfcheck.reset()
    good, good_calls = _counting(R.grouped_mm)
    monkeypatch.setattr(K, f"_{op}_unchecked", good)
    out = getattr(K, op)(a, b, offs, torch.bfloat16)
    torch.testing.assert_close(out, R.grouped_mm(a, b, offs, torch.bfloat16))
    assert len(good_calls) == 2  # one check problem, then the call itself


class _Never:
    """A completion marker that never completes (a hung kernel)."""

    def query(self):
        return False


class _Faulted:
    """A completion marker whose query reports an asynchronous device fault."""

    def query(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("mode", ["m", "k"])
def test_selfcheck_refuses_a_hang(mode):
    """A kernel whose work never completes: the watchdog gives up after the timeout and the
    check refuses, naming the problem (it does not wait forever)."""
    kernel, calls = _counting(R.grouped_mm)
    t0 = time.monotonic()
    why = selfcheck.run_selfcheck(kernel, mode, "cpu", SMALL[mode], timeout_s=0.2,
                                  fence=lambda dev: _Never())
    assert time.monotonic() - t0 < 5
    assert why is not None and "did not finish within 0.2 s" in why and "N=64" in why
    assert len(calls) == 1


@pytest.mark.parametrize("mode", ["m", "k"])
def test_selfcheck_refuses_a_device_fault(mode):
    """An asynchronous fault surfacing while waiting is caught and reported as a refusal."""
    kernel, _ = _counting(R.grouped_mm)
    why = selfcheck.run_selfcheck(kernel, mode, "cpu", SMALL[mode], timeout_s=5,
                                  fence=lambda dev: _Faulted())
    assert why is not None and "device fault" in why and "illegal memory access" in why


def test_ensure_verified_names_the_configuration_of_a_fault():
    kernel, _ = _counting(R.grouped_mm)
    cfg = ("k", 64, 32, "float32", "1cta")
    with pytest.raises(selfcheck.KernelSelfCheckError) as err:
        selfcheck.ensure_verified("test.op_k", kernel, "cpu", problems=SMALL["k"], config=cfg,
                                  fence=lambda dev: _Faulted())
    assert str(cfg) in str(err.value) and "device fault" in str(err.value)
    assert selfcheck.verdict("test.op_k", "cpu", cfg) not in (None, False)


def test_verdict_is_keyed_on_the_compiled_configuration():
    """Each compiled configuration is checked once; a failure of one does not condemn another,
    and a passing one does not vouch for another."""
    good, good_calls = _counting(R.grouped_mm)
    bad, bad_calls = _counting(_scaled)
    cfg_a, cfg_b = ("m", 64, 96, "bf16"), ("m", 64, 128, "bf16")
    selfcheck.ensure_verified("test.op_m", good, "cpu", problems=SMALL["m"], config=cfg_a)
    selfcheck.ensure_verified("test.op_m", good, "cpu", problems=SMALL["m"], config=cfg_a)
    assert len(good_calls) == 1
    with pytest.raises(selfcheck.KernelSelfCheckError, match="compiled for"):
        selfcheck.ensure_verified("test.op_m", bad, "cpu", problems=SMALL["m"], config=cfg_b)
    assert len(bad_calls) == 1
    assert selfcheck.verdict("test.op_m", "cpu", cfg_a) is None
    assert selfcheck.verdict("test.op_m", "cpu", cfg_b) not in (None, False)


def test_selfcheck_passes_the_grid_cap():
    kernel, calls = _counting(R.grouped_mm)
    prob = dataclasses.replace(SMALL["m"][0], max_clusters=3)
    assert selfcheck.run_selfcheck(kernel, "m", "cpu", (prob,)) is None
    assert calls == [{"max_clusters": 3}]


# Every compiled configuration kind: mode, CTA mode, output dtype; N/K small and dsv3-sized.
_CHECK_CONFIGS = [
    ("m", 128, 160, 288, torch.bfloat16), ("m", 128, 4096, 7168, torch.float32),
    ("m", 256, 96, 160, torch.float32), ("m", 256, 7168, 2048, torch.bfloat16),
    ("k", 128, 160, 96, torch.bfloat16), ("k", 128, 4096, 7168, torch.float32),
    ("m", 128, 128, 128, torch.bfloat16),
]


@pytest.mark.parametrize("mode,mma_m,n,k,dt", _CHECK_CONFIGS)
def test_selfcheck_problems_wrap_the_pipeline(K, mode, mma_m, n, k, dt):
    """The check problem of a configuration selects that configuration, has an empty group
    and partial tiles, and -- walked by the kernel's own schedule code with its grid cap --
    gives every cluster >= 3 tiles (both accumulator stages wrap) and more k-tiles than ring
    stages (every stage barrier flips phase)."""
    from moe_mxfp8.kernels import grouped_gemm_common as ggc

    cfg = K.Sm100GroupedConfig(mode, n, k, dt, mma_m, 128)
    (prob,) = K.selfcheck_problems(cfg)
    stages = K.pipeline_stages(cfg)
    assert 3 <= stages <= 12
    m = sum(prob.sizes)
    p = ggc.GroupedProblem(mode, m, n, k, len(prob.sizes), dt, 1, torch.device("cpu"))
    assert K.select_config(p) == cfg
    assert K.Sm100GroupedBlockScaledGemm(cfg).can_implement(
        dataclasses.replace(p, m=ggc.k_aligned_extent(m, len(prob.sizes))) if mode == "k"
        else p)[0]
    assert 0 in prob.sizes and any(s % 128 for s in prob.sizes)
    sizes = prob.sizes if mode == "m" else tuple(-(-s // 16) * 16 for s in prob.sizes)
    walk = _walk(K, mode, sizes, n, k, mma_m, prob.max_clusters)
    per = {}
    for r in walk:
        if r["v"] == 0:
            units, kts = per.get(r["cluster"], (0, 0))
            per[r["cluster"]] = (units + 1, kts + r["k_tiles"])
    assert len(per) == prob.max_clusters, (per, prob)
    for units, kts in per.values():
        assert units >= 3 and kts > stages, (units, kts, stages, prob)
    # Cost: the kernel's FLOPs (the fp32 reference does the same again); < 50 GFLOP at dsv3.
    assert prob.flops() < 50e9, prob.flops()


# ---------------------------------------------------------------------------------------------
# Blackwell GPU (skipped everywhere else; no Blackwell GPU has run these yet)
# ---------------------------------------------------------------------------------------------

_BLACKWELL = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10
blackwell = pytest.mark.skipif(not _BLACKWELL, reason="needs a Blackwell (sm_100) GPU")


def _random_sizes(gen, m, e, empty=1):
    """``e`` group sizes summing to ``m`` (multiples of 16 when ``m`` is), ``empty`` of them 0."""
    cuts = torch.sort(torch.randint(0, m // 16 + 1, (e - 1 - empty,), generator=gen)).values * 16
    bounds = [0, *cuts.tolist(), m]
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return tuple(sizes[:1] + [0] * empty + sizes[1:])


@pytest.mark.gpu
@blackwell
@pytest.mark.parametrize("mode", ["m", "k"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,e", [(1000, 256, 512, 4), (4096, 384, 1024, 8),
                                     (8192, 2880, 2880, 8), (96, 128, 160, 3)])
def test_sm100_grouped_mm_matches_reference(K, mode, out_dtype, m, n, k, e):
    gen = torch.Generator().manual_seed(m + n + k + e)
    m = m if mode == "m" else m // 16 * 16
    prob = selfcheck.CheckProblem(_random_sizes(gen, m, e), n=n, k=k, out_dtype=out_dtype)
    a, b, offs = selfcheck.make_operands(mode, prob, "cuda", seed=e)
    fn = K.grouped_mm_m if mode == "m" else K.grouped_mm_k
    out = fn(a, b, offs, out_dtype)
    ref = R.grouped_mm(a, b, offs, torch.float32)
    assert selfcheck._compare(mode, prob, out, ref, offs) is None


@pytest.mark.gpu
@blackwell
@pytest.mark.parametrize("op", ["grouped_mm_m", "grouped_mm_k"])
def test_sm100_selfcheck_passes_on_device(K, op):
    selfcheck.ensure_verified(f"sm100.{op}", getattr(K, f"_{op}_unchecked"), "cuda")
    assert selfcheck.verdict(f"sm100.{op}", "cuda") is None


@pytest.mark.gpu
@blackwell
@pytest.mark.parametrize("mode,mma_m,n,k,dt", _CHECK_CONFIGS)
def test_sm100_pipeline_selfcheck_passes_on_device(K, mode, mma_m, n, k, dt):
    """The strengthened check (capped grid: ring and accumulator stages wrap) per configuration,
    timed: its cost per configuration is printed for docs/NOTES.md."""
    cfg = K.Sm100GroupedConfig(mode, n, k, dt, mma_m, 128)
    fn = K._grouped_mm_m_unchecked if mode == "m" else K._grouped_mm_k_unchecked
    t0 = time.perf_counter()
    selfcheck.ensure_verified(f"sm100.grouped_mm_{mode}", fn, "cuda", mode=mode, config=cfg,
                              problems=K.selfcheck_problems(cfg))
    print(f"self-check {cfg}: {time.perf_counter() - t0:.3f} s (incl. compile)")
    assert selfcheck.verdict(f"sm100.grouped_mm_{mode}", "cuda", cfg) is None
