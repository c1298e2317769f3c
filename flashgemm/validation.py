"""Host-side argument checks of the public op, before anything is launched.

Every check reads only metadata (shapes, strides, dtypes, pointers, devices):
masked_m's *contents* are never read on the host, so a call stays sync-free
and CUDA-graph capturable. Each failure names the argument and what was
expected.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import GemmConfig, Tail
from .formats import Format
from .jit.arch import backend_name

_AB_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
FP8 = torch.float8_e4m3fn
_SCALE_BLOCK = 128  # 1x128 activation / 128x128 weight scale blocks
TMA_ALIGN = 16  # bytes: TMA base address and stride granularity
_MAX_DIM = 2**31 - 1  # extents are int32 in the kernel


def check_dense(name: str, t: torch.Tensor) -> None:
    """A strided tensor: sparse, nested and other layouts have no strides or
    base address for the checks to read (their accessors raise)."""
    if t.is_nested:
        raise ValueError(f"{name} must be a dense (strided) tensor, got a nested tensor")
    if t.layout is not torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def check_tensor(name: str, t, rank: int, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, t)
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
        if (stride[dim] * es) % TMA_ALIGN:
            raise ValueError(
                f"{name}.stride({dim}) = {stride[dim]} elements is not a multiple of "
                f"{TMA_ALIGN} bytes (TMA requirement)"
            )
    ptr = t.data_ptr()
    if ptr % TMA_ALIGN:
        raise ValueError(f"{name} base address must be {TMA_ALIGN}-byte aligned")
    for dim in (0, 1, 2):
        if shape[dim] > _MAX_DIM:
            raise ValueError(f"{name}.shape[{dim}] = {shape[dim]} exceeds {_MAX_DIM}")
    return span(ptr, shape, stride, es)


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


def span(ptr: int, shape, stride, element_size: int) -> tuple[int, int]:
    last = sum((size - 1) * st for size, st in zip(shape, stride))
    return ptr, ptr + (last + 1) * element_size


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that a tensor of any rank can touch."""
    return span(t.data_ptr(), t.shape, t.stride(), t.element_size())


def overlaps(x: tuple[int, int], y: tuple[int, int]) -> bool:
    return x[0] < y[1] and y[0] < x[1]


def check_no_alias(name: str, span: tuple[int, int], others: dict) -> None:
    """A tensor the kernel writes (byte span ``span``) shares no byte with any
    of ``others`` (argument name -> tensor, or -> span already computed; None
    entries are skipped)."""
    for other_name, other in others.items():
        if other is None:
            continue
        other_span = other if isinstance(other, tuple) else byte_span(other)
        if overlaps(span, other_span):
            raise ValueError(f"{name} must not overlap {other_name} in memory")


def _check_scales(a, b, a_scale, b_scale, e_count, max_m, n, k) -> None:
    """fp8 operands come with both scale tensors, 16-bit operands with none."""
    fp8 = a.dtype == FP8
    if not fp8:
        for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
            if t is not None:
                raise ValueError(f"{name} is only for float8_e4m3fn operands; a and b are {a.dtype}")
        return
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if t is None:
            raise ValueError(f"float8_e4m3fn operands need {name} (block-scaled fp8); got None")
    check_tensor("a_scale", a_scale, 3, (torch.float32,))
    check_tensor("b_scale", b_scale, 3, (torch.float32,))
    k_blocks = -(-k // _SCALE_BLOCK)
    check_a_scale_shape(a_scale, e_count, max_m, k)
    want_b = (e_count, -(-n // _SCALE_BLOCK), k_blocks)
    if tuple(b_scale.shape) != want_b:
        raise ValueError(
            f"b_scale must have shape (E, ceil(N/128), ceil(K/128)) = {want_b}, got {tuple(b_scale.shape)}"
        )
    if (k_blocks - 1) * b_scale.stride(2) >= 2**31:
        # the kernel steps through one block's scales over K with 32-bit offsets
        raise ValueError(
            "b_scale's stride along the K blocks is too large: (ceil(K/128) - 1) * stride(2) "
            f"must be below 2**31, got ({k_blocks} - 1) * {b_scale.stride(2)}"
        )
    check_a_scale_strides(a_scale)


def check_a_scale_shape(a_scale, e_count: int, max_m: int, k: int) -> None:
    """The 1x128 activation scales: (E, max_m, ceil(K/128))."""
    want = (e_count, max_m, -(-k // _SCALE_BLOCK))
    if tuple(a_scale.shape) != want:
        raise ValueError(f"a_scale must have shape (E, max_m, ceil(K/128)) = {want}, got {tuple(a_scale.shape)}")


def check_a_scale_strides(a_scale) -> None:
    """M contiguous (read in place) or K-block contiguous (copied first: ``tma_ready_a_scale``)."""
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
    in_place = st[1] == 1 and st[0] % 4 == 0 and st[2] % 4 == 0 and a_scale.data_ptr() % TMA_ALIGN == 0
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


def check_expert_dims(a, b) -> tuple[int, int]:
    """a [E, max_m, *] and b [E, N, *] (rank-3 tensors): at least one expert,
    one row, the same E. Returns b's (N, last extent)."""
    e_count, max_m, _ = a.shape
    b_e, n, b_k = b.shape
    if e_count < 1:
        raise ValueError(f"a must hold at least one expert, got shape {tuple(a.shape)}")
    if max_m < 1:
        raise ValueError(f"a.shape[1] (max_m) must be >= 1, got {max_m}")
    if b_e != e_count:
        raise ValueError(f"b.shape[0] must equal the expert count E={e_count} of a, got {b_e}")
    return n, b_k


def check_masked_m(masked_m, e_count: int) -> None:
    """masked_m (an int32 vector) holds one contiguous entry per expert."""
    if masked_m.shape[0] != e_count:
        raise ValueError(f"masked_m must have E={e_count} entries, got {masked_m.shape[0]}")
    if masked_m.stride(0) != 1 and e_count > 1:
        raise ValueError(f"masked_m must be contiguous, got stride {masked_m.stride(0)}")


def validate_args(a, b, out, masked_m, a_scale=None, b_scale=None) -> tuple[int, int, int, int]:
    """Shape, dtype, stride and aliasing checks. Returns (E, max_m, N, K)."""
    check_tensor("a", a, 3, _AB_DTYPES)
    if isinstance(b, torch.Tensor) and b.dtype != a.dtype and b.dtype in _AB_DTYPES:
        raise TypeError(f"a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    check_tensor("b", b, 3, (a.dtype,))
    check_tensor("masked_m", masked_m, 1, (torch.int32,))
    e_count, max_m, k = a.shape
    n, b_k = check_expert_dims(a, b)
    if b_k != k:
        raise ValueError(f"b.shape[2] must equal K={k} of a, got {b_k}")
    n_mult, k_mult = dim_multiples(Format.FP8_BLOCK128 if a.dtype == FP8 else Format.BF16)
    if k < k_mult or k % k_mult:
        raise ValueError(f"K (a.shape[2]) must be a positive multiple of {k_mult}, got {k}")
    if n < n_mult or n % n_mult:
        raise ValueError(f"N (b.shape[1]) must be a positive multiple of {n_mult}, got {n}")
    check_masked_m(masked_m, e_count)
    _check_scales(a, b, a_scale, b_scale, e_count, max_m, n, k)
    if out is not None:
        check_tensor("out", out, 3, (out_dtype(a.dtype),))
        if tuple(out.shape) != (e_count, max_m, n):
            raise ValueError(
                f"out must have shape (E, max_m, N) = {(e_count, max_m, n)}, got {tuple(out.shape)}"
            )
    span_a = _check_tma_operand("a", a, "K")
    span_b = _check_tma_operand("b", b, "K")
    if out is not None:
        span_out = _check_tma_operand("out", out, "N", is_input=False)
        _check_no_self_overlap("out", out)
        others = {"a": span_a, "b": span_b, "masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale}
        check_no_alias("out", span_out, others)
    return e_count, max_m, n, k


def dim_multiples(fmt: Format) -> tuple[int, int]:
    """(N, K) multiples a call with ``fmt`` operands needs, K in elements.

    16-byte TMA rows: K % 8 for 16-bit operands, K % 16 for fp8 (N likewise,
    for the fp8 weight rows' own 16-byte rule). MXFP8 / NVFP4 (checked in
    ``blockscaled_args``): K whole scale blocks, N whole 16-byte bf16 rows."""
    if fmt is Format.FP8_BLOCK128:
        return 16, 16
    if fmt.converts_weights:  # (the exponents' N-contiguous rows are 16-byte TMA lines)
        return 16, 32
    if fmt.block_scaled:
        return 8, fmt.k_align
    return 8, 8


def check_problem_sizes(fmt: Format, num_experts, max_m, n, k) -> None:
    """A problem given by its sizes (``signal_layout``): ints >= 1, with N and
    K the multiples a call with ``fmt`` operands needs (``dim_multiples``)."""
    for name, value in (("num_experts", num_experts), ("max_m", max_m), ("n", n), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    n_mult, k_mult = dim_multiples(fmt)
    if n % n_mult:
        raise ValueError(f"n (the call's N, b.shape[1]) must be a multiple of {n_mult} for {fmt.value} "
                         f"operands, got {n}")
    if k % k_mult:
        raise ValueError(f"k (the call's K, in elements) must be a multiple of {k_mult} for {fmt.value} "
                         f"operands, got {k}")


def out_dtype(ab_dtype: torch.dtype) -> torch.dtype:
    """fp8 products are written as bf16; 16-bit ones in their own dtype."""
    return torch.bfloat16 if ab_dtype == FP8 else ab_dtype


def check_expected_m(expected_m) -> None:
    """The host hint: an int >= 0, or None."""
    if expected_m is not None:
        if isinstance(expected_m, bool) or not isinstance(expected_m, int):
            raise TypeError(f"expected_m must be an int or None, got {type(expected_m).__name__}")
        if expected_m < 0:
            raise ValueError(f"expected_m must be >= 0, got {expected_m}")


def _check_num_sms_type(num_sms) -> None:
    if isinstance(num_sms, bool) or not isinstance(num_sms, int):
        raise TypeError(f"num_sms must be an int or None, got {type(num_sms).__name__}")


def check_num_sms_arg(num_sms) -> None:
    """``num_sms`` before the device is known: None or an int >= 1 (its upper
    bound, the SM count, is checked with the device by ``check_num_sms``)."""
    if num_sms is not None:
        _check_num_sms_type(num_sms)
        if num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {num_sms}")


def check_num_sms(num_sms, sm_count: int, device) -> int:
    """The persistent-grid cap: ``num_sms`` (an int in [1, sm_count]) or every SM."""
    if num_sms is None:
        return sm_count
    _check_num_sms_type(num_sms)
    if not 1 <= num_sms <= sm_count:
        raise ValueError(f"num_sms must be in [1, {sm_count}] on {device}, got {num_sms}")
    return num_sms


def check_tail_with_signals(config: GemmConfig, signals: bool) -> None:
    if signals and config.tail is Tail.SPLIT:
        raise ValueError(
            "config.tail=SPLIT cannot publish dst_signals (the two halves of a split "
            "tile finish on different CTAs); pass a config with another tail"
        )


def check_config_arg(config, fmt: Format, num_sms, signals: bool, combine: bool) -> None:
    """``config`` from itself and the call's other arguments, before the
    device is known: the backend whose configuration type it is checks it
    against its rules (a GemmConfig the sm_90 kernels', an Sm100Config the
    sm_100 / sm_103 ones')."""
    if config is not None:
        from . import backend

        cluster = backend.for_config(config).check_config_arg(config, fmt, signals, combine)
        if num_sms is not None and num_sms < cluster:
            raise ValueError(f"config.cluster_n={cluster} needs num_sms >= {cluster}, got {num_sms}")


def check_options(fmt: Format, config, expected_m, num_sms, signals: bool, combine: bool) -> None:
    """``expected_m``, ``num_sms`` and ``config`` before the device is known
    (``num_sms``' upper bound, the SM count, comes with the device)."""
    check_expected_m(expected_m)
    check_num_sms_arg(num_sms)
    check_config_arg(config, fmt, num_sms, signals, combine)


def validate_device(
    tensors: dict, num_sms: Optional[int], capability: tuple[int, int], sm_count: int, name: str = ""
) -> int:
    """Device checks from given device facts (pure, so CPU tests can drive it).

    ``tensors`` maps argument names to tensors (or None) that must all be on
    one CUDA device. Returns the persistent-grid cap.
    """
    devices = {}
    for arg, t in tensors.items():
        if t is None:
            continue
        device = getattr(t, "device", None)
        if not isinstance(device, torch.device):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if device.type != "cuda":
            raise ValueError(f"{arg} must be on a CUDA device, got {device}")
        devices[arg] = device
    first_arg, first = next(iter(devices.items()))
    for arg, dev in devices.items():
        if dev != first:
            raise ValueError(f"{arg} is on {dev} but {first_arg} is on {first}; all must share one device")
    if backend_name(capability) is None:
        raise ValueError(
            f"flashgemm's kernels need an sm_90 (Hopper) or sm_100 / sm_103 (Blackwell) GPU; {first} is "
            f"{name + ' ' if name else ''}sm_{capability[0]}{capability[1]}"
        )
    return check_num_sms(num_sms, sm_count, first)
