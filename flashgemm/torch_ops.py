"""The public op as ``torch.ops.flashgemm.*`` custom ops, with fake
implementations, so ``torch.compile(fullgraph=True)`` traces models that
call ``flashgemm.grouped_gemm_nt_masked`` (it routes through these while
compiling). The CPU implementation is the torch reference, so a compiled
model also runs, slowly, where there is no GPU.

Covered: a, b, out or not, masked_m, the fp8 scales, expected_m, num_sms.
Signals, combine, config and stream are eager-only arguments.
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
