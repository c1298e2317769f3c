#!/usr/bin/env python3
"""Cost of completion signals, and the gain from overlapping GEMM and combine.

(a) the same GEMM with and without dst_signals (all SMs, CUDA-graph timing;
    the counters are zeroed once, not per call, so the cost is the kernel's
    own; the memset a caller adds is timed alone). "Same GEMM" is the config
    the heuristic picks for a call with signals; without signals it may pick
    another order (``TileOrder.N_MAJOR`` for the fp8 mid tiles), timed as
    "no-signal pick", and "vs no-signal pick" is what turning signals on
    costs a caller of the heuristic;
(b) GEMM on `gemm_sms` SMs and the reference combine on the rest: each alone,
    both sequential on one stream, and overlapped on two streams.
Every time is per call from CUDA-graph replays (the overlapped fork/join is
captured too), so host launch costs do not hide the GPU time. The graphs
compared with each other are timed in interleaved rounds, every other one
in reverse order; times are medians over rounds, and the signal cost and the
overlap ratio are medians of the ratios within each round (why: docs/design.md,
Measurement method).

    python benchmarks/bench_overlap.py [--cases ...] [--combine-sms 20 [28 ...]] [--top-k 8] [--dtype bf16 fp8]

``--set FIELD=VALUE`` (repeatable) changes the config the heuristic picks for
every call with signals (a ``GemmConfig`` field; enum fields by member name,
e.g. ``--set order=n_major``, ``--set tail=none``); the no-signal pick stays
the heuristic's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's flashgemm; common.py beside this file
import flashgemm  # noqa: E402

from flashgemm.formats import Format  # noqa: E402
from flashgemm.overlap import combine_masked, run_gemm_and_combine  # noqa: E402
from flashgemm.sm90.limits import check_config  # noqa: E402
from common import (  # noqa: E402
    apply_changes, case_operands, cases_by_name, draw_masked_m, load_cases, paired_median,
    parse_config_changes, time_graph_rounds,
)


def run_case(case, seed, combine_sms, reps, rounds, top_k, rows_per_item=None, fp8=False):
    e_count, max_m, n, k, em = case["E"], case["max_m"], case["N"], case["K"], case["expected_m"]
    a, b, a_scale, b_scale = case_operands(case, seed, fp8)
    scales = dict(a_scale=a_scale, b_scale=b_scale)
    masked_m = draw_masked_m(case, seed).cuda()
    out = torch.empty(e_count, max_m, n, device="cuda", dtype=torch.bfloat16)
    # The combine stands for a rank's receive side: each token sums the rows
    # of its top_k experts. The cases hold E * expected_m = 1024 rows, so
    # top_k=8 gives 128 tokens (a DeepEP low-latency rank's decode batch) and
    # a 3.7 MB fp32 buffer on N=7168; top_k=1 gives one row per token, a
    # 29 MB buffer whose write-back competes with the GEMM for DRAM.
    num_tokens = max(1, round(e_count * em / top_k))
    token_idx = torch.randint(0, num_tokens, (e_count, max_m), dtype=torch.int32, device="cuda")
    weight = torch.rand(e_count, max_m, device="cuda")
    combined = torch.zeros(num_tokens, n, device="cuda")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    gemm_sms = sm_count - combine_sms

    layout_full = flashgemm.signal_layout(e_count, max_m, n, k, expected_m=em, fp8=fp8)
    sig_full = flashgemm.alloc_signals(layout_full, "cuda")
    layout = flashgemm.signal_layout(e_count, max_m, n, k, expected_m=em, num_sms=gemm_sms, fp8=fp8)
    sig = flashgemm.alloc_signals(layout, "cuda")

    def gemm_split():
        sig.zero_()
        flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, expected_m=em, num_sms=gemm_sms, dst_signals=sig, **scales
        )

    def sequential():
        gemm_split()
        combine_masked(out, masked_m, sig, layout, token_idx, weight, combined, num_sms=combine_sms,
                       rows_per_item=rows_per_item)

    sig_cfg = flashgemm.choose_config(em, max_m, n, k, sm_count, fp8, e_count, signals=True)
    timed = {
        "gemm_us": lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, expected_m=em, config=sig_cfg, **scales
        ),
        "gemm_pick_us": lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=em, **scales),
        # the in-kernel cost alone: the counters are not zeroed between calls
        # (the kernel only adds to them), so no memset kernel and no gap
        # between two graph nodes is counted as signal cost
        "gemm_signals_us": lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, expected_m=em, dst_signals=sig_full, **scales
        ),
        # the caller's zeroing of the counters, alone
        "memset_us": lambda: sig_full.zero_(),
        "gemm_split_us": gemm_split,
        # combine alone: its counters are final, since the GEMM just before it
        # in every round (gemm_split) completed them
        "combine_split_us": lambda: combine_masked(
            out, masked_m, sig, layout, token_idx, weight, combined, num_sms=combine_sms,
            rows_per_item=rows_per_item,
        ),
        "sequential_us": sequential,
        # the two-stream fork/join is captured into the graph as well
        "overlapped_us": lambda: run_gemm_and_combine(
            a, b, masked_m, token_idx, weight, combined, gemm_sms=gemm_sms,
            combine_sms=combine_sms, expected_m=em, out=out, rows_per_item=rows_per_item, **scales,
        ),
    }
    samples = dict(zip(timed, time_graph_rounds(list(timed.values()), rounds=rounds, reps=reps)))
    r = {"case": case["name"], "dtype": "fp8" if fp8 else "bf16", "combine_sms": combine_sms,
         "top_k": top_k, "tokens": num_tokens}
    r.update({name: 1e3 * statistics.median(t) for name, t in samples.items()})
    # the two ratios are taken round by round (graphs timed minutes apart
    # drift by more than the effects measured), then their median
    r["signal_overhead_pct"] = 100 * paired_median(
        lambda plain, sig: sig / plain - 1, samples["gemm_us"], samples["gemm_signals_us"]
    )
    r["signals_vs_pick_pct"] = 100 * paired_median(
        lambda pick, sig: sig / pick - 1, samples["gemm_pick_us"], samples["gemm_signals_us"]
    )
    r["overlap_vs_longer"] = paired_median(
        lambda o, g, c: o / max(g, c),
        samples["overlapped_us"], samples["gemm_split_us"], samples["combine_split_us"],
    )
    return r


def change_signalled_configs(changes):
    """--set: apply ``changes`` to every config the heuristic picks for a
    call with signals (what ``flashgemm.api`` and ``flashgemm.choose_config`` call)."""
    from flashgemm import api

    pick = api.choose_config
    params = inspect.signature(pick)

    def changed(*args, **kw):
        cfg = pick(*args, **kw)
        given = params.bind(*args, **kw).arguments
        if not given.get("signals", False):
            return cfg
        operands = Format.FP8_BLOCK128 if given.get("fp8", False) else Format.BF16
        return check_config(apply_changes(cfg, changes), operands)

    api.choose_config = flashgemm.choose_config = changed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*")
    p.add_argument("--combine-sms", type=int, nargs="+", default=[20])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--top-k", type=int, default=8, help="rows summed per token by the combine")
    p.add_argument("--rows-per-item", type=int, help="combine work item size (default: the package's)")
    p.add_argument("--dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
                   help="GEMM operands (fp8: block-scaled e4m3, bf16 out)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--json")
    args = p.parse_args()
    if args.set:
        change_signalled_configs(parse_config_changes(args.set, p.error))
    decode = [c["name"] for c in load_cases()["cases"] if c["regime"] == "decode"]
    # (seed, case) in the file's order; seed = the case's place in the file,
    # as in bench.py (same masked_m draws)
    cases = sorted(cases_by_name(args.cases or decode, p.error), key=lambda sc: sc[0])
    not_decode = [c["name"] for _, c in cases if c["name"] not in decode]
    if not_decode:
        p.error(f"--cases: the overlap runs decode cases only ({', '.join(decode)}); got {', '.join(not_decode)}")
    if not torch.cuda.is_available():
        sys.exit("bench_overlap.py needs a CUDA GPU")
    rows = []
    for dtype, combine_sms in [(d, s) for d in args.dtype for s in args.combine_sms]:
        part = [
            run_case(c, seed, combine_sms, args.reps, args.rounds, args.top_k, args.rows_per_item,
                     fp8=dtype == "fp8")
            for seed, c in cases
        ]
        rows += part
        print(f"Device: {torch.cuda.get_device_name()}; {dtype} GEMM; combine on {combine_sms} SMs, GEMM on the rest; "
              f"combine sums top-{args.top_k} rows per token ({part[0]['tokens']} tokens); "
              f"median of {args.rounds} interleaved rounds of {args.reps} graph replays; signal cost and "
              "overlap ratio: median of the per-round ratios")
        print("| case | GEMM us | + signals us | memset us | signal cost | no-signal pick us | vs no-signal pick "
              "| GEMM split us | combine split us | sequential us | overlapped us | overlapped / longer alone |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in part:
            print(f"| {r['case']} | {r['gemm_us']:.1f} | {r['gemm_signals_us']:.1f} | {r['memset_us']:.1f} | "
                  f"{r['signal_overhead_pct']:+.1f}% | {r['gemm_pick_us']:.1f} | {r['signals_vs_pick_pct']:+.1f}% | "
                  f"{r['gemm_split_us']:.1f} | {r['combine_split_us']:.1f} | "
                  f"{r['sequential_us']:.1f} | {r['overlapped_us']:.1f} | {r['overlap_vs_longer']:.3f}x |",
                  flush=True)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
