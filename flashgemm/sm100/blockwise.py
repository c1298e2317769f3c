"""Kernel assembly: the masked grouped GEMM for sm_100a / sm_103a with
DeepSeek's fp8 block-scale recipe (fp32 scales: one per 1x128 block of
``a``, one per 128x128 block of ``b``).

out[e, r, n] = sum_k a[e, r, k] sfa[e, r, k // 128] b[e, n, k] sfb[e, n // 128, k // 128]
for r < m_e = clamp(masked_m[e], 0, max_m). This module builds the TMA
descriptors, the shared storage and the pipelines, then hands each warp its
role (``blockwise_roles`` for loads and MMAs, ``blockwise_epilogue`` for
promotion and stores).
"""

# (no `from __future__ import annotations`: cute.struct reads its field annotations as types)

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils.layout import LayoutEnum

from ..device.layout import batch_last
from .blockwise_epilogue import PromoteEpilogue
from .blockwise_roles import run_load_warp, run_mma_warp, tcgen05_fence
from .blockwise_store import TileStoreWarp
from .limits import SMEM_BYTES

TILE_M = 128
TILE_N = 128  # one weight scale covers the tile's columns
SCALE_BLOCK = 128  # K per MMA k-block: one activation and one weight scale each
ACC_STAGES = 4  # 128 fp32 TMEM columns each: the whole 512-column tensor memory
TMEM_COLUMNS = ACC_STAGES * TILE_N
A_CHUNK = 32  # rows per TMA box of A: boxes past the tile's valid rows are skipped

# warp roles (one CTA per SM)
EPILOGUE_WARPS = (0, 1, 2, 3)  # warp w % 4 reads TMEM lanes [32 w, 32 w + 32)
MMA_WARP = 4
LOAD_WARP = 5
STORE_WARP = 6
THREADS = 32 * 7
EPILOGUE_THREADS = 32 * len(EPILOGUE_WARPS)


def smem_bytes(stages: int) -> int:
    """Shared memory of a build: A/B ring, activation-scale ring, the staged
    output tile, barriers and alignment slack."""
    ab = stages * (TILE_M + TILE_N) * SCALE_BLOCK  # fp8: one byte each
    sfa = sfa_stages(stages) * TILE_M * 4
    out = TILE_M * TILE_N * 2
    return ab + sfa + out + 1024 + 4 * 1024


def sfa_stages(stages: int) -> int:
    """Activation-scale slots: a slot is freed by the epilogue, which runs up
    to ACC_STAGES k-blocks behind the MMAs; with fewer slots the load warp
    would wait on the epilogue instead of on the A/B ring."""
    return stages + ACC_STAGES


class BlockwiseMaskedGemmSm100:
    """Persistent, warp-specialized masked grouped GEMM, fp8 e4m3 with fp32
    block scales, tcgen05 MMAs into tensor memory, bf16 out. 1-CTA, 128x128
    tiles, one CTA per SM, 224 threads.

    Warp roles (every role walks its own ``MaskedTileScheduler`` over the
    same masked_m, so all see the same tiles in the same order):

    * warp 5, **load** (``blockwise_roles.run_load_warp``): per k-block of
      128, TMA loads of the A and B tiles into the ``stages``-deep ring, and
      of the tile's 128 activation scales (M contiguous) into the scale ring.
    * warp 4, **MMA** (``blockwise_roles.run_mma_warp``): per k-block, four
      ``tcgen05.mma ... kind::f8f6f4`` (K = 32 each) into a fresh TMEM
      accumulator stage (ACCUMULATE cleared on the first), then commits the
      stage to the epilogue and the A/B slot back to the load warp.
    * warps 0-3, **epilogue** (``blockwise_epilogue.PromoteEpilogue``): one
      tile row per thread. Per k-block, ``tcgen05.ld`` of the stage,
      ``sum += acc * sfa[row] * sfb`` on CUDA cores (the fp32 running sum in
      registers), then the stage goes back to the MMA warp. After the last
      k-block: bf16 into the staged shared-memory tile (full tile), or
      direct stores of the valid rows only (an expert's last, partial tile).
      Warp 0 allocates and frees the tensor memory.
    * warp 6, **store** (``blockwise_store.TileStoreWarp``): TMA stores of
      each staged full tile, then the optional completion signal of every
      tile, so the epilogue never waits for global memory.

    Pipelines (all on mbarriers; no named-barrier ids):

    * A/B: ``PipelineTmaUmma`` (TMA -> tcgen05), ``stages`` slots;
    * activation scales: ``PipelineTmaAsync`` (TMA -> epilogue warps),
      ``sfa_stages(stages)`` slots; the weight scale is a plain global load
      (one per 32 k-blocks and lane, any strides) handed out by shuffle;
    * accumulator: ``PipelineUmmaAsync`` (tcgen05.commit -> epilogue warps),
      ACC_STAGES stages of 128 TMEM columns, with ``tcgen05.wait::ld`` and
      the tcgen05 thread-sync fences around each hand-over;
    * output: ``PipelineAsync``, one slot, epilogue warps (128 arrivals) ->
      store warp (frees it once its bulk stores have read the staged tile);
      it also orders a partial tile's row stores before the signal.

    Launched with programmatic dependent launch: every thread waits in
    ``griddepcontrol.wait`` after the set-up and before its first global
    access; the load warp triggers the next launch once its loads are issued.
    """

    def __init__(self, stages: int, signal_mode=None):
        if smem_bytes(stages) > SMEM_BYTES:
            raise ValueError(f"{stages} stages need {smem_bytes(stages)} bytes of shared memory")
        self.stages = stages
        self.signal_mode = signal_mode
        self.ab_dtype = cutlass.Float8E4M3FN
        self.out_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.sfa_stages = sfa_stages(stages)
        self.cta_tile_mnk = (TILE_M, TILE_N, SCALE_BLOCK)

    def _make_tiled_mma(self):
        return sm100_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            tcgen05.CtaGroup.ONE,
            (TILE_M, TILE_N),
        )

    def _make_layouts(self, tiled_mma):
        self.a_smem_layout = sm100_utils.make_smem_layout_a(
            tiled_mma, self.cta_tile_mnk, self.ab_dtype, self.stages
        )
        # the same bytes as (rows, K, stage): the view the row boxes of A are cut from
        self.a_rows_layout = sm100_utils.make_smem_layout(
            cute.nvgpu.OperandMajorMode.K, (TILE_M, SCALE_BLOCK), self.ab_dtype, self.stages
        )
        self.b_smem_layout = sm100_utils.make_smem_layout_b(
            tiled_mma, self.cta_tile_mnk, self.ab_dtype, self.stages
        )
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            self.cta_tile_mnk, False, LayoutEnum.ROW_MAJOR, self.out_dtype
        )
        # the whole output tile is staged: one buffer per epilogue sub-tile
        subtiles = (TILE_M // cute.size(self.epi_tile[0])) * (TILE_N // cute.size(self.epi_tile[1]))
        self.c_smem_layout = sm100_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, subtiles
        )

    def _shared_storage(self):
        """Built on the host side with the layouts' sizes (ints): a layout
        value made there cannot be used inside the kernel."""
        stages, sfa_stages_ = self.stages, self.sfa_stages
        c_size = cute.cosize(self.c_smem_layout.outer)
        a_size = cute.cosize(self.a_smem_layout.outer)
        b_size = cute.cosize(self.b_smem_layout.outer)

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sfa_mbar: cute.struct.MemRange[cutlass.Int64, 2 * sfa_stages_]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, 2 * ACC_STAGES]
            handoff_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: cutlass.Int32
            sC: cute.struct.Align[
                cute.struct.MemRange[self.out_dtype, c_size], 1024
            ]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, a_size], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, b_size], 1024
            ]
            sSFA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, TILE_M * sfa_stages_], 128]

        if SharedStorage.size_in_bytes() > SMEM_BYTES:
            raise ValueError(f"{stages} stages need {SharedStorage.size_in_bytes()} bytes of shared memory")
        return SharedStorage

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (E, max_m, K) fp8, K contiguous
        mB: cute.Tensor,  # (E, N, K) fp8, K contiguous
        mSFA: cute.Tensor,  # (E, max_m, ceil(K/128)) fp32, M contiguous
        mSFB: cute.Tensor,  # (E, ceil(N/128), ceil(K/128)) fp32, any strides
        mC: cute.Tensor,  # (E, max_m, N) bf16, N contiguous
        mMaskedM: cute.Tensor,  # (E,) int32, read on the device only
        mSignals: cute.Tensor,  # int32 counters, or None without a signal mode
        num_ctas: Int32,
        stream,
    ):
        tiled_mma = self._make_tiled_mma()
        self._make_layouts(tiled_mma)
        mA_mkl, mB_nkl, mC_mnl = batch_last(mA), batch_last(mB), batch_last(mC)
        # (max_m, K blocks, E): one TMA box is the tile's 128 rows of one k-block
        mSFA_mkl = batch_last(mSFA)
        cluster_vmnk = cute.make_layout((1, 1, 1, 1))

        a_box = cute.slice_(
            sm100_utils.make_smem_layout(
                cute.nvgpu.OperandMajorMode.K, (A_CHUNK, SCALE_BLOCK), self.ab_dtype, 1
            ),
            (None, None, 0),
        )
        b_box = cute.slice_(self.b_smem_layout, (None, None, None, 0))
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA_mkl, a_box, (A_CHUNK, SCALE_BLOCK)
        )
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), mB_nkl, b_box, self.cta_tile_mnk,
            tiled_mma, cluster_vmnk.shape,
        )
        tma_atom_sfa, tma_sfa = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mSFA_mkl, cute.make_layout((TILE_M, 1)), (TILE_M, 1)
        )
        c_box = cute.slice_(self.c_smem_layout, (None, None, 0))
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC_mnl, c_box, self.epi_tile
        )
        # the slot's barrier: B's bytes here, A's per tile (only its valid row boxes)
        b_bytes = cute.size_in_bytes(self.ab_dtype, b_box)
        a_chunk_bytes = cute.size_in_bytes(self.ab_dtype, a_box)
        self.shared_storage = self._shared_storage()

        self.kernel(
            tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_sfa, tma_sfa, tma_atom_c, tma_c,
            mC_mnl, mSFB, mMaskedM, mSignals, self.a_smem_layout, self.a_rows_layout, self.b_smem_layout,
            self.c_smem_layout, self.epi_tile, b_bytes, a_chunk_bytes,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[THREADS, 1, 1],
            cluster=[1, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA_mkl: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC_tma: cute.Tensor,  # the TMA store's coordinate tensor (M, N, E)
        mC_mnl: cute.Tensor,  # the output itself, for the partial tiles' direct stores
        mSFB: cute.Tensor,
        mMaskedM: cute.Tensor,
        mSignals: cute.Tensor,
        a_smem_layout: cute.ComposedLayout,
        a_rows_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        c_smem_layout: cute.ComposedLayout,
        epi_tile: cute.Tile,
        b_bytes: cutlass.Constexpr,
        a_chunk_bytes: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()

        if warp_idx == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_sfa)
            cpasync.prefetch_descriptor(tma_atom_c)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # pipelines: barriers initialised here, made visible by the CTA
        # barrier below before any role waits on them
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            tx_count=b_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        # the epilogue releases a scale slot with lane 0 of each warp
        sfa_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.sfa_mbar.data_ptr(),
            num_stages=self.sfa_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(EPILOGUE_WARPS)),
            tx_count=TILE_M * 4,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        # every epilogue thread releases an accumulator stage after its own TMEM loads
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=ACC_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPILOGUE_THREADS),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        # epilogue warps -> store warp, one tile at a time (one staged tile)
        handoff = pipeline.PipelineAsync.create(
            barrier_storage=storage.handoff_mbar.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPILOGUE_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),  # the store warp's lane 0
            defer_sync=True,
        )
        if warp_idx == EPILOGUE_WARPS[0]:
            # every tile's accumulator lives in TMEM from here to the end
            cute.arch.alloc_tmem(TMEM_COLUMNS, storage.tmem_addr.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
            tcgen05_fence(after_sync=False)
        cute.arch.mbarrier_init_fence()
        # the barriers and the TMEM address are visible to every warp
        cute.arch.barrier()
        # Launched with programmatic dependent launch, this CTA may run before
        # the previous kernel on the stream has finished (e.g. the memset of
        # the signals): everything above touched only shared memory, TMEM and
        # the parameters. Every thread waits here for that kernel's completion
        # before its first global access (masked_m, operands, out, signals).
        cute.arch.griddepcontrol_wait()

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sA_rows = storage.sA.get_tensor(a_rows_layout.outer, swizzle=a_rows_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sC = storage.sC.get_tensor(c_smem_layout.outer, swizzle=c_smem_layout.inner)
        sSFA = storage.sSFA.get_tensor(cute.make_layout((TILE_M, self.sfa_stages)))

        num_experts = cute.size(mA_mkl, mode=[2])
        max_m = cute.size(mA_mkl, mode=[0])
        n_total = cute.size(mB_nkl, mode=[0])
        num_n_blocks = (n_total + TILE_N - 1) // TILE_N
        walk = (mMaskedM, num_experts, max_m, num_n_blocks, TILE_M, bidx, grid)

        # (MMA, MMA_M, MMA_N, ACC_STAGES) accumulator stages in TMEM
        acc_shape = tiled_mma.partition_shape_C((TILE_M, TILE_N))
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, ACC_STAGES))
        tmem_ptr = cute.arch.retrieve_tmem_ptr(self.acc_dtype, 16, storage.tmem_addr.ptr)
        tCtAcc = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)

        if warp_idx == LOAD_WARP:
            run_load_warp(
                walk, tiled_mma, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, tma_atom_sfa, mSFA_mkl,
                sA_rows, sB, sSFA, ab_pipe, sfa_pipe, self.stages, self.sfa_stages, self.cta_tile_mnk,
                A_CHUNK, a_chunk_bytes,
            )
        if warp_idx == MMA_WARP:
            run_mma_warp(walk, tiled_mma, mA_mkl, sA, sB, tCtAcc, ab_pipe, acc_pipe, self.stages,
                         ACC_STAGES, self.cta_tile_mnk)
        if warp_idx < MMA_WARP:
            epilogue = PromoteEpilogue(
                tidx, tCtAcc, sC, sSFA, mC_mnl, mSFB, epi_tile, self.out_dtype, self.acc_dtype
            )
            epilogue.run(walk, mA_mkl, acc_pipe, sfa_pipe, self.sfa_stages, handoff)
        if warp_idx == STORE_WARP:
            sub_mn = (TILE_M // cute.size(epi_tile[0]), TILE_N // cute.size(epi_tile[1]))
            storer = TileStoreWarp(
                sC, tma_atom_c, mC_tma, mSignals, epi_tile, sub_mn, self.signal_mode, (TILE_M, TILE_N)
            )
            storer.run(walk, max_m, handoff)

        # every role is done: the last MMA was read back, so TMEM can go
        tcgen05_fence(after_sync=False)
        cute.arch.barrier()
        if warp_idx == EPILOGUE_WARPS[0]:
            tcgen05_fence(after_sync=True)
            cute.arch.dealloc_tmem(tmem_ptr, TMEM_COLUMNS)
