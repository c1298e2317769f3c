"""The heuristic and config facts (CPU only)."""

import itertools
import json
import os

import pytest

from flashgemm.config import (
    Epilogue,
    GemmConfig,
    KernelSpec,
    Promotion,
    Staging,
    Tail,
    TileOrder,
)
from flashgemm.epilogue import family
from flashgemm.formats import Format
from flashgemm.sm90.heuristic import (
    DECODE_128_CONFIG,
    DECODE_CONFIG,
    FP8_SIGNAL_WINDOW,
    MID_192_CONFIG,
    MID_CONFIG,
    PREFILL_CONFIG,
    choose_activation_config,
    choose_config,
    reachable_specs,
)
from flashgemm.sm90.limits import (
    CONVERTER_REGS, PRODUCER_REGS, SMEM_BYTES, check_config, consumer_regs, converter_warpgroups, resolved_stages,
    smem_bytes,
)

BF16, FP8 = Format.BF16, Format.FP8_BLOCK128
BF16_SPECS = reachable_specs(BF16)
FP8_SPECS = reachable_specs(FP8)
# the configurations the heuristic can pick, each once (a spec adds the signal mode)
BF16_CONFIGS = tuple(dict.fromkeys(s.config for s in BF16_SPECS))
FP8_CONFIGS = tuple(dict.fromkeys(s.config for s in FP8_SPECS))


def _specs(ops, cfg, use):
    """The specs a call with this config launches: no signal mode without
    signals, either granularity with them, the fused-combine epilogue with
    ``combine``."""
    if use == "combine":  # the target (fp32 or bf16 sums, or the peers' buffers) and the bias pick the build
        return {KernelSpec(cfg, ops, None, epi) for epi in family("combine")}
    modes = ("m_block", "expert") if use == "signals" else (None,)
    return {KernelSpec(cfg, ops, mode) for mode in modes}


def _reachable(ops, cfg, signals=False):
    return _specs(ops, cfg, "signals" if signals else "plain") <= set(reachable_specs(ops))


@pytest.mark.parametrize(
    "expected_m, want",
    [(1, DECODE_CONFIG), (32, DECODE_CONFIG), (48, DECODE_CONFIG), (64, DECODE_128_CONFIG),
     (96, DECODE_128_CONFIG), (97, MID_192_CONFIG), (128, MID_192_CONFIG), (144, MID_192_CONFIG),
     (145, MID_CONFIG), (256, MID_CONFIG), (1024, PREFILL_CONFIG)],
)
def test_heuristic_regimes(expected_m, want):
    assert choose_config(expected_m, 4096, 4096, 7168, 132) == want


def test_top_level_choose_config_is_the_heuristic():
    """flashgemm.choose_config asks the compile target's backend (sm_90a
    here, without a GPU): the sm_90 heuristic's pick."""
    import flashgemm

    for args in [(1, 4096, 4096, 7168, 132), (128, 4096, 7168, 2048, 132, True, 8), (700, 1024, 512, 512, 7)]:
        assert flashgemm.choose_config(*args) == choose_config(*args)
    assert flashgemm.choose_config(64, 256, 512, 512, 132, fmt="fp8_block128", signals=True) == \
        choose_config(64, 256, 512, 512, 132, True, signals=True)


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
        assert cfg.cluster_n == 1 and _reachable(BF16, cfg)


def test_every_heuristic_config_is_valid_and_fits():
    for cfg in BF16_CONFIGS:
        assert check_config(cfg, BF16) is cfg
        assert resolved_stages(cfg, BF16) >= 4  # deep enough to keep weight loads in flight
        assert smem_bytes(cfg, BF16) <= 232448 == SMEM_BYTES
        assert not cfg.n_major  # the bf16 tiles lost with it (docs/design.md)


def test_register_split_fits_the_launch_allocation():
    """setmaxnreg.inc only takes registers that other warps of the CTA gave
    back, so a split over the launch allocation waits forever (ptxas gives
    a setmaxnreg kernel 64K registers over its threads, in multiples of 8):
    every reachable kernel's roles fit. The split once tried for two
    consumers beside two converter warpgroups (168 registers per consumer)
    did not, and hung on the GPU (docs/design.md)."""
    def fits(consumers, converters, producer=PRODUCER_REGS, converter=CONVERTER_REGS, consumer=None):
        warpgroups = consumers + 1 + converters
        launch = 65536 // (128 * warpgroups) // 8 * 8
        if consumer is None:
            consumer = consumer_regs(consumers, converters)
        return producer + converter * converters + consumer * consumers <= launch * warpgroups

    specs = reachable_specs()
    assert {s.fmt for s in specs} >= {BF16, FP8, Format.FP8_MXFP4, Format.BF16_MXFP4}
    for spec in specs:
        cfg = spec.config
        converters = converter_warpgroups(cfg.consumer_warpgroups) if spec.fmt.converts_weights else 0
        assert fits(cfg.consumer_warpgroups, converters), spec
    # 640 threads launch at 96 registers: 24 + 2 * 72 + 2 * 168 asks for 24 more than they hold
    assert not fits(2, 2, producer=24, converter=72, consumer=168)
    assert fits(2, 2, producer=24, converter=72, consumer=152)


def test_config_derived_facts():
    """What the removed fields became: tile_k follows the operands, the
    consumer warpgroups follow tile_m, the enum fields answer the old flags."""
    assert (BF16.tile_k, FP8.tile_k) == (64, 128) and (BF16.elem_bytes, FP8.elem_bytes) == (2, 1)
    assert BF16.value == "bf16" and FP8.value == "fp8_block128"
    assert GemmConfig().tile_mnk(BF16) == (128, 128, 64)
    assert GemmConfig(tile_m=64, tile_n=192).tile_mnk(FP8) == (64, 192, 128)
    for tile_m, wgs in ((64, 1), (128, 2), (192, 3)):
        cfg = GemmConfig(tile_m=tile_m)
        assert cfg.consumer_warpgroups == wgs and cfg.threads == 128 * (1 + wgs)
    assert GemmConfig(order=TileOrder.DYNAMIC).dynamic and not GemmConfig(order=TileOrder.DYNAMIC).n_major
    assert GemmConfig(order=TileOrder.N_MAJOR).n_major and not GemmConfig(order=TileOrder.N_MAJOR).dynamic
    assert not GemmConfig().dynamic and not GemmConfig().n_major
    assert GemmConfig(promotion=Promotion.TWO_PARTS).promote_parts == 2
    assert GemmConfig(promotion=Promotion.OVERLAPPED).promote_parts == 1 == GemmConfig().promote_parts
    assert GemmConfig(tile_n=256).epi_buffers == 2
    assert GemmConfig(tile_n=256, staging=Staging.WHOLE_TILE).epi_buffers == 8
    # replace is dataclasses.replace
    assert GemmConfig().replace(tile_n=64, tail=Tail.BALANCE) == GemmConfig(tile_n=64, tail=Tail.BALANCE)
    # the removed fields are gone, not silently ignored
    for removed in ("tile_k", "cluster_m", "dynamic", "n_major", "balance_rounds", "split_last_round",
                    "promote_overlap", "promote_parts", "epi_whole_tile", "consumer_warpgroups"):
        with pytest.raises(TypeError):
            GemmConfig(**{removed: 1})
    spec = KernelSpec(GemmConfig(), FP8, "expert")
    assert spec.name() == f"fp8_block128-{GemmConfig().short_name()}-expert"
    assert KernelSpec(GemmConfig(), BF16).name() == f"bf16-{GemmConfig().short_name()}-nosig"


def test_short_name_distinguishes_configs():
    names = {c.short_name() for c in BF16_CONFIGS}
    assert len(names) == len(BF16_CONFIGS)
    fp8_names = {c.short_name() for c in FP8_CONFIGS}
    assert len(fp8_names) == len(FP8_CONFIGS)
    # one name per kernel
    specs = reachable_specs()
    # bf16 and fp8: 78 stores; 26 fused combines into fp32, 26 into bf16 and 26
    # into the peers' receive buffers, each with and without a bias; 16 gate_up
    # kernels with the SwiGLU fused.
    # MXFP4 weights: the fp8 picks adapted (some 64-wide ones become the same 128-wide tile)
    mxfp4 = reachable_specs(Format.FP8_MXFP4)
    assert len(mxfp4) == 114
    # with bf16 activations: the bf16 picks adapted likewise
    bf16_mxfp4 = reachable_specs(Format.BF16_MXFP4)
    assert len(bf16_mxfp4) == 80
    assert len({s.name() for s in specs}) == len(specs) == 250 + len(mxfp4) + len(bf16_mxfp4)
    base = GemmConfig().short_name()
    for changes in (
        dict(l2_hints=True), dict(order=TileOrder.N_MAJOR), dict(order=TileOrder.DYNAMIC),
        dict(promotion=Promotion.OVERLAPPED), dict(promotion=Promotion.TWO_PARTS),
        dict(tail=Tail.BALANCE), dict(tail=Tail.SPLIT), dict(staging=Staging.WHOLE_TILE),
        dict(a_chunk_rows=32), dict(pdl=False), dict(l2_warmup=False), dict(stages=4),
    ):
        assert GemmConfig(**changes).short_name() != base, changes
    n_major = GemmConfig(order=TileOrder.N_MAJOR)
    assert n_major.replace(n_major_window=2).short_name() != n_major.short_name()
    assert GemmConfig(promotion=Promotion.OVERLAPPED).short_name() != GemmConfig(
        promotion=Promotion.TWO_PARTS).short_name()
    from flashgemm.sm90.heuristic import FP8_MID_CONFIG

    assert FP8_MID_CONFIG.short_name() == "m128n128sAc2-n_major-balance-overlapped-ac32"


@pytest.mark.parametrize("fp8", [False, True])
def test_dynamic_order_only_for_the_smallest_m(fp8):
    """The heuristic claims units dynamically on the expected_m <= 48 tiles
    (8-16 units per cluster, where uneven routing gained 3-5%) and keeps the
    static order where a cluster gets only a few units."""
    assert choose_config(32, 1024, 4096, 7168, 132, fp8=fp8, num_experts=32).order is TileOrder.DYNAMIC
    assert choose_config(48, 1024, 7168, 2048, 132, fp8=fp8, num_experts=32).dynamic
    for m in (64, 128, 1024):
        assert not choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=16).dynamic


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_splits_its_last_round_unless_signalled(fp8):
    """Prefill tiles (expected_m > 256) split a last round at most half full
    (compute-bound units); decode and mid tiles stream weights, where half a
    unit reads as many bytes, and keep it whole. With completion signals the
    heuristic runs the same tile unsplit; that config is precompiled too."""
    ops = FP8 if fp8 else BF16
    for m in (257, 1024, 4096):
        cfg = choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=4)
        signalled = choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=4, signals=True)
        assert cfg.tail is Tail.SPLIT
        assert signalled == cfg.replace(tail=Tail.BALANCE if fp8 else Tail.NONE)
        assert _reachable(ops, cfg) and _reachable(ops, signalled, signals=True)
        assert _reachable(ops, cfg.replace(cluster_n=1))
        # a split config is never launched with signals
        assert not _specs(ops, cfg, "signals") & set(reachable_specs(ops))
    for m in (1, 32, 64, 128, 256):
        assert choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=8).tail is not Tail.SPLIT
    assert GemmConfig(tail=Tail.SPLIT).short_name() != GemmConfig().short_name()


def test_bf16_192_row_tile_width_follows_the_rounds():
    """expected_m 97..144 (bf16): 192x128 where its rounds, at WIDE_UNIT_COST
    per half of a unit, beat 192x64's; the measured cases of docs/design.md."""
    from flashgemm.sm90.heuristic import MID_192_N128_CONFIG, Facts, expected_rounds, mid_192_wide_wins

    # dsv3-ep32 (E 8, m 128): gate_up N 4096 has 2 rounds of 192x128 against 4;
    # down N 7168 has 4 against 7, where 192x128 lost (1.040)
    assert expected_rounds(MID_192_N128_CONFIG, 8, 128, 4096, 132) == 2
    assert expected_rounds(MID_192_CONFIG, 8, 128, 4096, 132) == 4
    assert expected_rounds(MID_192_N128_CONFIG, 8, 128, 7168, 132) == 4
    assert expected_rounds(MID_192_CONFIG, 8, 128, 7168, 132) == 7
    assert choose_config(128, 4096, 4096, 7168, 132, num_experts=8) == MID_192_N128_CONFIG
    assert choose_config(128, 4096, 7168, 2048, 132, num_experts=8) == MID_192_CONFIG
    assert mid_192_wide_wins(Facts(128, 4096, 7168, 132, 8))
    assert not mid_192_wide_wins(Facts(128, 3072, 7168, 132, 8))  # 2 rounds against 3
    assert not mid_192_wide_wins(Facts(128, 4096, 7168, 132, None))
    # without num_experts the rounds are unknown: the 64-wide tile
    assert choose_config(128, 4096, 4096, 7168, 132) == MID_192_CONFIG
    # m-blocks: 0.7..1.3 x expected_m against the tile edges (128-row tile,
    # m 128: half the experts take a second m-block)
    assert expected_rounds(MID_CONFIG, 66, 128, 256, 132) == 2  # 66 * 1.5 * 1 units on 66 clusters
    assert expected_rounds(MID_CONFIG, 66, 60, 256, 132) == 1


def test_fp8_heuristic_regimes():
    from flashgemm.sm90.launch import resolve_config
    from flashgemm.sm90.heuristic import (
        FP8_DECODE_CONFIG, FP8_DECODE_N64_CONFIG, FP8_MID_CONFIG, FP8_PREFILL_CONFIG,
        FP8_PREFILL_N128_CONFIG,
    )

    # decode: 64-wide tiles from K 4096 on (units whose time grows with K)
    assert choose_config(32, 1024, 7168, 2048, 132, fp8=True) == FP8_DECODE_CONFIG
    assert choose_config(48, 1024, 4096, 4095, 132, fp8=True) == FP8_DECODE_CONFIG
    assert choose_config(32, 1024, 4096, 7168, 132, fp8=True) == FP8_DECODE_N64_CONFIG
    assert choose_config(48, 1024, 3072, 4096, 132, fp8=True) == FP8_DECODE_N64_CONFIG
    assert FP8_DECODE_N64_CONFIG == FP8_DECODE_CONFIG.replace(tile_n=64)
    assert _reachable(FP8, FP8_DECODE_N64_CONFIG)
    assert _reachable(FP8, FP8_DECODE_N64_CONFIG.replace(cluster_n=1))
    assert choose_config(32, 1024, 4096, 7168, 1, fp8=True) == FP8_DECODE_N64_CONFIG.replace(cluster_n=1)
    # expected_m 64: every expert fits one 128-row m-block, so the L2 hints are on
    assert choose_config(64, 1024, 4096, 1536, 132, fp8=True) == FP8_MID_CONFIG.replace(l2_hints=True)
    assert choose_config(98, 1024, 4096, 1536, 132, fp8=True).l2_hints
    # 99 rows: two m-blocks; their 2 x 16 units fit the 66 clusters of 132 SMs
    assert choose_config(99, 1024, 4096, 1536, 132, fp8=True).l2_hints
    assert not choose_config(99, 1024, 4096, 1536, 40, fp8=True).l2_hints
    assert not choose_config(197, 4096, 4096, 7168, 132, fp8=True).l2_hints  # three m-blocks
    assert choose_config(128, 4096, 7168, 2048, 132, fp8=True) == FP8_MID_CONFIG.replace(l2_hints=True)
    assert choose_config(128, 4096, 4096, 7168, 132, fp8=True) == FP8_MID_CONFIG.replace(l2_hints=True)
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
    assert FP8_PREFILL_CONFIG == FP8_MID_CONFIG.replace(
        tile_n=192, promotion=Promotion.TWO_PARTS, order=TileOrder.EXPERT_MAJOR, tail=Tail.SPLIT,
        a_chunk_rows=0, staging=Staging.WHOLE_TILE,
    ) and FP8_MID_CONFIG.n_major and FP8_MID_CONFIG.promotion is Promotion.OVERLAPPED
    # the whole-tile staging only where it was measured to pay: the fp8
    # prefill tiles (not bf16's 128x256, not the mostly partial mid tiles)
    assert FP8_PREFILL_N128_CONFIG == FP8_PREFILL_CONFIG.replace(tile_n=128, promotion=Promotion.OVERLAPPED)
    whole = [s for s in reachable_specs() if s.config.staging is Staging.WHOLE_TILE]
    assert {(s.config.tile_n, s.fmt.tile_k) for s in whole} == {(192, 128), (128, 128)}
    assert all(s.config.tail is Tail.SPLIT or s.config.tail is Tail.BALANCE and not s.config.n_major
               for s in whole)
    # with signals the last round stays whole (a signal counts whole tiles)
    # and is balanced, as before the split
    for e, cfg in ((4, FP8_PREFILL_CONFIG), (None, FP8_PREFILL_N128_CONFIG)):
        signalled = choose_config(1024, 4096, 7168, 2048, 132, fp8=True, num_experts=e, signals=True)
        assert signalled == cfg.replace(tail=Tail.BALANCE)
        assert _reachable(FP8, signalled, signals=True) and _reachable(FP8, cfg)
    assert not any(c.tail is Tail.SPLIT for c in FP8_CONFIGS if c.tile_m == 64 or c.n_major)
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
        assert signalled == plain.replace(n_major_window=FP8_SIGNAL_WINDOW), m
        assert _reachable(FP8, signalled, signals=True) and _reachable(FP8, plain)

    assert resolve_config(None, FP8, 128, 4096, 7168, 2048, 132, 8, signals=True).n_major_window
    assert not resolve_config(None, FP8, 128, 4096, 7168, 2048, 132, 8).n_major_window
    # an explicit config is the caller's choice, signals or not
    assert not resolve_config(FP8_MID_CONFIG, FP8, None, 4096, 7168, 2048, 132, 8, signals=True).n_major_window
    single = choose_config(32, 1024, 4096, 7168, 1, fp8=True)
    assert single.cluster_n == 1 and _reachable(FP8, single)
    for cfg in FP8_CONFIGS:
        assert cfg.tile_mnk(FP8)[2] == 128 and check_config(cfg, FP8) is cfg
        # two product sets on the two-warpgroup mid tiles (5-8% faster), one
        # on the one-warpgroup decode tile (no gain there) and on the
        # 192-wide prefill tile (no registers for a third set)
        assert (cfg.promotion is Promotion.OVERLAPPED) == (cfg.consumer_warpgroups == 2 and cfg.tile_n <= 128)
        assert cfg.tile_n <= 128 or cfg == FP8_PREFILL_CONFIG.replace(cluster_n=cfg.cluster_n, tail=cfg.tail, staging=cfg.staging)
    assert _reachable(FP8, FP8_PREFILL_N128_CONFIG.replace(cluster_n=1))


def test_fp8_wave_rule_picks_narrow_tiles_only_for_a_nearly_empty_last_round():
    from flashgemm.sm90.heuristic import (
        FP8_MID_CONFIG, FP8_MID_N64_CONFIG, FP8_PREFILL_CONFIG, FP8_PREFILL_N128_CONFIG, wave_efficiency,
    )

    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "moe_cases.json")) as f:
        spec = json.load(f)
    cases = {c["name"]: c for c in spec["cases"]}

    def pick(name, num_sms=132):
        c = cases[name]
        return choose_config(c["expected_m"], c["max_m"], c["N"], c["K"], num_sms, fp8=True,
                             num_experts=c["E"])

    # qwen3-30b-ep8: 16 experts x 6 n-groups of 128x128 = 96 units on 66 clusters
    c = cases["qwen3-30b-ep8-gate_up"]
    assert wave_efficiency(FP8_MID_CONFIG, c["E"], c["expected_m"], c["N"], 132) == pytest.approx(96 / 132)
    assert pick("qwen3-30b-ep8-gate_up") == FP8_MID_N64_CONFIG.replace(l2_hints=True)
    # rounds already full with 128x128: keep it (64-wide tiles re-read A twice as often)
    for name in ("dsv3-ep32-gate_up", "dsv3-ep32-down", "qwen3-235b-ep8-gate_up", "qwen3-235b-ep8-down"):
        assert pick(name).replace(l2_hints=False, order=TileOrder.N_MAJOR) == FP8_MID_CONFIG, name
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
    from flashgemm.sm90.heuristic import wave_efficiency

    # 8 experts x 1.5 m-blocks x 28 n-groups = 336 units on 66 clusters: 6 rounds
    assert wave_efficiency(MID_CONFIG, 8, 128, 7168, 132) == pytest.approx(336 / 396)
    assert wave_efficiency(MID_CONFIG, 1, 1, 128, 132) == pytest.approx(1 / 66)
    assert 0 < wave_efficiency(MID_CONFIG, 256, 4096, 7168, 132) <= 1


# ---------------------------------------------------------------------------
# reachable_specs is exactly what choose_config can return
# ---------------------------------------------------------------------------

SWEEP_EXPECTED_M = (
    None, 0, 1, 8, 16, 32, 48, 49, 64, 96, 97, 128, 144, 145, 196, 197, 256, 257, 512, 1024, 2048, 4096,
)
SWEEP_MAX_M = (64, 256, 1024, 4096)
# every N and every K of the grid, paired: the full product of the two took
# four times as long (450k calls, 16 s) and reached nothing more
SWEEP_NK = tuple(zip((256, 1536, 2048, 4096, 7168, 14336), itertools.cycle((512, 2048, 4096, 7168))))
SWEEP_SMS = (1, 2, 20, 66, 112, 132)
SWEEP_EXPERTS = (None, 1, 2, 4, 8, 16, 32, 64, 256)


def test_heuristic_sweep_yields_exactly_the_reachable_specs():
    """choose_config over a grid that crosses every regime edge: the kernels
    it picks (no signal mode without signals, either granularity with them,
    the fused-combine epilogue with combine), and the fused-SwiGLU gate_up
    kernels ``choose_activation_config`` picks, are exactly
    ``reachable_specs()``, which precompile builds."""
    got = set()
    calls = 0
    for fp8, m, max_m, (n, k), num_sms, e in itertools.product(
        (False, True), SWEEP_EXPECTED_M, SWEEP_MAX_M, SWEEP_NK, SWEEP_SMS, SWEEP_EXPERTS
    ):
        ops = FP8 if fp8 else BF16
        for use in ("plain", "signals", "combine"):
            cfg = choose_config(m, max_m, n, k, num_sms, fp8=fp8, num_experts=e, signals=use == "signals",
                                combine=use == "combine")
            got |= _specs(ops, cfg, use)
            calls += 1
        if not (fp8 and num_sms < 2):  # (an fp8 fused SwiGLU runs 2-CTA clusters)
            act = choose_activation_config(m, max_m, n, k, num_sms, fp8, e)
            got.add(KernelSpec(act, ops, None, Epilogue.SWIGLU_FP8 if fp8 else Epilogue.SWIGLU_BF16))
    assert calls > 100_000
    want = set(reachable_specs(BF16)) | set(reachable_specs(FP8))  # (MXFP4 weights: test_mxfp4_kernel)
    assert len(want) == 250
    assert sum(s.epilogue.activates for s in want) == 16
    for epi in family("combine"):  # one build per target, with and without a bias, of each combine config
        assert sum(s.epilogue is epi for s in want) == 26, epi
    missing = sorted(s.name() for s in want - got)
    extra = sorted(s.name() for s in got - want)
    assert not missing and not extra, (missing, extra)
    assert set(reachable_specs(BF16)) | set(reachable_specs(FP8)) | set(reachable_specs(Format.FP8_MXFP4)) \
        | set(reachable_specs(Format.BF16_MXFP4)) == set(reachable_specs())
    assert all(s.fmt is BF16 for s in reachable_specs(BF16))
    assert all(s.fmt is FP8 for s in reachable_specs(FP8))


def test_precompile_default_builds_exactly_the_reachable_specs(monkeypatch):
    """precompile() with no list stores every reachable spec, once each, in
    reachable_specs() order, then one combine per signalled tile_m; with a
    list, those specs alone. Recorded, not compiled."""
    import flashgemm
    from flashgemm.jit import cache
    from flashgemm.sm90 import build

    built, stored = [], []
    monkeypatch.setattr(build, "build", lambda spec, arch=None, **kw: built.append(spec) or ("gemm", spec))
    monkeypatch.setattr(
        build, "build_combine",
        lambda block_m, arch=None, keep_ptx=False, rows_per_item=None: ("combine", block_m, rows_per_item),
    )

    def record(key, compile_fn, cache_dir=None):
        stored.append((key, cache_dir))
        return compile_fn()

    monkeypatch.setattr(cache, "store", record)
    from flashgemm.moe import activation

    monkeypatch.setattr(activation, "build", lambda fp8, arch=None, keep_ptx=False,
                        kind=activation.ActivationKind.SILU: (kind.value, fp8))
    from flashgemm.ep import combine as ep_combine

    monkeypatch.setattr(ep_combine, "build_ep_combine", lambda m, rows, arch=None, **kw: ("ep_combine", m))
    monkeypatch.setattr(ep_combine, "build_ep_complete", lambda arch=None, **kw: ("ep_complete",))
    monkeypatch.setattr(ep_combine, "build_token_sum", lambda k, ids, out, arch=None, **kw: ("ep_sum", k))
    from flashgemm.ep import device_dispatch

    monkeypatch.setattr(device_dispatch, "build_ep_dispatch", lambda k, fp8, ids, arch=None, **kw: ("ep_disp", k))
    count = flashgemm.precompile(arch="sm_90a", cache_dir="/nonexistent/never-written")
    specs = reachable_specs()
    gemm_keys = [k for k, _ in stored if isinstance(k[-1], KernelSpec)]
    combine_keys = [k for k, _ in stored if "combine" in k]
    assert [k[-1] for k in gemm_keys] == list(specs) == built
    assert all(k[3] == "sm_90a" for k in gemm_keys)
    block_ms = build.combine_block_ms(specs)
    assert block_ms == sorted({s.config.tile_m for s in specs if s.signal_mode}) == [64, 128, 192]
    from flashgemm.signals import DEFAULT_ROWS_PER_ITEM

    assert [k[-3:] for k in combine_keys] == [("combine", m, DEFAULT_ROWS_PER_ITEM) for m in block_ms]
    assert combine_keys == [build.combine_key("sm_90a", m, DEFAULT_ROWS_PER_ITEM) for m in block_ms]
    activation_keys = [k for k, _ in stored if "silu_mul" in k or "gpt_oss" in k]
    assert activation_keys == [activation.activation_key("sm_90a", fp8, kind)
                               for kind in activation.ActivationKind for fp8 in (True, False)]
    # the expert-parallel kernels: a signalled combine per tile_m, the completion step, the device
    # dispatch (fp8 / bf16 rows x int32 / int64 ids) and 4 sums for top-8
    ep_keys = [k for k, _ in stored if any(str(part).startswith("ep_") for part in k)]
    assert ep_keys == [key for _, key, _ in ep_combine.ep_kernel_jobs("sm_90a", block_ms)]
    assert len(ep_keys) == len(block_ms) + 1 + 4 + 4
    assert count == len(stored) == len(specs) + len(block_ms) + 4 + len(ep_keys)
    assert {d for _, d in stored} == {"/nonexistent/never-written"}
    # an explicit list: those kernels, no combine
    stored.clear()
    built.clear()
    few = specs[:2]
    assert flashgemm.precompile(few, arch="sm_90a") == 2
    assert [k[-1] for k, _ in stored] == list(few) == built


def test_benchmark_reads_back_every_config_name(bench_script):
    """The benchmark's --configs takes the short names the tables print."""
    for cfg in BF16_CONFIGS + FP8_CONFIGS + (GemmConfig(l2_warmup=False, pdl=False), GemmConfig(stages=4)):
        back = bench_script.parse_config(cfg.short_name())
        assert back.short_name() == cfg.short_name(), cfg
        assert back == cfg, cfg


def test_benchmark_set_option_reads_fields(bench_script):
    """--set FIELD=VALUE of ab_revision.py and bench_overlap.py: bools from 0/1,
    ints as given, and a field GemmConfig lacks goes to the parser's error."""
    assert bench_script.parse_config_changes(["tile_n=64", "pdl=0", "l2_hints=1"], None) == {
        "tile_n": 64, "pdl": False, "l2_hints": True,
    }

    class Refused(Exception):
        pass

    def error(message):
        raise Refused(message)

    with pytest.raises(Refused, match="no field 'tile_q'"):
        bench_script.parse_config_changes(["tile_q=3"], error)


def test_top_level_exports():
    import flashgemm
    from flashgemm import config, formats, signals, version

    names = {"GemmConfig", "KernelSpec", "Promotion", "Staging", "Tail", "TileOrder",
             "choose_config", "grouped_gemm_nt_masked", "signal_layout", "SignalLayout", "alloc_signals",
             "precompile", "reference", "__version__"}
    assert names <= set(flashgemm.__all__)
    for name in names:
        assert getattr(flashgemm, name) is not None, name
    for name in ("GemmConfig", "KernelSpec", "Promotion", "Staging", "Tail", "TileOrder"):
        assert getattr(flashgemm, name) is getattr(config, name)
    assert flashgemm.Format is formats.Format and not hasattr(flashgemm, "Operands")  # one format name
    assert flashgemm.SignalLayout is signals.SignalLayout and flashgemm.alloc_signals is signals.alloc_signals
    from flashgemm.api import grouped_gemm_nt_masked, signal_layout

    assert flashgemm.grouped_gemm_nt_masked is grouped_gemm_nt_masked
    assert flashgemm.signal_layout is signal_layout
    assert flashgemm.__version__ == version.__version__


FIELD_TYPE_ERRORS = [
    ("tile_m", 128.0, "an int"),
    ("tile_n", 128.0, "an int"),
    ("stages", 2.5, "an int"),
    ("cluster_n", True, "an int"),
    ("n_major_window", 0.0, "an int"),
    ("a_chunk_rows", False, "an int"),
    ("l2_hints", "no", "a bool"),
    ("pdl", 1, "a bool"),
    ("l2_warmup", None, "a bool"),
    ("order", "expert_major", "a flashgemm.TileOrder"),
    ("tail", None, "a flashgemm.Tail"),
    ("promotion", 0, "a flashgemm.Promotion"),
    ("staging", "pair", "a flashgemm.Staging"),
]


@pytest.mark.parametrize("field, value, want", FIELD_TYPE_ERRORS, ids=[f[0] for f in FIELD_TYPE_ERRORS])
def test_config_field_types_are_checked(field, value, want):
    """Values equal to valid ones (128.0 == 128, True == 1) or truthy ones
    ('no') must not pass: the field and the type expected are named."""
    import re

    cfg = GemmConfig(**{field: value})
    message = f"^config.{field} must be {re.escape(want)}, got {re.escape(repr(value))} \\({type(value).__name__}\\)$"
    for ops in (BF16, FP8):
        with pytest.raises(ValueError, match=message):
            check_config(cfg, ops)


def test_config_equality_sees_field_types():
    """Configs key the compile cache and the launch plans: one whose fields
    only equal a valid config's (128.0, True) is another config, so it
    cannot reuse that config's checks or plans."""
    assert GemmConfig(tile_m=128) == GemmConfig() and hash(GemmConfig(tile_m=128)) == hash(GemmConfig())
    for odd in (GemmConfig(tile_m=128.0), GemmConfig(cluster_n=True), GemmConfig(l2_hints=0)):
        assert odd != GemmConfig() and GemmConfig() != odd
        assert len({GemmConfig(): 1, odd: 2}) == 2
    assert KernelSpec(GemmConfig(tile_m=128.0), BF16) != KernelSpec(GemmConfig(), BF16)
    assert GemmConfig().__eq__("m128n128") is NotImplemented


def test_config_unhashable_field_is_named():
    with pytest.raises(TypeError, match=r"^GemmConfig\.tile_n must be an int, got list$"):
        GemmConfig(tile_n=[128])
