#!/usr/bin/env python3
"""Host time per call of grouped_gemm_nt_masked, and where it goes.

    python benchmarks/bench_host.py [--rounds 5] [--cpu N]

Every row is timed in ``--rounds`` interleaved rounds (2000 calls each, the
median call per round); the table gives the median round and the range. Each
round starts one row later than the one before, so no row always runs first
(a fixed order favoured the rows after the first). The GPU time of the same
call (graph replay) is printed too: a host time under it would be the launch
queue's pace. ``--cpu N`` pins the process to core N first. Then a new
process's time to its first launch, cold and with a warm disk cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's flashgemm; common.py beside this file
import flashgemm  # noqa: E402
from flashgemm import api, workspace  # noqa: E402
from flashgemm.config import KernelSpec  # noqa: E402
from flashgemm.formats import Format  # noqa: E402
from flashgemm.sm90.build import get_kernel  # noqa: E402
from flashgemm.sm90.heuristic import DECODE_CONFIG  # noqa: E402
from common import host_us, time_graph  # noqa: E402

NO_EXTRAS = (None,) * 6  # a plain call: no combine routing (5) and no fused-SwiGLU scales

SPEC = KernelSpec(DECODE_CONFIG, Format.BF16)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cpu", type=int, help="pin the process to this core")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host.py needs a CUDA GPU")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    e, m, n, k = 8, 64, 256, 256  # tiny: the GPU work hides behind the host
    a = torch.randn(e, m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(e, m, n, device="cuda", dtype=torch.bfloat16)
    mm = torch.full((e,), 32, device="cuda", dtype=torch.int32)
    fn = get_kernel(SPEC)
    call = api.CallArgs(a, b, out, mm, config=DECODE_CONFIG)
    plan = api._make_plan(call)
    named = call.tensors()
    # the dynamic order's claim counter (DECODE_CONFIG claims its tiles)
    counter = workspace.claim_counter(torch.cuda.current_device()) if DECODE_CONFIG.dynamic else None
    rows = {
        "grouped_gemm_nt_masked (whole call)": lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, out, mm, config=DECODE_CONFIG
        ),
        "  the same, heuristic (expected_m=32)": lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, out, mm, expected_m=32
        ),
        "  first call of a signature: all checks": lambda: api._make_plan(call),
        "  later calls: pointer checks": lambda: plan.pointers_ok(named),
        "  get_kernel (cache hit)": lambda: get_kernel(SPEC),
        "  compiled fn call (DSL wrapper)": lambda: fn(a, b, out, mm, None, None, None, counter, *NO_EXTRAS, plan.num_ctas),
        "  compiled fn call (TVM-FFI function)": lambda: plan.fn(
            a, b, out, mm, None, None, None, counter, *NO_EXTRAS, plan.num_ctas
        ),
        "  the stream's claim counter": lambda: workspace.claim_counter(0),
        "  torch.cuda.current_device()": torch.cuda.current_device,
        "torch._grouped_mm 3D (peer)": lambda: torch._grouped_mm(a, b.transpose(-2, -1)),
    }
    # tvm_ffi turns torch tensors into DLPack through torch's C exchange API
    # when torch has one (2.10+), else through slower Python calls
    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    pinned = f"pinned to core {args.cpu}" if args.cpu is not None else "not pinned"
    print(f"torch {torch.__version__}; DLPack C exchange API: {'yes' if fast else 'no'}; {pinned}; "
          f"{os.cpu_count()} cores; median call per round, median round [range] of {args.rounds}")
    times = {name: [] for name in rows}
    names = list(rows)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(host_us(rows[name], reps=2000))
    for name, ts in times.items():
        print(f"{name:40s} {statistics.median(ts):8.1f} us  [{min(ts):.1f} - {max(ts):.1f}]")
    gpu_us = 1e3 * time_graph(rows[names[0]], reps=30)
    print(f"{'GPU time of the whole call (graph)':40s} {gpu_us:8.1f} us")
    cold_start()


def cold_start():
    """New process to first launch: cold (compile) and with a warm disk cache."""
    import subprocess
    import tempfile

    script = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        "import flashgemm; "
        "a = torch.randn(8, 64, 256, device='cuda', dtype=torch.bfloat16); "
        "b = torch.randn(8, 256, 256, device='cuda', dtype=torch.bfloat16); "
        "m = torch.full((8,), 32, device='cuda', dtype=torch.int32); "
        "torch.cuda.synchronize(); t2 = time.perf_counter(); "
        "flashgemm.grouped_gemm_nt_masked(a, b, None, m, expected_m=32); torch.cuda.synchronize(); "
        "t3 = time.perf_counter(); print(t1 - t0, t3 - t1, t3 - t2)"
    )
    with tempfile.TemporaryDirectory() as d:
        # this checkout's package, as in this process
        path = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, FLASHGEMM_CACHE_DIR=d, PYTHONPATH=path)
        for label in ("cold (compiles)", "warm disk cache"):
            out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
            torch_s, after_torch_s, first_call_s = map(float, out.stdout.split()[-3:])
            print(f"new process, {label:16s}: import torch {torch_s:.2f} s; then to first launch done "
                  f"{after_torch_s:.2f} s (first call alone {first_call_s:.2f} s)")


if __name__ == "__main__":
    main()
