"""Masked persistent tile scheduler.

Work is the set of output tiles (expert, m_block, n_block) whose m-block holds
at least one valid row: m_block < ceil(m_e / tile_m) with
m_e = clamp(masked_m[e], 0, max_m). Tiles are numbered expert-major, then
n-block, then m-block (m fastest): the m-blocks of one n-block land on
neighbouring CTAs at the same time and share each weight tile through L2, so
the weights, the bytes that bound decode, leave DRAM once. Measured on H100
(qwen3-235b-ep8 shapes, m_e 44..83, tile_m 64): n-fastest order read B twice
and ran 1.2x slower.

With clusters of ``cluster_n`` CTAs along N, the unit of work is an
(expert, n-group, m-block) and both CTAs of a cluster take the same unit, the
CTA of rank r computing n-block ``n_group * cluster_n + r``: they share the A
tile through TMA multicast. A rank whose n-block falls past N (odd n-block
count) still runs the mainloop, since its peer needs its half of A, but
stores nothing (the TMA unit and the column predicate clip it).

Cluster (or CTA) ``c`` of ``G`` takes units c, c + G, c + 2G, ... With
``GemmConfig.balance_rounds`` G is first cut to ``active_clusters`` (counted
from masked_m on the device) when the last round would be at most half
full. With ``GemmConfig.dynamic`` the walker starts from unit 0 and each
cluster claims every unit it runs from a global counter
(``dynamic_scheduler``); ``jump`` moves the walker to the claimed unit.
The scheduler walks the experts forward once (the tile index only grows), so
the cost is O(E) loads of masked_m per CTA over the whole kernel, never a host
sync. The producer warp and the consumer warpgroups each run their own copy;
both read the same masked_m, so they see the same sequence.

With ``GemmConfig.n_major`` the units are numbered n-group first instead
(:class:`NMajorTileScheduler`), so each round mixes every expert; the same
dealing, balancing and claiming apply to that numbering.

With ``GemmConfig.split_last_round`` (static expert-major order) each role
counts the units first; when the grid's last round would be at most half
full, the cluster's index walks virtual units, and each unit of that round
becomes two half units (``tail_start``, ``WorkTile.half``).

``tile_order`` is the pure-Python model of exactly these rules; the tests check
the kernel's invariants against it.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


def clamp_rows(masked_m_e: int, max_m: int) -> int:
    return min(max(int(masked_m_e), 0), max_m)


def active_clusters(units, clusters):
    """Clusters that take units under ``GemmConfig.balance_rounds``.

    Dealt round-robin, U units on G clusters take r = ceil(U / G) rounds, the
    last holding U - (r - 1) G. A decode tile's time is set by the weight
    bytes it streams: with every SM loading, the GPU's bandwidth is the
    limit; with a few, each SM's own rate is. So a last round of a few units
    costs nearly a full round on an almost idle GPU. When it is at most half
    full, the same r rounds go to ceil(U / r) clusters instead: every round
    full, the rest of the SMs idle (free for a concurrent combine). Measured
    on H100 (2026-11-24): fp8 dsv3-ep32-down (280 units, 66 clusters, a fifth
    round of 16) ran on 56 clusters in 0.964-0.976x the time of 66; capping
    the grid where the last round was more than half full moved times by
    -2.6% to +2.9%, so those keep every cluster. The count (one warp's loads
    and reduction before its first tile) cost the cases it never cut nothing
    measurable on the 128x128 tile and up to 2% on others, so the heuristic
    balances the 128x128 tile only (``config``).

    Integer arithmetic only: the same code runs on Python ints (the model)
    and on the kernel's Int32 values.
    """
    rounds = cutlass.max((units + clusters - 1) // clusters, 1)
    last = units - (rounds - 1) * clusters  # 0..clusters units in the last round
    spread = (units + rounds - 1) // rounds
    keep_all = (2 * last) // (clusters + 1)  # 1 when the last round is over half full, else 0
    return spread + keep_all * (clusters - spread)


def tail_start(units, clusters):
    """``GemmConfig.split_last_round``: the first unit of the grid's last
    round when that round is at most half full (its units then run as two
    half units each, one warpgroup per half), else ``units`` (nothing split).

    Dealt round-robin, a cluster's virtual index v maps to unit v below the
    returned start s, and from it on to half (v - s) % 2 of unit
    s + (v - s) // 2, so the r last units become 2r half units on 2r <= G
    clusters, the two halves of a unit on neighbouring clusters (they read
    the same weight tile). On compute-bound tiles a half unit takes about
    half as long: one warpgroup drove the tensor cores nearly as fast as
    two (H100, 2026-11-24, ``ab_revision.py --set tile_m=64 --set
    consumer_warpgroups=1``: bf16 dense-like 1.017), so a last round of a
    few units costs about half a round instead of a whole one.

    Integer arithmetic only, as ``active_clusters``.
    """
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


def tile_order(
    masked_m: Sequence[int],
    max_m: int,
    n: int,
    tile_m: int,
    tile_n: int,
    num_ctas: int,
    cluster_n: int = 1,
    balance: bool = False,
    n_major: bool = False,
    split: bool = False,
    window: int = 0,
) -> List[List[Tuple[int, ...]]]:
    """Model of the device scheduler: the (expert, m_block, n_block) list of each CTA.

    With ``cluster_n`` > 1, ``num_ctas`` must be a multiple of it; tiles whose
    n-block lies past N (computed, never stored) are left out. ``balance``:
    ``GemmConfig.balance_rounds``; ``n_major``: ``GemmConfig.n_major`` (units
    numbered n-group first, :class:`NMajorTileScheduler`); ``split``:
    ``GemmConfig.split_last_round``, and the tiles are then (expert, m_block,
    n_block, half), half -1 for a whole tile, 0 or 1 for the upper or lower
    64 rows. ``window``: ``GemmConfig.n_major_window`` (with ``n_major``,
    units numbered window by window of that many experts).
    """
    n_blocks = -(-n // tile_n)
    n_groups = -(-n_blocks // cluster_n)
    m_blocks = [-(-clamp_rows(m, max_m) // tile_m) for m in masked_m]
    if n_major:
        w = window or len(m_blocks) or 1
        units = [
            (e, mb, ng)
            for first in range(0, len(m_blocks), w)
            for ng in range(n_groups)
            for e in range(first, min(first + w, len(m_blocks)))
            for mb in range(m_blocks[e])
        ]
    else:
        units = [(e, mb, ng) for e, mbs in enumerate(m_blocks) for ng in range(n_groups) for mb in range(mbs)]
    num_clusters = num_ctas // cluster_n
    if balance:
        num_clusters = active_clusters(len(units), num_clusters)
    if split:
        start = tail_start(len(units), num_clusters)
        virtual = len(units) + (len(units) - start)
        units = [units[u] + (h,) for u, h in (split_unit(v, start) for v in range(virtual))]
    order = []
    for c in range(num_ctas):
        cluster, rank = divmod(c, cluster_n)
        mine = units[cluster::num_clusters] if cluster < num_clusters else []
        tiles = [(e, mb, ng * cluster_n + rank, *rest) for e, mb, ng, *rest in mine]
        order.append([t for t in tiles if t[2] < n_blocks])
    return order


def valid_tiles(
    masked_m: Iterable[int], max_m: int, n: int, tile_m: int, tile_n: int
) -> set:
    """The tiles that must be computed, stated directly from the op's definition."""
    out = set()
    for e, m in enumerate(masked_m):
        rows = clamp_rows(m, max_m)
        for mb in range(max_m // tile_m + 1):
            for nb in range(-(-n // tile_n)):
                if mb * tile_m < rows:
                    out.add((e, mb, nb))
    return out


def _n_groups(num_n_blocks, cluster_n: int):
    """Units along N: clusters of ``cluster_n`` CTAs take adjacent n-blocks."""
    return (num_n_blocks + (cluster_n - 1)) // cluster_n


class WorkTile:
    """One tile handed out by :class:`MaskedTileScheduler` (device values)."""

    def __init__(self, expert, m_block, n_block, valid_rows, is_valid, half=None):
        self.expert = expert
        self.m_block = m_block
        self.n_block = n_block
        # rows of this tile that hold data: min(tile_m, m_e - m_block * tile_m)
        self.valid_rows = valid_rows
        self.is_valid = is_valid
        # GemmConfig.split_last_round builds only: -1 for the whole tile, else
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
        # split_last_round: linear_idx is a virtual index, split from this
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
        split_last_round: bool = False,
    ) -> "MaskedTileScheduler":
        """num_n_blocks: n-blocks of the output; block_idx / grid_size: this CTA
        and the grid (a multiple of cluster_n); cta_rank: rank in the cluster.
        split_last_round: count the launch's units first (one warp's loads of
        masked_m, every lane of the calling warp here) for ``tail_start``."""
        num_n_groups = _n_groups(num_n_blocks, cluster_n)
        sched = MaskedTileScheduler(
            mMaskedM, num_experts, max_m, num_n_groups, tile_m, grid_size // cluster_n,
            cluster_n, Int32(cta_rank), Int32(block_idx // cluster_n), Int32(0), Int32(0), Int32(0),
        )
        if cutlass.const_expr(split_last_round):
            units = sched._warp_units(sched.lane_masked_m(mMaskedM, num_experts))
            sched.split_from = tail_start(units, sched.num_ctas)
        sched.expert_tiles = sched._tiles_of(Int32(0))
        sched._seek()
        return sched

    # ---- GemmConfig.balance_rounds (static order) ------------------------
    # One warp counts the units (``lane_masked_m`` first, so its load runs
    # alongside the walker's own seek, then ``count_active_clusters``) and
    # hands the result to the CTA's other roles, which only ``keep_active`` it.

    def _warp_units(self, lane_m: Int32) -> Int32:
        """This launch's unit count, m-blocks times n-groups (warp-collective;
        ``lane_m`` as for ``_warp_m_blocks``): what ``balance_rounds`` and
        ``split_last_round`` both start from."""
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


class NMajorTileScheduler(_ExpertRows):
    """Device-side walker for ``GemmConfig.n_major``: units numbered n-group
    first, u = n_group * M + r, where M is the launch's m-block count
    (sum over experts of ceil(m_e / tile_m)) and r numbers the (expert,
    m_block) pairs expert-major, m fastest.

    Why: in the expert-major order a round of G consecutive units holds one
    or two experts, so when some experts span two m-blocks (whose CTAs share
    each weight tile through L2) and others one, rounds alternate between
    bound by HBM (every CTA streams its own weights) and bound by the tensor
    cores (pairs share them). Trace of fp8 dsv3-ep32-down (H100, 2026-11-24,
    ``trace_tiles.py --json``): three rounds of single-m-block experts at
    10.0-11.7 us per tile, then two of paired m-blocks at 7.1-7.6 us. Here
    every round holds a slice of every expert, so both kinds run at once.
    The m-blocks of one (expert, n-group) stay adjacent: they still run in
    the same round and share the weight tile.

    Finding the expert of r is warp-collective (every lane of the calling
    warp must be here, as in every role of the kernel): lane l holds expert
    l's m-block count (and l + 32, ... in later chunks of 32), one inclusive
    scan gives the prefix sums, and the expert is the number of lanes whose
    prefix is <= r. No loop-carried expert state: each step is one masked_m
    load per lane (an L1 hit after the first) per chunk of 32 experts.
    With ``GemmConfig.n_major_window`` W (a power of two up to 32) the
    experts are taken W at a time, each window's units numbered n-group
    first and windows one after another, so a window's experts finish
    together instead of every expert at the end of the launch: what a
    combine waiting on completion signals needs. A window never straddles
    a chunk of 32 experts; the window of u is the last window-start lane
    whose units before it are <= u (one more ballot).
    """

    def __init__(
        self,
        mMaskedM: cute.Tensor,
        num_experts: Int32,
        max_m: Int32,
        num_n_groups: Int32,
        tile_m: int,
        num_clusters: Int32,
        cluster_n: int,
        cta_rank: Int32,
        linear_idx: Int32,
        m_total: Int32,
        window: int = 0,
    ):
        self.mMaskedM = mMaskedM
        self.num_experts = num_experts
        self.max_m = max_m
        self.num_n_blocks = num_n_groups  # (named as in MaskedTileScheduler)
        self.tile_m = tile_m
        self.num_ctas = num_clusters
        self.cluster_n = cluster_n
        self.cta_rank = cta_rank
        self.linear_idx = linear_idx
        self.m_total = m_total
        self.window = window  # experts per window (compile time); 0: all

    def __extract_mlir_values__(self):
        return extract_mlir_values([self.linear_idx])

    def __new_from_mlir_values__(self, values):
        (li,) = new_from_mlir_values([self.linear_idx], values)
        return NMajorTileScheduler(
            self.mMaskedM, self.num_experts, self.max_m, self.num_n_blocks, self.tile_m,
            self.num_ctas, self.cluster_n, self.cta_rank, li, self.m_total, self.window,
        )

    @staticmethod
    def first_tile_guess(
        cluster: Int32, cta_rank: Int32, num_n_blocks: Int32, num_experts: Int32, cluster_n: int,
        window: int = 0,
    ):
        """As ``MaskedTileScheduler.first_tile_guess``, in this order: with
        one m-block per expert, unit c is expert c % E of n-group c // E
        (with a window of W experts: expert c % W of n-group (c // W) % NG
        in window c // (W * NG))."""
        num_n_groups = _n_groups(num_n_blocks, cluster_n)
        if cutlass.const_expr(window == 0):
            n_group = cluster // num_experts
            expert = cluster - n_group * num_experts
            n_block = n_group * cluster_n + cta_rank
            return expert, n_block, (n_group < num_n_groups) & (n_block < num_n_blocks)
        w_idx = cluster // (window * num_n_groups)  # every window but the last is full
        first = w_idx * window
        size = cutlass.max(cutlass.min(num_experts - first, window), 1)
        local = cluster - first * num_n_groups
        n_group = local // size
        expert = first + local - n_group * size
        n_block = n_group * cluster_n + cta_rank
        return expert, n_block, (n_group < num_n_groups) & (n_block < num_n_blocks) & (
            first < num_experts
        )

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
        window: int = 0,
    ) -> "NMajorTileScheduler":
        """Same arguments as ``MaskedTileScheduler.create``, and
        ``GemmConfig.n_major_window``; counts M."""
        sched = NMajorTileScheduler(
            mMaskedM, num_experts, max_m, _n_groups(num_n_blocks, cluster_n), tile_m,
            grid_size // cluster_n, cluster_n, Int32(cta_rank), Int32(block_idx // cluster_n), Int32(0),
            window,
        )
        sched.m_total = sched._warp_m_blocks(sched.lane_masked_m(mMaskedM, num_experts))
        return sched

    def units(self) -> Int32:
        return self.m_total * self.num_n_blocks

    def keep_active(self, active: Int32):
        """``MaskedTileScheduler.keep_active``: stride ``active``; a cluster
        at or past it gets no unit."""
        self.linear_idx = cutlass.select_(self.linear_idx < active, self.linear_idx, self.units())
        self.num_ctas = active

    def _lane_blocks(self, base: Int32):
        """(rows, m-blocks) of expert ``base + lane`` (0 past E)."""
        rows = self._rows_of(base + cute.arch.lane_idx())
        return rows, self._m_blocks(rows)

    @cute.jit
    def work(self) -> WorkTile:
        units = self.units()
        is_valid = self.linear_idx < units
        u = cutlass.min(self.linear_idx, cutlass.max(units - 1, Int32(0)))
        ng = self.num_n_blocks
        # Without a window: the n-group is known up front and r counts the
        # (expert, m_block) pairs left to skip. With one: r counts units, and
        # the n-group comes from the window that holds them.
        n_group = Int32(0)
        r = u
        if cutlass.const_expr(self.window == 0):
            n_group = u // cutlass.max(self.m_total, Int32(1))
            r = u - n_group * self.m_total
        lane = cute.arch.lane_idx()
        expert = Int32(0)
        m_block = Int32(0)
        rows = Int32(0)
        base = Int32(0)
        searching = is_valid
        while searching:
            lane_rows, blocks = self._lane_blocks(base)
            incl = blocks  # inclusive prefix sum over the chunk's lanes
            for d in (1, 2, 4, 8, 16):
                up = cute.arch.shuffle_sync_up(incl, d)
                incl = incl + cutlass.select_(lane >= d, up, Int32(0))
            chunk_total = cute.arch.shuffle_sync(incl, 31)
            chunk_units = chunk_total
            if cutlass.const_expr(self.window != 0):
                chunk_units = chunk_total * ng
            if r < chunk_units:
                if cutlass.const_expr(self.window != 0):
                    w = self.window
                    excl = incl - blocks
                    starts = cute.arch.vote_ballot_sync(((lane & (w - 1)) == 0) & (excl * ng <= r))
                    first = (cute.arch.popc(starts) - 1) * w  # the window's first lane
                    before = cute.arch.shuffle_sync(excl, first)
                    window_blocks = cute.arch.shuffle_sync(incl, first + (w - 1)) - before
                    local = r - before * ng
                    n_group = local // window_blocks
                    r = before + local - n_group * window_blocks
                e_in = cute.arch.popc(cute.arch.vote_ballot_sync(incl <= r))
                expert = base + e_in
                m_block = r - cute.arch.shuffle_sync(incl - blocks, e_in)
                rows = cute.arch.shuffle_sync(lane_rows, e_in)
                searching = False
            else:
                r = r - chunk_units
                base = base + 32
                searching = base < self.num_experts
        valid_rows = cutlass.min(rows - m_block * self.tile_m, Int32(self.tile_m))
        n_block = n_group * self.cluster_n + self.cta_rank
        return WorkTile(expert, m_block, n_block, valid_rows, is_valid)

    def advance(self):
        self.linear_idx = self.linear_idx + self.num_ctas

    def jump(self, unit: Int32):
        """The dynamic order's next claim."""
        self.linear_idx = unit
