"""Which sm_90a kernel a call gets: a regime table over the expected rows per
expert, then a few rules that refine the pick from host-side facts only
(masked_m is never read). ``reachable_specs`` is the exact set of kernels the
table and its rules can return: what ``precompile`` builds.

The measurements behind every row and rule are in ``docs/design.md``
("Tile choice per regime").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from ..config import (
    SIGNAL_MODES,
    SWIGLU_TILE_N,
    Epilogue,
    GemmConfig,
    KernelSpec,
    Promotion,
    Staging,
    Tail,
    TileOrder,
)
from ..epilogue import family as epilogue_family
from ..formats import Format
from .limits import SM90_FORMATS

A_CHUNK_ROWS = 32
# the fused combine's builds (every epilogue of the "combine" family: fp32 and
# bf16 sums, bf16 rows stored into the owner ranks' receive buffers, each with
# and without a per-expert bias); one configuration each
COMBINES = epilogue_family("combine")

# ---- bf16 tiles -------------------------------------------------------------
DECODE_CONFIG = GemmConfig(
    tile_m=64, tile_n=64, cluster_n=2, order=TileOrder.DYNAMIC, a_chunk_rows=A_CHUNK_ROWS,
    l2_hints=True,
)
DECODE_128_CONFIG = GemmConfig(
    tile_m=128, tile_n=64, cluster_n=2, a_chunk_rows=A_CHUNK_ROWS, l2_hints=True
)
MID_192_CONFIG = GemmConfig(
    tile_m=192, tile_n=64, cluster_n=2, a_chunk_rows=A_CHUNK_ROWS, l2_hints=True
)
MID_192_N128_CONFIG = MID_192_CONFIG.replace(tile_n=128)
MID_CONFIG = GemmConfig(
    tile_m=128, tile_n=128, cluster_n=2, tail=Tail.BALANCE, a_chunk_rows=A_CHUNK_ROWS
)
PREFILL_CONFIG = GemmConfig(tile_m=128, tile_n=256, cluster_n=2, tail=Tail.SPLIT)

# ---- block-scaled fp8 tiles -------------------------------------------------
FP8_DECODE_CONFIG = GemmConfig(
    tile_m=64, tile_n=128, cluster_n=2, order=TileOrder.DYNAMIC, a_chunk_rows=A_CHUNK_ROWS,
    l2_hints=True,
)
FP8_DECODE_N64_CONFIG = FP8_DECODE_CONFIG.replace(tile_n=64)
FP8_MID_CONFIG = MID_CONFIG.replace(order=TileOrder.N_MAJOR, promotion=Promotion.OVERLAPPED)
FP8_MID_N64_CONFIG = DECODE_128_CONFIG.replace(
    order=TileOrder.N_MAJOR, promotion=Promotion.OVERLAPPED, l2_hints=False
)
FP8_PREFILL_CONFIG = GemmConfig(
    tile_m=128, tile_n=192, cluster_n=2, tail=Tail.SPLIT, promotion=Promotion.TWO_PARTS,
    staging=Staging.WHOLE_TILE,
)
FP8_PREFILL_N128_CONFIG = FP8_PREFILL_CONFIG.replace(tile_n=128, promotion=Promotion.OVERLAPPED)

# ---- the rules' constants ---------------------------------------------------
WIDE_UNIT_COST = 0.93  # a 192x128 bf16 unit against two 192x64 ones
FP8_DECODE_N64_MIN_K = 4096  # fp8 decode: 64-wide tiles from this K on
FP8_NARROW_WAVE_GAIN = 0.15  # fp8 mid: 128x64 when its rounds are this much fuller
FP8_WIDE_MIN_ROUNDS = 4  # fp8 prefill: 128x192 needs this many expected rounds ...
FP8_WIDE_MAX_K = 2048  # ... and, past this K, rounds at most
FP8_WIDE_ROUND_SLACK = 1.1  # this much coarser than 128x128's (a wide unit is 1.5 narrow ones)
FP8_SIGNAL_WINDOW = 1  # signalled fp8 n-major calls walk the expert-major order
M_SPREAD = 1.3  # m_e is expected within expected_m * [0.7, 1.3]


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the host knows when it picks: never masked_m itself."""

    m: int  # expected rows per expert, clamped into [1, max_m]
    n: int
    k: int
    num_sms: int
    num_experts: Optional[int]


@dataclasses.dataclass(frozen=True)
class Regime:
    """Expected rows per expert up to ``up_to_m`` (inclusive) get ``config``,
    or ``alternative`` where ``prefer_alternative(facts)`` holds."""

    up_to_m: float
    config: GemmConfig
    why: str
    alternative: Optional[GemmConfig] = None
    prefer_alternative: Optional[Callable[[Facts], bool]] = None
    # False where the rule never prefers the alternative on a grid of one SM
    alternative_on_one_sm: bool = True

    def pick(self, facts: Facts) -> GemmConfig:
        if self.alternative is not None and self.prefer_alternative(facts):
            return self.alternative
        return self.config


def _units_and_rounds(cfg: GemmConfig, num_experts: int, m_blocks: float, n: int, num_sms: int):
    units = max(1, round(num_experts * m_blocks * cfg.n_groups(n)))
    return units, -(-units // cfg.n_clusters(num_sms))


def wave_efficiency(cfg: GemmConfig, num_experts: int, expected_m: int, n: int, num_sms: int) -> float:
    """Share of the grid's rounds that is busy: an expert whose mean fills a
    tile spills into a second m-block about half the time."""
    m_blocks = max(1.0, expected_m / cfg.tile_m + 0.5)
    units, rounds = _units_and_rounds(cfg, num_experts, m_blocks, n, num_sms)
    return units / (rounds * cfg.n_clusters(num_sms))


def expected_rounds(cfg: GemmConfig, num_experts: int, expected_m: int, n: int, num_sms: int) -> int:
    """Rounds of the persistent grid with m_e spread evenly over
    expected_m * [0.7, 1.3]."""
    lo, hi = 0.7 * expected_m, M_SPREAD * expected_m
    m_blocks, edge = 1.0, cfg.tile_m
    while edge < hi:  # the share of experts past each further m-block edge
        m_blocks += (hi - max(edge, lo)) / (hi - lo)
        edge += cfg.tile_m
    return _units_and_rounds(cfg, num_experts, m_blocks, n, num_sms)[1]


def mid_192_wide_wins(f: Facts) -> bool:
    """bf16 97..144 rows: 192x128 where its rounds, each worth
    2 * WIDE_UNIT_COST rounds of 192x64, take less time."""
    if not f.num_experts:
        return False
    wide = expected_rounds(MID_192_N128_CONFIG, f.num_experts, f.m, f.n, f.num_sms)
    narrow = expected_rounds(MID_192_CONFIG, f.num_experts, f.m, f.n, f.num_sms)
    return 2 * WIDE_UNIT_COST * wide < narrow


def fp8_decode_narrow(f: Facts) -> bool:
    """A unit's time grows with K; 64-wide units shorten the launch's tail."""
    return f.k >= FP8_DECODE_N64_MIN_K


def fp8_mid_narrow(f: Facts) -> bool:
    """128x64 where its rounds are much fuller than 128x128's."""
    if not f.num_experts:
        return False
    wide = wave_efficiency(FP8_MID_CONFIG, f.num_experts, f.m, f.n, f.num_sms)
    narrow = wave_efficiency(FP8_MID_N64_CONFIG, f.num_experts, f.m, f.n, f.num_sms)
    return narrow - wide >= FP8_NARROW_WAVE_GAIN


def fp8_prefill_wide(f: Facts) -> bool:
    """128x192 where at least FP8_WIDE_MIN_ROUNDS rounds of it are expected
    and, past FP8_WIDE_MAX_K, its rounds cost at most FP8_WIDE_ROUND_SLACK
    times those of 128x128."""
    if not f.num_experts:
        return False
    wide = expected_rounds(FP8_PREFILL_CONFIG, f.num_experts, f.m, f.n, f.num_sms)
    if wide < FP8_WIDE_MIN_ROUNDS:
        return False
    if f.k <= FP8_WIDE_MAX_K:
        return True
    narrow = expected_rounds(FP8_PREFILL_N128_CONFIG, f.num_experts, f.m, f.n, f.num_sms)
    return 1.5 * wide <= FP8_WIDE_ROUND_SLACK * narrow


BF16_REGIMES = (
    Regime(48, DECODE_CONFIG, "a few rows: 64-row tiles, units claimed dynamically"),
    Regime(96, DECODE_128_CONFIG, "m_e may pass 64: one 128-row m-block per expert"),
    Regime(144, MID_192_CONFIG, "m_e under 192: one 192-row m-block per expert",
           MID_192_N128_CONFIG, mid_192_wide_wins),
    Regime(256, MID_CONFIG, "128x128, rounds balanced"),
    Regime(math.inf, PREFILL_CONFIG, "128x256, a thin last round split in halves"),
)
FP8_REGIMES = (
    Regime(48, FP8_DECODE_CONFIG, "64x128, units claimed dynamically",
           FP8_DECODE_N64_CONFIG, fp8_decode_narrow),
    # (on one SM every round of either width is full: the wave rule keeps 128x128)
    Regime(256, FP8_MID_CONFIG, "128x128 n-group-major, two product sets, rounds balanced",
           FP8_MID_N64_CONFIG, fp8_mid_narrow, alternative_on_one_sm=False),
    Regime(math.inf, FP8_PREFILL_CONFIG, "128x192 in two promotion parts, whole-tile staging",
           FP8_PREFILL_N128_CONFIG, lambda f: not fp8_prefill_wide(f)),
)


def regimes(fmt: Format):
    return FP8_REGIMES if fmt is Format.FP8_BLOCK128 else BF16_REGIMES


def _hint_always(cfg: GemmConfig, m: int) -> bool:
    """fp8 L2 hints hold at ``m`` rows whatever the grid: every expert fits one m-block."""
    return m * M_SPREAD <= cfg.tile_m


def _hint_maybe(cfg: GemmConfig, m: int) -> bool:
    """fp8 L2 hints may hold at ``m`` rows: two m-blocks, if all their units fit one round."""
    return m * M_SPREAD <= 2 * cfg.tile_m


def _fp8_hint(cfg: GemmConfig, f: Facts) -> bool:
    """fp8: weights evict-first, activations evict-last where every expert
    fits one m-block, or two m-blocks whose units all fit one round (the
    second read of a weight tile then comes while the first is in L2)."""
    return _hint_always(cfg, f.m) or (
        _hint_maybe(cfg, f.m) and 2 * cfg.n_groups(f.n) <= cfg.n_clusters(f.num_sms)
    )


def _finish(
    cfg: GemmConfig, fp8: bool, hint: bool, signals: bool, single_cta: bool, combine: bool = False
) -> GemmConfig:
    """The rules after the table: L2 hints, what signals or a fused combine
    change, one SM."""
    if hint:
        cfg = cfg.replace(l2_hints=True)
    if signals and cfg.order is TileOrder.N_MAJOR:
        # experts finish one after another for a combine (expert-major order)
        cfg = cfg.replace(n_major_window=FP8_SIGNAL_WINDOW)
    if signals and cfg.tail is Tail.SPLIT:
        # a split tile's halves finish on two CTAs, and a signal counts tiles
        cfg = cfg.replace(tail=Tail.BALANCE if fp8 else Tail.NONE)
    if combine and cfg.staging is Staging.WHOLE_TILE:
        # the fused combine's rows leave one by one: no whole-tile staging
        cfg = cfg.replace(staging=Staging.PAIR)
    if single_cta:
        cfg = cfg.replace(cluster_n=1)
    return cfg


def choose_config(
    expected_m: Optional[int],
    max_m: int,
    n: int,
    k: int,
    num_sms: int,
    fp8: bool = False,
    num_experts: Optional[int] = None,
    signals: bool = False,
    combine: bool = False,
) -> GemmConfig:
    """Pick a configuration from host-side facts only. ``signals``: the call
    publishes completion signals; ``combine``: its epilogue is the fused
    combine (any of ``COMBINES``: the target does not change the pick)."""
    m = max_m if expected_m is None else max(1, min(int(expected_m), max_m))
    facts = Facts(m, n, k, num_sms, num_experts)
    fmt = Format.FP8_BLOCK128 if fp8 else Format.BF16
    regime = next(r for r in regimes(fmt) if m <= r.up_to_m)
    cfg = regime.pick(facts)
    hint = fp8 and _fp8_hint(cfg, facts)
    return _finish(cfg, fp8, hint, signals and not combine, num_sms < cfg.cluster_n, combine)


def weight_format_config(cfg: GemmConfig, fmt: Format) -> GemmConfig:
    """The fp8 (or bf16) pick made buildable for ``fmt``'s weights. MXFP4
    weights (``Format.FP8_MXFP4``, ``Format.BF16_MXFP4``) add converter
    warpgroups, which take registers: at most two consumer warpgroups, and
    two of them with one product set; and tiles 128 to 192 wide."""
    if not fmt.converts_weights:
        return cfg
    if cfg.tile_n == 64:
        # a slot's conversion has a fixed cost: 64-wide tiles pay it per half the bytes
        cfg = cfg.replace(tile_n=128)
    if cfg.tile_m == 192:
        cfg = cfg.replace(tile_m=128)
    if cfg.tile_n > 192:
        cfg = cfg.replace(tile_n=192)
    if cfg.tile_m == 128 and cfg.promotion is Promotion.OVERLAPPED:
        cfg = cfg.replace(promotion=Promotion.SERIAL)
    return cfg


def activation_config(cfg: GemmConfig, fp8: bool) -> GemmConfig:
    """The fused SwiGLU's version of a pick (``limits.check_activation_config``):
    SWIGLU_TILE_N wide (a 64-wide pick's rounds double: measured in
    docs/design.md), no split tail, pair staging, and for fp8 a 2-CTA
    cluster (each row's scale spans the pair)."""
    cfg = cfg.replace(tile_n=SWIGLU_TILE_N, staging=Staging.PAIR)
    if cfg.tail is Tail.SPLIT:
        cfg = cfg.replace(tail=Tail.BALANCE if fp8 else Tail.NONE)
    if cfg.promotion is Promotion.TWO_PARTS:
        cfg = cfg.replace(promotion=Promotion.OVERLAPPED)
    if fp8:
        cfg = cfg.replace(cluster_n=2)
    return cfg


def choose_activation_config(
    expected_m: Optional[int], max_m: int, n: int, k: int, num_sms: int, fp8: bool, num_experts: Optional[int]
) -> GemmConfig:
    """The fused SwiGLU gate_up's configuration (n = 2I, k = H): the plain
    pick made SWIGLU_TILE_N wide. An fp8 one needs num_sms >= 2."""
    cfg = choose_config(expected_m, max_m, n, k, max(num_sms, 2) if fp8 else num_sms, fp8, num_experts)
    return activation_config(cfg, fp8)


def reachable_specs(fmt: Optional[Format] = None) -> tuple[KernelSpec, ...]:
    """Every kernel ``choose_config`` can pick, with the signal modes each
    can be launched with, the fused-SwiGLU builds (``choose_activation_config``)
    and the fused-combine builds (tests sweep the
    heuristic to show the sets equal)."""
    if fmt is not None and fmt.converts_weights:
        # the fp8 (bf16) picks, as ``weight_format_config`` adapts them
        base = Format.FP8_BLOCK128 if fmt.promotes else Format.BF16
        return tuple(dict.fromkeys(
            KernelSpec(weight_format_config(s.config, fmt), fmt, s.signal_mode, s.epilogue)
            for s in reachable_specs(base)
        ))
    if fmt is None:
        return tuple(s for f in SM90_FORMATS for s in reachable_specs(f))
    specs = []
    ops = fmt
    fp8 = ops is Format.FP8_BLOCK128
    lower = 1
    for regime in regimes(ops):
        for cfg in dict.fromkeys(c for c in (regime.config, regime.alternative) if c):
            # the hints _fp8_hint can give over the regime's rows, for some grid
            hints = {cfg.l2_hints}
            if fp8 and _hint_maybe(cfg, lower):
                hints.add(True)
            if fp8 and _hint_always(cfg, regime.up_to_m):
                hints.discard(False)
            for hint in sorted(hints):
                for use in ("plain", "signals", "combine"):
                    for single in (False, True):
                        if single and cfg is regime.alternative and not regime.alternative_on_one_sm:
                            continue
                        final = _finish(cfg, fp8, hint, use == "signals", single, use == "combine")
                        if use == "combine":
                            specs.extend(KernelSpec(final, ops, None, epi) for epi in COMBINES)
                            continue
                        if use == "plain" and not (fp8 and single):
                            act = Epilogue.SWIGLU_FP8 if fp8 else Epilogue.SWIGLU_BF16
                            specs.append(KernelSpec(activation_config(final, fp8), ops, None, act))
                        modes = SIGNAL_MODES[1:] if use == "signals" else SIGNAL_MODES[:1]
                        specs.extend(KernelSpec(final, ops, mode) for mode in modes)
        lower = regime.up_to_m + 1
    return tuple(dict.fromkeys(specs))
