#!/usr/bin/env python3
"""Benchmark flashgemm against torch's grouped GEMMs, a Triton masked grouped
GEMM (benchmarks/triton_masked.py), for bf16 QuACK's varlen-M grouped GEMM
(quack-kernels, the optional ``bench`` extra) and DeepGEMM's masked kernels
(bf16, and fp8 with the same recipe), on the MoE cases (bf16 and block-scaled
fp8). A peer that is not installed (QuACK, Triton, ``deep_gemm``) is skipped
with a note.

Every implementation runs in the same process on the same data. Times are the
median of CUDA-event timings after warm-up; FLOPs count valid rows only; the
effective bytes are what the op must move at least: the weights (and fp8 weight
scales) of non-empty experts plus the valid rows of A (and its scales) and of
the output. DeepGEMM is also timed against ours in interleaved rounds (the
"paired" column); fp8 rows also print the ratio to DeepGEMM's times listed in
the case file, measured on the same H100 model by the maintainers.

    python benchmarks/bench.py                       # all cases, markdown table to stdout
    python benchmarks/bench.py --cases dsv3-ep8-gate_up --json out.json --md docs/benchmarks.md
    python benchmarks/bench.py --dtype fp8               # block-scaled fp8 vs torch _scaled_grouped_mm
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's flashgemm; common.py beside this file
import flashgemm  # noqa: E402
from flashgemm.config import GemmConfig  # noqa: E402
from flashgemm.formats import Format  # noqa: E402
from flashgemm.reference import grouped_gemm_nt_masked_ref, relative_error  # noqa: E402
from flashgemm.sm90.heuristic import reachable_specs  # noqa: E402
from flashgemm.sm90.limits import check_config  # noqa: E402
from common import (  # noqa: E402,F401  (parse_config_changes: read here by the tests)
    CONFIG_NAME_HELP, DISTRIBUTIONS, case_operands, deepgemm_masked, draw_masked_m, host_us,
    load_cases, paired_median, parse_config, parse_config_changes, time_fn, time_graph, time_graph_rounds,
)


def copy_bandwidth_gbps():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_fn(lambda: y.copy_(x), warmup=3, reps=20)
    return 2 * x.numel() / ms / 1e6


def dense_rates(size=8192):
    """The compute limits of this run: TFLOPS of a dense size^3 bf16 ``mm`` and
    of a rowwise-scaled fp8 ``_scaled_mm`` (the fastest dense fp8 product torch has)."""
    flops = 2 * size**3
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    bf16_ms = time_fn(lambda: a @ b, warmup=5, reps=20)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    sa = torch.rand(size, 1, device="cuda") + 0.5
    sb = torch.rand(1, size, device="cuda") + 0.5
    fp8_ms = time_fn(lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16), warmup=5, reps=20)
    return {"bf16_mm_TFLOPS": flops / bf16_ms / 1e9, "fp8_rowwise_mm_TFLOPS": flops / fp8_ms / 1e9}


def time_triton_peer(results, case, a, b, masked_m, check, reps, a_scale=None, b_scale=None):
    """Time the Triton masked grouped GEMM peer (benchmarks/triton_masked.py) with
    its configurations for the regime, keep the fastest, and check that one's
    poisoned-then-recomputed output with ``check(out)``; None if Triton is absent."""
    try:
        import triton_masked
    except ImportError as exc:
        print(f"{case['name']}: Triton peer skipped ({exc})", flush=True)
        return None
    out = torch.empty(a.shape[0], a.shape[1], b.shape[1], device=a.device, dtype=torch.bfloat16)
    small = case["expected_m"] <= 128
    candidates = [
        (cfg.short_name(), lambda cfg=cfg: triton_masked.masked_gemm(a, b, out, masked_m, cfg, a_scale, b_scale))
        for cfg in triton_masked.CONFIGS if (cfg.block_m == 64) == small
    ]
    kept = time_fastest(results, "triton_masked", candidates, out, check, reps, f"{case['name']}: Triton peer")
    return {"config": kept[0], "err": kept[1]} if kept else None


def time_fastest(results, key, candidates, out, check, reps, what):
    """Time each (label, fn) of ``candidates`` (CUDA-graph replays), keep the
    fastest in ``results[key]``, poison ``out``, rerun that one and check it
    with ``check(out)``. Returns (label, error), or None if none ran (each
    failure is printed, prefixed with ``what``)."""
    best = None
    for label, fn in candidates:
        try:
            ms = time_graph(fn, reps=reps)
        except Exception as exc:  # a peer build that cannot run this case or config
            print(f"{what} {label} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if best is None or ms < best[0]:
            best = (ms, label, fn)
    if best is None:
        return None
    ms, label, fn = best
    out.fill_(float("nan"))
    fn()
    results[key] = ms
    return label, check(out)


QUACK_TUNED = [False]  # --quack-tuned
PAIRED_ROUNDS = [6]  # --paired-rounds
EXTRA_CONFIGS: dict = {}  # --configs: Format -> the configs valid for them

# --sweep: tiles the heuristic never picks, timed after every one it can pick
SWEEP_EXTRA = {
    Format.BF16: (
        GemmConfig(tile_m=64, tile_n=256),
        GemmConfig(tile_m=128, tile_n=192, cluster_n=2),
        GemmConfig(tile_m=128, tile_n=64, cluster_n=2),
        GemmConfig(tile_m=192, tile_n=128, cluster_n=2),
        GemmConfig(tile_m=192, tile_n=64, cluster_n=2),
    ),
    Format.FP8_BLOCK128: (
        GemmConfig(tile_m=128, tile_n=192, cluster_n=2),
        GemmConfig(tile_m=64, tile_n=64, cluster_n=2),
        GemmConfig(tile_m=64, tile_n=192, cluster_n=2),
        GemmConfig(tile_m=192, tile_n=64, cluster_n=2),
    ),
}


def sweep_configs(operands):
    """Every config the heuristic can pick for ``operands``, then ``SWEEP_EXTRA``."""
    picked = dict.fromkeys(spec.config for spec in reachable_specs(operands))
    return list(picked) + [c for c in SWEEP_EXTRA[operands] if c not in picked]


def split_configs(configs, operands, note=print):
    """{operands: the configs of ``configs`` that build for them}; ``note``
    gets each config left out, with the reason."""
    valid = {}
    for ops in operands:
        valid[ops] = []
        for cfg in configs:
            try:
                valid[ops].append(check_config(cfg, ops))
            except ValueError as err:
                note(f"--configs {cfg.short_name()}: not timed for {ops.value} ({err})")
    return valid


def time_configs(results, label, variants, out, check, tol, reps, call):
    """Time ``call(cfg)`` for each config into ``results["cfg:<name>"]``; then
    check each on a NaN-poisoned ``out`` (a tile a config leaves unwritten
    shows) and stop the run if one is wrong. Returns {name: error}."""
    errs = {}
    for cfg in variants:
        results[f"cfg:{cfg.short_name()}"] = time_graph(lambda: call(cfg), reps=reps)
        out.fill_(float("nan"))
        call(cfg)
        errs[cfg.short_name()] = check()
        if errs[cfg.short_name()] > tol:
            raise SystemExit(f"{label}: config {cfg.short_name()} gives a wrong result")
    return errs


def time_quack_peer(results, case, a_packed, bt, rows, check, reps):
    """Time QuACK's varlen-M grouped GEMM (``quack.gemm_interface.gemm`` with
    ``cu_seqlens_m``) on the packed valid rows, with its default configuration,
    or its autotuner's pick with --quack-tuned (it compiles and times ~20
    configurations first), and check its output with ``check(out_packed)``;
    None if quack-kernels is absent (the optional ``bench`` extra)."""
    try:
        from quack.gemm_interface import gemm as quack_gemm
    except ImportError as exc:
        print(f"{case['name']}: QuACK peer skipped (quack-kernels not installed: {exc})", flush=True)
        return None
    if a_packed.shape[0] == 0:
        return None
    cu_seqlens_m = torch.tensor([0] + list(itertools.accumulate(rows)), dtype=torch.int32, device=a_packed.device)
    out = torch.empty(a_packed.shape[0], bt.shape[-1], device=a_packed.device, dtype=torch.bfloat16)

    def fn():
        quack_gemm(a_packed, bt, out=out, cu_seqlens_m=cu_seqlens_m, tuned=QUACK_TUNED[0])

    try:
        results["quack_varlen"] = time_graph(fn, reps=reps)
    except Exception as exc:  # a QuACK build that cannot run this case
        print(f"{case['name']}: QuACK peer failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    out.fill_(float("nan"))
    fn()
    return {"config": "autotuned" if QUACK_TUNED[0] else "default", "err": check(out)}


def time_deepgemm_peer(results, case, a, b, masked_m, check, reps, a_scale=None, b_scale=None, ours=None):
    """Time DeepGEMM's masked grouped GEMM on the same operands, in the same run:
    ``deep_gemm.m_grouped_fp8_gemm_nt_masked`` (same 1x128 / 128x128 recipe) when
    scales are given, else ``m_grouped_bf16_gemm_nt_masked``. DeepGEMM picks its
    tile from an expected_m hint: both the case's expected_m (what we are given)
    and 1.2x it (what DeepGEMM's own tests pass) are timed, and the faster is kept.
    Its output is poisoned, recomputed and checked with ``check(out)``. None,
    with a note, where ``deep_gemm`` cannot be imported (an optional peer).

    With ``ours`` (our call on the same operands) the kept hint is then timed
    against it in ``PAIRED_ROUNDS`` interleaved rounds (``time_graph_rounds``):
    the returned ``paired`` is the median over rounds of DeepGEMM's time over
    ours, the measure to compare with: the single timings each ran in the
    power state the kernels before them left (docs/design.md, Measurement method)."""
    try:
        import deep_gemm
    except Exception as exc:  # not installed, or it fails to load
        print(f"{case['name']}: DeepGEMM peer skipped (deep_gemm not importable: {exc})", flush=True)
        return None
    out = torch.empty(a.shape[0], a.shape[1], b.shape[1], device=a.device, dtype=torch.bfloat16)
    gemm = deepgemm_masked(deep_gemm, a, b, out, masked_m, a_scale, b_scale)
    candidates = [
        (hint, lambda hint=hint: gemm(hint))
        for hint in sorted({case["expected_m"], int(case["expected_m"] * 1.2)})
    ]
    kept = time_fastest(results, "deepgemm_masked", candidates, out, check, reps,
                        f"{case['name']}: DeepGEMM peer, expected_m")
    if not kept:
        return None
    peer = {"expected_m": kept[0], "err": kept[1], "paired": None}
    if ours is not None:
        samples = time_graph_rounds([ours, lambda: gemm(kept[0])], rounds=PAIRED_ROUNDS[0], reps=reps)
        peer["paired"] = paired_median(lambda o, d: d / o, *samples)
    return peer


def _limits_line(limits):
    return (f"limits measured in this run: copy {limits['copy_GBps']:.0f} GB/s (read+write), dense "
            f"8192^3 bf16 mm {limits['bf16_mm_TFLOPS']:.0f} TFLOPS, fp8 rowwise _scaled_mm "
            f"{limits['fp8_rowwise_mm_TFLOPS']:.0f} TFLOPS")


def run_fp8_case(case, seed, reps, sweep=False, dist="uniform"):
    """Block-scaled fp8 (1x128 / 128x128) against torch's rowwise-scaled fp8 grouped GEMM."""
    from flashgemm.reference import similarity

    e_count, max_m, n, k = case["E"], case["max_m"], case["N"], case["K"]
    masked_cpu = draw_masked_m(case, seed, dist)
    rows = masked_cpu.tolist()
    total_rows = sum(rows)
    dev = "cuda"
    a, b, a_scale, b_scale = case_operands(case, seed, fp8=True, dev=dev)
    masked_m = masked_cpu.to(dev)
    out = torch.empty(e_count, max_m, n, device=dev, dtype=torch.bfloat16)
    nkb, nnb = -(-k // 128), -(-n // 128)
    flops = 2.0 * total_rows * n * k
    nonempty = sum(1 for r in rows if r > 0)
    eff_bytes = nonempty * (n * k + 4.0 * nnb * nkb) + total_rows * (k + 4.0 * nkb) + 2.0 * total_rows * n

    def ours():
        flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, expected_m=case["expected_m"]
        )

    top = max(1, max(rows))
    ref = grouped_gemm_nt_masked_ref(
        a[:, :top], b, masked_m.clamp(max=top), a_scale=a_scale[:, :top], b_scale=b_scale
    )

    def max_diff(got=out):
        torch.cuda.synchronize()
        diffs = [similarity(got[e, : rows[e]].float(), ref[e, : rows[e]]) for e in range(e_count) if rows[e]]
        return float("inf") if any(x != x for x in diffs) else max(diffs, default=0.0)

    results = {}
    ours()
    errs = [max_diff()]
    results["flashgemm"] = time_graph(ours, reps=reps)
    out.fill_(float("nan"))
    time_graph(ours, reps=1, calls=1)
    errs.append(max_diff())
    if max(errs) > 1e-3:
        raise SystemExit(f"{case['name']} fp8: flashgemm result wrong (max similarity diff {max(errs):.2e})")
    variants = list(EXTRA_CONFIGS.get(Format.FP8_BLOCK128, ()))
    if sweep:
        variants += sweep_configs(Format.FP8_BLOCK128)
    sweep_err = time_configs(
        results, f"{case['name']} fp8", variants, out, max_diff, 1e-3, reps,
        lambda cfg: flashgemm.grouped_gemm_nt_masked(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=cfg
        ),
    )
    # torch peer: rowwise scales (one per row of A, one per column of B), packed valid rows
    a_packed = torch.cat([a[e, : rows[e]] for e in range(e_count)])
    sa_packed = torch.rand(total_rows, device=dev) + 0.5
    sb = torch.rand(e_count, n, device=dev) + 0.5
    offs = torch.cumsum(masked_cpu, 0).to(torch.int32).to(dev)
    bt = b.transpose(-2, -1)
    try:
        results["torch_scaled_grouped_mm_packed"] = time_graph(
            lambda: torch._scaled_grouped_mm(
                a_packed, bt, sa_packed, sb, offs=offs, out_dtype=torch.bfloat16
            ),
            reps=reps,
        )
    except (RuntimeError, AttributeError) as exc:  # torch build without it, or no rows
        print(f"{case['name']}: torch._scaled_grouped_mm not timed: {exc}", flush=True)
    triton_peer = time_triton_peer(results, case, a, b, masked_m, max_diff, reps, a_scale, b_scale)
    if triton_peer and triton_peer["err"] > 1e-3:
        raise SystemExit(f"{case['name']} fp8: Triton peer wrong (max similarity diff {triton_peer['err']:.2e})")
    deepgemm_peer = time_deepgemm_peer(results, case, a, b, masked_m, max_diff, reps, a_scale, b_scale,
                                       ours=ours)
    if deepgemm_peer and deepgemm_peer["err"] > 1e-3:
        raise SystemExit(f"{case['name']} fp8: DeepGEMM peer wrong (max similarity diff {deepgemm_peer['err']:.2e})")
    return {
        "triton_peer": triton_peer,
        "deepgemm_peer": deepgemm_peer,
        "case": _label(case, dist), "dtype": "fp8", "regime": case["regime"], "dist": dist,
        "E": e_count, "max_m": max_m, "N": n, "K": k, "valid_rows": total_rows,
        "max_similarity_diff": max(errs), "sweep_max_similarity_diff": sweep_err,
        "flops": flops, "eff_bytes": eff_bytes, "ms": results,
    }


def _label(case, dist):
    return case["name"] if dist == "uniform" else f"{case['name']} [{dist}]"


def run_case(case, seed, reps, host=False, sweep=False, dist="uniform"):
    e_count, max_m, n, k = case["E"], case["max_m"], case["N"], case["K"]
    masked_cpu = draw_masked_m(case, seed, dist)
    rows = masked_cpu.tolist()
    total_rows = sum(rows)
    dev = "cuda"
    a, b, _, _ = case_operands(case, seed, dev=dev)
    masked_m = masked_cpu.to(dev)
    out = torch.empty(e_count, max_m, n, device=dev, dtype=torch.bfloat16)

    flops = 2.0 * total_rows * n * k
    nonempty = sum(1 for r in rows if r > 0)
    eff_bytes = 2.0 * (nonempty * n * k + total_rows * k + total_rows * n)

    results = {}

    def ours():
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=case["expected_m"])

    ours()
    top = max(1, max(rows))
    ref = grouped_gemm_nt_masked_ref(a[:, :top], b, masked_m.clamp(max=top))

    def max_err(got=out):
        torch.cuda.synchronize()
        errs = [relative_error(got[e, : rows[e]].float(), ref[e, : rows[e]]) for e in range(e_count) if rows[e]]
        return float("inf") if any(x != x for x in errs) else max(errs, default=0.0)  # NaN = unwritten

    errs = [max_err()]
    results["flashgemm"] = time_graph(ours, reps=reps)
    # the graph really launched our kernel: poison, replay once more, re-check
    out.fill_(float("nan"))
    time_graph(ours, reps=1, calls=1)
    torch.cuda.synchronize()
    errs.append(max_err())
    results["flashgemm_eager"] = time_fn(ours, reps=reps)
    if max(errs) > 1e-2:
        raise SystemExit(f"{case['name']}: flashgemm result wrong (max rel err {max(errs):.2e})")
    ours_host_us = host_us(ours) if host else None

    variants = list(EXTRA_CONFIGS.get(Format.BF16, ()))
    if sweep:
        variants += sweep_configs(Format.BF16)
    sweep_err = time_configs(
        results, case["name"], variants, out, max_err, 1e-2, reps,
        lambda cfg: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg),
    )

    bt = b.transpose(-2, -1)  # (E, K, N) view, K-major columns, as _grouped_mm wants
    results["torch_grouped_mm_3d"] = time_graph(lambda: torch._grouped_mm(a, bt), reps=reps)
    a_packed = torch.cat([a[e, : rows[e]] for e in range(e_count)])
    offs = torch.cumsum(masked_cpu, 0).to(torch.int32).to(dev)
    try:
        results["torch_grouped_mm_packed"] = time_graph(
            lambda: torch._grouped_mm(a_packed, bt, offs=offs), reps=reps
        )
    except RuntimeError as exc:  # no valid rows at all
        print(f"{case['name']}: torch._grouped_mm packed not timed: {exc}", flush=True)
    triton_peer = time_triton_peer(results, case, a, b, masked_m, max_err, reps)
    if triton_peer and triton_peer["err"] > 1e-2:
        raise SystemExit(f"{case['name']}: Triton peer wrong (max rel err {triton_peer['err']:.2e})")

    def packed_err(got):  # the packed output, expert by expert, against the same reference
        starts = [0] + list(itertools.accumulate(rows))
        return max_err(torch.stack([
            torch.nn.functional.pad(got[starts[e]:starts[e + 1]], (0, 0, 0, max_m - rows[e]))
            for e in range(e_count)
        ]))

    quack_peer = time_quack_peer(results, case, a_packed, bt, rows, packed_err, reps)
    if quack_peer and quack_peer["err"] > 1e-2:
        raise SystemExit(f"{case['name']}: QuACK peer wrong (max rel err {quack_peer['err']:.2e})")
    deepgemm_peer = time_deepgemm_peer(results, case, a, b, masked_m, max_err, reps, ours=ours)
    if deepgemm_peer and deepgemm_peer["err"] > 1e-2:
        raise SystemExit(f"{case['name']}: DeepGEMM peer wrong (max rel err {deepgemm_peer['err']:.2e})")
    return {
        "triton_peer": triton_peer,
        "deepgemm_peer": deepgemm_peer,
        "quack_peer": quack_peer,
        "case": _label(case, dist),
        "dist": dist,
        "dtype": "bf16",
        "regime": case["regime"],
        "E": e_count, "max_m": max_m, "N": n, "K": k,
        "valid_rows": total_rows,
        "max_rel_err": max(errs),
        "host_us": ours_host_us,
        "sweep_max_rel_err": sweep_err,
        "flops": flops,
        "eff_bytes": eff_bytes,
        "ms": results,
    }


def _quack_mode(rows):
    modes = {r["quack_peer"]["config"] for r in rows if r.get("quack_peer")}
    return ("configuration: " + ", ".join(sorted(modes))) if modes else "not run (quack-kernels absent)"


def _deepgemm_mode(rows):
    hints = sorted({r["deepgemm_peer"]["expected_m"] for r in rows if r.get("deepgemm_peer")})
    if not hints:
        return "not run (deep_gemm not importable)"
    return ("timed in this run with the faster of two expected_m hints per case (the case's and 1.2x; "
            f"kept: {', '.join(map(str, hints))}); 'paired' is the median over {PAIRED_ROUNDS[0]} "
            "interleaved rounds of its time over ours, timed back to back with ours in each round "
            "(the measure to compare with; the single timings each ran in the power state the "
            "kernels before them left)")


def _paired(r):
    paired = (r.get("deepgemm_peer") or {}).get("paired")
    return f"{paired:.2f}x" if paired else "n/a"


def to_markdown(rows, limits, device, cmd):
    date = datetime.date.today().isoformat()
    lines = [
        f"Device: {device}; date: {date}; command: `{cmd}`; {_limits_line(limits)}. "
        "Every implementation timed the same way: median of 30 "
        "CUDA-event timings of CUDA-graph replays (10 calls per graph, 3 warm-up replays), per call; "
        "'eager' is back-to-back launches without a graph (includes host overhead when the host is the "
        "bottleneck). TFLOPS over valid rows; GB/s on effective bytes (weights of non-empty experts + "
        "valid rows of A and out). % roofline: max(bytes / copy bandwidth, FLOPs / dense rate) over "
        "our time. Triton masked: the fastest of its configurations per case. QuACK: varlen-M grouped "
        f"GEMM on the packed valid rows, {_quack_mode(rows)}. DeepGEMM: its masked bf16 kernel "
        f"{_deepgemm_mode(rows)}.",
        "",
        "| case | regime | flashgemm us | eager us | TFLOPS | GB/s | % copy BW | % roofline | torch packed us | torch 3D us | Triton masked us | QuACK varlen us | DeepGEMM us | vs packed | vs 3D | vs Triton | vs QuACK | vs DeepGEMM | vs DeepGEMM paired | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        us, tflops, gbps, pct, roof = _rates(r, limits, "bf16_mm_TFLOPS")
        packed = ms.get("torch_grouped_mm_packed")
        lines.append(
            f"| {r['case']} | {r['regime']} | {us} | {ms['flashgemm_eager'] * 1e3:.1f} | {tflops} | "
            f"{gbps} | {pct} | {roof} | {_us(packed)} | {_us(ms['torch_grouped_mm_3d'])} | "
            f"{_us(ms.get('triton_masked'))} | {_us(ms.get('quack_varlen'))} | {_us(ms.get('deepgemm_masked'))} | "
            f"{_ratio(packed, ms['flashgemm'])} | {_ratio(ms['torch_grouped_mm_3d'], ms['flashgemm'])} | "
            f"{_ratio(ms.get('triton_masked'), ms['flashgemm'])} | {_ratio(ms.get('quack_varlen'), ms['flashgemm'])} | "
            f"{_ratio(ms.get('deepgemm_masked'), ms['flashgemm'])} | {_paired(r)} | {r['max_rel_err']:.1e} |"
        )
    return "\n".join(lines)


def _rates(r, limits, dense_key):
    """(us, TFLOPS, GB/s, % of copy bandwidth, % of roofline) cells of our time for one row."""
    ms = r["ms"]["flashgemm"]
    gbps = r["eff_bytes"] / ms / 1e6
    bound_ms = max(r["eff_bytes"] / (limits["copy_GBps"] * 1e6), r["flops"] / (limits[dense_key] * 1e9))
    return (f"{ms * 1e3:.1f}", f"{r['flops'] / ms / 1e9:.0f}", f"{gbps:.0f}",
            f"{100 * gbps / limits['copy_GBps']:.0f}%", f"{100 * bound_ms / ms:.0f}%")


def _us(peer_ms):
    return f"{peer_ms * 1e3:.1f}" if peer_ms else "n/a"


def _ratio(peer_ms, ours_ms):
    """A peer's time over ours (>1: we are faster), or n/a."""
    return f"{peer_ms / ours_ms:.2f}x" if peer_ms else "n/a"


def fp8_markdown(rows, limits, device, cmd, deepgemm):
    date = datetime.date.today().isoformat()
    lines = [
        f"Device: {device}; date: {date}; command: `{cmd}`; {_limits_line(limits)}. Block-scaled fp8 (1x128 activation, 128x128 weight scales), "
        "bf16 out; timing as for bf16 (CUDA-graph replay, median of 30). torch peer: "
        "`_scaled_grouped_mm` with rowwise scales on packed valid rows (a simpler recipe). "
        f"DeepGEMM: its masked fp8 kernel (same recipe) {_deepgemm_mode(rows)}; 'listed' is its "
        "time in the case file (same H100 model, measured by the maintainers, not in this run). "
        "GB/s on effective bytes (fp8 weights and scales of non-empty experts + valid rows of A, "
        "its scales and out).",
        "",
        "| case | regime | flashgemm us | TFLOPS | GB/s | % copy BW | % roofline | torch fp8 us | vs torch | Triton masked us | vs Triton | DeepGEMM us | vs DeepGEMM | vs DeepGEMM paired | DeepGEMM listed us | vs listed | max sim diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        us, tflops, gbps, pct, roof = _rates(r, limits, "fp8_rowwise_mm_TFLOPS")
        peer = ms.get("torch_scaled_grouped_mm_packed")
        dg_us = deepgemm.get(r["case"], {}).get("deepgemm_fp8_us")
        dg = dg_us / 1e3 if dg_us else None
        lines.append(
            f"| {r['case']} | {r['regime']} | {us} | {tflops} | {gbps} | {pct} | {roof} | "
            f"{_us(peer)} | {_ratio(peer, ms['flashgemm'])} | {_us(ms.get('triton_masked'))} | "
            f"{_ratio(ms.get('triton_masked'), ms['flashgemm'])} | {_us(ms.get('deepgemm_masked'))} | "
            f"{_ratio(ms.get('deepgemm_masked'), ms['flashgemm'])} | {_paired(r)} | {_us(dg)} | "
            f"{_ratio(dg, ms['flashgemm'])} | "
            f"{r['max_similarity_diff']:.1e} |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", help="case names (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", help="write raw results here")
    p.add_argument("--sweep", action="store_true",
                   help="also time every config the heuristic can pick, and a few it cannot")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--configs", nargs="*", default=[],
                   help=f"also time these configs, by the short names the tables print: {CONFIG_NAME_HELP}")
    p.add_argument("--quack-tuned", action="store_true",
                   help="let QuACK's autotuner pick its configuration per case (slow first run)")
    p.add_argument("--paired-rounds", type=int, default=6,
                   help="interleaved rounds of ours against DeepGEMM (its 'paired' column)")
    p.add_argument("--dtype", choices=["bf16", "fp8", "both"], default="bf16")
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="uniform",
                   help="masked_m distribution (uniform = the case file's rule)")
    args = p.parse_args()
    QUACK_TUNED[0] = args.quack_tuned
    PAIRED_ROUNDS[0] = args.paired_rounds
    dtypes = {"bf16": [Format.BF16], "fp8": [Format.FP8_BLOCK128]}.get(args.dtype, [Format.BF16, Format.FP8_BLOCK128])
    EXTRA_CONFIGS.clear()
    EXTRA_CONFIGS.update(split_configs([parse_config(c) for c in args.configs], dtypes))
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU (none found)")
    spec = load_cases()
    cases = [c for c in spec["cases"] if not args.cases or c["name"] in args.cases]
    device = torch.cuda.get_device_name()
    limits = {"copy_GBps": copy_bandwidth_gbps(), **dense_rates()}
    print(_limits_line(limits), flush=True)
    rows, fp8_rows = [], []
    for i, case in enumerate(cases):
        # the seed is the case's place in the file, so a run of a few cases draws
        # the same masked_m as a full run
        seed = args.seed + spec["cases"].index(case)
        if args.dtype in ("bf16", "both"):
            r = run_case(case, seed, args.reps, host=(i == 0), sweep=args.sweep, dist=args.dist)
            rows.append(r)
            print(f"{r['case']}: " + ", ".join(f"{k}={v * 1e3:.1f}us" for k, v in r["ms"].items())
                  + (f", flashgemm host {r['host_us']:.1f}us/call" if r["host_us"] else ""), flush=True)
        if args.dtype in ("fp8", "both"):
            r = run_fp8_case(case, seed, args.reps, sweep=args.sweep, dist=args.dist)
            fp8_rows.append(r)
            print(f"{r['case']} fp8: " + ", ".join(f"{k}={v * 1e3:.1f}us" for k, v in r["ms"].items()),
                  flush=True)
    cmd = "python benchmarks/bench.py " + " ".join(sys.argv[1:])
    parts = []
    if rows:
        parts.append(to_markdown(rows, limits, device, cmd.strip()))
    if fp8_rows:
        deepgemm = spec.get("deepgemm_h100_2026_11_22", {})
        parts.append(fp8_markdown(fp8_rows, limits, device, cmd.strip(), deepgemm))
    md = "\n\n".join(parts)
    print(md)
    rows = rows + fp8_rows
    if args.json:
        json.dump({"device": device, "copy_GBps": limits["copy_GBps"], "limits": limits, "rows": rows},
                  open(args.json, "w"), indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
