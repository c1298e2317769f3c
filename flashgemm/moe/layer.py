"""The expert computation of an expert-parallel MoE layer, in the masked layout.

After a dispatch, ``x[e, :m_e]`` holds the tokens routed to local expert e.
``MaskedExperts`` runs them through

1. gate_up: ``gu = x @ w13.T`` (masked grouped GEMM, bf16 out),
2. SwiGLU: ``h = silu(gu[..., :I]) * gu[..., I:]``, quantized to 1x128 fp8
   for an fp8 layer: in the gate_up GEMM's epilogue (``ActivationPath.FUSED``,
   ``gate_up``), or by a kernel of its own (``SEPARATE``, ``activation``),
3. down: ``y = h @ w2.T``, with the combine fused into its epilogue
   (``output[token_index[e, r]] += weight[e, r] * y[e, r]``), or with
   completion signals for an external combine, or stored plainly.

Everything stays on the GPU: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from ..api import grouped_gemm_nt_masked
from ..config import SWIGLU_GRANULE
from ..routing import Combine
from .activation import SCALE_BLOCK, silu_mul
from .gate_up import deinterleave_w13, gate_up_swiglu, interleave_w13

FP8 = torch.float8_e4m3fn


class ActivationPath(enum.Enum):
    """Where the SwiGLU runs (both give the same h: docs/design.md)."""

    FUSED = "fused"  # in the gate_up GEMM's epilogue: gate_up never reaches memory (sm_90)
    SEPARATE = "separate"  # the gate_up GEMM stores gate_up, then the activation kernel


class MaskedExperts:
    """The local experts' weights, in the usual checkpoint layout.

    w13: [E, 2I, H], the gate projection's I rows then the up projection's;
    w2: [E, H, I]. fp8 e4m3 with 128x128 block scales (``w13_scale`` [E,
    2I/128, H/128], ``w2_scale`` [E, H/128, I/128]: DeepSeek-V3's recipe), or
    bf16 without scales, or MXFP4 as ``mxfp4.prepare_weights`` makes it (int8
    w13 [E, 2I, H/2] and w2 [E, H, I/2], their E8M0 exponents [E, 2I, H/32] /
    [E, H, I/32] as the scales; x then fp8 or bf16, h the same). I must be a
    multiple of 128 for fp8 activations (8 for bf16; 64 for
    ``ActivationPath.FUSED``).

    ``activation``: an :class:`ActivationPath`, or None for FUSED where the
    shape allows it (I a multiple of 64: always for fp8) and SEPARATE
    otherwise. FUSED keeps w13 (and its scales) interleaved in 64-row gate /
    up groups (``gate_up.interleave_w13``, done here once), in place of the
    checkpoint layout.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, w13_scale=None, w2_scale=None,
                 activation: Optional[ActivationPath] = None):
        for name, w in (("w13", w13), ("w2", w2)):
            if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in (FP8, torch.bfloat16, torch.int8):
                raise TypeError(f"{name} must be a 3-D float8_e4m3fn, bfloat16 or int8 (MXFP4, "
                                f"mxfp4.prepare_weights) tensor, got {getattr(w, 'dtype', type(w).__name__)}")
        if w13.dtype != w2.dtype:
            raise TypeError(f"w13 and w2 must share a dtype, got {w13.dtype} and {w2.dtype}")
        self.mxfp4 = w13.dtype == torch.int8
        per_byte = 2 if self.mxfp4 else 1  # (MXFP4: two values per byte along K)
        e_count, two_i, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * per_byte
        if two_i % 2 or tuple(w2.shape) != (e_count, hidden, two_i // 2 // per_byte):
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I] (MXFP4: the last dimension halved); got "
                             f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        self.fp8 = w13.dtype in (FP8, torch.int8)  # (fp8 activations)
        if self.fp8 and (w13_scale is None or w2_scale is None):
            raise ValueError("fp8 weights need w13_scale and w2_scale (128x128 block scales; MXFP4 weights: "
                             "the E8M0 exponents of mxfp4.prepare_weights)")
        if not self.fp8 and (w13_scale is not None or w2_scale is not None):
            raise ValueError("block scales are only for fp8 weights")
        if activation is None:
            fits = (two_i // 2) % SWIGLU_GRANULE == 0
            activation = ActivationPath.FUSED if fits else ActivationPath.SEPARATE
        if not isinstance(activation, ActivationPath):
            raise TypeError(f"activation must be a flashgemm.moe.ActivationPath, got {activation!r}")
        self.activation = activation
        inter, mult = two_i // 2, (SCALE_BLOCK if self.fp8 else 8)
        if activation is ActivationPath.SEPARATE and inter % mult:
            # checked here, not after gate_up has run: the activation kernel needs whole 1x128 scale
            # blocks of h (fp8) or 16-byte rows (bf16)
            raise ValueError(f"w13 [E, 2I, H] and w2 give I={inter}; ActivationPath.SEPARATE needs I a "
                             f"multiple of {mult} for {'fp8' if self.fp8 else 'bf16'} weights")
        self.w13_interleaved = None
        if activation is ActivationPath.FUSED:
            self.w13_interleaved = interleave_w13(w13, w13_scale)
            w13, w13_scale = self.w13_interleaved
        self.w13, self.w2 = w13, w2
        self.w13_scale, self.w2_scale = w13_scale, w2_scale
        self.num_experts, self.hidden, self.intermediate = e_count, hidden, two_i // 2

    def checkpoint_weights(self) -> dict:
        """w13, w2, w13_scale, w2_scale in the checkpoint layout (a copy of
        w13 for ``ActivationPath.FUSED``): what the float references take."""
        w13, w13_scale = self.w13, self.w13_scale
        if self.activation is ActivationPath.FUSED:
            w13, w13_scale = deinterleave_w13(w13, w13_scale)
        return dict(w13=w13, w2=self.w2, w13_scale=w13_scale, w2_scale=self.w2_scale)

    def __call__(
        self,
        x: torch.Tensor,
        masked_m: torch.Tensor,
        *,
        x_scale: Optional[torch.Tensor] = None,
        expected_m: Optional[int] = None,
        combine: Optional[Combine] = None,
        dst_signals: Optional[torch.Tensor] = None,
        num_sms: Optional[int] = None,
    ):
        """x: [E, max_m, H] (fp8 with ``x_scale`` [E, max_m, H/128] for an fp8
        layer, else bf16; MXFP4 weights take either); masked_m: int32 [E] on the GPU.

        With ``combine`` the down GEMM reduce-adds each valid row, times its
        routing weight, into ``combine.output`` (fp32 or bf16 [T, H]) and the call
        returns ``(output, err)``. With ``dst_signals`` it returns ``(y,
        layout)`` as ``grouped_gemm_nt_masked`` does, for a combine that
        polls. Otherwise it returns y [E, max_m, H] bf16 (rows >= m_e unwritten).
        """
        h, h_scale = self.up(x, masked_m, x_scale=x_scale, expected_m=expected_m, num_sms=num_sms)
        return grouped_gemm_nt_masked(
            h, self.w2, None, masked_m, a_scale=h_scale, b_scale=self.w2_scale, expected_m=expected_m,
            num_sms=num_sms, combine=combine, dst_signals=dst_signals,
        )

    def up(self, x: torch.Tensor, masked_m: torch.Tensor, *, x_scale: Optional[torch.Tensor] = None,
           expected_m: Optional[int] = None, num_sms: Optional[int] = None):
        """gate_up and the SwiGLU (by ``self.activation``): the down GEMM's
        input (h, h_scale), h_scale None for bf16."""
        if x.shape[0] != self.num_experts or x.shape[-1] != self.hidden:
            raise ValueError(f"x must be [E={self.num_experts}, max_m, H={self.hidden}], got {tuple(x.shape)}")
        h_scale = None
        fp8 = x.dtype == FP8 if self.mxfp4 else self.fp8  # (h in the activations' precision)
        if self.activation is ActivationPath.FUSED:
            h = gate_up_swiglu(x, self.w13_interleaved, masked_m, x_scale=x_scale,
                               expected_m=expected_m, num_sms=num_sms)
            if fp8:
                h, h_scale = h
        else:
            gate_up = grouped_gemm_nt_masked(
                x, self.w13, None, masked_m, a_scale=x_scale, b_scale=self.w13_scale,
                expected_m=expected_m, num_sms=num_sms,
            )
            if fp8:
                h, h_scale = silu_mul(gate_up, masked_m, fp8=True, num_sms=num_sms)
            else:
                h = silu_mul(gate_up, masked_m, fp8=False, num_sms=num_sms)
        return h, h_scale


def moe_experts_ref(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    x_scale=None,
    w13_scale=None,
    w2_scale=None,
    token_index: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    num_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Float32 reference of the whole path on the same (de)quantized inputs,
    with the roundings the path has by definition: the gate_up and down
    outputs in bf16, and for fp8 the activation quantized 1x128 as
    ``quant.quantize_fp8_per_token`` does. Returns y [E, max_m, H] (float32,
    rows >= m_e zero), or with the routing the combined [T, H] float32 sums."""
    from ..quant import quantize_fp8_per_token
    from ..reference import clamp_masked_m, grouped_gemm_nt_masked_ref

    fp8 = x.dtype == FP8
    gu = grouped_gemm_nt_masked_ref(x, w13, masked_m, a_scale=x_scale, b_scale=w13_scale).to(torch.bfloat16)
    inter = gu.shape[-1] // 2
    h = torch.nn.functional.silu(gu[..., :inter].float()) * gu[..., inter:].float()
    rows = clamp_masked_m(masked_m, x.shape[1]).to(h.device)
    valid = torch.arange(x.shape[1], device=h.device)[None, :] < rows[:, None]
    h = h * valid[..., None]
    if fp8:
        hq, hs = quantize_fp8_per_token(h)
        y = grouped_gemm_nt_masked_ref(hq, w2, masked_m, a_scale=hs, b_scale=w2_scale)
    else:
        y = grouped_gemm_nt_masked_ref(h.to(torch.bfloat16), w2, masked_m, b_scale=w2_scale)  # (MXFP4 w2: exponents)
    y = y.to(torch.bfloat16).float() * valid[..., None]
    if token_index is None:
        return y
    out = torch.zeros(num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    w = (weight.float() * valid)[..., None] * y
    idx = torch.where(valid, token_index.long(), 0)
    out.index_add_(0, idx.reshape(-1), w.reshape(-1, y.shape[-1]))
    return out
