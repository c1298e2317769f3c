#!/usr/bin/env python3
"""What an expert's partial last m-block costs: one case timed with its
masked_m and with masked_m clamped to the tile's rows (every expert then
fits one m-block), on the same config, in interleaved rounds.

The clamped run drops the second m-blocks' work (a few rows each, but a
whole unit of the grid, which reads its weight tile again from L2) while
moving almost the same bytes, so the ratio bounds what any scheme that
folds those rows into the first m-block's unit could gain.

    python scripts/probe_mblock_cost.py --cases dsv3-ep32-gate_up dsv3-ep32-down --dtype fp8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import flashgemm  # noqa: E402
from bench import (  # noqa: E402
    cases_by_name, heuristic_setup, paired_median, probe_arguments, time_graph_rounds,
)


def probe(case, seed, fp8, dist, rounds, reps):
    cfg, masked, (a, b, sa, sb), out = heuristic_setup(case, seed, fp8, dist)
    fns = []
    for m in (masked, masked.clamp(max=cfg.tile_m)):
        m = m.cuda()
        fns.append(lambda m=m: flashgemm.grouped_gemm_nt_masked(
            a, b, out, m, a_scale=sa, b_scale=sb, config=cfg))
    samples = time_graph_rounds(fns, rounds=rounds, reps=reps)
    us = [statistics.median(s) * 1e3 for s in samples]
    ratio = paired_median(lambda full, one: one / full, *samples)
    return cfg, masked.tolist(), us, ratio


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probe_arguments(p, "skewed routing also clamps the hot experts' real m-blocks: no bound there")
    args = p.parse_args()
    cases = cases_by_name(args.cases, p.error)
    if not torch.cuda.is_available():
        sys.exit("probe_mblock_cost.py needs a CUDA GPU (none found)")
    print("| case | config | masked_m | us | clamped to tile_m us | clamped / full |")
    print("|---|---|---|---|---|---|")
    for seed, case in cases:
        cfg, masked, us, ratio = probe(case, seed, args.dtype == "fp8", args.dist, args.rounds, args.reps)
        print(f"| {case['name']} | {cfg.short_name()} | {masked} | {us[0]:.1f} | {us[1]:.1f} | {ratio:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
