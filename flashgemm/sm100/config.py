"""What one sm_100a / sm_103a kernel build is: its tile, CTA group, ring
depth and operand format (``Sm100Config``), plus the signal mode
(``Sm100Spec``). Legality lives in ``limits``; the choice in ``heuristic``."""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar, Optional

from ..formats import Format

SIGNAL_MODES = (None, "m_block", "expert")
# formats with a kernel in this package (FP8_BLOCK128 lives in blockwise*)
SM100_FORMATS = (Format.MXFP8, Format.NVFP4, Format.BF16, Format.MXFP8_MXFP4)


class CtaGroup(enum.Enum):
    """CTAs that issue one tcgen05.mma together (``cta_group::1`` / ``::2``)."""

    ONE = 1
    TWO = 2


@dataclasses.dataclass(frozen=True)
class Sm100Config:
    """One kernel's static shape.

    tile_m: rows of one MMA tile (the cluster's rows): 128 with
    ``CtaGroup.ONE``, 256 with ``CtaGroup.TWO`` (each CTA owns 128 of them).
    tile_n: output columns per tile. stages: operand ring depth, 0 for as
    many as fit in shared memory.
    """

    fmt: Format = Format.MXFP8
    tile_m: int = 128
    tile_n: int = 128
    cta_group: CtaGroup = CtaGroup.ONE
    stages: int = 0

    @property
    def cluster_size(self) -> int:
        return self.cta_group.value

    @property
    def cta_tile_m(self) -> int:
        """Rows one CTA computes and stores (its half of a 2-CTA tile)."""
        return self.tile_m // self.cta_group.value

    @property
    def has_alpha(self) -> bool:
        """NVFP4 takes a per-expert fp32 alpha (1 / (g_a * g_b)); the other
        formats are compiled with alpha None."""
        return self.fmt is Format.NVFP4

    def replace(self, **changes) -> "Sm100Config":
        return dataclasses.replace(self, **changes)

    def name(self) -> str:
        stages = f"s{self.stages}" if self.stages else "sauto"
        return f"{self.fmt.value}-{self.tile_m}x{self.tile_n}-cta{self.cta_group.value}-{stages}"


@dataclasses.dataclass(frozen=True)
class Sm100Spec:
    """A compiled kernel: a config and a signal mode (None, "m_block", "expert")."""

    config: Sm100Config
    signal_mode: Optional[str] = None
    # the compiled function's tensor parameters, then the grid size (``kernel``)
    SLOTS: ClassVar[tuple] = ("a", "b", "a_scale", "b_scale", "alpha", "out", "masked_m", "signals")

    def name(self) -> str:
        return f"sm100-{self.config.name()}-{self.signal_mode or 'nosig'}"
