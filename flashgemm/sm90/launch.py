"""The launch plan of a call that the sm_90 kernels serve.

``api`` has already checked the arguments' metadata and the device; here the
configuration is resolved (the caller's, checked, or the heuristic's), the
signal layout derived, the grid sized and the kernel fetched. Every sm_90
GEMM build, the fused gate_up included, takes the tensors of ``SLOTS`` in
that order (absent ones None), then the grid size.
"""

from __future__ import annotations

import torch

from ..config import Epilogue, GemmConfig, KernelSpec
from ..formats import Format
from ..plan import LaunchPlan
from ..routing import ROUTING_SLOTS, combine_epilogue
from ..signals import make_signal_layout, validate_signals
from ..validation import check_expected_m, check_tail_with_signals, tma_ready_a_scale
from .limits import validated_config

# the compiled kernel's tensor parameters (``kernel.MaskedGroupedGemmSm90.__call__``)
SLOTS = ("a", "b", "out", "masked_m", "signals", "a_scale", "b_scale", "counter", *ROUTING_SLOTS, "out_scale")
# TMA bases, the fused combine's 16-byte reductions into ``combined`` and
# 16-byte loads of ``bias``, the fused SwiGLU's scales (read in place by the
# down GEMM's TMA)
ALIGNED = ("a", "b", "out", "combined", "bias", "out_scale")
# what the kernel writes (``peers`` only addresses the buffers written)
WRITTEN = ("out", "signals", "combined", "err", "out_scale")


def resolve_config(config, fmt: Format, expected_m, max_m, n, k, grid_cap, num_experts, signals=False,
                   epilogue: Epilogue = Epilogue.STORE) -> GemmConfig:
    """The caller's config checked against the sm_90 rules, or the heuristic's."""
    check_expected_m(expected_m)
    if config is None:
        from .heuristic import choose_activation_config, choose_config, weight_format_config

        fp8 = fmt.promotes
        if epilogue.activates:
            cfg = choose_activation_config(expected_m, max_m, n, k, grid_cap, fp8, num_experts)
        else:
            cfg = choose_config(expected_m, max_m, n, k, grid_cap, fp8, num_experts, signals, epilogue.combines)
        return weight_format_config(cfg, fmt)
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a flashgemm.GemmConfig, got {type(config).__name__}")
    return validated_config(config, fmt, Epilogue.COMBINE if epilogue.combines else epilogue)


def gemm_plan(call, tensors: dict, epilogue: Epilogue, config: GemmConfig, spec_fmt: Format,
              copy_a_scale: bool, out_shape: tuple, **facts) -> LaunchPlan:
    """The plan of one sm_90 build: the kernel of (config, format, signal
    mode, epilogue) on the grid the call allows."""
    from .build import get_kernel

    e_count, max_m, n, _ = call.sizes
    cn = config.cluster_n
    if call.grid_cap < cn:
        raise ValueError(f"config.cluster_n={cn} needs num_sms >= {cn}, got {call.grid_cap}")
    layout = facts.pop("layout", None)
    mode = layout.granularity if layout is not None else None
    fn = get_kernel(KernelSpec(config, spec_fmt, mode, epilogue))
    mxfp4 = spec_fmt.converts_weights
    if config.dynamic and call.device_index is not None:
        from .. import workspace

        workspace.prepare_graph_counters(call.device_index)
    # persistent grid: never more clusters than units of work could use
    num_ctas = cn * config.grid_clusters(e_count, max_m, n, call.grid_cap)
    return LaunchPlan(
        fn, SLOTS, tensors, scalars=(num_ctas,),
        aligned=ALIGNED + (() if copy_a_scale else ("a_scale",)) + (("b_scale",) if mxfp4 else ()),
        written=WRITTEN,
        num_ctas=num_ctas, layout=layout, out_shape=out_shape, copy_a_scale=copy_a_scale,
        counter_device=call.device_index if config.dynamic else None,
        # the compiled kernel takes the packed weights and their exponents as bytes
        views=(("b_scale", torch.uint8),) if mxfp4 else (), **facts,
    )


def make_plan(call) -> LaunchPlan:
    """``Backend.make_plan`` on sm_90: the plain GEMM, signalled, with the
    fused combine, or with the fused SwiGLU (``call.epilogue``; its output
    h is [E, max_m, N / 2])."""
    e_count, max_m, n, k = call.sizes
    t = call.tensors
    signals = t.get("signals") is not None
    if call.epilogue is not None:
        epilogue = call.epilogue
    else:
        epilogue = Epilogue.STORE if call.combine is None else combine_epilogue(call.combine)
    config = resolve_config(call.config, call.fmt, call.expected_m, max_m, n, k, call.grid_cap, e_count,
                            signals, epilogue)
    if epilogue.activates:
        validated_config(config, call.fmt, epilogue)
    check_tail_with_signals(config, signals)  # (the heuristic's pick too)
    layout = None
    if signals:
        layout = make_signal_layout(call.granularity, max_m, n, config.tile_m, config.tile_n, e_count)
        validate_signals(t["signals"], layout, t["a"].device)
    copy_a_scale = call.fmt.promotes and tma_ready_a_scale(t["a_scale"], check_only=True)
    tensors = {**t, **dict(zip(ROUTING_SLOTS, call.routing))}
    out_n = n // 2 if epilogue.activates else n
    return gemm_plan(call, tensors, epilogue, config, call.fmt, copy_a_scale, (e_count, max_m, out_n),
                     layout=layout, out_dtype=torch.bfloat16, routed=bool(call.routing))


def signal_layout(fmt: Format, num_experts, max_m, n, k, expected_m, grid_cap, config, granularity):
    """``Backend.signal_layout`` on sm_90: the same resolution as a launch."""
    cfg = resolve_config(config, fmt, expected_m, max_m, n, k, grid_cap, num_experts, signals=True)
    return make_signal_layout(granularity, max_m, n, cfg.tile_m, cfg.tile_n, num_experts)
