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

from .. import backend as backends
from ..config import SWIGLU_GRANULE, Epilogue
from ..formats import Format
from ..jit.arch import default_arch, device_facts
from ..plan import PlanCache, planned
from ..blockscaled_args import infer_format, validate_mxfp4_weight_args
from ..mxfp4 import n_contiguous
from ..validation import (
    FP8,
    byte_span,
    check_tensor,
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

    weight: torch.Tensor  # [E, 2I, H] (MXFP4: int8 [E, 2I, H/2]), 64-row gate / up groups alternating
    # fp8: [E, 2I/64, ceil(H/128)] float32, one per group; MXFP4: the E8M0
    # exponents [E, 2I, H/32], rows alike, N contiguous; bf16: None
    scale: Optional[torch.Tensor]


def interleave_w13(w13: torch.Tensor, w13_scale: Optional[torch.Tensor] = None) -> InterleavedW13:
    """w13 [E, 2I, H] (gate rows, then up rows) reordered as 64-row groups
    gate 0, up 0, gate 1, up 1, ... and, for fp8, its 128x128 block scales
    [E, 2I/128, H/128] as one scale per 64-row group [E, 2I/64, H/128] (a
    group's rows lie in one 128-row block of w13). Returns an
    ``InterleavedW13`` (weight, scale) with scale None for bf16; I must be a
    multiple of 64 (128 for fp8)."""
    check_tensor("w13", w13, 3, (FP8, torch.bfloat16, torch.int8))
    e_count, two_i, hidden = w13.shape
    inter = _check_inter(w13, w13.dtype != torch.bfloat16)
    groups = inter // SWIGLU_GRANULE
    w = w13.reshape(e_count, 2, groups, SWIGLU_GRANULE, hidden).transpose(1, 2)
    w = w.reshape(e_count, two_i, hidden).contiguous()
    if w13.dtype == torch.int8:  # MXFP4 (mxfp4.prepare_weights): the exponents' rows move alike
        return InterleavedW13(w, n_contiguous(_interleave_rows(_mxfp4_exps(w13_scale, w13), groups)))
    if w13.dtype != FP8:
        if w13_scale is not None:
            raise ValueError("w13_scale is only for float8_e4m3fn weights")
        return InterleavedW13(w, None)
    check_tensor("w13_scale", w13_scale, 3, (torch.float32,))
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


def _mxfp4_exps(w13_scale, w13: torch.Tensor) -> torch.Tensor:
    """MXFP4 w13's exponents [E, 2I, H/32] (uint8 or float8_e8m0fnu), as uint8."""
    want = (w13.shape[0], w13.shape[1], w13.shape[2] * 2 // 32)
    if not isinstance(w13_scale, torch.Tensor) or w13_scale.dtype not in (torch.uint8, torch.float8_e8m0fnu) \
            or tuple(w13_scale.shape) != want:
        raise ValueError(f"MXFP4 w13 (int8, mxfp4.prepare_weights) needs w13_scale: its E8M0 exponents {want}, "
                         f"got {getattr(w13_scale, 'dtype', None)} {tuple(getattr(w13_scale, 'shape', ()))}")
    return w13_scale.view(torch.uint8)


def _interleave_rows(t: torch.Tensor, groups: int) -> torch.Tensor:
    e_count, two_i, cols = t.shape
    return t.reshape(e_count, 2, groups, SWIGLU_GRANULE, cols).transpose(1, 2).reshape(e_count, two_i, cols)


def deinterleave_w13(w13: torch.Tensor, w13_scale: Optional[torch.Tensor] = None):
    """The inverse of ``interleave_w13``: (w13 [E, 2I, H], scales [E, 2I/128,
    H/128] or None) in the checkpoint layout."""
    e_count, two_i, hidden = w13.shape
    groups = two_i // 2 // SWIGLU_GRANULE
    w = w13.reshape(e_count, groups, 2, SWIGLU_GRANULE, hidden).transpose(1, 2).reshape(e_count, two_i, hidden)
    if w13.dtype == torch.int8:
        s = w13_scale.reshape(e_count, groups, 2, SWIGLU_GRANULE, -1).transpose(1, 2).reshape(e_count, two_i, -1)
        return w.contiguous(), n_contiguous(s)
    if w13_scale is None:
        return w.contiguous(), None
    per_block = SCALE_BLOCK // SWIGLU_GRANULE  # groups per 128-row block, each of gate and up
    gate, up = w13_scale[:, 0::2 * per_block], w13_scale[:, 1::2 * per_block]
    return w.contiguous(), torch.cat([gate, up], dim=1).contiguous()


_PLANS = PlanCache(1024)


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
    fp8 = isinstance(x, torch.Tensor) and x.dtype == FP8
    if torch.compiler.is_compiling():
        if out is not None or out_scale is not None:
            raise ValueError("out and out_scale cannot be traced by torch.compile; call gate_up_swiglu "
                             "outside the compiled region for them")
        h, h_scale = torch.ops.flashgemm.gate_up_swiglu(x, w13, masked_m, x_scale, w13_scale, expected_m, num_sms)
        return (h, h_scale) if fp8 else h
    tensors = {"a": x, "b": w13, "out": out, "masked_m": masked_m, "a_scale": x_scale, "b_scale": w13_scale,
               "out_scale": out_scale}
    plan = planned(_PLANS, "gate_up_swiglu", tensors, (expected_m, num_sms), lambda: _make_plan(
        x, w13, masked_m, x_scale, w13_scale, out, out_scale, expected_m, num_sms, dict(tensors)))
    e_count, max_m, inter = plan.out_shape
    if fp8:
        if out is None:
            tensors["out"], tensors["out_scale"] = alloc_fp8_input(e_count, max_m, inter, x.device)
    elif out is None:
        tensors["out"] = torch.empty(plan.out_shape, dtype=torch.bfloat16, device=x.device)
    if plan.copy_a_scale:
        tensors["a_scale"] = tma_ready_a_scale(x_scale)
    if plan.counter_device is not None:
        from .. import workspace

        tensors["counter"] = workspace.claim_counter(plan.counter_device)
    plan.launch(tensors)
    return (tensors["out"], tensors["out_scale"]) if fp8 else tensors["out"]


def _make_plan(x, w13, masked_m, x_scale, w13_scale, out, out_scale, expected_m, num_sms, tensors: dict):
    """Every check, before anything launches; ``tensors``: the same by launch slot."""
    check_tensor("x", x, 3, (FP8, torch.bfloat16))
    fp8 = x.dtype == FP8
    mxfp4 = isinstance(w13, torch.Tensor) and w13.dtype == torch.int8  # (with fp8 or bf16 x)
    check_tensor("w13", w13, 3, (torch.int8,) if mxfp4 else (x.dtype,))
    e_count, max_m, hidden = x.shape
    inter = _check_inter(w13, fp8)
    two_i = 2 * inter
    scale_view = None
    if mxfp4:
        validate_mxfp4_weight_args(x, w13, None, masked_m, x_scale, w13_scale,
                                   Format.FP8_MXFP4 if fp8 else Format.BF16_MXFP4)
    elif fp8:
        check_tensor("w13_scale", w13_scale, 3, (torch.float32,))
        want = (e_count, two_i // SWIGLU_GRANULE, -(-hidden // SCALE_BLOCK))
        if tuple(w13_scale.shape) != want:
            raise ValueError(f"w13_scale must be the interleaved scales (E, 2I/64, ceil(H/128)) = {want} "
                             f"(interleave_w13), got {tuple(w13_scale.shape)}")
        scale_view = w13_scale[:, ::2]  # (the 128-row view the GEMM checks take)
    elif w13_scale is not None:
        raise ValueError("w13_scale is only for float8_e4m3fn weights")
    if not mxfp4:
        validate_args(x, w13, None, masked_m, x_scale, scale_view)
    check_expected_m(expected_m)
    h_shape = (e_count, max_m, inter)
    check_h_out(out, out_scale, h_shape, fp8)
    if out is not None:
        written = {"out": byte_span(out)}
        if out_scale is not None:
            written["out_scale"] = byte_span(out_scale)
        inputs = {"x": x, "w13": w13, "masked_m": masked_m, "x_scale": x_scale, "w13_scale": w13_scale}
        for name, span in written.items():
            check_no_alias(name, span, {**inputs, **{k: v for k, v in written.items() if k != name}})
    index = x.device.index if x.device.type == "cuda" else None
    capability, sm_count, name = device_facts(index) if index is not None else ((0, 0), 0, "")
    grid_cap = validate_device(
        {"x": x, "w13": w13, "masked_m": masked_m, "x_scale": x_scale, "w13_scale": w13_scale, "out": out,
         "out_scale": out_scale}, num_sms, capability, sm_count, name,
    )
    be = backends.for_capability(capability) or backends.for_arch(default_arch())
    epilogue = Epilogue.SWIGLU_FP8 if fp8 else Epilogue.SWIGLU_BF16
    if epilogue not in be.epilogues:
        raise ValueError(f"gate_up_swiglu runs on sm_90 (Hopper) only; {x.device} is "
                         f"sm_{capability[0]}{capability[1]}")
    if fp8 and grid_cap < 2:
        raise ValueError(f"num_sms must be >= 2 for fp8 (the fused SwiGLU runs 2-CTA clusters), got {grid_cap}")
    fmt = infer_format(x, x_scale, w13)
    return be.make_plan(backends.GemmCall(
        fmt=fmt, sizes=(e_count, max_m, two_i, hidden),
        tensors=tensors, routing=(), combine=None, expected_m=expected_m, config=None, granularity="m_block",
        grid_cap=grid_cap, device_index=index, epilogue=epilogue))
