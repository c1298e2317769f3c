"""The fused combines' device code on sm_90 (``Epilogue.COMBINE``,
``COMBINE_BF16``, ``COMBINE_PEERS`` and their ``*_BIAS`` builds;
``flashgemm.epilogue.combine``).

Every tile leaves row by row, rows < valid_rows (and >= row_lo) only. As a
partial tile of the plain store, each sub-tile is staged in buffer 0
(rounded to bf16, as the stored output would be) and read back in 16-byte
row pieces; a piece (with ``target.mBias``: plus the expert's bias at its 8
columns, in fp32) is scaled by its row's routing weight in fp32 and sent:

* fp32 output: reduce-added into its token's row in two
  ``red.global.add.v4.f32`` (performed in L2, in no fixed order);
* bf16 output: rounded to bf16 and added in one
  ``red.global.add.noftz.v4.bf16x2`` (half the bytes; docs/design.md);
* the peers (expert parallelism, ``target.mPeers``): the token is the flat
  destination owner * R + row (R: the rows of each rank's receive buffer),
  and the piece, rounded to bf16, leaves in one plain 16-byte store
  (``st.global.v4.b32``, no reduction) to ``mPeers[owner] + (row * N +
  col) * 2`` bytes, the owner's receive buffer (over NVLink for another GPU).

A token outside [0, T) (with peers: [0, W * R)) sets ERR_BAD_ROUTE and its
row is skipped. The bias of a piece is read with the piece, in two 16-byte
``ld.global.v4`` (the same 32 bytes for every row of those columns: L1 and
L2 hits), only for the rows that are sent.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..device.errors import ERR_BAD_ROUTE
from .epilogue import TileEpilogue, epi_tile_count, tile_rows


class CombineTarget(NamedTuple):
    """Where each valid row goes, and how heavily."""

    mTokenIdx: cute.Tensor  # (E, max_m) int32: the token (with mPeers: owner * R + row) of each row
    mWeight: cute.Tensor  # (E, max_m) fp32: its routing weight
    # (T, N) fp32 or bf16, contiguous: reduce-added into; with mPeers this
    # rank's (R, N) bf16 receive buffer, the shape of every rank's
    mCombined: cute.Tensor
    mErr: cute.Tensor  # (1,) int32 error word: ERR_BAD_ROUTE for a token outside [0, T) / [0, W * R)
    mPeers: cute.Tensor = None  # COMBINE_PEERS*: (W,) int64, each rank's receive-buffer address
    mBias: cute.Tensor = None  # COMBINE*_BIAS: (E, N) fp32, contiguous, 16-byte aligned: added before the weight


class CombineEpilogue(TileEpilogue):
    """One consumer thread's fused-combine state: the plain epilogue's
    staging and row pieces, and the routing target."""

    def __init__(self, tiled_mma, accumulators, sD, gD_mem, tile_mn, out_dtype, consumer_tidx, epi_barrier,
                 consumer_barrier, epi_tile, handoff, target: CombineTarget):
        super().__init__(tiled_mma, accumulators, sD, gD_mem, tile_mn, out_dtype, consumer_tidx, epi_barrier,
                         consumer_barrier, epi_tile, handoff)
        self.combine = target

    @cute.jit
    def store(self, expert: Int32, m_block: Int32, n_block: Int32, valid_rows: Int32, n_total: Int32,
              sig_pipeline, sig_state, half=None, tile_count=None):
        """Send one tile's rows; no signals."""
        full, row_lo, row_hi = tile_rows(valid_rows, half, self.tile_mn[0])
        self._reduce_rows(expert, m_block, n_block, row_hi, n_total, row_lo)
        return sig_state

    @cute.jit
    def _reduce_rows(
        self, expert: Int32, m_block: Int32, n_block: Int32, valid_rows: Int32, n_total: Int32,
        row_lo=None,
    ):
        target = self.combine
        peer_stores = target.mPeers is not None
        n_rem = n_total - n_block * self.tile_mn[1]
        num_tokens = cute.size(target.mCombined, mode=[0])
        rows_per_rank = num_tokens
        if cutlass.const_expr(peer_stores):
            num_tokens = rows_per_rank * cute.size(target.mPeers, mode=[0])  # < 2**31 (routing.py)
        passes = cute.size(self.tSG_sD, mode=[1])
        tokens, weights, dests = self._routing(expert, m_block, passes, num_tokens, rows_per_rank, n_total)
        piece = cute.make_rmem_tensor((8,), self.out_dtype)
        vals = cute.make_rmem_tensor((8,), cutlass.Float32)
        for epi_idx in cutlass.range_constexpr(epi_tile_count(self.tile_mn)):
            self._stage(epi_idx, 0)
            self.consumer_barrier.arrive_and_wait()  # sub-tile staged
            for i in cutlass.range_constexpr(passes):
                for n in cutlass.range_constexpr(cute.size(self.tSG_sD, mode=[2])):
                    row, col = self.tSG_cD[(0, i, n)]
                    keep = (row < valid_rows) & (epi_idx * self.epi_tile[1] + col < n_rem)
                    if cutlass.const_expr(row_lo is not None):
                        keep = keep & (row >= row_lo)
                    if keep:
                        token = tokens[i]
                        if (token >= 0) & (token < num_tokens):
                            cute.autovec_copy(self.tSG_sD[(None, i, n)], piece)
                            col0 = n_block * self.tile_mn[1] + epi_idx * self.epi_tile[1] + col
                            if cutlass.const_expr(target.mBias is not None):
                                self._load_bias(vals, expert, col0, n_total)
                                vals.store((piece.load().to(cutlass.Float32) + vals.load()) * weights[i])
                            else:
                                vals.store(piece.load().to(cutlass.Float32) * weights[i])
                            self._send(piece, vals, token, dests, i, col0, n_total)
                        else:
                            cute.arch.atomic_or(target.mErr.iterator, Int32(ERR_BAD_ROUTE))
            self.consumer_barrier.arrive_and_wait()  # buffer 0 read: free again

    @cute.jit
    def _routing(self, expert: Int32, m_block: Int32, passes: cutlass.Constexpr, num_tokens: Int32,
                 rows_per_rank: Int32, n_total: Int32):
        """This thread's rows are the same in every sub-tile: their tokens,
        weights and (with peers) byte destinations, read once per tile (a
        row past m_e reads a real, unused entry)."""
        target = self.combine
        tokens = cute.make_rmem_tensor((passes,), Int32)
        weights = cute.make_rmem_tensor((passes,), cutlass.Float32)
        dests = None
        if cutlass.const_expr(target.mPeers is not None):
            dests = cute.make_rmem_tensor((passes,), Int64)  # each row's byte address
        row0 = m_block * self.tile_mn[0]
        last_row = cute.size(target.mTokenIdx, mode=[1]) - 1
        for i in cutlass.range_constexpr(passes):
            src = cutlass.min(row0 + self.tSG_cD[(0, i, 0)][0], last_row)
            tokens[i] = target.mTokenIdx[expert, src]
            weights[i] = target.mWeight[expert, src]
            if cutlass.const_expr(target.mPeers is not None):
                # an invalid destination reads entry 0 of the table, never past it
                flat = cutlass.select_((tokens[i] >= 0) & (tokens[i] < num_tokens), tokens[i], Int32(0))
                owner = flat // rows_per_rank
                dests[i] = target.mPeers[owner] + Int64(flat - owner * rows_per_rank) * Int64(n_total) * 2
        return tokens, weights, dests

    @cute.jit
    def _load_bias(self, vals, expert: Int32, col0: Int32, n_total: Int32):
        """The 8 fp32 bias values of ``expert`` at a piece's columns (col0 on)
        into ``vals``: two 16-byte loads, read just before their one use (held
        across the sub-tile's staging instead, they make the fp8 two-part and
        overlapped builds spill)."""
        # 16-byte aligned: the base (routing.py), N % 8 == 0 and col0 a multiple of 8; E * N < 2**31
        src = self.combine.mBias.iterator + (expert * n_total + col0)
        src = cute.make_ptr(cutlass.Float32, src.toint(), cute.AddressSpace.gmem, assumed_align=16)
        cute.autovec_copy(cute.make_tensor(src, cute.make_layout(8)), vals)

    @cute.jit
    def _send(self, piece, vals, token: Int32, dests, i: cutlass.Constexpr, col0: Int32, n_total: Int32):
        """One weighted 16-byte piece (``vals``, fp32) of row ``i`` to its
        token: a peer store, a bf16 reduction or two fp32 reductions."""
        target = self.combine
        if cutlass.const_expr(target.mPeers is not None):
            dst = cute.make_ptr(Int32, dests[i] + Int64(col0) * 2, cute.AddressSpace.gmem, assumed_align=16)
            piece.store(vals.load().to(self.out_dtype))
            words = cute.recast_tensor(piece, Int32)  # 4 bf16 pairs
            cute.arch.store(dst, words.load().ir_value())
        else:
            dst = target.mCombined.iterator + (token * n_total + col0)
            if cutlass.const_expr(target.mCombined.element_type == self.out_dtype):
                piece.store(vals.load().to(self.out_dtype))
                words = cute.recast_tensor(piece, Int32)  # 4 bf16 pairs
                cute.arch.red(dst, words.load().ir_value(), op="add", dtype="bf16x2", sem="relaxed", scope="gpu")
            else:
                for h in cutlass.range_constexpr(2):  # two 16-byte reductions
                    quad = cute.local_tile(vals, (4,), (h,)).load()
                    cute.arch.red(dst + 4 * h, quad.ir_value(), op="add", dtype="f32", sem="relaxed", scope="gpu")
