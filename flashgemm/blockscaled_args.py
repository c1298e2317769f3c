"""The operand format of a call, and the host-side checks of the
block-scaled (MXFP8 / NVFP4, and MXFP4 weights with fp8 activations)
arguments, before anything is launched.

Like ``validation``, every check reads metadata only (shapes, strides,
dtypes, pointers), so CPU tensors drive all of them; each failure names the
argument and what was expected.

How the format follows from the dtypes:

=====================================  ============================  ============
``a`` / ``b``                          ``a_scale`` / ``b_scale``     format
=====================================  ============================  ============
bfloat16                               None                          BF16
float8_e4m3fn                          float32 (1x128 / 128x128)     FP8_BLOCK128
float8_e4m3fn                          float8_e8m0fnu or uint8       MXFP8
uint8 or float4_e2m1fn_x2 (packed)     float8_e4m3fn                 NVFP4
a float8_e4m3fn, b int8 (prepared)     float32 / E8M0, N contiguous  FP8_MXFP4
a bfloat16, b int8 (prepared)          None / E8M0, N contiguous     BF16_MXFP4
a float8_e4m3fn, b uint8 or            float8_e8m0fnu or uint8       MXFP8_MXFP4
float4_e2m1fn_x2 (packed)              (both blocked 128x4)
=====================================  ============================  ============

uint8 is accepted for E8M0 scales because ``blockscale.quantize_mxfp8``
returns them so; uint8 ``a`` always means packed e2m1 (NVFP4), so NVFP4
scales must carry their real dtype (float8_e4m3fn) and cannot be confused
with MXFP8's bytes.
"""

from __future__ import annotations

import torch

from .formats import Format
from .mxfp4 import blackwell_row_bytes
from .validation import (
    FP8, _check_no_self_overlap, _check_tma_operand, check_a_scale_shape, check_a_scale_strides, check_expert_dims,
    check_masked_m, check_no_alias, check_tensor,
)

_E8M0 = torch.float8_e8m0fnu
_FP4_BYTES = (torch.uint8, torch.float4_e2m1fn_x2)  # two e2m1 codes per byte along K
_MX_SCALE_DTYPES = (_E8M0, torch.uint8)
_ATOM_ROWS, _ATOM_COLS = 128, 4  # one scale atom: 128 rows x 4 scale columns (512 bytes)
_OUT_ALIGN = 8  # bf16 output rows are whole 16-byte TMA lines


def infer_format(a, a_scale, b=None) -> Format:
    """The format a call's dtypes select (see the module's table). Anything
    it cannot place goes to BF16's checks, whose errors name the dtype."""
    dtype = getattr(a, "dtype", None)
    if dtype in _FP4_BYTES:
        return Format.NVFP4
    mxfp4_b = getattr(b, "dtype", None) in _FP4_BYTES + (torch.int8,)
    if dtype == torch.bfloat16 and mxfp4_b:
        return Format.BF16_MXFP4  # (as below, raw packed b is refused by name)
    if dtype != FP8:
        return Format.BF16
    sdtype = getattr(a_scale, "dtype", None)
    if mxfp4_b and sdtype in (None, torch.float32):
        return Format.FP8_MXFP4  # (raw packed b is refused by its checks, naming prepare_weights)
    if sdtype is None or sdtype == torch.float32:
        return Format.FP8_BLOCK128  # (a missing scale is reported by its checks)
    if sdtype in _MX_SCALE_DTYPES:
        return Format.MXFP8_MXFP4 if mxfp4_b else Format.MXFP8
    raise TypeError(
        f"with float8_e4m3fn a, a_scale must be float32 (DeepSeek 1x128 blocks) or float8_e8m0fnu / "
        f"uint8 (MXFP8, blocked 128x4 layout); got {sdtype}"
    )


def logical_k(fmt: Format, a: torch.Tensor) -> int:
    """K in elements: NVFP4 packs two per byte."""
    return 2 * a.shape[2] if fmt is Format.NVFP4 else a.shape[2]


def blocked_scale_shape(fmt: Format, num_experts: int, rows: int, k: int) -> tuple:
    """(E, ceil(rows/128), ceil(K/vec/4), 32, 4, 4): ``blockscale.to_blocked_scales``' layout."""
    cols = -(-k // fmt.sf_vec_size)
    return (num_experts, -(-rows // _ATOM_ROWS), -(-cols // _ATOM_COLS), 32, 4, 4)


def _scale_dtypes(fmt: Format) -> tuple:
    return (FP8,) if fmt is Format.NVFP4 else _MX_SCALE_DTYPES


def _check_scale(name: str, t, fmt: Format, want: tuple, rows_name: str) -> None:
    if t is None:
        raise ValueError(f"{fmt.value} operands need {name}: blocked scales of shape {want} "
                         f"(flashgemm.blockscale.to_blocked_scales); got None")
    check_tensor(name, t, 6, _scale_dtypes(fmt))
    if tuple(t.shape) != want:
        raise ValueError(
            f"{name} must have shape (E, ceil({rows_name}/128), ceil(K/{fmt.sf_vec_size}/4), 32, 4, 4) "
            f"= {want} (the 128x4-atom layout of blockscale.to_blocked_scales), got {tuple(t.shape)}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the blocked layout is read as bytes), "
                         f"got strides {tuple(t.stride())}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} base address must be 16-byte aligned")


def check_alpha(fmt: Format, alpha, num_experts: int) -> None:
    """NVFP4 needs alpha (float32 [E], contiguous); no other format takes it."""
    if fmt is not Format.NVFP4:
        if alpha is not None:
            raise ValueError(
                f"alpha is only for NVFP4 operands (1 / (g_a * g_b) per expert); the {fmt.value} "
                "kernels take none, so pass alpha=None"
            )
        return
    if alpha is None:
        raise ValueError(
            "NVFP4 operands need alpha: float32 [E] = 1 / (g_a * g_b) of the global scales "
            "(flashgemm.blockscale.nvfp4_alpha); pass torch.ones(E) if both global scales are 1"
        )
    check_tensor("alpha", alpha, 1, (torch.float32,))
    if alpha.shape[0] != num_experts:
        raise ValueError(f"alpha must have E={num_experts} entries (one per expert), got {alpha.shape[0]}")
    if alpha.stride(0) != 1 and num_experts > 1:
        raise ValueError(f"alpha must be contiguous, got stride {alpha.stride(0)}")


def validate_blockscaled_args(
    fmt: Format, a, b, out, masked_m, a_scale, b_scale, alpha=None
) -> tuple[int, int, int, int]:
    """Every metadata check of an MXFP8 / NVFP4 / MXFP8_MXFP4 call. Returns
    (E, max_m, N, K), K in elements (twice the packed bytes for NVFP4)."""
    if not fmt.block_scaled:
        raise ValueError(f"validate_blockscaled_args is for MXFP8 / NVFP4 / MXFP8_MXFP4, got {fmt.value}")
    mxfp4_b = fmt is Format.MXFP8_MXFP4
    if mxfp4_b and isinstance(b, torch.Tensor) and b.dtype == torch.int8:
        raise TypeError("b is int8 (mxfp4.prepare_weights' layout, for Hopper's conversion); Blackwell's "
                        "mxfp8_mxfp4 kernel reads the checkpoint's packed e2m1 blocks, rows zero-padded: pass "
                        "b, b_scale = flashgemm.mxfp4.blackwell_weights(packed, scales) "
                        "(uint8 [E, N, ceil(K/128) * 64])")
    check_tensor("a", a, 3, _FP4_BYTES if fmt is Format.NVFP4 else (FP8,))
    check_tensor("b", b, 3, _FP4_BYTES if fmt in (Format.NVFP4, Format.MXFP8_MXFP4) else (FP8,))
    check_tensor("masked_m", masked_m, 1, (torch.int32,))
    e_count, max_m, _ = a.shape
    k = logical_k(fmt, a)
    n, b_k = check_expert_dims(a, b)
    if mxfp4_b:
        if b_k != blackwell_row_bytes(k):
            raise ValueError(f"b.shape[2] must be ceil(K/128) * 64 = {blackwell_row_bytes(k)} (two e2m1 codes per "
                             f"byte, each row zero-padded to whole 128-value pieces for the unpacking TMA: "
                             f"flashgemm.mxfp4.blackwell_weights; K = a.shape[2] = {k}), got {b_k}")
    elif b_k != a.shape[2]:
        packed = " (2 e2m1 per byte)" if fmt is Format.NVFP4 else ""
        raise ValueError(f"b.shape[2] must equal a.shape[2] = {a.shape[2]}{packed}, got {b_k}")
    if k < fmt.k_align or k % fmt.k_align:
        what = "2 * a.shape[2]" if fmt is Format.NVFP4 else "a.shape[2]"
        raise ValueError(f"K ({what} = {k}) must be a positive multiple of {fmt.k_align} for "
                         f"{fmt.value} (whole scale blocks, 16-byte rows)")
    if mxfp4_b:
        _check_padded_b(b)
    if n < _OUT_ALIGN or n % _OUT_ALIGN:
        raise ValueError(f"N (b.shape[1]) must be a positive multiple of {_OUT_ALIGN} "
                         f"(16-byte bf16 output rows), got {n}")
    check_masked_m(masked_m, e_count)
    _check_scale("a_scale", a_scale, fmt, blocked_scale_shape(fmt, e_count, max_m, k), "max_m")
    _check_scale("b_scale", b_scale, fmt, blocked_scale_shape(fmt, e_count, n, k), "N")
    check_alpha(fmt, alpha, e_count)
    _check_out_and_operands(a, b, out, (e_count, max_m, n),
                            {"masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale, "alpha": alpha})
    return e_count, max_m, n, k


def _check_padded_b(b) -> None:
    """The unpacking TMA's own rules for packed e2m1 b: a 32-byte-aligned
    base and row and expert strides."""
    if b.data_ptr() % 32:
        raise ValueError("b base address must be 32-byte aligned for mxfp8_mxfp4 (the unpacking TMA)")
    for dim in (0, 1):
        if b.stride(dim) % 32 and b.shape[dim] > 1:
            raise ValueError(f"b.stride({dim}) must be a multiple of 32 bytes for mxfp8_mxfp4 (the unpacking "
                             f"TMA), got {b.stride(dim)}")


def validate_mxfp4_weight_args(a, b, out, masked_m, a_scale, b_scale,
                               fmt: Format = Format.FP8_MXFP4) -> tuple[int, int, int, int]:
    """Every metadata check of an FP8_MXFP4 / BF16_MXFP4 call: a and a_scale
    as for 1x128 fp8, or bf16 a and no a_scale; b int8 [E, N, K/2] and
    b_scale [E, N, K/32] E8M0 bytes stored N contiguous, as
    ``mxfp4.prepare_weights`` makes them. Returns (E, max_m, N, K)."""
    fp8 = fmt is Format.FP8_MXFP4
    check_tensor("a", a, 3, (FP8,) if fp8 else (torch.bfloat16,))
    if isinstance(b, torch.Tensor) and b.dtype in _FP4_BYTES:
        raise TypeError(f"MXFP4 weights ({b.dtype}) go to the Hopper kernel in its own layout: pass "
                        "b, b_scale = flashgemm.mxfp4.prepare_weights(packed, scales) (int8 b), made once per weight "
                        "(Blackwell reads the packed bytes with MXFP8 activations: flashgemm.mxfp4.blackwell_weights)")
    check_tensor("b", b, 3, (torch.int8,))
    check_tensor("masked_m", masked_m, 1, (torch.int32,))
    e_count, max_m, k = a.shape
    n, b_k = check_expert_dims(a, b)
    if 2 * b_k != k:
        raise ValueError(f"b.shape[2] must be K/2 = {k // 2} (two e2m1 codes per byte; K = a.shape[2] = {k}), "
                         f"got {b_k}")
    if k < 32 or k % 32:
        raise ValueError(f"K (a.shape[2]) must be a positive multiple of 32 for MXFP4 weights (whole E8M0 "
                         f"groups, 16-byte packed rows), got {k}")
    if n < 16 or n % 16:
        raise ValueError(f"N (b.shape[1]) must be a positive multiple of 16 for MXFP4 weights (16-byte rows "
                         f"of the N-contiguous exponents), got {n}")
    check_masked_m(masked_m, e_count)
    if not fp8:
        if a_scale is not None:
            raise ValueError("bfloat16 a takes no a_scale (the MXFP4 weights carry their own scales); pass None")
    elif a_scale is None:
        raise ValueError("float8_e4m3fn a needs a_scale: float32 [E, max_m, ceil(K/128)]; got None")
    else:
        check_tensor("a_scale", a_scale, 3, (torch.float32,))
        check_a_scale_shape(a_scale, e_count, max_m, k)
        check_a_scale_strides(a_scale)
    if b_scale is None:
        raise ValueError("MXFP4 weights need b_scale: E8M0 exponents [E, N, K/32] stored N contiguous "
                         "(flashgemm.mxfp4.prepare_weights); got None")
    check_tensor("b_scale", b_scale, 3, _MX_SCALE_DTYPES)
    want_b = (e_count, n, k // 32)
    if tuple(b_scale.shape) != want_b:
        raise ValueError(f"b_scale must have shape (E, N, K/32) = {want_b}, got {tuple(b_scale.shape)}")
    sst = b_scale.stride()
    if sst[1] != 1:
        raise ValueError("b_scale must be stored N contiguous (stride(1) == 1; flashgemm.mxfp4.prepare_weights "
                         f"gives that layout from a checkpoint's scales), got strides {tuple(sst)}")
    for dim in (0, 2):
        if sst[dim] % 16 or (sst[dim] == 0 and b_scale.shape[dim] > 1):
            raise ValueError(f"b_scale.stride({dim}) must be a nonzero multiple of 16 bytes (TMA), got {sst[dim]}")
    if b_scale.data_ptr() % 16:
        raise ValueError("b_scale base address must be 16-byte aligned")
    _check_out_and_operands(a, b, out, (e_count, max_m, n),
                            {"masked_m": masked_m, "a_scale": a_scale, "b_scale": b_scale})
    return e_count, max_m, n, k


def _check_out_and_operands(a, b, out, out_shape: tuple, others: dict) -> None:
    """out bf16 of ``out_shape`` (if given), a and b TMA operands, and out
    sharing no byte with a, b or ``others``."""
    if out is not None:
        check_tensor("out", out, 3, (torch.bfloat16,))
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape (E, max_m, N) = {out_shape}, got {tuple(out.shape)}")
    span_a = _check_tma_operand("a", a, "K")
    span_b = _check_tma_operand("b", b, "K")
    if out is not None:
        span_out = _check_tma_operand("out", out, "N", is_input=False)
        _check_no_self_overlap("out", out)
        check_no_alias("out", span_out, {"a": span_a, "b": span_b, **others})


def format_of(fmt=None, fp8: bool = False) -> Format:
    """``signal_layout``'s format argument: a Format, its value ("mxfp8", ...),
    or None with ``fp8`` (the older flag) choosing FP8_BLOCK128 or BF16."""
    if fmt is None:
        return Format.FP8_BLOCK128 if fp8 else Format.BF16
    if isinstance(fmt, str):
        try:
            fmt = Format(fmt)
        except ValueError:
            raise ValueError(f"fmt must be one of {[f.value for f in Format]}, got {fmt!r}") from None
    if not isinstance(fmt, Format):
        raise TypeError(f"fmt must be a flashgemm.Format or its name, got {type(fmt).__name__}")
    if fp8 and fmt is not Format.FP8_BLOCK128:
        raise ValueError(f"fp8=True contradicts fmt={fmt.value!r}; pass fmt alone")
    return fmt
