"""Host-side argument checks of the public op (CPU only, no GPU needed).

validate_args reads only metadata (shape, dtype, strides, pointers), so CPU
tensors exercise every check; validate_device takes the device facts as
arguments, so any capability / SM count can be driven from here.
"""

import re
import types

import pytest

from flashgemm.plan import PlanCache
import torch

import flashgemm
from flashgemm.config import GemmConfig, Tail, TileOrder
from flashgemm.formats import Format
from flashgemm.sm90.limits import SMEM_BYTES, check_config, resolved_stages, smem_bytes
from flashgemm.validation import validate_args, validate_device

BF16 = torch.bfloat16
E, M, N, K = 3, 40, 24, 32


def make(e=E, m=M, n=N, k=K, with_out=True):
    a = torch.randn(e, m, k).to(BF16)
    b = torch.randn(e, n, k).to(BF16)
    out = torch.empty(e, m, n, dtype=BF16) if with_out else None
    mm = torch.full((e,), m, dtype=torch.int32)
    return a, b, out, mm


class FakeTensor:
    """validate_device only reads ``.device``: a stand-in for CUDA tensors."""

    def __init__(self, device):
        self.device = torch.device(device)


def cuda_tensors(**devices):
    return {name: FakeTensor(dev) for name, dev in devices.items()}


# ---------------------------------------------------------------------------
# validate_args: accepted inputs
# ---------------------------------------------------------------------------


def test_valid_compact_inputs_return_sizes():
    a, b, out, mm = make()
    assert validate_args(a, b, out, mm) == (E, M, N, K)


def test_out_none_accepted():
    a, b, _, mm = make(with_out=False)
    assert validate_args(a, b, None, mm) == (E, M, N, K)


def test_non_compact_legal_strides_accepted():
    # sliced along experts and rows of bigger tensors: strides stay 16-byte
    # multiples, inner dim stays contiguous, base stays aligned
    big_a = torch.randn(2 * E, M + 24, K).to(BF16)
    big_b = torch.randn(E + 2, N, K + 16).to(BF16)
    big_out = torch.empty(E + 1, M + 8, N + 8, dtype=BF16)
    a = big_a[::2, 8 : 8 + M]  # expert stride doubled, row offset 8 rows
    b = big_b[1 : 1 + E, :, 8 : 8 + K]  # K offset 8 elems = 16 bytes
    out = big_out[1:, :M, :N]
    assert not a.is_contiguous() and not b.is_contiguous() and not out.is_contiguous()
    mm = torch.tensor([0, 5, M], dtype=torch.int32)
    assert validate_args(a, b, out, mm) == (E, M, N, K)


def test_minimum_sizes_accepted():
    # K = N = 8 (16-byte rows), max_m = 1, E = 1
    a, b, out, mm = make(e=1, m=1, n=8, k=8)
    assert validate_args(a, b, out, mm) == (1, 1, 8, 8)


def test_masked_m_values_are_data_not_validated():
    a, b, out, _ = make(e=2)
    mm = torch.tensor([-5, 10**9], dtype=torch.int32)
    assert validate_args(a, b, out, mm) == (2, M, N, K)


def test_out_adjacent_to_a_in_one_buffer_is_not_overlap():
    # one storage: a occupies [0, E*M*K), out starts right after it
    buf = torch.empty(E * M * K + E * M * N, dtype=BF16)
    a = buf[: E * M * K].view(E, M, K)
    out = buf[E * M * K :].view(E, M, N)
    _, b, _, mm = make()
    assert validate_args(a, b, out, mm) == (E, M, N, K)


# ---------------------------------------------------------------------------
# validate_args: dtypes and types
# ---------------------------------------------------------------------------


def test_a_float32_rejected():
    a, b, out, mm = make()
    with pytest.raises(TypeError, match=r"^a must have dtype"):
        validate_args(a.float(), b, out, mm)


def test_a_float16_rejected():
    a, b, out, mm = make()
    with pytest.raises(TypeError, match=r"^a must have dtype .*float16"):
        validate_args(a.half(), b.half(), out.half(), mm)


def test_b_dtype_differs_from_a():
    a, b, out, mm = make()
    with pytest.raises(TypeError, match=r"^b must have dtype"):
        validate_args(a, b.half(), out, mm)


def test_out_dtype_rejected():
    a, b, out, mm = make()
    with pytest.raises(TypeError, match=r"^out must have dtype"):
        validate_args(a, b, out.float(), mm)


def test_masked_m_int64_rejected():
    a, b, out, mm = make()
    with pytest.raises(TypeError, match=r"^masked_m must have dtype torch\.int32"):
        validate_args(a, b, out, mm.long())


@pytest.mark.parametrize("which", ["a", "b", "out", "masked_m"])
def test_non_tensor_argument_rejected(which):
    args = dict(zip(("a", "b", "out", "masked_m"), make()))
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=rf"^{which} must be a torch\.Tensor, got list"):
        validate_args(**args)


# ---------------------------------------------------------------------------
# validate_args: ranks and shapes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which,bad",
    [
        ("a", lambda t: t[0]),
        ("a", lambda t: t.unsqueeze(0)),
        ("b", lambda t: t[0]),
        ("out", lambda t: t.reshape(E * M, N)),
        ("masked_m", lambda t: t.reshape(1, E)),
        ("masked_m", lambda t: t[0]),
    ],
)
def test_wrong_rank_rejected(which, bad):
    args = dict(zip(("a", "b", "out", "masked_m"), make()))
    args[which] = bad(args[which])
    with pytest.raises(ValueError, match=rf"^{which} must have rank"):
        validate_args(**args)


def test_expert_count_mismatch():
    a, _, out, mm = make()
    b = torch.randn(E + 1, N, K).to(BF16)
    with pytest.raises(ValueError, match=r"b\.shape\[0\] must equal the expert count E=3"):
        validate_args(a, b, out, mm)


def test_k_mismatch():
    a, _, out, mm = make()
    b = torch.randn(E, N, K + 8).to(BF16)
    with pytest.raises(ValueError, match=r"b\.shape\[2\] must equal K=32"):
        validate_args(a, b, out, mm)


@pytest.mark.parametrize(
    "shape", [(E + 1, M, N), (E, M + 1, N), (E, M - 1, N), (E, M, N + 8)], ids=["E", "max_m+", "max_m-", "N"]
)
def test_out_shape_mismatch(shape):
    a, b, _, mm = make()
    out = torch.empty(shape, dtype=BF16)
    with pytest.raises(ValueError, match=r"^out must have shape \(E, max_m, N\)"):
        validate_args(a, b, out, mm)


@pytest.mark.parametrize("length", [E - 1, E + 1])
def test_masked_m_wrong_length(length):
    a, b, out, _ = make()
    mm = torch.zeros(length, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^masked_m must have E=3 entries"):
        validate_args(a, b, out, mm)


def test_masked_m_not_contiguous():
    a, b, out, _ = make()
    mm = torch.zeros(2 * E, dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match=r"^masked_m must be contiguous"):
        validate_args(a, b, out, mm)


def test_zero_experts_rejected():
    a, b, out, mm = make(e=0)
    with pytest.raises(ValueError, match=r"^a must hold at least one expert"):
        validate_args(a, b, out, mm)


def test_zero_rows_rejected():
    a, b, out, mm = make(m=0)
    with pytest.raises(ValueError, match=r"max_m"):
        validate_args(a, b, out, mm)


@pytest.mark.parametrize("k", [4, 12, 36])
def test_k_not_multiple_of_8(k):
    a, b, out, mm = make(k=k)
    with pytest.raises(ValueError, match=rf"^K \(a\.shape\[2\]\) must be a positive multiple of 8, got {k}"):
        validate_args(a, b, out, mm)


@pytest.mark.parametrize("n", [4, 20, 36])
def test_n_not_multiple_of_8(n):
    a, b, out, mm = make(n=n)
    with pytest.raises(ValueError, match=rf"^N \(b\.shape\[1\]\) must be a positive multiple of 8, got {n}"):
        validate_args(a, b, out, mm)


# ---------------------------------------------------------------------------
# validate_args: strides and alignment the TMA cannot take
# ---------------------------------------------------------------------------


def test_a_not_k_contiguous():
    _, b, out, mm = make()
    a = torch.randn(E, K, M).to(BF16).transpose(1, 2)  # [E, M, K], K stride M
    assert a.shape == (E, M, K)
    with pytest.raises(ValueError, match=r"^a must be contiguous along K"):
        validate_args(a, b, out, mm)


def test_b_not_k_contiguous():
    a, _, out, mm = make()
    b = torch.randn(E, K, N).to(BF16).transpose(1, 2)
    with pytest.raises(ValueError, match=r"^b must be contiguous along K"):
        validate_args(a, b, out, mm)


def test_out_not_n_contiguous():
    a, b, _, mm = make()
    out = torch.empty(E, N, M, dtype=BF16).transpose(1, 2)
    with pytest.raises(ValueError, match=r"^out must be contiguous along N"):
        validate_args(a, b, out, mm)


def test_a_row_stride_not_16_byte_multiple():
    # last dim K+4 -> row stride (K+4)*2 = 72 bytes; expert stride 2*72 = 144 = 9*16
    # is fine, so the row stride is the one reported
    _, b, out, mm = make(m=2)
    a = torch.randn(E, 2, K + 4).to(BF16)[:, :, :K]
    assert (a.stride(1) * 2) % 16 != 0 and (a.stride(0) * 2) % 16 == 0
    with pytest.raises(ValueError, match=r"^a\.stride\(1\) = 36 elements is not a multiple of 16 bytes"):
        validate_args(a, b, out, mm)


def test_b_expert_stride_not_16_byte_multiple():
    a, _, out, mm = make()
    flat = torch.empty(E * N * K + 8 * E, dtype=BF16)
    b = flat.as_strided((E, N, K), (N * K + 4, K, 1))  # expert stride 4 elems off
    with pytest.raises(ValueError, match=r"^b\.stride\(0\)"):
        validate_args(a, b, out, mm)


def test_out_row_stride_not_16_byte_multiple():
    a, b, _, mm = make(m=8)
    out = torch.empty(E, 8, N + 2, dtype=BF16)[:, :, :N]  # 52-byte rows
    with pytest.raises(ValueError, match=r"^out\.stride\(1\)"):
        validate_args(a, b, out, mm)


def test_a_base_not_16_byte_aligned():
    _, b, out, mm = make()
    flat = torch.empty(E * M * K + 8, dtype=BF16)
    assert flat.data_ptr() % 16 == 0
    a = flat[1 : 1 + E * M * K].view(E, M, K)  # 2 bytes past an aligned base
    assert a.stride() == (M * K, K, 1)
    with pytest.raises(ValueError, match=r"^a base address must be 16-byte aligned"):
        validate_args(a, b, out, mm)


def test_out_base_not_16_byte_aligned():
    a, b, _, mm = make()
    flat = torch.empty(E * M * N + 8, dtype=BF16)
    out = flat[4 : 4 + E * M * N].view(E, M, N)  # 8 bytes past an aligned base
    with pytest.raises(ValueError, match=r"^out base address must be 16-byte aligned"):
        validate_args(a, b, out, mm)


# ---------------------------------------------------------------------------
# validate_args: aliasing
# ---------------------------------------------------------------------------


def test_out_overlapping_a():
    # out starts 16 elements (32 bytes, aligned) before the end of a
    buf = torch.empty(E * M * K + E * M * N, dtype=BF16)
    a = buf[: E * M * K].view(E, M, K)
    out = buf[E * M * K - 16 : E * M * K - 16 + E * M * N].view(E, M, N)
    _, b, _, mm = make()
    with pytest.raises(ValueError, match=r"^out must not overlap a in memory"):
        validate_args(a, b, out, mm)


def test_out_overlapping_b():
    # out ends inside b: b lies 8 elements after out's base
    buf = torch.empty(E * M * N + E * N * K, dtype=BF16)
    out = buf[: E * M * N].view(E, M, N)
    b = buf[8 : 8 + E * N * K].view(E, N, K)
    a, _, _, mm = make()
    with pytest.raises(ValueError, match=r"^out must not overlap b in memory"):
        validate_args(a, b, out, mm)


def test_out_identical_to_a():
    a, b, _, mm = make(n=K)
    with pytest.raises(ValueError, match=r"^out must not overlap a"):
        validate_args(a, b, a, mm)


def test_out_overlapping_masked_m():
    # one byte buffer seen as bf16 out and int32 masked_m
    raw = torch.zeros(2 * E * M * N, dtype=torch.uint8)
    out = raw.view(BF16).view(E, M, N)
    mm = raw[16 : 16 + 4 * E].view(torch.int32)
    a, b, _, _ = make()
    with pytest.raises(ValueError, match=r"^out must not overlap masked_m"):
        validate_args(a, b, out, mm)


# ---------------------------------------------------------------------------
# validate_device
# ---------------------------------------------------------------------------

HOPPER = (9, 0)
SMS = 132


def test_device_cpu_tensor_named():
    t = cuda_tensors(a="cuda:0", out="cuda:0")
    t["b"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"^b must be on a CUDA device, got cpu"):
        validate_device(t, None, HOPPER, SMS)


def test_device_real_cpu_tensors():
    a, b, out, mm = make()
    with pytest.raises(ValueError, match=r"^a must be on a CUDA device"):
        validate_device({"a": a, "b": b, "out": out, "masked_m": mm}, None, HOPPER, SMS)


def test_device_mismatch():
    t = cuda_tensors(a="cuda:0", b="cuda:0", out="cuda:0", masked_m="cuda:1")
    with pytest.raises(ValueError, match=r"^masked_m is on cuda:1 but a is on cuda:0"):
        validate_device(t, None, HOPPER, SMS)


@pytest.mark.parametrize("arg", ["b", "out", "masked_m", "a_scale", "b_scale", "dst_signals"])
def test_device_mismatch_named_for_every_tensor_argument(arg):
    """Every tensor the launcher passes (fp8 scales and dst_signals included)
    must be on a's GPU; the refusal names the one that is not."""
    names = ("a", "b", "out", "masked_m", "a_scale", "b_scale", "dst_signals")
    t = {name: types.SimpleNamespace(device=torch.device("cuda", 0)) for name in names}
    assert validate_device(dict(t), None, HOPPER, SMS) == SMS
    t[arg] = types.SimpleNamespace(device=torch.device("cuda", 1))
    with pytest.raises(ValueError, match=rf"^{arg} is on cuda:1 but a is on cuda:0"):
        validate_device(t, None, HOPPER, SMS)
    t[arg] = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"^{arg} must be on a CUDA device, got cpu"):
        validate_device(t, None, HOPPER, SMS)


def test_launcher_passes_every_tensor_to_the_device_check(monkeypatch):
    """_make_plan hands validate_device every tensor argument by name."""
    from flashgemm import api

    seen = {}

    class Stop(Exception):
        pass

    def spy(tensors, *args, **kw):
        seen.update(tensors)
        raise Stop

    monkeypatch.setattr(api, "validate_device", spy)
    a, b, out, mm = make()
    sig = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(Stop):
        api._make_plan(api.CallArgs(a, b, out, mm, config=None, dst_signals=sig, signal_granularity="expert"))
    assert set(seen) == {"a", "b", "out", "masked_m", "a_scale", "b_scale", "alpha", "dst_signals"}
    assert seen["dst_signals"] is sig and seen["out"] is out and seen["a_scale"] is None


def test_device_out_none_skipped():
    t = cuda_tensors(a="cuda:1", b="cuda:1", masked_m="cuda:1")
    t["out"] = None
    assert validate_device(t, None, HOPPER, SMS) == SMS


@pytest.mark.parametrize("cap,shown", [((8, 0), "sm_80"), ((12, 0), "sm_120"), ((9, 1), "sm_91")])
def test_device_wrong_capability(cap, shown):
    t = cuda_tensors(a="cuda:0", b="cuda:0")
    with pytest.raises(ValueError, match=rf"sm_90 \(Hopper\) or sm_100 / sm_103 \(Blackwell\).*cuda:0 is NVIDIA X {shown}$"):
        validate_device(t, None, cap, SMS, "NVIDIA X")


@pytest.mark.parametrize("cap", [(9, 0), (10, 0), (10, 3)])
def test_device_capabilities_with_kernels(cap):
    assert validate_device(cuda_tensors(a="cuda:0"), None, cap, SMS) == SMS


def test_device_wrong_capability_without_name():
    t = cuda_tensors(a="cuda:0")
    with pytest.raises(ValueError, match=r"cuda:0 is sm_80$"):
        validate_device(t, None, (8, 0), SMS)


@pytest.mark.parametrize("num_sms", [0, -1, SMS + 1])
def test_device_num_sms_out_of_range(num_sms):
    t = cuda_tensors(a="cuda:0")
    with pytest.raises(ValueError, match=rf"^num_sms must be in \[1, {SMS}\].*got {num_sms}"):
        validate_device(t, num_sms, HOPPER, SMS)


@pytest.mark.parametrize("num_sms", [2.5, True, False, "8", 8.0])
def test_device_num_sms_not_int(num_sms):
    t = cuda_tensors(a="cuda:0")
    with pytest.raises(TypeError, match=rf"^num_sms must be an int or None, got {type(num_sms).__name__}$"):
        validate_device(t, num_sms, HOPPER, SMS)


def test_device_num_sms_none_is_sm_count():
    t = cuda_tensors(a="cuda:0", b="cuda:0")
    assert validate_device(t, None, HOPPER, SMS) == SMS
    assert validate_device(t, None, HOPPER, 114) == 114


@pytest.mark.parametrize("num_sms", [1, 7, SMS])
def test_device_valid_num_sms_returned(num_sms):
    t = cuda_tensors(a="cuda:0", b="cuda:0", out="cuda:0", masked_m="cuda:0")
    assert validate_device(t, num_sms, HOPPER, SMS) == num_sms


# ---------------------------------------------------------------------------
# public op on CPU tensors: must raise before any launch
# ---------------------------------------------------------------------------


def test_public_cpu_tensors_rejected():
    a, b, out, mm = make()
    with pytest.raises(ValueError, match=r"must be on a CUDA device"):
        flashgemm.grouped_gemm_nt_masked(a, b, out, mm)


def test_public_cpu_out_none_rejected():
    a, b, _, mm = make()
    with pytest.raises(ValueError, match=r"^a must be on a CUDA device"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, expected_m=4, num_sms=8)


def test_public_argument_errors_come_first():
    # shape checks run before the device check
    a, b, out, mm = make()
    with pytest.raises(TypeError, match=r"^masked_m must have dtype"):
        flashgemm.grouped_gemm_nt_masked(a, b, out, mm.long())


def test_public_bad_config_type_on_cpu():
    # the config is metadata: checked before the device, so CPU tensors reach it
    a, b, out, mm = make()
    with pytest.raises(TypeError, match=r"^config must be a flashgemm\.GemmConfig \(sm_90\), .* got dict$"):
        flashgemm.grouped_gemm_nt_masked(a, b, out, mm, config={"tile_m": 64})


def test_public_unsupported_config_on_cpu():
    a, b, out, mm = make()
    with pytest.raises(ValueError, match=r"^config\.tile_n must be one of 64, 128, 192, 256, got 96$"):
        flashgemm.grouped_gemm_nt_masked(a, b, out, mm, config=GemmConfig(tile_n=96))


# ---------------------------------------------------------------------------
# sm90.limits.check_config (GemmConfig.check_fields and the sm_90a budget)
# ---------------------------------------------------------------------------

BF16_OPS, FP8_OPS = Format.BF16, Format.FP8_BLOCK128


@pytest.mark.parametrize(
    "cfg,operands,pattern",
    [
        (GemmConfig(tile_m=256), BF16_OPS, r"config\.tile_m must be 64, 128 or 192"),
        (GemmConfig(tile_m=96), BF16_OPS, r"config\.tile_m must be 64, 128 or 192 .*got 96"),
        (GemmConfig(tile_n=96), BF16_OPS, r"config\.tile_n must be one of"),
        (GemmConfig(tile_n=512), BF16_OPS, r"config\.tile_n must be one of"),
        (GemmConfig(cluster_n=4), BF16_OPS, r"config\.cluster_n must be 1 or 2, got 4"),
        (GemmConfig(tile_m=192, tile_n=256), BF16_OPS, r"config\.tile_n must be <= 128 with tile_m=192"),
        (GemmConfig(tile_m=192, tile_n=128), FP8_OPS, r"config\.tile_n must be <= 64 with tile_m=192"),
        (GemmConfig(stages=-1), BF16_OPS, r"config\.stages must be >= 0"),
        (GemmConfig(stages=1), BF16_OPS, r"at least 2 pipeline stages"),
        (GemmConfig(stages=20), BF16_OPS, r"shared\s+memory"),
        (GemmConfig(tile_m=64, tail=Tail.SPLIT), BF16_OPS,
         r"config\.tail=SPLIT runs each half .* tile_m=64"),
        (GemmConfig(tail=Tail.SPLIT, order=TileOrder.DYNAMIC), BF16_OPS,
         r"config\.tail=SPLIT applies to the static order"),
        (GemmConfig(tail=Tail.SPLIT, order=TileOrder.N_MAJOR), BF16_OPS, r"expert-major order.*order=N_MAJOR"),
        (GemmConfig(n_major_window=2), BF16_OPS,
         r"config\.n_major_window must be 0, or a power of two .*\(order=EXPERT_MAJOR\)"),
        (GemmConfig(order=TileOrder.N_MAJOR, n_major_window=3), BF16_OPS, r"config\.n_major_window .* got 3"),
        (GemmConfig(order=TileOrder.N_MAJOR, n_major_window=64), BF16_OPS, r"up to 32 .* got 64"),
        (GemmConfig(order="dynamic"), BF16_OPS, r"config\.order must be a flashgemm\.TileOrder"),
        (GemmConfig(tail=True), BF16_OPS, r"config\.tail must be a flashgemm\.Tail"),
    ],
)
def test_config_check_rejects(cfg, operands, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_config(cfg, operands)


def test_config_check_needs_a_config():
    with pytest.raises(TypeError, match="config must be a flashgemm.GemmConfig, got dict"):
        check_config({"tile_m": 64}, BF16_OPS)


@pytest.mark.parametrize(
    "cfg",
    [
        GemmConfig(),
        GemmConfig(tile_m=64, tile_n=256),
        GemmConfig(tile_n=192),
        GemmConfig(cluster_n=2),
        GemmConfig(stages=4),
    ],
    ids=lambda c: c.short_name(),
)
def test_config_check_accepts(cfg):
    assert check_config(cfg, BF16_OPS) is cfg
    assert resolved_stages(cfg, BF16_OPS) >= 2
    assert smem_bytes(cfg, BF16_OPS) <= 232448 == SMEM_BYTES


def test_config_auto_stages_fill_smem():
    cfg = GemmConfig()
    s = resolved_stages(cfg, BF16_OPS)
    # one more stage would not fit
    assert check_config(GemmConfig(stages=s), BF16_OPS)
    with pytest.raises(ValueError, match=re.escape("lower config.stages")):
        check_config(GemmConfig(stages=s + 1), BF16_OPS)


@pytest.mark.parametrize(
    "make_out",
    [
        lambda e, m, n: torch.empty(1, m, n, dtype=torch.bfloat16).expand(e, m, n),
        lambda e, m, n: torch.empty(m * n + 64, dtype=torch.bfloat16).as_strided((e, m, n), (0, 0, 1)),
        lambda e, m, n: torch.empty(e * m * n, dtype=torch.bfloat16).as_strided((e, m, n), (8 * n, n, 1)),
    ],
    ids=["expanded-experts", "all-rows-aliased", "experts-overlap"],
)
def test_out_overlapping_itself_rejected(make_out):
    e, m, n, k = 3, 64, 128, 64
    a = torch.randn(e, m, k, dtype=torch.bfloat16)
    b = torch.randn(e, n, k, dtype=torch.bfloat16)
    masked_m = torch.full((e,), m, dtype=torch.int32)
    with pytest.raises(ValueError, match="out must not overlap itself"):
        validate_args(a, b, make_out(e, m, n), masked_m)


def test_out_permuted_layout_accepted():
    """A non-overlapping out with experts interleaved between rows is legal."""
    e, m, n, k = 3, 64, 128, 64
    a = torch.randn(e, m, k, dtype=torch.bfloat16)
    b = torch.randn(e, n, k, dtype=torch.bfloat16)
    out = torch.empty(m, e, n, dtype=torch.bfloat16).transpose(0, 1)
    assert validate_args(a, b, out, torch.full((e,), m, dtype=torch.int32)) == (e, m, n, k)


@pytest.mark.parametrize("which", ["a", "b"])
def test_broadcast_operand_rejected(which):
    e, m, n, k = 3, 64, 128, 64
    a = torch.randn(e, m, k, dtype=torch.bfloat16)
    b = torch.randn(e, n, k, dtype=torch.bfloat16)
    if which == "a":
        a = torch.randn(1, m, k, dtype=torch.bfloat16).expand(e, m, k)
    else:
        b = torch.randn(1, n, k, dtype=torch.bfloat16).expand(e, n, k)
    with pytest.raises(ValueError, match=rf"{which}\.stride\(0\) is 0"):
        validate_args(a, b, None, torch.full((e,), m, dtype=torch.int32))


# ---------------------------------------------------------------------------
# the per-signature fast path: its pointer checks must catch what the full
# checks would (alignment, aliasing), so a reused signature never skips them
# ---------------------------------------------------------------------------


def _plan_for(a, b, out, mm):
    from flashgemm.plan import LaunchPlan
    from flashgemm.sm90.launch import ALIGNED, SLOTS, WRITTEN

    return LaunchPlan(None, SLOTS, _named(a, b, mm, out), aligned=ALIGNED + ("a_scale",), written=WRITTEN)


def _named(a, b, mm, out):
    return {"a": a, "b": b, "masked_m": mm, "out": out}


def test_fast_path_pointer_checks_accept_distinct_aligned_tensors():
    a, b, out, mm = make()
    assert _plan_for(a, b, out, mm).pointers_ok(_named(a, b, mm, out))


def test_fast_path_pointer_checks_catch_aliasing_and_misalignment():
    a, b, out, mm = make()
    plan = _plan_for(a, b, out, mm)
    # same shapes and strides, but out now lives on top of a
    buf = torch.empty(a.numel() + out.numel(), dtype=BF16)
    a2 = buf[: a.numel()].view_as(a)
    out2 = buf[a.numel() // 2 : a.numel() // 2 + out.numel()].view_as(out)
    assert not plan.pointers_ok(_named(a2, b, mm, out2))
    with pytest.raises(ValueError, match="out must not overlap a"):
        validate_args(a2, b, out2, mm)
    # a misaligned by one element
    big = torch.empty(a.numel() + 8, dtype=BF16)
    a3 = big[1 : 1 + a.numel()].view_as(a)
    assert not plan.pointers_ok(_named(a3, b, mm, out))
    # masked_m inside out
    mm2 = out.view(-1)[:2 * E].view(torch.int32)
    assert not plan.pointers_ok(_named(a, b, mm2, out))


class _CompiledStandIn:
    """Stands in for the compiled TVM-FFI function on CPU tensors: it refuses
    what the real one refuses among the arguments the signature key leaves
    out (masked_m's and out's shapes, out's dtype), like it with a ValueError
    before launching, and counts launches."""

    def __init__(self):
        self.launches = 0

    def __call__(self, a, b, out, masked_m, signals, a_scale, b_scale, counter, *rest):
        # (rest: whatever else the compiled signature takes, num_ctas last)
        e, m, _ = a.shape
        if tuple(masked_m.shape) != (e,) or tuple(out.shape) != (e, m, b.shape[1]) or out.dtype != a.dtype:
            raise ValueError("Mismatched Tensor on argument")
        self.launches += 1


@pytest.fixture
def cpu_launcher(monkeypatch):
    """The launcher on CPU tensors with the device checks, the compile and the
    launch stubbed; returns the stand-in for the compiled function."""
    from flashgemm import api
    from flashgemm.sm90 import build

    fn = _CompiledStandIn()
    monkeypatch.setattr(api, "validate_device", lambda *args, **kw: 132)
    monkeypatch.setattr(build, "get_kernel", lambda *args, **kw: fn)
    monkeypatch.setattr(api, "_PLANS", PlanCache())
    return fn


def test_a_new_signature_gets_the_full_checks(cpu_launcher):
    from flashgemm import api

    a, b, out, mm = make()
    api.grouped_gemm_nt_masked(a, b, out, mm)
    api.grouped_gemm_nt_masked(a, b, out, mm)
    assert cpu_launcher.launches == 2 and len(api._PLANS) == 1
    bad = {
        rf"^masked_m must have E={E} entries, got {E + 1}$": (a, b, out, torch.zeros(E + 1, dtype=torch.int32)),
        "^out must have dtype torch.bfloat16, got torch.float16$": (a, b, out.view(torch.float16), mm),
        # a view with out's strides but fewer columns
        r"^out must have shape \(E, max_m, N\)": (
            a, b, torch.empty(E, M, N, dtype=BF16)[:, :, : N - 8], mm,
        ),
    }
    for message, args in bad.items():
        # every tensor's dtype, shape and strides are in the signature: no plan
        # serves these, and the full checks name the argument before any launch
        with pytest.raises((TypeError, ValueError), match=message):
            api.grouped_gemm_nt_masked(*args)
    assert cpu_launcher.launches == 2 and len(api._PLANS) == 1


def test_reused_plan_passes_on_a_refusal_the_full_checks_accept(cpu_launcher, monkeypatch):
    from flashgemm import api

    a, b, out, mm = make()
    api.grouped_gemm_nt_masked(a, b, out, mm)

    def launch_failure(*args):
        raise RuntimeError("CUDA error: too many resources requested for launch")

    plan = next(iter(api._PLANS.values()))
    monkeypatch.setattr(plan, "fn", launch_failure)
    with pytest.raises(RuntimeError, match="too many resources"):
        api.grouped_gemm_nt_masked(a, b, out, mm)


def test_signature_key_covers_the_int32_tensors_dtypes(cpu_launcher):
    # the compiled function accepts uint32 for int32: masked_m's and
    # dst_signals' dtypes must reach the full checks through the key
    from flashgemm import api

    a, b, out, mm = make()
    api.grouped_gemm_nt_masked(a, b, out, mm)
    with pytest.raises(TypeError, match="masked_m must have dtype torch.int32"):
        api.grouped_gemm_nt_masked(a, b, out, mm.view(torch.uint32))
    sig = torch.zeros(64, dtype=torch.int32)
    api.grouped_gemm_nt_masked(a, b, out, mm, dst_signals=sig, signal_granularity="expert")
    with pytest.raises(TypeError, match="dst_signals must have dtype torch.int32"):
        api.grouped_gemm_nt_masked(a, b, out, mm, dst_signals=sig.view(torch.uint32),
                                        signal_granularity="expert")
    assert cpu_launcher.launches == 2


def test_stream_argument_is_checked():
    a, b, out, mm = make()
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream or None, got int"):
        flashgemm.grouped_gemm_nt_masked(a, b, out, mm, stream=7)


def test_check_no_alias_names_the_first_overlap():
    from flashgemm.validation import check_no_alias

    buf = torch.empty(64, dtype=torch.int32)
    span = (buf.data_ptr(), buf.data_ptr() + 16)
    check_no_alias("x", span, {"far": torch.empty(4, dtype=torch.int32), "none": None})
    with pytest.raises(ValueError, match="^x must not overlap inside in memory$"):
        check_no_alias("x", span, {"none": None, "inside": buf[2:6]})
    with pytest.raises(ValueError, match="^x must not overlap given in memory$"):
        check_no_alias("x", span, {"given": (buf.data_ptr() + 12, buf.data_ptr() + 20)})
    check_no_alias("x", span, {"adjacent": buf[4:8]})  # touching, not overlapping


def test_split_tail_config_with_signals_rejected_before_compiling(monkeypatch):
    # a split tile's two halves finish on two CTAs: no tile count to publish
    from flashgemm import api
    from flashgemm.jit import cache

    monkeypatch.setattr(api, "validate_device", lambda *args, **kw: 132)
    a, b, out, mm = make()
    sig = torch.zeros(64, dtype=torch.int32)
    cfg = GemmConfig(cluster_n=2, tail=Tail.SPLIT)
    before = cache.compile_count
    with pytest.raises(ValueError, match=r"^config\.tail=SPLIT cannot publish dst_signals"):
        api._make_plan(api.CallArgs(a, b, out, mm, config=cfg, dst_signals=sig, signal_granularity="expert"))
    assert cache.compile_count == before


@pytest.mark.parametrize("victim", ["a", "out", "masked_m"])
def test_dst_signals_aliasing_rejected_before_compiling(monkeypatch, victim):
    # drive the launcher's planning on CPU tensors: the device checks are
    # covered above, here they are stubbed to reach the signal checks
    from flashgemm import api
    from flashgemm.jit import cache

    monkeypatch.setattr(api, "validate_device", lambda *args, **kw: 132)
    a, b, out, mm = make()
    tensors = {"a": a, "out": out, "masked_m": mm}
    sig = tensors[victim].view(-1)[:8].view(torch.int32)
    before = cache.compile_count
    with pytest.raises(ValueError, match=f"^dst_signals must not overlap {victim} in memory$"):
        api._make_plan(api.CallArgs(a, b, out, mm, config=None, dst_signals=sig, signal_granularity="expert"))
    assert cache.compile_count == before


# ---------------------------------------------------------------------------
# combine.err: the kernel ORs error bits into it, so it shares no byte with
# any other tensor of the call
# ---------------------------------------------------------------------------

ERR_VICTIMS = ["a", "b", "masked_m", "a_scale", "b_scale", "combine.token_index", "combine.weight", "combine.peers"]


def _combine_call_args(peers: bool):
    """A valid fp8 call with combine (bf16 receive buffer and a peers table
    when ``peers``), as (inputs by name, Combine)."""
    from flashgemm import Combine
    from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token

    a, a_scale = quantize_fp8_per_token(torch.randn(E, M, 128))
    b, b_scale = quantize_fp8_per_block(torch.randn(E, 128, 128))
    inputs = {"a": a, "b": b, "masked_m": torch.full((E,), M, dtype=torch.int32), "a_scale": a_scale,
              "b_scale": b_scale}
    output = torch.zeros(16, 128, dtype=torch.bfloat16 if peers else torch.float32)
    table = torch.tensor([output.data_ptr(), 0], dtype=torch.int64) if peers else None
    combine = Combine(torch.zeros(E, M, dtype=torch.int32), torch.zeros(E, M), output,
                      torch.zeros(1, dtype=torch.int32), table)
    return inputs, combine


@pytest.mark.parametrize("victim", ERR_VICTIMS)
def test_combine_err_must_not_overlap_any_other_tensor(victim):
    from flashgemm.routing import check_combine

    inputs, combine = _combine_call_args(peers=True)
    tensors = {**inputs, **{f"combine.{f}": getattr(combine, f) for f in ("token_index", "weight", "peers")}}
    err = tensors[victim].view(-1).view(torch.uint8)[:4].view(torch.int32)  # its first 4 bytes
    bad = combine._replace(err=err)
    with pytest.raises(ValueError, match=f"^combine.err must not overlap {re.escape(victim)}$"):
        check_combine(bad, None, None, E, M, 128, inputs)
    with pytest.raises(ValueError, match=f"^combine.err must not overlap {re.escape(victim)}$"):
        flashgemm.grouped_gemm_nt_masked(inputs["a"], inputs["b"], None, inputs["masked_m"], a_scale=inputs["a_scale"],
                                         b_scale=inputs["b_scale"], combine=bad)


def test_combine_err_apart_from_every_tensor_is_accepted():
    from flashgemm.routing import check_combine

    for peers in (False, True):
        inputs, combine = _combine_call_args(peers)
        assert check_combine(combine, None, None, E, M, 128, inputs) == tuple(combine)
        # beside a (one buffer, adjacent bytes): touching is not overlapping
        buf = torch.empty(inputs["a"].numel() + 16, dtype=torch.float8_e4m3fn)
        a = buf[: inputs["a"].numel()].view(inputs["a"].shape)
        err = buf[inputs["a"].numel():].view(torch.int32)[:1]
        assert check_combine(combine._replace(err=err), None, None, E, M, 128, {**inputs, "a": a})
