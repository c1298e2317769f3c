"""FlashInfer's masked block-scaled grouped GEMM with its argument conventions.

``grouped_gemm_nt_masked((a, sfa), (b, sfb), out, masked_m, ab_dtype=...,
sf_dtype=..., c_dtype=..., sf_vec_size=..., alpha=..., alpha_dtype=...)``
takes FlashInfer's batch-last views and maps them, by permutes and
same-size dtype views only (no copy), onto ``flashgemm.grouped_gemm_nt_masked``:

===================================  ============================================
FlashInfer                           flashgemm
===================================  ============================================
``a`` (m, k, l), fp4: (m, k/2, l)    ``a = a.permute(2, 0, 1)``: (E, max_m, K)
``sfa`` (32, 4, rm, 4, rk, l)        ``a_scale = sfa.permute(5, 2, 4, 0, 1, 3)``
``b`` (n, k, l), ``sfb`` likewise    ``b``, ``b_scale`` the same way
``out`` (m, n, l)                    ``out.permute(2, 0, 1)``: (E, max_m, N)
``masked_m`` (l,) int32              ``masked_m``
``sm_count``                         ``num_sms``
``alpha`` (l,) float32               ``alpha`` (NVFP4 only)
===================================  ============================================

Formats: ``ab_dtype="float8_e4m3fn"``, ``sf_dtype="float8_e8m0fnu"``,
``sf_vec_size=32`` is MXFP8; ``ab_dtype="float4_e2m1fn"``,
``sf_dtype="float8_e4m3fn"``, ``sf_vec_size=16`` is NVFP4. ``c_dtype`` must
be "bfloat16". Byte tensors (uint8, as FlashInfer's tests allocate them) are
viewed as the named dtype. NVFP4 without alpha means alpha = 1, as in
FlashInfer (a cached per-device tensor of ones).

Not taken: ``dst_signals`` (FlashInfer's per-expert count of CTAs that passed
an expert has no counterpart here; see the error for ours), e5m2 operands,
other output dtypes, and the combine-fusion / swap-AB arguments.
``mma_tiler_mn`` and ``cluster_shape_mn`` are accepted and ignored: the tile
choice is flashgemm's. ``expected_m`` (not FlashInfer's) passes the host hint
through.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..api import grouped_gemm_nt_masked as _flashgemm_call

# FlashInfer's formats that flashgemm runs: (ab_dtype, sf_dtype) -> (sf_vec_size, operand dtypes, scale dtype)
_FORMATS = {
    ("float8_e4m3fn", "float8_e8m0fnu"): (32, torch.float8_e4m3fn, torch.float8_e8m0fnu),
    ("float4_e2m1fn", "float8_e4m3fn"): (16, torch.float4_e2m1fn_x2, torch.float8_e4m3fn),
}
_AB_DTYPES = ("float8_e4m3fn", "float4_e2m1fn")
_SF_DTYPES = ("float8_e8m0fnu", "float8_e4m3fn")
# storage we view as the named dtype (same byte size, so the view is free); the
# targets are the dtypes the kernels are built for, so the launch needs no other view
_STORAGE = {torch.float8_e4m3fn: (torch.uint8, torch.float8_e4m3fn),
            torch.float4_e2m1fn_x2: (torch.uint8, torch.float4_e2m1fn_x2),
            torch.float8_e8m0fnu: (torch.uint8, torch.float8_e8m0fnu)}
_SF_TO_BLOCKED = (5, 2, 4, 0, 1, 3)  # (32, 4, rm, 4, rk, l) -> (l, rm, rk, 32, 4, 4)
_BATCH_FIRST = (2, 0, 1)  # (rows, cols, l) -> (l, rows, cols)
# FlashInfer arguments for its combine fusion, with their defaults: refused if set
_FUSION_ARGS = {"topk_weights": None, "idx_src_info": None, "rank_src_info": None, "out_ptrs": None,
                "num_ranks": 0, "barrier_flag_local": None, "barrier_flag_multicast": None,
                "is_combine_fusion": False, "is_swap_ab": False}
_TILE_ARGS = ("mma_tiler_mn", "cluster_shape_mn")

SIGNALS_REFUSED = (
    "dst_signals: FlashInfer's signal (per expert, +1 from every CTA once it has passed that expert, "
    "complete at the CTA count) is not implemented by flashgemm. flashgemm publishes a GPU-scope "
    "release add per finished output tile, with signal_granularity 'm_block' (a counter per expert "
    "and m-block, final at ceil(N / block_n)) or 'expert' (a counter per expert, final at "
    "ceil(m_e / block_m) * ceil(N / block_n)): call flashgemm.grouped_gemm_nt_masked(..., "
    "dst_signals=..., signal_granularity=...) with flashgemm's layouts, and size and read the "
    "counters with flashgemm.signal_layout(E, max_m, N, K, fmt=..., signal_granularity=...)"
)

_ONES: dict = {}  # (device, E) -> float32 ones: alpha = 1 for NVFP4 calls without alpha


def _pick_format(ab_dtype, sf_dtype, c_dtype, sf_vec_size):
    if ab_dtype not in _AB_DTYPES:
        raise ValueError(f"ab_dtype must be one of {_AB_DTYPES} (float8_e5m2 is not supported), got {ab_dtype!r}")
    if sf_dtype not in _SF_DTYPES:
        raise ValueError(f"sf_dtype must be one of {_SF_DTYPES}, got {sf_dtype!r}")
    if (ab_dtype, sf_dtype) not in _FORMATS:
        raise ValueError(
            f"ab_dtype={ab_dtype!r} with sf_dtype={sf_dtype!r} is not a format flashgemm runs: "
            "MXFP8 is float8_e4m3fn with float8_e8m0fnu scales, NVFP4 is float4_e2m1fn with float8_e4m3fn scales"
        )
    vec, ab, sf = _FORMATS[ab_dtype, sf_dtype]
    if isinstance(sf_vec_size, bool) or sf_vec_size != vec:
        raise ValueError(f"sf_vec_size must be {vec} for ab_dtype={ab_dtype!r} with sf_dtype={sf_dtype!r}, "
                         f"got {sf_vec_size!r}")
    if c_dtype != "bfloat16":
        raise ValueError(f"c_dtype must be 'bfloat16' (flashgemm writes bf16 output), got {c_dtype!r}")
    return ab, sf


def _as(name: str, t, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """``t`` viewed as ``dtype`` (same element size: no copy), after its rank check."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} (FlashInfer's layout), got shape {tuple(t.shape)}")
    if t.dtype == dtype:
        return t
    if t.dtype not in _STORAGE[dtype]:
        allowed = " or ".join(str(d) for d in _STORAGE[dtype])
        raise TypeError(f"{name} must have dtype {allowed} for this ab_dtype/sf_dtype, got {t.dtype}")
    return t.view(dtype)


def _pair(name: str, value):
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a pair (tensor, scale factors), got {type(value).__name__}")
    return value


def _ones(device: torch.device, e_count: int) -> torch.Tensor:
    key = (device, e_count)
    ones = _ONES.get(key)
    if ones is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # a tensor filled inside a capture holds ones only on replay
            raise ValueError("NVFP4 without alpha inside CUDA-graph capture: pass alpha (float32 [l]) or call "
                             "once outside the capture first")
        ones = _ONES[key] = torch.ones(e_count, dtype=torch.float32, device=device)
    return ones


def map_arguments(lhs, rhs, out, masked_m, *, ab_dtype, sf_dtype, c_dtype, sf_vec_size, alpha=None,
                  alpha_dtype=None):
    """FlashInfer's arguments as flashgemm's: ``(a, b, out, masked_m, kwargs)``,
    every tensor a view of the caller's (``kwargs``: a_scale, b_scale, alpha)."""
    ab, sf = _pick_format(ab_dtype, sf_dtype, c_dtype, sf_vec_size)
    a, sfa = _pair("lhs", lhs)
    b, sfb = _pair("rhs", rhs)
    a = _as("lhs[0]", a, ab, 3).permute(_BATCH_FIRST)
    b = _as("rhs[0]", b, ab, 3).permute(_BATCH_FIRST)
    a_scale = _as("lhs[1]", sfa, sf, 6).permute(_SF_TO_BLOCKED)
    b_scale = _as("rhs[1]", sfb, sf, 6).permute(_SF_TO_BLOCKED)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor (m, n, l), got {type(out).__name__}")
    if out.dim() != 3:
        raise ValueError(f"out must have rank 3, (m, n, l), got shape {tuple(out.shape)}")
    out_view = out.permute(_BATCH_FIRST)
    if alpha is not None:
        if alpha_dtype != "float32":
            raise ValueError(f"alpha needs alpha_dtype='float32', got {alpha_dtype!r}")
        if ab_dtype != "float4_e2m1fn":
            raise ValueError("alpha is taken with NVFP4 (float4_e2m1fn) only: flashgemm's MXFP8 kernels apply "
                             "no per-expert alpha; fold it into the scale factors or pass alpha=None")
    elif ab_dtype == "float4_e2m1fn":
        alpha = _ones(a.device, a.shape[0])
    return a, b, out_view, masked_m, dict(a_scale=a_scale, b_scale=b_scale, alpha=alpha)


def grouped_gemm_nt_masked(
    lhs, rhs, out: torch.Tensor, masked_m: torch.Tensor, *, ab_dtype: str, sf_dtype: str, c_dtype: str,
    sf_vec_size: int, alpha: Optional[torch.Tensor] = None, alpha_dtype: Optional[str] = None,
    dst_signals: Optional[torch.Tensor] = None, sm_count: Optional[int] = None,
    expected_m: Optional[int] = None, **kwargs,
):
    """``out[:m_l, :, l] = alpha[l] * (A_l * SFA_l) @ (B_l * SFB_l).T`` for each
    batch l with FlashInfer's layouts (module docstring); rows >= masked_m[l]
    of ``out`` are not written. Returns ``out``."""
    if dst_signals is not None:
        raise ValueError(SIGNALS_REFUSED)
    for name, value in kwargs.items():
        if name in _FUSION_ARGS:
            default = _FUSION_ARGS[name]
            if not (value is default or (type(value) in (bool, int) and value == default)):
                raise ValueError(f"{name}: FlashInfer's combine fusion / swap-AB is not supported by flashgemm "
                                 "(its fused combine is flashgemm.grouped_gemm_nt_masked(..., combine=...), sm_90)")
        elif name not in _TILE_ARGS:
            raise TypeError(f"grouped_gemm_nt_masked got an unexpected keyword argument {name!r}")
    a, b, out_view, masked_m, kw = map_arguments(lhs, rhs, out, masked_m, ab_dtype=ab_dtype, sf_dtype=sf_dtype,
                                                 c_dtype=c_dtype, sf_vec_size=sf_vec_size, alpha=alpha,
                                                 alpha_dtype=alpha_dtype)
    _flashgemm_call(a, b, out_view, masked_m, num_sms=sm_count, expected_m=expected_m, **kw)
    return out
