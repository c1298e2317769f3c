#!/usr/bin/env python3
"""Run one benchmark case a few times, for a profiler to catch one launch.

The heuristic's call on the case's operands and uniform masked_m, as
``benchmarks/bench.py`` draws them. Under Nsight Compute (on the device machines
that run on Firecracker; leave the clocks alone):

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section SchedulerStats \\
        python tools/profile_case.py dense-like --dtype fp8

The first calls compile (or load) the kernel; ``--launch-skip`` passes
over them. With ``--range`` the last call alone runs between
``cudaProfilerStart`` and ``cudaProfilerStop``, for ``ncu --profile-from-start
off``; ``tools/ncu_regions.py`` sums such a launch's stall samples by code
region. ``--dtype mxfp4``: fp8 activations, the weights quantized to MXFP4.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "benchmarks")]
import flashgemm  # noqa: E402
from common import (  # noqa: E402
    CONFIG_NAME_HELP, DISTRIBUTIONS, case_operands, cases_by_name, draw_masked_m, parse_config,
)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", help="a case name of the benchmark's case file")
    p.add_argument("--dtype", choices=["bf16", "fp8", "mxfp4"], default="fp8")
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="uniform")
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--config", help=f"a config short name instead of the heuristic's: {CONFIG_NAME_HELP}")
    p.add_argument("--range", action="store_true", help="profile only the last call (cudaProfilerStart/Stop)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_case.py needs a CUDA GPU")
    ((seed, case),) = cases_by_name([args.case], p.error)
    masked_m = draw_masked_m(case, seed, args.dist).cuda()
    a, b, a_scale, b_scale = case_operands(case, seed, args.dtype == "fp8")
    if args.dtype == "mxfp4":
        from flashgemm.mxfp4 import prepare_weights, quantize_mxfp4
        from flashgemm.quant import quantize_fp8_per_token

        a, a_scale = quantize_fp8_per_token(a)
        b, b_scale = prepare_weights(*quantize_mxfp4(b.float()))
    out = torch.empty(case["E"], case["max_m"], case["N"], device="cuda", dtype=torch.bfloat16)
    config = parse_config(args.config) if args.config else None
    for call in range(args.calls):
        if args.range and call == args.calls - 1:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
        flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, expected_m=case["expected_m"], a_scale=a_scale, b_scale=b_scale,
            config=config,
        )
    torch.cuda.synchronize()
    if args.range:
        torch.cuda.cudart().cudaProfilerStop()
    print(f"{args.case} {args.dtype} {args.dist}: {args.calls} calls")


if __name__ == "__main__":
    main()
