"""The fused combine's per-expert bias (``Combine.bias``, the ``*_BIAS``
epilogues) on an sm_90 GPU, for each target (fp32 sums, bf16 sums, the
peers' receive buffers) and each operand format that takes a combine (bf16,
1x128 fp8, MXFP4 weights with bf16 or fp8 activations): every valid row
leaves as ``weight * (row + bias[e])``, against the float64 reference of
that formula summed per token; padding rows (poisoned) are never sent and
rows no token was routed to (poisoned) keep their bits.

The operands are small integers (scales 1), so the GEMM's rows are exact in
fp32 and in bf16 and the only roundings are the epilogue's: ``row + bias``
and ``* weight`` in fp32 (2**-24 relative each), then the target's (an fp32
or a bf16 add per row, or one rounding to bf16 of the stored row). Each
bound below is that count of roundings, each at most half an ulp, doubled
for slack (as in test_gpu_moe's bf16 bound)."""

import pytest
import torch

import flashgemm
from flashgemm import Combine
from flashgemm.mxfp4 import dequantize_mxfp4, prepare_weights, quantize_mxfp4

from conftest import requires_hopper

pytestmark = requires_hopper
E, MAX_M, N, K = 6, 80, 1008, 128  # N: a partial last n-block for every tile width; |row| <= K, exact in bf16
MASKED = [80, 0, 37, 80 + 9, 1, 64]  # an empty expert, an over-long one (clamped to max_m)
TOKENS = 400  # more than max_m: some tokens get no row
FP8_NAN, BF16_NAN = 0x7F, 0x7FC1  # poison bit patterns
F32_ULP, BF16_ULP = 2.0**-23, 2.0**-8  # twice the unit roundoff of each


def _operands(fmt, mm):
    """(a, b, a_scale, b_scale) of ``fmt`` holding small integers (weights
    +-1, activations in {-1, 0, 1}), every padding row of a (and of a_scale)
    poisoned; and the float64 rows a @ b.T of the valid rows (zero past m_e)."""
    dev = "cuda"
    x = torch.randint(-1, 2, (E, MAX_M, K), device=dev).double()
    w = torch.randint(0, 2, (E, N, K), device=dev).double() * 2 - 1
    valid = torch.arange(MAX_M, device=dev)[None, :] < mm.clamp(0, MAX_M)[:, None]
    y = (x * valid[..., None]) @ w.transpose(1, 2)  # [E, MAX_M, N], integers |y| <= K
    fp8 = fmt in ("fp8", "mxfp4-fp8")
    a = x.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    a.view(torch.uint8 if fp8 else torch.int16)[~valid] = FP8_NAN if fp8 else BF16_NAN
    a_scale = None
    if fp8:  # 1x128 activation scales of 1 (poisoned past m_e)
        a_scale = torch.ones(E, MAX_M, -(-K // 128), device=dev)
        a_scale[~valid] = float("nan")
    if fmt.startswith("mxfp4"):
        packed, scales = quantize_mxfp4(w.float())
        assert torch.equal(dequantize_mxfp4(packed, scales).double(), w)  # +-1: exact in e2m1
        b, b_scale = prepare_weights(packed, scales)
    elif fp8:
        b, b_scale = w.to(torch.float8_e4m3fn), torch.ones(E, -(-N // 128), -(-K // 128), device=dev)
    else:
        b, b_scale = w.to(torch.bfloat16), None
    return a, b, a_scale, b_scale, y


def _routing(mm, slots, distinct):
    """token_index for the valid rows (``distinct``: no two rows share a
    destination; else each expert's rows are distinct tokens, tokens shared
    across experts), garbage in the padding rows (never read as routing);
    weights in [-1, 1)."""
    rows = mm.clamp(0, MAX_M).tolist()
    tok = torch.randint(-(2**31), 2**31 - 1, (E, MAX_M), dtype=torch.int32)
    dest = torch.randperm(slots)[: sum(rows)].to(torch.int32)
    start = 0
    for e, m in enumerate(rows):
        tok[e, :m] = dest[start : start + m] if distinct else torch.randperm(slots)[:m].to(torch.int32)
        start += m
    return tok.cuda(), torch.rand(E, MAX_M, device="cuda") * 2 - 1


def _per_token(y, bias, tok, wt, mm, slots):
    """float64 per token: sum of weight * (y + bias[e]) over its rows, sum of
    |weight| * (|y| + |bias[e]|) (the magnitude the roundings scale with) and
    its row count."""
    ref = torch.zeros(slots, N, dtype=torch.float64, device="cuda")
    mag = torch.zeros_like(ref)
    count = torch.zeros(slots, 1, dtype=torch.float64, device="cuda")
    for e, m in enumerate(mm.clamp(0, MAX_M).tolist()):
        t, w = tok[e, :m].long(), wt[e, :m, None].double()
        b = bias[e].double()
        ref.index_add_(0, t, w * (y[e, :m] + b))
        mag.index_add_(0, t, w.abs() * (y[e, :m].abs() + b.abs()))
        count.index_add_(0, t, torch.ones(m, 1, dtype=torch.float64, device="cuda"))
    return ref, mag, count


FORMATS = ["bf16", "fp8", "mxfp4-bf16", "mxfp4-fp8"]


@pytest.mark.parametrize("expected_m", [8, 80], ids=["decode", "mid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bias_sums_match_the_float64_formula(seed, fmt, dtype, expected_m):
    mm = torch.tensor(MASKED, dtype=torch.int32, device="cuda")
    a, b, a_scale, b_scale, y = _operands(fmt, mm)
    tok, wt = _routing(mm, TOKENS, distinct=False)
    bias = torch.randn(E, N, device="cuda") * 8  # the rows' size (|y| ~ sqrt(K))
    ref, mag, count = _per_token(y, bias, tok, wt, mm, TOKENS)
    routed = count[:, 0] > 0
    assert routed.any() and not routed.all()
    base = torch.randn(TOKENS, N, device="cuda").to(dtype)
    base.view(torch.int32 if dtype == torch.float32 else torch.int16)[~routed] = -1  # a NaN pattern: poison
    output = base.clone()
    got, err = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=a_scale, b_scale=b_scale,
                                                expected_m=expected_m, combine=Combine(tok, wt, output, bias=bias))
    torch.cuda.synchronize()
    assert got is output and int(err.item()) == 0  # (the padding rows' garbage tokens never read)
    assert torch.equal(output[~routed].view(torch.uint8), base[~routed].view(torch.uint8)), "an unrouted row written"
    want = base[routed].double() + ref[routed]
    # fp32: two roundings per row (+ bias, * weight) and one per add into the sum; bf16: one rounding of
    # each weighted row to bf16 and one per add, the fp32 ones below a bf16 ulp (docs/design.md, bf16 sums)
    ulp = F32_ULP if dtype == torch.float32 else BF16_ULP
    bound = (count[routed] + 2) * ulp * (base[routed].double().abs() + mag[routed])
    excess = (output[routed].double() - want).abs() - bound
    assert excess.max() <= 0, f"off the float64 formula by more than its roundings: {excess.max().item()}"


@pytest.mark.parametrize("world", [1, 2], ids=["W1", "W2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bias_travels_with_the_peer_stores(seed, fmt, world):
    """Each valid row stored once, as bf16(fp32(fp32(row + bias) * weight)):
    bit for bit torch's fp32 ops on the same values, and within one bf16
    rounding (plus the two fp32 ones) of the float64 formula; every
    destination no row was sent to keeps its poison."""
    slots = 400  # destinations over all ranks: more than the 262 valid rows
    mm = torch.tensor(MASKED, dtype=torch.int32, device="cuda")
    a, b, a_scale, b_scale, y = _operands(fmt, mm)
    tok, wt = _routing(mm, slots, distinct=True)
    bias = torch.randn(E, N, device="cuda") * 8
    bufs = [torch.empty(slots // world, N, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    for t in bufs:
        t.view(torch.int16).fill_(BF16_NAN)
    peers = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64, device="cuda")
    _, err = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=a_scale, b_scale=b_scale, expected_m=40,
                                              combine=Combine(tok, wt, bufs[0], None, peers, bias))
    torch.cuda.synchronize()
    assert int(err.item()) == 0
    recv = torch.cat(bufs)  # destination owner * R + row is row owner * R + row here
    ref, mag, count = _per_token(y, bias, tok, wt, mm, slots)
    sent = count[:, 0] > 0
    assert (recv[~sent].view(torch.int16) == BF16_NAN).all(), "a row, or columns >= N, written where none was sent"
    assert count.max() == 1
    exact = torch.empty(slots, N, device="cuda", dtype=torch.bfloat16)
    for e, m in enumerate(mm.clamp(0, MAX_M).tolist()):
        rows = y[e, :m].float()  # exact in bf16 and fp32
        exact[tok[e, :m].long()] = ((rows + bias[e]) * wt[e, :m, None]).to(torch.bfloat16)
    assert torch.equal(recv[sent].view(torch.int16), exact[sent].view(torch.int16))
    bound = BF16_ULP * mag[sent] + 2 * F32_ULP * mag[sent]
    assert ((recv[sent].double() - ref[sent]).abs() <= bound).all()
