"""The selftest's checks of Blackwell's block-scaled formats (MXFP8, NVFP4):
random operands quantized with ``blockscale``, outputs poisoned with NaN
inside NaN guard regions, compared with the float reference
(``blockscale.grouped_gemm_nt_masked_blockscaled_ref``); and the completion
signals of both granularities, the "m_block" ones read by the polling
reference combine on SMs the GEMM leaves free. Each check returns a list of
problems in plain words (empty: passed)."""

from __future__ import annotations

import torch

from .blockscale import (
    grouped_gemm_nt_masked_blockscaled_ref, nvfp4_alpha, quantize_mxfp8, quantize_nvfp4, to_blocked_scales,
)

GUARD = 64  # elements of poison before and after every output
TOLERANCE = 1e-4  # similarity diff of a bf16 rounding of the fp32 product: ~1e-5
COMBINE_SMS = 8


def guarded(shape, dtype=torch.bfloat16):
    """(buffer, view): a NaN-filled tensor of ``shape`` inside a NaN-filled buffer."""
    n = 1
    for d in shape:
        n *= d
    buf = torch.full((n + 2 * GUARD,), float("nan"), device="cuda", dtype=dtype)
    return buf, buf[GUARD:GUARD + n].view(shape)


def guards_intact(buf) -> bool:
    return bool(buf[:GUARD].isnan().all() and buf[-GUARD:].isnan().all())


def operands(fmt: str, e_count, max_m, n, k):
    """Random a, b quantized to ``fmt`` ("mxfp8" / "nvfp4" / "mxfp8_mxfp4"): (a,
    b, the GEMM's keyword arguments, the reference's row-major scales and alpha)."""
    x = torch.randn(e_count, max_m, k, device="cuda")
    w = torch.randn(e_count, n, k, device="cuda") / k**0.5
    if fmt == "mxfp8_mxfp4":
        from .mxfp4 import blackwell_weights, quantize_mxfp4

        a, sa = quantize_mxfp8(x)
        packed, sb = quantize_mxfp4(w)
        b, b_scale = blackwell_weights(packed, sb)
        return a, b, dict(a_scale=to_blocked_scales(sa), b_scale=b_scale, alpha=None), (sa, sb, None)
    if fmt == "mxfp8":
        a, sa = quantize_mxfp8(x)
        b, sb = quantize_mxfp8(w)
        alpha = None
    else:
        a, sa, ga = quantize_nvfp4(x)
        b, sb, gb = quantize_nvfp4(w)
        alpha = nvfp4_alpha(ga, gb).cuda()
    kw = dict(a_scale=to_blocked_scales(sa), b_scale=to_blocked_scales(sb), alpha=alpha)
    return a, b, kw, (sa, sb, alpha)


def compare(out, a, b, masked_m, fmt, ref_args, buf) -> list:
    """Valid rows against the reference, rows >= m_e and the guards still NaN."""
    from .reference import similarity

    sa, sb, alpha = ref_args
    e_count, max_m, _ = out.shape
    if fmt == "mxfp8_mxfp4":  # (the checkpoint's bytes: each row's padding to 128-value pieces dropped)
        b = b[..., :a.shape[-1] // 2]
    ref = grouped_gemm_nt_masked_blockscaled_ref(a, sa, b, sb, masked_m, fmt=fmt, alpha=alpha)
    rows = masked_m.to(torch.int64).clamp(0, max_m).tolist()
    worst = max((similarity(out[e, :m].float(), ref[e, :m]) for e, m in enumerate(rows) if m), default=0.0)
    problems = []
    if not worst < TOLERANCE:
        problems.append(f"valid rows differ from the reference (similarity diff {worst:.1e})")
    if not all(bool(out[e, m:].isnan().all()) for e, m in enumerate(rows)):
        problems.append("rows >= m_e were written")
    if not guards_intact(buf):
        problems.append("memory outside out was written")
    return problems


def check_gemm(fmt: str, e_count, max_m, n, k, masked) -> list:
    from . import grouped_gemm_nt_masked

    a, b, kw, ref_args = operands(fmt, e_count, max_m, n, k)
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    buf, out = guarded((e_count, max_m, n))
    grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=max(1, max_m // 2), **kw)
    torch.cuda.synchronize()
    return compare(out, a, b, masked_m, fmt, ref_args, buf)


def check_signals(fmt: str) -> list:
    """The GEMM on all SMs but COMBINE_SMS, publishing "m_block" counters that
    the reference combine polls on a side stream; then the "expert" counters."""
    from . import alloc_signals, grouped_gemm_nt_masked, signal_layout
    from .overlap import combine_masked

    e_count, max_m, n, k, tokens = 6, 256, 512, 512, 300
    a, b, kw, ref_args = operands(fmt, e_count, max_m, n, k)
    masked_m = torch.tensor([0, 1, 128, 129, 256, 400], dtype=torch.int32, device="cuda")
    tok = torch.stack([torch.randperm(tokens)[:max_m] for _ in range(e_count)]).to(torch.int32).cuda()
    wt = torch.rand(e_count, max_m, device="cuda")
    combined = torch.zeros(tokens, n, device="cuda")
    gemm_sms = torch.cuda.get_device_properties(0).multi_processor_count - COMBINE_SMS
    layout = signal_layout(e_count, max_m, n, k, expected_m=64, num_sms=gemm_sms, fmt=fmt)
    sig = alloc_signals(layout, "cuda")
    buf, out = guarded((e_count, max_m, n))
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    ready = main.record_event()
    _, used = grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=64, num_sms=gemm_sms, dst_signals=sig, **kw)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        err = combine_masked(out, masked_m, sig, layout, tok, wt, combined, num_sms=COMBINE_SMS)
    main.wait_stream(side)
    torch.cuda.synchronize()
    problems = compare(out, a, b, masked_m, fmt, ref_args, buf)
    if used != layout:
        problems.append(f"signal_layout before the launch ({layout}) differs from the launch's ({used})")
    if not torch.equal(sig.cpu(), layout.final_values(masked_m, max_m).cpu()):
        problems.append("'m_block' counters did not reach the values signal_layout gives")
    if int(err.item()) != 0:
        problems.append(f"the polling combine reported error word {int(err.item())} (1: a wait timed out)")
    ref = torch.zeros_like(combined)
    for e, m in enumerate(masked_m.clamp(0, max_m).tolist()):
        ref.index_add_(0, tok[e, :m].long(), wt[e, :m, None] * out[e, :m].float())
    if not torch.allclose(combined, ref, rtol=1e-4, atol=1e-4):
        problems.append("the combine read rows before their signal said they were final")
    expert = signal_layout(e_count, max_m, n, k, expected_m=64, fmt=fmt, signal_granularity="expert")
    sig_e = alloc_signals(expert, "cuda")
    grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=64, dst_signals=sig_e, signal_granularity="expert", **kw)
    if not torch.equal(sig_e.cpu(), expert.final_values(masked_m, max_m).cpu()):
        problems.append("'expert' counters did not reach the values signal_layout gives")
    return problems


def checks() -> list:
    """(name, check) of every block-scaled check."""
    found = []
    for fmt, label in (("mxfp8", "MXFP8 (E8M0 per 32)"), ("nvfp4", "NVFP4 (e4m3 per 16, alpha)"),
                       ("mxfp8_mxfp4", "MXFP4 weights, MXFP8 activations")):
        found += [
            (f"{label} GEMM, odd shapes, empty / over-long / negative masked_m",
             lambda fmt=fmt: check_gemm(fmt, 5, 37, 200, 288, [0, 1, 37, 99, -4])),
            (f"{label} GEMM, one expert", lambda fmt=fmt: check_gemm(fmt, 1, 300, 256, 512, [257])),
            (f"{label} GEMM, every expert empty", lambda fmt=fmt: check_gemm(fmt, 4, 64, 128, 256, [0, 0, 0, 0])),
            (f"{label} GEMM, decode shape", lambda fmt=fmt: check_gemm(
                fmt, 16, 256, 1024, 1024, [int(x) for x in torch.randint(0, 64, (16,))])),
            (f"{label} completion signals (both granularities) with a polling combine",
             lambda fmt=fmt: check_signals(fmt)),
        ]
    return found
