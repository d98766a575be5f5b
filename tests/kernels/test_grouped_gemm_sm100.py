"""Blackwell grouped MXFP8 GEMM (kernels/grouped_gemm/sm100.py) -- CPU CI.

No Blackwell GPU ran this kernel. CI checks what can be checked without one:

* every variant compiles for sm_100a (fake pointers, in a subprocess with CUTE_DSL_ARCH set
  before CuTeDSL is imported) and its SASS holds the block-scaled MMA (UTCQMMA, .2CTA for the
  CTA-pair variant), the SMEM->TMEM scale copy (UTCCP), TMA loads/stores and no local memory
  (LDL/STL: register spills or stack arrays), and partial output tiles leave by 16-byte stores;
* its PTX: every store into shared memory at a computed address (``st.shared``, ``stmatrix``,
  ``st.async``, ``red``/``atom`` on shared memory, ``cp.async``: the K-grouped tail zeroing,
  the epilogue staging) carries the swizzle of the buffer's CuTeDSL layout, and the
  descriptor immediates (instruction descriptor, scale-factor ids, TMEM columns, scale copy
  shape, smem descriptors, transaction bytes, CTA-pair barrier masks) are the ones the PTX ISA
  derivation gives;
* its configuration choice, and the dispatcher picks it on compute capability 10.x.

The shared schedule and scale-tile addressing are tested in test_grouped_gemm_schedule.py, the
first-use self-check in test_selfcheck.py, and the full GEMM is emulated from the kernel's index
code in test_sm100_emulation.py.
"""

from __future__ import annotations

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

from moe_mxfp8 import grouped_gemm, selfcheck

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
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm import sm100 as K
    from sm100_emu import layout_swizzles
    out_dir, variants = sys.argv[1], json.loads(sys.argv[2])
    times, swizzles = {{}}, {{}}
    for name, mode, mma_m, n, k, dt in variants:
        cfg = K.GroupedGemmSm100Config(mode, n, k, getattr(torch, dt), mma_m, 128)
        t = time.time()
        launcher.compile_config(K.GroupedGemmSm100, cfg)  # the grid is a launch argument
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


# The buffers of _UNSWIZZLED_TAIL_PTX (TMA copies) and a store of each kind that writes shared
# memory at a computed address, into A: {addr} is a register holding base + A's offset,
# swizzled (x ^ ((x >> 3) & 112): the 128-byte swizzle S<3,4,3>) or not.
_BUFFERS_PTX = "\n".join(_UNSWIZZLED_TAIL_PTX.splitlines()[:5]) + """
	cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%rd65, {%r486, %r60, %r506}], [%r438+1024];
	add.s32 	%r50, %r13, 17408;
	shr.u32 	%r51, %r50, 3;
	and.b32 	%r52, %r51, 112;
	xor.b32 	%r53, %r50, %r52;
"""  # noqa: E501
_SMEM_WRITES = {
    "st.shared": "st.shared.b32 	[{addr}], %r1;",
    "stmatrix": "stmatrix.sync.aligned.m8n8.x4.shared.b16 	[{addr}], {{%r1, %r2, %r3, %r4}};",
    "st.async": "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 	[{addr}], %r1, "
                "[%r11];",
    "red.shared": "red.shared.add.u32 	[{addr}], %r1;",
    "red.async": "red.async.relaxed.cluster.shared::cluster.mbarrier::complete_tx::bytes.add"
                 ".u32 	[{addr}], %r1, [%r11];",
    "atom.shared": "atom.shared.add.u32 	%r70, [{addr}], %r1;",
    "cp.async": "cp.async.ca.shared.global 	[{addr}], [%rd5], 16;",
}
_SWIZZLES_128B = ["S<3,4,3>", "S<3,4,3>", "S<3,4,3>"]


@pytest.mark.parametrize("kind", list(_SMEM_WRITES))
def test_ptx_swizzle_check_covers_every_shared_store(kind):
    """The swizzle check reads every kind of shared-memory store, not only ``st.shared``: a
    store of any kind into a swizzled operand buffer without the swizzle is reported, and
    with the swizzle it passes."""
    store = "\t" + _SMEM_WRITES[kind] + "\n"
    bad = _check_shared_stores(_BUFFERS_PTX + store.format(addr="%r50"), _SWIZZLES_128B)
    assert len(bad) == 1 and "into a carries swizzle None" in bad[0], bad
    good = _check_shared_stores(_BUFFERS_PTX + store.format(addr="%r53"), _SWIZZLES_128B)
    assert good == [], good


def test_ptx_swizzle_check_ignores_what_writes_no_shared_memory():
    """Global stores, reductions and atomics, and the TMA copies themselves, are not checked."""
    from sm100_ptx import shared_stores

    others = ("\tst.global.v4.b32 	[%rd9], {%r1, %r2, %r3, %r4};\n"
              "\tred.global.add.u32 	[%rd9], %r1;\n"
              "\tatom.global.add.u32 	%r71, [%rd9], %r1;\n")
    assert shared_stores(_BUFFERS_PTX + others) == []


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
# host decisions (no compile)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def K():
    pytest.importorskip("cutlass")
    from moe_mxfp8.kernels.grouped_gemm import sm100
    from sm100_emu import sm100_target

    # host functions that build the kernel's tcgen05 layouts need the sm_100a target even
    # where another GPU is present
    with sm100_target():
        yield sm100


def test_select_config(K):
    from moe_mxfp8.kernels.grouped_gemm import problem as P

    def prob(mode, m, e):
        return P.GroupedProblem(mode, m, 256, 512, e, torch.bfloat16, "1x32",
                                torch.device("cpu"))

    select = K.GroupedGemmSm100.select_config
    assert select(prob("m", 4096, 8)).two_cta  # mean group 512 rows
    assert not select(prob("m", 1000, 8)).two_cta
    assert not select(prob("k", 1 << 16, 2)).two_cta  # tail fix-up needs one CTA
    kern = K.GroupedGemmSm100(select(prob("k", 1000, 2)))
    ok, why = kern.can_implement(prob("k", 1000, 2))
    assert not ok and "multiple of 16" in why
    assert kern.can_implement(prob("k", 1024, 2))[0]


# ---------------------------------------------------------------------------------------------
# dispatch on compute capability 10.x
# ---------------------------------------------------------------------------------------------


def test_dispatch_selects_sm100(monkeypatch):
    pytest.importorskip("cutlass")
    from moe_mxfp8 import backend

    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    dev = torch.device("cuda", 0)
    assert backend.resolve_backend("auto", dev) == "sm100"
    assert backend.resolve_backend("sm100", dev) == "sm100"
    from moe_mxfp8.kernels.grouped_gemm.sm100 import GroupedGemmSm100

    host = grouped_gemm._host_class("sm100")
    assert host.kernel_class() is GroupedGemmSm100 and issubclass(GroupedGemmSm100, host)
    assert host.check_on_first_use and GroupedGemmSm100.check_on_first_use
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 3))
    backend._capability_of_index.cache_clear()  # another GPU in its place: asked anew
    assert backend.resolve_backend("auto", dev) == "sm100"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backend._capability_of_index.cache_clear()
    with pytest.raises(RuntimeError, match="sm100 needs 10.x"):
        backend.resolve_backend("sm100", dev)


# ---------------------------------------------------------------------------------------------
# Blackwell GPU (skipped everywhere else; no Blackwell GPU has run these yet)
# ---------------------------------------------------------------------------------------------

_BLACKWELL = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10
blackwell = pytest.mark.skipif(not _BLACKWELL, reason="needs a Blackwell (sm_100) GPU")


@pytest.mark.gpu
@blackwell
@pytest.mark.parametrize("mode,mma_m,n,k,dt", [
    ("m", 128, 160, 288, torch.bfloat16), ("m", 128, 4096, 7168, torch.float32),
    ("m", 256, 96, 160, torch.float32), ("m", 256, 7168, 2048, torch.bfloat16),
    ("k", 128, 160, 96, torch.bfloat16), ("k", 128, 4096, 7168, torch.float32),
])
def test_sm100_pipeline_selfcheck_passes_on_device(K, mode, mma_m, n, k, dt):
    """The first-use check (capped grid: ring and accumulator stages wrap) per configuration,
    timed: its cost per configuration is printed (docs/design/blackwell_gemm.md)."""
    cfg = K.GroupedGemmSm100Config(mode, n, k, dt, mma_m, 128)
    t0 = time.perf_counter()
    selfcheck.verify_on_first_use(K.GroupedGemmSm100, cfg, "cuda")
    print(f"self-check {cfg}: {time.perf_counter() - t0:.3f} s (incl. compile)")
    assert selfcheck.verdict(f"GroupedGemmSm100.{mode}", "cuda", cfg) is None
