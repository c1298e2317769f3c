"""The load warp and the MMA warp of the sm_100 blockwise kernel
(``blockwise.BlockwiseMaskedGemmSm100``).

Both walk every tile of their own walker and every k-block of 128 of each
tile, in the order the epilogue warps walk them, so the three rings (A/B,
activation scales, accumulator stages) stay in step without any other
hand-off.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cutlass_dsl import dsl_user_op

from ..schedule.walker import MaskedTileScheduler


def make_walker(walk) -> MaskedTileScheduler:
    """One role's walker over the masked tile order (``schedule.walker``):
    units (expert, m-block, n-block) with at least one valid row."""
    return MaskedTileScheduler.create(*walk)


@dsl_user_op
def tcgen05_fence(after_sync: bool, *, loc=None, ip=None):
    """``tcgen05.fence::after_thread_sync`` (``after_sync``) or
    ``::before_thread_sync``: orders tcgen05 operations of two threads that
    meet at an mbarrier or a CTA barrier (PTX's cross-thread TMEM pattern),
    e.g. the epilogue's TMEM reads of a stage before the next MMA into it."""
    kind = nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC if after_sync else nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC
    nvvm.tcgen05_fence(kind, loc=loc, ip=ip)


def k_block_count(mA_mkl: cute.Tensor, tile_k: int):
    """ceil(K / 128): the last block's missing columns arrive as TMA zero fill."""
    return (cute.size(mA_mkl, mode=[1]) + tile_k - 1) // tile_k


@cute.jit
def run_load_warp(
    walk, tiled_mma: cute.TiledMma,
    tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor,
    tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor,
    tma_atom_sfa: cute.CopyAtom, mSFA_mkl: cute.Tensor,
    sA_rows: cute.Tensor, sB: cute.Tensor, sSFA: cute.Tensor,
    ab_pipe, sfa_pipe, stages: cutlass.Constexpr, sfa_stages: cutlass.Constexpr,
    tile_mnk: cutlass.Constexpr, a_chunk: cutlass.Constexpr, a_chunk_bytes: cutlass.Constexpr,
):
    """TMA loads: per k-block the A and B tiles (one A/B slot, one
    transaction barrier) and the tile's 128 activation scales (a slot of
    the scale ring). Rows past max_m and columns past K or N come in as zeros.

    A goes in boxes of ``a_chunk`` rows, and a box past the tile's last
    valid row is not loaded (in decode most of a 128-row tile is past m_e):
    its rows of the slot keep stale bytes, which only reach accumulator rows
    that are never stored. The slot's barrier expects B's bytes from the
    pipeline and the loaded A boxes' bytes from ``mbarrier.expect_tx``,
    added before the loads are issued (the pipeline's arrive already came,
    so the count must never reach zero early)."""
    # B: ((atom_v, rest_v), STAGE) / ((atom_v, rest_v), RestN, RestK, E)
    gB = cute.local_tile(mB_nkl, cute.slice_(tile_mnk, (0, None, None)), (None, None, None))
    tCgB = tiled_mma.get_slice(0).partition_B(gB)
    tBsB, tBgB = cpasync.tma_partition(
        tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3)
    )
    # A in row boxes: (TMA, CHUNKS, 1, STAGE) / (TMA, RestM in boxes, RestK, E);
    # ``sA_rows`` is the slot as (rows, K, STAGE), the bytes the MMA reads
    chunk_mk = (a_chunk, tile_mnk[2])
    chunks = tile_mnk[0] // a_chunk
    tAsA, tAgA = cpasync.tma_partition(
        tma_atom_a, 0, cute.make_layout(1),
        cute.group_modes(cute.flat_divide(sA_rows, chunk_mk), 0, 2),
        cute.group_modes(cute.local_tile(mA_mkl, chunk_mk, (None, None, None)), 0, 2),
    )
    # scales: (128, 1, RestM, K blocks, E) boxes of one k-block's 128 rows
    gSFA = cute.local_tile(mSFA_mkl, (tile_mnk[0], 1), (None, None, None))
    sSFA_box = cute.make_tensor(sSFA.iterator, cute.make_layout((tile_mnk[0], 1, sfa_stages)))
    tSsSFA, tSgSFA = cpasync.tma_partition(
        tma_atom_sfa, 0, cute.make_layout(1), cute.group_modes(sSFA_box, 0, 2), cute.group_modes(gSFA, 0, 2)
    )

    k_blocks = k_block_count(mA_mkl, tile_mnk[2])
    ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    sfa_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, sfa_stages)
    sched = make_walker(walk)
    work = sched.work()
    while work.is_valid:
        a_boxes = cutlass.min((work.valid_rows + a_chunk - 1) // a_chunk, chunks)
        tBgB_tile = tBgB[(None, work.n_block, None, work.expert)]
        tSgSFA_tile = tSgSFA[(None, work.m_block, None, work.expert)]
        for kb in cutlass.range(k_blocks, unroll=1):
            ab_pipe.producer_acquire(ab_state)
            ab_bar = ab_pipe.producer_get_barrier(ab_state)
            with cute.arch.elect_one():
                cute.arch.mbarrier_expect_tx(ab_bar, a_boxes * a_chunk_bytes)
            cute.arch.sync_warp()  # the expected bytes are counted before any load is issued
            for c in cutlass.range_constexpr(chunks):
                if c < a_boxes:
                    cute.copy(
                        tma_atom_a, tAgA[(None, work.m_block * chunks + c, kb, work.expert)],
                        tAsA[(None, c, 0, ab_state.index)], tma_bar_ptr=ab_bar,
                    )
            cute.copy(tma_atom_b, tBgB_tile[(None, kb)], tBsB[(None, ab_state.index)], tma_bar_ptr=ab_bar)
            ab_state.advance()
            sfa_pipe.producer_acquire(sfa_state)
            cute.copy(
                tma_atom_sfa, tSgSFA_tile[(None, kb)], tSsSFA[(None, sfa_state.index)],
                tma_bar_ptr=sfa_pipe.producer_get_barrier(sfa_state),
            )
            sfa_state.advance()
        sched.advance()
        work = sched.work()
    # This CTA issued its last loads: once every CTA has, a PDL-launched
    # kernel after this one may start its set-up (its griddepcontrol.wait
    # still waits for this grid to complete).
    cute.arch.griddepcontrol_launch_dependents()
    # the CTA outlives every load it issued into its own shared memory
    ab_pipe.producer_tail(ab_state)
    sfa_pipe.producer_tail(sfa_state)


@cute.jit
def run_mma_warp(
    walk, tiled_mma: cute.TiledMma, mA_mkl: cute.Tensor,
    sA: cute.Tensor, sB: cute.Tensor, tCtAcc: cute.Tensor,
    ab_pipe, acc_pipe, stages: cutlass.Constexpr, acc_stages: cutlass.Constexpr,
    tile_mnk: cutlass.Constexpr,
):
    """Per k-block: one accumulator stage, started from zero (the promotion
    needs each k-block's partial product on its own), four K = 32 MMAs, then
    ``tcgen05.commit`` frees the A/B slot and hands the stage to the epilogue."""
    # (MMA, MMA_M, MMA_K, STAGE) shared-memory descriptors
    tCrA = tiled_mma.make_fragment_A(sA)
    tCrB = tiled_mma.make_fragment_B(sB)
    k_phases = cute.size(tCrA, mode=[2])
    k_blocks = k_block_count(mA_mkl, tile_mnk[2])
    ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, acc_stages)
    sched = make_walker(walk)
    work = sched.work()
    while work.is_valid:
        for kb in cutlass.range(k_blocks, unroll=1):
            acc_pipe.producer_acquire(acc_state)
            tcgen05_fence(after_sync=True)  # the epilogue's reads of this stage come first
            ab_pipe.consumer_wait(ab_state)
            tCtAcc_stage = tCtAcc[(None, None, None, acc_state.index)]
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for kp in cutlass.range_constexpr(k_phases):
                coord = (None, None, kp, ab_state.index)
                cute.gemm(tiled_mma, tCtAcc_stage, tCrA[coord], tCrB[coord], tCtAcc_stage)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            ab_pipe.consumer_release(ab_state)
            acc_pipe.producer_commit(acc_state)
            ab_state.advance()
            acc_state.advance()
        sched.advance()
        work = sched.work()
    acc_pipe.producer_tail(acc_state)
