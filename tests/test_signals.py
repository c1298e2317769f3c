"""Completion-signal arithmetic, validation and PTX (CPU only)."""

import random
import re
from collections import Counter

import pytest
import torch

from flashgemm import signal_layout
from flashgemm.__main__ import ptx_features
from flashgemm.config import GemmConfig, KernelSpec, Tail
from flashgemm.formats import Format
from flashgemm.schedule.model import tile_order
from flashgemm.signals import make_signal_layout, validate_signals
from flashgemm.sm90.epilogue import SIGNAL_STAGES
from flashgemm.sm90.heuristic import DECODE_CONFIG, MID_CONFIG


def _counts_from_schedule(masked_m, max_m, n, cfg, granularity, num_ctas=14):
    """Signal values implied by the scheduler model: one add per stored tile."""
    layout = make_signal_layout(granularity, max_m, n, cfg.tile_m, cfg.tile_n, len(masked_m))
    counts = Counter()
    balance = cfg.tail is Tail.BALANCE
    for cta in tile_order(masked_m, max_m, n, cfg.tile_m, cfg.tile_n, num_ctas, cfg.cluster_n, balance):
        for e, mb, nb in cta:
            counts[layout.index(e, mb)] += 1
    return layout, torch.tensor([counts[i] for i in range(layout.size)], dtype=torch.int32)


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
def test_final_values_match_scheduler_model(granularity):
    rng = random.Random(1234)
    configs = [DECODE_CONFIG, MID_CONFIG, GemmConfig(tile_m=128, tile_n=192), GemmConfig(tile_m=64, tile_n=64, cluster_n=2)]
    for _ in range(200):
        e_count = rng.choice([1, 3, 17, 64])
        max_m = rng.choice([1, 64, 100, 300])
        n = rng.choice([8, 136, 520, 1032])
        cfg = rng.choice(configs)
        masked = [rng.choice([0, 0, 1, max_m, max_m + 9, -4, rng.randint(0, max_m)]) for _ in range(e_count)]
        layout, expected = _counts_from_schedule(masked, max_m, n, cfg, granularity)
        got = layout.final_values(torch.tensor(masked, dtype=torch.int32), max_m)
        assert torch.equal(got, expected), (masked, max_m, n, cfg)
        # empty experts never get a signal
        for e, m in enumerate(masked):
            if min(max(m, 0), max_m) == 0:
                lo, hi = (e, e + 1) if granularity == "expert" else (e * layout.num_m_blocks, (e + 1) * layout.num_m_blocks)
                assert int(got[lo:hi].sum()) == 0


def test_layout_facts_before_launch(fake_gpu):
    lay = signal_layout(32, 1024, 4096, 7168, expected_m=32)
    assert (lay.block_m, lay.block_n) == (DECODE_CONFIG.tile_m, DECODE_CONFIG.tile_n)
    assert lay.num_m_blocks == 1024 // DECODE_CONFIG.tile_m and lay.n_tiles == 4096 // DECODE_CONFIG.tile_n
    assert lay.size == 32 * lay.num_m_blocks
    lay_e = signal_layout(32, 1024, 4096, 7168, expected_m=32, signal_granularity="expert")
    assert lay_e.size == 32
    with pytest.raises(ValueError, match="signal_granularity"):
        signal_layout(4, 64, 128, 128, signal_granularity="tile")


def test_signal_validation():
    lay = make_signal_layout("m_block", 100, 256, 64, 128, 4)  # 4 experts x 2 m-blocks
    ok = torch.zeros(8, dtype=torch.int32)
    validate_signals(ok, lay, None)
    with pytest.raises(TypeError, match="dst_signals.*int32"):
        validate_signals(torch.zeros(8, dtype=torch.int64), lay, None)
    with pytest.raises(TypeError, match="dst_signals"):
        validate_signals([0] * 8, lay, None)
    with pytest.raises(ValueError, match="at least 8"):
        validate_signals(torch.zeros(7, dtype=torch.int32), lay, None)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        validate_signals(torch.zeros(16, dtype=torch.int32)[::2], lay, None)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        validate_signals(torch.zeros(2, 8, dtype=torch.int32), lay, None)
    with pytest.raises(ValueError, match="dst_signals is on cpu"):
        validate_signals(ok, lay, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="signal_granularity"):
        make_signal_layout("rows", 100, 256, 64, 128, 4)


@pytest.mark.parametrize("mode", ["m_block", "expert"])
def test_ptx_publishes_with_release(mode, kernel_ptx):
    ptx = kernel_ptx(KernelSpec(MID_CONFIG, Format.BF16, mode))
    assert "red.release.gpu.global.add.s32" in ptx
    # waits for the bulk stores to complete, not only to release shared memory
    assert re.search(r"cp\.async\.bulk\.wait_group\s", ptx)
    assert "fence.proxy.async.global" in ptx
    # the release add is the only GPU-scope ordering: an extra fence.acq_rel.gpu
    # before it cost ~1% on the small decode cases (docs/signals.md)
    assert "fence.acq_rel.gpu" not in ptx
    plain = kernel_ptx(KernelSpec(MID_CONFIG, Format.BF16))
    assert "red.release.gpu" not in plain
    # in order: the bulk stores complete, the proxy fence, the release add
    assert "signal-publish" in ptx_features(ptx) and "signal-publish" not in ptx_features(plain)
    # partial tiles reach the store warp through the signal pipeline's
    # mbarriers (a CTA-local release arrive), not through another named barrier
    assert ptx.count("mbarrier.init") == plain.count("mbarrier.init") + 2 * SIGNAL_STAGES
    assert "mbarrier.arrive.shared.b64" in ptx and "mbarrier.arrive.shared.b64" not in plain
    named = r"\bbar(?:rier)?\.(?:sync|arrive)\b"
    assert len(re.findall(named, ptx)) == len(re.findall(named, plain))


def test_combine_ptx_polls_with_acquire_and_backoff(kernel_ptx):
    from flashgemm.signals import DEFAULT_ROWS_PER_ITEM

    ptx = kernel_ptx(("combine", 64, DEFAULT_ROWS_PER_ITEM))
    assert "ld.acquire.gpu.global.b32" in ptx  # the wait's poll
    assert "nanosleep" in ptx  # back-off between polls
    assert "atom.global.or.b32" in ptx  # timeout / bad-token error bits
    assert "ld.global.v4" in ptx  # 16-byte loads of the GEMM output rows
    # rows are staged in shared memory and added by the bulk-copy engine
    assert "fence.proxy.async.shared::cta" in ptx
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx)  # double-buffered staging
    assert {"bulk-reduce", "acquire-poll"} <= set(ptx_features(ptx))


def _cpu_combine_args(e_count=2, max_m=64, n=128):
    """combine_masked's arguments up to ``combined``, on the CPU (validation
    only), with the m_block layout of a DECODE_CONFIG call (block_m 64)."""
    layout = signal_layout(e_count, max_m, n, 64, config=DECODE_CONFIG, num_sms=8)
    return (
        torch.zeros(e_count, max_m, n, dtype=torch.bfloat16),
        torch.zeros(e_count, dtype=torch.int32),
        torch.zeros(layout.size, dtype=torch.int32),
        layout,
        torch.zeros(e_count, max_m, dtype=torch.int32),
        torch.zeros(e_count, max_m),
    )


def test_combine_rejects_a_misaligned_output(fake_gpu):
    from flashgemm.overlap import combine_masked

    tokens, n = 16, 128
    combined = torch.zeros(tokens * n + 1)[1:].view(tokens, n)  # 4 bytes past an aligned base
    with pytest.raises(ValueError, match="combined must start at a 16-byte aligned"):
        combine_masked(*_cpu_combine_args(n=n), combined, num_sms=8)


@pytest.mark.parametrize("rows", [0, 3, 128, True, 4.0])
def test_combine_rejects_bad_rows_per_item(rows, fake_gpu):
    from flashgemm.signals import check_rows_per_item
    from flashgemm.sm90.combine import MaskedCombineSm90
    from flashgemm.overlap import combine_masked

    match = "rows_per_item must be a power of two dividing block_m=64"
    with pytest.raises(ValueError, match=match):
        combine_masked(*_cpu_combine_args(), torch.zeros(16, 128), num_sms=8, rows_per_item=rows)
    with pytest.raises(ValueError, match=match):  # the kernel class checks the same rule
        MaskedCombineSm90(64, rows)
    with pytest.raises(ValueError, match=match):  # ... from flashgemm.signals
        check_rows_per_item(rows, 64)


def test_signal_layout_follows_the_fp8_wave_rule(fake_gpu):
    # qwen3-30b-ep8 shapes: the fp8 heuristic takes 64-wide tiles on a 132-SM
    # grid, 128-wide on 12 SMs; the layout the combine sets up must match
    lay = signal_layout(16, 256, 1536, 2048, expected_m=64, num_sms=132, fp8=True)
    assert (lay.block_m, lay.block_n, lay.n_tiles) == (128, 64, 24)
    lay = signal_layout(16, 256, 1536, 2048, expected_m=64, num_sms=12, fp8=True)
    assert (lay.block_m, lay.block_n, lay.n_tiles) == (128, 128, 12)


@pytest.mark.parametrize("num_sms, error", [(0, ValueError), (-1, ValueError), (133, ValueError),
                                            ("4", TypeError), (4.0, TypeError), (True, TypeError)])
def test_signal_layout_checks_num_sms_like_the_call(fake_gpu, num_sms, error):
    """signal_layout takes num_sms as the call does, and refuses what the
    call refuses (the same check_num_sms), before picking a config."""
    with pytest.raises(error, match=r"^num_sms must be (an int or None|>= 1|in \[1, 132\] on cuda:0), got"):
        signal_layout(8, 256, 1024, 1024, num_sms=num_sms)
    assert signal_layout(8, 256, 1024, 1024, num_sms=132) == signal_layout(8, 256, 1024, 1024)


def test_signal_layout_sizes_the_grid_from_its_device(monkeypatch):
    """The grid cap (and so the fp8 wave rule's pick) comes from the SM
    count of ``device``, by default the current CUDA device."""
    from flashgemm import api

    asked = []
    sms = {0: 132, 1: 12}

    def device_facts(index):
        asked.append(index)
        return (9, 0), sms[index], "NVIDIA H100 (fake)"

    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(api, "device_facts", device_facts)
    args, kw = (16, 256, 1536, 2048), dict(expected_m=64, fp8=True)
    # (qwen3-30b-ep8 shapes: 64-wide tiles on 132 SMs, 128-wide on 12)
    on_0 = signal_layout(*args, **kw)
    assert (on_0.block_m, on_0.block_n, on_0.n_tiles) == (128, 64, 24) and asked == [0]
    on_1 = signal_layout(*args, **kw, device="cuda:1")
    assert (on_1.block_m, on_1.block_n, on_1.n_tiles) == (128, 128, 12) and asked == [0, 1]
    assert signal_layout(*args, **kw, device=torch.device("cuda", 1)) == on_1 and asked[-1] == 1
    assert signal_layout(*args, **kw, device="cuda:0") == on_0 and asked[-1] == 0
    assert signal_layout(*args, **kw, device="cuda:0", num_sms=12) == on_1  # the same grid
    with pytest.raises(ValueError, match=r"^num_sms must be in \[1, 12\] on cuda:1, got 13$"):
        signal_layout(*args, **kw, device="cuda:1", num_sms=13)
    # "cuda" without an index, or no device: the current one
    current[0] = 1
    assert signal_layout(*args, **kw, device="cuda") == on_1 and asked[-1] == 1
    assert signal_layout(*args, **kw) == on_1 and asked[-1] == 1


def test_signal_layout_needs_a_cuda_device_or_num_sms(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="signal_layout needs a CUDA device, or num_sms"):
        signal_layout(8, 256, 1024, 1024)
    with pytest.raises(ValueError, match="device must be a CUDA device, got cpu"):
        signal_layout(8, 256, 1024, 1024, num_sms=8, device="cpu")


# the kernels read above (all of them are listed by the compile CLI too)
PTX_SPECS = tuple(KernelSpec(MID_CONFIG, Format.BF16, mode) for mode in (None, "m_block", "expert"))


BAD_SIZES = [
    (dict(num_experts=-1), ValueError, r"^num_experts must be >= 1, got -1$"),
    (dict(num_experts=0), ValueError, r"^num_experts must be >= 1, got 0$"),
    (dict(max_m=0), ValueError, r"^max_m must be >= 1, got 0$"),
    (dict(max_m=64.5), TypeError, r"^max_m must be an int, got float$"),
    (dict(max_m=True), TypeError, r"^max_m must be an int, got bool$"),
    (dict(n=127), ValueError,
     r"^n \(the call's N, b\.shape\[1\]\) must be a multiple of 8 for bf16 operands, got 127$"),
    (dict(n="128"), TypeError, r"^n must be an int, got str$"),
    (dict(k=0), ValueError, r"^k must be >= 1, got 0$"),
    (dict(k=36), ValueError, r"^k \(the call's K, in elements\) must be a multiple of 8 for bf16 operands, got 36$"),
    (dict(n=136, fp8=True), ValueError, r"^n .* multiple of 16 for fp8_block128 operands, got 136$"),
    (dict(k=200, fp8=True), ValueError, r"^k .* multiple of 16 for fp8_block128 operands, got 200$"),
    (dict(k=48, fmt="nvfp4"), ValueError, r"^k .* multiple of 32 for nvfp4 operands, got 48$"),
    (dict(n=12, fmt="mxfp8"), ValueError, r"^n .* multiple of 8 for mxfp8 operands, got 12$"),
    (dict(expected_m=-2), ValueError, r"^expected_m must be >= 0"),
    (dict(num_sms=0), ValueError, r"^num_sms must be >= 1, got 0$"),
    (dict(config={"tile_m": 64}), TypeError, r"^config must be a flashgemm\.GemmConfig"),
    (dict(config=GemmConfig(stages=2.5)), ValueError, r"^config\.stages must be an int, got 2\.5 \(float\)$"),
    (dict(config=GemmConfig(cluster_n=2, tail=Tail.SPLIT)), ValueError, r"^config\.tail=SPLIT cannot publish"),
    (dict(signal_granularity="tile"), ValueError, r"^signal_granularity must be one of"),
]


def _change_id(change: dict) -> str:
    return ",".join(f"{k}={v.short_name() if isinstance(v, GemmConfig) else v}" for k, v in change.items())


@pytest.mark.parametrize("change, error, message", BAD_SIZES, ids=[_change_id(c) for c, _, _ in BAD_SIZES])
def test_signal_layout_checks_its_arguments_before_the_device(fake_gpu, change, error, message):
    """signal_layout refuses what the call would refuse, naming the argument,
    without asking the device (a GPU is visible here: only the checks stop it)."""
    args = dict(num_experts=4, max_m=64, n=128, k=256)
    args.update(change)
    with pytest.raises(error, match=message):
        signal_layout(args.pop("num_experts"), args.pop("max_m"), args.pop("n"), args.pop("k"), **args)
    assert fake_gpu == []


def test_signal_layout_accepts_the_smallest_sizes(fake_gpu):
    assert signal_layout(1, 1, 8, 8).size == 1
    assert signal_layout(1, 1, 16, 16, fp8=True).n_tiles == 1


def test_signal_layout_with_num_sms_needs_no_gpu(fake_gpu, monkeypatch):
    """Given num_sms, a machine without a GPU gets the layout of the compile
    target's kernels ($CUTE_DSL_ARCH, sm_90a by default) at that grid: the
    one a GPU of that arch gives."""
    from flashgemm import api

    cases = [dict(expected_m=32), dict(expected_m=64, fp8=True),
             dict(config=DECODE_CONFIG, signal_granularity="expert")]
    on_gpu = [signal_layout(16, 256, 1536, 2048, num_sms=12, **kw) for kw in cases]

    def no_device(index):
        raise AssertionError("the device was queried")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(api, "device_facts", no_device)
    monkeypatch.setattr(api, "default_arch", lambda: "sm_90a")
    assert [signal_layout(16, 256, 1536, 2048, num_sms=12, **kw) for kw in cases] == on_gpu
    with pytest.raises(ValueError, match="format 'mxfp8' needs a Blackwell GPU"):
        signal_layout(16, 256, 1536, 2048, num_sms=12, fmt="mxfp8")
    monkeypatch.setattr(api, "default_arch", lambda: "sm_100a")
    planned = signal_layout(16, 1024, 4096, 512, fmt="mxfp8", expected_m=512, num_sms=148)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(api, "device_facts", lambda index: ((10, 0), 148, "NVIDIA B200 (fake)"))
    assert signal_layout(16, 1024, 4096, 512, fmt="mxfp8", expected_m=512) == planned


@pytest.mark.parametrize("arch, capability", [("sm_90a", (9, 0)), ("sm_100a", (10, 0)), ("sm_103a", (10, 3))])
def test_compile_target_capability(monkeypatch, arch, capability):
    from flashgemm import backend

    assert backend.for_arch(arch) is backend.for_capability(capability)
    assert backend.for_arch(arch).name == ("sm90" if capability[0] == 9 else "sm100")
