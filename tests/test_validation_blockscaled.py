"""Host-side checks of the block-scaled (MXFP8 / NVFP4) arguments and the
dispatch by GPU generation (CPU only).

The metadata checks come before the device checks, so CPU tensors reach
every one of them through the public call; the dispatch is driven with the
device facts and the kernels stubbed.
"""

import types

import pytest

from flashgemm.plan import PlanCache
import torch

import flashgemm
from flashgemm import api
from flashgemm.blockscale import quantize_mxfp8, quantize_nvfp4, nvfp4_alpha, to_blocked_scales
from flashgemm.blockscaled_args import (
    blocked_scale_shape, check_alpha, format_of, infer_format, validate_blockscaled_args,
)
from flashgemm.formats import Format

E, M, N, K = 3, 40, 200, 256  # M and N not multiples of the 128-row scale atom


def mxfp8_case(e=E, m=M, n=N, k=K, scale_dtype=torch.uint8):
    a, sa = quantize_mxfp8(torch.randn(e, m, k))
    b, sb = quantize_mxfp8(torch.randn(e, n, k))
    return dict(a=a, b=b, out=torch.empty(e, m, n, dtype=torch.bfloat16),
                masked_m=torch.tensor([m, 0, m + 5][:e] + [1] * max(0, e - 3), dtype=torch.int32),
                a_scale=to_blocked_scales(sa).view(scale_dtype), b_scale=to_blocked_scales(sb).view(scale_dtype),
                alpha=None)


def nvfp4_case(e=E, m=M, n=N, k=K, packed_dtype=torch.uint8):
    a, sa, ga = quantize_nvfp4(torch.randn(e, m, k))
    b, sb, gb = quantize_nvfp4(torch.randn(e, n, k))
    return dict(a=a.view(packed_dtype), b=b.view(packed_dtype), out=torch.empty(e, m, n, dtype=torch.bfloat16),
                masked_m=torch.full((e,), m, dtype=torch.int32),
                a_scale=to_blocked_scales(sa), b_scale=to_blocked_scales(sb), alpha=nvfp4_alpha(ga, gb))


def mxfp4_case(e=E, m=M, n=N, k=K, packed_dtype=torch.uint8):
    """MXFP8 activations and a checkpoint's MXFP4 weights (Blackwell's kind::mxf8f6f4), rows padded."""
    from flashgemm.mxfp4 import blackwell_weights, quantize_mxfp4

    a, sa = quantize_mxfp8(torch.randn(e, m, k))
    b, b_scale = blackwell_weights(*quantize_mxfp4(torch.randn(e, n, k)))
    return dict(a=a, b=b.view(packed_dtype), out=torch.empty(e, m, n, dtype=torch.bfloat16),
                masked_m=torch.full((e,), m, dtype=torch.int32),
                a_scale=to_blocked_scales(sa), b_scale=b_scale, alpha=None)


def check(fmt, args):
    return validate_blockscaled_args(fmt, args["a"], args["b"], args["out"], args["masked_m"], args["a_scale"],
                                     args["b_scale"], args["alpha"])


def call(args, **kw):
    """The public call with these arguments (CPU tensors: stops at the device check at the latest)."""
    return flashgemm.grouped_gemm_nt_masked(args["a"], args["b"], args["out"], args["masked_m"],
                                           a_scale=args["a_scale"], b_scale=args["b_scale"], alpha=args["alpha"],
                                           **kw)


# ---------------------------------------------------------------- format inference


def test_format_follows_the_dtypes():
    bf = torch.empty(1, 1, 8, dtype=torch.bfloat16)
    f8 = torch.empty(1, 1, 32, dtype=torch.float8_e4m3fn)
    assert infer_format(bf, None) is Format.BF16
    assert infer_format(f8, torch.empty(1, 1, 1)) is Format.FP8_BLOCK128
    assert infer_format(f8, None) is Format.FP8_BLOCK128  # its checks then ask for the scales
    assert infer_format(f8, torch.empty(1, dtype=torch.float8_e8m0fnu)) is Format.MXFP8
    assert infer_format(f8, torch.empty(1, dtype=torch.uint8)) is Format.MXFP8
    assert infer_format(torch.empty(1, 1, 16, dtype=torch.uint8), None) is Format.NVFP4
    assert infer_format(torch.empty(1, 1, 16, dtype=torch.float4_e2m1fn_x2), None) is Format.NVFP4
    assert infer_format(torch.empty(1, 1, 8, dtype=torch.float16), None) is Format.BF16  # (refused by its checks)
    # packed e2m1 b beside fp8 a: E8M0 a_scale is Blackwell's MXFP4 kernel, fp32 Hopper's
    for packed in (torch.uint8, torch.float4_e2m1fn_x2):
        b4 = torch.empty(1, 1, 16, dtype=packed)
        assert infer_format(f8, torch.empty(1, dtype=torch.float8_e8m0fnu), b4) is Format.MXFP8_MXFP4
        assert infer_format(f8, torch.empty(1, dtype=torch.uint8), b4) is Format.MXFP8_MXFP4
        assert infer_format(f8, torch.empty(1, 1, 1), b4) is Format.FP8_MXFP4


def test_fp8_with_a_scale_of_another_dtype_names_both_choices():
    f8 = torch.empty(1, 1, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"a_scale must be float32 .* or float8_e8m0fnu / uint8 \(MXFP8"):
        infer_format(f8, torch.empty(1, dtype=torch.float8_e4m3fn))


def test_blocked_shape_is_what_to_blocked_scales_returns():
    for fmt, vec in ((Format.MXFP8, 32), (Format.NVFP4, 16)):
        for rows, k in ((1, 32), (40, 256), (129, 4096), (300, 7168)):
            s = torch.zeros(2, rows, k // vec, dtype=torch.uint8)
            assert blocked_scale_shape(fmt, 2, rows, k) == tuple(to_blocked_scales(s).shape)


# ---------------------------------------------------------------- accepted


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu])
def test_valid_mxfp8(scale_dtype):
    assert check(Format.MXFP8, mxfp8_case(scale_dtype=scale_dtype)) == (E, M, N, K)


@pytest.mark.parametrize("packed", [torch.uint8, torch.float4_e2m1fn_x2])
def test_valid_nvfp4_reports_k_in_elements(packed):
    args = nvfp4_case(packed_dtype=packed)
    assert args["a"].shape[2] == K // 2
    assert check(Format.NVFP4, args) == (E, M, N, K)


@pytest.mark.parametrize("packed", [torch.uint8, torch.float4_e2m1fn_x2])
@pytest.mark.parametrize("k", [K, 2880, 32])
def test_valid_mxfp4_weights_report_k_in_elements(packed, k):
    """b's rows hold K rounded up to whole 128-value pieces (zero codes past K)."""
    args = mxfp4_case(k=k, packed_dtype=packed)
    assert args["b"].shape[2] == -(-k // 128) * 64
    assert check(Format.MXFP8_MXFP4, args) == (E, M, N, k)


@pytest.mark.parametrize("change, error, match", [
    # Hopper's prepared bytes are not what the tensor core reads
    (lambda a: a.update(b=a["b"].view(torch.int8)), TypeError, r"mxfp8_mxfp4 kernel reads the checkpoint's packed"),
    (lambda a: a.update(b=a["b"][:, :, :64]), ValueError, r"b\.shape\[2\] must be ceil\(K/128\) \* 64 = 128"),
    # K = 160 in rows of K/2 bytes: not padded to whole 128-value pieces
    (lambda a: a.update(**{k: v for k, v in mxfp4_case(k=160).items() if k not in ("out", "b")},
                        b=torch.zeros(E, N, 80, dtype=torch.uint8)), ValueError,
     r"b\.shape\[2\] must be ceil\(K/128\) \* 64 = 128 .* K = a\.shape\[2\] = 160\), got 80"),
    # rows of 128 + 16 bytes: 16-byte aligned (TMA) but not 32 (the unpacking TMA)
    (lambda a: a.update(b=torch.zeros(E, N, 144, dtype=torch.uint8)[:, :, :128]), ValueError,
     r"b\.stride\(1\) must be a multiple of 32 bytes for mxfp8_mxfp4"),
    (lambda a: a.update(a_scale=a["a_scale"].view(torch.float8_e4m3fn)), TypeError,
     r"a_scale must be float32 .* or float8_e8m0fnu / uint8"),
    (lambda a: a.update(b_scale=a["b_scale"][:, :1]), ValueError, r"b_scale must have shape \(E, ceil\(N/128\)"),
])
def test_mxfp4_weights_refused(change, error, match):
    args = mxfp4_case()
    change(args)
    with pytest.raises(error, match=match):
        call(args)


def test_mxfp4_weights_need_a_32_byte_aligned_b():
    args = mxfp4_case()
    base = torch.zeros(E * N * 128 + 16, dtype=torch.uint8)
    args["b"] = base[16:].view(E, N, 128)  # 16-byte aligned, not 32
    with pytest.raises(ValueError, match=r"b base address must be 32-byte aligned for mxfp8_mxfp4"):
        check(Format.MXFP8_MXFP4, args)


def test_valid_without_out_and_with_one_expert():
    args = mxfp8_case(e=1, m=1, n=8, k=32)
    args["out"] = None
    assert check(Format.MXFP8, args) == (1, 1, 8, 32)


# ---------------------------------------------------------------- refused, each naming the argument


@pytest.mark.parametrize("name", ["a_scale", "b_scale"])
def test_missing_scale(name):
    args = mxfp8_case()
    args[name] = None
    with pytest.raises(ValueError, match=rf"mxfp8 operands need {name}: blocked scales of shape"):
        check(Format.MXFP8, args)


def test_mxfp8_scale_dtype():
    args = mxfp8_case()
    args["b_scale"] = args["b_scale"].view(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"b_scale must have dtype torch.float8_e8m0fnu or torch.uint8"):
        check(Format.MXFP8, args)


def test_nvfp4_scales_must_be_e4m3_not_bytes():
    args = nvfp4_case()
    args["a_scale"] = args["a_scale"].view(torch.uint8)
    with pytest.raises(TypeError, match=r"a_scale must have dtype torch.float8_e4m3fn, got torch.uint8"):
        check(Format.NVFP4, args)


def test_row_major_scales_are_refused_with_the_blocked_shape():
    a, sa = quantize_mxfp8(torch.randn(E, M, K))
    args = mxfp8_case()
    args["a_scale"] = sa  # [E, M, K/32]: not the blocked layout
    with pytest.raises(ValueError, match=r"a_scale must have rank 6"):
        check(Format.MXFP8, args)


@pytest.mark.parametrize("name,rows", [("a_scale", "max_m"), ("b_scale", "N")])
def test_blocked_scale_of_the_wrong_size(name, rows):
    args = mxfp8_case()
    t = args[name]
    args[name] = torch.zeros(t.shape[0], t.shape[1] + 1, *t.shape[2:], dtype=t.dtype)
    want = blocked_scale_shape(Format.MXFP8, E, M if rows == "max_m" else N, K)
    with pytest.raises(ValueError, match=rf"{name} must have shape \(E, ceil\({rows}/128\), ceil\(K/32/4\), 32, 4, 4\) "
                                         rf"= \({', '.join(map(str, want))}\)"):
        check(Format.MXFP8, args)


def test_nvfp4_scale_blocks_counted_per_16():
    args = nvfp4_case(k=512)  # 32 scales per row: rk = 8 (MXFP8 would have rk = 4)
    assert args["a_scale"].shape[2] == 8
    assert check(Format.NVFP4, args)[3] == 512
    args["b_scale"] = args["b_scale"][:, :, :4].contiguous()
    with pytest.raises(ValueError, match=r"b_scale must have shape .*ceil\(K/16/4\)"):
        check(Format.NVFP4, args)


def test_non_contiguous_scale():
    args = mxfp8_case()
    t = args["a_scale"]
    args["a_scale"] = torch.zeros(*t.shape[:-1], 8, dtype=t.dtype)[..., :4]
    with pytest.raises(ValueError, match=r"a_scale must be contiguous"):
        check(Format.MXFP8, args)


@pytest.mark.parametrize("k", [16, 48, 100])
def test_mxfp8_k_alignment(k):
    args = mxfp8_case(k=64)
    args["a"] = torch.zeros(E, M, k, dtype=torch.float8_e4m3fn)
    args["b"] = torch.zeros(E, N, k, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"K \(a.shape\[2\] = {k}\) must be a positive multiple of 32 for mxfp8"):
        check(Format.MXFP8, args)


@pytest.mark.parametrize("k_bytes", [8, 24])
def test_nvfp4_k_alignment_counts_elements(k_bytes):
    args = nvfp4_case()
    args["a"] = torch.zeros(E, M, k_bytes, dtype=torch.uint8)
    args["b"] = torch.zeros(E, N, k_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"K \(2 \* a.shape\[2\] = {2 * k_bytes}\) must be a positive multiple of 32"):
        check(Format.NVFP4, args)


def test_packed_k_mismatch_between_a_and_b():
    args = nvfp4_case()
    args["b"] = torch.zeros(E, N, K // 2 + 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"b.shape\[2\] must equal a.shape\[2\] = 128 \(2 e2m1 per byte\)"):
        check(Format.NVFP4, args)


def test_n_must_give_whole_output_lines():
    args = mxfp8_case(n=132)
    with pytest.raises(ValueError, match=r"N \(b.shape\[1\]\) must be a positive multiple of 8"):
        check(Format.MXFP8, args)


def test_mxfp8_operand_of_another_dtype():
    args = mxfp8_case()
    args["b"] = args["b"].view(torch.uint8)
    with pytest.raises(TypeError, match=r"b must have dtype torch.float8_e4m3fn, got torch.uint8"):
        check(Format.MXFP8, args)


def test_out_must_be_bf16_and_shaped():
    args = mxfp8_case()
    args["out"] = torch.empty(E, M, N, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"out must have dtype torch.bfloat16"):
        check(Format.MXFP8, args)
    args["out"] = torch.empty(E, M, N + 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must have shape \(E, max_m, N\)"):
        check(Format.MXFP8, args)


def test_out_aliasing_a_scale():
    args = mxfp8_case()
    flat = torch.empty(E * M * N, dtype=torch.bfloat16)
    args["out"] = flat.view(E, M, N)
    args["a_scale"] = flat.view(torch.uint8)[: args["a_scale"].numel()].view(args["a_scale"].shape)
    with pytest.raises(ValueError, match="out must not overlap a_scale"):
        check(Format.MXFP8, args)


# ---------------------------------------------------------------- alpha


def test_nvfp4_needs_alpha():
    args = nvfp4_case()
    args["alpha"] = None
    with pytest.raises(ValueError, match=r"NVFP4 operands need alpha: float32 \[E\] = 1 / \(g_a \* g_b\)"):
        check(Format.NVFP4, args)


@pytest.mark.parametrize("alpha,message", [
    (torch.ones(E, dtype=torch.float64), r"alpha must have dtype torch.float32"),
    (torch.ones(E, 1), r"alpha must have rank 1"),
    (torch.ones(E + 1), rf"alpha must have E={E} entries"),
    (torch.ones(2 * E)[::2], r"alpha must be contiguous"),
    (1.0, r"alpha must be a torch.Tensor"),
])
def test_alpha_checked(alpha, message):
    args = nvfp4_case()
    args["alpha"] = alpha
    with pytest.raises((TypeError, ValueError), match=message):
        check(Format.NVFP4, args)


@pytest.mark.parametrize("fmt", [Format.MXFP8, Format.BF16, Format.FP8_BLOCK128])
def test_alpha_refused_for_other_formats(fmt):
    with pytest.raises(ValueError, match=rf"alpha is only for NVFP4 operands .* the {fmt.value} kernels take none"):
        check_alpha(fmt, torch.ones(E), E)
    check_alpha(fmt, None, E)


# ---------------------------------------------------------------- through the public call, before any GPU


def test_public_call_checks_block_scaled_arguments_before_the_device():
    args = nvfp4_case()
    args["alpha"] = None
    with pytest.raises(ValueError, match="NVFP4 operands need alpha"):
        call(args)
    args = mxfp8_case()
    args["b_scale"] = args["b_scale"][:1]
    with pytest.raises(ValueError, match="b_scale must have shape"):
        call(args)
    with pytest.raises(ValueError, match="alpha is only for NVFP4"):
        flashgemm.grouped_gemm_nt_masked(torch.zeros(1, 8, 8, dtype=torch.bfloat16),
                                         torch.zeros(1, 8, 8, dtype=torch.bfloat16), None,
                                         torch.ones(1, dtype=torch.int32), alpha=torch.ones(1))


@pytest.mark.parametrize("case", [mxfp8_case, nvfp4_case])
def test_public_call_reaches_the_device_check_with_valid_cpu_operands(case):
    with pytest.raises(ValueError, match="a must be on a CUDA device, got cpu"):
        call(case())


def test_combine_refused_for_block_scaled_operands():
    from flashgemm import Combine

    args = mxfp8_case()
    args["out"] = None
    combine = Combine(torch.zeros(E, M, dtype=torch.int32), torch.zeros(E, M), torch.zeros(4, N))
    with pytest.raises(ValueError, match="combine takes bf16 or 1x128 fp8 operands on sm_90, not mxfp8"):
        call(args, combine=combine)


# ---------------------------------------------------------------- dispatch by GPU generation


@pytest.fixture
def stub_device(monkeypatch):
    """validate_device passes and reports 148 SMs; ``state.backend`` names
    the backend the GPU gets; the sm90 kernels refuse to be built."""
    from flashgemm import backend
    from flashgemm.sm90 import build as sm90_build

    state = types.SimpleNamespace(backend="sm90")
    monkeypatch.setattr(api, "validate_device", lambda *args, **kw: 148)
    monkeypatch.setattr(backend, "for_capability", lambda cap: backend.get(state.backend))
    monkeypatch.setattr(api, "_PLANS", PlanCache())

    def no_sm90(*args, **kw):
        raise AssertionError("an sm90 kernel was requested")

    monkeypatch.setattr(sm90_build, "get_kernel", no_sm90)
    return state


@pytest.mark.parametrize("case", [mxfp8_case, nvfp4_case, mxfp4_case])
def test_hopper_refuses_blackwell_formats_before_launch(stub_device, case):
    fmt = {mxfp8_case: "mxfp8", nvfp4_case: "nvfp4", mxfp4_case: "mxfp8_mxfp4"}[case]
    with pytest.raises(ValueError, match=rf"format '{fmt}' needs a Blackwell GPU \(sm_100/sm_103\); "
                                         r"this GPU's kernels \(sm90\) take: bf16, fp8_block128"):
        call(case())


def test_each_generation_names_the_other_ones_mxfp4_recipe(stub_device):
    """MXFP4 weights take 1x128 fp8 activations and prepared bytes on Hopper,
    MXFP8 activations and the packed bytes on Blackwell: each GPU's refusal
    of the other's call says which to pass."""
    from flashgemm.mxfp4 import prepare_weights, quantize_mxfp4
    from flashgemm.quant import quantize_fp8_per_token

    with pytest.raises(ValueError, match=r"format 'mxfp8_mxfp4' needs a Blackwell GPU .* on Hopper, MXFP4 "
                                         r"weights go with 1x128 fp8 activations .*mxfp4\.prepare_weights"):
        call(mxfp4_case())
    stub_device.backend = "sm100"
    a, a_scale = quantize_fp8_per_token(torch.randn(E, M, K))
    b, b_scale = prepare_weights(*quantize_mxfp4(torch.randn(E, 256, K)))
    with pytest.raises(ValueError, match=r"format 'fp8_mxfp4' runs on Hopper \(sm_90\) only; .* on Blackwell, "
                                         r"MXFP4 weights go with MXFP8 activations .*mxfp4\.blackwell_weights"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, torch.full((E,), M, dtype=torch.int32), a_scale=a_scale,
                                         b_scale=b_scale)


def _recording_plan(record):
    from flashgemm.plan import LaunchPlan

    return LaunchPlan(lambda *xs: record.append(("launch", xs)), ("a", "a_scale", "alpha"), {}, out_shape=(1,),
                      out_dtype=torch.bfloat16, copy_a_scale=False, counter_device=None, views=(), routed=False, layout=None)


@pytest.mark.parametrize("case", [mxfp8_case, nvfp4_case, mxfp4_case])
def test_sm100_gpu_goes_to_the_sm100_plan_once_per_signature(stub_device, monkeypatch, case):
    from flashgemm.sm100 import launch

    stub_device.backend = "sm100"
    record = []

    def make_plan(c):
        record.append(("plan", c.fmt, c.sizes, c.tensors["alpha"]))
        return _recording_plan(record)

    monkeypatch.setattr(launch, "make_plan", make_plan)
    args = case()
    call(args, expected_m=8)
    call(args, expected_m=8)
    fmt = {mxfp8_case: Format.MXFP8, nvfp4_case: Format.NVFP4, mxfp4_case: Format.MXFP8_MXFP4}[case]
    assert [r[0] for r in record] == ["plan", "launch", "launch"]
    assert record[0][1] is fmt and record[0][2] == (E, M, N, K) and record[0][3] is args["alpha"]
    assert record[1][1] == (args["a"], args["a_scale"], args["alpha"])


def test_sm100_gpu_serves_bf16_too(stub_device, monkeypatch):
    from flashgemm.sm100 import launch

    stub_device.backend = "sm100"
    seen = []
    monkeypatch.setattr(launch, "make_plan", lambda c: seen.append(c.fmt) or _recording_plan([]))
    a = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    flashgemm.grouped_gemm_nt_masked(a, torch.zeros(2, 32, 64, dtype=torch.bfloat16), None,
                                     torch.ones(2, dtype=torch.int32))
    assert seen == [Format.BF16]


# ---------------------------------------------------------------- the sm100 plan itself


def _choice(cluster=1, tile=(128, 128)):
    from flashgemm.sm100.launch import Choice

    return Choice(spec=None, blockwise=False, block=(tile[0] // cluster, tile[1]), cluster=cluster, cluster_tile=tile)


def test_grid_is_whole_clusters_within_num_sms_and_the_tiles():
    from flashgemm.sm100.launch import grid_ctas

    assert grid_ctas(_choice(), 8, 1024, 4096, 148) == 148
    assert grid_ctas(_choice(2, (256, 256)), 8, 1024, 4096, 147) == 146  # an odd cap rounds down
    assert grid_ctas(_choice(2, (256, 256)), 1, 100, 256, 148) == 2  # one tile: one cluster
    assert grid_ctas(_choice(), 1, 1, 8, 148) == 1
    with pytest.raises(ValueError, match=r"2-CTA clusters: num_sms must be >= 2, got 1"):
        grid_ctas(_choice(2, (256, 128)), 4, 512, 512, 1)


def _sm100_plan(fn, tensors, blockwise=False, **facts):
    from flashgemm.plan import LaunchPlan
    from flashgemm.sm100.blockwise_build import BlockwiseSpec
    from flashgemm.sm100.config import Sm100Spec

    facts = {"layout": None, "out_shape": None, "out_dtype": torch.bfloat16, "copy_a_scale": False,
             "counter_device": None, "views": (), "routed": False, **facts}
    return LaunchPlan(fn, (BlockwiseSpec if blockwise else Sm100Spec).SLOTS, tensors, scalars=(facts.pop("num_ctas"),),
                      written=("out", "signals"), **facts)


def test_sm100_plan_calls_the_kernel_in_its_argument_order():
    calls = []
    args = nvfp4_case()
    sig = torch.zeros(16, dtype=torch.int32)
    tensors = {k: args[k] for k in ("a", "b", "out", "masked_m", "a_scale", "b_scale", "alpha")}
    tensors["signals"] = sig
    plan = _sm100_plan(lambda *xs: calls.append(xs), tensors, num_ctas=146, layout="L", out_shape=(E, M, N))
    assert plan.pointers_ok(tensors)
    assert api._launch(plan, dict(tensors)) == (tensors["out"], "L")
    t = tensors
    assert calls == [(t["a"], t["b"], t["a_scale"], t["b_scale"], t["alpha"], t["out"], t["masked_m"], sig, 146)]
    # the signals inside out: refused by the per-call check
    assert not plan.pointers_ok({**tensors, "signals": tensors["out"].view(-1)[:32].view(torch.int32)})


def test_blockwise_plan_takes_no_alpha_and_copies_a_k_major_a_scale():
    calls = []
    a = torch.zeros(2, 8, 256, dtype=torch.float8_e4m3fn)
    sa = torch.rand(2, 8, 2)  # K-block contiguous: copied into the M-contiguous layout
    tensors = {"a": a, "b": a, "out": None, "masked_m": None, "a_scale": sa, "b_scale": None, "signals": None}
    plan = _sm100_plan(lambda *xs: calls.append(xs), tensors, blockwise=True, num_ctas=4, out_shape=(2, 8, 128),
                       copy_a_scale=True)
    out = api._launch(plan, dict(tensors))
    (x, _, sa_passed, _, out_passed, _, _, n_ctas), = calls
    assert out_passed is out and out.shape == (2, 8, 128) and out.dtype == torch.bfloat16 and n_ctas == 4
    assert sa_passed.stride(1) == 1 and torch.equal(sa_passed, sa)


# ---------------------------------------------------------------- signal_layout's format


def test_format_of_signal_layout():
    assert format_of() is Format.BF16
    assert format_of(fp8=True) is Format.FP8_BLOCK128
    assert format_of("nvfp4") is Format.NVFP4
    assert format_of(Format.MXFP8) is Format.MXFP8
    with pytest.raises(ValueError, match="fmt must be one of"):
        format_of("fp4")
    with pytest.raises(ValueError, match="fp8=True contradicts fmt='mxfp8'"):
        format_of("mxfp8", fp8=True)


def test_signal_layout_on_hopper(fake_gpu):
    assert flashgemm.signal_layout(4, 256, 512, 512, fmt="fp8_block128") == \
        flashgemm.signal_layout(4, 256, 512, 512, fp8=True)
    assert flashgemm.signal_layout(4, 256, 512, 512, fmt=Format.BF16) == flashgemm.signal_layout(4, 256, 512, 512)
    with pytest.raises(ValueError, match="format 'nvfp4' needs a Blackwell GPU"):
        flashgemm.signal_layout(4, 256, 512, 512, fmt="nvfp4")


def test_signal_layout_on_sm100_uses_the_sm100_choice(monkeypatch):
    from flashgemm.sm100 import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(api, "device_facts", lambda index: ((10, 0), 148, "B200 (fake)"))
    seen = []

    def choose(fmt, e, max_m, n, k, expected_m, grid_cap, config, mode):
        seen.append((fmt, e, max_m, n, k, expected_m, grid_cap, mode))
        return _choice(2, (256, 256))

    monkeypatch.setattr(launch, "choose", choose)
    layout = flashgemm.signal_layout(4, 300, 1000, 512, fmt="mxfp8", expected_m=20, num_sms=100,
                                     signal_granularity="expert")
    assert seen == [(Format.MXFP8, 4, 300, 1000, 512, 20, 100, "expert")]
    assert (layout.block_m, layout.block_n, layout.n_tiles, layout.size) == (128, 256, 4, 4)
