"""GPU correctness of the bf16 masked grouped GEMM (skipped without an sm_90 GPU)."""

import pytest
import torch

import flashgemm
from flashgemm.config import GemmConfig
from flashgemm.formats import Format
from flashgemm.jit import cache
from flashgemm.reference import grouped_gemm_nt_masked_ref, relative_error
from flashgemm.sm90.heuristic import reachable_specs

from conftest import requires_hopper

pytestmark = requires_hopper

POISON = -12345.0  # exactly representable in bf16, never produced by the data below
GUARD = 4096  # elements of poisoned memory on each side of `out`


def _random_case(e_count, max_m, n, k, masked):
    dev = "cuda"
    a = torch.randn(e_count, max_m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    masked_m = torch.tensor(masked, dtype=torch.int32, device=dev)
    return a, b, masked_m


def _poisoned_out(e_count, max_m, n):
    """`out` living inside a larger poisoned buffer, so writes outside it show."""
    numel = e_count * max_m * n
    buf = torch.full((GUARD + numel + GUARD,), POISON, device="cuda", dtype=torch.bfloat16)
    out = buf[GUARD : GUARD + numel].view(e_count, max_m, n)
    return buf, out


def _check(a, b, masked_m, out, buf, tol=1e-2):
    ref = grouped_gemm_nt_masked_ref(a, b, masked_m)
    e_count, max_m, n = out.shape
    rows = masked_m.clamp(0, max_m).tolist()
    torch.cuda.synchronize()
    assert (buf[:GUARD] == POISON).all(), "write before out"
    assert (buf[-GUARD:] == POISON).all(), "write after out"
    for e, m in enumerate(rows):
        assert (out[e, m:] == POISON).all(), f"expert {e}: rows >= m_e={m} were written"
        if m:
            valid = out[e, :m]
            assert not (valid == POISON).any(), f"expert {e}: some valid rows never written"
            assert not valid.isnan().any()
            err = relative_error(valid.float(), ref[e, :m])
            assert err < tol, f"expert {e} (m_e={m}): relative error {err:.2e}"


SHAPES = [
    # (E, max_m, N, K, masked_m) -- m_e in {0, 1, max_m, > max_m, negative}
    (4, 256, 256, 512, [0, 1, 256, 1000]),
    (3, 200, 136, 200, [200, -5, 77]),  # max_m, N, K not multiples of the tile
    (1, 64, 512, 4096, [64]),  # E = 1
    (64, 96, 256, 128, "random"),  # E = 64
    (2, 1, 64, 64, [1, 0]),  # max_m = 1
    (5, 384, 1032, 1040, [384, 130, 129, 128, 0]),
]


# every bf16 configuration the heuristic can pick (once each), and others
HEURISTIC_CONFIGS = tuple(dict.fromkeys(s.config for s in reachable_specs(Format.BF16)))
CONFIGS = HEURISTIC_CONFIGS + (
    GemmConfig(tile_m=64, tile_n=256),
    GemmConfig(tile_m=128, tile_n=192),
    GemmConfig(tile_m=64, tile_n=64, stages=3),
    GemmConfig(tile_m=128, tile_n=128, l2_hints=True),
    GemmConfig(tile_m=64, tile_n=128, cluster_n=2),  # the earlier decode tile
    GemmConfig(tile_m=192, tile_n=128, cluster_n=2),
    GemmConfig(tile_m=192, tile_n=64, cluster_n=1),
)
# (the heuristic's 2-CTA clusters share A by multicast; N=64/520/1032 give odd
# n-block counts, where one CTA of a pair computes a tile past N and stores nothing)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short_name())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_matches_reference(config, shape, seed):
    e_count, max_m, n, k, masked = shape
    if masked == "random":
        masked = torch.randint(-2, max_m + 3, (e_count,)).tolist()
    a, b, masked_m = _random_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out(e_count, max_m, n)
    res = flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config)
    assert res is out
    _check(a, b, masked_m, out, buf)


def test_heuristic_and_num_sms(seed):
    a, b, masked_m = _random_case(8, 512, 384, 256, [0, 1, 37, 128, 129, 511, 512, 600])
    for num_sms in (1, 7, None):
        for expected_m in (1, 100, 400, None):
            buf, out = _poisoned_out(8, 512, 384)
            flashgemm.grouped_gemm_nt_masked(
                a, b, out, masked_m, num_sms=num_sms, expected_m=expected_m
            )
            _check(a, b, masked_m, out, buf)


def test_allocates_out_when_none(seed):
    a, b, masked_m = _random_case(2, 128, 128, 128, [128, 50])
    out = flashgemm.grouped_gemm_nt_masked(a, b, None, masked_m)
    ref = grouped_gemm_nt_masked_ref(a, b, masked_m)
    assert out.shape == (2, 128, 128) and out.dtype == torch.bfloat16
    assert relative_error(out[0].float(), ref[0]) < 1e-2
    assert relative_error(out[1, :50].float(), ref[1, :50]) < 1e-2


def test_new_masked_m_and_shapes_do_not_recompile(seed):
    cfg = GemmConfig(tile_m=64, tile_n=128)
    a, b, masked_m = _random_case(6, 192, 256, 256, [5, 0, 192, 64, 65, 1])
    buf, out = _poisoned_out(6, 192, 256)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg)
    before = cache.compile_count
    for _ in range(3):
        masked_m.copy_(torch.randint(0, 193, (6,), dtype=torch.int32))
        buf, out = _poisoned_out(6, 192, 256)
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg)
        _check(a, b, masked_m, out, buf)
    a2, b2, m2 = _random_case(3, 100, 520, 136, [100, 3, 0])
    buf, out = _poisoned_out(3, 100, 520)
    flashgemm.grouped_gemm_nt_masked(a2, b2, out, m2, config=cfg)
    _check(a2, b2, m2, out, buf)
    assert cache.compile_count == before


def test_strided_operands(seed):
    """Non-compact but TMA-legal strides (padded rows, experts sliced from a bigger batch)."""
    big_a = torch.randn(6, 160, 264, device="cuda", dtype=torch.bfloat16)
    a = big_a[::2, :150, :256]  # stride(0) skips experts, rows padded to 264
    b = torch.randn(3, 192, 256, device="cuda", dtype=torch.bfloat16)[:, :136] / 16
    masked_m = torch.tensor([150, 10, 64], dtype=torch.int32, device="cuda")
    buf, out = _poisoned_out(3, 150, 136)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m)
    _check(a, b, masked_m, out, buf)


def test_cluster_grid_sizes(seed):
    cfg = GemmConfig(tile_m=64, tile_n=128, cluster_n=2)
    a, b, masked_m = _random_case(5, 130, 392, 256, [130, 0, 1, 64, 65])
    with pytest.raises(ValueError, match="num_sms"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, masked_m, config=cfg, num_sms=1)
    for num_sms in (2, 3, 5, 131):  # odd caps round down to whole clusters
        buf, out = _poisoned_out(5, 130, 392)
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=cfg, num_sms=num_sms)
        _check(a, b, masked_m, out, buf)


def test_reused_signature_still_checks_pointers(seed):
    """The per-signature fast path skips the shape checks, never the address ones."""
    from flashgemm import api

    a, b, masked_m = _random_case(4, 64, 256, 256, [64, 3, 0, 17])
    out = torch.empty(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m)
    plans = len(api._PLANS)
    buf, out2 = _poisoned_out(4, 64, 256)
    flashgemm.grouped_gemm_nt_masked(a, b, out2, masked_m)  # same signature: reuses the plan
    assert len(api._PLANS) == plans
    _check(a, b, masked_m, out2, buf)
    # same shapes and strides, but out on top of a / misaligned
    shared = torch.empty(2 * a.numel(), device="cuda", dtype=torch.bfloat16)
    a_alias = shared[: a.numel()].view_as(a).copy_(a)
    out_alias = shared[64 : 64 + out.numel()].view_as(out)
    with pytest.raises(ValueError, match="out must not overlap a"):
        flashgemm.grouped_gemm_nt_masked(a_alias, b, out_alias, masked_m)
    out_odd = torch.empty(out.numel() + 8, device="cuda", dtype=torch.bfloat16)[1 : 1 + out.numel()].view_as(out)
    with pytest.raises(ValueError, match="out base address must be 16-byte aligned"):
        flashgemm.grouped_gemm_nt_masked(a, b, out_odd, masked_m)


def test_a_changed_argument_gets_the_full_checks(seed):
    """Every tensor's dtype, shape and strides are in the signature key: a
    call that changes one (b's or out's dtype, out's or masked_m's shape)
    gets no cached plan but the full checks' error, and launches nothing."""
    a, b, masked_m = _random_case(4, 64, 256, 256, [64, 3, 0, 17])
    buf, out = _poisoned_out(4, 64, 256)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m)  # makes the plan
    _check(a, b, masked_m, out, buf)
    buf, out = _poisoned_out(4, 64, 256)
    wide = torch.full((4, 64, 264), POISON, device="cuda", dtype=torch.bfloat16)
    bad_calls = {
        "masked_m must have E=4 entries": (a, b, out, torch.zeros(5, dtype=torch.int32, device="cuda")),
        "a and b must have the same dtype": (a, b.to(torch.float8_e4m3fn), out, masked_m),
        "out must have dtype torch.bfloat16": (a, b, out.view(torch.float16), masked_m),
        # same strides as a (4, 64, 256) view of `wide`, another N
        r"out must have shape \(E, max_m, N\)": (a, b, wide[:, :, :248], masked_m),
    }
    flashgemm.grouped_gemm_nt_masked(a, b, wide[:, :, :256], masked_m)  # plan for wide's strides
    wide.fill_(POISON)
    for message, args in bad_calls.items():
        with pytest.raises((TypeError, ValueError), match=message):
            flashgemm.grouped_gemm_nt_masked(*args)
    with pytest.raises(TypeError, match="masked_m must have dtype torch.int32"):  # keyed
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m.to(torch.int64))
    torch.cuda.synchronize()
    assert (buf == POISON).all() and (wide == POISON).all(), "a refused call wrote to out"
