"""Host side of the signalled expert-parallel combine (form b): argument
checks, the compile (cached like the GEMMs) and the launch.

``combine_to_owners(y, masked_m, dst_signals, layout, routing, buffers,
num_sms=...)`` launches ``combine_kernel.EpCombineSm90`` on the current
stream: every valid row of ``y`` goes, times its weight, into its owner
rank's receive buffer as soon as the down GEMM has signalled its m-block;
the kernel ends once every peer has reported completion. Launch it on a side
stream while the GEMM runs, within the SMs the GEMM leaves free
(``flashgemm.overlap``'s co-residency rule), or after the GEMM.
``complete(buffers, err)`` is the completion step alone, after a down GEMM
whose epilogue wrote the rows itself (``Combine.peers``). Then
``finalize(buffers, topk_ids)`` sums each token's k received rows, in slot
order with fp32 accumulation (deterministic), into ``buffers.tokens``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..jit import cache
from ..jit.arch import default_arch, device_facts, ensure_arch_env
from ..jit.key import cache_key
from ..jit.fakes import row_major
from ..jit.options import compile_options
from ..signals import SignalLayout, check_rows_per_item
from .buffers import FLAG_WORDS, RECV_DTYPE, STATE_WORDS, SUM_DTYPES, TokenBuffers
from ..plan import LaunchPlan, PlanCache, planned
from .plan import CombineRouting

DEFAULT_MAX_POLLS = 20_000_000  # back-off <= 256 ns (signals) or 1024 ns (peers): 5-20 s, not a hang
# one row per item: a warp is a team here, and a decode layer's ~1000 rows per
# rank then spread over all the combine's warps (not measured against 2 or 4 yet)
DEFAULT_EP_ROWS_PER_ITEM = 1
ERROR_BITS = {
    1: "a wait on the down GEMM's completion signal timed out (co-residency rule broken, or the GEMM failed)",
    2: "a routing entry named a rank, token, slot or expert out of range (that row was skipped)",
    4: "a peer did not report completion in time (a rank failed or fell behind)",
    8: "a peer reported an error of its own",
    # the device dispatch's bits (``device_dispatch``: the layer shares one word)
    16: "an expert received more rows than its capacity max_m (rows dropped): raise max_m",
    32: "a peer arrived with another sequence number (a rank skipped or repeated a layer)",
}


def describe_error(word: int, rank: Optional[int] = None) -> str:
    """The error word in words (empty for 0)."""
    parts = [text for bit, text in ERROR_BITS.items() if word & bit]
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}EP error word {word:#x}: " + "; ".join(parts) if parts else ""


def check_error(err: torch.Tensor, rank: Optional[int] = None) -> None:
    """Read the error word (a host sync) and raise RuntimeError if it is set.
    Every rank raises: a rank's error reaches its peers as bit 8, a rank that
    never arrives as bit 4. After an error the buffers' flags no longer match
    across ranks (and a posted error stays): make new buffers."""
    word = int(err.item())
    if word:
        raise RuntimeError(describe_error(word, rank))


def build_ep_combine(block_m: int, rows_per_item: int, arch: Optional[str] = None, keep_ptx: bool = False):
    """Compile ``EpCombineSm90`` for dynamic shapes, no caching."""
    ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .combine_kernel import EpCombineSm90

    e, m = cute.sym_int(), cute.sym_int()
    n = cute.sym_int(divisibility=8)  # rows of y and of the receive buffers are 16-byte aligned
    w = cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor

    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            EpCombineSm90(block_m, rows_per_item),
            row_major(cutlass.BFloat16, (e, m, n), 16),
            fake(cutlass.Int32, (e,), assumed_align=4),
            fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4),
            row_major(cutlass.Int32, (e, m)),
            row_major(cutlass.Int32, (e, m)),
            row_major(cutlass.Int32, (e, m)),
            row_major(cutlass.Float32, (e, m)),
            fake(cutlass.Int64, (w,), assumed_align=8),
            fake(cutlass.Int64, (w,), assumed_align=8),
            fake(cutlass.Int32, (FLAG_WORDS,), assumed_align=16),
            fake(cutlass.Int32, (STATE_WORDS,), assumed_align=4),
            fake(cutlass.Int32, (1,), assumed_align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            cutlass.Int32(0),
            cutlass.Int32(1),
            cutlass.Int32(1),
            cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


def build_ep_complete(arch: Optional[str] = None, keep_ptx: bool = False):
    """Compile ``EpCompleteSm90`` (the completion step alone), no caching."""
    ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .combine_kernel import EpCompleteSm90

    fake = cute.runtime.make_fake_compact_tensor
    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            EpCompleteSm90(),
            fake(cutlass.Int64, (cute.sym_int(),), assumed_align=8),
            fake(cutlass.Int32, (FLAG_WORDS,), assumed_align=16),
            fake(cutlass.Int32, (STATE_WORDS,), assumed_align=4),
            fake(cutlass.Int32, (1,), assumed_align=4),
            cutlass.Int32(0),
            cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


_ID_TYPES = {torch.int32: "Int32", torch.int64: "Int64"}
_SUM_TYPES = {torch.float32: "Float32", torch.bfloat16: "BFloat16"}
SUM_CTAS_PER_SM = 4  # 256-thread CTAs without shared memory, as the activation kernel


def build_token_sum(top_k: int, ids_dtype: torch.dtype, out_dtype: torch.dtype, arch: Optional[str] = None,
                    keep_ptx: bool = False):
    """Compile ``sum_kernel.TokenSum`` for dynamic T and H, no caching."""
    ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .sum_kernel import TokenSum

    t_max, t, n = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=8)
    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            TokenSum(top_k),
            row_major(cutlass.BFloat16, (t_max, top_k, n), 16),
            row_major(getattr(cutlass, _ID_TYPES[ids_dtype]), (t, top_k)),
            row_major(getattr(cutlass, _SUM_TYPES[out_dtype]), (t_max, n), 16),
            cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


def get_token_sum(top_k: int, ids_dtype: torch.dtype, out_dtype: torch.dtype, arch: Optional[str] = None):
    arch = arch or default_arch()
    return cache.cached(token_sum_key(arch, top_k, ids_dtype, out_dtype),
                        lambda: build_token_sum(top_k, ids_dtype, out_dtype, arch))


def ep_combine_key(arch: str, block_m: int, rows_per_item: int) -> tuple:
    return cache_key(arch, "ep_combine_store", block_m, rows_per_item)


def ep_complete_key(arch: str) -> tuple:
    return cache_key(arch, "ep_complete")


def token_sum_key(arch: str, top_k: int, ids_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple:
    return cache_key(arch, "ep_token_sum", top_k, str(ids_dtype), str(out_dtype))


def get_ep_combine(block_m: int, rows_per_item: int, arch: Optional[str] = None):
    arch = arch or default_arch()
    return cache.cached(ep_combine_key(arch, block_m, rows_per_item),
                        lambda: build_ep_combine(block_m, rows_per_item, arch))


def get_ep_complete(arch: Optional[str] = None):
    arch = arch or default_arch()
    return cache.cached(ep_complete_key(arch), lambda: build_ep_complete(arch))


EP_TOP_KS = (8,)  # DeepSeek-V3's and Qwen3's top-8; other k go through ``ep_kernel_jobs(top_ks=...)``


def ep_kernel_jobs(arch: str, block_ms, top_ks=EP_TOP_KS) -> list:
    """(name, cache key, build) of every EP kernel a layer can launch: the
    signalled combine for each signalled m-block height (``block_ms``), the
    completion step, the device dispatch (fp8 and bf16 rows, each id dtype)
    and the owner's sum for each top-k, id dtype and sum
    dtype. ``python -m flashgemm compile`` lists them; ``precompile`` stores
    them."""
    jobs = [(f"ep-combine-block_m{m}-rows{DEFAULT_EP_ROWS_PER_ITEM}",
             ep_combine_key(arch, m, DEFAULT_EP_ROWS_PER_ITEM),
             lambda m=m, **kw: build_ep_combine(m, DEFAULT_EP_ROWS_PER_ITEM, arch, **kw)) for m in block_ms]
    jobs.append(("ep-complete", ep_complete_key(arch), lambda **kw: build_ep_complete(arch, **kw)))
    from .device_dispatch import dispatch_jobs

    jobs += dispatch_jobs(arch, top_ks)
    for k in top_ks:
        for ids in _ID_TYPES:
            for out in _SUM_TYPES:
                jobs.append((f"ep-token-sum-k{k}-{str(ids)[6:]}-{str(out)[6:]}", token_sum_key(arch, k, ids, out),
                             lambda k=k, ids=ids, out=out, **kw: build_token_sum(k, ids, out, arch, **kw)))
    return jobs


def precompile(top_ks=EP_TOP_KS, *, arch: Optional[str] = None, cache_dir: Optional[str] = None) -> int:
    """Store every EP kernel (``ep_kernel_jobs``) in the disk cache, without a
    GPU, next to ``flashgemm.precompile``'s GEMMs; returns how many."""
    from .. import backend

    arch = ensure_arch_env(arch or default_arch())
    be = backend.for_arch(arch)
    jobs = ep_kernel_jobs(arch, be.signal_block_ms(be.reachable_specs()), top_ks)
    for _, key, make in jobs:
        cache.store(key, make, cache_dir)
    return len(jobs)


def _check(name, t, dtype, shape, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but y is on {device}")


def check_buffers(buffers, hidden: int, dev) -> None:
    if not isinstance(buffers, TokenBuffers):
        raise TypeError(f"buffers must be a flashgemm.ep.buffers.TokenBuffers, got {type(buffers).__name__}")
    world = buffers.world_size
    recv = buffers.recv
    if recv.dtype != RECV_DTYPE or recv.dim() != 3 or recv.shape[2] != hidden or not recv.is_contiguous():
        raise ValueError(f"buffers.recv must be a contiguous [T, k, H={hidden}] bfloat16 tensor, got "
                         f"{recv.dtype} {tuple(recv.shape)}")
    if recv.device != dev or recv.data_ptr() % 16:
        raise ValueError(f"buffers.recv must be on {dev} and 16-byte aligned")
    tokens = buffers.tokens
    if tokens.dtype not in SUM_DTYPES or tuple(tokens.shape) != (recv.shape[0], hidden) or tokens.device != dev:
        raise ValueError(f"buffers.tokens must be [T={recv.shape[0]}, H={hidden}] float32 or bfloat16 on {dev}, "
                         f"got {tokens.dtype} {tuple(tokens.shape)} on {tokens.device}")
    _check("buffers.peer_recv", buffers.peer_recv, torch.int64, (world,), dev)
    _check("buffers.peer_flags", buffers.peer_flags, torch.int64, (world,), dev)
    _check("buffers.flags", buffers.flags, torch.int32, (FLAG_WORDS,), dev)
    _check("buffers.state", buffers.state, torch.int32, (STATE_WORDS,), dev)
    if not 0 <= buffers.rank < world:
        raise ValueError(f"buffers.rank must lie in [0, {world}), got {buffers.rank}")


def check_combine_args(y, masked_m, dst_signals, layout, routing, buffers, num_sms, max_polls,
                       rows_per_item, err) -> None:
    """Every check of ``combine_to_owners``, before anything is launched."""
    if not isinstance(layout, SignalLayout) or layout.granularity != "m_block":
        raise ValueError("layout must be the 'm_block' SignalLayout of the down GEMM call")
    check_rows_per_item(rows_per_item, layout.block_m)
    _check_polls(max_polls)
    if not isinstance(y, torch.Tensor) or y.dim() != 3 or y.dtype != torch.bfloat16:
        raise ValueError(f"y must be the [E, max_m, H] bfloat16 down GEMM output, got "
                         f"{getattr(y, 'dtype', type(y).__name__)} {tuple(getattr(y, 'shape', ()))}")
    if not y.is_contiguous():
        raise ValueError("y must be contiguous")
    if y.device.type != "cuda":
        raise ValueError(f"y must be on a CUDA device, got {y.device}")
    e_count, max_m, hidden = y.shape
    if hidden % 8:
        raise ValueError(f"y's H must be a multiple of 8 (16-byte rows), got {hidden}")
    if -(-max_m // layout.block_m) != layout.num_m_blocks:
        raise ValueError(f"layout was made for {layout.num_m_blocks} m-blocks of {layout.block_m} rows, "
                         f"y has max_m={max_m}")
    dev = y.device
    _check("masked_m", masked_m, torch.int32, (e_count,), dev)
    if not isinstance(dst_signals, torch.Tensor) or dst_signals.dtype != torch.int32 \
            or dst_signals.numel() < layout.size:
        raise ValueError(f"dst_signals must be an int32 tensor with at least {layout.size} entries")
    _check("dst_signals", dst_signals, torch.int32, tuple(dst_signals.shape), dev)
    if not isinstance(routing, CombineRouting):
        raise TypeError(f"routing must be a flashgemm.ep.plan.CombineRouting, got {type(routing).__name__}")
    _check("routing.src_rank", routing.src_rank, torch.int32, (e_count, max_m), dev)
    _check("routing.src_token", routing.src_token, torch.int32, (e_count, max_m), dev)
    _check("routing.src_slot", routing.src_slot, torch.int32, (e_count, max_m), dev)
    _check("routing.weight", routing.weight, torch.float32, (e_count, max_m), dev)
    check_buffers(buffers, hidden, dev)
    _check("err", err, torch.int32, (1,), dev)
    sm_count = device_facts(dev.index)[1]
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 1 <= num_sms <= sm_count:
        raise ValueError(f"num_sms must be an int in [1, {sm_count}], got {num_sms!r}")


def combine_to_owners(
    y: torch.Tensor,
    masked_m: torch.Tensor,
    dst_signals: torch.Tensor,
    layout: SignalLayout,
    routing: CombineRouting,
    buffers: TokenBuffers,
    *,
    num_sms: int,
    max_polls: int = DEFAULT_MAX_POLLS,
    rows_per_item: Optional[int] = None,
    err: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the signalled combine on the current stream; returns the int32
    error word (``check_error`` reads it after a sync). Every rank of the group
    must launch it (or ``complete``) once per layer: its completion step
    counts launches."""
    rows_per_item = DEFAULT_EP_ROWS_PER_ITEM if rows_per_item is None else rows_per_item
    if err is None and isinstance(y, torch.Tensor):
        err = torch.zeros(1, dtype=torch.int32, device=y.device)
    tensors = {"y": y, "masked_m": masked_m, "signals": dst_signals, **_routing_tensors(routing),
               **_buffer_tensors(buffers), "err": err}

    def make():
        check_combine_args(y, masked_m, dst_signals, layout, routing, buffers, num_sms, max_polls,
                           rows_per_item, err)
        return LaunchPlan(get_ep_combine(layout.block_m, rows_per_item), COMBINE_SLOTS, tensors,
                          scalars=(buffers.max_tokens, buffers.top_k, buffers.rank, layout.n_tiles, max_polls,
                                   num_sms),
                          aligned=("y",), written=("err", "flags", "state"))

    planned(_PLANS, "ep_combine", tensors, (layout, num_sms, max_polls, rows_per_item, *_buffer_facts(buffers)),
            make).launch(tensors)
    return err


# the compiled kernels' tensor parameters (``combine_kernel``, ``sum_kernel``)
COMBINE_SLOTS = ("y", "masked_m", "signals", "src_rank", "src_token", "src_slot", "weight", "peer_recv",
                 "peer_flags", "flags", "state", "err")
COMPLETE_SLOTS = ("peer_flags", "flags", "state", "err")
SUM_SLOTS = ("recv", "ids", "tokens")
_PLANS = PlanCache(1024)


def _routing_tensors(routing) -> dict:
    names = ("src_rank", "src_token", "src_slot", "weight")
    return {name: getattr(routing, name, None) for name in names}


def _buffer_tensors(buffers) -> dict:
    names = ("recv", "tokens", "peer_recv", "peer_flags", "flags", "state")
    return {name: getattr(buffers, name, None) for name in names}


def _buffer_facts(buffers) -> tuple:
    """What the checks read of the buffers beside their tensors."""
    return tuple(getattr(buffers, name, None) for name in ("world_size", "rank", "max_tokens", "top_k", "hidden"))


def _check_polls(max_polls) -> None:
    if not isinstance(max_polls, int) or isinstance(max_polls, bool) or not 1 <= max_polls < 2**31:
        raise ValueError(f"max_polls must be an int in [1, 2**31), got {max_polls!r}")


def complete(buffers: TokenBuffers, err: torch.Tensor, *, max_polls: int = DEFAULT_MAX_POLLS) -> torch.Tensor:
    """The completion step alone, on the current stream, after a down GEMM
    that stored its rows into the peers itself (``Combine.peers``): tells
    every peer this rank is done and waits, bounded, for every peer. Sets
    ``err`` as ``combine_to_owners`` does (bits 4 and 8)."""
    tensors = {**_buffer_tensors(buffers), "err": err}

    def make():
        _check_polls(max_polls)
        if not isinstance(err, torch.Tensor) or err.device.type != "cuda":
            raise ValueError("err must be a [1] int32 CUDA tensor")
        check_buffers(buffers, buffers.hidden, err.device)
        _check("err", err, torch.int32, (1,), err.device)
        return LaunchPlan(get_ep_complete(), COMPLETE_SLOTS, tensors, scalars=(buffers.rank, max_polls),
                          written=("err", "flags", "state"))

    planned(_PLANS, "ep_complete", tensors, (max_polls, *_buffer_facts(buffers)), make).launch(tensors)
    return err


def finalize(buffers: TokenBuffers, topk_ids: torch.Tensor) -> torch.Tensor:
    """``buffers.tokens[:T]`` = the sum over each token's routed slots
    (``topk_ids >= 0``) of its received rows, in slot order, accumulated in
    fp32 (deterministic); unrouted slots, which nobody wrote, are not read.
    On the current stream, after the completion step; returns that view."""
    tensors = {"recv": getattr(buffers, "recv", None), "ids": topk_ids, "tokens": getattr(buffers, "tokens", None)}

    def make():
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be a [T, k] tensor, got {getattr(topk_ids, 'shape', type(topk_ids))}")
        t, k = topk_ids.shape
        if k != buffers.top_k or t > buffers.max_tokens:
            raise ValueError(f"topk_ids must be [T <= {buffers.max_tokens}, k = {buffers.top_k}], got {(t, k)}")
        if topk_ids.dtype not in _ID_TYPES:
            raise TypeError(f"topk_ids must have dtype int32 or int64, got {topk_ids.dtype}")
        if topk_ids.device != buffers.recv.device:
            raise ValueError(f"topk_ids is on {topk_ids.device}, the buffers on {buffers.recv.device}")
        sm_count = device_facts(topk_ids.device.index)[1]
        return LaunchPlan(get_token_sum(k, topk_ids.dtype, buffers.tokens.dtype), SUM_SLOTS, tensors,
                          scalars=(max(1, min(t, sm_count * SUM_CTAS_PER_SM)),), aligned=("recv", "tokens"),
                          written=("tokens",))

    plan = planned(_PLANS, "ep_token_sum", tensors, _buffer_facts(buffers), make)
    t = topk_ids.shape[0]
    if t:
        if not topk_ids.is_contiguous():
            tensors["ids"] = topk_ids.contiguous()
        plan.launch(tensors)
    return buffers.tokens[:t]
