"""gate_up with the SwiGLU activation fused into its epilogue (sm_90a).

``gate_up_swiglu`` computes ``h[e, :m_e] = silu(x @ w_gate.T) * (x @ w_up.T)``
in one kernel (``Epilogue.SWIGLU_FP8`` / ``SWIGLU_BF16``, ``sm90.act_epilogue``):
the gate_up output never reaches memory. It needs w13 with the gate and up
rows interleaved in 64-row groups (``interleave_w13``, once at load time), so
each 128-wide tile holds matching gate and up columns. For fp8 h comes out
quantized 1x128 with its scales in the layout the down GEMM reads in place,
exactly as ``activation.silu_mul`` would write it from the bf16 gate_up output.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..config import SWIGLU_GRANULE, Epilogue, KernelSpec
from ..formats import Format
from ..jit.arch import device_facts
from ..sm90.heuristic import choose_activation_config
from ..sm90.limits import check_config
from ..validation import (
    _FP8,
    _byte_span,
    _check_tensor,
    check_expected_m,
    check_no_alias,
    tma_ready_a_scale,
    validate_args,
    validate_device,
)
from .activation import SCALE_BLOCK, alloc_fp8_input, check_h_out


class InterleavedW13(NamedTuple):
    """w13 and its scales in the layout ``gate_up_swiglu`` takes, as
    ``interleave_w13`` returns them. A type of its own, so that a
    checkpoint-layout w13 cannot reach the kernel (it would give wrong h
    without an error)."""

    weight: torch.Tensor  # [E, 2I, H], 64-row gate / up groups alternating
    scale: Optional[torch.Tensor]  # fp8: [E, 2I/64, ceil(H/128)] float32, one per group; bf16: None


def interleave_w13(w13: torch.Tensor, w13_scale: Optional[torch.Tensor] = None) -> InterleavedW13:
    """w13 [E, 2I, H] (gate rows, then up rows) reordered as 64-row groups
    gate 0, up 0, gate 1, up 1, ... and, for fp8, its 128x128 block scales
    [E, 2I/128, H/128] as one scale per 64-row group [E, 2I/64, H/128] (a
    group's rows lie in one 128-row block of w13). Returns an
    ``InterleavedW13`` (weight, scale) with scale None for bf16; I must be a
    multiple of 64 (128 for fp8)."""
    _check_tensor("w13", w13, 3, (_FP8, torch.bfloat16))
    e_count, two_i, hidden = w13.shape
    inter = _check_inter(w13, w13.dtype == _FP8)
    groups = inter // SWIGLU_GRANULE
    w = w13.reshape(e_count, 2, groups, SWIGLU_GRANULE, hidden).transpose(1, 2)
    w = w.reshape(e_count, two_i, hidden).contiguous()
    if w13.dtype != _FP8:
        if w13_scale is not None:
            raise ValueError("w13_scale is only for float8_e4m3fn weights")
        return InterleavedW13(w, None)
    _check_tensor("w13_scale", w13_scale, 3, (torch.float32,))
    want = (e_count, two_i // SCALE_BLOCK, -(-hidden // SCALE_BLOCK))
    if tuple(w13_scale.shape) != want:
        raise ValueError(f"w13_scale must be (E, 2I/128, ceil(H/128)) = {want}, got {tuple(w13_scale.shape)}")
    j = torch.arange(2 * groups, device=w13_scale.device)
    # group j: gate (j even) or up (j odd) rows from row (j // 2) * 64 of that half
    rows = (j % 2) * inter + (j // 2) * SWIGLU_GRANULE
    return InterleavedW13(w, w13_scale.index_select(1, rows // SCALE_BLOCK).contiguous())


def _check_inter(w13: torch.Tensor, fp8: bool) -> int:
    """I of w13 [E, 2I, H]: a positive multiple of 128 for fp8 (a scale
    block), of SWIGLU_GRANULE for bf16."""
    two_i = w13.shape[1]
    mult = SCALE_BLOCK if fp8 else SWIGLU_GRANULE
    if two_i % 2 or two_i // 2 < mult or (two_i // 2) % mult:
        raise ValueError(f"w13 must be [E, 2I, H] with I a positive multiple of {mult}, got {tuple(w13.shape)}")
    return two_i // 2


def deinterleave_w13(w13: torch.Tensor, w13_scale: Optional[torch.Tensor] = None):
    """The inverse of ``interleave_w13``: (w13 [E, 2I, H], scales [E, 2I/128,
    H/128] or None) in the checkpoint layout."""
    e_count, two_i, hidden = w13.shape
    groups = two_i // 2 // SWIGLU_GRANULE
    w = w13.reshape(e_count, groups, 2, SWIGLU_GRANULE, hidden).transpose(1, 2).reshape(e_count, two_i, hidden)
    if w13_scale is None:
        return w.contiguous(), None
    per_block = SCALE_BLOCK // SWIGLU_GRANULE  # groups per 128-row block, each of gate and up
    gate, up = w13_scale[:, 0::2 * per_block], w13_scale[:, 1::2 * per_block]
    return w.contiguous(), torch.cat([gate, up], dim=1).contiguous()


_PLANS: dict = {}
_MAX_PLANS = 1024


def gate_up_swiglu(
    x: torch.Tensor,
    w13: InterleavedW13,
    masked_m: torch.Tensor,
    *,
    x_scale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    out_scale: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None,
    num_sms: Optional[int] = None,
):
    """``h[e, :m_e] = silu(gate) * up`` of ``x[e, :m_e] @ w13[e].T``, one kernel.

    x: [E, max_m, H] (fp8 e4m3 with ``x_scale`` [E, max_m, H/128], or bf16);
    w13: the ``InterleavedW13`` of ``interleave_w13``; masked_m: int32 [E] on the GPU.
    Returns (h fp8 [E, max_m, I], scales fp32 [E, max_m, I/128] M-contiguous)
    for fp8, else h bf16; ``out`` / ``out_scale`` preallocated (``activation.
    alloc_fp8_input``). Rows >= m_e of h are never written. An fp8 call runs
    2-CTA clusters: num_sms >= 2."""
    if not isinstance(w13, InterleavedW13):
        raise TypeError(f"w13 must be the InterleavedW13 that interleave_w13(w13, w13_scale) returns, got "
                        f"{type(w13).__name__}: a checkpoint-layout w13 would give wrong h")
    w13, w13_scale = w13
    fp8 = isinstance(x, torch.Tensor) and x.dtype == _FP8
    if torch.compiler.is_compiling():
        if out is not None or out_scale is not None:
            raise ValueError("out and out_scale cannot be traced by torch.compile; call gate_up_swiglu "
                             "outside the compiled region for them")
        h, h_scale = torch.ops.flashgemm.gate_up_swiglu(x, w13, masked_m, x_scale, w13_scale, expected_m, num_sms)
        return (h, h_scale) if fp8 else h
    key = None
    try:
        key = (x.dtype, x.shape, x.stride(), x.device, w13.shape, w13.stride(), masked_m.shape,
               None if x_scale is None else (x_scale.shape, x_scale.stride()),
               None if w13_scale is None else (w13_scale.shape, w13_scale.stride()),
               out is None, None if out is None else (out.dtype, out.shape, out.stride()),
               None if out_scale is None else (out_scale.shape, out_scale.stride()),
               expected_m, type(expected_m), num_sms, type(num_sms))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):
        plan = None
    ptrs = None
    if plan is not None:
        ptrs = _pointers(x, w13, masked_m, x_scale, w13_scale, out, out_scale)
    if plan is None or ptrs != plan.last_ok:
        plan = _make_plan(x, w13, masked_m, x_scale, w13_scale, out, out_scale, expected_m, num_sms)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
        plan.last_ok = _pointers(x, w13, masked_m, x_scale, w13_scale, out, out_scale)
    e_count, max_m, inter = plan.h_shape
    if fp8:
        if out is None:
            out, out_scale = alloc_fp8_input(e_count, max_m, inter, x.device)
        if plan.copy_x_scale:
            x_scale = tma_ready_a_scale(x_scale)
    elif out is None:
        out = torch.empty(plan.h_shape, dtype=torch.bfloat16, device=x.device)
    plan.fn(x, w13, out, masked_m, None, x_scale, w13_scale, plan.counter(), None, None, None, None, None,
            out_scale, plan.num_ctas)
    return (out, out_scale) if fp8 else out


class _Plan:
    """The checks' result for one argument signature: kernel and grid."""

    def __init__(self, fn, num_ctas, h_shape, copy_x_scale, counter_device):
        self.fn, self.num_ctas, self.h_shape = fn, num_ctas, h_shape
        self.copy_x_scale, self.counter_device = copy_x_scale, counter_device
        self.last_ok = None  # the addresses of the last checked call

    def counter(self):
        if self.counter_device is None:
            return None
        from .. import workspace

        return workspace.claim_counter(self.counter_device)



def _pointers(*tensors) -> tuple:
    # a plan is reused as is for the same buffers; new addresses go through
    # every check again (alignment and aliasing depend on them)
    return tuple(None if t is None else t.data_ptr() for t in tensors)


def _make_plan(x, w13, masked_m, x_scale, w13_scale, out, out_scale, expected_m, num_sms) -> _Plan:
    """Every check, before anything launches."""
    _check_tensor("x", x, 3, (_FP8, torch.bfloat16))
    _check_tensor("w13", w13, 3, (x.dtype,))
    fp8 = x.dtype == _FP8
    e_count, max_m, hidden = x.shape
    inter = _check_inter(w13, fp8)
    two_i = 2 * inter
    scale_view = None
    if fp8:
        _check_tensor("w13_scale", w13_scale, 3, (torch.float32,))
        want = (e_count, two_i // SWIGLU_GRANULE, -(-hidden // SCALE_BLOCK))
        if tuple(w13_scale.shape) != want:
            raise ValueError(f"w13_scale must be the interleaved scales (E, 2I/64, ceil(H/128)) = {want} "
                             f"(interleave_w13), got {tuple(w13_scale.shape)}")
        scale_view = w13_scale[:, ::2]  # (the 128-row view the GEMM checks take)
    elif w13_scale is not None:
        raise ValueError("w13_scale is only for float8_e4m3fn weights")
    validate_args(x, w13, None, masked_m, x_scale, scale_view)
    check_expected_m(expected_m)
    h_shape = (e_count, max_m, inter)
    check_h_out(out, out_scale, h_shape, fp8)
    if out is not None:
        written = {"out": _byte_span(out)}
        if out_scale is not None:
            written["out_scale"] = _byte_span(out_scale)
        inputs = {"x": x, "w13": w13, "masked_m": masked_m, "x_scale": x_scale, "w13_scale": w13_scale}
        for name, span in written.items():
            check_no_alias(name, span, {**inputs, **{k: v for k, v in written.items() if k != name}})
    index = x.device.index if x.device.type == "cuda" else None
    capability, sm_count, name = device_facts(index) if index is not None else ((0, 0), 0, "")
    grid_cap = validate_device(
        {"x": x, "w13": w13, "masked_m": masked_m, "x_scale": x_scale, "w13_scale": w13_scale, "out": out,
         "out_scale": out_scale}, num_sms, capability, sm_count, name,
    )
    if capability[0] != 9:
        raise ValueError(f"gate_up_swiglu runs on sm_90 (Hopper) only; {x.device} is sm_{capability[0]}{capability[1]}")
    if fp8 and grid_cap < 2:
        raise ValueError(f"num_sms must be >= 2 for fp8 (the fused SwiGLU runs 2-CTA clusters), got {grid_cap}")
    config = choose_activation_config(expected_m, max_m, two_i, hidden, grid_cap, fp8, e_count)
    fmt = Format.FP8_BLOCK128 if fp8 else Format.BF16
    epilogue = Epilogue.SWIGLU_FP8 if fp8 else Epilogue.SWIGLU_BF16
    check_config(config, fmt, epilogue)
    from ..sm90.build import get_kernel

    fn = get_kernel(KernelSpec(config, fmt, None, epilogue))
    if config.dynamic:
        from .. import workspace

        workspace.prepare_graph_counters(index)
    num_ctas = config.cluster_n * config.grid_clusters(e_count, max_m, two_i, grid_cap)
    return _Plan(getattr(fn, "__tvm_ffi_object__", lambda: None)() or fn, num_ctas, h_shape,
                 fp8 and tma_ready_a_scale(x_scale, check_only=True), index if config.dynamic else None)
