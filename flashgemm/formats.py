"""Operand formats of the masked grouped GEMM (which backend runs each: its
``Backend.formats``).

A format fixes the element type of ``a`` and ``b``, how their scale factors
are shaped and typed, and what the epilogue multiplies in:

* ``BF16``: no scales.
* ``FP8_BLOCK128``: DeepSeek's recipe. e4m3 elements, fp32 scales per 1x128
  block of ``a`` and per 128x128 block of ``b`` (the Hopper call).
* ``MXFP8``: e4m3 elements, one E8M0 scale per 32 of K on both operands.
* ``NVFP4``: e2m1 packed two per byte along K, one e4m3 scale per 16 of K,
  and a per-expert fp32 ``alpha`` (``blockscale.nvfp4_alpha``).
* ``FP8_MXFP4``: 4-bit weights with fp8 activations. ``a`` as in
  FP8_BLOCK128 (e4m3, fp32 scales per 1x128); ``b`` MXFP4: e2m1 two per
  byte along K, one E8M0 exponent per 32 of K, in the layout
  ``mxfp4.prepare_weights`` makes (int8 bytes; exponents N contiguous).
  Hopper converts b to e4m3 in the kernel.
* ``BF16_MXFP4``: 4-bit weights with bf16 activations. ``a`` bf16, no
  scales; ``b`` as in FP8_MXFP4. Hopper converts b to bf16 in the kernel,
  each group's exponent folded in exactly.
* ``MXFP8_MXFP4``: 4-bit weights with MXFP8 activations, Blackwell's
  ``kind::mxf8f6f4``: ``a`` as in MXFP8, ``b`` e2m1 packed two per byte
  along K (a checkpoint's ``blocks``, each row zero-padded to whole 128-value
  pieces: ``mxfp4.blackwell_weights``), E8M0 scales per 32 of K on both, in
  the 128x4-atom layout. The tensor core reads b as it is.

MXFP8 and NVFP4 scales use the 128x4-atom layout of ``blockscale``.
"""

from __future__ import annotations

import enum
from typing import Optional


class Format(enum.Enum):
    BF16 = "bf16"
    FP8_BLOCK128 = "fp8_block128"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"
    FP8_MXFP4 = "fp8_mxfp4"
    BF16_MXFP4 = "bf16_mxfp4"
    MXFP8_MXFP4 = "mxfp8_mxfp4"

    @property
    def sf_vec_size(self) -> Optional[int]:
        """Elements of K that share one scale factor (None without scales)."""
        return {Format.BF16: None, Format.FP8_BLOCK128: 128, Format.MXFP8: 32, Format.NVFP4: 16,
                Format.FP8_MXFP4: 32, Format.BF16_MXFP4: 32, Format.MXFP8_MXFP4: 32}[self]

    @property
    def element_bits(self) -> int:
        """Bits per element of ``a`` (the MMA's operand width)."""
        return {Format.BF16: 16, Format.FP8_BLOCK128: 8, Format.MXFP8: 8, Format.NVFP4: 4, Format.FP8_MXFP4: 8,
                Format.BF16_MXFP4: 16, Format.MXFP8_MXFP4: 8}[self]

    @property
    def weight_bits(self) -> int:
        """Bits per element of ``b`` as stored."""
        return 4 if self.converts_weights or self is Format.MXFP8_MXFP4 else self.element_bits

    @property
    def converts_weights(self) -> bool:
        """MXFP4 weights that Hopper converts to ``a``'s type inside the kernel."""
        return self in (Format.FP8_MXFP4, Format.BF16_MXFP4)

    @property
    def elem_bytes(self):
        """Bytes per element of a and b: an int, or 0.5 for packed NVFP4."""
        bits = self.element_bits
        return bits // 8 if bits % 8 == 0 else bits / 8

    @property
    def tile_k(self) -> int:
        """K depth of one 128-byte swizzle row of an operand tile (for 1x128
        fp8 also one scale block): a Hopper pipeline stage."""
        return 1024 // self.element_bits

    @property
    def promotes(self) -> bool:
        """e4m3 products promoted with fp32 scales per 1x128 of ``a`` (Hopper's fp8 recipe)."""
        return self in (Format.FP8_BLOCK128, Format.FP8_MXFP4)

    @property
    def block_scaled(self) -> bool:
        """Scales applied by the tensor core (Blackwell ``kind::mx*.block_scale``)."""
        return self in (Format.MXFP8, Format.NVFP4, Format.MXFP8_MXFP4)

    @property
    def k_align(self) -> int:
        """K must be a multiple of this (a whole scale block, and 16-byte TMA rows)."""
        return {Format.BF16: 8, Format.FP8_BLOCK128: 128, Format.MXFP8: 32, Format.NVFP4: 32, Format.FP8_MXFP4: 32,
                Format.BF16_MXFP4: 32, Format.MXFP8_MXFP4: 32}[self]
