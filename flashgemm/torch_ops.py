"""The public ops as ``torch.ops.flashgemm.*`` custom ops, with fake
implementations, so ``torch.compile(fullgraph=True)`` traces models that
call ``flashgemm.grouped_gemm_nt_masked`` or ``moe.gate_up.gate_up_swiglu``
(they route through these while compiling). The CPU implementations are the
torch references, so a compiled model also runs, slowly, where there is no GPU.

Covered: a, b, out or not, masked_m, the fp8 scales, expected_m, num_sms; for
the fused SwiGLU the functional form (no out). Signals, combine, config and
stream are eager-only arguments.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import grouped_gemm_nt_masked_ref


def _out_shape(a: torch.Tensor, b: torch.Tensor):
    return (a.shape[0], a.shape[1], b.shape[1])


def _out_dtype(a: torch.Tensor):
    return torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype


@torch.library.custom_op("flashgemm::grouped_gemm_nt_masked_out", mutates_args=("out",))
def grouped_gemm_nt_masked_out(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, masked_m: torch.Tensor,
    a_scale: Optional[torch.Tensor] = None, b_scale: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None, num_sms: Optional[int] = None,
) -> None:
    """``out[e, :m_e] = a[e, :m_e] @ b[e].T``; rows >= m_e untouched."""
    if a.device.type == "cpu":
        ref = grouped_gemm_nt_masked_ref(a, b, masked_m, out, a_scale=a_scale, b_scale=b_scale)
        out.copy_(ref.to(out.dtype))
        return
    from .api import grouped_gemm_nt_masked

    grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale,
                           expected_m=expected_m, num_sms=num_sms)


@grouped_gemm_nt_masked_out.register_fake
def _(a, b, out, masked_m, a_scale=None, b_scale=None, expected_m=None, num_sms=None):
    return None


@torch.library.custom_op("flashgemm::grouped_gemm_nt_masked", mutates_args=())
def grouped_gemm_nt_masked(
    a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor,
    a_scale: Optional[torch.Tensor] = None, b_scale: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None, num_sms: Optional[int] = None,
) -> torch.Tensor:
    """The functional form: a new [E, max_m, N] output (rows >= m_e undefined)."""
    out = torch.empty(_out_shape(a, b), dtype=_out_dtype(a), device=a.device)
    if a.device.type == "cpu":
        out.zero_()
    grouped_gemm_nt_masked_out(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms)
    return out


@grouped_gemm_nt_masked.register_fake
def _(a, b, masked_m, a_scale=None, b_scale=None, expected_m=None, num_sms=None):
    return a.new_empty(_out_shape(a, b), dtype=_out_dtype(a))


def _h_buffers(x: torch.Tensor, w13: torch.Tensor):
    """New (h, h_scale) of the fused SwiGLU: ``alloc_fp8_input``'s layout for
    fp8 (what the kernel's launcher allocates), else bf16 h and an empty
    [E, max_m, 0] scale. (In a fake implementation: fake tensors.)"""
    from .moe.activation import alloc_fp8_input

    e_count, max_m, inter = x.shape[0], x.shape[1], w13.shape[1] // 2
    if x.dtype == torch.float8_e4m3fn:
        return alloc_fp8_input(e_count, max_m, inter, x.device)
    return (x.new_empty((e_count, max_m, inter), dtype=torch.bfloat16),
            x.new_empty((e_count, max_m, 0), dtype=torch.float32))


@torch.library.custom_op("flashgemm::gate_up_swiglu", mutates_args=())
def gate_up_swiglu(
    x: torch.Tensor, w13: torch.Tensor, masked_m: torch.Tensor,
    x_scale: Optional[torch.Tensor] = None, w13_scale: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None, num_sms: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.gate_up.gate_up_swiglu`` (w13 interleaved): (h, h_scale); for
    bf16 x, h_scale is an empty [E, max_m, 0] tensor. Rows >= m_e of a new h
    are undefined (zero on the CPU)."""
    if x.device.type == "cpu":
        from .moe.activation import silu_mul_ref
        from .moe.gate_up import deinterleave_w13

        w, s = deinterleave_w13(w13, w13_scale)
        gu = grouped_gemm_nt_masked_ref(x, w, masked_m, a_scale=x_scale, b_scale=s).to(torch.bfloat16)
        fp8 = x.dtype == torch.float8_e4m3fn
        ref = silu_mul_ref(gu, masked_m, fp8=fp8)
        h, h_scale = _h_buffers(x, w13)
        h.copy_(ref[0] if fp8 else ref)
        if fp8:
            h_scale.copy_(ref[1])
        return h, h_scale
    from .moe.gate_up import InterleavedW13
    from .moe.gate_up import gate_up_swiglu as launch

    h = launch(x, InterleavedW13(w13, w13_scale), masked_m, x_scale=x_scale, expected_m=expected_m,
               num_sms=num_sms)
    if isinstance(h, tuple):
        return h
    return h, _h_buffers(x, w13)[1]


@gate_up_swiglu.register_fake
def _(x, w13, masked_m, x_scale=None, w13_scale=None, expected_m=None, num_sms=None):
    return _h_buffers(x, w13)
