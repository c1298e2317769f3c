"""Claim counters of the dynamic tile order (``flashgemm.workspace``), on CPU:
capture and streams are simulated, the counters are CPU tensors."""

import sys
import threading
import time

import pytest
import torch

from flashgemm import workspace
from flashgemm.config import CLAIM_COUNTER_INTS

THREADS, CALLS = 16, 64


@pytest.fixture
def pool(monkeypatch):
    """Fresh counter tables, CPU counters, and a switch for "capturing"
    (``torch._C._cuda_isCurrentStreamCapturing``); returns (switch, zeroed
    calls). Thread switches are made frequent so races show."""
    monkeypatch.setattr(workspace, "_GRAPH_POOLS", {})
    monkeypatch.setattr(workspace, "_COUNTERS", {})
    zeroed = []

    def cpu_zeroed(index, *count):
        zeroed.append((index, count))
        time.sleep(0.001)  # a slow allocation widens any race window
        return torch.zeros(*count, CLAIM_COUNTER_INTS, dtype=torch.int32)

    monkeypatch.setattr(workspace, "_zeroed", cpu_zeroed)
    capturing = threading.Event()
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", capturing.is_set)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield capturing, zeroed
    sys.setswitchinterval(interval)


def _in_threads(fn, threads=THREADS):
    """fn() in ``threads`` threads started together; their results."""
    start = threading.Barrier(threads)
    results = [None] * threads
    errors = []

    def run(i):
        try:
            start.wait()
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    return results


class _SlowEntry(list):
    """A pool entry ([pool tensor, slots handed out]) whose count is slow to read."""

    def __getitem__(self, i):
        if i == 1:
            time.sleep(0.0001)
        return super().__getitem__(i)


def test_graph_pool_hands_every_slot_out_once_across_threads(pool):
    capturing, zeroed = pool
    workspace.prepare_graph_counters(0)  # outside capture: zero the pool
    workspace.prepare_graph_counters(0)  # once per GPU
    assert zeroed == [(0, (workspace.GRAPH_POOL_SLOTS,))]
    assert workspace.graph_slots_used(0) == 0 and workspace.graph_slots_used(1) == 0
    pool_tensor = workspace._GRAPH_POOLS[0][0]
    # reading the slot count yields the thread: without the lock two threads
    # would read the same count and take the same slot
    workspace._GRAPH_POOLS[0] = _SlowEntry(workspace._GRAPH_POOLS[0])
    capturing.set()
    workspace.prepare_graph_counters(1)  # during capture: nothing is allocated
    assert 1 not in workspace._GRAPH_POOLS
    assert THREADS * CALLS == workspace.GRAPH_POOL_SLOTS

    got = _in_threads(lambda: [workspace.claim_counter(0) for _ in range(CALLS)])
    slots = [t for per_thread in got for t in per_thread]
    assert len(slots) == THREADS * CALLS
    row = CLAIM_COUNTER_INTS * 4
    indices = []
    for t in slots:
        offset = t.data_ptr() - pool_tensor.data_ptr()
        assert offset % row == 0 and tuple(t.shape) == (CLAIM_COUNTER_INTS,)
        indices.append(offset // row)
        assert t.tolist() == [0] * CLAIM_COUNTER_INTS  # zeroed ahead of capture
    assert sorted(indices) == list(range(workspace.GRAPH_POOL_SLOTS)), "a slot was handed out twice"
    assert len({t.data_ptr() for t in slots}) == len(slots)
    assert workspace.graph_slots_used(0) == len(slots) == workspace.GRAPH_POOL_SLOTS
    # each thread's own slots come out in increasing order
    for per_thread in got:
        ptrs = [t.data_ptr() for t in per_thread]
        assert ptrs == sorted(ptrs)
    assert len(zeroed) == 1  # no slot was allocated outside the pool

    # the pool is spent: a fresh zeroed counter each (a memset node of the
    # graph), never a reused slot
    extra = _in_threads(lambda: workspace.claim_counter(0), threads=4)
    assert workspace.graph_slots_used(0) == workspace.GRAPH_POOL_SLOTS
    assert len(zeroed) == 1 + 4
    for t in extra:
        assert not pool_tensor.data_ptr() <= t.data_ptr() < pool_tensor.data_ptr() + pool_tensor.nbytes
    assert len({t.data_ptr() for t in extra}) == 4


def test_graph_pool_partly_used_counts_what_was_handed_out(pool):
    capturing, _ = pool
    workspace.prepare_graph_counters(3)
    capturing.set()
    got = _in_threads(lambda: [workspace.claim_counter(3) for _ in range(5)], threads=8)
    assert workspace.graph_slots_used(3) == 40
    assert len({t.data_ptr() for per_thread in got for t in per_thread}) == 40
    assert workspace.graph_slots_used(0) == 0  # another GPU's pool is untouched


def test_eager_counter_is_one_per_stream_even_when_threads_race(pool, monkeypatch):
    """Outside capture each (GPU, stream) has one counter, made once even
    when many threads ask for a new one at the same time."""
    _, zeroed = pool
    streams = threading.local()
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: getattr(streams, "raw", 7), raising=False)
    same = _in_threads(lambda: workspace.claim_counter(0))
    assert all(t is same[0] for t in same) and zeroed == [(0, ())]
    assert workspace.claim_counter(0) is same[0]
    assert workspace.claim_counter(1) is not same[0]  # another GPU

    def on_own_stream():
        streams.raw = threading.get_ident()
        return workspace.claim_counter(0)

    own = _in_threads(on_own_stream)
    assert len({id(t) for t in own}) == THREADS and all(t is not same[0] for t in own)
    assert len(workspace._COUNTERS) == 2 + THREADS
    assert workspace.graph_slots_used(0) == 0  # eager launches never take pool slots
