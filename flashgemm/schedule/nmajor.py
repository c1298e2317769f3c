"""Device walker of the n-group-major order (``TileOrder.N_MAJOR``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from .rules import n_groups as _n_groups
from .walker import WorkTile, _ExpertRows


class NMajorTileScheduler(_ExpertRows):
    """Device-side walker for ``TileOrder.N_MAJOR``: units numbered n-group
    first, u = n_group * M + r, where M is the launch's m-block count
    (sum over experts of ceil(m_e / tile_m)) and r numbers the (expert,
    m_block) pairs expert-major, m fastest.

    Why: every round holds a slice of every expert, so tiles that stream
    their own weights (bound by HBM) run beside pairs of m-blocks that share
    a weight tile (bound by the SMs); the m-blocks of one (expert, n-group)
    stay adjacent (``docs/design.md``, Scheduling).

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
