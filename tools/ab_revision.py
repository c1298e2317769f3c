#!/usr/bin/env python3
"""The working tree's GEMM against another revision's, or against itself with
config fields changed, in one process.

Kernel changes of a few percent hide in the drift between processes and
machines, so both packages are loaded side by side and timed in interleaved
rounds (docs/design.md, Measurement method); the table gives each median and
the median of the per-round ratios. The outputs of the two are compared bit
for bit on the valid rows first.

The other revision is a copy of its ``flashgemm`` package renamed
``flashgemm_base`` (the package uses relative imports only); make it where
git is, since the GPU machine gets no repository:

    mkdir -p scratch/base && git archive HEAD flashgemm | tar -x -C scratch/base \\
        && mv scratch/base/flashgemm scratch/base/flashgemm_base
    python tools/ab_revision.py --base scratch/base [--dtype bf16 fp8] [--dist uniform skewed]

Of the base package only ``choose_config``, ``GemmConfig`` and
``grouped_gemm_nt_masked`` are used, so a revision from before the package's
restructuring works too.

``--set FIELD=VALUE`` (repeatable) changes the working tree's heuristic
config (a ``GemmConfig`` field: ints, bools as 0/1, enum fields by member
name in any case, e.g. ``--set order=dynamic``, ``--set tail=split``,
``--set promotion=two_parts``, ``--set staging=whole_tile``); a dynamic
order set without a tail drops the config's tail rule. Without ``--base``
the other side is the working tree's unchanged heuristic config:

    python tools/ab_revision.py --set order=dynamic --dist uniform skewed

With ``--base`` and ``--both`` the changes apply to both sides (a kernel
change timed on a config the heuristic does not pick); the base side reads
them through its own ``GemmConfig``, so its fields are the ones to name.

``--shape E,MAX_M,EXPECTED_M,N,K`` (repeatable) runs shapes outside the case
file, drawn the same way (without ``--cases``, only those).

``--no-check`` skips the bit-for-bit comparison: for a bound measured with a
timing-only change that computes wrong results on purpose (such as leaving
out a load), never for a change meant to be kept.

Each package compiles into the same cache directory under its own keys (the
source digest is part of the key).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "benchmarks")]
import flashgemm  # noqa: E402

from flashgemm.formats import Format  # noqa: E402
from flashgemm.sm90.limits import check_config  # noqa: E402
from common import (  # noqa: E402
    DISTRIBUTIONS, apply_changes, case_operands, draw_masked_m, load_cases, paired_median,
    parse_config_changes, time_graph_rounds,
)


def tree_config(case, fp8, changes, num_sms=None, package=flashgemm):
    """A package's heuristic config for a case with ``changes`` applied
    (None: no changes, let the call choose). Only the package's public
    ``choose_config`` is called, so ``package`` may be another revision's."""
    if not changes:
        return None
    cfg = package.choose_config(
        case["expected_m"], case["max_m"], case["N"], case["K"],
        num_sms or torch.cuda.get_device_properties(0).multi_processor_count, fp8, case["E"],
    )
    cfg = apply_changes(cfg, changes)
    if package is flashgemm:
        try:
            check_config(cfg, Format.FP8_BLOCK128 if fp8 else Format.BF16)
        except ValueError as err:
            raise SystemExit(f"{case['name']} {'fp8' if fp8 else 'bf16'}: --set gives {cfg.short_name()}: {err}")
    return cfg


def compare_case(
    base, case, seed, fp8, dist, rounds, reps, changes=None, num_sms=None, base_changes=None, check=True
):
    e, max_m, n, em = case["E"], case["max_m"], case["N"], case["expected_m"]
    masked_m = draw_masked_m(case, seed, dist).cuda()
    a, b, a_scale, b_scale = case_operands(case, seed, fp8)
    outs = [torch.full((e, max_m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    cfg = tree_config(case, fp8, changes, num_sms)
    base_cfg = tree_config(case, fp8, base_changes, num_sms, base)
    fns = [
        lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, outs[0], masked_m, expected_m=em, a_scale=a_scale, b_scale=b_scale, config=cfg,
            num_sms=num_sms,
        ),
        lambda: base.grouped_gemm_nt_masked(
            a, b, outs[1], masked_m, expected_m=em, a_scale=a_scale, b_scale=b_scale, config=base_cfg,
            num_sms=num_sms,
        ),
    ]
    for f in fns:
        f()
    torch.cuda.synchronize()
    if check:
        for i, m in enumerate(masked_m.tolist()):
            if not torch.equal(outs[0][i, :m], outs[1][i, :m]):
                raise SystemExit(f"{case['name']}: expert {i} differs between the two sides")
    ours, theirs = time_graph_rounds(fns, rounds=rounds, reps=reps)
    return (1e3 * statistics.median(ours), 1e3 * statistics.median(theirs),
            paired_median(lambda x, y: x / y, ours, theirs))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="directory holding the flashgemm_base package "
                   "(default: the working tree itself, with its unchanged heuristic config)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a GemmConfig field of the working tree's heuristic config "
                   "(ints, bools as 0/1, enum fields by member name: order=n_major, tail=split, ...)")
    p.add_argument("--both", action="store_true",
                   help="with --base: apply the --set changes to the base's heuristic config too")
    p.add_argument("--cases", nargs="*", help="case names (default: the decode cases)")
    p.add_argument("--dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    p.add_argument("--dist", nargs="+", choices=DISTRIBUTIONS, default=["uniform"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--num-sms", type=int, help="num_sms for both sides' calls (default: every SM)")
    p.add_argument("--shape", action="append", default=[], metavar="E,MAX_M,EXPECTED_M,N,K",
                   help="also run this ad hoc case (seeded by its place after the file's cases)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the bit-for-bit comparison (timing-only changes that compute wrong results)")
    args = p.parse_args()
    if args.both and not args.base:
        p.error("--both applies the --set changes to the --base side too; give --base")
    changes = parse_config_changes(args.set, p.error)
    if not torch.cuda.is_available():
        sys.exit("ab_revision.py needs a CUDA GPU")
    if args.base:
        sys.path.insert(0, os.path.abspath(args.base))
        import flashgemm_base as base
    else:
        base = flashgemm
    # --both: the base reads the changes through its own GemmConfig (its fields, its enums)
    base_changes = parse_config_changes(args.set, p.error, base.GemmConfig) if args.both else None

    spec = load_cases()
    cases = [c for c in spec["cases"] if (c["name"] in args.cases if args.cases else c["regime"] == "decode")]
    if args.shape and not args.cases:
        cases = []  # only the ad hoc shapes
    for text in args.shape:
        try:
            e, max_m, em, n, k = (int(x) for x in text.split(","))
        except ValueError:
            p.error(f"--shape {text!r}: expected five integers E,MAX_M,EXPECTED_M,N,K")
        case = dict(name=f"E{e}-m{em}-n{n}-k{k}", E=e, max_m=max_m, expected_m=em, N=n, K=k, regime="adhoc")
        spec["cases"].append(case)
        cases.append(case)
    changed = f" ({'both sides' if args.both else 'working tree'}: {', '.join(args.set)})" if args.set else ""
    print(f"Device: {torch.cuda.get_device_name()}; heuristic config of each side{changed}; median of "
          f"{args.rounds} interleaved rounds of {args.reps} graph replays; ratio: median per-round ratio"
          f"{f'; num_sms={args.num_sms}' if args.num_sms else ''}"
          f"{'; outputs NOT compared (--no-check)' if args.no_check else ''}")
    print("| dtype | masked_m | case | working tree us | base us | tree / base |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtype:
        for dist in args.dist:
            for case in cases:
                # seed = the case's place in the file, as in bench.py
                ours, theirs, ratio = compare_case(
                    base, case, spec["cases"].index(case), dtype == "fp8", dist, args.rounds, args.reps, changes,
                    args.num_sms, base_changes, not args.no_check,
                )
                print(f"| {dtype} | {dist} | {case['name']} | {ours:.1f} | {theirs:.1f} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
