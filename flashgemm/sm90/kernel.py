"""Kernel assembly: the masked grouped GEMM for sm_90a.

out[e, :m_e] = a[e, :m_e] @ b[e].T for every expert e, m_e = clamp(masked_m[e], 0, max_m).
This module builds the TMA descriptors, the shared storage and the pipelines,
then hands each warp its role (``producer``, ``storer``, ``consumer``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from ..config import Epilogue, GemmConfig, Staging, Tail, TileOrder
from ..formats import Format
from ..device.layout import batch_last
from ..schedule.dynamic import FEED_STAGES, TileFeed, reader_warps
from .. import trace as tr
from . import barriers
from .consumer import Consumer, ConsumerSmem
from .layouts import GemmLayouts
from .converter import (
    TEAM_WARPS, ConvertedRing, WeightConverter, converter_smem, init_converted_barriers, packed_b_boxes,
    packed_b_partitions,
)
from .act_epilogue import act_target, init_exchange_barriers
from .combine_epilogue import CombineTarget
from .epilogue import SIGNAL_STAGES
from .limits import (
    CONVERTER_REGS, PRODUCER_REGS, SMEM_BYTES, consumer_regs, converter_warpgroups,
    resolved_stages,
)
from .producer import Producer, ProducerLoads
from .storer import TileStorer, run_store_warp
from .walk import BalanceSlot, KernelShape, ProducerClaims, WalkArgs


class MaskedGroupedGemmSm90(GemmLayouts):
    """Persistent, warp-specialized masked grouped GEMM (NT; bf16, block-scaled
    fp8 e4m3, or e4m3 with MXFP4 weights in; fp32 accumulate, bf16 out).

    Warp roles (one CTA per SM, ``config.threads`` threads):

    * warpgroup 0, warp 0: the **producer** (``producer``): walks the tile
      order and issues the TMA loads of A, B (and for fp8 the scales) into
      the ``stages``-deep ring; in a 2-CTA cluster each CTA multicasts half
      of the A tile to both. With the dynamic order rank 0's producer claims
      the units for the cluster.
    * warpgroup 0, warp 1: the **store warp** (``storer``): walks the same
      order, issues the bulk stores of the sub-tiles the consumers staged and
      publishes completion signals. Warps 2-3 only give back registers
      (``setmaxnreg``).
    * warpgroups 1..W: the **consumers** (``consumer``): each owns 64 rows
      of the tile, issues wgmma from the ring (``mainloop``; for fp8 with the
      promotion ``config.promotion`` names) and runs the epilogue
      (``epilogue``): full tiles staged for the store warp, partial ones
      stored row by row; or the fused combine's weighted rows, or the fused
      SwiGLU's h (``act_epilogue``), which the consumers send themselves.
    * MXFP4 weights only, warpgroups W+1..: the **converters**
      (``converter``): turn each slot's packed B into e4m3 (bf16) in place.

    Pipelines and barriers (ids in ``barriers``):

    * operands: ``PipelineTmaAsync``, producer -> consumers, a full/empty
      mbarrier pair per stage (fp8: the full barrier also takes the weight
      scales' ``cp.async`` arrival); with MXFP4 weights a *converted*
      mbarrier per stage, converters -> consumers;
    * output staging: ``barriers.EPILOGUE`` (``Staging.PAIR``: two crossings
      per sub-tile, buffer reuse guarded by the store warp's
      ``cp.async.bulk.wait_group.read``), or a free/staged pair per consumer
      warpgroup (``Staging.WHOLE_TILE``); ``barriers.CONSUMERS`` around the
      partial-tile staging;
    * signals: ``PipelineAsync``, consumers -> store warp, ``SIGNAL_STAGES``
      mbarrier pairs, for the partial tiles the consumers store themselves;
    * ``Tail.BALANCE`` in the expert-major order: ``barriers.BALANCE``, once
      per launch, hands the producer's active-cluster count to the others
      (the producer only arrives); the n-major walker counts in every role;
    * ``TileOrder.DYNAMIC``: a ``FEED_STAGES``-slot claim ring (full/empty
      mbarriers, ``st.async`` into the peer, ``schedule.dynamic``);
    * ``Epilogue.SWIGLU_FP8``: the cluster pair's row maxima, per tile and
      consumer warpgroup: ``st.async`` into the peer's slot of the tile's
      parity, one mbarrier per (parity, warpgroup) (``act_epilogue``).

    With ``config.pdl`` every thread waits in ``griddepcontrol.wait`` after
    the barrier set-up and before its first global access, and the producer
    triggers the next launch once its loads are issued; with
    ``config.l2_warmup`` it first prefetches its likely first weight k-tiles
    into L2.
    """

    def __init__(
        self, config: GemmConfig, ab_dtype, out_dtype, signal_mode=None, trace=False,
        epilogue: Epilogue = Epilogue.STORE, fmt: Format = None,
    ):
        """signal_mode: None, "m_block" or "expert" (see ``signals.py``).
        trace: development builds only; the signals argument is then the
        timeline buffer of ``flashgemm.trace`` (no signals)."""
        if trace and signal_mode is not None:
            raise ValueError("a trace build takes no signal_mode (the buffer replaces the signals)")
        if config.tail is Tail.SPLIT and signal_mode is not None:
            # a tile's two halves finish on two CTAs; the signal counts tiles
            raise ValueError("config.tail=SPLIT builds take no signal_mode")
        if not epilogue.op.signals and (signal_mode is not None or trace or config.staging is not Staging.PAIR):
            raise ValueError(f"an Epilogue.{epilogue.name} build takes no signals, no trace and Staging.PAIR")
        self.config = config
        self.epilogue = epilogue
        self.signal_mode = signal_mode
        self.trace = trace
        self.ab_dtype = ab_dtype
        self.out_dtype = out_dtype
        self.acc_dtype = cutlass.Float32
        if fmt is None:
            fmt = Format.FP8_BLOCK128 if ab_dtype.width == 8 else Format.BF16
        # MXFP4 weights: converted to e4m3 / bf16 in shared memory (``converter``); ab_dtype is the MMA's
        self.fmt, self.converted_b = fmt, fmt.converts_weights
        self.converters = converter_warpgroups(config.consumer_warpgroups) if self.converted_b else 0
        self.tile_mnk = config.tile_mnk(fmt)
        self.stages = resolved_stages(config, fmt, epilogue)
        self.epi_stages = config.epi_buffers
        self.num_consumer_wg = config.consumer_warpgroups
        self.num_consumer_threads = 128 * self.num_consumer_wg
        self.threads = config.threads + 128 * self.converters
        self.cluster_n = config.cluster_n
        self.a_chunk = config.a_chunk_rows
        # e4m3 products promoted with the 1x128 / weight scales (a_scale, b_scale)
        self.blockwise = fmt.promotes
        # the fused fp8 SwiGLU exchanges row maxima with its cluster peer (act_epilogue)
        self.row_max_exchange = epilogue is Epilogue.SWIGLU_FP8
        shape = KernelShape(config, self.tile_mnk, self.stages, ab_dtype, self.acc_dtype, self.blockwise,
                            64 if self.row_max_exchange else 128, self.converted_b)
        self.producer = Producer(shape)
        self.consumer = Consumer(shape, self._make_tiled_mma)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (E, max_m, K), K contiguous
        mB: cute.Tensor,  # (E, N, K), K contiguous; MXFP4: (E, N, K/2) packed e2m1 bytes
        mD: cute.Tensor,  # (E, max_m, N), N contiguous
        mMaskedM: cute.Tensor,  # (E,) int32
        mSignals: cute.Tensor,  # int32 counters, or the trace buffer; None without either
        mSFA: cute.Tensor,  # fp8: (E, max_m, ceil(K/128)) fp32, M contiguous; else None
        mSFB: cute.Tensor,  # fp8: (E, ceil(N/128), ceil(K/128)) fp32; MXFP4: (E, N, K/32) E8M0, N contiguous
        mCounter: cute.Tensor,  # dynamic: (2,) int32 claim counter, zero between launches; else None
        mTokenIdx: cute.Tensor,  # Epilogue.COMBINE* (else None): (E, max_m) int32
        mWeight: cute.Tensor,  # (E, max_m) fp32
        mCombined: cute.Tensor,  # (T, N) fp32, or bf16 for COMBINE_BF16; COMBINE_PEERS: (R, N) bf16
        mErr: cute.Tensor,  # (1,) int32
        mPeers: cute.Tensor,  # Epilogue.COMBINE_PEERS* (else None): (W,) int64 receive-buffer addresses
        mBias: cute.Tensor,  # Epilogue.COMBINE*_BIAS (else None): (E, N) fp32, added to each row
        mDScale: cute.Tensor,  # Epilogue.SWIGLU_FP8 (else None): (E, max_m, N/256) fp32 scales of h (mD)
        num_ctas: Int32,
        stream,
    ):
        self._make_layouts()
        mA_mkl = batch_last(mA)
        mB_nkl = batch_last(mB)
        mD_mnl = None if mD is None else batch_last(mD)
        tma_atom_sfa, mSFA_tma, mSFB_nkl = None, None, None
        if cutlass.const_expr(self.blockwise):
            tma_atom_sfa, mSFA_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                batch_last(mSFA),
                cute.slice_(self._sfa_smem_layout(), (None, None, 0)),
                (self.tile_mnk[0], 1),
            )
            mSFB_nkl = mSFB

        b_smem_one = cute.slice_(self.b_smem_layout, (None, None, 0))
        b_box = (self.tile_mnk[1], self.tile_mnk[2])
        tma_atom_bsf, mBSF_tma = None, None
        if cutlass.const_expr(self.converted_b):
            # the TMA brings the packed tile (into sB) and its exponents; the converters fill sB
            b_smem_one, b_box, (tma_atom_bsf, mBSF_tma) = packed_b_boxes(mSFB, self.tile_mnk)
            mSFB_nkl = None
        d_store_one = cute.slice_(self.d_store_layout, (None, None, 0))
        tma_atom_a, mA_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.cluster_n > 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mA_mkl,
            self.a_box_layout,
            (self.a_chunk or self.tile_mnk[0], self.tile_mnk[2]),
            # chunks are dealt to the cluster's CTAs by the kernel itself
            num_multicast=1 if self.a_chunk else self.cluster_n,
        )
        tma_atom_b, mB_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mB_nkl,
            b_smem_one,
            b_box,
        )
        tma_atom_d, mD_tma = None, None
        if cutlass.const_expr(mD is not None and self.epilogue is Epilogue.STORE):
            tma_atom_d, mD_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                mD_mnl,
                d_store_one,
                self.d_store_box,
            )

        self.shared_storage = self._shared_storage()
        if cutlass.const_expr(self.shared_storage.size_in_bytes() > SMEM_BYTES):  # (limits undercounted)
            raise ValueError(f"{self.shared_storage.size_in_bytes()} bytes of shared memory; sm_90 allows {SMEM_BYTES}")

        self.kernel(
            tma_atom_a, mA_tma, tma_atom_b, mB_tma, tma_atom_d, mD_tma, mD_mnl, mMaskedM, mSignals,
            tma_atom_sfa, mSFA_tma, mSFB_nkl, mCounter, mTokenIdx, mWeight, mCombined, mErr, mPeers, mBias,
            mDScale, tma_atom_bsf, mBSF_tma, self.tiled_mma, self.a_smem_layout, self.b_smem_layout,
            self.d_smem_layout, self.d_store_layout,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_n, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.config.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        mD_tma: cute.Tensor,
        mD_mnl: cute.Tensor,
        mMaskedM: cute.Tensor,
        mSignals: cute.Tensor,
        tma_atom_sfa,  # block-scaled only (else None)
        mSFA_tma,
        mSFB: cute.Tensor,  # (E, N/128, K/128)
        mCounter,  # dynamic only (else None)
        mTokenIdx,  # Epilogue.COMBINE* only (else None)
        mWeight, mCombined, mErr,
        mPeers,  # Epilogue.COMBINE_PEERS* only (else None)
        mBias,  # Epilogue.COMBINE*_BIAS only (else None)
        mDScale,  # Epilogue.SWIGLU_FP8 only (else None)
        tma_atom_bsf,  # MXFP4 weights only (else None): their E8M0 exponents
        mBSF_tma,
        tiled_mma: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        d_smem_layout: cute.ComposedLayout,
        d_store_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        trace_base = bidx * tr.SLOTS
        entry_time = Int32(0)
        if cutlass.const_expr(self.trace):
            entry_time = cute.arch.globaltimer_lo()

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(tma_atom_d is not None):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_d)
            if cutlass.const_expr(self.blockwise):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_sfa)
            if cutlass.const_expr(self.converted_b):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_bsf)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # with config.a_chunk_rows the A bytes are counted per tile (produce_tile)
        if cutlass.const_expr(self.converted_b):
            tma_bytes = self.tile_mnk[1] * (self.tile_mnk[2] // 2 + self.tile_mnk[2] // 32)  # packed + E8M0
        else:
            tma_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_layout, (None, None, 0)))
        if cutlass.const_expr(self.a_chunk == 0):
            tma_bytes += cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_layout, (None, None, 0)))
        if cutlass.const_expr(self.blockwise):
            tma_bytes += self.tile_mnk[0] * 4  # the tile's activation scales
        # Every consumer warp arrives on the empty barrier of each CTA whose
        # producer wrote into the slot: itself, plus the peer that multicast
        # half of A into it. Block-scaled fp8: the full barrier also takes the
        # arrival of the slot's weight-scale cp.async (produce_tile).
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 2 if self.blockwise and not self.converted_b else 1
            ),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.cluster_n * self.num_consumer_wg * 4
            ),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, self.cluster_n, 1)),
            defer_sync=True,
        )
        # partial tiles with signals: every consumer thread hands its stores
        # to the store warp, which publishes them (epilogue.py)
        sig_pipeline = None
        if cutlass.const_expr(self.signal_mode is not None):
            sig_pipeline = pipeline.PipelineAsync.create(
                barrier_storage=storage.sig_mbar.data_ptr(),
                num_stages=SIGNAL_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                defer_sync=True,
            )
        feed = None
        if cutlass.const_expr(self.config.order is TileOrder.DYNAMIC):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    TileFeed.init_barriers(
                        storage.feed_mbar.data_ptr(),
                        reader_warps(self.cluster_n, self.num_consumer_wg + self.converters),
                    )
            feed = TileFeed(
                storage.feed_slots.get_tensor(cute.make_layout(FEED_STAGES)),
                storage.feed_mbar.data_ptr(), self.cluster_n,
            )
        if cutlass.const_expr(self.converted_b):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    init_converted_barriers(storage.conv_mbar.data_ptr(), self.stages, TEAM_WARPS)
        if cutlass.const_expr(self.row_max_exchange):
            if warp_idx == 0:
                init_exchange_barriers(storage.amax_mbar.data_ptr(), self.num_consumer_wg)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, self.cluster_n), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sD = storage.sD.get_tensor(d_smem_layout.outer, swizzle=d_smem_layout.inner)
        sD_store = storage.sD.get_tensor(d_store_layout.outer, swizzle=d_store_layout.inner)

        # (BM, BK, RestM, RestK, E) / (BN, BK, RestN, RestK, E) / (BM, BN, RestM, RestN, E)
        gA = cute.local_tile(mA_mkl, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB_nkl, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        gD_tma, gD_mem = None, None
        if cutlass.const_expr(mD_tma is not None):
            gD_tma = cute.local_tile(mD_tma, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))
            gD_mem = cute.local_tile(mD_mnl, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))

        if cutlass.const_expr(self.a_chunk > 0):
            # (TMA, chunks, 1, stages) / (TMA, RestM in chunks, RestK, E):
            # which chunks a CTA loads is decided per tile (_a_loads)
            gA_chunks = cute.local_tile(mA_mkl, (self.a_chunk, self.tile_mnk[2]), (None, None, None))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_a,
                0,
                cute.make_layout(1),
                cute.group_modes(cute.flat_divide(sA, (self.a_chunk, self.tile_mnk[2])), 0, 2),
                cute.group_modes(gA_chunks, 0, 2),
            )
        else:
            # each CTA of the cluster loads its 1/cluster_n share of the A tile
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_a,
                cta_rank,
                cute.make_layout(self.cluster_n),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
        a_mcast_mask = cutlass.Int16((1 << self.cluster_n) - 1) if self.cluster_n > 1 else None
        tBsB, tBgB, b_exps = None, None, None
        if cutlass.const_expr(self.converted_b):
            tBsB, tBgB, b_exps = packed_b_partitions(
                storage, tma_atom_b, mB_nkl, tma_atom_bsf, mBSF_tma, self.tile_mnk, self.stages)
        else:
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
        sSFA, tSFAsSFA, tSFAgSFA, mSFB_nkl, sSFB = None, None, None, None, None
        if cutlass.const_expr(self.blockwise):
            if cutlass.const_expr(not self.converted_b):
                mSFB_nkl = batch_last(mSFB)
            sSFA = storage.sSFA.get_tensor(self._sfa_smem_layout())
            sSFB = storage.sSFB.get_tensor(self._sfb_smem_layout())
            # (BM, 1, RestM, K/128, E): every CTA loads its own tile's scales
            gSFA = cute.local_tile(mSFA_tma, (self.tile_mnk[0], 1), (None, None, None))
            tSFAsSFA, tSFAgSFA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_sfa, 0, cute.make_layout(1),
                cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2),
            )

        num_experts = cute.size(mA_mkl, mode=[2])
        max_m = cute.size(mA_mkl, mode=[0])
        n_total = cute.size(mB_nkl, mode=[0])
        num_n_blocks = (n_total + self.tile_mnk[1] - 1) // self.tile_mnk[1]
        k_tile_cnt = cute.size(gA, mode=[3])

        # barrier init visible to every thread of the cluster before anyone
        # waits on them or multicasts into a peer
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, self.cluster_n))
        if cutlass.const_expr(self.config.pdl and self.config.l2_warmup):
            if warp_idx == 0:
                self.producer.warm_l2_weights(
                    tma_atom_b, tBgB, bidx // self.cluster_n, cta_rank, num_n_blocks, num_experts, k_tile_cnt
                )
        if cutlass.const_expr(self.config.pdl):
            # With PDL this CTA may run before the previous kernel finished: all
            # above touched only shared memory and parameters; every thread waits
            # here for its writes before any global access.
            cute.arch.griddepcontrol_wait()
        mTrace = None  # trace builds: the timeline buffer, passed as mSignals
        if cutlass.const_expr(self.trace):
            mTrace = mSignals
            if tidx == 0:
                mTrace[trace_base + tr.ENTRY] = entry_time

        epi_barrier = barriers.epilogue(self.num_consumer_threads)
        consumer_barrier = barriers.consumers(self.num_consumer_threads)
        handoff = None
        if cutlass.const_expr(self.config.staging is Staging.WHOLE_TILE):
            handoff = barriers.WarpgroupHandoff(self.num_consumer_wg)
        tile_mn = (self.tile_mnk[0], self.tile_mnk[1])
        num_m_slots = (max_m + self.tile_mnk[0] - 1) // self.tile_mnk[0]
        num_clusters = gdim // self.cluster_n
        # static order: cluster c starts on unit c; dynamic: every unit is
        # claimed, and the walker starts from unit 0
        sched_block = 0 if self.config.order is TileOrder.DYNAMIC else bidx
        # Each role walks its own copy of the tile order (``walk``).
        walk_args = WalkArgs(
            mMaskedM, num_experts, max_m, num_n_blocks, self.tile_mnk[0], sched_block, gdim,
            self.cluster_n, cta_rank,
        )
        producer_claims = ProducerClaims(cta_rank == 0, mCounter)
        balance = None
        if cutlass.const_expr(self.config.tail is Tail.BALANCE and self.config.order is not TileOrder.N_MAJOR):
            # the producer warp publishes the active cluster count to the
            # store warp and the consumers
            balance = BalanceSlot(
                storage.active.get_tensor(cute.make_layout(1)),
                barriers.balance(self.num_consumer_threads + 128 * self.converters),
            )

        if warp_group_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                loads = ProducerLoads(
                    tma_atom_a, tAgA, tAsA, a_mcast_mask, tma_atom_b, tBgB, tBsB,
                    tma_atom_sfa, tSFAgSFA, tSFAsSFA, mSFB_nkl, sSFB, b_exps,
                )
                self.producer.run(
                    walk_args, feed, producer_claims, balance, ab_pipeline, loads, tma_bytes,
                    k_tile_cnt, cta_rank, num_clusters, mCounter, mTrace, trace_base,
                )
            if warp_idx == 1:
                # the store warp: bulk stores and signals, off the wgmma warps
                storer = None  # the fused combine: the consumers send every row themselves
                if cutlass.const_expr(self.epilogue is Epilogue.STORE):
                    storer = TileStorer(
                        sD_store, tma_atom_d, gD_tma, tile_mn, self.epi_tile,
                        cute.arch.lane_idx() == 0, epi_barrier, handoff,
                    )
                run_store_warp(
                    self.config, storer, self.signal_mode, walk_args, feed, balance, sig_pipeline,
                    mSignals, num_m_slots, num_n_blocks, mTrace, trace_base,
                )
        else:
            consumers = (
                tidx, warp_group_idx, tiled_mma, storage, ConsumerSmem(sA, sB, sD, sSFA, sSFB), gD_mem,
                (epi_barrier, consumer_barrier, handoff), walk_args, feed, balance, ab_pipeline, sig_pipeline,
                k_tile_cnt, n_total, mTrace, trace_base, (mD_mnl, mDScale, cta_rank),
                (mTokenIdx, mWeight, mCombined, mErr, mPeers, mBias),
            )
            # (nested in const_expr: builds without converters keep their code unchanged)
            if cutlass.const_expr(self.converted_b):
                if warp_group_idx > self.num_consumer_wg:
                    cute.arch.setmaxregister_decrease(CONVERTER_REGS)
                    WeightConverter(self.config, self.fmt, *self.tile_mnk[1:], self.stages, self.converters).run(
                        tidx - 128 * (1 + self.num_consumer_wg), walk_args, feed, balance, ab_pipeline,
                        converter_smem(storage, sB, sSFB, *self.tile_mnk[1:], self.stages),
                        k_tile_cnt,
                    )
                else:
                    self._consumer_role(*consumers)
            else:
                self._consumer_role(*consumers)

    def _consumer_role(self, tidx, warp_group_idx, tiled_mma, storage, smem, gD_mem, epi_barriers, walk_args,
                       feed, balance, ab_pipeline, sig_pipeline, k_tile_cnt, n_total, mTrace, trace_base,
                       act_args, combine_args):
        """The consumer warpgroups' branch (traced inline)."""
        cute.arch.setmaxregister_increase(consumer_regs(self.num_consumer_wg, self.converters))
        ring = ab_pipeline
        if self.converted_b:
            ring = ConvertedRing(ab_pipeline, storage.conv_mbar.data_ptr())
        target = None  # where a fused epilogue sends the tiles
        if self.epilogue.activates:
            mD_mnl, mDScale, cta_rank = act_args
            target = act_target(storage if self.row_max_exchange else None, mD_mnl, mDScale,
                                self.tile_mnk[0], cta_rank)
        if self.epilogue.combines:
            target = CombineTarget(*combine_args)
        self.consumer.run(
            tidx, warp_group_idx, tiled_mma, smem, gD_mem, self.out_dtype, epi_barriers, walk_args, feed,
            balance, ring, sig_pipeline, k_tile_cnt, n_total, mTrace, trace_base, self.epilogue, target,
        )
