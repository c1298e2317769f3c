"""The heuristic and config facts (CPU only)."""

from dataclasses import replace

import pytest

from flashgemm.config import (
    FP8_SIGNAL_WINDOW,
    DECODE_128_CONFIG,
    DECODE_CONFIG,
    FP8_HEURISTIC_CONFIGS,
    HEURISTIC_CONFIGS,
    MID_192_CONFIG,
    MID_CONFIG,
    PREFILL_CONFIG,
    GemmConfig,
    choose_config,
)


@pytest.mark.parametrize(
    "expected_m, want",
    [(1, DECODE_CONFIG), (32, DECODE_CONFIG), (48, DECODE_CONFIG), (64, DECODE_128_CONFIG),
     (96, DECODE_128_CONFIG), (97, MID_192_CONFIG), (128, MID_192_CONFIG), (144, MID_192_CONFIG),
     (145, MID_CONFIG), (256, MID_CONFIG), (1024, PREFILL_CONFIG)],
)
def test_heuristic_regimes(expected_m, want):
    assert choose_config(expected_m, 4096, 4096, 7168, 132) == want


@pytest.mark.parametrize("expected_m", [1, 32, 48, 64, 96, 97, 144, 145, 256, 1024])
def test_l2_hints_only_where_weight_tiles_are_not_reread_after_eviction(expected_m):
    # evict-first weights are safe only if no second m-block's CTA re-reads
    # them: m_e up to expected_m + 30% must fit one tile
    cfg = choose_config(expected_m, 4096, 4096, 7168, 132)
    assert cfg.l2_hints == (expected_m * 1.3 <= cfg.tile_m)
    assert cfg.l2_hints == (expected_m <= 144)
    # fp8 also hints 128x128 tiles when an expert's two m-blocks fit one round:
    # 2 x 16 n-groups of N=4096 on 66 clusters yes, 2 x 64 of N=16384 no
    fp8 = choose_config(expected_m, 4096, 4096, 7168, 132, fp8=True, num_experts=8)
    assert fp8.l2_hints == (expected_m * 1.3 <= 2 * fp8.tile_m)
    wide = choose_config(expected_m, 4096, 16384, 7168, 132, fp8=True, num_experts=8)
    assert wide.l2_hints == (expected_m * 1.3 <= wide.tile_m)


def test_heuristic_is_host_only_and_bounded():
    # no hint: assume every row is valid; the hint is clamped to max_m
    assert choose_config(None, 64, 4096, 7168, 132) == choose_config(64, 64, 4096, 7168, 132)
    assert choose_config(10**6, 100, 4096, 7168, 132) == choose_config(100, 100, 4096, 7168, 132)


def test_one_sm_falls_back_to_single_cta_clusters():
    for m in (1, 64, 128, 1024):
        cfg = choose_config(m, 4096, 4096, 7168, 1)
        assert cfg.cluster_n == 1 and cfg in HEURISTIC_CONFIGS


def test_every_heuristic_config_is_valid_and_fits():
    for cfg in HEURISTIC_CONFIGS:
        cfg.validate()
        assert cfg.resolved_stages() >= 4  # deep enough to keep weight loads in flight
        assert cfg.smem_bytes() <= 232448
        assert not cfg.n_major  # the bf16 tiles lost with it (config.py)


def test_short_name_distinguishes_configs():
    names = {c.short_name() for c in HEURISTIC_CONFIGS}
    assert len(names) == len(HEURISTIC_CONFIGS)
    assert GemmConfig(l2_hints=True).short_name() != GemmConfig().short_name()
    assert GemmConfig(n_major=True).short_name() != GemmConfig().short_name()
    assert GemmConfig(n_major=True, n_major_window=2).short_name() != GemmConfig(n_major=True).short_name()
    fp8_names = {c.short_name() for c in FP8_HEURISTIC_CONFIGS}
    assert len(fp8_names) == len(FP8_HEURISTIC_CONFIGS)
    assert GemmConfig(dynamic=True).short_name() != GemmConfig().short_name()
    assert GemmConfig(promote_overlap=True).short_name() != GemmConfig().short_name()


@pytest.mark.parametrize("fp8", [False, True])
def test_dynamic_order_only_for_the_smallest_m(fp8):
    """The heuristic claims units dynamically on the expected_m <= 48 tiles
    (8-16 units per cluster, where uneven routing gained 3-5%) and keeps the
    static order where a cluster gets only a few units."""
    assert choose_config(32, 1024, 4096, 7168, 132, fp8=fp8, num_experts=32).dynamic
    assert choose_config(48, 1024, 7168, 2048, 132, fp8=fp8, num_experts=32).dynamic
    for m in (64, 128, 1024):
        assert not choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=16).dynamic


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_splits_its_last_round_unless_signalled(fp8):
    """Prefill tiles (expected_m > 256) split a last round at most half full
    (compute-bound units); decode and mid tiles stream weights, where half a
    unit reads as many bytes, and keep it whole. With completion signals the
    heuristic runs the same tile unsplit; that config is precompiled too."""
    configs = FP8_HEURISTIC_CONFIGS if fp8 else HEURISTIC_CONFIGS
    for m in (257, 1024, 4096):
        cfg = choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=4)
        signalled = choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=4, signals=True)
        assert cfg.split_last_round
        assert signalled == replace(cfg, split_last_round=False, balance_rounds=fp8)
        assert cfg in configs and signalled in configs
        assert replace(cfg, cluster_n=1) in configs
    for m in (1, 32, 64, 128, 256):
        assert not choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=8).split_last_round
    assert GemmConfig(split_last_round=True).short_name() != GemmConfig().short_name()


def test_bf16_192_row_tile_width_follows_the_rounds():
    """expected_m 97..144 (bf16): 192x128 where its rounds, at WIDE_UNIT_COST
    per half of a unit, beat 192x64's; the measured cases of config.py."""
    from flashgemm.config import MID_192_CONFIG, MID_192_N128_CONFIG, expected_rounds, mid_192_wide_wins

    # dsv3-ep32 (E 8, m 128): gate_up N 4096 has 2 rounds of 192x128 against 4;
    # down N 7168 has 4 against 7, where 192x128 lost (1.040)
    assert expected_rounds(MID_192_N128_CONFIG, 8, 128, 4096, 132) == 2
    assert expected_rounds(MID_192_CONFIG, 8, 128, 4096, 132) == 4
    assert expected_rounds(MID_192_N128_CONFIG, 8, 128, 7168, 132) == 4
    assert expected_rounds(MID_192_CONFIG, 8, 128, 7168, 132) == 7
    assert choose_config(128, 4096, 4096, 7168, 132, num_experts=8) == MID_192_N128_CONFIG
    assert choose_config(128, 4096, 7168, 2048, 132, num_experts=8) == MID_192_CONFIG
    assert not mid_192_wide_wins(8, 128, 3072, 132)  # 2 rounds against 3
    # without num_experts the rounds are unknown: the 64-wide tile
    assert choose_config(128, 4096, 4096, 7168, 132) == MID_192_CONFIG
    # m-blocks: 0.7..1.3 x expected_m against the tile edges (128-row tile,
    # m 128: half the experts take a second m-block)
    from flashgemm.config import MID_CONFIG

    assert expected_rounds(MID_CONFIG, 66, 128, 256, 132) == 2  # 66 * 1.5 * 1 units on 66 clusters
    assert expected_rounds(MID_CONFIG, 66, 60, 256, 132) == 1


def test_fp8_heuristic_regimes():
    from flashgemm.config import (
        FP8_DECODE_CONFIG, FP8_DECODE_N64_CONFIG, FP8_HEURISTIC_CONFIGS, FP8_MID_CONFIG, FP8_PREFILL_CONFIG,
        FP8_PREFILL_N128_CONFIG,
    )

    # decode: 64-wide tiles from K 4096 on (units whose time grows with K)
    assert choose_config(32, 1024, 7168, 2048, 132, fp8=True) == FP8_DECODE_CONFIG
    assert choose_config(48, 1024, 4096, 4095, 132, fp8=True) == FP8_DECODE_CONFIG
    assert choose_config(32, 1024, 4096, 7168, 132, fp8=True) == FP8_DECODE_N64_CONFIG
    assert choose_config(48, 1024, 3072, 4096, 132, fp8=True) == FP8_DECODE_N64_CONFIG
    assert FP8_DECODE_N64_CONFIG == replace(FP8_DECODE_CONFIG, tile_n=64)
    assert FP8_DECODE_N64_CONFIG in FP8_HEURISTIC_CONFIGS
    assert replace(FP8_DECODE_N64_CONFIG, cluster_n=1) in FP8_HEURISTIC_CONFIGS
    assert choose_config(32, 1024, 4096, 7168, 1, fp8=True) == replace(FP8_DECODE_N64_CONFIG, cluster_n=1)
    # expected_m 64: every expert fits one 128-row m-block, so the L2 hints are on
    assert choose_config(64, 1024, 4096, 1536, 132, fp8=True) == replace(FP8_MID_CONFIG, l2_hints=True)
    assert choose_config(98, 1024, 4096, 1536, 132, fp8=True).l2_hints
    # 99 rows: two m-blocks; their 2 x 16 units fit the 66 clusters of 132 SMs
    assert choose_config(99, 1024, 4096, 1536, 132, fp8=True).l2_hints
    assert not choose_config(99, 1024, 4096, 1536, 40, fp8=True).l2_hints
    assert not choose_config(197, 4096, 4096, 7168, 132, fp8=True).l2_hints  # three m-blocks
    assert choose_config(128, 4096, 7168, 2048, 132, fp8=True) == replace(FP8_MID_CONFIG, l2_hints=True)
    assert choose_config(128, 4096, 4096, 7168, 132, fp8=True) == replace(FP8_MID_CONFIG, l2_hints=True)
    # prefill: in the expert-major order, a last round at most half full
    # split instead of balanced; up to 256 rows n-major. 192-wide tiles with
    # one product set where at least 4 rounds of them are expected
    # (dsv3-prefill-down: 4 experts x 8.5 m-blocks x 19 n-groups on 66
    # clusters, 10 rounds) and, on K over 2048, 1.5 times their rounds are at
    # most 1.1 times the 128x128 tile's (dsv3-prefill-gate_up: 6 against 9);
    # else 128-wide ones with two product sets: dense-like (6 rounds against
    # 8), one round (E2 m600 N2048: 2 x 5.2 x 6 units), or no num_experts to
    # count them.
    assert choose_config(1024, 4096, 7168, 2048, 132, fp8=True, num_experts=4) == FP8_PREFILL_CONFIG
    assert choose_config(1024, 4096, 4096, 7168, 132, fp8=True, num_experts=4) == FP8_PREFILL_CONFIG
    assert choose_config(4096, 4096, 4096, 7168, 132, fp8=True, num_experts=1) == FP8_PREFILL_N128_CONFIG
    assert choose_config(600, 2048, 2048, 2048, 132, fp8=True, num_experts=2) == FP8_PREFILL_N128_CONFIG
    assert choose_config(1024, 4096, 7168, 2048, 132, fp8=True) == FP8_PREFILL_N128_CONFIG
    assert FP8_PREFILL_CONFIG == replace(
        FP8_MID_CONFIG, tile_n=192, promote_overlap=False, n_major=False, balance_rounds=False,
        split_last_round=True, a_chunk_rows=0, epi_whole_tile=True, promote_parts=2,
    ) and FP8_MID_CONFIG.n_major and FP8_MID_CONFIG.promote_overlap
    # the whole-tile staging only where it was measured to pay: the fp8
    # prefill tiles (not bf16's 128x256, not the mostly partial mid tiles)
    assert FP8_PREFILL_N128_CONFIG == replace(
        FP8_PREFILL_CONFIG, tile_n=128, promote_overlap=True, promote_parts=1
    )
    whole = [c for c in FP8_HEURISTIC_CONFIGS + HEURISTIC_CONFIGS if c.epi_whole_tile]
    assert {(c.tile_n, c.tile_k) for c in whole} == {(192, 128), (128, 128)}
    assert all(c.split_last_round or c.balance_rounds and not c.n_major for c in whole)
    # with signals the last round stays whole (a signal counts whole tiles)
    # and is balanced, as before the split
    for e, cfg in ((4, FP8_PREFILL_CONFIG), (None, FP8_PREFILL_N128_CONFIG)):
        signalled = choose_config(1024, 4096, 7168, 2048, 132, fp8=True, num_experts=e, signals=True)
        assert signalled == replace(cfg, split_last_round=False, balance_rounds=True)
        assert signalled in FP8_HEURISTIC_CONFIGS and cfg in FP8_HEURISTIC_CONFIGS
    assert not any(c.split_last_round for c in FP8_HEURISTIC_CONFIGS if c.tile_m == 64 or c.n_major)
    assert choose_config(256, 4096, 4096, 7168, 132, fp8=True).n_major
    assert not choose_config(257, 4096, 4096, 7168, 132, fp8=True).n_major
    assert not FP8_DECODE_CONFIG.n_major
    # with completion signals experts must finish one after another, not all
    # at the end: windows of FP8_SIGNAL_WINDOW experts (1: expert-major)
    assert FP8_SIGNAL_WINDOW in (1, 2, 4, 8, 16, 32)
    for m in (64, 99, 128, 256):
        plain = choose_config(m, 4096, 7168, 2048, 132, fp8=True, num_experts=8)
        signalled = choose_config(m, 4096, 7168, 2048, 132, fp8=True, num_experts=8, signals=True)
        assert plain.n_major and not plain.n_major_window, m
        assert signalled == replace(plain, n_major_window=FP8_SIGNAL_WINDOW), m
        assert signalled in FP8_HEURISTIC_CONFIGS and plain in FP8_HEURISTIC_CONFIGS
    from flashgemm.launcher import _resolve_config

    assert _resolve_config(None, 128, 4096, 7168, 2048, 132, True, 8, signals=True).n_major_window
    assert not _resolve_config(None, 128, 4096, 7168, 2048, 132, True, 8).n_major_window
    # an explicit config is the caller's choice, signals or not
    assert not _resolve_config(FP8_MID_CONFIG, None, 4096, 7168, 2048, 132, True, 8, signals=True).n_major_window
    single = choose_config(32, 1024, 4096, 7168, 1, fp8=True)
    assert single.cluster_n == 1 and single in FP8_HEURISTIC_CONFIGS
    for cfg in FP8_HEURISTIC_CONFIGS:
        assert cfg.tile_k == 128 and cfg.validate(1) is cfg
        # two product sets on the two-warpgroup mid tiles (5-8% faster), one
        # on the one-warpgroup decode tile (no gain there) and on the
        # 192-wide prefill tile (no registers for a third set)
        assert cfg.promote_overlap == (cfg.consumer_warpgroups == 2 and cfg.tile_n <= 128)
        assert cfg.tile_n <= 128 or cfg == replace(
            FP8_PREFILL_CONFIG, cluster_n=cfg.cluster_n, split_last_round=cfg.split_last_round,
            balance_rounds=cfg.balance_rounds,
        )
    assert replace(FP8_PREFILL_N128_CONFIG, cluster_n=1) in FP8_HEURISTIC_CONFIGS


def test_fp8_wave_rule_picks_narrow_tiles_only_for_a_nearly_empty_last_round():
    import json
    import os

    from flashgemm.config import (
        FP8_MID_CONFIG, FP8_MID_N64_CONFIG, FP8_PREFILL_CONFIG, FP8_PREFILL_N128_CONFIG, wave_efficiency,
    )

    spec = json.load(open(os.path.join(os.path.dirname(__file__), "..", "scripts", "moe_cases.json")))
    cases = {c["name"]: c for c in spec["cases"]}

    def pick(name, num_sms=132):
        c = cases[name]
        return choose_config(c["expected_m"], c["max_m"], c["N"], c["K"], num_sms, fp8=True,
                             num_experts=c["E"])

    # qwen3-30b-ep8: 16 experts x 6 n-groups of 128x128 = 96 units on 66 clusters
    c = cases["qwen3-30b-ep8-gate_up"]
    assert wave_efficiency(FP8_MID_CONFIG, c["E"], c["expected_m"], c["N"], 132) == pytest.approx(96 / 132)
    assert pick("qwen3-30b-ep8-gate_up") == replace(FP8_MID_N64_CONFIG, l2_hints=True)
    # rounds already full with 128x128: keep it (64-wide tiles re-read A twice as often)
    for name in ("dsv3-ep32-gate_up", "dsv3-ep32-down", "qwen3-235b-ep8-gate_up", "qwen3-235b-ep8-down"):
        assert replace(pick(name), l2_hints=False, n_major=True) == FP8_MID_CONFIG, name
    # prefill has its own rule: 192 wide unless its coarser rounds cost more
    assert pick("dsv3-prefill-down") == FP8_PREFILL_CONFIG
    assert pick("dsv3-prefill-gate_up") == FP8_PREFILL_CONFIG
    assert pick("dense-like") == FP8_PREFILL_N128_CONFIG
    # experts of up to 166 rows span two m-blocks there, whose 2 x 28 (down) and
    # 2 x 16 (gate_up) units fit one round of 66 clusters: hinted
    assert pick("dsv3-ep32-down").l2_hints and pick("dsv3-ep32-gate_up").l2_hints
    # on 24 SMs (12 clusters) they do not: the second read comes a round later
    assert not pick("dsv3-ep32-down", num_sms=24).l2_hints
    # small-m decode keeps its own tile; without num_experts the rule is off
    assert pick("dsv3-ep8-gate_up").tile_m == 64
    assert choose_config(64, 1024, 1536, 2048, 132, fp8=True).tile_n == 128
    # the grid it is told about counts: on 12 SMs 96 units fill their rounds
    assert pick("qwen3-30b-ep8-gate_up", num_sms=12).tile_n == 128


def test_wave_efficiency_counts_rounds():
    from flashgemm.config import MID_CONFIG, wave_efficiency

    # 8 experts x 1.5 m-blocks x 28 n-groups = 336 units on 66 clusters: 6 rounds
    assert wave_efficiency(MID_CONFIG, 8, 128, 7168, 132) == pytest.approx(336 / 396)
    assert wave_efficiency(MID_CONFIG, 1, 1, 128, 132) == pytest.approx(1 / 66)
    assert 0 < wave_efficiency(MID_CONFIG, 256, 4096, 7168, 132) <= 1


def test_benchmark_reads_back_every_config_name(bench_script):
    """scripts/bench.py --configs takes the short names the tables print."""
    from flashgemm.config import FP8_HEURISTIC_CONFIGS

    for cfg in HEURISTIC_CONFIGS + FP8_HEURISTIC_CONFIGS + (GemmConfig(l2_warmup=False, pdl=False),):
        back = bench_script.parse_config(cfg.short_name())
        assert back.short_name() == cfg.short_name(), cfg
        # stages were resolved into the name; everything else comes back equal
        assert replace(back, stages=cfg.stages) == cfg, cfg


def test_benchmark_set_option_reads_fields(bench_script):
    """--set FIELD=VALUE of ab_revision.py and bench_overlap.py: bools from 0/1,
    ints as given, and a field GemmConfig lacks goes to the parser's error."""
    assert bench_script.parse_config_changes(["n_major=1", "tile_n=64", "pdl=0"], None) == {
        "n_major": True, "tile_n": 64, "pdl": False,
    }

    class Refused(Exception):
        pass

    def error(message):
        raise Refused(message)

    with pytest.raises(Refused, match="no field 'tile_q'"):
        bench_script.parse_config_changes(["tile_q=3"], error)
