"""The device conversion of e2m1 codes to e4m3 bytes and to bf16
(flashgemm.device.e2m1): its tables and selectors checked exhaustively
against a model of PTX prmt on the CPU, its build checked in PTX for sm_90a,
and (on a Hopper GPU) its results against the model."""

import pytest
import torch

from flashgemm.blockscale import e2m1_to_float
from flashgemm.device import e2m1
from flashgemm import mxfp4
from flashgemm.mxfp4 import kernel_bytes


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


def _table_model(d: int) -> tuple:
    """``e2m1.scaled_table``'s arithmetic on Python ints (32-bit words)."""
    if d < e2m1.MIN_SHIFT:
        return 0, 0
    lo = e2m1.POS_LO + d * e2m1.EXP_STEP_LO if d >= e2m1.LO_NORMAL_SHIFT else e2m1.SUB_LO_AT_MIN << (d - e2m1.MIN_SHIFT)
    hi = e2m1.POS_HI + d * e2m1.EXP_STEP_HI if d >= e2m1.HI_NORMAL_SHIFT else e2m1.SUB_HI_AT_MIN
    return lo & 0xFFFFFFFF, hi & 0xFFFFFFFF


def _model(word: int, d: int = 0) -> tuple:
    """``e2m1.e2m1x8_to_e4m3x8``'s arithmetic on Python ints (32-bit words)."""
    lo_t, hi_t = _table_model(d)
    mags = word & 0x77777777
    lo = _prmt(lo_t, hi_t, mags) | (word & e2m1.SIGN)
    hi = _prmt(lo_t, hi_t, mags >> 16) | ((word << 4) & e2m1.SIGN)
    return lo, hi


def _bf16_table_model(e: int) -> tuple:
    """``e2m1.bf16_table``'s arithmetic on Python ints (32-bit words)."""
    if e < e2m1.BF16_MIN_E8M0:
        return 0, 0, 0, 0
    step = (e - 127) << 7
    pairs = [(e2m1.BF16_PAIRS[0] + (step << 16)) & 0xFFFFFFFF]
    pairs += [(p + step * 0x10001) & 0xFFFFFFFF for p in e2m1.BF16_PAIRS[1:]]
    return (_prmt(pairs[0], pairs[1], 0x7531), _prmt(pairs[2], pairs[3], 0x7531),
            _prmt(pairs[0], pairs[1], 0x6420), _prmt(pairs[2], pairs[3], 0x6420))


def _bf16_model(word: int, e: int) -> list:
    """``e2m1.e2m1x8_to_bf16x8``'s arithmetic on Python ints (32-bit words)."""
    table = _bf16_table_model(e)
    mags = word & 0x77777777
    out = []
    for sel, sign in ((mags, word & e2m1.SIGN), (mags >> 16, (word << 4) & e2m1.SIGN)):
        high = _prmt(table[0], table[1], sel) | sign
        low = _prmt(table[2], table[3], sel)
        out += [_prmt(low, high, 0x5140), _prmt(low, high, 0x7362)]
    return out


def _words(codes: torch.Tensor) -> list:
    """Codes [..., 8] as the kernel's 32-bit words (``mxfp4.kernel_bytes``)."""
    b = kernel_bytes(codes).view(torch.uint8).to(torch.int64)
    return (b * torch.tensor([1, 1 << 8, 1 << 16, 1 << 24])).sum(-1).tolist()


def _all_codes() -> torch.Tensor:
    """[65536, 8]: k0..k3 take every combination of four codes, k4..k7 every one too (in another order)."""
    combos = torch.arange(1 << 16, dtype=torch.int64)
    low = torch.stack([(combos >> (4 * j)) & 15 for j in range(4)], dim=-1)
    return torch.cat([low, low.flip(0)], dim=-1)


@pytest.mark.parametrize("d", range(e2m1.MIN_SHIFT - 2, e2m1.MAX_SHIFT + 1))
def test_scaled_tables_are_exact_in_range_and_flush_below(d):
    # every four codes in each half of a word, against torch's e4m3 of value * 2**d
    codes = _all_codes()
    values = e2m1_to_float(codes).double() * 2.0 ** d
    if d < e2m1.MIN_SHIFT:
        values = values * 0.0  # flushed (keeps the sign of zero)
    e4m3 = values.to(torch.float8_e4m3fn)
    assert torch.equal(e4m3.double(), values)  # exact in e4m3
    want = e4m3.view(torch.uint8).to(torch.int64) * torch.tensor([1 << (8 * (j % 4)) for j in range(8)])
    want_lo, want_hi = want[:, :4].sum(-1).tolist(), want[:, 4:].sum(-1).tolist()
    got = [_model(w, d) for w in _words(codes)]
    assert [g[0] for g in got] == want_lo
    assert [g[1] for g in got] == want_hi


@pytest.mark.parametrize("e", [0, 1, 2, 3, 100, 126, 127, 128, 200, 251, 252])
def test_bf16_tables_are_exact_in_range_and_flush_below(e):
    # every four codes in each half of a word, against torch's bf16 of value * 2**(e - 127)
    codes = _all_codes()
    values = e2m1_to_float(codes).double() * 2.0 ** (e - 127)
    if e < e2m1.BF16_MIN_E8M0:
        values = values * 0.0  # flushed (keeps the sign of zero)
    bf = values.to(torch.bfloat16)
    assert torch.equal(bf.double(), values)  # exact in bf16
    bits = bf.view(torch.int16).to(torch.int64) & 0xFFFF
    want = (bits[:, 0::2] | bits[:, 1::2] << 16).tolist()
    assert [_bf16_model(w, e) for w in _words(codes)] == want


def test_bf16_table_bounds_are_the_hosts():
    """The device tables' E8M0 range (``device`` imports nothing outside
    itself, so it keeps its own copy) is the one ``mxfp4`` flushes by in
    ``dequantize_as_kernel`` and checks in ``prepare_weights``."""
    assert (e2m1.BF16_MIN_E8M0, e2m1.BF16_MAX_E8M0) == (mxfp4.BF16_MIN_E8M0, mxfp4.MAX_E8M0)


def test_kernel_layout_round_trips():
    from flashgemm.mxfp4 import prepare_weights, quantize_mxfp4, unprepare_weights

    packed, scales = quantize_mxfp4(torch.randn(3, 40, 96))
    b, b_scale = prepare_weights(packed, scales)
    assert b.dtype == torch.int8 and b_scale.stride(1) == 1
    back = unprepare_weights(b, b_scale)
    assert torch.equal(back[0], packed) and torch.equal(back[1], scales)


def _kernel_ptx_and_fn(bf16: bool):
    """A kernel converting one word per thread (its 2 e4m3 words, or its 4
    bf16 words with ``bf16``), with the table's argument (d, or the E8M0
    byte) as a run-time value: (its PTX, the callable)."""
    import cutlass
    import cutlass.cute as cute

    per_word = 4 if bf16 else 2

    @cute.kernel
    def convert(mIn: cute.Tensor, mOut: cute.Tensor, arg: cutlass.Int32):
        i = cute.arch.block_idx()[0] * 128 + cute.arch.thread_idx()[0]
        if i < cute.size(mIn):
            word = cutlass.Int32(mIn[i])
            if cutlass.const_expr(bf16):
                words = e2m1.e2m1x8_to_bf16x8(word, e2m1.bf16_table(arg))
            else:
                words = e2m1.e2m1x8_to_e4m3x8(word, e2m1.scaled_table(arg))
            for j in cutlass.range_constexpr(per_word):
                mOut[per_word * i + j] = words[j]

    @cute.jit
    def launch(mIn: cute.Tensor, mOut: cute.Tensor, arg: cutlass.Int32, blocks: cutlass.Int32, stream):
        convert(mIn, mOut, arg).launch(grid=[blocks, 1, 1], block=[128, 1, 1], stream=stream)

    from flashgemm.jit.options import compile_options

    fake = cute.runtime.make_fake_compact_tensor
    with compile_options(True) as options:
        fn = cute.compile(launch, fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4),
                          fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4), cutlass.Int32(0), cutlass.Int32(1),
                          cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=options)
    return fn.__ptx__, fn


@pytest.fixture(scope="module")
def built():
    from flashgemm.jit.arch import ensure_arch_env

    ensure_arch_env("sm_90a")
    return _kernel_ptx_and_fn(bf16=False)


@pytest.fixture(scope="module")
def built_bf16():
    from flashgemm.jit.arch import ensure_arch_env

    ensure_arch_env("sm_90a")
    return _kernel_ptx_and_fn(bf16=True)


def test_two_prmt_per_eight_values(built):
    ptx, _ = built
    assert ptx.count("prmt.b32") == 2  # one word of 8 values: one table lookup per half


def test_bf16_eight_prmt_per_eight_values_and_four_per_table(built_bf16):
    ptx, _ = built_bf16
    # two lookups and two interleaves per half word, four for the table
    assert ptx.count("prmt.b32") == 8 + 4


HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs a Hopper GPU")


def _on_the_gpu(fn, arg, per_word, model):
    """fn's outputs for random words and every byte value, against ``model(word)``
    (the model is checked against torch above; any 32-bit pattern is a word of the layout)."""
    words = torch.randint(-(1 << 31), 1 << 31, (4096,), dtype=torch.int64)
    words[:256] = torch.arange(256) * 0x01010101 - (torch.arange(256) >= 128).long() * (1 << 32)  # every byte
    src = words.to(torch.int32).cuda()
    out = torch.full((per_word * src.numel(),), -1, dtype=torch.int32, device="cuda")
    fn(src, out, arg, (src.numel() + 127) // 128)
    torch.cuda.synchronize()
    want = [v for w in words.tolist() for v in model(w & 0xFFFFFFFF)]
    assert out.cpu().to(torch.int64).bitwise_and(0xFFFFFFFF).tolist() == want


@HOPPER
@pytest.mark.parametrize("d", [-9, -8, -7, -6, -5, 0, 6])
def test_on_the_gpu_as_the_model(built, d, seed):
    _on_the_gpu(built[1], d, 2, lambda w: _model(w, d))


@HOPPER
@pytest.mark.parametrize("e", [0, 1, 2, 119, 127, 140, 252])
def test_bf16_on_the_gpu_as_the_model(built_bf16, e, seed):
    _on_the_gpu(built_bf16[1], e, 4, lambda w: _bf16_model(w, e))
