"""MXFP4 weights on the host (CPU): quantization against an independent
float64 model of the OCP rule, the gpt-oss checkpoint layout, and the exact
conversion to e4m3 with 128x128 fp32 scales."""

import math

import pytest
import torch

from flashgemm.mxfp4 import dequantize_mxfp4, from_checkpoint, quantize_mxfp4, to_fp8_blockwise

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
LUT = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)  # gpt-oss's FP4_VALUES order


def _reference_codes(w: torch.Tensor) -> tuple:
    """The OCP MX rule, value by value in float64: e = floor(log2(amax)) - 2
    per 32-block, then the nearest e2m1 magnitude (ties to the even code),
    saturating at 6; the sign kept except on zero."""
    blocks = w.double().unflatten(-1, (-1, 32))
    codes = torch.zeros(blocks.shape, dtype=torch.int64)
    exps = torch.zeros(blocks.shape[:-1], dtype=torch.int64)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in blocks.shape[:-1]]).tolist():
        idx = tuple(idx) if isinstance(idx, list) else (idx,)
        block = blocks[idx]
        amax = float(block.abs().max())
        e = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - 2))
        exps[idx] = e
        for j, x in enumerate(block.tolist()):
            a = abs(x) / 2.0 ** e
            best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c % 2))  # nearest, ties to even code
            codes[idx + (j,)] = best | (8 if x < 0 and best else 0)
    return codes.flatten(-2), exps


def test_quantize_follows_the_ocp_rule():
    torch.manual_seed(0)
    w = torch.randn(3, 5, 64) * torch.logspace(-3, 3, 5).view(1, 5, 1)
    w[0, 0, :32] = 0.0  # an all-zero block
    w[1, 2, 5] = 6.0 * 2.0 ** 3  # an exact top value
    packed, scales = quantize_mxfp4(w)
    codes, exps = _reference_codes(w)
    assert packed.dtype == scales.dtype == torch.uint8
    assert packed.shape == (3, 5, 32) and scales.shape == (3, 5, 2)
    assert torch.equal(scales.to(torch.int64) - 127, exps)
    got = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).to(torch.int64)
    assert torch.equal(got, codes)


def test_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (2, 4, 96), generator=g)
    exps = torch.randint(-20, 20, (2, 4, 3), generator=g)
    codes[..., ::32] = 7  # each block holds +6: its amax fixes the exponent
    w = LUT[codes] * torch.pow(2.0, exps.double()).repeat_interleave(32, dim=-1)
    packed, scales = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(packed, scales).double(), w)


def test_non_finite_block_gets_the_nan_scale():
    w = torch.ones(1, 64)
    w[0, 40] = float("inf")
    _, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[125, 255]]  # 1.0 -> 2**(0 - 2); the block with inf: NaN
    assert torch.isnan(dequantize_mxfp4(*quantize_mxfp4(w))[0, 32:]).all()


def test_checkpoint_layout_is_gpt_oss():
    """gpt-oss: blocks [.., N, K/32, 16], low nibble = even column, value
    = FP4_VALUES[code] * 2**(scale - 127) (its loaders' ldexp)."""
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), generator=g, dtype=torch.uint8)
    raw = torch.randint(110, 140, (2, 3, 4), generator=g, dtype=torch.uint8)
    lo, hi = LUT[(blocks & 15).long()], LUT[(blocks >> 4).long()]
    expect = torch.stack([lo, hi], dim=-1).flatten(-2) * torch.pow(2.0, raw.double() - 127).unsqueeze(-1)
    packed, scales = from_checkpoint(blocks, raw)
    assert packed.shape == (2, 3, 64) and packed.data_ptr() == blocks.data_ptr()
    assert torch.equal(dequantize_mxfp4(packed, scales).double(), expect.flatten(-2))


@pytest.mark.parametrize("n, k", [(256, 256), (2880, 2880 // 10 * 2), (130, 96)])
def test_fp8_blockwise_is_exact_within_the_span(n, k):
    g = torch.Generator().manual_seed(n + k)
    # row exponents in [-5, 5], and a 32-value randn block's amax in [0.5, 8) (outside with
    # probability < 1e-12): each 128x128 block's exponents span at most 13
    w = torch.randn(2, n, k, generator=g) * torch.pow(2.0, torch.randint(-5, 6, (2, n, 1), generator=g).double())
    packed, scales = quantize_mxfp4(w)
    q, s = to_fp8_blockwise(packed, scales)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, n, k)
    assert s.dtype == torch.float32 and s.shape == (2, -(-n // 128), -(-k // 128))
    full = s.double().repeat_interleave(128, dim=1)[:, :n].repeat_interleave(128, dim=2)[:, :, :k]
    assert torch.equal(q.double() * full, dequantize_mxfp4(packed, scales).double())


def test_fp8_blockwise_refuses_a_span_it_cannot_hold_and_nan():
    packed = torch.full((1, 128, 64), 0x22, dtype=torch.uint8)  # every value 1.0
    scales = torch.full((1, 128, 4), 127, dtype=torch.uint8)
    scales[0, 5, 2] = 127 - 14
    to_fp8_blockwise(packed, scales)  # a span of 14: exact
    scales[0, 5, 2] = 127 - 15
    with pytest.raises(ValueError, match=r"block \(expert, row block, column block\) \(0, 0, 0\) holds E8M0 "
                                         r"exponents 15 apart, more than the 14"):
        to_fp8_blockwise(packed, scales)
    scales[0, 5, 2] = 255
    with pytest.raises(ValueError, match=r"E8M0 NaN \(255\) at \(expert, row, group\) \(0, 5, 2\)"):
        to_fp8_blockwise(packed, scales)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(4, 48))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_mxfp4(torch.ones(4, 64, dtype=torch.int32))
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\)"):
        dequantize_mxfp4(packed, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="E8M0 bytes"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[\.\.\., N, K/32, 16\]"):
        from_checkpoint(torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


def test_blackwell_weights_keep_the_bytes_and_block_the_scales():
    """Blackwell's MXFP4 kernel reads the packed bytes as they are and the
    exponents in the 128x4-atom layout; the reference dequantizes both the
    way the checkpoint's loaders do."""
    from flashgemm.blockscale import (
        from_blocked_scales, grouped_gemm_nt_masked_blockscaled_ref, quantize_mxfp8, to_blocked_scales,
    )
    from flashgemm.mxfp4 import blackwell_weights

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 136, 8, 16), generator=g, dtype=torch.uint8)  # N = 136, K = 256
    raw = torch.randint(110, 140, (2, 136, 8), generator=g, dtype=torch.uint8)
    packed, scales = from_checkpoint(blocks, raw)
    b, b_scale = blackwell_weights(packed.view(torch.float4_e2m1fn_x2), scales)
    assert b.dtype == torch.uint8 and torch.equal(b, packed) and b.is_contiguous()  # (K = 256: no padding)
    assert tuple(b_scale.shape) == (2, 2, 2, 32, 4, 4)
    assert torch.equal(from_blocked_scales(b_scale, 136, 8), scales)
    # the reference of fmt="mxfp8_mxfp4": MXFP8 a times the checkpoint's values
    a, sa = quantize_mxfp8(torch.randn(2, 5, 256, generator=g))
    masked_m = torch.tensor([5, 2], dtype=torch.int32)
    ref = grouped_gemm_nt_masked_blockscaled_ref(a, sa, b, scales, masked_m, fmt="mxfp8_mxfp4")
    a_f = a.double() * torch.pow(2.0, sa.double() - 127).repeat_interleave(32, dim=-1)
    w_f = dequantize_mxfp4(packed, scales).double()
    for e, m in enumerate((5, 2)):
        assert torch.allclose(ref[e, :m].double(), a_f[e, :m] @ w_f[e].T, rtol=1e-6, atol=1e-30)
        assert not ref[e, m:].any()
    # K = 2880 (gpt-oss): rows of 1440 bytes padded with zero codes to 1472, the exponents as for 2880
    packed, scales = quantize_mxfp4(torch.randn(2, 8, 2880, generator=g))
    b, b_scale = blackwell_weights(packed, scales)
    assert b.shape == (2, 8, 1472) and torch.equal(b[..., :1440], packed) and not b[..., 1440:].any()
    assert torch.equal(b_scale, to_blocked_scales(scales))
