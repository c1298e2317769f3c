#!/usr/bin/env python3
"""A bound on swap-AB for the decode cases: the package's own kernel run on
the transposed problem, against the heuristic's pick on the real one, in
interleaved rounds.

Swap-AB computes out[e]^T = b[e] @ a[e]^T, so the weights fill the wgmma's
M side (every row valid) and the tokens its N side, in steps of 8 instead of
64-row warpgroup blocks. The transposed problem here is that product, run by
the existing kernel: the expert's N weight rows as the kernel's A (masked_m =
N for every expert), the first ``T`` token rows as its B, a 128 x T tile. It
streams the same weights and reads the tokens once per 128-row weight block,
as a swap-AB kernel with T-token tiles would, and does T / 128 of a 128x128
tile's tensor work per unit. What it leaves out favours swap-AB: a real one
would promote each column with its own token's scale (more instructions than
the row scales here) and store its accumulators transposed. What it adds
against it: T comes in multiples of 64 here, not of 8 (fp8: 16 with two
parts). So when this bound is slower than the heuristic, swap-AB with that T
is too. (The outputs are not compared: the transposed product is a different
quantization of different data; only the time counts.)

    python scripts/probe_swap_bound.py --cases dsv3-ep32-gate_up dsv3-ep32-down --tokens 64 128 192
"""

from __future__ import annotations

import argparse
import dataclasses
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
from flashgemm.config import GemmConfig  # noqa: E402


def transposed_config(tokens: int, fp8: bool) -> GemmConfig:
    """The 128 x T tile of the transposed problem: no cluster (one n-block of
    tokens), no L2 hints (they would favour the wrong operand), balanced
    rounds; fp8 keeps two product sets up to 128 columns and promotes in two
    parts above (the registers of the 128x192 prefill tile)."""
    cfg = GemmConfig(tile_m=128, tile_n=tokens, tile_k=128 if fp8 else 64, balance_rounds=True)
    if fp8:
        cfg = dataclasses.replace(
            cfg, promote_overlap=tokens <= 128, promote_parts=1 if tokens <= 128 else 2,
            epi_whole_tile=tokens > 128,
        )
    return cfg


def transposed_call(case, seed, fp8, tokens):
    """A call of the kernel on the transposed problem of ``case``, on fresh
    random data: weights as A with every row valid, ``tokens`` rows as B."""
    e, n, k = case["E"], case["N"], case["K"]
    torch.manual_seed(seed)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    t = torch.randn(e, tokens, k, device="cuda", dtype=torch.bfloat16)
    sw = st = None
    if fp8:
        from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token

        w, sw = quantize_fp8_per_token(w)  # the weights take the row scales of A
        t, st = quantize_fp8_per_block(t)
    out = torch.empty(e, n, tokens, device="cuda", dtype=torch.bfloat16)
    every_row = torch.full((e,), n, dtype=torch.int32, device="cuda")
    cfg = transposed_config(tokens, fp8)
    return lambda: flashgemm.grouped_gemm_nt_masked(w, t, out, every_row, a_scale=sw, b_scale=st, config=cfg)


def probe(case, seed, fp8, dist, token_counts, rounds, reps):
    """(heuristic config, masked_m, [us of the heuristic, then of each T],
    [transposed / heuristic per T])."""
    cfg, masked, (a, b, sa, sb), out = heuristic_setup(case, seed, fp8, dist)
    m = masked.cuda()
    fns = [lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, m, a_scale=sa, b_scale=sb, config=cfg)]
    fns += [transposed_call(case, seed, fp8, t) for t in token_counts]
    samples = time_graph_rounds(fns, rounds=rounds, reps=reps)
    us = [statistics.median(s) * 1e3 for s in samples]
    ratios = [paired_median(lambda base, x: x / base, samples[0], s) for s in samples[1:]]
    return cfg, masked.tolist(), us, ratios


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probe_arguments(p)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 192],
                   help="token tile sizes T of the transposed runs (64, 128 or 192)")
    args = p.parse_args()
    cases = cases_by_name(args.cases, p.error)
    fp8 = args.dtype == "fp8"
    for t in args.tokens:
        try:
            transposed_config(t, fp8).validate(1 if fp8 else 2)
        except ValueError as err:
            p.error(f"--tokens {t}: {err}")
    if not torch.cuda.is_available():
        sys.exit("probe_swap_bound.py needs a CUDA GPU (none found)")
    heads = " | ".join(f"T={t} us | T={t} / heuristic" for t in args.tokens)
    print(f"| case | heuristic config | masked_m range | heuristic us | {heads} |")
    print("|---|---|---|---|" + "---|---|" * len(args.tokens))
    for seed, case in cases:
        cfg, masked, us, ratios = probe(case, seed, fp8, args.dist, args.tokens, args.rounds, args.reps)
        cells = " | ".join(f"{u:.1f} | {r:.3f}" for u, r in zip(us[1:], ratios))
        print(f"| {case['name']} | {cfg.short_name()} | {min(masked)}-{max(masked)} | {us[0]:.1f} | {cells} |",
              flush=True)


if __name__ == "__main__":
    main()
