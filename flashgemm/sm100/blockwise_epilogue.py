"""The epilogue warps of the sm_100 blockwise kernel: promotion of each
k-block's partial product with its scales, and the output tile.

Promotion (per tile row r held by one thread, per k-block kb of 128):
``sum += acc_kb * sfa[e, r, kb] * sfb[e, n_block, kb]`` in fp32 registers,
``acc_kb`` read from its TMEM stage with ``tcgen05.ld``.

After the tile's last k-block, behind the one-slot hand-off to the store
warp (``blockwise_store``; the slot is free once the previous tile's bulk
stores have read shared memory):

* full tile (128 valid rows): bf16 into the staged shared-memory tile,
  which the store warp sends out with TMA stores (rows past max_m and
  columns past N are clipped by the TMA unit);
* an expert's last, partial tile: each thread whose row is below m_e stores
  its row from registers, 16 bytes at a time and only columns below N, so
  rows >= m_e are never written;

then every thread arrives on the hand-off, which also orders its stores
before the store warp's signal.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import tcgen05
from cutlass.tensor_utils.layout import LayoutEnum

from .blockwise_roles import k_block_count, make_walker, tcgen05_fence


@cute.jit
def _promote(tTR_rAcc: cute.Tensor, tTR_rSum: cute.Tensor, scale):
    """sum += acc * scale, two lanes per packed fp32 FMA (one rounding, and
    no temporaries beside the running sum)."""
    for i in cutlass.range_constexpr(0, cute.size(tTR_rAcc), 2):
        tTR_rSum[i], tTR_rSum[i + 1] = cute.arch.fma_packed_f32x2(
            (tTR_rAcc[i], tTR_rAcc[i + 1]), (scale, scale), (tTR_rSum[i], tTR_rSum[i + 1])
        )


class PromoteEpilogue:
    """Epilogue-warp side (warps 0-3, thread t owns TMEM lane and tile row t)."""

    def __init__(
        self, tidx, tCtAcc, sC, sSFA, mC_mnl, mSFB, epi_tile, out_dtype, acc_dtype,
    ):
        tile_m, tile_n = 128, 128
        self.tidx = tidx
        self.sSFA = sSFA
        self.mSFB = mSFB
        self.mC_mnl = mC_mnl
        self.out_dtype = out_dtype
        self.acc_dtype = acc_dtype
        self.tile_mn = (tile_m, tile_n)

        # (128, 128, ACC_STAGES) -> (EPI_M, EPI_N, SUB_M, SUB_N, ACC_STAGES)
        tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0, None)], epi_tile)
        t2r_atom = sm100_utils.get_tmem_load_op(
            (tile_m, tile_n, 128), LayoutEnum.ROW_MAJOR, out_dtype, acc_dtype, epi_tile, False
        )
        self.tiled_t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = self.tiled_t2r.get_slice(tidx)
        # (T2R, T2R_M, T2R_N, SUB_M, SUB_N, ACC_STAGES)
        self.tTR_tAcc = thr_t2r.partition_S(tAcc_epi)
        # tile coordinates of this thread's values: (T2R, T2R_M, T2R_N, SUB_M, SUB_N)
        cC = cute.make_identity_tensor((tile_m, tile_n))
        self.tTR_cC = thr_t2r.partition_D(cute.flat_divide(cC, epi_tile))
        self.sub_mn = (cute.size(self.tTR_cC, mode=[3]), cute.size(self.tTR_cC, mode=[4]))
        # direct stores of a partial tile: (T2R, T2R_M, T2R_N, SUB_M, SUB_N, RestM, RestN, E)
        gC = cute.local_tile(mC_mnl, (tile_m, tile_n), (None, None, None))
        self.tTR_gC = thr_t2r.partition_D(cute.flat_divide(gC, epi_tile))

        # registers -> staged tile
        r2s_atom = sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, out_dtype, acc_dtype, self.tiled_t2r)
        self.tiled_r2s = cute.make_tiled_copy_D(r2s_atom, self.tiled_t2r)
        # (R2S, R2S_M, R2S_N, SUB_M * SUB_N)
        self.tRS_sC = self.tiled_r2s.get_slice(tidx).partition_D(sC)

    @cute.jit
    def run(self, walk, mA_mkl: cute.Tensor, acc_pipe, sfa_pipe, sfa_stages: cutlass.Constexpr, handoff):
        k_blocks = k_block_count(mA_mkl, 128)
        n_total = cute.size(self.mC_mnl, mode=[1])
        lane = cute.arch.lane_idx()
        row = self.tTR_cC[0][0]  # every value of a thread lies in its TMEM lane's row

        tTR_rAcc = cute.make_rmem_tensor(self.tTR_cC[(None, None, None, 0, 0)].shape, self.acc_dtype)
        tTR_rSum = cute.make_rmem_tensor(self.tTR_cC.shape, self.acc_dtype)
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.out_dtype)

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, acc_pipe.num_stages)
        sfa_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, sfa_stages)
        h_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        sched = make_walker(walk)
        work = sched.work()
        while work.is_valid:
            tTR_rSum.fill(0.0)
            b_scales = cutlass.Float32(0.0)
            for kb in cutlass.range(k_blocks, unroll=1):
                # lane l holds the weight scale of k-block (kb & ~31) + l: one
                # load per 32 k-blocks, issued before the waits below
                if kb % 32 == 0:
                    kb_lane = cutlass.min(kb + lane, k_blocks - 1)
                    b_scales = cutlass.Float32(self.mSFB[(work.expert, work.n_block, kb_lane)])
                sfa_pipe.consumer_wait(sfa_state)
                a_scale = self.sSFA[(row, sfa_state.index)]
                cute.arch.sync_warp()  # every lane has its scale before lane 0 frees the slot
                sfa_pipe.consumer_release(sfa_state)
                sfa_state.advance()
                scale = a_scale * cute.arch.shuffle_sync(b_scales, kb % 32)

                acc_pipe.consumer_wait(acc_state)
                tcgen05_fence(after_sync=True)  # the stage's MMAs precede these reads
                for sm in cutlass.range_constexpr(self.sub_mn[0]):
                    for sn in cutlass.range_constexpr(self.sub_mn[1]):
                        tTR_tAcc = self.tTR_tAcc[(None, None, None, sm, sn, acc_state.index)]
                        cute.copy(self.tiled_t2r, tTR_tAcc, tTR_rAcc)
                        _promote(tTR_rAcc, tTR_rSum[(None, None, None, sm, sn)], scale)
                # the stage's TMEM reads are complete before the MMA warp may overwrite it
                cute.arch.fence_view_async_tmem_load()
                tcgen05_fence(after_sync=False)
                acc_pipe.consumer_release(acc_state)
                acc_state.advance()

            # the store warp is done with the previous tile's staging
            handoff.producer_acquire(h_state)
            if work.valid_rows == self.tile_mn[0]:
                self._stage_full(tTR_rSum, tTR_rC)
            else:
                self._store_partial(work, tTR_rSum, tTR_rC, row, n_total)
            handoff.producer_commit(h_state)
            h_state.advance()
            sched.advance()
            work = sched.work()

    @cute.jit
    def _stage_full(self, tTR_rSum: cute.Tensor, tTR_rC: cute.Tensor):
        tRS_rC = self.tiled_r2s.retile(tTR_rC)
        for sm in cutlass.range_constexpr(self.sub_mn[0]):
            for sn in cutlass.range_constexpr(self.sub_mn[1]):
                tTR_rC.store(tTR_rSum[(None, None, None, sm, sn)].load().to(self.out_dtype))
                cute.copy(self.tiled_r2s, tRS_rC, self.tRS_sC[(None, None, None, sm * self.sub_mn[1] + sn)])
        # generic-proxy writes of the staged tile visible to the TMA unit
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def _store_partial(self, work, tTR_rSum: cute.Tensor, tTR_rC: cute.Tensor, row, n_total):
        if row < work.valid_rows:
            n_base = work.n_block * self.tile_mn[1]
            for sm in cutlass.range_constexpr(self.sub_mn[0]):
                for sn in cutlass.range_constexpr(self.sub_mn[1]):
                    tTR_rC.store(tTR_rSum[(None, None, None, sm, sn)].load().to(self.out_dtype))
                    tTR_gC = self.tTR_gC[(None, None, None, sm, sn, work.m_block, work.n_block, work.expert)]
                    tTR_cC = self.tTR_cC[(None, None, None, sm, sn)]
                    self._store_row_piece(tTR_rC, tTR_gC, tTR_cC, n_base, n_total)

    @cute.jit
    def _store_row_piece(self, tTR_rC, tTR_gC, tTR_cC, n_base, n_total):
        """16-byte stores of this thread's row piece; N is a multiple of 16,
        so a vector of 8 columns lies wholly below or at/after N."""
        vec = 8
        rC = cute.zipped_divide(tTR_rC, (vec,))
        gC = cute.zipped_divide(tTR_gC, (vec,))
        cC = cute.zipped_divide(tTR_cC, (vec,))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        for v in cutlass.range_constexpr(cute.size(rC, mode=[1])):
            if n_base + cC[(0, v)][1] < n_total:
                cute.copy(atom, rC[(None, v)], gC[(None, v)])
