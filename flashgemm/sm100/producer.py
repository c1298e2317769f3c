"""The TMA warp: walks the masked tile order and loads each unit's k-tiles
of A, B (and for block-scaled formats SFA, SFB) into the operand ring.

With two CTAs each loads its 128 rows of A and its half of B, and both
signal the leader CTA's full barrier (the 2-SM TMA ops route the arrival),
so the leader's MMA warp sees the whole stage of the pair."""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .padded_b import load_padded_b
from .walk import make_walker


class PaddedLoads(NamedTuple):
    """B by its own tensor map (``padded_b``): the descriptor, the staged
    smem view (this CTA's bN, bK, STAGE), the tile's rows, the CTAs of a
    tile and this CTA's place among them."""

    desc: object
    smem: cute.Tensor
    tile_n: int
    pair: int
    cta_v: object


class OperandLoads(NamedTuple):
    """One operand's TMA atom, its staged smem view, its global k-tiles
    ((TMA, RestMN, RestK, E)) and multicast mask (None in a 1-CTA build)."""

    atom: object
    smem: cute.Tensor
    gmem: cute.Tensor
    mcast_mask: object


def partition_loads(atom, cta_coord, cta_layout, sX: cute.Tensor, tCgX: cute.Tensor, mcast_mask, filter_zeros=False):
    """TMA partition of one operand: (smem (TMA, STAGE), gmem (TMA, RestMN, RestK, E))."""
    tXsX, tXgX = cpasync.tma_partition(
        atom, cta_coord, cta_layout, cute.group_modes(sX, 0, 3), cute.group_modes(tCgX, 0, 3)
    )
    if cutlass.const_expr(filter_zeros):
        # scale factors: the atom's broadcast (stride 0) modes hold no data
        tXsX = cute.filter_zeros(tXsX)
        tXgX = cute.filter_zeros(tXgX)
    return OperandLoads(atom, tXsX, tXgX, mcast_mask)


@cute.jit
def run_tma_warp(
    walk_args: tuple,  # (mMaskedM, E, max_m, num_n_blocks, tile_m, cluster, num_clusters)
    ab_pipeline,
    stages: cutlass.Constexpr,
    k_tile_cnt: Int32,
    a: OperandLoads,
    b,  # OperandLoads, or PaddedLoads for e2m1 B beside e4m3 A
    sfa: OperandLoads,  # None without scales
    sfb: OperandLoads,
    sfb_n_shift: cutlass.Constexpr,  # 1 when tile_n = 64: two n-blocks share a 128-wide SFB tile
):
    sched = make_walker(*walk_args)
    work = sched.work()
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    while work.is_valid:
        e, mb, nb = work.expert, work.m_block, work.n_block
        gA = a.gmem[(None, mb, None, e)]
        gB = None
        if cutlass.const_expr(not isinstance(b, PaddedLoads)):
            gB = b.gmem[(None, nb, None, e)]
        for k_tile in cutlass.range(0, k_tile_cnt, 1, unroll=1):
            ab_pipeline.producer_acquire(state)
            bar = ab_pipeline.producer_get_barrier(state)
            cute.copy(a.atom, gA[(None, k_tile)], a.smem[(None, state.index)], tma_bar_ptr=bar,
                      mcast_mask=a.mcast_mask)
            if cutlass.const_expr(isinstance(b, PaddedLoads)):
                load_padded_b(b.desc, b.smem[(None, state.index)], k_tile, nb, e, b.tile_n, b.pair, b.cta_v, bar)
            else:
                cute.copy(b.atom, gB[(None, k_tile)], b.smem[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=b.mcast_mask)
            if cutlass.const_expr(sfa is not None):
                cute.copy(sfa.atom, sfa.gmem[(None, mb, k_tile, e)], sfa.smem[(None, state.index)],
                          tma_bar_ptr=bar, mcast_mask=sfa.mcast_mask)
                cute.copy(sfb.atom, sfb.gmem[(None, nb >> sfb_n_shift, k_tile, e)],
                          sfb.smem[(None, state.index)], tma_bar_ptr=bar, mcast_mask=sfb.mcast_mask)
            state.advance()
        sched.advance()
        work = sched.work()
    # this CTA's loads are issued: a PDL-launched kernel after this one may
    # start its set-up on the SMs this grid frees (its griddepcontrol.wait
    # still waits for this grid to complete)
    cute.arch.griddepcontrol_launch_dependents()
    # every stage consumed before the CTA may exit (its peer still reads them)
    ab_pipeline.producer_tail(state)
