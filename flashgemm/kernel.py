"""Kernel assembly: the masked grouped GEMM for sm_90a.

out[e, :m_e] = a[e, :m_e] @ b[e].T for every expert e, m_e = clamp(masked_m[e], 0, max_m).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.tensor_utils.layout import LayoutEnum

from .config import FP8_SLOT_WEIGHT_SCALES, GemmConfig
from .dynamic_scheduler import FEED_STAGES, TileFeed, producer_next_unit, reader_warps
from .epilogue import SIGNAL_STAGES, TileEpilogue, TileStorer, WarpgroupHandoff
from .mainloop import consume_tile, consume_tile_blockscaled, produce_tile, skip_tile
from .scheduler import MaskedTileScheduler, NMajorTileScheduler, active_clusters
from . import trace as tr

# Register split (setmaxnreg): the producer warpgroup only walks the scheduler
# and issues TMA; the consumers hold up to 128 fp32 accumulators per thread.
PRODUCER_REGS = 40


def consumer_regs(num_consumer_wg: int) -> int:
    """Registers per consumer thread: the SM's 64K registers split over the
    warpgroups, less the producer's share, in setmaxnreg's multiples of 8,
    at most 232 (2 consumers: 232; 3 consumers: 152)."""
    warpgroups = num_consumer_wg + 1
    avg = 65536 // (128 * warpgroups)
    per_consumer = (avg * warpgroups - PRODUCER_REGS) // num_consumer_wg
    return min(232, per_consumer // 8 * 8)


# L2 cache-policy descriptors for TMA loads (the createpolicy encodings that
# CUTLASS's CacheHintSm90 uses).
L2_EVICT_FIRST = 0x12F0000000000000
L2_EVICT_LAST = 0x14F0000000000000


def _batch_last(t: cute.Tensor) -> cute.Tensor:
    """View a torch-ordered (E, X, Y) tensor as CuTe's (X, Y, E)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 2, 0]))


class MaskedGroupedGemmSm90:
    """Persistent, warp-specialized masked grouped GEMM (NT, bf16/fp16 or
    block-scaled fp8 e4m3 in, fp32 accumulate).

    Warp roles (one CTA per SM, ``config.threads`` threads):

    * warpgroup 0, warp 0: the **producer**. Walks the masked tile scheduler and
      issues TMA loads of A (tile_m x tile_k) and B (tile_n x tile_k) into the
      ``stages``-deep shared-memory ring. With ``cluster_n=2`` the two CTAs of
      a cluster work on adjacent n-blocks of one m-block and each multicasts
      half of the A tile to both. With ``config.a_chunk_rows`` A goes in
      chunks of rows, dealt to the cluster's CTAs in turn, and a chunk past
      m_e is not loaded (the slot's barrier expects only what is).
    * warpgroup 0, warp 1: the **store warp** (``TileStorer``). Walks the same
      schedule, issues the bulk stores of the sub-tiles the consumers staged,
      and publishes completion signals, so no wgmma warp waits on a store.
      Warps 2-3 only give back registers.
    * warpgroups 1..W: the **consumers**. Each owns 64 rows of the tile,
      issues wgmma from the ring, then runs the epilogue on its accumulators
      (``TileEpilogue``): staging full tiles in shared memory for the store
      warp, or storing only the valid rows of partial ones. For block-scaled fp8 each
      k-tile is one 128-wide scale block: its products are promoted into the
      accumulators with the row's activation scale (which the producer loads
      by TMA into the same ring slot as the operands) times the weight scale
      (which it copies into the slot with a 4-byte cp.async);
      with ``config.promote_overlap`` the next k-tile's wgmma is already in
      flight (a second product accumulator) while one k-tile is promoted.

    Pipelines: ``PipelineTmaAsync`` (producer -> consumers, one full/empty
    mbarrier pair per stage) for operands; named barrier 1 (consumers + store
    warp, two crossings per staged sub-tile) for the 2-buffer output staging,
    whose reuse the store warp guards with ``cp.async.bulk.wait_group.read``;
    with ``config.epi_whole_tile`` instead, named barriers 4.. (a free/staged
    pair per consumer warpgroup with the store warp, ``WarpgroupHandoff``),
    so a warpgroup that staged its rows goes on without the other; with
    signals, ``PipelineAsync`` (consumers -> store warp, ``SIGNAL_STAGES``
    mbarrier pairs) hands over each partial tile the consumers stored themselves,
    so the store warp can publish it while they move on. With
    ``config.balance_rounds``, named barrier 3 (producer warp, store warp,
    consumers, once per launch) hands the producer's count of active clusters
    to the other roles; the producer only arrives, so its first loads never
    wait on it. With ``config.n_major`` every role counts the m-blocks itself
    (its walker needs them) and there is no barrier 3. The
    producer runs ahead into the next tile while the consumers are in the
    epilogue, so loads overlap stores.

    With ``config.split_last_round`` every role counts the units itself, and
    a unit of a last round at most half full runs as two half units on two
    clusters: in each, the consumer warpgroup that owns the half's 64 rows
    computes and stores them (as a partial tile), and the other one only
    waits for and releases every slot (``mainloop.skip_tile``).

    With ``config.dynamic`` each cluster claims its units, one at a time, from
    a global counter (``dynamic_scheduler``): the producer warp of rank 0
    claims, and a ``FEED_STAGES``-slot ring (full/empty mbarriers, ``st.async``
    into the peer) hands each claim to every other role of the cluster.

    With ``config.pdl`` the grid is launched with programmatic dependent
    launch: every thread waits in ``griddepcontrol.wait`` after the barrier
    set-up and before its first global access, and the producer warp issues
    ``griddepcontrol.launch_dependents`` once its loads are all issued. With
    ``config.l2_warmup`` as well, the producer warp first has the TMA unit
    prefetch its likely first tile's leading weight k-tiles into L2.
    """

    def __init__(self, config: GemmConfig, ab_dtype, out_dtype, signal_mode=None, trace=False):
        """signal_mode: None, "m_block" or "expert" (see ``signals.py``).
        trace: development builds only; the signals argument is then the
        timeline buffer of ``flashgemm.trace`` (no signals)."""
        if trace and signal_mode is not None:
            raise ValueError("a trace build takes no signal_mode (the buffer replaces the signals)")
        if config.split_last_round and signal_mode is not None:
            # a tile's two halves finish on two CTAs; the signal counts tiles
            raise ValueError("config.split_last_round builds take no signal_mode")
        self.config = config
        self.signal_mode = signal_mode
        self.trace = trace
        self.ab_dtype = ab_dtype
        self.out_dtype = out_dtype
        self.acc_dtype = cutlass.Float32
        self.tile_mnk = config.tile_mnk
        self.stages = config.resolved_stages(ab_dtype.width // 8, out_dtype.width // 8)
        self.epi_stages = config.epi_buffers
        self.num_consumer_wg = config.consumer_warpgroups
        self.num_consumer_threads = 128 * self.num_consumer_wg
        self.threads = config.threads
        self.cluster_n = config.cluster_n
        self.a_chunk = config.a_chunk_rows
        # 8-bit operands are the block-scaled fp8 recipe (a_scale, b_scale)
        self.block_scaled = ab_dtype.width == 8

    def _make_tiled_mma(self, n: int):
        """The warpgroups' wgmma over ``n`` columns (both operands K-major)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_consumer_wg, 1, 1),
            tiler_mn=(64, n),
        )

    def _make_layouts(self):
        self.tiled_mma = self._make_tiled_mma(self.tile_mnk[1])
        self.a_smem_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, self.tile_mnk, self.ab_dtype, self.stages
        )
        # one TMA box of A: this CTA's share of the tile, or one chunk of rows
        # (config.a_chunk_rows; the stage holds the chunks one after another)
        self.a_box_layout = cute.slice_(self.a_smem_layout, (None, None, 0))
        if self.a_chunk:
            chunk_mnk = (self.a_chunk, self.tile_mnk[1], self.tile_mnk[2])
            self.a_box_layout = cute.slice_(
                sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, chunk_mnk, self.ab_dtype, 1),
                (None, None, 0),
            )
        self.b_smem_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, self.tile_mnk, self.ab_dtype, self.stages
        )
        self.epi_tile = self.config.epi_tile
        self.d_smem_layout = sm90_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.epi_stages
        )
        # the store warp's view of the same bytes: with the whole tile staged,
        # each warpgroup's 64 rows of a sub-tile leave in a bulk store of
        # their own (epilogue.WarpgroupHandoff)
        self.d_store_layout, self.d_store_box = self.d_smem_layout, self.epi_tile
        if self.config.epi_whole_tile:
            self.d_store_box = (64, self.epi_tile[1])
            self.d_store_layout = sm90_utils.make_smem_layout_epi(
                self.out_dtype, LayoutEnum.ROW_MAJOR, self.d_store_box,
                self.epi_stages * self.num_consumer_wg,
            )

    def _sfb_smem_layout(self):
        # (scale block, stage): the one or two weight scales of each slot
        return cute.make_layout((FP8_SLOT_WEIGHT_SCALES, self.stages))

    def _sfa_smem_layout(self):
        # one fp32 activation scale per tile row and stage (M contiguous); built
        # where it is used (a layout made on the host side cannot enter the kernel)
        return cute.make_layout((self.tile_mnk[0], 1, self.stages))

    def _shared_storage(self):
        """The CTA's shared memory (plain Python: the struct differs by dtype)."""
        stages, ab, out = self.stages, self.ab_dtype, self.out_dtype
        a_size, b_size = cute.cosize(self.a_smem_layout), cute.cosize(self.b_smem_layout)
        d_size = cute.cosize(self.d_smem_layout)
        sfa_size = cute.cosize(self._sfa_smem_layout()) if self.block_scaled else 4
        sfb_size = cute.cosize(self._sfb_smem_layout()) if self.block_scaled else 4

        fields = {  # (annotations are strings in this module: build them explicitly)
            "ab_mbar": cute.struct.MemRange[cutlass.Int64, stages * 2],
            "sig_mbar": cute.struct.MemRange[cutlass.Int64, SIGNAL_STAGES * 2],
            "sA": cute.struct.Align[cute.struct.MemRange[ab, a_size], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[ab, b_size], 1024],
            "sD": cute.struct.Align[cute.struct.MemRange[out, d_size], 1024],
            "sSFA": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, sfa_size], 128],
            # block-scaled fp8: each slot's weight scales, copied in by the producer
            "sSFB": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, sfb_size], 16],
        }
        if self.config.balance_rounds and not self.config.n_major:
            fields["active"] = cute.struct.MemRange[Int32, 1]  # the producer's count
        if self.config.dynamic:
            fields["feed_mbar"] = cute.struct.MemRange[cutlass.Int64, 2 * FEED_STAGES]
            fields["feed_slots"] = cute.struct.Align[cute.struct.MemRange[Int32, FEED_STAGES], 16]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (E, max_m, K), K contiguous
        mB: cute.Tensor,  # (E, N, K), K contiguous
        mD: cute.Tensor,  # (E, max_m, N), N contiguous
        mMaskedM: cute.Tensor,  # (E,) int32
        mSignals: cute.Tensor,  # int32 counters, or the trace buffer; None without either
        mSFA: cute.Tensor,  # fp8: (E, max_m, ceil(K/128)) fp32, M contiguous; else None
        mSFB: cute.Tensor,  # fp8: (E, ceil(N/128), ceil(K/128)) fp32; else None
        mCounter: cute.Tensor,  # dynamic: (2,) int32 claim counter, zero between launches; else None
        num_ctas: Int32,
        stream,
    ):
        self._make_layouts()
        mA_mkl = _batch_last(mA)
        mB_nkl = _batch_last(mB)
        mD_mnl = _batch_last(mD)
        tma_atom_sfa, mSFA_tma, mSFB_nkl = None, None, None
        if cutlass.const_expr(self.block_scaled):
            tma_atom_sfa, mSFA_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                _batch_last(mSFA),
                cute.slice_(self._sfa_smem_layout(), (None, None, 0)),
                (self.tile_mnk[0], 1),
            )
            mSFB_nkl = mSFB

        b_smem_one = cute.slice_(self.b_smem_layout, (None, None, 0))
        d_store_one = cute.slice_(self.d_store_layout, (None, None, 0))
        tma_atom_a, mA_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.cluster_n > 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mA_mkl,
            self.a_box_layout,
            (self.a_chunk or self.tile_mnk[0], self.tile_mnk[2]),
            # chunks are dealt to the cluster's CTAs by the kernel itself
            num_multicast=1 if self.a_chunk else self.cluster_n,
        )
        tma_atom_b, mB_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mB_nkl,
            b_smem_one,
            (self.tile_mnk[1], self.tile_mnk[2]),
        )
        tma_atom_d, mD_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            mD_mnl,
            d_store_one,
            self.d_store_box,
        )

        self.shared_storage = self._shared_storage()

        self.kernel(
            tma_atom_a,
            mA_tma,
            tma_atom_b,
            mB_tma,
            tma_atom_d,
            mD_tma,
            mD_mnl,
            mMaskedM,
            mSignals,
            tma_atom_sfa,
            mSFA_tma,
            mSFB_nkl,
            mCounter,
            self.tiled_mma,
            self.a_smem_layout,
            self.b_smem_layout,
            self.d_smem_layout,
            self.d_store_layout,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_n, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.config.pdl,
        )

    def _start_walk(self, walk_args, feed, producer_claims=None, balance=None):
        """One role's copy of the tile walker, moved to its first unit
        (``MaskedTileScheduler.create``'s arguments in ``walk_args``);
        returns (walker, feed slots used). ``balance`` (with
        ``config.balance_rounds`` in the expert-major order): (shared slot,
        named barrier); the producer warp (the role with ``producer_claims``)
        counts the active clusters and publishes them, the other roles wait
        for them. The n-major walker counts the m-blocks in every role
        anyway, so each role cuts its own grid."""
        if cutlass.const_expr(self.config.n_major):
            sched = NMajorTileScheduler.create(*walk_args, self.config.n_major_window)
            if cutlass.const_expr(self.config.balance_rounds):
                sched.keep_active(active_clusters(sched.units(), sched.num_ctas))
        else:
            lane_m = None
            if cutlass.const_expr(balance is not None and producer_claims is not None):
                lane_m = MaskedTileScheduler.lane_masked_m(walk_args[0], walk_args[1])
            sched = MaskedTileScheduler.create(*walk_args, self.config.split_last_round)
            if cutlass.const_expr(balance is not None):
                slot, barrier = balance
                if cutlass.const_expr(producer_claims is not None):
                    active = sched.count_active_clusters(lane_m)
                    slot[0] = active  # (every lane stores the same value)
                    barrier.arrive()  # never waits: the first loads go out now
                    sched.keep_active(active)
                else:
                    barrier.arrive_and_wait()
                    sched.keep_active(slot[0])
        claims = Int32(0)
        if cutlass.const_expr(self.config.dynamic):
            claims = self._to_next_unit(sched, feed, claims, producer_claims)
        return sched, claims

    def _to_next_unit(self, sched, feed, claims, producer_claims=None):
        """Move ``sched`` to this role's next unit; returns the feed slots
        used so far. Static order: the cluster's next G-th unit. Dynamic: the
        next claim, made by rank 0's producer warp (``producer_claims``: is
        this the claimer, the counter) and read from the feed by every other
        role. (Plain trace-time helpers: the DSL allows no closure inside the
        staged role branches.)"""
        if cutlass.const_expr(not self.config.dynamic):
            sched.advance()
            return claims
        if producer_claims is None:
            unit = feed.receive(claims)
        else:
            unit = producer_next_unit(feed, claims, *producer_claims)
        sched.jump(unit)
        return claims + 1

    def _a_loads(self, tAgA, tAsA, work, cta_rank):
        """(needed, source k-tiles, ring slots) of each TMA box of A this CTA
        may load for ``work``, and the A bytes its slot then receives (None:
        the pipeline's own count holds them). Without ``config.a_chunk_rows``:
        its share of the tile, always loaded. With it: its chunks (rank r
        takes chunks r, r + cluster_n, ...), each loaded only if it holds a
        valid row; the rest of the slot keeps stale rows, which only feed
        output rows past m_e (never stored)."""
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
        return tuple(loads), loaded * (self.a_chunk * self.tile_mnk[2] * self.ab_dtype.width // 8)

    def _weight_scales_over_k(self, mSFB_nkl, work):
        """The weight scales over K of each 128-row block of N that ``work``'s
        tile covers: one block, or two for a tile_n of 192 that straddles a
        block boundary (the second clamped at the last block). The first is
        clamped too: a cluster's tile past N reads the last block's scales
        and stores nothing."""
        n0 = work.n_block * self.tile_mnk[1]
        last = cute.size(mSFB_nkl, mode=[0]) - 1
        blocks = (cutlass.min(n0 // 128, last),)
        if cutlass.const_expr(128 % self.tile_mnk[1] != 0):
            blocks = blocks + (cutlass.min(n0 // 128 + 1, last),)
        return tuple(mSFB_nkl[(b, None, work.expert)] for b in blocks)

    def _consume(self, mma, read_state, release_state, work):
        """One tile's mainloop on this consumer warpgroup; returns (read_state,
        release_state) (the block-scaled loop keeps no separate release state)."""
        ab_pipeline, tiled_mma, accumulators, acc_blocks, tCrA, tCrB, k_tile_cnt, sSFA, rows, sSFB = mma
        if cutlass.const_expr(self.block_scaled):
            read_state = consume_tile_blockscaled(
                ab_pipeline, read_state, tiled_mma, accumulators, acc_blocks,
                tCrA, tCrB, k_tile_cnt, sSFA, rows, sSFB, work.n_block, self.tile_mnk[1],
            )
        else:
            read_state, release_state = consume_tile(
                ab_pipeline, read_state, release_state, tiled_mma, accumulators,
                tCrA, tCrB, k_tile_cnt,
            )
        return read_state, release_state

    def _part_width_mma(self, sA, sB, warp_group_idx):
        """config.promote_parts: (((tiled MMA of one part's width that starts
        from zero, the same accumulating), A fragments, B fragments of each
        part of sB), the parts' product accumulators, which hold the same
        values, in the same order, as one full-width product accumulator
        would). Each field is set once, here: setting it inside the k-loop
        rebinds the MMA there, so no code after that loop could use it."""
        parts = self.config.promote_parts
        part_n = self.tile_mnk[1] // parts
        tiled_mma_zero = self._make_tiled_mma(part_n)
        tiled_mma_zero.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        tiled_mma_p = self._make_tiled_mma(part_n)
        tiled_mma_p.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        wg_mma = tiled_mma_p.get_slice((warp_group_idx - 1) * 128)
        tCrA = tiled_mma_p.make_fragment_A(wg_mma.partition_A(sA))
        tCrB = tuple(
            tiled_mma_p.make_fragment_B(wg_mma.partition_B(
                cute.local_tile(sB, (part_n, self.tile_mnk[2], self.stages), (p, 0, 0))
            ))
            for p in range(parts)
        )
        shape = tiled_mma_p.get_slice(0).partition_shape_C((self.tile_mnk[0], part_n))
        products = tuple(cute.make_rmem_tensor(shape, self.acc_dtype) for _ in range(parts))
        return ((tiled_mma_zero, tiled_mma_p), tCrA, tCrB), products

    @cute.jit
    def _warm_l2_weights(
        self, tma_atom_b, tBgB, cluster, cta_rank, num_n_blocks, num_experts, k_tile_cnt
    ):
        """Before ``griddepcontrol.wait``: ask the TMA unit to bring the first
        ring's worth of weight k-tiles of this CTA's likely first tile into L2.

        The weights are not written by the kernel before this one (a prefetch
        into L2 is coherent even if they were: it only moves lines into the
        cache every SM reads through), so the HBM reads can start during that
        kernel's tail instead of after it. The first unit is guessed without
        masked_m (not readable yet; the walker's ``first_tile_guess``), exact
        for the decode tiles where m_e fits one m-block. A wrong guess
        costs at most ``stages`` k-tiles of reads per CTA.
        """
        if cutlass.const_expr(self.config.n_major):
            expert, n_block, in_range = NMajorTileScheduler.first_tile_guess(
                cluster, cta_rank, num_n_blocks, num_experts, self.cluster_n, self.config.n_major_window
            )
        else:
            expert, n_block, in_range = MaskedTileScheduler.first_tile_guess(
                cluster, cta_rank, num_n_blocks, num_experts, self.cluster_n
            )
        if in_range:
            with cute.arch.elect_one():
                for k_tile in cutlass.range(cutlass.min(k_tile_cnt, self.stages), unroll=1):
                    cute.prefetch(tma_atom_b, tBgB[(None, n_block, k_tile, expert)])

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        mD_tma: cute.Tensor,
        mD_mnl: cute.Tensor,
        mMaskedM: cute.Tensor,
        mSignals: cute.Tensor,
        tma_atom_sfa,  # block-scaled only (else None)
        mSFA_tma,
        mSFB: cute.Tensor,  # (E, N/128, K/128)
        mCounter,  # dynamic only (else None)
        tiled_mma: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        d_smem_layout: cute.ComposedLayout,
        d_store_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        trace_base = bidx * tr.SLOTS
        entry_time = Int32(0)
        if cutlass.const_expr(self.trace):
            entry_time = cute.arch.globaltimer_lo()

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_d)
            if cutlass.const_expr(self.block_scaled):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_sfa)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # with config.a_chunk_rows the A bytes are counted per tile (produce_tile)
        tma_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_layout, (None, None, 0)))
        if cutlass.const_expr(self.a_chunk == 0):
            tma_bytes += cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_layout, (None, None, 0)))
        if cutlass.const_expr(self.block_scaled):
            tma_bytes += self.tile_mnk[0] * 4  # the tile's activation scales
        # Every consumer warp arrives on the empty barrier of each CTA whose
        # producer wrote into the slot: itself, plus the peer that multicast
        # half of A into it. Block-scaled fp8: the full barrier also takes the
        # arrival of the slot's weight-scale cp.async (produce_tile).
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 if self.block_scaled else 1),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.cluster_n * self.num_consumer_wg * 4
            ),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, self.cluster_n, 1)),
            defer_sync=True,
        )
        # partial tiles with signals: every consumer thread hands its stores
        # to the store warp, which publishes them (epilogue.py)
        sig_pipeline = None
        if cutlass.const_expr(self.signal_mode is not None):
            sig_pipeline = pipeline.PipelineAsync.create(
                barrier_storage=storage.sig_mbar.data_ptr(),
                num_stages=SIGNAL_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                defer_sync=True,
            )
        feed = None
        if cutlass.const_expr(self.config.dynamic):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    TileFeed.init_barriers(
                        storage.feed_mbar.data_ptr(), reader_warps(self.cluster_n, self.num_consumer_wg)
                    )
            feed = TileFeed(
                storage.feed_slots.get_tensor(cute.make_layout(FEED_STAGES)),
                storage.feed_mbar.data_ptr(), self.cluster_n,
            )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, self.cluster_n), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sD = storage.sD.get_tensor(d_smem_layout.outer, swizzle=d_smem_layout.inner)
        sD_store = storage.sD.get_tensor(d_store_layout.outer, swizzle=d_store_layout.inner)

        # (BM, BK, RestM, RestK, E) / (BN, BK, RestN, RestK, E) / (BM, BN, RestM, RestN, E)
        gA = cute.local_tile(mA_mkl, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB_nkl, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        gD_tma = cute.local_tile(mD_tma, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))
        gD_mem = cute.local_tile(mD_mnl, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))

        if cutlass.const_expr(self.a_chunk > 0):
            # (TMA, chunks, 1, stages) / (TMA, RestM in chunks, RestK, E):
            # which chunks a CTA loads is decided per tile (_a_loads)
            gA_chunks = cute.local_tile(mA_mkl, (self.a_chunk, self.tile_mnk[2]), (None, None, None))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_a,
                0,
                cute.make_layout(1),
                cute.group_modes(cute.flat_divide(sA, (self.a_chunk, self.tile_mnk[2])), 0, 2),
                cute.group_modes(gA_chunks, 0, 2),
            )
        else:
            # each CTA of the cluster loads its 1/cluster_n share of the A tile
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_a,
                cta_rank,
                cute.make_layout(self.cluster_n),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
        a_mcast_mask = cutlass.Int16((1 << self.cluster_n) - 1) if self.cluster_n > 1 else None
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        sSFA, tSFAsSFA, tSFAgSFA, mSFB_nkl, sSFB = None, None, None, None, None
        if cutlass.const_expr(self.block_scaled):
            mSFB_nkl = _batch_last(mSFB)
            sSFA = storage.sSFA.get_tensor(self._sfa_smem_layout())
            sSFB = storage.sSFB.get_tensor(self._sfb_smem_layout())
            # (BM, 1, RestM, K/128, E): every CTA loads its own tile's scales
            gSFA = cute.local_tile(mSFA_tma, (self.tile_mnk[0], 1), (None, None, None))
            tSFAsSFA, tSFAgSFA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_sfa, 0, cute.make_layout(1),
                cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2),
            )

        num_experts = cute.size(mA_mkl, mode=[2])
        max_m = cute.size(mA_mkl, mode=[0])
        n_total = cute.size(mB_nkl, mode=[0])
        num_n_blocks = (n_total + self.tile_mnk[1] - 1) // self.tile_mnk[1]
        k_tile_cnt = cute.size(gA, mode=[3])

        # barrier init visible to every thread of the cluster before anyone
        # waits on them or multicasts into a peer
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, self.cluster_n))
        if cutlass.const_expr(self.config.pdl and self.config.l2_warmup):
            if warp_idx == 0:
                self._warm_l2_weights(
                    tma_atom_b, tBgB, bidx // self.cluster_n, cta_rank, num_n_blocks, num_experts, k_tile_cnt
                )
        if cutlass.const_expr(self.config.pdl):
            # Launched with programmatic dependent launch, this CTA may be
            # running before the previous kernel on the stream has finished:
            # everything above touched only shared memory and the kernel
            # parameters. Every thread waits here until that kernel has
            # completed and its writes are visible, before any global access
            # (masked_m, operands, out, signals).
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                mSignals[trace_base + tr.ENTRY] = entry_time

        # named barrier 1: the consumers and the store warp, around each
        # staged sub-tile of a full tile
        epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_consumer_threads + 32)
        # named barrier 2: the consumers alone, around the staging of partial tiles
        consumer_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=self.num_consumer_threads)
        # named barriers 4..: each consumer warpgroup and the store warp, with
        # the whole tile staged
        handoff = WarpgroupHandoff(self.num_consumer_wg) if self.config.epi_whole_tile else None
        tile_mn = (self.tile_mnk[0], self.tile_mnk[1])
        num_m_slots = (max_m + self.tile_mnk[0] - 1) // self.tile_mnk[0]
        num_clusters = gdim // self.cluster_n
        # static order: cluster c starts on unit c; dynamic: every unit is
        # claimed, and the walker starts from unit 0
        sched_block = 0 if self.config.dynamic else bidx
        # Each role (producer, store warp, consumers) walks its own copy of
        # the scheduler (``_start_walk`` / ``_to_next_unit``); all read the
        # same masked_m and, with the dynamic order, the same claims.
        walk_args = (
            mMaskedM, num_experts, max_m, num_n_blocks, self.tile_mnk[0], sched_block, gdim,
            self.cluster_n, cta_rank,
        )
        producer_claims = (cta_rank == 0, mCounter)  # the producer's claimer flag and counter
        balance = None
        if cutlass.const_expr(self.config.balance_rounds and not self.config.n_major):
            # named barrier 3: the producer warp publishes the active cluster
            # count to the store warp and the consumers
            balance = (
                storage.active.get_tensor(cute.make_layout(1)),
                pipeline.NamedBarrier(barrier_id=3, num_threads=64 + self.num_consumer_threads),
            )

        if warp_group_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                sched, claims = self._start_walk(walk_args, feed, producer_claims, balance)
                work = sched.work()
                producer_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                policy_a = None
                policy_b = None
                if cutlass.const_expr(self.config.l2_hints):
                    policy_a = cutlass.Int64(L2_EVICT_LAST)
                    policy_b = cutlass.Int64(L2_EVICT_FIRST)
                if cutlass.const_expr(self.trace):
                    if cute.arch.lane_idx() == 0:
                        mSignals[trace_base + tr.PRODUCER_START] = cute.arch.globaltimer_lo()
                while work.is_valid:
                    a_loads, a_tx = self._a_loads(tAgA, tAsA, work, cta_rank)
                    tBgB_k = tBgB[(None, work.n_block, None, work.expert)]
                    tSFAgSFA_k, sfb_k = None, None
                    slot_tx = None if cutlass.const_expr(a_tx is None) else tma_bytes + a_tx
                    if cutlass.const_expr(self.block_scaled):
                        tSFAgSFA_k = tSFAgSFA[(None, work.m_block, None, work.expert)]
                        sfb_k = self._weight_scales_over_k(mSFB_nkl, work)
                        if cutlass.const_expr(a_tx is None):
                            slot_tx = tma_bytes
                    producer_state = produce_tile(
                        ab_pipeline, producer_state, tma_atom_a, a_loads,
                        tma_atom_b, tBgB_k, tBsB, k_tile_cnt, policy_a, policy_b, a_mcast_mask,
                        tma_atom_sfa, tSFAgSFA_k, tSFAsSFA, slot_tx, sfb_k, sSFB,
                    )
                    claims = self._to_next_unit(sched, feed, claims, producer_claims)
                    work = sched.work()
                if cutlass.const_expr(self.config.dynamic):
                    if cta_rank == 0:
                        feed.finish(claims, mCounter, num_clusters)
                if cutlass.const_expr(self.config.pdl):
                    # This CTA issued its last loads: once every CTA has, a
                    # PDL-launched kernel after this one may start its setup on
                    # the SMs this grid frees (its griddepcontrol.wait still
                    # waits for this grid to complete). Not earlier: its idle
                    # CTAs would sit on SMs left free for a concurrent combine.
                    cute.arch.griddepcontrol_launch_dependents()
                # keep the CTA alive until the consumers released every slot
                ab_pipeline.producer_tail(producer_state)
                if cutlass.const_expr(self.trace):
                    if cute.arch.lane_idx() == 0:
                        mSignals[trace_base + tr.PRODUCER_END] = cute.arch.globaltimer_lo()
            if warp_idx == 1:
                # the store warp: bulk stores and signals, off the wgmma warps
                storer = TileStorer(
                    sD_store, tma_atom_d, gD_tma, tile_mn, self.epi_tile,
                    cute.arch.lane_idx() == 0, epi_barrier, handoff,
                )
                sched, claims = self._start_walk(walk_args, feed, None, balance)
                work = sched.work()
                sig_state = None
                if cutlass.const_expr(sig_pipeline is not None):
                    sig_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Consumer, SIGNAL_STAGES
                    )
                while work.is_valid:
                    index = work.expert
                    if cutlass.const_expr(self.signal_mode == "m_block"):
                        index = work.expert * num_m_slots + work.m_block
                    # a cluster's tile past N stores and signals nothing
                    index = cutlass.select_(work.n_block < num_n_blocks, index, Int32(-1))
                    sig_state = storer.store(
                        work.expert, work.m_block, work.n_block, work.valid_rows,
                        index, mSignals, sig_pipeline, sig_state, work.half,
                    )
                    claims = self._to_next_unit(sched, feed, claims)
                    work = sched.work()
                storer.tail()
                if cutlass.const_expr(self.trace):
                    if cute.arch.lane_idx() == 0:
                        mSignals[trace_base + tr.STORER_END] = cute.arch.globaltimer_lo()
        else:
            cute.arch.setmaxregister_increase(consumer_regs(self.num_consumer_wg))
            consumer_tidx = tidx - 128
            thr_mma = tiled_mma.get_slice(consumer_tidx)
            # The A and B fragments are shared-memory descriptors, the same for
            # every thread of a warpgroup. Sliced by the thread index, A's were
            # built in ordinary registers and moved to uniform ones (8 R2UR and
            # their moves per k-tile of the fp8 128x192 loop, 189 -> 176
            # instructions); sliced by the warp-uniform warpgroup index they
            # stay uniform. With the 32-bit scale offsets (mainloop): fp8
            # dsv3-prefill-down 0.955-0.958 (uniform routing) and 0.957
            # (skewed), the other fp8 cases 0.983-1.010, bf16 dsv3-prefill-down
            # 0.940 / 0.999 in two runs, the other bf16 cases 0.983-1.034
            # (paired A/B, H100, 2026-11-24).
            wg_mma = tiled_mma.get_slice((warp_group_idx - 1) * 128)
            tCsA = wg_mma.partition_A(sA)
            tCsB = wg_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc_shape = thr_mma.partition_shape_C(cute.slice_(self.tile_mnk, (None, None, 0)))
            accumulators = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            acc_blocks, rows = None, None
            # the k-loop's wgmma and fragments: the tile's, or one part's
            # width with config.promote_parts
            mma_k, tCrA_k, tCrB_k = tiled_mma, tCrA, tCrB
            if cutlass.const_expr(self.block_scaled):
                if cutlass.const_expr(self.config.promote_parts > 1):
                    # one tuple of part products in place of the product set
                    (mma_k, tCrA_k, tCrB_k), products = self._part_width_mma(sA, sB, warp_group_idx)
                    acc_blocks = (products,)
                else:
                    acc_blocks = tuple(
                        cute.make_rmem_tensor(acc_shape, self.acc_dtype)
                        for _ in range(2 if self.config.promote_overlap else 1)
                    )
                # the two tile rows this thread's accumulators cover (value mode 1)
                tCcC = thr_mma.partition_C(cute.make_identity_tensor(tile_mn))
                rows = (tCcC[0][0], tCcC[2][0])
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            epi = TileEpilogue(
                tiled_mma, accumulators, sD, gD_mem, tile_mn, self.out_dtype, consumer_tidx,
                epi_barrier, consumer_barrier, self.epi_tile,
                None if handoff is None else (handoff, warp_group_idx - 1),
            )
            sched, claims = self._start_walk(walk_args, feed, None, balance)
            work = sched.work()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            tile_count = Int32(0)  # (read by trace builds only)
            sig_state = None
            if cutlass.const_expr(sig_pipeline is not None):
                sig_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, SIGNAL_STAGES
                )
            mma = (
                ab_pipeline, mma_k, accumulators, acc_blocks, tCrA_k, tCrB_k, k_tile_cnt, sSFA, rows, sSFB,
            )
            while work.is_valid:
                if cutlass.const_expr(self.config.split_last_round):
                    # a half unit: only the warpgroup that owns its 64 rows computes
                    if (work.half < 0) | (work.half == warp_group_idx - 1):
                        read_state, release_state = self._consume(mma, read_state, release_state, work)
                    else:
                        read_state, release_state = skip_tile(
                            ab_pipeline, read_state, release_state, k_tile_cnt
                        )
                else:
                    read_state, release_state = self._consume(mma, read_state, release_state, work)
                if cutlass.const_expr(self.trace):
                    if consumer_tidx == 0 and tile_count < tr.MAX_TILES:
                        mSignals[trace_base + tr.TILE0 + 2 * tile_count] = cute.arch.globaltimer_lo()
                sig_state = epi.store(
                    work.expert, work.m_block, work.n_block, work.valid_rows, n_total,
                    sig_pipeline, sig_state, work.half,
                )
                if cutlass.const_expr(self.trace):
                    if consumer_tidx == 0 and tile_count < tr.MAX_TILES:
                        mSignals[trace_base + tr.TILE0 + 2 * tile_count + 1] = cute.arch.globaltimer_lo()
                tile_count += 1
                claims = self._to_next_unit(sched, feed, claims)
                work = sched.work()
            if cutlass.const_expr(self.trace):
                if consumer_tidx == 0:
                    mSignals[trace_base + tr.CONSUMER_END] = cute.arch.globaltimer_lo()
                    mSignals[trace_base + tr.TILES] = tile_count
