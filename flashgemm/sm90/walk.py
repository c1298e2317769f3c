"""What every warp role of the sm_90a kernel shares: the kernel's static
shape, and the walk over the tile order that each role runs on its own copy
of the walker (the same masked_m and, with the dynamic order, the same
claims, so all roles see the same tiles in the same order)."""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..config import GemmConfig, Tail, TileOrder
from ..schedule.dynamic import producer_next_unit
from ..schedule.nmajor import NMajorTileScheduler
from ..schedule.rules import active_clusters
from ..schedule.walker import MaskedTileScheduler


class KernelShape(NamedTuple):
    """Trace-time facts of one kernel build."""

    config: GemmConfig
    tile_mnk: tuple
    stages: int
    ab_dtype: object  # cutlass dtype of A and B
    acc_dtype: object
    blockwise: bool  # 8-bit operands: the block-scaled fp8 recipe
    # rows of N per weight scale: 128, or 64 for the fused SwiGLU's interleaved
    # w13 (a tile's gate and up groups come from two 128-row blocks)
    weight_scale_rows: int = 128
    # MXFP4 weights: B arrives packed with its exponents, and the converters
    # turn each slot's B into e4m3 / bf16 in place
    converted_b: bool = False

    @property
    def cluster_n(self) -> int:
        return self.config.cluster_n

    @property
    def a_chunk(self) -> int:
        return self.config.a_chunk_rows

    @property
    def num_consumer_wg(self) -> int:
        return self.config.consumer_warpgroups


class WalkArgs(NamedTuple):
    """``MaskedTileScheduler.create``'s arguments, in its order."""

    mMaskedM: cute.Tensor
    num_experts: Int32
    max_m: Int32
    num_n_blocks: Int32
    tile_m: int
    block: Int32  # static order: this cluster's first unit; dynamic: 0
    grid: Int32
    cluster_n: int
    cta_rank: Int32


class ProducerClaims(NamedTuple):
    """The dynamic order's claimer (rank 0's producer warp) and its counter."""

    is_claimer: object
    counter: object


class BalanceSlot(NamedTuple):
    """``Tail.BALANCE`` in the expert-major order: the producer warp counts
    the active clusters into ``slot`` and the other roles read it after
    ``barrier``."""

    slot: cute.Tensor
    barrier: object


def start_walk(config: GemmConfig, args: WalkArgs, feed, claims=None, balance=None):
    """One role's walker, moved to its first unit; returns (walker, feed
    slots used). ``claims`` marks the producer warp; ``balance`` (a
    ``BalanceSlot``): the producer counts and publishes, the others wait.
    The n-major walker counts the m-blocks in every role anyway, so each
    role cuts its own grid."""
    if cutlass.const_expr(config.order is TileOrder.N_MAJOR):
        sched = NMajorTileScheduler.create(*args, config.n_major_window)
        if cutlass.const_expr(config.tail is Tail.BALANCE):
            sched.keep_active(active_clusters(sched.units(), sched.num_ctas))
    else:
        lane_m = None
        if cutlass.const_expr(balance is not None and claims is not None):
            lane_m = MaskedTileScheduler.lane_masked_m(args.mMaskedM, args.num_experts)
        sched = MaskedTileScheduler.create(*args, config.tail is Tail.SPLIT)
        if cutlass.const_expr(balance is not None):
            if cutlass.const_expr(claims is not None):
                active = sched.count_active_clusters(lane_m)
                balance.slot[0] = active  # (every lane stores the same value)
                balance.barrier.arrive()  # never waits: the first loads go out now
                sched.keep_active(active)
            else:
                balance.barrier.arrive_and_wait()
                sched.keep_active(balance.slot[0])
    used = Int32(0)
    if cutlass.const_expr(config.order is TileOrder.DYNAMIC):
        used = to_next_unit(config, sched, feed, used, claims)
    return sched, used


def to_next_unit(config: GemmConfig, sched, feed, used, claims=None):
    """Move ``sched`` to this role's next unit; returns the feed slots used
    so far. Static orders: the cluster's next G-th unit. Dynamic: the next
    claim, made by rank 0's producer warp and read from the feed by every
    other role. (Plain trace-time helpers: the DSL allows no closure inside
    the staged role branches.)"""
    if cutlass.const_expr(config.order is not TileOrder.DYNAMIC):
        sched.advance()
        return used
    if claims is None:
        unit = feed.receive(used)
    else:
        unit = producer_next_unit(feed, used, *claims)
    sched.jump(unit)
    return used + 1
