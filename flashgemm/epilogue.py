"""Epilogue: accumulators -> bf16 -> global memory, never past row m_e.

Two paths, chosen per tile (the choice is uniform across the tile's threads):

* full tile (all ``tile_m`` rows valid): registers -> ``stmatrix`` into a
  2-stage shared-memory staging buffer of ``epi_tile`` sub-tiles -> one
  thread issues the bulk tensor store. The TMA unit clips columns past N.
* partial tile (the last m-block of an expert, and every tile in decode where
  m_e < tile_m): each thread writes its own accumulator elements with
  predicated global stores, row < valid_rows and column < N. A TMA store
  cannot be used here: its box would write the rows between m_e and the end
  of the tile, which belong to the caller (``out[e, m_e:]`` stays untouched).
  These tiles are small (decode outputs are ~0.5% of the weight bytes), so
  the narrower stores do not show in the time.

Completion signals (see ``signals.py``): a finished tile's signal is not
published at once but left *pending* and published by ``publish`` after the
first k-tile of the next tile has been issued (or at exit): by then the tile's
bulk stores have had a k-tile's time to drain, so the storing thread's
``cp.async.bulk.wait_group 0`` rarely waits and the epilogue never blocks on
its own stores. Publishing is: wait for the bulk groups to *complete* (not just
to release shared memory), ``fence.proxy.async.global`` (order the async-proxy
writes before generic-proxy operations), ``fence.acq_rel.gpu`` (cumulativity
over the other threads' predicated stores, ordered by the epilogue barrier),
then ``red.release.gpu.add`` on the counter.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.tensor_utils.layout import LayoutEnum


class TileEpilogue:
    """Per-thread epilogue state of one consumer thread (built once per kernel)."""

    def __init__(
        self,
        tiled_mma: cute.TiledMma,
        accumulators: cute.Tensor,
        sD: cute.Tensor,  # (EPI_M, EPI_N, EPI_STAGES) swizzled staging buffer
        tma_atom_d: cute.CopyAtom,
        gD_tma: cute.Tensor,  # (BM, BN, RestM, RestN, E) TMA coordinate tiles
        gD_mem: cute.Tensor,  # (BM, BN, RestM, RestN, E) the real output, for SIMT stores
        tile_mn: tuple,
        epi_tile: tuple,
        out_dtype,
        consumer_tidx: Int32,
        is_store_thread,
        epi_barrier: pipeline.NamedBarrier,
        num_consumer_threads: int,
    ):
        self.tiled_mma = tiled_mma
        self.accumulators = accumulators
        self.sD = sD
        self.tma_atom_d = tma_atom_d
        self.gD_tma = gD_tma
        self.gD_mem = gD_mem
        self.tile_mn = tile_mn
        self.epi_tile = epi_tile
        self.out_dtype = out_dtype
        self.is_store_thread = is_store_thread
        self.epi_barrier = epi_barrier

        thr_mma = tiled_mma.get_slice(consumer_tidx)
        self.thr_mma = thr_mma
        # register -> smem copy through stmatrix, tiled like the accumulators
        copy_atom_r2s = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, out_dtype, cutlass.Float32)
        copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), out_dtype)
        tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
        self.tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
        thr_copy_r2s = self.tiled_copy_r2s.get_slice(consumer_tidx)
        self.tRS_sD = thr_copy_r2s.partition_D(sD)
        self.tRS_rAcc = self.tiled_copy_r2s.retile(accumulators)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
        self.rD_shape = rD_shape[:3]
        # coordinates of each accumulator element inside the tile, for predication
        self.tCcD = thr_mma.partition_C(cute.make_identity_tensor(tile_mn))
        self.store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=cute.size(sD, mode=[2]),
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
        )

    # Nothing here changes inside the tile loop: carry no values through it.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def store(
        self,
        expert: Int32,
        m_block: Int32,
        n_block: Int32,
        valid_rows: Int32,
        n_total: Int32,
        signals: cutlass.Constexpr = False,
    ):
        if valid_rows == self.tile_mn[0]:
            self._store_full_tma(expert, m_block, n_block)
        else:
            self._store_partial_simt(expert, m_block, n_block, valid_rows, n_total)
            if cutlass.const_expr(signals):
                # every thread's stores are issued before the storing thread
                # publishes the tile
                self.epi_barrier.arrive_and_wait()

    @cute.jit
    def publish(self, pending: Int32, mSignals: cute.Tensor):
        """Release-add 1 to counter ``pending`` (if >= 0) once the tile is in memory."""
        if self.is_store_thread:
            if pending >= 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                cute.arch.fence_proxy("async.global")
                cute.arch.fence_acq_rel_gpu()
                cute.arch.red(
                    mSignals.iterator + pending,
                    Int32(1),
                    op="add",
                    dtype=cutlass.Int32,
                    sem="release",
                    scope="gpu",
                )

    @cute.jit
    def _store_full_tma(self, expert: Int32, m_block: Int32, n_block: Int32):
        gD_tile = self.gD_tma[(None, None, m_block, n_block, expert)]
        gD_epi = cute.zipped_divide(gD_tile, self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            self.tma_atom_d,
            0,
            cute.make_layout(1),
            cute.group_modes(self.sD, 0, 2),
            gD_epi,
        )
        epi_rest = gD_epi.shape[1]
        epi_tile_num = cute.size(epi_rest)
        epi_rest_layout = cute.make_layout(epi_rest, stride=(epi_rest[1], 1))
        num_bufs = cute.size(self.tRS_sD, mode=[3])
        tRS_rD = cute.make_rmem_tensor(self.rD_shape, cutlass.Float32)
        tRS_rD_out = cute.make_rmem_tensor(self.rD_shape, self.out_dtype)
        size_rD = cute.size(tRS_rD)
        for epi_idx in cutlass.range_constexpr(epi_tile_num):
            for v in cutlass.range_constexpr(size_rD):
                tRS_rD[v] = self.tRS_rAcc[epi_idx * size_rD + v]
            tRS_rD_out.store(tRS_rD.load().to(self.out_dtype))
            # epi_tile_num is even (tile_n / 32) and buffers rotate mod 2, so
            # each tile starts on buffer 0 and the rotation stays continuous.
            buf = epi_idx % num_bufs
            cute.copy(self.tiled_copy_r2s, tRS_rD_out, self.tRS_sD[(None, None, None, buf)])
            # stmatrix writes are generic-proxy; the bulk store reads through
            # the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            self.epi_barrier.arrive_and_wait()
            if self.is_store_thread:
                cute.copy(
                    self.tma_atom_d,
                    bSG_sD[(None, buf)],
                    bSG_gD[(None, epi_rest_layout.get_hier_coord(epi_idx))],
                )
                self.store_pipeline.producer_commit()
                # at most num_bufs-1 stores may still be reading smem
                self.store_pipeline.producer_acquire()
            self.epi_barrier.arrive_and_wait()

    @cute.jit
    def _store_partial_simt(
        self, expert: Int32, m_block: Int32, n_block: Int32, valid_rows: Int32, n_total: Int32
    ):
        gD_tile = self.gD_mem[(None, None, m_block, n_block, expert)]
        tCgD = self.thr_mma.partition_C(gD_tile)
        n_rem = n_total - n_block * self.tile_mn[1]
        for i in cutlass.range_constexpr(cute.size(self.accumulators)):
            row, col = self.tCcD[i]
            if (row < valid_rows) & (col < n_rem):
                tCgD[i] = self.out_dtype(self.accumulators[i])

    @cute.jit
    def tail(self):
        """Wait for every outstanding bulk store before the CTA exits."""
        if self.is_store_thread:
            self.store_pipeline.producer_tail()
