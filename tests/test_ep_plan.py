"""The EP dispatch plan on the CPU: dispatch then combine with plain torch
math equals the reference sum; the masked layout is compact and ordered; bad
arguments raise errors that name them."""

import pytest
import torch

from flashgemm.ep.plan import (
    Placement,
    default_max_m,
    make_receive_plan,
    make_send_plan,
    plan_world,
)


def _routing(world, tokens, num_experts, k, seed=0, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    ids, weights = [], []
    for r in range(world):
        t = tokens[r] if isinstance(tokens, (list, tuple)) else tokens
        scores = torch.rand(t, num_experts, generator=g)
        top = torch.topk(scores, k, dim=1).indices
        if drop:
            top[torch.rand(t, k, generator=g) < drop] = -1
        ids.append(top.to(torch.int32))
        weights.append(torch.rand(t, k, generator=g))
    return ids, weights


def _dispatch_and_combine(ids, weights, xs, num_experts, fn, max_m=None):
    """Emulate the whole layer with the world plan: every rank's rows land in
    the receivers' masked layouts, each row goes through the expert ``fn``,
    each weighted row is written to its owner's receive buffer at (token,
    slot), exactly once, and each owner sums its tokens' routed slots."""
    world = len(ids)
    plan = plan_world(ids, weights, num_experts, max_m=max_m)
    e_local = num_experts // world
    hidden = xs[0].shape[1]
    k = ids[0].shape[1]
    recv = [torch.full((x.shape[0], k, hidden), float("nan")) for x in xs]
    for dest in range(world):
        rp = plan.receive[dest]
        layout = torch.full((e_local * rp.max_m, hidden), float("nan"))
        src_rank, src_token = plan.sources[dest]
        for row, r, t in zip(plan.rows[dest].tolist(), src_rank.tolist(), src_token.tolist()):
            layout[row] = xs[r][t]
        layout = layout.view(e_local, rp.max_m, hidden)
        routing = plan.routing[dest]
        for e in range(e_local):
            m = int(rp.masked_m[e])
            # the masked layout is compact: exactly the first m rows are written
            assert not torch.isnan(layout[e, :m]).any()
            assert torch.isnan(layout[e, m:]).all()
            assert (routing.src_rank[e, m:] == -1).all() and (routing.src_token[e, m:] == -1).all()
            assert (routing.src_slot[e, m:] == -1).all()
            y = fn(dest * e_local + e, layout[e, :m])
            for r in range(m):
                owner, token, slot = (int(routing.src_rank[e, r]), int(routing.src_token[e, r]),
                                      int(routing.src_slot[e, r]))
                assert int(ids[owner][token, slot]) == dest * e_local + e  # the slot that routed it here
                assert torch.isnan(recv[owner][token, slot]).all()  # one writer per (token, slot)
                recv[owner][token, slot] = routing.weight[e, r] * y[r]
    outs = [torch.where((i >= 0)[..., None], rv, 0.0).sum(1) for i, rv in zip(ids, recv)]
    return outs, plan


def _reference(ids, weights, xs, fn):
    outs = []
    for i, w, x in zip(ids, weights, xs):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(i.shape[1]):
                e = int(i[t, j])
                if e >= 0:
                    out[t] += float(w[t, j]) * fn(e, x[t:t + 1])[0]
        outs.append(out)
    return outs


@pytest.mark.parametrize("world,tokens,num_experts,k,drop", [
    (1, 7, 4, 2, 0.0),
    (2, 16, 8, 3, 0.0),
    (4, [5, 0, 9, 3], 16, 4, 0.2),
    (8, 6, 32, 8, 0.1),
])
def test_round_trip_equals_reference(world, tokens, num_experts, k, drop):
    ids, weights = _routing(world, tokens, num_experts, k, drop=drop)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(i.shape[0], 8, generator=g) for i in ids]
    scale = torch.randn(num_experts, 8, generator=g)

    def fn(e, rows):  # an expert: a per-expert elementwise map
        return torch.tanh(rows * scale[e]) + e

    outs, _ = _dispatch_and_combine(ids, weights, xs, num_experts, fn)
    for got, want in zip(outs, _reference(ids, weights, xs, fn)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_are_ordered_by_source_rank_then_token():
    ids, weights = _routing(4, 12, 8, 3, seed=3)
    plan = plan_world(ids, weights, 8)
    for dest in range(4):
        r = plan.routing[dest]
        for e in range(2):
            m = int(plan.receive[dest].masked_m[e])
            key = r.src_rank[e, :m].long() * 1000 + r.src_token[e, :m].long()
            assert torch.all(key[1:] > key[:-1])


def test_counts_and_masked_m():
    ids, weights = _routing(2, 10, 4, 2, seed=5)
    plan = plan_world(ids, weights, 4)
    total = torch.zeros(4, dtype=torch.int64)
    for i in ids:
        total += torch.bincount(i.reshape(-1).long(), minlength=4)
    assert torch.equal(torch.cat([p.masked_m.long() for p in plan.receive]), total)
    for s in plan.send:
        assert int(s.split_sizes.sum()) == s.num_copies
        assert s.counts.dtype == torch.int32 and s.counts.shape == (2, 2)
    assert plan.receive[0].max_m == default_max_m(10, 2) == 20


def test_send_plan_fields():
    ids = torch.tensor([[3, 0], [1, -1], [0, 2]], dtype=torch.int64)
    w = torch.tensor([[0.5, 0.25], [1.0, 9.0], [0.125, 2.0]])
    s = make_send_plan(ids, w, Placement(4, 2))
    # sorted by global expert, token order inside an expert
    assert s.token.tolist() == [0, 2, 1, 2, 0]
    assert s.slot.tolist() == [1, 0, 0, 1, 0]
    assert s.dest_rank.tolist() == [0, 0, 0, 1, 1]
    assert s.local_expert.tolist() == [0, 0, 1, 0, 1]
    assert s.pos.tolist() == [0, 1, 0, 0, 0]
    assert s.weight.tolist() == [0.25, 0.125, 1.0, 2.0, 0.5]
    assert s.counts.tolist() == [[2, 1], [1, 1]]
    assert s.split_sizes.tolist() == [3, 2]


def test_max_m_overflow_raises():
    ids = [torch.zeros(5, 1, dtype=torch.int32), torch.zeros(5, 1, dtype=torch.int32)]
    w = [torch.ones(5, 1), torch.ones(5, 1)]
    with pytest.raises(ValueError, match="local expert 0 would receive 10 rows, more than max_m=8"):
        plan_world(ids, w, 2, max_m=8)
    assert int(plan_world(ids, w, 2, max_m=10).receive[0].masked_m[0]) == 10


@pytest.mark.parametrize("ids,weights,match,exc", [
    (torch.tensor([[0, 4]]), torch.ones(1, 2), r"topk_ids must lie in \[-1, 4\)", ValueError),
    (torch.tensor([[0, -2]]), torch.ones(1, 2), r"topk_ids must lie in \[-1, 4\)", ValueError),
    (torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), "topk_ids must have dtype int32 or int64", TypeError),
    (torch.tensor([0, 1]), torch.ones(2), r"topk_ids must be \[T, k\]", ValueError),
    (torch.tensor([[0, 1]]), torch.ones(1, 3), "topk_weights must have topk_ids' shape", ValueError),
    (torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.int32), "topk_weights must have dtype", TypeError),
    ([[0, 1]], torch.ones(1, 2), "topk_ids must be a torch.Tensor", TypeError),
])
def test_routing_errors_name_the_argument(ids, weights, match, exc):
    with pytest.raises(exc, match=match):
        make_send_plan(ids, weights, Placement(4, 2))


def test_placement_and_receive_errors():
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be a multiple of world_size \(4\)"):
        Placement(6, 4)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        Placement(4, 0)
    with pytest.raises(ValueError, match=r"recv_counts must have shape \(world_size, E_local\)"):
        make_receive_plan(torch.zeros(3, 2, dtype=torch.int32), Placement(4, 2), 8)
    with pytest.raises(ValueError, match="max_m must be an int >= 1"):
        make_receive_plan(torch.zeros(2, 2, dtype=torch.int32), Placement(4, 2), 0)
    with pytest.raises(ValueError, match="recv_counts must be non-negative"):
        make_receive_plan(torch.tensor([[1, -1], [0, 0]]), Placement(4, 2), 8)


def test_plans_are_frozen():
    s = make_send_plan(torch.tensor([[0]]), torch.ones(1, 1), Placement(2, 1))
    with pytest.raises(Exception):
        s.num_tokens = 3


@pytest.mark.parametrize("fp8", [False, True])
def test_dispatch_at_world_size_one_is_a_local_permutation(fp8):
    from flashgemm.ep.dispatch import dispatch
    from flashgemm.quant import quantize_fp8_per_token

    ids, weights = _routing(1, 9, 4, 2, seed=7, drop=0.2)
    x = torch.randn(9, 256).to(torch.bfloat16)
    x_scale = None
    if fp8:
        x, x_scale = quantize_fp8_per_token(x, m_major=False)
    d = dispatch(x, ids[0], weights[0], 4, x_scale=x_scale)
    plan = plan_world(ids, weights, 4)
    assert d.max_m == 9 and torch.equal(d.masked_m, plan.receive[0].masked_m)
    for field in ("src_rank", "src_token", "src_slot", "weight"):
        assert torch.equal(getattr(d.routing, field), getattr(plan.routing[0], field))
    for e in range(4):
        for r in range(int(d.masked_m[e])):
            t = int(d.routing.src_token[e, r])
            assert torch.equal(d.x[e, r].view(torch.uint8), x[t].view(torch.uint8))
            if fp8:
                assert torch.equal(d.x_scale[e, r], x_scale[t])
    if fp8:
        assert d.x_scale.shape == (4, 9, 2)


def test_dispatch_errors():
    from flashgemm.ep.dispatch import dispatch

    ids = torch.zeros(3, 1, dtype=torch.int32)
    w = torch.ones(3, 1)
    with pytest.raises(ValueError, match="x has 2 tokens but topk_ids has 3"):
        dispatch(torch.zeros(2, 16, dtype=torch.bfloat16), ids, w, 2)
    with pytest.raises(TypeError, match="x must be bfloat16, or float8_e4m3fn"):
        dispatch(torch.zeros(3, 16), ids, w, 2)
    with pytest.raises(ValueError, match="x_scale goes with float8_e4m3fn x"):
        dispatch(torch.zeros(3, 16, dtype=torch.float8_e4m3fn), ids, w, 2)
    with pytest.raises(ValueError, match="more than max_tokens_per_rank=2"):
        dispatch(torch.zeros(3, 16, dtype=torch.bfloat16), ids, w, 2, max_tokens_per_rank=2)
    with pytest.raises(ValueError, match="more than max_m=2"):
        dispatch(torch.zeros(3, 16, dtype=torch.bfloat16), ids, w, 2, max_m=2)


def test_all_gather_reference_at_world_size_one_equals_a_token_loop():
    from flashgemm.ep.reference import ep_layer_ref
    from flashgemm.moe.layer import MaskedExperts

    g = torch.Generator().manual_seed(0)
    e_count, hidden, inter, t, k = 8, 64, 32, 10, 3
    w13 = (torch.randn(e_count, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e_count, hidden, inter, generator=g) * inter ** -0.5).to(torch.bfloat16)
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    ids = torch.topk(torch.rand(t, e_count, generator=g), k).indices
    ids[0, 0] = -1
    w = torch.rand(t, k, generator=g)
    out = ep_layer_ref(MaskedExperts(w13, w2), x, ids, w, e_count)
    want = torch.zeros(t, hidden)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            if e >= 0:
                gu = (x[i].float() @ w13[e].float().T).to(torch.bfloat16).float()
                h = (torch.nn.functional.silu(gu[:inter]) * gu[inter:]).to(torch.bfloat16).float()
                want[i] += w[i, j] * (h @ w2[e].float().T).to(torch.bfloat16).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
