"""Block-scaled operand formats of Blackwell's tensor cores: MXFP8 and NVFP4.

Pure torch (CPU or GPU): quantize / dequantize helpers, the tiled layout the
block-scaled GEMMs read their scale factors in, and a float reference of the
masked grouped GEMM on such operands.

MXFP8 (OCP Microscaling v1.0): e4m3 elements, one E8M0 scale per block of 32
along K. An E8M0 byte ``b`` is the power of two ``2**(b - 127)``, ``b = 255``
is NaN, and ``x ~= float(q) * 2**(b - 127)``. A block's exponent is the
smallest ``e`` with ``amax / 2**e <= 448``, clamped to E8M0's range [-127, 127]::

    e = max(-127, ceil(log2(amax / 448)))

so no element saturates. The spec's suggestion, ``floor(log2(amax)) - 8``, is
the same exponent or one less (the latter when amax's mantissa exceeds 1.75,
where it clamps the largest elements to 448). An all-zero block gets
``e = -127`` (byte 0). A block holding NaN or +-inf gets the NaN scale (byte
255) and NaN elements: it dequantizes to NaN, whatever its other elements.
fp8 activations quantized 1x128 with power-of-two scales (DeepSeek's UE8M0
recipe) are MXFP8 operands as they are: :func:`mx_scales_from_block128`
repeats each scale, as its E8M0 byte, over its four 32-blocks.

NVFP4: e2m1 elements (magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign),
one e4m3 scale ``s_b`` per block of 16 along K, and one float32 global scale
``g`` per matrix (per expert)::

    g   = 448 * 6 / amax(x)                   (1 for an all-zero matrix)
    s_b = e4m3(amax_block / 6 * g)            (saturates at 448)
    q   = rne_e2m1(x * g / s_b)               (saturates at +-6; 0 where s_b == 0)
    x  ~= e2m1(q) * s_b / g

A 4-bit code holds the sign in bit 3 and the magnitude's index (0-7) in bits
0-2 (the e2m1 bit pattern); zero is always code 0. Codes are packed two per
byte along K, the even column in the low nibble. Rounding is to nearest, ties
to the even index. NVFP4 has no NaN or inf: quantizing one is an error.

A block-scaled GEMM multiplies the block-dequantized operands (``e2m1 * s_b``)
and scales the product by a per-expert ``alpha``; for NVFP4
``alpha = 1 / (g_a * g_b)`` (:func:`nvfp4_alpha`) yields the product of the
dequantized operands.

Scale-factor layout (CUTLASS ``Sm1xxBlockScaledConfig`` / FlashInfer's
``grouped_gemm_nt_masked``): scales of logical shape [L, M, S] (S = K / vec)
are padded to M a multiple of 128 and S a multiple of 4 and stored as 128x4
atoms, ``(m, s)`` with ``m = 128*rm + 32*m4 + m32`` and ``s = 4*rk + s4`` at
``[l, rm, rk, m32, m4, s4]`` of a contiguous (L, ceil(M/128), ceil(S/4), 32, 4, 4)
tensor: within an atom the byte offset is ``16*m32 + 4*m4 + s4``. Padding is
all-zero bytes for every dtype: 0.0 for e4m3, 2**-127 for E8M0 (not the
"neutral" 127 = 2**0), so a padded scale contributes nothing against zero-filled
data and at most 448 * 2**-127 per element against garbage.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

MX_BLOCK = 32
NVFP4_BLOCK = 16
FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude by index
# rounding thresholds between neighbouring magnitudes (a tie goes to the even index)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E4M3_NAN_BYTE = 0x7F
_FP32_MAX = torch.finfo(torch.float32).max

SF_ATOM_M = 128  # rows of a scale atom: 4 groups of 32
SF_ATOM_S = 4  # scale columns of an atom


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2.0**e in float64, exactly, for integer e in [-1022, 1023] (from the bits)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _check_float(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")


def _as_bytes(t: torch.Tensor, name: str, dtypes) -> torch.Tensor:
    """``t`` viewed as uint8, after checking its dtype is one of ``dtypes``."""
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _check_scale_shape(scales: torch.Tensor, expected, name: str, why: str) -> None:
    if tuple(scales.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({why}), got {tuple(scales.shape)}")


# ---------------------------------------------------------------- MXFP8


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float32 ``2**(b - 127)``, NaN for 255."""
    b = _as_bytes(scales, "scales", (torch.uint8, torch.float8_e8m0fnu)).to(torch.int64)
    value = _pow2_f64(b - E8M0_BIAS).float()  # 2**-127 is a float32 subnormal: exact
    return torch.where(b == E8M0_NAN, torch.full_like(value, float("nan")), value)


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e with amax / 2**e <= 448, clamped to [-127, 127] (int64).

    With amax = mant * 2**ex (mant in [0.5, 1)) and 448 = 0.875 * 2**9 it is
    ex - 9 when mant <= 0.875, else ex - 8: exact, no log2 rounding."""
    mant, ex = torch.frexp(amax)
    e = ex.to(torch.int64) - 9 + (mant > FP8_E4M3_MAX / 512).to(torch.int64)
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mxfp8(x: torch.Tensor, *, dim: int = -1):
    """x [..., M, K] -> (q float8_e4m3fn [..., M, K], scales uint8 [..., M, ceil(K/32)]).

    Blocks of 32 run along ``dim`` (K by default; a partial last block is
    allowed); ``scales`` holds the biased E8M0 exponent of each block, in the
    position of ``dim``. See the module docstring for the exponent rule and NaN.
    """
    _check_float(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    xt = x.movedim(dim, -1).float()
    k = xt.shape[-1]
    blocks = _cdiv(k, MX_BLOCK)
    xp = torch.nn.functional.pad(xt, (0, blocks * MX_BLOCK - k)).unflatten(-1, (blocks, MX_BLOCK))
    amax = xp.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    e = _mx_exponent(torch.where(bad, torch.zeros_like(amax), amax))
    # x * 2**-e is exact (float32 loses bits only far below e4m3's range): one rounding, to e4m3
    q = (xp.double() * _pow2_f64(-e).unsqueeze(-1)).float().to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(bad.unsqueeze(-1), torch.full_like(q, _E4M3_NAN_BYTE), q)
    q = q.flatten(-2)[..., :k].view(torch.float8_e4m3fn)
    scales = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)
    return q.movedim(-1, dim).contiguous(), scales.movedim(-1, dim).contiguous()


def mx_scales_from_block128(a_scale: torch.Tensor, k: int) -> torch.Tensor:
    """1x128 activation scales that are powers of two (DeepSeek's UE8M0
    recipe), float32 [..., ceil(K/128)] -> the same scales as E8M0 bytes
    [..., ceil(K/32)], each repeated over its four 32-blocks: the fp8 values
    then are MXFP8 operands, unchanged. Anything but a power of two in
    [2**-127, 2**127] is refused (it has no exact E8M0 form). The check reads
    the scales on the host (a sync): a conversion step outside a captured
    CUDA graph, not a per-step op of one."""
    _check_float(a_scale, "a_scale")
    if a_scale.dim() == 0 or a_scale.shape[-1] != _cdiv(k, 128):
        raise ValueError(f"a_scale must be [..., ceil(K/128)] = [..., {_cdiv(k, 128)}] for K = {k}, got "
                         f"{tuple(a_scale.shape)}")
    sc = a_scale.float()
    mant, ex = torch.frexp(sc)
    exact = torch.isfinite(sc) & (mant == 0.5) & (ex - 1 >= -E8M0_BIAS) & (ex - 1 <= E8M0_BIAS)
    if sc.numel() and not bool(exact.all()):  # (one read of the scales: host-side conversion)
        bad = tuple(int(i) for i in (~exact).nonzero()[0])
        raise ValueError(f"a_scale[{bad}] = {float(sc[bad])} is not a power of two in [2**-127, 2**127]: it has "
                         "no exact E8M0 form (quantize with power-of-two scales, or use quantize_mxfp8)")
    e8 = (ex.to(torch.int64) - 1 + E8M0_BIAS).to(torch.uint8)
    return e8.repeat_interleave(4, dim=-1)[..., :_cdiv(k, MX_BLOCK)].contiguous()


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp8`: float32 ``q * 2**(scales - 127)``.

    ``scales`` may be uint8 or float8_e8m0fnu, shaped like q with ``dim``
    reduced to ceil(size / 32).
    """
    _as_bytes(q, "q", (torch.float8_e4m3fn,))
    if q.dim() == 0:
        raise ValueError("q must have at least one dimension")
    expected = list(q.shape)
    k = expected[dim]
    expected[dim] = _cdiv(k, MX_BLOCK)
    why = f"one E8M0 byte per {MX_BLOCK} elements of q along dim {dim}"
    _check_scale_shape(scales, expected, "scales", why)
    qt, st = q.movedim(dim, -1), scales.movedim(dim, -1)
    expanded = e8m0_to_float(st).repeat_interleave(MX_BLOCK, dim=-1)[..., :k]
    return (qt.float() * expanded).movedim(-1, dim)


# ---------------------------------------------------------------- NVFP4


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., K] (integer, 0-15) -> uint8 [..., K/2], even column in the low nibble."""
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes must have an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("codes must lie in [0, 15]")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (or float4_e2m1fn_x2) [..., K/2] -> uint8 codes [..., K]; inverse of :func:`pack_e2m1`."""
    p = _as_bytes(packed, "packed", (torch.uint8, torch.float4_e2m1fn_x2))
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> float32 e2m1 values (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    mag = table[c & 7]
    return torch.where(c >= 8, -mag, mag)


def float_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit codes (uint8): round to nearest, ties to the even index, saturating at 6."""
    a = v.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=a.dtype, device=a.device)
    idx = torch.searchsorted(mids, a.contiguous())  # count of midpoints < a
    tie = (idx < len(_E2M1_MIDPOINTS)) & (mids[idx.clamp(max=len(_E2M1_MIDPOINTS) - 1)] == a)
    idx = idx + (tie & (idx % 2 == 1)).to(idx.dtype)
    sign = ((v < 0) & (idx > 0)).to(idx.dtype) << 3
    return (idx | sign).to(torch.uint8)


def _batch_global(global_scale, batch, device, name: str) -> torch.Tensor:
    """``global_scale`` as float32 of shape ``batch`` (a float or a tensor of shape () or ``batch``)."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.dim() and tuple(g.shape) != tuple(batch):
        raise ValueError(f"{name} must be a scalar or have shape {tuple(batch)} (one per matrix), "
                         f"got {tuple(g.shape)}")
    if not bool(torch.all(torch.isfinite(g) & (g > 0))):
        raise ValueError(f"{name} must be finite and positive")
    return g.expand(batch).contiguous()


def quantize_nvfp4(x: torch.Tensor, *, global_scale=None):
    """x [..., M, K] -> (packed uint8 [..., M, K/2], block_scales float8_e4m3fn [..., M, K/16],
    global_scale float32 [...]).

    One global scale per matrix: a 0-d tensor for a 2-D x, [E] for [E, M, K].
    ``global_scale`` overrides the default 448 * 6 / amax (a float, or a
    tensor of shape () or x.shape[:-2]). K must be a multiple of 16.
    """
    _check_float(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x must be [..., M, K] with at least 2 dimensions, got shape {tuple(x.shape)}")
    *batch, m, k = x.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"K (x.shape[-1] = {k}) must be a multiple of {NVFP4_BLOCK} for NVFP4")
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("x holds NaN or inf, which NVFP4 cannot encode")
    if global_scale is None:
        amax = xf.abs().amax(dim=(-2, -1)) if xf.numel() else xf.new_zeros(batch)
        g = (FP8_E4M3_MAX * E2M1_MAX / amax).clamp(max=_FP32_MAX)
        g = torch.where(amax > 0, g, torch.ones_like(g))
    else:
        g = _batch_global(global_scale, batch, x.device, "global_scale")
    gb = g[..., None, None, None]
    xb = xf.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK))
    s = (xb.abs().amax(dim=-1, keepdim=True) / E2M1_MAX * gb).clamp(max=FP8_E4M3_MAX)
    s_e4m3 = s.to(torch.float8_e4m3fn)
    sf = s_e4m3.float()
    v = torch.where(sf > 0, xb * gb / sf, torch.zeros_like(xb))  # 0/0 only in the unused branch
    codes = float_to_e2m1(v).flatten(-2)
    return pack_e2m1(codes), s_e4m3.squeeze(-1).contiguous(), g.contiguous()


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`: float32 ``e2m1 * s_b / g`` of shape [..., M, K]."""
    codes = unpack_e2m1(packed)
    if packed.dim() < 2:
        raise ValueError(f"packed must be [..., M, K/2], got shape {tuple(packed.shape)}")
    k = codes.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"K (2 * packed.shape[-1] = {k}) must be a multiple of {NVFP4_BLOCK} for NVFP4")
    _as_bytes(block_scales, "block_scales", (torch.float8_e4m3fn,))
    _check_scale_shape(block_scales, (*packed.shape[:-1], k // NVFP4_BLOCK), "block_scales",
                       f"one e4m3 scale per {NVFP4_BLOCK} elements")
    g = _batch_global(global_scale, packed.shape[:-2], packed.device, "global_scale")
    raw = e2m1_to_float(codes) * block_scales.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return raw / g[..., None, None]


def nvfp4_alpha(global_a, global_b) -> torch.Tensor:
    """alpha = 1 / (g_a * g_b), float32 (broadcast, e.g. [E] x [E] -> [E]).

    The GEMM sums ``(e2m1_a * s_a) * (e2m1_b * s_b)``; since
    ``a ~= e2m1_a * s_a / g_a`` and likewise for b, scaling that sum by alpha
    gives the product of the dequantized operands.
    """
    ga = torch.as_tensor(global_a, dtype=torch.float32)
    gb = torch.as_tensor(global_b, dtype=torch.float32, device=ga.device)
    return (1.0 / (ga.double() * gb.double())).float()


# ---------------------------------------------------------------- scale layout


def blocked_scale_shape(l: int, m: int, s: int):
    """Shape of the tiled scale tensor for logical [l, m, s] scales: (l, rm, rk, 32, 4, 4)."""
    for name, v in (("l", l), ("m", m), ("s", s)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return (l, _cdiv(m, SF_ATOM_M), _cdiv(s, SF_ATOM_S), 32, 4, 4)


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major scales [L, M, S] -> the contiguous tiled tensor (L, rm, rk, 32, 4, 4).

    ``(l, m, s)`` lands at ``[l, m // 128, s // 4, m % 32, (m % 128) // 32, s % 4]``;
    the padding (M up to 128*rm, S up to 4*rk) is zero bytes. Any dtype.
    """
    if scales.dim() != 3:
        raise ValueError(f"scales must be [L, M, S], got shape {tuple(scales.shape)}")
    l, m, s = scales.shape
    shape = blocked_scale_shape(l, m, s)
    rm, rk = shape[1], shape[2]
    src = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = src.new_zeros(l, rm * SF_ATOM_M, rk * SF_ATOM_S)
    padded[:, :m, :s] = src
    # M = (rm, m4, m32), S = (rk, s4) -> (l, rm, rk, m32, m4, s4)
    out = padded.view(l, rm, 4, 32, rk, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    return out.view(scales.dtype) if scales.element_size() == 1 else out


def from_blocked_scales(blocked: torch.Tensor, m: int, s: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_scales`: (L, rm, rk, 32, 4, 4) -> contiguous [L, m, s]."""
    if blocked.dim() != 6:
        raise ValueError(f"blocked must be (L, rm, rk, 32, 4, 4), got shape {tuple(blocked.shape)}")
    l = blocked.shape[0]
    _check_scale_shape(blocked, blocked_scale_shape(l, m, s), "blocked", f"tiled scales for m={m}, s={s}")
    rm, rk = blocked.shape[1], blocked.shape[2]
    src = blocked.view(torch.uint8) if blocked.element_size() == 1 else blocked
    out = src.permute(0, 1, 4, 3, 2, 5).reshape(l, rm * SF_ATOM_M, rk * SF_ATOM_S)[:, :m, :s].contiguous()
    return out.view(blocked.dtype) if blocked.element_size() == 1 else out


# ---------------------------------------------------------------- reference GEMM


def _block_dequant(t: torch.Tensor, scales: torch.Tensor, fmt: str, name: str) -> torch.Tensor:
    """An operand [E, rows, K(/2)] and its row-major scales -> float32 [E, rows, K]
    (NVFP4 without the global scale: ``e2m1 * s_b``)."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be [E, rows, K], got shape {tuple(t.shape)}")
    sname = f"{name}_scales"
    if fmt == "mxfp4":  # e2m1 packed along K, one E8M0 byte per 32
        t = _as_bytes(t, name, (torch.uint8, torch.float4_e2m1fn_x2))
        _as_bytes(scales, sname, (torch.uint8, torch.float8_e8m0fnu))
        _check_scale_shape(scales, (*t.shape[:-1], _cdiv(2 * t.shape[-1], MX_BLOCK)), sname,
                           f"one E8M0 byte per {MX_BLOCK} elements of {name}")
        return e2m1_to_float(unpack_e2m1(t)) * e8m0_to_float(scales).repeat_interleave(MX_BLOCK, dim=-1)
    if fmt == "mxfp8":
        _as_bytes(t, name, (torch.float8_e4m3fn,))
        _as_bytes(scales, sname, (torch.uint8, torch.float8_e8m0fnu))
        _check_scale_shape(scales, (*t.shape[:-1], _cdiv(t.shape[-1], MX_BLOCK)), sname,
                           f"one E8M0 byte per {MX_BLOCK} elements of {name}")
        return dequantize_mxfp8(t, scales)
    _as_bytes(t, name, (torch.uint8, torch.float4_e2m1fn_x2))
    k = 2 * t.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"K (2 * {name}.shape[-1] = {k}) must be a multiple of {NVFP4_BLOCK} for NVFP4")
    _as_bytes(scales, sname, (torch.float8_e4m3fn,))
    _check_scale_shape(scales, (*t.shape[:-1], k // NVFP4_BLOCK), sname,
                       f"one e4m3 scale per {NVFP4_BLOCK} elements of {name}")
    return e2m1_to_float(unpack_e2m1(t)) * scales.float().repeat_interleave(NVFP4_BLOCK, dim=-1)


def grouped_gemm_nt_masked_blockscaled_ref(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    fmt: str,
    alpha: Optional[Union[float, torch.Tensor]] = None,
) -> torch.Tensor:
    """out[e, :m_e] = alpha[e] * A_e[:m_e] @ B_e.T on the block-dequantized operands,
    float32 [E, max_m, N]; rows >= m_e are zero, m_e = clamp(masked_m[e], 0, max_m).

    ``fmt="mxfp8"``: a [E, max_m, K] / b [E, N, K] float8_e4m3fn with uint8 (or
    float8_e8m0fnu) scales [E, rows, ceil(K/32)]. ``fmt="nvfp4"``: a [E, max_m, K/2]
    / b [E, N, K/2] packed e2m1 with float8_e4m3fn scales [E, rows, K/16]; the
    global scales enter only through alpha (pass :func:`nvfp4_alpha`).
    ``fmt="mxfp8_mxfp4"``: a as for MXFP8, b [E, N, K/2] packed e2m1 (MXFP4)
    with uint8 (or float8_e8m0fnu) scales [E, N, K/32]. Scales are row-major (not the tiled layout). ``alpha``: None (1), a float
    or a tensor of shape () or [E]. The products are accumulated in float64.
    """
    if fmt not in ("mxfp8", "nvfp4", "mxfp8_mxfp4"):
        raise ValueError(f"fmt must be 'mxfp8', 'nvfp4' or 'mxfp8_mxfp4', got {fmt!r}")
    a_deq = _block_dequant(a, a_scales, "mxfp8" if fmt == "mxfp8_mxfp4" else fmt, "a")
    b_deq = _block_dequant(b, b_scales, "mxfp4" if fmt == "mxfp8_mxfp4" else fmt, "b")
    e_count, max_m, k = a_deq.shape
    if b_deq.shape[0] != e_count or b_deq.shape[2] != k:
        raise ValueError(f"b must match a in experts (E={e_count}) and K ({k}), got shape {tuple(b.shape)}")
    if tuple(masked_m.shape) != (e_count,):
        raise ValueError(f"masked_m must have shape ({e_count},), got {tuple(masked_m.shape)}")
    al = torch.ones(e_count, dtype=torch.float64) if alpha is None else torch.as_tensor(alpha).double().cpu()
    if al.dim() and tuple(al.shape) != (e_count,):
        raise ValueError(f"alpha must be a scalar or have shape ({e_count},), got {tuple(al.shape)}")
    al = al.expand(e_count).tolist()
    out = torch.zeros(e_count, max_m, b_deq.shape[1], dtype=torch.float32, device=a_deq.device)
    rows = masked_m.to(torch.int64).clamp(0, max_m).tolist()  # host sync: reference only
    for e, m in enumerate(rows):
        if m:
            out[e, :m] = (al[e] * (a_deq[e, :m].double() @ b_deq[e].double().T)).float()
    return out
