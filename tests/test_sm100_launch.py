"""The sm_100 launch plan on CPU: the public call on a GPU that reports
compute capability 10.0 (device facts stubbed), with the real heuristics and
the compiled functions replaced by recorders. Checks what reaches the
kernel (argument order, dtype views without copies, grid), that
``signal_layout`` gives the layout of the launch, and the config rules."""

import pytest

from flashgemm.plan import PlanCache
import torch

import flashgemm
from flashgemm import api
from flashgemm.blockscale import nvfp4_alpha, quantize_mxfp8, quantize_nvfp4, to_blocked_scales
from flashgemm.formats import Format
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.sm100 import blockwise_build, build
from flashgemm.sm100.config import CtaGroup, Sm100Config

SMS = 148


class Recorder:
    def __init__(self):
        self.calls, self.specs = [], []

    def get(self, spec, arch=None):
        self.specs.append(spec)
        return lambda *args: self.calls.append(args)


@pytest.fixture
def blackwell(monkeypatch):
    """A B200 as far as ``api`` can tell; kernels recorded, not compiled."""
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(api, "device_facts", lambda index: ((10, 0), SMS, "NVIDIA B200 (fake)"))
    # (CPU tensors report no device index, so the plan sees no capability: every GPU is an sm100 one)
    from flashgemm import backend

    sm100 = backend.get("sm100")
    monkeypatch.setattr(backend, "for_capability", lambda cap: sm100)
    monkeypatch.setattr(api, "validate_device", lambda tensors, num_sms, *rest: num_sms or SMS)
    monkeypatch.setattr(api, "_PLANS", PlanCache())
    monkeypatch.setattr(build, "get_kernel", rec.get)
    monkeypatch.setattr(blockwise_build, "get_blockwise_kernel", rec.get)
    return rec


def mx(e=4, m=300, n=512, k=256):
    a, sa = quantize_mxfp8(torch.randn(e, m, k))
    b, sb = quantize_mxfp8(torch.randn(e, n, k))
    return a, b, to_blocked_scales(sa), to_blocked_scales(sb)  # uint8 scales, as quantize_mxfp8 gives


def nv(e=4, m=300, n=512, k=256):
    a, sa, ga = quantize_nvfp4(torch.randn(e, m, k))
    b, sb, gb = quantize_nvfp4(torch.randn(e, n, k))
    return a, b, to_blocked_scales(sa), to_blocked_scales(sb), nvfp4_alpha(ga, gb)


def test_mxfp8_call_reaches_the_kernel_with_e8m0_views(blackwell):
    a, b, sa, sb = mx()
    mm = torch.tensor([0, 5, 300, 999], dtype=torch.int32)
    out = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb, expected_m=4)
    (args,) = blackwell.calls
    ka, kb, ksa, ksb, alpha, kout, kmm, sig, num_ctas = args
    assert ka is a and kb is b and kout is out and kmm is mm and alpha is None and sig is None
    assert ksa.dtype == ksb.dtype == torch.float8_e8m0fnu
    assert ksa.data_ptr() == sa.data_ptr() and ksb.data_ptr() == sb.data_ptr()
    assert out.shape == (4, 300, 512) and out.dtype == torch.bfloat16
    spec = blackwell.specs[0]
    assert spec.config.fmt is Format.MXFP8 and spec.signal_mode is None
    assert num_ctas % spec.config.cluster_size == 0 and 0 < num_ctas <= SMS


def test_nvfp4_call_passes_alpha_and_packed_views(blackwell):
    a, b, sa, sb, alpha = nv()
    mm = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    out = torch.empty(4, 300, 512, dtype=torch.bfloat16)
    for _ in range(2):  # the second call takes the remembered plan
        flashgemm.grouped_gemm_nt_masked(a, b, out, mm, a_scale=sa, b_scale=sb, alpha=alpha)
    assert len(blackwell.specs) == 1 and len(blackwell.calls) == 2
    ka, kb, ksa, ksb, kalpha, kout, *_ = blackwell.calls[1]
    assert ka.dtype == kb.dtype == torch.float4_e2m1fn_x2 and ka.data_ptr() == a.data_ptr()
    assert ksa is sa and ksb is sb and kalpha is alpha and kout is out


def test_bf16_on_sm100_takes_the_sm100_kernel(blackwell):
    a = torch.randn(2, 64, 64).bfloat16()
    b = torch.randn(2, 128, 64).bfloat16()
    flashgemm.grouped_gemm_nt_masked(a, b, None, torch.ones(2, dtype=torch.int32))
    (spec,) = blackwell.specs
    assert spec.config.fmt is Format.BF16
    assert blackwell.calls[0][2] is None and blackwell.calls[0][4] is None  # no scales, no alpha


def test_fp8_block128_on_sm100_takes_the_blockwise_kernel(blackwell):
    a, sa = quantize_fp8_per_token(torch.randn(3, 100, 384))
    b, sb = quantize_fp8_per_block(torch.randn(3, 256, 384))
    mm = torch.tensor([100, 0, 7], dtype=torch.int32)
    flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb)
    (spec,) = blackwell.specs
    assert isinstance(spec, blockwise_build.BlockwiseSpec)
    ka, kb, ksa, ksb, kout, kmm, sig, num_ctas = blackwell.calls[0]
    assert ksa.stride(1) == 1 and torch.equal(ksa, sa) and ksb is sb and sig is None
    assert num_ctas == 3 * 1 * 2  # one CTA per 128x128 tile while the tiles are fewer than the SMs


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "bf16", "fp8_block128"])
@pytest.mark.parametrize("granularity", ["m_block", "expert"])
def test_signal_layout_before_launch_is_the_launch_layout(blackwell, fmt, granularity):
    e, m, n, k = 4, 300, 512, 256
    if fmt == "mxfp8":
        a, b, sa, sb = mx(e, m, n, k)
        kw = dict(a_scale=sa, b_scale=sb)
    elif fmt == "nvfp4":
        a, b, sa, sb, alpha = nv(e, m, n, k)
        kw = dict(a_scale=sa, b_scale=sb, alpha=alpha)
    elif fmt == "bf16":
        a, b, kw = torch.randn(e, m, k).bfloat16(), torch.randn(e, n, k).bfloat16(), {}
    else:
        a, sa = quantize_fp8_per_token(torch.randn(e, m, k))
        b, sb = quantize_fp8_per_block(torch.randn(e, n, k))
        kw = dict(a_scale=sa, b_scale=sb)
    for expected_m, num_sms in ((4, None), (250, 100)):
        before = flashgemm.signal_layout(e, m, n, k, fmt=fmt, expected_m=expected_m, num_sms=num_sms,
                                         signal_granularity=granularity)
        sig = flashgemm.alloc_signals(before)
        _, layout = flashgemm.grouped_gemm_nt_masked(a, b, None, torch.full((e,), m, dtype=torch.int32),
                                                     expected_m=expected_m, num_sms=num_sms, dst_signals=sig,
                                                     signal_granularity=granularity, **kw)
        assert layout == before
        assert blackwell.calls[-1][-2] is sig
        assert blackwell.specs[-1].signal_mode == granularity


def test_two_cta_tiles_signal_per_cta_rows(blackwell):
    # enough rows per expert for the heuristic's 256x256 pair tile
    layout = flashgemm.signal_layout(16, 1024, 4096, 512, fmt="mxfp8", expected_m=512)
    assert (layout.block_m, layout.block_n) == (128, 256)
    a, b, sa, sb = mx(16, 1024, 4096, 64)
    flashgemm.grouped_gemm_nt_masked(a, b, None, torch.ones(16, dtype=torch.int32), a_scale=sa, b_scale=sb,
                                     expected_m=512, num_sms=147)
    assert blackwell.specs[-1].config.cta_group is CtaGroup.TWO
    assert blackwell.calls[-1][-1] == 146  # whole pairs within num_sms


def test_sm100_config_override_and_its_checks(blackwell):
    a, b, sa, sb = mx()
    mm = torch.ones(4, dtype=torch.int32)
    cfg = Sm100Config(fmt=Format.MXFP8, tile_m=128, tile_n=256)
    flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb, config=cfg)
    assert blackwell.specs[-1].config == cfg
    with pytest.raises(ValueError, match=r"config.fmt is nvfp4 but the operands are mxfp8"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb, config=cfg.replace(fmt=Format.NVFP4))
    with pytest.raises(ValueError, match=r"config.tile_n must be one of"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb, config=cfg.replace(tile_n=96))
    with pytest.raises(TypeError, match=r"config on an sm_100 GPU must be a flashgemm.Sm100Config"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb, config=flashgemm.GemmConfig())


def test_sm100_refusals(blackwell):
    from flashgemm import Combine

    a = torch.randn(2, 64, 64).bfloat16()
    b = torch.randn(2, 128, 64).bfloat16()
    mm = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"combine is available on sm_90 only; this GPU's kernels are sm100's"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=Combine(
            torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 64), torch.zeros(8, 128)))
    with pytest.raises(ValueError, match=r"combine is available on sm_90 only, combine.bias with it"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=Combine(
            torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 64), torch.zeros(8, 128), bias=torch.zeros(2, 128)))
    with pytest.raises(TypeError, match=r"expected_m must be an int or None"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, expected_m=1.5)
    with pytest.raises(ValueError, match=r"signal_granularity must be one of"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, dst_signals=torch.zeros(64, dtype=torch.int32),
                                         signal_granularity="tile")
    with pytest.raises(ValueError, match=r"dst_signals needs at least 2 entries"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, dst_signals=torch.zeros(1, dtype=torch.int32),
                                         signal_granularity="expert")
    assert blackwell.calls == []


# ---------------------------------------------------------------- the compiled functions' own signatures

_SIGNATURES_CHILD = r"""
import json, sys, torch
from flashgemm.formats import Format
from flashgemm.sm100.blockwise_build import BlockwiseSpec, build_blockwise
from flashgemm.sm100.build import build
from flashgemm.sm100.config import Sm100Config, Sm100Spec

found = {}
for key, make in (
    ("nvfp4-m_block", lambda: build(Sm100Spec(Sm100Config(fmt=Format.NVFP4), "m_block"), "sm_100a")),
    ("mxfp8-none", lambda: build(Sm100Spec(Sm100Config(fmt=Format.MXFP8), None), "sm_100a")),
    ("bf16-expert", lambda: build(Sm100Spec(Sm100Config(fmt=Format.BF16), "expert"), "sm_100a")),
    ("blockwise-none", lambda: build_blockwise(BlockwiseSpec(), "sm_100a")),
):
    fn = make()
    try:  # CPU tensors are refused before launch, with the signature in the message
        fn(*[torch.zeros(1)] * (7 if key.startswith("blockwise") else 8), 1)
    except Exception as exc:
        found[key] = str(exc)
print(json.dumps(found))
"""


def _params(message):
    """[(name, dtype or None)] of a TVM-FFI refusal's ``__call__(...)`` text."""
    import re

    inside = re.search(r"__call__\((.*)\)`", message).group(1)
    return [(name, dtype or (None if kind == "None" else kind))
            for name, kind, dtype in re.findall(r"(\w+): (Tensor\(\[[^\]]*\], (\w+)\)|None|int32)", inside)]


def _dtype_name(x):
    if x is None:
        return None
    if isinstance(x, int):
        return "int32"
    return {torch.float4_e2m1fn_x2: "float4_e2m1fnx2"}.get(x.dtype, str(x.dtype).replace("torch.", ""))


def test_compiled_signatures_take_what_the_plan_passes(blackwell):
    """Compile real sm_100a kernels in a child process and compare their
    argument lists with the arguments the plan passes, in order."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.run([sys.executable, "-c", _SIGNATURES_CHILD], cwd=repo, capture_output=True, text=True,
                           env=dict(os.environ, CUTE_DSL_ARCH="sm_100a", FLASHGEMM_CACHE="0"), timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    signatures = {key: _params(text) for key, text in json.loads(child.stdout.splitlines()[-1]).items()}
    a, b, sa, sb, alpha = nv(2, 64, 128, 256)
    mm = torch.ones(2, dtype=torch.int32)
    expert = flashgemm.signal_layout(2, 64, 128, 256, fmt="bf16", signal_granularity="expert")
    m_block = flashgemm.signal_layout(2, 64, 128, 256, fmt="nvfp4")
    flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb, alpha=alpha,
                                     dst_signals=flashgemm.alloc_signals(m_block))
    a8, b8, sa8, sb8 = mx(2, 64, 128, 256)
    flashgemm.grouped_gemm_nt_masked(a8, b8, None, mm, a_scale=sa8, b_scale=sb8)
    flashgemm.grouped_gemm_nt_masked(torch.zeros(2, 64, 256).bfloat16(), torch.zeros(2, 128, 256).bfloat16(), None,
                                     mm, dst_signals=flashgemm.alloc_signals(expert), signal_granularity="expert")
    fa, fsa = quantize_fp8_per_token(torch.randn(2, 64, 256))
    fb, fsb = quantize_fp8_per_block(torch.randn(2, 128, 256))
    flashgemm.grouped_gemm_nt_masked(fa, fb, None, mm, a_scale=fsa, b_scale=fsb)
    passed = dict(zip(("nvfp4-m_block", "mxfp8-none", "bf16-expert", "blockwise-none"), blackwell.calls))
    for key, params in signatures.items():
        assert [dtype for _, dtype in params] == [_dtype_name(x) for x in passed[key]], (key, params)
