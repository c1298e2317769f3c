"""``python -m flashgemm demo``: the MoE expert layer of an expert-parallel
decode step, checked against the float reference and timed stage by stage.

On a Hopper GPU: DeepSeek-V3 with 8-way expert parallelism (32 local experts,
H 7168, I 2048, top-8) at 128 and 256 tokens per rank, and Qwen3-235B-A22B
(16 local experts, H 4096, I 1536) at 128, in block-scaled fp8. Each runs
gate_up with SwiGLU + fp8 quantization fused into its epilogue, and down with
the combine fused into its own; against the unfused path: gate_up, the
activation kernel, and the down GEMM storing its rows with the reference
combine overlapped on 20 SMs. Times are CUDA-graph replays; the
bandwidth column counts the bytes each stage must move (valid rows only)
over its time. A PNG of the stage times against their bandwidth floor goes
to ``--png`` (when matplotlib is installed). Without a GPU it says so,
compiles a sample of the kernels (no launch) and runs the reference on a
small CPU case.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

EP, TOP_K = 8, 8
# without a GPU: the GEMMs of this tile configuration (every epilogue) are compiled
CPU_SAMPLE = "fp8_block128-m64n128sAc2"
LAYERS = (  # name, experts in all, local experts, hidden, intermediate, tokens per rank
    ("DeepSeek-V3 EP8, 128 tokens/rank", 256, 32, 7168, 2048, 128),
    ("DeepSeek-V3 EP8, 256 tokens/rank", 256, 32, 7168, 2048, 256),
    ("Qwen3-235B EP8, 128 tokens/rank", 128, 16, 4096, 1536, 128),
)


def _routing(masked_m, max_m, num_tokens, gen):
    e_count = masked_m.shape[0]
    tok = torch.zeros(e_count, max_m, dtype=torch.int32)
    for e, m in enumerate(masked_m.tolist()):
        tok[e, :m] = torch.randperm(num_tokens, generator=gen)[:m].to(torch.int32)
    return tok, torch.rand(e_count, max_m, generator=gen)


def _graph_us(fn, reps=20, rounds=5):
    from .timing import capture_graph

    graph = capture_graph(fn, reps)
    for _ in range(3):  # clocks up, caches warm
        graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def _copy_gbps():
    """Device-to-device copy bandwidth (bytes read + written), measured now."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):  # (eager: a memcpy node in a graph runs slower than the copy itself)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return 2 * src.numel() / (statistics.median(times) * 1e3)


def run_layer(spec, copy_gbps, seed):
    from . import Combine, grouped_gemm_nt_masked
    from .moe.activation import silu_mul
    from .moe.gate_up import gate_up_swiglu
    from .moe.layer import MaskedExperts, moe_experts_ref
    from .overlap import run_gemm_and_combine
    from .quant import quantize_fp8_per_block, quantize_fp8_per_token
    from .reference import similarity

    name, experts, e_local, hidden, inter, per_rank = spec
    tokens = per_rank * EP
    max_m, em = tokens, tokens * TOP_K // experts
    gen = torch.Generator().manual_seed(seed)
    masked = (em * (0.7 + 0.6 * torch.rand(e_local, generator=gen))).to(torch.int32).clamp(1, max_m)
    tok, wt = (t.cuda() for t in _routing(masked, max_m, tokens, gen))
    masked_m = masked.cuda()
    x, xs = quantize_fp8_per_token(torch.randn(e_local, max_m, hidden, device="cuda", dtype=torch.bfloat16))
    w13, s13 = quantize_fp8_per_block(
        torch.randn(e_local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5)
    w2, s2 = quantize_fp8_per_block(
        torch.randn(e_local, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5)
    layer = MaskedExperts(w13, w2, w13_scale=s13, w2_scale=s2)
    # bf16 sums: what a combine hands back, at half the reduction bytes of fp32
    combined = torch.zeros(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    combined32 = torch.zeros(tokens, hidden, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")

    t0 = time.perf_counter()
    layer(x, masked_m, x_scale=xs, expected_m=em, combine=Combine(tok, wt, combined, err))
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    ref = moe_experts_ref(x, masked_m, w13, w2, x_scale=xs, w13_scale=s13, w2_scale=s2,
                          token_index=tok, weight=wt, num_tokens=tokens)
    diff = similarity(combined, ref)
    ok = diff < 1e-3 and int(err.item()) == 0

    gu = grouped_gemm_nt_masked(x, w13, None, masked_m, a_scale=xs, b_scale=s13, expected_m=em)
    h, hs = silu_mul(gu, masked_m)
    h2, hs2 = torch.empty_like(h), torch.empty_like(hs)
    y = torch.empty(e_local, max_m, hidden, device="cuda", dtype=torch.bfloat16)
    stages = {
        "gate_up GEMM": lambda: grouped_gemm_nt_masked(x, w13, gu, masked_m, a_scale=xs, b_scale=s13,
                                                       expected_m=em),
        "SwiGLU + fp8 quant": lambda: silu_mul(gu, masked_m, out=h, out_scale=hs),
        "gate_up GEMM + SwiGLU + quant, fused": lambda: gate_up_swiglu(
            x, layer.w13_interleaved, masked_m, x_scale=xs, out=h2, out_scale=hs2, expected_m=em),
        "down GEMM + fused combine": lambda: grouped_gemm_nt_masked(
            h, w2, None, masked_m, a_scale=hs, b_scale=s2, expected_m=em,
            combine=Combine(tok, wt, combined, err)),
        "  the same, fp32 sums": lambda: grouped_gemm_nt_masked(
            h, w2, None, masked_m, a_scale=hs, b_scale=s2, expected_m=em,
            combine=Combine(tok, wt, combined32, err)),
        "down GEMM alone": lambda: grouped_gemm_nt_masked(h, w2, y, masked_m, a_scale=hs, b_scale=s2,
                                                          expected_m=em),
        "down GEMM + combine, two streams": lambda: run_gemm_and_combine(
            h, w2, masked_m, tok, wt, combined32, gemm_sms=torch.cuda.get_device_properties(0)
            .multi_processor_count - 20, expected_m=em, out=y, a_scale=hs, b_scale=s2),
        "whole layer (fused)": lambda: layer(x, masked_m, x_scale=xs, expected_m=em,
                                             combine=Combine(tok, wt, combined, err)),
    }
    us = {k: _graph_us(f) for k, f in stages.items()}
    rows, nonempty = int(masked.sum()), int((masked > 0).sum())
    floor_bytes = {
        "gate_up GEMM": nonempty * 2 * inter * hidden + rows * hidden + rows * 2 * inter * 2,
        "SwiGLU + fp8 quant": rows * 2 * inter * 2 + rows * inter,
        "gate_up GEMM + SwiGLU + quant, fused": nonempty * 2 * inter * hidden + rows * hidden + rows * inter,
        "down GEMM + fused combine": nonempty * hidden * inter + rows * inter,
        "down GEMM alone": nonempty * hidden * inter + rows * inter + rows * hidden * 2,
    }
    floor_bytes["whole layer (fused)"] = floor_bytes["gate_up GEMM + SwiGLU + quant, fused"] \
        + floor_bytes["down GEMM + fused combine"]
    unfused = us["gate_up GEMM"] + us["SwiGLU + fp8 quant"] + us["down GEMM + combine, two streams"]
    print(f"\n{name}: {e_local} experts, {rows} rows (expected {em} per expert), {tokens} tokens, fp8")
    print(f"  first call (compile or cache load + run) {first_s:.1f} s; combined bf16 output vs float reference: "
          f"similarity diff {diff:.1e}, error word {int(err.item())} -> {'OK' if ok else 'FAILED'}")
    for k, t in us.items():
        gbps = floor_bytes[k] / (t * 1e3) if k in floor_bytes else None
        bw = f"{gbps:6.0f} GB/s ({100 * gbps / copy_gbps:3.0f}% of copy)" if gbps else ""
        print(f"  {k:38s} {t:8.1f} us  {bw}")
    print(f"  unfused path (gate_up + act + two-stream down/combine): {unfused:.1f} us; fused layer "
          f"{us['whole layer (fused)']:.1f} us; unfused / fused = {unfused / us['whole layer (fused)']:.2f}")
    return ok, name, us, {k: b / (copy_gbps * 1e3) for k, b in floor_bytes.items()}


def _plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is optional: the check and the timings above stand without it
        print(f"skipped the plot {path}: matplotlib is not installed "
              "(pip install matplotlib, or pip install -e '.[bench]')")
        return
    keys = ["gate_up GEMM", "SwiGLU + fp8 quant", "gate_up GEMM + SwiGLU + quant, fused", "down GEMM + fused combine",
            "whole layer (fused)"]
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (name, us, floor) in zip(axes[0], results):
        pos = range(len(keys))
        ax.bar([p - 0.2 for p in pos], [us[k] for k in keys], 0.4, label="measured")
        ax.bar([p + 0.2 for p in pos], [floor[k] for k in keys], 0.4, label="bytes / copy bandwidth")
        ax.set_xticks(list(pos), ["gate_up", "act+quant", "gate_up+act", "down+combine", "layer"], fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("us")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(png: str = "moe_layer.png", seed=None) -> int:
    from .kernels_cli import hopper_gpu

    gpu, why = hopper_gpu()
    if gpu is None:
        return _without_gpu(why)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    torch.manual_seed(seed)
    copy_gbps = _copy_gbps()
    print(f"flashgemm MoE layer demo on {gpu} (seed {seed}); copy bandwidth measured now: {copy_gbps:.0f} GB/s")
    ok, plots = True, []
    for spec in LAYERS:
        good, name, us, floor = run_layer(spec, copy_gbps, seed)
        ok &= good
        plots.append((name, us, floor))
    _plot(plots, png)
    return 0 if ok else 1


def _without_gpu(why: str) -> int:
    import argparse

    from .kernels_cli import cmd_compile
    from .moe.layer import moe_experts_ref
    from .quant import quantize_fp8_per_block, quantize_fp8_per_token

    print(f"flashgemm demo: {why}.")
    print("Without a Hopper GPU nothing is launched. Instead: compile a sample of the layer's sm_90a kernels")
    print("(real builds, PTX checked): one fp8 GEMM tile configuration (64x128, 2-CTA clusters) in each of its")
    print("epilogues, and the four MoE activation kernels (the SwiGLU's and gpt-oss's, fp8 and bf16); then run the")
    print("layer's float reference on a small CPU case.")
    print("(python -m flashgemm compile builds every kernel: a few minutes on 2 cores.)\n")
    rc = cmd_compile(argparse.Namespace(arch="sm_90a", cache_dir=None, match=CPU_SAMPLE, moe=True))
    e_count, max_m, hidden, inter, tokens = 4, 16, 256, 128, 24
    gen = torch.Generator().manual_seed(0)
    masked_m = torch.tensor([0, 3, 16, 9], dtype=torch.int32)
    x, xs = quantize_fp8_per_token(torch.randn(e_count, max_m, hidden, generator=gen))
    w13, s13 = quantize_fp8_per_block(torch.randn(e_count, 2 * inter, hidden, generator=gen) / hidden**0.5)
    w2, s2 = quantize_fp8_per_block(torch.randn(e_count, hidden, inter, generator=gen) / inter**0.5)
    tok, wt = _routing(masked_m, max_m, tokens, gen)
    out = moe_experts_ref(x, masked_m, w13, w2, x_scale=xs, w13_scale=s13, w2_scale=s2,
                          token_index=tok, weight=wt, num_tokens=tokens)
    routed = torch.zeros(tokens, dtype=torch.bool)
    for e, m in enumerate(masked_m.tolist()):
        routed[tok[e, :m].long()] = True
    print(f"\nreference on CPU: E={e_count} max_m={max_m} H={hidden} I={inter}, masked_m={masked_m.tolist()}, "
          f"{tokens} tokens: combined output {tuple(out.shape)}, {int(routed.sum())} tokens routed, "
          f"the others zero: {bool((out[~routed] == 0).all())}")
    print("No GPU kernel ran. Run this on an H100/H200 to launch the layer.")
    return rc
