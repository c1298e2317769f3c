"""What an sm_100 kernel can hold: legal tiles per format, and the shared
and tensor memory budgets, computed on the host from the same numbers the
kernel uses, so a bad config is refused before anything is compiled."""

from __future__ import annotations

from ..formats import Format
from .config import SIGNAL_MODES, SM100_FORMATS, CtaGroup, Sm100Config, Sm100Spec

SMEM_BYTES = 232448  # 227 KiB of dynamic shared memory per CTA (sm_100 opt-in limit)
# mbarriers, the TMEM address slot and alignment padding of the buffers
SMEM_RESERVED_BYTES = 4096
TMEM_COLS = 512  # tensor memory columns per SM (128 lanes x 32 bit each)
# one MMA k-tile is 128 bytes of K per row for every format (4 MMA instructions)
K_TILE_BYTES = 128
MMA_INSTS_PER_K_TILE = 4
EPI_N = 32  # columns of one epilogue sub-tile
EPI_BUFFERS = 2  # staging buffers of bf16 output sub-tiles for the TMA store
MAX_STAGES = 12
# legal tile_n per CTA group: tcgen05 block-scaled MMA takes N in multiples of
# 64 up to 256 for M=128; with two CTAs each CTA loads half of B, and N=64
# would leave each a 32-row half that the scale-factor layout cannot tile
TILE_N = {CtaGroup.ONE: (64, 128, 256), CtaGroup.TWO: (128, 256)}


def tile_k(fmt: Format) -> int:
    """Elements of K in one k-tile (one ring stage)."""
    return K_TILE_BYTES * 8 // fmt.element_bits


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sf_bytes(cfg: Sm100Config) -> int:
    """Scale-factor bytes of one stage: a 128-row slice of SFA, and SFB
    over tile_n rounded up to 128 (the 128x4 atom), one byte per scale."""
    if not cfg.fmt.block_scaled:
        return 0
    per_row = tile_k(cfg.fmt) // cfg.fmt.sf_vec_size
    return (cfg.cta_tile_m + _round_up(cfg.tile_n, 128)) * per_row


def stage_bytes(cfg: Sm100Config) -> int:
    """One ring slot in one CTA: its A rows, its share of B, the scales."""
    b_rows = cfg.tile_n // cfg.cta_group.value
    return (cfg.cta_tile_m + b_rows) * K_TILE_BYTES + sf_bytes(cfg)


def epi_bytes(cfg: Sm100Config) -> int:
    return cfg.cta_tile_m * EPI_N * 2 * EPI_BUFFERS


def resolved_stages(cfg: Sm100Config) -> int:
    if cfg.stages:
        return cfg.stages
    free = SMEM_BYTES - SMEM_RESERVED_BYTES - epi_bytes(cfg)
    return max(min(free // stage_bytes(cfg), MAX_STAGES), 0)


def smem_bytes(cfg: Sm100Config) -> int:
    return SMEM_RESERVED_BYTES + resolved_stages(cfg) * stage_bytes(cfg) + epi_bytes(cfg)


def sf_tmem_cols(cfg: Sm100Config) -> int:
    """TMEM columns of one k-tile's scales: 32 rows of an atom per column
    group, MMA_INSTS_PER_K_TILE columns each (SFA, then SFB)."""
    if not cfg.fmt.block_scaled:
        return 0
    return (cfg.cta_tile_m // 32 + _round_up(cfg.tile_n, 128) // 32) * MMA_INSTS_PER_K_TILE


def acc_stages(cfg: Sm100Config) -> int:
    """Accumulator buffers in TMEM: two (the epilogue drains one while the
    MMA fills the other) when they fit beside the scales, else one."""
    return 2 if 2 * cfg.tile_n + sf_tmem_cols(cfg) <= TMEM_COLS else 1


def tmem_cols(cfg: Sm100Config) -> int:
    return acc_stages(cfg) * cfg.tile_n + sf_tmem_cols(cfg)


def check_config(cfg: Sm100Config) -> Sm100Config:
    """Raise ValueError naming the field if ``cfg`` cannot be built for sm_100."""
    if not isinstance(cfg, Sm100Config):
        raise TypeError(f"config must be a flashgemm.sm100.Sm100Config, got {type(cfg).__name__}")
    if cfg.fmt not in SM100_FORMATS:
        names = ", ".join(f.value for f in SM100_FORMATS)
        raise ValueError(f"config.fmt must be one of {names} for this kernel, got {cfg.fmt!r}")
    if not isinstance(cfg.cta_group, CtaGroup):
        raise ValueError(f"config.cta_group must be a CtaGroup, got {cfg.cta_group!r}")
    if cfg.tile_m != 128 * cfg.cta_group.value:
        raise ValueError(
            f"config.tile_m must be {128 * cfg.cta_group.value} with cta_group={cfg.cta_group.name} "
            f"(128 rows per CTA), got {cfg.tile_m}"
        )
    legal = TILE_N[cfg.cta_group]
    if cfg.tile_n not in legal:
        raise ValueError(f"config.tile_n must be one of {legal} with cta_group={cfg.cta_group.name}, "
                         f"got {cfg.tile_n}")
    if isinstance(cfg.stages, bool) or not isinstance(cfg.stages, int) or cfg.stages < 0:
        raise ValueError(f"config.stages must be a non-negative int (0: as many as fit), got {cfg.stages!r}")
    if resolved_stages(cfg) < 2:
        raise ValueError(f"config.stages: at least 2 pipeline stages needed, {resolved_stages(cfg)} fit")
    if smem_bytes(cfg) > SMEM_BYTES:
        raise ValueError(f"config.stages={cfg.stages} uses {smem_bytes(cfg)} bytes of shared memory; "
                         f"sm_100 allows {SMEM_BYTES}")
    if tmem_cols(cfg) > TMEM_COLS:
        raise ValueError(f"config.tile_n={cfg.tile_n} needs {tmem_cols(cfg)} tensor memory columns "
                         f"(at most {TMEM_COLS})")
    return cfg


def check_spec(spec: Sm100Spec) -> Sm100Spec:
    if not isinstance(spec, Sm100Spec):
        raise TypeError(f"spec must be a flashgemm.sm100.Sm100Spec, got {type(spec).__name__}")
    if spec.signal_mode not in SIGNAL_MODES:
        raise ValueError(f"spec.signal_mode must be one of {SIGNAL_MODES}, got {spec.signal_mode!r}")
    check_config(spec.config)
    return spec
