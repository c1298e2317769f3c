"""gpt-oss's expert layer on an sm_90 GPU: its activation kernel against the
torch reference (a partial last scale block, padding untouched), and the
whole layer (16 local experts, H = I = 2880, biases, the clamped SwiGLU, the
down biases in the fused combine), MXFP4 weights with fp8 activations and
bf16 weights with bf16 activations, against the float64 reference of the
model's formula: into fp32 and bf16 sums and into the peers' receive
buffers, eagerly and in a CUDA graph."""

import pytest
import torch

from flashgemm import Combine
from flashgemm.moe.activation import alloc_fp8_input, gpt_oss_swiglu, gpt_oss_swiglu_ref
from flashgemm.moe.gpt_oss import gpt_oss_experts_ref
from flashgemm.moe.gpt_oss_experts import GptOssExperts
from flashgemm.mxfp4 import dequantize_mxfp4, prepare_weights, quantize_mxfp4
from flashgemm.quant import dequantize_fp8_per_token, quantize_fp8_per_token
from flashgemm.reference import similarity

from conftest import capture_graph, requires_hopper
from test_gpu_moe import FP8_NAN, _masked, _routing, assert_fp8_h_matches

pytestmark = requires_hopper
HIDDEN = INTER = 2880
EXPERTS = 16  # gpt-oss-120b's 128 experts over 8 ranks
TOKENS = 1024  # 128 per rank, top-4: about 32 rows per local expert


@pytest.mark.parametrize("inter", [2880, 208], ids=lambda i: f"I{i}")
def test_activation_fp8_partial_block_and_padding(seed, inter):
    e_count, max_m = 5, 80
    masked = _masked(e_count, 30, max_m, "skewed")
    mm = masked.cuda()
    # spread past the clamps at +-7
    gu = (4 * torch.randn(e_count, max_m, 2 * inter, device="cuda")).to(torch.bfloat16)
    bias = torch.randn(e_count, 2 * inter, device="cuda")
    q, s = alloc_fp8_input(e_count, max_m, inter, "cuda")
    assert s.shape[-1] == -(-inter // 128)
    q.view(torch.uint8).fill_(FP8_NAN)
    s.fill_(float("nan"))
    gpt_oss_swiglu(gu, bias, mm, out=q, out_scale=s)
    torch.cuda.synchronize()
    assert_fp8_h_matches(q, s, *gpt_oss_swiglu_ref(gu, bias, mm), masked.clamp(0, max_m).tolist())


def test_activation_bf16(seed):
    e_count, max_m, inter = 4, 64, 2880
    masked = _masked(e_count, 30, max_m, "uniform")
    gu = (4 * torch.randn(e_count, max_m, 2 * inter, device="cuda")).to(torch.bfloat16)
    bias = torch.randn(e_count, 2 * inter, device="cuda")
    out = torch.full((e_count, max_m, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    gpt_oss_swiglu(gu, bias, masked.cuda(), fp8=False, out=out)
    torch.cuda.synchronize()
    ref = gpt_oss_swiglu_ref(gu, bias, masked.cuda(), fp8=False).float()
    for e, m in enumerate(masked.clamp(0, max_m).tolist()):
        assert out[e, m:].isnan().all()
        got = out[e, :m].float()
        # two roundings to bf16 of fp32 values a few ulp apart: at most one bf16 step (2**-7 relative)
        assert ((got - ref[e, :m]).abs() <= 2.0**-7 * torch.maximum(got.abs(), ref[e, :m].abs())).all()


def _layer(mxfp4: bool):
    w13 = 3 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") / HIDDEN**0.5  # gate_up ~ N(0, 9): clamps hit
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") / INTER**0.5
    b13, b2 = torch.randn(EXPERTS, 2 * INTER, device="cuda"), 0.1 * torch.randn(EXPERTS, HIDDEN, device="cuda")
    if mxfp4:
        q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        (p13, s13), (p2, s2) = prepare_weights(*q13), prepare_weights(*q2)
        layer = GptOssExperts(p13, b13, p2, b2, w13_scale=s13, w2_scale=s2)
        return layer, (dequantize_mxfp4(*q13), b13, dequantize_mxfp4(*q2), b2)
    layer = GptOssExperts(w13.to(torch.bfloat16), b13.to(torch.bfloat16), w2.to(torch.bfloat16),
                          b2.to(torch.bfloat16))
    return layer, (w13.to(torch.bfloat16).float(), b13.to(torch.bfloat16).float(),
                   w2.to(torch.bfloat16).float(), b2.to(torch.bfloat16).float())


def _inputs(masked, max_m, fp8: bool):
    """x as the layer takes it (fp8 with its scales, or bf16), padding rows
    poisoned; and the clean floats the reference takes."""
    x = torch.randn(EXPERTS, max_m, HIDDEN, device="cuda")
    valid = torch.arange(max_m, device="cuda")[None, :] < masked.cuda().clamp(0, max_m)[:, None]
    if fp8:
        xq, xs = quantize_fp8_per_token(x)
        x_float = dequantize_fp8_per_token(xq, xs) * valid[..., None]
        xq.view(torch.uint8)[~valid] = FP8_NAN
        xs[~valid] = float("nan")
        return xq, xs, x_float
    xb = x.to(torch.bfloat16)
    x_float = xb.float() * valid[..., None]
    xb[~valid] = float("nan")
    return xb, None, x_float


def _case(mxfp4, fp8, max_m, dist):
    """The layer, its float weights, masked_m (host, device), the inputs and the routing of one test."""
    layer, floats = _layer(mxfp4)
    masked = _masked(EXPERTS, 32, max_m, dist)
    return layer, floats, masked, masked.cuda(), _inputs(masked, max_m, fp8), _routing(masked, max_m, TOKENS)


@pytest.mark.parametrize("mxfp4, fp8", [(True, True), (True, False), (False, False)],
                         ids=["mxfp4-fp8", "mxfp4-bf16", "bf16"])
@pytest.mark.parametrize("dist", ["uniform", "skewed", "empty"])
def test_layer_matches_the_models_formula(seed, mxfp4, fp8, dist):
    max_m = 64
    layer, floats, masked, mm, (x, xs, x_float), (tok, wt) = _case(mxfp4, fp8, max_m, dist)
    base = torch.randn(TOKENS, HIDDEN, device="cuda")  # added to, never replaced
    output = base.clone()
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    got, got_err = layer(x, mm, Combine(tok, wt, output, err), x_scale=xs, expected_m=32)
    torch.cuda.synchronize()
    assert got is output and int(got_err.item()) == 0
    ref = gpt_oss_experts_ref(x_float, mm, *floats, token_index=tok.clamp(min=0), weight=wt,
                              num_tokens=TOKENS)
    routed = torch.zeros(TOKENS, dtype=torch.bool, device="cuda")
    for e, m in enumerate(masked.clamp(0, max_m).tolist()):
        routed[tok[e, :m].long()] = True
    assert torch.equal(output[~routed], base[~routed])  # no stray row
    if routed.any():
        diff = similarity(output[routed] - base[routed], ref[routed].float())
        # fp8: the 1x128 quantization of x is in the reference, h's is not (about 3e-4); bf16 activations
        # (bf16 or MXFP4 weights, both exact in the reference): two bf16 roundings
        assert diff <= (1e-3 if fp8 else 1e-4), diff


@pytest.mark.parametrize("mxfp4, fp8", [(True, True), (False, False)], ids=["mxfp4-fp8", "bf16"])
def test_layer_into_bf16_sums_matches_the_models_formula(seed, mxfp4, fp8):
    max_m = 64
    layer, floats, masked, mm, (x, xs, x_float), (tok, wt) = _case(mxfp4, fp8, max_m, "uniform")
    routed = torch.zeros(TOKENS, dtype=torch.bool, device="cuda")
    for e, m in enumerate(masked.clamp(0, max_m).tolist()):
        routed[tok[e, :m].long()] = True
    output = torch.zeros(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    output.view(torch.int16)[~routed] = 0x7FC1  # a bf16 NaN in the rows nobody is routed to
    got, err = layer(x, mm, Combine(tok, wt, output), x_scale=xs, expected_m=32)
    torch.cuda.synchronize()
    assert got is output and int(err.item()) == 0
    ref = gpt_oss_experts_ref(x_float, mm, *floats, token_index=tok.clamp(min=0), weight=wt,
                              num_tokens=TOKENS)
    assert (output[~routed].view(torch.int16) == 0x7FC1).all()
    # the bf16 sums add one bf16 rounding per row and per add (about 2**-9 relative each: ~1e-5) to the fp32 bound
    assert similarity(output[routed].float(), ref[routed].float()) <= (1e-3 if fp8 else 1e-4)


@pytest.mark.parametrize("mxfp4, fp8", [(True, True), (False, False)], ids=["mxfp4-fp8", "bf16"])
def test_layer_into_peer_buffers_matches_the_models_formula(seed, mxfp4, fp8):
    """``combine.peers``: each valid row, its down bias included, stored as
    bf16 into its own destination (one buffer here); summed per token after
    the call, it is the model's formula; destinations no row was sent to
    keep their poison."""
    max_m = 64
    layer, floats, masked, mm, (x, xs, x_float), (tok, wt) = _case(mxfp4, fp8, max_m, "skewed")
    rows = masked.clamp(0, max_m).tolist()
    slots = sum(rows) + 8  # and a few destinations nobody is sent to
    dest = torch.full((EXPERTS, max_m), -1, dtype=torch.int32, device="cuda")
    owner = torch.empty(slots, dtype=torch.int64, device="cuda")  # the token of each destination
    start = 0
    for e, m in enumerate(rows):
        dest[e, :m] = torch.arange(start, start + m, dtype=torch.int32, device="cuda")
        owner[start:start + m] = tok[e, :m].long()
        start += m
    recv = torch.empty(slots, HIDDEN, device="cuda", dtype=torch.bfloat16)
    recv.view(torch.int16).fill_(0x7FC1)  # a bf16 NaN
    peers = torch.tensor([recv.data_ptr()], dtype=torch.int64, device="cuda")
    got, err = layer(x, mm, Combine(dest, wt, recv, None, peers), x_scale=xs, expected_m=32)
    torch.cuda.synchronize()
    assert got is recv and int(err.item()) == 0
    assert (recv[start:].view(torch.int16) == 0x7FC1).all()
    summed = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64, device="cuda")
    summed.index_add_(0, owner[:start], recv[:start].double())
    ref = gpt_oss_experts_ref(x_float, mm, *floats, token_index=tok.clamp(min=0), weight=wt,
                              num_tokens=TOKENS)
    routed = torch.zeros(TOKENS, dtype=torch.bool, device="cuda")
    routed[owner[:start]] = True
    if routed.any():
        # each row rounded to bf16 once (2**-9 relative) beside the fp32 combine's error
        assert similarity(summed[routed], ref[routed].double()) <= (1e-3 if fp8 else 1e-4)


def test_layer_in_a_cuda_graph(seed):
    max_m = 64
    layer, _ = _layer(True)
    masked = _masked(EXPERTS, 32, max_m, "uniform")
    mm = masked.cuda()
    x, xs, _ = _inputs(masked, max_m, True)
    tok, wt = _routing(masked, max_m, TOKENS)
    eager = torch.zeros(TOKENS, HIDDEN, device="cuda")
    layer(x, mm, Combine(tok, wt, eager), x_scale=xs)
    output = torch.zeros(TOKENS, HIDDEN, device="cuda")
    graph = capture_graph(lambda: layer(x, mm, Combine(tok, wt, output), x_scale=xs), calls=1)
    output.zero_()
    graph.replay()
    torch.cuda.synchronize()
    # the combine's reductions land in any order: equal up to fp32 reassociation
    assert similarity(output, eager) < 1e-9
    assert (output - eager).abs().max().item() <= 1e-4 * eager.abs().max().item()
