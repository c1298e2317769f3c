"""The MXFP4-weight GEMM (``Format.FP8_MXFP4``) without a GPU: its build for
sm_90a and what the PTX must hold, its configuration rules and heuristic,
the checks of its arguments, and the layer's MXFP4 weights. Results on the
GPU: tests/test_gpu_mxfp4.py."""

import re

import pytest
import torch

from flashgemm.config import Epilogue, GemmConfig, KernelSpec, Promotion, Tail, TileOrder
from flashgemm.formats import Format
from flashgemm.mxfp4 import dequantize_as_kernel, dequantize_mxfp4, prepare_weights, quantize_mxfp4
from flashgemm.quant import quantize_fp8_per_token
from flashgemm.sm90 import heuristic as H
from flashgemm.sm90.limits import (
    CONVERTER_REGS, SMEM_BYTES, check_config, consumer_regs, resolved_stages, smem_bytes, stage_bytes,
)

MX = Format.FP8_MXFP4
DECODE = GemmConfig(tile_m=64, tile_n=128, cluster_n=2, order=TileOrder.DYNAMIC, a_chunk_rows=32, l2_hints=True)


# built by the listing run when one runs (conftest.kernel_ptx)
PTX_SPECS = (KernelSpec(DECODE, MX, "m_block"),)


@pytest.fixture(scope="module")
def decode_ptx(kernel_ptx):
    return kernel_ptx(PTX_SPECS[0])


def test_ptx_converts_with_table_lookups_and_hands_over_by_mbarrier(decode_ptx):
    ptx = decode_ptx
    # e4m3 x e4m3 wgmma: the weights reach the tensor cores as e4m3
    assert re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)
    # per slot a team of 2 warps (64 threads) converts all 128 x 128 values:
    # 8 groups of 32 per thread, 4 words of 8 each, 2 prmt per word
    assert ptx.count("prmt.b32") == 8 * 4 * 2
    # each group leaves in two 16-byte shared stores at its swizzled place
    assert ptx.count("st.shared.v4.b32") >= 8 * 2
    # and takes its shifted table (two words) from the team's copy in shared
    # memory, one load per group; the copy is written once per launch
    assert ptx.count("ld.shared.v2.b32") >= 8
    # the team's barrier (a run-time id, 64 threads), the async-proxy fence before the handover
    assert re.search(r"bar\.sync\s+%r\d+, 64;", ptx)
    assert "fence.proxy.async.shared::cta" in ptx
    # the packed tile and its exponents come by TMA, no scale cp.async
    assert "cp.async.ca.shared.global" not in ptx
    # the converters lower their registers, the consumers raise theirs
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{CONVERTER_REGS};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumer_regs(1, 2)};", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx  # no spills


def test_reachable_specs_build_rules_and_fit():
    specs = H.reachable_specs(MX)
    assert specs and all(s.fmt is MX for s in specs)
    assert len(specs) == len({s.name() for s in specs})
    for spec in specs:
        cfg = check_config(spec.config, MX, spec.epilogue)
        assert cfg.tile_m in (64, 128) and cfg.tile_n >= 128, spec.name()
        stages = resolved_stages(cfg, MX, spec.epilogue)
        assert stages >= 4, spec.name()  # each slot converted in place: the ring is the conversion's depth
        assert smem_bytes(cfg, MX, spec.epilogue) <= SMEM_BYTES, spec.name()
    # the fp8 picks, adapted: every fp8 spec has its MXFP4 counterpart, and no other
    adapted = {(H.weight_format_config(s.config, MX), s.signal_mode, s.epilogue)
               for s in H.reachable_specs(Format.FP8_BLOCK128)}
    assert adapted == {(s.config, s.signal_mode, s.epilogue) for s in specs}


@pytest.mark.parametrize("m", [1, 8, 32, 64, 96, 200, 512, 4096])
@pytest.mark.parametrize("n, k", [(4096, 7168), (7168, 2048), (5760, 2880), (2880, 2880)])
def test_heuristic_picks_stay_within_reachable_specs(m, n, k):
    from flashgemm.sm90.launch import resolve_config

    reachable = {(s.config, s.epilogue) for s in H.reachable_specs(MX)}
    for sms in (1, 2, 132):
        for epi in (Epilogue.STORE, Epilogue.COMBINE):
            cfg = resolve_config(None, MX, m, 4096, n, k, sms, 32, epilogue=epi)
            assert (cfg, epi) in reachable, (m, n, k, sms, cfg)
        if sms >= 2:
            cfg = resolve_config(None, MX, m, 4096, n, k, sms, 32, epilogue=Epilogue.SWIGLU_FP8)
            assert (cfg, Epilogue.SWIGLU_FP8) in reachable


def test_packed_tiles_take_no_shared_memory_of_their_own():
    """The packed B lands in the slot's B and is converted in place: an
    MXFP4 slot is the fp8 slot plus its E8M0 bytes, so the ring is as deep
    as the fp8 kernel's, less what the exponents take."""
    for tm, tn in ((64, 128), (128, 128), (128, 192)):
        cfg = GemmConfig(tile_m=tm, tile_n=tn)
        assert stage_bytes(cfg, MX) == stage_bytes(cfg, Format.FP8_BLOCK128) + tn * 128 // 32
        assert resolved_stages(cfg, MX) in (resolved_stages(cfg, Format.FP8_BLOCK128),
                                            resolved_stages(cfg, Format.FP8_BLOCK128) - 1)


def test_config_rules_name_the_field():
    with pytest.raises(ValueError, match=r"config.tile_m must be 64 or 128 with fp8_mxfp4"):
        check_config(GemmConfig(tile_m=192, tile_n=64), MX)
    with pytest.raises(ValueError, match=r"config.promotion must not be OVERLAPPED with tile_m=128"):
        check_config(GemmConfig(tile_m=128, promotion=Promotion.OVERLAPPED), MX)
    # any ring depth: each slot is converted in place, so only shared memory bounds it
    check_config(GemmConfig(tile_m=64, stages=6), MX)
    check_config(GemmConfig(tile_m=64, stages=8), MX)
    with pytest.raises(ValueError, match=r"config uses \d+ bytes of shared memory"):
        check_config(GemmConfig(tile_m=64, stages=9), MX)
    assert H.weight_format_config(GemmConfig(tile_m=192, tile_n=64, tail=Tail.BALANCE), MX).tile_m == 128
    assert H.weight_format_config(GemmConfig(tile_m=64, tile_n=64), MX).tile_n == 128
    assert H.weight_format_config(GemmConfig(promotion=Promotion.OVERLAPPED), MX).promotion is Promotion.SERIAL


def _args(e=2, m=8, n=256, k=512):
    a, a_scale = quantize_fp8_per_token(torch.randn(e, m, k))
    packed, scales = quantize_mxfp4(torch.randn(e, n, k))
    b, b_scale = prepare_weights(packed, scales)
    return a, a_scale, b, b_scale, packed, scales, torch.full((e,), m, dtype=torch.int32)



def test_format_follows_from_the_dtypes_and_the_kernel_gets_bytes(cpu_launches):
    from flashgemm import api

    a, a_scale, b, b_scale, *_, mm = _args()
    out = torch.empty(2, 8, 256, dtype=torch.bfloat16)
    api.grouped_gemm_nt_masked(a, b, out, mm, a_scale=a_scale, b_scale=b_scale.view(torch.float8_e8m0fnu))
    spec, tensors = cpu_launches[-1]
    assert spec.fmt is MX
    assert tensors[1].dtype == torch.int8 and tensors[6].dtype == torch.uint8  # b, b_scale as bytes


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "b": t["packed"]}, r"go to the Hopper kernel in its own layout: pass b, b_scale = "
                                        r"flashgemm.mxfp4.prepare_weights"),
    (lambda t: {**t, "b_scale": t["scales"]}, r"b_scale must be stored N contiguous"),
    (lambda t: {**t, "b_scale": None}, r"MXFP4 weights need b_scale"),
    (lambda t: {**t, "b_scale": t["b_scale"][:, :, :-1]}, r"b_scale must have shape \(E, N, K/32\)"),
    (lambda t: {**t, "b": t["b"][:, :, :-16]}, r"b.shape\[2\] must be K/2 = 256"),
    (lambda t: {**t, "b": t["b"][:, :-8], "b_scale": t["b_scale"][:, :-8]},
     r"N \(b.shape\[1\]\) must be a positive multiple of 16"),
    (lambda t: {**t, "a_scale": None}, r"float8_e4m3fn a needs a_scale"),
])
def test_bad_arguments_are_refused_by_name(cpu_launches, change, message):
    from flashgemm import api

    a, a_scale, b, b_scale, packed, scales, mm = _args()
    t = change({"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "packed": packed, "scales": scales})
    out = torch.empty(2, 8, 256, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=message):
        api.grouped_gemm_nt_masked(t["a"], t["b"], out, mm, a_scale=t["a_scale"], b_scale=t["b_scale"])
    assert not cpu_launches


def test_dequantize_as_kernel_flushes_only_groups_past_the_fold():
    packed, scales = quantize_mxfp4(torch.randn(1, 128, 256))
    s = scales.clone()
    top = int(s[0, :, 0:4].max())
    s[0, 3, 1] = top - 14  # 14 below the tile's largest: exact (d = -8)
    s[0, 4, 2] = top - 15  # 15 below: flushed
    kernel = dequantize_as_kernel(packed, s, 128)
    exact = dequantize_mxfp4(packed, s)
    assert torch.equal(kernel[0, 3], exact[0, 3])
    assert (kernel[0, 4, 64:96] == 0).all() and (exact[0, 4, 64:96] != 0).any()
    mask = torch.ones_like(exact, dtype=torch.bool)
    mask[0, 4, 64:96] = False
    assert torch.equal(kernel[mask], exact[mask])


def test_layer_takes_prepared_mxfp4_weights_and_keeps_their_rows_paired():
    from flashgemm.moe.gate_up import deinterleave_w13
    from flashgemm.moe.layer import ActivationPath, MaskedExperts

    b13, s13 = prepare_weights(*quantize_mxfp4(torch.randn(4, 256, 512)))
    b2, s2 = prepare_weights(*quantize_mxfp4(torch.randn(4, 512, 128)))
    layer = MaskedExperts(b13, b2, w13_scale=s13, w2_scale=s2)
    assert layer.activation is ActivationPath.FUSED and layer.fp8 and layer.mxfp4
    assert (layer.hidden, layer.intermediate) == (512, 128)
    w, s = layer.w13_interleaved
    assert s.stride(1) == 1  # still N contiguous after the row interleave
    back_w, back_s = deinterleave_w13(w, s)
    assert torch.equal(back_w, b13) and torch.equal(back_s, s13)
    with pytest.raises(TypeError, match="w13 and w2 must share a dtype"):
        MaskedExperts(b13, torch.zeros(4, 512, 128, dtype=torch.float8_e4m3fn), w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, H\] and w2 \[E, H, I\] \(MXFP4"):
        MaskedExperts(b13, b2[:, :256], w13_scale=s13, w2_scale=s2[:, :256])


def test_torch_compile_traces_mxfp4_weights_and_the_cpu_op_is_the_reference():
    import flashgemm

    a, a_scale, b, b_scale, packed, scales, _ = _args(e=2, m=4, n=64, k=256)
    masked_m = torch.tensor([4, 2], dtype=torch.int32)

    @torch.compile(fullgraph=True)
    def step(a, b, masked_m, a_scale, b_scale):
        return flashgemm.grouped_gemm_nt_masked(a, b, None, masked_m, a_scale=a_scale, b_scale=b_scale)

    out = step(a, b, masked_m, a_scale, b_scale)
    a_deq = a.double() * a_scale.double().repeat_interleave(128, dim=2)
    ref = a_deq @ dequantize_mxfp4(packed, scales).double().transpose(1, 2)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 64)
    # bf16 rounding of the float32 sums: half an ulp, plus the 256-term sums' own rounding
    bound = 2.0**-8 * ref.abs() + 258 * 2.0**-24 * (a_deq.abs() @ dequantize_mxfp4(packed, scales).abs().double()
                                                      .transpose(1, 2))
    assert ((out[0].double() - ref[0]).abs() <= bound[0]).all()
    assert ((out[1, :2].double() - ref[1, :2]).abs() <= bound[1, :2]).all()
    assert (out[1, 2:] == 0).all()  # (rows >= m_e of a new output are zero on the CPU)
