"""Consumer side of the epilogue: accumulators -> bf16 -> global memory,
never past row m_e.

Per tile, chosen uniformly for all its threads:

* full tile (all ``tile_m`` rows valid): the consumers ``stmatrix`` each
  (tile_m x 32) sub-tile into the staging area and hand it to the store warp
  (``storer``), which issues the bulk tensor store (the TMA unit clips
  columns past N). ``Staging.PAIR``: two buffers, named barrier
  ``barriers.EPILOGUE`` crossed twice per sub-tile. ``Staging.WHOLE_TILE``:
  every sub-tile has its buffer and each warpgroup hands its own 64 rows
  over on its own pair of barriers (``barriers.WarpgroupHandoff``): it waits
  at *free* (the last tile's stores of those rows have read them; before
  every tile, full or partial, since a partial tile reuses buffer 0),
  stages, and only arrives at *staged*. A partial tile arrives at *staged*
  too, without staging, so each side crosses both barriers once per tile.
* partial tile (an expert's last m-block): a bulk store would write rows
  between m_e and the end of the tile, which belong to the caller. The
  consumers stage each sub-tile in buffer 0 and read it back in 16-byte row
  pieces, storing those with row < valid_rows and columns inside N
  (``barriers.CONSUMERS`` around it). With signals each consumer thread then
  hands its stores to the store warp through the signal pipeline
  (``PipelineAsync``, ``SIGNAL_STAGES`` stages): it arrives on the stage's
  full barrier after its stores (release at CTA scope) and goes on; the
  store warp publishes (``storer``).

Why each piece is as it is, with numbers: ``docs/design.md`` (Epilogue).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.tensor_utils.layout import LayoutEnum


# stages of the partial-tile signal handoff (consumers -> store warp): with
# two, the consumers wait only if, when they finish tile t + 2, the store
# warp has not yet taken tile t (it takes each one as soon as it is handed over)
SIGNAL_STAGES = 2


class _NoLoopState:
    # Nothing here changes inside the tile loop: carry no values through it.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self


class TileEpilogue(_NoLoopState):
    """Consumer side: one consumer thread's epilogue state (built once per kernel)."""

    def __init__(
        self,
        tiled_mma: cute.TiledMma,
        accumulators: cute.Tensor,
        sD: cute.Tensor,  # (EPI_M, EPI_N, EPI_STAGES) swizzled staging buffer
        gD_mem: cute.Tensor,  # (BM, BN, RestM, RestN, E) the real output, for the partial-tile stores
        tile_mn: tuple,
        out_dtype,
        consumer_tidx: Int32,
        epi_barrier: pipeline.NamedBarrier,  # consumers + the store warp
        consumer_barrier: pipeline.NamedBarrier,  # the consumers alone
        epi_tile: tuple,
        handoff=None,  # Staging.WHOLE_TILE: (barriers.WarpgroupHandoff, this warpgroup's index)
        target=None,  # what a fused epilogue sends to (a subclass's); None here
    ):
        self.accumulators = accumulators
        self.whole_tile = handoff is not None
        if self.whole_tile:
            self.free_barrier = handoff[0].free(handoff[1])
            self.staged_barrier = handoff[0].staged(handoff[1])
        self.gD_mem = gD_mem
        self.tile_mn = tile_mn
        self.out_dtype = out_dtype
        self.epi_barrier = epi_barrier
        self.consumer_barrier = consumer_barrier
        self.epi_tile = epi_tile
        self.thr_mma = tiled_mma.get_slice(consumer_tidx)
        # register -> smem copy through stmatrix, tiled like the accumulators
        copy_atom_r2s = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, out_dtype, cutlass.Float32)
        copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), out_dtype)
        tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
        self.tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
        thr_copy_r2s = self.tiled_copy_r2s.get_slice(consumer_tidx)
        self.tRS_sD = thr_copy_r2s.partition_D(sD)
        self.tRS_rAcc = self.tiled_copy_r2s.retile(accumulators)
        self.rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))[:3]
        # Partial tiles go back out of the staging buffer in 16-byte row pieces
        # (4 threads per 32-column row), each stored only if its row is valid.
        num_threads = consumer_barrier.num_threads
        copy_atom_s2g = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=128
        )
        self.tiled_copy_s2g = cute.make_tiled_copy_tv(
            copy_atom_s2g,
            cute.make_layout((num_threads // 4, 4), stride=(4, 1)),
            cute.make_layout((1, 8)),
        )
        thr_copy_s2g = self.tiled_copy_s2g.get_slice(consumer_tidx)
        self.tSG_sD = thr_copy_s2g.partition_S(sD[(None, None, 0)])
        self.tSG_cD = thr_copy_s2g.partition_D(cute.make_identity_tensor(epi_tile))
        self.thr_copy_s2g = thr_copy_s2g

    @cute.jit
    def store(
        self,
        expert: Int32,
        m_block: Int32,
        n_block: Int32,
        valid_rows: Int32,
        n_total: Int32,
        sig_pipeline,  # PipelineAsync of the partial-tile handoff, or None without signals
        sig_state,  # its producer state (None without signals)
        half=None,  # Tail.SPLIT builds: WorkTile.half
        tile_count=None,  # the fused SwiGLU: tiles this thread stored before
    ):
        """Store one tile; returns the advanced signal-pipeline state."""
        full, row_lo, row_hi = tile_rows(valid_rows, half, self.tile_mn[0])
        if cutlass.const_expr(self.whole_tile):
            self.free_barrier.arrive_and_wait()  # the last tile's stores have read our rows
        if full:
            self._stage_full(epi_tile_count(self.tile_mn))
        else:
            if cutlass.const_expr(self.whole_tile):
                self.staged_barrier.arrive()  # nothing for the store warp to store
            self._store_partial(expert, m_block, n_block, row_hi, n_total, row_lo)
            if cutlass.const_expr(sig_pipeline is not None):
                # hand this thread's stores to the store warp, which publishes
                # them; no wait unless it is SIGNAL_STAGES tiles behind
                next_state = sig_state.clone()
                sig_pipeline.producer_acquire(next_state)
                sig_pipeline.producer_commit(next_state)
                next_state.advance()
                sig_state = next_state
        return sig_state

    @cute.jit
    def _stage(self, epi_idx: cutlass.Constexpr, buf: cutlass.Constexpr):
        """Convert sub-tile ``epi_idx`` of the accumulators and stmatrix it into
        staging buffer ``buf``."""
        tRS_rD = cute.make_rmem_tensor(self.rD_shape, cutlass.Float32)
        tRS_rD_out = cute.make_rmem_tensor(self.rD_shape, self.out_dtype)
        size_rD = cute.size(tRS_rD)
        for v in cutlass.range_constexpr(size_rD):
            tRS_rD[v] = self.tRS_rAcc[epi_idx * size_rD + v]
        tRS_rD_out.store(tRS_rD.load().to(self.out_dtype))
        cute.copy(self.tiled_copy_r2s, tRS_rD_out, self.tRS_sD[(None, None, None, buf)])

    @cute.jit
    def _stage_full(self, epi_tiles: cutlass.Constexpr):
        if cutlass.const_expr(self.whole_tile):
            for epi_idx in cutlass.range_constexpr(epi_tiles):
                self._stage(epi_idx, epi_idx)
            # stmatrix writes are generic-proxy; the bulk store reads through
            # the async proxy
            cute.arch.fence_proxy("async.shared", space="cta")
            # our rows of every sub-tile staged; on into the next tile
            self.staged_barrier.arrive()
        else:
            num_bufs = cute.size(self.tRS_sD, mode=[3])
            for epi_idx in cutlass.range_constexpr(epi_tiles):
                self._stage(epi_idx, epi_idx % num_bufs)
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epi_barrier.arrive_and_wait()  # sub-tile staged
                self.epi_barrier.arrive_and_wait()  # the other buffer is free again

    @cute.jit
    def _store_partial(
        self, expert: Int32, m_block: Int32, n_block: Int32, valid_rows: Int32, n_total: Int32,
        row_lo=None,
    ):
        """Rows < valid_rows only (and >= row_lo, a half unit's first row): each
        sub-tile is staged in buffer 0 (free: with two buffers the store warp's
        last bulk store of a full tile reads buffer 1, and it waited for buffer
        0's; with the whole tile staged, the barrier at the start of every tile
        says all of them have read), then read back in 16-byte row pieces that
        are stored if their row is valid and their columns lie inside N
        (N % 8 == 0)."""
        gD_tile = self.gD_mem[(None, None, m_block, n_block, expert)]
        n_rem = n_total - n_block * self.tile_mn[1]
        for epi_idx in cutlass.range_constexpr(epi_tile_count(self.tile_mn)):
            self._stage(epi_idx, 0)
            self.consumer_barrier.arrive_and_wait()  # sub-tile staged
            tSG_gD = self.thr_copy_s2g.partition_D(cute.local_tile(gD_tile, self.epi_tile, (0, epi_idx)))
            for m in cutlass.range_constexpr(cute.size(tSG_gD, mode=[1])):
                for n in cutlass.range_constexpr(cute.size(tSG_gD, mode=[2])):
                    row, col = self.tSG_cD[(0, m, n)]
                    keep = (row < valid_rows) & (epi_idx * self.epi_tile[1] + col < n_rem)
                    if cutlass.const_expr(row_lo is not None):
                        keep = keep & (row >= row_lo)
                    if keep:
                        cute.copy(
                            self.tiled_copy_s2g, self.tSG_sD[(None, m, n)], tSG_gD[(None, m, n)]
                        )
            self.consumer_barrier.arrive_and_wait()  # buffer 0 read: free again


def tile_rows(valid_rows: Int32, half, tile_m: int):
    """(full, row_lo, row_hi): whether the tile leaves by bulk store, and the
    rows [row_lo, row_hi) it holds. ``half`` (``WorkTile.half``, split builds
    only): a half unit holds the 64 rows of its warpgroup and stores them
    like a partial tile, since the other half's CTA stores the rest; row_lo
    is None in builds without halves."""
    if cutlass.const_expr(half is None):
        return valid_rows == tile_m, None, valid_rows
    row_lo = cutlass.max(half, Int32(0)) * 64
    row_hi = cutlass.select_(half < 0, valid_rows, cutlass.min(valid_rows, row_lo + 64))
    return (half < 0) & (valid_rows == tile_m), row_lo, row_hi


def epi_tile_count(tile_mn) -> int:
    # sub-tiles of (tile_m, 32); an even count keeps the 2-buffer rotation
    # continuous from one tile to the next (every tile starts on buffer 0)
    return tile_mn[1] // 32
