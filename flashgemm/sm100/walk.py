"""The masked tile order as the sm_100 roles walk it: one unit per cluster.

A unit is (expert, m-block of ``tile_m`` rows, n-block) with at least one
valid row, numbered as ``schedule.walker`` numbers them; the walker is fed
the cluster index and cluster count, so both CTAs of a 2-CTA pair take the
same unit. Every role (TMA warp, MMA warp, epilogue warps) of every CTA runs
its own copy from the same masked_m, so all see the same units in the same
order and no pipeline waits for a tile its peer skipped.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32

from ..schedule.walker import MaskedTileScheduler


def make_walker(mMaskedM, num_experts, max_m, num_n_blocks, tile_m: int, cluster: Int32, num_clusters: Int32):
    """This cluster's walker, moved to its first unit (the n-group is one
    n-block: the pair splits M, never N)."""
    return MaskedTileScheduler.create(mMaskedM, num_experts, max_m, num_n_blocks, tile_m, cluster, num_clusters)


def cta_rows(valid_rows: Int32, cta_v: Int32, cta_tile_m: int) -> Int32:
    """Valid rows of the 128-row half CTA ``cta_v`` stores: 0..cta_tile_m."""
    rows = valid_rows - cta_v * cta_tile_m
    return cutlass.max(cutlass.min(rows, Int32(cta_tile_m)), Int32(0))


def signal_index(signal_mode, expert: Int32, m_block: Int32, cta_v: Int32, cta_group: int, num_m_slots: Int32):
    """The counter a CTA's tile adds to: per expert, or per 128-row m-block
    (``e * ceil(max_m / 128) + m``, m counting this CTA's half)."""
    if cutlass.const_expr(signal_mode == "m_block"):
        return expert * num_m_slots + m_block * cta_group + cta_v
    return expert
