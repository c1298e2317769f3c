"""The epilogue warps (four, one per 32-lane quarter of TMEM): each unit's
accumulator TMEM -> registers (``tcgen05.ld`` 32x32b: thread t holds row t
of its CTA's 128 rows) -> bf16 (x alpha[e] for NVFP4) -> out.

* full tile (all 128 rows of this CTA valid): sub-tiles of ``EPI_N``
  columns are staged in shared memory and leave by TMA store, issued and
  committed by thread 0 (bulk groups belong to the thread that commits);
* an expert's last, partial tile: every thread stores its own row straight
  from registers, only when that row is < m_e (and each column < N): rows
  >= masked_m are never written;
* a CTA whose half of a 2-CTA tile holds no valid row stores nothing and
  publishes nothing, but still drains the accumulator (the pipeline counts it).

Signals (``publish``): a tile's counter add waits until after its
accumulator is released, so the MMA warp is never held up by it.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

from .limits import EPI_BUFFERS
from ..device.publish import publish_tile
from .walk import cta_rows, make_walker, signal_index


class EpilogueTensors(NamedTuple):
    """The epilogue's partitions (built once per CTA by ``partition``)."""

    tiled_copy_t2r: object
    tTR_tAcc: cute.Tensor  # (T2R, T2R_M, T2R_N, EPI, ACC_STAGE)
    tTR_rAcc: cute.Tensor
    tiled_copy_r2s: object
    tRS_rC: cute.Tensor
    tRS_sC: cute.Tensor  # (R2S, R2S_M, R2S_N, BUFFER)
    tTR_rC: cute.Tensor
    bSG_sC: cute.Tensor  # TMA store source: (TMA, BUFFER)
    bSG_gC: cute.Tensor  # (TMA, EPI_M, EPI_N, RestM, RestN, E)
    tTR_gC: cute.Tensor  # out itself: (T2R, T2R_M, T2R_N, EPI_M, EPI_N, RestM, RestN, E)
    tTR_cC: cute.Tensor  # the (m, n, e) coordinates of tTR_gC


def partition(tiling, tidx, tCtAcc_base, tCgC_tma, tCgC, tCcC, sC, tma_atom_c) -> EpilogueTensors:
    """Every thread's view of the accumulator, its registers, the staging
    buffers and out (through the TMA and directly), for one CTA's tiles."""
    epi_tile = tiling.epi_tile
    atom_t2r = sm100_utils.get_tmem_load_op(
        tiling.cta_tile_mnk, tiling.c_layout, tiling.out_dtype, tiling.acc_dtype, epi_tile, tiling.two_cta
    )
    # the partial-tile stores rely on one row per thread
    if not isinstance(atom_t2r.op, tcgen05.Ld32x32bOp):
        raise ValueError(f"epilogue expects a 32x32b TMEM load, got {atom_t2r.op}")
    tAcc_epi = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], epi_tile)
    tiled_copy_t2r = tcgen05.make_tmem_copy(atom_t2r, tAcc_epi[(None, None, 0, 0, 0)])
    thr_t2r = tiled_copy_t2r.get_slice(tidx)
    tTR_tAcc = thr_t2r.partition_S(tAcc_epi)
    tTR_tAcc = cute.group_modes(tTR_tAcc, 3, 5)  # (T2R, T2R_M, T2R_N, EPI, ACC_STAGE)

    def epi_view(t):  # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, RestM, RestN, E)
        return cute.flat_divide(t[((None, None), 0, 0, None, None, None)], epi_tile)

    tTR_gC = thr_t2r.partition_D(epi_view(tCgC))
    tTR_cC = thr_t2r.partition_D(epi_view(tCcC))
    tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, tiling.acc_dtype)
    tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, tiling.out_dtype)

    atom_r2s = sm100_utils.get_smem_store_op(tiling.c_layout, tiling.out_dtype, tiling.acc_dtype, tiled_copy_t2r)
    tiled_copy_r2s = cute.make_tiled_copy_D(atom_r2s, tiled_copy_t2r)
    tRS_sC = tiled_copy_r2s.get_slice(tidx).partition_D(sC)
    tRS_rC = tiled_copy_r2s.retile(tTR_rC)
    bSG_sC, bSG_gC = cpasync.tma_partition(
        tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
        cute.group_modes(epi_view(tCgC_tma), 0, 2),
    )
    return EpilogueTensors(tiled_copy_t2r, tTR_tAcc, tTR_rAcc, tiled_copy_r2s, tRS_rC, tRS_sC, tTR_rC,
                           bSG_sC, bSG_gC, tTR_gC, tTR_cC)


@cute.jit
def _convert(ep: EpilogueTensors, tiling_out_dtype: cutlass.Constexpr, alpha, subtile):
    """Sub-tile ``subtile`` of the accumulator into ep.tTR_rC as bf16 (x alpha)."""
    cute.copy(ep.tiled_copy_t2r, subtile, ep.tTR_rAcc)
    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the registers hold the data
    acc = ep.tTR_rAcc.load()
    if cutlass.const_expr(alpha is not None):
        acc = acc * alpha
    ep.tTR_rC.store(acc.to(tiling_out_dtype))


@cute.jit
def _store_rows(gC: cute.Tensor, cC: cute.Tensor, rC: cute.Tensor, row_end: Int32, n_total: Int32,
                cols_in: cutlass.Boolean):
    """This thread's row piece of one sub-tile into out, only if its row is
    valid (a 32x32b load gives each thread one row: first and last element
    agree). ``cols_in``: every column of the sub-tile is < N (then one
    vectorized copy), else each element's column is checked."""
    last = cute.size(cC) - 1
    if (cC[0][0] < row_end) & (cC[last][0] < row_end):
        if cols_in:
            cute.autovec_copy(rC, gC)
        else:
            for i in cutlass.range_constexpr(cute.size(cC)):
                if cC[i][1] < n_total:
                    gC[i] = rC[i]


@cute.jit
def run_epilogue(
    walk_args: tuple,
    tiling_consts: tuple,  # (out dtype, acc stages, cta tile m, tile m, tile n, cta group, subtiles)
    signal_mode: cutlass.Constexpr,
    ep: EpilogueTensors,
    tma_atom_c,
    acc_pipeline,
    epi_barrier,
    cta_v: Int32,
    is_epi_leader,
    mAlpha,  # (E,) fp32 or None
    mSignals,  # (S,) int32 or None
    n_total: Int32,
    num_m_slots: Int32,  # ceil(max_m / 128): counters per expert for "m_block"
):
    out_dtype, acc_stages, cta_tile_m, tile_m, tile_n, cta_group, subtiles = tiling_consts
    epi_n = tile_n // subtiles
    sched = make_walker(*walk_args)
    work = sched.work()
    acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, acc_stages)
    while work.is_valid:
        e, mb, nb = work.expert, work.m_block, work.n_block
        rows = cta_rows(work.valid_rows, cta_v, cta_tile_m)
        alpha = None
        if cutlass.const_expr(mAlpha is not None):
            alpha = mAlpha[e]
        tTR_tAcc = ep.tTR_tAcc[(None, None, None, None, acc_state.index)]
        acc_pipeline.consumer_wait(acc_state)
        if rows == cta_tile_m:
            bSG_gC = cute.group_modes(ep.bSG_gC[(None, None, None, mb, nb, e)], 1, 3)
            for s in cutlass.range_constexpr(subtiles):
                _convert(ep, out_dtype, alpha, tTR_tAcc[(None, None, None, s)])
                buf = s % EPI_BUFFERS
                cute.copy(ep.tiled_copy_r2s, ep.tRS_rC, ep.tRS_sC[(None, None, None, buf)])
                # generic-proxy smem writes visible to the TMA (async proxy)
                cute.arch.fence_proxy("async.shared", space="cta")
                epi_barrier.arrive_and_wait()
                if is_epi_leader:
                    cute.copy(tma_atom_c, ep.bSG_sC[(None, buf)], bSG_gC[(None, s)])
                    cute.arch.cp_async_bulk_commit_group()
                    # the buffer written next has been read by its store
                    cute.arch.cp_async_bulk_wait_group(EPI_BUFFERS - 1, read=True)
                epi_barrier.arrive_and_wait()
        elif rows > 0:
            # m_e in the expert's last m-block: no row from it on is written
            row_end = mb * tile_m + work.valid_rows
            tTR_gC = cute.group_modes(ep.tTR_gC[(None, None, None, None, None, mb, nb, e)], 3, 5)
            tTR_cC = cute.group_modes(ep.tTR_cC[(None, None, None, None, None, mb, nb, e)], 3, 5)
            for s in cutlass.range_constexpr(subtiles):
                _convert(ep, out_dtype, alpha, tTR_tAcc[(None, None, None, s)])
                cols_in = nb * tile_n + (s + 1) * epi_n <= n_total
                _store_rows(tTR_gC[(None, None, None, s)], tTR_cC[(None, None, None, s)], ep.tTR_rC,
                            row_end, n_total, cols_in)
        # every tcgen05.ld of this buffer done before the MMA may overwrite it
        cute.arch.fence_view_async_tmem_load()
        acc_pipeline.consumer_release(acc_state)
        acc_state.advance()
        if cutlass.const_expr(signal_mode is not None):
            # publish now that the MMA warp has its buffer back: waiting for
            # the stores overlaps this warp's wait for the next accumulator
            index = Int32(-1)
            if rows > 0:
                index = signal_index(signal_mode, e, mb, cta_v, cta_group, num_m_slots)
            publish_tile(index, mSignals, epi_barrier, is_epi_leader)
        sched.advance()
        work = sched.work()
    if is_epi_leader:
        # every bulk store complete before the CTA exits
        cute.arch.cp_async_bulk_wait_group(0, read=False)
