"""The store warp (warp 1 of the producer warpgroup): bulk stores of the
sub-tiles the consumers staged, and the completion signals, so no wgmma warp
ever waits for a store.

Publishing a tile's signal (lane 0, right after the tile):

* full tile: ``cp.async.bulk.wait_group 0`` (the bulk stores have
  *completed*, not only released shared memory; never the ``.read`` form),
  ``fence.proxy.async.global`` (async-proxy writes ordered before generic
  operations), then ``red.release.gpu.add``;
* partial tile: the store warp waits on the signal pipeline's full barrier
  (acquire at CTA scope) for every consumer thread's row-piece stores, frees
  the stage, and runs ``red.release.gpu.add``, whose GPU-scope release covers
  what it acquired (PTX causality order is transitive). The empty barriers
  only keep the consumers from lapping the store warp by more than
  ``SIGNAL_STAGES`` tiles.

``docs/signals.md`` states the guarantee a reader gets.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from .. import trace as tr
from ..device.publish import release_add
from .epilogue import SIGNAL_STAGES, _NoLoopState, epi_tile_count, tile_rows
from .walk import start_walk, to_next_unit


class TileStorer(_NoLoopState):
    """Store-warp side: bulk stores of staged sub-tiles, and signal publishing."""

    def __init__(
        self,
        sD: cute.Tensor,  # (EPI_M, EPI_N, buffers); with handoff (64, EPI_N, W * sub-tiles)
        tma_atom_d: cute.CopyAtom,  # its box: one buffer of sD
        gD_tma: cute.Tensor,  # (BM, BN, RestM, RestN, E) TMA coordinate tiles
        tile_mn: tuple,
        epi_tile: tuple,
        is_lane0,
        epi_barrier: pipeline.NamedBarrier,
        handoff=None,  # Staging.WHOLE_TILE: barriers.WarpgroupHandoff
    ):
        self.whole_tile = handoff is not None
        self.handoff = handoff
        self.sD = sD
        self.tma_atom_d = tma_atom_d
        self.gD_tma = gD_tma
        self.tile_mn = tile_mn
        self.epi_tile = epi_tile
        self.is_lane0 = is_lane0
        self.epi_barrier = epi_barrier

    @cute.jit
    def store(
        self,
        expert: Int32,
        m_block: Int32,
        n_block: Int32,
        valid_rows: Int32,
        signal_index: Int32,  # counter to publish, or -1
        mSignals: cute.Tensor,
        sig_pipeline,  # PipelineAsync of the partial-tile handoff, or None without signals
        sig_state,  # its consumer state (None without signals)
        half=None,  # Tail.SPLIT builds (no signals): WorkTile.half
    ):
        """Store (full tile) or publish (partial tile) one tile; returns the
        advanced signal-pipeline state."""
        full = tile_rows(valid_rows, half, self.tile_mn[0])[0]
        if cutlass.const_expr(self.whole_tile):
            self._store_by_warpgroup(expert, m_block, n_block, full)
        elif full:
            self._store_full(expert, m_block, n_block)
        if full:
            if cutlass.const_expr(sig_pipeline is not None):
                if self.is_lane0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.fence_proxy("async.global")
                    if signal_index >= 0:
                        release_add(mSignals.iterator + signal_index)
        else:
            if cutlass.const_expr(sig_pipeline is not None):
                next_state = sig_state.clone()
                sig_pipeline.consumer_wait(next_state)  # every consumer's stores issued
                if self.is_lane0:
                    sig_pipeline.consumer_release(next_state)
                    if signal_index >= 0:
                        release_add(mSignals.iterator + signal_index)
                next_state.advance()
                sig_state = next_state
        return sig_state

    def _partition(self, expert: Int32, m_block: Int32, n_block: Int32, box: tuple):
        """(staging buffers, the tile's boxes in global memory) for bulk stores
        of ``box``-sized pieces; the boxes' rest mode is (RestM, RestN)."""
        gD_epi = cute.zipped_divide(self.gD_tma[(None, None, m_block, n_block, expert)], box)
        return cute.nvgpu.cpasync.tma_partition(
            self.tma_atom_d, 0, cute.make_layout(1), cute.group_modes(self.sD, 0, 2), gD_epi
        )

    @cute.jit
    def _store_by_warpgroup(self, expert: Int32, m_block: Int32, n_block: Int32, full):
        """Whole-tile staging: free each warpgroup's rows once the last tile's
        stores of them have read them, then take each warpgroup's staged rows
        (or, for a partial tile, its arrival) in turn. Buffer W * j + w of sD
        (W warpgroups) holds rows [64 w, 64 w + 64) of sub-tile j: the same
        bytes as sub-tile j of the consumers' (tile_m, 32) view."""
        num_wg = self.handoff.num_consumer_wg
        for wg in cutlass.range_constexpr(num_wg):
            if self.is_lane0:
                # one bulk group per warpgroup and tile: at most the later
                # warpgroups' groups may still be reading
                cute.arch.cp_async_bulk_wait_group(num_wg - 1 - wg, read=True)
            self.handoff.free(wg).arrive()
        bSG_sD, bSG_gD = self._partition(expert, m_block, n_block, (64, self.epi_tile[1]))
        for wg in cutlass.range_constexpr(num_wg):
            self.handoff.staged(wg).arrive_and_wait()
            if full:
                if self.is_lane0:
                    for epi_idx in cutlass.range_constexpr(epi_tile_count(self.tile_mn)):
                        cute.copy(
                            self.tma_atom_d,
                            bSG_sD[(None, num_wg * epi_idx + wg)],
                            bSG_gD[(None, (wg, epi_idx))],
                        )
                    cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _store_full(self, expert: Int32, m_block: Int32, n_block: Int32):
        bSG_sD, bSG_gD = self._partition(expert, m_block, n_block, self.epi_tile)
        num_bufs = cute.size(self.sD, mode=[2])
        for epi_idx in cutlass.range_constexpr(epi_tile_count(self.tile_mn)):
            self.epi_barrier.arrive_and_wait()  # sub-tile staged
            if self.is_lane0:
                cute.copy(
                    self.tma_atom_d,
                    bSG_sD[(None, epi_idx % num_bufs)],
                    bSG_gD[(None, (0, epi_idx))],
                )
                cute.arch.cp_async_bulk_commit_group()
                # the buffer the consumers write next has been read
                cute.arch.cp_async_bulk_wait_group(num_bufs - 1, read=True)
            self.epi_barrier.arrive_and_wait()

    @cute.jit
    def tail(self):
        """Every bulk store complete before the CTA exits."""
        if self.is_lane0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)


@cute.jit
def run_store_warp(
    config, storer: TileStorer, signal_mode: cutlass.Constexpr, walk_args, feed, balance,
    sig_pipeline, mSignals, num_m_slots, num_n_blocks, mTrace, trace_base,
):
    """The store warp's walk: every tile's bulk stores and signal, then the
    full wait for the last stores before the CTA exits. ``storer`` None
    (the fused combine: the consumers send every row themselves): the
    walk alone, which the dynamic feed and the balance barrier count on."""
    sched, used = start_walk(config, walk_args, feed, None, balance)
    work = sched.work()
    sig_state = None
    if cutlass.const_expr(sig_pipeline is not None):
        sig_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SIGNAL_STAGES)
    while work.is_valid:
        index = work.expert
        if cutlass.const_expr(signal_mode == "m_block"):
            index = work.expert * num_m_slots + work.m_block
        # a cluster's tile past N stores and signals nothing
        index = cutlass.select_(work.n_block < num_n_blocks, index, Int32(-1))
        if cutlass.const_expr(storer is not None):
            sig_state = storer.store(
                work.expert, work.m_block, work.n_block, work.valid_rows,
                index, mSignals, sig_pipeline, sig_state, work.half,
            )
        used = to_next_unit(config, sched, feed, used)
        work = sched.work()
    if cutlass.const_expr(storer is not None):
        storer.tail()
    if cutlass.const_expr(mTrace is not None):
        if cute.arch.lane_idx() == 0:
            mTrace[trace_base + tr.STORER_END] = cute.arch.globaltimer_lo()
