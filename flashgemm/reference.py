"""Torch reference of the op (CPU or GPU), computed in float32 or float64."""

from __future__ import annotations

from typing import Optional

import torch

from .quant import dequantize_fp8_per_block, dequantize_fp8_per_token


def clamp_masked_m(masked_m: torch.Tensor, max_m: int) -> torch.Tensor:
    """m_e = clamp(masked_m[e], 0, max_m), as the kernel reads it."""
    return masked_m.to(torch.int64).clamp(0, max_m)


def grouped_gemm_nt_masked_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    masked_m: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    *,
    acc_dtype: torch.dtype = torch.float32,
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out[e, :m_e] = a[e, :m_e] @ b[e].T in ``acc_dtype``; rows >= m_e are taken
    from ``out`` when given (the kernel leaves them untouched), else zero.

    float8_e4m3fn operands need ``a_scale`` (1x128) and ``b_scale`` (128x128),
    or for MXFP4 weights (int8 ``b`` and its E8M0 ``b_scale`` from
    ``mxfp4.prepare_weights``) the exponents: the product is taken of the
    dequantized operands. bf16 ``a`` takes MXFP4 weights too (``b_scale``
    only).

    Returns a tensor of dtype ``acc_dtype`` (round it to compare with a bf16 result).
    """
    mxfp4 = b.dtype == torch.int8  # (prepared MXFP4 weights, with fp8 or bf16 a)
    if a.dtype == torch.float8_e4m3fn:
        if a_scale is None or b_scale is None:
            raise ValueError("float8_e4m3fn operands need a_scale and b_scale")
        a = dequantize_fp8_per_token(a, a_scale)
        if not mxfp4:
            b = dequantize_fp8_per_block(b, b_scale)
    elif a_scale is not None or (b_scale is not None and not mxfp4):
        raise ValueError(f"scales are only for float8_e4m3fn operands or MXFP4 weights, got {a.dtype}")
    if mxfp4:
        if b_scale is None:
            raise ValueError("MXFP4 weights (int8 b) need b_scale, their E8M0 exponents")
        from .mxfp4 import dequantize_mxfp4, unprepare_weights

        b = dequantize_mxfp4(*unprepare_weights(b, b_scale))
    e_count, max_m, _ = a.shape
    n = b.shape[1]
    if out is not None:
        ref = out.to(acc_dtype).clone()
    else:
        ref = torch.zeros(e_count, max_m, n, dtype=acc_dtype, device=a.device)
    rows = clamp_masked_m(masked_m, max_m).tolist()  # host sync: reference only
    for e, m in enumerate(rows):
        if m:
            ref[e, :m] = a[e, :m].to(acc_dtype) @ b[e].to(acc_dtype).T
    return ref


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out64, ref64 = out.double(), ref.double()
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def similarity(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2 * sum(x * y) / sum(x * x + y * y) in float64: 0 for equal tensors,
    ~1e-5 for a good bf16 rounding of an fp32 product (DeepGEMM's test measure)."""
    x64, y64 = x.double(), y.double()
    denom = (x64 * x64 + y64 * y64).sum().item()
    return 1.0 - 2.0 * (x64 * y64).sum().item() / denom if denom > 0 else 0.0
