"""Token buffers in PyTorch symmetric memory, and the multicast-off rules.

Engine: ``torch.distributed._symmetric_memory`` with its CUDA backend
(``empty`` + ``rendezvous``: cuMem allocations mapped into every rank's
address space, peer writes over NVLink). Every rank allocates one buffer of
the same size, laid out as

    [flags: FLAG_WORDS int32 | pad to 1 KiB | recv: (max_tokens, top_k, hidden) bfloat16]

``recv`` is where the combine stores the weighted expert rows of this rank's
tokens, one row per (token, top-k slot): peers write it with plain 16-byte
stores over NVLink (no remote atomics), and this rank then sums each token's
k rows itself in a fixed order (``combine.finalize``: deterministic, fp32
accumulation) into ``tokens``, ordinary local memory. ``flags`` is where peers
count their completions and post their error words
(``combine_kernel.peer_completion``). The combine reaches the peers through
two device tables of int64 addresses, ``peer_recv`` and ``peer_flags``.

Multicast stays off (NVLink SHARP / multimem are not used on these machines):
``multicast_off_env()`` sets ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` where
they are unset and raises where one holds another value. Call it before
``init_process_group`` (NCCL reads its variable when the communicator is made;
torch when the first symmetric buffer is mapped). ``alloc_token_buffers``
raises if the variables are not set, and again if the engine mapped a
multicast address anyway; with no multicast address the engine's ``barrier``
is its plain signal-pad barrier, never the multimem one.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Optional

import torch

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# the flags block: [0, MAX_PEERS) completions per peer, [MAX_PEERS, 2 * MAX_PEERS) peers' error words
MAX_PEERS = 64
FLAG_WORDS = 2 * MAX_PEERS
RECV_OFFSET = 1024  # bytes: the flags block, padded so the received rows stay 16-byte (and 1 KiB) aligned
# local state words of the combine: CTAs done in this launch, launches completed (the epoch)
STATE_WORDS = 2
ENGINE_BACKEND = "CUDA"
SUM_DTYPES = (torch.float32, torch.bfloat16)
RECV_DTYPE = torch.bfloat16  # the weighted rows as the GEMM rounds its output


def multicast_off_env(environ=None) -> dict:
    """Set the three multicast-off variables where unset; raise where one is
    set to anything else. Returns the values now in force."""
    environ = os.environ if environ is None else environ
    for name, want in MULTICAST_OFF.items():
        have = environ.get(name)
        if have is None:
            environ[name] = want
        elif have != want:
            raise RuntimeError(f"{name}={have!r} in this process, but flashgemm.ep keeps NVLink multicast "
                               f"off: set {name}={want} (or leave it unset) before init_process_group")
    return {name: environ[name] for name in MULTICAST_OFF}


def check_multicast_off(environ=None) -> None:
    """Raise unless all three multicast-off variables hold their values."""
    environ = os.environ if environ is None else environ
    wrong = [f"{k}={environ.get(k)!r} (need {v!r})" for k, v in MULTICAST_OFF.items() if environ.get(k) != v]
    if wrong:
        raise RuntimeError("NVLink multicast must be off before any process group or symmetric buffer "
                           "exists; call flashgemm.ep.buffers.multicast_off_env() first. Wrong: "
                           + ", ".join(wrong))


def symmetric_memory_unavailable() -> Optional[str]:
    """Why symmetric memory cannot be used in this process, or None."""
    if not torch.distributed.is_available():
        return "torch was built without torch.distributed"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError as exc:  # pragma: no cover - torch builds without it
        return f"torch.distributed._symmetric_memory does not import: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device (symmetric memory maps GPU memory)"
    return None


@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class TokenBuffers:
    """This rank's symmetric receive buffer and what the combine needs to
    reach every peer's. recv: [max_tokens, top_k, hidden] bf16 local view of
    the symmetric buffer; tokens: [max_tokens, hidden] float32 or bf16, the
    summed outputs (ordinary memory); flags: [FLAG_WORDS] int32 local view;
    peer_recv / peer_flags: [W] int64 device addresses of every rank's recv /
    flags (entry ``rank`` is this rank's); state: [STATE_WORDS] int32,
    ordinary device memory; handle: the engine's handle (``barrier``), None
    for buffers built without the engine."""

    rank: int
    world_size: int
    recv: torch.Tensor
    tokens: torch.Tensor
    flags: torch.Tensor
    peer_recv: torch.Tensor
    peer_flags: torch.Tensor
    state: torch.Tensor
    handle: object = None
    group_name: Optional[str] = None

    @property
    def max_tokens(self) -> int:
        return self.recv.shape[0]

    @property
    def top_k(self) -> int:
        return self.recv.shape[1]

    @property
    def hidden(self) -> int:
        return self.recv.shape[2]

    @property
    def rows_per_rank(self) -> int:
        """Rows of one rank's receive buffer: a destination ``owner *
        rows_per_rank + token * top_k + slot`` names one of them."""
        return self.max_tokens * self.top_k

    def barrier(self, timeout_ms: int = 10_000) -> None:
        """The engine's signal-pad barrier on the current stream (no multicast:
        ``alloc_token_buffers`` checked). On timeout the engine's kernel traps
        with a "[FATAL] ... barrier" message, so the next sync raises."""
        if self.handle is None:
            raise RuntimeError("these buffers have no symmetric-memory handle (built without the engine)")
        self.handle.barrier(channel=0, timeout_ms=timeout_ms)


def _select_backend(symm_mem, device: torch.device) -> None:
    """Ask for the CUDA backend (peer pointers and a plain signal-pad
    barrier); fine if already chosen, an error if another one is."""
    if hasattr(symm_mem, "set_backend"):
        try:
            symm_mem.set_backend(ENGINE_BACKEND)
        except Exception:  # fixed once a buffer exists: checked below
            pass
    if hasattr(symm_mem, "get_backend"):
        backend = symm_mem.get_backend(device)
        if backend not in (None, ENGINE_BACKEND):
            raise RuntimeError(f"symmetric memory uses the {backend} backend in this process; flashgemm.ep "
                               f"needs {ENGINE_BACKEND} (peer addresses, signal-pad barrier)")


def peer_addresses(handle, local_ptr: int, rank: int, world: int) -> list:
    """Every rank's address of the symmetric tensor that starts at
    ``local_ptr`` here, from the engine's handle; refuses a handle with a
    multicast mapping."""
    if getattr(handle, "multicast_ptr", 0):
        raise RuntimeError("symmetric memory mapped a multicast address although "
                           "TORCH_SYMM_MEM_DISABLE_MULTICAST=1; refusing to run (multicast must stay off)")
    ptrs = list(handle.buffer_ptrs)
    if len(ptrs) != world:
        raise RuntimeError(f"the engine gave {len(ptrs)} peer addresses for a group of {world}")
    # the handle's addresses name the allocations; our tensor may start inside one
    offset = local_ptr - ptrs[rank]
    size = getattr(handle, "buffer_size", None)
    if offset < 0 or (size is not None and offset >= size):
        raise RuntimeError(f"the symmetric tensor lies outside its allocation (offset {offset}, size {size})")
    return [p + offset for p in ptrs]


def _check_sizes(max_tokens, hidden, top_k, dtype) -> None:
    for name, value in (("max_tokens", max_tokens), ("hidden", hidden), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if dtype not in SUM_DTYPES:
        raise TypeError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8 (16-byte row pieces), got {hidden}")
    if max_tokens * top_k * hidden >= 2**31:
        raise ValueError(f"max_tokens * top_k * hidden must stay below 2**31, got {max_tokens * top_k * hidden}")


def symmetric_group(group, who: str):
    """(group, rank, world) of an initialized process group (default: the
    world) that symmetric memory can serve, multicast off; else an error
    naming ``who``."""
    check_multicast_off()
    reason = symmetric_memory_unavailable()
    if reason:
        raise RuntimeError(f"symmetric memory is unavailable: {reason}")
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs an initialized process group (init_process_group)")
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > MAX_PEERS:
        raise ValueError(f"world size {world} exceeds the {MAX_PEERS} peers the flags block holds")
    return group, rank, world


def alloc_symmetric(nbytes: int, zero_bytes: int, group, rank: int, world: int, device):
    """Collective: one ``nbytes`` uint8 buffer per rank in symmetric memory,
    its first ``zero_bytes`` zeroed, then a barrier, so no peer writes into
    it before that. Returns (raw, handle, every rank's base address)."""
    import torch.distributed._symmetric_memory as symm_mem

    _select_backend(symm_mem, device)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        # needed by older torch releases, a deprecated no-op in newer ones
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    raw = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(raw, group.group_name)
    bases = peer_addresses(handle, raw.data_ptr(), rank, world)
    raw[:zero_bytes].zero_()
    torch.cuda.current_stream(device).synchronize()
    handle.barrier(channel=0, timeout_ms=60_000)
    torch.cuda.current_stream(device).synchronize()
    return raw, handle, bases


def alloc_token_buffers(max_tokens: int, hidden: int, top_k: int, *, dtype: torch.dtype = torch.float32,
                        group=None, device=None) -> TokenBuffers:
    """Collective: every rank of ``group`` (default: the world) allocates its
    buffer and exchanges addresses. Needs an initialized process group whose
    ranks each drive one GPU. ``dtype``: the summed outputs' (``tokens``).
    The flags are zeroed and a barrier follows, so no peer counts into them
    before they are."""
    _check_sizes(max_tokens, hidden, top_k, dtype)
    group, rank, world = symmetric_group(group, "alloc_token_buffers")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    nbytes = RECV_OFFSET + max_tokens * top_k * hidden * 2
    raw, handle, bases = alloc_symmetric(nbytes, FLAG_WORDS * 4, group, rank, world, device)
    flags = raw[: FLAG_WORDS * 4].view(torch.int32)
    return TokenBuffers(
        rank=rank,
        world_size=world,
        recv=raw[RECV_OFFSET:].view(RECV_DTYPE).view(max_tokens, top_k, hidden),
        tokens=torch.zeros(max_tokens, hidden, dtype=dtype, device=device),
        flags=flags,
        peer_recv=torch.tensor([b + RECV_OFFSET for b in bases], dtype=torch.int64, device=device),
        peer_flags=torch.tensor(bases, dtype=torch.int64, device=device),
        state=torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
        handle=handle,
        group_name=group.group_name,
    )


def local_token_buffers(max_tokens: int, hidden: int, top_k: int, *, dtype=torch.float32,
                        device="cuda") -> TokenBuffers:
    """Ordinary device memory laid out as one rank's symmetric buffer, as
    "peer 0" of a world of one (tests; no process group, no engine)."""
    _check_sizes(max_tokens, hidden, top_k, dtype)
    raw = torch.zeros(RECV_OFFSET + max_tokens * top_k * hidden * 2, dtype=torch.uint8, device=device)
    base = raw.data_ptr()
    return TokenBuffers(
        rank=0,
        world_size=1,
        recv=raw[RECV_OFFSET:].view(RECV_DTYPE).view(max_tokens, top_k, hidden),
        tokens=torch.zeros(max_tokens, hidden, dtype=dtype, device=device),
        flags=raw[: FLAG_WORDS * 4].view(torch.int32),
        peer_recv=torch.tensor([base + RECV_OFFSET], dtype=torch.int64, device=device),
        peer_flags=torch.tensor([base], dtype=torch.int64, device=device),
        state=torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
    )
