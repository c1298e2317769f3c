"""The fused SwiGLU of gate_up: B is w13 with its gate and up rows
interleaved in ``SWIGLU_GRANULE``-row groups, and each tile leaves as
``h = silu(gate) * up`` from registers (no bulk stores), as bf16 or
quantized 1x128 to fp8 with its scales (``out_scale``); the fp8 build keeps
the cluster peer's row maxima (two tiles' worth of fp32 per row)."""

from .base import COMBINE_ONLY, EpilogueOp

SWIGLU_FP8 = EpilogueOp(name="swiglu_fp8", family="swiglu", params=("out_scale",), fp8_out=True,
                        extra_smem=2 * 4, ptx_required=frozenset({"fp8-cvt"}),
                        ptx_forbidden=COMBINE_ONLY | {"tma-store"})
SWIGLU_BF16 = EpilogueOp(name="swiglu_bf16", family="swiglu", ptx_forbidden=COMBINE_ONLY | {"tma-store", "fp8-cvt"})
