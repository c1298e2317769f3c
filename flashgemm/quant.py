"""Block-scaled FP8 quantization (the DeepSeek-V3 recipe) and its inverse.

Activations get one float32 scale per row and 128-wide K block (1x128),
weights one per 128x128 block. A block's scale maps its largest magnitude to
the e4m3 maximum (448), so ``x ~= fp8 * scale`` block by block. Edge blocks
(K or N not a multiple of 128) are simply narrower. ``power_of_two`` rounds
each scale up to a power of two, the UE8M0-valued scales newer checkpoints
use; the kernels take them as ordinary float32 values.

Used by the reference and the tests, and usable by callers.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0
_MIN_AMAX = 1e-10  # an all-zero block still gets a finite scale


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _pad_last(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad dimension ``dim`` of x to a multiple of FP8_BLOCK."""
    pad = _blocks(x.shape[dim]) * FP8_BLOCK - x.shape[dim]
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _scale_from_amax(amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    scale = amax.float().clamp(min=_MIN_AMAX) / FP8_E4M3_MAX
    if power_of_two:
        # 2**ceil(log2(s)) from the exponent bits: scale = mant * 2**exp with
        # mant in [0.5, 1), so it is 2**(exp - 1) when mant == 0.5, else 2**exp.
        # (float32 log2 rounds s = 2**k * (1 + 2**-23) to k, one power short.)
        mant, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - (mant == 0.5).to(exp.dtype))
    return scale


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_per_token(x: torch.Tensor, *, power_of_two: bool = False, m_major: bool = True):
    """x [..., M, K] -> (x_fp8 [..., M, K], scales float32 [..., M, ceil(K/128)]).

    With ``m_major`` (default) the scales are a view whose M dimension is
    contiguous and whose other strides are multiples of 4 elements (16 bytes):
    the layout a low-latency dispatch writes and the kernel TMA-loads in place.
    Otherwise a plain contiguous [..., M, K-blocks] tensor (the kernel copies
    it into the M-major layout on every call).
    """
    *batch, m, k = x.shape
    xp = _pad_last(x.float(), -1).reshape(*batch, m, _blocks(k), FP8_BLOCK)
    scale = _scale_from_amax(xp.abs().amax(dim=-1), power_of_two)  # [..., M, KB]
    q = _to_fp8(xp / scale.unsqueeze(-1)).reshape(*batch, m, _blocks(k) * FP8_BLOCK)[..., :k]
    if not m_major:
        return q.contiguous(), scale.contiguous()
    m_pad = -(-m // 4) * 4
    store = scale.new_zeros(*batch, _blocks(k), m_pad)
    store[..., :m] = scale.transpose(-1, -2)
    return q.contiguous(), store.transpose(-1, -2)[..., :m, :]


def quantize_fp8_per_block(w: torch.Tensor, *, power_of_two: bool = False):
    """w [..., N, K] -> (w_fp8 [..., N, K], scales float32 [..., ceil(N/128), ceil(K/128)])."""
    *batch, n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    wp = _pad_last(_pad_last(w.float(), -1), -2).reshape(*batch, nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = _scale_from_amax(wp.abs().amax(dim=(-3, -1)), power_of_two)  # [..., NB, KB]
    q = _to_fp8(wp / scale[..., :, None, :, None])
    q = q.reshape(*batch, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k]
    return q.contiguous(), scale.contiguous()


def dequantize_fp8_per_token(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_per_token` (any scale strides), float32."""
    k = x_fp8.shape[-1]
    expanded = scales.float().repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return x_fp8.float() * expanded


def dequantize_fp8_per_block(w_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_per_block`, float32."""
    n, k = w_fp8.shape[-2:]
    expanded = scales.float().repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    expanded = expanded.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return w_fp8.float() * expanded
