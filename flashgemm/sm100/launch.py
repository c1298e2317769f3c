"""The launch plan of a call that the sm_100 / sm_103 kernels serve.

``api`` has already checked the arguments' metadata and the device; here the
configuration is chosen (``heuristic`` for BF16 / MXFP8 / NVFP4,
``blockwise_build`` for DeepSeek's 1x128 fp8), the signal layout derived and
the kernel fetched. The plan then launches with only the address checks
(alignment, no aliasing of what the kernel writes) on later calls, as the
Hopper plan does. ``sm100_signal_layout`` runs the same choice, so the
layout known before a launch is the one the launch uses.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import Format
from ..signals import SignalLayout, check_granularity, make_signal_layout, validate_signals
from ..validation import _TMA_ALIGN, _byte_span, _span, check_expected_m, check_no_alias, tma_ready_a_scale


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one (format, shape, grid, signal mode) resolves to on sm_100."""

    spec: object  # Sm100Spec, or the blockwise kernel's BlockwiseSpec
    blockwise: bool  # the DeepSeek fp32-scale kernel (its call takes no alpha)
    block: tuple  # (block_m, block_n) of a signal: rows and columns of one output tile
    cluster: int  # CTAs per cluster: num_ctas must be a multiple of it
    cluster_tile: tuple  # (rows, columns) of one cluster's unit of work, for the grid size


def choose(fmt: Format, e_count, max_m, n, k, expected_m, grid_cap, config, mode) -> Choice:
    """The kernel for this call; ``config`` (an ``Sm100Config`` of the
    call's format, or None for the heuristic's) is checked here."""
    check_expected_m(expected_m)
    if mode is not None:
        check_granularity(mode)
    if fmt is Format.FP8_BLOCK128:
        if config is not None:
            raise ValueError("config cannot be set for 1x128 fp8 operands on sm_100 (the blockwise "
                             "kernel chooses its own tiles); pass config=None")
        from .blockwise_build import choose_blockwise

        spec = choose_blockwise(e_count, max_m, n, k, expected_m, grid_cap, mode)
        block = tuple(spec.signal_block)  # one CTA per 128x128 tile, no clusters
        return Choice(spec, True, block, 1, block)
    from .build import signal_block
    from .config import Sm100Config, Sm100Spec
    from .limits import check_config

    if config is None:
        from .heuristic import choose_config

        config = choose_config(fmt, e_count, max_m, n, k, expected_m, grid_cap, mode)
    elif not isinstance(config, Sm100Config):
        raise TypeError(f"config on an sm_100 GPU must be a flashgemm.Sm100Config or None, "
                        f"got {type(config).__name__}")
    elif config.fmt is not fmt:
        raise ValueError(f"config.fmt is {config.fmt.value} but the operands are {fmt.value}")
    else:
        check_config(config)
    spec = Sm100Spec(config, mode)
    return Choice(spec, False, tuple(signal_block(spec)), config.cluster_size, (config.tile_m, config.tile_n))


def sm100_signal_layout(fmt, e_count, max_m, n, k, expected_m, grid_cap, config, granularity) -> SignalLayout:
    """``api.signal_layout`` on an sm_100 / sm_103 GPU."""
    check_granularity(granularity)
    c = choose(fmt, e_count, max_m, n, k, expected_m, grid_cap, config, granularity)
    return make_signal_layout(granularity, max_m, n, c.block[0], c.block[1], e_count)


def grid_ctas(c: Choice, e_count: int, max_m: int, n: int, grid_cap: int) -> int:
    """Persistent grid: whole clusters, at most ``grid_cap`` CTAs, never more
    clusters than tiles (counted from max_m: masked_m stays on the GPU)."""
    if grid_cap < c.cluster:
        raise ValueError(f"this kernel runs {c.cluster}-CTA clusters: num_sms must be >= {c.cluster}, got {grid_cap}")
    tiles = e_count * -(-max_m // c.cluster_tile[0]) * -(-n // c.cluster_tile[1])
    return c.cluster * max(1, min(grid_cap // c.cluster, tiles))


def kernel_views(fmt: Format) -> tuple:
    """(index in (a, b, a_scale, b_scale), torch dtype) of the operands whose
    public dtypes include one the compiled function is not built for (uint8
    bytes for packed e2m1 or E8M0): a same-size view, no copy, at launch."""
    from .build import TORCH_DTYPES

    ab, sf = TORCH_DTYPES.get(fmt, (None, None))
    views = []
    if fmt is Format.NVFP4:
        views += [(0, getattr(torch, ab)), (1, getattr(torch, ab))]
    if fmt is Format.MXFP8:
        views += [(2, getattr(torch, sf)), (3, getattr(torch, sf))]
    return tuple(views)


def make_plan(fmt: Format, sizes, a, b, out, masked_m, a_scale, b_scale, alpha, expected_m, config,
              dst_signals, signal_granularity, grid_cap: int):
    """The plan for one argument signature (everything else already checked)."""
    e_count, max_m, n, k = sizes
    check_granularity(signal_granularity)
    mode = signal_granularity if dst_signals is not None else None
    c = choose(fmt, e_count, max_m, n, k, expected_m, grid_cap, config, mode)
    layout = None
    if dst_signals is not None:
        layout = make_signal_layout(signal_granularity, max_m, n, c.block[0], c.block[1], e_count)
        validate_signals(dst_signals, layout, a.device)
        others = {"a": a, "b": b, "out": out, "a_scale": a_scale, "b_scale": b_scale, "alpha": alpha,
                  "masked_m": masked_m}
        check_no_alias("dst_signals", _byte_span(dst_signals), others)
    num_ctas = grid_ctas(c, e_count, max_m, n, grid_cap)
    if c.blockwise:
        from .blockwise_build import get_blockwise_kernel

        fn = get_blockwise_kernel(c.spec)
    else:
        from .build import get_kernel

        fn = get_kernel(c.spec)
    copy_a_scale = c.blockwise and tma_ready_a_scale(a_scale, check_only=True)
    tensors = (a, b, masked_m, out, a_scale, b_scale, dst_signals, alpha)
    present = [i for i, t in enumerate(tensors) if t is not None]
    pos = {i: j for j, i in enumerate(present)}
    # TMA bases: a, b, out; blocked scales; an fp32 a_scale read in place (the
    # blockwise kernel reads b_scale with plain loads: 4-byte alignment)
    aligned = [pos[i] for i in (0, 1, 3) if i in pos]
    if 4 in pos and not copy_a_scale:
        aligned.append(pos[4])
    if 5 in pos and not c.blockwise:
        aligned.append(pos[5])
    return Sm100Plan(
        fn=getattr(fn, "__tvm_ffi_object__", lambda: None)() or fn,
        blockwise=c.blockwise,
        num_ctas=num_ctas,
        layout=layout,
        out_shape=(e_count, max_m, n),
        copy_a_scale=copy_a_scale,
        views=() if c.blockwise else kernel_views(fmt),
        aligned=tuple(aligned),
        written=tuple(pos[i] for i in (3, 6) if i in pos),
        extents=tuple(0 if tensors[i] is None else _span(0, tensors[i].shape, tensors[i].stride(),
                                                           tensors[i].element_size())[1] for i in present),
        spec=c.spec,
    )


class Sm100Plan:
    """What the checks derived for one argument signature on sm_100: the
    compiled kernel, grid and signal layout, and the byte extents for the
    per-call address checks. Same interface as the Hopper plan, with alpha
    passed as ``extra = (alpha,)``."""

    __slots__ = ("fn", "blockwise", "num_ctas", "layout", "out_shape", "copy_a_scale", "views",
                 "aligned", "written", "extents", "spec", "last_ok")

    def __init__(self, **kw):
        self.last_ok = None
        for name, value in kw.items():
            setattr(self, name, value)

    def pointers_ok(self, a, b, masked_m, out, a_scale, b_scale, dst_signals, extra=()) -> bool:
        """Alignment and no aliasing of what the kernel writes, from this
        call's addresses; False sends the call through the full checks."""
        ptrs = [t.data_ptr() for t in (a, b, masked_m, out, a_scale, b_scale, dst_signals, *extra)
                if t is not None]
        if ptrs == self.last_ok:
            return True
        bits = 0
        for i in self.aligned:
            bits |= ptrs[i]
        if bits % _TMA_ALIGN:
            return False
        ext = self.extents
        for w in self.written:
            lo, hi = ptrs[w], ptrs[w] + ext[w]
            if any(j != w and p < hi and lo < p + ext[j] for j, p in enumerate(ptrs)):
                return False
        self.last_ok = ptrs
        return True

    def launch(self, a, b, out, masked_m, a_scale, b_scale, dst_signals, extra=()):
        alpha = extra[0] if extra else None
        if out is None:
            out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=a.device)
        if self.views:
            args = [a, b, a_scale, b_scale]
            for i, dtype in self.views:
                if args[i].dtype is not dtype:  # (the key leaves these dtypes open: bytes or the real one)
                    args[i] = args[i].view(dtype)
            a, b, a_scale, b_scale = args
        if self.blockwise:
            if self.copy_a_scale:
                a_scale = tma_ready_a_scale(a_scale)
            self.fn(a, b, a_scale, b_scale, out, masked_m, dst_signals, self.num_ctas)
        else:
            self.fn(a, b, a_scale, b_scale, alpha, out, masked_m, dst_signals, self.num_ctas)
        return out if self.layout is None else (out, self.layout)
