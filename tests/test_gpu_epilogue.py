"""GPU tests of the epilogue's two staging modes (skipped without sm_90).

``Staging.WHOLE_TILE`` stages a full tile's every sub-tile before the
store warp issues the bulk stores, and the store warp waits for those stores
to have read the staging area before the next tile, full or partial (a
partial tile reuses buffer 0), is staged. A mistake there shows only when one
CTA runs many tiles back to back: a store reading a buffer the next tile is
already writing, or a barrier the two sides count differently (a hang). So
every case runs on a few SMs, with experts whose last m-block is partial
between full ones, on poisoned output.
"""

import pytest
import torch

import flashgemm
from flashgemm.config import GemmConfig, Promotion, Staging, Tail
from flashgemm.formats import Format
from flashgemm.sm90.heuristic import FP8_PREFILL_CONFIG, PREFILL_CONFIG

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

BF16, FP8 = Format.BF16, Format.FP8_BLOCK128
BF16_TILES = [
    GemmConfig(tile_m=128, tile_n=256, cluster_n=2),
    GemmConfig(tile_m=128, tile_n=128, cluster_n=1),
    GemmConfig(tile_m=64, tile_n=64, cluster_n=2),
]
FP8_TILES = [
    FP8_PREFILL_CONFIG.replace(tail=Tail.NONE),  # 128x192, straddles scale blocks
    FP8_PREFILL_CONFIG.replace(tail=Tail.NONE, tile_n=128, promotion=Promotion.OVERLAPPED, cluster_n=1),
]


def _whole(cfg):
    return cfg.replace(staging=Staging.WHOLE_TILE)


def _run_and_check(cfg, operands, e_count, max_m, n, k, masked, num_sms, **signals):
    """One call on fresh operands (fp8 or bf16) into poisoned output,
    checked against the reference."""
    if operands is FP8:
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
    _run_and_check(cfg, BF16, len(MASKED), MAX_M, 776, 256, MASKED, num_sms)


@pytest.mark.parametrize("num_sms", [4, 132])
@pytest.mark.parametrize("cfg", [_whole(c) for c in FP8_TILES], ids=lambda c: c.short_name())
def test_fp8_whole_tile_staging(cfg, num_sms, seed):
    # N 528: 192-wide tiles straddle weight-scale blocks at columns 128 and 64
    _run_and_check(cfg, FP8, len(MASKED), MAX_M, 528, 640, MASKED, num_sms)


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
@pytest.mark.parametrize(
    "cfg, operands", [(_whole(BF16_TILES[0]), BF16), (_whole(FP8_TILES[0]), FP8)],
    ids=lambda c: c.short_name() if isinstance(c, GemmConfig) else c.value,
)
def test_whole_tile_staging_signals(cfg, operands, granularity, seed):
    """Signals count each tile once its stores are complete: the full tiles'
    bulk stores now leave in one group per tile."""
    e_count, n, k = len(MASKED), 776 if operands is BF16 else 528, 256
    layout = flashgemm.signal_layout(
        e_count, MAX_M, n, k, config=cfg, num_sms=4, signal_granularity=granularity,
        fp8=operands is FP8,
    )
    sig = flashgemm.alloc_signals(layout, "cuda")
    masked_m = _run_and_check(
        cfg, operands, e_count, MAX_M, n, k, MASKED, 4, dst_signals=sig, signal_granularity=granularity
    )
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), MAX_M))


@pytest.mark.parametrize(
    "cfg, operands", [(_whole(PREFILL_CONFIG), BF16), (_whole(FP8_PREFILL_CONFIG), FP8)],
    ids=lambda c: c.short_name() if isinstance(c, GemmConfig) else c.value,
)
def test_whole_tile_staging_with_split_halves(cfg, operands, seed):
    """Half units (Tail.SPLIT) store like partial tiles, after full
    ones on the same CTA: 6 m-blocks x 2 n-groups = 12 units on 8 clusters,
    the last 4 as 8 halves."""
    assert cfg.tail is Tail.SPLIT
    n, masked = 2 * cfg.cluster_n * cfg.tile_n, [256, 256, 200]
    assert _half_tiles(cfg, masked, 256, n, 16) > 0, "the case must run half tiles"
    _run_and_check(cfg, operands, 3, 256, n, 384, masked, 16)
