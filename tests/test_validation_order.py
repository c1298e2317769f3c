"""The public op checks every argument's metadata before the device (CPU only).

On CPU tensors a call that is wrong in any other way must be refused for
that reason, naming the argument, with a TypeError or ValueError; only a
call that is valid apart from the CPU tensors gets the device error.
"""

import types

import pytest
import torch

import flashgemm
from flashgemm import Combine, GemmConfig, Sm100Config, Tail
from flashgemm.formats import Format
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.sm90.heuristic import DECODE_CONFIG
from flashgemm.validation import validate_device

BF16 = torch.bfloat16
E, M, N, K = 3, 40, 24, 32
DEVICE_ERROR = r"^a must be on a CUDA device, got cpu$"
# (torch's notes that its nested and sparse CSR tensors are prototypes / beta)
pytestmark = pytest.mark.filterwarnings("ignore:.*(nested tensors|Sparse CSR):UserWarning")


def make():
    a = torch.randn(E, M, K).to(BF16)
    b = torch.randn(E, N, K).to(BF16)
    return a, b, torch.empty(E, M, N, dtype=BF16), torch.full((E,), M, dtype=torch.int32)


def call(**changes):
    a, b, out, mm = make()
    args = dict(a=a, b=b, out=out, masked_m=mm)
    args.update(changes)
    return flashgemm.grouped_gemm_nt_masked(args.pop("a"), args.pop("b"), args.pop("out"), args.pop("masked_m"),
                                            **args)


def _signals(size=8, dtype=torch.int32):
    return torch.zeros(size, dtype=dtype)


DENSE = r"must be a dense \(strided\) tensor, got"
BAD = {
    # the options
    "config-dict": (lambda: dict(config={"tile_m": 64}), TypeError, r"^config must be a flashgemm\.GemmConfig"),
    "config-tile": (lambda: dict(config=GemmConfig(tile_n=96)), ValueError, r"^config\.tile_n must be one of"),
    "config-float": (lambda: dict(config=GemmConfig(tile_m=128.0)), ValueError,
                     r"^config\.tile_m must be an int"),
    "config-sm100-format": (lambda: dict(config=Sm100Config(fmt=Format.MXFP8)), ValueError,
                            r"^config\.fmt is mxfp8 but the operands are bf16$"),
    "config-split-signals": (lambda: dict(config=GemmConfig(cluster_n=2, tail=Tail.SPLIT), dst_signals=_signals()),
                             ValueError, r"^config\.tail=SPLIT cannot publish dst_signals"),
    "config-cluster-num-sms": (lambda: dict(config=GemmConfig(cluster_n=2), num_sms=1), ValueError,
                               r"^config\.cluster_n=2 needs num_sms >= 2, got 1$"),
    "num_sms-zero": (lambda: dict(num_sms=0), ValueError, r"^num_sms must be >= 1, got 0$"),
    "num_sms-float": (lambda: dict(num_sms=2.5), TypeError, r"^num_sms must be an int or None, got float$"),
    "num_sms-bool": (lambda: dict(num_sms=True), TypeError, r"^num_sms must be an int or None, got bool$"),
    "expected_m-negative": (lambda: dict(expected_m=-1), ValueError, r"^expected_m must be >= 0, got -1$"),
    "expected_m-float": (lambda: dict(expected_m=1.5), TypeError,
                         r"^expected_m must be an int or None, got float$"),
    "signals-list": (lambda: dict(dst_signals=[0] * 8), TypeError,
                     r"^dst_signals must be a torch\.Tensor, got list$"),
    "signals-int64": (lambda: dict(dst_signals=_signals(dtype=torch.int64)), TypeError,
                      r"^dst_signals must have dtype torch\.int32"),
    "signals-2d": (lambda: dict(dst_signals=_signals().view(2, 4)), ValueError,
                   r"^dst_signals must be a contiguous 1-D tensor"),
    "signals-short": (lambda: dict(dst_signals=_signals(E - 1)), ValueError,
                      rf"^dst_signals needs at least {E} entries"),
    "signals-sparse": (lambda: dict(dst_signals=_signals().to_sparse()), ValueError,
                       rf"^dst_signals {DENSE} layout torch\.sparse_coo$"),
    "granularity": (lambda: dict(signal_granularity="tile"), ValueError, r"^signal_granularity must be one of"),
    "granularity-with-signals": (lambda: dict(signal_granularity="rows", dst_signals=_signals()), ValueError,
                                 r"^signal_granularity must be one of"),
    # tensors of other layouts: refused by name, not by a RuntimeError from their strides
    "masked_m-sparse": (lambda: dict(masked_m=torch.full((E,), M, dtype=torch.int32).to_sparse()), ValueError,
                        rf"^masked_m {DENSE} layout torch\.sparse_coo$"),
    "masked_m-sparse-one-expert": (
        lambda: dict(a=torch.zeros(1, M, K, dtype=BF16), b=torch.zeros(1, N, K, dtype=BF16), out=None,
                     masked_m=torch.ones(1, dtype=torch.int32).to_sparse()),
        ValueError, rf"^masked_m {DENSE}"),
    "masked_m-nested": (lambda: dict(masked_m=torch.nested.nested_tensor([torch.zeros(E, dtype=torch.int32)])),
                        ValueError, rf"^masked_m {DENSE} a nested tensor$"),
    "a-sparse": (lambda: dict(a=torch.randn(E, M, K).to(BF16).to_sparse()), ValueError,
                 rf"^a {DENSE} layout torch\.sparse_coo$"),
    "out-sparse-csr": (lambda: dict(out=torch.zeros(E, M, N).to(BF16).to_sparse_csr()), ValueError,
                       rf"^out {DENSE} layout torch\.sparse_csr$"),
}


@pytest.mark.parametrize("changes, error, message", BAD.values(), ids=BAD.keys())
def test_bad_argument_is_named_before_the_device_check(changes, error, message):
    with pytest.raises(error, match=message):
        call(**changes())


def test_bad_combine_options_are_named_before_the_device_check():
    a, b, _, mm = make()
    c = Combine(torch.zeros(E, M, dtype=torch.int32), torch.zeros(E, M), torch.zeros(16, N))
    with pytest.raises(TypeError, match=r"^config with combine must be a flashgemm\.GemmConfig or None"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=c, config=Sm100Config(fmt=Format.BF16))
    with pytest.raises(ValueError, match=r"^num_sms must be >= 1, got -3$"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=c, num_sms=-3)


def test_config_fields_are_checked_even_after_an_equal_valid_config():
    # 128.0 == 128 and True == 1: a valid config checked (and cached) first
    # must not let an equal one of the wrong field types through
    for good, bad in ((GemmConfig(), GemmConfig(tile_m=128.0)), (GemmConfig(), GemmConfig(cluster_n=True)),
                      (GemmConfig(), GemmConfig(l2_hints=0))):
        with pytest.raises(ValueError, match=DEVICE_ERROR):
            call(config=good)
        with pytest.raises(ValueError, match=r"^config\.\w+ must be an? (int|bool)"):
            call(config=bad)


def _fp8_args():
    a, a_scale = quantize_fp8_per_token(torch.randn(E, M, 256))
    b, b_scale = quantize_fp8_per_block(torch.randn(E, 128, 256))
    return dict(a=a, b=b, out=None, a_scale=a_scale, b_scale=b_scale)


VALID = {
    "plain": {},
    "out-none": dict(out=None),
    "options": dict(expected_m=0, num_sms=1),
    "config": dict(config=DECODE_CONFIG, num_sms=132, expected_m=10**9),
    "config-pair": dict(config=GemmConfig(cluster_n=2), num_sms=2),
    "signals": dict(dst_signals=torch.zeros(E, dtype=torch.int32), signal_granularity="expert"),
    "signals-m_block": dict(dst_signals=torch.zeros(64, dtype=torch.int32), config=DECODE_CONFIG),
    "fp8": _fp8_args(),
    "fp8-config": dict(_fp8_args(), config=GemmConfig(tile_m=64, tile_n=128)),
    "combine": dict(out=None, combine=Combine(torch.zeros(E, M, dtype=torch.int32), torch.zeros(E, M),
                                              torch.zeros(16, N))),
}


@pytest.mark.parametrize("changes", VALID.values(), ids=VALID.keys())
def test_valid_call_on_cpu_gets_the_device_error(changes):
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(**changes)


def test_device_check_names_a_non_tensor():
    # validate_device reads .device: anything without one is refused by name
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(TypeError, match=r"^dst_signals must be a torch\.Tensor, got list$"):
        validate_device({"a": on_gpu, "dst_signals": [0]}, None, (9, 0), 132)
