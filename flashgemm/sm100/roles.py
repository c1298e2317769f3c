"""The kernel body of ``MaskedGroupedGemmSm100``: barriers, pipelines, the
TMEM allocation and the partitions every role needs, then one role per warp
(ids below; the class docstring says what each does)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import TmemAllocator

from . import barriers
from .epilogue import partition as partition_epilogue, run_epilogue
from .limits import TMEM_COLS
from .mma_warp import make_scale_copy, run_mma_warp
from .padded_b import prefetch_padded_b
from .producer import PaddedLoads, partition_loads, run_tma_warp
from .tiling import Tiling

EPILOGUE_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
TMA_WARP = 5


@cute.jit
def run_roles(gemm, tma_a, tma_b, tma_sfa, tma_sfb, tma_c, mD_mnl, mMaskedM, mAlpha, mSignals):
    # rebuilt inside the kernel: layouts made by the host side cannot enter it
    t = Tiling(gemm.config, gemm.ab_dtype, gemm.sf_dtype, gemm.out_dtype, gemm.b_dtype).setup()
    tiled_mma = t.tiled_mma
    atom_a, mA_tma = tma_a
    atom_b, mB_tma = (None, None) if t.b_padded else tma_b
    atom_sfa, mSFA_tma = tma_sfa
    atom_sfb, mSFB_tma = tma_sfb
    atom_c, mD_tma = tma_c
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    pair = cute.size(tiled_mma.thr_id.shape)
    cta_v = bidx % pair  # this CTA's half of a 2-CTA tile (0 in 1-CTA builds)
    is_leader = cta_v == 0
    cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
    coord_vmnk = t.cluster_layout_vmnk.get_flat_coord(cta_rank)

    if warp_idx == TMA_WARP:
        cpasync.prefetch_descriptor(atom_a)
        if cutlass.const_expr(t.b_padded):
            prefetch_padded_b(tma_b)
        else:
            cpasync.prefetch_descriptor(atom_b)
        cpasync.prefetch_descriptor(atom_c)
        if cutlass.const_expr(t.block_scaled):
            cpasync.prefetch_descriptor(atom_sfa)
            cpasync.prefetch_descriptor(atom_sfb)

    smem = cutlass.utils.SmemAllocator()
    storage = smem.allocate(gemm.shared_storage)
    # full: the TMA bytes of the pair; empty: the leader's tcgen05.commit
    # (multicast back to the CTAs whose TMA filled the stage)
    ab_pipeline = pipeline.PipelineTmaUmma.create(
        barrier_storage=storage.ab_mbar.data_ptr(),
        num_stages=t.stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        tx_count=t.stage_tx_bytes(),
        cta_layout_vmnk=t.cluster_layout_vmnk,
        defer_sync=True,
    )
    acc_pipeline = pipeline.PipelineUmmaAsync.create(
        barrier_storage=storage.acc_mbar.data_ptr(),
        num_stages=t.acc_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        # every epilogue thread of the pair releases the leader's buffer
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, barriers.EPILOGUE_THREADS * pair),
        cta_layout_vmnk=t.cluster_layout_vmnk,
        defer_sync=True,
    )
    tmem = TmemAllocator(
        storage.tmem_holding_buf.ptr,
        barrier_for_retrieve=barriers.tmem_alloc(),
        allocator_warp_id=EPILOGUE_WARPS[0],
        is_two_cta=pair == 2,
        two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
    )
    pipeline.pipeline_init_arrive(cluster_shape_mn=t.cluster_shape_mn, is_relaxed=True)

    sC = storage.sC.get_tensor(t.c_smem_layout.outer, swizzle=t.c_smem_layout.inner)
    sA = storage.sA.get_tensor(t.a_smem_layout.outer, swizzle=t.a_smem_layout.inner)
    sB = storage.sB.get_tensor(t.b_smem_layout.outer, swizzle=t.b_smem_layout.inner)

    # (bM, bK, RestM, RestK, E) and the like; MMA partitions of this CTA's share
    gA = cute.local_tile(mA_tma, cute.slice_(t.mma_tiler, (None, 0, None)), (None, None, None))
    gB = None
    if cutlass.const_expr(not t.b_padded):
        gB = cute.local_tile(mB_tma, cute.slice_(t.mma_tiler, (0, None, None)), (None, None, None))
    thr_mma = tiled_mma.get_slice(cta_v)
    k_tile_cnt = cute.size(gA, mode=[3])
    mcast = pair > 1
    a_mask, b_mask = None, None
    if cutlass.const_expr(mcast):
        a_mask = cpasync.create_tma_multicast_mask(t.cluster_layout_vmnk, coord_vmnk, mcast_mode=2)
        b_mask = cpasync.create_tma_multicast_mask(t.cluster_layout_vmnk, coord_vmnk, mcast_mode=1)
    a_cta_layout = cute.make_layout(cute.slice_(t.cluster_layout_vmnk, (0, 0, None, 0)).shape)
    b_cta_layout = cute.make_layout(cute.slice_(t.cluster_layout_vmnk, (0, None, 0, 0)).shape)
    a_loads = partition_loads(atom_a, coord_vmnk[2], a_cta_layout, sA, thr_mma.partition_A(gA), a_mask)
    if cutlass.const_expr(t.b_padded):
        b_loads = PaddedLoads(tma_b, cute.group_modes(sB, 0, 3), t.config.tile_n, pair, cta_v)
    else:
        b_loads = partition_loads(atom_b, coord_vmnk[1], b_cta_layout, sB, thr_mma.partition_B(gB), b_mask)
    sfa_loads, sfb_loads, sSFA, sSFB = None, None, None, None
    if cutlass.const_expr(t.block_scaled):
        sSFA = storage.sSFA.get_tensor(t.sfa_smem_layout)
        sSFB = storage.sSFB.get_tensor(t.sfb_smem_layout)
        coord_sfb = t.cluster_layout_sfb_vmnk.get_flat_coord(cta_rank)
        sfb_mask = None
        if cutlass.const_expr(mcast):
            sfb_mask = cpasync.create_tma_multicast_mask(t.cluster_layout_sfb_vmnk, coord_sfb, mcast_mode=1)
        gSFA = cute.local_tile(mSFA_tma, cute.slice_(t.mma_tiler, (None, 0, None)), (None, None, None))
        gSFB = cute.local_tile(mSFB_tma, cute.slice_(t.mma_tiler_sfb, (0, None, None)), (None, None, None))
        sfa_loads = partition_loads(atom_sfa, coord_vmnk[2], a_cta_layout, sSFA, thr_mma.partition_A(gSFA),
                                    a_mask, filter_zeros=True)
        sfb_layout = cute.make_layout(cute.slice_(t.cluster_layout_sfb_vmnk, (0, None, 0, 0)).shape)
        sfb_loads = partition_loads(atom_sfb, coord_sfb[1], sfb_layout, sSFB,
                                    t.tiled_mma_sfb.get_slice(cta_v).partition_B(gSFB), sfb_mask,
                                    filter_zeros=True)

    tCrA = tiled_mma.make_fragment_A(sA)
    tCrB = tiled_mma.make_fragment_B(sB)
    tCtAcc_fake = t.acc_fragment()

    num_experts = cute.size(mD_mnl, mode=[2])
    max_m = cute.size(mD_mnl, mode=[0])
    n_total = cute.size(mD_mnl, mode=[1])
    num_n_blocks = (n_total + t.config.tile_n - 1) // t.config.tile_n
    # both CTAs of a pair walk as one cluster: they take the same units
    walk_args = (mMaskedM, num_experts, max_m, num_n_blocks, t.config.tile_m, bidx // pair, gdim // pair)

    # barrier init visible to the whole cluster before anyone waits or multicasts
    pipeline.pipeline_init_wait(cluster_shape_mn=t.cluster_shape_mn)
    # Launched with programmatic dependent launch, this CTA may start while
    # the previous kernel on the stream still runs (everything above touched
    # only shared memory and the kernel parameters): every thread
    # waits here for it to complete before any global access (masked_m,
    # operands, out, signals).
    cute.arch.griddepcontrol_wait()

    if warp_idx == TMA_WARP:
        run_tma_warp(walk_args, ab_pipeline, t.stages, k_tile_cnt, a_loads, b_loads, sfa_loads, sfb_loads,
                     1 if t.config.tile_n == 64 else 0)
    if warp_idx == MMA_WARP:
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(t.acc_dtype)
        tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        sfa_copy, sfb_copy, tCtSFA, sfb_ptr, tCtSFB_layout = None, None, None, None, None
        if cutlass.const_expr(t.block_scaled):
            tCtSFA_layout = blockscaled_utils.make_tmem_layout_sfa(
                tiled_mma, t.mma_tiler, t.sf_vec, cute.slice_(t.sfa_smem_layout, (None, None, None, 0)))
            tCtSFB_layout = blockscaled_utils.make_tmem_layout_sfb(
                tiled_mma, t.mma_tiler, t.sf_vec, cute.slice_(t.sfb_smem_layout, (None, None, None, 0)))
            tCtSFA = cute.make_tensor(cute.recast_ptr(acc_ptr + t.acc_cols, dtype=t.sf_dtype), tCtSFA_layout)
            sfb_ptr = acc_ptr + t.acc_cols + t.sfa_cols
            tCtSFB = cute.make_tensor(cute.recast_ptr(sfb_ptr, dtype=t.sf_dtype), tCtSFB_layout)
            sfa_copy = make_scale_copy(t.cta_group, t.sf_dtype, sSFA, tCtSFA)
            sfb_copy = make_scale_copy(t.cta_group, t.sf_dtype, sSFB, tCtSFB)
        run_mma_warp(walk_args, tiled_mma, ab_pipeline, acc_pipeline, t.stages, t.acc_stages, k_tile_cnt,
                     is_leader, tCrA, tCrB, tCtAcc_base, sfa_copy, sfb_copy, tCtSFA, sfb_ptr, tCtSFB_layout,
                     t.sf_dtype, t.config.tile_n == 64)
    if warp_idx < MMA_WARP:
        tmem.allocate(TMEM_COLS)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(t.acc_dtype)
        tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        # out as (bM, bN, RestM, RestN, E) tiles, this CTA's rows of each
        tile_mn = cute.slice_(t.mma_tiler, (None, None, 0))
        tCgC_tma = thr_mma.partition_C(cute.local_tile(mD_tma, tile_mn, (None, None, None)))
        tCgC = thr_mma.partition_C(cute.local_tile(mD_mnl, tile_mn, (None, None, None)))
        cD = cute.make_identity_tensor(mD_mnl.shape)
        tCcC = thr_mma.partition_C(cute.local_tile(cD, tile_mn, (None, None, None)))
        ep = partition_epilogue(t, tidx, tCtAcc_base, tCgC_tma, tCgC, tCcC, sC, atom_c)
        subtiles = t.config.tile_n // t.epi_tile[1]
        consts = (t.out_dtype, t.acc_stages, t.config.cta_tile_m, t.config.tile_m, t.config.tile_n, pair, subtiles)
        epi_barrier = barriers.epilogue()
        run_epilogue(walk_args, consts, gemm.signal_mode, ep, atom_c, acc_pipeline, epi_barrier, cta_v,
                     tidx == 0, mAlpha, mSignals, n_total, (max_m + t.config.cta_tile_m - 1) // t.config.cta_tile_m)
        # TMEM back once every epilogue warp is done with it
        tmem.relinquish_alloc_permit()
        epi_barrier.arrive_and_wait()
        tmem.free(acc_ptr)
