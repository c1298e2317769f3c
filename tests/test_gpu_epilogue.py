"""GPU tests of the epilogue's two staging modes (skipped without sm_90).

``GemmConfig.epi_whole_tile`` stages a full tile's every sub-tile before the
store warp issues the bulk stores, and the store warp waits for those stores
to have read the staging area before the next tile, full or partial (a
partial tile reuses buffer 0), is staged. A mistake there shows only when one
CTA runs many tiles back to back: a store reading a buffer the next tile is
already writing, or a barrier the two sides count differently (a hang). So
every case runs on a few SMs, with experts whose last m-block is partial
between full ones, on poisoned output.
"""

import dataclasses

import pytest
import torch

import flashgemm
from flashgemm.config import FP8_PREFILL_CONFIG, PREFILL_CONFIG, GemmConfig

from conftest import requires_hopper
from test_gpu_fp8 import _check as _check_fp8
from test_gpu_fp8 import _fp8_case
from test_gpu_fp8 import _poisoned_out as _poisoned_out_fp8
from test_gpu_gemm import _check, _poisoned_out, _random_case
from test_gpu_split import _half_tiles

pytestmark = requires_hopper

# full, partial, empty, clamped and one-row experts: on 4 SMs each CTA runs
# full and partial tiles in turn
MASKED = [256, 200, 0, 129, 1000, 1, 256, 70]
MAX_M = 256

BF16_TILES = [
    GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, cluster_n=2),
    GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, cluster_n=1),
    GemmConfig(tile_m=64, tile_n=64, consumer_warpgroups=1, cluster_n=2),
]
FP8_TILES = [
    dataclasses.replace(FP8_PREFILL_CONFIG, split_last_round=False),  # 128x192, straddles scale blocks
    dataclasses.replace(FP8_PREFILL_CONFIG, split_last_round=False, tile_n=128, promote_overlap=True,
                        promote_parts=1,
                        cluster_n=1),
]


def _whole(cfg):
    return dataclasses.replace(cfg, epi_whole_tile=True)


def _run_and_check(cfg, e_count, max_m, n, k, masked, num_sms, **signals):
    """One call on fresh operands (fp8 for 128-deep configs) into poisoned
    output, checked against the reference."""
    if cfg.tile_k == 128:
        a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, max_m, n, k, masked)
        buf, out = _poisoned_out_fp8(e_count, max_m, n)
    else:
        a, b, masked_m = _random_case(e_count, max_m, n, k, masked)
        a_scale = b_scale = None
        buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=cfg, num_sms=num_sms, **signals
    )
    if a_scale is None:
        _check(a, b, masked_m, out, buf)
    else:
        _check_fp8(a, a_scale, b, b_scale, masked_m, out, buf)
    return masked_m


@pytest.mark.parametrize("num_sms", [4, 132])
@pytest.mark.parametrize("cfg", [_whole(c) for c in BF16_TILES], ids=lambda c: c.short_name())
def test_bf16_whole_tile_staging(cfg, num_sms, seed):
    # N 776: a last n-block of 8 columns (with 256-wide pairs, one past N)
    _run_and_check(cfg, len(MASKED), MAX_M, 776, 256, MASKED, num_sms)


@pytest.mark.parametrize("num_sms", [4, 132])
@pytest.mark.parametrize("cfg", [_whole(c) for c in FP8_TILES], ids=lambda c: c.short_name())
def test_fp8_whole_tile_staging(cfg, num_sms, seed):
    # N 528: 192-wide tiles straddle weight-scale blocks at columns 128 and 64
    _run_and_check(cfg, len(MASKED), MAX_M, 528, 640, MASKED, num_sms)


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
@pytest.mark.parametrize(
    "cfg", [_whole(BF16_TILES[0]), _whole(FP8_TILES[0])], ids=lambda c: c.short_name()
)
def test_whole_tile_staging_signals(cfg, granularity, seed):
    """Signals count each tile once its stores are complete: the full tiles'
    bulk stores now leave in one group per tile."""
    e_count, n, k = len(MASKED), 776 if cfg.tile_k == 64 else 528, 256
    layout = flashgemm.signal_layout(
        e_count, MAX_M, n, k, config=cfg, num_sms=4, signal_granularity=granularity,
        fp8=cfg.tile_k == 128,
    )
    sig = flashgemm.alloc_signals(layout, "cuda")
    masked_m = _run_and_check(
        cfg, e_count, MAX_M, n, k, MASKED, 4, dst_signals=sig, signal_granularity=granularity
    )
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), MAX_M))


@pytest.mark.parametrize(
    "cfg", [_whole(PREFILL_CONFIG), _whole(FP8_PREFILL_CONFIG)], ids=lambda c: c.short_name()
)
def test_whole_tile_staging_with_split_halves(cfg, seed):
    """Half units (split_last_round) store like partial tiles, after full
    ones on the same CTA: 6 m-blocks x 2 n-groups = 12 units on 8 clusters,
    the last 4 as 8 halves."""
    n, masked = 2 * cfg.cluster_n * cfg.tile_n, [256, 256, 200]
    assert _half_tiles(cfg, masked, 256, n, 16) > 0, "the case must run half tiles"
    _run_and_check(cfg, 3, 256, n, 384, masked, 16)
