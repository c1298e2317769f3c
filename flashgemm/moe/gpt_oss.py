"""gpt-oss's expert MLP as its model code defines it: the float reference the
4-bit layer is held to (``flashgemm.mxfp4`` gives its weights as floats).

    gu   = x @ w13.T + b13          w13 [E, 2I, H]: row 2j is gate j, row 2j + 1 up j
    gate = min(gu[..., 0::2], 7)
    up   = clamp(gu[..., 1::2], -7, 7)
    h    = gate * sigmoid(1.702 * gate) * (up + 1)
    y    = h @ w2.T + b2            w2 [E, H, I]

Each token's output is the routing-weighted sum of its experts' y. gpt-oss
runs H = I = 2880 (not a multiple of 128) with 128 experts, top-4 (120b).
"""

from __future__ import annotations

from typing import Optional

import torch

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def clamped_swiglu(gu: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss's activation of the interleaved gate_up output [..., 2I] -> [..., I],
    in float32 or, for float64 input, float64."""
    if gu.shape[-1] % 2:
        raise ValueError(f"gu's last dimension must be even (gate and up interleaved), got {gu.shape[-1]}")
    gu = gu.to(torch.promote_types(gu.dtype, torch.float32))
    gate = gu[..., 0::2].clamp(max=limit)
    up = gu[..., 1::2].clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1.0)


def gpt_oss_experts_ref(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    *,
    token_index: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    num_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Float64 reference of the layer in the masked layout: x [E, max_m, H]
    (its valid rows m_e = clamp(masked_m[e], 0, max_m)), w13 [E, 2I, H], b13
    [E, 2I], w2 [E, H, I], b2 [E, H], all as floats (dequantized). Returns y
    [E, max_m, H] with rows >= m_e zero, or with the routing (token_index,
    weight [E, max_m], num_tokens) the combined [T, H] sums."""
    from ..reference import clamp_masked_m

    e_count, max_m, hidden = x.shape
    if w13.shape[0] != e_count or w13.shape[2] != hidden or tuple(b13.shape) != (e_count, w13.shape[1]):
        raise ValueError(f"w13 must be [E={e_count}, 2I, H={hidden}] with b13 [E, 2I], got {tuple(w13.shape)} and "
                         f"{tuple(b13.shape)}")
    inter = w13.shape[1] // 2
    if tuple(w2.shape) != (e_count, hidden, inter) or tuple(b2.shape) != (e_count, hidden):
        raise ValueError(f"w2 must be [E, H, I] = {(e_count, hidden, inter)} with b2 [E, H], got "
                         f"{tuple(w2.shape)} and {tuple(b2.shape)}")
    rows = clamp_masked_m(masked_m, max_m).to(x.device)
    valid = (torch.arange(max_m, device=x.device)[None, :] < rows[:, None])[..., None]
    f64 = torch.float64
    gu = torch.einsum("emk,enk->emn", x.to(f64), w13.to(f64)) + b13.to(f64)[:, None, :]
    h = clamped_swiglu(gu)
    y = (torch.einsum("emi,ehi->emh", h, w2.to(f64)) + b2.to(f64)[:, None, :]) * valid
    if token_index is None:
        return y
    out = torch.zeros(num_tokens, hidden, dtype=f64, device=y.device)
    w = (weight.to(f64)[..., None] * valid) * y
    idx = torch.where(valid[..., 0], token_index.long(), 0)
    out.index_add_(0, idx.reshape(-1), w.reshape(-1, hidden))
    return out
