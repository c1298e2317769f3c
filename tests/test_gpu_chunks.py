"""GPU tests of ``GemmConfig.a_chunk_rows`` (skipped without sm_90).

The producer loads A in chunks of rows and skips the chunks of a partial
m-block that hold no valid row; each slot's barrier then expects only the
bytes of the chunks both CTAs of a cluster really load. A wrong count hangs
the launch or lets the wgmma read a slot before it is full; a wrong chunk
leaves rows of A missing. The skipped rows keep whatever an earlier tile left
in the slot, which may only reach output rows past m_e (never stored).

Every case sets the rows of A past m_e (and, for fp8, their scales) to NaN,
so a junk row that leaks into a valid one shows, and puts m_e on and around
the chunk edges, including a last m-block cut by max_m (200 rows: its third
chunk runs past the tensor). Outputs are poisoned first and compared with
the reference.
"""

import pytest
import torch

import flashgemm
from flashgemm.config import TileOrder
from flashgemm.sm90.heuristic import (
    DECODE_128_CONFIG, DECODE_CONFIG, FP8_DECODE_CONFIG, FP8_MID_CONFIG, FP8_MID_N64_CONFIG, MID_192_CONFIG,
    MID_CONFIG, choose_config,
)

from conftest import requires_hopper
from test_gpu_fp8 import _check as _check_fp8
from test_gpu_fp8 import _fp8_case
from test_gpu_fp8 import _poisoned_out as _poisoned_out_fp8
from test_gpu_gemm import _check, _poisoned_out, _random_case

pytestmark = requires_hopper

# m_e around 32-row and 16-row chunk edges, within one and two m-blocks,
# empty, negative and past max_m
MASKED = [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 160, 191, 192, 193, 200, 500, -3]
MAX_M = 200


def _junk_past_m(a, masked, a_scale=None):
    """NaN in every row past m_e: a leak into a valid row cannot pass."""
    for e, m in enumerate(masked):
        m = min(max(m, 0), a.shape[1])
        a[e, m:] = float("nan")
        if a_scale is not None:
            a_scale[e, m:] = float("nan")


BF16_CONFIGS = [
    DECODE_CONFIG,  # 64 rows, 2-CTA cluster: one 32-row chunk per CTA
    DECODE_CONFIG.replace(cluster_n=1),  # two chunks on one CTA
    DECODE_128_CONFIG,  # two per CTA
    DECODE_128_CONFIG.replace(a_chunk_rows=16),  # four per CTA
    MID_192_CONFIG,  # three per CTA, three consumer warpgroups
    MID_CONFIG.replace(cluster_n=1),  # four on one CTA, balanced rounds
    DECODE_128_CONFIG.replace(a_chunk_rows=64),  # one per CTA
]


@pytest.mark.parametrize("cfg", BF16_CONFIGS, ids=lambda c: c.short_name())
def test_bf16_chunked_a_matches_reference(cfg, seed):
    e_count, n, k = len(MASKED), 320, 448  # N: a partial n-block (and odd n-group count for 64)
    a, b, masked_m = _random_case(e_count, MAX_M, n, k, MASKED)
    _junk_past_m(a, MASKED)
    buf, out = _poisoned_out(e_count, MAX_M, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg)
    _check(a, b, masked_m, out, buf)


FP8_CONFIGS = [
    FP8_DECODE_CONFIG,
    FP8_DECODE_CONFIG.replace(a_chunk_rows=16),
    FP8_MID_CONFIG,  # n-group-major, two product sets
    FP8_MID_CONFIG.replace(order=TileOrder.EXPERT_MAJOR, cluster_n=1),
    FP8_MID_N64_CONFIG,
]


@pytest.mark.parametrize("cfg", FP8_CONFIGS, ids=lambda c: c.short_name())
def test_fp8_chunked_a_matches_reference(cfg, seed):
    e_count, n, k = len(MASKED), 384, 640
    a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, MAX_M, n, k, MASKED)
    _junk_past_m(a, MASKED, a_scale)
    buf, out = _poisoned_out_fp8(e_count, MAX_M, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=cfg)
    _check_fp8(a, a_scale, b, b_scale, masked_m, out, buf)


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
@pytest.mark.parametrize("fp8", [False, True])
def test_chunked_a_with_signals(granularity, fp8, seed):
    """The heuristic's chunked decode tiles with completion signals: every
    tile counted once, results right."""
    e_count, n, k = len(MASKED), 256, 512
    picked = choose_config(64, MAX_M, n, k, 132, fp8=fp8, num_experts=e_count, signals=True)
    assert picked.a_chunk_rows == 32
    layout = flashgemm.signal_layout(
        e_count, MAX_M, n, k, expected_m=64, signal_granularity=granularity, fp8=fp8
    )
    sig = flashgemm.alloc_signals(layout, device="cuda")
    if fp8:
        a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, MAX_M, n, k, MASKED)
        _junk_past_m(a, MASKED, a_scale)
        buf, out = _poisoned_out_fp8(e_count, MAX_M, n)
        _, got = flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, expected_m=64,
            dst_signals=sig, signal_granularity=granularity,
        )
        _check_fp8(a, a_scale, b, b_scale, masked_m, out, buf)
    else:
        a, b, masked_m = _random_case(e_count, MAX_M, n, k, MASKED)
        _junk_past_m(a, MASKED)
        buf, out = _poisoned_out(e_count, MAX_M, n)
        _, got = flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, expected_m=64, dst_signals=sig, signal_granularity=granularity
        )
        _check(a, b, masked_m, out, buf)
    assert got == layout
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), MAX_M))
