"""The producer warp (warp 0 of warpgroup 0): walks the tile order and loads
every k-tile of every tile into the shared-memory ring (``mainloop.produce_tile``).

With ``cluster_n=2`` the two CTAs of a cluster work on adjacent n-blocks of
one m-block and each multicasts half of the A tile to both; with
``a_chunk_rows`` A goes in chunks of rows, dealt to the cluster's CTAs in
turn, and a chunk past m_e is not loaded. With the dynamic order rank 0's
producer claims the units and feeds them to every other role.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from ..config import TileOrder
from ..schedule.nmajor import NMajorTileScheduler
from ..schedule.walker import MaskedTileScheduler
from .. import trace as tr
from .mainloop import produce_tile
from .walk import KernelShape, start_walk, to_next_unit

# L2 cache-policy descriptors for TMA loads (the createpolicy encodings of
# CUTLASS's CacheHintSm90).
L2_EVICT_FIRST = 0x12F0000000000000
L2_EVICT_LAST = 0x14F0000000000000


class ProducerLoads(NamedTuple):
    """The TMA atoms and partitions the producer loads through."""

    tma_atom_a: cute.CopyAtom
    tAgA: cute.Tensor  # (TMA, RestM [in chunks], RestK, E)
    tAsA: cute.Tensor  # (TMA, stages) or (TMA, chunks, 1, stages)
    a_mcast_mask: object  # Int16 mask of the CTAs receiving this CTA's share of A, or None
    tma_atom_b: cute.CopyAtom
    tBgB: cute.Tensor  # (TMA, RestN, RestK, E)
    tBsB: cute.Tensor  # (TMA, stages)
    tma_atom_sfa: object  # block-scaled fp8 (else None): the activation scales' TMA
    tSFAgSFA: object
    tSFAsSFA: object
    mSFB_nkl: object  # (N/128, K/128, E) weight scales
    sSFB: object  # (FP8_SLOT_WEIGHT_SCALES, stages)
    b_exps: object = None  # MXFP4 weights: (TMA atom, (TMA, RestN, RestK, E), (TMA, stages)) of the E8M0 bytes


class Producer:
    """Trace-time helper of the producer warp (see the module docstring)."""

    def __init__(self, shape: KernelShape):
        self.shape = shape
        self.config = shape.config
        self.tile_mnk = shape.tile_mnk
        self.cluster_n = shape.cluster_n
        self.a_chunk = shape.a_chunk

    @cute.jit
    def run(
        self, walk_args, feed, claims, balance, ab_pipeline, loads: ProducerLoads, tma_bytes,
        k_tile_cnt, cta_rank, num_clusters, mCounter, mTrace, trace_base,
    ):
        """Every tile's loads, then the dynamic claim counter's reset and the
        PDL trigger; keeps the CTA alive until every slot was released."""
        sched, used = start_walk(self.config, walk_args, feed, claims, balance)
        work = sched.work()
        producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.shape.stages)
        policy_a = None
        policy_b = None
        if cutlass.const_expr(self.config.l2_hints):
            policy_a = cutlass.Int64(L2_EVICT_LAST)
            policy_b = cutlass.Int64(L2_EVICT_FIRST)
        if cutlass.const_expr(mTrace is not None):
            if cute.arch.lane_idx() == 0:
                mTrace[trace_base + tr.PRODUCER_START] = cute.arch.globaltimer_lo()
        while work.is_valid:
            a_loads, a_tx = self.a_loads(loads.tAgA, loads.tAsA, work, cta_rank)
            tBgB_k = loads.tBgB[(None, work.n_block, None, work.expert)]
            tSFAgSFA_k, sfb_k = None, None
            slot_tx = None if cutlass.const_expr(a_tx is None) else tma_bytes + a_tx
            exps_k = None
            if cutlass.const_expr(loads.b_exps is not None):
                exps_k = (loads.b_exps[0], loads.b_exps[1][(None, work.n_block, None, work.expert)], loads.b_exps[2])
            if cutlass.const_expr(self.shape.blockwise):
                tSFAgSFA_k = loads.tSFAgSFA[(None, work.m_block, None, work.expert)]
                if cutlass.const_expr(not self.shape.converted_b):
                    sfb_k = self.weight_scales_over_k(loads.mSFB_nkl, work)
                if cutlass.const_expr(a_tx is None):
                    slot_tx = tma_bytes
            producer_state = produce_tile(
                ab_pipeline, producer_state, loads.tma_atom_a, a_loads,
                loads.tma_atom_b, tBgB_k, loads.tBsB, k_tile_cnt, policy_a, policy_b, loads.a_mcast_mask,
                loads.tma_atom_sfa, tSFAgSFA_k, loads.tSFAsSFA, slot_tx, sfb_k, loads.sSFB, exps_k,
            )
            used = to_next_unit(self.config, sched, feed, used, claims)
            work = sched.work()
        if cutlass.const_expr(self.config.order is TileOrder.DYNAMIC):
            if cta_rank == 0:
                feed.finish(used, mCounter, num_clusters)
        if cutlass.const_expr(self.config.pdl):
            # This CTA issued its last loads: once every CTA has, a
            # PDL-launched kernel after this one may start its setup on the
            # SMs this grid frees (its griddepcontrol.wait still waits for this
            # grid to complete). Not earlier: its idle CTAs would sit on SMs
            # left free for a concurrent combine.
            cute.arch.griddepcontrol_launch_dependents()
        # keep the CTA alive until the consumers released every slot
        ab_pipeline.producer_tail(producer_state)
        if cutlass.const_expr(mTrace is not None):
            if cute.arch.lane_idx() == 0:
                mTrace[trace_base + tr.PRODUCER_END] = cute.arch.globaltimer_lo()

    def a_loads(self, tAgA, tAsA, work, cta_rank):
        """(needed, source k-tiles, ring slots) of each TMA box of A this CTA
        may load for ``work``, and the A bytes its slot then receives (None:
        the pipeline's own count holds them). Without ``a_chunk_rows``: its
        share of the tile, always loaded. With it: its chunks (rank r takes
        chunks r, r + cluster_n, ...), each loaded only if it holds a valid
        row."""
        if cutlass.const_expr(self.a_chunk == 0):
            return ((True, tAgA[(None, work.m_block, None, work.expert)], tAsA),), None
        chunks = self.tile_mnk[0] // self.a_chunk
        loads = []
        for i in range(chunks // self.cluster_n):
            j = cta_rank + self.cluster_n * i
            loads.append((
                j * self.a_chunk < work.valid_rows,
                tAgA[(None, work.m_block * chunks + j, None, work.expert)],
                tAsA[(None, j, 0, None)],
            ))
        loaded = cutlass.min((work.valid_rows + self.a_chunk - 1) // self.a_chunk, chunks)
        return tuple(loads), loaded * (self.a_chunk * self.tile_mnk[2] * self.shape.ab_dtype.width // 8)

    def weight_scales_over_k(self, mSFB_nkl, work):
        """The weight scales over K of each block of N (128 rows, or 64 for the
        fused SwiGLU) that ``work``'s tile covers: one block, or two for a
        192-wide tile that straddles a block boundary or a 128-wide one over
        64-row blocks (the second clamped at the last block). The first is
        clamped too: a cluster's tile past N reads the last block's scales
        and stores nothing."""
        n0 = work.n_block * self.tile_mnk[1]
        rows = self.shape.weight_scale_rows
        last = cute.size(mSFB_nkl, mode=[0]) - 1
        blocks = (cutlass.min(n0 // rows, last),)
        if cutlass.const_expr(rows % self.tile_mnk[1] != 0):
            blocks = blocks + (cutlass.min(n0 // rows + 1, last),)
        return tuple(mSFB_nkl[(b, None, work.expert)] for b in blocks)

    @cute.jit
    def warm_l2_weights(self, tma_atom_b, tBgB, cluster, cta_rank, num_n_blocks, num_experts, k_tile_cnt):
        """Before ``griddepcontrol.wait``: ask the TMA unit to bring the first
        ring's worth of weight k-tiles of this CTA's likely first tile into L2.

        The weights are not written by the kernel before this one (and a
        prefetch into L2 is coherent anyway), so the HBM reads can start
        during that kernel's tail. The first unit is guessed without masked_m
        (not readable yet; the walker's ``first_tile_guess``), exact for the
        decode tiles where m_e fits one m-block; a wrong guess costs at most
        ``stages`` k-tiles of reads per CTA."""
        if cutlass.const_expr(self.config.order is TileOrder.N_MAJOR):
            expert, n_block, in_range = NMajorTileScheduler.first_tile_guess(
                cluster, cta_rank, num_n_blocks, num_experts, self.cluster_n, self.config.n_major_window
            )
        else:
            expert, n_block, in_range = MaskedTileScheduler.first_tile_guess(
                cluster, cta_rank, num_n_blocks, num_experts, self.cluster_n
            )
        if in_range:
            with cute.arch.elect_one():
                for k_tile in cutlass.range(cutlass.min(k_tile_cnt, self.shape.stages), unroll=1):
                    cute.prefetch(tma_atom_b, tBgB[(None, n_block, k_tile, expert)])
