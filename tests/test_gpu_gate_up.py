"""gate_up with the SwiGLU fused into its epilogue, on an sm_90 GPU: the same
h (and fp8 scales) as the gate_up GEMM followed by the activation kernel,
within the activation's bound of the float reference, rows >= m_e untouched,
on uniform, skewed, sparse and empty experts."""

import pytest
import torch

import flashgemm
from flashgemm.moe.activation import alloc_fp8_input, silu_mul, silu_mul_ref
from flashgemm.moe.gate_up import InterleavedW13, gate_up_swiglu, interleave_w13
from flashgemm.moe.layer import ActivationPath, MaskedExperts, moe_experts_ref
from flashgemm.quant import dequantize_fp8_per_token, quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.reference import similarity
from flashgemm.timing import capture_graph

from conftest import requires_hopper
from test_gpu_moe import FP8_NAN, _masked, assert_within_one_e4m3_step

pytestmark = requires_hopper


def _operands(e_count, max_m, hidden, inter, fp8):
    x = torch.randn(e_count, max_m, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(e_count, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    if not fp8:
        return x, None, w13, None
    return (*quantize_fp8_per_token(x), *quantize_fp8_per_block(w13))


def _poisoned(e_count, max_m, inter, fp8):
    if fp8:
        h, hs = alloc_fp8_input(e_count, max_m, inter, "cuda")
        h.view(torch.uint8).fill_(FP8_NAN)
        hs.fill_(float("nan"))
        return h, hs
    return torch.full((e_count, max_m, inter), float("nan"), device="cuda", dtype=torch.bfloat16), None


# (E, max_m, H, I, expected_m): 64-row dynamic tiles, 128-row n-major ones, a half K block (576)
SHAPES = [(8, 96, 1024, 512, 30), (8, 256, 1024, 768, 100), (6, 64, 576, 256, 20)]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("dist", ["uniform", "skewed", "sparse", "empty"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_swiglu_equals_the_two_kernel_path(seed, fp8, dist, shape):
    e_count, max_m, hidden, inter, em = shape
    masked = _masked(e_count, em, max_m, dist)
    mm = masked.cuda()
    x, xs, w13, s13 = _operands(e_count, max_m, hidden, inter, fp8)
    gu = flashgemm.grouped_gemm_nt_masked(x, w13, None, mm, a_scale=xs, b_scale=s13, expected_m=em)
    want = silu_mul(gu, mm, fp8=fp8)
    h, hs = _poisoned(e_count, max_m, inter, fp8)
    got = gate_up_swiglu(x, interleave_w13(w13, s13), mm, x_scale=xs, out=h, out_scale=hs, expected_m=em)
    torch.cuda.synchronize()
    assert (got[0] is h and got[1] is hs) if fp8 else got is h
    ref = silu_mul_ref(gu, mm, fp8=fp8)  # the float reference of the activation on the same gate_up
    for e, m in enumerate(masked.clamp(0, max_m).tolist()):
        if fp8:
            assert (h[e, m:].view(torch.uint8) == FP8_NAN).all() and hs[e, m:].isnan().all()
            if m:
                # the same gate_up values, rounded to bf16, and the same arithmetic
                assert torch.equal(h[e, :m].view(torch.uint8), want[0][e, :m].view(torch.uint8))
                assert torch.equal(hs[e, :m], want[1][e, :m])
                assert_within_one_e4m3_step(h[e, :m], hs[e, :m], ref[0][e, :m], ref[1][e, :m])
        else:
            assert h[e, m:].isnan().all()
            if m:
                assert torch.equal(h[e, :m], want[e, :m])
                assert similarity(h[e, :m].float(), ref[e, :m].float()) < 1e-6


def test_fused_swiglu_in_a_cuda_graph_follows_new_masked_m(seed):
    e_count, max_m, hidden, inter = 8, 128, 1024, 512
    x, xs, w13, s13 = _operands(e_count, max_m, hidden, inter, True)
    w13i = interleave_w13(w13, s13)
    mm = torch.zeros(e_count, dtype=torch.int32, device="cuda")
    h, hs = _poisoned(e_count, max_m, inter, True)
    graph = capture_graph(lambda: gate_up_swiglu(x, w13i, mm, x_scale=xs, out=h, out_scale=hs,
                                                 expected_m=40), calls=1)
    for _ in range(2):
        masked = _masked(e_count, 40, max_m, "uniform").clamp(0, max_m)
        mm.copy_(masked)
        h.view(torch.uint8).fill_(FP8_NAN)
        graph.replay()
        torch.cuda.synchronize()
        gu = flashgemm.grouped_gemm_nt_masked(x, w13, None, mm, a_scale=xs, b_scale=s13, expected_m=40)
        want_h, want_s = silu_mul(gu, mm, fp8=True)
        torch.cuda.synchronize()
        for e, m in enumerate(masked.tolist()):
            assert torch.equal(h[e, :m].view(torch.uint8), want_h[e, :m].view(torch.uint8))
            assert torch.equal(hs[e, :m], want_s[e, :m])
            assert (h[e, m:].view(torch.uint8) == FP8_NAN).all()


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_layer_paths_agree_with_the_reference(seed, fp8):
    e_count, hidden, inter, max_m = 8, 1024, 512, 96
    x, xs, w13, s13 = _operands(e_count, max_m, hidden, inter, fp8)
    w2 = torch.randn(e_count, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    s2 = None
    if fp8:
        w2, s2 = quantize_fp8_per_block(w2)
    masked = _masked(e_count, 30, max_m, "skewed")
    mm = masked.cuda()
    ys = {}
    for path in ActivationPath:
        layer = MaskedExperts(w13, w2, w13_scale=s13, w2_scale=s2, activation=path)
        w = layer.checkpoint_weights()
        assert torch.equal(w["w13"].view(torch.uint8), w13.view(torch.uint8))
        ys[path] = layer(x, mm, x_scale=xs, expected_m=30)
    torch.cuda.synchronize()
    ref = moe_experts_ref(x, mm, w13, w2, x_scale=xs, w13_scale=s13, w2_scale=s2)
    for e, m in enumerate(masked.clamp(0, max_m).tolist()):
        if m:
            assert torch.equal(ys[ActivationPath.FUSED][e, :m], ys[ActivationPath.SEPARATE][e, :m])
            assert similarity(ys[ActivationPath.FUSED][e, :m].float(), ref[e, :m]) < (1e-4 if fp8 else 1e-6)


def test_fp8_needs_two_sms(seed):
    x, xs, w13, s13 = _operands(2, 32, 256, 128, True)
    with pytest.raises(ValueError, match="num_sms must be >= 2"):
        gate_up_swiglu(x, interleave_w13(w13, s13), torch.ones(2, dtype=torch.int32, device="cuda"), x_scale=xs,
                       num_sms=1)


def test_bf16_odd_n_blocks_write_nothing_past_i(seed):
    # I = 192: three 128-wide gate_up tiles, so a cluster's second CTA holds an
    # n-block past N; h is a view with 64 poisoned columns after each row
    e_count, max_m, hidden, inter = 4, 64, 512, 192
    masked = torch.tensor([0, 17, 64, 40], dtype=torch.int32)
    mm = masked.cuda()
    x, _, w13, _ = _operands(e_count, max_m, hidden, inter, False)
    w13i = interleave_w13(w13)
    wide = torch.full((e_count, max_m, inter + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    h = wide[..., :inter]
    gate_up_swiglu(x, w13i, mm, out=h, expected_m=40)
    torch.cuda.synchronize()
    assert wide[..., inter:].isnan().all()
    want = silu_mul(flashgemm.grouped_gemm_nt_masked(x, w13, None, mm, expected_m=40), mm, fp8=False)
    for e, m in enumerate(masked.tolist()):
        assert torch.equal(h[e, :m], want[e, :m]) and h[e, m:].isnan().all()


def test_torch_compile_fullgraph_runs_the_fused_kernel(seed):
    e_count, max_m, hidden, inter = 4, 64, 512, 256
    masked = torch.tensor([0, 17, 64, 40], dtype=torch.int32)
    mm = masked.cuda()
    x, xs, w13, s13 = _operands(e_count, max_m, hidden, inter, True)
    wi, si = interleave_w13(w13, s13)

    def f(x, wi, mm, xs, si):
        h, hs = gate_up_swiglu(x, InterleavedW13(wi, si), mm, x_scale=xs, expected_m=40)
        return dequantize_fp8_per_token(h, hs)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, wi, mm, xs, si)
    want = dequantize_fp8_per_token(*gate_up_swiglu(x, InterleavedW13(wi, si), mm, x_scale=xs, expected_m=40))
    torch.cuda.synchronize()
    for e, m in enumerate(masked.tolist()):
        assert torch.equal(got[e, :m], want[e, :m])
