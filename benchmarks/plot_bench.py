#!/usr/bin/env python3
"""Percent-of-roofline plot per case and implementation, from bench.py JSON.

The roofline time of a case is max(effective bytes / copy bandwidth, valid-row
FLOPs / dense matrix-product rate): the copy bandwidth is the one bench.py
measured in the same run; the dense rates (bf16 mm, fp8 rowwise mm, 8192^3) are
the ones bench.py measured in the run too (its JSON "limits"), or for older JSON
the ones listed in the case file for the same H100 model. DeepGEMM's masked
kernels have two kinds of bars: timed in the run (when bench.py could import
``deep_gemm``) and, for fp8, the times listed in the case file.

    python benchmarks/plot_bench.py bench.json --out roofline.png
"""

from __future__ import annotations

import argparse
import json
import os

CASES_FILE = os.path.join(os.path.dirname(__file__), "moe_cases.json")

# (label, dtype of the rows it reads, key in row["ms"] or "deepgemm")
SERIES = [
    ("flashgemm bf16", "bf16", "flashgemm"),
    ("torch _grouped_mm packed (bf16)", "bf16", "torch_grouped_mm_packed"),
    ("Triton masked (bf16)", "bf16", "triton_masked"),
    ("QuACK varlen-M (bf16)", "bf16", "quack_varlen"),
    ("DeepGEMM masked (bf16)", "bf16", "deepgemm_masked"),
    ("flashgemm fp8 (1x128/128x128)", "fp8", "flashgemm"),
    ("torch _scaled_grouped_mm packed (fp8 rowwise)", "fp8", "torch_scaled_grouped_mm_packed"),
    ("Triton masked fp8 (1x128/128x128)", "fp8", "triton_masked"),
    ("DeepGEMM masked fp8 (1x128/128x128)", "fp8", "deepgemm_masked"),
    ("DeepGEMM fp8, listed time", "fp8", "deepgemm"),
]


def roofline_percent(row, ms, copy_gbps, peak_tflops):
    """Percent of the roofline reached by a run of ``ms`` milliseconds."""
    bound_ms = max(row["eff_bytes"] / (copy_gbps * 1e6), row["flops"] / (peak_tflops * 1e9))
    return 100.0 * bound_ms / ms


def series_values(rows, spec, copy_gbps, run_limits=None):
    """Percent of roofline per series and case; the dense rates measured in the
    run (bench.py's JSON "limits") when present, else those of the case file."""
    if run_limits:
        peak = {"bf16": run_limits["bf16_mm_TFLOPS"], "fp8": run_limits["fp8_rowwise_mm_TFLOPS"]}
    else:
        listed = spec["limits_h100_2026_11_22"]
        peak = {"bf16": listed["bf16_mm_8192_TFLOPS"], "fp8": listed["fp8_rowwise_mm_8192_TFLOPS"]}
    deepgemm = spec.get("deepgemm_h100_2026_11_22", {})
    cases = [c["name"] for c in spec["cases"]]
    by_key = {(r["case"], r.get("dtype", "bf16")): r for r in rows}
    out = {}
    for label, dtype, key in SERIES:
        vals = []
        for case in cases:
            r = by_key.get((case, dtype))
            ms = None
            if r is not None:
                if key == "deepgemm":
                    us = deepgemm.get(case, {}).get("deepgemm_fp8_us")
                    ms = us / 1e3 if us else None
                else:
                    ms = r["ms"].get(key)
            vals.append(roofline_percent(r, ms, copy_gbps, peak[dtype]) if ms else 0.0)
        out[label] = vals
    return cases, out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="bench.py --json output (run with --dtype both)")
    p.add_argument("--out", default="roofline.png")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(args.json))
    spec = json.load(open(CASES_FILE))
    cases, values = series_values(data["rows"], spec, data["copy_GBps"], data.get("limits"))
    fig, ax = plt.subplots(figsize=(13, 6))
    width = 0.8 / len(values)
    for i, (label, vals) in enumerate(values.items()):
        xs = [c + (i - (len(values) - 1) / 2) * width for c in range(len(cases))]
        ax.bar(xs, vals, width, label=label)
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("% of roofline (max of bandwidth and dense-mm bounds)")
    ax.set_title(f"{data['device']}: masked grouped GEMM, % of roofline per case "
                 f"(copy bandwidth {data['copy_GBps']:.0f} GB/s in the run)", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
