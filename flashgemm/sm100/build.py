"""Compile entry points of the sm_100a / sm_103a masked grouped GEMMs
(``MaskedGroupedGemmSm100``, one ``Sm100Spec`` each), and ``precompile``.

The callable ``build`` returns takes torch tensors through TVM-FFI and
launches on torch's current stream::

    fn(a, b, sfa, sfb, alpha, out, masked_m, signals, num_ctas)

===========  =====================================  ==========================================
argument     shape (contiguous unless said)          torch dtype per format
===========  =====================================  ==========================================
a            (E, max_m, K), K contiguous,            MXFP8, MXFP8_MXFP4 float8_e4m3fn; BF16 bfloat16;
             16-byte aligned row strides             NVFP4 float4_e2m1fn_x2 of shape
                                                     (E, max_m, K // 2) (two codes a byte,
                                                     even column in the low nibble; a uint8
                                                     tensor passes as ``.view(torch.float4_e2m1fn_x2)``)
b            (E, N, K), like a                       like a; MXFP8_MXFP4 float4_e2m1fn_x2
                                                     (E, N, ceil(K / 128) * 64): rows padded to
                                                     whole 128-value pieces, 32-byte aligned
                                                     base and strides
sfa, sfb     (E, rm, rk, 32, 4, 4) 128x4 atoms       MXFP8(_MXFP4) float8_e8m0fnu, NVFP4 float8_e4m3fn
             (``blockscale.to_blocked_scales``;      (uint8 bytes as ``.view(...)``); None for BF16
             rm = ceil(max_m / 128) for sfa,
             ceil(N / 128) for sfb;
             rk = ceil(K / vec / 4))
alpha        (E,)                                    float32 for NVFP4; None otherwise
out          (E, max_m, N), N contiguous             bfloat16 (N a multiple of 8)
masked_m     (E,)                                    int32, on the GPU (never read by the host)
signals      (S,) zeroed counters                    int32; None when spec.signal_mode is None
num_ctas     python int                              persistent CTAs: <= SM count, a multiple
                                                     of config.cluster_size
===========  =====================================  ==========================================

Extents (E, max_m, N, K, rm, rk, S) and strides are symbolic, so one compiled
object serves every shape; masked_m is data, so a new token distribution
never recompiles. Signals follow ``flashgemm.signals`` with the block of
``signal_block(spec)``.
"""

from __future__ import annotations

from typing import Optional

from ..formats import Format
from ..jit import cache
from ..jit.arch import default_arch, ensure_arch_env
from ..jit.key import cache_key
from .config import Sm100Spec
from .limits import check_spec

# torch dtype names of (a and b, the scale factors) per format, for callers
# that hold bytes and view them before the call
TORCH_DTYPES = {
    Format.MXFP8: ("float8_e4m3fn", "float8_e8m0fnu"),
    Format.NVFP4: ("float4_e2m1fn_x2", "float8_e4m3fn"),
    Format.BF16: ("bfloat16", None),
    Format.MXFP8_MXFP4: ("float8_e4m3fn", "float8_e8m0fnu"),  # (b: float4_e2m1fn_x2, as NVFP4's)
}


def signal_block(spec: Sm100Spec) -> tuple:
    """(block_m, block_n) of ``flashgemm.signals.make_signal_layout`` for
    this kernel: each CTA publishes its own 128 rows of a tile, so a 2-CTA
    tile counts as two 128-row m-blocks."""
    return (spec.config.cta_tile_m, spec.config.tile_n)


def _dtypes(fmt: Format):
    """(a element, b element, scale factor) cutlass dtypes of a format."""
    import cutlass

    return {
        Format.MXFP8: (cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU),
        Format.NVFP4: (cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, cutlass.Float8E4M3FN),
        Format.BF16: (cutlass.BFloat16, cutlass.BFloat16, None),
        Format.MXFP8_MXFP4: (cutlass.Float8E4M3FN, cutlass.Float4E2M1FN, cutlass.Float8E8M0FNU),
    }[fmt]


def _fake_args(fmt: Format, with_alpha: bool, with_signals: bool):
    """Fake tensors with symbolic extents and 16-byte-aligned symbolic strides."""
    import cutlass
    import cutlass.cute as cute

    a_dtype, b_dtype, sf_dtype = _dtypes(fmt)
    fake = cute.runtime.make_fake_tensor

    def ld(dtype):  # a stride in elements that is a multiple of 16 bytes
        return cute.sym_int64(divisibility=128 // dtype.width)

    e, m, n = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=8)
    k = cute.sym_int(divisibility=fmt.k_align)
    a = fake(a_dtype, (e, m, k), (ld(a_dtype), ld(a_dtype), 1), assumed_align=16)
    if fmt is Format.MXFP8_MXFP4:
        # packed e2m1 b under the unpacking TMA (padded_b): K of its own, in
        # whole 128-value pieces, and 32-byte rows and base
        b_ld = cute.sym_int64(divisibility=64)
        b = fake(b_dtype, (e, n, cute.sym_int(divisibility=128)), (b_ld, b_ld, 1), assumed_align=32)
    else:
        b = fake(b_dtype, (e, n, k), (ld(b_dtype), ld(b_dtype), 1), assumed_align=16)
    out = fake(cutlass.BFloat16, (e, m, n), (ld(cutlass.BFloat16), ld(cutlass.BFloat16), 1), assumed_align=16)
    masked_m = fake(cutlass.Int32, (e,), (1,), assumed_align=4)
    sfa = sfb = alpha = signals = None
    if sf_dtype is not None:
        def atoms(rows):
            rk = cute.sym_int()
            return cute.runtime.make_fake_compact_tensor(
                sf_dtype, (e, rows, rk, 32, 4, 4), stride_order=(5, 4, 3, 2, 1, 0), assumed_align=16
            )

        sfa, sfb = atoms(cute.sym_int()), atoms(cute.sym_int())
    if with_alpha:
        alpha = fake(cutlass.Float32, (e,), (1,), assumed_align=4)
    if with_signals:
        signals = fake(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)
    return a, b, sfa, sfb, alpha, out, masked_m, signals


def build(spec: Sm100Spec, arch: Optional[str] = None, keep_ptx: bool = False):
    """Compile one kernel (no caching): the TVM-FFI callable of the module
    docstring; with ``keep_ptx`` its ``__ptx__`` holds the PTX."""
    arch = ensure_arch_env(arch)
    check_spec(spec)
    import cutlass
    import cutlass.cute as cute

    from ..jit.options import compile_options
    from .kernel import MaskedGroupedGemmSm100

    config = spec.config
    a_dtype, b_dtype, sf_dtype = _dtypes(config.fmt)
    gemm = MaskedGroupedGemmSm100(config, a_dtype, sf_dtype, spec.signal_mode, b_dtype)
    args = _fake_args(config.fmt, config.has_alpha, spec.signal_mode is not None)
    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            gemm, *args, cutlass.Int32(1), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


def get_kernel(spec: Sm100Spec, arch: Optional[str] = None):
    """The cached compiled kernel of ``spec`` (compiled on first use, once per process)."""
    arch = arch or default_arch()
    return cache.cached(cache_key(arch, spec), lambda: build(spec, arch))
