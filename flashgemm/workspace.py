"""Claim counters of the dynamic tile order (``TileOrder.DYNAMIC``).

Each launch needs an int32 (2,) counter that is zero before it and that the
kernel returns to zero (``schedule.dynamic``). Eager launches use one per
(GPU, stream), so launches on two streams never share one. A launch being
captured into a CUDA graph gets one of its own from a pool zeroed ahead of
capture (no memset node), never reused: a graph may be replayed on any
stream, next to eager launches or another graph. Both tables are guarded by
one lock: two threads capturing at once must never be handed the same slot.
"""

from __future__ import annotations

import threading

import torch

from .config import CLAIM_COUNTER_INTS

GRAPH_POOL_SLOTS = 1024
_lock = threading.Lock()
_COUNTERS: dict = {}  # (device index, raw stream) -> counter
_GRAPH_POOLS: dict = {}  # device index -> [pool tensor, slots handed out]


def _zeroed(index: int, *count: int) -> torch.Tensor:
    return torch.zeros(*count, CLAIM_COUNTER_INTS, dtype=torch.int32, device=torch.device("cuda", index))


def claim_counter(index: int) -> torch.Tensor:
    """The claim counter for a launch on the current stream of GPU ``index``."""
    if torch._C._cuda_isCurrentStreamCapturing():
        with _lock:
            entry = _GRAPH_POOLS.get(index)
            if entry is not None and entry[1] < GRAPH_POOL_SLOTS:
                slot = entry[1]
                entry[1] = slot + 1
                return entry[0][slot]
        # no zeroed slot left: allocate in the graph's pool (its zeroing
        # becomes a memset node of the graph)
        return _zeroed(index)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _COUNTERS.get(key)  # lock-free hit: the per-call path
    if counter is None:
        with _lock:
            counter = _COUNTERS.get(key)
            if counter is None:
                counter = _zeroed(index)
                _COUNTERS[key] = counter
    return counter


def prepare_graph_counters(index: int) -> None:
    """Zero a pool of counters for launches captured later (called when a
    dynamic launch plan is made, normally during warm-up, outside capture)."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return
    with _lock:
        if index not in _GRAPH_POOLS:
            _GRAPH_POOLS[index] = [_zeroed(index, GRAPH_POOL_SLOTS), 0]


def graph_slots_used(index: int) -> int:
    """Pool slots handed out on GPU ``index`` (tests)."""
    with _lock:
        entry = _GRAPH_POOLS.get(index)
        return 0 if entry is None else entry[1]
