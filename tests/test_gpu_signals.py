"""GPU tests of completion signals and the overlapped combine (skipped without sm_90)."""

import time

import pytest
import torch

import flashgemm
from flashgemm.config import GemmConfig
from flashgemm.device.errors import ERR_BAD_ROUTE as ERR_BAD_TOKEN, ERR_TIMEOUT
from flashgemm.sm90.heuristic import (
    DECODE_CONFIG, FP8_DECODE_CONFIG, FP8_DECODE_N64_CONFIG, FP8_MID_CONFIG, MID_CONFIG,
)
from flashgemm.overlap import combine_masked, run_gemm_and_combine
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.reference import grouped_gemm_nt_masked_ref, relative_error, similarity

from conftest import requires_hopper

pytestmark = requires_hopper

SIGNAL_CONFIGS = [
    DECODE_CONFIG,
    MID_CONFIG,
    GemmConfig(tile_m=64, tile_n=128, cluster_n=2),  # odd n-tiles below
    GemmConfig(tile_m=128, tile_n=256, cluster_n=1),
    GemmConfig(tile_m=192, tile_n=128, cluster_n=2),
]


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
@pytest.mark.parametrize("config", SIGNAL_CONFIGS, ids=lambda c: c.short_name())
def test_final_signal_values(config, granularity, seed):
    e_count, max_m, n, k = 7, 200, 328, 192  # 328: odd tile count for n64 and n128
    masked = [0, 1, 64, 65, 200, 999, -3]
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    before = flashgemm.signal_layout(e_count, max_m, n, k, config=config, signal_granularity=granularity)
    sig = flashgemm.alloc_signals(before, "cuda")
    out, layout = flashgemm.grouped_gemm_nt_masked(
        a, b, None, masked_m, config=config, dst_signals=sig, signal_granularity=granularity
    )
    assert layout == before
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), max_m))
    ref = grouped_gemm_nt_masked_ref(a, b, masked_m)
    for e, m in enumerate(masked_m.clamp(0, max_m).tolist()):
        if m:
            assert relative_error(out[e, :m].float(), ref[e, :m]) < 1e-2


def _routing(e_count, max_m, num_tokens):
    token_idx = torch.randint(0, num_tokens, (e_count, max_m), dtype=torch.int32, device="cuda")
    weight = torch.rand(e_count, max_m, device="cuda")
    return token_idx, weight


def _reference_combine(out, masked_m, token_idx, weight, num_tokens):
    ref = torch.zeros(num_tokens, out.shape[2], dtype=torch.float64, device=out.device)
    for e, m in enumerate(masked_m.clamp(0, out.shape[1]).tolist()):
        if m:
            ref.index_add_(0, token_idx[e, :m].long(), out[e, :m].double() * weight[e, :m, None].double())
    return ref


@pytest.mark.parametrize("config", [DECODE_CONFIG, MID_CONFIG], ids=lambda c: c.short_name())
def test_overlapped_combine_never_reads_stale_rows(config, seed):
    """The combine runs concurrently on the SMs the GEMM leaves free and reads
    each m-block right after its signal. Output is poisoned (NaN) before every
    launch, so a read before the rows landed shows as NaN or a wrong sum."""
    e_count, max_m, n, k, num_tokens = 16, 256, 1032, 512, 512
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = 0
    for it in range(25):
        a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        masked_m = torch.randint(0, max_m + 1, (e_count,), dtype=torch.int32, device="cuda")
        masked_m[0] = 0
        token_idx, weight = _routing(e_count, max_m, num_tokens)
        out = torch.full((e_count, max_m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        combined = torch.zeros(num_tokens, n, device="cuda")
        gemm_sms = sm_count - 16 - (it % 3) * 16
        out, err = run_gemm_and_combine(
            a, b, masked_m, token_idx, weight, combined, gemm_sms=gemm_sms, config=config, out=out,
            rows_per_item=(1, 2, 4, 8, 64)[it % 5],
        )
        torch.cuda.synchronize()
        assert int(err) == 0
        ref = _reference_combine(out, masked_m, token_idx, weight, num_tokens)
        assert not combined.isnan().any(), f"launch {it}: combine read rows before they were written"
        # same bf16 inputs, only the fp32 atomic order differs
        assert relative_error(combined, ref) < 1e-5, f"launch {it}"
        gemm_ref = grouped_gemm_nt_masked_ref(a, b, masked_m)
        rows = masked_m.tolist()
        for e, m in enumerate(rows):
            if m:
                assert relative_error(out[e, :m].float(), gemm_ref[e, :m]) < 1e-2
        tiles += sum(-(-m // config.tile_m) for m in rows) * -(-n // config.tile_n)
    assert tiles > 2000


@pytest.mark.parametrize(
    "config", [FP8_DECODE_CONFIG, FP8_DECODE_N64_CONFIG, FP8_MID_CONFIG], ids=lambda c: c.short_name()
)
def test_overlapped_combine_of_fp8_gemm(config, seed):
    """The same overlap with block-scaled fp8 operands (bf16 out): the combine
    sums only rows the GEMM has signalled, and the GEMM matches the fp32
    reference on the dequantized inputs."""
    e_count, max_m, n, k, num_tokens = 8, 192, 784, 896, 256  # 784: a partial n-tile
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for it in range(6):
        a, a_scale = quantize_fp8_per_token(torch.randn(e_count, max_m, k, device="cuda"))
        b, b_scale = quantize_fp8_per_block(torch.randn(e_count, n, k, device="cuda") / k**0.5)
        masked_m = torch.randint(0, max_m + 1, (e_count,), dtype=torch.int32, device="cuda")
        masked_m[it % e_count] = 0
        token_idx, weight = _routing(e_count, max_m, num_tokens)
        out = torch.full((e_count, max_m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        combined = torch.zeros(num_tokens, n, device="cuda")
        out, err = run_gemm_and_combine(
            a, b, masked_m, token_idx, weight, combined, gemm_sms=sm_count - 16 - (it % 2) * 24,
            config=config, out=out, a_scale=a_scale, b_scale=b_scale,
        )
        torch.cuda.synchronize()
        assert int(err) == 0
        assert not combined.isnan().any(), f"launch {it}: combine read rows before they were written"
        ref = _reference_combine(out, masked_m, token_idx, weight, num_tokens)
        assert relative_error(combined, ref) < 1e-5, f"launch {it}"
        gemm_ref = grouped_gemm_nt_masked_ref(a, b, masked_m, a_scale=a_scale, b_scale=b_scale)
        for e, m in enumerate(masked_m.tolist()):
            if m:
                assert similarity(out[e, :m].float(), gemm_ref[e, :m].float()) < 1e-3, f"expert {e}"
    # without an explicit out the helper allocates the bf16 result
    out, err = run_gemm_and_combine(
        a, b, masked_m, token_idx, weight, combined, gemm_sms=sm_count - 16, config=config,
        a_scale=a_scale, b_scale=b_scale,
    )
    assert out.dtype == torch.bfloat16 and out.shape == (e_count, max_m, n)


def test_wait_times_out_instead_of_hanging(seed):
    e_count, max_m, n = 4, 128, 256
    layout = flashgemm.signal_layout(e_count, max_m, n, 64, config=DECODE_CONFIG)
    sig = flashgemm.alloc_signals(layout, "cuda")  # no GEMM will ever signal
    out = torch.randn(e_count, max_m, n, device="cuda").to(torch.bfloat16)
    masked_m = torch.full((e_count,), 100, dtype=torch.int32, device="cuda")
    token_idx, weight = _routing(e_count, max_m, 64)
    combined = torch.zeros(64, n, device="cuda")
    t0 = time.perf_counter()
    err = combine_masked(out, masked_m, sig, layout, token_idx, weight, combined, num_sms=8, max_polls=2000)
    torch.cuda.synchronize()
    assert int(err) & ERR_TIMEOUT
    assert time.perf_counter() - t0 < 10
    assert int(combined.abs().sum()) == 0  # nothing shipped without a signal


def test_bad_token_index_is_flagged_not_written(seed):
    e_count, max_m, n, k = 2, 64, 128, 64
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16)
    masked_m = torch.tensor([64, 10], dtype=torch.int32, device="cuda")
    token_idx, weight = _routing(e_count, max_m, 32)
    token_idx[1, 3] = 32  # one past the end
    token_idx[0, 5] = -1
    guard = torch.zeros(33, n, device="cuda")
    combined = guard[:32]
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    out, err = run_gemm_and_combine(a, b, masked_m, token_idx, weight, combined,
                                    gemm_sms=sm_count - 8, config=DECODE_CONFIG)
    torch.cuda.synchronize()
    assert int(err) & ERR_BAD_TOKEN
    assert int(guard[32].abs().sum()) == 0


def test_combine_validation():
    out = torch.zeros(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    layout = flashgemm.signal_layout(2, 64, 128, 64, config=DECODE_CONFIG)
    sig = flashgemm.alloc_signals(layout, "cuda")
    mm = torch.zeros(2, dtype=torch.int32, device="cuda")
    tok, w = _routing(2, 64, 16)
    comb = torch.zeros(16, 128, device="cuda")
    with pytest.raises(TypeError, match="token_idx"):
        combine_masked(out, mm, sig, layout, tok.long(), w, comb, num_sms=4)
    with pytest.raises(ValueError, match="combined"):
        combine_masked(out, mm, sig, layout, tok, w, comb[:, :64], num_sms=4)
    with pytest.raises(ValueError, match="num_sms"):
        combine_masked(out, mm, sig, layout, tok, w, comb, num_sms=0)
    expert_layout = flashgemm.signal_layout(2, 64, 128, 64, config=DECODE_CONFIG, signal_granularity="expert")
    with pytest.raises(ValueError, match="m_block"):
        combine_masked(out, mm, sig, expert_layout, tok, w, comb, num_sms=4)
    with pytest.raises(ValueError, match="co-residency"):
        run_gemm_and_combine(torch.zeros(2, 64, 64, device="cuda", dtype=torch.bfloat16),
                             torch.zeros(2, 128, 64, device="cuda", dtype=torch.bfloat16),
                             mm, tok, w, comb, gemm_sms=200)
