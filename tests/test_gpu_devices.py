"""Tensors on two GPUs are refused before anything launches (skipped
without two sm_90 GPUs)."""

import pytest
import torch

import flashgemm
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token

from conftest import requires_hopper

pytestmark = [
    requires_hopper,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

POISON = -12345.0
E, M, N, K = 4, 64, 256, 256
MASKED = [64, 3, 0, 17]


def _bf16_args(dev):
    layout = flashgemm.signal_layout(E, M, N, K, signal_granularity="expert", device=dev)
    return dict(
        a=torch.randn(E, M, K, device=dev, dtype=torch.bfloat16),
        b=torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) / K**0.5,
        out=torch.full((E, M, N), POISON, device=dev, dtype=torch.bfloat16),
        masked_m=torch.tensor(MASKED, dtype=torch.int32, device=dev),
        dst_signals=flashgemm.alloc_signals(layout, dev),
    )


def _call(args):
    return flashgemm.grouped_gemm_nt_masked(
        args["a"], args["b"], args["out"], args["masked_m"], a_scale=args.get("a_scale"),
        b_scale=args.get("b_scale"), dst_signals=args["dst_signals"], signal_granularity="expert",
    )


def _untouched(args):
    for t in args.values():
        torch.cuda.synchronize(t.device)
    return bool((args["out"] == POISON).all()) and not bool(args["dst_signals"].any())


@pytest.mark.parametrize("arg", ["b", "out", "masked_m", "dst_signals"])
def test_bf16_tensor_on_another_gpu_is_refused(arg, seed):
    on_0, on_1 = _bf16_args("cuda:0"), _bf16_args("cuda:1")
    _call(_bf16_args("cuda:0"))  # a launch plan for this signature, all on cuda:0
    mixed = dict(on_0, **{arg: on_1[arg]})
    with pytest.raises(ValueError, match=rf"^{arg} is on cuda:1 but a is on cuda:0"):
        _call(mixed)
    assert _untouched(on_0) and _untouched(on_1), "a refused call wrote something"


@pytest.mark.parametrize("arg", ["a_scale", "b_scale"])
def test_fp8_scales_on_another_gpu_are_refused(arg, seed):
    def fp8_args(dev):
        args = _bf16_args(dev)
        args["a"], args["a_scale"] = quantize_fp8_per_token(args["a"].float())
        args["b"], args["b_scale"] = quantize_fp8_per_block(args["b"].float())
        layout = flashgemm.signal_layout(E, M, N, K, signal_granularity="expert", fp8=True, device=dev)
        args["dst_signals"] = flashgemm.alloc_signals(layout, dev)
        return args

    on_0, on_1 = fp8_args("cuda:0"), fp8_args("cuda:1")
    _call(fp8_args("cuda:0"))
    mixed = dict(on_0, **{arg: on_1[arg]})
    with pytest.raises(ValueError, match=rf"^{arg} is on cuda:1 but a is on cuda:0"):
        _call(mixed)
    assert _untouched(on_0) and _untouched(on_1), "a refused call wrote something"
