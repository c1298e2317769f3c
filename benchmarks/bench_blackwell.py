#!/usr/bin/env python3
"""Blackwell (sm_100 / sm_103) benchmark of the masked grouped GEMM on the
MoE cases, in MXFP8, NVFP4, bf16 and DeepSeek's 1x128 fp8, against the copy
bandwidth measured in the same run and FlashInfer's masked block-scaled GEMM
(``flashinfer.gemm.grouped_gemm_nt_masked``) when ``flashinfer`` imports.

Every implementation runs on the same data (FlashInfer gets zero-copy
batch-last views of our tensors). Times are medians of CUDA-event timings of
CUDA-graph replays after warm-up (``common.time_graph``). Bytes count what
the op must move at least: the weights and weight scales of non-empty
experts, the valid rows of a and their scales, and the valid output rows;
FLOPs count valid rows only.

    python benchmarks/bench_blackwell.py --expected        # roofline table (markdown), no GPU needed
    python benchmarks/bench_blackwell.py                   # every case, mxfp8 nvfp4 bf16
    python benchmarks/bench_blackwell.py --formats nvfp4 --cases dsv3-ep8-down --json out.json

On a GPU other than sm_100 / sm_103 it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's flashgemm; common.py beside this file

FORMATS = ("mxfp8", "nvfp4", "bf16", "fp8_block128")
DEFAULT_FORMATS = ("mxfp8", "nvfp4", "bf16")
# B200 (HGX, 1000 W), dense tensor-core peaks and HBM3e bandwidth, from NVIDIA's
# published figures as listed at https://glennklockwood.com/garden/processors/B200
# (BF16 2.25, FP8 4.5, FP4 9 PFLOPS dense; 8 TB/s); 148 SMs.
B200 = {"hbm_GBps": 8000.0, "TFLOPS": {"bf16": 2250.0, "fp8_block128": 4500.0, "mxfp8": 4500.0, "nvfp4": 9000.0}}
FLASHINFER_ARGS = {  # format -> (ab_dtype, sf_dtype, sf_vec_size) of FlashInfer's call
    "mxfp8": ("float8_e4m3fn", "float8_e8m0fnu", 32),
    "nvfp4": ("float4_e2m1fn", "float8_e4m3fn", 16),
}


# ---- the roofline model (no GPU) ------------------------------------------------
def operand_bytes(fmt: str, rows: int, k: int, weights: bool) -> float:
    """Bytes of ``rows`` rows of K elements and their scales."""
    if fmt == "bf16":
        return rows * k * 2
    if fmt == "fp8_block128":
        scales = math.ceil(rows / 128) * math.ceil(k / 128) * 4 if weights else rows * math.ceil(k / 128) * 4
        return rows * k + scales
    if fmt == "mxfp8":
        return rows * k + rows * math.ceil(k / 32)
    if fmt == "nvfp4":
        return rows * k / 2 + rows * math.ceil(k / 16) + (4 if weights else 0)  # (+ alpha)
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def traffic(fmt: str, rows_per_expert, n: int, k: int):
    """(bytes, FLOPs) of one call: weights of non-empty experts, valid rows of a, bf16 output."""
    rows = [int(m) for m in rows_per_expert]
    live = sum(1 for m in rows if m > 0)
    total = sum(rows)
    bytes_ = live * operand_bytes(fmt, n, k, True) + operand_bytes(fmt, total, k, False) + total * n * 2
    return bytes_, 2.0 * total * n * k


def expected_us(fmt, rows_per_expert, n, k, hbm_gbps, tflops):
    """(time at the bandwidth, time at the peak rate, the larger) in microseconds."""
    b, f = traffic(fmt, rows_per_expert, n, k)
    t_mem, t_math = b / hbm_gbps / 1e3, f / tflops / 1e6
    return t_mem, t_math, max(t_mem, t_math)


def expected_table(cases, formats=FORMATS, machine=B200) -> str:
    """Markdown: the roofline time of every case and format with every expert
    holding expected_m rows (the mean of the cases' draw)."""
    lines = [
        f"| case | E | expected_m | N | K | format | MB moved | GFLOP | us at {machine['hbm_GBps'] / 1000:g} TB/s "
        "| us at peak | expected us | bound |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for case in cases:
        rows = [min(case["expected_m"], case["max_m"])] * case["E"]
        for fmt in formats:
            b, f = traffic(fmt, rows, case["N"], case["K"])
            t_mem, t_math, t = expected_us(fmt, rows, case["N"], case["K"], machine["hbm_GBps"],
                                           machine["TFLOPS"][fmt])
            lines.append(
                f"| {case['name']} | {case['E']} | {case['expected_m']} | {case['N']} | {case['K']} | {fmt} "
                f"| {b / 1e6:.1f} | {f / 1e9:.1f} | {t_mem:.1f} | {t_math:.1f} | {t:.1f} "
                f"| {'memory' if t_mem >= t_math else 'compute'} |"
            )
    return "\n".join(lines)


# ---- the run (Blackwell GPU) ------------------------------------------------------
def blackwell_gpu():
    """(name, None) of an sm_100 / sm_103 GPU, or (None, why not)."""
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA GPU found"
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cap not in ((10, 0), (10, 3)):
        return None, f"found {name} (sm_{cap[0]}{cap[1]}); this benchmark needs sm_100 or sm_103 (Blackwell)"
    return name, None


def copy_gbps():
    """Device-to-device copy of 1 GiB, bytes read plus written per second."""
    import torch
    from common import time_fn

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / time_fn(lambda: y.copy_(x), warmup=3, reps=20) / 1e6


def operands(fmt, case, seed):
    """(a, b, the GEMM's keyword arguments) of a case, quantized to ``fmt``."""
    import torch
    from common import case_operands

    if fmt in ("bf16", "fp8_block128"):
        a, b, sa, sb = case_operands(case, seed, fp8=fmt == "fp8_block128")
        return a, b, ({} if sa is None else dict(a_scale=sa, b_scale=sb))
    from flashgemm.blockscale import nvfp4_alpha, quantize_mxfp8, quantize_nvfp4, to_blocked_scales

    a, b, _, _ = case_operands(case, seed)
    if fmt == "mxfp8":
        (a, sa), (b, sb) = quantize_mxfp8(a), quantize_mxfp8(b)
        return a, b, dict(a_scale=to_blocked_scales(sa), b_scale=to_blocked_scales(sb))
    (a, sa, ga), (b, sb, gb) = quantize_nvfp4(a), quantize_nvfp4(b)
    alpha = nvfp4_alpha(ga, gb).to(torch.float32)
    return a, b, dict(a_scale=to_blocked_scales(sa), b_scale=to_blocked_scales(sb), alpha=alpha)


def flashinfer_call(fmt, a, b, kw, masked_m, out):
    """FlashInfer's masked GEMM on the same bytes (batch-last views, no copy), or a note why not."""
    if fmt not in FLASHINFER_ARGS:
        return None, "FlashInfer has no masked GEMM for this format"
    try:
        from flashinfer.gemm import grouped_gemm_nt_masked as fi_gemm
    except Exception as exc:  # noqa: BLE001 - any import failure means: skipped, with the reason
        return None, f"flashinfer not importable ({type(exc).__name__}: {exc})"
    import torch

    ab, sf, vec = FLASHINFER_ARGS[fmt]
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 - its tests pass uint8 storage
    sfa = as_bytes(kw["a_scale"]).permute(3, 4, 1, 5, 2, 0)
    sfb = as_bytes(kw["b_scale"]).permute(3, 4, 1, 5, 2, 0)
    extra = dict(alpha=kw["alpha"], alpha_dtype="float32") if "alpha" in kw else {}

    def call():
        fi_gemm((as_bytes(a).permute(1, 2, 0), sfa), (as_bytes(b).permute(1, 2, 0), sfb), out.permute(1, 2, 0),
                masked_m, ab_dtype=ab, sf_dtype=sf, c_dtype="bfloat16", sf_vec_size=vec, **extra)

    return call, None


def run_case(case, seed, fmt, copy, reps):
    import torch

    import flashgemm
    from common import draw_masked_m, time_graph
    from flashgemm.reference import similarity

    a, b, kw = operands(fmt, case, seed)
    masked_m = draw_masked_m(case, seed).cuda()
    rows = masked_m.clamp(0, case["max_m"]).tolist()
    out = torch.empty(case["E"], case["max_m"], case["N"], device="cuda", dtype=torch.bfloat16)
    ours = lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=case["expected_m"], **kw)  # noqa: E731
    ms = time_graph(ours, reps=reps)
    bytes_, flops = traffic(fmt, rows, case["N"], case["K"])
    _, _, floor_us = expected_us(fmt, rows, case["N"], case["K"], copy, B200["TFLOPS"][fmt])
    row = dict(case=case["name"], format=fmt, us=ms * 1e3, GBps=bytes_ / ms / 1e6, TFLOPS=flops / ms / 1e9,
               pct_copy=100 * bytes_ / ms / 1e6 / copy, floor_us=floor_us)
    fi, note = flashinfer_call(fmt, a, b, kw, masked_m, torch.empty_like(out))
    if fi is not None:
        try:
            fi_ms = time_graph(fi, reps=reps)
            fi_out = torch.empty_like(out)
            flashinfer_call(fmt, a, b, kw, masked_m, fi_out)[0]()
            worst = max((similarity(fi_out[e, :m].float(), out[e, :m].float()) for e, m in enumerate(rows) if m),
                        default=0.0)
            row.update(flashinfer_us=fi_ms * 1e3, vs_flashinfer=fi_ms / ms, flashinfer_diff=worst)
            if not worst < 1e-3:  # a misread layout shows here before it shows in the times
                note = f"FlashInfer's valid rows differ from ours (similarity diff {worst:.1e})"
        except Exception as exc:  # noqa: BLE001 - a peer failure is a note, not the end of the run
            note = f"FlashInfer failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    row["note"] = note or ""
    return row


def markdown(rows, copy, gpu) -> str:
    lines = [f"{gpu}: copy {copy:.0f} GB/s (read + write); floor = max(bytes at the copy rate, FLOPs at B200 peak)", "",
             "| case | format | us | GB/s | % of copy | TFLOPS | floor us | FlashInfer us | FlashInfer / ours | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fi = (f"{r['flashinfer_us']:.1f} | {r['vs_flashinfer']:.2f}x" if "flashinfer_us" in r else " | ")
        lines.append(f"| {r['case']} | {r['format']} | {r['us']:.1f} | {r['GBps']:.0f} | {r['pct_copy']:.0f}% "
                     f"| {r['TFLOPS']:.0f} | {r['floor_us']:.1f} | {fi} | {r['note']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from common import cases_by_name, load_cases

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--expected", action="store_true", help="print the roofline table (markdown) and exit")
    p.add_argument("--formats", nargs="+", choices=FORMATS,
                   help=f"default: {' '.join(DEFAULT_FORMATS)} (with --expected: all of {', '.join(FORMATS)})")
    p.add_argument("--cases", nargs="+", help="case names of benchmarks/moe_cases.json (default: all)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    cases = load_cases()["cases"]
    picked = cases_by_name(args.cases, p.error) if args.cases else list(enumerate(cases))
    if args.expected:
        print(expected_table([c for _, c in picked], args.formats or FORMATS))
        return 0
    gpu, why = blackwell_gpu()
    if gpu is None:
        print(f"bench_blackwell: {why}. Nothing was timed; `--expected` prints the roofline table anywhere.")
        return 2
    copy = copy_gbps()
    rows = []
    for seed, case in picked:
        for fmt in args.formats or DEFAULT_FORMATS:
            rows.append(run_case(case, seed, fmt, copy, args.reps))
            print(markdown(rows[-1:], copy, gpu).splitlines()[-1], flush=True)
    print()
    print(markdown(rows, copy, gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, copy_GBps=copy, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
