"""Command line: ``python -m flashgemm demo`` and ``python -m flashgemm compile``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

PTX_FEATURES = {
    "wgmma": "wgmma.mma_async",
    "fp8-wgmma": ".e4m3.e4m3",
    "tma-load": "cp.async.bulk.tensor.3d.shared::cta.global",
    "tma-store": "cp.async.bulk.tensor.3d.global.shared::cta",
    "setmaxnreg": "setmaxnreg",
    "stmatrix": "stmatrix",
    "bulk-reduce": "cp.reduce.async.bulk",
    "acquire-poll": "ld.acquire.gpu",
}
# A signalled kernel's publishing sequence, in this order: the bulk stores
# complete (the full wait, not ``.read``), the async-proxy writes are fenced
# before generic operations, then the GPU-scope release add.
SIGNAL_SEQUENCE = re.compile(
    r"cp\.async\.bulk\.wait_group\s+0;\s*fence\.proxy\.async\.global;"
    r"[^;]*(?:;[^;]*){0,8}?red\.release\.gpu\.global\.add\.s32"
)


def ptx_features(ptx: str) -> list[str]:
    feats = [name for name, needle in PTX_FEATURES.items() if needle in ptx]
    if SIGNAL_SEQUENCE.search(ptx):
        feats.append("signal-publish")
    return feats


def _hopper_gpu():
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA GPU found"
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cap != (9, 0):
        return None, f"found {name} (sm_{cap[0]}{cap[1]}), but the kernels need sm_90"
    return name, ""


def cmd_compile(args) -> int:
    from .jit.arch import ensure_arch_env
    from .sm90.build import build, build_combine, combine_block_ms, precompile
    from .sm90.heuristic import reachable_specs
    from .signals import DEFAULT_ROWS_PER_ITEM

    arch = ensure_arch_env(args.arch)
    if getattr(args, "cache_dir", None):
        t0 = time.perf_counter()
        n = precompile(arch=arch, cache_dir=args.cache_dir, progress=True)
        print(f"{n} kernels for {arch} in {args.cache_dir} ({time.perf_counter() - t0:.1f} s); "
              f"use them with FLASHGEMM_CACHE_DIR={args.cache_dir}")
        return 0
    specs = [s for s in reachable_specs() if not args.match or args.match in s.name()]
    block_ms = [] if args.match else combine_block_ms(reachable_specs())
    total = len(specs) + len(block_ms)
    print(f"compiling the {total} kernels flashgemm can launch on {arch}: {len(specs)} GEMMs "
          f"(every configuration the heuristic picks x signal mode) and {len(block_ms)} combines "
          f"(no GPU needed)", flush=True)
    ok = True
    t_all = time.perf_counter()
    for i, spec in enumerate(specs):
        t0 = time.perf_counter()
        feats = ptx_features(build(spec, arch, keep_ptx=True).__ptx__ or "")
        ok &= "wgmma" in feats and "tma-load" in feats
        if spec.signal_mode is not None:
            ok &= "signal-publish" in feats
        print(f"  [{i + 1:3d}/{total}] {spec.name():58s} {time.perf_counter() - t0:5.1f} s  "
              f"PTX: {', '.join(feats)}", flush=True)
    for j, block_m in enumerate(block_ms):
        t0 = time.perf_counter()
        feats = ptx_features(build_combine(block_m, arch, keep_ptx=True,
                                           rows_per_item=DEFAULT_ROWS_PER_ITEM).__ptx__ or "")
        ok &= "bulk-reduce" in feats and "acquire-poll" in feats
        name = f"combine-block_m{block_m}-rows{DEFAULT_ROWS_PER_ITEM}"
        print(f"  [{len(specs) + j + 1:3d}/{total}] {name:58s} {time.perf_counter() - t0:5.1f} s  "
              f"PTX: {', '.join(feats)}", flush=True)
    print(f"done in {time.perf_counter() - t_all:.0f} s", flush=True)
    return 0 if ok else 1


def cmd_demo(args) -> int:
    import torch

    from . import grouped_gemm_nt_masked
    from .quant import quantize_fp8_per_block, quantize_fp8_per_token
    from .reference import grouped_gemm_nt_masked_ref, relative_error, similarity

    gpu, why = _hopper_gpu()
    if gpu is None:
        print(f"flashgemm demo: {why}.")
        print("Without a Hopper GPU nothing is launched. Instead: compile the sm_90a kernels")
        print("(the real build, PTX checked) and run the torch reference on a small CPU case.\n")
        rc = cmd_compile(argparse.Namespace(arch="sm_90a", cache_dir=None, match="m64n64"))
        e_count, max_m, n, k = 4, 64, 256, 512
        a = torch.randn(e_count, max_m, k, dtype=torch.bfloat16)
        b = torch.randn(e_count, n, k, dtype=torch.bfloat16)
        masked_m = torch.tensor([0, 1, 37, 64], dtype=torch.int32)
        ref = grouped_gemm_nt_masked_ref(a, b, masked_m)
        direct = torch.einsum("emk,enk->emn", a.double(), b.double())
        err = max(
            relative_error(ref[e, :m], direct[e, :m]) for e, m in enumerate(masked_m.tolist()) if m
        )
        print(f"\nreference on CPU: E={e_count} max_m={max_m} N={n} K={k} masked_m={masked_m.tolist()}")
        print(f"  fp32 reference vs float64: max relative error {err:.1e}")
        a8, a_scale = quantize_fp8_per_token(a)
        b8, b_scale = quantize_fp8_per_block(b)
        ref8 = grouped_gemm_nt_masked_ref(a8, b8, masked_m, a_scale=a_scale, b_scale=b_scale)
        diff = max(similarity(ref8[e, :m], direct[e, :m]) for e, m in enumerate(masked_m.tolist()) if m)
        print(f"  fp8 block-scaled reference vs float64 of the unquantized data: similarity diff {diff:.1e}")
        print("No GPU kernel ran. Run this on an H100/H200 to launch it.")
        return rc

    # An MoE decode layer: DeepSeek-V3 gate_up with EP8 (32 local experts).
    e_count, max_m, n, k, expected_m = args.experts, args.max_m, args.n, args.k, args.expected_m
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    u = torch.rand(e_count) * 0.6 + 0.7
    masked_cpu = (expected_m * u).to(torch.int32).clamp(1, max_m)
    masked_m = masked_cpu.cuda()
    rows = masked_cpu.tolist()
    total = sum(rows)
    print(f"flashgemm demo on {gpu}: E={e_count} max_m={max_m} N={n} K={k}, "
          f"{total} valid rows (expected_m={expected_m})")
    a8, a_scale = quantize_fp8_per_token(x)
    b8, b_scale = quantize_fp8_per_block(w)
    nonempty = sum(1 for m in rows if m)
    ok = True
    for label, a, b, scales, elem in (
        ("bf16", x, w, {}, 2),
        ("fp8 block-scaled (1x128 / 128x128)", a8, b8, dict(a_scale=a_scale, b_scale=b_scale), 1),
    ):
        out = torch.full((e_count, max_m, n), float("nan"), device="cuda", dtype=torch.bfloat16)

        def call():
            grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=expected_m, **scales)

        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        ref = grouped_gemm_nt_masked_ref(a, b, masked_m, **scales)
        diff = max(similarity(out[e, :m].float(), ref[e, :m]) for e, m in enumerate(rows) if m)
        untouched = all(bool(out[e, m:].isnan().all()) for e, m in enumerate(rows))
        for _ in range(5):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 50
        start.record()
        for _ in range(reps):
            call()
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) / reps * 1e3
        eff_bytes = elem * (nonempty * n * k + total * k) + 2 * total * n
        print(f"  {label}: first call (compile or cache load + run) {first_s:.1f} s; "
              f"similarity diff vs fp32 reference {diff:.1e}; rows >= m_e untouched: {untouched}")
        print(f"    time {us:.1f} us, {eff_bytes / us / 1e3:.0f} GB/s effective, "
              f"{2 * total * n * k / us / 1e6:.1f} TFLOPS over valid rows")
        ok &= diff < 1e-3 and untouched
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashgemm")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run an MoE-shaped masked GEMM (GPU), or compile + reference (no GPU)")
    d.add_argument("--experts", type=int, default=32)
    d.add_argument("--max-m", type=int, default=1024)
    d.add_argument("--expected-m", type=int, default=32)
    d.add_argument("-n", type=int, default=4096)
    d.add_argument("-k", type=int, default=7168)
    c = sub.add_parser("compile", help="compile every kernel the package can launch (no GPU needed)")
    c.add_argument("--arch", default="sm_90a")
    c.add_argument("--cache-dir", help="fill this disk cache with every kernel the package can launch "
                   "instead of listing PTX features")
    c.add_argument("--match", default="", help="only the GEMM kernels whose name contains this")
    args = p.parse_args(argv)
    if args.cmd == "compile":
        return cmd_compile(args)
    return cmd_demo(args)


if __name__ == "__main__":
    sys.exit(main())
