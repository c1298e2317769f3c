"""Benchmark peer: a Triton masked grouped GEMM of the kind serving stacks use
for batched experts (one program per (m-block, n-block, expert); programs
whose m-block holds no valid row return at once; invalid rows are masked out
of the loads and the stores). bf16, and block-scaled fp8 with the same
1x128 / 128x128 recipe as flashgemm. Not part of the package: ``bench.py``
times it next to flashgemm on the same data, taking the fastest of ``CONFIGS``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class TritonConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def short_name(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"


# block_n <= 128 and a divisor of 128, so one weight-scale block covers a tile
CONFIGS = [
    TritonConfig(64, 128, 4, 4),
    TritonConfig(64, 64, 4, 5),
    TritonConfig(128, 128, 8, 3),
    TritonConfig(128, 64, 4, 4),
]


@triton.jit
def _masked_gemm_kernel(
    a_ptr, b_ptr, c_ptr, masked_m_ptr, sa_ptr, sb_ptr,
    max_m, N, K,
    s_ae, s_am, s_ak, s_be, s_bn, s_bk, s_ce, s_cm, s_cn,
    s_sae, s_sam, s_sak, s_sbe, s_sbn, s_sbk,
    FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.program_id(2)
    m_e = tl.minimum(tl.maximum(tl.load(masked_m_ptr + e), 0), max_m)
    if pid_m * BLOCK_M >= m_e:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < m_e
    col_ok = offs_n < N
    a_ptrs = a_ptr + e * s_ae + offs_m[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + e * s_be + offs_n[None, :] * s_bn + offs_k[:, None] * s_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8:  # BLOCK_K == 128: one scale block per step
            sa = tl.load(sa_ptr + e * s_sae + offs_m * s_sam + kb * s_sak, mask=row_ok, other=0.0)
            sb = tl.load(sb_ptr + e * s_sbe + (pid_n * BLOCK_N // 128) * s_sbn + kb * s_sbk)
            acc += tl.dot(a, b) * (sa[:, None] * sb)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    c_ptrs = c_ptr + e * s_ce + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])


def masked_gemm(a, b, out, masked_m, config: TritonConfig, a_scale=None, b_scale=None):
    """``out[e, :m_e] = a[e, :m_e] @ b[e].T`` (fp8: with the block scales)."""
    e_count, max_m, k = a.shape
    n = b.shape[1]
    fp8 = a.dtype == torch.float8_e4m3fn
    if fp8:
        sa, sb = a_scale, b_scale
    else:
        sa = sb = a  # unused
    grid = (triton.cdiv(max_m, config.block_m), triton.cdiv(n, config.block_n), e_count)
    _masked_gemm_kernel[grid](
        a, b, out, masked_m, sa, sb, max_m, n, k,
        *a.stride(), *b.stride(), *out.stride(),
        *(sa.stride() if fp8 else (0, 0, 0)), *(sb.stride() if fp8 else (0, 0, 0)),
        FP8=fp8, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=128 if fp8 else 64,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
