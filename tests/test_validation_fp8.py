"""Host-side checks of the block-scaled fp8 arguments (CPU only).

Every error names the argument and what was expected, and is raised before any
launch: validate_args reads metadata only, so CPU tensors drive every check.
"""

import pytest
import torch

from flashgemm.validation import tma_ready_a_scale, validate_args

FP8 = torch.float8_e4m3fn
E, M, N, K = 3, 40, 272, 2880  # K has a partial last 128-block; N is not a multiple of 128
KB, NB = -(-K // 128), -(-N // 128)


def fp8(*shape):
    return torch.randn(*shape).clamp(-400, 400).to(FP8)


def m_major_scales(e=E, m=M, kb=KB):
    """(E, M, KB) view with M contiguous and 16-byte-aligned K-block stride."""
    m_pad = -(-m // 4) * 4
    return torch.rand(e, kb, m_pad).transpose(1, 2)[:, :m]


def make(**over):
    args = dict(
        a=fp8(E, M, K),
        b=fp8(E, N, K),
        out=torch.empty(E, M, N, dtype=torch.bfloat16),
        masked_m=torch.full((E,), M, dtype=torch.int32),
        a_scale=m_major_scales(),
        b_scale=torch.rand(E, NB, KB),
    )
    args.update(over)
    return args


def check(**over):
    args = make(**over)
    return validate_args(args["a"], args["b"], args["out"], args["masked_m"], args["a_scale"], args["b_scale"])


def test_valid_fp8_both_scale_layouts():
    assert check() == (E, M, N, K)
    assert check(a_scale=torch.rand(E, M, KB)) == (E, M, N, K)  # K-block contiguous


def test_fp8_needs_both_scales():
    with pytest.raises(ValueError, match="need a_scale"):
        check(a_scale=None)
    with pytest.raises(ValueError, match="need b_scale"):
        check(b_scale=None)


def test_scales_with_bf16_operands_rejected():
    bf = dict(
        a=torch.randn(E, M, K).to(torch.bfloat16),
        b=torch.randn(E, N, K).to(torch.bfloat16),
    )
    with pytest.raises(ValueError, match="a_scale is only for float8_e4m3fn"):
        check(**bf)
    with pytest.raises(ValueError, match="b_scale is only for float8_e4m3fn"):
        check(a_scale=None, **bf)


def test_mixed_operand_dtypes_rejected():
    with pytest.raises(TypeError, match="a and b must have the same dtype"):
        check(b=torch.randn(E, N, K).to(torch.bfloat16))
    with pytest.raises(TypeError, match="a and b must have the same dtype"):
        check(a=torch.randn(E, M, K).to(torch.bfloat16))


@pytest.mark.parametrize("name", ["a_scale", "b_scale"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_scale_dtype_must_be_float32(name, dtype):
    t = make()[name].to(dtype)
    with pytest.raises(TypeError, match=f"{name} must have dtype torch.float32"):
        check(**{name: t})


@pytest.mark.parametrize(
    "shape, match",
    [
        ((E, M, KB - 1), r"a_scale must have shape \(E, max_m, ceil\(K/128\)\)"),
        ((E, M + 1, KB), r"a_scale must have shape"),
        ((E - 1, M, KB), r"a_scale must have shape"),
        ((E, M), r"a_scale must have rank 3"),
    ],
)
def test_a_scale_shape(shape, match):
    with pytest.raises(ValueError, match=match):
        check(a_scale=torch.rand(*shape))


@pytest.mark.parametrize(
    "shape, match",
    [
        ((E, NB + 1, KB), r"b_scale must have shape \(E, ceil\(N/128\), ceil\(K/128\)\)"),
        ((E, NB, KB + 1), r"b_scale must have shape"),
        ((E, N, KB), r"b_scale must have shape"),  # per-row weight scales: wrong recipe
        ((NB, KB), r"b_scale must have rank 3"),
    ],
)
def test_b_scale_shape(shape, match):
    with pytest.raises(ValueError, match=match):
        check(b_scale=torch.rand(*shape))


def test_a_scale_layout_neither_accepted():
    # expert-contiguous: neither M nor the K blocks has stride 1
    odd = torch.rand(M, KB, E).permute(2, 0, 1)
    assert odd.stride(1) != 1 and odd.stride(2) != 1
    with pytest.raises(ValueError, match="a_scale must be contiguous along M .* or along the K blocks"):
        check(a_scale=odd)


@pytest.mark.parametrize("k", [8, 24, 2888])
def test_fp8_k_multiple_of_16(k):
    kb = -(-k // 128)
    with pytest.raises(ValueError, match="K .* multiple of 16"):
        check(a=fp8(E, M, k), b=fp8(E, N, k), a_scale=m_major_scales(kb=kb), b_scale=torch.rand(E, NB, kb))


@pytest.mark.parametrize("n", [8, 264])
def test_fp8_n_multiple_of_16(n):
    nb = -(-n // 128)
    with pytest.raises(ValueError, match="N .* multiple of 16"):
        check(b=fp8(E, n, K), out=torch.empty(E, M, n, dtype=torch.bfloat16), b_scale=torch.rand(E, nb, KB))


def test_fp8_out_must_be_bf16():
    with pytest.raises(TypeError, match="out must have dtype torch.bfloat16"):
        check(out=torch.empty(E, M, N, dtype=FP8))


def test_out_overlapping_a_scale_rejected():
    # out and a_scale carved from one buffer
    buf = torch.empty(E * M * N * 2 + 64, dtype=torch.uint8)
    out = buf[: E * M * N * 2].view(torch.bfloat16).view(E, M, N)
    a_scale = out.view(torch.uint8).view(-1)[: E * M * KB * 4].view(torch.float32).view(E, M, KB)
    with pytest.raises(ValueError, match="out must not overlap a_scale"):
        check(out=out, a_scale=a_scale)


def test_tma_ready_a_scale_zero_copy_and_copy_paths():
    fast = m_major_scales()
    assert tma_ready_a_scale(fast) is fast  # the dispatch layout: no copy
    for slow in (torch.rand(E, M, KB), torch.rand(E, KB, M + 1).transpose(1, 2)[:, :M]):
        got = tma_ready_a_scale(slow)
        assert got is not slow and torch.equal(got, slow)
        st = got.stride()
        assert st[1] == 1 and st[0] % 4 == 0 and st[2] % 4 == 0 and got.data_ptr() % 16 == 0


def test_b_scale_k_stride_fits_32_bit_offsets():
    # the kernel steps through a block's weight scales over K with 32-bit
    # offsets; a view that strides 2**28 floats between K blocks (a meta
    # tensor: nothing is allocated) would overflow them
    far = torch.empty_strided((E, NB, KB), (NB, 1, 2**28), device="meta")
    with pytest.raises(ValueError, match=r"b_scale's stride along the K blocks is too large"):
        check(b_scale=far)
    near = torch.empty_strided((E, NB, KB), (NB, 1, 2**31 // KB), device="meta")
    assert check(b_scale=near) == (E, M, N, K)
