"""flashgemm.compat.flashinfer: FlashInfer's argument conventions mapped onto
flashgemm's call without a copy, and what it refuses (CPU only: the launcher
is replaced by a recorder, or stops at the device check)."""

import pytest
import torch

from flashgemm.blockscale import nvfp4_alpha, quantize_mxfp8, quantize_nvfp4, to_blocked_scales
from flashgemm.blockscaled_args import validate_blockscaled_args
from flashgemm.compat import flashinfer as fi
from flashgemm.formats import Format

L, M, N, K = 3, 40, 200, 256


def _batch_last(t):
    """A batch-first (l, rows, cols) tensor as FlashInfer's (rows, cols, l) view."""
    return t.permute(1, 2, 0)


def _sf_view(blocked):
    """Our (l, rm, rk, 32, 4, 4) as FlashInfer's (32, 4, rm, 4, rk, l) view."""
    return blocked.permute(3, 4, 1, 5, 2, 0)


def mxfp8(storage_bytes=False):
    a, sa = quantize_mxfp8(torch.randn(L, M, K))
    b, sb = quantize_mxfp8(torch.randn(L, N, K))
    sa, sb = to_blocked_scales(sa), to_blocked_scales(sb)
    if storage_bytes:  # FlashInfer's tests allocate uint8 storage for every 8-bit type
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    else:
        sa, sb = sa.view(torch.float8_e8m0fnu), sb.view(torch.float8_e8m0fnu)
    out = torch.empty(L, M, N, dtype=torch.bfloat16)
    ours = dict(a=a, b=b, a_scale=sa, b_scale=sb, out=out)
    theirs = dict(lhs=(_batch_last(a), _sf_view(sa)), rhs=(_batch_last(b), _sf_view(sb)), out=_batch_last(out),
                  masked_m=torch.tensor([M, 0, 7], dtype=torch.int32))
    kw = dict(ab_dtype="float8_e4m3fn", sf_dtype="float8_e8m0fnu", c_dtype="bfloat16", sf_vec_size=32)
    return ours, theirs, kw


def nvfp4(packed=torch.uint8):
    a, sa, ga = quantize_nvfp4(torch.randn(L, M, K))
    b, sb, gb = quantize_nvfp4(torch.randn(L, N, K))
    a, b = a.view(packed), b.view(packed)
    sa, sb = to_blocked_scales(sa), to_blocked_scales(sb)
    out = torch.empty(L, M, N, dtype=torch.bfloat16)
    ours = dict(a=a, b=b, a_scale=sa, b_scale=sb, out=out, alpha=nvfp4_alpha(ga, gb))
    theirs = dict(lhs=(_batch_last(a), _sf_view(sa)), rhs=(_batch_last(b), _sf_view(sb)), out=_batch_last(out),
                  masked_m=torch.full((L,), M, dtype=torch.int32))
    kw = dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", c_dtype="bfloat16", sf_vec_size=16)
    return ours, theirs, kw


@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def launcher(a, b, out, masked_m, **kw):
        calls.append(dict(a=a, b=b, out=out, masked_m=masked_m, **kw))
        return out

    monkeypatch.setattr(fi, "_flashgemm_call", launcher)
    return calls


def _same_memory(x, y):
    """The same bytes in the same places: a view, not a copy."""
    return (x.data_ptr() == y.data_ptr() and tuple(x.shape) == tuple(y.shape) and x.stride() == y.stride()
            and x.element_size() == y.element_size())


@pytest.mark.parametrize("storage_bytes", [False, True])
def test_mxfp8_maps_onto_our_tensors_without_a_copy(recorder, storage_bytes):
    ours, theirs, kw = mxfp8(storage_bytes)
    res = fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"],
                                    sm_count=100, **kw)
    assert res is theirs["out"]
    (got,) = recorder
    for name in ("a", "b", "a_scale", "b_scale", "out"):
        assert _same_memory(got[name], ours[name]), name
    assert got["a"].dtype == got["b"].dtype == torch.float8_e4m3fn
    assert got["a_scale"].dtype == got["b_scale"].dtype == torch.float8_e8m0fnu
    assert got["a_scale"].is_contiguous() and got["out"].is_contiguous()
    assert got["masked_m"] is theirs["masked_m"] and got["num_sms"] == 100 and got["alpha"] is None
    assert got["expected_m"] is None


@pytest.mark.parametrize("packed", [torch.uint8, torch.float4_e2m1fn_x2])
def test_nvfp4_maps_with_alpha(recorder, packed):
    ours, theirs, kw = nvfp4(packed)
    fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"],
                              alpha=ours["alpha"], alpha_dtype="float32", expected_m=12, **kw)
    (got,) = recorder
    for name in ("a", "b", "a_scale", "b_scale", "out"):
        assert _same_memory(got[name], ours[name]), name
    assert got["alpha"] is ours["alpha"] and got["expected_m"] == 12 and got["num_sms"] is None
    assert got["a"].dtype == got["b"].dtype == torch.float4_e2m1fn_x2  # what the kernel is built for


def test_nvfp4_without_alpha_means_alpha_one(recorder):
    _, theirs, kw = nvfp4()
    for _ in range(2):
        fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"], **kw)
    first, second = recorder
    assert torch.equal(first["alpha"], torch.ones(L)) and first["alpha"].dtype == torch.float32
    assert second["alpha"] is first["alpha"]  # allocated once per (device, l)


@pytest.mark.parametrize("case", [mxfp8, nvfp4])
def test_mapped_views_pass_flashgemms_checks(case):
    """The mapped views are in the layouts the public call takes: its full
    checks pass and the call stops only at the device check (CPU tensors)."""
    ours, theirs, kw = case()
    alpha = ours.get("alpha")
    extra = dict(alpha=alpha, alpha_dtype="float32") if alpha is not None else {}
    a, b, out, mm, ours_kw = fi.map_arguments(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"],
                                              **kw, **extra)
    fmt = Format.NVFP4 if case is nvfp4 else Format.MXFP8
    assert validate_blockscaled_args(fmt, a, b, out, mm, ours_kw["a_scale"], ours_kw["b_scale"],
                                     ours_kw["alpha"]) == (L, M, N, K)
    with pytest.raises(ValueError, match="a must be on a CUDA device"):
        fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"], **kw, **extra)


def test_a_layout_other_than_flashinfers_is_refused_by_our_checks():
    ours, theirs, kw = mxfp8()
    l_innermost = ours["a"].permute(1, 2, 0).contiguous()  # (m, k, l) stored with l innermost
    with pytest.raises(ValueError, match=r"a must be contiguous along K \(stride 1\)"):
        fi.grouped_gemm_nt_masked((l_innermost, theirs["lhs"][1]), theirs["rhs"], theirs["out"], theirs["masked_m"],
                                  **kw)
    # a batch-first view whose experts are farther apart is a layout we take as it is
    spread = torch.zeros(L, M + 8, K, dtype=torch.float8_e4m3fn)[:, :M]
    a, *_ = fi.map_arguments((spread.permute(1, 2, 0), theirs["lhs"][1]), theirs["rhs"], theirs["out"],
                             theirs["masked_m"], **kw)
    assert _same_memory(a, spread)


# ---------------------------------------------------------------- refusals


def test_dst_signals_refused_naming_our_granularities(recorder):
    _, theirs, kw = mxfp8()
    with pytest.raises(ValueError) as info:
        fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"],
                                  dst_signals=torch.zeros(L, dtype=torch.int32), **kw)
    msg = str(info.value)
    for needle in ("'m_block'", "'expert'", "flashgemm.grouped_gemm_nt_masked(", "dst_signals=",
                   "signal_granularity=", "flashgemm.signal_layout("):
        assert needle in msg, needle
    assert recorder == []


@pytest.mark.parametrize("change,error,message", [
    (dict(ab_dtype="float8_e5m2"), ValueError, r"ab_dtype must be one of .*float8_e5m2 is not supported"),
    (dict(ab_dtype="bfloat16"), ValueError, r"ab_dtype must be one of"),
    (dict(sf_dtype="float32"), ValueError, r"sf_dtype must be one of"),
    (dict(ab_dtype="float4_e2m1fn", sf_vec_size=16), ValueError,
     r"ab_dtype='float4_e2m1fn' with sf_dtype='float8_e8m0fnu' is not a format flashgemm runs"),
    (dict(sf_vec_size=16), ValueError, r"sf_vec_size must be 32 for ab_dtype='float8_e4m3fn'"),
    (dict(sf_vec_size=True), ValueError, r"sf_vec_size must be 32"),
    (dict(c_dtype="float16"), ValueError, r"c_dtype must be 'bfloat16'"),
    (dict(alpha=torch.ones(L), alpha_dtype="float32"), ValueError, r"alpha is taken with NVFP4 .* only"),
    (dict(topk_weights=torch.ones(L, M)), ValueError, r"topk_weights: FlashInfer's combine fusion"),
    (dict(is_swap_ab=True), ValueError, r"is_swap_ab: FlashInfer's combine fusion"),
    (dict(num_ranks=2), ValueError, r"num_ranks"),
    (dict(tile_m=128), TypeError, r"unexpected keyword argument 'tile_m'"),
])
def test_refused_arguments(recorder, change, error, message):
    _, theirs, kw = mxfp8()
    kw.update(change)
    with pytest.raises(error, match=message):
        fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"], **kw)
    assert recorder == []


def test_nvfp4_alpha_needs_its_dtype_string(recorder):
    ours, theirs, kw = nvfp4()
    with pytest.raises(ValueError, match=r"alpha needs alpha_dtype='float32', got None"):
        fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"],
                                  alpha=ours["alpha"], **kw)


def test_defaults_and_tile_hints_are_accepted(recorder):
    _, theirs, kw = mxfp8()
    fi.grouped_gemm_nt_masked(theirs["lhs"], theirs["rhs"], theirs["out"], theirs["masked_m"],
                              mma_tiler_mn=(256, 128), cluster_shape_mn=(2, 1), is_swap_ab=False, num_ranks=0,
                              topk_weights=None, **kw)
    assert len(recorder) == 1


@pytest.mark.parametrize("where,bad,error,message", [
    ("lhs0", torch.zeros(M, K, L, dtype=torch.bfloat16), TypeError,
     r"lhs\[0\] must have dtype torch.uint8 or torch.float8_e4m3fn"),
    ("lhs0", torch.zeros(M, K, dtype=torch.uint8), ValueError, r"lhs\[0\] must have rank 3"),
    ("rhs1", torch.zeros(4, dtype=torch.uint8), ValueError, r"rhs\[1\] must have rank 6"),
    ("rhs1", torch.zeros(32, 4, 2, 4, 2, L, dtype=torch.float8_e4m3fn), TypeError,
     r"rhs\[1\] must have dtype torch.uint8 or torch.float8_e8m0fnu"),
    ("out", torch.zeros(M, N, dtype=torch.bfloat16), ValueError, r"out must have rank 3, \(m, n, l\)"),
    ("lhs", (torch.zeros(1),), TypeError, r"lhs must be a pair"),
])
def test_bad_tensors_named_in_flashinfers_terms(recorder, where, bad, error, message):
    _, theirs, kw = mxfp8()
    lhs, rhs, out = list(theirs["lhs"]), list(theirs["rhs"]), theirs["out"]
    if where == "lhs0":
        lhs[0] = bad
    elif where == "rhs1":
        rhs[1] = bad
    elif where == "out":
        out = bad
    else:
        lhs = bad
    with pytest.raises(error, match=message):
        fi.grouped_gemm_nt_masked(tuple(lhs) if isinstance(lhs, list) else lhs, tuple(rhs), out,
                                  theirs["masked_m"], **kw)
