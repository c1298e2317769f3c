"""Pure-Python model of the device tile order: the list of tiles each CTA
computes. The tests check the kernel's invariants (every valid tile exactly
once, nothing past m_e, clusters in step) against it."""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

from .rules import active_clusters, clamp_rows, split_unit, tail_start


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
    """The (expert, m_block, n_block) list of each CTA.

    With ``cluster_n`` > 1, ``num_ctas`` must be a multiple of it; tiles whose
    n-block lies past N (computed, never stored) are left out. ``balance``:
    ``Tail.BALANCE``; ``n_major``: ``TileOrder.N_MAJOR`` (units numbered
    n-group first); ``split``: ``Tail.SPLIT``, and the tiles are then
    (expert, m_block, n_block, half), half -1 for a whole tile, 0 or 1 for
    the upper or lower 64 rows. ``window``: ``GemmConfig.n_major_window``.
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
