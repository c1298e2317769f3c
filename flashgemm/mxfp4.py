"""MXFP4 expert weights (OCP MX, the format of gpt-oss's expert checkpoints):
e2m1 values packed two per byte along K (even column in the low nibble), one
E8M0 exponent per 32 of K.

* ``quantize_mxfp4(w)``: w [..., N, K] -> (packed uint8 [..., N, K/2],
  scales uint8 [..., N, K/32]). The OCP rule: a block's exponent is
  ``floor(log2(amax)) - 2`` (2: e2m1's largest exponent), clamped to
  [-127, 127]; each value is ``w / 2**e`` rounded to the nearest e2m1 value
  (ties to the even code), saturating at +-6. A block with a non-finite value
  gets the NaN scale (255).
* ``dequantize_mxfp4(packed, scales)``: float32 ``e2m1 * 2**(scale - 127)``.
* ``from_checkpoint(blocks, scales)``: gpt-oss's ``*_blocks`` [..., N, K/32,
  16] and ``*_scales`` [..., N, K/32] as (packed, scales) (a view, no copy).
* ``prepare_weights(packed, scales)``: the weights as the Hopper kernel
  takes them (``Format.FP8_MXFP4`` and ``Format.BF16_MXFP4``), made once at load time: int8 [E, N,
  K/2] bytes in the kernel's nibble layout (``device.e2m1``: each sign bit
  where the conversion ORs it in) and the exponents stored N contiguous (one
  TMA box brings a tile's). ``unprepare_weights`` undoes the byte layout.
* ``blackwell_weights(packed, scales)``: the weights as Blackwell's
  ``Format.MXFP8_MXFP4`` kernel takes them: the packed bytes (the tensor
  core reads e2m1 itself), each row zero-padded to ``blackwell_row_bytes(K)``,
  and the exponents in the 128x4-atom layout of ``blockscale.to_blocked_scales``.
* ``dequantize_as_kernel(packed, scales, tile_n)``: what that kernel
  multiplies: ``dequantize_mxfp4`` with the groups more than 14 binades
  below their tile's largest exponent flushed to zero (with bf16
  activations, ``tile_n`` None: the groups below 2**-125 flushed).
* ``to_fp8_blockwise(packed, scales)``: the same values as e4m3 with one
  fp32 scale per 128x128 block (DeepSeek's weight recipe, what the fp8
  kernels take), exactly: within a block, a 32-value group with exponent s
  becomes ``e2m1 * 2**(s - r)`` in e4m3 with the block scale ``2**r``, r the
  block's largest exponent less 6, and every e2m1 value times a power of two
  in [2**-8, 2**6] is an e4m3 value. So the conversion is exact where each
  block's exponents span at most 14; elsewhere it raises (docs/design.md,
  "MXFP4 weights on Hopper").
"""

from __future__ import annotations

from typing import Optional

import torch

from .blockscale import (
    E8M0_BIAS, E8M0_NAN, e2m1_to_float, e8m0_to_float, float_to_e2m1, pack_e2m1, to_blocked_scales, unpack_e2m1,
)

MX_BLOCK = 32  # values of K per E8M0 exponent
E2M1_EMAX = 2  # e2m1's largest exponent (6 = 1.5 * 2**2)
FP8_BLOCK = 128  # rows and columns of one fp32 weight scale (DeepSeek's recipe)
# a group's e2m1 values times 2**d are e4m3 values for d in [-8, 6]: the span
# of exponents one 128x128 block may hold for an exact conversion
FOLD_SPAN = 14
_FOLD_TOP = 6
# the largest E8M0 byte the kernels take: 6 * 2**(252 - 127) is still a finite
# bf16 / fp32 value (no finite weight quantizes above it; 255 is NaN)
MAX_E8M0 = 252
# with bf16 activations, groups whose exponent byte is below this are flushed
# (their values are below 2**-124: not normal bf16 numbers at every code)
BF16_MIN_E8M0 = 2


def _check_k(k: int, name: str) -> None:
    if k % MX_BLOCK:
        raise ValueError(f"{name} must be a multiple of {MX_BLOCK} (one E8M0 scale per {MX_BLOCK} values), got {k}")


def quantize_mxfp4(w: torch.Tensor):
    """w [..., N, K] (K a multiple of 32) -> (packed uint8 [..., N, K/2], scales uint8 [..., N, K/32])."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() < 1:
        raise ValueError("w must have at least one dimension")
    _check_k(w.shape[-1], "w's last dimension K")
    blocks = w.float().unflatten(-1, (w.shape[-1] // MX_BLOCK, MX_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    mant, ex = torch.frexp(torch.where(bad, torch.zeros_like(amax), amax))  # amax = mant * 2**ex, mant in [0.5, 1)
    e = (ex.to(torch.int64) - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)  # floor(log2(amax)) - 2
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e)
    # w * 2**-e is exact in float64; one rounding, to e2m1
    scaled = blocks.double() * torch.pow(2.0, (-e).double()).unsqueeze(-1)
    codes = float_to_e2m1(scaled).flatten(-2)
    scales = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)
    return pack_e2m1(codes), scales.contiguous()


def _check_pair(packed: torch.Tensor, scales: torch.Tensor):
    codes = unpack_e2m1(packed)
    k = codes.shape[-1]
    _check_k(k, "K (2 x packed's last dimension)")
    want = (*codes.shape[:-1], k // MX_BLOCK)
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != want:
        raise ValueError(f"scales must have shape {want} (one E8M0 byte per {MX_BLOCK} values), "
                         f"got {tuple(getattr(scales, 'shape', ()))}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"scales must be uint8 or float8_e8m0fnu E8M0 bytes, got {scales.dtype}")
    return codes, scales.view(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: float32 [..., N, K] (NaN where a scale is 255)."""
    codes, s = _check_pair(packed, scales)
    return e2m1_to_float(codes) * e8m0_to_float(s).repeat_interleave(MX_BLOCK, dim=-1)


def from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor):
    """gpt-oss's ``*_blocks`` [..., N, K/32, 16] uint8 (32 e2m1 codes per row
    of 16 bytes, the even one in the low nibble) and ``*_scales`` [..., N,
    K/32] uint8 (E8M0) -> (packed [..., N, K/2], scales [..., N, K/32])."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() < 2 \
            or blocks.shape[-1] != MX_BLOCK // 2:
        raise ValueError(f"blocks must be uint8 [..., N, K/32, {MX_BLOCK // 2}], got "
                         f"{getattr(blocks, 'dtype', type(blocks).__name__)} {tuple(getattr(blocks, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"scales must have shape {tuple(blocks.shape[:-1])} (one per block of blocks), got "
                         f"{tuple(getattr(scales, 'shape', ()))}")
    packed = blocks.flatten(-2)
    _check_pair(packed, scales)
    return packed, scales.view(torch.uint8)


def prepare_weights(packed: torch.Tensor, scales: torch.Tensor):
    """(packed [E, N, K/2], scales [E, N, K/32]) in the OCP layout (uint8 or
    float4_e2m1fn_x2; uint8 or float8_e8m0fnu) -> (b int8 [E, N, K/2], b_scale
    uint8 [E, N, K/32] stored N contiguous): what ``grouped_gemm_nt_masked``
    takes for MXFP4 weights on Hopper. Byte j of each 4-byte word (values k0..k7)
    is ``mag(k_2j) | sign(k_4+j) << 3 | mag(k_2j+1) << 4 | sign(k_j) << 7``."""
    codes, s = _check_pair(packed, scales)
    if codes.dim() != 3:
        raise ValueError(f"packed must be [E, N, K/2], got {tuple(packed.shape)}")
    over = s > MAX_E8M0
    if s.numel() and bool(over.any()):  # (read once, at load time)
        where = tuple(int(i) for i in over.nonzero()[0])
        raise ValueError(f"scales holds E8M0 byte {int(s[where])} at (expert, row, group) {where}: the kernels "
                         f"take at most {MAX_E8M0} (255 is NaN; above {MAX_E8M0} the values leave the bf16 range)")
    return kernel_bytes(codes), n_contiguous(s)


def blackwell_row_bytes(k: int) -> int:
    """Bytes of one packed row of Blackwell's MXFP4 weights: K rounded up to
    whole 128-value pieces (64 bytes each), as the unpacking TMA reads them."""
    return -(-k // 128) * 64


def blackwell_weights(packed: torch.Tensor, scales: torch.Tensor):
    """(packed [E, N, K/2], scales [E, N, K/32]) in the OCP layout -> (b uint8
    [E, N, ceil(K/128) * 64] contiguous, b_scale uint8 (E, ceil(N/128),
    ceil(K/128), 32, 4, 4)): what ``grouped_gemm_nt_masked`` takes for MXFP4
    weights on sm_100 / sm_103 (``Format.MXFP8_MXFP4``, with MXFP8
    activations). The bytes are the checkpoint's; each row is zero-padded to
    whole 128-value pieces (the TMA that unpacks b reads 64-byte pieces, and
    a's zero fill past K meets zero codes there): K = 2880 gives 1472-byte
    rows. The exponents' padding groups stay outside K, as
    ``blockscale.to_blocked_scales`` pads them."""
    codes, s = _check_pair(packed, scales)
    if codes.dim() != 3:
        raise ValueError(f"packed must be [E, N, K/2], got {tuple(packed.shape)}")
    b = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    pad = blackwell_row_bytes(codes.shape[-1]) - b.shape[-1]
    return torch.nn.functional.pad(b, (0, pad)).contiguous(), to_blocked_scales(s)


def n_contiguous(t: torch.Tensor) -> torch.Tensor:
    """[..., N, C] with the same values, stored N contiguous (allocated
    explicitly: ``.contiguous()`` keeps a size-1 dim's unaligned stride)."""
    out = torch.empty(t.shape[:-2] + (t.shape[-1], t.shape[-2]), dtype=t.dtype, device=t.device)
    out.copy_(t.transpose(-1, -2))
    return out.transpose(-1, -2)


def kernel_bytes(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., K] (K a multiple of 8) -> int8 [..., K/2] in the kernel's layout."""
    words = codes.unflatten(-1, (codes.shape[-1] // 8, 8)).to(torch.int32)
    mag, sign = words & 7, words >> 3
    by = [mag[..., 2 * j] | sign[..., 4 + j] << 3 | mag[..., 2 * j + 1] << 4 | sign[..., j] << 7 for j in range(4)]
    return torch.stack(by, dim=-1).flatten(-2).to(torch.uint8).view(torch.int8)


def unprepare_weights(b: torch.Tensor, b_scale: torch.Tensor):
    """The inverse of :func:`prepare_weights`: (packed uint8, scales uint8 contiguous) in the OCP layout."""
    if not isinstance(b, torch.Tensor) or b.dtype != torch.int8 or b.shape[-1] % 4:
        raise ValueError(f"b must be int8 [..., K/2] from prepare_weights, got {getattr(b, 'dtype', type(b))}")
    by = b.view(torch.uint8).to(torch.int32).unflatten(-1, (b.shape[-1] // 4, 4))
    mag = [None] * 8
    sign = [None] * 8
    for j in range(4):
        mag[2 * j], mag[2 * j + 1] = by[..., j] & 7, (by[..., j] >> 4) & 7
        sign[4 + j], sign[j] = (by[..., j] >> 3) & 1, by[..., j] >> 7
    codes = torch.stack([m | s << 3 for m, s in zip(mag, sign)], dim=-1).flatten(-2)
    return pack_e2m1(codes), b_scale.view(torch.uint8).contiguous()


def dequantize_as_kernel(packed: torch.Tensor, scales: torch.Tensor, tile_n: Optional[int]) -> torch.Tensor:
    """float32 [E, N, K]: the weights the MXFP4 kernels multiply. fp8
    activations (``Format.FP8_MXFP4``): per tile of ``tile_n`` rows and 128
    columns each group's exponent folds into e4m3 relative to the tile's
    largest, 2**(s - s_max + 6); a group more than 14 below is flushed to
    zero (its values are below 2**-12 of the tile's largest magnitude). bf16
    activations (``Format.BF16_MXFP4``, ``tile_n`` None): every value as it
    is, but groups with exponent bytes below ``BF16_MIN_E8M0``, which are
    flushed."""
    values = dequantize_mxfp4(packed, scales)
    s = scales.view(torch.uint8).to(torch.int64)
    if tile_n is None:
        return values * (s >= BF16_MIN_E8M0).repeat_interleave(MX_BLOCK, dim=-1)
    e_count, n, groups = s.shape
    per_tile = FP8_BLOCK // MX_BLOCK
    nt, kt = -(-n // tile_n), -(-groups // per_tile)
    tiles = torch.nn.functional.pad(s, (0, kt * per_tile - groups, 0, nt * tile_n - n))
    top = tiles.view(e_count, nt, tile_n, kt, per_tile).amax(dim=(2, 4))
    top = top.repeat_interleave(tile_n, dim=1)[:, :n].repeat_interleave(per_tile, dim=2)[:, :, :groups]
    keep = (s - (top - _FOLD_TOP)) >= -(FOLD_SPAN - _FOLD_TOP)
    return values * keep.repeat_interleave(MX_BLOCK, dim=-1)


def to_fp8_blockwise(packed: torch.Tensor, scales: torch.Tensor):
    """(packed [E, N, K/2], scales [E, N, K/32]) -> (e4m3 [E, N, K], fp32
    [E, ceil(N/128), ceil(K/128)]) with ``e4m3 * scale`` equal, value for
    value, to ``dequantize_mxfp4``. Raises ValueError naming the first block
    whose exponents span more than 14, or that holds a NaN scale."""
    codes, s = _check_pair(packed, scales)
    if codes.dim() != 3:
        raise ValueError(f"packed must be [E, N, K/2], got {tuple(packed.shape)}")
    e_count, n, k = codes.shape
    exp = s.to(torch.int64) - E8M0_BIAS  # [E, N, K/32]
    nan = s == E8M0_NAN
    if nan.any():
        where = tuple(int(i) for i in nan.nonzero()[0])
        raise ValueError(f"scales holds the E8M0 NaN (255) at (expert, row, group) {where}")
    values = e2m1_to_float(codes)
    nonzero = (values != 0).unflatten(-1, (k // MX_BLOCK, MX_BLOCK)).any(dim=-1)  # groups with a value
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    groups = FP8_BLOCK // MX_BLOCK
    pad_n, pad_g = nb * FP8_BLOCK - n, kb * groups - k // MX_BLOCK
    low = torch.iinfo(torch.int64).min // 2
    live = torch.where(nonzero, exp, torch.full_like(exp, low))
    tiles = torch.nn.functional.pad(live, (0, pad_g, 0, pad_n), value=low).view(e_count, nb, FP8_BLOCK, kb, groups)
    top = tiles.amax(dim=(2, 4))  # [E, nb, kb]: the largest exponent of each block's values
    lowest = torch.where(tiles == low, torch.full_like(tiles, -low), tiles).amin(dim=(2, 4))
    empty = top == low
    span = torch.where(empty, torch.zeros_like(top), top - lowest)
    if (span > FOLD_SPAN).any():
        where = tuple(int(i) for i in (span > FOLD_SPAN).nonzero()[0])
        raise ValueError(f"the 128x128 block (expert, row block, column block) {where} holds E8M0 exponents "
                         f"{int(span[where])} apart, more than the {FOLD_SPAN} an exact e4m3 conversion allows")
    ref = torch.where(empty, torch.zeros_like(top), top - _FOLD_TOP)  # [E, nb, kb]
    per_group = ref.repeat_interleave(FP8_BLOCK, dim=1)[:, :n].repeat_interleave(groups, dim=2)[:, :, : k // MX_BLOCK]
    shift = (exp - per_group).clamp(-60, 60)  # (zero groups may be far off: their values stay 0)
    q = (values * torch.pow(2.0, shift.double()).repeat_interleave(MX_BLOCK, dim=-1)).to(torch.float8_e4m3fn)
    return q, torch.pow(2.0, ref.double()).float()
