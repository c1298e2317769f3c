"""Every named-barrier id of the sm_100 kernels, in one place (barrier 0 is
``__syncthreads``; an SM has 16). Each id's users and thread count are
stated beside it."""

from __future__ import annotations

import cutlass.pipeline as pipeline

EPILOGUE_THREADS = 128  # four epilogue warps: one per 32-lane quarter of TMEM

EPILOGUE = 1  # the epilogue warps: output staging around each TMA store, and before a publish
TMEM_ALLOC = 2  # epilogue warps + MMA warp: the TMEM address is in shared memory


def epilogue() -> pipeline.NamedBarrier:
    return pipeline.NamedBarrier(barrier_id=EPILOGUE, num_threads=EPILOGUE_THREADS)


def tmem_alloc() -> pipeline.NamedBarrier:
    return pipeline.NamedBarrier(barrier_id=TMEM_ALLOC, num_threads=EPILOGUE_THREADS + 32)
