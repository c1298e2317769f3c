"""A warp's walk over the valid rows of the masked layout, 32 experts a step.

Items are ``rows_per_item``-row slices of each expert's valid rows, numbered
expert-major (the GEMM's order at ``tile_m = rows_per_item``, one n-group). A
warp takes items ``start, start + stride, ...``. Where ``MaskedTileScheduler``
moves one expert per dependent load of masked_m, here lane l loads expert
``base + l`` and one warp scan gives the 32 experts' item offsets: O(E / 32)
loads per warp. That is what a launch of thousands of warps over a few
hundred rows needs: most warps find no item, and each used to learn it by a
walk over every expert (docs/design.md, "The combine's fixed cost").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def lane_expert_items(mMaskedM: cute.Tensor, num_experts: Int32, max_m: Int32, base: Int32,
                      rows_per_item: cutlass.Constexpr[int]):
    """Every lane of the warp: (rows, inclusive item prefix) of expert
    ``base + lane``: rows clamped into [0, max_m] (0 past E), the prefix
    summed over lanes 0..lane of the chunk."""
    lane = cute.arch.lane_idx()
    e = base + lane
    rows = Int32(mMaskedM[cutlass.min(e, num_experts - 1)])
    rows = cutlass.select_(e < num_experts, cutlass.max(cutlass.min(rows, max_m), Int32(0)), Int32(0))
    items = (rows + (rows_per_item - 1)) // rows_per_item
    incl = items
    for k in cutlass.range_constexpr(5):
        got = cute.arch.shuffle_sync_up(incl, 1 << k)
        if lane >= (1 << k):
            incl = incl + got
    return rows, incl


@cute.jit
def pick_item(rows: Int32, incl: Int32, local: Int32, rows_per_item: cutlass.Constexpr[int]):
    """For item ``local`` of the chunk (``local`` < the chunk's item count,
    uniform over the warp): (lane of its expert, its first row, its valid
    rows), uniform over the warp."""
    lane_sel = cute.arch.popc(cute.arch.vote_ballot_sync(incl <= local))
    items = (rows + (rows_per_item - 1)) // rows_per_item
    before = cute.arch.shuffle_sync(incl - items, lane_sel)
    rows_sel = cute.arch.shuffle_sync(rows, lane_sel)
    row0 = (local - before) * rows_per_item
    return lane_sel, row0, cutlass.min(Int32(rows_per_item), rows_sel - row0)
