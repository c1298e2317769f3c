"""The device dispatch compiled for sm_90a without a GPU, its PTX checked; its
buffer layout and argument checks on the CPU."""

import re

import pytest
import torch

from flashgemm.ep.device_dispatch import (
    ALIGN,
    DispatchBuffers,
    build_ep_dispatch,
    check_dispatch_args,
    local_dispatch_buffers,
    make_layout,
)

TOP_K = 8


@pytest.fixture(scope="module", params=[True, False], ids=["fp8", "bf16"])
def dispatch_ptx(request):
    return request.param, build_ep_dispatch(TOP_K, request.param, torch.int64, "sm_90a", keep_ptx=True).__ptx__


def _lines(ptx, pattern):
    lines = (line.strip() for line in ptx.splitlines())
    return [line for line in lines if re.search(pattern, line)]


def test_rows_are_claimed_with_system_scope_atomics_on_the_owner(dispatch_ptx):
    _, ptx = dispatch_ptx
    assert len(_lines(ptx, r"^atom\.global\.sys\.add\.u32")) == 1  # one slot claim per (token, slot) lane
    assert len(_lines(ptx, r"^atom\.global\.sys\.exch\.b32")) == 1  # counters taken and reset by the owner
    assert not _lines(ptx, r"^red\.")  # no reductions into rows


def test_rows_leave_as_16_byte_stores_one_per_slot(dispatch_ptx):
    fp8, ptx = dispatch_ptx
    rows = _lines(ptx, r"^st\.global\.v4\.b32")
    assert len(rows) == TOP_K * (1 if fp8 else 2)  # 16 fp8 or 2 x 8 bf16 values per slot, unrolled
    assert ".local" not in ptx


def test_fp8_quantization_is_the_host_recipe(dispatch_ptx):
    fp8, ptx = dispatch_ptx
    if not fp8:
        assert not _lines(ptx, r"cvt\.rn\.satfinite\.e4m3x2")
        return
    assert len(_lines(ptx, r"^shfl\.sync\.bfly")) == 3  # |max| over the 8 lanes of a 128-column block
    assert len(_lines(ptx, r"^div\.rn\.f32")) == 16  # x / scale for 16 values (the scale: amax * fl(1/448))
    assert len(_lines(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32")) == 8
    assert not _lines(ptx, r"div\.(approx|full)")


def test_arrival_is_release_acquire_at_system_scope(dispatch_ptx):
    _, ptx = dispatch_ptx
    assert len(_lines(ptx, r"^st\.release\.sys\.global\.b32")) == 1  # the sequence number into each peer
    assert _lines(ptx, r"^ld\.acquire\.sys\.global\.b32")  # wait for each peer's
    assert len(_lines(ptx, r"^fence\.acq_rel\.sys")) == 2  # rows performed before the count and the post
    assert _lines(ptx, r"atom\.global\.sys\.or\.b32")  # a local error posted to the peers
    assert _lines(ptx, r"nanosleep")  # backed-off, bounded poll
    assert "multimem" not in ptx


def test_layout_regions_are_aligned_and_disjoint():
    lay = make_layout(7168, 256, 4, 128, fp8=True)
    assert lay.e_local == 64 and lay.max_m == 512
    starts = [0, lay.counters, lay.meta, lay.x, lay.scale, lay.nbytes]
    assert starts == sorted(starts)
    assert all(s % ALIGN == 0 for s in (lay.meta, lay.x, lay.scale))
    assert lay.x - lay.meta == 4 * 64 * 512 * 4
    assert lay.scale - lay.x == 64 * 512 * 7168
    assert lay.nbytes - lay.scale == 64 * 56 * 512 * 4
    assert make_layout(7168, 256, 4, 128, fp8=True, max_m=100).max_m == 112  # the stated capacity, rounded up
    bf16 = make_layout(7168, 256, 4, 128, fp8=False)
    assert bf16.nbytes == bf16.scale and bf16.scale - bf16.x == 64 * 512 * 7168 * 2


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(hidden=7160), ValueError, "hidden must be a multiple of 16"),
    (dict(num_experts=250), ValueError, r"num_experts \(250\) must be a multiple of world_size \(4\)"),
    (dict(max_tokens=0), ValueError, "max_tokens must be an int >= 1"),
    (dict(max_m=0), ValueError, "max_m must be an int >= 1"),
    (dict(max_tokens=2**20), ValueError, "must stay below 2\\*\\*31"),
])
def test_layout_errors_name_the_argument(kwargs, exc, match):
    args = dict(hidden=7168, num_experts=256, world=4, max_tokens=128, fp8=True)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        make_layout(**args)


def _call_args():
    buffers = local_dispatch_buffers(16, 256, 2, 8, fp8=True, device="cpu")
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    ids = torch.zeros(16, 2, dtype=torch.int64)
    w = torch.zeros(16, 2)
    return x, ids, w, buffers


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: {"x": a["x"].float()}, ValueError, r"x must be a \[T, H\] bfloat16 tensor"),
    (lambda a: {"x": a["x"][:, :128]}, ValueError, "x has H=128, the buffers H=256"),
    (lambda a: {"x": torch.zeros(17, 256, dtype=torch.bfloat16)}, ValueError, "more than the buffers' max_tokens=16"),
    (lambda a: {"ids": a["ids"].float()}, TypeError, "topk_ids must be a tensor of dtype"),
    (lambda a: {"ids": a["ids"][:, :1]}, ValueError, r"topk_ids must be a contiguous \[T, k\] = \(16, 2\)"),
    (lambda a: {"w": a["w"].half()}, TypeError, "topk_weights must be a tensor of dtype torch.float32"),
    (lambda a: {"w": a["w"].t().contiguous().t()}, ValueError, "topk_weights must be a contiguous"),
    (lambda a: {"buffers": object()}, TypeError, "buffers must be a flashgemm.ep.device_dispatch.DispatchBuffers"),
    (lambda a: {"max_polls": 0}, ValueError, "max_polls must be an int in"),
])
def test_argument_errors_name_the_argument(change, exc, match):
    x, ids, w, buffers = _call_args()
    args = dict(x=x, ids=ids, w=w, buffers=buffers, max_polls=10)
    args.update(change(args))
    with pytest.raises(exc, match=match):
        check_dispatch_args(args["x"], args["ids"], args["w"], args["buffers"], args["max_polls"])
    check_dispatch_args(x, ids, w, buffers, 10)  # the unchanged call passes


def test_buffer_views_share_the_raw_allocation():
    buffers = local_dispatch_buffers(16, 256, 2, 8, fp8=True, device="cpu")
    assert isinstance(buffers, DispatchBuffers)
    raw = buffers.raw.data_ptr()
    lay = buffers.layout
    assert buffers.x.data_ptr() - raw == lay.x and buffers.x.shape == (8, 16, 256)
    assert buffers.x_scale.data_ptr() - raw == lay.scale and buffers.x_scale.stride() == (2 * 16, 1, 16)
    r = buffers.routing
    assert [t.data_ptr() - raw for t in (r.src_rank, r.src_token, r.src_slot, r.weight)] == \
        [lay.meta + i * lay.table_bytes for i in range(4)]
    assert r.weight.dtype == torch.float32 and buffers.counters.data_ptr() - raw == lay.counters
