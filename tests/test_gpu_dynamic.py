"""GPU tests of the dynamic tile order (``TileOrder.DYNAMIC``; skipped without sm_90).

Each launch claims units from its stream's counter and must leave it at zero:
the next launch on that stream starts from it without any memset.
"""

import pytest
import torch

import flashgemm
from flashgemm import workspace
from flashgemm.config import Tail, TileOrder
from flashgemm.sm90.heuristic import (
    DECODE_128_CONFIG,
    DECODE_CONFIG,
    FP8_DECODE_CONFIG,
    FP8_DECODE_N64_CONFIG,
    FP8_MID_CONFIG,
    MID_192_CONFIG,
    MID_CONFIG,
)

from flashgemm.reference import grouped_gemm_nt_masked_ref, relative_error
from flashgemm.timing import capture_graph

from conftest import requires_hopper
from test_gpu_fp8 import _check as _check_fp8
from test_gpu_fp8 import _fp8_case
from test_gpu_fp8 import _poisoned_out as _poisoned_out_fp8
from test_gpu_gemm import POISON, _check, _poisoned_out, _random_case

pytestmark = requires_hopper


def _dyn(cfg, **kw):
    """The dynamic order (it replaces the static order's tail rule)."""
    return cfg.replace(order=TileOrder.DYNAMIC, tail=Tail.NONE, **kw)


BF16_CONFIGS = [
    _dyn(DECODE_CONFIG),  # 2-CTA cluster: the claim crosses to the peer
    _dyn(DECODE_128_CONFIG),
    _dyn(MID_192_CONFIG),  # three consumer warpgroups
    _dyn(MID_CONFIG, cluster_n=1),
]
# (FP8_MID_CONFIG's n-major order becomes the dynamic one: the two are one field now)
FP8_CONFIGS = [_dyn(FP8_DECODE_CONFIG), _dyn(FP8_DECODE_N64_CONFIG), _dyn(FP8_MID_CONFIG, l2_hints=True)]

SHAPES = [
    # (E, max_m, N, K, masked_m): empty experts, m_e past max_m, negative m_e
    (4, 256, 256, 512, [0, 1, 256, 1000]),
    (5, 384, 1032, 1040, [384, 130, 129, 128, 0]),  # odd n-block counts
    (64, 96, 256, 128, "random"),
    (3, 64, 128, 128, [0, 0, 0]),  # no work at all
]


def _counter_is_zero():
    torch.cuda.synchronize()
    counter = workspace.claim_counter(torch.cuda.current_device())
    assert counter.tolist() == [0, 0], f"claim counter left at {counter.tolist()}"


def _masked(spec, e_count, max_m):
    if spec == "random":
        return torch.randint(0, max_m + 1, (e_count,)).tolist()
    return spec


@pytest.mark.parametrize("num_sms", [None, 6, 2])  # 6 / 2 SMs: many claims per cluster
@pytest.mark.parametrize("config", BF16_CONFIGS, ids=lambda c: c.short_name())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_bf16_matches_reference(config, shape, num_sms, seed):
    e_count, max_m, n, k, masked = shape
    a, b, masked_m = _random_case(e_count, max_m, n, k, _masked(masked, e_count, max_m))
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config, num_sms=num_sms)
    _check(a, b, masked_m, out, buf)
    _counter_is_zero()


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=lambda c: c.short_name())
@pytest.mark.parametrize("num_sms", [None, 4])
def test_fp8_matches_reference(config, num_sms, seed):
    e_count, max_m, n, k = 6, 300, 528, 2880  # 528: five 128-wide n-blocks, one partial
    masked = [0, 300, 129, 64, 1, 257]
    a, a_scale, b, b_scale, masked_m = _fp8_case(e_count, max_m, n, k, masked)
    buf, out = _poisoned_out_fp8(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=config, num_sms=num_sms
    )
    _check_fp8(a, a_scale, b, b_scale, masked_m, out, buf)
    _counter_is_zero()


def test_back_to_back_launches_each_start_from_zero(seed):
    """Twenty launches queued on one stream with no sync between them, each
    with its own masked_m and output: a counter not returned to zero would
    make a later launch skip units (poisoned rows) or run past the end."""
    e_count, max_m, n, k = 8, 256, 512, 256
    config = _dyn(DECODE_128_CONFIG)
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    runs = []
    for _ in range(20):
        masked_m = torch.randint(0, max_m + 1, (e_count,), dtype=torch.int32, device="cuda")
        buf, out = _poisoned_out(e_count, max_m, n)
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config, num_sms=16)
        runs.append((masked_m, out, buf))
    for masked_m, out, buf in runs:
        _check(a, b, masked_m, out, buf)
    _counter_is_zero()


def test_two_streams_use_their_own_counters(seed):
    """Launches interleaved on two streams run concurrently; each stream has
    its own counter, so neither steals the other's units."""
    e_count, max_m, n, k = 8, 256, 1024, 1024
    config = _dyn(DECODE_128_CONFIG)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cases = []
    for s in streams:
        a, b, masked_m = _random_case(e_count, max_m, n, k, torch.randint(1, max_m + 1, (e_count,)).tolist())
        cases.append((a, b, masked_m, [_poisoned_out(e_count, max_m, n) for _ in range(6)]))
    torch.cuda.synchronize()
    for i in range(6):
        for s, (a, b, masked_m, outs) in zip(streams, cases):
            with torch.cuda.stream(s):
                flashgemm.grouped_gemm_nt_masked(a, b, outs[i][1], masked_m, config=config, num_sms=64)
    torch.cuda.synchronize()
    for a, b, masked_m, outs in cases:
        for buf, out in outs:
            _check(a, b, masked_m, out, buf)
    counters = []
    for s in streams:
        with torch.cuda.stream(s):
            counters.append(workspace.claim_counter(torch.cuda.current_device()))
    assert counters[0].data_ptr() != counters[1].data_ptr()
    assert all(c.tolist() == [0, 0] for c in counters)


def test_graph_replay_with_new_masked_m(seed):
    e_count, max_m, n, k = 8, 256, 512, 512
    config = _dyn(DECODE_CONFIG)
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    masked_m = torch.randint(0, max_m + 1, (e_count,), dtype=torch.int32, device="cuda")
    buf, out = _poisoned_out(e_count, max_m, n)
    graph = capture_graph(lambda: flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config), calls=1)
    for _ in range(5):
        a.copy_(torch.randn_like(a))
        masked_m.copy_(torch.randint(0, max_m + 1, (e_count,), dtype=torch.int32))
        buf.fill_(POISON)
        graph.replay()
        _check(a, b, masked_m, out, buf)


@pytest.mark.parametrize("granularity", ["m_block", "expert"])
def test_signals_count_every_tile_once(granularity, seed):
    e_count, max_m, n, k = 7, 200, 328, 192
    config = _dyn(DECODE_CONFIG)
    masked_m = torch.tensor([0, 1, 64, 65, 200, 999, -3], dtype=torch.int32, device="cuda")
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    layout = flashgemm.signal_layout(e_count, max_m, n, k, config=config, signal_granularity=granularity)
    sig = flashgemm.alloc_signals(layout, "cuda")
    buf, out = _poisoned_out(e_count, max_m, n)
    flashgemm.grouped_gemm_nt_masked(
        a, b, out, masked_m, config=config, num_sms=8, dst_signals=sig, signal_granularity=granularity
    )
    _check(a, b, masked_m, out, buf)
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), max_m))
    _counter_is_zero()


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_full_grid_gemm_behind_a_resident_combine(dynamic, seed):
    """A combine already holds 20 SMs, polling for the GEMM's signals, when
    the GEMM is launched on every SM (num_sms not capped, against the
    co-residency rule of ``overlap``). The clusters that find no free SMs
    start only when the combine ends. In the static order they own units, so
    the combine waits on tiles nobody computes and times out (checked here, so
    the test is known to build that situation); in the dynamic order the
    resident clusters claim every unit and the combine completes."""
    from flashgemm.device.errors import ERR_TIMEOUT
    from flashgemm.overlap import combine_masked
    from test_gpu_signals import _reference_combine, _routing

    e_count, max_m, n, k, num_tokens = 8, 256, 2048, 1024, 64
    config = DECODE_CONFIG.replace(order=TileOrder.DYNAMIC if dynamic else TileOrder.EXPERT_MAJOR)
    assert config.dynamic == dynamic
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    masked_m = torch.randint(1, max_m + 1, (e_count,), dtype=torch.int32, device="cuda")
    out = torch.empty(e_count, max_m, n, device="cuda", dtype=torch.bfloat16)
    layout = flashgemm.signal_layout(e_count, max_m, n, k, config=config)
    out_ref = grouped_gemm_nt_masked_ref(a, b, masked_m)
    sig = flashgemm.alloc_signals(layout, "cuda")
    token_idx, weight = _routing(e_count, max_m, num_tokens)
    combined = torch.zeros(num_tokens, n, device="cuda")
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config)  # compile first
    out.fill_(float("nan"))  # a combine read before the rows landed shows
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        err = combine_masked(out, masked_m, sig, layout, token_idx, weight, combined, num_sms=20,
                             max_polls=2_000_000)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config, dst_signals=sig)
    torch.cuda.synchronize()
    assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), max_m))  # every tile, once
    if not dynamic:
        assert err.item() & ERR_TIMEOUT, "the combine did not hold its SMs: the test builds nothing"
        return
    assert err.item() == 0
    for e, m in enumerate(masked_m.tolist()):
        assert relative_error(out[e, :m].float(), out_ref[e, :m]) < 1e-2
    ref = _reference_combine(out, masked_m, token_idx, weight, num_tokens)
    assert not combined.isnan().any(), "the combine read rows before they were written"
    assert relative_error(combined, ref) < 1e-5  # same inputs, only the fp32 add order differs


def test_graphs_and_eager_launches_never_share_a_counter(seed):
    """Two graphs captured on one stream are replayed at the same time on two
    other streams while an eager launch runs on the capture stream: each
    captured launch has a counter of its own (zeroed before capture, so the
    graphs hold no memset), so none of the three steals another's units."""
    e_count, max_m, n, k = 8, 256, 1024, 1024
    config = _dyn(DECODE_128_CONFIG)
    cap = torch.cuda.Stream()
    cases = []
    for _ in range(3):
        a, b, masked_m = _random_case(e_count, max_m, n, k, torch.randint(1, max_m + 1, (e_count,)).tolist())
        cases.append((a, b, masked_m, *_poisoned_out(e_count, max_m, n)))

    def launch(case):
        a, b, masked_m, _, out = case
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, config=config, num_sms=64)

    with torch.cuda.stream(cap):
        for case in cases:
            launch(case)  # warm-up: compile, plan, the zeroed counters for graphs
    torch.cuda.synchronize()
    used = workspace.graph_slots_used(torch.cuda.current_device())
    graphs = []
    for case in cases[:2]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=cap):
            launch(case)
        graphs.append(g)
    assert workspace.graph_slots_used(torch.cuda.current_device()) == used + 2
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(4):
        for case in cases:
            case[3].fill_(POISON)
        torch.cuda.synchronize()
        for g, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                g.replay()
        with torch.cuda.stream(cap):
            launch(cases[2])
        torch.cuda.synchronize()
        for a, b, masked_m, buf, out in cases:
            _check(a, b, masked_m, out, buf)
