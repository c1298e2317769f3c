"""gpt-oss's expert layer on the CPU: its activation kernel's build (PTX
checked), the argument checks before any launch and the activation's torch
reference (the down biases ride in the fused combine: test_combine_bias.py)."""

import re

import pytest
import torch

from flashgemm import Combine
from flashgemm.moe.activation import ActivationKind, build, gpt_oss_swiglu, gpt_oss_swiglu_ref
from flashgemm.moe.gpt_oss import clamped_swiglu
from flashgemm.moe.gpt_oss_experts import GptOssExperts
from flashgemm.quant import dequantize_fp8_per_token


@pytest.fixture(scope="module")
def gpt_oss_ptx():
    return {fp8: build(fp8, "sm_90a", keep_ptx=True, kind=ActivationKind.GPT_OSS).__ptx__ for fp8 in (True, False)}


def test_gpt_oss_activation_ptx(gpt_oss_ptx):
    for fp8, ptx in gpt_oss_ptx.items():
        # 16 interleaved gate_up values (32 bytes) and their 16 fp32 biases (64 bytes) per lane
        assert len(re.findall(r"ld\.global(?:\.nc)?\.v4\.b32", ptx)) >= 6
        assert ".local" not in ptx
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global.b32")  # masked_m read after the wait
        # the clamps: gate capped above, up clamped on both sides, 8 values a lane
        assert len(re.findall(r"\bmin(?:\.ftz)?\.f32", ptx)) >= 16
        assert len(re.findall(r"\bmax(?:\.ftz)?\.f32", ptx)) >= 8
        assert "ex2.approx" in ptx  # the sigmoid
    assert "cvt.rn.satfinite.e4m3x2.f32" in gpt_oss_ptx[True] and "shfl.sync.bfly" in gpt_oss_ptx[True]
    assert "e4m3" not in gpt_oss_ptx[False]


def test_gpt_oss_swiglu_checks_before_launch():
    gu = torch.randn(2, 4, 2 * 64).to(torch.bfloat16)
    bias = torch.randn(2, 2 * 64)
    mm = torch.tensor([4, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="bias"):
        gpt_oss_swiglu(gu, bias.double(), mm)
    with pytest.raises(ValueError, match=r"bias must be a contiguous, 16-byte-aligned float32 \[E, 2I\]"):
        gpt_oss_swiglu(gu, bias[:, :64], mm)
    with pytest.raises(ValueError, match="multiple of 16"):  # fp8 h: 16-byte rows
        gpt_oss_swiglu(gu[..., :2 * 24], bias[:, :2 * 24].contiguous(), mm)
    with pytest.raises(ValueError, match="multiple of 8"):
        gpt_oss_swiglu(gu[..., :2 * 12], bias[:, :2 * 12].contiguous(), mm, fp8=False)
    with pytest.raises(ValueError, match="masked_m must have E=2"):
        gpt_oss_swiglu(gu, bias, mm[:1])
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        gpt_oss_swiglu(gu, bias, mm)  # (every other check passed: a CPU tensor is the last thing refused)


def test_gpt_oss_swiglu_ref_partial_scale_block():
    """I = 200: one 128-column block and one of 72, each with its own scale."""
    g = torch.Generator().manual_seed(0)
    gu = (4 * torch.randn(3, 5, 400, generator=g)).to(torch.bfloat16)
    bias = torch.randn(3, 400, generator=g)
    mm = torch.tensor([5, 0, -2], dtype=torch.int32)
    h = gpt_oss_swiglu_ref(gu, bias, mm, fp8=False).float()
    want = clamped_swiglu(gu.float() + bias[:, None, :])
    assert torch.equal(h[0], want[0].to(torch.bfloat16).float())
    assert not h[1:].any()  # rows past m_e (none valid in experts 1 and 2) are zero
    q, s = gpt_oss_swiglu_ref(gu, bias, mm, fp8=True)
    assert s.shape == (3, 5, 2)
    assert torch.allclose(s[0, :, 1], want[0, :, 128:].abs().amax(-1) / 448)
    back = dequantize_fp8_per_token(q, s)[0]
    assert torch.all((back - want[0]).abs() <= want[0].abs() / 16 + s[0].repeat_interleave(128, 1)[:, :200] / 512)


def _weights(e=2, hidden=64, inter=32, mxfp4=False):
    if mxfp4:
        w13 = torch.zeros(e, 2 * inter, hidden // 2, dtype=torch.int8)
        w2 = torch.zeros(e, hidden, inter // 2, dtype=torch.int8)
        return w13, w2, dict(w13_scale=torch.zeros(e, 2 * inter, hidden // 32, dtype=torch.uint8),
                             w2_scale=torch.zeros(e, hidden, inter // 32, dtype=torch.uint8))
    return (torch.zeros(e, 2 * inter, hidden, dtype=torch.bfloat16),
            torch.zeros(e, hidden, inter, dtype=torch.bfloat16), {})


def test_gpt_oss_experts_checks_its_arguments():
    w13, w2, _ = _weights()
    b13, b2 = torch.zeros(2, 64), torch.zeros(2, 64)
    layer = GptOssExperts(w13, b13, w2, b2)
    assert (layer.num_experts, layer.hidden, layer.intermediate) == (2, 64, 32) and layer.b2.dtype == torch.float32
    m13, m2, scales = _weights(mxfp4=True)
    assert GptOssExperts(m13, b13, m2, b2, **scales).mxfp4
    cases = [
        (lambda: GptOssExperts(w13.float(), b13, w2, b2), TypeError, "w13 must be a 3-D bfloat16 or int8"),
        (lambda: GptOssExperts(w13, b13, m2, b2), TypeError, "must share a dtype"),
        (lambda: GptOssExperts(w13, b13, w2[:, :, :16], b2), ValueError, r"w2 \[E, H, I\]"),
        (lambda: GptOssExperts(w13, b13[:, :8], w2, b2), ValueError, r"b13 must be .* shape \(2, 64\)"),
        (lambda: GptOssExperts(w13, b13, w2, b2.long()), ValueError, "b2 must be a floating-point"),
        (lambda: GptOssExperts(m13, b13, m2, b2), ValueError, "MXFP4 weights need w13_scale"),
        (lambda: GptOssExperts(w13, b13, w2, b2, **scales), ValueError, "only for MXFP4"),
    ]
    for make, err, msg in cases:
        with pytest.raises(err, match=msg):
            make()
    x, mm = torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.tensor([4, 1], dtype=torch.int32)
    combine = Combine(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4), torch.zeros(3, 64))
    with pytest.raises(TypeError, match="combine must be a flashgemm.Combine"):
        layer(x, mm, tuple(combine))
    with pytest.raises(ValueError, match="combine.bias must be None"):
        layer(x, mm, combine._replace(bias=torch.zeros(2, 64)))
    with pytest.raises(TypeError, match=r"combine.output must have dtype torch.bfloat16 with combine.peers"):
        layer(x, mm, combine._replace(peers=torch.zeros(1, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"x must be \[E=2, max_m, H=64\]"):
        layer(x[..., :32], mm, combine)
    # the combine is checked before gate_up launches (on the CPU, a launch would fail on the device instead)
    with pytest.raises(ValueError, match=r"combine.weight must have shape \(E, max_m\) = \(2, 4\)"):
        layer(x, mm, combine._replace(weight=torch.zeros(2, 3)))
    with pytest.raises(ValueError, match=r"combine.output must be a contiguous \[T, N=64\]"):
        layer(x, mm, combine._replace(output=torch.zeros(3, 32)))
