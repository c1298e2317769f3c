"""The completion publish of the GEMM epilogues (``docs/signals.md`` states
the guarantee a reader gets; ``flashgemm.signals.signal_layout`` the
counters). One add per tile with valid rows, after its rows are in global
memory (``publish_tile``, for an epilogue whose warps share a barrier):

1. a CTA-scope barrier of the epilogue warps: every thread's row stores of
   a partial tile happen before thread 0 goes on;
2. thread 0, which committed the tile's TMA stores: ``cp.async.bulk.wait_group 0``
   (the stores have *completed*; never the ``.read`` form), then
   ``fence.proxy.async.global`` (async-proxy writes ordered before generic
   operations), then ``red.release.gpu.global.add.s32``, whose GPU-scope
   release covers the other threads' stores it synchronized with in 1.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def release_add(counter: cute.Pointer):
    """Add 1 to ``*counter`` with a GPU-scope release."""
    cute.arch.red(counter, Int32(1), op="add", dtype=cutlass.Int32, sem="release", scope="gpu")


@cute.jit
def publish_bulk_stored(counter: cute.Pointer):
    """Steps 2 and 3 by the thread that committed the tile's bulk stores."""
    cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.fence_proxy("async.global")
    release_add(counter)


@cute.jit
def publish_tile(index: Int32, mSignals: cute.Tensor, epi_barrier, is_epi_leader):
    """Add 1 to counter ``index`` (nothing for -1: a tile without rows here)."""
    if index >= 0:
        epi_barrier.arrive_and_wait()
        if is_epi_leader:
            publish_bulk_stored(mSignals.iterator + index)
