"""The device conversion of e2m1 codes to e4m3 bytes (flashgemm.device.e2m1):
its tables and selectors checked exhaustively against a model of PTX prmt on
the CPU, its build checked in PTX for sm_90a, and (on a Hopper GPU) its
results against torch's e4m3 of the same values."""

import pytest
import torch

from flashgemm.blockscale import e2m1_to_float
from flashgemm.device import e2m1


def _prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 in its default mode: byte j of the result is byte (c's
    nibble j & 7) of {b, a}, or that byte's sign replicated when the nibble's
    bit 3 is set."""
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for j in range(4):
        nib = (c >> (4 * j)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * j)
    return out


def _model(word: int) -> tuple:
    """The helper's arithmetic on Python ints (32-bit words)."""
    mags = word & 0x77777777
    pick = (((word & 0x88888888) >> 1) & 0x44444444) | e2m1.PICK
    words = []
    for half in range(2):
        sel = mags >> (16 * half)
        pos = _prmt(e2m1.POS_LO, e2m1.POS_HI, sel)
        neg = _prmt(e2m1.POS_LO | e2m1.SIGN, e2m1.POS_HI | e2m1.SIGN, sel)
        words.append(_prmt(pos, neg, pick >> (16 * half)))
    return tuple(words)


def _expected_bytes(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes of the e2m1 values of ``codes``, by torch's conversion."""
    return e2m1_to_float(codes).to(torch.float8_e4m3fn).view(torch.uint8)


def test_every_four_codes_convert_exactly():
    # every combination of four codes, in both halves of the word
    combos = torch.arange(1 << 16, dtype=torch.int64)
    codes = torch.stack([(combos >> (4 * j)) & 15 for j in range(4)], dim=-1)
    want = _expected_bytes(codes).to(torch.int64)
    want_words = (want * torch.tensor([1, 1 << 8, 1 << 16, 1 << 24])).sum(-1).tolist()
    for combo, expected in zip(combos.tolist(), want_words):
        assert _model(combo)[0] == expected, hex(combo)
        assert _model(combo << 16)[1] == expected, hex(combo)


def _kernel_ptx_and_fn():
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def convert(mIn: cute.Tensor, mOut: cute.Tensor):
        i = cute.arch.block_idx()[0] * 128 + cute.arch.thread_idx()[0]
        if i < cute.size(mIn):
            lo, hi = e2m1.e2m1x8_to_e4m3x8(cutlass.Int32(mIn[i]))
            mOut[2 * i] = lo
            mOut[2 * i + 1] = hi

    @cute.jit
    def launch(mIn: cute.Tensor, mOut: cute.Tensor, blocks: cutlass.Int32, stream):
        convert(mIn, mOut).launch(grid=[blocks, 1, 1], block=[128, 1, 1], stream=stream)

    from flashgemm.jit.options import compile_options

    n = cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    with compile_options(True) as options:
        fn = cute.compile(launch, fake(cutlass.Int32, (n,), assumed_align=4),
                          fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4), cutlass.Int32(1),
                          cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=options)
    return fn.__ptx__, fn


@pytest.fixture(scope="module")
def built():
    from flashgemm.jit.arch import ensure_arch_env

    ensure_arch_env("sm_90a")
    return _kernel_ptx_and_fn()


def test_three_prmt_per_four_values(built):
    ptx, _ = built
    assert ptx.count("prmt.b32") == 6  # one word of 8 codes: two halves of three


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
def test_on_the_gpu_every_code_pair(built, seed):
    _, fn = built
    words = torch.randint(-(1 << 31), 1 << 31, (4096,), dtype=torch.int64)
    words[:256] = torch.arange(256) * 0x01010101 - (torch.arange(256) >= 128).long() * (1 << 32)  # every byte
    src = words.to(torch.int32).cuda()
    out = torch.full((2 * src.numel(),), -1, dtype=torch.int32, device="cuda")
    fn(src, out, (src.numel() + 127) // 128)
    torch.cuda.synchronize()
    codes = torch.stack([(src.cpu().long() >> (4 * j)) & 15 for j in range(8)], dim=-1)
    assert torch.equal(out.cpu().view(torch.uint8).view(-1, 8), _expected_bytes(codes))
