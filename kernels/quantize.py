"""MXFP8 quantizer kernels (CuTeDSL): rowwise, columnwise, dual and expert weights.

The kernel classes and `build_quantizer` (their compile); the configuration is in
`quantize_config`, the compile cache and entry points in `quantize_launch` (no CuTeDSL: a
process whose kernels load from the compile cache never imports this file).

Bit-exact with the pure-PyTorch reference next to the public entry points
(`moe_mxfp8.reference`, called by `moe_mxfp8.quantize`; the contract is ``docs/numerics.md``).
Scales are written straight into the packed (tcgen05) layout, pad bytes included, so no memset
is needed. The entry points return plain ``(data, scale)`` tensors; `moe_mxfp8.quantize` checks
the arguments before and wraps the result into an ``MXFP8Tensor`` after.

**Arch genericity.** One source compiles for sm_90a and sm_100a: the kernels use only SIMT
instructions that both have (`kernels/ptx.py`) -- 16-byte ``ld.global.nc``/``st.global``,
``shfl.sync``, shared memory, integer min/max and ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+,
``F2FP.SATFINITE.E4M3`` in SASS). No TMA, wgmma or tcgen05; `target_arch` (``CUTE_DSL_ARCH``)
only picks the cubin.

**One tile kernel, several front ends** (rowwise, columnwise, dual, expert weights; and the
data path's computed sources -- SwiGLU and its backward, the combine backward, the dispatch's
gather -- whose rows are computed in the load, `QuantConfig.source`). Every CTA (256 threads)
owns a 128-token x 128-feature
tile of ``x (M, K)`` (``x`` row-major, tokens = rows). Grid: ``ceil(K/128) * virtual token
tiles`` CTAs on one axis, feature tiles fastest. A *virtual token tile* is a 128-row tile of the
packed scale layout: with row groups (``offs``) each group's tiles start on a tile boundary
(contract, "Grouped layouts"), so tile ``t`` belongs to one group and covers up to 128 of its
tokens; tiles past the last group only write zero pad bytes. Both grouped layouts (rows: tile
``t`` is packed row tile ``t``; K-groups: group g's packed matrix starts at ``Rp * 4 * T_g``
bytes, ``T_g`` = tiles before g) are indexed by the same ``t``, which is why one grid serves
rowwise, columnwise and dual.

* load: each thread issues 8 (16-bit input) or 16 (fp32) independent 16-byte loads; a warp reads
  512 contiguous bytes per instruction (no TMA: plain vector loads already run above the copy
  ceiling, benchmarks/RESULTS.md "Quantizers"). Rows past the group end / features past K load
  as 0, which makes their scale byte 0 -- exactly the pad bytes the layout wants. A columnwise
  K that is not a multiple of the vector (rows not 16-byte aligned) loads element by element.
  Every global offset is 64-bit (tensors of 2^31 elements and more); extents are int32.
* rowwise (from registers): a 32-element block spans 4 lanes (16-bit) or 8 lanes (fp32); the
  block amax is the integer max of the fp32 ``|x|`` bit patterns, finished with ``shfl.bfly``.
* columnwise (through shared memory): the tile is stored row-major; a thread reads one 32-bit
  word down 32 tokens (lanes along features: conflict-free), takes the amax per feature,
  quantizes, stages the transposed bytes in shared memory, and the CTA writes ``x.T`` rows with
  16-byte stores (aligned case) or funnel-shifted aligned 4-byte stores plus byte stores at the
  two ends of a segment (arbitrary group starts / odd M).
* weights: axis K = rowwise over ``(E*N, K)`` with uniform groups of N rows (= the expert
  layout); axis N = columnwise with each expert's ``(K, N)`` block contiguous; ``block_rows=32``
  reduces the 32 column amaxes of a 32x32 tile across lanes first.

**The 1x128 recipe is the same tile** (docs/numerics.md, "The 1x128 recipe"): a 128-element
block along K is one row of the CTA tile, a 128-token block along the tokens is one column of it
(a virtual tile starts at its group's first token, exactly where the 128-blocks restart), and a
128x128 weight tile (per expert, partial at the edges) is the whole CTA tile. So ``act_block=128``
widens the row amax's butterfly from one 32-block's lanes to the row's 16 / 32 lanes, and
reduces a column's four 32-token amaxes across warps through shared memory; ``block_rows=128``
reduces the tile's sixteen 32x32 amaxes there. The four bytes of a 128-block are adjacent in
the packed layout (``c % 4`` is the fastest index), so one 32-bit store writes them, with 0 for
the 32-blocks past the data (pad bytes stay 0, as the reference packs them).

Scale exponent from the amax bits (never log2): ``e = E - 135 + (m > 0x600000)`` (RCEIL) or
``E - 135`` (FLOOR), clamped to [-127, 127]; 0xFF for NaN/Inf blocks. ``2^-e`` is built from
bits; the multiply is ``mul.rn.f32`` (no flush-to-zero: fp32 subnormal inputs scale exactly),
then ``cvt.rn.satfinite.e4m3x2.f32`` -- RNE with saturation to +-448, the same as the
reference's clamp-then-cast.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, const_expr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import AddressSpace

from . import mx_format as F
from .common import TORCH_TO_CUTLASS
from .native import cu_stream, current_stream
from .ptx import (
    add_f32_bits,
    cvt_e4m3x4,
    dot_bf16x2,
    f16_to_f32_bits,
    funnel_shift_right,
    ld_global_b32,
    ld_global_u16,
    ld_global_v4,
    ld_shared_b32,
    ld_shared_v4,
    scale_bf16x2,
    st_global,
    st_global_u8,
    st_shared,
    st_shared_pred,
    swiglu_bf16x2,
    swiglu_grad_bf16x2,
    swiglu_grad_pair_bf16x2,
)
from .quantize_config import (
    ACT_BLOCKS,
    ELEM_BYTES,
    SOURCES,
    TILE_BLOCK_ROWS,
    TILE_FEATURES,
    TILE_TOKENS,
    TORCH_DTYPES,
    VEC_BYTES,
    QuantConfig,
)

THREADS = 256
SM90_MAX_SMEM_PER_SM = 228 * 1024  # sm_90 and sm_100: the most shared memory an SM gives
SMEM_PER_CTA_RESERVED = 1024  # the driver's shared memory per CTA
STAGE_ROW_BYTES = TILE_TOKENS + 16  # transposed staging row, padded by 16 B against conflicts
SUBTILES = (TILE_TOKENS // F.BLOCK_SIZE) * F.TILE_BLOCKS  # 32x32 sub-tiles of a CTA tile: 16

ABS_MASK = 0x7FFFFFFF
BF16_HI_MASK = -65536  # 0xFFFF0000 as int32
NO_MATCH = 0x7FFFFFFF  # load default that never satisfies ``tile_end <= t``


def _log2(n: int) -> int:
    return n.bit_length() - 1


def unpack_f32_bits(word, half: int, dtype: str):
    """fp32 bits of element ``half`` (0 = lower address) of a 32-bit input word."""
    if dtype == "float32":
        return word
    if dtype == "bfloat16":
        return word << 16 if half == 0 else word & BF16_HI_MASK
    return f16_to_f32_bits(word, half)


def scale_from_amax(amax, rceil: bool):
    """(E8M0 byte, fp32 bits of 2^-e) from the fp32 bits of a block's |amax|."""
    exp_field = amax >> 23
    e = exp_field - F.E4M3_EMAX_BIASED
    if rceil:
        e = e + Int32((amax & 0x7FFFFF) > F.RCEIL_MANTISSA_THRESHOLD)
    e = cutlass.min(cutlass.max(e, -F.E8M0_BIAS), F.E8M0_BIAS)
    byte = cutlass.select_(exp_field == F.FP32_EXP_INF, Int32(F.E8M0_NAN), e + F.E8M0_BIAS)
    return byte, (F.E8M0_BIAS - e) << 23  # fp32 bits of 2^-e: a normal number for |e| <= 127


def replicated_word(byte, n_blocks):
    """The four packed bytes of one 128-block (``c % 4`` = 0..3, adjacent): ``byte`` in the
    first ``n_blocks`` (the 32-blocks that hold data), 0 in the pad blocks after them."""
    word = Int32(0)
    for b in range(F.TILE_BLOCKS):
        word = word | cutlass.select_(Int32(b) < n_blocks, byte << (8 * b), Int32(0))
    return word


# ---------------------------------------------------------------------------------------------
# The tile kernel
# ---------------------------------------------------------------------------------------------


class TileQuantizer:
    """Shared implementation; the four public classes below pick its flags."""

    def __init__(self, config: QuantConfig):
        self.cfg = config
        eb = ELEM_BYTES[config.dtype]
        self.elem_bytes = eb
        self.vec_elems = VEC_BYTES // eb  # elements per 16-byte vector: 8 or 4
        self.lanes_per_block = F.BLOCK_SIZE // self.vec_elems  # 4 or 8
        self.vecs_per_row = TILE_FEATURES * eb // VEC_BYTES  # 16 or 32
        self.vecs_per_thread = TILE_TOKENS * self.vecs_per_row // THREADS  # 8 or 16
        self.row_bytes = TILE_FEATURES * eb  # shared tile row: 256 or 512 bytes
        self.words_per_row = self.row_bytes // 4  # 64 or 128
        self.feats_per_word = 4 // eb  # 2 or 1
        self.col_tasks = self.words_per_row * 4 // THREADS  # (word column, block) per thread
        self.feat_tiles = F.ceil_div(config.k, TILE_FEATURES)
        # A row of x starts on a 16-byte boundary only if K fills whole vectors; otherwise (a
        # columnwise K that is not a multiple of 8 / 4) the tile loads element by element.
        self.vec_loads = config.k % self.vec_elems == 0
        self.k_padded = self.feat_tiles * TILE_FEATURES  # Rp of the colwise packed layout
        self.tiled = config.block_rows > 1  # weights' 32x32 / 128x128 scale tiles
        self.block32 = config.block_rows == F.BLOCK_SIZE
        act128 = config.act_block == F.BLOCK_128
        # a 128-block (or tile) spans the four 32-blocks of a packed word: one 32-bit store
        wide = act128 or config.block_rows == F.BLOCK_128
        self.wide_rows = config.rows and wide
        self.wide_cols = config.cols and wide
        self.col128 = config.cols and act128
        # lanes that share one rowwise amax: a 32-block's, or (1x128) the whole tile row's
        self.row_lanes = self.vecs_per_row if act128 else self.lanes_per_block
        # dh with H a multiple of the tile (``joint_halves``): a CTA makes the dgate and the dup
        # tile of one feature tile -- one read of gate / up / dA and one exp for both; the dup
        # tile waits in a second shared-memory region
        self.joint = (config.source == "swiglu_grad" and config.joint_halves
                      and (config.k // 2) % TILE_FEATURES == 0)
        self.grid_feat_tiles = self.feat_tiles // 2 if self.joint else self.feat_tiles
        self.needs_smem = config.cols or self.tiled or self.joint
        tile_bytes = TILE_TOKENS * self.row_bytes
        stage_bytes = TILE_FEATURES * STAGE_ROW_BYTES
        self.amax_offset = max(tile_bytes, stage_bytes)  # staging aliases the input tile
        # amax exchange slots: (32-token block, feature) for 1x128 columns, else 32x32 sub-tiles
        # (+ one per warp: the 128 x 128 column tiles' CTA-wide maximum, `column_tile_amax`)
        slots = (F.TILE_BLOCKS * TILE_FEATURES + (THREADS // 32 if config.col_tile else 0)
                 if self.col128 else SUBTILES if self.tiled else 0)
        self.smem_region = self.amax_offset + 4 * slots if self.needs_smem else 0
        self.smem_bytes = self.smem_region * (2 if self.joint else 1)

    def can_implement(self) -> str | None:
        """None if this config can run, else why not."""
        c = self.cfg
        if c.dtype not in ELEM_BYTES:
            return f"input dtype {c.dtype} not supported (bfloat16, float16, float32)"
        if c.rounding not in ("rceil", "floor"):
            return f"rounding {c.rounding!r} not supported"
        if c.k < 1:
            return f"K={c.k}: nothing to quantize (the entry points skip empty tensors)"
        if c.act_block not in ACT_BLOCKS:
            return f"activation block {c.act_block} not supported {ACT_BLOCKS}"
        if c.block_rows not in TILE_BLOCK_ROWS:
            return f"weight tile rows {c.block_rows} not supported {TILE_BLOCK_ROWS}"
        if (c.rows or self.block32) and c.k % F.BLOCK_SIZE:
            return f"K={c.k} must be a multiple of 32 when blocks run along K (rowwise, 32x32)"
        if not (c.rows or c.cols):
            return "nothing to write"
        if c.grouping not in ("none", "offs", "uniform"):
            return f"grouping {c.grouping!r} unknown"
        if c.grouping == "uniform" and c.group_rows <= 0:
            return "uniform groups (experts) need a positive row count"
        if c.grouping == "uniform" and (c.cols or self.block32) and c.group_rows % F.BLOCK_SIZE:
            return f"blocks along the expert rows need N % 32 == 0, got N={c.group_rows}"
        if c.col_layout == "experts" and c.grouping != "uniform":
            return "the experts column layout needs uniform groups"
        if self.tiled and c.grouping != "uniform":
            return "32x32 / 128x128 scale tiles are for expert weights (uniform groups)"
        if c.grouping == "uniform" and c.act_block != F.BLOCK_SIZE:
            return "expert weights choose their scale tiles with block_rows, not act_block"
        if c.source not in SOURCES:
            return f"source {c.source!r} unknown {SOURCES}"
        if c.source != "x" and (c.dtype != "bfloat16" or c.grouping == "uniform"):
            return f"the {c.source!r} source takes BF16 activations (not weights)"
        if c.top_k < 1:
            return f"top_k must be >= 1, got {c.top_k}"
        if c.with_part and c.source != "combine_grad":
            return "the routing-weight gradient (with_part) is the combine_grad source's"
        if c.load_batch not in (1, 2, 4, 8):
            return f"load_batch {c.load_batch} must divide the 8 vectors a thread loads"
        if c.ctas_per_sm < 0:
            return f"ctas_per_sm must be >= 0, got {c.ctas_per_sm}"
        if not 0 <= c.load_ahead < self.vecs_per_thread // c.load_batch:
            return (f"load_ahead {c.load_ahead} must be below the "
                    f"{self.vecs_per_thread // c.load_batch} batches a thread loads")
        if c.unpredicated and c.source not in ("swiglu", "swiglu_grad"):
            return "unpredicated loads are the SwiGLU sources' (their rows exist for pad rows)"
        if c.speculate_rows and c.grouping != "offs":
            return "speculate_rows guesses a grouped tile's rows (grouping 'offs')"
        if c.col_tile and not (c.cols and c.act_block == F.BLOCK_128 and not self.tiled):
            return "col_tile (128 x 128 column tiles) needs the 1x128 columnwise output"
        if c.source != "x" and c.k % F.BLOCK_SIZE:
            # whole 16-byte vectors of every input (and, for dh, none across the halves)
            return f"the {c.source!r} source needs a multiple of 32 features, got {c.k}"
        return None

    # ---- host side --------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self, x: cute.Pointer, aux: cute.Pointer, src: cute.Pointer, wts: cute.Pointer,
        part: cute.Pointer, q_row: cute.Pointer, s_row: cute.Pointer, q_col: cute.Pointer,
        s_col: cute.Pointer, offs: cute.Pointer, tile_ends: cute.Pointer, m: Int32,
        n_groups: Int32, search_steps: Int32, n_vtiles: Int32, stream,
    ):
        """``x``: the input (``h`` for the SwiGLU sources, the token rows for "gather" and
        "combine_grad"); ``aux``: ``dA`` ("swiglu_grad") or ``y`` ("combine_grad"); ``src``:
        the layout's source pair of each row (-1 on pad rows); ``wts``: the fp32 routing
        weight of each pair and ``part``: the fp32 partial routing-weight gradients
        ("combine_grad")."""
        self.kernel(
            x, aux, src, wts, part, q_row, s_row, q_col, s_col, offs, tile_ends, m, n_groups,
            search_steps, n_vtiles,
        ).launch(
            # One linear grid dimension (limit 2^31 - 1 CTAs; grid y stops at 65535, i.e. at
            # 8.4M tokens): CTA i takes feature tile i % feat_tiles of token tile i // feat_tiles,
            # the order a (feat_tiles, n_vtiles) grid would run them in.
            grid=[n_vtiles * self.grid_feat_tiles, 1, 1], block=[THREADS, 1, 1],
            smem=self.smem_bytes, stream=stream,
            # 0: as many CTAs an SM as the registers the compiler picks allow
            min_blocks_per_mp=self.cfg.ctas_per_sm, preferred_smem_carveout=self.carveout(),
        )

    def carveout(self) -> int | None:
        """Shared memory share (% of the SM's most) for ``ctas_per_sm`` CTAs, None below 2 (the
        driver's choice); given, so that the compile needs no device to look the SM up."""
        n = self.cfg.ctas_per_sm
        if n < 2:
            return None
        per_cta = self.smem_bytes + SMEM_PER_CTA_RESERVED
        return min(100, -(-100 * n * per_cta // SM90_MAX_SMEM_PER_SM))

    # ---- device side ------------------------------------------------------------------------

    @cute.jit
    def tile_context(self, offs, tile_ends, m, n_groups, search_steps, n_vtiles, t):
        """For virtual token tile t: (first token, valid rows, first tile of its group,
        tiles of its group, group id)."""
        c = self.cfg
        tok_begin = t * TILE_TOKENS
        n_valid = m - tok_begin
        t_first = Int32(0)
        tiles_g = n_vtiles
        g = Int32(0)
        if const_expr(c.grouping == "uniform"):
            tiles_per_group = F.ceil_div(c.group_rows, TILE_TOKENS)
            g = t // tiles_per_group
            t_first = g * tiles_per_group
            local = (t - t_first) * TILE_TOKENS
            tok_begin = g * c.group_rows + local
            n_valid = c.group_rows - local
            tiles_g = Int32(tiles_per_group)
        if const_expr(c.grouping == "offs"):
            # g = number of groups whose cumulative tile end is <= t (branch-free binary search
            # over the int32 cumulative tile counts of the groups; empty groups own no tile).
            te = tile_ends.toint()
            lo = Int32(0)
            n = n_groups
            for _ in cutlass.range(search_steps, unroll=1):
                half = n // 2
                v = ld_global_b32(te + Int64(lo + half) * 4, n > 0, NO_MATCH)
                go = v <= t
                lo = cutlass.select_(go, lo + half + 1, lo)
                n = cutlass.select_(go, n - half - 1, half)
            g = lo
            real = Int32(g < n_groups)
            t_first = ld_global_b32(te + Int64(g - 1) * 4, g > 0, 0)
            t_end = ld_global_b32(te + Int64(g) * 4, real, 0)
            o = offs.toint()
            start = ld_global_b32(o + Int64(g - 1) * 4, g > 0, 0)
            end = ld_global_b32(o + Int64(g) * 4, real, 0)
            tok_begin = start + (t - t_first) * TILE_TOKENS
            n_valid = cutlass.select_(real != 0, end - tok_begin, 0)
            tiles_g = cutlass.select_(real != 0, t_end, n_vtiles) - t_first
        n_valid = cutlass.min(cutlass.max(n_valid, 0), TILE_TOKENS)
        return tok_begin, n_valid, t_first, tiles_g, g

    @cute.kernel
    def kernel(
        self, x: cute.Pointer, aux: cute.Pointer, src: cute.Pointer, wts: cute.Pointer,
        part: cute.Pointer, q_row: cute.Pointer, s_row: cute.Pointer, q_col: cute.Pointer,
        s_col: cute.Pointer, offs: cute.Pointer, tile_ends: cute.Pointer, m: Int32,
        n_groups: Int32, search_steps: Int32, n_vtiles: Int32,
    ):
        c = self.cfg
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        bx = cta % self.grid_feat_tiles  # static divisor: a multiply and a shift
        t = cta // self.grid_feat_tiles
        feat0 = bx * TILE_FEATURES
        smem = Int32(0)
        if const_expr(self.needs_smem):
            smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16).toint()
        words = []
        if const_expr(c.speculate_rows):
            # load rows [128 t, 128 t + 128) while the group search runs: they are the tile's
            # wherever every group starts on a tile boundary; else (CTA-uniform) load again
            tb0 = t * TILE_TOKENS
            nv0 = cutlass.min(cutlass.max(m - tb0, 0), TILE_TOKENS)
            words = self.source_words(x, aux, src, wts, part, tb0, nv0, feat0, bx, m, tid,
                                      smem)
            tok_begin, n_valid, t_first, tiles_g, g = self.tile_context(
                offs, tile_ends, m, n_groups, search_steps, n_vtiles, t
            )
            if (tok_begin != tb0) | (n_valid != nv0):
                words = self.source_words(x, aux, src, wts, part, tok_begin, n_valid, feat0,
                                          bx, m, tid, smem)
        else:
            tok_begin, n_valid, t_first, tiles_g, g = self.tile_context(
                offs, tile_ends, m, n_groups, search_steps, n_vtiles, t
            )
            words = self.source_words(x, aux, src, wts, part, tok_begin, n_valid, feat0, bx,
                                      m, tid, smem)
        if const_expr(self.needs_smem):
            self.stash_tile(smem, words, tid)
        if const_expr(c.rows and not self.tiled):
            self.rows_phase(q_row, s_row, words, smem, tok_begin, n_valid, feat0, bx, t, tid)
        if const_expr(self.needs_smem):
            cute.arch.sync_threads()
            self.cols_phase(q_col, s_col, smem, tok_begin, n_valid, feat0, bx, t, t_first,
                            tiles_g, g, m, tid)
        if const_expr(c.rows and self.tiled):
            self.rows_phase(q_row, s_row, words, smem, tok_begin, n_valid, feat0, bx, t, tid)
        if const_expr(self.joint):  # the dup tile, from its own region
            smem_u = smem + self.smem_region
            bx_u = bx + self.grid_feat_tiles
            if const_expr(c.rows):
                self.rows_phase(q_row, s_row, self.unstash_tile(smem_u, tid), smem_u,
                                tok_begin, n_valid, bx_u * TILE_FEATURES, bx_u, t, tid)
            cute.arch.sync_threads()
            self.cols_phase(q_col, s_col, smem_u, tok_begin, n_valid, bx_u * TILE_FEATURES,
                            bx_u, t, t_first, tiles_g, g, m, tid)

    @cute.jit
    def source_words(self, x, aux, src, wts, part, tok_begin, n_valid, feat0, bx, m, tid, smem):
        """The tile's words, read (``x``) or computed in the load (the other sources)."""
        c = self.cfg
        words = []
        if const_expr(c.source == "x"):
            words = self.load_tile(x, tok_begin, n_valid, feat0, tid)
        elif const_expr(self.joint):
            words = self.swiglu_joint_tile(x, aux, src, tok_begin, n_valid, feat0, tid,
                                           smem + self.smem_region)
        elif const_expr(c.source in ("gather", "combine_grad")):
            words = self.routed_tile(x, aux, src, wts, part, tok_begin, n_valid, feat0, bx, m,
                                     tid)
        else:
            words = self.swiglu_tile(x, aux, src, tok_begin, n_valid, feat0, tid)
        return words

    @cute.jit
    def load_pairs(self, src, tok_begin, n_valid, tid):
        """The source pair of each of this thread's vectors, all loaded before any vector's data
        (whose addresses or predicates need them), or [] where the data loads do not wait for
        them (``unpredicated``: each vector loads its pair where it zeroes a pad row)."""
        pairs = []
        if const_expr(not self.cfg.unpredicated):
            for it in cutlass.range_constexpr(self.vecs_per_thread):
                r, _ = self.vec_slot(it, tid)
                pairs.append(ld_global_b32(src.toint() + (Int64(tok_begin) + r) * 4,
                                           Int32(r < n_valid), -1))
        return pairs

    def vec_slot(self, it, tid):
        """(tile row, 16-byte vector in the row) of this thread's ``it``-th vector: a warp covers
        whole rows, 512 contiguous bytes per instruction."""
        return (it * (THREADS // self.vecs_per_row) + tid // self.vecs_per_row,
                tid % self.vecs_per_row)

    @cute.jit
    def row_slot(self, src, it, tid, tok_begin, n_valid, feat0, width, pairs):
        """This thread's ``it``-th vector of a tile computed from the layout's rows: (tile row,
        vector, its first feature, the sorted row, the row's source pair (0 on pad rows),
        whether it holds data -- in the tile, features below ``width``, no pad row -- and
        whether it is in the tile below ``width``)."""
        r, vec = self.vec_slot(it, tid)
        feat = feat0 + vec * self.vec_elems
        row = Int64(tok_begin) + r
        if const_expr(len(pairs) > 0):
            pair = pairs[it]
        else:
            pair = ld_global_b32(src.toint() + row * 4, Int32(r < n_valid), -1)
        inside = Int32(r < n_valid) & Int32(feat < width)
        ok = inside & Int32(pair >= 0)
        return r, vec, feat, row, cutlass.max(pair, 0), ok, inside

    @cute.jit
    def load_tile(self, x, tok_begin, n_valid, feat0, tid):
        """All of this thread's 16-byte vectors of the tile, issued back to back."""
        c = self.cfg
        words = []
        base = x.toint()
        for it in cutlass.range_constexpr(self.vecs_per_thread):
            r = it * (THREADS // self.vecs_per_row) + tid // self.vecs_per_row
            vec = tid % self.vecs_per_row
            feat = feat0 + vec * self.vec_elems
            row_ok = Int32(r < n_valid)
            elem = (Int64(tok_begin) + r) * c.k + feat  # 64-bit: x may hold >= 2^31 elements
            addr = base + elem * self.elem_bytes
            if const_expr(self.vec_loads):
                words.extend(ld_global_v4(addr, row_ok & Int32(feat < c.k)))
            else:
                words.extend(self.load_elements(addr, feat, row_ok))
        return words

    @cute.jit
    def load_elements(self, addr, feat, row_ok):
        """The 4 words of one vector slot, element by element (rows not 16-byte aligned: a
        columnwise K that is not a multiple of the vector); features past K load as 0."""
        c = self.cfg
        eb = self.elem_bytes
        vals = []
        for i in cutlass.range_constexpr(self.vec_elems):
            ok = row_ok & Int32(feat + i < c.k)
            if const_expr(eb == 4):
                vals.append(ld_global_b32(addr + i * eb, ok, 0))
            else:
                vals.append(ld_global_u16(addr + i * eb, ok))
        if const_expr(eb == 4):
            return vals
        return [vals[2 * j] | (vals[2 * j + 1] << 16) for j in range(4)]

    @cute.jit
    def swiglu_tile(self, h, da, src, tok_begin, n_valid, feat0, tid):
        """The tile's BF16 words of ``a = silu(gate) * up`` ("swiglu") or of ``dh = [dgate |
        dup]`` ("swiglu_grad"), in `load_tile`'s order, from ``h = [gate | up]`` (and ``dA``):
        the same arithmetic as PyTorch's BF16 ops (`ptx.swiglu_bf16x2`), zero on pad rows.
        A dh tile here may straddle the halves (H % 128 != 0; else `swiglu_joint_tile`): each
        vector picks its own.

        The loads go out ``load_batch`` vectors at a time, ``load_ahead`` batches before the
        arithmetic that needs them (`pipeline`): enough bytes in flight, without holding all of
        the tile's inputs (2-3x its output) in registers."""
        pairs = self.load_pairs(src, tok_begin, n_valid, tid)
        return self.pipeline(self.swiglu_issue, self.swiglu_math,
                             (h.toint(), da.toint(), src, tid, tok_begin, n_valid, feat0, pairs))

    def swiglu_issue(self, b, h_base, da_base, src, tid, tok_begin, n_valid, feat0, pairs):
        """The loads of batch ``b`` of `swiglu_tile` (traced inline)."""
        c = self.cfg
        grad = c.source == "swiglu_grad"
        hidden = c.k // 2 if grad else c.k  # H: the width of gate, up and dA
        loads = []
        for it in range(b * c.load_batch, (b + 1) * c.load_batch):
            _, _, feat, tok, _, ok, inside = self.row_slot(src, it, tid, tok_begin, n_valid,
                                                           feat0, c.k, pairs)
            pred = inside if c.unpredicated else ok
            # dh's feature f < H is dgate of gate feature f, else dup of feature f - H
            is_up = Int32(0)
            if grad:
                is_up = Int32(feat >= hidden)
            f = feat - is_up * hidden
            row = h_base + (tok * (2 * hidden) + f) * 2
            g = ld_global_v4(row, pred)
            u = ld_global_v4(row + hidden * 2, pred & (1 - is_up))  # dup does not read up
            d = [Int32(0)] * 4
            if grad:
                d = ld_global_v4(da_base + (tok * hidden + f) * 2, pred)
            loads.append((g, u, d, is_up, ok))
        return loads

    def swiglu_math(self, loads, *_):
        """The words of one batch of `swiglu_issue`'s loads."""
        c = self.cfg
        words = []
        for g, u, d, is_up, ok in loads:
            for j in range(4):
                if c.source == "swiglu_grad":
                    val = swiglu_grad_bf16x2(g[j], u[j], d[j], is_up)
                else:
                    val = swiglu_bf16x2(g[j], u[j])
                if c.unpredicated:  # pad rows were read: zero them here
                    val = cutlass.select_(ok != 0, val, Int32(0))
                words.append(val)
        return words

    def pipeline(self, issue, math, args):
        """The tile's words, batch by batch: ``issue(b, *args)`` returns batch b's loads,
        ``math(loads, *args)`` its words; batches ``b + 1 .. b + ahead`` are issued before
        batch b's arithmetic, so their latency overlaps it (traced inline)."""
        nb = self.vecs_per_thread // self.cfg.load_batch
        ahead = self.cfg.load_ahead
        issued = [issue(b, *args) for b in range(min(ahead, nb))]
        words = []
        for b in range(nb):
            if b + ahead < nb:
                issued.append(issue(b + ahead, *args))
            words.extend(math(issued[b], *args))
        return words

    @cute.jit
    def stash_tile(self, smem, words, tid):
        """Row-major copy of the tile in shared memory (a warp stores 512 contiguous bytes)."""
        for it in cutlass.range_constexpr(self.vecs_per_thread):
            r, vec = self.vec_slot(it, tid)
            st_shared(smem + r * self.row_bytes + vec * VEC_BYTES, words[4 * it: 4 * it + 4])

    @cute.jit
    def routed_tile(self, x, y, src, wts, part, tok_begin, n_valid, feat0, bx, m, tid):
        """The tile's BF16 words gathered from the token rows of ``x (T, k)``: row r holds
        token ``src[r] // top_k`` ("gather": the dispatch), times ``bf16(wts[src[r]])``
        ("combine_grad": the combine's backward, PyTorch's BF16 product); zero on pad rows.
        With ``with_part``, also ``part[bx, r]`` = the fp32 sum over the tile's features of
        ``bf16(x[token] * y[r])`` (the routing weight's gradient, per 128-feature tile): each
        lane sums its 8 features in order, then the row's 16 lanes by butterfly."""
        pairs = self.load_pairs(src, tok_begin, n_valid, tid)
        return self.pipeline(self.routed_issue, self.routed_math,
                             (x.toint(), y.toint(), src, wts, part, tok_begin, n_valid, feat0,
                              bx, m, tid, pairs))

    def routed_issue(self, b, x_base, y_base, src, wts, part, tok_begin, n_valid, feat0, bx, m,
                     tid, pairs):
        """The loads of batch ``b`` of `routed_tile` (traced inline)."""
        c = self.cfg
        loads = []
        for it in range(b * c.load_batch, (b + 1) * c.load_batch):
            r, _, feat, row, pair, ok, _ = self.row_slot(src, it, tid, tok_begin, n_valid,
                                                         feat0, c.k, pairs)
            tok = Int64(pair // c.top_k)
            v = ld_global_v4(x_base + (tok * c.k + feat) * 2, ok)
            w = Int32(0)
            yv = [Int32(0)] * 4
            if c.source == "combine_grad":
                w = ld_global_b32(wts.toint() + Int64(pair) * 4, ok, 0)
            if c.with_part:
                yv = ld_global_v4(y_base + (row * c.k + feat) * 2, ok)
            loads.append((v, w, yv, r))
        return loads

    def routed_math(self, loads, x_base, y_base, src, wts, part, tok_begin, n_valid, feat0, bx,
                    m, tid, pairs):
        """The words of one batch of `routed_issue`'s loads (and their ``part`` sums)."""
        c = self.cfg
        words = []
        for v, w, yv, r in loads:
            if c.source == "combine_grad":
                words.extend([scale_bf16x2(v[j], w) for j in range(4)])
            else:
                words.extend(v)
            if c.with_part:
                acc = Int32(0)
                for j in range(4):
                    acc = dot_bf16x2(acc, v[j], yv[j])
                for step in range(_log2(self.vecs_per_row)):
                    acc = add_f32_bits(acc, cute.arch.shuffle_sync_bfly(acc, offset=1 << step))
                # lane 0 of the row's lanes; every row of [0, M) is in one tile
                st_global(part.toint() + (Int64(bx) * m + tok_begin + r) * 4, [acc],
                          Int32(r < n_valid) & Int32(tid % self.vecs_per_row == 0))
        return words

    @cute.jit
    def swiglu_joint_tile(self, h, da, src, tok_begin, n_valid, feat0, tid, smem_u):
        """The dgate words of gate feature tile ``feat0`` (returned) and its dup words (stored
        in `stash_tile`'s layout at ``smem_u``) from one read of gate, up and dA."""
        pairs = self.load_pairs(src, tok_begin, n_valid, tid)
        return self.pipeline(self.joint_issue, self.joint_math,
                             (h.toint(), da.toint(), src, tid, tok_begin, n_valid, feat0, pairs,
                              smem_u))

    def joint_issue(self, b, h_base, da_base, src, tid, tok_begin, n_valid, feat0, pairs,
                    smem_u):
        """The loads of batch ``b`` of `swiglu_joint_tile` (traced inline)."""
        c = self.cfg
        hidden = c.k // 2
        loads = []
        for it in range(b * c.load_batch, (b + 1) * c.load_batch):
            r, vec, feat, tok, _, ok, inside = self.row_slot(src, it, tid, tok_begin, n_valid,
                                                             feat0, hidden, pairs)
            pred = inside if c.unpredicated else ok
            row = h_base + (tok * (2 * hidden) + feat) * 2
            loads.append((ld_global_v4(row, pred), ld_global_v4(row + hidden * 2, pred),
                          ld_global_v4(da_base + (tok * hidden + feat) * 2, pred), r, vec, ok))
        return loads

    def joint_math(self, loads, h_base, da_base, src, tid, tok_begin, n_valid, feat0, pairs,
                   smem_u):
        """The dgate words of one batch of `joint_issue`'s loads; their dup words to smem."""
        c = self.cfg
        words = []
        for g, u, d, r, vec, ok in loads:
            dup = []
            for j in range(4):
                dg_w, du_w = swiglu_grad_pair_bf16x2(g[j], u[j], d[j])
                if c.unpredicated:
                    dg_w = cutlass.select_(ok != 0, dg_w, Int32(0))
                    du_w = cutlass.select_(ok != 0, du_w, Int32(0))
                words.append(dg_w)
                dup.append(du_w)
            st_shared(smem_u + r * self.row_bytes + vec * VEC_BYTES, dup)
        return words

    @cute.jit
    def unstash_tile(self, smem, tid):
        """This thread's words of the tile back from `stash_tile`'s copy (its own stores: no
        barrier needed)."""
        words = []
        for it in cutlass.range_constexpr(self.vecs_per_thread):
            r, vec = self.vec_slot(it, tid)
            words.extend(ld_shared_v4(smem + r * self.row_bytes + vec * VEC_BYTES))
        return words

    @cute.jit
    def rows_phase(self, q_row, s_row, words, smem, tok_begin, n_valid, feat0, bx, t, tid):
        """Rowwise output from registers: ``row_lanes`` lanes share a block (shfl amax); with
        scale tiles (weights), the tile amaxes the columns phase left in shared memory."""
        c = self.cfg
        lane = tid % 32
        rceil = c.rounding == "rceil"
        q_base = q_row.toint()
        s_base = s_row.toint()
        whole_tile = Int32(0)
        if const_expr(c.block_rows == F.BLOCK_128):
            whole_tile = self.slots_max(smem, range(SUBTILES))
        # 32-blocks of this feature tile that hold data (the rest of a 128-block is pad)
        blocks_here = cutlass.min(cutlass.max(c.k // F.BLOCK_SIZE - bx * F.TILE_BLOCKS, 0),
                                  F.TILE_BLOCKS)
        for it in cutlass.range_constexpr(self.vecs_per_thread):
            r = it * (THREADS // self.vecs_per_row) + tid // self.vecs_per_row
            vec = tid % self.vecs_per_row
            blk = vec // self.lanes_per_block
            w = words[4 * it: 4 * it + 4]
            bits = []
            for j in cutlass.range_constexpr(4):
                for h in cutlass.range_constexpr(self.feats_per_word):
                    bits.append(unpack_f32_bits(w[j], h, c.dtype))
            amax = Int32(0)
            if const_expr(c.block_rows == F.BLOCK_128):
                amax = whole_tile
            elif const_expr(self.block32):
                amax = ld_shared_b32(self.slot(smem, (r // 32) * F.TILE_BLOCKS + blk))
            else:
                amax = bits[0] & ABS_MASK
                for i in cutlass.range_constexpr(1, len(bits)):
                    amax = cutlass.max(amax, bits[i] & ABS_MASK)
                for step in cutlass.range_constexpr(_log2(self.row_lanes)):
                    amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << step))
            byte, inv = scale_from_amax(amax, rceil)
            out = []
            for j in cutlass.range_constexpr(len(bits) // 4):
                out.append(cvt_e4m3x4(bits[4 * j], bits[4 * j + 1], bits[4 * j + 2],
                                      bits[4 * j + 3], inv))
            feat = feat0 + vec * self.vec_elems
            ok = Int32(r < n_valid) & Int32(feat < c.k)
            st_global(q_base + (Int64(tok_begin) + r) * c.k + feat, out, ok)
            # Packed offset of (virtual row t*128 + r, block 4*bx + blk); every byte of the
            # tile is written (pad rows / blocks load as zeros -> byte 0). 64-bit like every
            # global offset here.
            s_off = Int64((Int64(t) * self.feat_tiles + bx) * F.TILE_BYTES + (r % 32) * 16
                          + (r // 32) * 4)
            if const_expr(self.wide_rows):
                # one lane per row writes the 128-block's four bytes; a pad row or pad blocks
                # get 0 (their amax is the tile's, or the row's, not their own zeros)
                n = cutlass.select_(r < n_valid, blocks_here, Int32(0))
                st_global(s_base + s_off, [replicated_word(byte, n)],
                          Int32(lane % self.vecs_per_row == 0))
            else:
                st_global_u8(s_base + s_off + blk, byte, Int32(lane % self.lanes_per_block == 0))

    @cute.jit
    def cols_phase(self, q_col, s_col, smem, tok_begin, n_valid, feat0, bx, t, t_first,
                   tiles_g, g, m, tid):
        """Column amax/quantize from the shared tile, staged transposed, then written out."""
        c = self.cfg
        rceil = c.rounding == "rceil"
        s_base = s_col.toint()
        lane = tid % 32
        # Group g's packed matrix: Rp rows x 4*tiles_g blocks, at Rp*4*t_first bytes.
        col_base = Int64(t_first) * (self.k_padded * 4)
        outs = []
        for task in cutlass.range_constexpr(self.col_tasks):
            u = task * THREADS + tid
            wc = u % self.words_per_row
            blk = u // self.words_per_row
            cw = []
            for i in cutlass.range_constexpr(F.BLOCK_SIZE):
                cw.append(ld_shared_b32(smem + (blk * 32 + i) * self.row_bytes + wc * 4))
            for h in cutlass.range_constexpr(self.feats_per_word):
                bits = [unpack_f32_bits(cw[i], h, c.dtype) for i in range(F.BLOCK_SIZE)]
                amax = bits[0] & ABS_MASK
                for i in cutlass.range_constexpr(1, F.BLOCK_SIZE):
                    amax = cutlass.max(amax, bits[i] & ABS_MASK)
                outs.append((wc * self.feats_per_word + h, blk, bits, amax))
        if const_expr(self.tiled):
            outs = self.tile_amax(outs, smem, lane)
        if const_expr(self.col128):
            if const_expr(c.col_tile):
                outs = self.column_tile_amax(outs, smem, lane, tid)
            else:
                outs = self.column_amax_128(outs, smem)
        # 32-token blocks of this tile that hold tokens (the rest of a 128-block is pad)
        blocks_here = cutlass.min((n_valid + (F.BLOCK_SIZE - 1)) // F.BLOCK_SIZE, F.TILE_BLOCKS)
        staged = []
        for oi in cutlass.range_constexpr(len(outs)):
            f, blk, bits, amax = outs[oi]
            byte, inv = scale_from_amax(amax, rceil)
            if const_expr(c.cols):
                q = [cvt_e4m3x4(bits[4 * j], bits[4 * j + 1], bits[4 * j + 2], bits[4 * j + 3],
                                inv) for j in range(8)]
                staged.append((f, blk, q))
                s_off = col_base + ((Int64(bx) * tiles_g + (t - t_first)) * F.TILE_BYTES
                                    + (f % 32) * 16 + (f // 32) * 4)
                if const_expr(self.wide_cols):
                    # the block-0 thread of a feature writes its four bytes; features past K
                    # and pad blocks get 0
                    n = cutlass.select_(feat0 + f < c.k, blocks_here, Int32(0))
                    st_global(s_base + s_off, [replicated_word(byte, n)], Int32(blk == 0))
                else:
                    st_global_u8(s_base + s_off + blk, byte, 1)
        if const_expr(c.cols):
            cute.arch.sync_threads()  # every column read of the input tile is done
            for si in cutlass.range_constexpr(len(staged)):
                f, blk, q = staged[si]
                a = smem + f * STAGE_ROW_BYTES + blk * 32
                st_shared(a, q[0:4])
                st_shared(a + 16, q[4:8])
            cute.arch.sync_threads()
            self.write_cols(q_col, smem, tok_begin, n_valid, feat0, t, t_first, g, m, tid)
        else:
            cute.arch.sync_threads()  # tile amaxes visible to the rows phase

    def slot(self, smem, i):
        """Shared address of amax exchange slot ``i`` (past the input tile and staging)."""
        return smem + self.amax_offset + i * 4

    def slots_max(self, smem, indices):
        """Max of the amax slots ``indices`` (static)."""
        idx = list(indices)
        amax = ld_shared_b32(self.slot(smem, idx[0]))
        for i in idx[1:]:
            amax = cutlass.max(amax, ld_shared_b32(self.slot(smem, i)))
        return amax

    @cute.jit
    def tile_amax(self, outs, smem, lane):
        """Scale tiles (weights): the amax of each 32x32 sub-tile -- the 32 column amaxes its
        lanes hold, by butterfly -- left in shared memory for the rows phase; for 128x128
        tiles, the max of all sixteen (a CTA-wide exchange) replaces every column amax."""
        c = self.cfg
        width = F.BLOCK_SIZE // self.feats_per_word  # lanes spanning 32 features
        res = []
        for task in cutlass.range_constexpr(self.col_tasks):
            parts = outs[task * self.feats_per_word: (task + 1) * self.feats_per_word]
            amax = parts[0][3]
            for i in cutlass.range_constexpr(1, len(parts)):
                amax = cutlass.max(amax, parts[i][3])
            for step in cutlass.range_constexpr(_log2(width)):
                amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << step))
            if const_expr(c.rows or c.block_rows == F.BLOCK_128):
                f, blk = parts[0][0], parts[0][1]
                # one writer per 32x32 sub-tile (all its lanes hold the same value)
                st_shared_pred(self.slot(smem, blk * F.TILE_BLOCKS + f // 32), amax,
                               Int32(lane % width == 0))
            for i in cutlass.range_constexpr(len(parts)):
                res.append((parts[i][0], parts[i][1], parts[i][2], amax))
        if const_expr(c.block_rows == F.BLOCK_128 and c.cols):
            cute.arch.sync_threads()  # all sixteen sub-tile amaxes written
            whole = self.slots_max(smem, range(SUBTILES))
            res = [(f, blk, bits, whole) for f, blk, bits, _ in res]
        return res

    @cute.jit
    def column_amax_128(self, outs, smem):
        """1x128 along the tokens: a feature's amax over the tile's four 32-token blocks. Those
        are held by threads of different warps (the block index is the slow one), so they meet
        in shared memory: slot ``blk * 128 + f``."""
        for oi in cutlass.range_constexpr(len(outs)):
            f, blk, _, amax = outs[oi]
            st_shared(self.slot(smem, blk * TILE_FEATURES + f), [amax])
        cute.arch.sync_threads()
        res = []
        for oi in cutlass.range_constexpr(len(outs)):
            f, blk, bits, _ = outs[oi]
            amax = ld_shared_b32(self.slot(smem, f))
            for j in cutlass.range_constexpr(1, F.TILE_BLOCKS):
                amax = cutlass.max(amax, ld_shared_b32(self.slot(smem, j * TILE_FEATURES + f)))
            res.append((f, blk, bits, amax))
        return res

    @cute.jit
    def column_tile_amax(self, outs, smem, lane, tid):
        """1x128 along the tokens with 128 x 128 tiles (``col_tile``): the whole tile's amax
        for every feature -- the maximum of this thread's 32-token block amaxes, of its warp's
        (butterfly), then of the warps' (one shared slot each, past the 1x128 slots)."""
        amax = outs[0][3]
        for oi in cutlass.range_constexpr(1, len(outs)):
            amax = cutlass.max(amax, outs[oi][3])
        for step in cutlass.range_constexpr(5):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << step))
        base = F.TILE_BLOCKS * TILE_FEATURES
        st_shared_pred(self.slot(smem, base + tid // 32), amax, Int32(lane == 0))
        cute.arch.sync_threads()
        whole = self.slots_max(smem, range(base, base + THREADS // 32))
        return [(f, blk, bits, whole) for f, blk, bits, _ in outs]

    @cute.jit
    def write_cols(self, q_col, smem, tok_begin, n_valid, feat0, t, t_first, g, m, tid):
        """Transposed rows from the staging buffer to ``x.T`` (or the experts' ``(K, N)``)."""
        c = self.cfg
        base = q_col.toint()
        if const_expr(c.col_aligned):
            chunks = TILE_TOKENS // VEC_BYTES  # 16-byte chunks per staged row
            for it in cutlass.range_constexpr(TILE_FEATURES * chunks // THREADS):
                u = it * THREADS + tid
                f = u // chunks
                ch = u % chunks
                v = ld_shared_v4(smem + f * STAGE_ROW_BYTES + ch * VEC_BYTES)
                ok = Int32(feat0 + f < c.k) & Int32(ch * VEC_BYTES < n_valid)
                dst = self.col_row_start(feat0 + f, tok_begin, t, t_first, g, m)
                st_global(base + dst + ch * VEC_BYTES, v, ok)
        else:
            # Arbitrary byte alignment (group starts, odd M): each lane writes one aligned 32-bit
            # word of the destination, funnel-shifting two staged words into place; the partial
            # words at either end of the segment fall back to byte stores (their other bytes
            # belong to the neighbouring tile). A row spans up to 33 words: lane 31 also takes
            # word 32. Measured: byte stores everywhere ran grouped colwise at 78% of copy.
            wpr = TILE_TOKENS // 4  # staged words per row; a warp writes one row
            for it in cutlass.range(TILE_FEATURES * wpr // THREADS, unroll=4):
                u = it * THREADS + tid
                f = u // wpr
                w = u % wpr
                dst = base + self.col_row_start(feat0 + f, tok_begin, t, t_first, g, m)
                mis = Int32(dst & 3)
                row = smem + f * STAGE_ROW_BYTES
                fok = Int32(feat0 + f < c.k)
                self.store_shifted_word(row, w, dst - mis, mis, n_valid, fok)
                self.store_shifted_word(row, Int32(wpr), dst - mis, mis, n_valid,
                                        fok & Int32(w == wpr - 1))

    @cute.jit
    def store_shifted_word(self, row, w, aligned, mis, n_valid, pred):
        """Destination word ``w`` (bytes ``4w - mis ..`` of the staged row) of a segment whose
        first byte sits ``mis`` bytes past the 4-byte aligned address ``aligned``."""
        lo = ld_shared_b32(row + cutlass.max(w - 1, 0) * 4)
        hi = ld_shared_b32(row + w * 4)
        d = funnel_shift_right(lo, hi, 32 - 8 * mis)
        i0 = 4 * w - mis
        full = Int32(i0 >= 0) & Int32(i0 + 4 <= n_valid)
        addr = aligned + 4 * w
        st_global(addr, [d], pred & full)
        part = pred & (1 - full)
        for b in cutlass.range_constexpr(4):
            st_global_u8(addr + b, (d >> (8 * b)) & 0xFF,
                         part & Int32(i0 + b >= 0) & Int32(i0 + b < n_valid))

    @cute.jit
    def col_row_start(self, k, tok_begin, t, t_first, g, m):
        """Byte offset of the tile's first token in output row ``k`` (a feature)."""
        c = self.cfg
        if const_expr(c.col_layout == "experts"):
            n = c.group_rows
            return Int64(g) * (c.k * n) + Int64(k) * n + (t - t_first) * TILE_TOKENS
        return Int64(k) * m + tok_begin


# ---------------------------------------------------------------------------------------------
# Public kernel classes (one per kernel; all share TileQuantizer's device code)
# ---------------------------------------------------------------------------------------------


class RowwiseQuantizer(TileQuantizer):
    """``x (M, K)`` -> ``(M, K)`` e4m3 + packed scales (optionally row-grouped by ``offs``)."""

    def __init__(self, config: QuantConfig):
        assert config.rows and not config.cols
        super().__init__(config)


class ColwiseQuantizer(TileQuantizer):
    """``x (M, K)`` -> ``x.T (K, M)`` e4m3, blocks along M (restarting per ``offs`` group)."""

    def __init__(self, config: QuantConfig):
        assert config.cols and not config.rows
        super().__init__(config)


class DualQuantizer(TileQuantizer):
    """One read of ``x``: both the rowwise and the columnwise outputs."""

    def __init__(self, config: QuantConfig):
        assert config.cols and config.rows
        super().__init__(config)


class _SourceQuantizer(TileQuantizer):
    """A tile whose rows are computed in its load (`QuantConfig.source`), one class per source
    so that profilers name the data-path stage each kernel is."""

    source = ""

    def __init__(self, config: QuantConfig):
        assert config.source == self.source
        super().__init__(config)


class SwigluQuantizer(_SourceQuantizer):
    """The data path's SwiGLU forward: ``a`` of ``h``, quantized (either copy or both)."""

    source = "swiglu"


class SwigluGradQuantizer(_SourceQuantizer):
    """The SwiGLU backward: ``dh`` of ``dA`` and ``h``, quantized."""

    source = "swiglu_grad"


class GatherQuantizer(_SourceQuantizer):
    """The dispatch: ``x[token]`` of each sorted row, quantized."""

    source = "gather"


class CombineGradQuantizer(_SourceQuantizer):
    """The combine's backward: ``dout[token] * bf16(w)`` of each sorted row, quantized, and the
    routing weights' partial gradients."""

    source = "combine_grad"


class WeightQuantizer(TileQuantizer):
    """Expert weights ``(E, N, K)``: axis K = rows of ``(E*N, K)`` in groups of N; axis N =
    columns, each expert's ``(K, N)`` contiguous; either or both from one read; optional
    32x32 / 128x128 scale tiles."""

    def __init__(self, config: QuantConfig):
        assert config.grouping == "uniform"
        super().__init__(config)


KERNEL_CLASSES = {
    "quantize_rowwise": RowwiseQuantizer,
    "quantize_colwise": ColwiseQuantizer,
    "quantize_dual": DualQuantizer,
    "quantize_weights": WeightQuantizer,
    "quantize_swiglu": SwigluQuantizer,
    "quantize_swiglu_grad": SwigluGradQuantizer,
    "quantize_gather": GatherQuantizer,
    "quantize_combine_grad": CombineGradQuantizer,
}


def build_quantizer(op: str, config: QuantConfig, stream=None):
    """Compile ``op``'s kernel for ``config`` (`quantize_launch.compile_quantizer` caches it);
    ``stream``: the launch's `native.Stream` (else the current one, or a fake one off CUDA)."""
    kern = KERNEL_CLASSES[op](config)
    why = kern.can_implement()
    if why:
        raise ValueError(f"moe_mxfp8 {op}: {why}")
    in_t = TORCH_TO_CUTLASS[TORCH_DTYPES[config.dtype]]
    f8, u8, i32, f32 = cutlass.Float8E4M3FN, cutlass.Uint8, cutlass.Int32, cutlass.Float32
    args = [make_ptr(t, 0, AddressSpace.gmem, assumed_align=16)
            for t in (in_t, in_t, i32, f32, f32, f8, u8, f8, u8, i32, i32)]
    if stream is None and torch.cuda.is_available():
        stream = current_stream(torch.cuda.current_device())
    stream = cu_stream(stream) if stream is not None else cute.runtime.make_fake_stream()
    return cute.compile(kern, *args, Int32(1), Int32(1), Int32(1), Int32(1), stream)
