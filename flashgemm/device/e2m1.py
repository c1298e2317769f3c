"""e2m1 codes to e4m3 bytes on the device (Hopper's tensor cores take no
fp4: 4-bit weights become e4m3 before the MMA).

Every e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) is an e4m3
value, so the conversion is a table lookup: eight codes, one 32-bit word with
element i in nibble i (element 2j in the low nibble of byte j, as MXFP4
packs them), become eight e4m3 bytes in two words. Per four values, one
``prmt`` looks the magnitudes up in the positive table, one in the negative
table, and a third picks, byte by byte, by the code's sign bit (the selector
nibble's own bit 3 would ask prmt to replicate a sign instead, so the magnitude
selectors are masked to 3 bits).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

# e4m3 bytes of the e2m1 magnitudes by code: 0x00, 0x30 (0.5), 0x38, 0x3C, 0x40 (2), 0x44, 0x48, 0x4C (6)
POS_LO, POS_HI = 0x3C383000, 0x4C484440
SIGN = 0x80808080
PICK = 0x32103210  # byte j from the positive word; + 4 in nibble j picks the negative one


@cute.jit
def e2m1x8_to_e4m3x8(word: Int32):
    """(low, high): the e4m3 bytes of codes 0-3 and of codes 4-7 of ``word``."""
    mags = word & Int32(0x77777777)
    pick = (((word & Int32(0x88888888 - (1 << 32))) >> 1) & Int32(0x44444444)) | Int32(PICK)
    return _four(mags, pick), _four(mags >> 16, pick >> 16)


@cute.jit
def _four(sel: Int32, pick: Int32) -> Int32:
    """The e4m3 bytes of the four codes whose magnitudes are ``sel``'s low nibbles."""
    pos = Int32(cute.arch.prmt(Int32(POS_LO), Int32(POS_HI), sel))
    neg = Int32(cute.arch.prmt(Int32((POS_LO | SIGN) - (1 << 32)), Int32((POS_HI | SIGN) - (1 << 32)), sel))
    return Int32(cute.arch.prmt(pos, neg, pick))
