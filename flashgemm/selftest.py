"""``python -m flashgemm selftest``: a short correctness pass on the GPU that
is present, reported in plain words, so a user on hardware the project could
not test finds a fault in one command.

Each check poisons the outputs and the guard regions around them first, runs
on fresh random data, and compares with the float reference: odd shapes,
empty, over-long and negative masked_m, every operand format the arch
supports (Hopper: bf16 and 1x128 fp8; Blackwell also MXFP8 and NVFP4, in
``selftest_blockscaled``), the completion signals with a polling consumer,
and on Hopper the MoE layer with the combine fused. What the GPU present
cannot check is said in the report.
"""

from __future__ import annotations

import os
import traceback

import torch

GUARD = 64  # elements of poison before and after every output


def _guarded(shape, dtype):
    """A poisoned tensor of ``shape`` inside a poisoned buffer (NaN)."""
    n = 1
    for d in shape:
        n *= d
    buf = torch.full((n + 2 * GUARD,), float("nan"), device="cuda", dtype=dtype)
    return buf, buf[GUARD:GUARD + n].view(shape)


def _guards_intact(buf):
    return bool(buf[:GUARD].isnan().all() and buf[-GUARD:].isnan().all())


def _operands(fp8: bool, e_count, max_m, n, k):
    """Fresh random a [E, max_m, K] and b [E, N, K], fp8-quantized with their
    scales (as keyword arguments of the GEMM) or bf16."""
    from .quant import quantize_fp8_per_block, quantize_fp8_per_token

    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    if not fp8:
        return a, b, {}
    a, sa = quantize_fp8_per_token(a)
    b, sb = quantize_fp8_per_block(b)
    return a, b, dict(a_scale=sa, b_scale=sb)


def _check_gemm(fp8: bool, e_count, max_m, n, k, masked):
    from . import grouped_gemm_nt_masked
    from .reference import clamp_masked_m, grouped_gemm_nt_masked_ref, similarity

    a, b, scales = _operands(fp8, e_count, max_m, n, k)
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    buf, out = _guarded((e_count, max_m, n), torch.bfloat16)
    grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=max(1, max_m // 2), **scales)
    torch.cuda.synchronize()
    ref = grouped_gemm_nt_masked_ref(a, b, masked_m, **scales)
    rows = clamp_masked_m(masked_m, max_m).tolist()
    worst = max((similarity(out[e, :m].float(), ref[e, :m]) for e, m in enumerate(rows) if m), default=0.0)
    padding = all(bool(out[e, m:].isnan().all()) for e, m in enumerate(rows))
    problems = []
    if not worst < 1e-4:
        problems.append(f"valid rows differ from the reference (similarity diff {worst:.1e})")
    if not padding:
        problems.append("rows >= m_e were written")
    if not _guards_intact(buf):
        problems.append("memory outside out was written")
    return problems


def _check_signals(fp8: bool):
    from .overlap import run_gemm_and_combine

    e_count, max_m, n, k, tokens = 6, 128, 512, 512, 160
    a, b, scales = _operands(fp8, e_count, max_m, n, k)
    masked_m = torch.tensor([0, 1, 64, 65, 128, 300], dtype=torch.int32, device="cuda")
    tok = torch.stack([torch.randperm(tokens)[:max_m] for _ in range(e_count)]).to(torch.int32).cuda()
    wt = torch.rand(e_count, max_m, device="cuda")
    combined = torch.zeros(tokens, n, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out, err = run_gemm_and_combine(a, b, masked_m, tok, wt, combined, gemm_sms=sms - 8, combine_sms=8,
                                    expected_m=64, **scales)
    torch.cuda.synchronize()
    ref = torch.zeros_like(combined)
    rows = masked_m.clamp(0, max_m).tolist()
    for e, m in enumerate(rows):
        ref.index_add_(0, tok[e, :m].long(), wt[e, :m, None] * out[e, :m].float())
    problems = []
    if int(err.item()) != 0:
        problems.append(f"the polling combine reported error word {int(err.item())} (1: a wait timed out)")
    if not torch.allclose(combined, ref, rtol=1e-4, atol=1e-4):
        problems.append("the combine read rows before their signal said they were final")
    return problems


def _check_layer(fp8: bool):
    from . import Combine
    from .moe.layer import MaskedExperts, moe_experts_ref
    from .quant import quantize_fp8_per_block, quantize_fp8_per_token
    from .reference import similarity

    e_count, hidden, inter, max_m, tokens = 6, 512, 256, 48, 64
    w13 = torch.randn(e_count, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(e_count, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    x = torch.randn(e_count, max_m, hidden, device="cuda", dtype=torch.bfloat16)
    xs = s13 = s2 = None
    if fp8:
        x, xs = quantize_fp8_per_token(x)
        w13, s13 = quantize_fp8_per_block(w13)
        w2, s2 = quantize_fp8_per_block(w2)
    masked_m = torch.tensor([0, 48, 7, 60, 1, 33], dtype=torch.int32, device="cuda")
    tok = torch.stack([torch.randperm(tokens)[:max_m] for _ in range(e_count)]).to(torch.int32).cuda()
    wt = torch.rand(e_count, max_m, device="cuda")
    base = torch.randn(tokens, hidden, device="cuda")
    output = base.clone()
    _, err = MaskedExperts(w13, w2, w13_scale=s13, w2_scale=s2)(
        x, masked_m, x_scale=xs, expected_m=24, combine=Combine(tok, wt, output))
    torch.cuda.synchronize()
    ref = moe_experts_ref(x, masked_m, w13, w2, x_scale=xs, w13_scale=s13, w2_scale=s2,
                          token_index=tok, weight=wt, num_tokens=tokens)
    problems = []
    if int(err.item()) != 0:
        problems.append(f"error word {int(err.item())}")
    if not similarity(output - base, ref) < 1e-4:
        problems.append("the combined output differs from the reference")
    return problems


# what a GPU without Blackwell's block-scaled tensor cores cannot check
NOT_ON_HOPPER = ("MXFP8 and NVFP4 GEMMs, and MXFP4 weights with MXFP8 activations (block-scaled formats of "
                 "Blackwell's tensor cores): not checked, this GPU has no kernels for them (they need sm_100 / sm_103)")
NOT_ON_BLACKWELL = "MoE layer with the fused combine: not checked, the fused combine runs on sm_90 only"


def main() -> int:
    from .jit.arch import backend_name

    if not torch.cuda.is_available():
        print("flashgemm selftest: no CUDA GPU found; nothing to test here (the CPU tests are `./dev test`).")
        return 2
    cap = torch.cuda.get_device_capability()
    gpu = torch.cuda.get_device_name()
    backend = backend_name(cap)
    if backend is None:
        print(f"flashgemm selftest: found {gpu} (sm_{cap[0]}{cap[1]}), but flashgemm has kernels for "
              "sm_90 (Hopper) and sm_100 / sm_103 (Blackwell) only; nothing was run.")
        return 2
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"flashgemm selftest on {gpu}, sm_{cap[0]}{cap[1]} (seed {seed})")
    checks = _checks(backend == "sm90")
    if backend != "sm90":
        from .selftest_blockscaled import checks as blockscaled_checks

        checks += blockscaled_checks()
    failed = 0
    for name, check in checks:
        try:
            problems = check()
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            problems = [f"raised {type(exc).__name__}: {exc}".splitlines()[0]]
            traceback.print_exc()
        failed += bool(problems)
        print(f"  {'ok  ' if not problems else 'FAIL'} {name}" + "".join(f"\n       - {p}" for p in problems))
    print(f"  --   {NOT_ON_HOPPER if backend == 'sm90' else NOT_ON_BLACKWELL}")
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _checks(with_layer: bool) -> list:
    """(name, check) of the bf16 and 1x128 fp8 checks; ``with_layer``: also
    the MoE layer with the fused combine (an sm_90 epilogue)."""
    checks = []
    for fp8 in (False, True):
        fmt = "fp8 1x128/128x128" if fp8 else "bf16"
        k = 272 if fp8 else 264  # a last partial 128-wide K block
        checks += [
            (f"{fmt} GEMM, odd shapes, empty / over-long / negative masked_m",
             lambda fp8=fp8, k=k: _check_gemm(fp8, 5, 37, 144 if fp8 else 136, k, [0, 1, 37, 99, -4])),
            (f"{fmt} GEMM, one expert", lambda fp8=fp8: _check_gemm(fp8, 1, 300, 256, 512, [257])),
            (f"{fmt} GEMM, decode shape", lambda fp8=fp8: _check_gemm(fp8, 16, 256, 1024, 1024,
                                                                        [int(x) for x in torch.randint(0, 64, (16,))])),
            (f"{fmt} completion signals with a polling combine", lambda fp8=fp8: _check_signals(fp8)),
        ]
        if with_layer:
            checks.append((f"{fmt} MoE layer with the fused combine", lambda fp8=fp8: _check_layer(fp8)))
    return checks
