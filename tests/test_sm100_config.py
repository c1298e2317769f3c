"""sm_100 kernel family, host side (no compile): config legality, the
heuristic's closure over reachable_specs, and the signal counters the
kernel's indexing produces against ``flashgemm.signals``' layout."""

import itertools
import random
import zlib

import pytest
import torch

from flashgemm.formats import Format
from flashgemm.schedule.model import tile_order
from flashgemm.schedule.rules import clamp_rows
from flashgemm.signals import make_signal_layout
from flashgemm.sm100 import limits
from flashgemm.sm100.build import signal_block
from flashgemm.sm100.config import SIGNAL_MODES, CtaGroup, Sm100Config, Sm100Spec
from flashgemm.sm100.heuristic import choose_config, reachable_specs
from flashgemm.sm100.limits import check_config, check_spec

FORMATS = (Format.MXFP8, Format.NVFP4, Format.BF16, Format.MXFP8_MXFP4)


def test_reachable_specs_are_legal_unique_and_modest():
    specs = reachable_specs()
    assert 20 <= len(specs) <= 40
    assert len({s.name() for s in specs}) == len(specs)
    for spec in specs:
        check_spec(spec)
        assert limits.smem_bytes(spec.config) <= limits.SMEM_BYTES
        assert limits.tmem_cols(spec.config) <= limits.TMEM_COLS
        assert limits.resolved_stages(spec.config) >= 2
    # every format, signal mode and both CTA groups are built
    assert {s.config.fmt for s in specs} == set(FORMATS)
    assert {s.signal_mode for s in specs} == set(SIGNAL_MODES)
    assert {s.config.cta_group for s in specs} == set(CtaGroup)
    # alpha exactly for NVFP4
    assert all(s.config.has_alpha == (s.config.fmt is Format.NVFP4) for s in specs)


@pytest.mark.parametrize("changes, field", [
    (dict(tile_m=256), "config.tile_m"),  # 256 rows need a CTA pair
    (dict(tile_m=128, cta_group=CtaGroup.TWO), "config.tile_m"),
    (dict(tile_m=64), "config.tile_m"),
    (dict(tile_n=192), "config.tile_n"),
    (dict(tile_n=32), "config.tile_n"),
    (dict(tile_m=256, tile_n=64, cta_group=CtaGroup.TWO), "config.tile_n"),
    (dict(stages=1), "config.stages"),
    (dict(stages=-1), "config.stages"),
    (dict(stages=True), "config.stages"),
    (dict(stages=40), "config.stages"),  # far past shared memory
    (dict(fmt=Format.FP8_BLOCK128), "config.fmt"),
    (dict(cta_group=2), "config.cta_group"),
])
def test_illegal_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_config(Sm100Config().replace(**changes))


def test_check_rejects_other_types_and_signal_modes():
    with pytest.raises(TypeError):
        check_config("128x128")
    with pytest.raises(ValueError, match=r"spec\.signal_mode"):
        check_spec(Sm100Spec(Sm100Config(), "tile"))


def test_budget_numbers():
    # a 2-CTA pair loads half of B per CTA; 256-wide tiles keep one TMEM accumulator
    pair = Sm100Config(tile_m=256, tile_n=256, cta_group=CtaGroup.TWO)
    assert limits.stage_bytes(pair) == (128 + 128) * 128 + limits.sf_bytes(pair)
    assert limits.acc_stages(pair) == 1 and limits.acc_stages(Sm100Config()) == 2
    assert limits.sf_bytes(Sm100Config(fmt=Format.BF16)) == 0
    # NVFP4: a 128-byte k-tile is 256 elements, 16 scales per row
    assert limits.tile_k(Format.NVFP4) == 256 and limits.sf_bytes(Sm100Config(fmt=Format.NVFP4)) == 256 * 16
    # MXFP4 weights sit padded in shared memory: a stage as large as MXFP8's
    for tile_n in (64, 128, 256):
        mx4, mx8 = Sm100Config(fmt=Format.MXFP8_MXFP4, tile_n=tile_n), Sm100Config(fmt=Format.MXFP8, tile_n=tile_n)
        assert limits.stage_bytes(mx4) == limits.stage_bytes(mx8) and limits.tmem_cols(mx4) == limits.tmem_cols(mx8)
    # the explicit stage count is what is used
    assert limits.resolved_stages(Sm100Config(stages=3)) == 3


def test_choose_config_stays_within_reachable_specs():
    reachable = {(s.config, s.signal_mode) for s in reachable_specs()}
    picked = set()
    for fmt, e, m, n, sms, mode in itertools.product(
        FORMATS, (1, 4, 8, 32, 256), (1, 7, 32, 100, 128, 200, 256, 1000, 4096),
        (128, 2048, 4096, 7168), (1, 20, 112, 132, 148), SIGNAL_MODES,
    ):
        for expected in (None, 1, m // 2 or 1, m):
            cfg = choose_config(fmt, e, m, n, 7168, expected, sms, mode)
            assert (cfg, mode) in reachable, (fmt, e, m, n, sms, mode, expected)
            assert cfg.fmt is fmt
            picked.add(cfg)
    # every reachable config is reachable indeed
    assert picked == {s.config for s in reachable_specs()}


def test_choose_config_regimes():
    small = choose_config(Format.MXFP8, 4, 4096, 2048, 7168, 8, 148)  # 64 tiles of 128x128
    assert (small.tile_m, small.tile_n) == (128, 64)  # few tiles: narrow ones spread over more SMs
    mid = choose_config(Format.MXFP8, 32, 4096, 4096, 7168, 64, 148)
    assert (mid.tile_m, mid.tile_n) == (128, 128)
    big = choose_config(Format.NVFP4, 32, 4096, 4096, 7168, 1024, 148)
    assert big.cta_group is CtaGroup.TWO and (big.tile_m, big.tile_n) == (256, 256)
    with pytest.raises(ValueError, match="fmt"):
        choose_config(Format.FP8_BLOCK128, 8, 128, 128, 128, 8, 132)
    with pytest.raises(ValueError, match="signal_mode"):
        choose_config(Format.MXFP8, 8, 128, 128, 128, 8, 132, "tile")


def _kernel_counters(spec, masked_m, max_m, n, num_clusters):
    """Counter values the kernel adds, from its own indexing (``walk``) over
    the cluster-level tile order the walker follows (``schedule.model``)."""
    from flashgemm.sm100.walk import cta_rows, signal_index

    cfg = spec.config
    counts = {}
    order = tile_order(masked_m, max_m, n, cfg.tile_m, cfg.tile_n, num_clusters)
    num_m_slots = -(-max_m // cfg.cta_tile_m)
    for units in order:
        for e, mb, nb in units:
            valid = min(clamp_rows(masked_m[e], max_m) - mb * cfg.tile_m, cfg.tile_m)
            assert valid > 0
            for v in range(cfg.cluster_size):  # both CTAs of a pair take the unit
                if int(cta_rows(valid, v, cfg.cta_tile_m)) > 0:
                    i = int(signal_index(spec.signal_mode, e, mb, v, cfg.cluster_size, num_m_slots))
                    counts[i] = counts.get(i, 0) + 1
    return counts


@pytest.mark.parametrize("spec", [s for s in reachable_specs() if s.signal_mode], ids=lambda s: s.name())
def test_signal_block_matches_the_host_layout(spec):
    rng = random.Random(zlib.crc32(spec.name().encode()))  # the same cases every run
    cases = [([0], 64, 256), ([5], 5, 64), ([300, 0, 129, 1000, -3], 1000, 1000), ([0, 0, 0], 256, 128)]
    for _ in range(6):
        e = rng.choice((1, 2, 9, 40))
        max_m = rng.choice((1, 127, 128, 129, 255, 256, 257, 700))
        cases.append(([rng.randint(-2, max_m + 5) for _ in range(e)], max_m, rng.choice((64, 136, 384, 1000))))
    for masked_m, max_m, n in cases:
        layout = make_signal_layout(spec.signal_mode, max_m, n, *signal_block(spec), len(masked_m))
        for clusters in (1, 3, 66):
            counts = _kernel_counters(spec, masked_m, max_m, n, clusters)
            assert all(0 <= i < layout.size for i in counts), (masked_m, max_m, n)
            got = [counts.get(i, 0) for i in range(layout.size)]
            want = layout.final_values(torch.tensor(masked_m, dtype=torch.int32), max_m).tolist()
            assert got == want, (spec.name(), masked_m, max_m, n, clusters)


def test_signal_block_is_the_cta_tile():
    for spec in reachable_specs():
        assert signal_block(spec) == (128, spec.config.tile_n)


def test_precompile_dispatches_by_arch(monkeypatch):
    """flashgemm.precompile builds the target backend's kernels (sm100's for
    an sm_10x target, sm90's otherwise), the four MoE activations, and the
    expert-parallel kernels where the backend has the fused combines
    (nothing is built here: all are stubbed)."""
    import flashgemm
    from flashgemm import backend
    from flashgemm.ep import combine as ep_combine
    from flashgemm.jit import cache

    calls = []
    monkeypatch.setattr(backend.get("sm100"), "precompile", lambda *a, **kw: calls.append(("sm100", kw["arch"])) or 1)
    monkeypatch.setattr(backend.get("sm90"), "precompile", lambda *a, **kw: calls.append(("sm90", kw["arch"])) or 2)
    monkeypatch.setattr(ep_combine, "precompile", lambda *a, **kw: calls.append(("ep", kw["arch"])) or 5)
    monkeypatch.setattr(cache, "store", lambda key, make, cache_dir=None: calls.append(("store", key[-2])))
    assert flashgemm.precompile(arch="sm_103a") == 1 + 4
    assert flashgemm.precompile(arch="sm_90a") == 2 + 4 + 5
    assert flashgemm.precompile([], arch="sm_90a") == 2  # an explicit list: those kernels only
    act = [("store", "silu_mul")] * 2 + [("store", "gpt_oss")] * 2
    assert calls == [("sm100", "sm_103a"), *act, ("sm90", "sm_90a"), *act, ("ep", "sm_90a"), ("sm90", "sm_90a")]
