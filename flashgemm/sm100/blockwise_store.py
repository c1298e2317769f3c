"""The store warp of the sm_100 blockwise kernel: TMA stores of the staged
full tiles and the completion signals, so no epilogue warp ever waits for
global memory.

Per tile, after the hand-off from the epilogue warps (a one-slot
``PipelineAsync``: every epilogue thread arrives once the tile's bytes are
staged in shared memory, or for a partial tile once its own row stores are
issued), lane 0:

* full tile: issues the bulk tensor stores of the sub-tiles and commits
  them as one group, waits until they have *read* shared memory
  (``.read``) and frees the slot, so the epilogue may stage the next tile;
  with signals it then waits for the stores to *complete*
  (``cp.async.bulk.wait_group 0``, never the ``.read`` form), orders them
  before its generic operations (``fence.proxy.async.global``) and adds 1
  with ``red.release.gpu``;
* partial tile: frees the slot and, with signals, adds with
  ``red.release.gpu``: the hand-off's mbarrier (each epilogue thread's
  arrive releases its row stores at CTA scope, the wait here acquires them)
  and the GPU-scope release make every row visible to a reader that
  acquires the counter (PTX causality order is transitive).

``signals.py`` / ``docs/signals.md`` state the guarantee a reader gets.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from ..device.publish import publish_bulk_stored, release_add
from .blockwise_roles import make_walker
from .walk import signal_index


class TileStoreWarp:
    """Store-warp side: bulk stores of staged tiles, and signal publishing."""

    def __init__(self, sC, tma_atom_c, mC_tma, mSignals, epi_tile, sub_mn, signal_mode, tile_mn):
        self.tma_atom_c = tma_atom_c
        self.mSignals = mSignals
        self.sub_mn = sub_mn
        self.signal_mode = signal_mode
        self.tile_mn = tile_mn
        # ((ATOM_V, REST_V), SUB_M * SUB_N) staged sub-tiles /
        # ((ATOM_V, REST_V), SUB_M, SUB_N, RestM, RestN, E) their boxes in global memory
        gC = cute.local_tile(mC_tma, tile_mn, (None, None, None))
        self.bSG_sC, self.bSG_gC = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
            cute.group_modes(cute.flat_divide(gC, epi_tile), 0, 2),
        )

    @cute.jit
    def run(self, walk, max_m, handoff):
        num_m_slots = (max_m + self.tile_mn[0] - 1) // self.tile_mn[0]
        is_lane0 = cute.arch.lane_idx() == 0
        h_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        sched = make_walker(walk)
        work = sched.work()
        while work.is_valid:
            handoff.consumer_wait(h_state)
            if work.valid_rows == self.tile_mn[0]:
                if is_lane0:
                    for sm in cutlass.range_constexpr(self.sub_mn[0]):
                        for sn in cutlass.range_constexpr(self.sub_mn[1]):
                            cute.copy(
                                self.tma_atom_c,
                                self.bSG_sC[(None, sm * self.sub_mn[1] + sn)],
                                self.bSG_gC[(None, sm, sn, work.m_block, work.n_block, work.expert)],
                            )
                    cute.arch.cp_async_bulk_commit_group()
                    # the staged tile may be overwritten once the stores have read it
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    handoff.consumer_release(h_state)
                    if cutlass.const_expr(self.signal_mode is not None):
                        publish_bulk_stored(self._counter(work, num_m_slots))
            else:
                if is_lane0:
                    handoff.consumer_release(h_state)
                    if cutlass.const_expr(self.signal_mode is not None):
                        release_add(self._counter(work, num_m_slots))
            h_state.advance()
            sched.advance()
            work = sched.work()
        # every bulk store has completed before the CTA exits
        if is_lane0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    def _counter(self, work, num_m_slots):
        # one CTA per 128-row tile: the sm_100 index with a CTA group of one
        return self.mSignals.iterator + signal_index(self.signal_mode, work.expert, work.m_block, 0, 1, num_m_slots)
