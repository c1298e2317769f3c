"""GPU tests of ``Tail.SPLIT`` (skipped without sm_90).

Every role of every CTA counts the launch's units from masked_m and finds
the same last round; there each unit runs as two half units on two clusters,
one consumer warpgroup computing and storing its 64 rows while the other only
waits for and releases the slots. A disagreement would hang the CTA, store a
half twice or never, or let one half's store run over the other's rows. Each
case is chosen, with the scheduler's model, so that halves really run (among
them halves of partial m-blocks and of tiles past N), and checked against
the reference on poisoned output, and across graph replays whose masked_m
switches the split on and off.
"""

import pytest
import torch

import flashgemm
from flashgemm.config import Promotion, Tail
from flashgemm.schedule.model import tile_order
from flashgemm.sm90.heuristic import FP8_PREFILL_CONFIG, MID_CONFIG, PREFILL_CONFIG

from conftest import capture_graph, requires_hopper
from test_gpu_balance import replay_with_draws
from test_gpu_fp8 import _check as _check_fp8
from test_gpu_fp8 import _fp8_case
from test_gpu_fp8 import _poisoned_out as _poisoned_out_fp8
from test_gpu_gemm import _check, _poisoned_out, _random_case


pytestmark = requires_hopper

MID_SPLIT = MID_CONFIG.replace(tail=Tail.SPLIT)


def _half_tiles(cfg, masked, max_m, n, num_sms):
    """Half tiles the launch runs (the model's count, on the launcher's grid)."""
    clusters = cfg.grid_clusters(len(masked), max_m, n, num_sms)
    order = tile_order(masked, max_m, n, cfg.tile_m, cfg.tile_n, clusters * cfg.cluster_n, cfg.cluster_n,
                       split=True)
    return sum(1 for tiles in order for t in tiles if t[3] >= 0)


# (config, E, max_m, N, K, masked_m, num_sms): every row runs half tiles
BF16_CASES = [
    # 6 m-blocks x 3 n-groups (N 1032: the last n-block 8 wide, its pair past N)
    # = 18 units on 12 clusters: the last 6 as 12 halves
    (PREFILL_CONFIG, 3, 384, 1032, 256, [384, 100, 200], 24),
    # 15 units on 12 clusters; the last is a 1-row m-block: its lower half is empty
    (PREFILL_CONFIG, 3, 384, 1032, 256, [300, 0, 129], 24),
    # 2 units, every one split: the grid doubles to 4 clusters for them
    (PREFILL_CONFIG, 2, 128, 512, 512, [50, 70], 132),
    # 16 units (N 776: 3 full n-blocks and 8 columns) on 12 CTAs: the last 4 as 8 halves
    (PREFILL_CONFIG.replace(cluster_n=1), 3, 384, 776, 320, [384, 65, 0], 12),
    (MID_SPLIT, 5, 384, 1032, 256, [384, 130, 129, 200, 1], 44),
]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: f"{c[0].short_name()}-E{c[1]}-sms{c[6]}")
def test_bf16_split_last_round_matches_reference(case, seed):
    cfg, e_count, max_m, n, k, masked, num_sms = case
    assert _half_tiles(cfg, masked, max_m, n, num_sms) > 0, "the case must run half tiles"
    a, b, masked_m = _random_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg, num_sms=num_sms)
    _check(a, b, masked_m, out, buf)


@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize(
    "tile", [(192, False), (128, True)], ids=["n192", "n128-po"]
)  # the heuristic's prefill tile, and the 128-wide one with two product sets
def test_fp8_split_last_round_matches_reference(cluster_n, tile, seed):
    tile_n, overlap = tile
    cfg = FP8_PREFILL_CONFIG.replace(
        cluster_n=cluster_n, tile_n=tile_n,
        promotion=Promotion.OVERLAPPED if overlap else FP8_PREFILL_CONFIG.promotion,
    )
    assert cfg.tail is Tail.SPLIT
    # 8 m-blocks; N 528: 128-wide n-blocks 5 (one partial), 192-wide 3 (the
    # last 144 wide; the tiles straddle scale blocks at columns 128 and 64);
    # K 2880: a partial scale block. The grid is the first, from 18 clusters
    # down, whose last round is at most half full, so it runs half tiles.
    e_count, max_m, n, k = 4, 300, 528, 2880
    masked = [300, 129, 0, 257]
    num_sms = next(
        c * cluster_n for c in range(18, 2, -1) if _half_tiles(cfg, masked, max_m, n, c * cluster_n) > 0
    )
    a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out_fp8(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=cfg, num_sms=num_sms
    )
    _check_fp8(a, a_scale, b, b_scale, masked_m, out, buf)


def test_heuristic_prefill_call_splits(seed):
    """The heuristic's own prefill pick on a case whose last round it splits."""
    # 9 m-blocks x 4 n-groups = 36 units on 17 clusters: the last 2 split
    e_count, max_m, n, k, masked, num_sms = 3, 512, 2048, 256, [512, 300, 130], 34
    cfg = flashgemm.choose_config(400, max_m, n, k, num_sms, num_experts=e_count)
    assert cfg.tail is Tail.SPLIT and _half_tiles(cfg, masked, max_m, n, num_sms) > 0
    a, b, masked_m = _random_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=400, num_sms=num_sms)
    _check(a, b, masked_m, out, buf)


def test_graph_replays_switch_the_split_with_masked_m(seed):
    """One captured launch replayed with new masked_m: the units are counted
    on the device each time, so the split comes and goes with the data."""
    cfg, e_count, max_m, n, k, num_sms = PREFILL_CONFIG, 3, 384, 1032, 256, 24
    draws = [[384, 100, 200], [384, 384, 384], [0, 0, 0], [1, 1, 1], [300, 0, 129], [384, 256, 129]]
    halves = [_half_tiles(cfg, m, max_m, n, num_sms) for m in draws]
    assert halves[0] > 0 and halves[-1] == 0  # (the last draw, 21 units on 12: over half)
    a, b, masked_m = _random_case(e_count, max_m, n, k, draws[-1])
    buf, out = _poisoned_out(e_count, max_m, n)
    graph = capture_graph(
        lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg, num_sms=num_sms), calls=1
    )
    replay_with_draws(graph, draws, a, b, masked_m, buf, out)
