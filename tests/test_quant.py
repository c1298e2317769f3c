"""Block-scaled fp8 quantization helpers and the fp8 torch reference (CPU only).

Fresh random data every run (the ``seed`` fixture prints the seed to replay a
failure). The helpers are checked against a plain per-block loop, for their
error bounds, for the m-major scale layout, and for the corner cases: partial
edge blocks, all-zero blocks, power-of-two scales and values at the e4m3 limit.
"""

import math

import pytest
import torch

from flashgemm.quant import (
    FP8_BLOCK,
    FP8_E4M3_MAX,
    dequantize_fp8_per_block,
    dequantize_fp8_per_token,
    quantize_fp8_per_block,
    quantize_fp8_per_token,
)
from flashgemm.reference import grouped_gemm_nt_masked_ref, similarity

FP8 = torch.float8_e4m3fn


def cdiv(a, b):
    return -(-a // b)


def bits(t):
    """fp8 tensor as raw bytes, for exact comparisons."""
    return t.view(torch.uint8)


def is_nan_fp8(t):
    # e4m3fn has no infinities; S.1111.111 is its only NaN
    return (bits(t) & 0x7F) == 0x7F


def per_token_amax(x):
    """[..., M, KB] amax of each 1x128 block (loop-free, zero-padded)."""
    k = x.shape[-1]
    xp = torch.nn.functional.pad(x.float().abs(), (0, cdiv(k, FP8_BLOCK) * FP8_BLOCK - k))
    return xp.unflatten(-1, (-1, FP8_BLOCK)).amax(-1)


def per_block_amax(w):
    """[..., NB, KB] amax of each 128x128 block (loop-free, zero-padded)."""
    n, k = w.shape[-2:]
    pad = (0, cdiv(k, FP8_BLOCK) * FP8_BLOCK - k, 0, cdiv(n, FP8_BLOCK) * FP8_BLOCK - n)
    wp = torch.nn.functional.pad(w.float().abs(), pad)
    return wp.unflatten(-1, (-1, FP8_BLOCK)).unflatten(-3, (-1, FP8_BLOCK)).amax(dim=(-3, -1))


def expand_token(s, k):
    return s.repeat_interleave(FP8_BLOCK, -1)[..., :k]


def expand_block(s, n, k):
    return s.repeat_interleave(FP8_BLOCK, -2)[..., :n, :].repeat_interleave(FP8_BLOCK, -1)[..., :k]


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize("k", [128, 2880, 7168, 100])
@pytest.mark.parametrize("m_major", [True, False])
def test_per_token_shapes(seed, k, m_major):
    x = torch.randn(2, 5, k, dtype=torch.bfloat16)
    q, s = quantize_fp8_per_token(x, m_major=m_major)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (2, 5, cdiv(k, 128))


@pytest.mark.parametrize("k", [128, 2880, 7168, 100])
@pytest.mark.parametrize("n", [128, 4096, 200])
def test_per_block_shapes(seed, n, k):
    w = torch.randn(n, k, dtype=torch.bfloat16)
    q, s = quantize_fp8_per_block(w)
    assert q.dtype == FP8 and q.shape == (n, k) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (cdiv(n, 128), cdiv(k, 128)) and s.is_contiguous()


def test_batched_per_block_shapes(seed):
    q, s = quantize_fp8_per_block(torch.randn(2, 3, 200, 300))
    assert q.shape == (2, 3, 200, 300) and s.shape == (2, 3, 2, 3) and s.is_contiguous()


# ---------------------------------------------------------------- m-major layout


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
@pytest.mark.parametrize("m", [1, 5, 64, 130])
def test_m_major_layout(seed, batch, m):
    k = 300  # 3 K-blocks, the last partial
    x = torch.randn(*batch, m, k)
    q, s = quantize_fp8_per_token(x)  # m_major=True is the default
    q_ref, s_ref = quantize_fp8_per_token(x, m_major=False)
    assert s.shape == (*batch, m, 3)
    assert s.stride(-2) == 1  # M contiguous
    assert s.stride(-1) % 4 == 0 and s.stride(-1) >= m  # 16-byte-aligned K-block stride
    assert all(st % 4 == 0 for st in s.stride()[:-2])  # batch strides too
    assert s.data_ptr() % 16 == 0
    assert s_ref.is_contiguous() and s_ref.shape == s.shape
    assert torch.equal(s, s_ref)
    assert torch.equal(bits(q), bits(q_ref))


def test_m_major_empty_m():
    q, s = quantize_fp8_per_token(torch.zeros(2, 0, 300))
    assert q.shape == (2, 0, 300) and s.shape == (2, 0, 3)


# ---------------------------------------------------------------- loop reference


def loop_per_token(x, power_of_two):
    """The recipe written out block by block (one row at a time)."""
    *batch, m, k = x.shape
    xf = x.float().reshape(-1, m, k)
    scales = torch.empty(xf.shape[0], m, cdiv(k, FP8_BLOCK))
    q = torch.empty(xf.shape, dtype=FP8)
    for b in range(xf.shape[0]):
        for i in range(m):
            for j in range(scales.shape[-1]):
                cols = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
                blk = xf[b, i, cols]
                s = blk.abs().max().clamp(min=1e-10) / FP8_E4M3_MAX
                if power_of_two:
                    s = torch.tensor(2.0 ** math.ceil(math.log2(s.item())))
                scales[b, i, j] = s
                q[b, i, cols] = (blk / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    return q.reshape(x.shape), scales.reshape(*batch, m, -1)


def loop_per_block(w, power_of_two):
    *batch, n, k = w.shape
    wf = w.float().reshape(-1, n, k)
    scales = torch.empty(wf.shape[0], cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))
    q = torch.empty(wf.shape, dtype=FP8)
    for b in range(wf.shape[0]):
        for i in range(scales.shape[-2]):
            for j in range(scales.shape[-1]):
                rows = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK)
                cols = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
                blk = wf[b, rows, cols]
                s = blk.abs().max().clamp(min=1e-10) / FP8_E4M3_MAX
                if power_of_two:
                    s = torch.tensor(2.0 ** math.ceil(math.log2(s.item())))
                scales[b, i, j] = s
                q[b, rows, cols] = (blk / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    return q.reshape(w.shape), scales.reshape(*batch, *scales.shape[-2:])


@pytest.mark.parametrize("power_of_two", [False, True])
def test_per_token_matches_loop(seed, power_of_two):
    x = torch.randn(2, 7, 300, dtype=torch.bfloat16) * torch.rand(2, 7, 1).mul(8).exp2().to(torch.bfloat16)
    x[0, 3, 128:256] = 0  # an all-zero block
    x[1, 2, 5] = 1000.0  # an outlier that sets its block's scale
    q, s = quantize_fp8_per_token(x, power_of_two=power_of_two)
    q_ref, s_ref = loop_per_token(x, power_of_two)
    assert torch.equal(s, s_ref)
    assert torch.equal(bits(q), bits(q_ref))


@pytest.mark.parametrize("power_of_two", [False, True])
def test_per_block_matches_loop(seed, power_of_two):
    w = torch.randn(2, 200, 300, dtype=torch.bfloat16)
    w[1, 128:, :128] = 0  # an all-zero (partial) block
    w[0, 150, 260] = -3000.0  # an outlier in the corner block
    q, s = quantize_fp8_per_block(w, power_of_two=power_of_two)
    q_ref, s_ref = loop_per_block(w, power_of_two)
    assert torch.equal(s, s_ref)
    assert torch.equal(bits(q), bits(q_ref))


# ---------------------------------------------------------------- error bounds


@pytest.mark.parametrize("power_of_two", [False, True])
def test_per_token_round_trip_error(seed, power_of_two):
    k = 1000  # partial last block
    # rows spanning many magnitudes, so the scales (not one global range) do the work
    x = torch.randn(4, 64, k) * torch.randn(4, 64, 1).mul(6).exp2()
    q, s = quantize_fp8_per_token(x, power_of_two=power_of_two)
    dq = dequantize_fp8_per_token(q, s)
    assert dq.dtype == torch.float32 and dq.shape == x.shape
    err = (dq - x).abs()
    # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of itself
    # (+ half the subnormal step, 2**-10 in scaled units)
    assert (err <= x.abs() / 16 + expand_token(s, k) * 2**-10 + 1e-6 * x.abs()).all()
    block_err = per_token_amax(dq - x) / per_token_amax(x)
    assert block_err.max() <= 1 / 16 + 1e-6
    assert ((dq - x).norm() / x.norm()).item() < 0.05


@pytest.mark.parametrize("power_of_two", [False, True])
def test_per_block_round_trip_error(seed, power_of_two):
    n, k = 300, 400
    w = torch.randn(3, n, k) * torch.randn(3, 1, k).mul(4).exp2()
    q, s = quantize_fp8_per_block(w, power_of_two=power_of_two)
    dq = dequantize_fp8_per_block(q, s)
    assert dq.dtype == torch.float32 and dq.shape == w.shape
    err = (dq - w).abs()
    assert (err <= w.abs() / 16 + expand_block(s, n, k) * 2**-10 + 1e-6 * w.abs()).all()
    block_err = per_block_amax(dq - w) / per_block_amax(w)
    assert block_err.max() <= 1 / 16 + 1e-6
    assert ((dq - w).norm() / w.norm()).item() < 0.05


def test_dequantize_accepts_any_scale_strides(seed):
    x = torch.randn(3, 37, 300)
    q, s = quantize_fp8_per_token(x)  # m-major view
    assert torch.equal(dequantize_fp8_per_token(q, s), dequantize_fp8_per_token(q, s.contiguous()))
    w = torch.randn(2, 200, 300)
    qw, sw = quantize_fp8_per_block(w)
    sw_t = sw.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, K-block-major storage
    assert not sw_t.is_contiguous()
    assert torch.equal(dequantize_fp8_per_block(qw, sw_t), dequantize_fp8_per_block(qw, sw))
    # and the expansion is the exact product fp8 * scale
    assert torch.equal(dequantize_fp8_per_block(qw, sw), qw.float() * expand_block(sw, 200, 300))


# ---------------------------------------------------------------- scales


def test_scale_is_block_amax_over_448(seed):
    x = torch.randn(3, 20, 700)
    _, s = quantize_fp8_per_token(x)
    assert torch.equal(s, per_token_amax(x) / FP8_E4M3_MAX)


@pytest.mark.parametrize("per_block", [False, True])
def test_power_of_two_scales(seed, per_block):
    x = torch.randn(2, 150, 300) * torch.randn(2, 150, 1).mul(10).exp2()
    if per_block:
        _, s = quantize_fp8_per_block(x, power_of_two=True)
        _, exact = quantize_fp8_per_block(x)
    else:
        _, s = quantize_fp8_per_token(x, power_of_two=True)
        _, exact = quantize_fp8_per_token(x)
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()  # exact powers of two
    assert (s >= exact).all() and (s < 2 * exact).all()  # the smallest one that fits


def test_power_of_two_just_above_a_power():
    # amax / 448 one float32 ulp above 2**-10: float32 log2 rounds that to
    # exactly -10, so a log2/ceil implementation picks 2**-10 (too small)
    amax = 0.4375 + 2**-25
    assert torch.tensor(amax) / 448 > 2**-10
    x = torch.zeros(1, 128)
    x[0, 7] = amax
    q, s = quantize_fp8_per_token(x, power_of_two=True)
    assert s.item() == 2**-9
    qb, sb = quantize_fp8_per_block(x, power_of_two=True)
    assert sb.item() == 2**-9
    assert dequantize_fp8_per_token(q, s)[0, 7].item() == pytest.approx(amax, rel=1 / 16)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_all_zero_blocks(seed, power_of_two):
    x = torch.randn(2, 6, 300)
    x[0] = 0  # whole rows
    x[1, :, 128:256] = 0  # one block column
    q, s = quantize_fp8_per_token(x, power_of_two=power_of_two)
    assert torch.isfinite(s).all() and (s > 0).all()
    dq = dequantize_fp8_per_token(q, s)
    assert (dq[0] == 0).all() and (dq[1, :, 128:256] == 0).all()
    assert (dq[1, :, :128] != 0).any()

    w = torch.randn(200, 300)
    w[:128, 128:256] = 0
    qw, sw = quantize_fp8_per_block(w, power_of_two=power_of_two)
    assert torch.isfinite(sw).all() and (sw > 0).all()
    assert (dequantize_fp8_per_block(qw, sw)[:128, 128:256] == 0).all()

    qz, sz = quantize_fp8_per_block(torch.zeros(130, 130), power_of_two=power_of_two)
    assert torch.isfinite(sz).all() and (dequantize_fp8_per_block(qz, sz) == 0).all()


# ---------------------------------------------------------------- saturation


@pytest.fixture
def strict_fp8_cast(monkeypatch):
    """Make every cast to float8_e4m3fn fail on values beyond +-448 (NaN and
    inf included). torch's CPU cast saturates them to 448 silently, while
    the CUDA cast makes NaN of them, so the helpers must clamp first."""
    original = torch.Tensor.to
    seen = []

    def to(self, *args, **kwargs):
        if FP8 in args or kwargs.get("dtype") is FP8:
            assert not self.isnan().any(), "NaN cast to fp8"
            peak = self.abs().max().item() if self.numel() else 0.0
            assert peak <= FP8_E4M3_MAX, f"{peak} cast to fp8 (beyond the e4m3 range)"
            seen.append(peak)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return seen


@pytest.mark.parametrize("power_of_two", [False, True])
def test_no_value_beyond_448_before_the_cast(seed, strict_fp8_cast, power_of_two):
    x = torch.rand(8, 64, 512) * 10
    # amax / (amax / 448) rounds to 448 + 2**-15 in float32 for this amax (and for
    # ~9% of random ones)
    x[0, 0, 0] = 9.405658721923828
    x[1, 0, 0] = 0.4375 + 2**-25  # the power-of-two edge case
    x[2, 0] = 1e30  # huge, still finite
    q, s = quantize_fp8_per_token(x, power_of_two=power_of_two)
    qw, sw = quantize_fp8_per_block(x, power_of_two=power_of_two)
    assert len(strict_fp8_cast) >= 2
    for qq in (q, qw):
        assert not is_nan_fp8(qq).any()
        assert qq.float().abs().max() <= FP8_E4M3_MAX
    assert torch.isfinite(s).all() and torch.isfinite(sw).all()


# ---------------------------------------------------------------- fp8 reference


def test_fp8_reference(seed):
    e_count, max_m, n, k = 4, 40, 200, 300  # partial blocks along M, N and K
    a = torch.randn(e_count, max_m, k, dtype=torch.bfloat16)
    b = (torch.randn(e_count, n, k) / k**0.5).to(torch.bfloat16)
    masked_m = torch.tensor([0, 17, max_m, max_m + 9], dtype=torch.int32)  # last one clamps
    a8, a_scale = quantize_fp8_per_token(a)
    b8, b_scale = quantize_fp8_per_block(b)
    ref = grouped_gemm_nt_masked_ref(a8, b8, masked_m, a_scale=a_scale, b_scale=b_scale)
    assert ref.dtype == torch.float32 and ref.shape == (e_count, max_m, n)

    a_dq = dequantize_fp8_per_token(a8, a_scale)
    b_dq = dequantize_fp8_per_block(b8, b_scale)
    for e, m in enumerate(masked_m.clamp(max=max_m).tolist()):
        expect = a_dq[e, :m] @ b_dq[e].T
        torch.testing.assert_close(ref[e, :m], expect, rtol=1e-5, atol=1e-5)
        assert (ref[e, m:] == 0).all()
        if m:
            exact = a[e, :m].double() @ b[e].double().T
            assert similarity(ref[e, :m], exact) < 1e-3

    # rows past m_e come from ``out`` when it is given
    out = torch.full((e_count, max_m, n), 7.0, dtype=torch.bfloat16)
    ref_out = grouped_gemm_nt_masked_ref(a8, b8, masked_m, out, a_scale=a_scale, b_scale=b_scale)
    assert (ref_out[1, 17:] == 7.0).all() and (ref_out[0] == 7.0).all()
    assert torch.equal(ref_out[1, :17], ref[1, :17])


def test_fp8_reference_with_power_of_two_and_k_major_scales(seed):
    a = torch.randn(2, 24, 256, dtype=torch.bfloat16)
    b = torch.randn(2, 136, 256, dtype=torch.bfloat16)
    masked_m = torch.tensor([24, 11])
    a8, sa = quantize_fp8_per_token(a, power_of_two=True, m_major=False)
    b8, sb = quantize_fp8_per_block(b, power_of_two=True)
    ref = grouped_gemm_nt_masked_ref(a8, b8, masked_m, a_scale=sa, b_scale=sb)
    for e, m in enumerate(masked_m.tolist()):
        assert similarity(ref[e, :m], a[e, :m].double() @ b[e].double().T) < 1e-3


def test_fp8_reference_needs_both_scales(seed):
    a8, sa = quantize_fp8_per_token(torch.randn(1, 8, 128))
    b8, sb = quantize_fp8_per_block(torch.randn(1, 128, 128))
    m = torch.tensor([8])
    with pytest.raises(ValueError):
        grouped_gemm_nt_masked_ref(a8, b8, m, a_scale=sa)
    with pytest.raises(ValueError):
        grouped_gemm_nt_masked_ref(a8, b8, m, b_scale=sb)


def test_scales_with_bf16_operands_rejected(seed):
    a = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    b = torch.randn(1, 128, 128, dtype=torch.bfloat16)
    m = torch.tensor([8])
    sa, sb = torch.ones(1, 8, 1), torch.ones(1, 1, 1)
    for kwargs in (dict(a_scale=sa), dict(b_scale=sb), dict(a_scale=sa, b_scale=sb)):
        with pytest.raises(ValueError):
            grouped_gemm_nt_masked_ref(a, b, m, **kwargs)
    # and without scales bf16 keeps working as before
    ref = grouped_gemm_nt_masked_ref(a, b, m)
    torch.testing.assert_close(ref[0], a[0].float() @ b[0].float().T)


def test_similarity(seed):
    x = torch.randn(64, 96)
    assert isinstance(similarity(x, x), float)
    assert abs(similarity(x, x)) < 1e-12
    assert abs(similarity(x, -x) - 2.0) < 1e-12
    assert similarity(x, 2 * x) == pytest.approx(0.2, abs=1e-12)  # 1 - 2*2/(1+4)
    assert similarity(x, x + 1e-3 * torch.randn_like(x)) < 1e-5
