"""Every named-barrier id the sm_90a kernels use, in one place (barrier 0 is
``__syncthreads``; an SM has 16). Each id's users and thread count are
stated beside it, so two roles never meet on one id by accident."""

from __future__ import annotations

import cutlass.pipeline as pipeline

# GEMM kernel
EPILOGUE = 1  # consumers + store warp, around each staged sub-tile (Staging.PAIR)
CONSUMERS = 2  # the consumer warpgroups alone, around partial-tile staging
BALANCE = 3  # producer warp + store warp + consumers: the active-cluster count (Tail.BALANCE)
HANDOFF_FIRST = 4  # Staging.WHOLE_TILE: free (4 + w) and staged (4 + W + w) per consumer warpgroup w
CONVERTERS = 12  # MXFP4 weights: 12 + t for converter team t (its warps, once per slot it converts; converter)
# combine kernel
COMBINE_TEAM_FIRST = 1  # 1 + team: one per team of warps


def epilogue(num_consumer_threads: int) -> pipeline.NamedBarrier:
    return pipeline.NamedBarrier(barrier_id=EPILOGUE, num_threads=num_consumer_threads + 32)


def consumers(num_consumer_threads: int) -> pipeline.NamedBarrier:
    return pipeline.NamedBarrier(barrier_id=CONSUMERS, num_threads=num_consumer_threads)


def balance(num_consumer_threads: int) -> pipeline.NamedBarrier:
    # the producer warp, the store warp and every consumer thread
    return pipeline.NamedBarrier(barrier_id=BALANCE, num_threads=64 + num_consumer_threads)


class WarpgroupHandoff:
    """``Staging.WHOLE_TILE``: for consumer warpgroup w, *free* (id
    HANDOFF_FIRST + w) and *staged* (id HANDOFF_FIRST + W + w), each crossed
    by its 128 threads and the store warp."""

    def __init__(self, num_consumer_wg: int):
        self.num_consumer_wg = num_consumer_wg

    def free(self, wg):
        return pipeline.NamedBarrier(barrier_id=HANDOFF_FIRST + wg, num_threads=128 + 32)

    def staged(self, wg):
        return pipeline.NamedBarrier(
            barrier_id=HANDOFF_FIRST + self.num_consumer_wg + wg, num_threads=128 + 32
        )
