"""Consumer side of the completion signals.

``MaskedCombineSm90``, the single-GPU stand-in for a DeepEP-style combine.
For each slice of valid rows, in the GEMM's (expert, m-block) order, it
waits until the m-block's counter reaches ``n_tiles`` (``device.signal_wait``)
and then scatter-adds the rows into a token-major fp32 output:
``combined[token_idx[e, r]] += weight[e, r] * out[e, r]``. It runs
concurrently with the GEMM, on the SMs the GEMM was told to leave free
(``num_sms``), which is the overlap the package exists for.

Error word bits: 1 = a wait timed out, 2 = a routing entry named a token
outside ``[0, T)`` (that row was skipped).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.experimental.primitives.nvvm_wrapper import (
    CpReduceOp,
    CpReduceType,
    cp_reduce_async_bulk_global_shared_cta,
)

from ..device.errors import ERR_BAD_ROUTE
from ..device.signal_wait import wait_signal
from ..schedule.walker import MaskedTileScheduler
from ..signals import check_rows_per_item
from .barriers import COMBINE_TEAM_FIRST

# One CTA per SM it is given (more would land on the GEMM's SMs), so it is
# made as wide as a CTA can be: 1024 threads, each moving 16-byte chunks.
COMBINE_THREADS = 1024
CHUNK = 8  # bf16 elements per 16-byte load
# Teams of 8 warps work on separate items, so one item's latency chain
# (poll, loads, staging, barriers) overlaps the other teams' work.
TEAMS = 4
TEAM_THREADS = COMBINE_THREADS // TEAMS
TEAM_WARPS = TEAM_THREADS // 32
# 16-byte loads each thread has in flight per group; a team stages a group as
# fp32 in shared memory, double-buffered: 4 teams x 2 x 24 KiB.
ROUNDS = 3
GROUP_ELEMS = ROUNDS * TEAM_THREADS * CHUNK


class MaskedCombineSm90:
    """Signal-driven combine: ``combined[token] += weight * out[e, row]`` in fp32.

    Roles: each CTA (``COMBINE_THREADS`` threads) holds ``TEAMS`` teams of 8
    warps. Work items are ``rows_per_item``-row slices of the valid rows, in
    the GEMM's expert-major order, dealt round-robin to the teams of all
    CTAs. For an item the team's thread 0 acquire-polls the m-block's counter
    and a named barrier (one per team) orders the team's reads after that
    acquire. The item's rows, flattened, then go through shared memory in
    groups of ``GROUP_ELEMS``: the team loads 16-byte bf16 chunks, scales them
    by the row's routing weight and writes fp32 into one of its two group
    buffers; the team's warp 0 hands each row's piece of the group to the
    bulk-copy engine (one ``cp.reduce.async.bulk .add.f32`` into
    ``combined[token]``), which performs the adds in L2 while the team loads
    the next group. Pipelines: the two buffers per team, guarded by the
    issuing warp's ``cp.async.bulk.wait_group.read 1`` and the team barrier.
    (Per-thread ``red.global.add.v4.f32`` moved ~19 GB/s per SM: the
    dsv3-ep32-down combine took 80 us on 20 SMs, and its last expert set the
    overlapped run's tail.)
    """

    def __init__(self, block_m: int, rows_per_item: int):
        check_rows_per_item(rows_per_item, block_m)
        self.block_m = block_m
        self.rows_per_item = rows_per_item

    @cute.jit
    def __call__(
        self,
        mOut: cute.Tensor,  # (E, max_m, N) bf16: the GEMM output
        mMaskedM: cute.Tensor,  # (E,) int32
        mSignals: cute.Tensor,  # (E * num_m_slots,) int32, "m_block" layout
        mTokenIdx: cute.Tensor,  # (E, max_m) int32
        mWeight: cute.Tensor,  # (E, max_m) float32
        mCombined: cute.Tensor,  # (T, N) float32, accumulated into
        mErr: cute.Tensor,  # (1,) int32 error word
        n_tiles: Int32,
        max_polls: Int32,
        num_ctas: Int32,
        stream,
    ):
        self.kernel(mOut, mMaskedM, mSignals, mTokenIdx, mWeight, mCombined, mErr, n_tiles, max_polls).launch(
            grid=[num_ctas, 1, 1], block=[COMBINE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mOut: cute.Tensor,
        mMaskedM: cute.Tensor,
        mSignals: cute.Tensor,
        mTokenIdx: cute.Tensor,
        mWeight: cute.Tensor,
        mCombined: cute.Tensor,
        mErr: cute.Tensor,
        n_tiles: Int32,
        max_polls: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # this thread's team and its index in it; warp 0 of a team issues
        # the team's bulk reductions, its thread 0 polls
        team = warp_idx // TEAM_WARPS
        ttid = tidx - team * TEAM_THREADS
        issuer = warp_idx == team * TEAM_WARPS
        num_experts = cute.size(mOut, mode=[0])
        max_m = cute.size(mOut, mode=[1])
        n = cute.size(mOut, mode=[2])
        num_tokens = cute.size(mCombined, mode=[0])
        num_m_slots = (max_m + self.block_m - 1) // self.block_m

        smem = cutlass.memory.SmemAllocator()
        sGroup = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((GROUP_ELEMS, 2, TEAMS)), byte_alignment=128
        )
        # per team, the latest item whose wait timed out: the team's barriers
        # need all its threads to take the same branch. (Compared with >=:
        # after a skipped item, the poller may already have recorded a later one.)
        sFailed = smem.allocate_tensor(Int32, cute.make_layout(TEAMS), byte_alignment=4)
        if ttid == 0:
            sFailed[team] = Int32(-1)
        cute.arch.sync_threads()
        frag = cute.make_rmem_tensor((CHUNK, ROUNDS), mOut.element_type)
        wgt = cute.make_rmem_tensor((ROUNDS,), cutlass.Float32)
        # Work items are rows_per_item-row slices of the valid rows only,
        # walked expert-major by the GEMM's own masked scheduler (one "n-block")
        # and dealt to the teams of all CTAs, consecutive items to different
        # CTAs. (With one item per (expert, m-block) and most m-blocks empty,
        # the dsv3-ep8 work had landed on 5 of 20 CTAs.)
        sched = MaskedTileScheduler.create(
            mMaskedM, num_experts, max_m, Int32(1), self.rows_per_item, bidx + team * gdim, gdim * TEAMS
        )
        work = sched.work()
        group_count = Int32(0)
        item_count = Int32(0)
        while work.is_valid:
            e = work.expert
            row0 = work.m_block * self.rows_per_item
            unit = e * num_m_slots + row0 // self.block_m  # the GEMM m-block's counter
            # One thread polls, then the team barrier passes its acquire on
            # to the team (the pattern of CUTLASS's generic barrier wait):
            # every thread polling put 640 warps on one L2 line.
            if ttid == 0:
                if not wait_signal(mSignals.iterator + unit, n_tiles, max_polls, mErr.iterator):
                    sFailed[team] = item_count
            cute.arch.barrier(barrier_id=COMBINE_TEAM_FIRST + team, number_of_threads=TEAM_THREADS)
            if sFailed[team] < item_count:
                total = work.valid_rows * n  # the item's rows, flattened
                for g0 in cutlass.range(0, total, GROUP_ELEMS, unroll=1):
                    buf = group_count % 2
                    # loads first, before any barrier (clamped to the last
                    # chunk: n % 8 == 0, so a chunk never crosses a row)
                    for j in cutlass.range_constexpr(ROUNDS):
                        i = cutlass.min(g0 + (j * TEAM_THREADS + ttid) * CHUNK, total - CHUNK)
                        r = i // n
                        wgt[j] = mWeight[e, row0 + r]
                        src = cute.local_tile(mOut[e, row0 + r, None], (CHUNK,), ((i - r * n) // CHUNK,))
                        cute.autovec_copy(src, frag[None, j])
                    if g0 > 0:
                        # the issuer's wait after the last group freed this
                        # buffer (an item's first group: the item barrier did)
                        cute.arch.barrier(barrier_id=COMBINE_TEAM_FIRST + team, number_of_threads=TEAM_THREADS)
                    for j in cutlass.range_constexpr(ROUNDS):
                        off = (j * TEAM_THREADS + ttid) * CHUNK
                        if g0 + off < total:
                            vals = frag[None, j].load().to(cutlass.Float32) * wgt[j]
                            dst = cute.local_tile(sGroup[None, buf, team], (CHUNK,), (off // CHUNK,))
                            dst.store(vals)
                    # generic-proxy writes -> visible to the bulk-copy engine
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=COMBINE_TEAM_FIRST + team, number_of_threads=TEAM_THREADS)
                    if issuer:
                        # one bulk reduction per row piece in [g0, g0 + count)
                        count = cutlass.min(total - g0, GROUP_ELEMS)
                        r_first = g0 // n
                        r_last = (g0 + count - 1) // n
                        for r in cutlass.range(r_first + lane, r_last + 1, 32, unroll=1):
                            lo = cutlass.max(g0, r * n)
                            hi = cutlass.min(g0 + count, (r + 1) * n)
                            token = Int32(mTokenIdx[e, row0 + r])
                            if (token >= 0) & (token < num_tokens):
                                cp_reduce_async_bulk_global_shared_cta(
                                    mCombined.iterator + (token * n + (lo - r * n)),
                                    sGroup.iterator + ((team * 2 + buf) * GROUP_ELEMS + (lo - g0)),
                                    (hi - lo) * 4,
                                    op=CpReduceOp.ADD,
                                    type=CpReduceType.F32,
                                )
                            else:
                                cute.arch.atomic_or(mErr.iterator, Int32(ERR_BAD_ROUTE))
                        cute.arch.cp_async_bulk_commit_group()
                        # the other buffer's reductions (one group ago) have
                        # read it before anyone stages the next group there
                        cute.arch.cp_async_bulk_wait_group(1, read=True)
                    group_count += 1
            item_count += 1
            sched.advance()
            work = sched.work()
        if issuer:
            # the reductions must have read shared memory before the CTA exits
            cute.arch.cp_async_bulk_wait_group(0, read=False)
