"""DeepGEMM's masked grouped GEMMs with its argument conventions.

``m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, expected_m)``
and ``m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)`` compute
what DeepGEMM's do (Hopper: fp32 1x128 / 128x128 scales; ``sfa`` M-major as
DeepGEMM wants it is read in place). The overlap form that SGLang's
single-batch overlap calls (``enable_overlap=True, signal=...``) publishes a
counter per (expert, 64-row block) that reaches exactly ``threshold`` =
ceil(N / block_n) once the block's rows are final, and returns
``(block_m, threshold)`` with ``block_m == 64``: what DeepEP's overlapping
combine asserts on the host and waits for (counter *equal* to the threshold;
the caller zeroes the counters before each call, as there).

Scale granularities follow DeepGEMM's convention: ``recipe = (gran_m, gran_n,
gran_k)`` for both operands, or ``recipe_a`` / ``recipe_b = (gran_mn, gran_k)``
per operand (not both forms at once). The one implemented is the DeepSeek-V3
recipe: ``(1, 128, 128)``, i.e. ``recipe_a = (1, 128)`` and ``recipe_b = (128, 128)``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..api import grouped_gemm_nt_masked
from ..jit.arch import device_facts
from .. import backend as backends
from ..formats import Format

OVERLAP_BLOCK_M = 64  # DeepEP's overlapping combine asserts 64-row blocks
_DECODE_M = 1  # any expected_m <= 48 picks the heuristic's 64-row decode tile


def _overlap_config(a, b, num_sms, fp8):
    """The heuristic's 64-row tile for a signalled call: its signal counts
    64-row blocks, whatever expected_m is."""
    e_count, max_m, k = a.shape
    if a.device.type != "cuda":  # (device_facts would only assert on a CPU-only torch)
        raise ValueError(f"enable_overlap=True needs a, b and d on a CUDA GPU (sm_90: H100/H200); "
                         f"a is on {a.device}")
    capability, sm_count, _ = device_facts(a.device.index)
    if tuple(capability) != (9, 0):
        # the sm100 kernels signal 128-row blocks; DeepEP's combine asserts 64
        raise ValueError(f"enable_overlap=True needs {OVERLAP_BLOCK_M}-row signal blocks, which only the "
                         f"sm_90 kernels publish; this GPU is sm_{capability[0]}{capability[1]}. Use "
                         "flashgemm.grouped_gemm_nt_masked(..., dst_signals=) with its signal_layout instead")
    sms = num_sms or sm_count
    cfg = backends.for_capability(capability).choose_config(
        Format.FP8_BLOCK128 if fp8 else Format.BF16, _DECODE_M, max_m, b.shape[1], k, sms, e_count, signals=True)
    if cfg.tile_m != OVERLAP_BLOCK_M:  # (the decode regime's tiles are 64 rows high)
        raise RuntimeError(f"the overlap form needs {OVERLAP_BLOCK_M}-row tiles, the heuristic gave {cfg.tile_m}")
    return cfg


def _run(a, b, d, masked_m, expected_m, a_scale, b_scale, enable_overlap, signal, num_sms):
    if not enable_overlap:
        if signal is not None:
            raise ValueError("signal is only for enable_overlap=True")
        grouped_gemm_nt_masked(a, b, d, masked_m, a_scale=a_scale, b_scale=b_scale,
                               expected_m=expected_m, num_sms=num_sms)
        return None
    if signal is None:
        raise ValueError("enable_overlap=True needs signal: int32 [E * ceil(max_m / 64)] counters, zeroed")
    cfg = _overlap_config(a, b, num_sms, a_scale is not None)
    _, layout = grouped_gemm_nt_masked(
        a, b, d, masked_m, a_scale=a_scale, b_scale=b_scale, expected_m=expected_m, num_sms=num_sms,
        config=cfg, dst_signals=signal, signal_granularity="m_block",
    )
    return layout.block_m, layout.n_tiles


# the DeepSeek-V3 recipe, the only one the kernels implement
RECIPE = (1, 128, 128)  # (gran_m, gran_n, gran_k)
RECIPE_A = (1, 128)  # (gran_m, gran_k): a scale per row per 128 of K
RECIPE_B = (128, 128)  # (gran_n, gran_k): a scale per 128x128 block


def _check_recipes(recipe, recipe_a, recipe_b) -> None:
    """Accept None or the DeepSeek-V3 recipe, in DeepGEMM's combined or
    per-operand form; anything else is a recipe we do not implement."""
    if recipe is not None and (recipe_a is not None or recipe_b is not None):
        raise ValueError("pass either recipe or recipe_a / recipe_b, not both (as in DeepGEMM)")
    for arg, value, want, what in (
        ("recipe", recipe, RECIPE, "1x128 scales for a, 128x128 for b"),
        ("recipe_a", recipe_a, RECIPE_A, "a scale per row per 128 of K"),
        ("recipe_b", recipe_b, RECIPE_B, "a scale per 128x128 block"),
    ):
        if value is not None and _as_tuple(value) != want:
            raise ValueError(f"{arg} must be None or {want} ({what}): the DeepSeek-V3 recipe is the only "
                             f"one flashgemm implements; got {value!r}")


def _as_tuple(value):
    try:
        return tuple(value)
    except TypeError:  # not a sequence: never equal to a recipe
        return value


def _pair(arg: str, value):
    """DeepGEMM's fp8 operand: a (tensor, scale) pair (a bare tensor would
    unpack along its expert dimension)."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value
    if isinstance(value, torch.Tensor):
        got = f"a tensor of shape {tuple(value.shape)}"
    elif isinstance(value, (tuple, list)):
        got = f"a {type(value).__name__} of {len(value)}"
    else:
        got = type(value).__name__
    raise TypeError(f"{arg} must be a (tensor, scale) pair: ({arg}_fp8, {arg}_scale) with float32 scales; "
                    f"got {got}")


def m_grouped_fp8_gemm_nt_masked(
    a: tuple, b: tuple, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
    recipe=None, recipe_a=None, recipe_b=None, compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
    enable_overlap: bool = False, signal: Optional[torch.Tensor] = None, max_block_n: int = 256,
    num_sms: Optional[int] = None,
):
    """``d[e, :m_e] = (a[0] * a[1]) @ (b[0] * b[1]).T`` per 1x128 / 128x128
    block. ``recipe`` / ``recipe_a`` / ``recipe_b`` may name that recipe (or
    be None; others raise ``ValueError``). ``compiled_dims``,
    ``disable_ue8m0_cast`` and ``max_block_n`` are accepted for signature
    compatibility: the scales are fp32 as on Hopper, and the tile choice is
    flashgemm's. Returns None, or ``(block_m, threshold)`` with
    ``enable_overlap``."""
    _check_recipes(recipe, recipe_a, recipe_b)
    (a_fp8, sfa), (b_fp8, sfb) = _pair("a", a), _pair("b", b)
    return _run(a_fp8, b_fp8, d, masked_m, expected_m, sfa, sfb, enable_overlap, signal, num_sms)


def m_grouped_bf16_gemm_nt_masked(
    a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
    compiled_dims: str = "nk", enable_overlap: bool = False, signal: Optional[torch.Tensor] = None,
    max_block_n: int = 256, num_sms: Optional[int] = None,
):
    """``d[e, :m_e] = a[e, :m_e] @ b[e].T`` in bf16 (fp32 accumulation)."""
    return _run(a, b, d, masked_m, expected_m, None, None, enable_overlap, signal, num_sms)


# DeepGEMM's older name for the fp8 entry point
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
