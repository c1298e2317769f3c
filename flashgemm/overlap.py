"""Torch-level overlap: the GEMM and a signal-driven combine on two streams.

Co-residency rule (why this cannot deadlock): the GEMM waits on nothing, so it
always finishes if its CTAs get SMs. The combine spins until tiles are ready,
so its CTAs must never take the SMs the GEMM still needs: launch the GEMM with
``num_sms = gemm_sms`` and the combine with at most ``sm_count - gemm_sms``
CTAs (one GEMM CTA fills an SM's shared memory). ``run_gemm_and_combine``
enforces this; the combine's bounded wait turns any violation into an error
bit, not a hang.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .api import grouped_gemm_nt_masked, signal_layout
from .jit.arch import device_facts
from .signals import DEFAULT_ROWS_PER_ITEM, SignalLayout, alloc_signals, check_rows_per_item
from .validation import FP8, byte_span, check_tensor, out_dtype

DEFAULT_MAX_POLLS = 20_000_000  # with <= 256 ns back-off: ~5 s before giving up


def _check(name, t, dtype, shape):
    check_tensor(name, t, len(shape), (dtype,))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def combine_masked(
    out: torch.Tensor,
    masked_m: torch.Tensor,
    dst_signals: torch.Tensor,
    layout: SignalLayout,
    token_idx: torch.Tensor,
    weight: torch.Tensor,
    combined: torch.Tensor,
    *,
    num_sms: int,
    max_polls: int = DEFAULT_MAX_POLLS,
    err: Optional[torch.Tensor] = None,
    rows_per_item: Optional[int] = None,
) -> torch.Tensor:
    """Launch the reference combine on the current stream; returns the int32
    error word (see ``combine.py``), which the caller reads after a sync.

    For every valid row r of expert e: ``combined[token_idx[e, r]] += weight[e, r] * out[e, r]``,
    each m-block once its counter in ``dst_signals`` reaches ``layout.n_tiles``.
    rows_per_item: rows of one work item (a power of two dividing
    ``layout.block_m``; default ``DEFAULT_ROWS_PER_ITEM``). Smaller items
    spread the last m-block over more CTAs.
    """
    if not isinstance(layout, SignalLayout) or layout.granularity != "m_block":
        raise ValueError("combine_masked needs the 'm_block' SignalLayout of the GEMM call")
    if not isinstance(max_polls, int) or not 1 <= max_polls < 2**31:
        raise ValueError(f"max_polls must be an int in [1, 2**31), got {max_polls!r}")
    if rows_per_item is None:
        rows_per_item = DEFAULT_ROWS_PER_ITEM
    check_rows_per_item(rows_per_item, layout.block_m)
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise ValueError("out must be the [E, max_m, N] GEMM output")
    e_count, max_m, n = out.shape
    _check("out", out, torch.bfloat16, (e_count, max_m, n))
    if n % 8:
        raise ValueError(f"out's N must be a multiple of 8 (16-byte rows), got {n}")
    _check("masked_m", masked_m, torch.int32, (e_count,))
    _check("token_idx", token_idx, torch.int32, (e_count, max_m))
    _check("weight", weight, torch.float32, (e_count, max_m))
    if not isinstance(combined, torch.Tensor) or combined.dim() != 2:
        raise ValueError("combined must be a [T, N] float32 tensor")
    _check("combined", combined, torch.float32, (combined.shape[0], n))
    if _overlaps(out, combined):
        raise ValueError("combined must not overlap out (the combine reads out while it writes combined)")
    if combined.data_ptr() % 16:
        # rows leave by 16-byte-aligned bulk reductions
        raise ValueError("combined must start at a 16-byte aligned address")
    if dst_signals.dtype != torch.int32 or dst_signals.numel() < layout.size:
        raise ValueError(f"dst_signals must be int32 with at least {layout.size} entries")
    if err is None:
        err = torch.zeros(1, dtype=torch.int32, device=out.device)
    _check("err", err, torch.int32, (1,))
    for name, t in (("masked_m", masked_m), ("dst_signals", dst_signals), ("token_idx", token_idx),
                    ("weight", weight), ("combined", combined), ("err", err)):
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device} but out is on {out.device}")
    if out.device.type != "cuda":
        raise ValueError(f"out must be on a CUDA device, got {out.device}")
    sm_count = device_facts(out.device.index)[1]
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 1 <= num_sms <= sm_count:
        raise ValueError(f"num_sms must be an int in [1, {sm_count}], got {num_sms!r}")

    from . import backend

    fn = backend.for_capability(device_facts(out.device.index)[0]).reference_combine(layout.block_m, rows_per_item)
    fn(out, masked_m, dst_signals, token_idx, weight, combined, err, layout.n_tiles, max_polls, num_sms)
    return err


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    lo_x, hi_x = byte_span(x)
    lo_y, hi_y = byte_span(y)
    return x.device == y.device and lo_x < hi_y and lo_y < hi_x


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def run_gemm_and_combine(
    a: torch.Tensor,
    b: torch.Tensor,
    masked_m: torch.Tensor,
    token_idx: torch.Tensor,
    weight: torch.Tensor,
    combined: torch.Tensor,
    *,
    gemm_sms: int,
    combine_sms: Optional[int] = None,
    expected_m: Optional[int] = None,
    config=None,
    out: Optional[torch.Tensor] = None,
    max_polls: int = DEFAULT_MAX_POLLS,
    rows_per_item: Optional[int] = None,
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
):
    """An MoE layer's GEMM with its combine overlapped: the combine runs on a
    side stream and ships each m-block as soon as the GEMM signals it.
    Block-scaled fp8 operands take ``a_scale`` and ``b_scale`` as in
    ``grouped_gemm_nt_masked`` (``out`` is then bf16).
    Returns (out, err); both streams are joined into the current one."""
    if not isinstance(a, torch.Tensor) or a.dim() != 3 or a.device.type != "cuda":
        raise ValueError(f"a must be an [E, max_m, K] tensor on a CUDA device, got {_describe(a)}")
    if not isinstance(b, torch.Tensor) or b.dim() != 3:
        raise ValueError(f"b must be an [E, N, K] tensor, got {_describe(b)}")
    sm_count = device_facts(a.device.index)[1]
    for name, value in (("gemm_sms", gemm_sms), ("combine_sms", combine_sms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if combine_sms is None:
        combine_sms = sm_count - gemm_sms
    if not 1 <= gemm_sms < sm_count or not 1 <= combine_sms <= sm_count - gemm_sms:
        raise ValueError(
            f"need gemm_sms + combine_sms <= {sm_count} (co-residency), got {gemm_sms} + {combine_sms}"
        )
    e_count, max_m, _ = a.shape
    if out is not None and isinstance(combined, torch.Tensor) and _overlaps(out, combined):
        raise ValueError("combined must not overlap out (the combine reads out while it writes combined)")
    layout = signal_layout(e_count, max_m, b.shape[1], a.shape[2], expected_m=expected_m,
                           num_sms=gemm_sms, config=config, fp8=a.dtype == FP8, device=a.device)
    signals = alloc_signals(layout, a.device)
    if out is None:
        out = torch.empty((e_count, max_m, b.shape[1]), dtype=out_dtype(a.dtype), device=a.device)
    main = torch.cuda.current_stream(a.device)
    side = _side_stream(a.device.index)
    ready = main.record_event()  # inputs and zeroed counters are ready
    # The GEMM is enqueued first so its 2-CTA clusters are placed on an empty
    # GPU; the combine's CTAs then take the SMs left over (combine first
    # scatters its CTAs over the GPCs and fewer GEMM clusters fit: docs/design.md).
    grouped_gemm_nt_masked(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, expected_m=expected_m,
                           num_sms=gemm_sms, config=config, dst_signals=signals)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        err = combine_masked(out, masked_m, signals, layout, token_idx, weight, combined,
                             num_sms=combine_sms, max_polls=max_polls, rows_per_item=rows_per_item)
    main.wait_stream(side)
    for t in (out, signals, combined, err, token_idx, weight):
        t.record_stream(side)
    return out, err
