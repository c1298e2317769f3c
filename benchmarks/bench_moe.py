#!/usr/bin/env python3
"""The MoE expert path on one GPU: the combine fused into the down GEMM, and
the whole layer.

(a) ``--suite fused``, every decode case of the case file (its N taken as the
    hidden size the combine sums over): the GEMM alone on all SMs; the GEMM
    with the combine fused into its epilogue (``combine=``); and the GEMM on
    ``132 - combine_sms`` SMs with the reference combine overlapped on the
    rest (``overlap.run_gemm_and_combine``). Each token sums the rows of its
    ``--top-k`` experts (E * expected_m / top_k tokens).
(b) ``--suite layer``: ``moe.MaskedExperts`` on DeepSeek-V3 (EP8: 32 local
    experts, H 7168, I 2048) and Qwen3-235B (EP8: 16 local experts, H 4096,
    I 1536) decode shapes with top-8 routing: gate_up, the activation, gate_up
    with the activation fused (``moe.gate_up``), down with the fused combine,
    each alone, and the whole path in one CUDA graph with either activation path,
    against the two GEMMs back to back in one graph (and against the sum of
    each GEMM timed alone, which keeps its inputs and output in L2).

Times are per call from CUDA-graph replays, timed in interleaved rounds, the
ratios taken round by round (``common.time_graph_rounds``). Bytes and FLOPs
count valid rows only.

    python benchmarks/bench_moe.py [--suite fused layer] [--dtype fp8 bf16] [--json F] [--md F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's flashgemm; common.py beside this file

import flashgemm  # noqa: E402
from common import case_operands, draw_masked_m, load_cases, paired_median, time_graph_rounds  # noqa: E402
from flashgemm import Combine  # noqa: E402
from flashgemm.overlap import run_gemm_and_combine  # noqa: E402

# DeepSeek-V3 / Qwen3-235B-A22B with 8-way expert parallelism, decode:
# (name, experts in all, local experts, hidden, intermediate, tokens per rank)
LAYERS = (
    ("dsv3-ep8-t128", 256, 32, 7168, 2048, 128),
    ("dsv3-ep8-t256", 256, 32, 7168, 2048, 256),
    ("qwen3-235b-ep8-t128", 128, 16, 4096, 1536, 128),
)
EP = 8
TOP_K = 8


def routing(masked_m: torch.Tensor, max_m: int, num_tokens: int, seed: int):
    """token_index / weight [E, max_m]: each expert's rows come from distinct
    tokens (a token meets an expert at most once), weights in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    e_count = masked_m.shape[0]
    tok = torch.zeros(e_count, max_m, dtype=torch.int32)
    for e, m in enumerate(masked_m.tolist()):
        if m:
            tok[e, :m] = torch.randperm(num_tokens, generator=g)[:m].to(torch.int32)
    return tok.cuda(), torch.rand(e_count, max_m, generator=g).cuda()


def fused_case(case, fp8, seed, rounds, reps, combine_sms, top_k):
    e_count, max_m, n, k, em = case["E"], case["max_m"], case["N"], case["K"], case["expected_m"]
    a, b, a_scale, b_scale = case_operands(case, seed, fp8)
    scales = dict(a_scale=a_scale, b_scale=b_scale)
    masked_m = draw_masked_m(case, seed)
    num_tokens = max(int(masked_m.max()), round(e_count * em / top_k))
    tok, wt = routing(masked_m, max_m, num_tokens, seed)
    masked_m = masked_m.to(torch.int32).cuda()
    out = torch.empty(e_count, max_m, n, device="cuda", dtype=torch.bfloat16)
    combined = torch.zeros(num_tokens, n, device="cuda")
    combined_bf16 = torch.zeros(num_tokens, n, device="cuda", dtype=torch.bfloat16)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    timed = {
        "gemm_us": lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=em, **scales),
        "fused_us": lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, None, masked_m, expected_m=em, combine=Combine(tok, wt, combined, err), **scales),
        "fused_bf16_us": lambda: flashgemm.grouped_gemm_nt_masked(
            a, b, None, masked_m, expected_m=em, combine=Combine(tok, wt, combined_bf16, err), **scales),
        "two_stream_us": lambda: run_gemm_and_combine(
            a, b, masked_m, tok, wt, combined, gemm_sms=sm_count - combine_sms, combine_sms=combine_sms,
            expected_m=em, out=out, **scales),
        "memset_us": lambda: combined.zero_(),
    }
    samples = dict(zip(timed, time_graph_rounds(list(timed.values()), rounds=rounds, reps=reps)))
    rows = int(masked_m.sum())
    r = {"case": case["name"], "dtype": "fp8" if fp8 else "bf16", "tokens": num_tokens, "rows": rows,
         "combine_sms": combine_sms}
    r.update({name: 1e3 * statistics.median(t) for name, t in samples.items()})
    r["fused_vs_gemm"] = paired_median(lambda g, f: f / g, samples["gemm_us"], samples["fused_us"])
    r["fused_bf16_vs_gemm"] = paired_median(lambda g, f: f / g, samples["gemm_us"], samples["fused_bf16_us"])
    r["two_stream_vs_gemm"] = paired_median(lambda g, o: o / g, samples["gemm_us"], samples["two_stream_us"])
    r["bf16_sums_error"] = _sums_error(a, b, masked_m, tok, wt, num_tokens, n, em, scales)
    assert int(err.item()) == 0, "the routing named a token out of range"
    return r


def _sums_error(a, b, masked_m, tok, wt, num_tokens, n, em, scales):
    """One call into fp32 and one into bf16 from zero: max |bf16 - fp32| over
    max |fp32| (the fp32 sums stand for the exact ones: their own error is
    about 2**-16 of the bf16 one's)."""
    sums = {}
    for dtype in (torch.float32, torch.bfloat16):
        sums[dtype] = torch.zeros(num_tokens, n, device="cuda", dtype=dtype)
        flashgemm.grouped_gemm_nt_masked(a, b, None, masked_m, expected_m=em,
                                         combine=Combine(tok, wt, sums[dtype]), **scales)
    ref = sums[torch.float32]
    return float((sums[torch.bfloat16].float() - ref).abs().max() / ref.abs().max())


def layer_case(spec, fp8, seed, rounds, reps):
    from flashgemm.moe.activation import silu_mul
    from flashgemm.moe.gate_up import gate_up_swiglu
    from flashgemm.moe.layer import ActivationPath, MaskedExperts
    from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token

    name, experts, e_local, hidden, inter, per_rank = spec
    num_tokens = per_rank * EP
    max_m = num_tokens  # DeepEP low-latency: tokens per rank x ranks
    em = num_tokens * TOP_K // experts
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    masked = (em * (0.7 + 0.6 * torch.rand(e_local, generator=g))).to(torch.int32).clamp(1, max_m)
    tok, wt = routing(masked, max_m, num_tokens, seed)
    masked_m = masked.cuda()
    x = torch.randn(e_local, max_m, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(e_local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(e_local, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    xs = s13 = s2 = None
    if fp8:
        x, xs = quantize_fp8_per_token(x)
        w13, s13 = quantize_fp8_per_block(w13)
        w2, s2 = quantize_fp8_per_block(w2)
    layer = MaskedExperts(w13, w2, w13_scale=s13, w2_scale=s2, activation=ActivationPath.FUSED)
    layer_sep = MaskedExperts(w13, w2, w13_scale=s13, w2_scale=s2, activation=ActivationPath.SEPARATE)
    combined = torch.zeros(num_tokens, hidden, device="cuda")
    combined_bf16 = torch.zeros(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    gu = flashgemm.grouped_gemm_nt_masked(x, w13, None, masked_m, a_scale=xs, b_scale=s13, expected_m=em)
    act = silu_mul(gu, masked_m, fp8=fp8)
    h, hs = act if fp8 else (act, None)
    h2, hs2 = (torch.empty_like(h), torch.empty_like(hs)) if fp8 else (torch.empty_like(h), None)
    y = torch.empty(e_local, max_m, hidden, device="cuda", dtype=torch.bfloat16)
    timed = {
        "gate_up_us": lambda: flashgemm.grouped_gemm_nt_masked(
            x, w13, gu, masked_m, a_scale=xs, b_scale=s13, expected_m=em),
        "act_us": lambda: silu_mul(gu, masked_m, fp8=fp8, out=h, out_scale=hs),
        "gate_up_act_us": lambda: gate_up_swiglu(x, layer.w13_interleaved, masked_m, x_scale=xs,
                                                 out=h2, out_scale=hs2, expected_m=em),
        "down_us": lambda: flashgemm.grouped_gemm_nt_masked(
            h, w2, y, masked_m, a_scale=hs, b_scale=s2, expected_m=em),
        "down_fused_us": lambda: flashgemm.grouped_gemm_nt_masked(
            h, w2, None, masked_m, a_scale=hs, b_scale=s2, expected_m=em,
            combine=Combine(tok, wt, combined, err)),
        "down_fused_bf16_us": lambda: flashgemm.grouped_gemm_nt_masked(
            h, w2, None, masked_m, a_scale=hs, b_scale=s2, expected_m=em,
            combine=Combine(tok, wt, combined_bf16, err)),
        # the two GEMMs back to back: their outputs leave L2 as they do in the
        # layer (repeated calls of one GEMM keep its output and inputs there)
        "gemms_us": lambda: (
            flashgemm.grouped_gemm_nt_masked(x, w13, gu, masked_m, a_scale=xs, b_scale=s13, expected_m=em),
            flashgemm.grouped_gemm_nt_masked(h, w2, y, masked_m, a_scale=hs, b_scale=s2, expected_m=em)),
        "layer_us": lambda: layer(x, masked_m, x_scale=xs, expected_m=em,
                                  combine=Combine(tok, wt, combined, err)),
        "layer_bf16_us": lambda: layer(x, masked_m, x_scale=xs, expected_m=em,
                                       combine=Combine(tok, wt, combined_bf16, err)),
        "layer_sep_bf16_us": lambda: layer_sep(x, masked_m, x_scale=xs, expected_m=em,
                                               combine=Combine(tok, wt, combined_bf16, err)),
    }
    samples = dict(zip(timed, time_graph_rounds(list(timed.values()), rounds=rounds, reps=reps)))
    rows = int(masked.sum())
    nonempty = int((masked > 0).sum())
    elem = 1 if fp8 else 2
    r = {"case": name, "dtype": "fp8" if fp8 else "bf16", "experts": e_local, "tokens": num_tokens,
         "rows": rows, "expected_m": em}
    r.update({k: 1e3 * statistics.median(t) for k, t in samples.items()})
    r["layer_vs_gemms"] = paired_median(lambda l, a, d: l / (a + d), samples["layer_us"],
                                        samples["gate_up_us"], samples["down_us"])
    r["layer_bf16_vs_gemms"] = paired_median(lambda l, a, d: l / (a + d), samples["layer_bf16_us"],
                                             samples["gate_up_us"], samples["down_us"])
    r["layer_sep_bf16_vs_gemms"] = paired_median(lambda l, a, d: l / (a + d), samples["layer_sep_bf16_us"],
                                                 samples["gate_up_us"], samples["down_us"])
    r["fused_act_vs_separate"] = paired_median(lambda g, a, f: f / (g + a), samples["gate_up_us"],
                                               samples["act_us"], samples["gate_up_act_us"])
    r["layer_vs_pair"] = paired_median(lambda l, p: l / p, samples["layer_us"], samples["gemms_us"])
    r["layer_bf16_vs_pair"] = paired_median(lambda l, p: l / p, samples["layer_bf16_us"], samples["gemms_us"])
    r["layer_fused_vs_sep_bf16"] = paired_median(lambda f, s_: f / s_, samples["layer_bf16_us"],
                                                 samples["layer_sep_bf16_us"])
    r["fused_vs_down"] = paired_median(lambda d, f: f / d, samples["down_us"], samples["down_fused_us"])
    r["fused_bf16_vs_down"] = paired_median(lambda d, f: f / d, samples["down_us"],
                                            samples["down_fused_bf16_us"])
    # bytes each stage must move at least (valid rows only), for the bandwidth column
    r["bytes"] = {
        "gate_up": nonempty * 2 * inter * hidden * elem + rows * hidden * elem + rows * 2 * inter * 2,
        "act": rows * 2 * inter * 2 + rows * inter * elem,
        "gate_up_act": nonempty * 2 * inter * hidden * elem + rows * hidden * elem + rows * inter * elem,
        "down": nonempty * hidden * inter * elem + rows * inter * elem + rows * hidden * 2,
        "down_fused": nonempty * hidden * inter * elem + rows * inter * elem + rows * hidden * 4,
        "down_fused_bf16": nonempty * hidden * inter * elem + rows * inter * elem + rows * hidden * 2,
    }
    assert int(err.item()) == 0
    return r


def fused_table(rows):
    lines = ["| dtype | case | rows | tokens | GEMM alone (us) | fused, fp32 sums (us) | / GEMM | "
             "fused, bf16 sums (us) | / GEMM | bf16 sums: max error / max | two streams (us) | / GEMM | "
             "memset of the fp32 output (us) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['case']} | {r['rows']} | {r['tokens']} | {r['gemm_us']:.1f} | "
                     f"{r['fused_us']:.1f} | {r['fused_vs_gemm']:.3f} | {r['fused_bf16_us']:.1f} | "
                     f"{r['fused_bf16_vs_gemm']:.3f} | {r['bf16_sums_error']:.1e} | {r['two_stream_us']:.1f} | "
                     f"{r['two_stream_vs_gemm']:.3f} | {r['memset_us']:.1f} |")
    return "\n".join(lines)


def activation_table(rows):
    lines = ["| dtype | layer | rows | gate_up (us) | act (us) | gate_up, then act: sum (us) | "
             "gate_up with the act fused (us, GB/s) | fused / sum | whole path, act fused (us) | "
             "whole path, act separate (us) | fused / separate | whole, act fused / (gate_up + down, each alone) | "
             "whole, act separate / (gate_up + down, each alone) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = r["bytes"]["gate_up_act"] / (r["gate_up_act_us"] * 1e3)
        lines.append(
            f"| {r['dtype']} | {r['case']} | {r['rows']} | {r['gate_up_us']:.1f} | {r['act_us']:.1f} | "
            f"{r['gate_up_us'] + r['act_us']:.1f} | {r['gate_up_act_us']:.1f} ({bw:.0f}) | "
            f"{r['fused_act_vs_separate']:.3f} | {r['layer_bf16_us']:.1f} | {r['layer_sep_bf16_us']:.1f} | "
            f"{r['layer_fused_vs_sep_bf16']:.3f} | {r['layer_bf16_vs_gemms']:.3f} | {r['layer_sep_bf16_vs_gemms']:.3f} |")
    return "\n".join(lines)


def layer_table(rows):
    lines = ["| dtype | layer | rows | gate_up (us, GB/s) | act (us, GB/s) | down (us) | down + combine, fp32 "
             "sums (us, GB/s) | bf16 sums (us, GB/s) | gate_up then down (us) | whole path, fp32 sums (us) | "
             "/ (gate_up then down) | / (gate_up + down, each alone) | whole path, bf16 sums (us) | "
             "/ (gate_up then down) | / (gate_up + down, each alone) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = {k: r["bytes"][k] / (r[f"{k}_us"] * 1e3) for k in ("gate_up", "act", "down_fused", "down_fused_bf16")}
        lines.append(
            f"| {r['dtype']} | {r['case']} | {r['rows']} | {r['gate_up_us']:.1f} ({bw['gate_up']:.0f}) | "
            f"{r['act_us']:.1f} ({bw['act']:.0f}) | {r['down_us']:.1f} | {r['down_fused_us']:.1f} "
            f"({bw['down_fused']:.0f}) | {r['down_fused_bf16_us']:.1f} ({bw['down_fused_bf16']:.0f}) | "
            f"{r['gemms_us']:.1f} | {r['layer_us']:.1f} | {r['layer_vs_pair']:.3f} | {r['layer_vs_gemms']:.3f} | "
            f"{r['layer_bf16_us']:.1f} | {r['layer_bf16_vs_pair']:.3f} | {r['layer_bf16_vs_gemms']:.3f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", nargs="+", default=["fused", "layer"], choices=["fused", "layer"])
    p.add_argument("--dtype", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--combine-sms", type=int, default=20)
    p.add_argument("--top-k", type=int, default=TOP_K)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fused": [], "layer": []}
    md = [f"device: {result['device']}, torch {torch.__version__}, flashgemm {flashgemm.__version__}"]
    cases = [c for c in load_cases()["cases"] if c["regime"] == "decode"]
    for dtype in args.dtype:
        fp8 = dtype == "fp8"
        if "fused" in args.suite:
            for c in cases:
                r = fused_case(c, fp8, args.seed, args.rounds, args.reps, args.combine_sms, args.top_k)
                result["fused"].append(r)
                print(json.dumps(r), flush=True)
        if "layer" in args.suite:
            for spec in LAYERS:
                r = layer_case(spec, fp8, args.seed, args.rounds, args.reps)
                result["layer"].append(r)
                print(json.dumps(r), flush=True)
    if result["fused"]:
        md += ["", "### Down GEMM with the combine fused", "", fused_table(result["fused"])]
    if result["layer"]:
        md += ["", "### The expert path", "", layer_table(result["layer"]),
               "", "### The activation: fused into gate_up, or a kernel of its own (bf16 sums)", "",
               activation_table(result["layer"])]
    text = "\n".join(md)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
