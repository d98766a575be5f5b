"""The Hopper grouped GEMM's scale warps and the shared-memory scale layout they write.

Part of `GroupedGemmSm90` (`sm90.py`, which mixes `Sm90ScaleWarps` in): warps 1..3 of the
producer warpgroup read the packed E8M0 scale tiles (docs/numerics.md, "Packed scale layout"),
convert them to fp32 and store them in shared memory in the order the consumer threads read
them (`load_scales`, the one reader of that layout). Kept apart from the kernel's main file so
that each file stays one concern: data movement and MMA there, scales here.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..mx_format import E8M0_NAN
from .schedule import TILE_K

SCALE_ROWS = 128  # rows of one packed scale tile (= the kernel's TILE_M and its MMA's N)
MMA_K = 32  # one fp8 wgmma step == one scale block
BLOCKS_PER_KTILE = TILE_K // MMA_K
SCALE_TILE_WORDS = 128  # 512 bytes as int32 words
SCALE_WARPS = 3  # producer-warpgroup warps 1..3 convert scales
SFA_STRIDE = SCALE_ROWS  # fp32 row scales per block
SFB_Q_STRIDE = SCALE_ROWS // 4 + 4  # 32 column scales per lane%4 group + 4 pad (bank spread)
SFB_STRIDE = 4 * SFB_Q_STRIDE
PROD_STRIDE = (SCALE_ROWS // 2) * 8  # 32x32 mode: 64 thread-row pairs x 8 products per block
F32_NAN_BITS = 0x7FC00000


class Sm90ScaleWarps:
    """Scale-warp and scale-layout methods of `GroupedGemmSm90` (needs its ``cfg``,
    ``stages``, ``blocks_1x128``, ``b_tiles_128`` (B in 128x128 tiles), ``weights_32x32``,
    ``products`` and ``halves``: the output tile's 128-column halves, each one packed B scale
    tile per k-tile)."""

    @cute.jit
    def scale_producer(self, pipe, sfA: cute.Tensor, sfB: cute.Tensor, sSFA: cute.Tensor,
                       sSFB: cute.Tensor, a_tile0: Int32, b_tile0: Int32, b_tile1: Int32,
                       kbase: Int32, k_tiles: Int32, which: Int32):
        """E8M0 bytes -> fp32 in smem, in the order the consumer threads read them.

        Lane l holds packed word w of a tile: rows ``r = l + 32 w``, its 4 bytes = blocks 0..3.
        1x32 (`write_scales`): A rows at ``pos_a(r)`` (each consumer thread's two rows r, r+8
        adjacent); B columns at ``pos_b(c) = q*36 + j*2 + e`` for ``c = 8j + 2q + e`` (a
        thread's 32 columns contiguous: 8 x 16-byte loads; the 4-float pad per q keeps the four
        q-groups of a warp on different banks). 32x32: `write_products`.
        SCALE_WARPS warps take the pipeline's k-tiles round-robin: one warp's loop waits on
        its global loads, three keep ahead of the consumers (removing the scale work
        altogether, diag "no_scale_wait", did not speed up 1x32 mode).
        A 256-column tile (``halves == 2``) reads a second B tile per k-tile, starting
        at ``b_tile1`` (negative: its columns lie past N, nothing is read and its scale is 0).
        """
        lane = cute.arch.lane_idx()
        ahead = self.cfg.scale_lookahead
        # pipeline position of this tile's k-tile kt is kbase + kt; this warp takes those with
        # (kbase + kt) % SCALE_WARPS == which: kt = first + SCALE_WARPS * j, j < n_own. Slot
        # j % ahead of a register ring holds k-tile j's words while later loads fly.
        first = (which - kbase % SCALE_WARPS + SCALE_WARPS) % SCALE_WARPS
        n_own = (k_tiles - first + SCALE_WARPS - 1) // SCALE_WARPS
        wa = cute.make_rmem_tensor((4, ahead), Int32)
        wb = cute.make_rmem_tensor((4 * self.halves, ahead), Int32)
        for s in cutlass.range_constexpr(ahead):
            if s < n_own:
                self.load_scale_words(sfA, sfB, wa, wb, s, a_tile0, b_tile0, b_tile1,
                                      first + SCALE_WARPS * s, lane)
        for j0 in range(0, n_own, ahead):
            for s in cutlass.range_constexpr(ahead):
                j = j0 + s
                if j < n_own:
                    kt = first + SCALE_WARPS * j
                    pos = kbase + kt
                    stage = pos % self.stages
                    # producer phase starts at 1 (make_pipeline_state) and flips per wrap
                    pipe.sync_object_empty.wait(stage, ((pos // self.stages) % 2) ^ 1)
                    if cutlass.const_expr(self.blocks_1x128):
                        self.write_scales_128(sSFA, sSFB, wa, wb, s, stage, lane)
                    elif cutlass.const_expr(self.products):
                        self.write_products(sSFA, wa, wb, s, stage, lane)
                    else:
                        self.write_scales(sSFA, sSFB, wa, wb, s, stage, lane)
                    cute.arch.mbarrier_arrive(pipe.sync_object_full.get_barrier(stage))
                    if j + ahead < n_own:
                        self.load_scale_words(sfA, sfB, wa, wb, s, a_tile0, b_tile0, b_tile1,
                                              kt + SCALE_WARPS * ahead, lane)

    @cute.jit
    def write_scales(self, sSFA: cute.Tensor, sSFB: cute.Tensor, wa: cute.Tensor,
                     wb: cute.Tensor, slot: cutlass.Constexpr[int], stage: Int32, lane: Int32):
        """1x32: row scales at ``pos_a(r)``, column scales at ``pos_b(c)`` (fp32)."""
        for w in cutlass.range_constexpr(4):
            pos_a, pos_b = _scale_positions(lane + 32 * w)
            for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                sSFA[pos_a, c, stage] = _e8m0_to_f32((wa[w, slot] >> (8 * c)) & 0xFF)
                sSFB[pos_b, c, stage] = _e8m0_to_f32((wb[w, slot] >> (8 * c)) & 0xFF)

    @cute.jit
    def write_scales_128(self, sSFA: cute.Tensor, sSFB: cute.Tensor, wa: cute.Tensor,
                         wb: cute.Tensor, slot: cutlass.Constexpr[int], stage: Int32,
                         lane: Int32):
        """1x128 recipe: one scale per row (and per column, or per 128x128 B tile) per k-tile.

        The packed tiles hold each row's 4 block bytes, which this recipe makes equal (the
        128-block's scale, replicated; blocks past a group's or K's end are 0 = pad): the scale
        is their maximum, and bytes that disagree (an operand not quantized 1x128) give NaN, so
        a wrong operand cannot give a plausible result. With B in 128x128 tiles (weights, or the
        wgrad's activation operand), B's scale is
        row 0's byte (every byte of the tile equals it or is pad) and the scale warps store the
        products row scale x tile scale at ``pos_a(r)`` (slot ``h`` of the stage for B tile
        ``h`` of a 256-column tile); otherwise row scales at ``pos_a(r)`` and column scales at
        ``pos_b(c)`` as in 1x32 mode (slot ``h``: B tile ``h``).
        """
        bt = None  # B in 128x128 tiles: each B tile's scale
        if cutlass.const_expr(self.b_tiles_128):
            bt = cute.make_rmem_tensor((self.halves,), Float32)
            for h in cutlass.range_constexpr(self.halves):
                ref = cute.arch.shuffle_sync(wb[4 * h, slot], 0) & 0xFF
                bad = Int32(0)
                for w in cutlass.range_constexpr(4):
                    for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                        b = (wb[4 * h + w, slot] >> (8 * c)) & 0xFF
                        bad = bad | (b * (ref - b))  # 0 iff b is the tile's byte or pad (0)
                tile_byte = ref
                if cute.arch.vote_any_sync(bad != 0):
                    tile_byte = Int32(E8M0_NAN)
                bt[h] = _e8m0_to_f32(tile_byte)
        for w in cutlass.range_constexpr(4):
            pos_a, pos_b = _scale_positions(lane + 32 * w)
            sa = _e8m0_to_f32(_block128_byte(wa[w, slot]))
            if cutlass.const_expr(self.b_tiles_128):
                for h in cutlass.range_constexpr(self.halves):
                    sSFA[pos_a, h, stage] = sa * bt[h]
            else:
                # slot h: the row scales (repeated, so that `load_scales` reads one slot) and
                # the column scales of B tile h
                for h in cutlass.range_constexpr(self.halves):
                    sSFA[pos_a, h, stage] = sa
                    sSFB[pos_b, h, stage] = _e8m0_to_f32(_block128_byte(wb[4 * h + w, slot]))

    @cute.jit
    def write_products(self, sSFA: cute.Tensor, wa: cute.Tensor, wb: cute.Tensor,
                       slot: cutlass.Constexpr[int], stage: Int32, lane: Int32):
        """32x32: the 8 products ``sa[row] * sb[column group]`` each consumer thread needs,
        contiguous per thread: rows r0 = 64 cwg + 16 warp + lane/4 and r0 + 8 (h = 0, 1),
        column groups 0..3 -> ``(r0 // 16 * 8 + r0 % 8) * 8 + 4 h + cg``. Moving the 8 FMULs
        per k-step out of the consumers' promotion (whose issue time adds to the MMA time,
        docs/design/hopper_gemm.md) onto these otherwise idle warps."""
        # column group cg's scale is row 32*cg of the packed B tile: lane 0, word cg
        sbw = cute.make_rmem_tensor((4,), Int32)
        for cg in cutlass.range_constexpr(SCALE_ROWS // 32):
            sbw[cg] = cute.arch.shuffle_sync(wb[cg, slot], 0)
        for w in cutlass.range_constexpr(4):
            r = lane + 32 * w
            base = ((r // 16) * 8 + r % 8) * 8 + ((r % 16) // 8) * 4
            for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                sa = _e8m0_to_f32((wa[w, slot] >> (8 * c)) & 0xFF)
                prod = cute.make_rmem_tensor((SCALE_ROWS // 32,), Float32)
                for cg in cutlass.range_constexpr(SCALE_ROWS // 32):
                    prod[cg] = sa * _e8m0_to_f32((sbw[cg] >> (8 * c)) & 0xFF)
                # one 16-byte store per (row, block): base is a multiple of 4 floats
                dst = cute.make_tensor(sSFA[(None, c, stage)].iterator + base,
                                       cute.make_layout((SCALE_ROWS // 32,)))
                dst.store(prod.load())

    @cute.jit
    def load_scale_words(self, sfA: cute.Tensor, sfB: cute.Tensor, wa: cute.Tensor,
                         wb: cute.Tensor, slot: cutlass.Constexpr[int], a_tile0: Int32,
                         b_tile0: Int32, b_tile1: Int32, kt: Int32, lane: Int32):
        """Lane ``lane``'s 4 words of k-tile ``kt``'s packed scale tiles (A, then B's one or
        two; a second B tile past N reads as 0) -> ring slot."""
        for w in cutlass.range_constexpr(4):
            wa[w, slot] = sfA[(a_tile0 + kt) * SCALE_TILE_WORDS + lane * 4 + w]
            wb[w, slot] = sfB[(b_tile0 + kt) * SCALE_TILE_WORDS + lane * 4 + w]
        if cutlass.const_expr(self.halves == 2):
            for w in cutlass.range_constexpr(4):
                wb[4 + w, slot] = 0
                if b_tile1 >= 0:
                    wb[4 + w, slot] = sfB[(b_tile1 + kt) * SCALE_TILE_WORDS + lane * 4 + w]

    @cute.jit
    def load_scales(self, sSFA: cute.Tensor, sSFB: cute.Tensor, stage: Int32,
                    blk: cutlass.Constexpr[int], pos_a: Int32, q: Int32):
        """(sa0, sa1, sb): this thread's two row scales and its column scales of ``blk``.

        1x32: ``sb`` holds the thread's 32 column scales (8 x 16-byte loads; a 256-column tile:
        their shared-memory view); 32x32: ``sb`` holds the 8 products row scale x column-group
        scale (4 column groups x 2 rows).
        """
        if cutlass.const_expr(self.b_tiles_128):
            # row scale x tile scale of this thread's rows r0, r0 + 8 (write_scales_128)
            sa0 = sSFA[pos_a, blk, stage]
            sa1 = sSFA[pos_a + 1, blk, stage]
            sb = cute.make_rmem_tensor((1,), Float32)
            sb[0] = Float32(1.0)
        elif cutlass.const_expr(self.products):
            # the 8 products written by write_products (pos_a // 2 = this thread's r0 index)
            sa0 = Float32(1.0)
            sa1 = Float32(1.0)
            sb = cute.make_rmem_tensor((2 * (SCALE_ROWS // 32),), Float32)
            view = cute.make_tensor(sSFA[(None, blk, stage)].iterator + (pos_a // 2) * 8,
                                    cute.make_layout((2 * (SCALE_ROWS // 32),)))
            sb.store(view.load())
        elif cutlass.const_expr(self.weights_32x32):
            sa0 = sSFA[pos_a, blk, stage]
            sa1 = sSFA[pos_a + 1, blk, stage]
            sb = cute.make_rmem_tensor((2 * (SCALE_ROWS // 32),), Float32)
            for cg in cutlass.range_constexpr(SCALE_ROWS // 32):
                sbc = sSFB[8 * cg, blk, stage]  # column 32*cg: j = 4*cg, q = 0, e = 0
                sb[cg] = sa0 * sbc
                sb[SCALE_ROWS // 32 + cg] = sa1 * sbc
        else:
            sa0 = sSFA[pos_a, blk, stage]
            sa1 = sSFA[pos_a + 1, blk, stage]
            sb = cute.make_tensor(sSFB[(None, blk, stage)].iterator + q * SFB_Q_STRIDE,
                                  cute.make_layout((SCALE_ROWS // 4,)))
            if cutlass.const_expr(self.halves == 1):
                # into registers: 8 x 16-byte loads. A 256-column tile has no 32 registers to
                # spare beside two accumulators and a temporary (ptxas spills): the promotion
                # reads the column scales from shared memory as it goes
                regs = cute.make_rmem_tensor((SCALE_ROWS // 4,), Float32)
                regs.store(sb.load())
                sb = regs
        return sa0, sa1, sb


def _scale_positions(r):
    """Row / column ``r`` of a packed scale tile -> its fp32 slot in a stage's row scales
    (``pos_a``: a consumer thread's two rows r, r + 8 adjacent) and column scales (``pos_b``:
    a thread's 32 columns contiguous, see `scale_producer`)."""
    pos_a = (((r // 64) * 4 + (r % 64) // 16) * 8 + r % 8) * 2 + (r % 16) // 8
    pos_b = ((r % 8) // 2) * SFB_Q_STRIDE + (r // 8) * 2 + r % 2
    return pos_a, pos_b


@cute.jit
def _e8m0_to_f32(byte: Int32) -> Float32:
    """2^(byte-127) built from the bits (byte 0 gives 0, not 2^-127); 0xFF gives NaN."""
    bits = byte << 23
    if byte == E8M0_NAN:
        bits = Int32(F32_NAN_BITS)
    return bits.bitcast(Float32)


@cute.jit
def _block128_byte(word: Int32) -> Int32:
    """A packed word's 4 block bytes of one row -> its 1x128 scale byte: their maximum, or
    0xFF (NaN) unless every byte equals it or is 0 (pad past a group's or K's end)."""
    top = Int32(0)
    for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
        top = cutlass.max(top, (word >> (8 * c)) & 0xFF)
    bad = Int32(0)
    for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
        b = (word >> (8 * c)) & 0xFF
        bad = bad | (b * (top - b))
    if bad != 0:
        top = Int32(E8M0_NAN)
    return top
