"""Expert-parallel failures on the CPU: a world of two processes over gloo
runs the baseline dispatch, one rank with bad routing (an expert named twice
in a token's top-k) or an expert over its capacity; every rank must raise
before any row moves, none may wait forever in a collective."""

import multiprocessing as mp
import os
import tempfile

import pytest
import torch

from flashgemm.ep.plan import Placement, check_routing

JOIN_S = 120


def _rank(rank, world, store, case, out):
    import torch.distributed as dist

    from flashgemm.ep.dispatch import dispatch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        t, k, experts, hidden = 6, 2, 4, 16
        ids = torch.stack([torch.arange(t) % experts, (torch.arange(t) + 1) % experts], dim=1)
        max_m = None
        if case == "duplicate" and rank == 1:
            ids[3] = torch.tensor([2, 2])
        if case == "overflow":
            ids[:] = torch.tensor([0, 1])  # every token of both ranks to experts 0 and 1 (rank 0's)
            max_m = 8  # rank 0 receives 12 rows per expert
        x = torch.randn(t, hidden).to(torch.bfloat16)
        w = torch.rand(t, k)
        try:
            dispatch(x, ids, w, experts, max_m=max_m)
            out.put((rank, "returned", ""))
        except Exception as raised:  # reported to the test, which checks type and text
            out.put((rank, type(raised).__name__, str(raised)))
    finally:
        dist.destroy_process_group()


def _run(case, world=2):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, case, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_S)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        assert not hung, f"{len(hung)} rank(s) still waiting after {JOIN_S} s"
    return dict((r, (kind, text)) for r, kind, text in (out.get(timeout=5) for _ in range(world)))


def test_a_duplicate_expert_raises_on_every_rank_before_any_row_moves():
    got = _run("duplicate")
    assert got[1][0] == "ValueError" and "names one expert twice for token 3" in got[1][1], got
    assert got[0][0] == "RuntimeError" and "the argument checks failed on rank(s) [1]" in got[0][1], got


def test_an_expert_over_capacity_raises_on_every_rank():
    got = _run("overflow")
    assert got[0][0] == "ValueError" and "more than max_m=8" in got[0][1], got
    assert got[1][0] == "RuntimeError" and "the receive plan failed on rank(s) [0]" in got[1][1], got


@pytest.mark.parametrize("row", [[1, 1, 0], [-1, 3, 3]])
def test_check_routing_refuses_an_expert_twice(row):
    ids = torch.tensor([[0, 1, 2], row])
    with pytest.raises(ValueError, match="names one expert twice for token 1"):
        check_routing(ids, torch.ones(2, 3), Placement(4, 1))
    check_routing(torch.tensor([[0, 1, 2], [-1, -1, 3]]), torch.ones(2, 3), Placement(4, 1))  # -1 may repeat
