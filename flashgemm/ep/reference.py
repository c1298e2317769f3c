"""The all-gather reference of an EP MoE layer: every rank gathers all
ranks' tokens and routing, runs its local experts on every copy routed to
them (``flashgemm.moe.layer.moe_experts_ref``, in chunks of experts to bound
the float32 dequantized weights), and an all-reduce sums the partial outputs;
each rank keeps its own tokens' rows. Float32 throughout, with the path's
roundings by definition (bf16 GEMM outputs, 1x128 fp8 activations)."""

from __future__ import annotations

from typing import Optional

import torch

from ..moe.layer import MaskedExperts, moe_experts_ref
from .plan import plan_world

FP8 = torch.float8_e4m3fn
EXPERTS_PER_CHUNK = 8


def _gather(t: torch.Tensor, world: int, group) -> list:
    import torch.distributed as dist

    if world == 1:
        return [t]
    raw = t.view(torch.uint8) if t.dtype == FP8 else t
    out = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(out, raw.contiguous(), group=group)
    return [o.view(torch.float8_e4m3fn) for o in out] if t.dtype == FP8 else out


def ep_layer_ref(experts: MaskedExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, *, x_scale: Optional[torch.Tensor] = None, rank: int = 0, world: int = 1,
                 group=None) -> torch.Tensor:
    """This rank's [T, H] float32 layer output. Collective when world > 1
    (every rank passes the same T)."""
    import torch.distributed as dist

    xs = _gather(x, world, group)
    scales = _gather(x_scale, world, group) if x_scale is not None else None
    ids = _gather(topk_ids, world, group)
    weights = _gather(topk_weights.float(), world, group)
    num_tokens = x.shape[0]
    counts = torch.bincount(torch.cat([i.reshape(-1) for i in ids]).long().clamp(min=0),
                            minlength=num_experts)
    max_m = max(1, int(counts.max()))
    plan = plan_world(ids, weights, num_experts, max_m=max_m)
    rp, routing = plan.receive[rank], plan.routing[rank]
    src_rank, src_token = plan.sources[rank]
    rows = plan.rows[rank]
    e_local, hidden = experts.num_experts, x.shape[1]
    all_x = torch.cat(xs)
    gather = src_rank * num_tokens + src_token
    layout = torch.zeros(e_local * max_m, hidden, dtype=torch.uint8 if x.dtype == FP8 else x.dtype,
                         device=x.device)
    layout[rows] = all_x.view(torch.uint8)[gather] if x.dtype == FP8 else all_x[gather]
    layout = layout.view(e_local, max_m, hidden)
    if x.dtype == FP8:
        layout = layout.view(FP8)
    layout_s = None
    if scales is not None:
        all_s = torch.cat(scales)
        layout_s = torch.ones(e_local * max_m, all_s.shape[1], dtype=torch.float32, device=x.device)
        layout_s[rows] = all_s[gather]
        layout_s = layout_s.view(e_local, max_m, -1)
    token_index = torch.where(routing.src_rank >= 0, routing.src_rank * num_tokens + routing.src_token, 0)
    out = torch.zeros(world * num_tokens, hidden, dtype=torch.float32, device=x.device)
    w = experts.checkpoint_weights()
    for e0 in range(0, e_local, EXPERTS_PER_CHUNK):
        e1 = min(e_local, e0 + EXPERTS_PER_CHUNK)
        if int(rp.masked_m[e0:e1].sum()) == 0:
            continue
        pick = slice(e0, e1)
        out += moe_experts_ref(
            layout[pick], rp.masked_m[pick], w["w13"][pick], w["w2"][pick],
            x_scale=None if layout_s is None else layout_s[pick],
            w13_scale=None if w["w13_scale"] is None else w["w13_scale"][pick],
            w2_scale=None if w["w2_scale"] is None else w["w2_scale"][pick],
            token_index=token_index[pick].to(torch.int32), weight=routing.weight[pick],
            num_tokens=world * num_tokens,
        )
    if world > 1:
        dist.all_reduce(out, group=group)
    return out[rank * num_tokens:(rank + 1) * num_tokens]
