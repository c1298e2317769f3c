"""The consumer warpgroups (warpgroups 1..W): each owns 64 rows of the tile,
issues wgmma from the ring (``mainloop``) and runs the epilogue on its
accumulators (``epilogue``).

With ``Tail.SPLIT`` a half unit is computed and stored by the warpgroup that
owns its 64 rows; the other one only waits for and releases every slot
(``mainloop.skip_tile``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from ..config import Promotion, Tail
from .. import trace as tr
from .epilogue import SIGNAL_STAGES
from .epilogues import tile_epilogue
from .mainloop import KTileMma, consume_tile, consume_tile_blockscaled, skip_tile
from .walk import KernelShape, start_walk, to_next_unit


class ConsumerSmem(NamedTuple):
    """The shared-memory tensors the consumers read or stage into."""

    sA: cute.Tensor
    sB: cute.Tensor
    sD: cute.Tensor
    sSFA: object  # block-scaled fp8 only (else None)
    sSFB: object


class Consumer:
    """Trace-time helper of the consumer warpgroups (see the module docstring)."""

    def __init__(self, shape: KernelShape, make_tiled_mma):
        self.shape = shape
        self.config = shape.config
        self.tile_mnk = shape.tile_mnk
        self.make_tiled_mma = make_tiled_mma  # (n columns) -> the warpgroups' wgmma

    @cute.jit
    def run(
        self, tidx, warp_group_idx, tiled_mma, smem: ConsumerSmem, gD_mem, out_dtype, epi_barriers,
        walk_args, feed, balance, ab_pipeline, sig_pipeline, k_tile_cnt, n_total, mTrace, trace_base,
        epilogue=None, target=None,
    ):
        """Every tile's mainloop and epilogue on this warpgroup.
        ``epi_barriers``: (epilogue barrier, consumer barrier, handoff or None);
        ``epilogue``: the build's ``Epilogue``, whose device class
        (``epilogues.tile_epilogue``) stores the tiles; ``target``: where a
        fused one sends them (its ``CombineTarget`` or ``ActTarget``)."""
        tile_mn = (self.tile_mnk[0], self.tile_mnk[1])
        consumer_tidx = tidx - 128
        thr_mma = tiled_mma.get_slice(consumer_tidx)
        # The A and B fragments are shared-memory descriptors, the same for
        # every thread of a warpgroup: sliced by the warp-uniform warpgroup
        # index they stay in uniform registers (docs/design.md, Mainloop).
        wg_mma = tiled_mma.get_slice((warp_group_idx - 1) * 128)
        tCsA = wg_mma.partition_A(smem.sA)
        tCsB = wg_mma.partition_B(smem.sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        acc_shape = thr_mma.partition_shape_C(cute.slice_(self.tile_mnk, (None, None, 0)))
        accumulators = cute.make_rmem_tensor(acc_shape, self.shape.acc_dtype)
        products, rows = None, None
        # the k-loop's wgmma and fragments: the tile's, or one part's width
        # with Promotion.TWO_PARTS
        mma_k, tCrA_k, tCrB_k = tiled_mma, tCrA, tCrB
        if cutlass.const_expr(self.shape.blockwise):
            if cutlass.const_expr(self.config.promotion is Promotion.TWO_PARTS):
                (mma_k, tCrA_k, tCrB_k), products = self.part_width_mma(smem.sA, smem.sB, warp_group_idx)
            else:
                products = tuple(
                    cute.make_rmem_tensor(acc_shape, self.shape.acc_dtype)
                    for _ in range(2 if self.config.promotion is Promotion.OVERLAPPED else 1)
                )
            # the two tile rows this thread's accumulators cover (value mode 1)
            tCcC = thr_mma.partition_C(cute.make_identity_tensor(tile_mn))
            rows = (tCcC[0][0], tCcC[2][0])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        epi_barrier, consumer_barrier, handoff = epi_barriers
        epi = tile_epilogue(epilogue)(
            tiled_mma, accumulators, smem.sD, gD_mem, tile_mn, out_dtype, consumer_tidx,
            epi_barrier, consumer_barrier, self.config.epi_tile,
            None if handoff is None else (handoff, warp_group_idx - 1), target,
        )
        sched, used = start_walk(self.config, walk_args, feed, None, balance)
        work = sched.work()
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.shape.stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.shape.stages)
        tile_count = Int32(0)  # (read by trace builds and the fused SwiGLU)
        sig_state = None
        if cutlass.const_expr(sig_pipeline is not None):
            sig_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SIGNAL_STAGES)
        mma = KTileMma(ab_pipeline, mma_k, tCrA_k, tCrB_k, smem.sSFA, rows, smem.sSFB)
        while work.is_valid:
            if cutlass.const_expr(self.config.tail is Tail.SPLIT):
                # a half unit: only the warpgroup that owns its 64 rows computes
                if (work.half < 0) | (work.half == warp_group_idx - 1):
                    read_state, release_state = self.consume(
                        mma, accumulators, products, k_tile_cnt, read_state, release_state, work
                    )
                else:
                    read_state, release_state = skip_tile(ab_pipeline, read_state, release_state, k_tile_cnt)
            else:
                read_state, release_state = self.consume(
                    mma, accumulators, products, k_tile_cnt, read_state, release_state, work
                )
            if cutlass.const_expr(mTrace is not None):
                if consumer_tidx == 0 and tile_count < tr.MAX_TILES:
                    mTrace[trace_base + tr.TILE0 + 2 * tile_count] = cute.arch.globaltimer_lo()
            sig_state = epi.store(
                work.expert, work.m_block, work.n_block, work.valid_rows, n_total,
                sig_pipeline, sig_state, work.half, tile_count,
            )
            if cutlass.const_expr(mTrace is not None):
                if consumer_tidx == 0 and tile_count < tr.MAX_TILES:
                    mTrace[trace_base + tr.TILE0 + 2 * tile_count + 1] = cute.arch.globaltimer_lo()
            tile_count += 1
            used = to_next_unit(self.config, sched, feed, used)
            work = sched.work()
        if cutlass.const_expr(mTrace is not None):
            if consumer_tidx == 0:
                mTrace[trace_base + tr.CONSUMER_END] = cute.arch.globaltimer_lo()
                mTrace[trace_base + tr.TILES] = tile_count

    def consume(self, mma: KTileMma, accumulators, products, k_tile_cnt, read_state, release_state, work):
        """One tile's mainloop on this warpgroup; returns (read_state,
        release_state) (the block-scaled loop keeps no separate release state)."""
        if cutlass.const_expr(self.shape.blockwise):
            read_state = consume_tile_blockscaled(
                mma, read_state, accumulators, products, k_tile_cnt, work.n_block, self.tile_mnk[1],
                self.config.promotion, self.shape.weight_scale_rows,
            )
        else:
            read_state, release_state = consume_tile(
                mma.ab_pipeline, read_state, release_state, mma.tiled_mma, accumulators,
                mma.tCrA, mma.tCrB, k_tile_cnt,
            )
        return read_state, release_state

    def part_width_mma(self, sA, sB, warp_group_idx):
        """``Promotion.TWO_PARTS``: (((wgmma of one part's width that starts
        from zero, the same accumulating), A fragments, B fragments of each
        part of sB), the parts' product accumulators, which hold the values
        of one full-width product set in the same order). Each MMA's field
        is set once, here: set inside the k-loop it would be rebound there,
        and no code after that loop could use it."""
        parts = self.config.promote_parts
        part_n = self.tile_mnk[1] // parts
        tiled_mma_zero = self.make_tiled_mma(part_n)
        tiled_mma_zero.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        tiled_mma_p = self.make_tiled_mma(part_n)
        tiled_mma_p.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        wg_mma = tiled_mma_p.get_slice((warp_group_idx - 1) * 128)
        tCrA = tiled_mma_p.make_fragment_A(wg_mma.partition_A(sA))
        tCrB = tuple(
            tiled_mma_p.make_fragment_B(wg_mma.partition_B(
                cute.local_tile(sB, (part_n, self.tile_mnk[2], self.shape.stages), (p, 0, 0))
            ))
            for p in range(parts)
        )
        shape = tiled_mma_p.get_slice(0).partition_shape_C((self.tile_mnk[0], part_n))
        products = tuple(cute.make_rmem_tensor(shape, self.shape.acc_dtype) for _ in range(parts))
        return ((tiled_mma_zero, tiled_mma_p), tCrA, tCrB), products
