"""Kernel configuration: what changes the generated code, apart from the arch.

A :class:`GemmConfig` is frozen so it keys the compile cache. Choices that
exclude each other are one enum field each (the tile order, the tail rule,
the fp8 promotion, the output staging); what follows from other fields is
derived (``tile_k`` from the operand dtype, the consumer warpgroups from
``tile_m``). :class:`KernelSpec` adds the operand dtype and the signal mode:
one spec is one compiled kernel. Which configurations an arch can build, and
which one a call gets, live in the arch package (``flashgemm.sm90``).
The reasons behind each field's existence are in ``docs/design.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from collections.abc import Hashable
from typing import Optional

from .epilogue import Epilogue
from .formats import Format


class TileOrder(enum.Enum):
    """How units of work are numbered and dealt to the persistent clusters."""

    EXPERT_MAJOR = "expert_major"  # expert, then n-group, then m-block; cluster c takes c, c+G, ...
    N_MAJOR = "n_major"  # n-group first, so each round holds a slice of every expert
    DYNAMIC = "dynamic"  # expert-major, every unit claimed from a global counter


class Tail(enum.Enum):
    """What a static launch does with a last round that is at most half full."""

    NONE = "none"
    BALANCE = "balance"  # the same rounds on fewer clusters, every round full
    SPLIT = "split"  # each unit of that round runs as two 64-row half units


class Promotion(enum.Enum):
    """Block-scaled fp8: how each k-block's products reach the fp32 sum."""

    SERIAL = "serial"  # one product set, promoted after its wgmma retires
    OVERLAPPED = "overlapped"  # two product sets: the next wgmma runs during a promotion
    TWO_PARTS = "two_parts"  # one product set as two column chains; part 0 promoted during part 1


class Staging(enum.Enum):
    """Shared-memory staging of a full output tile before its bulk stores."""

    PAIR = "pair"  # two 32-column buffers, rotated sub-tile by sub-tile
    WHOLE_TILE = "whole_tile"  # every sub-tile; each warpgroup hands its rows over alone


SIGNAL_MODES = (None, "m_block", "expert")
# The fused SwiGLU: w13's gate and up rows interleaved in groups of this many,
# so a SWIGLU_TILE_N-wide tile holds the gate and up columns of 64 h columns,
# and a 2-CTA cluster the 128 of one fp8 scale block (docs/design.md)
SWIGLU_GRANULE = 64
SWIGLU_TILE_N = 2 * SWIGLU_GRANULE
# Output staging: one bulk store per (tile_m x EPI_COLS) sub-tile.
EPI_COLS = 32
EPI_PAIR_BUFFERS = 2
# The dynamic order's claim counter: int32 (next unit, finished clusters).
CLAIM_COUNTER_INTS = 2
# Block-scaled fp8: the fp32 weight scales each ring slot carries, one per
# 128-row block of N the tile covers (a 192-wide tile can straddle two).
FP8_SLOT_WEIGHT_SCALES = 2


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration.

    tile_m: rows of the CTA tile, 64 per consumer warpgroup (64, 128, 192).
    tile_n: columns of the CTA tile (64, 128, 192, 256).
    stages: depth of the TMA -> MMA shared-memory ring; 0 = as many as fit.
    cluster_n: CTAs per cluster along N (1 or 2); a pair computes adjacent
        n-blocks of one m-block and multicasts half of the A tile each.
    order: :class:`TileOrder`.
    n_major_window: with ``TileOrder.N_MAJOR``, 0 (one window of every
        expert) or a power of two up to 32: experts taken that many at a
        time, so each window finishes before the next (1 is the expert-major
        order found by the n-major scan, what signalled calls use).
    tail: :class:`Tail` (static orders only; SPLIT needs tile_m 128 and the
        expert-major order).
    promotion: :class:`Promotion` (SERIAL for bf16).
    staging: :class:`Staging`.
    a_chunk_rows: 0, or load A as boxes of this many rows and skip those
        holding no valid row (16, 32 or 64, dividing tile_m / cluster_n).
    l2_hints: weights loaded evict-first, activations evict-last.
    pdl: programmatic dependent launch.
    l2_warmup: with ``pdl``, prefetch the likely first tile's weights into
        L2 while the previous kernel drains.
    """

    tile_m: int = 128
    tile_n: int = 128
    stages: int = 0
    cluster_n: int = 1
    order: TileOrder = TileOrder.EXPERT_MAJOR
    n_major_window: int = 0
    tail: Tail = Tail.NONE
    promotion: Promotion = Promotion.SERIAL
    staging: Staging = Staging.PAIR
    a_chunk_rows: int = 0
    l2_hints: bool = False
    pdl: bool = True
    l2_warmup: bool = True

    def __post_init__(self):
        values = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        for f, value in zip(dataclasses.fields(self), values):
            if not isinstance(value, Hashable):  # (hash() would not say which field)
                raise TypeError(f"GemmConfig.{f.name} must be {_expected(_field_types(GemmConfig)[f.name])}, "
                                f"got {type(value).__name__}")
        # Hashed into the launch-plan key on every call: compute it once.
        object.__setattr__(self, "_hash", hash(values))
        # Equality sees the field types: 128.0 == 128 and True == 1, so an
        # ill-typed config would otherwise match a valid one's cached checks
        # and plans and never reach check_fields.
        object.__setattr__(self, "_typed", tuple((type(v), v) for v in values))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._typed == other._typed

    def replace(self, **changes) -> "GemmConfig":
        return dataclasses.replace(self, **changes)

    # ---- derived facts -------------------------------------------------
    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def threads(self) -> int:
        # one producer warpgroup (TMA warp, store warp, two idle) + consumers
        return 128 * (1 + self.consumer_warpgroups)

    @property
    def dynamic(self) -> bool:
        return self.order is TileOrder.DYNAMIC

    @property
    def n_major(self) -> bool:
        return self.order is TileOrder.N_MAJOR

    @property
    def promote_parts(self) -> int:
        """Column chains per k-tile (1, or 2 with ``Promotion.TWO_PARTS``)."""
        return 2 if self.promotion is Promotion.TWO_PARTS else 1

    @property
    def epi_tile(self) -> tuple[int, int]:
        return (self.tile_m, EPI_COLS)

    @property
    def epi_buffers(self) -> int:
        """Staging buffers of one epi_tile each: the whole tile, or a pair."""
        return self.tile_n // EPI_COLS if self.staging is Staging.WHOLE_TILE else EPI_PAIR_BUFFERS

    def tile_mnk(self, fmt: Format) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, fmt.tile_k)

    def n_groups(self, n: int) -> int:
        """Units of work along N: ceil(ceil(N / tile_n) / cluster_n)."""
        return -(-(-(-n // self.tile_n)) // self.cluster_n)

    def n_clusters(self, num_sms: int) -> int:
        """Clusters a persistent grid capped at num_sms runs at once (at least 1)."""
        return max(1, num_sms // self.cluster_n)

    def grid_clusters(self, num_experts: int, max_m: int, n: int, num_sms: int) -> int:
        """Clusters the launcher starts: capped at num_sms, and never more
        than the units of work every expert at max_m rows would make."""
        max_units = num_experts * -(-max_m // self.tile_m) * self.n_groups(n)
        if self.tail is Tail.SPLIT:  # a last round of halves may use twice the clusters
            max_units *= 2
        return max(1, min(num_sms // self.cluster_n, max_units))

    def check_fields(self, fmt: Format) -> "GemmConfig":
        """The arch-neutral rules: field types and the combinations no kernel
        implements. Raises ValueError naming the field."""
        check_field_types(self)
        if self.tile_m not in (64, 128, 192):
            raise ValueError(f"config.tile_m must be 64, 128 or 192 (64 rows per consumer "
                             f"warpgroup), got {self.tile_m}")
        if self.tile_n not in (64, 128, 192, 256):
            raise ValueError(f"config.tile_n must be one of 64, 128, 192, 256, got {self.tile_n}")
        if self.cluster_n not in (1, 2):
            raise ValueError(f"config.cluster_n must be 1 or 2, got {self.cluster_n}")
        if self.stages < 0:
            raise ValueError(f"config.stages must be >= 0 (0 = auto), got {self.stages}")
        if self.promotion is not Promotion.SERIAL and not fmt.promotes:
            raise ValueError(
                f"config.promotion={self.promotion.name} applies to block-scaled fp8 operands only"
            )
        if self.tail is not Tail.NONE and self.order is TileOrder.DYNAMIC:
            raise ValueError(
                f"config.tail={self.tail.name} applies to the static orders; the dynamic order "
                "already gives late clusters fewer units"
            )
        if self.tail is Tail.SPLIT and (self.order is not TileOrder.EXPERT_MAJOR or self.tile_m != 128):
            raise ValueError(
                "config.tail=SPLIT runs each half of a split unit on one of two consumer "
                "warpgroups, in the expert-major order: needs tile_m=128 and "
                f"order=EXPERT_MAJOR, got tile_m={self.tile_m}, order={self.order.name}"
            )
        if self.n_major_window and (
            self.order is not TileOrder.N_MAJOR or self.n_major_window not in (1, 2, 4, 8, 16, 32)
        ):
            raise ValueError(
                "config.n_major_window must be 0, or a power of two up to 32 with "
                f"order=N_MAJOR; got {self.n_major_window} (order={self.order.name})"
            )
        if self.a_chunk_rows and (
            self.a_chunk_rows not in (16, 32, 64) or self.tile_m % (self.a_chunk_rows * self.cluster_n)
        ):
            raise ValueError(
                "config.a_chunk_rows must be 0, or 16, 32 or 64 dividing tile_m / cluster_n "
                f"({self.tile_m} / {self.cluster_n}), got {self.a_chunk_rows}"
            )
        return self

    def short_name(self) -> str:
        """A compact, unique name (benchmark tables, the compile listing)."""
        return (
            f"m{self.tile_m}n{self.tile_n}s{self.stages or 'A'}c{self.cluster_n}"
            + ("" if self.order is TileOrder.EXPERT_MAJOR else f"-{self.order.value}")
            + (f"-w{self.n_major_window}" if self.n_major_window else "")
            + ("" if self.tail is Tail.NONE else f"-{self.tail.value}")
            + ("" if self.promotion is Promotion.SERIAL else f"-{self.promotion.value}")
            + ("" if self.staging is Staging.PAIR else "-whole")
            + (f"-ac{self.a_chunk_rows}" if self.a_chunk_rows else "")
            + ("-l2hint" if self.l2_hints else "")
            + ("" if self.pdl else "-nopdl")
            + ("" if self.l2_warmup else "-nowarm")
        )


@functools.lru_cache(maxsize=None)
def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _expected(kind) -> str:
    if kind is bool:
        return "a bool"
    if kind is int:
        return "an int"
    # this module's enums are exported as flashgemm.<name>; others by their module
    return f"a {'flashgemm' if kind.__module__ == __name__ else kind.__module__}.{kind.__name__}"


def check_field_types(config) -> None:
    """Each field of a config dataclass holds its annotated type: an int
    field a real int (not a bool, not a float: the kernel builders take them
    as compile-time constants), a bool field a real bool (a truthy string
    would turn a feature on), an enum field its enum. Raises ValueError
    naming the field and the type expected."""
    for name, kind in _field_types(type(config)).items():
        value = getattr(config, name)
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ValueError(f"config.{name} must be {_expected(kind)}, got {value!r} ({type(value).__name__})")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel: a configuration, its operands, its signal mode
    (None, "m_block" or "expert") and its epilogue."""

    config: GemmConfig
    fmt: Format
    signal_mode: Optional[str] = None
    epilogue: Epilogue = Epilogue.STORE

    def name(self) -> str:
        tail = self.epilogue.value if self.epilogue is not Epilogue.STORE else self.signal_mode or "nosig"
        return f"{self.fmt.value}-{self.config.short_name()}-{tail}"
