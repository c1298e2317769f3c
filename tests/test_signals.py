"""Completion-signal arithmetic, validation and PTX (CPU only)."""

import random
import re
from collections import Counter

import pytest
import torch

from flashgemm import compile as fg_compile
from flashgemm import signal_layout
from flashgemm.config import DECODE_CONFIG, MID_CONFIG, GemmConfig
from flashgemm.epilogue import SIGNAL_STAGES
from flashgemm.scheduler import tile_order
from flashgemm.signals import make_signal_layout, validate_signals


def _counts_from_schedule(masked_m, max_m, n, cfg, granularity, num_ctas=14):
    """Signal values implied by the scheduler model: one add per stored tile."""
    layout = make_signal_layout(granularity, max_m, n, cfg.tile_m, cfg.tile_n, len(masked_m))
    counts = Counter()
    for cta in tile_order(masked_m, max_m, n, cfg.tile_m, cfg.tile_n, num_ctas, cfg.cluster_n, cfg.balance_rounds):
        for e, mb, nb in cta:
            counts[layout.index(e, mb)] += 1
    return layout, torch.tensor([counts[i] for i in range(layout.size)], dtype=torch.int32)


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
def test_final_values_match_scheduler_model(granularity):
    rng = random.Random(1234)
    configs = [DECODE_CONFIG, MID_CONFIG, GemmConfig(tile_m=128, tile_n=192), GemmConfig(tile_m=64, tile_n=64, consumer_warpgroups=1, cluster_n=2)]
    for _ in range(200):
        e_count = rng.choice([1, 3, 17, 64])
        max_m = rng.choice([1, 64, 100, 300])
        n = rng.choice([8, 136, 520, 1032])
        cfg = rng.choice(configs)
        masked = [rng.choice([0, 0, 1, max_m, max_m + 9, -4, rng.randint(0, max_m)]) for _ in range(e_count)]
        layout, expected = _counts_from_schedule(masked, max_m, n, cfg, granularity)
        got = layout.final_values(torch.tensor(masked, dtype=torch.int32), max_m)
        assert torch.equal(got, expected), (masked, max_m, n, cfg)
        # empty experts never get a signal
        for e, m in enumerate(masked):
            if min(max(m, 0), max_m) == 0:
                lo, hi = (e, e + 1) if granularity == "expert" else (e * layout.num_m_blocks, (e + 1) * layout.num_m_blocks)
                assert int(got[lo:hi].sum()) == 0


def test_layout_facts_before_launch():
    lay = signal_layout(32, 1024, 4096, 7168, expected_m=32)
    assert (lay.block_m, lay.block_n) == (DECODE_CONFIG.tile_m, DECODE_CONFIG.tile_n)
    assert lay.num_m_blocks == 1024 // DECODE_CONFIG.tile_m and lay.n_tiles == 4096 // DECODE_CONFIG.tile_n
    assert lay.size == 32 * lay.num_m_blocks
    lay_e = signal_layout(32, 1024, 4096, 7168, expected_m=32, signal_granularity="expert")
    assert lay_e.size == 32
    with pytest.raises(ValueError, match="signal_granularity"):
        signal_layout(4, 64, 128, 128, signal_granularity="tile")


def test_signal_validation():
    lay = make_signal_layout("m_block", 100, 256, 64, 128, 4)  # 4 experts x 2 m-blocks
    ok = torch.zeros(8, dtype=torch.int32)
    validate_signals(ok, lay, None)
    with pytest.raises(TypeError, match="dst_signals.*int32"):
        validate_signals(torch.zeros(8, dtype=torch.int64), lay, None)
    with pytest.raises(TypeError, match="dst_signals"):
        validate_signals([0] * 8, lay, None)
    with pytest.raises(ValueError, match="at least 8"):
        validate_signals(torch.zeros(7, dtype=torch.int32), lay, None)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        validate_signals(torch.zeros(16, dtype=torch.int32)[::2], lay, None)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        validate_signals(torch.zeros(2, 8, dtype=torch.int32), lay, None)
    with pytest.raises(ValueError, match="dst_signals is on cpu"):
        validate_signals(ok, lay, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="signal_granularity"):
        make_signal_layout("rows", 100, 256, 64, 128, 4)


@pytest.mark.parametrize("mode", ["m_block", "expert"])
def test_ptx_publishes_with_release(mode):
    ptx = fg_compile.build(MID_CONFIG, arch="sm_90a", keep_ptx=True, signal_mode=mode).__ptx__
    assert "red.release.gpu.global.add.s32" in ptx
    # waits for the bulk stores to complete, not only to release shared memory
    assert re.search(r"cp\.async\.bulk\.wait_group\s", ptx)
    assert "fence.proxy.async.global" in ptx
    # the release add is the only GPU-scope ordering: an extra fence.acq_rel.gpu
    # before it cost ~1% on the small decode cases (docs/signals.md)
    assert "fence.acq_rel.gpu" not in ptx
    plain = fg_compile.build(MID_CONFIG, arch="sm_90a", keep_ptx=True).__ptx__
    assert "red.release.gpu" not in plain
    # partial tiles reach the store warp through the signal pipeline's
    # mbarriers (a CTA-local release arrive), not through another named barrier
    assert ptx.count("mbarrier.init") == plain.count("mbarrier.init") + 2 * SIGNAL_STAGES
    assert "mbarrier.arrive.shared.b64" in ptx and "mbarrier.arrive.shared.b64" not in plain
    named = r"\bbar(?:rier)?\.(?:sync|arrive)\b"
    assert len(re.findall(named, ptx)) == len(re.findall(named, plain))


def test_combine_ptx_polls_with_acquire_and_backoff():
    ptx = fg_compile.build_combine(64, "sm_90a", keep_ptx=True).__ptx__
    assert "ld.acquire.gpu.global.b32" in ptx  # the wait's poll
    assert "nanosleep" in ptx  # back-off between polls
    assert "atom.global.or.b32" in ptx  # timeout / bad-token error bits
    assert "ld.global.v4" in ptx  # 16-byte loads of the GEMM output rows
    # rows are staged in shared memory and added by the bulk-copy engine
    assert "fence.proxy.async.shared::cta" in ptx
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx)  # double-buffered staging


def _cpu_combine_args(e_count=2, max_m=64, n=128):
    """combine_masked's arguments up to ``combined``, on the CPU (validation
    only), with the m_block layout of a DECODE_CONFIG call (block_m 64)."""
    layout = signal_layout(e_count, max_m, n, 64, config=DECODE_CONFIG, num_sms=8)
    return (
        torch.zeros(e_count, max_m, n, dtype=torch.bfloat16),
        torch.zeros(e_count, dtype=torch.int32),
        torch.zeros(layout.size, dtype=torch.int32),
        layout,
        torch.zeros(e_count, max_m, dtype=torch.int32),
        torch.zeros(e_count, max_m),
    )


def test_combine_rejects_a_misaligned_output():
    from flashgemm.overlap import combine_masked

    tokens, n = 16, 128
    combined = torch.zeros(tokens * n + 1)[1:].view(tokens, n)  # 4 bytes past an aligned base
    with pytest.raises(ValueError, match="combined must start at a 16-byte aligned"):
        combine_masked(*_cpu_combine_args(n=n), combined, num_sms=8)


@pytest.mark.parametrize("rows", [0, 3, 128, True, 4.0])
def test_combine_rejects_bad_rows_per_item(rows):
    from flashgemm.combine import MaskedCombineSm90
    from flashgemm.overlap import combine_masked

    match = "rows_per_item must be a power of two dividing block_m=64"
    with pytest.raises(ValueError, match=match):
        combine_masked(*_cpu_combine_args(), torch.zeros(16, 128), num_sms=8, rows_per_item=rows)
    with pytest.raises(ValueError, match=match):  # the kernel class checks the same rule
        MaskedCombineSm90(64, rows)


def test_signal_layout_follows_the_fp8_wave_rule():
    # qwen3-30b-ep8 shapes: the fp8 heuristic takes 64-wide tiles on a 132-SM
    # grid, 128-wide on 12 SMs; the layout the combine sets up must match
    lay = signal_layout(16, 256, 1536, 2048, expected_m=64, num_sms=132, fp8=True)
    assert (lay.block_m, lay.block_n, lay.n_tiles) == (128, 64, 24)
    lay = signal_layout(16, 256, 1536, 2048, expected_m=64, num_sms=12, fp8=True)
    assert (lay.block_m, lay.block_n, lay.n_tiles) == (128, 128, 12)
