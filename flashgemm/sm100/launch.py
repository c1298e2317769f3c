"""The launch plan of a call that the sm_100 / sm_103 kernels serve.

``api`` has already checked the arguments' metadata and the device; here the
configuration is chosen (``heuristic`` for BF16 / MXFP8 / NVFP4,
``blockwise_build`` for DeepSeek's 1x128 fp8), the signal layout derived and
the kernel fetched, into a ``plan.LaunchPlan``. ``sm100_signal_layout`` runs
the same choice, so the layout known before a launch is the one the launch
uses.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import Format
from ..signals import SignalLayout, check_granularity, make_signal_layout, validate_signals
from ..plan import LaunchPlan
from ..validation import byte_span, check_expected_m, check_no_alias, tma_ready_a_scale


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one (format, shape, grid, signal mode) resolves to on sm_100."""

    spec: object  # Sm100Spec, or the blockwise kernel's BlockwiseSpec (each names its parameters: SLOTS)
    blockwise: bool  # the DeepSeek recipe's fp32 scales: a_scale TMA-loaded, b_scale read with plain loads
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
    """(slot, torch dtype) of the operands whose public dtypes include one
    the compiled function is not built for (uint8 bytes for packed e2m1 or
    E8M0): a same-size view, no copy, at launch."""
    from .build import TORCH_DTYPES

    ab, sf = TORCH_DTYPES.get(fmt, (None, None))
    views = []
    if fmt is Format.NVFP4:
        views += [("a", getattr(torch, ab)), ("b", getattr(torch, ab))]
    if fmt is Format.MXFP8_MXFP4:
        views += [("b", torch.float4_e2m1fn_x2)]
    if fmt in (Format.MXFP8, Format.MXFP8_MXFP4):
        views += [("a_scale", getattr(torch, sf)), ("b_scale", getattr(torch, sf))]
    return tuple(views)


def kernel_of(spec):
    """The cached compiled kernel of an ``Sm100Spec`` or a ``BlockwiseSpec``."""
    from .blockwise_build import BlockwiseSpec, get_blockwise_kernel
    from .build import get_kernel

    return get_blockwise_kernel(spec) if isinstance(spec, BlockwiseSpec) else get_kernel(spec)


def make_plan(call) -> LaunchPlan:
    """``Backend.make_plan`` on sm_100 / sm_103 (everything else already checked)."""
    e_count, max_m, n, k = call.sizes
    t = call.tensors
    fmt, signals = call.fmt, t["signals"]
    check_granularity(call.granularity)
    mode = call.granularity if signals is not None else None
    c = choose(fmt, e_count, max_m, n, k, call.expected_m, call.grid_cap, call.config, mode)
    layout = None
    if signals is not None:
        layout = make_signal_layout(call.granularity, max_m, n, c.block[0], c.block[1], e_count)
        validate_signals(signals, layout, t["a"].device)
        check_no_alias("signals", byte_span(signals), {k: v for k, v in t.items() if k != "signals"})
    num_ctas = grid_ctas(c, e_count, max_m, n, call.grid_cap)
    fn = kernel_of(c.spec)
    copy_a_scale = c.blockwise and tma_ready_a_scale(t["a_scale"], check_only=True)
    # TMA bases: a, b, out; blocked scales; an fp32 a_scale read in place (the
    # blockwise kernel reads b_scale with plain loads: 4-byte alignment)
    aligned = ("a", "b", "out") + (() if copy_a_scale else ("a_scale",)) + (() if c.blockwise else ("b_scale",))
    return LaunchPlan(
        fn, c.spec.SLOTS, t, scalars=(num_ctas,), aligned=aligned,
        written=("out", "signals"), num_ctas=num_ctas, layout=layout, out_shape=(e_count, max_m, n),
        out_dtype=torch.bfloat16, copy_a_scale=copy_a_scale, counter_device=None,
        views=() if c.blockwise else kernel_views(fmt), routed=False, spec=c.spec,
    )
