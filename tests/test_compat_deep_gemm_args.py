"""DeepGEMM-compatible entry points: the arguments DeepGEMM 2.6 takes, and
clear errors for the ones we do not implement (CPU only: the GEMM itself is
stubbed where a call would launch)."""

import inspect
import re

import pytest
import torch

from flashgemm.compat import deep_gemm as dg
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token


@pytest.fixture
def operands():
    e_count, max_m, n, k = 3, 64, 256, 256  # 3 experts: a bare tensor does not unpack into two
    a = quantize_fp8_per_token(torch.randn(e_count, max_m, k))
    b = quantize_fp8_per_block(torch.randn(e_count, n, k))
    d = torch.empty(e_count, max_m, n, dtype=torch.bfloat16)
    masked_m = torch.tensor([1, 0, 64], dtype=torch.int32)
    return a, b, d, masked_m


@pytest.fixture
def calls(monkeypatch):
    """The arguments each call hands the GEMM (stubbed: no GPU here)."""
    seen = []
    monkeypatch.setattr(dg, "grouped_gemm_nt_masked", lambda *args, **kw: seen.append((args, kw)))
    return seen


def test_signature_has_deep_gemm_2_6_parameters_in_order():
    names = list(inspect.signature(dg.m_grouped_fp8_gemm_nt_masked).parameters)
    assert names[:10] == ["a", "b", "d", "masked_m", "expected_m", "recipe", "recipe_a", "recipe_b",
                          "compiled_dims", "disable_ue8m0_cast"]


@pytest.mark.parametrize("kw", [
    {}, {"recipe_a": None, "recipe_b": None}, {"recipe_a": (1, 128), "recipe_b": (128, 128)},
    {"recipe_a": [1, 128]}, {"recipe_b": (128, 128)}, {"recipe": (1, 128, 128)},
])
def test_deepseek_recipe_and_none_are_accepted(operands, calls, kw):
    (a, sfa), (b, sfb), d, masked_m = operands
    assert dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, 32, **kw) is None
    (args, call_kw), = calls
    assert args[0] is a and args[1] is b and args[2] is d and args[3] is masked_m
    assert call_kw["a_scale"] is sfa and call_kw["b_scale"] is sfb and call_kw["expected_m"] == 32


def test_recipes_are_taken_positionally_as_in_deep_gemm(operands, calls):
    (a, sfa), (b, sfb), d, masked_m = operands
    dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, 32, None, (1, 128), (128, 128))
    assert len(calls) == 1


@pytest.mark.parametrize("kw, arg", [
    ({"recipe_a": (1, 32)}, "recipe_a"),  # MXFP8-style per-32 scales
    ({"recipe_a": (128, 128)}, "recipe_a"),
    ({"recipe_b": (1, 128)}, "recipe_b"),  # per-channel weight scales
    ({"recipe_b": (1, 32)}, "recipe_b"),
    ({"recipe": (1, 1, 128)}, "recipe"),
])
def test_other_recipes_raise_naming_the_argument(operands, calls, kw, arg):
    (a, sfa), (b, sfb), d, masked_m = operands
    got = re.escape(repr(kw[arg]))
    with pytest.raises(ValueError, match=rf"^{arg} must be None or .*DeepSeek-V3 recipe.*got {got}$"):
        dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, 32, **kw)
    assert not calls


def test_recipe_and_per_operand_recipes_are_exclusive(operands, calls):
    (a, sfa), (b, sfb), d, masked_m = operands
    with pytest.raises(ValueError, match="either recipe or recipe_a / recipe_b, not both"):
        dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, 32, recipe=(1, 128, 128),
                                        recipe_a=(1, 128))
    assert not calls


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("experts", [2, 3])  # 2: a bare tensor would unpack "successfully" into two experts
def test_bare_tensor_instead_of_a_pair_is_a_type_error(calls, which, experts):
    a = quantize_fp8_per_token(torch.randn(experts, 64, 256))
    b = quantize_fp8_per_block(torch.randn(experts, 128, 256))
    d = torch.empty(experts, 64, 128, dtype=torch.bfloat16)
    args = {"a": a, "b": b}
    args[which] = args[which][0]  # the fp8 tensor without its scales
    with pytest.raises(TypeError, match=rf"^{which} must be a \(tensor, scale\) pair.*got a tensor of shape "
                                        rf"\({experts}, "):
        dg.m_grouped_fp8_gemm_nt_masked(args["a"], args["b"], d, torch.zeros(experts, dtype=torch.int32), 32)
    assert not calls


def test_pair_of_the_wrong_length_is_a_type_error(operands, calls):
    (a, sfa), (b, sfb), d, masked_m = operands
    with pytest.raises(TypeError, match=r"^b must be a \(tensor, scale\) pair.*got a tuple of 3"):
        dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb, sfb), d, masked_m, 32)
    assert not calls


def test_overlap_on_cpu_tensors_is_a_clear_error(operands):
    """No stub: on a CPU-only torch the device query would fail an assert."""
    (a, sfa), (b, sfb), d, masked_m = operands
    signal = torch.zeros(a.shape[0], dtype=torch.int32)
    with pytest.raises(ValueError, match="enable_overlap=True needs a, b and d on a CUDA GPU .*a is on cpu"):
        dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, 32, enable_overlap=True, signal=signal)
    with pytest.raises(ValueError, match="enable_overlap=True needs a, b and d on a CUDA GPU .*a is on cpu"):
        dg.m_grouped_bf16_gemm_nt_masked(a.bfloat16(), b.bfloat16(), d, masked_m, 32, enable_overlap=True,
                                         signal=signal)
