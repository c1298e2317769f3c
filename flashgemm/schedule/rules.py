"""Integer rules of the tile order, shared by the model and the device.

Integer arithmetic only (``cutlass.min``/``max`` accept Python ints): the same
code runs on the model's ints and on the kernel's Int32 values, so the two
cannot drift apart. Why each rule exists: ``docs/design.md`` (Scheduling).
"""

from __future__ import annotations

from typing import Tuple

import cutlass


def clamp_rows(masked_m_e: int, max_m: int) -> int:
    """Valid rows of one expert: masked_m clamped into [0, max_m]."""
    return min(max(int(masked_m_e), 0), max_m)


def n_groups(num_n_blocks, cluster_n: int):
    """Units along N: clusters of ``cluster_n`` CTAs take adjacent n-blocks."""
    return (num_n_blocks + (cluster_n - 1)) // cluster_n


def active_clusters(units, clusters):
    """Clusters that take units under ``Tail.BALANCE``.

    Dealt round-robin, U units on G clusters take r = ceil(U / G) rounds, the
    last holding U - (r - 1) G. When that round is at most half full, the
    same r rounds go to ceil(U / r) clusters instead: every round full, the
    other SMs idle (free for a concurrent combine)."""
    rounds = cutlass.max((units + clusters - 1) // clusters, 1)
    last = units - (rounds - 1) * clusters  # 0..clusters units in the last round
    spread = (units + rounds - 1) // rounds
    keep_all = (2 * last) // (clusters + 1)  # 1 when the last round is over half full, else 0
    return spread + keep_all * (clusters - spread)


def tail_start(units, clusters):
    """``Tail.SPLIT``: the first unit of the grid's last round when that
    round is at most half full (its units then run as two half units each,
    one warpgroup per half), else ``units`` (nothing split).

    Dealt round-robin, a cluster's virtual index v maps to unit v below the
    returned start s, and from it on to half (v - s) % 2 of unit
    s + (v - s) // 2, so the r last units become 2r half units on 2r <= G
    clusters, the two halves of a unit on neighbouring clusters (they read
    the same weight tile)."""
    full = (units // clusters) * clusters
    rem = units - full
    split = cutlass.min(rem, 1) * (1 - (2 * rem) // (clusters + 1))  # 1 when 0 < 2 rem <= G
    return units - rem * split


def split_unit(v: int, start: int) -> Tuple[int, int]:
    """(unit, half) of virtual index ``v`` under ``tail_start`` ``start``;
    half -1: the whole unit (the model's form of the walker's arithmetic)."""
    if v < start:
        return v, -1
    return start + (v - start) // 2, (v - start) % 2
