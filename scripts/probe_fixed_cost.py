#!/usr/bin/env python3
"""Per-tile fixed cost probe: time one decode shape at several K and fit
T(K) = a + b*K; the intercept is what every tile pays besides its k-loop
(epilogue, scheduler, pipeline ramp). Prints one line per (dtype, config).

    python scripts/probe_fixed_cost.py --e 8 --m 128 --n 7168
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import flashgemm  # noqa: E402
from bench import time_graph  # noqa: E402
from flashgemm.config import GemmConfig  # noqa: E402
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--e", type=int, default=8)
    p.add_argument("--m", type=int, default=128)
    p.add_argument("--n", type=int, default=7168)
    p.add_argument("--ks", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    args = p.parse_args()
    e, m, n = args.e, args.m, args.n
    mm = torch.full((e,), m, dtype=torch.int32, device="cuda")
    configs = {
        "fp8": [GemmConfig(64, 128, 128, 0, 1, 2, 1), GemmConfig(128, 128, 128, 0, 1, 2, 2)],
        "bf16": [GemmConfig(64, 128, 64, 0, 1, 2, 1), GemmConfig(128, 128, 64, 0, 1, 2, 2)],
    }
    for dtype, cfgs in configs.items():
        for cfg in cfgs:
            times = []
            for k in args.ks:
                x = torch.randn(e, m, k, device="cuda")
                w = torch.randn(e, n, k, device="cuda")
                out = torch.empty(e, m, n, device="cuda", dtype=torch.bfloat16)
                if dtype == "fp8":
                    a, sa = quantize_fp8_per_token(x)
                    b, sb = quantize_fp8_per_block(w)
                    kw = dict(a_scale=sa, b_scale=sb)
                else:
                    a, b, kw = x.bfloat16(), w.bfloat16(), {}
                times.append(time_graph(lambda: flashgemm.grouped_gemm_nt_masked(
                    a, b, out, mm, config=cfg, **kw), reps=20) * 1e3)
            ks = torch.tensor(args.ks, dtype=torch.float64)
            ts = torch.tensor(times, dtype=torch.float64)
            slope = ((ks - ks.mean()) * (ts - ts.mean())).sum() / ((ks - ks.mean()) ** 2).sum()
            icpt = ts.mean() - slope * ks.mean()
            print(f"{dtype} {cfg.short_name()}: " + ", ".join(f"K={k}: {t:.1f}us" for k, t in zip(args.ks, times))
                  + f"; fit T = {icpt:.1f} us + {slope * 1024:.2f} us per 1024 of K", flush=True)


if __name__ == "__main__":
    main()
