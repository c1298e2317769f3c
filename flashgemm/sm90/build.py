"""Compile entry points of the sm_90a kernels: the GEMM (one ``KernelSpec``
each) and the reference combine (``backend`` lists them for precompile).

Kernels are compiled from fake tensors whose extents (E, max_m, N, K) and
strides are symbolic, so one compiled object serves every shape: only the
spec and the target arch change the generated code, and those (with the
versions and the source digest, ``jit.key``) form the cache key. masked_m is
data, so a new token distribution never recompiles. Compiled objects take
torch tensors directly through TVM-FFI and launch on torch's current stream.
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..config import CLAIM_COUNTER_INTS, KernelSpec, TileOrder
from ..jit import cache
from ..jit.arch import default_arch, ensure_arch_env
from ..jit.key import cache_key
from ..jit.fakes import row_major
from ..jit.options import compile_options
from ..routing import ROUTING_SLOTS
from ..signals import DEFAULT_ROWS_PER_ITEM
from .limits import check_config

OUT_DTYPE = "bf16"


def _cutlass_dtype(name: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8_block128": cutlass.Float8E4M3FN,
            "fp8_mxfp4": cutlass.Float8E4M3FN, "bf16_mxfp4": cutlass.BFloat16}[name]


def _fake_args(ab_dtype, out_dtype, sum_dtype=None, mxfp4=False):
    """Fake (E, max_m, K) / (E, N, K) / (E, max_m, N) / (E,) tensors with symbolic
    extents and 16-byte-aligned symbolic strides (the TMA requirement).
    ``mxfp4``: b is (E, N, K/2) packed bytes and b_scale (E, N, K/32) E8M0
    bytes, N contiguous."""
    import cutlass
    import cutlass.cute as cute

    def ld(dtype):  # a stride in elements that is a multiple of 16 bytes
        return cute.sym_int64(divisibility=128 // dtype.width)

    e, m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    fake = cute.runtime.make_fake_tensor
    a = fake(ab_dtype, (e, m, k), (ld(ab_dtype), ld(ab_dtype), 1), assumed_align=16)
    b = fake(ab_dtype, (e, n, k), (ld(ab_dtype), ld(ab_dtype), 1), assumed_align=16)
    d = fake(out_dtype, (e, m, n), (ld(out_dtype), ld(out_dtype), 1), assumed_align=16)
    masked_m = fake(cutlass.Int32, (e,), (1,), assumed_align=4)
    signals = fake(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)
    sfa = sfb = None
    if ab_dtype.width == 8:
        f32 = cutlass.Float32
        kb, nb = cute.sym_int(), cute.sym_int()
        # activation scales (E, max_m, K/128), M contiguous, TMA-aligned strides;
        # weight scales (E, N/128, K/128) read element-wise: any strides
        sfa = fake(f32, (e, m, kb), (ld(f32), 1, ld(f32)), assumed_align=16)
        sfb = fake(f32, (e, nb, kb), (cute.sym_int64(), cute.sym_int64(), cute.sym_int64()), assumed_align=4)
    if mxfp4:
        u8 = cutlass.Uint8
        b = fake(cutlass.Int8, (e, n, cute.sym_int()), (ld(u8), ld(u8), 1), assumed_align=16)
        sfb = fake(u8, (e, n, cute.sym_int()), (ld(u8), 1, ld(u8)), assumed_align=16)
    # the fused combine: the routing of each row, the token-major output of the
    # sums (or this rank's receive buffer), the peers' receive-buffer addresses
    # and the per-expert bias
    sum_dtype = sum_dtype or cutlass.Float32
    routing = (
        fake(cutlass.Int32, (e, m), (cute.sym_int64(), 1), assumed_align=4),
        fake(cutlass.Float32, (e, m), (cute.sym_int64(), 1), assumed_align=4),
        cute.runtime.make_fake_compact_tensor(sum_dtype, (cute.sym_int(), n), stride_order=(1, 0),
                                              assumed_align=16),
        fake(cutlass.Int32, (1,), (1,), assumed_align=4),
        fake(cutlass.Int64, (cute.sym_int(),), (1,), assumed_align=8),
        cute.runtime.make_fake_compact_tensor(cutlass.Float32, (e, n), stride_order=(1, 0), assumed_align=16),
    )
    return a, b, d, masked_m, signals, sfa, sfb, routing


def _fake_act_out(fp8: bool):
    """The fused SwiGLU's h (E, max_m, I) (fp8 or bf16) and, for fp8, its
    (E, max_m, I/128) fp32 scales, M contiguous: the down GEMM's a / a_scale."""
    import cutlass
    import cutlass.cute as cute

    def ld(dtype):
        return cute.sym_int64(divisibility=128 // dtype.width)

    fake = cute.runtime.make_fake_tensor
    e, m, i = cute.sym_int(), cute.sym_int(), cute.sym_int()
    out_t = cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16
    h = fake(out_t, (e, m, i), (ld(out_t), ld(out_t), 1), assumed_align=16)
    scale = None
    if fp8:
        f32 = cutlass.Float32
        scale = fake(f32, (e, m, cute.sym_int()), (ld(f32), 1, ld(f32)), assumed_align=16)
    return h, scale


def build(spec: KernelSpec, arch: Optional[str] = None, keep_ptx: bool = False, trace: bool = False):
    """Compile one kernel (no caching). Returns the TVM-FFI callable
    ``fn(a, b, out, masked_m, signals, a_scale, b_scale, counter, token_idx,
    weight, combined, err, peers, bias, out_scale, num_ctas)`` (``signals`` is None without a
    signal mode; the scales are None for bf16; ``counter``, an int32 (2,)
    workspace that is zero between launches, only for the dynamic order, else
    None; ``out`` None and the routing tensors given only for the fused
    combine, ``peers`` only for ``Epilogue.COMBINE_PEERS*``, ``bias`` only for
    the ``*_BIAS`` combines; with the fused
    SwiGLU ``out`` is h and ``out_scale`` its fp8 scales); with ``keep_ptx`` its ``__ptx__``
    holds the generated PTX. ``trace``: a development build whose
    ``signals`` argument is a ``flashgemm.trace`` timeline buffer (never cached)."""
    arch = ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .kernel import MaskedGroupedGemmSm90

    config, fmt = spec.config, spec.fmt
    check_config(config, fmt, spec.epilogue)
    ab_t, out_t = _cutlass_dtype(fmt.value), _cutlass_dtype(OUT_DTYPE)
    gemm = MaskedGroupedGemmSm90(config, ab_t, out_t, spec.signal_mode, trace=trace, epilogue=spec.epilogue,
                                 fmt=fmt)
    op = spec.epilogue.op  # what the epilogue takes: its parameters, its rows' dtype
    a, b, d, masked_m, signals, sfa, sfb, routing = _fake_args(
        ab_t, out_t, cutlass.BFloat16 if op.rows_dtype == "bf16" else cutlass.Float32, fmt.converts_weights)
    routing = tuple(t if name in op.params else None for name, t in zip(ROUTING_SLOTS, routing))
    d_scale = None
    if not op.writes_out:
        d = None
    elif op.family == "swiglu":
        d, d_scale = _fake_act_out(op.fp8_out)
    if spec.signal_mode is None and not trace:
        # no signals tensor to pass: each tensor argument costs the call a
        # DLPack conversion and its checks on every call (docs/design.md)
        signals = None
    counter = None
    if config.order is TileOrder.DYNAMIC:
        counter = cute.runtime.make_fake_tensor(cutlass.Int32, (CLAIM_COUNTER_INTS,), (1,), assumed_align=4)
    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            gemm, a, b, d, masked_m, signals, sfa, sfb, counter, *routing, d_scale, cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


def get_kernel(spec: KernelSpec, arch: Optional[str] = None):
    """The cached compiled kernel of ``spec`` (compiled on first use, once per process)."""
    arch = arch or default_arch()
    return cache.cached(cache_key(arch, spec), lambda: build(spec, arch))


def combine_block_ms(specs: Iterable[KernelSpec]) -> list:
    """The m-block heights a combine waits on: the tile_m of every signalled kernel."""
    return sorted({s.config.tile_m for s in specs if s.signal_mode is not None})


def build_combine(
    block_m: int, arch: Optional[str] = None, keep_ptx: bool = False, rows_per_item: Optional[int] = None
):
    """Compile the reference combine (``combine.MaskedCombineSm90``), no caching."""
    ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .combine import MaskedCombineSm90

    # N is a multiple of 8 (validated): rows of out are 16-byte aligned
    e, m, t = cute.sym_int(), cute.sym_int(), cute.sym_int()
    n = cute.sym_int(divisibility=8)
    fake = cute.runtime.make_fake_compact_tensor

    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            MaskedCombineSm90(block_m, rows_per_item or DEFAULT_ROWS_PER_ITEM),
            row_major(cutlass.BFloat16, (e, m, n), 16),
            fake(cutlass.Int32, (e,), assumed_align=4),
            fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4),
            row_major(cutlass.Int32, (e, m)),
            row_major(cutlass.Float32, (e, m)),
            row_major(cutlass.Float32, (t, n)),
            fake(cutlass.Int32, (1,), assumed_align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


def combine_key(arch: str, block_m: int, rows_per_item: int) -> tuple:
    return cache_key(arch, "combine", block_m, rows_per_item)


def get_combine_kernel(block_m: int, rows_per_item: int, arch: Optional[str] = None):
    """The compiled reference combine, cached like the GEMMs."""
    arch = arch or default_arch()
    return cache.cached(
        combine_key(arch, block_m, rows_per_item),
        lambda: build_combine(block_m, arch, rows_per_item=rows_per_item),
    )
