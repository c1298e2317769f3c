#!/usr/bin/env python3
"""Outputs and signal counters of the working tree's kernels against another
revision's, bit for bit, on a GPU: one configuration per tile family the
sm_90 heuristic can reach (bf16 and fp8, each plain and with both signal
granularities where the family publishes signals), the three fused
combines and the fused SwiGLU, on the same random operands.

The other revision is a copy of its ``flashgemm`` package renamed
``flashgemm_base`` (``tools/ab_revision.py`` says how to make one):

    python tools/ab_bits.py --base scratch/base

A fused combine is compared with one row per token (each output element then
receives exactly one add, so its value does not depend on the order of the
adds). Exit status 1 if anything differs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]
import flashgemm  # noqa: E402
from flashgemm.formats import Format  # noqa: E402
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token  # noqa: E402
from flashgemm.sm90.heuristic import reachable_specs  # noqa: E402

E, MAX_M, N, K = 6, 200, 512, 512


def families(fp8: bool) -> list:
    """One configuration per tile family: (tile, order, tail, promotion, staging, chunks, hints)."""
    seen, configs = set(), []
    for spec in reachable_specs(Format.FP8_BLOCK128 if fp8 else Format.BF16):
        c = spec.config
        if spec.epilogue.value != "store" or spec.signal_mode is not None:
            continue
        family = (c.tile_m, c.tile_n, c.cluster_n, c.order, c.tail, c.promotion, c.staging, c.a_chunk_rows,
                  c.n_major_window)
        if family not in seen:
            seen.add(family)
            configs.append(c)
    return configs


def base_config(base, cfg):
    """The same configuration as the base package's GemmConfig."""
    fields = {}
    for name, value in cfg.__dict__.items():
        if name.startswith("_"):
            continue
        if hasattr(value, "name") and hasattr(value, "value"):  # an enum: the base's member of that name
            value = getattr(getattr(base, type(value).__name__), value.name)
        fields[name] = value
    return base.GemmConfig(**fields)


def operands(fp8: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(E, MAX_M, K, device="cuda", generator=g).to(torch.bfloat16)
    b = (torch.randn(E, N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    masked_m = torch.tensor([0, 1, 63, 64, 129, MAX_M], dtype=torch.int32, device="cuda")
    if not fp8:
        return a, b, None, None, masked_m
    qa, sa = quantize_fp8_per_token(a)
    qb, sb = quantize_fp8_per_block(b)
    return qa, qb, sa, sb, masked_m


def same(x, y) -> bool:
    return x.shape == y.shape and torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                                              y.view(torch.uint8) if y.dtype.itemsize == 1 else y)


def gemm_case(base, cfg, fp8, mode, seed) -> bool:
    a, b, sa, sb, mm = operands(fp8, seed)
    results = []
    for pkg, config in ((flashgemm, cfg), (base, base_config(base, cfg))):
        out = torch.full((E, MAX_M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        kw = dict(a_scale=sa, b_scale=sb, config=config)
        sig = None
        if mode:
            layout = pkg.signal_layout(E, MAX_M, N, K, config=config, fp8=fp8, signal_granularity=mode)
            sig = pkg.alloc_signals(layout, "cuda")
            kw.update(dst_signals=sig, signal_granularity=mode)
        pkg.grouped_gemm_nt_masked(a, b, out, mm, **kw)
        results.append((out, sig))
    torch.cuda.synchronize()
    (o1, s1), (o2, s2) = results
    ok = same(o1.view(torch.int16), o2.view(torch.int16))  # NaN poison compared as bits
    return ok and (s1 is None or same(s1, s2))


def combine_case(base, fp8, target, seed) -> bool:
    a, b, sa, sb, mm = operands(fp8, seed)
    rows = E * MAX_M
    token = torch.arange(rows, dtype=torch.int32, device="cuda").view(E, MAX_M)  # one row per token
    weight = torch.rand(E, MAX_M, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 1))
    outs = []
    for pkg in (flashgemm, base):
        dtype = torch.float32 if target == "fp32" else torch.bfloat16
        output = torch.zeros(rows, N, dtype=dtype, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        peers = torch.tensor([output.data_ptr()], dtype=torch.int64, device="cuda") if target == "peers" else None
        pkg.grouped_gemm_nt_masked(a, b, None, mm, a_scale=sa, b_scale=sb, expected_m=64,
                                   combine=pkg.Combine(token, weight, output, err, peers))
        outs.append((output, err))
    torch.cuda.synchronize()
    return same(outs[0][0], outs[1][0]) and same(outs[0][1], outs[1][1])


def swiglu_case(base, fp8, seed) -> bool:
    a, _, sa, _, mm = operands(fp8, seed)
    inter = 256
    w13 = (torch.randn(E, 2 * inter, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    ws = None
    if fp8:
        w13, ws = quantize_fp8_per_block(w13)
    outs = []
    for mod in (importlib.import_module("flashgemm.moe.gate_up"),
                importlib.import_module(base.__name__ + ".moe.gate_up")):
        got = mod.gate_up_swiglu(a, mod.interleave_w13(w13, ws), mm, x_scale=sa, expected_m=64)
        outs.append(got if fp8 else (got, None))
    torch.cuda.synchronize()
    (h1, s1), (h2, s2) = outs
    ok = all(same(h1[e, :m], h2[e, :m]) for e, m in enumerate(mm.tolist()))
    if fp8:
        ok &= all(same(s1[e, :m], s2[e, :m]) for e, m in enumerate(mm.tolist()))
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="directory holding the flashgemm_base package")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sys.path.insert(0, args.base)
    import flashgemm_base as base

    bad, count = [], 0
    for fp8 in (False, True):
        dtype = "fp8" if fp8 else "bf16"
        for cfg in families(fp8):
            modes = [None] if cfg.tail.name == "SPLIT" else [None, "m_block", "expert"]
            for mode in modes:
                count += 1
                if not gemm_case(base, cfg, fp8, mode, args.seed + count):
                    bad.append(f"{dtype} {cfg.short_name()} signals={mode}")
        for target in ("fp32", "bf16", "peers"):
            count += 1
            if not combine_case(base, fp8, target, args.seed + count):
                bad.append(f"{dtype} fused combine into {target}")
        count += 1
        if not swiglu_case(base, fp8, args.seed + count):
            bad.append(f"{dtype} fused SwiGLU")
    print(f"{count} cases (tile families x signal modes, fused combines, fused SwiGLU), bf16 and fp8: "
          f"{count - len(bad)} bit-identical to the base" + ("".join(f"\n  DIFFERS: {b}" for b in bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
