"""The SwiGLU arithmetic on the device, shared by the activation kernel and
the gate_up epilogues that fuse it, so both paths
give bit-identical h: ``h = (g * u) * rcp(1 + exp(-g))`` in fp32, and the fp8
values ``h * (1 / scale)`` with ``scale = max(amax, MIN_AMAX) / FP8_MAX``.
Reciprocals instead of divisions: a full-precision division per element
cost the fused epilogue several microseconds per tile (docs/design.md)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

FP8_MAX = 448.0
MIN_AMAX = 1e-10  # an all-zero block still gets a finite scale (as quant.py)


@cute.jit
def swiglu(gate: cute.Tensor, up: cute.Tensor, h: cute.Tensor):
    """h[v] = silu(gate[v]) * up[v] for every value of these fp32 register tensors."""
    denom = cute.make_rmem_tensor(cute.shape(gate), cutlass.Float32)
    denom.store(1.0 + cute.math.exp(-gate.load()))
    for v in cutlass.range_constexpr(cute.size(gate)):
        h[v] = (gate[v] * up[v]) * cute.arch.rcp_approx(denom[v])


@cute.jit
def quantize(h: cute.Tensor, inv_scale, q: cute.Tensor):
    """q = h * inv_scale, converted to q's dtype (fp8 e4m3)."""
    q.store((h.load() * inv_scale).to(q.element_type))


@cute.jit
def clamped_swiglu(gate: cute.Tensor, up: cute.Tensor, h: cute.Tensor, alpha: float, limit: float):
    """gpt-oss's activation (``moe.gpt_oss``): h[v] = g * sigmoid(alpha * g) * (u + 1)
    with g = min(gate[v], limit) and u = up[v] clamped to [-limit, limit]."""
    for v in cutlass.range_constexpr(cute.size(gate)):
        g = cute.arch.fmin(gate[v], cutlass.Float32(limit))
        u = cute.arch.fmax(cute.arch.fmin(up[v], cutlass.Float32(limit)), cutlass.Float32(-limit))
        denom = 1.0 + cute.math.exp(-alpha * g)
        h[v] = (g * (u + 1.0)) * cute.arch.rcp_approx(denom)
