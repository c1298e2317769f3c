"""GPU tests of ``TileOrder.N_MAJOR`` and ``n_major_window`` (skipped without sm_90).

Every role of every CTA finds its tiles in the n-group-major order by a warp
scan over masked_m, 32 experts at a time; roles that disagreed would hang or
compute a tile twice or never. The cases cover one and several 32-expert
chunks, empty and over-full experts, partial tiles in M and N, clusters of
one and two, balanced rounds, signals, and graph replays
whose masked_m changes the m-block count between replays.
"""

import pytest
import torch

import flashgemm
from flashgemm.config import Tail, TileOrder
from flashgemm.sm90.heuristic import (
    DECODE_128_CONFIG, DECODE_CONFIG, FP8_MID_CONFIG, FP8_MID_N64_CONFIG, MID_CONFIG,
)

from conftest import capture_graph, requires_hopper
from test_gpu_fp8 import _check as _check_fp8
from test_gpu_fp8 import _fp8_case
from test_gpu_fp8 import _poisoned_out as _poisoned_out_fp8
from test_gpu_balance import replay_with_draws
from test_gpu_gemm import _check, _poisoned_out, _random_case


pytestmark = requires_hopper


def _nm(cfg, **kw):
    """The n-major order (in place of DECODE_CONFIG's dynamic one: the order
    is one field, so the dynamic n-major builds of old are gone)."""
    return cfg.replace(order=TileOrder.N_MAJOR, **kw)


BF16_CONFIGS = [
    _nm(MID_CONFIG),  # balanced, clusters of 2
    _nm(MID_CONFIG, tail=Tail.NONE, cluster_n=1),
    _nm(DECODE_128_CONFIG),
    _nm(DECODE_CONFIG),  # one consumer warpgroup
    # n_major_window: windows of 1 (the expert-major order, as calls with
    # signals run it), of 2 (the first one empty: experts 0 and 1 hold no
    # rows), of 8 (E = 70: a short last window) and of 32 (one per chunk)
    _nm(MID_CONFIG, n_major_window=1),
    _nm(MID_CONFIG, n_major_window=2),
    _nm(DECODE_CONFIG, n_major_window=8),
    _nm(MID_CONFIG, tail=Tail.NONE, cluster_n=1, n_major_window=32),
]


def _masked(e_count, max_m, gen):
    """Mostly 1..2 m-blocks, with empty, negative and over-full experts."""
    masked = torch.randint(1, max_m + 1, (e_count,), generator=gen).tolist()
    for i in range(0, e_count, 5):
        masked[i] = 0
    masked[1] = -4
    masked[-1] = 10 * max_m
    return masked


# (E, max_m, N, K, num_sms): E = 7 (one chunk of 32), 40 and 70 (two and three)
SHAPES = [(7, 200, 328, 192, None), (40, 160, 264, 128, None), (70, 96, 136, 64, 10)]


@pytest.mark.parametrize("config", BF16_CONFIGS, ids=lambda c: c.short_name())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}")
def test_bf16_matches_reference(config, shape, seed):
    e_count, max_m, n, k, num_sms = shape
    gen = torch.Generator().manual_seed(seed)
    a, b, masked_m = _random_case(e_count, max_m, n, k, _masked(e_count, max_m, gen))
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config, num_sms=num_sms)
    _check(a, b, masked_m, out, buf)


@pytest.mark.parametrize("config", [FP8_MID_CONFIG, FP8_MID_N64_CONFIG, _nm(FP8_MID_CONFIG, n_major_window=1),
                                    _nm(FP8_MID_CONFIG, n_major_window=2),
                                    _nm(FP8_MID_N64_CONFIG, n_major_window=4)], ids=lambda c: c.short_name())
@pytest.mark.parametrize("e_count", [6, 37])
def test_fp8_matches_reference(config, e_count, seed):
    max_m, n, k = 300, 528, 2880  # 528: five 128-wide n-blocks, one partial
    gen = torch.Generator().manual_seed(seed)
    masked = _masked(e_count, max_m, gen)
    a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out_fp8(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=config)
    _check_fp8(a, a_scale, b, b_scale, masked_m, out, buf)


@pytest.mark.parametrize("window", [0, 1, 2])
@pytest.mark.parametrize("granularity", ["m_block", "expert"])
def test_signals_count_every_tile_once(granularity, window, seed):
    e_count, max_m, n, k = 40, 200, 392, 128
    config = _nm(MID_CONFIG, n_major_window=window)
    gen = torch.Generator().manual_seed(seed)
    a, b, masked_m = _random_case(e_count, max_m, n, k, _masked(e_count, max_m, gen))
    layout = flashgemm.signal_layout(e_count, max_m, n, k, config=config, signal_granularity=granularity)
    sig = flashgemm.alloc_signals(layout, "cuda")
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, config=config, dst_signals=sig, signal_granularity=granularity
    )
    _check(a, b, masked_m, out, buf)
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), max_m))


@pytest.mark.parametrize("window", [0, 1, 2])
def test_graph_replays_with_new_m_block_counts(window, seed):
    """One captured launch replayed with masked_m whose m-block count M (the
    order's period) changes: it is counted on the device each time."""
    config, e_count, max_m, n, k = _nm(MID_CONFIG, n_major_window=window), 5, 384, 1032, 256
    draws = [[384, 130, 129, 200, 1], [1, 1, 1, 1, 0], [384] * 5, [0] * 5, [1, 2, 3, 129, 0]]
    a, b, masked_m = _random_case(e_count, max_m, n, k, draws[-1])
    buf, out = _poisoned_out(e_count, max_m, n)
    graph = capture_graph(lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config), calls=1)
    replay_with_draws(graph, draws, a, b, masked_m, buf, out)
