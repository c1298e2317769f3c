"""The dispatch plan of an expert-parallel MoE layer (pure torch, any device).

Placement: ``num_experts`` experts over ``world_size`` ranks, contiguously:
rank r owns global experts ``[r * E_local, (r + 1) * E_local)``.

Each rank routes its ``T`` tokens with ``topk_ids [T, k]`` (global expert ids;
``-1`` marks a slot that is not routed, as DeepEP allows) and ``topk_weights
[T, k]``. A *copy* is one routed (token, slot) pair; it lands as one row of the
receiver's masked layout ``x[E_local, max_m, H]``.

Row order on a receiver, deterministic: local expert e holds first the copies
from rank 0, then from rank 1, ..., and within one source rank in that rank's
token order. So a copy's row is ``offset[src, e] + pos`` where ``pos`` is its
index among the copies that ``src`` sends to (dest, e), known to the sender
alone, and ``offset[src, e]`` is the exclusive prefix sum over source ranks of
the counts the receiver gets, known to the receiver once the counts are
exchanged. The two halves:

* ``SendPlan`` (``make_send_plan``): the sender's copies, sorted by (dest rank,
  local expert, token), with ``pos`` and the counts per (dest, local expert).
* ``ReceivePlan`` (``make_receive_plan``): from the counts each source sends
  here, the offsets, ``masked_m`` and the row of every received copy; with the
  received (src token, weight) it gives the combine's routing
  (``CombineRouting``): per row, the owner rank, the token there and the weight.

``max_m`` defaults to ``T_max * world_size`` (DeepEP low-latency style: room
for every token of every rank at one expert); a receiver that would need more
raises, never drops a row.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

_ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_int(name: str, value, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Placement:
    """Contiguous expert placement: rank r owns experts [r * E_local, (r + 1) * E_local)."""

    num_experts: int
    world_size: int

    def __post_init__(self):
        check_int("num_experts", self.num_experts)
        check_int("world_size", self.world_size)
        if self.num_experts % self.world_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of "
                             f"world_size ({self.world_size}) for a contiguous placement")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def owner(self, expert: int) -> int:
        return expert // self.experts_per_rank


def default_max_m(max_tokens_per_rank: int, world_size: int) -> int:
    """Rows per local expert with room for every token of every rank."""
    return check_int("max_tokens_per_rank", max_tokens_per_rank) * check_int("world_size", world_size)


@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class SendPlan:
    """One rank's copies, sorted by (dest rank, local expert, token, slot); C copies.

    token, slot: where the copy comes from (``topk_ids[token, slot]``);
    dest_rank, local_expert: where it goes; pos: its index among this rank's
    copies to (dest_rank, local_expert); weight: float32 routing weight;
    counts [W, E_local] int32: copies per (dest rank, local expert);
    split_sizes [W] int64: copies per dest rank (rows of the all-to-all)."""

    placement: Placement
    num_tokens: int
    token: torch.Tensor
    slot: torch.Tensor
    dest_rank: torch.Tensor
    local_expert: torch.Tensor
    pos: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor
    split_sizes: torch.Tensor

    @property
    def num_copies(self) -> int:
        return self.token.shape[0]


def check_routing(topk_ids, topk_weights, placement: Placement, max_tokens: Optional[int] = None) -> None:
    """Shapes, dtypes, devices and id ranges of one rank's routing."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"topk_weights must be a torch.Tensor, got {type(topk_weights).__name__}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"topk_ids must have dtype int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"topk_weights must have dtype float32, bfloat16 or float16, got {topk_weights.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T, k] with k >= 1, got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    if topk_weights.device != topk_ids.device:
        raise ValueError(f"topk_weights is on {topk_weights.device} but topk_ids is on {topk_ids.device}")
    if max_tokens is not None and topk_ids.shape[0] > max_tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} tokens, more than max_tokens_per_rank={max_tokens}")
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())  # one host sync: checks before any launch
        if lo < -1 or hi >= placement.num_experts:
            raise ValueError(f"topk_ids must lie in [-1, {placement.num_experts}) (num_experts="
                             f"{placement.num_experts}; -1 = not routed), got values in [{lo}, {hi}]")
        ids = torch.sort(topk_ids, dim=1).values
        twice = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)
        if bool(twice.any()):
            token = int(twice.any(dim=1).nonzero()[0, 0])
            raise ValueError(f"topk_ids names one expert twice for token {token} ({topk_ids[token].tolist()}): "
                             f"each routed slot of a token must name a different expert")


def make_send_plan(topk_ids: torch.Tensor, topk_weights: torch.Tensor, placement: Placement,
                   *, check: bool = True) -> SendPlan:
    """Sort this rank's copies by destination; count them per (dest, local expert)."""
    if check:
        check_routing(topk_ids, topk_weights, placement)
    num_tokens, k = topk_ids.shape
    e_local, world = placement.experts_per_rank, placement.world_size
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    copy = torch.nonzero(flat >= 0).reshape(-1)  # routed (token, slot) pairs, token-major
    expert = flat[copy]
    # stable sort on the global expert id keeps token order within each expert,
    # and the contiguous placement makes (dest, local expert) the same order
    expert, order = torch.sort(expert, stable=True)
    copy = copy[order]
    group_counts = torch.bincount(expert, minlength=placement.num_experts)
    group_start = torch.cumsum(group_counts, 0) - group_counts
    pos = torch.arange(expert.shape[0], device=device) - group_start[expert]
    counts = group_counts.reshape(world, e_local)
    return SendPlan(
        placement=placement,
        num_tokens=num_tokens,
        token=torch.div(copy, k, rounding_mode="floor"),
        slot=copy % k,
        dest_rank=torch.div(expert, e_local, rounding_mode="floor"),
        local_expert=expert % e_local,
        pos=pos,
        weight=topk_weights.reshape(-1)[copy].to(torch.float32),
        counts=counts.to(torch.int32),
        split_sizes=counts.sum(1),
    )


@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class ReceivePlan:
    """One rank's receive side. recv_counts [W, E_local]: copies each source
    rank sends to each local expert; offsets [W, E_local]: the first row of
    (src, e) in expert e; masked_m [E_local] int32; split_sizes [W] int64:
    copies from each source (rows of the all-to-all); max_m: rows per expert."""

    placement: Placement
    max_m: int
    recv_counts: torch.Tensor
    offsets: torch.Tensor
    masked_m: torch.Tensor
    split_sizes: torch.Tensor

    def rows(self, src_rank: torch.Tensor, local_expert: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat row ``e * max_m + offset[src, e] + pos`` of each received copy."""
        src, e = src_rank.to(torch.int64), local_expert.to(torch.int64)
        return e * self.max_m + self.offsets[src, e].to(torch.int64) + pos.to(torch.int64)


def make_receive_plan(recv_counts: torch.Tensor, placement: Placement, max_m: int) -> ReceivePlan:
    """Offsets and masked_m from the counts every source rank sends here.
    Raises when an expert would receive more than ``max_m`` rows."""
    if not isinstance(recv_counts, torch.Tensor) or recv_counts.dtype not in _ID_DTYPES:
        raise TypeError("recv_counts must be an int32 or int64 torch.Tensor")
    world, e_local = placement.world_size, placement.experts_per_rank
    if tuple(recv_counts.shape) != (world, e_local):
        raise ValueError(f"recv_counts must have shape (world_size, E_local) = {(world, e_local)}, "
                         f"got {tuple(recv_counts.shape)}")
    check_int("max_m", max_m)
    counts = recv_counts.to(torch.int64)
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError("recv_counts must be non-negative")
    totals = counts.sum(0)
    worst = int(totals.max()) if totals.numel() else 0
    if worst > max_m:
        e = int(torch.argmax(totals))
        raise ValueError(f"local expert {e} would receive {worst} rows, more than max_m={max_m}; "
                         f"raise max_m (or max_tokens_per_rank); no row is dropped silently")
    offsets = torch.cumsum(counts, 0) - counts
    return ReceivePlan(placement, max_m, counts.to(torch.int32), offsets.to(torch.int32),
                       totals.to(torch.int32), counts.sum(1))


@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class CombineRouting:
    """Where each row of the masked layout goes back to, [E_local, max_m] each:
    src_rank (int32, -1 for rows >= masked_m), src_token (int32, the token's
    index on its owner rank, -1 likewise), src_slot (int32, the copy's top-k
    slot there, -1 likewise), weight (float32, 0 likewise). The combine
    writes a row to ``(src_token, src_slot)`` of its owner's receive buffer."""

    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    weight: torch.Tensor

    def destinations(self, rows_per_rank: int, top_k: int) -> torch.Tensor:
        """[E_local, max_m] int32: each row's flat destination ``src_rank *
        rows_per_rank + src_token * top_k + src_slot`` (-1 for rows >= m_e),
        the ``token_index`` of a peer combine (``flashgemm.Combine.peers``)."""
        flat = (self.src_rank.to(torch.int64) * rows_per_rank + self.src_token.to(torch.int64) * top_k
                + self.src_slot.to(torch.int64))
        return torch.where(self.src_rank >= 0, flat, -1).to(torch.int32)


def make_combine_routing(plan: ReceivePlan, rows: torch.Tensor, src_rank: torch.Tensor,
                         src_token: torch.Tensor, src_slot: torch.Tensor, weight: torch.Tensor) -> CombineRouting:
    """Scatter the received copies' origins into [E_local, max_m] tables."""
    shape = (plan.placement.experts_per_rank, plan.max_m)
    device = rows.device
    rank_t = torch.full(shape, -1, dtype=torch.int32, device=device)
    token_t = torch.full(shape, -1, dtype=torch.int32, device=device)
    slot_t = torch.full(shape, -1, dtype=torch.int32, device=device)
    weight_t = torch.zeros(shape, dtype=torch.float32, device=device)
    rank_t.view(-1)[rows] = src_rank.to(torch.int32)
    token_t.view(-1)[rows] = src_token.to(torch.int32)
    slot_t.view(-1)[rows] = src_slot.to(torch.int32)
    weight_t.view(-1)[rows] = weight.to(torch.float32)
    return CombineRouting(rank_t, token_t, slot_t, weight_t)


@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class WorldPlan:
    """Every rank's plans, computed in one process (tests, references)."""

    send: tuple  # SendPlan per rank
    receive: tuple  # ReceivePlan per rank
    routing: tuple  # CombineRouting per rank
    rows: tuple  # per (dest rank): flat rows of the copies received, in all-to-all order
    sources: tuple  # per (dest rank): (src rank, src token) of those copies


def plan_world(topk_ids: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor], num_experts: int,
               max_m: Optional[int] = None) -> WorldPlan:
    """All ranks' plans from all ranks' routing, exchanging in memory what the
    dispatch exchanges over the network, in the same order."""
    world = len(topk_ids)
    if world < 1 or len(topk_weights) != world:
        raise ValueError("topk_ids and topk_weights must be non-empty lists with one entry per rank")
    placement = Placement(num_experts, world)
    t_max = max(1, max(t.shape[0] for t in topk_ids))
    max_m = default_max_m(t_max, world) if max_m is None else max_m
    send = tuple(make_send_plan(i, w, placement) for i, w in zip(topk_ids, topk_weights))
    receive, routing, rows_all, sources = [], [], [], []
    for dest in range(world):
        recv_counts = torch.stack([s.counts[dest] for s in send])
        plan = make_receive_plan(recv_counts, placement, max_m)
        pick = [s.dest_rank == dest for s in send]
        src_rank = torch.cat([torch.full((int(p.sum()),), r, dtype=torch.int64, device=p.device)
                              for r, p in enumerate(pick)])
        e = torch.cat([s.local_expert[p] for s, p in zip(send, pick)])
        pos = torch.cat([s.pos[p] for s, p in zip(send, pick)])
        token = torch.cat([s.token[p] for s, p in zip(send, pick)])
        slot = torch.cat([s.slot[p] for s, p in zip(send, pick)])
        weight = torch.cat([s.weight[p] for s, p in zip(send, pick)])
        rows = plan.rows(src_rank, e, pos)
        receive.append(plan)
        routing.append(make_combine_routing(plan, rows, src_rank, token, slot, weight))
        rows_all.append(rows)
        sources.append((src_rank, token))
    return WorldPlan(tuple(send), tuple(receive), tuple(routing), tuple(rows_all), tuple(sources))
