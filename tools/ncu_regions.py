#!/usr/bin/env python3
"""One launch's warp-stall samples summed by code region.

Record a launch with its source counters and export ncu's source page (the
launch from ``tools/profile_case.py --range``; leave the clocks alone)::

    ncu --clock-control none --profile-from-start off \\
        --section WarpStateStats --section SourceCounters -o rep \\
        python tools/profile_case.py dsv3-ep8-gate_up --dtype mxfp4 --range
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python tools/ncu_regions.py rep.csv

A region is a run of consecutive SASS instructions executed equally often:
in a warp-specialized kernel, one role's loop body (docs/design.md, "The
converter's arithmetic, located with ncu"). Printed: each region holding at
least 1% of the samples, with its top stall reasons, then the busiest
instructions.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_sass(path: str):
    """(header, rows) of the source page's SASS table."""
    text = open(path).read()
    start = text.find('"Address"')
    if start < 0:
        raise SystemExit(f"{path}: no SASS table (export with --page source --csv --print-source sass)")
    rows = list(csv.reader(io.StringIO(text[start:])))
    head = rows[0]
    if SAMPLES not in head or EXECUTED not in head:
        raise SystemExit(f"{path}: no stall samples (record with --section SourceCounters)")
    return head, [r for r in rows[1:] if len(r) == len(head)]


def regions(head, rows):
    """Runs of consecutive rows with the same execution count."""
    at = head.index(EXECUTED)
    runs = []
    for r in rows:
        if runs and runs[-1][-1][at] == r[at]:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu's source page, exported as csv with SASS")
    p.add_argument("--top", type=int, default=20, help="busiest instructions to list")
    args = p.parse_args(argv)
    head, rows = read_sass(args.csv)
    at_samples, at_executed = head.index(SAMPLES), head.index(EXECUTED)
    reasons = [i for i, name in enumerate(head) if name.startswith("stall_") and "Not Issued" not in name]

    def samples(group):
        return sum(float(r[at_samples] or 0) for r in group)

    def stalls(group):
        count = collections.Counter()
        for r in group:
            for i in reasons:
                count[head[i][len("stall_"):]] += float(r[i] or 0)
        whole = sum(count.values()) or 1.0
        return ", ".join(f"{name} {100 * v / whole:.0f}%" for name, v in count.most_common(3))

    total = samples(rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples")
    for group in regions(head, rows):
        share = samples(group) / total
        if share >= 0.01:
            print(f"{group[0][0]}  {len(group):4d} instructions  executed {group[0][at_executed]:>9}  "
                  f"{100 * share:5.1f}%  {stalls(group)}  | {group[0][1].strip()[:48]}")
    print()
    for r in sorted(rows, key=lambda r: -float(r[at_samples] or 0))[:args.top]:
        print(f"{r[0]}  {100 * float(r[at_samples] or 0) / total:5.1f}%  {stalls([r])}  | {r[1].strip()[:60]}")


if __name__ == "__main__":
    main()
