"""The MMA warp: walks the same tile order, and for each unit waits for an
empty accumulator buffer in TMEM, then for each k-tile copies the stage's
scale factors into TMEM (``tcgen05.cp``) and issues the k-tile's
``tcgen05.mma``; the commit of the last one arrives on the accumulator's
full barrier. In a 2-CTA build only the leader CTA issues (``cta_group::2``
MMAs read both CTAs' shared memory and write both CTAs' TMEM); the peer
walks along so that its pipeline states stay in step."""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import tcgen05

from .walk import make_walker


class ScaleCopy(NamedTuple):
    """SMEM -> TMEM copy of one operand's scale factors (``tcgen05.cp``)."""

    tiled_copy: object
    smem: cute.Tensor  # (..., STAGE)
    tmem: cute.Tensor


def make_scale_copy(cta_group, sf_dtype, sSF: cute.Tensor, tSF: cute.Tensor) -> ScaleCopy:
    """Partition one operand's staged scales and their TMEM home for the
    4x32x128b copy (each 128x4 atom lands in 4 columns of 32 lanes x 4)."""
    sSF_compact = cute.filter_zeros(sSF)
    tSF_compact = cute.filter_zeros(tSF)
    atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(cta_group), sf_dtype)
    tiled_copy = tcgen05.make_s2t_copy(atom, tSF_compact)
    thr_copy = tiled_copy.get_slice(0)
    smem = tcgen05.get_s2t_smem_desc_tensor(tiled_copy, thr_copy.partition_S(sSF_compact))
    return ScaleCopy(tiled_copy, smem, thr_copy.partition_D(tSF_compact))


@cute.jit
def run_mma_warp(
    walk_args: tuple,
    tiled_mma: cute.TiledMma,
    ab_pipeline,
    acc_pipeline,
    stages: cutlass.Constexpr,
    acc_stages: cutlass.Constexpr,
    k_tile_cnt: Int32,
    is_leader,
    tCrA: cute.Tensor,  # (MMA, MMA_M, MMA_K, STAGE)
    tCrB: cute.Tensor,
    tCtAcc_base: cute.Tensor,  # (MMA, MMA_M, MMA_N, ACC_STAGE)
    sfa_copy: ScaleCopy,  # None without scales
    sfb_copy: ScaleCopy,
    tCtSFA: cute.Tensor,
    sfb_tmem_ptr,  # Float32 TMEM pointer of SFB's first column
    tCtSFB_layout,
    sf_dtype: cutlass.Constexpr,
    sfb_odd_shift: cutlass.Constexpr,  # tile_n = 64: an odd n-block reads the atom's upper half
):
    sched = make_walker(*walk_args)
    work = sched.work()
    ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, acc_stages)
    num_kblocks = cute.size(tCrA, mode=[2])
    while work.is_valid:
        tCtAcc = tCtAcc_base[(None, None, None, acc_state.index)]
        if is_leader:
            acc_pipeline.producer_acquire(acc_state)
        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
        tCtSFB = None
        if cutlass.const_expr(sfa_copy is not None):
            # two 64-wide n-blocks share one 128-row SFB atom: an odd one skips
            # the first 64 rows' scales, 2 columns further on
            offset = Int32(0)
            if cutlass.const_expr(sfb_odd_shift):
                offset = (work.n_block % 2) * 2
            tCtSFB = cute.make_tensor(cute.recast_ptr(sfb_tmem_ptr + offset, dtype=sf_dtype), tCtSFB_layout)
        for k_tile in cutlass.range(0, k_tile_cnt, 1, unroll=1):
            if is_leader:
                ab_pipeline.consumer_wait(ab_state)
                if cutlass.const_expr(sfa_copy is not None):
                    stage = (None, None, None, None, ab_state.index)
                    cute.copy(sfa_copy.tiled_copy, sfa_copy.smem[stage], sfa_copy.tmem)
                    cute.copy(sfb_copy.tiled_copy, sfb_copy.smem[stage], sfb_copy.tmem)
                for kb in cutlass.range(num_kblocks, unroll_full=True):
                    if cutlass.const_expr(sfa_copy is not None):
                        tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                        tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                    cute.gemm(
                        tiled_mma, tCtAcc,
                        tCrA[(None, None, kb, ab_state.index)], tCrB[(None, None, kb, ab_state.index)],
                        tCtAcc,
                    )
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                # the stage is free once these MMAs have read it (tcgen05.commit)
                ab_pipeline.consumer_release(ab_state)
            ab_state.advance()
        if is_leader:
            acc_pipeline.producer_commit(acc_state)
        acc_state.advance()
        sched.advance()
        work = sched.work()
    # the epilogue has drained every accumulator before TMEM is freed
    acc_pipeline.producer_tail(acc_state)
