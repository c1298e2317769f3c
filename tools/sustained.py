#!/usr/bin/env python3
"""Sustained load: each kernel replayed for several seconds, with the SM clock
and board power sampled meanwhile.

``benchmarks/bench.py`` times short bursts (30 replays of a 10-call graph). A
compute-bound kernel kept running reaches the board's power limit within a
second, and the SM clock then drops to whatever that power buys: the time per
call depends on energy per unit of work, not only on cycles. Here flashgemm
and, when ``deep_gemm`` imports, DeepGEMM's masked fp8 kernel run one after
the other (ours, DeepGEMM, ours again, so a drift of temperature over the run
shows), each for ``--seconds``, on the same operands; nvidia-smi samples every
100 ms.

    python tools/sustained.py --cases dsv3-prefill-down dsv3-prefill-gate_up dense-like

Per run: the median time per call over its second half, and the median SM clock
and board power over the samples after its first half second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "benchmarks")]
import flashgemm  # noqa: E402
from common import capture_graph, case_operands, cases_by_name, deepgemm_masked, draw_masked_m  # noqa: E402

SMI_FIELDS = "clocks.sm,power.draw,temperature.gpu"
SMI_PERIOD_MS = 100


def summarize(call_us, smi_lines, settle_samples=5):
    """(median us per call over the second half of the run, median SM clock MHz,
    median power W, (min, max) temperature C) from the per-replay times and the
    CSV lines nvidia-smi printed (``SMI_FIELDS``, no units); the first
    ``settle_samples`` samples (the load ramping up) are left out."""
    if not call_us:
        raise ValueError("no timed replays")
    rows = [[float(x) for x in line.split(",")] for line in smi_lines if line.strip()]
    rows = rows[settle_samples:] or rows
    if not rows:
        raise ValueError("no nvidia-smi samples")
    clocks, power, temp = zip(*rows)
    half = call_us[len(call_us) // 2:]
    return statistics.median(half), statistics.median(clocks), statistics.median(power), (min(temp), max(temp))


def run_sustained(fn, seconds, calls=10):
    """Replay a graph of ``calls`` calls of fn for ``seconds``; returns
    ``summarize`` of the run."""
    graph = capture_graph(fn, calls)
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", f"-lms={SMI_PERIOD_MS}"],
        stdout=subprocess.PIPE, text=True,
    )
    call_us = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            call_us.append(start.elapsed_time(stop) * 1000 / calls)
    finally:
        smi.terminate()
    return summarize(call_us, smi.communicate()[0].splitlines())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", required=True, help="case names of moe_cases.json")
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sustained.py needs a GPU")
    try:
        import deep_gemm
    except Exception as exc:
        print(f"DeepGEMM not timed (deep_gemm not importable: {exc})")
        deep_gemm = None
    print(f"Device: {torch.cuda.get_device_name()}; {args.seconds:g} s per run, fp8")
    print("| case | kernel | us per call | SM clock MHz | power W | temperature C |")
    print("|---|---|---|---|---|---|")
    for idx, case in cases_by_name(args.cases, p.error):
        a, b, a_scale, b_scale = case_operands(case, idx, fp8=True)
        masked_m = draw_masked_m(case, idx).cuda()
        out = torch.empty(a.shape[0], a.shape[1], b.shape[1], device="cuda", dtype=torch.bfloat16)
        runs = [("flashgemm", lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, expected_m=case["expected_m"]))]
        if deep_gemm is not None:
            gemm = deepgemm_masked(deep_gemm, a, b, out, masked_m, a_scale, b_scale)
            runs.append(("DeepGEMM", lambda: gemm(case["expected_m"])))
            runs.append(runs[0])
        for name, fn in runs:
            us, clock, power, (t_lo, t_hi) = run_sustained(fn, args.seconds)
            print(f"| {case['name']} | {name} | {us:.1f} | {clock:.0f} | {power:.0f} | {t_lo:.0f}-{t_hi:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
