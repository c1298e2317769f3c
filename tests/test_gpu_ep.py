"""The EP layer on the GPU.

World size 1 runs the multi-GPU code path on one GPU: the dispatch is a local
permutation, the combine stores into this GPU's own receive buffer as
"peer 0" and its completion step signals and waits on itself. With symmetric
memory (a process group of one, in a subprocess) and without it (ordinary
memory laid out the same way). The bounded waits are driven into their error
bits. The multi-GPU tests run the demo under torchrun and skip below 2 GPUs.
"""

import os
import subprocess
import sys

import pytest
import torch

from flashgemm.ep.buffers import MULTICAST_OFF, TokenBuffers, local_token_buffers, symmetric_memory_unavailable

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200); the kernels are sm_90a")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SMALL = ["--experts", "16", "--hidden", "512", "--intermediate", "256", "--tokens", "32", "--top-k", "4",
         "--iters", "3", "--warmup", "1"]


def _experts(e_local, hidden, inter, fp8, seed=0):
    from flashgemm.moe.layer import MaskedExperts
    from flashgemm.quant import quantize_fp8_per_block

    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(e_local, 2 * inter, hidden, generator=g, device="cuda") * hidden ** -0.5
    w2 = torch.randn(e_local, hidden, inter, generator=g, device="cuda") * inter ** -0.5
    if not fp8:
        return MaskedExperts(w13.to(torch.bfloat16), w2.to(torch.bfloat16))
    (q13, s13), (q2, s2) = quantize_fp8_per_block(w13), quantize_fp8_per_block(w2)
    return MaskedExperts(q13, q2, w13_scale=s13, w2_scale=s2)


def _tokens(t, hidden, num_experts, k, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.topk(torch.rand(t, num_experts, generator=g, device="cuda"), k).indices
    ids[0, 0] = -1  # a slot that is not routed
    w = torch.rand(t, k, generator=g, device="cuda")
    return x, ids, w


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("form", ["fused", "signalled", "sequential"])
@pytest.mark.parametrize("sums", [torch.float32, torch.bfloat16], ids=["f32-sums", "bf16-sums"])
def test_world_of_one_equals_reference(fp8, form, sums):
    from flashgemm.ep.combine import check_error
    from flashgemm.ep.layer import CombineForm, EpMoELayer
    from flashgemm.ep.reference import ep_layer_ref
    from flashgemm.quant import quantize_fp8_per_token
    from flashgemm.reference import similarity

    e, hidden, inter, t, k = 16, 512, 256, 37, 4
    experts = _experts(e, hidden, inter, fp8)
    buffers = local_token_buffers(t, hidden, k, dtype=sums)
    layer = EpMoELayer(experts, e, buffers, combine_sms=8)
    x, ids, w = _tokens(t, hidden, e, k)
    x_scale = None
    if fp8:
        x, x_scale = quantize_fp8_per_token(x, m_major=False)
    ref = ep_layer_ref(experts, x, ids, w, e, x_scale=x_scale)
    outs = []
    for step in range(3):  # the completion's epoch advances; the receive buffer is overwritten
        buffers.recv.fill_(float("nan"))  # unrouted slots hold garbage: the sum must skip them
        out, err = layer(x, ids, w, x_scale=x_scale, expected_m=8, form=CombineForm(form))
        torch.cuda.synchronize()
        check_error(err)
        assert similarity(out.float(), ref) < (1e-3 if sums == torch.bfloat16 else 1e-4)
        assert buffers.state[1].item() == step + 1
        assert buffers.flags[0].item() == step + 1
        outs.append(out.clone())
    assert all(torch.equal(o, outs[0]) for o in outs)  # each token's slots summed in a fixed order


@pytest.mark.parametrize("form", ["fused", "signalled", "sequential"])
def test_expert_path_and_combine_replay_from_a_cuda_graph(form):
    """Steps 2-4 of the layer (gate_up + SwiGLU, the down GEMM and the
    combine, the sum) have no host sync: captured once, replayed, they give
    the reference tokens, also for new routing weights written in place."""
    from flashgemm.ep.combine import check_error
    from flashgemm.ep.layer import CombineForm, EpMoELayer
    from flashgemm.ep.reference import ep_layer_ref
    from flashgemm.reference import similarity
    from flashgemm.timing import capture_graph

    e, hidden, inter, t, k = 16, 512, 256, 37, 4
    experts = _experts(e, hidden, inter, fp8=False)
    buffers = local_token_buffers(t, hidden, k)
    layer = EpMoELayer(experts, e, buffers, combine_sms=8)
    x, ids, w = _tokens(t, hidden, e, k)
    d = layer.dispatch(x, ids, w)
    errs = []

    def steps():
        h, hs = layer.up(d, 8)
        errs.append(layer.down_and_combine(d, h, hs, ids, form=CombineForm(form), expected_m=8)[1])

    graph = capture_graph(steps, calls=1)
    for scale in (1.0, 0.5):
        d.routing.weight.mul_(scale)  # new weights in place: the graph reads them on replay
        buffers.tokens.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_error(errs[-1])
        ref = ep_layer_ref(experts, x, ids, w * (0.5 if scale != 1.0 else 1.0), e)
        assert similarity(buffers.tokens[:t].float(), ref) < 1e-4


def _combine_inputs(rows=8, hidden=64):
    from flashgemm.ep.plan import CombineRouting
    from flashgemm.signals import make_signal_layout

    layout = make_signal_layout("m_block", rows, hidden, 64, 64, 1)
    y = torch.ones(1, rows, hidden, dtype=torch.bfloat16, device="cuda")
    masked_m = torch.tensor([rows], dtype=torch.int32, device="cuda")
    signals = torch.full((layout.size,), layout.n_tiles, dtype=torch.int32, device="cuda")
    # row r goes to token r // 2, slot r % 2 (top-2)
    r = torch.arange(rows, dtype=torch.int32, device="cuda")[None]
    routing = CombineRouting(torch.zeros(1, rows, dtype=torch.int32, device="cuda"), r // 2, r % 2,
                             torch.full((1, rows), 0.5, device="cuda"))
    return y, masked_m, signals, layout, routing


def test_gemm_signal_timeout_sets_bit_1_and_still_completes():
    from flashgemm.ep.combine import check_error, combine_to_owners

    y, masked_m, signals, layout, routing = _combine_inputs()
    buffers = local_token_buffers(4, 64, 2)
    signals.zero_()  # the GEMM never signals
    err = combine_to_owners(y, masked_m, signals, layout, routing, buffers, num_sms=2, max_polls=1000)
    torch.cuda.synchronize()
    assert err.item() == 1
    with pytest.raises(RuntimeError, match="rank 0: EP error word 0x1: a wait on the down GEMM"):
        check_error(err, 0)


def test_bad_route_sets_bit_2():
    from flashgemm.ep.combine import combine_to_owners

    y, masked_m, signals, layout, routing = _combine_inputs()
    routing.src_token[0, 3] = 4  # past T
    routing.src_rank[0, 5] = 1  # no such rank
    routing.src_slot[0, 6] = 2  # past k
    buffers = local_token_buffers(4, 64, 2)
    buffers.recv.fill_(-1.0)
    err = combine_to_owners(y, masked_m, signals, layout, routing, buffers, num_sms=2)
    torch.cuda.synchronize()
    assert err.item() == 2
    got = buffers.recv[:, :, 0].reshape(-1).tolist()
    assert got == [0.5 if r not in (3, 5, 6) else -1.0 for r in range(8)]
    assert (buffers.recv[:, :, 1:] == buffers.recv[:, :, :1]).all()  # whole rows, not just column 0


def _pair(me, ghost):
    """A world of two made of two local buffers: this rank and a peer that never runs."""
    return TokenBuffers(0, 2, me.recv, me.tokens, me.flags, torch.cat([me.peer_recv, ghost.peer_recv]),
                        torch.cat([me.peer_flags, ghost.peer_flags]), me.state)


def test_silent_peer_after_a_fused_gemm_sets_bit_4():
    from flashgemm.ep.combine import complete

    me, ghost = local_token_buffers(4, 64, 2), local_token_buffers(4, 64, 2)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    complete(_pair(me, ghost), err, max_polls=2000)
    torch.cuda.synchronize()
    assert err.item() == 4
    assert ghost.flags[0].item() == 1


@pytest.mark.parametrize("ids_dtype,sums", [(torch.int32, torch.bfloat16), (torch.int64, torch.float32)])
def test_finalize_sums_routed_slots_in_slot_order(ids_dtype, sums):
    from flashgemm.ep.combine import finalize

    buffers = local_token_buffers(7, 4096 + 64, 3, dtype=sums)
    buffers.recv.fill_(float("nan"))  # never-written slots: must not be read
    buffers.tokens.fill_(-7.0)
    ids = torch.tensor([[0, 1, 2], [3, -1, 4], [-1, -1, -1], [5, 6, -1], [1, 2, 3]], dtype=ids_dtype,
                       device="cuda")
    vals = (torch.randn(5, 3, 4096 + 64, device="cuda") * 4).to(torch.bfloat16)
    routed = (ids >= 0)[..., None]
    buffers.recv[:5] = torch.where(routed, vals, float("nan"))
    out = finalize(buffers, ids)
    want = torch.zeros(5, 4096 + 64, device="cuda")
    for j in range(3):  # the kernel's order: slot 0, 1, 2 in fp32
        want += torch.where(routed[:, j], vals[:, j].float(), 0.0)
    assert torch.equal(out, want.to(sums))
    assert (buffers.tokens[5:] == -7.0).all()  # tokens past T untouched
    with pytest.raises(ValueError, match=r"topk_ids must be \[T <= 7, k = 3\]"):
        finalize(buffers, ids[:, :2])
    with pytest.raises(TypeError, match="topk_ids must have dtype int32 or int64"):
        finalize(buffers, ids.float())


def test_silent_peer_sets_bit_4_not_a_hang():
    """A world of two whose second rank never runs: the wait gives up."""
    from flashgemm.ep.combine import combine_to_owners

    y, masked_m, signals, layout, routing = _combine_inputs()
    me, ghost = local_token_buffers(4, 64, 2), local_token_buffers(4, 64, 2)
    two = _pair(me, ghost)
    err = combine_to_owners(y, masked_m, signals, layout, routing, two, num_sms=2, max_polls=2000)
    torch.cuda.synchronize()
    assert err.item() == 4
    assert ghost.flags[0].item() == 1  # we did tell the ghost we were done


def test_peer_error_is_raised_here_as_bit_8():
    from flashgemm.ep.buffers import MAX_PEERS
    from flashgemm.ep.combine import combine_to_owners

    y, masked_m, signals, layout, routing = _combine_inputs()
    me, ghost = local_token_buffers(4, 64, 2), local_token_buffers(4, 64, 2)
    two = _pair(me, ghost)
    me.flags[1] = 1  # rank 1 reported this launch done...
    me.flags[MAX_PEERS + 1] = 2  # ...with an error word of its own
    err = combine_to_owners(y, masked_m, signals, layout, routing, two, num_sms=2)
    torch.cuda.synchronize()
    assert err.item() == 8
    assert ghost.flags[MAX_PEERS].item() == 0  # this rank had no error to pass on


def test_combine_argument_errors():
    from dataclasses import replace

    from flashgemm.ep.combine import combine_to_owners

    y, masked_m, signals, layout, routing = _combine_inputs()
    buffers = local_token_buffers(4, 64, 2)
    with pytest.raises(ValueError, match="routing.src_rank must have shape"):
        combine_to_owners(y, masked_m, signals, layout, replace(routing, src_rank=routing.src_rank[:, :4]),
                          buffers, num_sms=2)
    with pytest.raises(TypeError, match="routing.src_slot must have dtype"):
        combine_to_owners(y, masked_m, signals, layout, replace(routing, src_slot=routing.src_slot.long()),
                          buffers, num_sms=2)
    with pytest.raises(ValueError, match="num_sms must be an int"):
        combine_to_owners(y, masked_m, signals, layout, routing, buffers, num_sms=0)
    with pytest.raises(ValueError, match=r"buffers.recv must be a contiguous \[T, k, H=64\]"):
        combine_to_owners(y, masked_m, signals, layout, routing, local_token_buffers(4, 32, 2), num_sms=2)


def _env():
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _run(cmd, timeout=900):
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    return proc


def test_symmetric_memory_world_of_one():
    """The demo outside torchrun: a process group of one (file store),
    symmetric memory with one rank, the combine into peer 0."""
    reason = symmetric_memory_unavailable()
    if reason:
        pytest.skip(f"symmetric memory unavailable: {reason}")
    proc = _run([sys.executable, "-m", "flashgemm.ep.demo", *SMALL])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a world of one" in proc.stdout and "-> OK" in proc.stdout


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ GPUs (EP across GPUs over NVLink)")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp8", "bf16"])
def test_two_or_more_gpus_equal_the_reference(bf16):
    n = min(_gpus(), 8)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                 "-m", "flashgemm.ep.demo", *SMALL, "--layers", "1000", *(["--bf16"] if bf16 else [])])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-> OK" in proc.stdout and "1000 graph replays of the whole layer back to back: no hang" in proc.stdout
    assert "FAILED" not in proc.stdout


@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ GPUs (EP across GPUs over NVLink)")
def test_a_failed_rank_raises_on_every_rank_not_a_hang():
    n = min(_gpus(), 8)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                 "-m", "flashgemm.ep.demo", *SMALL, "--fail-rank", "1", "--drill-polls", "20000"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "failure drill" in line]
    assert len(lines) == n, proc.stdout[-3000:]
    for line in lines:  # every rank raises: the skipping one at its next arrival (the word is sticky)
        assert "raised RuntimeError" in line and "EP error word" in line, line
        if "rank 1: raised" not in line:
            assert "a peer did not report completion" in line, line


@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ GPUs (EP across GPUs over NVLink)")
def test_two_or_more_gpus_deepseek_v3_shapes():
    n = min(_gpus(), 8)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                 "-m", "flashgemm.ep.demo", "--iters", "10"], timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-> OK" in proc.stdout


@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ GPUs (EP across GPUs over NVLink)")
def test_two_or_more_gpus_baseline_dispatch_equals_the_reference():
    n = min(_gpus(), 8)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                 "-m", "flashgemm.ep.demo", *SMALL, "--baseline"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-> OK" in proc.stdout and "all_to_all_single baseline" in proc.stdout
