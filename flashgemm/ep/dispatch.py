"""Baseline dispatch into the masked layout over
``torch.distributed.all_to_all_single`` (NCCL), not over symmetric memory.

Per layer: one all-to-all of the counts [W, E_local], one device-to-host copy
of the split sizes (``all_to_all_single`` takes its splits on the host, so
this dispatch is not CUDA-graph capturable), then one all-to-all each of the
token rows, their routing metadata and, for fp8, their 1x128 scales. The
receiver scatters the rows into ``x[E_local, max_m, H]`` at the rows the plan
gives (``plan``: source rank, then token order) and builds the combine's
routing. At world size 1, or without a process group, the collectives are
skipped: the dispatch is a local permutation.

It is the measured baseline; a dispatch writing straight into the peers'
symmetric buffers is the engine-side alternative this module does not build.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .plan import (
    CombineRouting,
    Placement,
    ReceivePlan,
    SendPlan,
    check_routing,
    default_max_m,
    make_combine_routing,
    make_receive_plan,
    make_send_plan,
)

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128
_META = 5  # int32 words per copy: local expert, pos, source token, top-k slot, weight bits


@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class Dispatched:
    """What the expert path and the combine need on the receiving rank.

    x: [E_local, max_m, H] (bf16, or fp8 with x_scale [E_local, max_m,
    ceil(H/128)] float32, M-contiguous when max_m % 4 == 0, the layout the
    GEMM loads in place); rows >= masked_m[e] are not written. masked_m:
    [E_local] int32 on the device. routing: the combine's (src rank, src
    token, top-k slot, weight) per row. send / receive: the host plans of
    this baseline, None after the device dispatch."""

    x: torch.Tensor
    x_scale: Optional[torch.Tensor]
    masked_m: torch.Tensor
    routing: CombineRouting
    send: Optional[SendPlan]
    receive: Optional[ReceivePlan]

    @property
    def max_m(self) -> int:
        return self.x.shape[1]


def _group_world(group):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a group was given but no process group is initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _agreed(step, what: str, group, world: int):
    """Run ``step`` on every rank and agree on whether any rank raised, before
    the next collective: the rank that failed raises its own error, every
    other rank a RuntimeError naming it, so no rank is left waiting in NCCL."""
    if world == 1:
        return step()
    import torch.distributed as dist

    try:
        result, failure = step(), None
    except (TypeError, ValueError) as raised:
        result, failure = None, raised
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    failed = torch.zeros(world, dtype=torch.int32, device=device)
    failed[dist.get_rank(group)] = int(failure is not None)
    dist.all_reduce(failed, group=group)
    if failure is not None:
        raise failure
    if bool(failed.any()):
        ranks = failed.nonzero().flatten().tolist()
        raise RuntimeError(f"{what} failed on rank(s) {ranks} (which raised the reason): this rank stops "
                           f"before sending anything")
    return result


def check_tokens(x, x_scale, topk_ids) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [T, H] tensor, got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    if x.dtype not in (torch.bfloat16, FP8):
        raise TypeError(f"x must be bfloat16, or float8_e4m3fn with x_scale, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens but topk_ids has {topk_ids.shape[0]}")
    if x.device != topk_ids.device:
        raise ValueError(f"x is on {x.device} but topk_ids is on {topk_ids.device}")
    if (x.dtype == FP8) != (x_scale is not None):
        raise ValueError("x_scale goes with float8_e4m3fn x (1x128 scales), and only with it")
    if x_scale is not None:
        blocks = -(-x.shape[1] // SCALE_BLOCK)
        if not isinstance(x_scale, torch.Tensor) or x_scale.dtype != torch.float32 \
                or tuple(x_scale.shape) != (x.shape[0], blocks):
            raise ValueError(f"x_scale must be float32 [T, ceil(H/128)] = {(x.shape[0], blocks)}, got "
                             f"{getattr(x_scale, 'dtype', None)} {tuple(getattr(x_scale, 'shape', ()))}")
        if x_scale.device != x.device:
            raise ValueError(f"x_scale is on {x_scale.device} but x is on {x.device}")


def _all_to_all(send: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
    import torch.distributed as dist

    recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group)
    return recv


def _masked_scales(e_local: int, max_m: int, blocks: int, device) -> torch.Tensor:
    if max_m % 4:
        return torch.empty(e_local, max_m, blocks, dtype=torch.float32, device=device)
    return torch.empty(e_local, blocks, max_m, dtype=torch.float32, device=device).transpose(1, 2)


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    *,
    x_scale: Optional[torch.Tensor] = None,
    max_tokens_per_rank: Optional[int] = None,
    max_m: Optional[int] = None,
    group=None,
) -> Dispatched:
    """Collective over ``group`` (default: the world; none needed at world
    size 1). x: [T, H] this rank's tokens; topk_ids / topk_weights: [T, k]
    global expert ids (-1: not routed) and weights. max_m defaults to
    ``max_tokens_per_rank * W`` (``max_tokens_per_rank`` defaults to T: pass
    it to get the same shapes on every rank and every step)."""
    rank, world = _group_world(group)
    placement = Placement(num_experts, world)

    def checks():
        check_routing(topk_ids, topk_weights, placement, max_tokens_per_rank)
        check_tokens(x, x_scale, topk_ids)

    _agreed(checks, "the argument checks", group, world)
    if max_m is None:
        max_m = default_max_m(max_tokens_per_rank or max(1, x.shape[0]), world)
    send = make_send_plan(topk_ids, topk_weights, placement, check=False)
    device = x.device
    if world == 1:
        recv_counts = send.counts
    else:
        recv_counts = torch.empty_like(send.counts)
        import torch.distributed as dist

        dist.all_to_all_single(recv_counts, send.counts, group=group)
    # raises on overflow (a host sync), on every rank before any row moves
    receive = _agreed(lambda: make_receive_plan(recv_counts, placement, max_m), "the receive plan", group, world)
    send_splits = send.split_sizes.tolist()
    recv_splits = receive.split_sizes.tolist()

    meta = torch.stack([send.local_expert.to(torch.int32), send.pos.to(torch.int32),
                        send.token.to(torch.int32), send.slot.to(torch.int32), send.weight.view(torch.int32)],
                       dim=1)
    rows_x = x.view(torch.uint8)[send.token] if x.dtype == FP8 else x[send.token]
    rows_s = x_scale[send.token] if x_scale is not None else None
    if world > 1:
        meta = _all_to_all(meta, send_splits, recv_splits, group)
        rows_x = _all_to_all(rows_x, send_splits, recv_splits, group)
        if rows_s is not None:
            rows_s = _all_to_all(rows_s, send_splits, recv_splits, group)
    src_rank = torch.repeat_interleave(torch.arange(world, device=device),
                                       receive.split_sizes.to(device), output_size=meta.shape[0])
    rows = receive.rows(src_rank, meta[:, 0], meta[:, 1])
    e_local, hidden = placement.experts_per_rank, x.shape[1]
    layout = torch.empty(e_local, max_m, hidden, dtype=x.dtype, device=device)
    flat = layout.view(torch.uint8).view(-1, hidden) if x.dtype == FP8 else layout.view(-1, hidden)
    flat[rows] = rows_x
    scales = None
    if rows_s is not None:
        scales = _masked_scales(e_local, max_m, rows_s.shape[1], device)
        scales[torch.div(rows, max_m, rounding_mode="floor"), rows % max_m] = rows_s
    routing = make_combine_routing(receive, rows, src_rank, meta[:, 2], meta[:, 3], meta[:, 4].view(torch.float32))
    return Dispatched(layout, scales, receive.masked_m.to(device), routing, send, receive)
