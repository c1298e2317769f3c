"""GPU tests of ``Tail.BALANCE`` (skipped without sm_90).

The producer warp of every CTA counts the launch's units from masked_m and
publishes the active cluster count to the store warp and the consumers; a
disagreement would hang the CTA or compute a tile twice or never. Each case
here is chosen, with the scheduler's model, so that the cut really applies
(fewer clusters than launched take units), and checked against the reference
on poisoned output, through the signals, and across graph replays whose
masked_m switches the cut on and off.
"""

import pytest
import torch

import flashgemm
from flashgemm.config import Tail
from flashgemm.schedule.rules import active_clusters, clamp_rows
from flashgemm.sm90.heuristic import FP8_MID_CONFIG, FP8_MID_N64_CONFIG, MID_192_CONFIG, MID_CONFIG

from conftest import capture_graph, requires_hopper
from test_gpu_fp8 import _check as _check_fp8
from test_gpu_fp8 import _fp8_case
from test_gpu_fp8 import _poisoned_out as _poisoned_out_fp8
from test_gpu_gemm import POISON, _check, _poisoned_out, _random_case


pytestmark = requires_hopper


def _bal(cfg):
    """The heuristic balances only its 128x128 tiles; any static tile can."""
    return cfg.replace(tail=Tail.BALANCE)


def _clusters(cfg, masked, max_m, n, num_sms):
    """(clusters launched, clusters that take units) for one call, from the
    launcher's grid rule and the scheduler's model."""
    units = sum(-(-clamp_rows(m, max_m) // cfg.tile_m) for m in masked) * cfg.n_groups(n)
    launched = cfg.grid_clusters(len(masked), max_m, n, num_sms)
    return launched, active_clusters(units, launched)


# (config, E, max_m, N, K, masked_m, num_sms): every row cuts the grid
BF16_CASES = [
    # 9 m-blocks x 5 n-groups = 45 units on 22 clusters: 2 rounds + 1 -> 3 x 15
    (MID_CONFIG, 5, 384, 1032, 256, [384, 130, 129, 200, 1], 44),
    (MID_CONFIG, 3, 256, 256, 512, [256, 256, 129], 8),  # 6 units on 4 clusters -> 2 x 3
    (_bal(MID_192_CONFIG), 4, 400, 520, 192, [400, 193, 0, 17], 24),  # 30 units on 12 -> 3 x 10
    (MID_CONFIG.replace(cluster_n=1), 2, 300, 136, 128, [300, 129], 8),
]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: f"{c[0].short_name()}-E{c[1]}-sms{c[6]}")
def test_bf16_cut_grid_matches_reference(case, seed):
    cfg, e_count, max_m, n, k, masked, num_sms = case
    launched, active = _clusters(cfg, masked, max_m, n, num_sms)
    assert active < launched, "the case must exercise the cut"
    a, b, masked_m = _random_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg, num_sms=num_sms)
    _check(a, b, masked_m, out, buf)


@pytest.mark.parametrize("cfg", [FP8_MID_CONFIG, _bal(FP8_MID_N64_CONFIG)], ids=lambda c: c.short_name())
def test_fp8_cut_grid_matches_reference(cfg, seed):
    e_count, max_m, n, k = 6, 300, 528, 2880  # 528: five 128-wide n-blocks, one partial
    masked = [0, 300, 129, 64, 1, 257]
    num_sms = 14 if cfg.tile_n == 128 else 30
    launched, active = _clusters(cfg, masked, max_m, n, num_sms)
    assert active < launched, "the case must exercise the cut"
    a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out_fp8(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=cfg, num_sms=num_sms
    )
    _check_fp8(a, a_scale, b, b_scale, masked_m, out, buf)


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
def test_signals_count_every_tile_once_with_a_cut(granularity, seed):
    cfg, e_count, max_m, n, k, masked, num_sms = BF16_CASES[0]
    launched, active = _clusters(cfg, masked, max_m, n, num_sms)
    assert active < launched, "the case must exercise the cut"
    a, b, masked_m = _random_case(e_count, max_m, n, k, masked)
    layout = flashgemm.signal_layout(e_count, max_m, n, k, config=cfg, signal_granularity=granularity)
    sig = flashgemm.alloc_signals(layout, "cuda")
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, config=cfg, num_sms=num_sms, dst_signals=sig, signal_granularity=granularity
    )
    _check(a, b, masked_m, out, buf)
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), max_m))


def test_graph_replays_switch_the_cut_with_masked_m(seed):
    """One captured launch replayed with new masked_m: the count is made on
    the device each time, so the cut comes and goes with the data."""
    cfg, e_count, max_m, n, k, num_sms = MID_CONFIG, 5, 384, 1032, 256, 44
    draws = [[384, 130, 129, 200, 1], [1, 1, 1, 1, 0], [384, 384, 384, 384, 384], [0, 0, 0, 0, 0], [1, 2, 3, 129, 0]]
    cuts = [_clusters(cfg, m, max_m, n, num_sms) for m in draws]
    assert any(a < g for g, a in cuts) and any(a == g for g, a in cuts)
    a, b, masked_m = _random_case(e_count, max_m, n, k, draws[-1])
    buf, out = _poisoned_out(e_count, max_m, n)
    graph = capture_graph(
        lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg, num_sms=num_sms), calls=1
    )
    replay_with_draws(graph, draws, a, b, masked_m, buf, out)


def replay_with_draws(graph, draws, a, b, masked_m, buf, out):
    """Replay ``graph`` once per masked_m of ``draws``, with new activations
    and re-poisoned output each time, and check every replay."""
    for masked in draws:
        a.copy_(torch.randn_like(a))
        masked_m.copy_(torch.tensor(masked, dtype=torch.int32))
        buf.fill_(POISON)
        graph.replay()
        _check(a, b, masked_m, out, buf)
