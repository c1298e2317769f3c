"""Compile entry points of the sm_100 blockwise fp8 kernel
(``blockwise.BlockwiseMaskedGemmSm100``): its specs, the choice among them,
and the cached TVM-FFI build.

The compiled callable is ``fn(a, b, sfa, sfb, out, masked_m, signals,
num_ctas)`` on torch's current stream:

* ``a`` (E, max_m, K) and ``b`` (E, N, K) float8_e4m3fn, K contiguous,
  other strides and the base 16-byte aligned;
* ``sfa`` (E, max_m, ceil(K/128)) float32 with stride 1 along max_m (the
  TMA layout, ``validation.tma_ready_a_scale``), other strides multiples of
  4 elements;
* ``sfb`` (E, ceil(N/128), ceil(K/128)) float32, any strides;
* ``out`` (E, max_m, N) bfloat16, N contiguous, 16-byte aligned strides;
* ``masked_m`` (E,) int32 on the GPU (never read by the host);
* ``signals`` int32 counters (``signals.make_signal_layout`` with
  ``spec.signal_block``), None when ``spec.signal_mode`` is None;
* ``num_ctas`` an int, at most the SM count (one CTA per SM).

Extents and strides are symbolic in the build, so one compiled object
serves every shape.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Tuple

from ..jit import cache
from ..jit.arch import default_arch, ensure_arch_env
from ..jit.key import cache_key
from ..jit.options import compile_options
from ..signals import GRANULARITIES

BLOCK = 128  # tile_m = tile_n = the scale block
BLACKWELL_ARCHS = ("sm_100a", "sm_100f", "sm_103a")  # tcgen05 targets this kernel compiles for
# A/B ring depth: 5 k-blocks of 32 KiB fill shared memory beside the staged
# 32 KiB output tile (6 would not fit in 227 KiB)
STAGE_CHOICES = (5,)


@dataclasses.dataclass(frozen=True)
class BlockwiseSpec:
    """What changes the generated code of the blockwise kernel."""

    tile_n: int = BLOCK
    stages: int = 5
    signal_mode: Optional[str] = None  # None, "m_block" or "expert" (signals.py)
    # the compiled function's tensor parameters, then the grid size (``blockwise``)
    SLOTS: ClassVar[tuple] = ("a", "b", "a_scale", "b_scale", "out", "masked_m", "signals")

    def __post_init__(self):
        if self.tile_n != BLOCK:
            # one weight scale must cover the tile's columns
            raise ValueError(f"BlockwiseSpec.tile_n must be {BLOCK}, got {self.tile_n}")
        if self.stages not in STAGE_CHOICES:
            raise ValueError(f"BlockwiseSpec.stages must be one of {STAGE_CHOICES}, got {self.stages}")
        if self.signal_mode is not None and self.signal_mode not in GRANULARITIES:
            raise ValueError(f"BlockwiseSpec.signal_mode must be None or one of {GRANULARITIES}")

    @property
    def tile_m(self) -> int:
        return BLOCK

    @property
    def signal_block(self) -> Tuple[int, int]:
        """(block_m, block_n) of the signal counters (``signals.make_signal_layout``)."""
        return (self.tile_m, self.tile_n)

    def name(self) -> str:
        sig = f"_sig-{self.signal_mode}" if self.signal_mode else ""
        return f"sm100_blockwise_fp8_{self.tile_m}x{self.tile_n}_s{self.stages}{sig}"


def blockwise_specs() -> Tuple[BlockwiseSpec, ...]:
    """Every spec the package may launch: the one ring depth, without and
    with each signal granularity."""
    return tuple(
        BlockwiseSpec(stages=s, signal_mode=m) for m in (None, *GRANULARITIES) for s in STAGE_CHOICES
    )


def choose_blockwise(
    num_experts: int, max_m: int, n: int, k: int, expected_m: int, num_sms: int, signal_mode: Optional[str]
) -> BlockwiseSpec:
    """The spec for a problem: 128x128 tiles and the deepest ring that fits
    (decode tiles stream their own weights from HBM and want the most bytes
    in flight; prefill tiles lose nothing by it), so only the signal mode
    varies. The shape arguments are kept so that a tuned choice can use them
    without changing callers."""
    if signal_mode is not None and signal_mode not in GRANULARITIES:
        raise ValueError(f"signal_mode must be None or one of {GRANULARITIES}, got {signal_mode!r}")
    return BlockwiseSpec(stages=max(STAGE_CHOICES), signal_mode=signal_mode)


def _fake_args(signal_mode):
    """Fake tensors with symbolic extents and 16-byte-aligned symbolic strides."""
    import cutlass
    import cutlass.cute as cute

    def ld(dtype):  # a stride in elements that is a multiple of 16 bytes
        return cute.sym_int64(divisibility=128 // dtype.width)

    fp8, f32, bf16 = cutlass.Float8E4M3FN, cutlass.Float32, cutlass.BFloat16
    e, m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    kb, nb = cute.sym_int(), cute.sym_int()
    fake = cute.runtime.make_fake_tensor
    a = fake(fp8, (e, m, k), (ld(fp8), ld(fp8), 1), assumed_align=16)
    b = fake(fp8, (e, n, k), (ld(fp8), ld(fp8), 1), assumed_align=16)
    sfa = fake(f32, (e, m, kb), (ld(f32), 1, ld(f32)), assumed_align=16)
    sfb = fake(f32, (e, nb, kb), (cute.sym_int64(), cute.sym_int64(), cute.sym_int64()), assumed_align=4)
    out = fake(bf16, (e, m, n), (ld(bf16), ld(bf16), 1), assumed_align=16)
    masked_m = fake(cutlass.Int32, (e,), (1,), assumed_align=4)
    signals = None
    if signal_mode is not None:
        signals = fake(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)
    return a, b, sfa, sfb, out, masked_m, signals


def build_blockwise(spec: BlockwiseSpec, arch: Optional[str] = None, keep_ptx: bool = False):
    """Compile one kernel (no caching); with ``keep_ptx`` the callable's
    ``__ptx__`` holds the PTX."""
    arch = arch or default_arch()
    if arch not in BLACKWELL_ARCHS:
        raise ValueError(f"the blockwise sm_100 kernel targets one of {BLACKWELL_ARCHS}, not {arch!r}")
    ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .blockwise import BlockwiseMaskedGemmSm100

    gemm = BlockwiseMaskedGemmSm100(spec.stages, spec.signal_mode)
    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            gemm, *_fake_args(spec.signal_mode), cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


def get_blockwise_kernel(spec: BlockwiseSpec, arch: Optional[str] = None):
    """The cached compiled kernel of ``spec`` (compiled on first use, once per process)."""
    arch = arch or default_arch()
    return cache.cached(cache_key(arch, "sm100-blockwise", spec), lambda: build_blockwise(spec, arch))
