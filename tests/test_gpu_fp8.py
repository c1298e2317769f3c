"""GPU correctness of the block-scaled fp8 masked grouped GEMM (skipped without an sm_90 GPU).

Each case quantizes fresh random bf16 data with the package's helpers and
compares with the float32 product of the *dequantized* operands, per expert on
valid rows, with DeepGEMM's similarity measure (< 1e-3 required).
"""

import pytest
import torch

import flashgemm
from flashgemm.config import GemmConfig, Promotion
from flashgemm.formats import Format
from flashgemm.jit import cache
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.reference import grouped_gemm_nt_masked_ref, similarity
from flashgemm.sm90.heuristic import FP8_MID_N64_CONFIG, reachable_specs

from conftest import requires_hopper

pytestmark = requires_hopper

POISON = -12345.0  # exactly representable in bf16
GUARD = 4096


def _fp8_case(e_count, max_m, n, k, masked, *, m_major=True, power_of_two=False):
    dev = "cuda"
    # rows of different magnitudes, so the per-row scales matter
    x = torch.randn(e_count, max_m, k, device=dev) * torch.rand(e_count, max_m, 1, device=dev).mul(8).exp2()
    w = torch.randn(e_count, n, k, device=dev) / k**0.5
    a, a_scale = quantize_fp8_per_token(x, power_of_two=power_of_two, m_major=m_major)
    b, b_scale = quantize_fp8_per_block(w, power_of_two=power_of_two)
    masked_m = torch.tensor(masked, dtype=torch.int32, device=dev)
    return a, a_scale, b, b_scale, masked_m


def _poisoned_out(e_count, max_m, n):
    numel = e_count * max_m * n
    buf = torch.full((GUARD + numel + GUARD,), POISON, device="cuda", dtype=torch.bfloat16)
    return buf, buf[GUARD : GUARD + numel].view(e_count, max_m, n)


def _check(a, a_scale, b, b_scale, masked_m, out, buf):
    ref = grouped_gemm_nt_masked_ref(a, b, masked_m, a_scale=a_scale, b_scale=b_scale)
    max_m = out.shape[1]
    torch.cuda.synchronize()
    assert (buf[:GUARD] == POISON).all(), "write before out"
    assert (buf[-GUARD:] == POISON).all(), "write after out"
    for e, m in enumerate(masked_m.clamp(0, max_m).tolist()):
        assert (out[e, m:] == POISON).all(), f"expert {e}: rows >= m_e={m} were written"
        if m:
            valid = out[e, :m]
            assert not (valid == POISON).any(), f"expert {e}: some valid rows never written"
            assert not valid.isnan().any(), f"expert {e}: NaN"
            diff = similarity(valid.float(), ref[e, :m])
            assert diff < 1e-3, f"expert {e} (m_e={m}): similarity diff {diff:.2e}"


SHAPES = [
    # (E, max_m, N, K, masked_m): m_e in {0, 1, max_m, > max_m, negative}
    (4, 256, 256, 7168, [0, 1, 256, 1000]),
    (3, 200, 384, 2880, [200, -5, 77]),  # K with a partial last scale block
    (1, 64, 512, 2048, [64]),  # E = 1
    (32, 96, 256, 512, "random"),
    (2, 1, 128, 128, [1, 0]),  # max_m = 1
    (5, 130, 272, 1040, [130, 129, 128, 64, 0]),  # N not a multiple of 128 or of the tile
    # two and three k-tiles: Promotion.OVERLAPPED's prologue and tails alone
    (2, 70, 256, 256, [70, 33]),
    (3, 64, 128, 384, [64, 1, 0]),
]

# every fp8 configuration the heuristic can pick (once each), and others
FP8_HEURISTIC_CONFIGS = tuple(dict.fromkeys(s.config for s in reachable_specs(Format.FP8_BLOCK128)))
CONFIGS = FP8_HEURISTIC_CONFIGS + (
    GemmConfig(tile_m=128, tile_n=192),  # spans scale blocks
    # two part chains per k-tile, on one consumer warpgroup
    GemmConfig(tile_m=64, tile_n=128, promotion=Promotion.TWO_PARTS),
    GemmConfig(tile_m=64, tile_n=64, cluster_n=2),
    GemmConfig(tile_m=192, tile_n=64),
    # 128x64 with two product sets on single-CTA clusters (the heuristic no
    # longer picks it on one SM, where either width fills every round)
    FP8_MID_N64_CONFIG.replace(cluster_n=1),
)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short_name())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_fp8_matches_reference(config, shape, seed):
    e_count, max_m, n, k, masked = shape
    if masked == "random":
        masked = torch.randint(-2, max_m + 3, (e_count,)).tolist()
    a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    res = flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=config
    )
    assert res is out
    _check(a, a_scale, b, b_scale, masked_m, out, buf)


@pytest.mark.parametrize("m_major", [True, False], ids=["m_major", "kblock_major"])
@pytest.mark.parametrize("power_of_two", [False, True], ids=["fp32_scales", "ue8m0_scales"])
def test_fp8_scale_layouts_and_pow2(m_major, power_of_two, seed):
    a, a_scale, b, b_scale, masked_m = _fp8_case(
        6, 160, 512, 7168, [160, 3, 0, 129, 64, 200], m_major=m_major, power_of_two=power_of_two
    )
    assert (a_scale.stride(1) == 1) == m_major
    buf, out = _poisoned_out(6, 160, 512)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, expected_m=80)
    _check(a, a_scale, b, b_scale, masked_m, out, buf)


def test_fp8_heuristic_allocates_and_never_recompiles(seed):
    a, a_scale, b, b_scale, masked_m = _fp8_case(8, 64, 256, 1024, [64] * 8)
    out = flashgemm.grouped_gemm_nt_masked(a, b, None, masked_m, a_scale=a_scale, b_scale=b_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 64, 256)
    before = cache.compile_count
    for _ in range(3):
        masked_m.copy_(torch.randint(0, 65, (8,), dtype=torch.int32))
        buf, out = _poisoned_out(8, 64, 256)
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale)
        _check(a, a_scale, b, b_scale, masked_m, out, buf)
    assert cache.compile_count == before


def test_fp8_signals_final_values(seed):
    a, a_scale, b, b_scale, masked_m = _fp8_case(4, 192, 384, 512, [192, 0, 65, 1])
    layout = flashgemm.signal_layout(4, 192, 384, 512, fp8=True)
    sig = flashgemm.alloc_signals(layout, device="cuda")
    out, got = flashgemm.grouped_gemm_nt_masked(
        a, b, None, masked_m, a_scale=a_scale, b_scale=b_scale, dst_signals=sig
    )
    assert got == layout
    torch.cuda.synchronize()
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), 192))
