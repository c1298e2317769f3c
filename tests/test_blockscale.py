"""Block-scaled MXFP8 / NVFP4 helpers, the tiled scale layout and the float
reference GEMM (CPU only).

Fresh random data every run (the ``seed`` fixture prints the seed to replay a
failure). Round trips are held to error bounds derived from the formats'
grids, values already on the grids must come back bit for bit, and the tiled
layout is checked against its index formula element by element.
"""

import re

import pytest
import torch

from flashgemm.blockscale import (
    E2M1_VALUES,
    blocked_scale_shape,
    dequantize_mxfp8,
    dequantize_nvfp4,
    e2m1_to_float,
    e8m0_to_float,
    from_blocked_scales,
    grouped_gemm_nt_masked_blockscaled_ref,
    nvfp4_alpha,
    pack_e2m1,
    quantize_mxfp8,
    quantize_nvfp4,
    to_blocked_scales,
    unpack_e2m1,
)

E4M3 = torch.float8_e4m3fn


def cdiv(a, b):
    return -(-a // b)


def bits(t):
    return t.view(torch.uint8)


def varied(*shape, spread=20):
    """randn with a random power-of-two magnitude per row (never an all-zero block)."""
    x = torch.randn(*shape)
    x[x == 0] = 1.0
    return x * torch.exp2(torch.randint(-spread, spread + 1, (*shape[:-1], 1)).float())


def block_amax(x, block):
    k = x.shape[-1]
    xp = torch.nn.functional.pad(x.double().abs(), (0, cdiv(k, block) * block - k))
    return xp.unflatten(-1, (-1, block)).amax(-1)


def expand(s, block, k):
    return s.repeat_interleave(block, -1)[..., :k]


# ---------------------------------------------------------------- MXFP8


@pytest.mark.parametrize("shape", [(7, 32), (3, 5, 100), (2, 4, 256), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_round_trip_bound(seed, shape, dtype):
    x = varied(*shape).to(dtype)
    q, s = quantize_mxfp8(x)
    k = shape[-1]
    assert q.dtype == E4M3 and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.uint8 and s.shape == (*shape[:-1], cdiv(k, 32))
    deq = dequantize_mxfp8(q, s)
    assert deq.dtype == torch.float32 and not deq.isnan().any()
    # e4m3 round to nearest: half an ulp, 2**-4 relative for normals, plus
    # half the subnormal step (2**-10) times the block scale below 2**-6
    scale = expand(e8m0_to_float(s).double(), 32, k)
    err = (x.double() - deq.double()).abs()
    assert (err <= 2.0**-4 * x.double().abs() + 2.0**-10 * scale).all()
    assert q.float().abs().max() <= 448  # nothing saturates


def test_mxfp8_exponent_rule(seed):
    x = varied(6, 4, 96, spread=60)
    _, s = quantize_mxfp8(x)
    amax = block_amax(x, 32)
    e = s.double() - 127
    assert (amax / torch.exp2(e) <= 448).all()  # fits
    assert (amax / torch.exp2(e - 1) > 448).all()  # and is the smallest power that fits
    # the spec's floor(log2(amax)) - 8 is the same binade or one below
    spec = torch.frexp(amax)[1].double() - 1 - 8
    assert ((e - spec == 0) | (e - spec == 1)).all()


@pytest.mark.parametrize("amax, byte", [
    (448.0, 127), (448.5, 128), (1.0, 119), (1.75, 119), (1.76, 120),
    (2.0**-140, 0), (3e38, 247), (0.0, 0),
])
def test_mxfp8_exponent_table(amax, byte):
    x = torch.zeros(1, 32)
    x[0, 5] = -amax
    x[0, 9] = amax / 3
    q, s = quantize_mxfp8(x)
    assert s.item() == byte
    assert q.float().abs().max() <= 448


def test_mxfp8_values_on_the_grid_round_trip_exactly(seed):
    shape = (4, 6, 96)
    q0 = torch.randint(0, 255, shape, dtype=torch.uint8)
    q0[(q0 & 0x7F) == 0x7F] = 0x38  # no NaN: 1.0 instead
    # one element of each block in (224, 448] fixes the block's exponent
    big = torch.randint(0x77, 0x7F, (*shape[:-1], 3), dtype=torch.uint8)
    big |= torch.randint(0, 2, big.shape, dtype=torch.uint8) << 7
    q0.view(*shape[:-1], 3, 32)[..., 0] = big
    s0 = torch.randint(0, 127 + 120, (*shape[:-1], 3), dtype=torch.uint8)
    x = dequantize_mxfp8(q0.view(E4M3), s0)
    q, s = quantize_mxfp8(x)
    assert torch.equal(bits(q), q0) and torch.equal(s, s0)
    assert torch.equal(dequantize_mxfp8(q, s), x)


def test_mxfp8_zero_blocks(seed):
    x = varied(3, 128)
    x[0, 32:64] = 0
    x[1] = 0
    x[2, 96:] = -0.0
    q, s = quantize_mxfp8(x)
    assert s[0, 1] == 0 and (s[1] == 0).all() and s[2, 3] == 0
    deq = dequantize_mxfp8(q, s)
    assert (deq[0, 32:64] == 0).all() and (deq[1] == 0).all() and (deq[2, 96:] == 0).all()
    assert (deq[0, :32] != 0).any()


def test_mxfp8_nan_and_inf_blocks(seed):
    x = varied(2, 96)
    x[0, 40] = float("nan")
    x[1, 70] = float("inf")
    q, s = quantize_mxfp8(x)
    assert s[0, 1] == 255 and s[1, 2] == 255
    deq = dequantize_mxfp8(q, s)
    assert deq[0, 32:64].isnan().all() and deq[1, 64:96].isnan().all()
    clean = x.clone()
    clean[0, 32:64] = 0
    clean[1, 64:96] = 0
    q2, s2 = quantize_mxfp8(clean)
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 1] = keep[1, 2] = False
    assert torch.equal(s[keep], s2[keep])
    assert torch.equal(deq[0, :32], dequantize_mxfp8(q2, s2)[0, :32])
    assert torch.equal(e8m0_to_float(torch.tensor([0, 127, 254, 255], dtype=torch.uint8))[:3],
                       torch.tensor([2.0**-127, 1.0, 2.0**127]))


def test_mxfp8_along_another_dim(seed):
    x = varied(70, 40)
    q, s = quantize_mxfp8(x, dim=0)
    qt, st = quantize_mxfp8(x.T.contiguous())
    assert s.shape == (3, 40) and torch.equal(bits(q), bits(qt.T)) and torch.equal(s, st.T)
    assert torch.equal(dequantize_mxfp8(q, s, dim=0), dequantize_mxfp8(qt, st).T)
    # the scales may also come as float8_e8m0fnu
    assert torch.equal(dequantize_mxfp8(qt, st.view(torch.float8_e8m0fnu)), dequantize_mxfp8(qt, st))


# ---------------------------------------------------------------- e2m1 codes


def test_pack_unpack_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # even column low
    assert torch.equal(unpack_e2m1(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(every_byte)), every_byte)
    assert torch.equal(unpack_e2m1(every_byte.view(torch.float4_e2m1fn_x2)), unpack_e2m1(every_byte))
    values = e2m1_to_float(codes)
    assert values[:8].tolist() == list(E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in E2M1_VALUES]


def test_nvfp4_rounds_to_nearest_even_and_saturates():
    # global scale 1 and a block amax of 6: the block scale is 1, v = x
    ties = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor([ties + [-t for t in ties]])
    packed, s, g = quantize_nvfp4(x, global_scale=1.0)
    assert s.float().item() == 1.0 and g.item() == 1.0
    assert unpack_e2m1(packed)[0].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 15, 0, 10, 10, 12, 12, 14, 14]
    # a forced global scale saturates the block scale at 448 and the elements at 6
    packed, s, g = quantize_nvfp4(torch.full((1, 16), 6000.0), global_scale=1.0)
    assert s.float().max() == 448 and (dequantize_nvfp4(packed, s, g) == 6 * 448).all()


# ---------------------------------------------------------------- NVFP4


def nvfp4_error_bound(x, s, g):
    """|x - deq| allowed per element: half the local e2m1 step (or the
    saturation excess past 6) in units of v = x * g / s, times s / g."""
    k = x.shape[-1]
    sd = expand(s.double(), 16, k)
    gd = g.double()[..., None, None]
    v = (x.double() * gd / sd).abs()
    half = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    err_v = torch.maximum(half, v - 6)
    return err_v * sd / gd, sd


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 128), (1, 16), (2, 2, 3, 32)])
def test_nvfp4_round_trip_bound(seed, shape):
    x = varied(*shape, spread=6)
    packed, s, g = quantize_nvfp4(x)
    k = shape[-1]
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], k // 2)
    assert s.dtype == E4M3 and s.shape == (*shape[:-1], k // 16)
    assert g.dtype == torch.float32 and g.shape == shape[:-2]
    # the recipe: g = 448 * 6 / amax per matrix, s_b = e4m3(amax_b / 6 * g)
    amax = x.abs().amax(dim=(-2, -1))
    assert torch.equal(g, 2688.0 / amax)
    sb = (block_amax(x, 16).float() / 6 * g[..., None, None]).clamp(max=448).to(E4M3)
    assert torch.equal(bits(s), bits(sb)) and s.float().max() <= 448
    deq = dequantize_nvfp4(packed, s, g)
    assert deq.shape == x.shape and deq.dtype == torch.float32
    bound, sd = nvfp4_error_bound(x, s.float(), g)
    err = (x.double() - deq.double()).abs()
    assert (sd > 0).all()
    assert (err <= bound * (1 + 1e-6)).all()
    # coarser, per block: at most the top half-step (1) times s_b / g for a
    # normal block scale (|v| <= 6 / (1 - 2**-4) < 7, so saturation costs < 1)
    normal = sd >= 2.0**-6
    assert (err[normal] <= (sd / g.double()[..., None, None])[normal] * (1 + 1e-6)).all()


def test_nvfp4_values_on_the_grid_round_trip_exactly(seed):
    e, m, k = 3, 4, 64
    codes = torch.randint(0, 16, (e, m, k), dtype=torch.uint8)
    codes[codes == 8] = 0  # zero is always +0
    sixes = 7 | (torch.randint(0, 2, (e, m, k // 16), dtype=torch.uint8) << 3)
    codes.view(e, m, k // 16, 16)[..., 3] = sixes  # each block holds a +-6
    s0 = torch.randint(1, 0x7F, (e, m, k // 16), dtype=torch.uint8).view(E4M3)  # nonzero, finite
    g0 = torch.exp2(torch.randint(-10, 11, (e,)).float())
    x = dequantize_nvfp4(pack_e2m1(codes), s0, g0)
    packed, s, g = quantize_nvfp4(x, global_scale=g0)
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(bits(s), bits(s0)) and torch.equal(g, g0)
    assert torch.equal(dequantize_nvfp4(packed, s, g), x)


def test_nvfp4_zero_blocks(seed):
    x = varied(2, 64, spread=3)
    x[0, 16:32] = 0
    packed, s, g = quantize_nvfp4(x)
    assert s[0, 1].float() == 0 and (unpack_e2m1(packed)[0, 16:32] == 0).all()
    deq = dequantize_nvfp4(packed, s, g)
    assert (deq[0, 16:32] == 0).all() and not deq.isnan().any()
    packed, s, g = quantize_nvfp4(torch.zeros(2, 3, 32))
    assert (g == 1).all() and (bits(s) == 0).all() and (packed == 0).all()
    assert (dequantize_nvfp4(packed, s, g) == 0).all()


def test_nvfp4_one_global_scale_per_expert(seed):
    base = varied(5, 48, spread=4)
    x = torch.stack([base * 2.0**-12, base, base * 2.0**12])
    packed, s, g = quantize_nvfp4(x)
    # a power-of-two rescaling of an expert changes only its global scale
    assert torch.equal(g, g[1] * torch.tensor([2.0**12, 1.0, 2.0**-12]))
    for i in (0, 2):
        assert torch.equal(packed[i], packed[1]) and torch.equal(bits(s[i]), bits(s[1]))
    deq = dequantize_nvfp4(packed, s, g)
    assert torch.equal(deq[0], deq[1] * 2.0**-12) and torch.equal(deq[2], deq[1] * 2.0**12)


def test_nvfp4_alpha():
    ga = torch.tensor([2.0, 0.5, 3.0])
    gb = torch.tensor([4.0, 8.0, 7.0])
    alpha = nvfp4_alpha(ga, gb)
    assert alpha.dtype == torch.float32
    assert torch.equal(alpha, (1.0 / (ga.double() * gb.double())).float())
    assert nvfp4_alpha(2.0, 4.0).item() == 0.125


# ---------------------------------------------------------------- scale layout


@pytest.mark.parametrize("l, m, s", [(1, 1, 1), (1, 128, 4), (3, 200, 7), (3, 257, 9), (1, 100, 3)])
@pytest.mark.parametrize("dtype", [torch.uint8, E4M3, torch.float8_e8m0fnu, torch.float32])
def test_blocked_round_trip(seed, l, m, s, dtype):
    def raw(t):
        return t if t.dtype == torch.float32 else t.view(torch.uint8)

    scales = torch.randint(1, 255, (l, m, s), dtype=torch.uint8)
    scales = scales.float() if dtype == torch.float32 else scales.view(dtype)
    blocked = to_blocked_scales(scales)
    assert blocked.shape == blocked_scale_shape(l, m, s) == (l, cdiv(m, 128), cdiv(s, 4), 32, 4, 4)
    assert blocked.dtype == dtype and blocked.is_contiguous()
    back = from_blocked_scales(blocked, m, s)
    assert back.dtype == dtype and back.shape == (l, m, s)
    assert torch.equal(raw(back), raw(scales))
    # the padding is zero bytes (the data is nonzero)
    full = raw(from_blocked_scales(blocked, cdiv(m, 128) * 128, cdiv(s, 4) * 4))
    pad = torch.ones_like(full, dtype=torch.bool)
    pad[:, :m, :s] = False
    assert (full[pad] == 0).all() and raw(blocked).count_nonzero() == l * m * s


def test_blocked_index_mapping(seed):
    l, m, s = 3, 200, 9
    scales = torch.randint(0, 256, (l, m, s), dtype=torch.uint8)
    blocked = to_blocked_scales(scales)
    li, mi, si = torch.meshgrid(torch.arange(l), torch.arange(m), torch.arange(s), indexing="ij")
    # m = 128*rm + 32*m4 + m32, s = 4*rk + s4 -> [l, rm, rk, m32, m4, s4]
    assert torch.equal(blocked[li, mi // 128, si // 4, mi % 32, (mi % 128) // 32, si % 4], scales)
    # as flat bytes: atoms of 512 in (l, rm, rk) order, 16*m32 + 4*m4 + s4 inside
    rm_n, rk_n = cdiv(m, 128), cdiv(s, 4)
    flat = ((li * rm_n + mi // 128) * rk_n + si // 4) * 512 + 16 * (mi % 32) + 4 * ((mi % 128) // 32) + si % 4
    assert torch.equal(blocked.flatten()[flat], scales)
    # the hand-made example: (l=1, m=161, s=6) -> [1, 1, 1, 1, 1, 2]
    one = torch.zeros(l, m, s, dtype=torch.uint8)
    one[1, 161, 6] = 7
    hit = to_blocked_scales(one).nonzero().tolist()
    assert hit == [[1, 1, 1, 1, 1, 2]]


# ---------------------------------------------------------------- reference GEMM


def quantized_operands(fmt, e, max_m, n, k):
    a, b = varied(e, max_m, k, spread=3), varied(e, n, k, spread=3)
    if fmt == "mxfp8":
        (qa, sa), (qb, sb) = quantize_mxfp8(a), quantize_mxfp8(b)
        return qa, sa, qb, sb, dequantize_mxfp8(qa, sa), dequantize_mxfp8(qb, sb), None
    (qa, sa, ga), (qb, sb, gb) = quantize_nvfp4(a), quantize_nvfp4(b)
    raw_a = dequantize_nvfp4(qa, sa, torch.ones(e))  # e2m1 * s_b, exact
    raw_b = dequantize_nvfp4(qb, sb, torch.ones(e))
    return qa, sa, qb, sb, raw_a, raw_b, (ga, gb)


def masked_product(a, b, masked_m, alpha):
    max_m = a.shape[1]
    out = torch.einsum("emk,enk->emn", a.double(), b.double()) * alpha.double()[:, None, None]
    rows = torch.arange(max_m)[None, :, None] < masked_m.clamp(0, max_m)[:, None, None]
    return torch.where(rows, out, torch.zeros_like(out))


@pytest.mark.parametrize("fmt, k", [("mxfp8", 96), ("mxfp8", 100), ("nvfp4", 64), ("nvfp4", 160)])
def test_reference_gemm(seed, fmt, k):
    e, max_m, n = 4, 40, 24
    qa, sa, qb, sb, raw_a, raw_b, globals_ = quantized_operands(fmt, e, max_m, n, k)
    masked_m = torch.tensor([0, 17, 99, -3], dtype=torch.int32)  # empty, partial, clamped, negative
    out = grouped_gemm_nt_masked_blockscaled_ref(qa, sa, qb, sb, masked_m, fmt=fmt)
    assert out.dtype == torch.float32 and out.shape == (e, max_m, n)
    expected = masked_product(raw_a, raw_b, masked_m, torch.ones(e))
    assert torch.equal(out, expected.float())
    assert (out[0] == 0).all() and (out[1, 17:] == 0).all() and (out[3] == 0).all()
    assert (out[2] != 0).any()
    alpha = torch.rand(e) + 0.5
    out = grouped_gemm_nt_masked_blockscaled_ref(qa, sa, qb, sb, masked_m, fmt=fmt, alpha=alpha)
    assert torch.equal(out, masked_product(raw_a, raw_b, masked_m, alpha).float())
    if globals_ is not None:
        # alpha = 1 / (g_a * g_b) gives the product of the fully dequantized operands
        ga, gb = globals_
        out = grouped_gemm_nt_masked_blockscaled_ref(qa, sa, qb, sb, masked_m, fmt=fmt,
                                                     alpha=nvfp4_alpha(ga, gb))
        deq_a, deq_b = dequantize_nvfp4(qa, sa, ga), dequantize_nvfp4(qb, sb, gb)
        full = masked_product(deq_a, deq_b, masked_m, torch.ones(e))
        scale = masked_product(deq_a.abs(), deq_b.abs(), masked_m, torch.ones(e))
        assert ((out.double() - full).abs() <= 1e-6 * scale + 1e-30).all()


# ---------------------------------------------------------------- errors


def _q8(*shape):
    return quantize_mxfp8(torch.randn(*shape))


def _q4(*shape):
    return quantize_nvfp4(torch.randn(*shape))


def _ref(fmt, a=None, sa=None, b=None, sb=None, masked_m=None, **kw):
    qa, s_a, qb, s_b = (*_q8(2, 8, 64), *_q8(2, 4, 64)) if fmt != "nvfp4" else (
        *_q4(2, 8, 64)[:2], *_q4(2, 4, 64)[:2])
    m = torch.tensor([3, 8]) if masked_m is None else masked_m
    return grouped_gemm_nt_masked_blockscaled_ref(
        qa if a is None else a, s_a if sa is None else sa, qb if b is None else b,
        s_b if sb is None else sb, m, fmt=fmt, **kw)


ERRORS = [
    ("mx-x-int", lambda: quantize_mxfp8(torch.ones(2, 32, dtype=torch.int32)),
     "x must be a floating-point tensor, got torch.int32"),
    ("mx-x-0d", lambda: quantize_mxfp8(torch.tensor(1.0)), "x must have at least one dimension"),
    ("mx-q-dtype", lambda: dequantize_mxfp8(torch.ones(2, 32), _q8(2, 32)[1]),
     "q must have dtype torch.float8_e4m3fn, got torch.float32"),
    ("mx-q-0d", lambda: dequantize_mxfp8(torch.tensor(1.0).to(E4M3), torch.tensor(127, dtype=torch.uint8)),
     "q must have at least one dimension"),
    ("mx-scales-shape", lambda: dequantize_mxfp8(_q8(2, 64)[0], torch.zeros(2, 3, dtype=torch.uint8)),
     "scales must have shape (2, 2) (one E8M0 byte per 32 elements of q along dim -1), got (2, 3)"),
    ("mx-scales-dtype", lambda: dequantize_mxfp8(_q8(2, 64)[0], torch.zeros(2, 2)),
     "scales must have dtype torch.uint8 or torch.float8_e8m0fnu, got torch.float32"),
    ("nv-x-int", lambda: quantize_nvfp4(torch.ones(2, 32, dtype=torch.int64)),
     "x must be a floating-point tensor, got torch.int64"),
    ("nv-x-1d", lambda: quantize_nvfp4(torch.ones(32)),
     "x must be [..., M, K] with at least 2 dimensions, got shape (32,)"),
    ("nv-x-k", lambda: quantize_nvfp4(torch.ones(2, 40)), "K (x.shape[-1] = 40) must be a multiple of 16 for NVFP4"),
    ("nv-x-nan", lambda: quantize_nvfp4(torch.full((2, 32), float("nan"))),
     "x holds NaN or inf, which NVFP4 cannot encode"),
    ("nv-global-zero", lambda: quantize_nvfp4(torch.ones(2, 32), global_scale=0.0),
     "global_scale must be finite and positive"),
    ("nv-global-shape", lambda: quantize_nvfp4(torch.ones(3, 2, 32), global_scale=torch.ones(2)),
     "global_scale must be a scalar or have shape (3,) (one per matrix), got (2,)"),
    ("nv-packed-dtype", lambda: dequantize_nvfp4(torch.ones(2, 16), _q4(2, 32)[1], 1.0),
     "packed must have dtype torch.uint8 or torch.float4_e2m1fn_x2, got torch.float32"),
    ("nv-packed-1d", lambda: dequantize_nvfp4(torch.zeros(16, dtype=torch.uint8), _q4(2, 32)[1], 1.0),
     "packed must be [..., M, K/2], got shape (16,)"),
    ("nv-packed-k", lambda: dequantize_nvfp4(torch.zeros(2, 20, dtype=torch.uint8), _q4(2, 32)[1], 1.0),
     "K (2 * packed.shape[-1] = 40) must be a multiple of 16 for NVFP4"),
    ("nv-scales-dtype", lambda: dequantize_nvfp4(_q4(2, 32)[0], torch.zeros(2, 2, dtype=torch.uint8), 1.0),
     "block_scales must have dtype torch.float8_e4m3fn, got torch.uint8"),
    ("nv-scales-shape", lambda: dequantize_nvfp4(_q4(2, 32)[0], _q4(2, 64)[1], 1.0),
     "block_scales must have shape (2, 2) (one e4m3 scale per 16 elements), got (2, 4)"),
    ("nv-deq-global", lambda: dequantize_nvfp4(*_q4(2, 32)[:2], float("inf")),
     "global_scale must be finite and positive"),
    ("pack-float", lambda: pack_e2m1(torch.zeros(4)), "codes must be an integer tensor, got torch.float32"),
    ("pack-odd", lambda: pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8)),
     "codes must have an even last dimension, got shape (2, 3)"),
    ("pack-range", lambda: pack_e2m1(torch.tensor([3, 16])), "codes must lie in [0, 15]"),
    ("unpack-dtype", lambda: unpack_e2m1(torch.zeros(4, dtype=torch.int32)),
     "packed must have dtype torch.uint8 or torch.float4_e2m1fn_x2, got torch.int32"),
    ("e8m0-dtype", lambda: e8m0_to_float(torch.zeros(4)),
     "scales must have dtype torch.uint8 or torch.float8_e8m0fnu, got torch.float32"),
    ("shape-neg", lambda: blocked_scale_shape(-1, 4, 4), "l must be a non-negative int, got -1"),
    ("shape-float", lambda: blocked_scale_shape(1, 4.0, 4), "m must be a non-negative int, got 4.0"),
    ("blocked-2d", lambda: to_blocked_scales(torch.zeros(4, 4, dtype=torch.uint8)),
     "scales must be [L, M, S], got shape (4, 4)"),
    ("unblocked-5d", lambda: from_blocked_scales(torch.zeros(1, 1, 32, 4, 4, dtype=torch.uint8), 4, 4),
     "blocked must be (L, rm, rk, 32, 4, 4), got shape (1, 1, 32, 4, 4)"),
    ("unblocked-shape", lambda: from_blocked_scales(torch.zeros(1, 1, 1, 32, 4, 4, dtype=torch.uint8), 130, 4),
     "blocked must have shape (1, 2, 1, 32, 4, 4) (tiled scales for m=130, s=4), got (1, 1, 1, 32, 4, 4)"),
    ("ref-fmt", lambda: _ref("fp4"), "fmt must be 'mxfp8', 'nvfp4' or 'mxfp8_mxfp4', got 'fp4'"),
    ("ref-a-2d", lambda: _ref("mxfp8", a=_q8(8, 64)[0], sa=_q8(8, 64)[1]),
     "a must be [E, rows, K], got shape (8, 64)"),
    ("ref-a-dtype", lambda: _ref("mxfp8", a=torch.zeros(2, 8, 64, dtype=torch.bfloat16)),
     "a must have dtype torch.float8_e4m3fn, got torch.bfloat16"),
    ("ref-a-scales-shape", lambda: _ref("mxfp8", sa=torch.zeros(2, 8, 3, dtype=torch.uint8)),
     "a_scales must have shape (2, 8, 2) (one E8M0 byte per 32 elements of a), got (2, 8, 3)"),
    ("ref-b-scales-dtype", lambda: _ref("mxfp8", sb=torch.zeros(2, 4, 2)),
     "b_scales must have dtype torch.uint8 or torch.float8_e8m0fnu, got torch.float32"),
    ("ref-b-k", lambda: _ref("mxfp8", b=_q8(2, 4, 96)[0], sb=_q8(2, 4, 96)[1]),
     "b must match a in experts (E=2) and K (64), got shape (2, 4, 96)"),
    ("ref-masked-shape", lambda: _ref("mxfp8", masked_m=torch.tensor([1, 2, 3])),
     "masked_m must have shape (2,), got (3,)"),
    ("ref-alpha-shape", lambda: _ref("mxfp8", alpha=torch.ones(3)),
     "alpha must be a scalar or have shape (2,), got (3,)"),
    ("ref-nv-a-dtype", lambda: _ref("nvfp4", a=torch.zeros(2, 8, 32, dtype=E4M3)),
     "a must have dtype torch.uint8 or torch.float4_e2m1fn_x2, got torch.float8_e4m3fn"),
    ("ref-nv-k", lambda: _ref("nvfp4", a=torch.zeros(2, 8, 4, dtype=torch.uint8)),
     "K (2 * a.shape[-1] = 8) must be a multiple of 16 for NVFP4"),
    ("ref-nv-scales-dtype", lambda: _ref("nvfp4", sb=torch.zeros(2, 4, 4, dtype=torch.uint8)),
     "b_scales must have dtype torch.float8_e4m3fn, got torch.uint8"),
    ("ref-nv-scales-shape", lambda: _ref("nvfp4", sa=torch.zeros(2, 8, 2, dtype=E4M3)),
     "a_scales must have shape (2, 8, 4) (one e4m3 scale per 16 elements of a), got (2, 8, 2)"),
]


@pytest.mark.parametrize("call, message", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_messages(call, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call()


def test_power_of_two_block128_scales_become_mx_scales():
    """DeepSeek's UE8M0 1x128 scales are exact E8M0 bytes over each 32-block:
    the fp8 values dequantize to the same numbers either way."""
    from flashgemm.blockscale import dequantize_mxfp8, mx_scales_from_block128

    g = torch.Generator().manual_seed(5)
    k = 320  # a partial last 128-block (2.5 blocks, 10 32-blocks)
    q = (torch.randn(2, 3, k, generator=g) * 50).to(torch.float8_e4m3fn)
    exps = torch.randint(-20, 20, (2, 3, 3), generator=g)
    a_scale = torch.pow(2.0, exps.float())
    mx = mx_scales_from_block128(a_scale, k)
    assert mx.dtype == torch.uint8 and tuple(mx.shape) == (2, 3, 10)
    want = q.float() * a_scale.repeat_interleave(128, dim=-1)[..., :k]
    assert torch.equal(dequantize_mxfp8(q, mx), want)
    a_scale[1, 2, 1] = 3.0
    with pytest.raises(ValueError, match=r"a_scale\[\(1, 2, 1\)\] = 3.0 is not a power of two"):
        mx_scales_from_block128(a_scale, k)
    with pytest.raises(ValueError, match=r"a_scale must be \[\.\.\., ceil\(K/128\)\] = \[\.\.\., 2\]"):
        mx_scales_from_block128(torch.ones(1, 3), 256)
