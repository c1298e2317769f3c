"""Property tests of the tile scheduler's model and of the torch reference (CPU only).

``tile_order`` models the device scheduler; ``valid_tiles`` states the work
from the op's definition. The device walker (MaskedTileScheduler) is mirrored
here in plain integer arithmetic and must reproduce tile_order exactly.
"""

import random
from collections import Counter

import pytest
import torch

from flashgemm.reference import grouped_gemm_nt_masked_ref
from flashgemm.schedule.model import tile_order, valid_tiles
from flashgemm.schedule.rules import active_clusters, clamp_rows, n_groups, split_unit, tail_start

MAX_MS = (1, 63, 64, 65, 200, 1024)
NS = (8, 120, 128, 136, 4096)
TILE_MS = (64, 128)
TILE_NS = (64, 128, 256)
NUM_CTAS = (1, 7, 132)


def cdiv(a, b):
    return -(-a // b)


def clamp(m, max_m):
    return min(max(m, 0), max_m)


def draw_masked_m(rng, e_count, max_m):
    choices = [
        lambda: 0,
        lambda: 1,
        lambda: max_m,
        lambda: max_m + 5,
        lambda: 10**6,
        lambda: -3,
        lambda: rng.randint(0, max_m),
        lambda: rng.randint(0, max_m),
    ]
    # some draws are mostly empty experts, some are mostly full
    weights = [rng.random() for _ in choices]
    return [rng.choices(choices, weights)[0]() for _ in range(e_count)]


def draw_cases(seed, count, max_tiles=60_000):
    """Random problems; the first two pin E = 1 and E = 256."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        i = len(cases)
        e_count = 1 if i == 0 else 256 if i == 1 else rng.choice([rng.randint(1, 16), rng.randint(1, 256)])
        max_m = rng.choice(MAX_MS)
        n = rng.choice(NS)
        tile_m = rng.choice(TILE_MS)
        tile_n = rng.choice(TILE_NS)
        num_ctas = rng.choice(NUM_CTAS)
        # bound the worst case so the Python walker stays fast
        if e_count * cdiv(max_m, tile_m) * cdiv(n, tile_n) > max_tiles:
            continue
        masked_m = draw_masked_m(rng, e_count, max_m)
        cases.append((masked_m, max_m, n, tile_m, tile_n, num_ctas))
    return cases


CASES = draw_cases(seed=20261122, count=400)


def case_id(case):
    masked_m, max_m, n, tile_m, tile_n, num_ctas = case
    return f"E{len(masked_m)}-M{max_m}-N{n}-t{tile_m}x{tile_n}-g{num_ctas}"


def test_cases_cover_the_grid():
    # the draw really spans the requested space (guards the generator itself)
    assert {len(c[0]) for c in CASES} >= {1, 256}
    assert {c[1] for c in CASES} == set(MAX_MS)
    assert {c[2] for c in CASES} == set(NS)
    assert {c[3] for c in CASES} == set(TILE_MS)
    assert {c[4] for c in CASES} == set(TILE_NS)
    assert {c[5] for c in CASES} == set(NUM_CTAS)
    values = {v for c in CASES for v in c[0]}
    assert {0, 1, 10**6, -3} <= values
    assert any(c[1] + 5 in c[0] for c in CASES) and any(c[1] in c[0] for c in CASES)


def global_order(masked_m, max_m, n, tile_m, tile_n):
    """All valid tiles in the scheduler's global order, built from the definition."""
    return sorted(valid_tiles(masked_m, max_m, n, tile_m, tile_n), key=lambda t: (t[0], t[2], t[1]))


# ---------------------------------------------------------------------------
# tile_order against the op's definition
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", range(8))
def test_every_valid_tile_exactly_once(chunk):
    for case in CASES[chunk::8]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        order = tile_order(masked_m, max_m, n, tile_m, tile_n, num_ctas)
        assert len(order) == num_ctas, case_id(case)
        got = Counter(t for cta in order for t in cta)
        assert all(c == 1 for c in got.values()), f"{case_id(case)}: duplicated tiles"
        assert set(got) == valid_tiles(masked_m, max_m, n, tile_m, tile_n), case_id(case)
        empty = {e for e, m in enumerate(masked_m) if clamp(m, max_m) == 0}
        assert not any(t[0] in empty for t in got), f"{case_id(case)}: tile of an empty expert"


@pytest.mark.parametrize("chunk", range(8))
def test_round_robin_in_global_order(chunk):
    for case in CASES[chunk::8]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        order = tile_order(masked_m, max_m, n, tile_m, tile_n, num_ctas)
        ref = global_order(masked_m, max_m, n, tile_m, tile_n)
        for c, tiles in enumerate(order):
            keys = [(e, nb, mb) for e, mb, nb in tiles]
            assert keys == sorted(keys) and len(set(keys)) == len(keys), f"{case_id(case)} cta {c}"
            assert tiles == ref[c::num_ctas], f"{case_id(case)} cta {c}"


@pytest.mark.parametrize("chunk", range(8))
def test_tiles_hold_rows_and_count(chunk):
    for case in CASES[chunk::8]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        order = tile_order(masked_m, max_m, n, tile_m, tile_n, num_ctas)
        n_blocks = cdiv(n, tile_n)
        total = 0
        for tiles in order:
            for e, mb, nb in tiles:
                assert 0 <= e < len(masked_m)
                assert 0 <= mb and mb * tile_m < clamp(masked_m[e], max_m), case_id(case)
                assert 0 <= nb < n_blocks, case_id(case)
            total += len(tiles)
        want = sum(cdiv(clamp(m, max_m), tile_m) * n_blocks for m in masked_m)
        assert total == want, case_id(case)
        # balance: round robin gives every CTA floor or ceil of the share
        sizes = {len(t) for t in order}
        assert sizes <= {want // num_ctas, cdiv(want, num_ctas)}, case_id(case)


def test_tile_order_hand_example():
    # e0: 3 rows -> 1 m-block; e1: empty; e2: 130 rows (clamped from 500 to
    # max_m=130) -> 2 m-blocks; 2 n-blocks each; m fastest within an n-block
    order = tile_order([3, 0, 500], 130, 256, 128, 128, 3)
    assert order == [
        [(0, 0, 0), (2, 1, 0)],
        [(0, 0, 1), (2, 0, 1)],
        [(2, 0, 0), (2, 1, 1)],
    ]


def test_tile_order_all_empty():
    order = tile_order([0, -7, 0], 64, 128, 64, 128, 4)
    assert order == [[], [], [], []]
    assert valid_tiles([0, -7, 0], 64, 128, 64, 128) == set()


# ---------------------------------------------------------------------------
# mirror of MaskedTileScheduler's device arithmetic
# ---------------------------------------------------------------------------


class WalkerModel:
    """MaskedTileScheduler in plain Python integers (same state, same steps)."""

    def __init__(self, masked_m, max_m, num_n_blocks, tile_m, block_idx, grid_size, cluster_n=1, cta_rank=0,
                 balance=False):
        self.masked_m = masked_m
        self.num_experts = len(masked_m)
        self.max_m = max_m
        self.num_n_blocks = (num_n_blocks + cluster_n - 1) // cluster_n  # n-groups
        self.tile_m = tile_m
        self.num_ctas = grid_size // cluster_n  # clusters
        self.cluster_n = cluster_n
        self.cta_rank = cta_rank
        self.linear_idx = block_idx // cluster_n
        self.expert = 0
        self.tiles_before = 0
        self.expert_tiles = self._tiles_of(0)
        self._seek()
        if balance:  # the producer's count_active_clusters, then keep_active
            units = sum(self._tiles_of(e) for e in range(self.num_experts))
            active = active_clusters(units, self.num_ctas)
            if self.linear_idx >= active:
                self.expert = self.num_experts
            self.num_ctas = active

    def _rows_of(self, e):
        in_range = e < self.num_experts
        e_safe = min(e, self.num_experts - 1)  # never read past E
        m = self.masked_m[e_safe]
        m = max(min(m, self.max_m), 0)
        return m if in_range else 0

    def _tiles_of(self, e):
        rows = self._rows_of(e)
        return ((rows + (self.tile_m - 1)) // self.tile_m) * self.num_n_blocks

    def _seek(self):
        while self.expert < self.num_experts and self.linear_idx >= self.tiles_before + self.expert_tiles:
            self.tiles_before += self.expert_tiles
            self.expert += 1
            self.expert_tiles = self._tiles_of(self.expert)

    def work(self):
        local = self.linear_idx - self.tiles_before
        m_blocks = max(self.expert_tiles // self.num_n_blocks, 1)
        n_group = local // m_blocks
        m_block = local - n_group * m_blocks
        n_block = n_group * self.cluster_n + self.cta_rank
        rows = self._rows_of(self.expert)
        valid_rows = min(rows - m_block * self.tile_m, self.tile_m)
        return self.expert, m_block, n_block, valid_rows, self.expert < self.num_experts

    def advance(self):
        self.linear_idx += self.num_ctas
        self._seek()


def walk(masked_m, max_m, n, tile_m, tile_n, num_ctas, cluster_n=1, keep_clipped=False, balance=False,
         model=None, **model_kw):
    """Run the walker model (``WalkerModel`` unless ``model``, built with
    ``model_kw`` besides) for every CTA of the grid, as the kernel does."""
    model = model or WalkerModel
    n_blocks = cdiv(n, tile_n)
    per_cta = []
    for c in range(num_ctas):
        w = model(masked_m, max_m, n_blocks, tile_m, c, num_ctas, cluster_n, c % cluster_n, balance, **model_kw)
        tiles = []
        e, mb, nb, valid_rows, ok = w.work()
        while ok:
            assert 1 <= valid_rows <= tile_m  # every handed-out tile stores >= 1 row
            assert valid_rows == min(clamp(masked_m[e], max_m) - mb * tile_m, tile_m)
            if keep_clipped or nb < n_blocks:  # past-N ranks compute, store nothing
                tiles.append((e, mb, nb))
            w.advance()
            e, mb, nb, valid_rows, ok = w.work()
        if model is WalkerModel:
            assert w.expert == len(masked_m)  # walked off the end, guarded
        per_cta.append(tiles)
    return per_cta


@pytest.mark.parametrize("chunk", range(8))
def test_walker_matches_tile_order(chunk):
    for case in CASES[chunk::8]:
        assert walk(*case) == tile_order(*case), case_id(case)


@pytest.mark.parametrize("chunk", range(4))
def test_walker_matches_tile_order_clusters(chunk):
    for case in CASES[chunk::4][:60]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        num_ctas = 2 * max(1, num_ctas // 2)  # grid is a multiple of cluster_n
        args = (masked_m, max_m, n, tile_m, tile_n, num_ctas)
        order = tile_order(*args, cluster_n=2)
        assert walk(*args, cluster_n=2) == order, case_id(case)
        got = Counter(t for cta in order for t in cta)
        assert all(c == 1 for c in got.values())
        assert set(got) == valid_tiles(masked_m, max_m, n, tile_m, tile_n), case_id(case)
        # both CTAs of a cluster take the same (expert, m_block) in lockstep,
        # on adjacent n-blocks (before the past-N clip)
        full = walk(*args, cluster_n=2, keep_clipped=True)
        for c in range(0, num_ctas, 2):
            assert len(full[c]) == len(full[c + 1])
            for t0, t1 in zip(full[c], full[c + 1]):
                assert t0[:2] == t1[:2] and t1[2] == t0[2] + 1 and t0[2] % 2 == 0


@pytest.mark.parametrize("chunk", range(4))
def test_balanced_walker_matches_tile_order_and_keeps_the_round_count(chunk):
    """Tail.BALANCE: the walker (with the producer's count) is the model;
    every valid tile runs once; no cluster runs more units than the plain
    round-robin's busiest (the same number of rounds); and when the plain
    order's last round is at most half full, ceil(units / rounds) clusters
    take them."""
    triggered = 0
    for case in CASES[chunk::4][:80]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        for cluster_n in (1, 2):
            grid = cluster_n * max(1, num_ctas // cluster_n)
            args = (masked_m, max_m, n, tile_m, tile_n, grid)
            order = tile_order(*args, cluster_n=cluster_n, balance=True)
            assert walk(*args, cluster_n=cluster_n, balance=True) == order, case_id(case)
            got = Counter(t for cta in order for t in cta)
            assert all(c == 1 for c in got.values()), case_id(case)
            assert set(got) == valid_tiles(masked_m, max_m, n, tile_m, tile_n), case_id(case)
            plain = walk(*args, cluster_n=cluster_n, keep_clipped=True)
            balanced = walk(*args, cluster_n=cluster_n, keep_clipped=True, balance=True)
            units = sum(len(t) for t in plain[::cluster_n])
            clusters = grid // cluster_n
            if units == 0:
                continue
            rounds = cdiv(units, clusters)
            assert max(len(t) for t in balanced) == max(len(t) for t in plain) == rounds
            busy = sum(1 for t in balanced[::cluster_n] if t)
            last = units - (rounds - 1) * clusters
            if rounds > 1 and 2 * last <= clusters:
                # (with many rounds the spread can still need every cluster)
                assert busy == cdiv(units, rounds) <= clusters, case_id(case)
                triggered += busy < clusters
            else:
                assert busy == min(units, clusters), case_id(case)
    assert triggered >= 2  # the draw really exercises the cut (4-9 per chunk)


def test_rules_by_hand():
    # the integer rules the model and the walkers share
    assert [clamp_rows(m, 100) for m in (-3, 0, 1, 100, 101, 10**6)] == [0, 0, 1, 100, 100, 100]
    assert [n_groups(b, 2) for b in (0, 1, 2, 3, 56)] == [0, 1, 1, 2, 28]
    assert [n_groups(b, 1) for b in (0, 1, 7)] == [0, 1, 7]


def test_active_clusters_by_hand():
    assert active_clusters(280, 66) == 56  # fp8 dsv3-ep32-down: 4 full rounds + 16 -> 5 x 56
    assert active_clusters(192, 66) == 66  # last round 60 of 66: kept
    assert active_clusters(67, 66) == 34  # 66 + 1 -> 2 x 34 (33 + 34 units)
    assert active_clusters(99, 66) == 50  # last round 33: exactly half, cut
    assert active_clusters(100, 66) == 66  # 34: over half, kept
    assert active_clusters(10, 66) == 10  # one round: the same clusters work either way
    assert active_clusters(0, 66) == 0


# ---------------------------------------------------------------------------
# TileOrder.N_MAJOR: units numbered n-group first (NMajorTileScheduler)
# ---------------------------------------------------------------------------


class NMajorWalkerModel:
    """NMajorTileScheduler in plain integers, lane by lane: each step scans
    the experts in chunks of 32 "lanes" (inclusive prefix sums of their
    m-block counts) and takes the expert as the number of lanes whose prefix
    is <= r, as the device's ballot and popc do."""

    def __init__(self, masked_m, max_m, num_n_blocks, tile_m, block_idx, grid_size, cluster_n=1,
                 cta_rank=0, balance=False, window=0):
        self.masked_m, self.max_m, self.tile_m, self.window = masked_m, max_m, tile_m, window
        self.num_experts = len(masked_m)
        self.num_n_groups = cdiv(num_n_blocks, cluster_n)
        self.num_clusters = grid_size // cluster_n
        self.cluster_n, self.cta_rank = cluster_n, cta_rank
        self.linear_idx = block_idx // cluster_n
        lane_sums = [0] * 32  # lane l counts experts l, l + 32, ...
        for base in range(0, self.num_experts, 32):
            for lane, blocks in enumerate(self._lane_blocks(base)[1]):
                lane_sums[lane] += blocks
        self.m_total = sum(lane_sums)  # one warp reduction
        if balance:  # every role cuts its own grid
            active = active_clusters(self.m_total * self.num_n_groups, self.num_clusters)
            if self.linear_idx >= active:
                self.linear_idx = self.m_total * self.num_n_groups
            self.num_clusters = active

    def _lane_blocks(self, base):
        rows, blocks = [], []
        for lane in range(32):
            e = base + lane
            m = self.masked_m[min(e, self.num_experts - 1)]
            r = max(min(m, self.max_m), 0) if e < self.num_experts else 0
            rows.append(r)
            blocks.append((r + self.tile_m - 1) // self.tile_m)
        return rows, blocks

    def work(self):
        units = self.m_total * self.num_n_groups
        ok = self.linear_idx < units
        u = min(self.linear_idx, max(units - 1, 0))
        ng, w = self.num_n_groups, self.window
        n_group, r = (0, u) if w else divmod(u, max(self.m_total, 1))
        expert = m_block = rows = 0
        base, searching = 0, ok
        while searching:
            lane_rows, blocks = self._lane_blocks(base)
            incl = [sum(blocks[: lane + 1]) for lane in range(32)]
            chunk_units = incl[31] * ng if w else incl[31]
            if r < chunk_units:
                if w:  # popc(ballot(window-start lanes with units before them <= r))
                    excl = [x - b for x, b in zip(incl, blocks)]
                    first = (sum(1 for lane in range(0, 32, w) if excl[lane] * ng <= r) - 1) * w
                    before = excl[first]
                    n_group, rest = divmod(r - before * ng, incl[first + w - 1] - before)
                    r = before + rest
                e_in = sum(1 for x in incl if x <= r)  # popc(ballot(incl <= r))
                expert = base + e_in
                m_block = r - (incl[e_in] - blocks[e_in])
                rows = lane_rows[e_in]
                searching = False
            else:
                r -= chunk_units
                base += 32
                searching = base < self.num_experts
        valid_rows = min(rows - m_block * self.tile_m, self.tile_m)
        return expert, m_block, n_group * self.cluster_n + self.cta_rank, valid_rows, ok

    def advance(self):
        self.linear_idx += self.num_clusters


def walk_n_major(*args, **kw):
    return walk(*args, model=NMajorWalkerModel, **kw)


@pytest.mark.parametrize("chunk", range(4))
def test_n_major_walker_matches_tile_order(chunk):
    """Every valid tile once, in the model's n-group-major order, for plain,
    clustered and balanced grids (E up to 256: several 32-expert chunks)."""
    for case in CASES[chunk::4][:40]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        for cluster_n, balance in ((1, False), (2, False), (2, True)):
            grid = cluster_n * max(1, num_ctas // cluster_n)
            args = (masked_m, max_m, n, tile_m, tile_n, grid)
            order = tile_order(*args, cluster_n=cluster_n, balance=balance, n_major=True)
            assert walk_n_major(*args, cluster_n=cluster_n, balance=balance) == order, case_id(case)
            got = Counter(t for cta in order for t in cta)
            assert all(c == 1 for c in got.values()), case_id(case)
            assert set(got) == valid_tiles(masked_m, max_m, n, tile_m, tile_n), case_id(case)
        # the m-blocks of one (expert, n-block) are consecutive units, so
        # they go to neighbouring CTAs of one round
        plain = tile_order(masked_m, max_m, n, tile_m, tile_n, num_ctas, n_major=True)
        seq = [plain[i % num_ctas][i // num_ctas] for i in range(sum(map(len, plain)))]
        where = {t: i for i, t in enumerate(seq)}
        for (e, mb, nb), i in where.items():
            if mb:
                assert where[(e, mb - 1, nb)] == i - 1, case_id(case)


def test_n_major_order_by_hand():
    # e0: 1 m-block, e1: empty, e2: 2 m-blocks; 2 n-blocks; 3 CTAs.
    # n-group 0: (0,0) (2,0) (2,1), then n-group 1: the same
    order = tile_order([3, 0, 500], 130, 256, 128, 128, 3, n_major=True)
    assert order == [
        [(0, 0, 0), (0, 0, 1)],
        [(2, 0, 0), (2, 0, 1)],
        [(2, 1, 0), (2, 1, 1)],
    ]
    assert walk_n_major([3, 0, 500], 130, 256, 128, 128, 3) == order
    assert walk_n_major([0, -2, 0], 64, 128, 64, 64, 4) == [[], [], [], []]


def test_n_major_mixes_experts_in_every_round():
    """The point of the order, on fp8 dsv3-ep32-down's masked_m (seed 3 of
    the benchmark): expert-major rounds hold only single-m-block experts
    (rounds 0-2) or only paired ones (3-4); n-major rounds hold both."""
    masked_m = [89, 97, 111, 91, 125, 94, 148, 146]
    args = (masked_m, 4096, 7168, 128, 128, 132)
    for n_major, mixed in ((False, 0), (True, 5)):
        order = tile_order(*args, cluster_n=2, balance=True, n_major=n_major)
        rounds = list(zip(*[cta for cta in order[::2] if cta]))
        assert len(rounds) == 5
        paired = [{masked_m[e] > 128 for e, _, _ in r} for r in rounds]
        assert sum(p == {True, False} for p in paired) == mixed


@pytest.mark.parametrize("cluster_n", (1, 2))
def test_n_major_first_tile_guess(cluster_n):
    from flashgemm.schedule.nmajor import NMajorTileScheduler

    rng = random.Random(7 + cluster_n)
    for e_count, n in ((1, 120), (3, 7168), (8, 7168)):
        masked_m = [rng.randint(1, 64) for _ in range(e_count)]
        n_blocks = cdiv(n, 64)
        order = tile_order(masked_m, 1024, n, 64, 64, cluster_n * 66, cluster_n, n_major=True)
        for c in range(cluster_n * 66):
            expert, n_block, in_range = NMajorTileScheduler.first_tile_guess(
                c // cluster_n, c % cluster_n, n_blocks, e_count, cluster_n
            )
            assert bool(in_range) == bool(order[c]), (c, masked_m)
            if order[c]:
                assert (expert, 0, n_block) == order[c][0], (c, masked_m)


@pytest.mark.parametrize("window", (1, 2, 4, 8, 32))
def test_n_major_window_walker_matches_tile_order(window):
    """GemmConfig.n_major_window: every valid tile once, in the model's
    window-by-window order, for plain, clustered and balanced grids; every
    expert of a window is dealt before any unit of a later window."""
    for case in CASES[window % 4::4][:30]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        for cluster_n, balance in ((1, False), (2, False), (2, True)):
            grid = cluster_n * max(1, num_ctas // cluster_n)
            args = (masked_m, max_m, n, tile_m, tile_n, grid)
            order = tile_order(*args, cluster_n=cluster_n, balance=balance, n_major=True, window=window)
            got = walk_n_major(*args, cluster_n=cluster_n, balance=balance, window=window)
            assert got == order, case_id(case)
            tiles = Counter(t for cta in order for t in cta)
            assert all(c == 1 for c in tiles.values()), case_id(case)
            assert set(tiles) == valid_tiles(masked_m, max_m, n, tile_m, tile_n), case_id(case)
            clusters = order[::cluster_n]  # dealt round by round, cluster by cluster
            seq = [cta[i] for i in range(max(map(len, clusters), default=0)) for cta in clusters if i < len(cta)]
            windows = [e // window for e, _, _ in seq]
            assert windows == sorted(windows), case_id(case)
        if window == 1:  # one expert per window: the expert-major order itself
            assert order == tile_order(*args, cluster_n=2, balance=True), case_id(case)


def test_n_major_window_order_by_hand():
    # e0: 1 m-block, e1: empty, e2: 2 m-blocks, e3: 1; 2 n-blocks; windows of
    # 2: (e0, e1) by n-group, then (e2, e3) by n-group
    masked_m = [3, 0, 500, 7]
    order = tile_order(masked_m, 130, 256, 128, 128, 8, n_major=True, window=2)
    seq = [cta[0] for cta in order if cta]
    assert seq == [(0, 0, 0), (0, 0, 1), (2, 0, 0), (2, 1, 0), (3, 0, 0), (2, 0, 1), (2, 1, 1), (3, 0, 1)]
    assert walk_n_major(masked_m, 130, 256, 128, 128, 8, window=2) == order
    # an empty window is skipped
    assert walk_n_major([0, 0, 5, 9], 64, 128, 64, 64, 3, window=2) == tile_order(
        [0, 0, 5, 9], 64, 128, 64, 64, 3, n_major=True, window=2
    )


@pytest.mark.parametrize("cluster_n", (1, 2))
@pytest.mark.parametrize("window", (2, 4))
def test_n_major_window_first_tile_guess(cluster_n, window):
    from flashgemm.schedule.nmajor import NMajorTileScheduler

    rng = random.Random(11 + cluster_n + window)
    for e_count, n in ((1, 120), (3, 7168), (8, 7168), (16, 1536)):
        masked_m = [rng.randint(1, 64) for _ in range(e_count)]
        n_blocks = cdiv(n, 64)
        order = tile_order(masked_m, 1024, n, 64, 64, cluster_n * 66, cluster_n, n_major=True, window=window)
        for c in range(cluster_n * 66):
            expert, n_block, in_range = NMajorTileScheduler.first_tile_guess(
                c // cluster_n, c % cluster_n, n_blocks, e_count, cluster_n, window
            )
            assert bool(in_range) == bool(order[c]), (c, masked_m)
            if order[c]:
                assert (expert, 0, n_block) == order[c][0], (c, masked_m)


def test_walker_empty_experts_and_guard():
    # trailing and leading empty experts, values past max_m and negative
    masked_m = [0, -3, 10**6, 0, 0]
    assert walk(masked_m, 65, 136, 64, 64, 7) == tile_order(masked_m, 65, 136, 64, 64, 7)
    assert walk([0] * 5, 64, 128, 64, 128, 3) == [[], [], []]


# ---------------------------------------------------------------------------
# Tail.SPLIT: a last round at most half full runs in halves
# ---------------------------------------------------------------------------


class SplitWalkerModel(WalkerModel):
    """MaskedTileScheduler with ``split_from``: linear_idx is a virtual index;
    the unit and half come from the device's arithmetic (``_unit``, ``work``),
    not from ``split_unit``, which the model ``tile_order`` uses."""

    def __init__(self, masked_m, max_m, num_n_blocks, tile_m, block_idx, grid_size, cluster_n=1, cta_rank=0,
                 balance=False):
        assert not balance
        probe = WalkerModel(masked_m, max_m, num_n_blocks, tile_m, 0, grid_size, cluster_n, 0)
        units = sum(probe._tiles_of(e) for e in range(len(masked_m)))  # the warp's count
        self.split_from = tail_start(units, grid_size // cluster_n)
        super().__init__(masked_m, max_m, num_n_blocks, tile_m, block_idx, grid_size, cluster_n, cta_rank)

    def _unit(self):
        if not hasattr(self, "split_from"):  # (during WalkerModel.__init__'s first seek)
            raise AssertionError("split_from must be set before the first seek")
        past = max(self.linear_idx - self.split_from, 0)
        return self.linear_idx - (past - past // 2)

    def _seek(self):
        while self.expert < self.num_experts and self._unit() >= self.tiles_before + self.expert_tiles:
            self.tiles_before += self.expert_tiles
            self.expert += 1
            self.expert_tiles = self._tiles_of(self.expert)

    def work(self):
        saved = self.linear_idx
        self.linear_idx = self._unit()  # WalkerModel.work reads the unit from linear_idx
        e, mb, nb, valid_rows, ok = super().work()
        self.linear_idx = saved
        past = self.linear_idx - self.split_from
        return e, mb, nb, valid_rows, ok, (-1 if past < 0 else max(past, 0) % 2)


def walk_split(masked_m, max_m, n, tile_m, tile_n, num_ctas, cluster_n=1):
    n_blocks = cdiv(n, tile_n)
    per_cta = []
    for c in range(num_ctas):
        w = SplitWalkerModel(masked_m, max_m, n_blocks, tile_m, c, num_ctas, cluster_n, c % cluster_n)
        tiles = []
        e, mb, nb, valid_rows, ok, half = w.work()
        while ok:
            assert 1 <= valid_rows <= tile_m
            if nb < n_blocks:
                tiles.append((e, mb, nb, half))
            w.advance()
            e, mb, nb, valid_rows, ok, half = w.work()
        assert w.expert == len(masked_m)
        per_cta.append(tiles)
    return per_cta


def test_tail_start_by_hand():
    assert tail_start(272, 66) == 264  # bf16 dsv3-prefill-gate_up: 4 rounds + 8 -> 8 units in 16 halves
    assert tail_start(256, 66) == 256  # dense-like: last round 58 of 66, kept whole
    assert tail_start(99, 66) == 66  # 33: exactly half, split into 66 halves
    assert tail_start(100, 66) == 100  # 34: over half
    assert tail_start(132, 66) == 132  # full rounds
    assert tail_start(10, 66) == 0  # one small round: every unit in halves, 20 clusters busy
    assert tail_start(0, 66) == 0
    assert tail_start(1, 1) == 1  # one cluster: halves would only run one after the other
    assert [split_unit(v, 4) for v in range(4, 8)] == [(4, 0), (4, 1), (5, 0), (5, 1)]
    assert split_unit(3, 4) == (3, -1)


@pytest.mark.parametrize("chunk", range(4))
def test_split_walker_matches_tile_order_and_covers_every_row_once(chunk):
    """The walker's arithmetic is the model; each valid tile runs whole
    exactly once or as both of its halves; halves only in the last round,
    both halves of a unit on neighbouring clusters, and no cluster runs more
    units than the unsplit order's busiest."""
    triggered = 0
    for case in CASES[chunk::4][:80]:
        masked_m, max_m, n, tile_m, tile_n, num_ctas = case
        tile_m = 128  # two consumer warpgroups
        for cluster_n in (1, 2):
            grid = cluster_n * max(1, num_ctas // cluster_n)
            args = (masked_m, max_m, n, tile_m, tile_n, grid)
            order = tile_order(*args, cluster_n=cluster_n, split=True)
            assert walk_split(*args, cluster_n=cluster_n) == order, case_id(case)
            got = Counter(t for cta in order for t in cta)
            assert all(c == 1 for c in got.values()), case_id(case)
            whole = {t[:3] for t in got if t[3] == -1}
            halves = Counter(t[:3] for t in got if t[3] >= 0)
            assert not whole & set(halves) and all(c == 2 for c in halves.values()), case_id(case)
            assert {t[3] for t in got} <= {-1, 0, 1}
            assert whole | set(halves) == valid_tiles(masked_m, max_m, n, tile_m, tile_n), case_id(case)
            plain = tile_order(*args, cluster_n=cluster_n)
            assert max(map(len, order)) == max(map(len, plain)), case_id(case)
            if halves:
                triggered += 1
                rounds = max(map(len, order))
                for c, tiles in enumerate(order[::cluster_n]):  # rank 0: never clipped at N
                    c *= cluster_n
                    assert all(t[3] == -1 for t in tiles[: rounds - 1]), case_id(case)
                    if tiles and tiles[-1][3] >= 0:
                        # the other half on the neighbouring cluster, same tile
                        peer = order[c + cluster_n if tiles[-1][3] == 0 else c - cluster_n][-1]
                        assert peer[:3] == tiles[-1][:3] and peer[3] == 1 - tiles[-1][3], case_id(case)
    assert triggered >= 5


def test_split_order_by_hand():
    # e0: 3 rows (1 m-block), e2: 130 rows (2 m-blocks), 2 n-blocks each: 6
    # units on 4 CTAs; the last round (2 units) is half full: 4 halves
    order = tile_order([3, 0, 500], 130, 256, 128, 128, 4, split=True)
    assert order == [
        [(0, 0, 0, -1), (2, 0, 1, 0)],
        [(0, 0, 1, -1), (2, 0, 1, 1)],
        [(2, 0, 0, -1), (2, 1, 1, 0)],
        [(2, 1, 0, -1), (2, 1, 1, 1)],
    ]
    assert walk_split([3, 0, 500], 130, 256, 128, 128, 4) == order


# ---------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------


def direct_f64(a, b):
    """out[i, j] = sum_k a[i, k] * b[j, k], elementwise in float64."""
    return (a.double()[:, None, :] * b.double()[None, :, :]).sum(-1)


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64])
def test_reference_matches_direct(seed, acc_dtype):
    e_count, max_m, n, k = 5, 12, 24, 40
    a = torch.randn(e_count, max_m, k).to(torch.bfloat16)
    b = torch.randn(e_count, n, k).to(torch.bfloat16)
    out = torch.randn(e_count, max_m, n).to(torch.bfloat16)
    out_before = out.clone()
    masked_m = torch.tensor([0, 5, max_m, -4, max_m + 9], dtype=torch.int32)
    ref = grouped_gemm_nt_masked_ref(a, b, masked_m, out, acc_dtype=acc_dtype)
    assert ref.dtype == acc_dtype and ref.shape == (e_count, max_m, n)
    assert torch.equal(out, out_before)  # the given out is not modified
    tol = 1e-12 if acc_dtype == torch.float64 else 1e-4
    for e, m in enumerate([0, 5, max_m, 0, max_m]):  # clamped rows
        if m:
            want = direct_f64(a[e, :m], b[e])
            torch.testing.assert_close(ref[e, :m].double(), want, rtol=tol, atol=tol)
        # rows >= m_e are the given out's rows, bit for bit (bf16 -> acc is exact)
        assert torch.equal(ref[e, m:], out[e, m:].to(acc_dtype))
    # a negative count computes nothing; a count past max_m computes every row
    assert torch.equal(ref[3], out[3].to(acc_dtype))
    assert not torch.equal(ref[4], out[4].to(acc_dtype))


def test_reference_without_out_zero_fills(seed):
    a = torch.randn(3, 8, 16).to(torch.bfloat16)
    b = torch.randn(3, 16, 16).to(torch.bfloat16)
    masked_m = torch.tensor([3, 0, 100], dtype=torch.int32)
    ref = grouped_gemm_nt_masked_ref(a, b, masked_m)
    assert ref.dtype == torch.float32
    assert torch.count_nonzero(ref[0, 3:]) == 0 and torch.count_nonzero(ref[1]) == 0
    torch.testing.assert_close(ref[0, :3].double(), direct_f64(a[0, :3], b[0]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref[2].double(), direct_f64(a[2], b[2]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cluster_n", (1, 2))
@pytest.mark.parametrize("n", (120, 7168))
def test_first_tile_guess_is_the_first_tile_when_every_expert_fits_one_m_block(cluster_n, n):
    """The kernel's L2 warm-up guesses each CTA's first tile without masked_m
    (MaskedTileScheduler.first_tile_guess, plain integer arithmetic, so it runs
    here on ints). With every expert holding 1..tile_m rows the guess must be
    the model's first tile for every CTA, and in range exactly when the CTA
    has a first tile."""
    from flashgemm.schedule.walker import MaskedTileScheduler

    rng = random.Random(n * 10 + cluster_n)
    tile_m, tile_n = 64, 64
    for e_count in (1, 3, 8):
        masked_m = [rng.randint(1, tile_m) for _ in range(e_count)]
        n_blocks = cdiv(n, tile_n)
        num_ctas = cluster_n * 66
        order = tile_order(masked_m, 1024, n, tile_m, tile_n, num_ctas, cluster_n)
        for c in range(num_ctas):
            expert, n_block, in_range = MaskedTileScheduler.first_tile_guess(
                c // cluster_n, c % cluster_n, n_blocks, e_count, cluster_n
            )
            assert bool(in_range) == bool(order[c]), (c, masked_m)
            if order[c]:
                assert (expert, 0, n_block) == order[c][0], (c, masked_m)
