"""What an sm_90a kernel can hold: shared memory, registers, wgmma shapes.

Validation must reject a configuration the hardware cannot run before
anything is compiled, so the budget is computed here, on the host, from the
same numbers the kernel's shared storage uses.
"""

from __future__ import annotations

import functools

from ..config import (
    FP8_SLOT_WEIGHT_SCALES, SWIGLU_TILE_N, Epilogue, GemmConfig, Promotion, Staging, Tail,
)
from ..formats import Format

# 227 KiB of dynamic shared memory per CTA (the sm_90 opt-in limit).
# the formats the sm_90 kernels take (the MXFP4-weight ones convert b inside)
SM90_FORMATS = (Format.BF16, Format.FP8_BLOCK128, Format.FP8_MXFP4, Format.BF16_MXFP4)
SMEM_BYTES = 232448
# Kept out of the operand ring: the mbarriers before it and the small fields
# after the staging area (scales, counts, the claim feed), with their alignment.
SMEM_RESERVED_BYTES = 2048
# setmaxnreg: the producer warpgroup only walks the scheduler and issues TMA.
PRODUCER_REGS = 40


# setmaxnreg of the MXFP4 converter warpgroups (``converter``)
CONVERTER_REGS = 88


def converter_warpgroups(num_consumer_wg: int) -> int:
    """MXFP4 weights: converter warpgroups beside the consumers (two for one
    consumer warpgroup, so a converter warp shares each scheduler with
    another; one beside two consumers, whose registers it would take)."""
    return 2 if num_consumer_wg == 1 else 1


def consumer_regs(num_consumer_wg: int, converters: int = 0) -> int:
    """Registers per consumer thread: the CTA's launch allocation (64K
    registers over its threads, in multiples of 8; setmaxnreg.inc only takes
    what the other warps gave back) split over the warpgroups, less the
    producer's (and the converters') share, in setmaxnreg's multiples of 8,
    at most 232 (2 consumers: 232; 3 consumers: 152; beside converters: 1
    consumer 232, 2 consumers 192)."""
    warpgroups = num_consumer_wg + 1 + converters
    launch = 65536 // (128 * warpgroups) // 8 * 8
    per_consumer = (launch * warpgroups - PRODUCER_REGS - CONVERTER_REGS * converters) // num_consumer_wg
    return min(232, per_consumer // 8 * 8)


def stage_bytes(cfg: GemmConfig, fmt: Format) -> int:
    """One ring slot: the A and B k-tiles, and for fp8 the tile's fp32 row
    scales and its weight scales."""
    operand_bytes = (cfg.tile_m + cfg.tile_n) * fmt.tile_k * fmt.elem_bytes
    if fmt.converts_weights:
        # the E8M0 bytes (the packed B lands in the converted B's first half)
        operand_bytes += cfg.tile_n * fmt.tile_k // 32
    if fmt.promotes:
        operand_bytes += (cfg.tile_m + FP8_SLOT_WEIGHT_SCALES) * 4
    return operand_bytes


def epi_bytes(cfg: GemmConfig, epilogue: Epilogue = Epilogue.STORE) -> int:
    """The bf16 output staging (the fused combine stages its rows there too),
    and what the epilogue keeps beside it (``EpilogueOp.smem_bytes``)."""
    em, en = cfg.epi_tile
    return em * en * 2 * cfg.epi_buffers + epilogue.op.smem_bytes(cfg.tile_m)


def resolved_stages(cfg: GemmConfig, fmt: Format, epilogue: Epilogue = Epilogue.STORE) -> int:
    """Stages actually used: the explicit count, or as many as fit."""
    if cfg.stages:
        return cfg.stages
    free = SMEM_BYTES - SMEM_RESERVED_BYTES - epi_bytes(cfg, epilogue)
    return max(free // stage_bytes(cfg, fmt), 0)


def smem_bytes(cfg: GemmConfig, fmt: Format, epilogue: Epilogue = Epilogue.STORE) -> int:
    return (SMEM_RESERVED_BYTES + resolved_stages(cfg, fmt, epilogue) * stage_bytes(cfg, fmt)
            + epi_bytes(cfg, epilogue))


def check_config(cfg: GemmConfig, fmt: Format, epilogue: Epilogue = Epilogue.STORE) -> GemmConfig:
    """Raise ValueError naming the field if ``cfg`` cannot be built for sm_90a."""
    if not isinstance(cfg, GemmConfig):
        raise TypeError(f"config must be a flashgemm.GemmConfig, got {type(cfg).__name__}")
    cfg.check_fields(fmt)
    fp8 = fmt.promotes
    if fmt.converts_weights and cfg.consumer_warpgroups == 3:
        # the converter warpgroup leaves three consumers 120 registers each
        raise ValueError(f"config.tile_m must be 64 or 128 with {fmt.value} weights (a converter warpgroup "
                         f"shares the registers), got {cfg.tile_m}")
    if fmt.converts_weights and cfg.tile_n > 192:
        # with the converters 512 threads compile at 128 registers, all of them a 256-wide wgmma's accumulators
        raise ValueError(f"config.tile_n must be <= 192 with {fmt.value} weights (the converter warpgroups make "
                         f"512 threads), got {cfg.tile_n}")
    if fmt is Format.FP8_MXFP4 and cfg.consumer_warpgroups == 2 and cfg.promotion is Promotion.OVERLAPPED:
        raise ValueError(f"config.promotion must not be OVERLAPPED with tile_m=128 and {fmt.value} weights "
                         "(two consumers get 192 registers each beside the converter)")
    if cfg.consumer_warpgroups == 3 and cfg.tile_n > (64 if fp8 else 128):
        # 512 threads share 64K registers: 152 per consumer thread
        raise ValueError(
            f"config.tile_n must be <= {64 if fp8 else 128} with tile_m=192 (three consumer "
            f"warpgroups) for {fmt.value}, got {cfg.tile_n}"
        )
    if fp8 and cfg.tile_n > 192:
        # the running sum and one k-block's products: tile_n fp32 registers per thread
        raise ValueError(f"config.tile_n must be <= 192 for fp8, got {cfg.tile_n}")
    if cfg.promotion is Promotion.OVERLAPPED and cfg.tile_n > 128:
        # three accumulator sets: 3 * tile_n / 2 registers per thread
        raise ValueError(f"config.tile_n must be <= 128 with promotion=OVERLAPPED, got {cfg.tile_n}")
    if epilogue.combines and cfg.staging is not Staging.PAIR:
        raise ValueError("config.staging must be Staging.PAIR with the fused combine "
                         f"(its rows are staged sub-tile by sub-tile), got {cfg.staging.name}")
    if epilogue.activates:
        check_activation_config(cfg, fmt, epilogue)
    n_stages = resolved_stages(cfg, fmt, epilogue)
    if n_stages < 2:
        raise ValueError(f"config needs at least 2 pipeline stages; {n_stages} fit in shared memory")
    if smem_bytes(cfg, fmt, epilogue) > SMEM_BYTES:
        raise ValueError(
            f"config uses {smem_bytes(cfg, fmt, epilogue)} bytes of shared memory; sm_90 allows "
            f"{SMEM_BYTES} (lower config.stages)"
        )
    return cfg


def check_activation_config(cfg: GemmConfig, fmt: Format, epilogue: Epilogue) -> None:
    """The fused SwiGLU's tile: SWIGLU_TILE_N wide (the interleaved w13's gate
    and up groups), every tile whole on one CTA, and for fp8 a 2-CTA cluster
    whose pair holds one 128-column scale block of h."""
    if cfg.tile_n != SWIGLU_TILE_N:
        raise ValueError(f"config.tile_n must be {SWIGLU_TILE_N} with Epilogue.{epilogue.name} (one gate and one "
                         f"up group of the interleaved w13 per tile), got {cfg.tile_n}")
    if cfg.tail is Tail.SPLIT:
        raise ValueError(f"config.tail must not be SPLIT with Epilogue.{epilogue.name} (a tile's rows stay on one CTA)")
    if epilogue is Epilogue.SWIGLU_FP8 and (cfg.cluster_n != 2 or not fmt.promotes):
        raise ValueError("Epilogue.SWIGLU_FP8 needs fp8 operands and config.cluster_n=2 (the pair's 128 h "
                         f"columns share each row's scale), got {fmt.value}, cluster_n={cfg.cluster_n}")


@functools.lru_cache(maxsize=64)
def validated_config(cfg: GemmConfig, fmt: Format, epilogue: Epilogue = Epilogue.STORE) -> GemmConfig:
    """``check_config``, once per (frozen) config in a process."""
    return check_config(cfg, fmt, epilogue)
