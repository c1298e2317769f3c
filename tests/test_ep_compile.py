"""The EP combine and its completion step compiled for sm_90a without a GPU,
their PTX checked; and the CPU-side rules of the EP buffers (multicast off)."""

import re

import pytest
import torch

from flashgemm.ep import buffers as ep_buffers
from flashgemm.ep.combine import build_ep_combine, build_ep_complete, describe_error


@pytest.fixture(scope="module", params=[(64, 1), (128, 4)], ids=["64x1", "128x4"])
def combine_ptx(request):
    block_m, rows_per_item = request.param
    return build_ep_combine(block_m, rows_per_item, "sm_90a", keep_ptx=True).__ptx__


@pytest.fixture(scope="module")
def complete_ptx():
    return build_ep_complete("sm_90a", keep_ptx=True).__ptx__


def _lines(ptx, pattern):
    lines = (line.strip() for line in ptx.splitlines())
    return [line for line in lines if re.search(pattern, line)]


def test_polls_the_gemm_signals_with_gpu_scope_acquire(combine_ptx):
    ptx = combine_ptx
    assert _lines(ptx, r"ld\.acquire\.gpu\.global\.b32")
    assert _lines(ptx, r"nanosleep")  # backed-off, bounded poll


def test_rows_leave_as_plain_16_byte_stores(combine_ptx):
    ptx = combine_ptx
    assert _lines(ptx, r"^st\.global\.v4\.b32")  # one writer per (token, slot): no remote atomics
    rows = [r for r in _lines(ptx, r"^red\.") if ".s32" not in r]
    assert not rows, rows  # the only reductions left are the int32 completion counts


def test_warps_find_their_rows_32_experts_at_a_time(combine_ptx):
    # lane-parallel loads of masked_m and one warp scan, not one dependent load per expert
    assert _lines(combine_ptx, r"shfl\.sync\.up\.b32")
    assert _lines(combine_ptx, r"vote\.sync\.ballot\.b32")
    assert _lines(combine_ptx, r"popc\.b32")


def test_completion_is_release_acquire_at_system_scope(combine_ptx, complete_ptx):
    for ptx in (combine_ptx, complete_ptx):
        assert _lines(ptx, r"red\.release\.sys\.global\.add\.s32")  # count into each peer's flags
        assert _lines(ptx, r"ld\.acquire\.sys\.global\.b32")  # wait for each peer's count
        assert _lines(ptx, r"fence\.acq_rel\.sys")  # row writes performed before the count
        assert _lines(ptx, r"atom\.global\.sys\.or\.b32")  # a local error posted to the peers
    assert _lines(combine_ptx, r"atom\.global\.acq_rel\.add")  # the CTA-done counter
    assert not _lines(complete_ptx, r"^st\.global\.v4")  # the completion step writes no rows


@pytest.mark.parametrize("ids_dtype,sums", [(torch.int64, torch.float32), (torch.int32, torch.bfloat16)])
def test_token_sum_loads_every_slot_at_once(ids_dtype, sums):
    from flashgemm.ep.combine import build_token_sum

    ptx = build_token_sum(8, ids_dtype, sums, "sm_90a", keep_ptx=True).__ptx__
    assert len(_lines(ptx, r"^ld\.global\.v4")) == 8  # the 8 slots' 16-byte loads, unrolled
    assert len(_lines(ptx, r"^st\.global\.v4")) == (2 if sums == torch.float32 else 1)
    assert ".local" not in ptx


def test_no_multicast_anywhere(combine_ptx, complete_ptx):
    for ptx in (combine_ptx, complete_ptx):
        assert "multimem" not in ptx
        assert "cp.reduce.async.bulk" not in ptx


def test_multicast_off_env_sets_and_refuses():
    env = {}
    assert ep_buffers.multicast_off_env(env) == ep_buffers.MULTICAST_OFF
    assert env == ep_buffers.MULTICAST_OFF
    ep_buffers.check_multicast_off(env)
    with pytest.raises(RuntimeError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST='0'.*set TORCH_SYMM_MEM_DISABLE"):
        ep_buffers.multicast_off_env({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"})
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE=None"):
        ep_buffers.check_multicast_off({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})


def test_alloc_checks_arguments_before_the_engine():
    with pytest.raises(ValueError, match="hidden must be a multiple of 8"):
        ep_buffers.alloc_token_buffers(4, 12, 2)
    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.bfloat16"):
        ep_buffers.alloc_token_buffers(4, 16, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        ep_buffers.alloc_token_buffers(0, 16, 2)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        ep_buffers.alloc_token_buffers(4, 16, 0)


def test_peer_addresses_from_the_engine_handle():
    from types import SimpleNamespace

    handle = SimpleNamespace(buffer_ptrs=[1 << 20, 3 << 20], buffer_size=1 << 16, multicast_ptr=0)
    assert ep_buffers.peer_addresses(handle, (3 << 20) + 512, 1, 2) == [(1 << 20) + 512, (3 << 20) + 512]
    with pytest.raises(RuntimeError, match="refusing to run"):
        ep_buffers.peer_addresses(SimpleNamespace(buffer_ptrs=[0], multicast_ptr=1 << 30), 0, 0, 1)
    with pytest.raises(RuntimeError, match="gave 2 peer addresses for a group of 4"):
        ep_buffers.peer_addresses(handle, 1 << 20, 0, 4)
    with pytest.raises(RuntimeError, match="outside its allocation"):
        ep_buffers.peer_addresses(handle, (1 << 20) + (1 << 16), 0, 2)


def test_error_word_in_words():
    assert describe_error(0) == ""
    text = describe_error(4 | 1, rank=3)
    assert text.startswith("rank 3: EP error word 0x5")
    assert "peer did not report completion" in text and "timed out" in text


def test_layer_forms():
    from flashgemm.ep.layer import CombineForm, check_form

    for form in CombineForm:
        assert check_form(form) is form
    with pytest.raises(TypeError, match="form must be a CombineForm"):
        check_form("fused")


def test_destinations_name_owner_token_and_slot():
    from flashgemm.ep.plan import CombineRouting

    i32 = torch.int32
    routing = CombineRouting(torch.tensor([[1, 0, -1]], dtype=i32), torch.tensor([[5, 2, -1]], dtype=i32),
                             torch.tensor([[3, 0, -1]], dtype=i32), torch.ones(1, 3))
    # rows per rank 40 = 10 tokens x top-4
    assert routing.destinations(40, 4).tolist() == [[40 + 5 * 4 + 3, 2 * 4, -1]]


def test_the_combine_is_cached_like_the_gemms():
    from flashgemm.ep.combine import DEFAULT_EP_ROWS_PER_ITEM, get_ep_combine
    from flashgemm.jit import cache

    first = get_ep_combine(64, DEFAULT_EP_ROWS_PER_ITEM, "sm_90a")
    builds = cache.compile_count
    assert get_ep_combine(64, DEFAULT_EP_ROWS_PER_ITEM, "sm_90a") is first
    assert cache.compile_count == builds


def test_combine_kernel_refuses_bad_rows_per_item():
    from flashgemm.ep.combine_kernel import EpCombineSm90

    with pytest.raises(ValueError, match="rows_per_item must be a power of two dividing block_m=64"):
        EpCombineSm90(64, 3)
