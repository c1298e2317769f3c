"""The signalled expert-parallel combine (CuTe DSL, sm_90a).

For each valid row r of local expert e, once the down GEMM's m-block counter
says the row is final:
``recv[src_rank[e, r]][src_token[e, r], src_slot[e, r]] = bf16(weight[e, r] * y[e, r])``,
where ``recv[p]`` is rank p's receive buffer in symmetric memory, reached
through a table of the W peers' buffer addresses (NVLink peer-to-peer), and
written with plain 16-byte stores: every (token, slot) has one writer, so no
remote atomics are needed. Then every rank tells every peer it is done, and
waits until every peer told it the same: on return, this rank's receive
buffer holds every row of its tokens (``combine.finalize`` sums them).

Error word bits: 1 a wait on the GEMM's counter timed out (that item
skipped), 2 a routing entry outside [0, W) x [0, T) x [0, k) (that row
skipped), 4 a peer did not report completion in time, 8 a peer reported an
error of its own.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.experimental.primitives.nvvm_wrapper import nanosleep

from ..schedule.warp_walk import lane_expert_items, pick_item
from ..signals import check_rows_per_item
from ..device.errors import ERR_BAD_ROUTE, ERR_PEER_FAILED, ERR_PEER_TIMEOUT
from ..device.signal_wait import wait_signal
from .buffers import MAX_PEERS

COMBINE_THREADS = 1024
WARPS = COMBINE_THREADS // 32
CHUNK = 8  # bf16 elements per 16-byte load
# 16-byte loads each lane has in flight before its reductions
ROUNDS = 4
WARP_ELEMS = 32 * CHUNK * ROUNDS


@cute.jit
def peer_completion(
    mPeerFlags: cute.Tensor, mFlags: cute.Tensor, mState: cute.Tensor, mErr: cute.Tensor,
    rank: Int32, world: Int32, max_polls: Int32,
):
    """One warp: add 1 to slot ``rank`` of every peer's flags (release, system
    scope), then wait until every peer's slot in this rank's flags reaches
    this launch's epoch (acquire, system scope), giving up after ``max_polls``
    polls with ERR_PEER_TIMEOUT. A local error is first ORed into the other
    peers' error slots, and another peer's error is raised here as
    ERR_PEER_FAILED (sticky: a failed layer is not reused). The
    slots only grow, so no reset is needed between layers (the compare is
    wrap-safe)."""
    lane = cute.arch.lane_idx()
    epoch = mState[1] + 1
    local_err = mErr[0]
    cute.arch.sync_warp()
    if lane == 0:
        mState[0] = Int32(0)  # ready for the next launch (stream-ordered after this one)
        mState[1] = epoch
    # the row writes of every CTA (ordered before this by the done counter, or
    # by the kernel boundary after a fused GEMM) are performed system-wide
    # before any peer can see the release
    cute.arch.fence_acq_rel_sys()
    for p in cutlass.range(lane, world, 32, unroll=1):
        flags = cute.make_ptr(Int32, mPeerFlags[p], cute.AddressSpace.gmem, assumed_align=4)
        if (local_err != 0) & (p != rank):  # this rank reports its own error itself
            cute.arch.atomic_or(flags + (MAX_PEERS + rank), local_err, sem="relaxed", scope="sys")
        cute.arch.red(flags + rank, Int32(1), op="add", dtype=Int32, sem="release", scope="sys")
    for p in cutlass.range(lane, world, 32, unroll=1):
        value = cute.arch.load(mFlags.iterator + p, Int32, sem="acquire", scope="sys")
        polls = Int32(0)
        backoff = Int32(64)
        while (value - epoch < 0) & (polls < max_polls):
            nanosleep(backoff)
            backoff = cutlass.min(backoff * 2, Int32(1024))
            polls = polls + 1
            value = cute.arch.load(mFlags.iterator + p, Int32, sem="acquire", scope="sys")
        if value - epoch < 0:
            cute.arch.atomic_or(mErr.iterator, Int32(ERR_PEER_TIMEOUT))
        elif (p != rank) & (mFlags[MAX_PEERS + p] != 0):
            cute.arch.atomic_or(mErr.iterator, Int32(ERR_PEER_FAILED))


class EpCombineSm90:
    """Signal-driven combine into the owner ranks' receive buffers.

    Roles: every warp of every CTA (``COMBINE_THREADS`` threads, one CTA per
    SM the GEMM leaves free) is a team of its own. Work items are
    ``rows_per_item``-row slices of the valid rows in the GEMM's
    expert-major order, dealt round-robin to the warps of all CTAs; a warp
    finds its items 32 experts at a time (``schedule.warp_walk``). For an
    item every lane acquire-polls the m-block's counter (one load per warp), so each lane's reads of the rows
    are ordered after the GEMM's release without a barrier. The warp then
    walks the item's rows flattened: each lane loads ``ROUNDS`` 16-byte bf16
    chunks, scales them by their row's weight in fp32, rounds them to bf16
    and stores them into the owner's (token, slot) row with one 16-byte
    store each (over NVLink for a peer). No shared-memory pipeline: a chunk's loads and its reductions are the
    whole path. Completion: after a CTA barrier, thread 0 fences at system scope and counts
    itself done (GPU-scope acq_rel add); the last CTA's warp 0 runs
    ``peer_completion``.
    """

    def __init__(self, block_m: int, rows_per_item: int):
        check_rows_per_item(rows_per_item, block_m)
        self.block_m = block_m
        self.rows_per_item = rows_per_item

    @cute.jit
    def __call__(
        self,
        mOut: cute.Tensor,  # (E, max_m, N) bf16: the down GEMM's output
        mMaskedM: cute.Tensor,  # (E,) int32
        mSignals: cute.Tensor,  # "m_block" counters of the GEMM
        mSrcRank: cute.Tensor,  # (E, max_m) int32
        mSrcToken: cute.Tensor,  # (E, max_m) int32
        mSrcSlot: cute.Tensor,  # (E, max_m) int32
        mWeight: cute.Tensor,  # (E, max_m) float32
        mPeerRecv: cute.Tensor,  # (W,) int64: each rank's receive buffer (T, k, N) bf16
        mPeerFlags: cute.Tensor,  # (W,) int64: each rank's flags block
        mFlags: cute.Tensor,  # (FLAG_WORDS,) int32: this rank's flags block
        mState: cute.Tensor,  # (STATE_WORDS,) int32, local
        mErr: cute.Tensor,  # (1,) int32
        num_tokens: Int32,
        top_k: Int32,
        rank: Int32,
        n_tiles: Int32,
        max_polls: Int32,
        num_ctas: Int32,
        stream,
    ):
        self.kernel(
            mOut, mMaskedM, mSignals, mSrcRank, mSrcToken, mSrcSlot, mWeight, mPeerRecv, mPeerFlags, mFlags,
            mState, mErr, num_tokens, top_k, rank, n_tiles, max_polls,
        ).launch(grid=[num_ctas, 1, 1], block=[COMBINE_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mOut: cute.Tensor,
        mMaskedM: cute.Tensor,
        mSignals: cute.Tensor,
        mSrcRank: cute.Tensor,
        mSrcToken: cute.Tensor,
        mSrcSlot: cute.Tensor,
        mWeight: cute.Tensor,
        mPeerRecv: cute.Tensor,
        mPeerFlags: cute.Tensor,
        mFlags: cute.Tensor,
        mState: cute.Tensor,
        mErr: cute.Tensor,
        num_tokens: Int32,
        top_k: Int32,
        rank: Int32,
        n_tiles: Int32,
        max_polls: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        num_experts = cute.size(mOut, mode=[0])
        max_m = cute.size(mOut, mode=[1])
        n = cute.size(mOut, mode=[2])
        world = cute.size(mPeerRecv, mode=[0])
        num_m_slots = (max_m + self.block_m - 1) // self.block_m

        smem = cutlass.memory.SmemAllocator()
        sLast = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        frag = cute.make_rmem_tensor((CHUNK, ROUNDS), mOut.element_type)
        vals = cute.make_rmem_tensor((CHUNK,), cutlass.Float32)
        piece = cute.make_rmem_tensor((CHUNK,), cutlass.BFloat16)
        u = bidx + warp_idx * gdim  # this warp's next item, over the launch
        stride = gdim * WARPS
        base = Int32(0)  # the chunk's first expert
        before = Int32(0)  # items of the experts before it
        while base < num_experts:
            rows_l, incl = lane_expert_items(mMaskedM, num_experts, max_m, base, self.rows_per_item)
            chunk_items = cute.arch.shuffle_sync(incl, 31)
            while u - before < chunk_items:
                lane_sel, row0, valid_rows = pick_item(rows_l, incl, u - before, self.rows_per_item)
                e = base + lane_sel
                unit = e * num_m_slots + row0 // self.block_m  # the GEMM m-block's counter
                if wait_signal(mSignals.iterator + unit, n_tiles, max_polls, mErr.iterator):
                    self.item(mOut, mSrcRank, mSrcToken, mSrcSlot, mWeight, mPeerRecv, mErr, frag, vals, piece,
                              e, row0, valid_rows * n, n, world, num_tokens, top_k)
                u = u + stride
            before = before + chunk_items
            base = base + 32

        # the CTA's stores are performed system-wide before it counts as done: the
        # barrier orders them before thread 0's fence, which is cumulative (one
        # fence per CTA rather than one per thread: docs/design.md)
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.fence_acq_rel_sys()
            done = cute.arch.atomic_add(mState.iterator, Int32(1), sem="acq_rel", scope="gpu")
            sLast[0] = Int32(0)
            if done == gdim - 1:
                sLast[0] = Int32(1)
        cute.arch.sync_threads()
        if (sLast[0] != 0) & (warp_idx == 0):
            peer_completion(mPeerFlags, mFlags, mState, mErr, rank, world, max_polls)


    @cute.jit
    def item(self, mOut, mSrcRank, mSrcToken, mSrcSlot, mWeight, mPeerRecv, mErr, frag, vals, piece,
             e: Int32, row0: Int32, total: Int32, n: Int32, world: Int32, num_tokens: Int32, top_k: Int32):
        """One item's rows, flattened (``total`` elements), by the whole warp:
        each lane's ``ROUNDS`` loads first (clamped to the last chunk:
        n % 8 == 0, so a chunk never crosses a row), then its stores."""
        lane = cute.arch.lane_idx()
        for g0 in cutlass.range(0, total, WARP_ELEMS, unroll=1):
            for j in cutlass.range_constexpr(ROUNDS):
                i = cutlass.min(g0 + (j * 32 + lane) * CHUNK, total - CHUNK)
                r = i // n
                src = cute.local_tile(mOut[e, row0 + r, None], (CHUNK,), ((i - r * n) // CHUNK,))
                cute.autovec_copy(src, frag[None, j])
            for j in cutlass.range_constexpr(ROUNDS):
                i = g0 + (j * 32 + lane) * CHUNK
                if i < total:
                    r = i // n
                    owner = Int32(mSrcRank[e, row0 + r])
                    token = Int32(mSrcToken[e, row0 + r])
                    slot = Int32(mSrcSlot[e, row0 + r])
                    if (owner >= 0) & (owner < world) & (token >= 0) & (token < num_tokens) \
                            & (slot >= 0) & (slot < top_k):
                        vals.store(frag[None, j].load().to(cutlass.Float32) * mWeight[e, row0 + r])
                        piece.store(vals.load().to(cutlass.BFloat16))
                        words = cute.recast_tensor(piece, Int32)  # 8 bf16 as 4 words
                        offset = (Int64(token) * Int64(top_k) + Int64(slot)) * Int64(n) + Int64(i - r * n)
                        dst = cute.make_ptr(cutlass.BFloat16, mPeerRecv[owner], cute.AddressSpace.gmem,
                                            assumed_align=16)
                        # one writer per (token, slot): a plain store, no remote atomic
                        cute.arch.store(dst + offset, words.load().ir_value())
                    else:
                        cute.arch.atomic_or(mErr.iterator, Int32(ERR_BAD_ROUTE))


class EpCompleteSm90:
    """The completion step alone (one warp, ``peer_completion``): after a
    down GEMM whose fused epilogue stored its rows into the peers' receive
    buffers (``Epilogue.COMBINE_PEERS``), launched after it on the same
    stream, so the kernel boundary orders the GEMM's stores before the
    release."""

    @cute.jit
    def __call__(self, mPeerFlags: cute.Tensor, mFlags: cute.Tensor, mState: cute.Tensor, mErr: cute.Tensor,
                 rank: Int32, max_polls: Int32, stream):
        self.kernel(mPeerFlags, mFlags, mState, mErr, rank, max_polls).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPeerFlags: cute.Tensor, mFlags: cute.Tensor, mState: cute.Tensor, mErr: cute.Tensor,
               rank: Int32, max_polls: Int32):
        peer_completion(mPeerFlags, mFlags, mState, mErr, rank, cute.size(mPeerFlags, mode=[0]), max_polls)
