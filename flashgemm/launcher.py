"""The public op: validate torch tensors, pick a configuration, launch.

Every check runs on the host before the launch and reads only metadata
(shapes, strides, pointers, device): masked_m's *contents* are never read on
the host, so the call stays sync-free and CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from .config import GemmConfig, choose_config
from .signals import SignalLayout, check_granularity, make_signal_layout, validate_signals

_AB_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
_FP8 = torch.float8_e4m3fn
_SCALE_BLOCK = 128  # 1x128 activation / 128x128 weight scale blocks
_TMA_ALIGN = 16  # bytes: TMA base address and stride granularity
_MAX_DIM = 2**31 - 1  # extents are int32 in the kernel


def _check_tensor(name: str, t, rank: int, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")


def _check_tma_operand(name: str, t: torch.Tensor, inner: str, is_input: bool = True) -> tuple[int, int]:
    """Inner dim contiguous, outer strides and base 16-byte aligned.

    Returns the tensor's byte span [start, end) for the aliasing checks.
    (Each torch accessor costs ~0.3 us on the host: read each once.)"""
    stride = t.stride()
    shape = t.shape
    es = t.element_size()
    if stride[2] != 1:
        raise ValueError(
            f"{name} must be contiguous along {inner} (stride 1), got strides {tuple(stride)}"
        )
    for dim in (0, 1):
        if is_input and stride[dim] == 0 and shape[dim] > 1:
            # broadcast views: we build no TMA descriptors with zero strides
            # (out gets the self-overlap check instead)
            raise ValueError(f"{name}.stride({dim}) is 0 (a broadcast view); pass a materialized tensor")
        if (stride[dim] * es) % _TMA_ALIGN:
            raise ValueError(
                f"{name}.stride({dim}) = {stride[dim]} elements is not a multiple of "
                f"{_TMA_ALIGN} bytes (TMA requirement)"
            )
    ptr = t.data_ptr()
    if ptr % _TMA_ALIGN:
        raise ValueError(f"{name} base address must be {_TMA_ALIGN}-byte aligned")
    for dim in (0, 1, 2):
        if shape[dim] > _MAX_DIM:
            raise ValueError(f"{name}.shape[{dim}] = {shape[dim]} exceeds {_MAX_DIM}")
    return _span(ptr, shape, stride, es)


def _check_no_self_overlap(name: str, t: torch.Tensor) -> None:
    """Distinct elements at distinct addresses (out is written concurrently).

    Sufficient test for any dim order: sorted by stride, each stride reaches
    past the whole extent of the dims inside it (permuted layouts pass)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    extent = 1
    for st, sz in dims:
        if st < extent:
            raise ValueError(
                f"{name} must not overlap itself in memory (strides {tuple(t.stride())} "
                f"for shape {tuple(t.shape)})"
            )
        extent = st * sz


def _span_1d(t: torch.Tensor) -> tuple[int, int]:
    ptr = t.data_ptr()
    return ptr, ptr + ((t.shape[0] - 1) * t.stride(0) + 1) * t.element_size()


def _span(ptr: int, shape, stride, element_size: int) -> tuple[int, int]:
    last = sum((size - 1) * st for size, st in zip(shape, stride))
    return ptr, ptr + (last + 1) * element_size


def _byte_span_3d(t: torch.Tensor) -> tuple[int, int]:
    return _span(t.data_ptr(), t.shape, t.stride(), t.element_size())


def _overlaps(x: tuple[int, int], y: tuple[int, int]) -> bool:
    return x[0] < y[1] and y[0] < x[1]


def _check_scales(a, b, a_scale, b_scale, e_count, max_m, n, k) -> None:
    """fp8 operands come with both scale tensors, 16-bit operands with none."""
    fp8 = a.dtype == _FP8
    if not fp8:
        for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
            if t is not None:
                raise ValueError(f"{name} is only for float8_e4m3fn operands; a and b are {a.dtype}")
        return
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if t is None:
            raise ValueError(f"float8_e4m3fn operands need {name} (block-scaled fp8); got None")
    _check_tensor("a_scale", a_scale, 3, (torch.float32,))
    _check_tensor("b_scale", b_scale, 3, (torch.float32,))
    k_blocks = -(-k // _SCALE_BLOCK)
    want_a = (e_count, max_m, k_blocks)
    if tuple(a_scale.shape) != want_a:
        raise ValueError(
            f"a_scale must have shape (E, max_m, ceil(K/128)) = {want_a}, got {tuple(a_scale.shape)}"
        )
    want_b = (e_count, -(-n // _SCALE_BLOCK), k_blocks)
    if tuple(b_scale.shape) != want_b:
        raise ValueError(
            f"b_scale must have shape (E, ceil(N/128), ceil(K/128)) = {want_b}, got {tuple(b_scale.shape)}"
        )
    st = a_scale.stride()
    if st[1] != 1 and st[2] != 1:
        raise ValueError(
            "a_scale must be contiguous along M (stride(1) == 1, the TMA layout) or along "
            f"the K blocks (stride(2) == 1), got strides {tuple(st)}"
        )


def tma_ready_a_scale(a_scale: torch.Tensor, check_only: bool = False):
    """``a_scale`` itself when the kernel can TMA-load it (M contiguous, other
    strides and the base 16-byte aligned), else a copy in that layout (one
    small extra kernel per call: the slower path). ``check_only``: just say
    whether a copy is needed."""
    st = a_scale.stride()
    in_place = st[1] == 1 and st[0] % 4 == 0 and st[2] % 4 == 0 and a_scale.data_ptr() % _TMA_ALIGN == 0
    if check_only:
        return not in_place
    if in_place:
        return a_scale
    e_count, max_m, k_blocks = a_scale.shape
    m_pad = -(-max_m // 4) * 4
    tma = torch.empty((e_count, k_blocks, m_pad), dtype=torch.float32, device=a_scale.device)
    tma = tma.transpose(1, 2)[:, :max_m]
    tma.copy_(a_scale)
    return tma


def validate_args(a, b, out, masked_m, a_scale=None, b_scale=None) -> tuple[int, int, int, int]:
    """Shape, dtype, stride and aliasing checks. Returns (E, max_m, N, K)."""
    _check_tensor("a", a, 3, _AB_DTYPES)
    if isinstance(b, torch.Tensor) and b.dtype != a.dtype and b.dtype in _AB_DTYPES:
        raise TypeError(f"a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    _check_tensor("b", b, 3, (a.dtype,))
    _check_tensor("masked_m", masked_m, 1, (torch.int32,))
    e_count, max_m, k = a.shape
    b_e, n, b_k = b.shape
    if e_count < 1:
        raise ValueError(f"a must hold at least one expert, got shape {tuple(a.shape)}")
    if max_m < 1:
        raise ValueError(f"a.shape[1] (max_m) must be >= 1, got {max_m}")
    if b_e != e_count:
        raise ValueError(f"b.shape[0] must equal the expert count E={e_count} of a, got {b_e}")
    if b_k != k:
        raise ValueError(f"b.shape[2] must equal K={k} of a, got {b_k}")
    # 16-byte TMA rows: K % 8 for 16-bit operands, K % 16 for fp8 (N likewise,
    # for the fp8 weight rows' own 16-byte rule)
    mult = 16 if a.dtype == _FP8 else 8
    if k < mult or k % mult:
        raise ValueError(f"K (a.shape[2]) must be a positive multiple of {mult}, got {k}")
    if n < mult or n % mult:
        raise ValueError(f"N (b.shape[1]) must be a positive multiple of {mult}, got {n}")
    if masked_m.shape[0] != e_count:
        raise ValueError(f"masked_m must have E={e_count} entries, got {masked_m.shape[0]}")
    if masked_m.stride(0) != 1 and e_count > 1:
        raise ValueError(f"masked_m must be contiguous, got stride {masked_m.stride(0)}")
    _check_scales(a, b, a_scale, b_scale, e_count, max_m, n, k)
    if out is not None:
        _check_tensor("out", out, 3, (out_dtype(a.dtype),))
        if tuple(out.shape) != (e_count, max_m, n):
            raise ValueError(
                f"out must have shape (E, max_m, N) = {(e_count, max_m, n)}, got {tuple(out.shape)}"
            )
    span_a = _check_tma_operand("a", a, "K")
    span_b = _check_tma_operand("b", b, "K")
    if out is not None:
        span_out = _check_tma_operand("out", out, "N", is_input=False)
        _check_no_self_overlap("out", out)
        others = [("a", span_a), ("b", span_b), ("masked_m", _span_1d(masked_m))]
        for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
            if t is not None:
                others.append((name, _byte_span_3d(t)))
        for other_name, span in others:
            if _overlaps(span_out, span):
                raise ValueError(f"out must not overlap {other_name} in memory")
    return e_count, max_m, n, k


def out_dtype(ab_dtype: torch.dtype) -> torch.dtype:
    """fp8 products are written as bf16; 16-bit ones in their own dtype."""
    return torch.bfloat16 if ab_dtype == _FP8 else ab_dtype


def validate_device(
    tensors: dict, num_sms: Optional[int], capability: tuple[int, int], sm_count: int, name: str = ""
) -> int:
    """Device checks from given device facts (pure, so CPU tests can drive it).

    ``tensors`` maps argument names to tensors that must share one CUDA device.
    Returns the persistent-grid cap.
    """
    devices = {}
    for arg, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{arg} must be on a CUDA device, got {t.device}")
        devices[arg] = t.device
    first_arg, first = next(iter(devices.items()))
    for arg, dev in devices.items():
        if dev != first:
            raise ValueError(f"{arg} is on {dev} but {first_arg} is on {first}; all must share one device")
    if tuple(capability) != (9, 0):
        raise ValueError(
            f"flashgemm's kernels need an sm_90 (Hopper) GPU; {first} is "
            f"{name + ' ' if name else ''}sm_{capability[0]}{capability[1]}"
        )
    if num_sms is None:
        return sm_count
    if isinstance(num_sms, bool) or not isinstance(num_sms, int):
        raise TypeError(f"num_sms must be an int, got {type(num_sms).__name__}")
    if not 1 <= num_sms <= sm_count:
        raise ValueError(f"num_sms must be in [1, {sm_count}] on {first}, got {num_sms}")
    return num_sms


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[tuple[int, int], int, str]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count, props.name


@functools.lru_cache(maxsize=64)
def _validated(config: GemmConfig, elem_bytes: int) -> GemmConfig:
    # configs are frozen: validate each one once per process
    return config.validate(elem_bytes, 2)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", _FP8: "fp8e4m3"}


@functools.lru_cache(maxsize=None)
def _unused_signals(index: int) -> torch.Tensor:
    # the compiled signature always takes a counter tensor; without signals
    # the kernel never touches this one
    return torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", index))


def _resolve_config(config, expected_m, max_m, n, k, grid_cap, fp8=False) -> GemmConfig:
    if expected_m is not None:
        if isinstance(expected_m, bool) or not isinstance(expected_m, int):
            raise TypeError(f"expected_m must be an int or None, got {type(expected_m).__name__}")
        if expected_m < 0:
            raise ValueError(f"expected_m must be >= 0, got {expected_m}")
    if config is None:
        return choose_config(expected_m, max_m, n, k, grid_cap, fp8)
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a flashgemm.GemmConfig, got {type(config).__name__}")
    return _validated(config, 1 if fp8 else 2)


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
) -> SignalLayout:
    """The signal layout a call with these arguments will use, known before launch
    (so a combine kernel can be set up first). ``num_sms`` as passed to the call;
    ``fp8`` for float8_e4m3fn operands."""
    cfg = _resolve_config(config, expected_m, max_m, n, k, num_sms if num_sms else 1 << 30, fp8)
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
):
    """``out[e, :m_e] = a[e, :m_e] @ b[e].T`` for every expert, m_e = clamp(masked_m[e], 0, max_m).

    a: [E, max_m, K] bf16, K contiguous. b: [E, N, K] bf16, K contiguous.
    out: [E, max_m, N] bf16, N contiguous, or None to allocate (rows >= m_e of a
    fresh tensor are uninitialized). masked_m: int32 [E] on the same GPU, read
    only by the kernel. Rows ``out[e, m_e:]`` and all memory outside ``out``
    are never written. Runs on the current torch stream; no host sync.

    Block-scaled fp8 (DeepSeek-V3 recipe): a and b float8_e4m3fn (K and N
    multiples of 16), out bf16, with a_scale float32 [E, max_m, ceil(K/128)]
    (one scale per row and 128-wide K block) and b_scale float32
    [E, ceil(N/128), ceil(K/128)] (one per 128x128 block):
    ``out[e, i, n] = sum_kb a_scale[e, i, kb] * b_scale[e, n // 128, kb] *
    (a[e, i, kb-block] . b[e, n, kb-block])``. An a_scale that is M contiguous
    with 16-byte-aligned strides (``quant.quantize_fp8_per_token``'s default,
    what a low-latency dispatch writes) is read in place; a K-block-contiguous
    one is first copied into that layout (an extra small kernel per call).

    expected_m: mean valid rows per expert (host hint for the configuration).
    num_sms: cap on the persistent grid, e.g. to leave SMs to a concurrent kernel.
    config: a :class:`GemmConfig` that overrides the heuristic.
    dst_signals: int32 counters, zeroed by the caller, that receive a release
    add per finished tile (see ``flashgemm.signals``); ``signal_granularity``
    is "m_block" or "expert". With signals the call returns ``(out, layout)``,
    the :class:`SignalLayout` used (the same ``signal_layout(...)`` gives
    before the launch); without, it returns ``out``.
    """
    try:
        # Everything the checks below depend on except the pointers: the same
        # signature again (the serving steady state) skips straight to the
        # pointer checks and the launch (~15 us of host time saved per call).
        # (one flat expression: ~1.8 us, a helper call per tensor costs 1 us more)
        key = (
            a.dtype, a.shape, a.stride(), a.get_device(),
            b.dtype, b.shape, b.stride(), b.get_device(),
            masked_m.dtype, masked_m.shape, masked_m.stride(), masked_m.get_device(),
            None if out is None else (out.dtype, out.shape, out.stride(), out.get_device()),
            None if a_scale is None else (a_scale.dtype, a_scale.shape, a_scale.stride(), a_scale.get_device()),
            None if b_scale is None else (b_scale.dtype, b_scale.shape, b_scale.stride(), b_scale.get_device()),
            None if dst_signals is None else (
                dst_signals.dtype, dst_signals.shape, dst_signals.stride(), dst_signals.get_device()
            ),
            expected_m, type(expected_m), num_sms, type(num_sms), config, signal_granularity,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, unhashable: the full checks explain
        key, plan = None, None
    if plan is None or not plan.pointers_ok((a, b, masked_m, out, a_scale, b_scale, dst_signals)):
        plan = _make_plan(
            a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config,
            dst_signals, signal_granularity,
        )
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan.launch(a, b, out, masked_m, a_scale, b_scale, dst_signals)


_PLANS: dict = {}
_MAX_PLANS = 4096


class _LaunchPlan:
    """What the full checks derived for one argument signature: the compiled
    kernel, grid, signal layout, and the byte extents for the pointer checks
    that must run on every call (alignment and aliasing depend on addresses)."""

    __slots__ = (
        "fn", "num_ctas", "layout", "index", "out_shape", "out_dtype", "copy_a_scale",
        "present", "aligned", "written", "extents", "unused_signals", "last_ok",
    )

    def __init__(self, **kw):
        self.last_ok = None
        for name, value in kw.items():
            setattr(self, name, value)

    def pointers_ok(self, tensors) -> bool:
        """The address-dependent checks of ``validate_args`` (alignment, no
        aliasing of what the kernel writes); False sends the call through the
        full checks, which name the problem. ``tensors``: (a, b, masked_m, out,
        a_scale, b_scale, dst_signals), None where absent."""
        # (written for the interpreter: ~1 us per call for four tensors, 0.5 us
        # when the addresses are those of the last call that passed)
        ptrs = [tensors[i].data_ptr() for i in self.present]
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

    def launch(self, a, b, out, masked_m, a_scale, b_scale, dst_signals):
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=a.device)
        if self.copy_a_scale:
            a_scale = tma_ready_a_scale(a_scale)
        signals = dst_signals if dst_signals is not None else self.unused_signals
        if self.index == _current_device():
            self.fn(a, b, out, masked_m, signals, a_scale, b_scale, self.num_ctas)
        else:
            # launch on the tensors' GPU and its current stream, not the caller's device
            with torch.cuda.device(self.index):
                self.fn(a, b, out, masked_m, signals, a_scale, b_scale, self.num_ctas)
        return out if self.layout is None else (out, self.layout)


# torch.cuda.current_device() without its lazy-init check (0.3 us -> 0.1 us);
# the plan exists only after a launch-ready CUDA context was seen
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _extent(t) -> int:
    return 0 if t is None else _span(0, t.shape, t.stride(), t.element_size())[1]


def _make_plan(
    a, b, out, masked_m, a_scale, b_scale, expected_m, num_sms, config, dst_signals, signal_granularity
) -> _LaunchPlan:
    """Every check, in order; raises on bad input before anything launches."""
    e_count, max_m, n, k = validate_args(a, b, out, masked_m, a_scale, b_scale)
    fp8 = a.dtype == _FP8
    index = a.device.index if a.device.type == "cuda" else None
    if index is not None:
        capability, sm_count, name = _device_facts(index)
    else:  # validate_device rejects the non-CUDA tensor
        capability, sm_count, name = (0, 0), 0, ""
    grid_cap = validate_device(
        {"a": a, "b": b, "out": out, "masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale},
        num_sms, capability, sm_count, name,
    )
    config = _resolve_config(config, expected_m, max_m, n, k, grid_cap, fp8)
    cn = config.cluster_n
    if grid_cap < cn:
        raise ValueError(f"config.cluster_n={cn} needs num_sms >= {cn}, got {grid_cap}")
    layout = None
    if dst_signals is not None:
        layout = make_signal_layout(signal_granularity, max_m, n, config.tile_m, config.tile_n, e_count)
        validate_signals(dst_signals, layout, a.device)
        span = _span_1d(dst_signals)
        others = {"a": a, "b": b, "out": out, "a_scale": a_scale, "b_scale": b_scale}
        for other_name, other in others.items():
            if other is not None and _overlaps(span, _byte_span_3d(other)):
                raise ValueError(f"dst_signals must not overlap {other_name} in memory")
        if _overlaps(span, _span_1d(masked_m)):
            raise ValueError("dst_signals must not overlap masked_m in memory")
    else:
        check_granularity(signal_granularity)

    # Persistent grid: never more clusters than units of work could use.
    n_groups = -(-(-(-n // config.tile_n)) // cn)  # ceil(ceil(N / tile_n) / cluster_n)
    max_units = e_count * -(-max_m // config.tile_m) * n_groups
    num_ctas = cn * max(1, min(grid_cap // cn, max_units))

    from .compile import get_kernel

    mode = layout.granularity if layout is not None else None
    d_dtype = out_dtype(a.dtype)
    copy_a_scale = fp8 and tma_ready_a_scale(a_scale, check_only=True)
    fn = get_kernel(config, _DTYPE_NAMES[a.dtype], _DTYPE_NAMES[d_dtype], signal_mode=mode)
    return _LaunchPlan(
        # call the TVM-FFI function itself, not the DSL's Python wrapper around it
        fn=getattr(fn, "__tvm_ffi_object__", lambda: None)() or fn,
        num_ctas=num_ctas,
        layout=layout,
        index=index,
        out_shape=(e_count, max_m, n),
        out_dtype=d_dtype,
        copy_a_scale=copy_a_scale,
        unused_signals=_unused_signals(index) if dst_signals is None else None,
        **_pointer_rules((a, b, masked_m, out, a_scale, b_scale, dst_signals), copy_a_scale),
    )


def _pointer_rules(tensors, copy_a_scale: bool) -> dict:
    """Which of (a, b, masked_m, out, a_scale, b_scale, dst_signals) are
    present, which must be 16-byte aligned (TMA bases), which are written."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    pos = {i: n for n, i in enumerate(present)}
    aligned = [pos[i] for i in (0, 1, 3) if i in pos]
    if not copy_a_scale and 4 in pos:
        aligned.append(pos[4])
    return dict(
        present=tuple(present),
        aligned=tuple(aligned),
        written=tuple(pos[i] for i in (3, 6) if i in pos),
        extents=tuple(_extent(tensors[i]) for i in present),
    )
