#!/usr/bin/env python3
"""Probes that measure a floor or bound a design choice, one subcommand each
(what each found is in docs/design.md):

  launch-floor  host time of a TVM-FFI call that launches an empty CuTe kernel
  fixed-cost    what every tile pays besides its k-loop: T(K) = a + b*K over several K
  mblock-cost   what an expert's partial last m-block costs
  swap-bound    a bound on swap-AB for the decode cases

    python tools/probe.py launch-floor
    python tools/probe.py fixed-cost --e 8 --m 128 --n 7168
    python tools/probe.py mblock-cost --cases dsv3-ep32-gate_up dsv3-ep32-down --dtype fp8
    python tools/probe.py swap-bound --cases dsv3-ep32-gate_up dsv3-ep32-down --tokens 64 128 192

``python tools/probe.py SUBCOMMAND --help`` describes one. Every probe needs
a GPU; its arguments are checked before any GPU work.
"""
# (no `from __future__ import annotations`: the CuTe DSL reads the launch-floor
# kernel's annotations, which must be the types themselves)

import argparse
import inspect
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "benchmarks")]
import flashgemm  # noqa: E402
from flashgemm.config import GemmConfig, Promotion, Staging, Tail  # noqa: E402
from flashgemm.formats import Format  # noqa: E402
from flashgemm.sm90.limits import check_config  # noqa: E402
from common import (  # noqa: E402
    DISTRIBUTIONS, case_operands, cases_by_name, draw_masked_m, host_us, paired_median, time_graph,
    time_graph_rounds,
)


def needs_gpu(command):
    if not torch.cuda.is_available():
        sys.exit(f"probe.py {command} needs a CUDA GPU (none found)")


def probe_arguments(p, dist_note=None):
    """The options of the probes that run cases: the cases (default the two
    dsv3-ep32 ones), dtype, routing, rounds and reps."""
    p.add_argument("--cases", nargs="+", default=["dsv3-ep32-gate_up", "dsv3-ep32-down"])
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="fp8")
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="uniform", help=dist_note)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=20)


def heuristic_setup(case, seed, fp8, dist="uniform"):
    """(config, masked_m on the host, operands (a, b, a_scale, b_scale), out)
    of a case with the heuristic's config for this GPU, on fresh data."""
    e, max_m, n, k = case["E"], case["max_m"], case["N"], case["K"]
    masked = draw_masked_m(case, seed, dist)
    operands = case_operands(case, seed, fp8=fp8)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = flashgemm.choose_config(case["expected_m"], max_m, n, k, num_sms, fp8, e)
    out = torch.empty(e, max_m, n, device="cuda", dtype=torch.bfloat16)
    return cfg, masked, operands, out


# ---- launch-floor --------------------------------------------------------------
def _noop_kernel():
    """An empty CuTe kernel, launched by three jit functions that take five
    tensors, five ints, or four ints and a tensor (the DSL is imported here,
    not when probe.py loads)."""
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    class Noop:
        def __init__(self, cluster):
            self.cluster = cluster

        @cute.kernel
        def kernel(self, x: Int64):
            tidx, _, _ = cute.arch.thread_idx()
            if tidx == 1023:  # never true (128 threads): a body the compiler keeps
                cute.printf("%d", x)

        @cute.jit
        def tensors(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor, e: cute.Tensor,
                    n: Int32, stream):
            self.kernel(Int64(0)).launch(grid=[2 * n, 1, 1], block=[128, 1, 1], cluster=[self.cluster, 1, 1],
                                         stream=stream)

        @cute.jit
        def ints(self, a: Int64, b: Int64, c: Int64, d: Int64, e: Int64, n: Int32, stream):
            self.kernel(a).launch(grid=[2 * n, 1, 1], block=[128, 1, 1], cluster=[self.cluster, 1, 1],
                                  stream=stream)

        @cute.jit
        def mixed(self, a: Int64, b: Int64, c: Int64, d: Int64, e: cute.Tensor, n: Int32, stream):
            self.kernel(a).launch(grid=[2 * n, 1, 1], block=[128, 1, 1], cluster=[self.cluster, 1, 1],
                                  stream=stream)

    return Noop


def compile_launch_floor(cluster):
    """The TVM-FFI functions of the empty kernel on a cluster of ``cluster``
    CTAs: (five tensors, five ints + a raw stream, four ints + a tensor)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    k = _noop_kernel()(cluster)
    fake = cute.runtime.make_fake_compact_tensor
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    ft = [fake(cutlass.BFloat16, (cute.sym_int(),), assumed_align=16) for _ in range(5)]
    fns = (
        cute.compile(k.tensors, *ft, Int32(1), stream, options="--enable-tvm-ffi"),
        cute.compile(k.ints, *[Int64(0)] * 5, Int32(1), cute.runtime.make_fake_stream(),
                     options="--enable-tvm-ffi"),
        cute.compile(k.mixed, *[Int64(0)] * 4, ft[0], Int32(1), stream, options="--enable-tvm-ffi"),
    )
    # call the TVM-FFI function itself, not the DSL's Python wrapper around it
    return tuple(f.__tvm_ffi_object__() or f for f in fns)


def launch_floor(args, error):
    """The host-time floor under grouped_gemm_nt_masked: a TVM-FFI call that
    launches an empty CuTe kernel, with five torch tensors as arguments or five
    ints (the launch alone), with and without a 2-CTA cluster."""
    needs_gpu("launch-floor")
    xs = [torch.zeros(64, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    ptrs = [x.data_ptr() for x in xs]
    raw_stream = torch._C._cuda_getCurrentRawStream
    for cluster in (1, 2):
        f_t, f_i, f_m = compile_launch_floor(cluster)
        for name, f in (("5 tensor args", lambda: f_t(*xs, 66)),
                        ("5 int args + raw stream", lambda: f_i(*ptrs, 66, raw_stream(0))),
                        ("4 int args + 1 tensor", lambda: f_m(*ptrs[:4], xs[4], 66))):
            try:
                print(f"cluster {cluster}: {name}: {host_us(f, reps=3000):.1f} us", flush=True)
            except Exception as exc:
                print(f"cluster {cluster}: {name}: failed: {exc!r}"[:300], flush=True)
    y = torch.zeros(1, device="cuda")
    print(f"torch y.add_(1): {host_us(lambda: y.add_(1), reps=3000):.1f} us")
    print(f"5 x data_ptr(): {host_us(lambda: [x.data_ptr() for x in xs], reps=3000):.2f} us")


# ---- fixed-cost ----------------------------------------------------------------
FIXED_COST_CONFIGS = (
    GemmConfig(tile_m=64, tile_n=128, cluster_n=2),
    GemmConfig(tile_m=128, tile_n=128, cluster_n=2),
)


def fit_line(xs, ys):
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    x = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    return float(y.mean() - slope * x.mean()), float(slope)


def fixed_cost(args, error):
    """Per-tile fixed cost: one decode shape (every expert at --m rows) timed
    at several K and fit T(K) = a + b*K; the intercept is what every tile
    pays besides its k-loop (epilogue, scheduler, pipeline ramp). One line
    per (dtype, config)."""
    if len(set(args.ks)) < 2:
        error("--ks: give at least two different K to fit a line")
    needs_gpu("fixed-cost")
    from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token

    e, m, n = args.e, args.m, args.n
    mm = torch.full((e,), m, dtype=torch.int32, device="cuda")
    for dtype in ("fp8", "bf16"):
        for cfg in FIXED_COST_CONFIGS:
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
            icpt, slope = fit_line(args.ks, times)
            print(f"{dtype} {cfg.short_name()}: " + ", ".join(f"K={k}: {t:.1f}us" for k, t in zip(args.ks, times))
                  + f"; fit T = {icpt:.1f} us + {slope * 1024:.2f} us per 1024 of K", flush=True)


# ---- mblock-cost ---------------------------------------------------------------
def mblock_cost_probe(case, seed, fp8, dist, rounds, reps):
    """(config, masked_m, [us with masked_m, us clamped to tile_m], clamped / full)."""
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


def mblock_cost(args, error):
    """What an expert's partial last m-block costs: one case timed with its
    masked_m and with masked_m clamped to the tile's rows (every expert then
    fits one m-block), on the same config, in interleaved rounds.

    The clamped run drops the second m-blocks' work (a few rows each, but a
    whole unit of the grid, which reads its weight tile again from L2) while
    moving almost the same bytes, so the ratio bounds what any scheme that
    folds those rows into the first m-block's unit could gain."""
    cases = cases_by_name(args.cases, error)
    needs_gpu("mblock-cost")
    print("| case | config | masked_m | us | clamped to tile_m us | clamped / full |")
    print("|---|---|---|---|---|---|")
    for seed, case in cases:
        cfg, masked, us, ratio = mblock_cost_probe(
            case, seed, args.dtype == "fp8", args.dist, args.rounds, args.reps
        )
        print(f"| {case['name']} | {cfg.short_name()} | {masked} | {us[0]:.1f} | {us[1]:.1f} | {ratio:.3f} |",
              flush=True)


# ---- swap-bound ----------------------------------------------------------------
def transposed_config(tokens: int, fp8: bool) -> GemmConfig:
    """The 128 x T tile of the transposed problem: no cluster (one n-block of
    tokens), no L2 hints (they would favour the wrong operand), balanced
    rounds; fp8 keeps two product sets up to 128 columns and promotes in two
    parts, with whole-tile staging, above (the registers of the 128x192
    prefill tile)."""
    cfg = GemmConfig(tile_m=128, tile_n=tokens, tail=Tail.BALANCE)
    if fp8:
        wide = tokens > 128
        cfg = cfg.replace(
            promotion=Promotion.TWO_PARTS if wide else Promotion.OVERLAPPED,
            staging=Staging.WHOLE_TILE if wide else Staging.PAIR,
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


def swap_bound_probe(case, seed, fp8, dist, token_counts, rounds, reps):
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


def swap_bound(args, error):
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
    quantization of different data; only the time counts.)"""
    cases = cases_by_name(args.cases, error)
    fp8 = args.dtype == "fp8"
    operands = Format.FP8_BLOCK128 if fp8 else Format.BF16
    for t in args.tokens:
        try:
            check_config(transposed_config(t, fp8), operands)
        except ValueError as err:
            error(f"--tokens {t}: {err}")
    needs_gpu("swap-bound")
    heads = " | ".join(f"T={t} us | T={t} / heuristic" for t in args.tokens)
    print(f"| case | heuristic config | masked_m range | heuristic us | {heads} |")
    print("|---|---|---|---|" + "---|---|" * len(args.tokens))
    for seed, case in cases:
        cfg, masked, us, ratios = swap_bound_probe(
            case, seed, fp8, args.dist, args.tokens, args.rounds, args.reps
        )
        cells = " | ".join(f"{u:.1f} | {r:.3f}" for u, r in zip(us[1:], ratios))
        print(f"| {case['name']} | {cfg.short_name()} | {min(masked)}-{max(masked)} | {us[0]:.1f} | {cells} |",
              flush=True)


# ---- command line --------------------------------------------------------------
def parser():
    """The probe.py parser, and its subparsers by command."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    subs = {}

    def add(name, run, help_line):
        sp = sub.add_parser(name, help=help_line, description=inspect.cleandoc(run.__doc__),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(run=run)
        subs[name] = sp
        return sp

    add("launch-floor", launch_floor, "host time of a TVM-FFI call launching an empty kernel")
    sp = add("fixed-cost", fixed_cost, "per-tile fixed cost, from T(K) = a + b*K")
    sp.add_argument("--e", type=int, default=8, help="experts")
    sp.add_argument("--m", type=int, default=128, help="rows of every expert")
    sp.add_argument("--n", type=int, default=7168)
    sp.add_argument("--ks", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    sp = add("mblock-cost", mblock_cost, "cost of the experts' partial last m-blocks")
    probe_arguments(sp, "skewed routing also clamps the hot experts' real m-blocks: no bound there")
    sp = add("swap-bound", swap_bound, "a bound on swap-AB from the transposed problem")
    probe_arguments(sp)
    sp.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 192],
                    help="token tile sizes T of the transposed runs (64, 128 or 192)")
    return p, subs


def main(argv=None):
    p, subs = parser()
    args = p.parse_args(argv)
    args.run(args, subs[args.command].error)


if __name__ == "__main__":
    main()
