"""The device dispatch on one GPU: a world of one in ordinary memory laid
out as the symmetric buffer (the kernel's stores and atomics go to this
GPU's own buffer as "peer 0"), and a world of two whose second rank never
runs (a ghost) to drive the bounded wait and the sequence check. The
multi-GPU runs are the demo's, in test_gpu_ep.py."""

import dataclasses
import os

import pytest
import torch
from test_gpu_ep import _experts

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200); the kernels are sm_90a")
FP8 = torch.float8_e4m3fn


def _seed():
    """A fresh seed on every call and every run (printed, so a failure can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little") >> 1
    print("seed", seed)
    return seed


def _tokens(t, hidden, num_experts, k, seed, ids_dtype=torch.int64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(t, hidden, generator=g, device="cuda") * 3).to(torch.bfloat16)
    ids = torch.topk(torch.rand(t, num_experts, generator=g, device="cuda"), k).indices.to(ids_dtype)
    ids[0, 0] = -1  # a slot that is not routed
    w = torch.rand(t, k, generator=g, device="cuda")
    return x, ids, w


def _poison(buffers):
    lay = buffers.layout
    buffers.raw[lay.meta:].fill_(0x7F)  # fp8 NaN, a huge bf16, a NaN fp32 scale


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_rows_routing_and_masked_m_equal_the_plan(fp8, ids_dtype):
    """Every routed copy lands once in its expert's rows < masked_m, with its
    routing; fp8 rows and scales are bit-identical to quantize_fp8_per_token;
    rows >= masked_m stay as poisoned. Twice, with new routing: the counters
    start from 0 again and the sequence advances."""
    from flashgemm.ep.device_dispatch import dispatch_on_device, local_dispatch_buffers
    from flashgemm.quant import quantize_fp8_per_token

    e, hidden, t, k = 16, 1040, 37, 4  # H not a multiple of 128: a narrow last scale block
    buffers = local_dispatch_buffers(t, hidden, k, e, fp8=fp8)
    for step in range(2):
        x, ids, w = _tokens(t, hidden, e, k, _seed(), ids_dtype)
        _poison(buffers)
        d = dispatch_on_device(x, ids, w, buffers)
        torch.cuda.synchronize()
        assert buffers.err.item() == 0
        assert buffers.state[1].item() == step + 1 and buffers.flags[0].item() == step + 1
        want_m = torch.bincount(ids[ids >= 0].long(), minlength=e).to(torch.int32)
        assert torch.equal(d.masked_m, want_m)
        assert (buffers.counters == 0).all()
        q, s = quantize_fp8_per_token(x, m_major=False) if fp8 else (x, None)
        r = d.routing
        for ex in range(e):
            m = int(want_m[ex])
            assert (r.src_rank[ex, :m] == 0).all()
            got = sorted(zip(r.src_token[ex, :m].tolist(), r.src_slot[ex, :m].tolist()))
            tok, slot = torch.nonzero(ids == ex, as_tuple=True)
            assert got == sorted(zip(tok.tolist(), slot.tolist()))
            rows_t, rows_j = r.src_token[ex, :m].long(), r.src_slot[ex, :m].long()
            assert torch.equal(r.weight[ex, :m], w[rows_t, rows_j])
            if fp8:
                assert torch.equal(d.x[ex, :m].view(torch.uint8), q[rows_t].view(torch.uint8))
                assert torch.equal(d.x_scale[ex, :m], s[rows_t])
                assert (d.x[ex, m:].view(torch.uint8) == 0x7F).all()
                assert (d.x_scale[ex, m:].contiguous().view(torch.uint8) == 0x7F).all()
            else:
                assert torch.equal(d.x[ex, :m], x[rows_t])
                assert (d.x[ex, m:].view(torch.uint8) == 0x7F).all()


def _layer(e, hidden, inter, t, k, fp8, max_m=None):
    from flashgemm.ep.buffers import local_token_buffers
    from flashgemm.ep.device_dispatch import local_dispatch_buffers
    from flashgemm.ep.layer import EpMoELayer

    experts = _experts(e, hidden, inter, fp8, _seed())
    recv = local_dispatch_buffers(t, hidden, k, e, fp8=fp8, max_m=max_m)
    return EpMoELayer(experts, e, local_token_buffers(t, hidden, k), combine_sms=8, recv=recv)


def _reference(layer, x, ids, w):
    from flashgemm.ep.reference import ep_layer_ref
    from flashgemm.quant import quantize_fp8_per_token

    e = layer.num_experts
    if layer.experts.fp8:
        q, s = quantize_fp8_per_token(x, m_major=False)
        return ep_layer_ref(layer.experts, q, ids, w, e, x_scale=s)
    return ep_layer_ref(layer.experts, x, ids, w, e)


# Each output row is a k-term sum of bf16-rounded GEMM rows, summed in fp32:
# the fp32 sums differ from the float64 reference by the GEMM's bf16 roundings
# (one half-ulp each, relative 2**-9), far below this bound on the similarity
# 1 - cos, which is quadratic in the relative error (~(2**-9)**2 / 2 per row).
SIMILARITY_BOUND = 1e-4


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("form", ["fused", "signalled", "sequential"])
def test_layer_with_the_device_dispatch_equals_the_reference(fp8, form):
    from flashgemm.ep.combine import check_error
    from flashgemm.ep.layer import CombineForm
    from flashgemm.reference import similarity

    e, hidden, inter, t, k = 16, 512, 256, 37, 4
    layer = _layer(e, hidden, inter, t, k, fp8)
    outs = []
    x, ids, w = _tokens(t, hidden, e, k, _seed())
    ref = _reference(layer, x, ids, w)
    for _ in range(3):
        layer.buffers.recv.fill_(float("nan"))
        out, err = layer(x, ids, w, expected_m=8, form=CombineForm(form))
        torch.cuda.synchronize()
        check_error(err)
        assert similarity(out.float(), ref) < SIMILARITY_BOUND
        outs.append(out.clone())
    # row order inside an expert follows the atomics; the tokens do not
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_whole_layer_replays_from_one_cuda_graph_with_new_tokens():
    """Dispatch, gate_up + SwiGLU, down + combine and the sum captured once;
    new tokens, routing and weights written in place before each replay;
    then 1000 replays back to back, no error and no hang."""
    from flashgemm.ep.combine import check_error
    from flashgemm.ep.layer import CombineForm
    from flashgemm.reference import similarity
    from flashgemm.timing import capture_graph

    e, hidden, inter, t, k = 16, 512, 256, 37, 4
    layer = _layer(e, hidden, inter, t, k, fp8=True)
    x, ids, w = _tokens(t, hidden, e, k, _seed())
    outs = []
    graph = capture_graph(lambda: outs.append(layer(x, ids, w, expected_m=8, form=CombineForm.FUSED)), calls=1)
    for _ in range(3):
        nx, nids, nw = _tokens(t, hidden, e, k, _seed())
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        layer.buffers.tokens.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out, err = outs[-1]
        check_error(err)
        assert similarity(out.float(), _reference(layer, x, ids, w)) < SIMILARITY_BOUND
    for _ in range(1000):
        graph.replay()
    torch.cuda.synchronize()
    check_error(outs[-1][1])
    assert similarity(outs[-1][0].float(), _reference(layer, x, ids, w)) < SIMILARITY_BOUND


def test_a_layer_makes_no_synchronizing_cuda_call():
    from flashgemm.ep.combine import check_error
    from flashgemm.ep.layer import CombineForm

    e, hidden, inter, t, k = 16, 512, 256, 37, 4
    layer = _layer(e, hidden, inter, t, k, fp8=True)
    x, ids, w = _tokens(t, hidden, e, k, _seed())
    for form in CombineForm:
        layer(x, ids, w, expected_m=8, form=form)  # compiles and first allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for form in CombineForm:
            _, err = layer(x, ids, w, expected_m=8, form=form)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    check_error(err)


def test_overflow_and_bad_ids_set_their_bits_and_write_nothing_past_capacity():
    from flashgemm.ep.combine import check_error
    from flashgemm.ep.device_dispatch import dispatch_on_device, local_dispatch_buffers

    e, hidden, t, k = 8, 256, 40, 2
    buffers = local_dispatch_buffers(t, hidden, k, e, fp8=True, max_m=16)
    assert buffers.max_m == 16
    x, _, w = _tokens(t, hidden, e, k, _seed())
    ids = torch.zeros(t, k, dtype=torch.int64, device="cuda")
    ids[:, 1] = 3  # expert 3: 40 rows for a capacity of 16; expert 0 likewise
    _poison(buffers)
    d = dispatch_on_device(x, ids, w, buffers)
    torch.cuda.synchronize()
    assert buffers.err.item() == 16
    assert d.masked_m.tolist() == [16, 0, 0, 16, 0, 0, 0, 0]
    with pytest.raises(RuntimeError, match="rank 0: EP error word 0x10: an expert received more rows"):
        check_error(buffers.err, 0)
    buffers.err.zero_()
    ids[5, 0] = e  # one past the last expert
    ids[6, 1] = -2
    ids[:, 1] = torch.where(ids[:, 1] == 3, 1, ids[:, 1])
    ids[:, 0] = torch.where(ids[:, 0] == 0, torch.arange(t, device="cuda") % e, ids[:, 0])
    d = dispatch_on_device(x, ids, w, buffers)
    torch.cuda.synchronize()
    assert buffers.err.item() == 2 | 16  # bad ids, and expert 1 still over capacity
    assert int(d.masked_m.sum()) == int(torch.bincount(ids[(ids >= 0) & (ids < e)], minlength=e)
                                         .clamp(max=16).sum())


def _pair(me, ghost):
    """A world of two made of two local buffers: this rank and a peer that never runs."""
    return dataclasses.replace(me, world_size=2, num_experts=2 * me.num_experts,
                               peer_base=torch.cat([me.peer_base, ghost.peer_base]))


def test_silent_peer_times_out_and_the_error_sticks():
    from flashgemm.ep.buffers import MAX_PEERS
    from flashgemm.ep.device_dispatch import dispatch_on_device, local_dispatch_buffers

    e, hidden, t, k = 4, 128, 8, 2
    me = local_dispatch_buffers(t, hidden, k, e, fp8=False)
    ghost = local_dispatch_buffers(t, hidden, k, e, fp8=False)
    two = _pair(me, ghost)
    x, ids, w = _tokens(t, hidden, 2 * e, k, _seed())
    dispatch_on_device(x, ids, w, two, max_polls=2000)
    torch.cuda.synchronize()
    assert me.err.item() == 4
    assert ghost.flags[0].item() == 1  # we did arrive at the ghost
    assert int(ghost.counters.sum()) == int((ids >= e).sum())  # and sent it its rows
    me.flags[1] = 2  # the ghost arrives for the second step...
    dispatch_on_device(x, ids, w, two, max_polls=2000)
    torch.cuda.synchronize()
    assert me.err.item() == 4  # ...and this rank's old error went out to it
    assert ghost.flags[MAX_PEERS].item() == 4


@pytest.mark.parametrize("peer_seq,peer_err,bit", [(2, 0, 32), (1, 2, 8)], ids=["ahead", "failed"])
def test_a_peer_out_of_sequence_or_in_error_is_raised_here(peer_seq, peer_err, bit):
    from flashgemm.ep.buffers import MAX_PEERS
    from flashgemm.ep.device_dispatch import dispatch_on_device, local_dispatch_buffers

    e, hidden, t, k = 4, 128, 8, 2
    me = local_dispatch_buffers(t, hidden, k, e, fp8=True)
    ghost = local_dispatch_buffers(t, hidden, k, e, fp8=True)
    me.flags[1] = peer_seq
    me.flags[MAX_PEERS + 1] = peer_err
    x, ids, w = _tokens(t, hidden, 2 * e, k, _seed())
    dispatch_on_device(x, ids, w, _pair(me, ghost), max_polls=2000)
    torch.cuda.synchronize()
    assert me.err.item() == bit
