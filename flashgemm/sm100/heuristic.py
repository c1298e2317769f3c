"""Which sm_100 kernel a call gets, from host-side facts only (masked_m is
never read): the expected rows per expert, N, K, E and the SM count.
``reachable_specs`` is the exact set ``choose_config`` can return, times the
signal modes: what ``precompile`` and the compile listing build.

Three tiles per format (not measured on a Blackwell GPU yet: the rules are
wave arithmetic, to be revisited with timings):

* 128x64, one CTA: decode, when 128-wide tiles would leave SMs idle;
* 128x128, one CTA: the default;
* 256x256, a 2-CTA pair (``cta_group::2``): enough rows per expert for
  256-row tiles and enough pair tiles to fill the SMs.
"""

from __future__ import annotations

from typing import Optional

from ..formats import Format
from .config import SIGNAL_MODES, SM100_FORMATS, CtaGroup, Sm100Config, Sm100Spec

NARROW = dict(tile_m=128, tile_n=64, cta_group=CtaGroup.ONE)
DEFAULT = dict(tile_m=128, tile_n=128, cta_group=CtaGroup.ONE)
PAIR = dict(tile_m=256, tile_n=256, cta_group=CtaGroup.TWO)
TILES = (NARROW, DEFAULT, PAIR)
PAIR_MIN_ROWS = 192  # expected rows per expert from which 256-row tiles waste little


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _units(num_experts: int, m: int, n: int, tile_m: int, tile_n: int) -> int:
    return num_experts * _cdiv(m, tile_m) * _cdiv(n, tile_n)


def choose_config(fmt: Format, num_experts: int, max_m: int, n: int, k: int, expected_m: Optional[int],
                  num_sms: int, signal_mode: Optional[str] = None) -> Sm100Config:
    """The config for a call (any signal mode: the tile does not depend on it)."""
    if fmt not in SM100_FORMATS:
        raise ValueError(f"fmt must be one of {[f.value for f in SM100_FORMATS]}, got {fmt!r}")
    if signal_mode not in SIGNAL_MODES:
        raise ValueError(f"signal_mode must be one of {SIGNAL_MODES}, got {signal_mode!r}")
    m = min(max(int(expected_m or max_m), 1), max(int(max_m), 1))
    sms = max(int(num_sms), 1)
    if m >= PAIR_MIN_ROWS and _units(num_experts, m, n, 256, 256) * 2 >= sms:
        tile = PAIR
    elif _units(num_experts, m, n, 128, 128) >= sms:
        tile = DEFAULT
    else:
        tile = NARROW
    return Sm100Config(fmt=fmt, **tile)


def reachable_specs() -> list:
    """Every spec ``choose_config`` can give, for each format and signal mode."""
    return [Sm100Spec(Sm100Config(fmt=fmt, **tile), mode)
            for fmt in SM100_FORMATS for tile in TILES for mode in SIGNAL_MODES]
