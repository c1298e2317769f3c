"""GPU correctness of the MXFP4-weight GEMMs (packed e2m1 weights with E8M0
exponents per 32; ``Format.FP8_MXFP4``: e4m3 activations with 1x128
scales; ``Format.BF16_MXFP4``: bf16 activations; skipped without an sm_90
GPU).

The reference is the float64 product of the *dequantized* operands (the
kernel multiplies exactly those values: the weights are exact in e4m3 once
each group's exponent is folded, ``device.e2m1``). Two checks per expert on
the valid rows:

* DeepGEMM's similarity < 1e-3 (the bar for fp8 activations);
* elementwise |out - ref| <= 2**-8 |ref| + 2**-11 (|a| @ |b|.T): bf16
  rounding of the output (half an ulp is 2**-9 relative), plus the fp8
  wgmma's own accumulation, which keeps about 13 fraction bits within a
  128-deep k-block before the fp32 promotion (DeepGEMM's measurement;
  2**-11 leaves a factor 4 for the partial sums' alignment).

With bf16 activations the products are exact (8-bit mantissas; the weights
are exact in bf16) and summed in fp32: similarity < 1e-4 (the bar for bf16
activations) and |out - ref| <= 2**-8 |ref| + (K + 2) 2**-23 (|a| @ |b|.T),
one fp32 ulp of the running magnitude per addition (truncated, not rounded)
plus the output's bf16 rounding.

Outputs and guard regions are poisoned first: rows >= m_e and memory
around ``out`` must keep the poison.
"""

import pytest
import torch

import flashgemm
from flashgemm.config import GemmConfig, Promotion, Tail, TileOrder
from flashgemm.mxfp4 import dequantize_as_kernel, dequantize_mxfp4, prepare_weights, quantize_mxfp4, unprepare_weights
from flashgemm.quant import quantize_fp8_per_token
from flashgemm.reference import similarity

from conftest import requires_hopper

pytestmark = requires_hopper

POISON = -12345.0
GUARD = 4096


def _operands(e_count, max_m, n, k, masked, spread):
    """float32 x, the MXFP4 weights (packed, scales) and masked_m on the GPU:
    rows and 32-groups of different magnitudes, so every exponent path is used."""
    dev = "cuda"
    x = torch.randn(e_count, max_m, k, device=dev) * torch.rand(e_count, max_m, 1, device=dev).mul(spread).exp2()
    w = torch.randn(e_count, n, k, device=dev) / k**0.5
    w = w * torch.rand(e_count, n, k // 32, 1, device=dev).mul(spread).exp2().repeat_interleave(32, -2).flatten(-2)
    return x, quantize_mxfp4(w), torch.tensor(masked, dtype=torch.int32, device=dev)


def _case(e_count, max_m, n, k, masked, spread=4.0):
    x, (packed, scales), masked_m = _operands(e_count, max_m, n, k, masked, spread)
    a, a_scale = quantize_fp8_per_token(x)
    b, b_scale = prepare_weights(packed, scales)
    return a, a_scale, b, b_scale, dequantize_mxfp4(packed, scales), masked_m


def _poisoned_out(e_count, max_m, n):
    numel = e_count * max_m * n
    buf = torch.full((GUARD + numel + GUARD,), POISON, device="cuda", dtype=torch.bfloat16)
    return buf, buf[GUARD:GUARD + numel].view(e_count, max_m, n)


def _dequant_a(a, a_scale):
    k = a.shape[2]
    return a.double() * a_scale.double().repeat_interleave(128, dim=2)[:, :, :k]


def _check(a, a_scale, b_deq, masked_m, out, buf):
    _check_deq(_dequant_a(a, a_scale), b_deq, masked_m, out, buf, 1e-3, 2.0**-11)


def _check_deq(a_deq, b_deq, masked_m, out, buf, sim_bar, acc_rel):
    """The module docstring's checks: guards and rows >= m_e poisoned, then per
    expert similarity < sim_bar and |out - ref| <= 2**-8 |ref| + acc_rel (|a| @ |b|.T)."""
    torch.cuda.synchronize()
    assert (buf[:GUARD] == POISON).all(), "write before out"
    assert (buf[-GUARD:] == POISON).all(), "write after out"
    max_m = out.shape[1]
    for e, m in enumerate(masked_m.clamp(0, max_m).tolist()):
        assert (out[e, m:] == POISON).all(), f"expert {e}: rows >= m_e={m} were written"
        if not m:
            continue
        ref = a_deq[e, :m] @ b_deq[e].double().T
        mag = a_deq[e, :m].abs() @ b_deq[e].double().abs().T
        got = out[e, :m].double()
        assert not got.isnan().any(), f"expert {e}: NaN"
        assert similarity(got.float(), ref.float()) < sim_bar, f"expert {e}: similarity"
        bound = 2.0**-8 * ref.abs() + acc_rel * mag
        excess = ((got - ref).abs() - bound).max().item()
        assert excess <= 0, f"expert {e} (m_e={m}): error over the bound by {excess:.3e}"


CASES = [
    # (E, max_m, N, K, masked_m): decode, odd N and K (2880, not multiples of 128), every masked_m kind
    (8, 64, 4096, 7168, [5, 0, 64, 17, 1, 33, 200, -3]),
    (4, 128, 2880, 2880, [128, 3, 0, 77]),
    (16, 32, 5760, 2880, [1, 2, 3, 4, 0, 32, 31, 8, 1, 1, 0, 9, 16, 5, 3, 2]),
    (2, 300, 1024, 512, [300, 129]),
    (1, 1, 16, 32, [1]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}-M{c[1]}-N{c[2]}-K{c[3]}")
def test_heuristic_pick(case, seed):
    e_count, max_m, n, k, masked = case
    a, a_scale, b, b_scale, b_deq, masked_m = _case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale,
                                     expected_m=max(1, sum(max(0, min(m, max_m)) for m in masked) // e_count))
    _check(a, a_scale, b_deq, masked_m, out, buf)


CONFIGS = [
    GemmConfig(tile_m=64, tile_n=128, cluster_n=2, order=TileOrder.DYNAMIC, a_chunk_rows=32, l2_hints=True),
    GemmConfig(tile_m=64, tile_n=64, cluster_n=1),
    GemmConfig(tile_m=64, tile_n=192, cluster_n=1, order=TileOrder.N_MAJOR),
    GemmConfig(tile_m=128, tile_n=128, cluster_n=2, tail=Tail.BALANCE, promotion=Promotion.SERIAL),
    GemmConfig(tile_m=128, tile_n=192, cluster_n=2, tail=Tail.SPLIT, promotion=Promotion.TWO_PARTS),
    GemmConfig(tile_m=64, tile_n=128, cluster_n=1, promotion=Promotion.OVERLAPPED),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short_name())
def test_configs(config, seed):
    e_count, max_m, n, k = 6, 200, 2880, 2880
    masked = [200, 0, 7, 150, 64, -1]
    a, a_scale, b, b_scale, b_deq, masked_m = _case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=config)
    _check(a, a_scale, b_deq, masked_m, out, buf)


def test_wide_exponent_spans_flush_as_documented(seed):
    # one weight group per tile 20 binades below the rest: the kernel multiplies
    # dequantize_as_kernel's values (that group zero), and the rest exactly
    e_count, max_m, n, k = 2, 64, 256, 512
    a, a_scale, b, b_scale, _, masked_m = _case(e_count, max_m, n, k, [64, 40], spread=2.0)
    b_scale = b_scale.clone()  # (N contiguous, as prepared)
    b_scale[:, 5, 1] = (b_scale[:, 5, 1].int() - 20).clamp(min=0).to(torch.uint8)
    packed, scales = unprepare_weights(b, b_scale)
    config = GemmConfig(tile_m=64, tile_n=128, cluster_n=1)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=config)
    kernel_view = dequantize_as_kernel(packed, scales, 128)
    assert (kernel_view[:, 5, 32:64] == 0).all() and (dequantize_mxfp4(packed, scales)[:, 5, 32:64] != 0).any()
    _check(a, a_scale, kernel_view, masked_m, out, buf)


def test_e8m0_dtype_and_graph_replay(seed):
    e_count, max_m, n, k = 4, 32, 512, 1024
    a, a_scale, b, b_scale, b_deq, masked_m = _case(e_count, max_m, n, k, [32, 1, 0, 20])
    s8 = b_scale.view(torch.float8_e8m0fnu)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=s8)  # warm (compile)
    buf.fill_(POISON)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=s8)
    masked_m.copy_(torch.tensor([3, 32, 17, 0], dtype=torch.int32))
    graph.replay()
    _check(a, a_scale, b_deq, masked_m, out, buf)


def _bf16_case(e_count, max_m, n, k, masked, spread=4.0):
    """bf16 activations and MXFP4 weights as in ``_case``; returns (x, b,
    b_scale, the kernel's weights, masked_m)."""
    x, (packed, scales), masked_m = _operands(e_count, max_m, n, k, masked, spread)
    b, b_scale = prepare_weights(packed, scales)
    return x.bfloat16(), b, b_scale, dequantize_as_kernel(packed, scales, None), masked_m


def _check_bf16(x, b_deq, masked_m, out, buf):
    _check_deq(x.double(), b_deq, masked_m, out, buf, 1e-4, (x.shape[2] + 2) * 2.0**-23)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}-M{c[1]}-N{c[2]}-K{c[3]}")
def test_bf16_activations_heuristic_pick(case, seed):
    e_count, max_m, n, k, masked = case
    x, b, b_scale, b_deq, masked_m = _bf16_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(x, b, out, masked_m, b_scale=b_scale,
                                     expected_m=max(1, sum(max(0, min(m, max_m)) for m in masked) // e_count))
    _check_bf16(x, b_deq, masked_m, out, buf)


BF16_CONFIGS = [
    GemmConfig(tile_m=64, tile_n=128, cluster_n=2, order=TileOrder.DYNAMIC, a_chunk_rows=32, l2_hints=True),
    GemmConfig(tile_m=64, tile_n=64, cluster_n=1),
    GemmConfig(tile_m=128, tile_n=128, cluster_n=2, tail=Tail.BALANCE),
    GemmConfig(tile_m=128, tile_n=192, cluster_n=2, tail=Tail.SPLIT),
    GemmConfig(tile_m=64, tile_n=192, cluster_n=1, order=TileOrder.N_MAJOR),
]


@pytest.mark.parametrize("config", BF16_CONFIGS, ids=lambda c: c.short_name())
def test_bf16_activations_configs(config, seed):
    e_count, max_m, n, k = 6, 200, 2880, 2880
    x, b, b_scale, b_deq, masked_m = _bf16_case(e_count, max_m, n, k, [200, 0, 7, 150, 64, -1])
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(x, b, out, masked_m, b_scale=b_scale, config=config)
    _check_bf16(x, b_deq, masked_m, out, buf)


def test_bf16_activations_tiny_groups_flush_and_graph_replay(seed):
    # groups with exponent bytes 0 and 1 are flushed (dequantize_as_kernel), the
    # extremes kept exact: 2 (the smallest normal table) and 252 beside tiny x
    e_count, max_m, n, k = 3, 48, 256, 512
    x, b, b_scale, _, masked_m = _bf16_case(e_count, max_m, n, k, [48, 5, 30], spread=2.0)
    b_scale = b_scale.clone()
    b_scale[:, 3, 0], b_scale[:, 4, 1], b_scale[:, 6, 2] = 0, 1, 2
    packed, scales = unprepare_weights(b, b_scale)
    b_deq = dequantize_as_kernel(packed, scales, None)
    assert (b_deq[:, 3, :32] == 0).all() and (b_deq[:, 4, 32:64] == 0).all()
    assert (b_deq[:, 6, 64:96] != 0).any()
    buf, out = _poisoned_out(e_count, max_m, n)
    s8 = b_scale.view(torch.float8_e8m0fnu)
    flashgemm.grouped_gemm_nt_masked(x, b, out, masked_m, b_scale=s8)  # warm (compile)
    buf.fill_(POISON)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flashgemm.grouped_gemm_nt_masked(x, b, out, masked_m, b_scale=s8)
    masked_m.copy_(torch.tensor([7, 48, 0], dtype=torch.int32))
    graph.replay()
    _check_bf16(x, b_deq, masked_m, out, buf)


def test_bf16_activations_largest_scale_is_exact(seed):
    # E8M0 252 (up to 6 * 2**125, bf16's largest binades) against activations scaled down to match
    e_count, max_m, n, k = 1, 16, 64, 64
    x, b, b_scale, _, masked_m = _bf16_case(e_count, max_m, n, k, [16], spread=0.0)
    b_scale = torch.full_like(b_scale, 252)
    x = x.float()
    x = (x.sign() * x.abs().clamp(min=2.0**-8) * 2.0**-110).bfloat16()  # normal bf16, products near 1
    packed, scales = unprepare_weights(b, b_scale)
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(x, b, out, masked_m, b_scale=b_scale)
    _check_bf16(x, dequantize_as_kernel(packed, scales, None), masked_m, out, buf)


def test_layer_with_mxfp4_weights_fused_swiglu_and_combine(seed):
    """``MaskedExperts`` on MXFP4 weights (gate_up with the SwiGLU and h's
    quantization fused, down with the fp32 combine fused) against a float
    reference of the same dequantized weights: gate_up rounded to bf16 as
    the kernel's epilogue does, h quantized 1x128, then the routed sums."""
    from flashgemm import Combine
    from flashgemm.moe.layer import MaskedExperts

    e_count, tokens, hidden, inter = 8, 64, 1024, 256
    x, xs = quantize_fp8_per_token(torch.randn(e_count, tokens, hidden, device="cuda"))
    w13 = torch.randn(e_count, 2 * inter, hidden, device="cuda") / hidden**0.5
    w2 = torch.randn(e_count, hidden, inter, device="cuda") / inter**0.5
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    (b13, s13), (b2, s2) = prepare_weights(*q13), prepare_weights(*q2)
    layer = MaskedExperts(b13, b2, w13_scale=s13, w2_scale=s2)
    masked = [64, 0, 3, 17, 64, 1, 40, 9]
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    tok = torch.stack([torch.randperm(tokens) for _ in range(e_count)]).to(torch.int32).cuda()
    wt = torch.rand(e_count, tokens, device="cuda")
    out = torch.zeros(tokens, hidden, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    layer(x, masked_m, x_scale=xs, combine=Combine(tok, wt, out, err))
    d13, d2 = dequantize_mxfp4(*q13), dequantize_mxfp4(*q2)
    xd = x.float() * xs.repeat_interleave(128, dim=2)
    ref = torch.zeros(tokens, hidden, device="cuda", dtype=torch.float64)
    for e, m in enumerate(masked):
        gu = (xd[e, :m] @ d13[e].T).bfloat16().float()
        h = torch.nn.functional.silu(gu[:, :inter]).bfloat16().float() * gu[:, inter:]
        hq, hs = quantize_fp8_per_token(h.bfloat16().unsqueeze(0))
        hd = hq[0].float() * hs[0].repeat_interleave(128, dim=1)
        ref.index_add_(0, tok[e, :m].long(), wt[e, :m, None].double() * (hd @ d2[e].T).double())
    torch.cuda.synchronize()
    assert int(err.item()) == 0
    # where the kernel's bf16 gate_up rounds apart from the reference's, h moves by up
    # to one e4m3 step (2**-3 relative) in that element: DeepGEMM's similarity bar
    # (1e-3) measures the whole output instead of such single elements
    assert similarity(out, ref.float()) < 1e-3


def test_layer_with_mxfp4_weights_and_bf16_activations(seed):
    """``MaskedExperts`` on MXFP4 weights with bf16 x (gate_up with the bf16
    SwiGLU fused, h bf16, down with the fp32 combine fused) against
    ``moe_experts_ref`` on the same dequantized weights: the bar for bf16
    activations (1e-4); where gate_up's accumulation order flips a bf16
    rounding, h moves by one bf16 step in that element."""
    from flashgemm import Combine
    from flashgemm.moe.layer import MaskedExperts, moe_experts_ref

    e_count, tokens, hidden, inter = 8, 64, 1024, 256
    x = torch.randn(e_count, tokens, hidden, device="cuda").bfloat16()
    w13 = torch.randn(e_count, 2 * inter, hidden, device="cuda") / hidden**0.5
    w2 = torch.randn(e_count, hidden, inter, device="cuda") / inter**0.5
    (b13, s13), (b2, s2) = prepare_weights(*quantize_mxfp4(w13)), prepare_weights(*quantize_mxfp4(w2))
    layer = MaskedExperts(b13, b2, w13_scale=s13, w2_scale=s2)
    masked = [64, 0, 3, 17, 64, 1, 40, -2]
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    tok = torch.stack([torch.randperm(tokens) for _ in range(e_count)]).to(torch.int32).cuda()
    wt = torch.rand(e_count, tokens, device="cuda")
    out = torch.zeros(tokens, hidden, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    layer(x, masked_m, combine=Combine(tok, wt, out, err))
    ref = moe_experts_ref(x, masked_m, b13, b2, w13_scale=s13, w2_scale=s2, token_index=tok, weight=wt,
                          num_tokens=tokens)
    torch.cuda.synchronize()
    assert int(err.item()) == 0
    assert similarity(out, ref) < 1e-4
