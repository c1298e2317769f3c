"""e2m1 codes to e4m3 bytes on the device (Hopper's tensor cores take no
fp4: 4-bit weights become e4m3 before the MMA).

Every e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) is an e4m3
value, so the conversion is a table lookup: one ``prmt`` looks four 3-bit
magnitudes up in an 8-byte table (two registers), and the sign is ORed into
bit 7. The words come in the kernel's layout (``mxfp4.prepare_weights``),
which puts each sign where that OR needs it: in a word of eight values k0..k7
nibble j holds k_j's magnitude in its low 3 bits, bit 8j + 7 holds k_j's sign
and bit 8j + 3 holds k_{4+j}'s (j < 4). Seven instructions per eight values:
the magnitude mask, two ``prmt``, one shift for the upper selector, one for
the upper signs, and two sign merges.

``scaled_table(d)`` gives the table of the magnitudes times 2**d, exact for d
in [-8, 6] (the MXFP4 kernel folds each 32-value group's exponent into its
weights this way, docs/design.md "MXFP4 weights on Hopper"): a nonzero
entry's exponent field moves by d while the value stays normal (the upper
four entries down to d = -7, the lower ones to d = -5); below that the
entries are e4m3 subnormals; below -8 the table is zero (the group is
flushed).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# e4m3 bytes of the e2m1 magnitudes by code: 0x00, 0x30 (0.5), 0x38, 0x3C, 0x40 (2), 0x44, 0x48, 0x4C (6)
POS_LO, POS_HI = 0x3C383000, 0x4C484440
SIGN = 0x80808080
# one exponent step in every byte of the table but code 0's
EXP_STEP_LO, EXP_STEP_HI = 0x08080800, 0x08080808
# the lowest shift at which each half of the table is still normal e4m3
LO_NORMAL_SHIFT, HI_NORMAL_SHIFT = -5, -7
# subnormal halves: the lower one at d = -8 (0.5, 1, 1.5 as 1, 2, 3 steps of
# 2**-9), doubled per step up to d = -6; the upper one at d = -8
SUB_LO_AT_MIN, SUB_HI_AT_MIN = 0x03020100, 0x0C080604
MIN_SHIFT, MAX_SHIFT = -8, 6  # 6 * 2**6 = 384 < 448; 0.5 * 2**-8 = 2**-9, e4m3's smallest subnormal


def _signed(word: int) -> int:
    """A 32-bit pattern as the Int32 constant the DSL takes."""
    return word - (1 << 32) if word >= 1 << 31 else word


def scaled_table(d: Int32):
    """(lo, hi): the e4m3 bytes of the e2m1 magnitudes 0-3 and 4-7 times
    2**d (d <= MAX_SHIFT), or zeros below MIN_SHIFT. Selects only, no
    branches (traced inline, so the caller's rows interleave)."""
    lo = Int32(cutlass.select_(d >= LO_NORMAL_SHIFT, Int32(POS_LO) + d * Int32(EXP_STEP_LO),
                               Int32(SUB_LO_AT_MIN) << (d - MIN_SHIFT)))
    hi = Int32(cutlass.select_(d >= HI_NORMAL_SHIFT, Int32(POS_HI) + d * Int32(EXP_STEP_HI), Int32(SUB_HI_AT_MIN)))
    keep = d >= MIN_SHIFT
    return Int32(cutlass.select_(keep, lo, Int32(0))), Int32(cutlass.select_(keep, hi, Int32(0)))


def e2m1x8_to_e4m3x8(word: Int32, table=None):
    """(low, high): the e4m3 bytes of values k0-k3 and k4-k7 of ``word`` (the
    kernel's layout, see the module docstring), looked up in ``table``
    (``scaled_table``; None: the values themselves)."""
    if table is None:
        table = (Int32(POS_LO), Int32(POS_HI))
    mags = word & Int32(0x77777777)
    lo = Int32(cute.arch.prmt(table[0], table[1], mags)) | (word & Int32(_signed(SIGN)))
    hi = Int32(cute.arch.prmt(table[0], table[1], mags >> 16)) | ((word << 4) & Int32(_signed(SIGN)))
    return lo, hi
