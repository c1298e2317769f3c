"""Completion signals: what the GEMM publishes for a concurrent combine kernel.

With ``dst_signals`` the kernel adds 1 to a signal (an int32 counter in global
memory) for every output tile it finished, once the tile's rows are in global
memory: the tile's stores complete, then a GPU-scope release add. A consumer
on any SM that reads the counter with a GPU-scope acquire load and sees value
v may read the rows of those v tiles and gets their final values.

Granularities:

* ``"m_block"`` (default): one counter per (expert, m-block),
  index ``e * num_m_blocks + mb`` with ``num_m_blocks = ceil(max_m / block_m)``.
  Each n-tile of the m-block adds 1; the block's rows ``[mb * block_m,
  min((mb + 1) * block_m, m_e))`` are final once the counter reaches
  ``n_tiles = ceil(N / block_n)``. m-blocks without valid rows stay 0.
* ``"expert"``: one counter per expert; reaches
  ``ceil(m_e / block_m) * n_tiles`` (0 for an empty expert).

The kernel never resets counters: the caller zeroes them before each launch
(``alloc_signals`` gives a zeroed buffer; ``buf.zero_()`` is a graph-capturable
memset). The GEMM never waits on anything external, so it cannot deadlock
with a consumer that polls; the consumer must only run on SMs the GEMM does
not need for progress, i.e. launch the GEMM with ``num_sms`` below the SM
count and keep the consumer's grid within the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .validation import check_dense

GRANULARITIES = ("m_block", "expert")
# A combine's work item: this many rows of one GEMM m-block (docs/design.md, Signals).
DEFAULT_ROWS_PER_ITEM = 4


def check_rows_per_item(rows_per_item, block_m: int) -> None:
    """A combine work item must be a power-of-two slice of one GEMM m-block."""
    if (isinstance(rows_per_item, bool) or not isinstance(rows_per_item, int) or rows_per_item < 1
            or rows_per_item & (rows_per_item - 1) or block_m % rows_per_item):
        raise ValueError(
            f"rows_per_item must be a power of two dividing block_m={block_m}, got {rows_per_item!r}"
        )


@dataclasses.dataclass(frozen=True)
class SignalLayout:
    """Host-side facts a consumer needs before the GEMM is launched."""

    granularity: str
    block_m: int  # rows per m-block
    block_n: int  # columns per output tile
    num_m_blocks: int  # m-blocks per expert slot: ceil(max_m / block_m)
    n_tiles: int  # tiles per m-block: ceil(N / block_n)
    size: int  # counters needed

    def index(self, expert: int, m_block: int = 0) -> int:
        if self.granularity == "expert":
            return expert
        return expert * self.num_m_blocks + m_block

    def final_values(self, masked_m: torch.Tensor, max_m: int) -> torch.Tensor:
        """Counter values after the GEMM, from masked_m (for tests and consumers)."""
        rows = masked_m.to(torch.int64).clamp(0, max_m)
        m_blocks = (rows + self.block_m - 1) // self.block_m
        if self.granularity == "expert":
            return (m_blocks * self.n_tiles).to(torch.int32)
        mb = torch.arange(self.num_m_blocks, device=masked_m.device)
        full = (mb[None, :] < m_blocks[:, None]).to(torch.int32) * self.n_tiles
        return full.reshape(-1)


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"signal_granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )


def make_signal_layout(
    granularity: str, max_m: int, n: int, block_m: int, block_n: int, num_experts: int
) -> SignalLayout:
    check_granularity(granularity)
    num_m_blocks = -(-max_m // block_m)
    size = num_experts if granularity == "expert" else num_experts * num_m_blocks
    return SignalLayout(granularity, block_m, block_n, num_m_blocks, -(-n // block_n), size)


def alloc_signals(layout: SignalLayout, device=None) -> torch.Tensor:
    """A zeroed int32 counter buffer of the size ``layout`` needs."""
    return torch.zeros(layout.size, dtype=torch.int32, device=device)


def _check_buffer(dst_signals) -> None:
    if not isinstance(dst_signals, torch.Tensor):
        raise TypeError(f"dst_signals must be a torch.Tensor, got {type(dst_signals).__name__}")
    check_dense("dst_signals", dst_signals)
    if dst_signals.dtype != torch.int32:
        raise TypeError(f"dst_signals must have dtype torch.int32, got {dst_signals.dtype}")
    if dst_signals.dim() != 1 or not dst_signals.is_contiguous():
        raise ValueError(
            f"dst_signals must be a contiguous 1-D tensor, got shape {tuple(dst_signals.shape)} "
            f"strides {tuple(dst_signals.stride())}"
        )


def check_signal_buffer(dst_signals, num_experts: int) -> None:
    """What the call can check of ``dst_signals`` before its layout is known
    (the layout follows the config, which may need the GPU's SM count): an
    int32 contiguous 1-D tensor with at least one counter per expert, the
    smallest size of either granularity."""
    _check_buffer(dst_signals)
    if dst_signals.numel() < num_experts:
        raise ValueError(
            f"dst_signals needs at least {num_experts} entries (one per expert for 'expert'; "
            f"one per expert and m-block for 'm_block'), got {dst_signals.numel()}"
        )


def validate_signals(dst_signals, layout: SignalLayout, device: Optional[torch.device]) -> None:
    _check_buffer(dst_signals)
    if dst_signals.numel() < layout.size:
        raise ValueError(
            f"dst_signals needs at least {layout.size} entries for granularity "
            f"{layout.granularity!r} (E x ceil(max_m / {layout.block_m}) for m_block), "
            f"got {dst_signals.numel()}"
        )
    if device is not None and dst_signals.device != device:
        raise ValueError(f"dst_signals is on {dst_signals.device} but a is on {device}")
