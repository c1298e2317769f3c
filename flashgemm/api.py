"""The public op: pick a configuration and launch, after the checks of
``validation`` (run once per argument signature; the address checks on every call).
The arch package that serves the GPU (``jit.arch.BACKENDS``) supplies the
heuristic, the configuration rules and the kernels.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from .blockscaled_args import check_alpha, format_of, infer_format, validate_blockscaled_args
from .formats import Format, check_format_on
from .jit.arch import backend_name, default_arch, device_facts
from .config import Epilogue, GemmConfig, KernelSpec
from .signals import SignalLayout, check_granularity, check_signal_buffer, make_signal_layout, validate_signals
from .sm90.heuristic import choose_config
from .routing import COMBINE_FIELDS, Combine, check_combine, combine_epilogue
from .validation import (
    _FP8,
    _TMA_ALIGN,
    _byte_span,
    _span,
    check_expected_m,
    check_no_alias,
    check_num_sms,
    check_options,
    check_problem_sizes,
    check_tail_with_signals,
    out_dtype,
    tma_ready_a_scale,
    validate_args,
    validate_device,
    validated_config,
)
from . import workspace


def _target_capability() -> tuple[int, int]:
    """The compute capability of the compile target (``jit.arch.default_arch``:
    $CUTE_DSL_ARCH, else sm_90a without a GPU), e.g. "sm_100a" -> (10, 0)."""
    match = re.fullmatch(r"sm_(\d+)(\d)a?", default_arch())
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _resolve_config(
    config, expected_m, max_m, n, k, grid_cap, fp8=False, num_experts=None, signals=False, combine=False
) -> GemmConfig:
    check_expected_m(expected_m)
    if config is None:
        return choose_config(expected_m, max_m, n, k, grid_cap, fp8, num_experts, signals, combine)
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a flashgemm.GemmConfig, got {type(config).__name__}")
    return validated_config(config, Format.FP8_BLOCK128 if fp8 else Format.BF16,
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
        # nothing to ask: the SM count is given, the arch is the compile target's
        capability, grid_cap = _target_capability(), num_sms
    else:
        if device is None:
            if not torch.cuda.is_available():
                raise ValueError("signal_layout needs a CUDA device, or num_sms (pass device=... or num_sms=...)")
            device = torch.device("cuda", torch.cuda.current_device())
        index = torch.cuda.current_device() if device.index is None else device.index
        capability, sm_count, _ = device_facts(index)
        grid_cap = check_num_sms(num_sms, sm_count, device)
    backend = backend_name(capability)
    if backend is not None:
        check_format_on(fmt, backend)
    if backend is not None and backend != "sm90":
        from .sm100.launch import sm100_signal_layout

        return sm100_signal_layout(fmt, num_experts, max_m, n, k, expected_m, grid_cap, config, signal_granularity)
    cfg = _resolve_config(config, expected_m, max_m, n, k, grid_cap, fmt is Format.FP8_BLOCK128, num_experts,
                          signals=True)
    return make_signal_layout(signal_granularity, max_m, n, cfg.tile_m, cfg.tile_n, num_experts)


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

    Blackwell (sm_100 / sm_103) also takes MXFP8 (a, b float8_e4m3fn with
    float8_e8m0fnu or uint8 scales, one per 32 of K) and NVFP4 (a [E, max_m, K/2],
    b [E, N, K/2] packed e2m1 as uint8 or float4_e2m1fn_x2, float8_e4m3fn
    scales, one per 16 of K, and ``alpha``: float32 [E] = 1 / (g_a * g_b),
    required). Their scales are in the 128x4-atom layout of
    ``blockscale.to_blocked_scales``: a_scale (E, ceil(max_m/128),
    ceil(K/vec/4), 32, 4, 4) and b_scale with N for max_m, contiguous. The
    format follows from the dtypes (``flashgemm.blockscaled_args``); on
    Hopper these formats raise ValueError before any launch.

    expected_m: mean valid rows per expert (host hint for the configuration).
    num_sms: cap on the persistent grid, e.g. to leave SMs to a concurrent kernel.
    config: a :class:`GemmConfig` that overrides the heuristic.
    dst_signals: int32 counters, zeroed by the caller, that receive a release
    add per finished tile (see ``flashgemm.signals``); ``signal_granularity``
    is "m_block" or "expert". With signals the call returns ``(out, layout)``,
    the :class:`SignalLayout` used (the same ``signal_layout(...)`` gives
    before the launch); without, it returns ``out``.
    combine: a :class:`Combine` (token_index, weight, output, err, peers): instead of
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
    flags a destination outside [0, W * R).
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
        return _combine_call(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config,
                             dst_signals, signal_granularity, combine)
    try:
        # The launch plan for this signature: what the checks depend on that the
        # compiled function does not check itself. Its TVM-FFI wrapper refuses,
        # before launching, any dtype other than the compiled ones, shapes not
        # tied to a's (E, max_m, K) and b's N (out, masked_m, a_scale's E and
        # max_m), inner strides other than 1, and unaligned strides or bases.
        # It takes uint32 for int32, so those two dtypes are keyed, and every
        # tensor's device is keyed, so a plan never serves tensors on another GPU.
        key = (
            a.dtype, a.shape, a.stride(), a.get_device(), b.shape, b.stride(), masked_m.dtype,
            b.get_device(), masked_m.get_device(), None if out is None else out.get_device(),
            None if a_scale is None else a_scale.get_device(),
            None if b_scale is None else b_scale.get_device(),
            None if dst_signals is None else dst_signals.get_device(),
            None if out is None else out.stride(),
            None if a_scale is None else (a_scale.shape, a_scale.stride()),
            None if b_scale is None else (b_scale.shape, b_scale.stride()),
            None if dst_signals is None else (dst_signals.dtype, dst_signals.shape),
            expected_m, type(expected_m), num_sms, type(num_sms), config, signal_granularity,
            None if alpha is None else (alpha.dtype, alpha.shape, alpha.stride(), alpha.get_device()),
        )
        # an sm100 plan takes alpha where a combine's plan takes its routing tensors
        extra = () if alpha is None else (alpha,)
        plan = _PLANS.get(key)
        if plan is not None and not plan.pointers_ok(a, b, masked_m, out, a_scale, b_scale, dst_signals, extra):
            plan = None
    except (AttributeError, TypeError, RuntimeError):
        # not tensors, unhashable, or without strides (sparse): the full checks explain
        key, plan = None, None
    if plan is not None:
        try:
            return plan.launch(a, b, out, masked_m, a_scale, b_scale, dst_signals, extra)
        except Exception as refused:  # noqa: BLE001 - re-raised below unless a clearer error exists
            # The compiled function's own checks refused an argument the key
            # does not cover (say masked_m of another dtype, or out of another
            # shape) before launching: every check below names the argument.
            _explain(refused, a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config,
                     dst_signals, signal_granularity, None, alpha)
    plan = _make_plan(
        a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config, dst_signals, signal_granularity,
        None, alpha,
    )
    _remember(key, plan)
    return plan.launch(a, b, out, masked_m, a_scale, b_scale, dst_signals, () if alpha is None else (alpha,))


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


def _combine_call(a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config, dst_signals,
                  signal_granularity, combine):
    """``grouped_gemm_nt_masked`` with ``combine``: its own plans, keyed also
    by the routing tensors; a missing error word is allocated zeroed."""
    if isinstance(combine, Combine) and combine.err is None and isinstance(a, torch.Tensor):
        combine = combine._replace(err=torch.zeros(1, dtype=torch.int32, device=a.device))
    args = (a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config, dst_signals,
            signal_granularity, combine)
    try:
        routing = tuple(combine)
        key = ("combine", a.dtype, a.shape, a.stride(), a.get_device(), b.shape, b.stride(),
               b.get_device(), masked_m.dtype, masked_m.get_device(), out is None, dst_signals is None,
               None if a_scale is None else (a_scale.shape, a_scale.stride(), a_scale.get_device()),
               None if b_scale is None else (b_scale.shape, b_scale.stride(), b_scale.get_device()),
               tuple(None if t is None else (t.dtype, t.shape, t.stride(), t.get_device()) for t in routing),
               expected_m, type(expected_m), num_sms, type(num_sms), config)
        plan = _PLANS.get(key)
        if plan is not None and not plan.pointers_ok(a, b, masked_m, out, a_scale, b_scale, dst_signals,
                                                     routing):
            plan = None
    except (AttributeError, TypeError, RuntimeError):  # as in grouped_gemm_nt_masked
        key, plan = None, None
    if plan is not None:
        try:
            return plan.launch(a, b, out, masked_m, a_scale, b_scale, dst_signals, routing)
        except Exception as refused:  # noqa: BLE001 - as in grouped_gemm_nt_masked
            _explain(refused, *args)
    plan = _make_plan(*args)
    _remember(key, plan)
    return plan.launch(a, b, out, masked_m, a_scale, b_scale, dst_signals, tuple(combine))


def _check_stream(stream, a) -> None:
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if isinstance(a, torch.Tensor) and a.device != stream.device:
        raise ValueError(f"stream is on {stream.device} but a is on {a.device}")


def _explain(refused: Exception, *args):
    """Raise the full checks' error for these arguments (chained to the
    compiled function's ``refused``), or ``refused`` itself if they pass."""
    try:
        _make_plan(*args)
    except (TypeError, ValueError) as clear:
        raise clear from refused
    raise refused


_PLANS: dict = {}
_MAX_PLANS = 4096
_NO_ROUTING = (None,) * 5  # token_index, weight, output, err, peers of a call without combine


def _remember(key, plan) -> None:
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan


class _LaunchPlan:
    """What the full checks derived for one argument signature: the compiled
    kernel, grid, signal layout, and the byte extents for the pointer checks
    that must run on every call (alignment and aliasing depend on addresses)."""

    __slots__ = (
        "fn", "num_ctas", "layout", "out_shape", "out_dtype", "copy_a_scale",
        "aligned", "written", "extents", "last_ok", "counter_device",
    )

    def __init__(self, **kw):
        self.last_ok = None
        for name, value in kw.items():
            setattr(self, name, value)

    def pointers_ok(self, a, b, masked_m, out, a_scale, b_scale, dst_signals, routing=()) -> bool:
        """The address-dependent checks of ``validate_args`` (alignment, no
        aliasing of what the kernel writes); False sends the call through the
        full checks, which name the problem. Absent tensors are None, as when
        the plan was made (the signature key says which are present)."""
        # (written for the interpreter: 0.4 us per call for four tensors when
        # the addresses are those of the last call that passed, on the
        # development CPU; a comprehension over all seven took 0.6)
        ptrs = [a.data_ptr(), b.data_ptr(), masked_m.data_ptr()]
        if out is not None:
            ptrs.append(out.data_ptr())
        if a_scale is not None:
            ptrs.append(a_scale.data_ptr())
        if b_scale is not None:
            ptrs.append(b_scale.data_ptr())
        if dst_signals is not None:
            ptrs.append(dst_signals.data_ptr())
        for t in routing:
            if t is not None:  # (peers, without expert parallelism)
                ptrs.append(t.data_ptr())
        if ptrs == self.last_ok:
            return True
        extents = self.extents
        bits = 0
        for i in self.aligned:
            bits |= ptrs[i]
        if bits % _TMA_ALIGN:
            return False
        for w in self.written:
            lo = ptrs[w]
            hi = lo + extents[w]
            j = 0
            for p in ptrs:
                if j != w and p < hi and lo < p + extents[j]:
                    return False
                j += 1
        self.last_ok = ptrs
        return True

    def launch(self, a, b, out, masked_m, a_scale, b_scale, dst_signals, routing=()):
        """``routing``: the combine's five fields (the call then has no out)."""
        if out is None and not routing:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=a.device)
        if self.copy_a_scale:
            a_scale = tma_ready_a_scale(a_scale)
        # On the tensors' GPU and its current torch stream, whatever the current
        # device: tvm_ffi passes the current stream of the first CUDA tensor's
        # device, and the compiled function switches to that device around the
        # launch. (Checking the current device here cost 0.6 us per call on the
        # H100 machine's CPU.)
        self.fn(
            a, b, out, masked_m, dst_signals, a_scale, b_scale,
            None if self.counter_device is None else workspace.claim_counter(self.counter_device),
            *(routing or _NO_ROUTING), None, self.num_ctas,
        )
        if routing:
            return routing[2], routing[3]  # (output, err)
        return out if self.layout is None else (out, self.layout)


def _extent(t) -> int:
    return 0 if t is None else _span(0, t.shape, t.stride(), t.element_size())[1]


def _make_plan(
    a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config, dst_signals, signal_granularity,
    combine=None, alpha=None,
):
    """Every check, in order; raises on bad input before anything launches:
    the arguments' metadata first (no GPU needed), then the device."""
    fmt = infer_format(a, a_scale)
    if fmt.block_scaled:
        sizes = validate_blockscaled_args(fmt, a, b, out, masked_m, a_scale, b_scale, alpha)
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
    check_options(fmt, config, expected_m, num_sms, signals=dst_signals is not None, combine=combine is not None)
    check_granularity(signal_granularity)
    tensors = {"a": a, "b": b, "out": out, "masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale,
               "alpha": alpha}
    if dst_signals is not None:
        check_signal_buffer(dst_signals, e_count)
        check_no_alias("dst_signals", _byte_span(dst_signals), tensors)
    fp8 = a.dtype == _FP8
    index = a.device.index if a.device.type == "cuda" else None
    if index is not None:
        capability, sm_count, name = device_facts(index)
    else:  # validate_device rejects the non-CUDA tensor
        capability, sm_count, name = (0, 0), 0, ""
    grid_cap = validate_device({**tensors, "dst_signals": dst_signals, **dict(zip(COMBINE_FIELDS, routing))},
                               num_sms, capability, sm_count, name)
    backend = backend_name(capability) or "sm90"  # (validate_device refused GPUs without one)
    check_format_on(fmt, backend)
    if backend != "sm90":
        if combine is not None:
            raise ValueError(f"combine is available on sm_90 only; this GPU's kernels are {backend}'s")
        from .sm100.launch import make_plan

        return make_plan(fmt, sizes, a, b, out, masked_m, a_scale, b_scale, alpha, expected_m, config,
                         dst_signals, signal_granularity, grid_cap)
    config = _resolve_config(
        config, expected_m, max_m, n, k, grid_cap, fp8, e_count, signals=dst_signals is not None,
        combine=combine is not None,
    )
    epilogue = Epilogue.STORE if combine is None else combine_epilogue(combine)
    cn = config.cluster_n
    if grid_cap < cn:
        raise ValueError(f"config.cluster_n={cn} needs num_sms >= {cn}, got {grid_cap}")
    layout = None
    check_tail_with_signals(config, dst_signals is not None)  # (the heuristic's pick too)
    if dst_signals is not None:
        layout = make_signal_layout(signal_granularity, max_m, n, config.tile_m, config.tile_n, e_count)
        validate_signals(dst_signals, layout, a.device)

    # Persistent grid: never more clusters than units of work could use.
    num_ctas = cn * config.grid_clusters(e_count, max_m, n, grid_cap)

    from .sm90.build import get_kernel

    mode = layout.granularity if layout is not None else None
    d_dtype = out_dtype(a.dtype)
    copy_a_scale = fp8 and tma_ready_a_scale(a_scale, check_only=True)
    fn = get_kernel(KernelSpec(config, Format.FP8_BLOCK128 if fp8 else Format.BF16, mode, epilogue))
    if config.dynamic and index is not None:
        workspace.prepare_graph_counters(index)
    return _LaunchPlan(
        # call the TVM-FFI function itself, not the DSL's Python wrapper around it
        fn=getattr(fn, "__tvm_ffi_object__", lambda: None)() or fn,
        num_ctas=num_ctas,
        layout=layout,
        out_shape=(e_count, max_m, n),
        out_dtype=d_dtype,
        copy_a_scale=copy_a_scale,
        counter_device=index if config.dynamic else None,
        **_pointer_rules((a, b, masked_m, out, a_scale, b_scale, dst_signals, *routing), copy_a_scale),
    )


def _pointer_rules(tensors, copy_a_scale: bool) -> dict:
    """Which of (a, b, masked_m, out, a_scale, b_scale, dst_signals, and the
    combine's token_index, weight, output, err, peers) are present, which must
    be 16-byte aligned, which are written (peers only addresses the buffers
    written)."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    pos = {i: n for n, i in enumerate(present)}
    aligned = [pos[i] for i in (0, 1, 3, 9) if i in pos]  # TMA bases; the combine's 16-byte reductions
    if not copy_a_scale and 4 in pos:
        aligned.append(pos[4])
    return dict(
        aligned=tuple(aligned),
        written=tuple(pos[i] for i in (3, 6, 9, 10) if i in pos),
        extents=tuple(_extent(tensors[i]) for i in present),
    )
