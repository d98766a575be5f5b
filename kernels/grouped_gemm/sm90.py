"""Hopper (sm_90a) grouped MXFP8 GEMM: FP8 e4m3 ``wgmma`` with CUDA-core scale promotion.

This file holds the Hopper kernel class (`GroupedGemmSm90`), its configuration and
heuristics, its scale warps in `sm90_scales.py`; the problem and operand checks
(`problem.py`), the tile walk over ``offs`` (`schedule.py`) and the launch (`launcher.py`)
are shared with the Blackwell kernel. Both
groupings (``config.mode``): M-grouped (fprop ``Y_g = X_g W_g^T``, dgrad ``dX_g = dY_g W_g``)
and K-grouped (wgrad ``dW_g = dY_g^T X_g``, zeros for an empty group).

Structure (persistent: at most one CTA of 384 threads = 3 warpgroups per SM; every role of a CTA
walks the same 128 x ``tile_n`` output tiles of `schedule.GroupedTileSchedule` (x tile fastest,
or in raster bands), and the smem pipeline runs on across tiles, so the next tile's loads
overlap this tile's epilogue):

* warp 0 (producer): TMA of the A and B tiles (128 rows x 128 K bytes each; a 256-column
  tile's B as two 128-row boxes into two sub-stages) into an
  ``S``-stage smem ring (PipelineTmaAsync), the tile origin read from ``offs`` on the GPU.
  K-grouped groups whose first token is not 16-byte aligned cannot be TMA'd (Hopper traps with
  "illegal instruction" on an unaligned innermost TMA coordinate, seen on the device): for
  those this warp copies the window itself (4-byte loads + funnel shift, `copy_producer`) --
  correct but much slower (docs/design/hopper_gemm.md); the launcher avoids it by re-laying
  the groups out first (`problem.align_k_groups`);
* warps 1-3 (scales, k-tiles round-robin): read the two 512-byte packed scale tiles of each
  k-tile (one packed tile is exactly 128 rows x 4 blocks = one k-tile, see
  `problem.scale_tile_index`), convert the E8M0 bytes to fp32 and write them to smem in the
  order the consumers read them (32x32 mode: the 8 row x column-group products each consumer thread
  needs), then arrive on the same "full" mbarrier as the TMA (the barrier counts 1 TMA arrive +
  32 scale-lane arrives);
* warpgroups 1, 2 (consumers, 64 rows each): per k=32 step (one scale block) one
  ``wgmma.m64n128k32`` into a temporary accumulator, then "promotion"
  ``acc += tmp * (sa[row] * sb[col])`` on the CUDA cores. Two temporaries alternate so that the
  next step's wgmma is in flight while the previous one is promoted.
* epilogue (1x128 recipe, 16-bit output, ``tma_store``): each consumer warpgroup writes its
  64 rows into 64 x 64 swizzled boxes in shared memory and one of its warps TMA-stores them;
  the stores drain during the next tile's k-loop (`epilogue_tma`). Otherwise, and for the
  M-grouped rows that cross a group's end: predicated direct stores of adjacent column pairs
  (one 32-bit store per two bf16 values; rows masked by the group end, columns by N).

Group structure comes from ``offs`` on the device (no host sync, `schedule.py`). K-grouped, a
group's last k-tile reads the next group's tokens, which are zeroed in smem (both operands, so
garbage x 0 cannot make NaN) before the wgmma, with ``fence.proxy.async``.

What limits it (measured on an H100, docs/design/hopper_gemm.md): the promotion's
instruction issue adds to the MMA time instead of hiding under it, so the kernel runs at
roughly (MMA + feed time) + (promotion issue time); the promotion is 1 FFMA per accumulator
element per k=32 step in 32x32 mode and 2 FP32 ops (+ scale loads) in 1x32 mode.

Scale modes: 1x32 x 1x32 (default; the row scale times the column scale is formed per element,
2 FP32 ops per element per k-step) and the 32x32 weight mode (``b.block_rows == 32``: one
column scale per 32 output columns, so the 8 distinct products per thread are formed once and
promotion is one FFMA per element).

The 1x128 recipe (``scale_blocks="1x128"``; docs/numerics.md "The 1x128 recipe"): one scale
per 128 elements of the reduced axis on both sides (M-grouped: 128x128 weight tiles), so the 4
wgmmas of a k-tile accumulate in the tensor core and the promotion runs once per k-tile -- 4x fewer
FP32 operations (64 FFMA per thread per k-tile M-grouped, + 64 FMUL K-grouped). The scale
warps check that the 4 replicated block bytes agree (otherwise the outputs become NaN). By
default its output tiles are 128 x 256 (``tile_n``; two column halves of one wgmma N = 128
each, two 64 x 128 accumulators and one temporary per consumer thread, `consumer_k128_wide`)
walked in raster bands of 16 rows of tiles (``band_m``), so the CTAs running at once share B
tiles in L2; 128 x 128 tiles promote k-tile 2p under the wgmmas of 2p+1 instead
(`consumer_k128_overlapped`). What limits this recipe: docs/design/hopper_gemm.md
("1x128 specifics").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory  # noqa: F401  (SmemAllocator)
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32

from ..common import TORCH_TO_CUTLASS
from ..mx_format import K_GROUP_ALIGN
from .base import GroupedGemmBase
from .schedule import TILE_K
from .sm90_config import (  # noqa: F401  (the configuration's names, re-exported)
    DIAG_MODES,
    NO_STORE_SENTINEL,
    RASTER_BAND,
    TILE_M,
    TILE_N,
    TILE_NS,
    TUNING_FIELDS,
    GroupedGemmSm90Config,
    GroupedGemmSm90Host,
    can_cluster,
    output_columns,
)
from .sm90_scales import (
    BLOCKS_PER_KTILE,
    PROD_STRIDE,
    SCALE_ROWS,
    SFA_STRIDE,
    SFB_STRIDE,
    Sm90ScaleWarps,
)

# the tiles' 128 rows (and a column half's 128 columns) are one packed scale tile's rows
assert TILE_M == TILE_N == SCALE_ROWS
THREADS_PER_WG = 128
NUM_CONSUMER_WG = 2
NUM_THREADS = THREADS_PER_WG * (1 + NUM_CONSUMER_WG)
PRODUCER_REGS = 40
CONSUMER_REGS = 232
SMEM_RESERVE = 2048  # barriers + alignment slack
MAX_STAGES = 8
CONSUMER_BARRIER_ID = 1
TMA_INNER_ALIGN = K_GROUP_ALIGN  # TMA's innermost (token) coordinate must be 16-byte aligned
COPY_ROWS = 8  # rows per batch of independent loads in the slow copy path
EPI_BOX = 64  # TMA-store epilogue: 64 x 64 boxes (64 16-bit columns = one 128-byte swizzle row)
EPI_BARRIER_ID = 2  # + consumer warpgroup index: the warpgroup's own epilogue barrier


class GroupedGemmSm90(Sm90ScaleWarps, GroupedGemmSm90Host, GroupedGemmBase):
    """Grouped MXFP8 GEMM for sm_90a; see the module docstring."""

    tile_m = TILE_M

    def __init__(self, config: GroupedGemmSm90Config):
        # column halves of an output tile, each one wgmma N and one packed B scale tile wide
        self.halves = config.tile_n // TILE_N
        super().__init__(config)
        self.weights_32x32 = config.scale_blocks == "32x32"
        # 1x128 recipe: one promotion per k-tile; with B in 128x128 tiles (M-grouped: the
        # weights; K-grouped: the wgrad's activation operand, ``b_block_rows``) the scale warps
        # write the row scale x tile scale products, so the promotion is 1 FFMA per element
        self.blocks_1x128 = config.scale_blocks == "1x128"
        self.b_tiles_128 = self.blocks_1x128 and (self.is_m or config.b_block_rows > 1)
        # scale slots per stage: 1x32 / 32x32 one per k=32 block; 1x128 one per column half
        self.sblocks = self.halves if self.blocks_1x128 else BLOCKS_PER_KTILE
        self.overlap = (self.is_m if config.overlap_promotion is None
                        else config.overlap_promotion)
        self.hoist_scales = (self.weights_32x32 if config.hoist_scales is None
                             else config.hoist_scales)
        self.out_dtype = TORCH_TO_CUTLASS[config.out_dtype]
        # two adjacent output columns as one store (`epilogue`)
        self.pair_dtype = Int32 if self.out_dtype.width == 16 else cutlass.Int64
        self.ab_dtype = cutlass.Float8E4M3FN
        ab_stage_bytes = (TILE_M + self.tile_n) * TILE_K
        # 32x32 mode keeps the row x column-group scale products (PROD_STRIDE per block) in
        # the sSFA region instead of the row and column scales (see scale_producer)
        self.products = self.weights_32x32 and config.scale_products is not False
        self.sfa_stride = PROD_STRIDE if self.products else SFA_STRIDE
        self.sfb_stride = 4 if self.products or self.b_tiles_128 else SFB_STRIDE
        sf_stage_bytes = self.sblocks * (self.sfa_stride + self.sfb_stride) * 4
        self.stage_bytes = ab_stage_bytes + sf_stage_bytes
        self.tma_store = (config.tma_store if config.tma_store is not None
                          else self.blocks_1x128 and config.out_dtype.itemsize == 2)
        # the TMA-store epilogue's buffer: the whole tile, so a tile's stores drain during the
        # next tile's k-loop and the buffer is free again by its epilogue
        self.epi_bytes = TILE_M * self.tile_n * 2 if self.tma_store else 0
        cap = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.stages = config.stages or min(
            MAX_STAGES, (cap - SMEM_RESERVE - self.epi_bytes) // self.stage_bytes)
        self.tx_bytes = ab_stage_bytes

    # ------------------------------------------------------------------ host-side (traced)
    @staticmethod
    def _swizzled(dtype, rows: int, cols: int, count: int):
        """``count`` row-major ``rows x cols`` tiles of ``dtype`` in shared memory, swizzled as
        the wgmma and TMA units read them (128 bytes a row: the 128-byte swizzle)."""
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
        return cute.tile_to_shape(atom, (rows, cols, count), order=(0, 1, 2))

    def _smem_layouts(self):
        # B: a stage of a 256-column tile is two 128-row sub-stages (2 s + h for column half
        # h), each the operand of one wgmma of N = 128 and the target of one TMA box
        return (self._swizzled(self.ab_dtype, TILE_M, TILE_K, self.stages),
                self._swizzled(self.ab_dtype, TILE_N, TILE_K, self.stages * self.halves))

    def _epi_layout(self):
        """The TMA-store epilogue's buffer: 64 x 64 boxes of the output dtype, ``tile_n / 32``
        of them (each consumer warpgroup's 64 rows, box by box)."""
        return self._swizzled(self.out_dtype, EPI_BOX, EPI_BOX,
                              NUM_CONSUMER_WG * self.tile_n // EPI_BOX)

    def _make_tiled_mma(self):
        """Two consumer warpgroups, each m64 n128 k32 fp8 wgmma with K-major operands."""
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            cute.nvgpu.warpgroup.OperandMajorMode.K, cute.nvgpu.warpgroup.OperandMajorMode.K,
            Float32, (NUM_CONSUMER_WG, 1, 1), tiler_mn=(64, TILE_N),
        )

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, sfa_ptr: cute.Pointer,
                 sfb_ptr: cute.Pointer, out_ptr: cute.Pointer, offs_ptr: cute.Pointer, m: Int32,
                 num_groups: Int32, sfa_bytes: Int32, sfb_bytes: Int32, num_clusters: Int32,
                 stream):
        """The launcher's signature (`base.py`): M-grouped mA (M, K), mB (N, K, E), mOut
        (M, N); K-grouped mA (N, M), mB (K, M), mOut (N, K, E); packed scales as int32 words;
        offs (E,); the persistent grid in clusters."""
        self.tiled_mma = self._make_tiled_mma()
        a_layout, b_layout = self._smem_layouts()
        # the slow copy path (`copy_window`) writes the stages through this swizzle
        self.stage_swizzle = (a_layout.inner.num_bits, a_layout.inner.num_base,
                              a_layout.inner.num_shift)
        assert self.stage_swizzle == (b_layout.inner.num_bits, b_layout.inner.num_base,
                                      b_layout.inner.num_shift)
        assert self.stage_swizzle[1] >= 2, "the swizzle must keep 4-byte words whole"
        mA3, mB3, mC3 = self.views(a_ptr, b_ptr, out_ptr, m, num_groups)
        mA = mA3[None, None, 0]
        # the output as pairs of adjacent columns (one 32- or 64-bit store per pair, see
        # `epilogue`; the output width is a multiple of 32, `limits`), 64-bit strides: M x N
        # may pass 2^31 elements
        pair_ptr = cute.recast_ptr(out_ptr, dtype=self.pair_dtype)
        if cutlass.const_expr(self.is_m):
            mB = mB3
            half_n = self.cfg.n // 2
            mOut = cute.make_tensor(pair_ptr, cute.make_layout(
                (m, half_n), stride=(cutlass.Int64(half_n), 1)))
        else:
            mB = mB3[None, None, 0]
            n, half_k = self.cfg.n, self.cfg.k // 2
            mOut = cute.make_tensor(pair_ptr, cute.make_layout(
                (n, half_k, num_groups), stride=(half_k, 1, cutlass.Int64(n * half_k))))
        sfA = cute.make_tensor(cute.recast_ptr(sfa_ptr, dtype=Int32),
                               cute.make_layout(sfa_bytes // 4))
        sfB = cute.make_tensor(cute.recast_ptr(sfb_ptr, dtype=Int32),
                               cute.make_layout(sfb_bytes // 4))
        offs = cute.make_tensor(offs_ptr, cute.make_layout(num_groups))
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        cl = self.cfg.cluster_n
        # in a cluster each CTA loads 1/cl of the shared A tile and multicasts it
        op_a = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp() if cl > 1 else op
        tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op_a, mA, cute.slice_(a_layout, (None, None, 0)), (TILE_M, TILE_K), num_multicast=cl)
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, mB, cute.slice_(b_layout, (None, None, 0)), (TILE_N, TILE_K))
        grid = (num_clusters * cl, 1, 1)
        e_layout = self._epi_layout()
        # `epilogue_tma` writes 4-byte words through this swizzle (it acts on byte offsets)
        self.epi_swizzle = (e_layout.inner.num_bits, e_layout.inner.num_base,
                            e_layout.inner.num_shift)
        assert self.epi_swizzle[1] >= 2, "the swizzle must keep 4-byte words whole"
        tma_c, tC = tma_b, tB  # placeholders when the epilogue stores directly
        if cutlass.const_expr(self.tma_store):
            # the output as (rows, columns[, group]) elements: M-grouped (M, N), K-grouped
            # (N, K, E); boxes past its end are clipped by the TMA unit
            mC = mC3[None, None, 0] if self.is_m else mC3
            tma_c, tC = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC,
                cute.slice_(e_layout, (None, None, 0)), (EPI_BOX, EPI_BOX))
        epi_elems = cute.cosize(e_layout) if self.tma_store else 8

        stages = self.stages
        sfa_words = stages * self.sblocks * self.sfa_stride
        sfb_words = stages * self.sblocks * self.sfb_stride
        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_layout)],
                                  1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_layout)],
                                  1024]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[Float32, sfa_words], 16]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[Float32, sfb_words], 16]
            sE: cute.struct.Align[cute.struct.MemRange[self.out_dtype, epi_elems],
                                  1024 if self.tma_store else 16]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, tA, tma_b, tB, tma_c, tC, mA, mB, mOut, sfA, sfB, offs, m,
                    self.tiled_mma, a_layout, b_layout, e_layout).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], min_blocks_per_mp=1, stream=stream,
            **({"cluster": (cl, 1, 1)} if cl > 1 else {}))

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, tA: cute.Tensor, tma_b: cute.CopyAtom,
               tB: cute.Tensor, tma_c: cute.CopyAtom, tC: cute.Tensor, mA: cute.Tensor,
               mB: cute.Tensor, mOut: cute.Tensor, sfA: cute.Tensor, sfB: cute.Tensor,
               offs: cute.Tensor, num_tokens: Int32, tiled_mma: cute.TiledMma,
               a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
               e_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        num_groups = cute.size(offs)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.tma_store):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=self.stages,
            # full barrier: 1 TMA arrive (with the byte count) + 32 scale-warp arrives
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 if self.cfg.diag == "no_scale_wait" else 1 + 32),
            # empty barrier: one arrive per consumer warp of every CTA of the cluster (the
            # producers write A into each other's stages)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     NUM_CONSUMER_WG * 4 * self.cfg.cluster_n),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, self.cfg.cluster_n, 1)),
        )
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sSFA = storage.sSFA.get_tensor(
            cute.make_layout((self.sfa_stride, self.sblocks, self.stages)))
        sSFB = storage.sSFB.get_tensor(
            cute.make_layout((self.sfb_stride, self.sblocks, self.stages)))
        sE = storage.sE.get_tensor(e_layout.outer, swizzle=e_layout.inner)

        # ---- persistent tile loop: every role of every CTA walks the same units of the
        # schedule, p = cid, cid + n_clusters, ... (n-tile fastest, so concurrent CTAs share A
        # rows in L2); the pipeline runs on across tiles, so the producers load the next tile
        # while the consumers store this one. Clusters of cl CTAs (1-D along x: the rank is
        # bidx % cl): rank r takes unit `cluster_unit(p, r)`, so the cluster's CTAs share the
        # A rows (same group, same k-tiles).
        self.sched.bind(num_tokens)
        cl = self.cfg.cluster_n
        n_ctas, _, _ = cute.arch.grid_dim()
        n_clusters = n_ctas // cl
        cid = bidx // cl
        rank = bidx % cl
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                    self.stages)
                p = cid
                cur = self.sched.seek(offs, self.cluster_unit(p, rank), self.sched.start(offs))
                while cur[0] < num_groups:
                    tx, ty, row0, row_end, _, _, _, k_tiles, _, grp = \
                        self.tile_args(self.cluster_unit(p, rank), cur)
                    tma_ok = True
                    if cutlass.const_expr(not self.is_m):
                        # TMA needs a 16-byte aligned innermost (token) coordinate: groups that
                        # start elsewhere are copied by this warp (slow path, see copy_window)
                        tma_ok = row0 % TMA_INNER_ALIGN == 0
                    if tma_ok:
                        prod = self.tma_producer(pipe, prod, tma_a, tA, tma_b, tB, sA, sB,
                                                 row0, tx, ty, grp, k_tiles, rank)
                    else:
                        prod = self.copy_producer(pipe, prod, mA, mB, storage.sA.data_ptr(),
                                                  storage.sB.data_ptr(), row0, row_end, tx, ty,
                                                  k_tiles)
                    p = p + n_clusters
                    cur = self.sched.seek(offs, self.cluster_unit(p, rank), cur)
                if cutlass.const_expr(cl > 1):
                    # the peer's consumers still arrive on this CTA's empty barriers: wait for
                    # all of them before the CTA may exit
                    pipe.producer_tail(prod)
            if warp_idx > 0 and cutlass.const_expr(self.cfg.diag != "no_scale_wait"):
                kbase = Int32(0)  # k-tiles of this CTA's earlier tiles (pipeline position)
                p = cid
                cur = self.sched.seek(offs, self.cluster_unit(p, rank), self.sched.start(offs))
                while cur[0] < num_groups:
                    _, _, _, _, a_tile0, b_tile0, b_tile1, k_tiles, _, _ = \
                        self.tile_args(self.cluster_unit(p, rank), cur)
                    self.scale_producer(pipe, sfA, sfB, sSFA, sSFB, a_tile0, b_tile0, b_tile1,
                                        kbase, k_tiles, warp_idx - 1)
                    kbase = kbase + k_tiles
                    p = p + n_clusters
                    cur = self.sched.seek(offs, self.cluster_unit(p, rank), cur)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            p = cid
            cur = self.sched.seek(offs, self.cluster_unit(p, rank), self.sched.start(offs))
            while cur[0] < num_groups:
                tx, ty, row0, row_end, _, _, _, k_tiles, tok_valid_last, grp = \
                    self.tile_args(self.cluster_unit(p, rank), cur)
                cons = self.consumer(pipe, cons, tiled_mma, sA, sB, sSFA, sSFB, mOut, tidx,
                                     wg_idx, row0, row_end, tx, ty, grp, k_tiles,
                                     tok_valid_last, tma_c, tC, sE)
                p = p + n_clusters
                cur = self.sched.seek(offs, self.cluster_unit(p, rank), cur)
            if cutlass.const_expr(self.tma_store):
                # the last tile's stores read this CTA's shared memory: done before it exits
                if (tidx % THREADS_PER_WG) // 32 == 0:
                    cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def cluster_unit(self, p: Int32, rank: Int32) -> Int32:
        """Cluster step ``p`` -> the work unit of CTA ``rank``: unit ``cl * p + rank``. The
        schedule keeps each run of ``cl`` units (its x-granule) on adjacent x tiles of one row
        of tiles, i.e. the same A rows, the tiles along x being a multiple of ``cl``
        (`can_cluster`)."""
        return p * self.cfg.cluster_n + rank

    @cute.jit
    def tile_args(self, unit: Int32, cur):
        """Unit ``unit`` of the walk (``cur``: its group's cursor) -> (bidx, bidy, row0,
        row_end, a_tile0, b_tile0, b_tile1, k_tiles, tok_valid_last, group): its tile
        coordinates along x (n-tiles, fastest) and y, its token range, the packed scale tiles
        of k-tile 0 (`problem.scale_tile_index`; ``b_tile1``: a 256-column tile's second B
        tile, -1 when its columns lie past N or the tile has one) and the valid tokens of the
        last k-tile (K-grouped)."""
        g, _, t0, t1, _ = cur
        mt, nt = self.sched.tile_coords(unit, cur)
        a_tile0, b_tile0, b_step = self.sched.scale_tiles(mt, nt, Int32(0), cur)
        b_tile1 = Int32(-1)
        if cutlass.const_expr(self.halves == 2):
            if nt * self.tile_n + TILE_N < output_columns(self.mode, self.cfg.n, self.cfg.k):
                b_tile1 = b_tile0 + b_step
        k_tiles = self.sched.k_tiles(cur)
        row0 = t0
        tok_valid_last = Int32(TILE_K)
        if cutlass.const_expr(self.is_m):
            row0 = t0 + mt * TILE_M
        else:
            tok_valid_last = (t1 - t0) - (k_tiles - 1) * TILE_K
        return nt, mt, row0, t1, a_tile0, b_tile0, b_tile1, k_tiles, tok_valid_last, g

    @cute.jit
    def tma_producer(self, pipe, state, tma_a, tA: cute.Tensor, tma_b, tB: cute.Tensor,
                     sA: cute.Tensor, sB: cute.Tensor, row0: Int32, bidx: Int32, bidy: Int32,
                     grp: Int32, k_tiles: Int32, rank: Int32):
        gA, gBs = self.operand_tiles(tA, tB, row0, bidx, bidy, grp)
        cl = self.cfg.cluster_n
        # with a cluster, this CTA's TMA moves slice `rank` of the A tile into every CTA
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, rank, cute.make_layout(cl), cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2))
        tBsB = None
        tBgBs = []
        for gB in gBs:
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                cute.group_modes(gB, 0, 2))
            tBgBs.append(tBgB)
        for kt in range(k_tiles):
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            if cutlass.const_expr(cl > 1):
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16((1 << cl) - 1))
            else:
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            for h in cutlass.range_constexpr(self.halves):
                cute.copy(tma_b, tBgBs[h][(None, kt)],
                          tBsB[(None, state.index * self.halves + h)], tma_bar_ptr=bar)
            pipe.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def operand_tiles(self, tA: cute.Tensor, tB: cute.Tensor, row0: Int32, bidx: Int32,
                      bidy: Int32, grp: Int32):
        """The TMA tiles of one output tile: A's ``(TILE_M, TILE_K, k-tile)`` and, per column
        half ``h``, B's (rows from ``128 (halves * bidx + h)``). M-grouped A starts at token row
        ``row0``, B in expert ``grp``; K-grouped both start at token ``row0`` (A at output row
        ``128 bidy``). Every origin is reached by shifting (``domain_offset``), never by a tile
        index along a mode, which names tile 0 again where the mode has one tile (`store_boxes`):
        B rows past the end then load as zeros. The CPU test runs this on coordinate tensors."""
        if cutlass.const_expr(self.is_m):
            gA = cute.local_tile(cute.domain_offset((row0, 0), tA), (TILE_M, TILE_K),
                                 (0, None))
            gBs = [cute.local_tile(
                cute.domain_offset(((bidx * self.halves + h) * TILE_N, 0, grp), tB),
                (TILE_N, TILE_K, 1), (0, None, 0))[(None, None, 0, None)]
                   for h in range(self.halves)]
        else:
            gA = cute.local_tile(cute.domain_offset((bidy * TILE_M, row0), tA),
                                 (TILE_M, TILE_K), (0, None))
            gBs = [cute.local_tile(
                cute.domain_offset(((bidx * self.halves + h) * TILE_N, row0), tB),
                (TILE_N, TILE_K), (0, None)) for h in range(self.halves)]
        return gA, gBs

    @cute.jit
    def copy_producer(self, pipe, state, mA: cute.Tensor, mB: cute.Tensor, pA, pB,
                      tok_start: Int32, tok_end: Int32, bidx: Int32, bidy: Int32,
                      k_tiles: Int32):
        """K-grouped slow path for a group whose first token is not 16-byte aligned (TMA
        cannot start there): the warp copies each k-tile window with 4-byte loads + funnel
        shifts into the 128B-swizzled stage, zero past the group end, then arrives."""
        lane = cute.arch.lane_idx()
        sA_w = cute.make_tensor(cute.recast_ptr(pA, dtype=Int32),
                                cute.make_layout(self.stages * TILE_M * TILE_K // 4))
        sB_w = cute.make_tensor(cute.recast_ptr(pB, dtype=Int32),
                                cute.make_layout(self.stages * self.tile_n * TILE_K // 4))
        for kt in range(k_tiles):
            pipe.sync_object_empty.wait(state.index, state.phase)
            t0 = tok_start + kt * TILE_K
            self.copy_window(mA, sA_w, state.index, bidy * TILE_M, t0, tok_end, lane)
            for h in cutlass.range_constexpr(self.halves):
                self.copy_window(mB, sB_w, state.index * self.halves + h,
                                 bidx * self.tile_n + h * TILE_N, t0, tok_end, lane)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(pipe.producer_get_barrier(state))
            state.advance()
        return state

    @cute.jit
    def copy_window(self, mSrc: cute.Tensor, sDst: cute.Tensor, stage: Int32, row_base: Int32,
                    t0: Int32, t_end: Int32, lane: Int32):
        """Tokens [t0, t0+128) of 128 rows -> swizzled smem words; lane i makes word i."""
        bits, base, shift = self.stage_swizzle
        n_rows = cute.size(mSrc, mode=[0])
        row_words = cute.size(mSrc, mode=[1]) // 4
        gw = cute.make_tensor(cute.recast_ptr(mSrc.iterator, dtype=Int32),
                              cute.make_layout(n_rows * row_words))
        wbase = t0 // 4
        sh = (t0 % 4) * 8
        nvalid = cutlass.min(cutlass.max(t_end - (t0 + 4 * lane), 0), 4)
        mask = Int32(-1)
        if nvalid < 4:
            mask = (Int32(1) << (8 * nvalid)) - 1
        lo_ok = (wbase + lane) * 4 < t_end
        hi_ok = lane == 31 and (wbase + 32) * 4 < t_end
        for rb in range(0, TILE_K, COPY_ROWS):
            lo = cute.make_rmem_tensor((COPY_ROWS,), Int32)
            ext = cute.make_rmem_tensor((COPY_ROWS,), Int32)
            for u in cutlass.range_constexpr(COPY_ROWS):
                grow = row_base + rb + u
                lo[u] = 0
                ext[u] = 0
                if grow < n_rows and lo_ok:
                    lo[u] = gw[grow * row_words + wbase + lane]
                if grow < n_rows and hi_ok:
                    ext[u] = gw[grow * row_words + wbase + 32]
            for u in cutlass.range_constexpr(COPY_ROWS):
                r = rb + u
                hi = cute.arch.shuffle_sync_down(lo[u], 1)
                if lane == 31:
                    hi = ext[u]
                out = lo[u]
                if sh != 0:
                    out = Int32((cutlass.Uint32(lo[u]) >> sh) | (cutlass.Uint32(hi) << (32 - sh)))
                # the stage's byte offset of (row r, bytes 4 lane ..): rows of TILE_K bytes,
                # through the smem layout's own swizzle (bits, base, shift), then in words
                byte = r * TILE_K + 4 * lane
                byte = byte ^ (((byte >> (base + shift)) & ((1 << bits) - 1)) << base)
                sDst[stage * (TILE_K * TILE_K // 4) + byte // 4] = out & mask

    @cute.jit
    def zero_tail(self, sA: cute.Tensor, sB: cute.Tensor, stage: Int32, ct: Int32,
                  valid_tok: Int32):
        """Zero token columns >= valid_tok of both operands' stage (K-grouped last k-tile)."""
        # the mbarrier spin of consumer_wait can leave a warp diverged; bar.sync is aligned
        cute.arch.sync_warp()
        for it in range(TILE_M * TILE_K // (THREADS_PER_WG * NUM_CONSUMER_WG)):
            idx = ct + it * THREADS_PER_WG * NUM_CONSUMER_WG
            r = idx // TILE_K
            c = idx % TILE_K
            if c >= valid_tok:
                sA[r, c, stage] = self.ab_dtype(0.0)
                for h in cutlass.range_constexpr(self.halves):
                    sB[r, c, stage * self.halves + h] = self.ab_dtype(0.0)
        # the generic-proxy stores must be visible to the wgmma (async proxy)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        pipeline.NamedBarrier(barrier_id=CONSUMER_BARRIER_ID,
                              num_threads=THREADS_PER_WG * NUM_CONSUMER_WG).arrive_and_wait()

    @cute.jit
    def consumer(self, pipe, state, tiled_mma: cute.TiledMma, sA: cute.Tensor,
                 sB: cute.Tensor,
                 sSFA: cute.Tensor, sSFB: cute.Tensor, mOut: cute.Tensor, tidx: Int32,
                 wg_idx: Int32, row0: Int32, row_end: Int32, bidx: Int32, bidy: Int32,
                 grp: Int32, k_tiles: Int32, tok_valid_last: Int32, tma_c: cute.CopyAtom,
                 tC: cute.Tensor, sE: cute.Tensor):
        cwg = wg_idx - 1
        ct = tidx - THREADS_PER_WG  # 0..255 over both consumer warpgroups
        lane = ct % 32
        warp_in_wg = (ct % THREADS_PER_WG) // 32
        thr_mma = tiled_mma.get_slice(cwg * THREADS_PER_WG)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        acc_shape = thr_mma.partition_shape_C((TILE_M, TILE_N))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        tmp0 = cute.make_rmem_tensor(acc_shape, Float32)
        tmp1 = cute.make_rmem_tensor(acc_shape, Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.cfg.diag == "promote_only"):
            # no wgmma writes the temporaries: left undefined, ptxas folds the promotion away
            # (FADD +QNAN); a runtime value keeps it (per-element values get rematerialized)
            tmp0.fill(Float32(row0))
            tmp1.fill(Float32(row0))
        # this thread's scale offsets inside a stage (see scale_producer)
        pos_a = ((cwg * 4 + warp_in_wg) * 8 + lane // 4) * 2
        q = lane % 4

        acc1 = acc  # a 256-column tile's second column half
        if cutlass.const_expr(self.halves == 2):
            acc1 = cute.make_rmem_tensor(acc_shape, Float32)
            acc1.fill(0.0)
            state = self.consumer_k128_wide(pipe, state, acc, acc1, tmp0, tCrA, tCrB, sA, sB,
                                            sSFA, sSFB, ct, pos_a, q, row0, k_tiles,
                                            tok_valid_last)
        elif cutlass.const_expr(self.blocks_1x128 and self.overlap):
            state = self.consumer_k128_overlapped(
                pipe, state, tiled_mma, acc, tmp0, tmp1, tCrA, tCrB, sA, sB, sSFA, sSFB, ct,
                pos_a, q, row0, k_tiles, tok_valid_last)
        else:
            for kt in range(k_tiles):
                pipe.consumer_wait(state)
                stage = state.index
                if cutlass.const_expr(not self.is_m):
                    # (the slow copy path zero-fills past the group end itself)
                    if (kt == k_tiles - 1 and tok_valid_last < TILE_K
                            and row0 % TMA_INNER_ALIGN == 0):
                        self.zero_tail(sA, sB, stage, ct, tok_valid_last)
                if cutlass.const_expr(self.blocks_1x128):
                    # 1x128: the k-tile's 4 wgmmas accumulate in the tensor core (one scale for
                    # all of them), then one promotion per k-tile. The scales are in smem already
                    # (same full barrier), so they load while the wgmmas run.
                    sa0, sa1, sb = self.load_scales(sSFA, sSFB, stage, 0, pos_a, q)
                    self.issue_ktile(tmp0, tCrA, tCrB, stage, stage)
                    cute.nvgpu.warpgroup.wait_group(0)
                    self.promote(acc, tmp0, sa0, sa1, sb)
                elif cutlass.const_expr(self.cfg.diag == "no_promote"):
                    for blk in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.fence()
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, blk, stage)],
                                  tCrB[(None, None, blk, stage)], acc)
                        cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                elif cutlass.const_expr(self.cfg.double_tmp):
                    # tmp0 takes blocks 0, 2 and tmp1 blocks 1, 3; block j is promoted while the
                    # wgmma of block j+1 runs. Scales are read before the wait (hoist_scales) so
                    # the shared-memory latency hides under the wgmma.
                    self.mma_step(tiled_mma, tmp0, tCrA, tCrB, 0, stage)
                    self.mma_step(tiled_mma, tmp1, tCrA, tCrB, 1, stage)
                    self.wait_and_promote(acc, tmp0, sSFA, sSFB, stage, 0, pos_a, q, 1)
                    self.mma_step(tiled_mma, tmp0, tCrA, tCrB, 2, stage)
                    self.wait_and_promote(acc, tmp1, sSFA, sSFB, stage, 1, pos_a, q, 1)
                    self.mma_step(tiled_mma, tmp1, tCrA, tCrB, 3, stage)
                    self.wait_and_promote(acc, tmp0, sSFA, sSFB, stage, 2, pos_a, q, 1)
                    self.wait_and_promote(acc, tmp1, sSFA, sSFB, stage, 3, pos_a, q, 0)
                else:
                    for blk in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                        self.mma_step(tiled_mma, tmp0, tCrA, tCrB, blk, stage)
                        self.wait_and_promote(acc, tmp0, sSFA, sSFB, stage, blk, pos_a, q, 0)
                pipe.consumer_release(state)
                state.advance()

        col0 = bidx * self.tile_n
        direct = True
        if cutlass.const_expr(self.tma_store):
            # this warpgroup's 64 rows; M-grouped they must all belong to the group
            slab = cwg * (TILE_M // NUM_CONSUMER_WG)
            if cutlass.const_expr(self.is_m):
                direct = row0 + slab + TILE_M // NUM_CONSUMER_WG > row_end
            else:
                direct = False
            if not direct:
                self.epilogue_tma(acc, acc1, tma_c, tC, sE, cwg, warp_in_wg, lane,
                                  row0 + slab if self.is_m else bidy * TILE_M + slab,
                                  col0, grp)
        if direct:
            self.epilogue(acc, mOut, cwg, warp_in_wg, lane, row0, row_end, col0, bidy, grp)
            if cutlass.const_expr(self.halves == 2):
                self.epilogue(acc1, mOut, cwg, warp_in_wg, lane, row0, row_end,
                              col0 + TILE_N, bidy, grp)
        return state

    @cute.jit
    def epilogue_tma(self, acc0: cute.Tensor, acc1: cute.Tensor, tma_c: cute.CopyAtom,
                     tC: cute.Tensor, sE: cute.Tensor, cwg: Int32, warp_in_wg: Int32,
                     lane: Int32, row: Int32, col0: Int32, grp: Int32):
        """The TMA-store epilogue of one consumer warpgroup: its 64 rows (output row ``row``
        on) of the tile whose first column is ``col0``, written as column pairs into its
        64 x 64 boxes of ``sE`` (128-byte swizzle, so the 8 rows of one store instruction hit
        distinct banks), then stored by warp 0 of the warpgroup with one TMA store per box.

        The buffer is reused tile after tile: before writing, warp 0 waits until the previous
        tile's stores have read it (they had a whole k-loop to drain), and a warpgroup barrier
        passes that on. The swizzle is the layout's own (``self.epi_swizzle``, on byte
        offsets), applied by hand as `copy_window` does."""
        boxes = self.tile_n // EPI_BOX  # per warpgroup
        box_words = EPI_BOX * EPI_BOX // 2
        bar = pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID + cwg, num_threads=THREADS_PER_WG)
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()  # bar.sync is aligned; an mbarrier spin may leave a warp diverged
        bar.arrive_and_wait()
        bits, base, shift = self.epi_swizzle
        words = cute.make_tensor(cute.recast_ptr(sE.iterator, dtype=Int32),
                                 cute.make_layout(NUM_CONSUMER_WG * boxes * box_words))
        n_acc = cute.size(acc0)
        for h in cutlass.range_constexpr(self.halves):
            pairs = self.column_pairs(acc0 if h == 0 else acc1)
            # value i = 4 q + 2 hr + b at row 8 hr, column 8 q + b of this thread's origin
            # (see `promote`); a 128-column half is two boxes of 8 column groups each
            for q in cutlass.range(n_acc // 4, unroll_full=True):
                for hr in cutlass.range_constexpr(2):
                    r = warp_in_wg * 16 + lane // 4 + 8 * hr
                    box = cwg * boxes + h * (TILE_N // EPI_BOX) + q // (EPI_BOX // 8)
                    byte = (r * EPI_BOX + (q % (EPI_BOX // 8)) * 8 + 2 * (lane % 4)) * 2
                    byte = byte ^ (((byte >> (base + shift)) & ((1 << bits) - 1)) << base)
                    words[box * box_words + byte // 4] = pairs[2 * q + hr]
        # the generic-proxy stores must be visible to the TMA unit (async proxy)
        cute.arch.fence_proxy("async.shared", space="cta")
        bar.arrive_and_wait()
        if warp_in_wg == 0:
            out_cols = output_columns(self.mode, self.cfg.n, self.cfg.k)
            tSs, tGg = cute.nvgpu.cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sE, 0, 2),
                cute.group_modes(self.store_boxes(tC, row, grp), 0, 2))
            # K-grouped rows wholly past N (the second warpgroup's when N <= 64): no stores
            # (M-grouped rows past the group's end took the direct epilogue)
            rows_end = Int32(self.cfg.n if not self.is_m else 2**31 - 1)
            if row < rows_end:
                for bx in cutlass.range_constexpr(boxes):
                    if col0 + bx * EPI_BOX < out_cols:  # boxes wholly past the end: nothing
                        cute.copy(tma_c, tSs[(None, cwg * boxes + bx)],
                                  tGg[(None, col0 // EPI_BOX + bx)])
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_boxes(self, tC: cute.Tensor, row: Int32, grp: Int32) -> cute.Tensor:
        """The output boxes of the 64 rows from ``row`` (K-grouped: of group ``grp``'s
        ``(N, K)`` matrix): ``(EPI_BOX, EPI_BOX, column box)`` TMA coordinates.

        The rows are reached by shifting the tensor's origin (``domain_offset``), never by a
        tile index along the rows: CuTe gives a mode of one tile stride 0, so with N <= 64 tile
        index 1 named row 0 again and the second warpgroup's zero rows raced the first one's
        results onto them (one 128-column half of a tile came out zero now and then; H100,
        2026-11-27). Shifted, rows past the end stay past it (the TMA unit clips them). The
        CPU test runs this on coordinate tensors (tests/kernels/test_grouped_gemm_sm90.py)."""
        if cutlass.const_expr(self.is_m):
            return cute.local_tile(cute.domain_offset((row, 0), tC), (EPI_BOX, EPI_BOX),
                                   (0, None))
        return cute.local_tile(cute.domain_offset((row, 0, grp), tC), (EPI_BOX, EPI_BOX, 1),
                               (0, None, 0))[(None, None, 0, None)]

    @cute.jit
    def consumer_k128_wide(self, pipe, state, acc0: cute.Tensor, acc1: cute.Tensor,
                           tmp: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                           sA: cute.Tensor, sB: cute.Tensor, sSFA: cute.Tensor,
                           sSFB: cute.Tensor, ct: Int32, pos_a: Int32, q: Int32, row0: Int32,
                           k_tiles: Int32, tok_valid_last: Int32):
        """1x128 k-loop of a 256-column tile: per k-tile and column half h, the 4 wgmmas of
        N = 128 into the one temporary (A stage ``s``, B sub-stage ``2 s + h``), wait, promote
        into ``acc_h`` (K-grouped: the last k-tile's tail zeroed first, `wait_ktile`).

        Two accumulators of 64 x 128 and one temporary are 192 of the 232 registers; a second
        temporary (the 128x128 kernel's overlap) does not fit, so a warpgroup's promotion does
        not overlap its own wgmmas: the other consumer warpgroup's keep the tensor cores busy
        meanwhile (its wgmmas of a half take 2-4x the promotion's issue time). Starting the
        second warpgroup half a k-tile late in each tile (a named barrier), so that the two
        could not fall into step, measured no faster (docs/design/hopper_gemm.md)."""
        for kt in range(k_tiles):
            stage = self.wait_ktile(pipe, state, sA, sB, ct, row0, kt, k_tiles, tok_valid_last)
            for h in cutlass.range_constexpr(2):
                sa0, sa1, sb = self.load_scales(sSFA, sSFB, stage, h, pos_a, q)
                self.issue_ktile(tmp, tCrA, tCrB, stage, stage * 2 + h)
                cute.nvgpu.warpgroup.wait_group(0)
                self.promote(acc0 if h == 0 else acc1, tmp, sa0, sa1, sb)
            pipe.consumer_release(state)
            state.advance()
        return state

    @cute.jit
    def consumer_k128_overlapped(self, pipe, state, tiled_mma: cute.TiledMma, acc: cute.Tensor,
                                 tmp0: cute.Tensor, tmp1: cute.Tensor, tCrA: cute.Tensor,
                                 tCrB: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor,
                                 sSFA: cute.Tensor, sSFB: cute.Tensor, ct: Int32, pos_a: Int32,
                                 q: Int32, row0: Int32, k_tiles: Int32, tok_valid_last: Int32):
        """1x128 k-loop over pairs of k-tiles: the wgmmas of both are issued (into tmp0 and
        tmp1), then k-tile 2p is promoted while those of 2p+1 run.

        Straight-line code between the issue and the last wait of a pair: an accumulator whose
        wgmma is in flight across a branch or loop edge makes ptxas serialise every wgmma
        (seen in SASS: one ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` per wgmma; docs/design/
        hopper_gemm.md), so both stages are waited for (and tail-zeroed) before either is
        issued. ``rel`` trails ``state`` and releases the stages in order.
        """
        rel = state.clone()
        for p in range(k_tiles // 2):
            kt = 2 * p
            st0 = self.wait_ktile(pipe, state, sA, sB, ct, row0, kt, k_tiles, tok_valid_last)
            state.advance()
            st1 = self.wait_ktile(pipe, state, sA, sB, ct, row0, kt + 1, k_tiles,
                                  tok_valid_last)
            state.advance()
            self.issue_ktile(tmp0, tCrA, tCrB, st0, st0)
            self.issue_ktile(tmp1, tCrA, tCrB, st1, st1)
            rel = self.finish_ktile(pipe, rel, acc, tmp0, sSFA, sSFB, pos_a, q, 1)
            rel = self.finish_ktile(pipe, rel, acc, tmp1, sSFA, sSFB, pos_a, q, 0)
        if k_tiles % 2 == 1:
            st0 = self.wait_ktile(pipe, state, sA, sB, ct, row0, k_tiles - 1, k_tiles,
                                  tok_valid_last)
            state.advance()
            self.issue_ktile(tmp0, tCrA, tCrB, st0, st0)
            rel = self.finish_ktile(pipe, rel, acc, tmp0, sSFA, sSFB, pos_a, q, 0)
        return state

    @cute.jit
    def wait_ktile(self, pipe, state, sA: cute.Tensor, sB: cute.Tensor, ct: Int32, row0: Int32,
                   kt: Int32, k_tiles: Int32, tok_valid_last: Int32) -> Int32:
        """Wait for k-tile ``kt``'s stage (K-grouped: zero a group's tail); its index."""
        pipe.consumer_wait(state)
        stage = state.index
        if cutlass.const_expr(not self.is_m):
            if kt == k_tiles - 1 and tok_valid_last < TILE_K and row0 % TMA_INNER_ALIGN == 0:
                self.zero_tail(sA, sB, stage, ct, tok_valid_last)
        return stage

    @cute.jit
    def issue_ktile(self, tmp: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                    stage: Int32, b_stage: Int32):
        """Issue the 4 wgmmas of the k-tile in ``stage`` into ``tmp`` (one commit group); B
        from ``b_stage`` (a 256-column tile's sub-stage, otherwise ``stage``).

        The ACCUMULATE flag is a value of the tiled MMA that ``set`` replaces: a tiled MMA made
        here keeps those values inside this call's control-flow region (the caller's, set
        inside a loop, would not dominate its next use outside)."""
        tiled_mma = self._make_tiled_mma()
        cute.nvgpu.warpgroup.fence()
        for blk in cutlass.range_constexpr(BLOCKS_PER_KTILE):
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, blk != 0)
            cute.gemm(tiled_mma, tmp, tCrA[(None, None, blk, stage)],
                      tCrB[(None, None, blk, b_stage)], tmp)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def finish_ktile(self, pipe, rel, acc: cute.Tensor, tmp: cute.Tensor, sSFA: cute.Tensor,
                     sSFB: cute.Tensor, pos_a: Int32, q: Int32,
                     pending: cutlass.Constexpr[int]):
        """Wait until ``tmp``'s wgmmas are done (``pending`` groups may stay in flight),
        promote it with the scales of stage ``rel`` and release that stage."""
        cute.nvgpu.warpgroup.wait_group(pending)
        sa0, sa1, sb = self.load_scales(sSFA, sSFB, rel.index, 0, pos_a, q)
        self.promote(acc, tmp, sa0, sa1, sb)
        pipe.consumer_release(rel)
        rel.advance()
        return rel

    @cute.jit
    def mma_step(self, tiled_mma: cute.TiledMma, tmp: cute.Tensor, tCrA: cute.Tensor,
                 tCrB: cute.Tensor, blk: cutlass.Constexpr[int], stage: Int32):
        """tmp = A[:, blk] . B[:, blk]^T: one wgmma k=32 step, i.e. one scale block."""
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        if cutlass.const_expr(self.cfg.diag != "promote_only"):
            cute.gemm(tiled_mma, tmp, tCrA[(None, None, blk, stage)],
                      tCrB[(None, None, blk, stage)], tmp)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def wait_and_promote(self, acc: cute.Tensor, tmp: cute.Tensor, sSFA: cute.Tensor,
                         sSFB: cute.Tensor, stage: Int32, blk: cutlass.Constexpr[int],
                         pos_a: Int32, q: Int32, pending: cutlass.Constexpr[int]):
        """Wait until at most ``pending`` wgmma groups are in flight (the one that wrote
        ``tmp`` is done), then ``acc += tmp * sa[row] * sb[col]`` for scale block ``blk``."""
        if cutlass.const_expr(self.hoist_scales):
            sa0, sa1, sb = self.load_scales(sSFA, sSFB, stage, blk, pos_a, q)
            cute.nvgpu.warpgroup.wait_group(pending)
            self.promote(acc, tmp, sa0, sa1, sb)
        else:
            cute.nvgpu.warpgroup.wait_group(pending)
            sa0, sa1, sb = self.load_scales(sSFA, sSFB, stage, blk, pos_a, q)
            self.promote(acc, tmp, sa0, sa1, sb)

    @cute.jit
    def promote(self, acc: cute.Tensor, tmp: cute.Tensor, sa0: Float32, sa1: Float32,
                sb: cute.Tensor):
        """acc += tmp * sa[row] * sb[col] (scales from `load_scales`).

        Accumulator fragment of wgmma m64nN (fp32): value i sits at row ``lane/4 + 8*((i/2)%2)``
        and column ``8*(i/4) + 2*(lane%4) + i%2`` of the warp's 16-row slab.
        """
        # value i = 4 q + 2 h + b: q the 8-column group, h the row half, b the column parity.
        # A runtime loop over q, fully unrolled by the compiler (same SASS), traces 16 bodies
        # instead of 64 (CuTeDSL traces every iteration of a static loop in Python).
        for q in cutlass.range(cute.size(acc) // 4, unroll_full=True):
            for h in cutlass.range_constexpr(2):
                sa = sa0 if h == 0 else sa1
                for b in cutlass.range_constexpr(2):
                    i = 4 * q + 2 * h + b
                    if cutlass.const_expr(self.b_tiles_128):
                        acc[i] = acc[i] + tmp[i] * sa
                    elif cutlass.const_expr(self.weights_32x32):
                        acc[i] = acc[i] + tmp[i] * sb[h * (TILE_N // 32) + q // 4]
                    else:
                        acc[i] = acc[i] + tmp[i] * (sa * sb[q * 2 + b])

    @cute.jit
    def column_pairs(self, acc: cute.Tensor) -> cute.Tensor:
        """``acc`` converted to the output dtype, as pairs of adjacent columns (value ``j`` of
        the result holds accumulator values ``2 j``, ``2 j + 1``: one 32-bit word for bf16,
        64 bits for fp32), the unit both epilogues store."""
        n_acc = cute.size(acc)
        flat = cute.make_tensor(acc.iterator, cute.make_layout(n_acc))
        out = cute.make_rmem_tensor((n_acc,), self.out_dtype)
        out.store(flat.load().to(self.out_dtype))
        return cute.recast_tensor(out, self.pair_dtype)

    @cute.jit
    def epilogue(self, acc: cute.Tensor, mOut: cute.Tensor, cwg: Int32, warp_in_wg: Int32,
                 lane: Int32, row0: Int32, row_end: Int32, col0: Int32, bidy: Int32,
                 grp: Int32):
        """Store a 128-column accumulator whose first output column is ``col0``: values
        ``2 j``, ``2 j + 1`` (adjacent columns of one row) as one 32-bit (bf16) or 64-bit (fp32)
        store into ``mOut``, the output viewed as column pairs (half the store instructions
        of element stores)."""
        n_acc = cute.size(acc)
        pairs = self.column_pairs(acc)
        r_base = cwg * 64 + warp_in_wg * 16 + lane // 4
        p_base = col0 // 2 + lane % 4  # this thread's first column pair
        n_len = cute.size(mOut, mode=[0 if not self.is_m else 1])
        k_len = cute.size(mOut, mode=[1])
        # value i = 4 q + 2 h + b at row 8 h, column 8 q + b of this thread's origin (see
        # `promote`): pair j = 2 q + h at column pair 4 q; the runtime loop over q is fully
        # unrolled (fewer bodies to trace)
        for q in cutlass.range(n_acc // 4, unroll_full=True):
            for h in cutlass.range_constexpr(2):
                pc = p_base + 4 * q
                if cutlass.const_expr(self.cfg.diag == "no_store"):
                    # every pair is tested (so computed); only one equal to the sentinel
                    # (none, in practice) keeps its column and is stored
                    if pairs[2 * q + h] != self.pair_dtype(NO_STORE_SENTINEL):
                        pc = n_len + k_len
                if cutlass.const_expr(self.is_m):
                    row = row0 + r_base + 8 * h
                    if row < row_end and pc < n_len:
                        mOut[row, pc] = pairs[2 * q + h]
                else:
                    row = bidy * TILE_M + r_base + 8 * h
                    if row < n_len and pc < k_len:
                        mOut[row, pc, grp] = pairs[2 * q + h]

