"""Blackwell (sm_100a) grouped block-scaled MXFP8 GEMM: ``tcgen05.mma ... kind::mxf8f6f4
.block_scale.block32`` with E8M0 scales.

This file holds the Blackwell kernel class (`GroupedGemmSm100`), its configuration and
heuristics; the problem and operand checks (`problem.py`), the tile walk over ``offs``
(`schedule.py`) and the launch (`launcher.py`) are shared with the Hopper kernel. Both
groupings (`problem.py`): M-grouped (fprop/dgrad) and K-grouped (wgrad, zeros for an empty
group).

Design (details in docs/design/blackwell_gemm.md):

* Warp-specialised and persistent: warps 0-3 epilogue (TMEM -> registers -> SMEM -> TMA store),
  warp 4 MMA (one thread issues tcgen05.mma), warp 5 TMA loads. Every role walks the same
  device-side schedule (`schedule.GroupedTileSchedule`: units numbered group by group, a cursor
  over ``offs`` read on the device; nothing is synchronised with the host).
* Operands arrive by TMA into an SMEM ring. Group starts are arbitrary token offsets: the TMA
  coordinate tensors are shifted with ``domain_offset`` (TMA box starts need no alignment).
* Scales: the quantizer's packed layout is a sequence of 512-byte tiles (128 rows x 4 blocks),
  exactly the SMEM layout ``tcgen05.cp`` reads. A 128 x 128 operand tile needs one such tile per
  128 rows, so each scale operand is viewed as a flat ``(tiles * 4, 128)`` byte matrix and one
  TMA box of ``(4, 128)`` copies one packed tile verbatim (no repack); its index comes from the
  shared addressing formula (`problem.scale_tile_index`). SMEM -> TMEM by ``tcgen05.cp``
  (``Cp4x32x128bOp``), issued by the MMA warp just before the MMAs that read it.
* Accumulators in TMEM, double-buffered so the epilogue of one tile overlaps the next mainloop.
* M-grouped: rows past a group's end are loaded (they belong to the next group, or are zero-filled
  by TMA past M) but never stored: full tiles leave by TMA store, the last tile of a group by
  predicated per-thread stores. cta_group::2 (256-row MMA over a CTA pair) when groups are large.
* K-grouped: a group's last k-tile may hold tokens of the next group. MMAs of whole 32-token
  blocks past the end are skipped; the tail of the last partial block is zeroed in SMEM (both
  operands) by the MMA warp before it issues the MMA. Output tiles align with ``(E, N, K)``, so
  every tile leaves by TMA store; an empty group stores zeros without reading TMEM.

No Blackwell GPU was available when this was written: the kernel is verified on the CPU by
compiling it for sm_100a and checking its SASS, PTX and descriptor immediates
(tests/kernels/test_grouped_gemm_sm100.py) and by emulating its index code -- schedule, TMA
boxes, swizzled shared memory, tail zeroing, epilogue -- against the reference
(tests/kernels/test_sm100_emulation.py). The first call of each compiled configuration on a
real Blackwell GPU is checked against the reference before use (``check_on_first_use``: the
API runs `moe_mxfp8.selfcheck`, which refuses the kernel if it is wrong, hangs or faults).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ..common import TORCH_TO_CUTLASS
from ..mx_format import BLOCK_SIZE, TILE_BYTES, TILE_ROWS
from .base import MODE_K, MODE_M, GroupedGemmBase
from .schedule import TILE_K
from .sm100_config import (  # noqa: F401  (the config is re-exported)
    EPI_STAGES,
    GroupedGemmSm100Config,
    GroupedGemmSm100Host,
)

SF_VEC_SIZE = BLOCK_SIZE  # MXFP8: one E8M0 scale per 32 elements along K (block32)
MMA_K = 32  # K of one tcgen05.mma kind::mxf8f6f4 instruction (8-bit operands)
K_BLOCKS_PER_TILE = TILE_K // MMA_K
SF_TILE_ROWS = TILE_ROWS  # rows of one 512-byte packed scale tile
SF_BOX = (4, 128)  # a 512-byte packed tile as a TMA box (inner box dimension <= 256 elements)
TMEM_COLS = 512  # TMEM columns per SM; allocated whole (one CTA per SM)
STORE_VECTOR_BYTES = 16  # partial output tiles: one 128-bit global store per 16 bytes
EPI_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
TMA_WARP = 5
THREADS = 32 * 6
EPI_BARRIER_ID = 1
TMEM_ALLOC_BARRIER_ID = 2


class GroupedGemmSm100(GroupedGemmSm100Host, GroupedGemmBase):
    """Persistent, warp-specialised grouped MXFP8 GEMM for sm_100a (see module docstring)."""

    def __init__(self, config: GroupedGemmSm100Config):
        super().__init__(config)
        self.cta_group = tcgen05.CtaGroup.TWO if config.two_cta else tcgen05.CtaGroup.ONE
        self.atom_thr = 2 if config.two_cta else 1
        self.cluster_shape_mn = config.cluster_shape_mn
        self.acc_dtype = cutlass.Float32
        self.a_dtype = cutlass.Float8E4M3FN
        self.b_dtype = cutlass.Float8E4M3FN
        self.sf_dtype = cutlass.Float8E8M0FNU
        self.c_dtype = TORCH_TO_CUTLASS[config.out_dtype]
        self.mma_tiler = (config.mma_m, config.mma_n, TILE_K)
        self.cta_tile_mnk = (config.mma_m // self.atom_thr, config.mma_n, TILE_K)
        # Every CTA needs the scales of the whole MMA N extent, rounded up to 128-row tiles.
        self.sfb_row_tiles = -(-config.mma_n // SF_TILE_ROWS)
        self.num_acc_stage = 2
        self.num_c_stage = EPI_STAGES

    # ------------------------------------------------------------------ static attributes
    def _setup(self):
        self.tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, OperandMajorMode.K, OperandMajorMode.K,
            self.sf_dtype, SF_VEC_SIZE, self.cta_group, self.mma_tiler[:2],
        )
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma.thr_id.shape,)
        )
        self.c_layout = utils.LayoutEnum.ROW_MAJOR
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            self.cta_tile_mnk, self.cfg.two_cta, self.c_layout, self.c_dtype
        )
        self.num_ab_stage = self._compute_ab_stages()
        self.a_smem_layout = sm100_utils.make_smem_layout_a(
            self.tiled_mma, self.mma_tiler, self.a_dtype, self.num_ab_stage
        )
        self.b_smem_layout = sm100_utils.make_smem_layout_b(
            self.tiled_mma, self.mma_tiler, self.b_dtype, self.num_ab_stage
        )
        self.sfa_smem_layout = blockscaled_utils.make_smem_layout_sfa(
            self.tiled_mma, self.mma_tiler, SF_VEC_SIZE, self.num_ab_stage
        )
        self.sfb_smem_layout = blockscaled_utils.make_smem_layout_sfb(
            self.tiled_mma, self.mma_tiler, SF_VEC_SIZE, self.num_ab_stage
        )
        # The same SMEM bytes seen by the scale TMA: one (4, 128) box per 512-byte packed tile.
        self.sfa_tma_layout = cute.make_layout(
            (*SF_BOX, 1, self.num_ab_stage), stride=(SF_BOX[1], 1, TILE_BYTES, TILE_BYTES)
        )
        self.sfb_tma_layout = cute.make_layout(
            (*SF_BOX, self.sfb_row_tiles, self.num_ab_stage),
            stride=(SF_BOX[1], 1, TILE_BYTES, TILE_BYTES * self.sfb_row_tiles),
        )
        self.c_smem_layout = sm100_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.num_c_stage
        )
        # TMEM columns: accumulator stages, then SFA, then SFB. tcgen05.cp (4x32x128b) puts the
        # scales of 128 rows x 4 blocks (one packed tile) in 4 columns per 32-row group, i.e.
        # (rows / 32) x 4 columns per 128-wide k-tile: 16 for 128 rows.
        sf_cols_per_128 = (SF_TILE_ROWS // 32) * K_BLOCKS_PER_TILE
        self.num_sfa_cols = sf_cols_per_128 * (self.cta_tile_mnk[0] // SF_TILE_ROWS)
        self.num_sfb_cols = sf_cols_per_128 * self.sfb_row_tiles
        self.num_acc_cols = self.cta_tile_mnk[1] * self.num_acc_stage
        assert self.num_acc_cols + self.num_sfa_cols + self.num_sfb_cols <= TMEM_COLS

    def _compute_ab_stages(self) -> int:
        """The configuration's stage count (`GroupedGemmSm100Config.ab_stages`, arithmetic the
        launch path shares); its epilogue size must be the traced layout's, else the ring
        would overrun shared memory or the first-use check would not wrap it."""
        c_one = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 1)
        c_bytes = cute.size_in_bytes(self.c_dtype, c_one) * self.num_c_stage
        if c_bytes != self.cfg.epilogue_smem_bytes():
            raise ValueError(f"epilogue staging is {c_bytes} bytes, the stage count assumed "
                             f"{self.cfg.epilogue_smem_bytes()} (sm100_config.EPI_TILE)")
        return self.cfg.ab_stages()

    # ------------------------------------------------------------------ launch
    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        offs_ptr: cute.Pointer,
        m: Int32,
        num_groups: Int32,
        sfa_bytes: Int32,
        sfb_bytes: Int32,
        num_clusters: Int32,
        stream,
    ):
        """Raw device pointers of the torch buffers (contiguous; see `views`), the token count
        ``m``, the group count, the packed scale buffer sizes in bytes (multiples of 512) and
        the persistent grid in clusters (a launch argument: the first-use self-check runs the
        same compiled kernel on a capped grid). Pointers + Int32 sizes keep one compiled
        signature for CPU CI and the GPU."""
        self._setup()
        mA, mB, mC = self.views(a_ptr, b_ptr, out_ptr, m, num_groups)
        # The same output for the predicated stores, with a 64-bit row stride: M x N may pass
        # 2^31 elements (TMA coordinates are per dimension and need no such care).
        mC_st = mC
        if cutlass.const_expr(self.mode == MODE_M):
            mC_st = cute.make_tensor(
                out_ptr, cute.make_layout((m, self.cfg.n, 1),
                                          stride=(cutlass.Int64(self.cfg.n), 1, 0))
            )
        offs = cute.make_tensor(offs_ptr, cute.make_layout(num_groups))
        # Packed scales as (tiles * 4, 128) bytes: row 4*t starts packed tile t.
        mSFA = cute.make_tensor(
            sfa_ptr, cute.make_layout((sfa_bytes // SF_BOX[1], SF_BOX[1]), stride=(SF_BOX[1], 1))
        )
        mSFB = cute.make_tensor(
            sfb_ptr, cute.make_layout((sfb_bytes // SF_BOX[1], SF_BOX[1]), stride=(SF_BOX[1], 1))
        )
        tiled_mma = self.tiled_mma
        a_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, tiled_mma.thr_id)
        b_op = sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, tiled_mma.thr_id)
        a_smem_one = cute.slice_(self.a_smem_layout, (None, None, None, 0))
        b_smem_one = cute.slice_(self.b_smem_layout, (None, None, None, 0))
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, mA, a_smem_one, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
        )
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, mB, b_smem_one, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
        )
        # Scale tiles: a CTA loads its own SFA tile and every SFB tile of the MMA's N extent
        # (both CTAs of a pair need all of SFB in their TMEM); with cta_group::2 the copies
        # complete on the leader CTA's barrier like the operand copies.
        sf_op = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        sf_box = cute.make_layout(SF_BOX, stride=(SF_BOX[1], 1))
        tma_atom_sfa, tma_sfa = cpasync.make_tiled_tma_atom(sf_op, mSFA, sf_box, SF_BOX)
        tma_atom_sfb, tma_sfb = cpasync.make_tiled_tma_atom(sf_op, mSFB, sf_box, SF_BOX)
        epi_smem_one = cute.slice_(self.c_smem_layout, (None, None, 0))
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, epi_smem_one, self.epi_tile
        )
        a_bytes = cute.size_in_bytes(self.a_dtype, a_smem_one)
        b_bytes = cute.size_in_bytes(self.b_dtype, b_smem_one)
        sf_bytes = TILE_BYTES * (1 + self.sfb_row_tiles)
        self.tx_bytes = (a_bytes + b_bytes + sf_bytes) * self.atom_thr

        @cute.struct
        class SharedStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            ab_empty: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            acc_full: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            acc_empty: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            tmem_dealloc: cutlass.Int64
            tmem_holding: cutlass.Int32
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem_layout.outer)], 1024
            ]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout.outer)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_layout.outer)], 1024
            ]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[self.sf_dtype, cute.cosize(self.sfa_smem_layout)], 1024
            ]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[self.sf_dtype, cute.cosize(self.sfb_smem_layout)], 1024
            ]

        self.shared_storage = SharedStorage
        cluster_size = self.cluster_shape_mn[0] * self.cluster_shape_mn[1]
        self.kernel(
            tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_sfa, tma_sfa,
            tma_atom_sfb, tma_sfb, tma_atom_c, tma_c, mC_st, offs, m, self.cluster_layout_vmnk,
            self.a_smem_layout, self.b_smem_layout, self.sfa_smem_layout, self.sfb_smem_layout,
            self.c_smem_layout, self.sfa_tma_layout, self.sfb_tma_layout, self.epi_tile,
        ).launch(
            grid=(num_clusters * cluster_size, 1, 1),
            block=(THREADS, 1, 1),
            cluster=(*self.cluster_shape_mn, 1),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC_tma: cute.Tensor,
        mC: cute.Tensor,
        offs: cute.Tensor,
        num_tokens: Int32,
        cluster_layout_vmnk: cute.Layout,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        sfa_smem_layout: cute.Layout,
        sfb_smem_layout: cute.Layout,
        c_smem_layout: cute.ComposedLayout,
        sfa_tma_layout: cute.Layout,
        sfb_tma_layout: cute.Layout,
        epi_tile: cute.Tile,
    ):
        # Layouts built on the host side of the jit are re-bound to the kernel's own values.
        self.cluster_layout_vmnk = cluster_layout_vmnk
        self.a_smem_layout, self.b_smem_layout = a_smem_layout, b_smem_layout
        self.sfa_smem_layout, self.sfb_smem_layout = sfa_smem_layout, sfb_smem_layout
        self.c_smem_layout, self.epi_tile = c_smem_layout, epi_tile
        self.sfa_tma_layout, self.sfb_tma_layout = sfa_tma_layout, sfb_tma_layout
        self.sched.bind(num_tokens)  # group ends are clamped to it
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == TMA_WARP:
            for atom in (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb, tma_atom_c):
                cpasync.prefetch_descriptor(atom)
        two_cta = cutlass.const_expr(self.atom_thr == 2)
        bidx, _, _ = cute.arch.block_idx()
        v = bidx % self.atom_thr  # this CTA's half of a cta_group::2 MMA tile
        is_leader = v == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = self.cluster_layout_vmnk.get_flat_coord(cta_rank)

        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.ab_full.data_ptr(),
            num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=self.cluster_layout_vmnk,
            defer_sync=True,
        )
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=st.acc_full.data_ptr(),
            num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 32 * len(EPI_WARPS) * self.atom_thr
            ),
            cta_layout_vmnk=self.cluster_layout_vmnk,
            defer_sync=True,
        )
        tmem = utils.TmemAllocator(
            st.tmem_holding.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=TMEM_ALLOC_BARRIER_ID, num_threads=32 * (1 + len(EPI_WARPS))
            ),
            allocator_warp_id=EPI_WARPS[0],
            is_two_cta=two_cta,
            two_cta_tmem_dealloc_mbar_ptr=st.tmem_dealloc.ptr,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = st.sA.get_tensor(self.a_smem_layout.outer, swizzle=self.a_smem_layout.inner)
        sB = st.sB.get_tensor(self.b_smem_layout.outer, swizzle=self.b_smem_layout.inner)
        sSFA = st.sSFA.get_tensor(self.sfa_smem_layout)
        sSFB = st.sSFB.get_tensor(self.sfb_smem_layout)
        sC = st.sC.get_tensor(self.c_smem_layout.outer, swizzle=self.c_smem_layout.inner)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if warp_idx == TMA_WARP:
            self._producer(
                tiled_mma, v, cluster_coord, ab_pipe, tma_atom_a, mA, tma_atom_b, mB,
                tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, sA, sB, sSFA, sSFB, offs,
            )
        if warp_idx == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
            self._mma(
                tiled_mma, is_leader, ab_pipe, acc_pipe, acc_ptr, tCtAcc_fake, sA, sB, sSFA,
                sSFB, offs,
            )
        if warp_idx < MMA_WARP:
            tmem.allocate(TMEM_COLS)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
            self._epilogue(
                tiled_mma, v, acc_pipe, acc_ptr, tCtAcc_fake, tma_atom_c, mC_tma, mC, sC, offs,
            )
            tmem.relinquish_alloc_permit()
            self._epi_barrier().arrive_and_wait()
            tmem.free(acc_ptr)

    def _epi_barrier(self):
        return pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID, num_threads=32 * len(EPI_WARPS))

    @cute.jit
    def _work_range(self):
        """(first unit, stride) of this CTA's cluster in the persistent walk."""
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        return bidx // self.atom_thr, gdim // self.atom_thr

    @cute.jit
    def _out_tile(self, unit: Int32, v: Int32, cur):
        """This CTA's output tile: (first row, first column, batch index, rows to store).

        M-grouped: rows past the group's end belong to the next group and are not stored
        (``valid_rows`` < 128, possibly <= 0 for the second CTA of a pair)."""
        g, _, _, t1, _ = cur
        mt, nt = self.sched.tile_coords(unit, cur)
        a_row, b_row, _, _ = self.sched.origins(mt, nt, cur)
        row0 = a_row + v * self.cta_tile_mnk[0]
        c_l = Int32(0)
        valid_rows = Int32(self.cta_tile_mnk[0])
        if cutlass.const_expr(self.mode == MODE_M):
            valid_rows = cutlass.min(t1 - row0, valid_rows)
        else:
            c_l = g
        return row0, b_row, c_l, valid_rows

    @cute.jit
    def _operand_tiles(self, mA, mB, mt, nt, cur):
        """A / B MMA tiles ``(rows, TILE_K, k-tile)`` of a work unit, shifted to the group's
        arbitrary token origin (TMA box starts need no alignment). The host emulation (tests)
        runs this on coordinate tensors to get the TMA box origins."""
        a_row, b_row, b_l, k0 = self.sched.origins(mt, nt, cur)
        gA = cute.local_tile(
            cute.domain_offset((a_row, k0, 0), mA),
            cute.slice_(self.mma_tiler, (None, 0, None)), (0, None, 0),
        )
        gB = cute.local_tile(
            cute.domain_offset((b_row, k0, 0), mB),
            cute.slice_(self.mma_tiler, (0, None, None)), (0, None, b_l),
        )
        return gA, gB

    # ------------------------------------------------------------------ TMA warp
    @cute.jit
    def _producer(
        self, tiled_mma, v, cluster_coord, ab_pipe, tma_atom_a, mA, tma_atom_b, mB,
        tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, sA, sB, sSFA, sSFB, offs,
    ):
        thr_mma = tiled_mma.get_slice(v)
        a_cta_layout = cute.make_layout(
            cute.slice_(self.cluster_layout_vmnk, (0, 0, None, 0)).shape
        )
        b_cta_layout = cute.make_layout(
            cute.slice_(self.cluster_layout_vmnk, (0, None, 0, 0)).shape
        )
        sSFA_tma = cute.make_tensor(cute.recast_ptr(sSFA.iterator, dtype=cutlass.Uint8),
                                    self.sfa_tma_layout)
        sSFB_tma = cute.make_tensor(cute.recast_ptr(sSFB.iterator, dtype=cutlass.Uint8),
                                    self.sfb_tma_layout)
        # ((box), STAGE) / ((box), tiles)
        tSsSFA, tSgSFA = cpasync.tma_partition(
            tma_atom_sfa, 0, cute.make_layout(1),
            cute.group_modes(sSFA_tma, 0, 3),  # ((box), STAGE)
            cute.group_modes(cute.local_tile(mSFA, SF_BOX, (None, 0)), 0, 2),
        )
        # ((box), ROW_TILE, STAGE) / ((box), tiles)
        tSsSFB, tSgSFB = cpasync.tma_partition(
            tma_atom_sfb, 0, cute.make_layout(1),
            cute.group_modes(sSFB_tma, 0, 2),
            cute.group_modes(cute.local_tile(mSFB, SF_BOX, (None, 0)), 0, 2),
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.num_ab_stage)
        unit, stride = self._work_range()
        cur = self.sched.start(offs)
        cur = self.sched.seek(offs, unit, cur)
        while cur[0] < cute.size(offs):
            mt, nt = self.sched.tile_coords(unit, cur)
            sfa_t, sfb_t, sfb_step = self.sched.scale_tiles(mt, nt, v, cur)
            k_tiles = self.sched.k_tiles(cur)
            gA, gB = self._operand_tiles(mA, mB, mt, nt, cur)
            tAsA, tAgA = cpasync.tma_partition(
                tma_atom_a, cluster_coord[2], a_cta_layout,
                cute.group_modes(sA, 0, 3), cute.group_modes(thr_mma.partition_A(gA), 0, 3),
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b, cluster_coord[1], b_cta_layout,
                cute.group_modes(sB, 0, 3), cute.group_modes(thr_mma.partition_B(gB), 0, 3),
            )
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_atom_a, tAgA[(None, kt)], tAsA[(None, state.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_atom_b, tBgB[(None, kt)], tBsB[(None, state.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_atom_sfa, tSgSFA[(None, sfa_t + kt)],
                          tSsSFA[(None, state.index)], tma_bar_ptr=bar)
                for j in cutlass.range_constexpr(self.sfb_row_tiles):
                    cute.copy(tma_atom_sfb, tSgSFB[(None, sfb_t + j * sfb_step + kt)],
                              tSsSFB[(None, j, state.index)], tma_bar_ptr=bar)
                state.advance()
            unit = unit + stride
            cur = self.sched.seek(offs, unit, cur)
        ab_pipe.producer_tail(state)

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def _mma(
        self, tiled_mma, is_leader, ab_pipe, acc_pipe, acc_ptr, tCtAcc_fake, sA, sB, sSFA,
        sSFB, offs,
    ):
        tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        sfa_ptr = cute.recast_ptr(acc_ptr + self.num_acc_cols, dtype=self.sf_dtype)
        tCtSFA = cute.make_tensor(
            sfa_ptr,
            blockscaled_utils.make_tmem_layout_sfa(
                tiled_mma, self.mma_tiler, SF_VEC_SIZE,
                cute.slice_(self.sfa_smem_layout, (None, None, None, 0)),
            ),
        )
        sfb_ptr = cute.recast_ptr(
            acc_ptr + self.num_acc_cols + self.num_sfa_cols, dtype=self.sf_dtype
        )
        tCtSFB = cute.make_tensor(
            sfb_ptr,
            blockscaled_utils.make_tmem_layout_sfb(
                tiled_mma, self.mma_tiler, SF_VEC_SIZE,
                cute.slice_(self.sfb_smem_layout, (None, None, None, 0)),
            ),
        )
        s2t_sfa, tSsSFA, tStSFA = self._s2t_partition(sSFA, tCtSFA)
        s2t_sfb, tSsSFB, tStSFB = self._s2t_partition(sSFB, tCtSFB)
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)

        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.num_ab_stage)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.num_acc_stage)
        unit, stride = self._work_range()
        cur = self.sched.start(offs)
        cur = self.sched.seek(offs, unit, cur)
        while cur[0] < cute.size(offs):
            k_tiles = self.sched.k_tiles(cur)
            tCtAcc = tCtAcc_base[(None, None, None, acc_state.index)]
            if is_leader:
                acc_pipe.producer_acquire(acc_state)
            for kt in cutlass.range(k_tiles, unroll=1):
                if is_leader:
                    ab_pipe.consumer_wait(ab_state)
                    n_kblocks = Int32(K_BLOCKS_PER_TILE)
                    if cutlass.const_expr(self.mode == MODE_K):
                        n_kblocks = self._fix_group_tail(kt, k_tiles, cur, sA, sB, ab_state)
                    stage = (None, None, None, None, ab_state.index)
                    cute.copy(s2t_sfa, tSsSFA[stage], tStSFA)
                    cute.copy(s2t_sfb, tSsSFB[stage], tStSFB)
                    for kb in cutlass.range_constexpr(K_BLOCKS_PER_TILE):
                        # Set outside the predicate: the MMA's runtime state is an SSA value.
                        # The first k-block of a tile overwrites the accumulator.
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, (kt > 0) if kb == 0 else True)
                        if kb < n_kblocks:
                            kc = (None, None, kb)
                            cute.gemm(
                                tiled_mma, tCtAcc,
                                [tCrA[(None, None, kb, ab_state.index)], tCtSFA[kc]],
                                [tCrB[(None, None, kb, ab_state.index)], tCtSFB[kc]],
                                tCtAcc,
                            )
                    ab_pipe.consumer_release(ab_state)
                ab_state.advance()
            # An empty group (K-grouped) issues no MMA: the epilogue stores zeros for it.
            if is_leader:
                acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            unit = unit + stride
            cur = self.sched.seek(offs, unit, cur)
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def _fix_group_tail(self, kt, k_tiles, cur, sA, sB, ab_state) -> Int32:
        """K-grouped: number of 32-token k-blocks of this k-tile inside the group, after zeroing
        the tokens past the group's end within the last partial block (A and B, in SMEM).

        Tokens past the end belong to the next group (TMA fills zeros only past M); a partial
        block's scale is the group's own, so its foreign tokens must be zero in both operands
        (one zero operand is not enough: 0 x NaN). Then fence so the MMA (async proxy) sees it.
        """
        _, _, t0, t1, _ = cur
        n_kblocks = Int32(K_BLOCKS_PER_TILE)
        if kt == k_tiles - 1:
            valid = t1 - t0 - kt * TILE_K  # 1..128 tokens of this tile are in the group
            n_kblocks = (valid + MMA_K - 1) // MMA_K
            tail = valid % MMA_K
            if tail != 0:
                lane = cute.arch.lane_idx()
                kb = valid // MMA_K
                self._zero_block_tail(self._kblock_bytes(sA, self.a_smem_layout, kb,
                                                         ab_state.index), tail, lane, 32)
                self._zero_block_tail(self._kblock_bytes(sB, self.b_smem_layout, kb,
                                                         ab_state.index), tail, lane, 32)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()
        return n_kblocks

    @cute.jit
    def _kblock_bytes(self, s_op, smem_layout, kb, stage):
        """Byte view ``((rows, 32))`` of k-block ``kb`` of one operand stage, addressed through
        the operand's 128-byte swizzle.

        The operand tensor carries its swizzle in the pointer type (`get_tensor(outer,
        swizzle=inner)`); `cute.recast_tensor` rebuilds the pointer without it (its address
        would be ``r * 128 + c`` instead of the TMA/MMA's ``r * 128 + (c ^ (r % 8) * 16)``),
        so the byte pointer is rebuilt with the layout's swizzle. fp8 and bytes have the same
        width: the layout is unchanged. The host emulation (tests) runs this same code."""
        view = s_op[(None, 0, kb, stage)]
        ptr = cute.recast_ptr(view.iterator, smem_layout.inner, dtype=cutlass.Uint8)
        return cute.make_tensor(ptr, view.layout)

    @cute.jit
    def _zero_block_tail(self, blk, tail, first_row, row_step):
        """Zero bytes ``[tail, 32)`` of rows ``first_row, first_row + row_step, ...`` of a
        k-block byte view (`_kblock_bytes`); one lane per row, the warp covers every row."""
        for r in cutlass.range(first_row, cute.size(blk, mode=[0, 0]), row_step, unroll=1):
            for c in cutlass.range(tail, MMA_K, unroll=1):
                blk[((r, c),)] = cutlass.Uint8(0)

    def _s2t_partition(self, sSF, tSF):
        """tcgen05.cp (SMEM -> TMEM) of a scale tile: copy, partitioned source, destination."""
        tCsSF = cute.filter_zeros(sSF)
        tCtSF = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.sf_dtype)
        tiled = tcgen05.make_s2t_copy(atom, tCtSF)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(tCsSF))
        return tiled, src, thr.partition_D(tCtSF)

    # ------------------------------------------------------------------ epilogue warps
    @cute.jit
    def _epilogue(self, tiled_mma, v, acc_pipe, acc_ptr, tCtAcc_fake, tma_atom_c, mC_tma, mC,
                  sC, offs):
        tidx, _, _ = cute.arch.thread_idx()
        tiled_t2r, tTR_tAcc_base, tTR_cC = self._epi_partition(tidx, acc_ptr, tCtAcc_fake)
        cta_tile_mn = (self.cta_tile_mnk[0], self.cta_tile_mnk[1])
        tTR_rAcc = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0, 0)].shape, self.acc_dtype)
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
        r2s_atom = sm100_utils.get_smem_store_op(
            self.c_layout, self.c_dtype, self.acc_dtype, tiled_t2r
        )
        tiled_r2s = cute.make_tiled_copy_D(r2s_atom, tiled_t2r)
        thr_r2s = tiled_r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_rC = tiled_r2s.retile(tTR_rC)
        c_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.num_c_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(EPI_WARPS)),
        )
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        epi_bar = self._epi_barrier()
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.num_acc_stage)
        n_total = self.cfg.n if self.mode == MODE_M else self.cfg.k
        subtiles = cute.size(tTR_tAcc_base, mode=[3]) * cute.size(tTR_tAcc_base, mode=[4])
        epi_n = cute.size(tTR_tAcc_base, mode=[4])
        c_iter = Int32(0)
        unit, stride = self._work_range()
        cur = self.sched.start(offs)
        cur = self.sched.seek(offs, unit, cur)
        while cur[0] < cute.size(offs):
            row0, col0, c_l, valid_rows = self._out_tile(unit, v, cur)
            has_acc = self.sched.k_tiles(cur) > 0
            full = valid_rows == self.cta_tile_mnk[0]
            gC_tma = cute.flat_divide(
                cute.local_tile(cute.domain_offset((row0, col0, c_l), mC_tma), cta_tile_mn,
                                (0, 0, 0)),
                self.epi_tile,
            )
            bSG_sC, bSG_gC = cpasync.tma_partition(
                tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                cute.group_modes(gC_tma, 0, 2),
            )
            tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_state.index)]
            acc_pipe.consumer_wait(acc_state)
            for s in cutlass.range(subtiles, unroll=1):
                em = s // epi_n
                en = s % epi_n
                if has_acc:
                    cute.copy(tiled_t2r, tTR_tAcc[(None, None, None, em, en)], tTR_rAcc)
                else:
                    tTR_rAcc.fill(0.0)
                tRS_rC.store(tiled_r2s.retile(tTR_rAcc).load().to(self.c_dtype))
                if full:
                    buf = c_iter % self.num_c_stage
                    cute.copy(tiled_r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    epi_bar.arrive_and_wait()
                    if warp_idx == EPI_WARPS[0]:
                        cute.copy(tma_atom_c, bSG_sC[(None, buf)], bSG_gC[(None, em, en)])
                        c_pipe.producer_commit()
                        c_pipe.producer_acquire()
                    epi_bar.arrive_and_wait()
                    c_iter = c_iter + 1
                else:
                    self._store_predicated(
                        tTR_rC, tTR_cC[(None, None, None, em, en)], mC, row0, col0, c_l,
                        valid_rows, n_total,
                    )
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            unit = unit + stride
            cur = self.sched.seek(offs, unit, cur)
        c_pipe.producer_tail()

    @cute.jit
    def _epi_partition(self, tidx, acc_ptr, tCtAcc_fake):
        """TMEM -> register copy of epilogue thread ``tidx``: (tiled copy, its TMEM source
        ``(..., EPI_M, EPI_N, ACC_STAGE)``, the CTA-tile coordinates of its registers
        ``(..., EPI_M, EPI_N)``). Layout algebra only: the host emulation (tests) runs it with
        a stand-in TMEM pointer to get every thread's elements."""
        tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        t2r_atom = sm100_utils.get_tmem_load_op(
            self.cta_tile_mnk, self.c_layout, self.c_dtype, self.acc_dtype, self.epi_tile,
            self.atom_thr == 2,
        )
        # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, STAGE)
        tAcc_epi = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], self.epi_tile)
        tiled_t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = tiled_t2r.get_slice(tidx)
        cta_tile_mn = (self.cta_tile_mnk[0], self.cta_tile_mnk[1])
        cC_epi = cute.flat_divide(cute.make_identity_tensor(cta_tile_mn), self.epi_tile)
        return tiled_t2r, thr_t2r.partition_S(tAcc_epi), thr_t2r.partition_D(cC_epi)

    @cute.jit
    def _store_predicated(self, tTR_rC, tTR_cC, mC, row0, col0, c_l, valid_rows, n_total):
        """The last tile of a group (M-grouped): each thread stores its own elements whose row
        is inside the group and column inside N (rows past the group belong to the next one),
        16 bytes at a time.

        A thread's registers of a subtile are one row's consecutive columns (the TMEM load
        gives lane = row; checked on the host by tests/kernels/test_sm100_emulation.py), and
        ``vec`` consecutive columns starting at a multiple of ``vec`` are 16-byte aligned in
        global memory: the base is 16-byte aligned, the row stride N elements with N % 32 == 0
        (`can_implement`), ``col0`` a multiple of 128. N % 32 == 0 also keeps a vector either
        wholly inside N or wholly past it."""
        vec = STORE_VECTOR_BYTES * 8 // self.c_dtype.width
        frag = cute.make_rmem_tensor((vec,), self.c_dtype)
        for i in cutlass.range_constexpr(0, cute.size(tTR_rC), vec):
            r, c = tTR_cC[i]
            if r < valid_rows and col0 + c < n_total:
                off = cute.crd2idx((row0 + r, col0 + c, c_l), mC.layout)
                dst = cute.make_tensor(mC.iterator + cute.assume(off, divby=vec),
                                       cute.make_layout(vec))
                for j in cutlass.range_constexpr(vec):
                    frag[j] = tTR_rC[i + j]
                dst.store(frag.load())
