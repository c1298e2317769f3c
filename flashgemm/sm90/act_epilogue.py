"""The fused SwiGLU epilogue (``Epilogue.SWIGLU_FP8`` / ``SWIGLU_BF16``): a
gate_up tile leaves as the down projection's input, never as gate_up itself.

B is w13 with its gate and up rows interleaved in ``SWIGLU_GRANULE``-row
groups (``moe.gate_up.interleave_w13``), so tile n_block (128 columns) holds
gate columns 0-63 and the matching up columns 64-127 of h columns
[64 n_block, 64 n_block + 64), and each consumer thread holds a gate value and
its up value in accumulator values v and v + size / 2. Each value is rounded to
bf16 first, as the stored gate_up output of the two-kernel path would be, so
both paths give the same h.

fp8: the 1x128 scale of a row spans the 128 h columns of the cluster pair
(n_block 2j on rank 0, 2j + 1 on rank 1). Per tile each consumer warpgroup
exchanges its 64 rows' partial maxima with the same warpgroup of the peer CTA:

* the quad's lane 0 (four lanes share a row) sends its two rows' maxima with
  ``st.async`` into the peer's ``peer_amax`` slot of this tile's parity,
  completing 4 bytes each on the peer's mbarrier of (parity, warpgroup);
* the warpgroup's thread 0 arrives on its own mbarrier expecting 64 * 4
  bytes, and every thread waits for that phase;
* the quad's lane 0 reads the peer's maxima and shares them by shuffle.

Two parities suffice: a CTA writes a slot again two tiles later, after the
peer's sends of the tile in between, which the peer issues after reading the
slot. Rank 0 writes the scales. Rows >= m_e are never written; h leaves by
direct stores from registers (a tile of h is 64 bytes of fp8 per row).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..device.swiglu import FP8_MAX, MIN_AMAX, swiglu


class ActTarget(NamedTuple):
    """Where the fused SwiGLU's h goes."""

    mH: cute.Tensor  # (max_m, I, E) fp8 e4m3 or bf16 (the kernel's batch-last view)
    mHScale: cute.Tensor  # fp8: (E, max_m, I/128) fp32, M contiguous; else None
    sPeerAmax: cute.Tensor  # fp8: (2 * tile_m,) fp32 shared memory, the peer's row maxima per parity
    amax_mbar: object  # fp8: pointer to 2 * W mbarriers (parity-major)
    cta_rank: Int32


def init_exchange_barriers(mbar, num_consumer_wg: int):
    """One elected thread, before the cluster's barrier-init sync: one
    mbarrier per (parity, consumer warpgroup), one local arrival each."""
    with cute.arch.elect_one():
        for i in range(2 * num_consumer_wg):  # (traced once each)
            cute.arch.mbarrier_init(mbar + i, 1)


def act_target(storage, mH, mHScale, tile_m: int, cta_rank) -> ActTarget:
    """The consumers' target; ``storage`` (the CTA's shared storage) only
    for the fp8 build, whose row maxima it holds."""
    if storage is None:
        return ActTarget(mH, mHScale, None, None, cta_rank)
    return ActTarget(mH, mHScale, storage.peer_amax.get_tensor(cute.make_layout(2 * tile_m)),
                     storage.amax_mbar.data_ptr(), cta_rank)


class SwigluEpilogue:
    """One consumer thread's fused SwiGLU state (built once per kernel), with
    the constructor and ``store`` every sm_90 tile epilogue has
    (``epilogues.make_tile_epilogue``); it uses no staging buffer."""

    def __init__(self, tiled_mma, accumulators, sD, gD_mem, tile_mn, out_dtype, consumer_tidx, epi_barrier,
                 consumer_barrier, epi_tile, handoff, target: ActTarget):
        self.target = target
        self.accumulators = accumulators
        self.tile_mn = tile_mn
        self.consumer_tidx = consumer_tidx
        self.num_consumer_wg = consumer_barrier.num_threads // 128
        # (row, column) in the tile of each accumulator value
        self.tCcC = tiled_mma.get_slice(consumer_tidx).partition_C(cute.make_identity_tensor(tile_mn))
        self.fp8 = target.mHScale is not None

    def __extract_mlir_values__(self):  # nothing here changes inside the tile loop
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def store(self, expert: Int32, m_block: Int32, n_block: Int32, valid_rows: Int32, n_total: Int32,
              sig_pipeline, sig_state, half=None, tile_count=None):
        """h of this tile's rows < valid_rows (tile_count: the tiles this
        thread stored before, the same on both CTAs of the pair); no signals."""
        self._store_h(expert, m_block, n_block, valid_rows, tile_count)
        return sig_state

    @cute.jit
    def _store_h(self, expert: Int32, m_block: Int32, n_block: Int32, valid_rows: Int32, tile_count: Int32):
        acc = self.accumulators
        half_n = cute.size(acc) // 2  # gate values; value v + half_n is v's up value
        gu = cute.make_rmem_tensor((2 * half_n,), Float32)
        gu.store(acc.load().to(cutlass.BFloat16).to(Float32))
        gate = cute.make_rmem_tensor((half_n,), Float32)
        up = cute.make_rmem_tensor((half_n,), Float32)
        for v in cutlass.range_constexpr(half_n):
            gate[v] = gu[v]
            up[v] = gu[v + half_n]
        h = cute.make_rmem_tensor((half_n,), Float32)
        swiglu(gate, up, h)
        out_t = self.target.mH.element_type
        out = cute.make_rmem_tensor((half_n,), out_t)
        # value v: column pair (v % 2), row half (v // 2 % 2), 8-column group (v // 4)
        scales = (Float32(1.0), Float32(1.0))
        if cutlass.const_expr(self.fp8):
            scales = self._row_scales(h, half_n, tile_count)
            # both rows' values, each times its row's 1 / scale (value v's row: v // 2 % 2)
            q = cute.make_rmem_tensor((half_n,), Float32)
            inv = (1.0 / scales[0], 1.0 / scales[1])
            for v in cutlass.range_constexpr(half_n):
                q[v] = h[v] * inv[(v // 2) % 2]
            out.store(q.load().to(out_t))
        else:
            out.store(h.load().to(out_t))
        row0 = m_block * self.tile_mn[0]
        col0 = n_block * (self.tile_mn[1] // 2)
        # a bf16 cluster's second CTA may hold an n-block past N (an odd count): it stores nothing
        inside = col0 < cute.size(self.target.mH, mode=[1])
        for r in cutlass.range_constexpr(2):
            row = self.tCcC[2 * r][0]
            if (row < valid_rows) & inside:
                dst_row = self.target.mH[row0 + row, None, expert]
                for grp in cutlass.range_constexpr(half_n // 4):
                    v0 = 4 * grp + 2 * r
                    col = col0 + self.tCcC[v0][1]
                    cute.autovec_copy(cute.local_tile(out, (2,), (v0 // 2,)),
                                      cute.local_tile(dst_row, (2,), (col // 2,)))
                if cutlass.const_expr(self.fp8):
                    if (self.target.cta_rank == 0) & (cute.arch.lane_idx() % 4 == 0):
                        self.target.mHScale[expert, row0 + row, n_block // 2] = scales[r]

    @cute.jit
    def _row_scales(self, h: cute.Tensor, half_n: cutlass.Constexpr, tile_count: Int32):
        """Each of this thread's two rows' 1x128 scale: the |max| over this
        CTA's 64 columns (the quad's four lanes), then with the peer CTA's."""
        amax = [Float32(MIN_AMAX), Float32(MIN_AMAX)]
        for v in cutlass.range_constexpr(half_n):
            amax[(v // 2) % 2] = cute.arch.fmax(amax[(v // 2) % 2], cute.math.absf(h[v]))
        for r in cutlass.range_constexpr(2):
            for off in (1, 2):  # the quad shares the row
                amax[r] = cute.arch.fmax(amax[r], cute.arch.shuffle_sync_bfly(amax[r], off))
        target = self.target
        lane = cute.arch.lane_idx()
        wg = self.consumer_tidx // 128
        parity = tile_count % 2
        bar = target.amax_mbar + parity * self.num_consumer_wg + wg
        base = parity * self.tile_mn[0]  # this parity's slots
        if self.consumer_tidx % 128 == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, 64 * 4)
        mine = cute.make_rmem_tensor((2,), Float32)
        mine[0] = amax[0]
        mine[1] = amax[1]
        bits = cute.recast_tensor(mine, Int32)
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(2):
                cute.arch.store_async_dsmem(
                    target.sPeerAmax.iterator + base + self.tCcC[2 * r][0], bits[r], bar, 1 - target.cta_rank
                )
        cute.arch.mbarrier_wait(bar, (tile_count // 2) % 2)
        peer = cute.make_rmem_tensor((2,), Float32)
        peer.fill(0.0)
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(2):
                peer[r] = target.sPeerAmax[base + self.tCcC[2 * r][0]]
            # the slot's next write comes from st.async (async proxy)
            cute.arch.fence_view_async_shared()
        scales = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            both = cute.arch.fmax(amax[r], cute.arch.shuffle_sync(peer[r], lane & ~3))
            scales[r] = both / FP8_MAX
        return scales[0], scales[1]
