"""Dynamic (work-stealing) tile order: units claimed from a global counter.

The static order (``walker``) deals unit ``c + i * G`` to cluster ``c`` of
``G``. With ``TileOrder.DYNAMIC`` every unit, the first included, is claimed
when a cluster is ready for it: ``atomicAdd(counter, 1)``. A cluster whose SM
is busy (another kernel holds it, its tiles run slow) takes fewer units, and
one that is not resident at all (a combine holds its SM) takes none, so no
unit waits on it. Claims come in increasing order, so the masked walker
(``MaskedTileScheduler.jump``) keeps its forward-only seek.

Who claims: lane 0 of the producer warp of the cluster's rank-0 CTA, at the
start and right after it has issued the last loads of its current unit (the
consumers still have ``stages`` k-tiles in flight, which hide the atomic's
round trip). It hands the index to every other role of both CTAs through a
ring of ``FEED_STAGES`` shared-memory slots in each CTA:

* full barrier (one per slot and CTA, 1 arrival + 4 transaction bytes): the
  claimer writes the local slot and arrives; it writes the peer's slot with
  ``st.async`` that completes 4 bytes on the peer's barrier;
* empty barrier (one per slot, in rank 0 only): every reader warp of the
  cluster arrives once it has read the slot (remote arrive from rank 1).

Readers: the store warp and every consumer warp in each CTA, and the producer
warp of the other ranks.

The counter (``counter[0]``) and a count of finished clusters
(``counter[1]``; ``config.CLAIM_COUNTER_INTS``) are 8 bytes the host zeroes once (``workspace``): one per
stream for eager launches, one per launch captured into a CUDA graph. The
kernel returns both to zero: each claimer, after the claim that ran past the
last unit, adds 1 to ``counter[1]`` (acq_rel); the one that brings it to G has
seen every other cluster's last claim and stores the zeros. So there is no
memset, and two launches that may run at the same time (two streams, a graph
replayed beside eager work) never share a counter. Launches on one stream are
ordered: with PDL, ``griddepcontrol.wait`` waits for the previous grid to
complete before any thread touches global memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

# Slots of the claim ring. Readers take a slot when they finish a unit, the
# store warp last; three slots let the claimer run a unit ahead of it.
FEED_STAGES = 3


def reader_warps(cluster_n: int, consumer_warpgroups: int) -> int:
    """Arrivals on a slot's empty barrier: per CTA the store warp and the
    consumer warps, plus the producer warp of every rank but the claimer's."""
    return cluster_n * (1 + 4 * consumer_warpgroups) + (cluster_n - 1)


class TileFeed:
    """Device side of the claim ring (see the module docstring).

    ``slots``: this CTA's (FEED_STAGES,) Int32 shared-memory tensor;
    ``mbar``: pointer to 2 * FEED_STAGES mbarriers (full, then empty).
    The caller carries the count of slots used so far (``k``), identical in
    every role, so the stage and phase follow from it.
    """

    def __init__(self, slots: cute.Tensor, mbar, cluster_n: int):
        self.slots = slots
        self.mbar = mbar
        self.cluster_n = cluster_n

    # (the kernel's role branches are staged ifs: the feed passes through them
    # as its two device values)
    def __extract_mlir_values__(self):
        return extract_mlir_values([self.slots, self.mbar])

    def __new_from_mlir_values__(self, values):
        slots, mbar = new_from_mlir_values([self.slots, self.mbar], values)
        return TileFeed(slots, mbar, self.cluster_n)

    def _full(self, stage):
        return self.mbar + stage

    def _empty(self, stage):
        return self.mbar + FEED_STAGES + stage

    @staticmethod
    def init_barriers(mbar, readers: int):
        """One thread, before the cluster-wide barrier-init sync."""
        for s in range(FEED_STAGES):  # (traced once per stage: not a device loop)
            cute.arch.mbarrier_init(mbar + s, 1)
            cute.arch.mbarrier_init(mbar + FEED_STAGES + s, readers)

    @cute.jit
    def claim(self, k: Int32, counter: cute.Tensor) -> Int32:
        """Claimer warp (all lanes): claim the next unit, publish it in slot
        ``k`` of every CTA of the cluster, and return it to every lane."""
        stage = k % FEED_STAGES
        # a slot is free once every reader released its previous use
        cute.arch.mbarrier_wait(self._empty(stage), ((k // FEED_STAGES) & 1) ^ 1)
        unit = Int32(0)
        if cute.arch.lane_idx() == 0:
            unit = cute.arch.atomic_add(
                counter.iterator, Int32(1), sem="relaxed", scope="gpu"
            )
            self.slots[stage] = unit
            cute.arch.mbarrier_arrive(self._full(stage))
            for r in cutlass.range_constexpr(1, self.cluster_n):
                cute.arch.mbarrier_arrive_and_expect_tx(self._full(stage), 4, r)
                cute.arch.store_async_dsmem(self.slots.iterator + stage, unit, self._full(stage), r)
        return cute.arch.shuffle_sync(unit, 0)

    @cute.jit
    def receive(self, k: Int32) -> Int32:
        """Reader warp (all lanes): the unit published in slot ``k``."""
        stage = k % FEED_STAGES
        cute.arch.mbarrier_wait(self._full(stage), (k // FEED_STAGES) & 1)
        unit = self.slots[stage]
        if cutlass.const_expr(self.cluster_n > 1):
            # the next write of this slot comes from st.async (async proxy):
            # order this generic-proxy read before it
            cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            if cutlass.const_expr(self.cluster_n > 1):
                cute.arch.mbarrier_arrive(self._empty(stage), Int32(0))
            else:
                cute.arch.mbarrier_arrive(self._empty(stage))
        return unit

    @cute.jit
    def finish(self, k: Int32, counter: cute.Tensor, num_clusters: Int32):
        """Claimer warp, after its last claim (``k`` slots used): wait until
        every reader released every slot (rank 1 arrives here remotely, so
        this CTA must outlive that), then count this cluster done; the last
        cluster puts the workspace back to zero for the next launch."""
        for j in cutlass.range_constexpr(FEED_STAGES):
            kk = k + j
            cute.arch.mbarrier_wait(self._empty(kk % FEED_STAGES), ((kk // FEED_STAGES) & 1) ^ 1)
        if cute.arch.lane_idx() == 0:
            done = cute.arch.atomic_add(
                counter.iterator + 1, Int32(1), sem="acq_rel", scope="gpu"
            )
            if done == num_clusters - 1:
                counter[0] = Int32(0)
                counter[1] = Int32(0)


@cute.jit
def producer_next_unit(feed: TileFeed, k: Int32, claimer, counter: cute.Tensor) -> Int32:
    """A producer warp's next unit: claimed by the cluster's rank 0
    (``claimer``), received by the other ranks. (A free function: the same
    branch as a TileFeed method failed the DSL's IR verification.)"""
    unit = Int32(0)
    if claimer:
        unit = feed.claim(k, counter)
    else:
        unit = feed.receive(k)
    return unit
