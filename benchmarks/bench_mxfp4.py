#!/usr/bin/env python3
"""The MXFP4-weight GEMM (``Format.FP8_MXFP4``) on the suite's cases, against
the same GEMM with fp8 weights (``FP8_BLOCK128``) and the copy bandwidth.

Both run on the same activations (e4m3, 1x128 scales); the MXFP4 weights are
the fp8 case's weights quantized to MXFP4. Times come from CUDA-graph replays
(10 calls per replay, median of the reps), the two formats timed in
interleaved rounds (``common.time_graph_rounds``). Effective bytes count
what each call must move: the weights and their scales of non-empty experts
(MXFP4: K/2 + K/32 bytes per row; fp8: K + the 128x128 fp32 scales), plus the
valid rows of A, their scales, and of the output.

With ``--bf16`` the activations are bf16 (``Format.BF16_MXFP4``) and the
baseline is the bf16 GEMM with the same weights in bf16 (2K bytes per row).

With ``--gpt-oss`` it times gpt-oss's expert layer (``moe.GptOssExperts``:
biases, the clamped SwiGLU, H = I = 2880, 16 local experts of 128, top-4,
128 tokens per rank on EP8) with MXFP4 weights and fp8 activations against
the same layer with bf16 weights and activations, and the MXFP4 layer with
bf16 activations too, and checks both MXFP4 ones against the float64
reference of the model's formula.

With ``--layer`` it times the whole MoE expert layer instead
(``moe.MaskedExperts``: gate_up with the SwiGLU and the fp8 quantization
fused, down with the combine fused) on DeepSeek-V3 and Qwen3-235B EP8 decode
shapes at 128 tokens per rank, MXFP4 weights against fp8 weights, fp8
activations in both; the MXFP4 layer's combined output is checked against a
float reference of the same dequantized weights.

    python benchmarks/bench_mxfp4.py                  # decode cases, markdown to stdout
    python benchmarks/bench_mxfp4.py --cases dsv3-ep8-gate_up --json out.json
    python benchmarks/bench_mxfp4.py --bf16           # bf16 activations: MXFP4 vs bf16 weights
    python benchmarks/bench_mxfp4.py --layer
    python benchmarks/bench_mxfp4.py --gpt-oss
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import flashgemm  # noqa: E402
from flashgemm.mxfp4 import dequantize_mxfp4, prepare_weights, quantize_mxfp4  # noqa: E402
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token  # noqa: E402
from flashgemm.reference import similarity  # noqa: E402
from common import draw_masked_m, load_cases, paired_median, time_fn, time_graph_rounds  # noqa: E402


def copy_gbps():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / time_fn(lambda: y.copy_(x), warmup=3, reps=20) / 1e6


def run_case(case, seed, rounds, reps, bf16=False):
    """One GEMM case: MXFP4 weights against fp8 weights on the same e4m3
    activations, or with ``bf16`` against bf16 weights on bf16 activations."""
    e_count, max_m, n, k = case["E"], case["max_m"], case["N"], case["K"]
    rows = draw_masked_m(case, seed).tolist()
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(e_count, max_m, k, device="cuda", generator=g)
    w = torch.randn(e_count, n, k, device="cuda", generator=g) / k**0.5
    packed, scales = quantize_mxfp4(w)
    b4, exps = prepare_weights(packed, scales)
    if bf16:
        a, a_scale = x.bfloat16(), None
        b_base, b_base_scale = w.bfloat16(), None
        a_deq = a.float()
    else:
        a, a_scale = quantize_fp8_per_token(x)
        b_base, b_base_scale = quantize_fp8_per_block(w)
        a_deq = a.float() * a_scale.repeat_interleave(128, dim=2)[:, :, :k]
    masked_m = torch.tensor(rows, dtype=torch.int32, device="cuda")
    out4 = torch.empty(e_count, max_m, n, device="cuda", dtype=torch.bfloat16)
    out_base = torch.empty_like(out4)

    def mx():
        flashgemm.grouped_gemm_nt_masked(a, b4, out4, masked_m, a_scale=a_scale, b_scale=exps,
                                         expected_m=case["expected_m"])

    def base():
        flashgemm.grouped_gemm_nt_masked(a, b_base, out_base, masked_m, a_scale=a_scale, b_scale=b_base_scale,
                                         expected_m=case["expected_m"])

    mx()
    torch.cuda.synchronize()
    b_deq = dequantize_mxfp4(packed, scales)
    worst = max(similarity(out4[e, :m].float(), a_deq[e, :m] @ b_deq[e].T) for e, m in enumerate(rows) if m)
    if worst > (1e-4 if bf16 else 1e-3):
        raise SystemExit(f"{case['name']}: MXFP4 result wrong (similarity diff {worst:.2e})")
    t4, t_base = time_graph_rounds([mx, base], rounds=rounds, reps=reps)
    total = sum(rows)
    live = sum(1 for r in rows if r)
    if bf16:
        act = 2 * total * k + 2 * total * n
        bytes_base = live * n * 2 * k + act
    else:
        act = total * (k + 4 * -(-k // 128)) + 2 * total * n
        bytes_base = live * (n * k + 4 * -(-n // 128) * -(-k // 128)) + act
    return {
        "case": case["name"], "E": e_count, "N": n, "K": k, "valid_rows": total, "similarity_diff": worst,
        "activations": "bf16" if bf16 else "fp8", "mxfp4_us": 1e3 * paired_median(lambda t: t, t4),
        "base_us": 1e3 * paired_median(lambda t: t, t_base), "speedup": paired_median(lambda p, q: q / p, t4, t_base),
        "bytes_mxfp4": live * n * (k // 2 + k // 32) + act, "bytes_base": bytes_base,
    }


LAYERS = (  # (name, experts in all, local experts, hidden, intermediate, tokens per rank), EP8, top-8
    ("dsv3-ep8-t128", 256, 32, 7168, 2048, 128),
    ("qwen3-235b-ep8-t128", 128, 16, 4096, 1536, 128),
)


def run_layer(spec, seed, rounds, reps):
    from flashgemm import Combine
    from flashgemm.moe.layer import MaskedExperts
    from flashgemm.moe.activation import SCALE_BLOCK

    name, experts, e_local, hidden, inter, per_rank = spec
    tokens = per_rank * 8
    em = tokens * 8 // experts
    g = torch.Generator().manual_seed(seed)
    masked = (em * (0.7 + 0.6 * torch.rand(e_local, generator=g))).to(torch.int32).clamp(1, tokens)
    tok = torch.stack([torch.randperm(tokens, generator=g)[:tokens] for _ in range(e_local)]).to(torch.int32)
    wt = torch.rand(e_local, tokens, generator=g)
    masked_m, tok, wt = masked.cuda(), tok.cuda(), wt.cuda()
    torch.manual_seed(seed)
    x, xs = quantize_fp8_per_token(torch.randn(e_local, tokens, hidden, device="cuda"))
    w13 = torch.randn(e_local, 2 * inter, hidden, device="cuda") / hidden**0.5
    w2 = torch.randn(e_local, hidden, inter, device="cuda") / inter**0.5
    (f13, f13_scale), (f2, f2_scale) = quantize_fp8_per_block(w13), quantize_fp8_per_block(w2)
    fp8_layer = MaskedExperts(f13, f2, w13_scale=f13_scale, w2_scale=f2_scale)
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    (b13, s13), (b2, s2) = prepare_weights(*q13), prepare_weights(*q2)
    mx_layer = MaskedExperts(b13, b2, w13_scale=s13, w2_scale=s2)
    out4 = torch.zeros(tokens, hidden, device="cuda")
    out8 = torch.zeros(tokens, hidden, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    mx_layer(x, masked_m, x_scale=xs, expected_m=em, combine=Combine(tok, wt, out4, err))
    # float reference of the MXFP4 layer: the dequantized weights, gate_up in bf16, h quantized 1x128
    d13, d2 = dequantize_mxfp4(*q13), dequantize_mxfp4(*q2)
    xd = x.float() * xs.repeat_interleave(128, dim=2)[:, :, :hidden]
    ref = torch.zeros(tokens, hidden, device="cuda", dtype=torch.float64)
    for e, m in enumerate(masked.tolist()):
        gu = (xd[e, :m] @ d13[e].T).bfloat16().float()
        h = torch.nn.functional.silu(gu[:, :inter]).bfloat16().float() * gu[:, inter:]
        hq, hs = quantize_fp8_per_token(h.bfloat16().unsqueeze(0))
        hd = hq[0].float() * hs[0].repeat_interleave(SCALE_BLOCK, dim=1)[:, :inter]
        ref.index_add_(0, tok[e, :m].long(), (wt[e, :m, None].double() * (hd @ d2[e].T).double()))
    torch.cuda.synchronize()
    diff = similarity(out4, ref.float())
    if diff > 1e-3 or int(err.item()):
        raise SystemExit(f"{name}: MXFP4 layer wrong (similarity diff {diff:.2e}, err {int(err.item())})")
    t4, t8 = time_graph_rounds([
        lambda: mx_layer(x, masked_m, x_scale=xs, expected_m=em, combine=Combine(tok, wt, out4, err)),
        lambda: fp8_layer(x, masked_m, x_scale=xs, expected_m=em, combine=Combine(tok, wt, out8, err)),
    ], rounds=rounds, reps=reps)
    return {"case": name, "experts": e_local, "rows": int(masked.sum()), "similarity_diff": diff,
            "mxfp4_us": 1e3 * paired_median(lambda t: t, t4), "fp8_us": 1e3 * paired_median(lambda t: t, t8),
            "speedup": paired_median(lambda p, q: q / p, t4, t8)}


def run_gpt_oss(seed, rounds, reps):
    from flashgemm import Combine
    from flashgemm.moe.gpt_oss import gpt_oss_experts_ref
    from flashgemm.moe.gpt_oss_experts import GptOssExperts
    from flashgemm.quant import dequantize_fp8_per_token

    e_local, hidden, inter, tokens, top_k, experts = 16, 2880, 2880, 1024, 4, 128
    em = tokens * top_k // experts
    g = torch.Generator().manual_seed(seed)
    masked = (em * (0.7 + 0.6 * torch.rand(e_local, generator=g))).to(torch.int32)
    tok = torch.stack([torch.randperm(tokens, generator=g) for _ in range(e_local)]).to(torch.int32)
    wt = torch.rand(e_local, tokens, generator=g)
    masked_m, tok, wt = masked.cuda(), tok.cuda(), wt.cuda()
    torch.manual_seed(seed)
    x = torch.randn(e_local, tokens, hidden, device="cuda")
    xq, xs = quantize_fp8_per_token(x)
    w13 = 3 * torch.randn(e_local, 2 * inter, hidden, device="cuda") / hidden**0.5
    w2 = torch.randn(e_local, hidden, inter, device="cuda") / inter**0.5
    b13, b2 = torch.randn(e_local, 2 * inter, device="cuda"), 0.1 * torch.randn(e_local, hidden, device="cuda")
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    (p13, s13), (p2, s2) = prepare_weights(*q13), prepare_weights(*q2)
    mx_layer = GptOssExperts(p13, b13, p2, b2, w13_scale=s13, w2_scale=s2)
    bf_layer = GptOssExperts(w13.bfloat16(), b13, w2.bfloat16(), b2)
    xb = x.bfloat16()
    out4 = torch.zeros(tokens, hidden, device="cuda")
    out16 = torch.zeros(tokens, hidden, device="cuda")
    mx_layer(xq, masked_m, Combine(tok, wt, out4), x_scale=xs, expected_m=em)
    ref = gpt_oss_experts_ref(dequantize_fp8_per_token(xq, xs), masked_m, dequantize_mxfp4(*q13), b13,
                              dequantize_mxfp4(*q2), b2, token_index=tok, weight=wt, num_tokens=tokens)
    torch.cuda.synchronize()
    diff = similarity(out4, ref.float())
    if diff > 1e-3:
        raise SystemExit(f"gpt-oss MXFP4 layer wrong (similarity diff {diff:.2e})")
    # MXFP4 weights with bf16 activations: against the formula on the bf16 x (bar 1e-4)
    out4b = torch.zeros(tokens, hidden, device="cuda")
    mx_layer(xb, masked_m, Combine(tok, wt, out4b), expected_m=em)
    ref_b = gpt_oss_experts_ref(xb.float(), masked_m, dequantize_mxfp4(*q13), b13, dequantize_mxfp4(*q2), b2,
                                token_index=tok, weight=wt, num_tokens=tokens)
    torch.cuda.synchronize()
    diff_b = similarity(out4b, ref_b.float())
    if diff_b > 1e-4:
        raise SystemExit(f"gpt-oss MXFP4 layer with bf16 activations wrong (similarity diff {diff_b:.2e})")
    t4, t4b, t16 = time_graph_rounds([
        lambda: mx_layer(xq, masked_m, Combine(tok, wt, out4), x_scale=xs, expected_m=em),
        lambda: mx_layer(xb, masked_m, Combine(tok, wt, out4b), expected_m=em),
        lambda: bf_layer(xb, masked_m, Combine(tok, wt, out16), expected_m=em),
    ], rounds=rounds, reps=reps)
    rows = int(masked.sum())
    return {"case": "gpt-oss-120b-ep8-t128", "experts": e_local, "rows": rows, "similarity_diff": diff,
            "similarity_diff_bf16_act": diff_b,
            "mxfp4_us": 1e3 * paired_median(lambda t: t, t4), "mxfp4_bf16_act_us": 1e3 * paired_median(lambda t: t, t4b),
            "bf16_us": 1e3 * paired_median(lambda t: t, t16),
            "speedup": paired_median(lambda p, q: q / p, t4, t16),
            "speedup_bf16_act": paired_median(lambda p, q: q / p, t4b, t16)}


def gpt_oss_markdown(row, device, cmd):
    return "\n".join([
        f"gpt-oss expert layer (H = I = 2880, biases, clamped SwiGLU, top-4), MXFP4 weights with fp8 or bf16 "
        f"activations vs bf16 weights + bf16 activations, {device}, {datetime.date.today()}, `{cmd}`.", "",
        "| layer | local experts | rows | weights, activations | us | bf16 / this | similarity diff (formula) |",
        "|---|---|---|---|---|---|---|",
        f"| {row['case']} | {row['experts']} | {row['rows']} | MXFP4, fp8 | {row['mxfp4_us']:.1f} | "
        f"{row['speedup']:.2f}x | {row['similarity_diff']:.1e} |",
        f"| {row['case']} | {row['experts']} | {row['rows']} | MXFP4, bf16 | {row['mxfp4_bf16_act_us']:.1f} | "
        f"{row['speedup_bf16_act']:.2f}x | {row['similarity_diff_bf16_act']:.1e} |",
        f"| {row['case']} | {row['experts']} | {row['rows']} | bf16, bf16 | {row['bf16_us']:.1f} | 1.00x | |"])


def layer_markdown(rows, device, cmd):
    lines = [f"MoE expert layer, MXFP4 vs fp8 weights (fp8 activations), {device}, {datetime.date.today()}, "
             f"`{cmd}`.", "",
             "| layer | local experts | rows | MXFP4 us | fp8 us | fp8 / MXFP4 | similarity diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['experts']} | {r['rows']} | {r['mxfp4_us']:.1f} | {r['fp8_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['similarity_diff']:.1e} |")
    return "\n".join(lines)


def to_markdown(rows, copy, device, cmd):
    act = rows[0]["activations"] if rows else "fp8"
    lines = [
        f"MXFP4-weight GEMM vs the {act}-weight GEMM, {act} activations in both, {device}, "
        f"{datetime.date.today()}, copy {copy:.0f} GB/s (read + write), `{cmd}`.", "",
        f"| case | E | N | K | rows | MXFP4 us | % copy BW | {act} us | % copy BW | {act} / MXFP4 | similarity diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bw4 = r["bytes_mxfp4"] / r["mxfp4_us"] / 1e3 / copy * 100
        bw_base = r["bytes_base"] / r["base_us"] / 1e3 / copy * 100
        lines.append(f"| {r['case']} | {r['E']} | {r['N']} | {r['K']} | {r['valid_rows']} | {r['mxfp4_us']:.1f} | "
                     f"{bw4:.0f}% | {r['base_us']:.1f} | {bw_base:.0f}% | {r['speedup']:.2f}x | "
                     f"{r['similarity_diff']:.1e} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", help="case names (default: every decode case)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json")
    p.add_argument("--layer", action="store_true", help="time the whole expert layer (MXFP4 vs fp8 weights)")
    p.add_argument("--gpt-oss", action="store_true", help="time gpt-oss's expert layer (MXFP4 vs bf16 weights)")
    p.add_argument("--bf16", action="store_true",
                   help="the GEMM with bf16 activations: MXFP4 vs bf16 weights (default: fp8 activations)")
    args = p.parse_args()
    cmd = "python " + " ".join(sys.argv)
    device = torch.cuda.get_device_name()
    if args.gpt_oss:
        row = run_gpt_oss(0, args.rounds, args.reps)
        return _report(gpt_oss_markdown(row, device, cmd), {"device": device, "gpt_oss": row}, args.json)
    if args.layer:
        rows = [run_layer(spec, i, args.rounds, args.reps) for i, spec in enumerate(LAYERS)]
        return _report(layer_markdown(rows, device, cmd), {"device": device, "layers": rows}, args.json)
    cases = load_cases()["cases"]
    chosen = [(i, c) for i, c in enumerate(cases)
              if (c["name"] in args.cases if args.cases else c["regime"] == "decode")]
    if not chosen:
        p.error("no case selected")
    copy = copy_gbps()
    rows = [run_case(c, seed, args.rounds, args.reps, args.bf16) for seed, c in chosen]
    _report(to_markdown(rows, copy, device, cmd), {"device": device, "copy_gbps": copy, "rows": rows}, args.json)


def _report(markdown: str, payload: dict, json_path) -> None:
    """The table to stdout, and the raw results to ``json_path`` if given."""
    print(markdown)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)

if __name__ == "__main__":
    main()
