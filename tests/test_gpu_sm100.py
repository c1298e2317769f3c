"""GPU correctness of the Blackwell (sm_100 / sm_103) path of the public call:
MXFP8, NVFP4 (with alpha), bf16, DeepSeek's 1x128 fp8 and MXFP4 weights
beside MXFP8 activations (kind::mxf8f6f4), with poisoned
padding rows and guard regions around ``out``, odd shapes, empty and
over-long experts, both signal granularities, CUDA-graph replay and the
FlashInfer entry point. Skipped unless a GPU of compute capability 10.x is
present."""

import pytest
import torch

import flashgemm
from flashgemm.blockscale import (
    grouped_gemm_nt_masked_blockscaled_ref, nvfp4_alpha, quantize_mxfp8, quantize_nvfp4, to_blocked_scales,
)
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.reference import grouped_gemm_nt_masked_ref, relative_error
from flashgemm.timing import capture_graph

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10),
    reason="needs a Blackwell GPU of compute capability 10.x (sm_100 / sm_103)",
)

POISON = -12345.0  # exactly representable in bf16, never produced by the data below
GUARD = 4096  # elements of poisoned memory on each side of `out`
FORMATS = ("mxfp8", "nvfp4", "bf16", "fp8_block128", "mxfp8_mxfp4")


class Case:
    """Random operands of one format, the GEMM's keyword arguments and the
    float reference of valid rows."""

    def __init__(self, fmt, e_count, max_m, n, k, masked, alpha_scale=1.0):
        self.fmt, self.max_m = fmt, max_m
        x = torch.randn(e_count, max_m, k, device="cuda")
        w = torch.randn(e_count, n, k, device="cuda") / k**0.5
        self.masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
        self.kw = {}
        if fmt == "mxfp8":
            self.a, sa = quantize_mxfp8(x)
            self.b, sb = quantize_mxfp8(w)
            self._ref_scales = (sa, sb, None)
            self.kw = dict(a_scale=to_blocked_scales(sa), b_scale=to_blocked_scales(sb))
        elif fmt == "nvfp4":
            self.a, sa, ga = quantize_nvfp4(x)
            self.b, sb, gb = quantize_nvfp4(w)
            alpha = nvfp4_alpha(ga, gb).cuda() * alpha_scale
            self._ref_scales = (sa, sb, alpha)
            self.kw = dict(a_scale=to_blocked_scales(sa), b_scale=to_blocked_scales(sb), alpha=alpha)
        elif fmt == "mxfp8_mxfp4":
            from flashgemm.mxfp4 import blackwell_weights, quantize_mxfp4

            self.a, sa = quantize_mxfp8(x)
            packed, sb = quantize_mxfp4(w)  # a checkpoint's packed blocks, rows padded to 128-value pieces
            self.b, b_scale = blackwell_weights(packed, sb)
            self._ref_b, self._ref_scales = packed, (sa, sb, None)
            self.kw = dict(a_scale=to_blocked_scales(sa), b_scale=b_scale)
        elif fmt == "bf16":
            self.a, self.b = x.bfloat16(), w.bfloat16()
        else:
            self.a, sa = quantize_fp8_per_token(x.bfloat16())
            self.b, sb = quantize_fp8_per_block(w.bfloat16())
            self.kw = dict(a_scale=sa, b_scale=sb)

    def reference(self):
        if self.fmt in ("mxfp8", "nvfp4", "mxfp8_mxfp4"):
            sa, sb, alpha = self._ref_scales
            b = self._ref_b if self.fmt == "mxfp8_mxfp4" else self.b
            return grouped_gemm_nt_masked_blockscaled_ref(self.a, sa, b, sb, self.masked_m, fmt=self.fmt,
                                                          alpha=alpha)
        return grouped_gemm_nt_masked_ref(self.a, self.b, self.masked_m, **self.kw)

    def run(self, out, **kw):
        return flashgemm.grouped_gemm_nt_masked(self.a, self.b, out, self.masked_m, **self.kw, **kw)


def _poisoned_out(e_count, max_m, n):
    numel = e_count * max_m * n
    buf = torch.full((GUARD + numel + GUARD,), POISON, device="cuda", dtype=torch.bfloat16)
    return buf, buf[GUARD:GUARD + numel].view(e_count, max_m, n)


def _check(case, out, buf, tol=1e-2):
    torch.cuda.synchronize()
    ref = case.reference()
    assert (buf[:GUARD] == POISON).all(), "write before out"
    assert (buf[-GUARD:] == POISON).all(), "write after out"
    for e, m in enumerate(case.masked_m.clamp(0, case.max_m).tolist()):
        assert (out[e, m:] == POISON).all(), f"expert {e}: rows >= m_e={m} were written"
        if m:
            valid = out[e, :m]
            assert not (valid == POISON).any(), f"expert {e}: some valid rows never written"
            assert not valid.isnan().any(), f"expert {e}: NaN in valid rows"
            err = relative_error(valid.float(), ref[e, :m])
            assert err < tol, f"expert {e} (m_e={m}): relative error {err:.2e}"


def _shape(fmt, n, k):
    """fp8 1x128 rows need N and K multiples of 16; the others N % 8 and K % 32."""
    if fmt == "fp8_block128":
        return -(-n // 16) * 16, -(-k // 16) * 16
    return n, k


SHAPES = [
    # (E, max_m, N, K, masked_m): m_e in {0, 1, max_m, > max_m, negative}
    (4, 256, 256, 512, [0, 1, 256, 1000]),
    (3, 200, 136, 288, [200, -5, 77]),  # max_m, N, K not multiples of the tiles
    (1, 64, 512, 1024, [64]),  # E = 1
    (1, 300, 256, 256, [301]),  # E = 1, over-long
    (4, 128, 128, 256, [0, 0, 0, 0]),  # every expert empty
    (6, 96, 264, 320, [96, 17, 1, 0, 0, 0]),  # trailing experts empty
    (64, 96, 256, 128, "random"),
    (2, 1, 64, 64, [1, 0]),  # max_m = 1
    (5, 384, 1032, 1056, [384, 130, 129, 128, 0]),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_matches_reference(fmt, shape, seed):
    e_count, max_m, n, k, masked = shape
    n, k = _shape(fmt, n, k)
    if masked == "random":
        masked = torch.randint(-2, max_m + 3, (e_count,)).tolist()
    case = Case(fmt, e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    assert case.run(out) is out
    _check(case, out, buf)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "bf16", "mxfp8_mxfp4"])
def test_every_heuristic_tile_and_small_grids(fmt, seed):
    from flashgemm.formats import Format
    from flashgemm.sm100.config import Sm100Config
    from flashgemm.sm100.heuristic import TILES

    case = Case(fmt, 5, 300, 520, 512, [300, 0, 1, 257, 129])
    for tile in TILES:
        cfg = Sm100Config(fmt=Format(fmt), **tile)
        for num_sms in (cfg.cluster_size, 7, None):
            buf, out = _poisoned_out(5, 300, 520)
            case.run(out, config=cfg, num_sms=num_sms)
            _check(case, out, buf)


@pytest.mark.parametrize("expected_m", [1, 64, 512, None])
@pytest.mark.parametrize("fmt", FORMATS)
def test_heuristic_choices(fmt, expected_m, seed):
    case = Case(fmt, 8, 512, 384, 256, [0, 1, 37, 128, 129, 511, 512, 600])
    buf, out = _poisoned_out(8, 512, 384)
    case.run(out, expected_m=expected_m)
    _check(case, out, buf)


def test_nvfp4_alpha_scales_each_expert(seed):
    case = Case("nvfp4", 3, 64, 128, 256, [64, 64, 64], alpha_scale=torch.tensor([1.0, 0.5, 4.0]).cuda())
    buf, out = _poisoned_out(3, 64, 128)
    case.run(out)
    _check(case, out, buf)


def test_out_allocated_when_none(seed):
    case = Case("mxfp8", 2, 128, 128, 128, [128, 50])
    out = case.run(None)
    assert out.shape == (2, 128, 128) and out.dtype == torch.bfloat16
    ref = case.reference()
    assert relative_error(out[0].float(), ref[0]) < 1e-2
    assert relative_error(out[1, :50].float(), ref[1, :50]) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granularity", ["m_block", "expert"])
def test_signals_reach_the_layout_counts(fmt, granularity, seed):
    e_count, max_m, n, k = 6, 384, 520, 256
    n, k = _shape(fmt, n, k)
    for expected_m in (4, 300):
        case = Case(fmt, e_count, max_m, n, k, [0, 1, 128, 129, 384, 500])
        before = flashgemm.signal_layout(e_count, max_m, n, k, fmt=fmt, expected_m=expected_m,
                                         signal_granularity=granularity)
        sig = flashgemm.alloc_signals(before, "cuda")
        buf, out = _poisoned_out(e_count, max_m, n)
        res, layout = case.run(out, expected_m=expected_m, dst_signals=sig, signal_granularity=granularity)
        assert res is out and layout == before
        _check(case, out, buf)
        assert torch.equal(sig.cpu(), layout.final_values(case.masked_m.cpu(), max_m))


def test_signals_with_a_polling_combine_on_the_free_sms(seed):
    from flashgemm.overlap import combine_masked

    e_count, max_m, n, k, tokens = 6, 256, 512, 512, 300
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for fmt in FORMATS:
        case = Case(fmt, e_count, max_m, n, k, [0, 1, 128, 129, 256, 400])
        tok = torch.stack([torch.randperm(tokens)[:max_m] for _ in range(e_count)]).to(torch.int32).cuda()
        wt = torch.rand(e_count, max_m, device="cuda")
        combined = torch.zeros(tokens, n, device="cuda")
        layout = flashgemm.signal_layout(e_count, max_m, n, k, fmt=fmt, expected_m=64, num_sms=sms - 8)
        sig = flashgemm.alloc_signals(layout, "cuda")
        buf, out = _poisoned_out(e_count, max_m, n)
        side = torch.cuda.Stream()
        ready = torch.cuda.current_stream().record_event()
        case.run(out, expected_m=64, num_sms=sms - 8, dst_signals=sig)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            err = combine_masked(out, case.masked_m, sig, layout, tok, wt, combined, num_sms=8)
        torch.cuda.current_stream().wait_stream(side)
        _check(case, out, buf)
        assert int(err.item()) == 0, f"{fmt}: the combine's wait timed out"
        ref = torch.zeros_like(combined)
        for e, m in enumerate(case.masked_m.clamp(0, max_m).tolist()):
            ref.index_add_(0, tok[e, :m].long(), wt[e, :m, None] * out[e, :m].float())
        torch.testing.assert_close(combined, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_graph_replay_with_new_masked_m(fmt, seed):
    e_count, max_m, n, k = 8, 192, 320, 256
    case = Case(fmt, e_count, max_m, n, k, [1] * e_count)
    layout = flashgemm.signal_layout(e_count, max_m, n, k, fmt=fmt, expected_m=64)
    sig = flashgemm.alloc_signals(layout, "cuda")
    buf, out = _poisoned_out(e_count, max_m, n)

    def step():
        sig.zero_()
        case.run(out, expected_m=64, dst_signals=sig)

    graph = capture_graph(step, calls=1)  # compiled and warmed up outside the capture
    for _ in range(4):
        case.masked_m.copy_(torch.randint(-2, max_m + 20, (e_count,), dtype=torch.int32))
        case.masked_m[-1] = 0
        out.fill_(POISON)
        graph.replay()
        _check(case, out, buf)
        assert torch.equal(sig.cpu(), layout.final_values(case.masked_m.cpu(), max_m))


def test_reused_plan_still_checks_pointers(seed):
    case = Case("mxfp8", 4, 64, 256, 256, [64, 3, 0, 17])
    out = torch.empty(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    case.run(out)
    odd = torch.empty(out.numel() + 8, device="cuda", dtype=torch.bfloat16)[1:1 + out.numel()].view_as(out)
    with pytest.raises(ValueError, match="out base address must be 16-byte aligned"):
        case.run(odd)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_flashinfer_entry_point_matches_ours(fmt, seed):
    from flashgemm.compat import flashinfer as fi

    case = Case(fmt, 4, 128, 256, 512, [128, 0, 77, 200])
    buf, out = _poisoned_out(4, 128, 256)
    ab, sf, vec = ("float8_e4m3fn", "float8_e8m0fnu", 32) if fmt == "mxfp8" else ("float4_e2m1fn", "float8_e4m3fn", 16)
    extra = dict(alpha=case.kw["alpha"], alpha_dtype="float32") if fmt == "nvfp4" else {}
    sfa = case.kw["a_scale"].permute(3, 4, 1, 5, 2, 0)
    sfb = case.kw["b_scale"].permute(3, 4, 1, 5, 2, 0)
    fi.grouped_gemm_nt_masked((case.a.permute(1, 2, 0), sfa), (case.b.permute(1, 2, 0), sfb), out.permute(1, 2, 0),
                              case.masked_m, ab_dtype=ab, sf_dtype=sf, c_dtype="bfloat16", sf_vec_size=vec, **extra)
    _check(case, out, buf)
