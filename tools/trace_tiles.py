#!/usr/bin/env python3
"""Where one launch spends its time: a per-CTA timeline of the masked GEMM.

Builds a trace kernel (``flashgemm.trace``: globaltimer stamps at CTA entry,
per tile and at exit) for the configuration the heuristic picks, runs it on a
case of ``moe_cases.json`` with the benchmark's masked_m, and prints:

* ``launch``: event time per call of back-to-back launches (trace build);
* ``spread``: last CTA entry after the first; ``first``: the first tile's
  mainloop, from the producer's start (pipeline fill included);
* ``steady`` / ``tail``: median time from one tile's epilogue end to the next
  tile's mainloop end, for tiles starting before / after the median CTA end;
  ``epilogue``: median time from a tile's mainloop end to its epilogue end
  (the consumers' part: staging, or the stores of a partial tile);
* ``end med/max``: when the median and the last CTA finished; the gap is the
  last, partly empty wave;
* the number of busy CTAs in every 5 us window.

    python tools/trace_tiles.py --dtype both --cases dsv3-ep32-down qwen3-30b-ep8-gate_up
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "benchmarks")]
from flashgemm import trace  # noqa: E402
from flashgemm.api import CallArgs, _make_plan  # noqa: E402
from flashgemm.config import KernelSpec  # noqa: E402
from flashgemm.formats import Format  # noqa: E402
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token  # noqa: E402
from flashgemm.sm90.build import build  # noqa: E402
from flashgemm.sm90.heuristic import choose_config  # noqa: E402
from flashgemm.workspace import claim_counter  # noqa: E402
from common import draw_masked_m, load_cases  # noqa: E402


def trace_case(case, seed, fp8, num_sms=None):
    e, max_m, n, k = case["E"], case["max_m"], case["N"], case["K"]
    masked_m = draw_masked_m(case, seed).cuda()
    a = torch.randn(e, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    sa = sb = None
    if fp8:
        a, sa = quantize_fp8_per_token(a)
        b, sb = quantize_fp8_per_block(b)
    out = torch.empty(e, max_m, n, device="cuda", dtype=torch.bfloat16)
    # the heuristic's choice for the whole GPU; the plan (grid size) is made
    # for it, capped at num_sms when given
    cfg = choose_config(case["expected_m"], max_m, n, k,
                        torch.cuda.get_device_properties(0).multi_processor_count, fp8, e)
    plan = _make_plan(CallArgs(a, b, out, masked_m, sa, sb, case["expected_m"], num_sms, cfg))
    fn = build(KernelSpec(cfg, Format.FP8_BLOCK128 if fp8 else Format.BF16), trace=True)
    buf = torch.zeros(plan.num_ctas * trace.SLOTS, dtype=torch.int32, device="cuda")
    counter = claim_counter(torch.cuda.current_device()) if cfg.dynamic else None

    def call():
        fn(a, b, out, masked_m, buf, sa, sb, counter, plan.num_ctas)

    for _ in range(5):
        call()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        call()
    stop.record()
    torch.cuda.synchronize()
    event_us = start.elapsed_time(stop) / 20 * 1e3
    buf.zero_()
    call()
    torch.cuda.synchronize()
    return cfg, event_us, trace.timeline(buf.cpu(), plan.num_ctas)


def summarize(t):
    ends = t["consumer_end"]
    end_med = statistics.median(ends)
    first, steady, tail, epilogue = [], [], [], []
    for c, tiles in enumerate(t["tile_times"]):
        prev = t["producer_start"][c]
        for i, (mainloop_end, epi_end) in enumerate(tiles):
            (first if i == 0 else tail if prev >= end_med - 2000 else steady).append(mainloop_end - prev)
            epilogue.append(epi_end - mainloop_end)
            prev = epi_end
    med = lambda xs: statistics.median(xs) / 1e3 if xs else float("nan")  # noqa: E731
    busy = [sum(1 for x in ends if x > w) for w in range(0, max(ends), 5000)]
    return {
        "spread_us": max(t["entry"]) / 1e3,
        "producer_start_us": med(t["producer_start"]),
        "first_us": med(first),
        "steady_us": med(steady),
        "tail_us": med(tail),
        "tail_tiles": len(tail),
        "epilogue_us": med(epilogue),
        "end_med_us": end_med / 1e3,
        "end_max_us": max(ends) / 1e3,
        "tiles_per_cta": (min(t["tiles"]), max(t["tiles"])),
        "busy_ctas_per_5us": busy,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", help="case names (default: the decode cases)")
    p.add_argument("--dtype", choices=["bf16", "fp8", "both"], default="both")
    p.add_argument("--json", help="write the raw timelines here")
    p.add_argument("--num-sms", type=int, help="cap the grid (as the call's num_sms), same config")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("trace_tiles.py needs a CUDA GPU")
    spec = load_cases()
    cases = [c for c in spec["cases"] if (c["name"] in args.cases if args.cases else c["regime"] == "decode")]
    raw = {}
    for fp8 in {"bf16": [False], "fp8": [True], "both": [False, True]}[args.dtype]:
        for case in cases:
            cfg, event_us, t = trace_case(case, spec["cases"].index(case), fp8, args.num_sms)
            s = summarize(t)
            name = f"{case['name']} {'fp8' if fp8 else 'bf16'}"
            print(f"{name}: {cfg.short_name()}")
            print(
                f"  launch {event_us:.1f} us | spread {s['spread_us']:.2f} | producer start "
                f"{s['producer_start_us']:.2f} | first {s['first_us']:.1f} | steady {s['steady_us']:.1f} | "
                f"tail {s['tail_us']:.1f} ({s['tail_tiles']} tiles) | epilogue {s['epilogue_us']:.2f} | "
                f"end med {s['end_med_us']:.1f} "
                f"max {s['end_max_us']:.1f} | tiles/CTA {s['tiles_per_cta'][0]}-{s['tiles_per_cta'][1]}"
            )
            print(f"  busy CTAs per 5 us: {s['busy_ctas_per_5us']}")
            raw[name] = {"summary": s, "timeline": t, "event_us": event_us}
    if args.json:
        json.dump(raw, open(args.json, "w"))


if __name__ == "__main__":
    main()
