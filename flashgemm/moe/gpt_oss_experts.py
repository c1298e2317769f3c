"""gpt-oss's expert layer in the masked layout (``moe.gpt_oss`` holds its
formula and the float reference):

1. gate_up: ``gu = x @ w13.T`` (masked grouped GEMM, bf16 out), w13's rows
   in the checkpoint's order (row 2j gate j, row 2j + 1 up j);
2. ``h = clamped_swiglu(gu + b13)`` (``activation.gpt_oss_swiglu``), for
   MXFP4 weights quantized 1x128 to fp8, the down GEMM's input;
3. down with the combine and the down biases fused:
   ``output[token] += weight * (h @ w2.T + b2[e])`` (``Combine.bias``: b2
   added in fp32 to each row, rounded to bf16, before its weight), into an
   fp32 or bf16 output or, with ``combine.peers``, stored into the owner
   ranks' receive buffers.

MXFP4 weights (``mxfp4.prepare_weights``) take fp8 activations with 1x128
scales (h then fp8 too) or bf16 activations (``Format.BF16_MXFP4``: h in
bf16, the model's own precision); bf16 weights take bf16 activations. H and
I need not be multiples
of 128 and nothing is padded: the GEMMs' TMA fills a last partial k-tile
with zeros, and h's last 1x128 scale block covers what is left (64 columns
at I = 2880). Everything stays on the GPU: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..api import grouped_gemm_nt_masked
from ..routing import Combine, check_combine
from .activation import gpt_oss_swiglu


class GptOssExperts:
    """The local experts of a gpt-oss layer.

    w13: [E, 2I, H] (gate and up rows interleaved), w2: [E, H, I]; bf16, or
    MXFP4 as ``mxfp4.prepare_weights`` makes them (int8 with the last
    dimension halved, their E8M0 exponents [E, 2I, H/32] / [E, H, I/32] as
    ``w13_scale`` / ``w2_scale``). b13: [E, 2I], b2: [E, H], any float dtype
    (kept as float32 copies).
    """

    def __init__(self, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, *,
                 w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None):
        for name, w in (("w13", w13), ("w2", w2)):
            if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in (torch.bfloat16, torch.int8):
                raise TypeError(f"{name} must be a 3-D bfloat16 or int8 (MXFP4, mxfp4.prepare_weights) tensor, "
                                f"got {getattr(w, 'dtype', type(w).__name__)}")
        if w13.dtype != w2.dtype:
            raise TypeError(f"w13 and w2 must share a dtype, got {w13.dtype} and {w2.dtype}")
        self.mxfp4 = w13.dtype == torch.int8
        per_byte = 2 if self.mxfp4 else 1
        e_count, two_i, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * per_byte
        inter = two_i // 2
        if two_i % 2 or tuple(w2.shape) != (e_count, hidden, inter // per_byte):
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I] (MXFP4: the last dimension halved); got "
                             f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        for name, b, want in (("b13", b13, (e_count, two_i)), ("b2", b2, (e_count, hidden))):
            if not isinstance(b, torch.Tensor) or not b.is_floating_point() or tuple(b.shape) != want:
                raise ValueError(f"{name} must be a floating-point tensor of shape {want}, got "
                                 f"{tuple(getattr(b, 'shape', ()))}")
            if b.device != w13.device:
                raise ValueError(f"{name} is on {b.device} but w13 is on {w13.device}")
        if self.mxfp4 and (w13_scale is None or w2_scale is None):
            raise ValueError("MXFP4 weights need w13_scale and w2_scale (the E8M0 exponents of "
                             "mxfp4.prepare_weights)")
        if not self.mxfp4 and (w13_scale is not None or w2_scale is not None):
            raise ValueError("scales are only for MXFP4 weights")
        self.w13, self.w2, self.w13_scale, self.w2_scale = w13, w2, w13_scale, w2_scale
        self.b13 = b13.float().contiguous()
        # a copy of its own: a fresh allocation meets the combine's 16-byte alignment
        self.b2 = b2.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        self.num_experts, self.hidden, self.intermediate = e_count, hidden, inter

    def __call__(self, x: torch.Tensor, masked_m: torch.Tensor, combine: Combine, *,
                 x_scale: Optional[torch.Tensor] = None, expected_m: Optional[int] = None,
                 num_sms: Optional[int] = None):
        """x: [E, max_m, H], bf16, or for MXFP4 weights also fp8 with
        ``x_scale`` [E, max_m, ceil(H/128)]; masked_m: int32 [E] on the GPU; combine:
        where each valid row goes (``combine.output`` fp32 or bf16 [T, H], or
        with ``combine.peers`` this rank's bf16 receive buffer), without a
        bias of its own (b2 is the layer's). Returns ``(output, err)`` as
        ``grouped_gemm_nt_masked`` does."""
        if isinstance(combine, Combine):
            if combine.bias is not None:
                raise ValueError("combine.bias must be None: GptOssExperts adds its own down biases (b2)")
            combine = combine._replace(bias=self.b2)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != self.num_experts \
                or x.shape[-1] != self.hidden:
            raise ValueError(f"x must be [E={self.num_experts}, max_m, H={self.hidden}], got "
                             f"{tuple(getattr(x, 'shape', ()))}")
        if isinstance(combine, Combine) and combine.err is None:
            combine = combine._replace(err=torch.zeros(1, dtype=torch.int32, device=x.device))
        # the down GEMM checks the combine again; here it is checked before gate_up launches
        check_combine(combine, None, None, self.num_experts, x.shape[1], self.hidden,
                      {"x": x, "masked_m": masked_m, "x_scale": x_scale})
        gu = grouped_gemm_nt_masked(x, self.w13, None, masked_m, a_scale=x_scale, b_scale=self.w13_scale,
                                    expected_m=expected_m, num_sms=num_sms)
        fp8 = x.dtype == torch.float8_e4m3fn  # (h in the activations' precision)
        h = gpt_oss_swiglu(gu, self.b13, masked_m, fp8=fp8, num_sms=num_sms)
        h, h_scale = h if fp8 else (h, None)
        return grouped_gemm_nt_masked(h, self.w2, None, masked_m, a_scale=h_scale, b_scale=self.w2_scale,
                                      expected_m=expected_m, num_sms=num_sms, combine=combine)
