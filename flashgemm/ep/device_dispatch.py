"""The device dispatch: host side (receive buffers, checks, compile, launch).

``alloc_dispatch_buffers(max_tokens, hidden, top_k, num_experts, fp8=...)``
makes every rank's receive buffer in PyTorch symmetric memory, once, sized
by the capacity the caller states: ``max_m`` rows per local expert (default
``max_tokens * W``, room for every token of every rank at one expert).
``dispatch_on_device(x, topk_ids, topk_weights, buffers)`` then launches
``dispatch_kernel.EpDispatchSm90`` on the current stream and returns the
``Dispatched`` the expert path and the combine take, all on the GPU: no
host sync, no allocation of rows, CUDA-graph capturable. Each call is a
collective step: every rank of the group calls it once per layer.

Reuse without a barrier: a peer writes into this rank's buffer for layer
i+1 only after its combine of layer i has seen this rank's completion, which
this rank posts after its down GEMM has read the rows of layer i. The
sequence numbers (``ERR_SEQUENCE``) catch a rank that skipped or repeated a
step; the error word is sticky, so a failure reaches every rank at the next
arrival at the latest.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..jit import cache
from ..jit.arch import default_arch, device_facts, ensure_arch_env
from ..jit.fakes import row_major
from ..jit.key import cache_key
from ..jit.options import compile_options
from ..plan import LaunchPlan, PlanCache, planned
from .buffers import FLAG_WORDS, STATE_WORDS, alloc_symmetric, symmetric_group
from .dispatch import Dispatched
from .plan import CombineRouting, Placement, check_int

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128
ALIGN = 1024  # every region starts 1 KiB aligned (TMA needs 16 bytes)
ROW_ALIGN = 16  # max_m is rounded up to this: 16-byte M-major scale rows
CTAS_PER_SM = 2  # 512-thread CTAs
DEFAULT_MAX_POLLS = 20_000_000  # with <= 1 us back-off: seconds, not a hang


def _round_up(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Byte offsets of one rank's receive buffer (the same on every rank)."""

    e_local: int
    max_m: int
    hidden: int
    fp8: bool

    @property
    def blocks(self) -> int:
        return -(-self.hidden // SCALE_BLOCK)

    @functools.cached_property  # views made once: the per-call path only reads them
    def counters(self) -> int:
        return FLAG_WORDS * 4

    @property
    def meta(self) -> int:
        return _round_up(self.counters + self.e_local * 4, ALIGN)

    @property
    def table_bytes(self) -> int:
        return self.e_local * self.max_m * 4

    @functools.cached_property  # views made once: the per-call path only reads them
    def x(self) -> int:
        return _round_up(self.meta + 4 * self.table_bytes, ALIGN)

    @property
    def scale(self) -> int:
        return _round_up(self.x + self.e_local * self.max_m * self.hidden * (1 if self.fp8 else 2), ALIGN)

    @property
    def nbytes(self) -> int:
        return self.scale + (self.e_local * self.blocks * self.max_m * 4 if self.fp8 else 0)


def make_layout(hidden: int, num_experts: int, world: int, max_tokens: int, fp8: bool,
                max_m: Optional[int] = None) -> DispatchLayout:
    check_int("hidden", hidden)
    if hidden % 16:
        raise ValueError(f"hidden must be a multiple of 16 (16-column pieces per lane), got {hidden}")
    check_int("max_tokens", max_tokens)
    placement = Placement(num_experts, world)
    max_m = max_tokens * world if max_m is None else check_int("max_m", max_m)
    layout = DispatchLayout(placement.experts_per_rank, _round_up(max_m, ROW_ALIGN), hidden, bool(fp8))
    if layout.e_local * layout.max_m * max(hidden, 4 * layout.blocks) >= 2**31:
        raise ValueError(f"E_local * max_m * H must stay below 2**31 elements, got {layout.e_local} * "
                         f"{layout.max_m} * {hidden}")
    return layout


@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class DispatchBuffers:
    """This rank's receive buffer of the device dispatch and what the kernel
    needs to reach every peer's. x [E_local, max_m, H] (fp8 or bf16) and
    x_scale [E_local, max_m, ceil(H/128)] float32 (M contiguous; None for
    bf16) are views of the symmetric buffer, as are the routing tables;
    masked_m [E_local] int32, state and err are ordinary device memory.
    ``err`` is the layer's sticky error word (the combine ORs into it too)."""

    rank: int
    world_size: int
    num_experts: int
    max_tokens: int
    top_k: int
    layout: DispatchLayout
    raw: torch.Tensor
    peer_base: torch.Tensor
    masked_m: torch.Tensor
    state: torch.Tensor
    err: torch.Tensor
    handle: object = None

    @property
    def fp8(self) -> bool:
        return self.layout.fp8

    @property
    def max_m(self) -> int:
        return self.layout.max_m

    @property
    def hidden(self) -> int:
        return self.layout.hidden

    def _view(self, offset: int, dtype, shape) -> torch.Tensor:
        count = 1
        for s in shape:
            count *= s
        width = torch.empty((), dtype=dtype).element_size()
        return self.raw[offset:offset + count * width].view(dtype).view(*shape)

    @functools.cached_property  # views made once: the per-call path only reads them
    def flags(self) -> torch.Tensor:
        return self.raw[:FLAG_WORDS * 4].view(torch.int32)

    @functools.cached_property  # views made once: the per-call path only reads them
    def counters(self) -> torch.Tensor:
        lay = self.layout
        return self._view(lay.counters, torch.int32, (lay.e_local,))

    @functools.cached_property  # views made once: the per-call path only reads them
    def x(self) -> torch.Tensor:
        lay = self.layout
        return self._view(lay.x, FP8 if lay.fp8 else torch.bfloat16, (lay.e_local, lay.max_m, lay.hidden))

    @functools.cached_property  # views made once: the per-call path only reads them
    def x_scale(self) -> Optional[torch.Tensor]:
        lay = self.layout
        if not lay.fp8:
            return None
        return self._view(lay.scale, torch.float32, (lay.e_local, lay.blocks, lay.max_m)).transpose(1, 2)

    @functools.cached_property  # views made once: the per-call path only reads them
    def routing(self) -> CombineRouting:
        """The combine's routing, written by the dispatch (rows >= masked_m[e]
        hold whatever an earlier layer left: nothing reads them)."""
        lay = self.layout
        shape = (lay.e_local, lay.max_m)
        tables = [self._view(lay.meta + i * lay.table_bytes, dtype, shape)
                  for i, dtype in enumerate((torch.int32, torch.int32, torch.int32, torch.float32))]
        return CombineRouting(*tables)


def _buffers(raw, bases, rank, world, num_experts, max_tokens, top_k, layout, handle=None) -> DispatchBuffers:
    device = raw.device
    return DispatchBuffers(
        rank=rank, world_size=world, num_experts=num_experts, max_tokens=max_tokens, top_k=top_k,
        layout=layout, raw=raw, peer_base=torch.tensor(bases, dtype=torch.int64, device=device),
        masked_m=torch.zeros(layout.e_local, dtype=torch.int32, device=device),
        state=torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
        err=torch.zeros(1, dtype=torch.int32, device=device),
        handle=handle)


def alloc_dispatch_buffers(max_tokens: int, hidden: int, top_k: int, num_experts: int, *, fp8: bool,
                           max_m: Optional[int] = None, group=None, device=None) -> DispatchBuffers:
    """Collective over ``group`` (default: the world). ``max_tokens``: the
    most tokens any rank dispatches in one call; ``max_m``: rows per local
    expert (the capacity; default ``max_tokens * W``, rounded up to 16).
    The header is zeroed and a barrier follows before anyone writes."""
    check_int("top_k", top_k)
    group, rank, world = symmetric_group(group, "alloc_dispatch_buffers")
    layout = make_layout(hidden, num_experts, world, max_tokens, fp8, max_m)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    raw, handle, bases = alloc_symmetric(layout.nbytes, layout.meta, group, rank, world, device)
    return _buffers(raw, bases, rank, world, num_experts, max_tokens, top_k, layout, handle)


def local_dispatch_buffers(max_tokens: int, hidden: int, top_k: int, num_experts: int, *, fp8: bool,
                           max_m: Optional[int] = None, device="cuda") -> DispatchBuffers:
    """Ordinary device memory laid out as one rank's buffer, a world of one
    without a process group (tests)."""
    check_int("top_k", top_k)
    layout = make_layout(hidden, num_experts, 1, max_tokens, fp8, max_m)
    raw = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    return _buffers(raw, [raw.data_ptr()], 0, 1, num_experts, max_tokens, top_k, layout)


_ID_TYPES = {torch.int32: "Int32", torch.int64: "Int64"}


def build_ep_dispatch(top_k: int, fp8: bool, ids_dtype: torch.dtype, arch: Optional[str] = None,
                      keep_ptx: bool = False):
    """Compile ``EpDispatchSm90`` for dynamic T, H, W and E_local, no caching."""
    ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .dispatch_kernel import EpDispatchSm90

    t = cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    e = cute.sym_int()
    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            EpDispatchSm90(top_k, fp8),
            row_major(cutlass.BFloat16, (t, cute.sym_int(divisibility=16)), 16),
            row_major(getattr(cutlass, _ID_TYPES[ids_dtype]), (t, top_k)),
            row_major(cutlass.Float32, (t, top_k)),
            fake(cutlass.Int64, (cute.sym_int(),), assumed_align=8),
            fake(cutlass.Int32, (FLAG_WORDS,), assumed_align=16),
            fake(cutlass.Int32, (e,), assumed_align=4),
            fake(cutlass.Int32, (e,), assumed_align=4),
            fake(cutlass.Int32, (STATE_WORDS,), assumed_align=4),
            fake(cutlass.Int32, (1,), assumed_align=4),
            cutlass.Int64(0), cutlass.Int64(0), cutlass.Int64(0), cutlass.Int64(0),
            cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    cache.count_compile()
    return fn


def ep_dispatch_key(arch: str, top_k: int, fp8: bool, ids_dtype: torch.dtype) -> tuple:
    return cache_key(arch, "ep_dispatch", top_k, bool(fp8), str(ids_dtype))


def get_ep_dispatch(top_k: int, fp8: bool, ids_dtype: torch.dtype, arch: Optional[str] = None):
    arch = arch or default_arch()
    return cache.cached(ep_dispatch_key(arch, top_k, fp8, ids_dtype),
                        lambda: build_ep_dispatch(top_k, fp8, ids_dtype, arch))


def dispatch_jobs(arch: str, top_ks) -> list:
    """(name, cache key, build) of every device-dispatch build for these top-k."""
    return [(f"ep-dispatch-k{k}-{'fp8' if fp8 else 'bf16'}-{str(ids)[6:]}", ep_dispatch_key(arch, k, fp8, ids),
             lambda k=k, fp8=fp8, ids=ids, **kw: build_ep_dispatch(k, fp8, ids, arch, **kw))
            for k in top_ks for fp8 in (True, False) for ids in _ID_TYPES]


def check_dispatch_args(x, topk_ids, topk_weights, buffers, max_polls) -> None:
    """Every check, metadata only (no host sync), before the launch."""
    if not isinstance(buffers, DispatchBuffers):
        raise TypeError(f"buffers must be a flashgemm.ep.device_dispatch.DispatchBuffers, got "
                        f"{type(buffers).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be a [T, H] bfloat16 tensor (the dispatch quantizes for an fp8 layer), got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    t, hidden = x.shape
    if hidden != buffers.hidden:
        raise ValueError(f"x has H={hidden}, the buffers H={buffers.hidden}")
    if t > buffers.max_tokens:
        raise ValueError(f"x has {t} tokens, more than the buffers' max_tokens={buffers.max_tokens}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise ValueError("x must be contiguous and 16-byte aligned")
    for name, tensor, dtypes in (("topk_ids", topk_ids, tuple(_ID_TYPES)),
                                 ("topk_weights", topk_weights, (torch.float32,))):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in dtypes:
            raise TypeError(f"{name} must be a tensor of dtype {' or '.join(map(str, dtypes))}, got "
                            f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        if tuple(tensor.shape) != (t, buffers.top_k) or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [T, k] = {(t, buffers.top_k)} tensor, got "
                             f"{tuple(tensor.shape)}")
    device = buffers.raw.device
    for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, the buffers on {device}")
    if isinstance(max_polls, bool) or not isinstance(max_polls, int) or not 1 <= max_polls < 2**31:
        raise ValueError(f"max_polls must be an int in [1, 2**31), got {max_polls!r}")


def dispatch_on_device(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       buffers: DispatchBuffers, *, max_polls: int = DEFAULT_MAX_POLLS) -> Dispatched:
    """Launch the device dispatch on the current stream (collective: every
    rank launches it once per layer). x: [T, H] bf16, T <= max_tokens;
    topk_ids: [T, k] int32/int64 global ids (-1: not routed); topk_weights:
    [T, k] float32. Bad ids and overflows are reported in ``buffers.err``
    (``combine.check_error`` reads it after the layer)."""
    names = ("peer_base", "flags", "counters", "masked_m", "state", "err")
    tensors = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights,
               **{name: getattr(buffers, name, None) for name in names}}

    def make():
        check_dispatch_args(x, topk_ids, topk_weights, buffers, max_polls)
        lay = buffers.layout
        sm_count = device_facts(x.device.index)[1]
        return LaunchPlan(get_ep_dispatch(buffers.top_k, lay.fp8, topk_ids.dtype), DISPATCH_SLOTS, tensors,
                          scalars=(lay.counters, lay.meta, lay.x, lay.scale, lay.max_m, buffers.rank, max_polls,
                                   max(1, min(x.shape[0], sm_count * CTAS_PER_SM))),
                          aligned=("x",), written=("flags", "counters", "masked_m", "state", "err"))

    facts = (max_polls, buffers.layout, buffers.rank, buffers.world_size, buffers.top_k)
    planned(_PLANS, "ep_dispatch", tensors, facts, make).launch(tensors)
    return Dispatched(buffers.x, buffers.x_scale, buffers.masked_m, buffers.routing, None, None)


# the compiled kernel's tensor parameters (``dispatch_kernel.EpDispatchSm90``)
DISPATCH_SLOTS = ("x", "topk_ids", "topk_weights", "peer_base", "flags", "counters", "masked_m", "state", "err")
_PLANS = PlanCache(1024)
