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

With bf16 activations the weights become bf16 instead, where every group
exponent folds in exactly: ``bf16_table(e)`` gives, for a group's E8M0 byte
e, the bf16 bit patterns of the eight magnitudes times 2**(e - 127) split
into a table of high bytes and one of low bytes (each an 8-byte ``prmt``
table); ``e2m1x8_to_bf16x8`` looks a word's eight values up in both and
interleaves them into four words of two bf16 each. Exact for e in
[BF16_MIN_E8M0, BF16_MAX_E8M0] (every nonzero entry stays a normal bf16);
below, the table is zero: the group's values are below 2**-124.
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


# bf16 bits of the e2m1 magnitudes by code, as pairs (code 2i low, 2i + 1 high)
BF16_PAIRS = (0x3F000000, 0x3FC03F80, 0x40404000, 0x40C04080)
# the lowest E8M0 byte whose 0.5 * 2**(e - 127) is a normal bf16, the highest
# whose 6 * 2**(e - 127) is finite
BF16_MIN_E8M0, BF16_MAX_E8M0 = 2, 252
_HIGH_BYTES, _LOW_BYTES = 0x7531, 0x6420  # prmt: the odd / even bytes of two words


def bf16_table(e: Int32):
    """(high lo, high hi, low lo, low hi): the high and low bytes of the bf16
    magnitudes 0-3 and 4-7 times 2**(e - 127), e an E8M0 byte in
    [0, BF16_MAX_E8M0]; zeros below BF16_MIN_E8M0. Traced inline."""
    step = (e - Int32(127)) << 7  # one binade of a bf16 bit pattern, per half
    both = step * Int32(0x10001)
    keep = e >= BF16_MIN_E8M0
    pairs = [Int32(_signed(BF16_PAIRS[0])) + (step << 16)]  # code 0 stays zero
    pairs += [Int32(_signed(p)) + both for p in BF16_PAIRS[1:]]
    pairs = [Int32(cutlass.select_(keep, p, Int32(0))) for p in pairs]
    return (Int32(cute.arch.prmt(pairs[0], pairs[1], Int32(_HIGH_BYTES))),
            Int32(cute.arch.prmt(pairs[2], pairs[3], Int32(_HIGH_BYTES))),
            Int32(cute.arch.prmt(pairs[0], pairs[1], Int32(_LOW_BYTES))),
            Int32(cute.arch.prmt(pairs[2], pairs[3], Int32(_LOW_BYTES))))


def e2m1x8_to_bf16x8(word: Int32, table):
    """Four words of two bf16 each (values k0, k1 / k2, k3 / k4, k5 / k6, k7,
    the even one in the low half) of ``word`` (the kernel's layout) looked up
    in ``table`` (``bf16_table``)."""
    mags = word & Int32(0x77777777)
    signs = Int32(_signed(SIGN))
    words = []
    for sel, sign in ((mags, word & signs), (mags >> 16, (word << 4) & signs)):
        high = Int32(cute.arch.prmt(table[0], table[1], sel)) | sign
        low = Int32(cute.arch.prmt(table[2], table[3], sel))
        words.append(Int32(cute.arch.prmt(low, high, Int32(0x5140))))
        words.append(Int32(cute.arch.prmt(low, high, Int32(0x7362))))
    return words
