"""The device dispatch (CuTe DSL, sm_90a): every token row straight into its
owners' receive buffers, in the masked layout, with no host round trip.

For each routed copy (token t, top-k slot j, global expert g) of this rank:
the owner ``g // E_local`` hands out the copy's row with a system-scope
atomic add on its counter of local expert ``e = g % E_local``, and the
copy's routing (this rank, t, j, weight) and its row land in the owner's
buffer at ``[e, row]``: bf16 as is, or fp8 e4m3 with one fp32 scale per 128
columns, quantized from bf16 on the way (``scale = max(amax, 1e-10) * fl(1/448)``,
``q = x / scale``: bit for bit what ``flashgemm.quant.quantize_fp8_per_token``
gives on the GPU).
Then every rank posts this launch's sequence number into every peer's
arrival slot and waits for every peer's (bounded); once all have arrived it
swaps each counter for 0 and writes the count into its own ``masked_m``.

Row order inside an expert follows the atomics, so it varies from run to
run; nothing downstream depends on it: the GEMMs compute each row alone and
the owner sums a token's rows in top-k slot order (``combine.finalize``).

Error word bits (shared with the combine's word: ``dispatch.ERROR_BITS``):
2 a top-k id outside [-1, num_experts) (that copy skipped), 4 a peer did
not arrive in time, 8 a peer reported an error, 16 an expert received more
rows than its capacity (the extra rows dropped; sender and owner both set
it), 32 a peer arrived with another sequence number than this rank (a rank
skipped or repeated a layer). The word is sticky: an error already in it is
posted to every peer at the next arrival.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.experimental.primitives.nvvm_wrapper import nanosleep

from ..device.swiglu import FP8_MAX, MIN_AMAX
from .buffers import MAX_PEERS
# one error word for the layer
from ..device.errors import ERR_BAD_ROUTE, ERR_OVERFLOW, ERR_PEER_FAILED, ERR_PEER_TIMEOUT, ERR_SEQUENCE
THREADS = 512
WARPS = THREADS // 32
VEC = 16  # columns per lane: 32 bytes of bf16 in, 16 bytes of fp8 out
WARP_COLS = 32 * VEC
LANES_PER_BLOCK = 128 // VEC  # 8 lanes cover one 128-column scale block
MAX_BACKOFF_NS = 1024


@cute.jit
def arrive_and_wait(mPeerBase: cute.Tensor, mFlags: cute.Tensor, mErr: cute.Tensor, seq: Int32, rank: Int32,
                    world: Int32, max_polls: Int32):
    """One warp: post this rank's error word (if any) and then ``seq``
    (release, system scope) into every peer's flags block, then wait for
    every peer's ``seq`` here (acquire), at most ``max_polls`` polls each.
    Equality is required: a peer one sequence ahead or behind raises
    ERR_SEQUENCE instead of passing."""
    lane = cute.arch.lane_idx()
    local_err = mErr[0]
    cute.arch.sync_warp()
    cute.arch.fence_acq_rel_sys()
    for p in cutlass.range(lane, world, 32, unroll=1):
        flags = cute.make_ptr(Int32, mPeerBase[p], cute.AddressSpace.gmem, assumed_align=16)
        if (local_err != 0) & (p != rank):
            cute.arch.atomic_or(flags + (MAX_PEERS + rank), local_err, sem="relaxed", scope="sys")
        cute.arch.store(flags + rank, seq, sem="release", scope="sys")
    for p in cutlass.range(lane, world, 32, unroll=1):
        value = cute.arch.load(mFlags.iterator + p, Int32, sem="acquire", scope="sys")
        polls = Int32(0)
        backoff = Int32(64)
        while (value - seq < 0) & (polls < max_polls):
            nanosleep(backoff)
            backoff = cutlass.min(backoff * 2, Int32(MAX_BACKOFF_NS))
            polls = polls + 1
            value = cute.arch.load(mFlags.iterator + p, Int32, sem="acquire", scope="sys")
        if value - seq < 0:
            cute.arch.atomic_or(mErr.iterator, Int32(ERR_PEER_TIMEOUT))
        elif value != seq:
            cute.arch.atomic_or(mErr.iterator, Int32(ERR_SEQUENCE))
        elif (p != rank) & (mFlags[MAX_PEERS + p] != 0):
            cute.arch.atomic_or(mErr.iterator, Int32(ERR_PEER_FAILED))
    cute.arch.sync_warp()


class EpDispatchSm90:
    """Token rows into the owners' masked layouts over NVLink.

    Roles: CTAs of ``THREADS`` threads take tokens in turn (token b, b +
    grid, ...). For a token, warp 0's lanes j < top_k each take a top-k slot:
    the owner's row counter (remote atomic), then the copy's routing into the
    owner's tables; the rows go through shared memory to the CTA. Then every
    warp takes 512-column pieces of the row: a lane loads 16 bf16 values,
    for fp8 the 8 lanes of a 128-column block reduce their |max| with
    butterfly shuffles and quantize, and the lane stores its 16 or 32 bytes
    into each slot's row at its owner (plain stores: one writer per row);
    the first lane of a block stores the block's scale. No pipelines.
    Completion: after a CTA barrier, thread 0 fences at system scope and counts the CTA done; the
    last CTA's warp 0 runs ``arrive_and_wait``, then swaps each local
    expert's counter for 0 into ``masked_m`` (clamped to the capacity).

    Buffer layout (byte offsets into every rank's buffer, from the host's
    ``dispatch.DispatchLayout``): flags at 0 (``MAX_PEERS`` arrival
    slots, then ``MAX_PEERS`` error slots), counters ``[E_local]`` int32,
    the routing tables ``[E_local, max_m]`` (src rank, src token, top-k
    slot: int32; weight: float32), x ``[E_local, max_m, H]``, and for fp8
    the scales ``[E_local, ceil(H / 128), max_m]`` float32 (M contiguous).
    """

    def __init__(self, top_k: int, fp8: bool):
        self.top_k = top_k
        self.fp8 = fp8

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (T, H) bf16, this rank's tokens
        mIds: cute.Tensor,  # (T, k) int32 or int64 global expert ids, -1: not routed
        mWeights: cute.Tensor,  # (T, k) float32
        mPeerBase: cute.Tensor,  # (W,) int64: every rank's buffer
        mFlags: cute.Tensor,  # (FLAG_WORDS,) int32: this rank's flags block
        mCounters: cute.Tensor,  # (E_local,) int32: this rank's counters
        mMaskedM: cute.Tensor,  # (E_local,) int32, ordinary memory
        mState: cute.Tensor,  # (STATE_WORDS,) int32, ordinary memory
        mErr: cute.Tensor,  # (1,) int32
        off_counters: Int64,  # byte offsets of the regions in every rank's buffer
        off_meta: Int64,
        off_x: Int64,
        off_scale: Int64,
        max_m: Int32,
        rank: Int32,
        max_polls: Int32,
        num_ctas: Int32,
        stream,
    ):
        self.kernel(mX, mIds, mWeights, mPeerBase, mFlags, mCounters, mMaskedM, mState, mErr, off_counters,
                    off_meta, off_x, off_scale, max_m,
                    rank, max_polls).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mIds: cute.Tensor,
        mWeights: cute.Tensor,
        mPeerBase: cute.Tensor,
        mFlags: cute.Tensor,
        mCounters: cute.Tensor,
        mMaskedM: cute.Tensor,
        mState: cute.Tensor,
        mErr: cute.Tensor,
        off_counters: Int64,
        off_meta: Int64,
        off_x: Int64,
        off_scale: Int64,
        max_m: Int32,
        rank: Int32,
        max_polls: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        num_tokens = cute.size(mX, mode=[0])
        hidden = cute.size(mX, mode=[1])
        world = cute.size(mPeerBase, mode=[0])
        e_local = cute.size(mCounters, mode=[0])
        blocks = (hidden + 127) // 128
        pieces = (hidden + WARP_COLS - 1) // WARP_COLS
        table = Int64(e_local) * Int64(max_m) * Int64(4)  # bytes of one routing table
        x_bytes = 1 if cutlass.const_expr(self.fp8) else 2

        smem = cutlass.memory.SmemAllocator()
        sRow = smem.allocate_tensor(Int32, cute.make_layout(self.top_k), byte_alignment=4)
        sOwner = smem.allocate_tensor(Int32, cute.make_layout(self.top_k), byte_alignment=4)
        sExpert = smem.allocate_tensor(Int32, cute.make_layout(self.top_k), byte_alignment=4)
        sLast = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        vin = cute.make_rmem_tensor((VEC,), mX.element_type)
        v32 = cute.make_rmem_tensor((VEC,), Float32)
        q = cute.make_rmem_tensor((VEC,), cutlass.Float8E4M3FN)

        for t in cutlass.range(bidx, num_tokens, gdim, unroll=1):
            if warp == 0:
                if lane < self.top_k:
                    gid = Int32(mIds[t, lane])
                    row = Int32(-1)
                    owner = Int32(0)
                    e = Int32(0)
                    if (gid >= 0) & (gid < e_local * world):
                        owner = gid // e_local
                        e = gid - owner * e_local
                        base = mPeerBase[owner]
                        counter = cute.make_ptr(Int32, base + off_counters, cute.AddressSpace.gmem, assumed_align=4)
                        got = cute.arch.atomic_add(counter + e, Int32(1), sem="relaxed", scope="sys")
                        if got < max_m:
                            row = got
                            at = off_meta + (Int64(e) * Int64(max_m) + Int64(row)) * Int64(4)
                            meta = cute.make_ptr(Int32, base + at, cute.AddressSpace.gmem, assumed_align=4)
                            cute.arch.store(meta, rank)
                            cute.arch.store(meta + (table // 4), Int32(t))
                            cute.arch.store(meta + (table // 2), lane)
                            wptr = cute.make_ptr(Float32, base + at + table * 3, cute.AddressSpace.gmem,
                                                 assumed_align=4)
                            cute.arch.store(wptr, Float32(mWeights[t, lane]))
                        else:
                            cute.arch.atomic_or(mErr.iterator, Int32(ERR_OVERFLOW))
                    elif gid != -1:
                        cute.arch.atomic_or(mErr.iterator, Int32(ERR_BAD_ROUTE))
                    sRow[lane] = row
                    sOwner[lane] = owner
                    sExpert[lane] = e
            cute.arch.sync_threads()
            for p in cutlass.range(warp, pieces, WARPS, unroll=1):
                col = p * WARP_COLS + lane * VEC
                inside = col < hidden
                src = cutlass.min(col, hidden - VEC)  # hidden % 16 == 0: a lane never straddles the end
                cute.autovec_copy(cute.local_tile(mX[t, None], (VEC,), (src // VEC,)), vin)
                v32.store(vin.load().to(Float32))
                scale = Float32(1.0)
                if cutlass.const_expr(self.fp8):
                    amax = Float32(0.0)
                    if inside:
                        for i in cutlass.range_constexpr(VEC):
                            amax = cute.arch.fmax(amax, cute.math.absf(v32[i]))
                    for off in (4, 2, 1):  # the 8 lanes of one 128-column block
                        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, off))
                    # times the fp32 reciprocal, as torch divides by a scalar on the GPU
                    scale = cute.arch.fmax(amax, Float32(MIN_AMAX)) * Float32(1.0 / FP8_MAX)
                    for i in cutlass.range_constexpr(VEC):
                        v32[i] = v32[i] / scale
                    q.store(v32.load().to(cutlass.Float8E4M3FN))
                if inside:
                    for j in cutlass.range_constexpr(self.top_k):
                        row = sRow[j]
                        if row >= 0:
                            base = mPeerBase[sOwner[j]]
                            flat = Int64(sExpert[j]) * Int64(max_m) + Int64(row)
                            at = base + off_x + (flat * Int64(hidden) + Int64(col)) * x_bytes
                            dst = cute.make_ptr(Int32, at, cute.AddressSpace.gmem, assumed_align=16)
                            if cutlass.const_expr(self.fp8):
                                cute.arch.store(dst, cute.recast_tensor(q, Int32).load().ir_value())
                                if lane % LANES_PER_BLOCK == 0:
                                    blk = Int64(sExpert[j]) * Int64(blocks) + Int64(col // 128)
                                    sat = base + off_scale + (blk * Int64(max_m) + Int64(row)) * 4
                                    cute.arch.store(
                                        cute.make_ptr(Float32, sat, cute.AddressSpace.gmem, assumed_align=4), scale)
                            else:
                                words = cute.recast_tensor(vin, Int32)  # 16 bf16 as 8 words
                                lo = cute.make_rmem_tensor((4,), Int32)
                                hi = cute.make_rmem_tensor((4,), Int32)
                                for w in cutlass.range_constexpr(4):
                                    lo[w] = words[w]
                                    hi[w] = words[w + 4]
                                cute.arch.store(dst, lo.load().ir_value())
                                cute.arch.store(dst + 4, hi.load().ir_value())
            cute.arch.sync_threads()  # the slot rows in shared memory are the next token's

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
        if (sLast[0] != 0) & (warp == 0):
            seq = mState[1] + 1
            if lane == 0:
                mState[0] = Int32(0)  # ready for the next launch (stream-ordered after this one)
                mState[1] = seq
            arrive_and_wait(mPeerBase, mFlags, mErr, seq, rank, world, max_polls)
            # every peer's atomics and rows are visible: take the counts, leave 0 for the next layer
            for e in cutlass.range(lane, e_local, 32, unroll=1):
                count = cute.arch.atomic_exch(mCounters.iterator + e, Int32(0), sem="relaxed", scope="sys")
                if count > max_m:
                    cute.arch.atomic_or(mErr.iterator, Int32(ERR_OVERFLOW))
                    count = max_m
                mMaskedM[e] = count
