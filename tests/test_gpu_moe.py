"""The MoE expert path on an sm_90 GPU: the activation kernel, the combine
fused into the down GEMM, the layer against its float reference, CUDA
graphs, torch.compile and the DeepGEMM-compatible overlap form."""

import pytest
import torch

import flashgemm
from flashgemm import Combine
from flashgemm.moe.activation import alloc_fp8_input, silu_mul, silu_mul_ref
from flashgemm.moe.layer import MaskedExperts, moe_experts_ref
from flashgemm.quant import dequantize_fp8_per_token, quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.reference import similarity
from flashgemm.timing import capture_graph

from conftest import requires_hopper

pytestmark = requires_hopper
FP8_NAN = 0x7F  # e4m3 NaN bit pattern: poison for fp8 outputs


def _masked(e_count, mean, max_m, dist):
    if dist == "uniform":
        m = (mean * (0.7 + 0.6 * torch.rand(e_count))).int()
    elif dist == "skewed":
        w = torch.rand(e_count) ** 3
        m = (w / w.sum() * mean * e_count).int()
    elif dist == "sparse":
        m = (mean * 2 * (torch.rand(e_count) < 0.4)).int()
    else:  # every expert empty
        m = torch.zeros(e_count, dtype=torch.int32)
    m[0] = 0  # always one empty expert
    if dist != "empty":
        m[-1] = max_m + 7  # an over-long one, clamped to max_m
    return m.to(torch.int32)


def _routing(masked, max_m, tokens):
    """Each expert's rows from distinct tokens (tokens >= max_m)."""
    assert tokens >= max_m
    tok = torch.full((masked.shape[0], max_m), -1, dtype=torch.int32)  # padding rows name no token
    for e, m in enumerate(masked.clamp(0, max_m).tolist()):
        tok[e, :m] = torch.randperm(tokens)[:m].to(torch.int32)
    return tok.cuda(), torch.rand(masked.shape[0], max_m, device="cuda")



def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at each value of q (subnormals below 2**-6: 2**-9)."""
    return torch.exp2(torch.floor(torch.log2(q.float().abs().clamp(min=2.0**-6))) - 3)


def assert_within_one_e4m3_step(q, s, rq, rs):
    """Each dequantized value of (q, s) lies within one e4m3 step, at the larger
    of the two scales, of the reference's (rq, rs): both are round-to-nearest
    of nearly the same fp32 value (the kernel's exp and reciprocal are a few
    ulp off), each within half a step of it; 2**-16 relative covers those ulp."""
    cols = q.shape[-1]
    scale = torch.maximum(s, rs).repeat_interleave(128, dim=-1)[..., :cols]
    d, r = dequantize_fp8_per_token(q, s), dequantize_fp8_per_token(rq, rs)
    bound = scale * torch.maximum(e4m3_step(q), e4m3_step(rq)) + 2.0**-16 * r.abs()
    worst = ((d - r).abs() - bound).max().item()
    assert worst <= 0, f"an element is {worst:.3g} past one e4m3 step of the reference"

@pytest.mark.parametrize("inter", [2048, 768, 1152], ids=lambda i: f"I{i}")
def test_activation_fp8_matches_reference_and_leaves_padding(seed, inter):
    e_count, max_m = 6, 96
    masked = _masked(e_count, 40, max_m, "uniform")
    mm = masked.cuda()
    gu = torch.randn(e_count, max_m, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    q, s = alloc_fp8_input(e_count, max_m, inter, "cuda")
    q.view(torch.uint8).fill_(FP8_NAN)
    s.fill_(float("nan"))
    silu_mul(gu, mm, out=q, out_scale=s)
    torch.cuda.synchronize()
    assert_fp8_h_matches(q, s, *silu_mul_ref(gu, mm), masked.clamp(0, max_m).tolist())


def assert_fp8_h_matches(q, s, rq, rs, rows):
    """An activation kernel's fp8 h (q, s) against its reference: each
    expert's rows past ``rows[e]`` still poisoned, the valid ones within one
    e4m3 step."""
    for e, m in enumerate(rows):
        assert (q[e, m:].view(torch.uint8) == FP8_NAN).all() and s[e, m:].isnan().all()
        if m:
            # the kernel's exp is ex2.approx (2 ulp): the block maxima agree to a few ulp
            torch.testing.assert_close(s[e, :m], rs[e, :m], rtol=4e-6, atol=0)
            assert_within_one_e4m3_step(q[e, :m], s[e, :m], rq[e, :m], rs[e, :m])


def test_activation_bf16(seed):
    e_count, max_m, inter = 5, 64, 1408
    masked = _masked(e_count, 30, max_m, "skewed")
    gu = torch.randn(e_count, max_m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    out = torch.full((e_count, max_m, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    silu_mul(gu, masked.cuda(), fp8=False, out=out)
    torch.cuda.synchronize()
    ref = silu_mul_ref(gu, masked.cuda(), fp8=False)
    for e, m in enumerate(masked.clamp(0, max_m).tolist()):
        assert out[e, m:].isnan().all()
        if m:
            assert similarity(out[e, :m].float(), ref[e, :m].float()) < 1e-6


def _layer(e_count, hidden, inter, fp8):
    w13 = torch.randn(e_count, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(e_count, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    if not fp8:
        return MaskedExperts(w13, w2), dict(w13=w13, w2=w2)
    q13, s13 = quantize_fp8_per_block(w13)
    q2, s2 = quantize_fp8_per_block(w2)
    return MaskedExperts(q13, q2, w13_scale=s13, w2_scale=s2), dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("dist", ["uniform", "skewed", "sparse", "empty"])
def test_layer_with_fused_combine_matches_reference(seed, fp8, dist):
    e_count, hidden, inter, max_m, tokens = 8, 1024, 512, 96, 128
    layer, w = _layer(e_count, hidden, inter, fp8)
    masked = _masked(e_count, 30, max_m, dist)
    mm = masked.cuda()
    x = torch.randn(e_count, max_m, hidden, device="cuda", dtype=torch.bfloat16)
    xs = None
    if fp8:
        x, xs = quantize_fp8_per_token(x)
    tok, wt = _routing(masked, max_m, tokens)
    base = torch.randn(tokens, hidden, device="cuda")  # what is there already: added to, never replaced
    output = base.clone()
    got, err = layer(x, mm, x_scale=xs, expected_m=30, combine=Combine(tok, wt, output))
    torch.cuda.synchronize()
    assert got is output and int(err.item()) == 0
    ref = moe_experts_ref(x, mm, w["w13"], w["w2"], x_scale=xs, w13_scale=w.get("w13_scale"),
                          w2_scale=w.get("w2_scale"), token_index=tok.clamp(min=0), weight=wt,
                          num_tokens=tokens)
    valid = torch.arange(max_m, device="cuda")[None, :] < mm.clamp(0, max_m)[:, None]
    routed = torch.zeros(tokens, dtype=torch.bool, device="cuda")
    routed[tok[valid].long()] = True
    assert torch.equal(output[~routed], base[~routed])  # tokens nobody routed: untouched
    if routed.any():
        assert similarity(output[routed] - base[routed], ref[routed]) < (1e-4 if fp8 else 1e-6)


def test_fused_combine_reports_tokens_out_of_range(seed):
    e_count, max_m, n, k, tokens = 4, 64, 512, 256, 72
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16)
    mm = torch.tensor([3, 0, 64, 10], dtype=torch.int32, device="cuda")
    tok, wt = _routing(mm.cpu(), max_m, tokens)
    tok[0, 1] = tokens  # one past the end
    tok[2, 5] = -3
    output = torch.zeros(tokens, n, device="cuda")
    _, err = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=Combine(tok, wt, output))
    torch.cuda.synchronize()
    assert int(err.item()) == 2
    ref = torch.zeros(tokens, n, dtype=torch.float64, device="cuda")
    y = flashgemm.reference.grouped_gemm_nt_masked_ref(a, b, mm).to(torch.bfloat16).double()
    for e, m in enumerate(mm.tolist()):
        for r in range(m):
            t = int(tok[e, r])
            if 0 <= t < tokens:
                ref[t] += wt[e, r].double() * y[e, r]
    assert similarity(output, ref) < 1e-6  # the bad rows were skipped, the others added


def test_layer_in_a_cuda_graph_follows_new_routing(seed):
    e_count, hidden, inter, max_m, tokens = 8, 1024, 256, 64, 64
    layer, w = _layer(e_count, hidden, inter, True)
    x, xs = quantize_fp8_per_token(torch.randn(e_count, max_m, hidden, device="cuda", dtype=torch.bfloat16))
    mm = torch.zeros(e_count, dtype=torch.int32, device="cuda")
    tok = torch.zeros(e_count, max_m, dtype=torch.int32, device="cuda")
    wt = torch.zeros(e_count, max_m, device="cuda")
    output = torch.zeros(tokens, hidden, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    run = lambda: layer(x, mm, x_scale=xs, expected_m=20, combine=Combine(tok, wt, output, err))  # noqa: E731
    graph = capture_graph(run, calls=1)  # compiled and warmed up outside the capture
    for _ in range(2):  # new masked_m and routing each replay, no recapture
        masked = _masked(e_count, 20, max_m, "uniform")
        mm.copy_(masked.clamp(0, max_m))
        t, wts = _routing(masked, max_m, tokens)
        tok.copy_(t.clamp(min=0))
        wt.copy_(wts)
        output.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_experts_ref(x, mm, w["w13"], w["w2"], x_scale=xs, w13_scale=w["w13_scale"],
                              w2_scale=w["w2_scale"], token_index=tok, weight=wt, num_tokens=tokens)
        assert similarity(output, ref) < 1e-4 and int(err.item()) == 0


def test_torch_compile_fullgraph_on_gpu(seed):
    a = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    mm = torch.tensor([0, 7, 64, 33], dtype=torch.int32, device="cuda")

    def f(a, b, mm):
        return torch.nn.functional.silu(flashgemm.grouped_gemm_nt_masked(a, b, None, mm, expected_m=32).float())

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(a, b, mm)
    want = f(a, b, mm)
    for e, m in enumerate(mm.tolist()):
        torch.testing.assert_close(got[e, :m], want[e, :m])


def test_deep_gemm_overlap_form_counts_64_row_blocks_to_the_threshold(seed):
    from flashgemm.compat.deep_gemm import m_grouped_fp8_gemm_nt_masked

    e_count, max_m, n, k = 6, 256, 1536, 512
    a, sfa = quantize_fp8_per_token(torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16))
    b, sfb = quantize_fp8_per_block(torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16))
    masked = torch.tensor([0, 1, 64, 65, 200, 256], dtype=torch.int32)
    d = torch.full((e_count, max_m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    signal = torch.zeros(e_count * (max_m // 64), dtype=torch.int32, device="cuda")
    block_m, threshold = m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked.cuda(), 64,
                                                      enable_overlap=True, signal=signal)
    torch.cuda.synchronize()
    assert block_m == 64
    want = torch.tensor([[threshold if mb * 64 < m else 0 for mb in range(max_m // 64)] for m in masked.tolist()])
    assert torch.equal(signal.cpu().view(e_count, -1), want.to(torch.int32))
    ref = flashgemm.reference.grouped_gemm_nt_masked_ref(a, b, masked.cuda(), a_scale=sfa, b_scale=sfb)
    for e, m in enumerate(masked.tolist()):
        assert d[e, m:].isnan().all()
        if m:
            assert similarity(d[e, :m].float(), ref[e, :m]) < 1e-4


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_fused_combine_into_bf16_stays_within_the_rounding_bound(seed, fp8):
    """bf16 sums against fp32 sums of the same kernel rows: each L2 add
    rounds the running sum to bf16 and each weighted row is rounded to bf16
    once before its add, so a token with k rows is off by at most
    (k + 2) * 2**-8 * (|base| + sum |w * y|) (half an ulp, 2**-9, per
    rounding, doubled for slack); tokens nobody routed keep their bits."""
    e_count, max_m, n, k, tokens = 6, 80, 1024, 512, 400  # some tokens routed nowhere
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    xs = ws = None
    if fp8:
        a, xs = quantize_fp8_per_token(a)
        b, ws = quantize_fp8_per_block(b)
    masked = torch.tensor([80, 0, 37, 80 + 9, 1, 64], dtype=torch.int32)
    mm = masked.cuda()
    tok, wt = _routing(masked, max_m, tokens)
    base = torch.randn(tokens, n, device="cuda").to(torch.bfloat16)
    sums = {}
    for dtype in (torch.bfloat16, torch.float32):
        sums[dtype] = base.to(dtype, copy=True)
        got, err = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=xs, b_scale=ws,
                                                    combine=Combine(tok, wt, sums[dtype]))
        torch.cuda.synchronize()
        assert got is sums[dtype] and int(err.item()) == 0
    # the kernel's rows are rounded to bf16 before they are weighted
    y = flashgemm.reference.grouped_gemm_nt_masked_ref(a, b, mm, a_scale=xs, b_scale=ws).to(torch.bfloat16)
    ref = base.double()
    mag = base.double().abs()
    count = torch.zeros(tokens, 1, dtype=torch.float64, device="cuda")
    for e, m in enumerate(mm.clamp(0, max_m).tolist()):
        t = tok[e, :m].long()
        term = wt[e, :m, None].double() * y[e, :m].double()
        ref.index_add_(0, t, term)
        mag.index_add_(0, t, term.abs())
        count.index_add_(0, t, torch.ones(m, 1, dtype=torch.float64, device="cuda"))
    routed = count[:, 0] > 0
    assert routed.any() and not routed.all()
    output, exact = sums[torch.bfloat16], sums[torch.float32].double()
    assert torch.equal(output[~routed], base[~routed])
    assert similarity(exact[routed] - base[routed].double(), ref[routed] - base[routed].double()) < \
        (1e-4 if fp8 else 1e-6)
    bound = (count + 2) * 2.0**-8 * mag
    excess = ((output.double() - exact).abs() - bound)[routed]
    assert excess.max() <= 0, f"bf16 sums off by more than the rounding bound: {excess.max().item()}"
