#!/usr/bin/env python3
"""Host time per ``grouped_gemm_nt_masked`` call, the working tree against
another revision's package (``flashgemm_base``, made as ``tools/ab_revision.py``
says), on a GPU: tiny bf16 and fp8 calls enqueued 5000 at a time, so the host,
not the GPU, sets the pace; the median of interleaved rounds.

    python tools/ab_host.py --base scratch/base
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]
import flashgemm  # noqa: E402
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="directory holding the flashgemm_base package")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    sys.path.insert(0, args.base)
    import flashgemm_base

    e, m, n, k = 8, 64, 256, 256  # tiny: the GPU work hides behind the host
    a = torch.randn(e, m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(e, m, n, device="cuda", dtype=torch.bfloat16)
    mm = torch.full((e,), 32, device="cuda", dtype=torch.int32)
    a8, sa = quantize_fp8_per_token(a)
    b8, sb = quantize_fp8_per_block(b)
    cases = {"bf16": (a, b, {}), "fp8": (a8, b8, {"a_scale": sa, "b_scale": sb})}
    times = {}
    for _ in range(args.rounds):
        for case, (x, y, kw) in cases.items():
            for name, pkg in (("tree", flashgemm), ("base", flashgemm_base)):
                for _ in range(50):
                    pkg.grouped_gemm_nt_masked(x, y, out, mm, expected_m=32, **kw)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    pkg.grouped_gemm_nt_masked(x, y, out, mm, expected_m=32, **kw)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                times.setdefault((case, name), []).append((t1 - t0) / args.calls * 1e6)
    print(f"{torch.cuda.get_device_name()}: host time per call (enqueue loops of {args.calls}, median of "
          f"{args.rounds} interleaved rounds)")
    for case in cases:
        tree, base = statistics.median(times[(case, "tree")]), statistics.median(times[(case, "base")])
        print(f"  {case}: tree {tree:.2f} us, base {base:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
