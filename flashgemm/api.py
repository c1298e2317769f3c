"""The public op: pick a configuration and launch, after the checks of
``validation`` (run once per argument signature; the address checks on every
call). The backend that serves the GPU (``flashgemm.backend``) supplies the
heuristic, the configuration rules, the kernels and the launch plan.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import backend as backends
from . import workspace
from .blockscaled_args import (
    check_alpha, format_of, infer_format, validate_blockscaled_args, validate_mxfp4_weight_args,
)
from .config import GemmConfig
from .jit.arch import default_arch, device_facts
from .plan import PlanCache, signature
from .routing import COMBINE_FIELDS, ROUTING_SLOTS, Combine, check_combine, combine_epilogue
from .signals import SignalLayout, check_granularity, check_signal_buffer
from .validation import (
    byte_span,
    check_no_alias,
    check_num_sms,
    check_options,
    check_problem_sizes,
    tma_ready_a_scale,
    validate_args,
    validate_device,
)


def choose_config(expected_m: Optional[int], max_m: int, n: int, k: int, num_sms: int, fp8: bool = False,
                  num_experts: Optional[int] = None, signals: bool = False, combine: bool = False, *,
                  fmt=None):
    """The configuration the compile target's backend (``$CUTE_DSL_ARCH``,
    else this GPU's, else sm_90a) picks for a call, from host facts only:
    a ``GemmConfig`` on sm_90, an ``Sm100Config`` on sm_100. ``fmt``: the
    operand format (``Format`` or its value), or the older ``fp8=True``."""
    from .epilogue import Epilogue

    fmt = format_of(fmt, fp8)
    be = backends.for_arch(default_arch())
    backends.check_format(be, fmt)
    return be.choose_config(fmt, expected_m, max_m, n, k, num_sms, num_experts, signals,
                            Epilogue.COMBINE if combine else Epilogue.STORE)


def signal_layout(
    num_experts: int,
    max_m: int,
    n: int,
    k: int,
    *,
    expected_m: Optional[int] = None,
    num_sms: Optional[int] = None,
    config: Optional[GemmConfig] = None,
    signal_granularity: str = "m_block",
    fp8: bool = False,
    device=None,
    fmt=None,
) -> SignalLayout:
    """The signal layout a call with these arguments will use, known before
    launch (so a combine kernel can be set up first). ``num_sms`` as passed to
    the call, checked the same way (None: every SM of ``device``); ``device``:
    the GPU the call's tensors are on (default: the current CUDA device);
    ``fmt``: the call's operand format (a ``flashgemm.Format`` or its value,
    "bf16", "fp8_block128", "mxfp8", "nvfp4"; default bf16), or the older
    ``fp8=True`` for float8_e4m3fn operands with fp32 scales. ``k`` is in
    elements for every format (NVFP4's packed a has k / 2 bytes per row).
    With ``num_sms`` and no GPU visible, the layout is that of the compile
    target's kernels (``$CUTE_DSL_ARCH``, default sm_90a): no device is needed."""
    fmt = format_of(fmt, fp8)
    check_problem_sizes(fmt, num_experts, max_m, n, k)
    check_options(fmt, config, expected_m, num_sms, signals=True, combine=False)
    check_granularity(signal_granularity)
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device must be a CUDA device, got {device!r}") from None
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
    if num_sms is not None and not torch.cuda.is_available():
        # nothing to ask: the SM count is given, the backend is the compile target's
        be, grid_cap = backends.for_arch(default_arch()), num_sms
    else:
        if device is None:
            if not torch.cuda.is_available():
                raise ValueError("signal_layout needs a CUDA device, or num_sms (pass device=... or num_sms=...)")
            device = torch.device("cuda", torch.cuda.current_device())
        index = torch.cuda.current_device() if device.index is None else device.index
        capability, sm_count, name = device_facts(index)
        grid_cap = check_num_sms(num_sms, sm_count, device)
        be = backends.for_capability(capability)
        if be is None:
            raise ValueError(f"flashgemm's kernels need an sm_90 (Hopper) or sm_100 / sm_103 (Blackwell) GPU; "
                             f"{device} is {name} sm_{capability[0]}{capability[1]}")
    backends.check_format(be, fmt)
    return be.signal_layout(fmt, num_experts, max_m, n, k, expected_m, grid_cap, config, signal_granularity)


def grouped_gemm_nt_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    out: Optional[torch.Tensor],
    masked_m: torch.Tensor,
    *,
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None,
    num_sms: Optional[int] = None,
    config: Optional[GemmConfig] = None,
    dst_signals: Optional[torch.Tensor] = None,
    signal_granularity: str = "m_block",
    stream: Optional[torch.cuda.Stream] = None,
    combine: Optional[Combine] = None,
    alpha: Optional[torch.Tensor] = None,
):
    """``out[e, :m_e] = a[e, :m_e] @ b[e].T`` for every expert, m_e = clamp(masked_m[e], 0, max_m).

    a: [E, max_m, K] bf16, K contiguous. b: [E, N, K] bf16, K contiguous.
    out: [E, max_m, N] bf16, N contiguous, or None to allocate (rows >= m_e of a
    fresh tensor are uninitialized). masked_m: int32 [E] on the same GPU, read
    only by the kernel. Rows ``out[e, m_e:]`` and all memory outside ``out``
    are never written. Runs on the current torch stream, or on ``stream``
    (a ``torch.cuda.Stream`` of a's GPU) if given; no host sync.

    Block-scaled fp8 (DeepSeek-V3 recipe): a and b float8_e4m3fn (K and N
    multiples of 16), out bf16, with a_scale float32 [E, max_m, ceil(K/128)]
    (one scale per row and 128-wide K block) and b_scale float32
    [E, ceil(N/128), ceil(K/128)] (one per 128x128 block):
    ``out[e, i, n] = sum_kb a_scale[e, i, kb] * b_scale[e, n // 128, kb] *
    (a[e, i, kb-block] . b[e, n, kb-block])``. An a_scale that is M contiguous
    with 16-byte-aligned strides (``quant.quantize_fp8_per_token``'s default,
    what a low-latency dispatch writes) is read in place; a K-block-contiguous
    one is first copied into that layout (an extra small kernel per call).

    MXFP4 weights (Hopper): b int8 [E, N, K/2] and b_scale its E8M0
    exponents [E, N, K/32] stored N contiguous, both from
    ``mxfp4.prepare_weights``; a float8_e4m3fn with a_scale as above
    (``Format.FP8_MXFP4``) or bf16 without (``Format.BF16_MXFP4``).

    Blackwell (sm_100 / sm_103) also takes MXFP8 (a, b float8_e4m3fn with
    float8_e8m0fnu or uint8 scales, one per 32 of K) and NVFP4 (a [E, max_m, K/2],
    b [E, N, K/2] packed e2m1 as uint8 or float4_e2m1fn_x2, float8_e4m3fn
    scales, one per 16 of K, and ``alpha``: float32 [E] = 1 / (g_a * g_b),
    required). Their scales are in the 128x4-atom layout of
    ``blockscale.to_blocked_scales``: a_scale (E, ceil(max_m/128),
    ceil(K/vec/4), 32, 4, 4) and b_scale with N for max_m, contiguous. The
    format follows from the dtypes (``flashgemm.blockscaled_args``); on
    Hopper these formats raise ValueError before any launch. MXFP4 weights on
    Blackwell (``Format.MXFP8_MXFP4``): a and a_scale as for MXFP8, b the
    checkpoint's packed e2m1 bytes with each row zero-padded to whole
    128-value pieces, [E, N, ceil(K/128) * 64], and b_scale its E8M0
    exponents in the same blocked layout (both from ``mxfp4.blackwell_weights``).

    expected_m: mean valid rows per expert (host hint for the configuration).
    num_sms: cap on the persistent grid, e.g. to leave SMs to a concurrent kernel.
    config: a :class:`GemmConfig` that overrides the heuristic.
    dst_signals: int32 counters, zeroed by the caller, that receive a release
    add per finished tile (see ``flashgemm.signals``); ``signal_granularity``
    is "m_block" or "expert". With signals the call returns ``(out, layout)``,
    the :class:`SignalLayout` used (the same ``signal_layout(...)`` gives
    before the launch); without, it returns ``out``.
    combine: a :class:`Combine` (token_index, weight, output, err, peers, bias): instead of
    storing ``out`` (pass None), the epilogue reduce-adds
    ``weight[e, r] * bf16(row r of expert e)`` into ``output[token_index[e, r]]``
    (fp32 or bf16 [T, N]) for every valid row; returns ``(output, err)``, where
    ``err`` is the int32 error word (bit 2: a token index outside [0, T), that
    row skipped). The adds land in no fixed order, so the sums can differ in
    their last bits from run to run. A bf16 output sums in bf16 in L2 (each
    add rounds): half the bytes of fp32 and nearly free beside the GEMM, at
    the rounding error ``docs/design.md`` measures. With ``peers`` (expert
    parallelism) each weighted row is instead stored as bf16 into its owner
    rank's receive buffer (see :class:`Combine`), no sums; ``err`` bit 2 then
    flags a destination outside [0, W * R). With ``bias`` (float32 [E, N])
    each row leaves as ``weight[e, r] * (bf16(row) + bias[e])``, the sum in
    fp32, for every target. The combine runs on sm_90 only: on sm_100 /
    sm_103 it raises ValueError before any launch, with or without a bias.
    """
    if torch.compiler.is_compiling():
        return _as_custom_op(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config,
                             dst_signals, stream, combine, alpha)
    if stream is not None:
        _check_stream(stream, a)
        with torch.cuda.stream(stream):
            return grouped_gemm_nt_masked(
                a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, expected_m=expected_m,
                num_sms=num_sms, config=config, dst_signals=dst_signals,
                signal_granularity=signal_granularity, combine=combine, alpha=alpha,
            )
    if combine is not None:
        if alpha is not None:
            raise ValueError("combine takes bf16 or 1x128 fp8 operands on sm_90; alpha is for NVFP4")
        if isinstance(combine, Combine) and combine.err is None and isinstance(a, torch.Tensor):
            combine = combine._replace(err=torch.zeros(1, dtype=torch.int32, device=a.device))
    try:
        tensors = slot_tensors(a, b, out, masked_m, a_scale, b_scale, dst_signals, alpha, combine)
        # The plan for this signature (every tensor's dtype, shape, strides
        # and device: a plan never serves tensors on another GPU)
        key = signature("gemm", tensors, expected_m, num_sms, config, signal_granularity)
        plan = _PLANS.get(key)
        if plan is not None and not plan.pointers_ok(tensors):
            plan = None
    except (AttributeError, TypeError, RuntimeError, IndexError):
        # not tensors, unhashable, without strides (sparse), a malformed combine: the full checks explain
        key, plan, tensors = None, None, None
    if plan is not None:
        try:
            return _launch(plan, tensors)
        except Exception as refused:  # noqa: BLE001 - re-raised below unless a clearer error exists
            # The compiled function's own checks refused an argument the key
            # does not cover before launching: every check below names the argument.
            _explain(refused, CallArgs(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config,
                                       dst_signals, signal_granularity, combine, alpha))
    call = CallArgs(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config, dst_signals,
                    signal_granularity, combine, alpha)
    plan = _PLANS.put(key, _make_plan(call))
    return _launch(plan, call.tensors() if tensors is None else tensors)


class CallArgs(NamedTuple):
    """The arguments of one ``grouped_gemm_nt_masked`` call."""

    a: object
    b: object
    out: object
    masked_m: object
    a_scale: object = None
    b_scale: object = None
    expected_m: Optional[int] = None
    num_sms: Optional[int] = None
    config: object = None
    dst_signals: object = None
    signal_granularity: str = "m_block"
    combine: Optional[Combine] = None
    alpha: object = None

    def tensors(self) -> dict:
        return slot_tensors(self.a, self.b, self.out, self.masked_m, self.a_scale, self.b_scale,
                            self.dst_signals, self.alpha, self.combine)


def slot_tensors(a, b, out, masked_m, a_scale, b_scale, signals, alpha, combine) -> dict:
    """A call's tensors by launch-slot name, the fused combine's routing
    only when there is one (absent ones read as None at launch)."""
    tensors = {"a": a, "b": b, "out": out, "masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale,
               "signals": signals, "alpha": alpha}
    if combine is not None:
        tensors.update(zip(ROUTING_SLOTS, tuple(combine)))
    return tensors


def _launch(plan, tensors: dict):
    """Launch a plan on this call's tensors: allocate ``out`` if the call
    passed none, give the kernel a TMA-ready a_scale, a claim counter for
    the dynamic order and its own dtype views; returns the call's result.
    On the tensors' GPU and its current torch stream, whatever the current
    device (TVM-FFI passes the first CUDA tensor's device's current stream)."""
    if plan.plain and tensors["out"] is not None:  # the common call: nothing to prepare
        plan.launch(tensors)
        return tensors["out"] if plan.layout is None else (tensors["out"], plan.layout)
    if tensors["out"] is None and not plan.routed:
        tensors["out"] = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=tensors["a"].device)
    if plan.copy_a_scale:
        tensors["a_scale"] = tma_ready_a_scale(tensors["a_scale"])
    if plan.counter_device is not None:
        tensors["counter"] = workspace.claim_counter(plan.counter_device)
    for name, dtype in plan.views:
        if tensors[name].dtype is not dtype:  # (the public dtypes include bytes: the compiled one's view)
            tensors[name] = tensors[name].view(dtype)
    plan.launch(tensors)
    if plan.routed:
        return tensors["combined"], tensors["err"]
    out = tensors["out"]
    return out if plan.layout is None else (out, plan.layout)


def _as_custom_op(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config, dst_signals,
                  stream, combine, alpha=None):
    """The call as torch.compile sees it: a ``torch.ops.flashgemm`` op
    (registered by ``torch_ops`` when the package is imported)."""
    eager_only = {"config": config, "dst_signals": dst_signals, "stream": stream, "combine": combine,
                  "alpha": alpha}
    given = [name for name, value in eager_only.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} cannot be traced by torch.compile; call "
                         "grouped_gemm_nt_masked outside the compiled region for them")
    if out is None:
        return torch.ops.flashgemm.grouped_gemm_nt_masked(a, b, masked_m, a_scale, b_scale, expected_m, num_sms)
    torch.ops.flashgemm.grouped_gemm_nt_masked_out(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms)
    return out


def _check_stream(stream, a) -> None:
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if isinstance(a, torch.Tensor) and a.device != stream.device:
        raise ValueError(f"stream is on {stream.device} but a is on {a.device}")


def _explain(refused: Exception, call: CallArgs):
    """Raise the full checks' error for these arguments (chained to the
    compiled function's ``refused``), or ``refused`` itself if they pass."""
    try:
        _make_plan(call)
    except (TypeError, ValueError) as clear:
        raise clear from refused
    raise refused


_PLANS = PlanCache()


def _make_plan(call: CallArgs):
    """Every check, in order; raises on bad input before anything launches:
    the arguments' metadata first (no GPU needed), then the device; then the
    backend of the GPU makes the plan."""
    a, b, out, masked_m, a_scale, b_scale = call.a, call.b, call.out, call.masked_m, call.a_scale, call.b_scale
    combine, dst_signals, alpha = call.combine, call.dst_signals, call.alpha
    fmt = infer_format(a, a_scale, b)
    if fmt.block_scaled:
        sizes = validate_blockscaled_args(fmt, a, b, out, masked_m, a_scale, b_scale, alpha)
    elif fmt.converts_weights:
        sizes = validate_mxfp4_weight_args(a, b, out, masked_m, a_scale, b_scale, fmt)
        check_alpha(fmt, alpha, sizes[0])
    else:
        sizes = validate_args(a, b, out, masked_m, a_scale, b_scale)
        check_alpha(fmt, alpha, sizes[0])  # (after a's checks: an alpha may mean a's dtype is the mistake)
    e_count, max_m, n, k = sizes
    routing = ()
    if combine is not None and fmt.block_scaled:
        raise ValueError(f"combine takes bf16 or 1x128 fp8 operands on sm_90, not {fmt.value}")
    if combine is not None:
        routing = check_combine(combine, out, dst_signals, e_count, max_m, n,
                                {"a": a, "b": b, "masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale})
    # the other arguments' metadata, still before the device
    check_options(fmt, call.config, call.expected_m, call.num_sms, signals=dst_signals is not None,
                  combine=combine is not None)
    check_granularity(call.signal_granularity)
    tensors = {"a": a, "b": b, "out": out, "masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale,
               "alpha": alpha}
    if dst_signals is not None:
        check_signal_buffer(dst_signals, e_count)
        check_no_alias("dst_signals", byte_span(dst_signals), tensors)
    index = a.device.index if a.device.type == "cuda" else None
    if index is not None:
        capability, sm_count, name = device_facts(index)
    else:  # validate_device rejects the non-CUDA tensor
        capability, sm_count, name = (0, 0), 0, ""
    grid_cap = validate_device({**tensors, "dst_signals": dst_signals, **dict(zip(COMBINE_FIELDS, routing))},
                               call.num_sms, capability, sm_count, name)
    # validate_device refused GPUs without a backend (no GPU: the compile target's, for CPU-driven checks)
    be = backends.for_capability(capability) or backends.for_arch(default_arch())
    backends.check_format(be, fmt)
    if combine is not None and combine_epilogue(combine) not in be.epilogues:
        with_bias = ", combine.bias with it" if combine.bias is not None else ""
        raise ValueError(f"combine is available on sm_90 only{with_bias}; this GPU's kernels are {be.name}'s")
    return be.make_plan(backends.GemmCall(
        fmt=fmt, sizes=sizes, tensors={**tensors, "signals": dst_signals}, routing=routing, combine=combine,
        expected_m=call.expected_m, config=call.config, granularity=call.signal_granularity,
        grid_cap=grid_cap, device_index=index))
