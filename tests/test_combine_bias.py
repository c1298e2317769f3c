"""The fused combine's per-expert bias (``Combine.bias``, the ``*_BIAS``
epilogues) on the CPU: the epilogue it picks, its argument checks (each a
ValueError naming ``combine.bias``, before any launch), the launch plan with
the compile and the device stubbed, and gpt-oss's layer passing its down
biases through it. Its PTX is checked in test_compile.py, its refusal on
sm_100 in test_sm100_launch.py, its results on the GPU in
test_gpu_combine_bias.py."""

import pytest
import torch

import flashgemm
from flashgemm import Combine
from flashgemm.config import Epilogue
from flashgemm.routing import check_combine, combine_epilogue

E, MAX_M, N, K, T = 3, 8, 16, 64, 5


def _combine(dtype=torch.float32, peers=False, bias=True):
    tok = torch.randint(0, T, (E, MAX_M), dtype=torch.int32)
    output = torch.zeros(T, N, dtype=torch.bfloat16 if peers else dtype)
    table = torch.tensor([output.data_ptr()], dtype=torch.int64) if peers else None
    b = torch.randn(E, N) if bias else None
    return Combine(tok, torch.rand(E, MAX_M), output, torch.zeros(1, dtype=torch.int32), table, b)


def _operands():
    a = torch.randn(E, MAX_M, K).to(torch.bfloat16)
    b = torch.randn(E, N, K).to(torch.bfloat16)
    return a, b, torch.tensor([0, 3, MAX_M], dtype=torch.int32)


def test_bias_picks_the_bias_twin_of_each_target():
    for dtype, peers, plain, biased in (
        (torch.float32, False, Epilogue.COMBINE, Epilogue.COMBINE_BIAS),
        (torch.bfloat16, False, Epilogue.COMBINE_BF16, Epilogue.COMBINE_BF16_BIAS),
        (torch.bfloat16, True, Epilogue.COMBINE_PEERS, Epilogue.COMBINE_PEERS_BIAS),
    ):
        c = _combine(dtype, peers)
        assert combine_epilogue(c) is biased and combine_epilogue(c._replace(bias=None)) is plain
        assert check_combine(c, None, None, E, MAX_M, N, {}) == tuple(c)
    assert Combine(*_combine()[:5]).bias is None  # the field is optional, last


def _offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t``'s values in a tensor of its shape that starts ``elements`` past an aligned allocation."""
    buf = torch.zeros(t.numel() + elements, dtype=t.dtype)
    return buf[elements:].view(t.shape).copy_(t)


@pytest.mark.parametrize("change, message", [
    (lambda c: c._replace(bias=c.bias.double()), r"combine.bias must have dtype torch.float32"),
    (lambda c: c._replace(bias=c.bias.to(torch.bfloat16)), r"combine.bias must have dtype torch.float32"),
    (lambda c: c._replace(bias=torch.zeros(E, N + 8)), r"combine.bias must be a contiguous \[E, N\] = \[3, 16\]"),
    (lambda c: c._replace(bias=torch.zeros(E + 1, N)), r"combine.bias must be a contiguous \[E, N\] = \[3, 16\]"),
    (lambda c: c._replace(bias=torch.zeros(E * N)), r"combine.bias must be a contiguous \[E, N\]"),
    (lambda c: c._replace(bias=torch.zeros(N, E).t()), r"combine.bias must be a contiguous \[E, N\] .* strides"),
    (lambda c: c._replace(bias=torch.zeros(E, N, device="meta")),
     r"combine.bias is on meta but combine.output is on cpu"),
    (lambda c: c._replace(bias=_offset(c.bias, 1)), r"combine.bias must start at a 16-byte aligned address"),
    (lambda c: c._replace(bias=c.output.view(-1)[: E * N].view(E, N)), r"combine.bias must not overlap combine.output"),
    (lambda c: c._replace(err=c.bias.view(-1)[:1].view(torch.int32)), r"combine.err must not overlap combine.bias"),
], ids=["float64", "bfloat16", "width", "experts", "rank", "strided", "device", "misaligned", "over-output",
        "under-err"])
def test_each_bad_bias_is_a_value_error_naming_it(change, message):
    bad = change(_combine())
    with pytest.raises(ValueError, match=message):
        check_combine(bad, None, None, E, MAX_M, N, {})
    # the public call refuses it the same way, before the device check (these are CPU tensors)
    a, b, mm = _operands()
    with pytest.raises(ValueError, match=message):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=bad)


def test_a_bias_that_is_no_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="combine.bias must be a torch.Tensor or None, got list"):
        check_combine(_combine()._replace(bias=[0.0] * N), None, None, E, MAX_M, N, {})


@pytest.mark.parametrize("dtype, peers", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "peers"])
def test_plan_passes_the_bias_in_its_slot_and_keys_on_it(stub_launch, dtype, peers):
    from flashgemm import api

    specs, seen, fn = stub_launch
    a, b, mm = _operands()
    c = _combine(dtype, peers)
    plain = c._replace(bias=None)
    for combine in (c, c, plain, plain):
        got = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, expected_m=4, combine=combine)
        assert got[0] is combine.output and got[1] is combine.err
    # a plan per signature: with and without the bias, one configuration for both builds
    assert len(api._PLANS) == 2 and [s.epilogue for s in specs] == [combine_epilogue(c), combine_epilogue(plain)]
    assert specs[0].epilogue.value == specs[1].epilogue.value + "_bias" and specs[0].config == specs[1].config
    # a, b, out, masked_m, signals, a_scale, b_scale, counter, then the six routing slots, out_scale, num_ctas
    assert [len(args) for args in fn.launches] == [16] * 4
    assert all(x is y for x, y in zip(fn.launches[0][8:14], c))
    assert fn.launches[0][13] is c.bias and fn.launches[2][13] is None
    # the device check sees the bias under its argument name
    assert seen[0]["combine.bias"] is c.bias and seen[1]["combine.bias"] is None


def test_plan_refuses_a_bias_moved_to_a_bad_address(stub_launch):
    _, _, fn = stub_launch
    a, b, mm = _operands()
    c = _combine()
    flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=c)
    # same signature (dtype, shape, strides, device), addresses the per-call check refuses: the full checks name it
    with pytest.raises(ValueError, match="combine.bias must start at a 16-byte aligned address"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=c._replace(bias=_offset(c.bias, 2)))
    inside = torch.zeros(E + T, N)
    over = c._replace(output=inside[:T], bias=inside[T - 1:T - 1 + E])
    with pytest.raises(ValueError, match="combine.bias must not overlap combine.output"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=over)
    assert len(fn.launches) == 1


# ---------------------------------------------------------------- gpt-oss's layer


def _layer():
    from flashgemm.moe.gpt_oss_experts import GptOssExperts

    w13 = torch.zeros(E, 2 * 32, K, dtype=torch.bfloat16)
    w2 = torch.zeros(E, K, 32, dtype=torch.bfloat16)
    return GptOssExperts(w13, torch.zeros(E, 2 * 32), w2, torch.randn(E, K).to(torch.bfloat16))


def test_gpt_oss_layer_sends_its_down_biases_with_the_combine(monkeypatch):
    """The layer's b2 (kept as an aligned float32 copy) is the down GEMM's
    ``combine.bias``, for every target, the peers' receive buffers included."""
    from flashgemm.moe import gpt_oss_experts as mod

    calls = []
    monkeypatch.setattr(mod, "grouped_gemm_nt_masked", lambda *args, **kw: calls.append(kw.get("combine")) or "y")
    monkeypatch.setattr(mod, "gpt_oss_swiglu", lambda gu, b13, mm, fp8, num_sms: "h")
    layer = _layer()
    assert layer.b2.dtype == torch.float32 and layer.b2.is_contiguous() and layer.b2.data_ptr() % 16 == 0
    x = torch.zeros(E, MAX_M, K, dtype=torch.bfloat16)
    mm = torch.tensor([1, 0, MAX_M], dtype=torch.int32)
    for peers in (False, True):
        c = _combine(torch.bfloat16, peers, bias=False)._replace(output=torch.zeros(T, K, dtype=torch.bfloat16))
        if peers:
            c = c._replace(peers=torch.tensor([c.output.data_ptr()], dtype=torch.int64))
        calls.clear()
        assert layer(x, mm, c) == "y"
        gate_up, down = calls
        assert gate_up is None and down.bias is layer.b2 and down._replace(bias=None) == c
    with pytest.raises(ValueError, match=r"combine.bias must be None: GptOssExperts adds its own down biases"):
        layer(x, mm, c._replace(bias=layer.b2))
