"""MXFP4 weights with bf16 activations (``Format.BF16_MXFP4``) without a GPU:
the build for sm_90a and what its PTX must hold, the configuration rules
and heuristic, the argument checks, the loader's exponent range, and the
CPU op under torch.compile. Results on the GPU: tests/test_gpu_mxfp4.py."""

import re

import pytest
import torch

from flashgemm.config import Epilogue, GemmConfig, KernelSpec, Tail, TileOrder
from flashgemm.formats import Format
from flashgemm.mxfp4 import MAX_E8M0, dequantize_as_kernel, dequantize_mxfp4, prepare_weights, quantize_mxfp4
from flashgemm.sm90 import heuristic as H
from flashgemm.sm90.limits import (
    CONVERTER_REGS, SMEM_BYTES, check_config, consumer_regs, resolved_stages, smem_bytes,
)

MX = Format.BF16_MXFP4
DECODE = GemmConfig(tile_m=64, tile_n=128, cluster_n=2, order=TileOrder.DYNAMIC, a_chunk_rows=32, l2_hints=True)


# built by the listing run when one runs (conftest.kernel_ptx)
PTX_SPECS = (KernelSpec(DECODE, MX, "m_block"),)


@pytest.fixture(scope="module")
def decode_ptx(kernel_ptx):
    return kernel_ptx(PTX_SPECS[0])


def test_ptx_converts_to_bf16_without_a_tile_scale(decode_ptx):
    ptx = decode_ptx
    # bf16 x bf16 wgmma: the weights reach the tensor cores as bf16, nothing in e4m3
    assert re.search(r"wgmma\.mma_async\S*\.bf16\.bf16", ptx) and ".e4m3" not in ptx
    # per slot a team of 2 warps converts 128 rows x 64 values: 4 groups of 32 per
    # thread, each a 4-prmt table and 4 words of 8 prmt (2 lookups, 2 interleaves per half)
    assert ptx.count("prmt.b32") == 4 * (4 + 4 * 8)
    # each group leaves in four 16-byte shared stores at its swizzled place
    assert ptx.count("st.shared.v4.b32") >= 4 * 4
    # no largest exponent to share, but the team's barrier orders the slot's packed
    # loads before its in-place stores; the async-proxy fence before the handover
    assert len(re.findall(r"bar\.sync\s+%r\d+, 64;", ptx)) == 1
    assert "fence.proxy.async.shared::cta" in ptx
    # no activation scales, no weight scales copied in
    assert "cp.async.ca.shared.global" not in ptx
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{CONVERTER_REGS};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumer_regs(1, 2)};", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_reachable_specs_are_the_bf16_picks_adapted_and_fit():
    specs = H.reachable_specs(MX)
    assert specs and all(s.fmt is MX for s in specs)
    for spec in specs:
        cfg = check_config(spec.config, MX, spec.epilogue)
        assert cfg.tile_m in (64, 128) and 128 <= cfg.tile_n <= 192, spec.name()
        stages = resolved_stages(cfg, MX, spec.epilogue)
        assert stages >= 4, spec.name()  # each slot converted in place: the ring is the conversion's depth
        assert smem_bytes(cfg, MX, spec.epilogue) <= SMEM_BYTES, spec.name()
    adapted = {(H.weight_format_config(s.config, MX), s.signal_mode, s.epilogue)
               for s in H.reachable_specs(Format.BF16)}
    assert adapted == {(s.config, s.signal_mode, s.epilogue) for s in specs}
    assert set(specs) <= set(H.reachable_specs())  # what the compile listing covers


@pytest.mark.parametrize("m", [1, 32, 200, 4096])
@pytest.mark.parametrize("n, k", [(5760, 2880), (2880, 2880), (4096, 7168)])
def test_heuristic_picks_stay_within_reachable_specs(m, n, k):
    from flashgemm.sm90.launch import resolve_config

    reachable = {(s.config, s.epilogue) for s in H.reachable_specs(MX)}
    for sms in (1, 132):
        for epi in (Epilogue.STORE, Epilogue.COMBINE, Epilogue.SWIGLU_BF16):
            cfg = resolve_config(None, MX, m, 4096, n, k, sms, 16, epilogue=epi)
            assert (cfg, epi) in reachable, (m, n, k, sms, cfg, epi)


def test_config_rules_name_the_field():
    for cfg in (GemmConfig(tile_m=128, tile_n=256, tail=Tail.SPLIT), GemmConfig(tile_m=64, tile_n=256)):
        with pytest.raises(ValueError, match=r"config.tile_n must be <= 192 with bf16_mxfp4 weights"):
            check_config(cfg, MX)
    with pytest.raises(ValueError, match=r"config.tile_m must be 64 or 128 with bf16_mxfp4"):
        check_config(GemmConfig(tile_m=192, tile_n=64), MX)
    with pytest.raises(ValueError, match=r"config.promotion=OVERLAPPED applies to block-scaled fp8"):
        from flashgemm.config import Promotion

        check_config(GemmConfig(tile_m=64, promotion=Promotion.OVERLAPPED), MX)
    check_config(GemmConfig(tile_m=64, tile_n=192), MX)
    assert H.weight_format_config(GemmConfig(tile_m=128, tile_n=256), MX).tile_n == 192


def _args(e=2, m=8, n=256, k=512):
    x = torch.randn(e, m, k).bfloat16()
    packed, scales = quantize_mxfp4(torch.randn(e, n, k))
    b, b_scale = prepare_weights(packed, scales)
    return x, b, b_scale, packed, scales, torch.full((e,), m, dtype=torch.int32)



def test_bf16_a_with_prepared_weights_selects_the_format(cpu_launches):
    from flashgemm import api

    x, b, b_scale, *_, mm = _args()
    out = torch.empty(2, 8, 256, dtype=torch.bfloat16)
    api.grouped_gemm_nt_masked(x, b, out, mm, b_scale=b_scale.view(torch.float8_e8m0fnu))
    spec, tensors = cpu_launches[-1]
    assert spec.fmt is MX
    assert tensors[0].dtype == torch.bfloat16 and tensors[5] is None  # no a_scale
    assert tensors[1].dtype == torch.int8 and tensors[6].dtype == torch.uint8


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "b": t["packed"]}, r"go to the Hopper kernel in its own layout"),
    (lambda t: {**t, "b": t["packed"].view(torch.float4_e2m1fn_x2)}, r"go to the Hopper kernel in its own layout"),
    (lambda t: {**t, "a_scale": torch.ones(2, 8, 4)}, r"bfloat16 a takes no a_scale"),
    (lambda t: {**t, "b_scale": None}, r"MXFP4 weights need b_scale"),
    (lambda t: {**t, "b_scale": t["scales"]}, r"b_scale must be stored N contiguous"),
    (lambda t: {**t, "a": t["a"][:, :, :-32]}, r"b.shape\[2\] must be K/2 = 240"),
    (lambda t: {**t, "a": t["a"].half()}, r"a must have dtype torch.bfloat16 or torch.float8_e4m3fn"),
])
def test_bad_arguments_are_refused_by_name(cpu_launches, change, message):
    from flashgemm import api

    x, b, b_scale, packed, scales, mm = _args()
    t = change({"a": x, "a_scale": None, "b": b, "b_scale": b_scale, "packed": packed, "scales": scales})
    out = torch.empty(2, 8, 256, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=message):
        api.grouped_gemm_nt_masked(t["a"], t["b"], out, mm, a_scale=t["a_scale"], b_scale=t["b_scale"])
    assert not cpu_launches


@pytest.mark.parametrize("byte", [MAX_E8M0 + 1, 255])
def test_loader_refuses_exponents_past_the_bf16_range(byte):
    packed, scales = quantize_mxfp4(torch.randn(2, 32, 64))
    assert int(scales.max()) <= MAX_E8M0  # finite weights never quantize above it
    scales[1, 7, 1] = byte
    with pytest.raises(ValueError, match=rf"scales holds E8M0 byte {byte} at \(expert, row, group\) \(1, 7, 1\)"):
        prepare_weights(packed, scales)


def test_dequantize_as_kernel_flushes_only_the_tiniest_groups_for_bf16():
    packed, scales = quantize_mxfp4(torch.randn(1, 8, 128))
    s = scales.clone()
    s[0, 1, 0], s[0, 2, 1], s[0, 3, 2] = 0, 1, 2
    kernel = dequantize_as_kernel(packed, s, None)
    exact = dequantize_mxfp4(packed, s)
    assert (kernel[0, 1, :32] == 0).all() and (kernel[0, 2, 32:64] == 0).all()
    mask = torch.ones_like(exact, dtype=torch.bool)
    mask[0, 1, :32] = mask[0, 2, 32:64] = False
    assert torch.equal(kernel[mask], exact[mask])  # e = 2 and above: exact


def test_torch_compile_traces_bf16_activations_and_the_cpu_op_is_the_reference():
    import flashgemm

    x, b, b_scale, packed, scales, _ = _args(e=2, m=4, n=64, k=256)
    masked_m = torch.tensor([4, 2], dtype=torch.int32)

    @torch.compile(fullgraph=True)
    def step(x, b, masked_m, b_scale):
        return flashgemm.grouped_gemm_nt_masked(x, b, None, masked_m, b_scale=b_scale)

    out = step(x, b, masked_m, b_scale)
    w = dequantize_mxfp4(packed, scales).double()
    ref = x.double() @ w.transpose(1, 2)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 64)
    # bf16 rounding of the float32 sums: half an ulp, plus the 256-term sums' own rounding
    bound = 2.0**-8 * ref.abs() + 258 * 2.0**-24 * (x.double().abs() @ w.abs().transpose(1, 2))
    for e, m in enumerate((4, 2)):
        assert ((out[e, :m].double() - ref[e, :m]).abs() <= bound[e, :m]).all()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_blackwell_gpu_refuses_mxfp4_weights_by_name(monkeypatch, fp8):
    # the sm_100 kernels take no MXFP4 weights in the Hopper layout: refused before any launch
    from flashgemm import api, backend
    from flashgemm.plan import PlanCache
    from flashgemm.quant import quantize_fp8_per_token

    monkeypatch.setattr(api, "validate_device", lambda *args, **kw: 148)
    monkeypatch.setattr(backend, "for_capability", lambda cap: backend.get("sm100"))
    monkeypatch.setattr(api, "_PLANS", PlanCache())
    x, b, b_scale, *_, mm = _args()
    a_scale = None
    if fp8:
        x, a_scale = quantize_fp8_per_token(x.float())
    name = "fp8_mxfp4" if fp8 else "bf16_mxfp4"
    with pytest.raises(ValueError, match=rf"format '{name}' runs on Hopper \(sm_90\) only; this GPU's kernels "
                                         r"\(sm100\) take: "):
        api.grouped_gemm_nt_masked(x, b, torch.empty(2, 8, 256, dtype=torch.bfloat16), mm, a_scale=a_scale,
                                   b_scale=b_scale)


def test_torch_compile_traces_the_fused_swiglu_with_mxfp4_weights_and_bf16_x():
    from flashgemm.moe.activation import silu_mul_ref
    from flashgemm.moe.gate_up import InterleavedW13, gate_up_swiglu, interleave_w13
    from flashgemm.reference import grouped_gemm_nt_masked_ref

    e_count, max_m, hidden, inter = 3, 16, 256, 128
    mm = torch.tensor([0, 5, 16], dtype=torch.int32)
    x = torch.randn(e_count, max_m, hidden, dtype=torch.bfloat16)
    w13, s13 = prepare_weights(*quantize_mxfp4(torch.randn(e_count, 2 * inter, hidden) / 16))
    wi, si = interleave_w13(w13, s13)

    def f(x, wi, mm, si):
        return gate_up_swiglu(x, InterleavedW13(wi, si), mm, expected_m=8).float().sum(-1)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(x, wi, mm, si)
    gu = grouped_gemm_nt_masked_ref(x, w13, mm, b_scale=s13).to(torch.bfloat16)
    want = silu_mul_ref(gu, mm, fp8=False).float().sum(-1)
    valid = torch.arange(max_m)[None, :] < mm[:, None]
    assert torch.equal(got[valid], want[valid])
    torch.library.opcheck(torch.ops.flashgemm.gate_up_swiglu, (x, wi, mm, None, si), {"expected_m": 8},
                          test_utils=("test_schema", "test_faketensor"))


def test_fused_swiglu_plans_the_bf16_activation_build(cpu_launches, monkeypatch):
    from flashgemm.moe import gate_up
    from flashgemm.moe.gate_up import InterleavedW13, interleave_w13

    monkeypatch.setattr(gate_up, "validate_device", lambda *args, **kw: 132)
    monkeypatch.setattr(gate_up, "_PLANS", gate_up.PlanCache())
    x = torch.randn(2, 8, 256, dtype=torch.bfloat16)
    w13, s13 = prepare_weights(*quantize_mxfp4(torch.randn(2, 256, 256)))
    wi = InterleavedW13(*interleave_w13(w13, s13))
    mm = torch.full((2,), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="bfloat16 a takes no a_scale"):
        gate_up.gate_up_swiglu(x, wi, mm, x_scale=torch.ones(2, 8, 2))
    assert not cpu_launches
    h = gate_up.gate_up_swiglu(x, wi, mm)
    spec, tensors = cpu_launches[-1]
    assert spec.fmt is MX and spec.epilogue is Epilogue.SWIGLU_BF16
    assert h.dtype == torch.bfloat16 and tuple(h.shape) == (2, 8, 128) and tensors[1].dtype == torch.int8
