"""Device walker of the masked tile order (expert-major, m fastest).

Work is the set of output tiles (expert, m_block, n_block) whose m-block holds
at least one valid row: m_block < ceil(m_e / tile_m), m_e = clamp(masked_m[e],
0, max_m). Units are numbered expert-major, then n-group, then m-block (m
fastest), so the m-blocks of one n-block run on neighbouring CTAs at the same
time and share each weight tile through L2.

With clusters of ``cluster_n`` CTAs along N, the unit is an (expert, n-group,
m-block) and the CTA of rank r computes n-block ``n_group * cluster_n + r``;
the pair shares the A tile through TMA multicast. A rank whose n-block falls
past N still runs the mainloop (its peer needs its half of A) but stores
nothing.

Cluster ``c`` of ``G`` takes units c, c + G, c + 2G, ... (``Tail.BALANCE``
first cuts G to ``rules.active_clusters``; ``Tail.SPLIT`` walks virtual units,
``rules.tail_start``); with ``TileOrder.DYNAMIC`` every unit is claimed
(``dynamic``) and ``jump`` moves the walker there. The walk only goes forward:
O(E) loads of masked_m per CTA over the kernel, never a host sync. Every role
(producer, store warp, consumers) runs its own copy; all read the same
masked_m, so they see the same sequence. ``model.tile_order`` is the
pure-Python model of these rules.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from .rules import active_clusters, n_groups as _n_groups, tail_start


class WorkTile:
    """One tile handed out by :class:`MaskedTileScheduler` (device values)."""

    def __init__(self, expert, m_block, n_block, valid_rows, is_valid, half=None):
        self.expert = expert
        self.m_block = m_block
        self.n_block = n_block
        # rows of this tile that hold data: min(tile_m, m_e - m_block * tile_m)
        self.valid_rows = valid_rows
        self.is_valid = is_valid
        # Tail.SPLIT builds only: -1 for the whole tile, else
        # the 64-row half (and consumer warpgroup) this CTA computes
        self.half = half

    def _fields(self):
        fields = [self.expert, self.m_block, self.n_block, self.valid_rows, self.is_valid]
        return fields if self.half is None else fields + [self.half]

    def __extract_mlir_values__(self):
        return extract_mlir_values(self._fields())

    def __new_from_mlir_values__(self, values):
        return WorkTile(*new_from_mlir_values(self._fields(), values))


class _ExpertRows:
    """Row arithmetic both walkers share (they hold ``mMaskedM``,
    ``num_experts``, ``max_m`` and ``tile_m``)."""

    def _rows_of(self, e: Int32) -> Int32:
        # masked_m is data: never read past E.
        return self._clamped_rows(e, Int32(self.mMaskedM[cutlass.min(e, self.num_experts - 1)]))

    def _clamped_rows(self, e: Int32, m: Int32) -> Int32:
        """Valid rows of expert ``e`` given its masked_m value ``m``: clamped
        into [0, max_m] on the device, 0 for an index past E."""
        m = cutlass.max(cutlass.min(m, self.max_m), Int32(0))
        return cutlass.select_(e < self.num_experts, m, Int32(0))

    def _m_blocks(self, rows: Int32) -> Int32:
        return (rows + (self.tile_m - 1)) // self.tile_m

    @staticmethod
    def lane_masked_m(mMaskedM: cute.Tensor, num_experts: Int32) -> Int32:
        """masked_m of expert ``lane`` (index clamped into range), as stored."""
        return Int32(mMaskedM[cutlass.min(cute.arch.lane_idx(), num_experts - 1)])

    @cute.jit
    def _warp_m_blocks(self, lane_m: Int32) -> Int32:
        """The launch's m-block count, summed over every expert by one warp
        (every lane must be here): lane l counts experts l, l + 32, ..., and
        one warp reduction adds them. ``lane_m``: expert l's masked_m from
        ``lane_masked_m``, which a caller can issue early."""
        lane = cute.arch.lane_idx()
        m_blocks = self._m_blocks(self._clamped_rows(lane, lane_m))
        for i in cutlass.range(1, (self.num_experts - lane + 31) // 32, unroll=1):
            m_blocks += self._m_blocks(self._rows_of(lane + 32 * i))
        return cute.arch.warp_redux_sync(m_blocks, "add")


class MaskedTileScheduler(_ExpertRows):
    """Device-side walker over the valid tiles of the masked layout.

    Loop-carried state (4 Int32): this cluster's next linear unit index, the
    expert it falls in, the number of units of all earlier experts, and the
    unit count of the current expert. Everything else is loop-invariant;
    ``num_n_blocks`` and ``num_ctas`` here count n-groups and clusters.
    """

    def __init__(
        self,
        mMaskedM: cute.Tensor,
        num_experts: Int32,
        max_m: Int32,
        num_n_blocks: Int32,
        tile_m: int,
        num_ctas: Int32,
        cluster_n: int,
        cta_rank: Int32,
        linear_idx: Int32,
        expert: Int32,
        tiles_before: Int32,
        expert_tiles: Int32,
        split_from: Int32 = None,
    ):
        self.mMaskedM = mMaskedM
        self.num_experts = num_experts
        self.max_m = max_m
        self.num_n_blocks = num_n_blocks
        self.tile_m = tile_m
        self.num_ctas = num_ctas
        self.cluster_n = cluster_n
        self.cta_rank = cta_rank
        self.linear_idx = linear_idx
        self.expert = expert
        self.tiles_before = tiles_before
        self.expert_tiles = expert_tiles
        # Tail.SPLIT: linear_idx is a virtual index, split from this
        # unit on (``tail_start``); None in other builds
        self.split_from = split_from

    # Only the walking state is carried through loops; the rest are SSA values
    # defined before the loop.
    def __extract_mlir_values__(self):
        return extract_mlir_values(
            [self.linear_idx, self.expert, self.tiles_before, self.expert_tiles]
        )

    def __new_from_mlir_values__(self, values):
        li, ex, tb, et = new_from_mlir_values(
            [self.linear_idx, self.expert, self.tiles_before, self.expert_tiles], values
        )
        return MaskedTileScheduler(
            self.mMaskedM, self.num_experts, self.max_m, self.num_n_blocks,
            self.tile_m, self.num_ctas, self.cluster_n, self.cta_rank, li, ex, tb, et, self.split_from,
        )

    @staticmethod
    def first_tile_guess(
        cluster: Int32, cta_rank: Int32, num_n_blocks: Int32, num_experts: Int32, cluster_n: int
    ):
        """(expert, n_block, in_range) of unit ``cluster`` as if every expert
        held exactly one m-block: the tile a cluster starts on when m_e fits
        one tile, known without reading masked_m (the kernel's L2 warm-up
        runs before it may). ``in_range``: both indices name a real tile."""
        num_n_groups = _n_groups(num_n_blocks, cluster_n)
        expert = cluster // num_n_groups
        n_block = (cluster - expert * num_n_groups) * cluster_n + cta_rank
        return expert, n_block, (expert < num_experts) & (n_block < num_n_blocks)

    @staticmethod
    def create(
        mMaskedM: cute.Tensor,
        num_experts: Int32,
        max_m: Int32,
        num_n_blocks: Int32,
        tile_m: int,
        block_idx: Int32,
        grid_size: Int32,
        cluster_n: int = 1,
        cta_rank: Int32 = 0,
        split_tail: bool = False,
    ) -> "MaskedTileScheduler":
        """num_n_blocks: n-blocks of the output; block_idx / grid_size: this CTA
        and the grid (a multiple of cluster_n); cta_rank: rank in the cluster.
        split_tail: count the launch's units first (one warp's loads of
        masked_m, every lane of the calling warp here) for ``tail_start``."""
        num_n_groups = _n_groups(num_n_blocks, cluster_n)
        sched = MaskedTileScheduler(
            mMaskedM, num_experts, max_m, num_n_groups, tile_m, grid_size // cluster_n,
            cluster_n, Int32(cta_rank), Int32(block_idx // cluster_n), Int32(0), Int32(0), Int32(0),
        )
        if cutlass.const_expr(split_tail):
            units = sched._warp_units(sched.lane_masked_m(mMaskedM, num_experts))
            sched.split_from = tail_start(units, sched.num_ctas)
        sched.expert_tiles = sched._tiles_of(Int32(0))
        sched._seek()
        return sched

    # ---- Tail.BALANCE (static orders) --------------------------------------
    # One warp counts the units (``lane_masked_m`` first, so its load runs
    # alongside the walker's own seek, then ``count_active_clusters``) and
    # hands the result to the CTA's other roles, which only ``keep_active`` it.

    def _warp_units(self, lane_m: Int32) -> Int32:
        """This launch's unit count, m-blocks times n-groups (warp-collective;
        ``lane_m`` as for ``_warp_m_blocks``): what ``Tail.BALANCE`` and
        ``Tail.SPLIT`` both start from."""
        return self._warp_m_blocks(lane_m) * self.num_n_blocks

    @cute.jit
    def count_active_clusters(self, lane_m: Int32) -> Int32:
        """``active_clusters`` of this launch's unit count (every lane of the
        calling warp must be here; ``lane_m`` as for ``_warp_m_blocks``)."""
        return active_clusters(self._warp_units(lane_m), self.num_ctas)

    def keep_active(self, active: Int32):
        """Walk with stride ``active``; a cluster at or past it gets no unit
        (its first unit is the same either way, so this may follow the seek)."""
        self.expert = cutlass.select_(self.linear_idx < active, self.expert, self.num_experts)
        self.num_ctas = active

    def _tiles_of(self, e: Int32) -> Int32:
        return self._m_blocks(self._rows_of(e)) * self.num_n_blocks

    def _unit(self) -> Int32:
        """The unit linear_idx names: itself, or with ``split_from`` the unit
        of a virtual index (``split_unit``)."""
        if cutlass.const_expr(self.split_from is None):
            return self.linear_idx
        past = cutlass.max(self.linear_idx - self.split_from, Int32(0))
        return self.linear_idx - (past - past // 2)

    @cute.jit
    def _seek(self):
        # Move forward to the expert that holds the unit (or past the last).
        linear_idx = self._unit()
        expert = self.expert
        tiles_before = self.tiles_before
        expert_tiles = self.expert_tiles
        while (expert < self.num_experts) & (linear_idx >= tiles_before + expert_tiles):
            tiles_before = tiles_before + expert_tiles
            expert = expert + 1
            expert_tiles = self._tiles_of(expert)
        self.expert = expert
        self.tiles_before = tiles_before
        self.expert_tiles = expert_tiles

    def work(self) -> WorkTile:
        local = self._unit() - self.tiles_before
        # expert_tiles = m_blocks * num_n_groups; at least 1 m-block when valid
        m_blocks = cutlass.max(self.expert_tiles // self.num_n_blocks, Int32(1))
        n_group = local // m_blocks
        m_block = local - n_group * m_blocks
        n_block = n_group * self.cluster_n + self.cta_rank
        rows = self._rows_of(self.expert)
        valid_rows = cutlass.min(rows - m_block * self.tile_m, Int32(self.tile_m))
        half = None
        if cutlass.const_expr(self.split_from is not None):
            past = self.linear_idx - self.split_from
            half = cutlass.select_(past < 0, Int32(-1), cutlass.max(past, Int32(0)) % 2)
        return WorkTile(
            self.expert, m_block, n_block, valid_rows, self.expert < self.num_experts, half
        )

    def advance(self):
        self.linear_idx = self.linear_idx + self.num_ctas
        self._seek()

    def jump(self, unit: Int32):
        """Move to linear unit ``unit`` (never behind the current one): the
        dynamic order's next claim."""
        self.linear_idx = unit
        self._seek()
