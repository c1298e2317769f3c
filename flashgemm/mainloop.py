"""Warp-specialized mainloop: a TMA producer warp and wgmma consumer warpgroups.

The two sides meet in a ring of ``stages`` shared-memory buffers, each guarded
by a full/empty mbarrier pair (``cutlass.pipeline.PipelineTmaAsync``):

* producer (one thread of warp 0): for every k-tile of a tile, wait until the
  slot is empty, arm the full barrier with the slot's byte count, and issue the
  A and B bulk tensor copies into it (in a 2-CTA cluster each producer loads
  half of the A tile and multicasts it into both CTAs' slots);
* consumers (128 threads each): wait until the slot is full, issue the wgmma
  chain over the slot's k-blocks, and release the *previous* slot (in every
  CTA that wrote into it) once the wgmma group that read it has retired (one wgmma group stays in flight, so
  the tensor cores never wait for the release round trip).

Block-scaled fp8 (``consume_tile_blockscaled``): a stage is one 128-wide scale
block and also carries the tile's activation scales (one more TMA load into
the same slot, counted in the same transaction bytes). Each k-tile's products
are accumulated from zero, waited for, and promoted on the CUDA cores with the
row's activation scale times the block's weight scale. ``promote_overlap``
keeps a second k-tile's chain in flight during each promotion (two product
accumulators); see ``GemmConfig`` for where that pays.

Rows past ``max_m`` and columns past K are zero-filled by the TMA unit, so a
partial m/k tile needs no special case here; rows between ``m_e`` and the end
of the tile are real (unused) rows of the same expert and never reach the
output (see ``epilogue``). With ``GemmConfig.a_chunk_rows`` the producer loads
A in chunks of rows and skips those past ``m_e`` (their slot rows keep stale
data, which feeds only those unstored output rows), arming each slot's
barrier with the bytes it really receives. Loading the skipped chunks from
past ``max_m`` instead, so the byte count stays fixed, was slower than
loading every row (fp8 dsv3-ep32-gate_up 1.32x, H100, 2026-11-24): a box
the TMA unit zero-fills is not cheap. Letting a consumer warpgroup whose 64
rows all lie past ``m_e`` skip its wgmma (only waiting for and releasing each slot) was
tried and dropped: fp8 dsv3-ep32-gate_up went from 97.8-101.4 to 110.1-112.7
us, the other decode cases moved by -1.3% to +1.2% (H100, 2026-11-23). Tried
again on the n-group-major kernel, with the branch around whole wgmma
pipelines (SASS: the same QGMMA and WARPGROUP.DEPBAR counts as without it, so
nothing was serialized): paired A/B gave fp8 dsv3-ep32-gate_up 1.065 uniform,
the other fp8 and bf16 decode cases 0.943-1.017 (H100, 2026-11-24). A likely
cause, not measured: an expert's two m-blocks read the same weight tiles, and
when the nearly empty one runs faster than its partner the two stop reading
them at the same time, so the second read misses L2.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32


@cute.jit
def produce_tile(
    ab_pipeline: pipeline.PipelineTmaAsync,
    producer_state: pipeline.PipelineState,
    tma_atom_a: cute.CopyAtom,
    a_loads: tuple,  # (needed, source (TMA, k_tiles), destination (TMA, stages)) per box of A
    tma_atom_b: cute.CopyAtom,
    tBgB_k: cute.Tensor,  # (TMA, k_tiles) of this tile's n-block and expert
    tBsB: cute.Tensor,  # (TMA, stages)
    k_tile_cnt: Int32,
    policy_a,  # Int64 L2 cache policy or None
    policy_b,
    a_mcast_mask,  # Int16 mask of the CTAs receiving this CTA's share of A, or None
    tma_atom_sfa=None,  # block-scaled fp8: the A scales of each k-tile ride in the same slot
    tSFAgSFA_k=None,  # (TMA, k_tiles)
    tSFAsSFA=None,  # (TMA, stages)
    slot_tx=None,  # GemmConfig.a_chunk_rows: the bytes each CTA's slot receives for this tile
) -> pipeline.PipelineState:
    """Load every k-tile of one output tile into the ring; returns the advanced state.

    ``a_loads`` holds (needed, source, destination) for each TMA box of A
    this CTA may load: its share of the tile, or with
    ``GemmConfig.a_chunk_rows`` each of its chunks of rows, loaded only if it
    holds a valid row. The slot's byte count then changes from tile to
    tile: ``slot_tx``, the chunks both CTAs of the cluster load into it plus
    B (and the scales), replaces the pipeline's fixed count."""
    for k_tile in cutlass.range(k_tile_cnt, unroll=1):
        bar = ab_pipeline.producer_get_barrier(producer_state)
        if cutlass.const_expr(slot_tx is None):
            ab_pipeline.producer_acquire(producer_state)
        else:
            # what producer_acquire does, with this tile's count
            ab_pipeline.sync_object_empty.wait(producer_state.index, producer_state.phase)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, slot_tx)
        for needed, tAgA_k, tAsA in a_loads:  # (traced once per box)
            if needed:
                cute.copy(
                    tma_atom_a, tAgA_k[(None, k_tile)], tAsA[(None, producer_state.index)],
                    tma_bar_ptr=bar, cache_policy=policy_a, mcast_mask=a_mcast_mask,
                )
        cute.copy(
            tma_atom_b, tBgB_k[(None, k_tile)], tBsB[(None, producer_state.index)],
            tma_bar_ptr=bar, cache_policy=policy_b,
        )
        if cutlass.const_expr(tma_atom_sfa is not None):
            cute.copy(
                tma_atom_sfa, tSFAgSFA_k[(None, k_tile)], tSFAsSFA[(None, producer_state.index)],
                tma_bar_ptr=bar,
            )
        ab_pipeline.producer_commit(producer_state)
        producer_state.advance()
    return producer_state


@cute.jit
def consume_tile(
    ab_pipeline: pipeline.PipelineTmaAsync,
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    tiled_mma: cute.TiledMma,
    accumulators: cute.Tensor,
    tCrA: cute.Tensor,  # (MMA, MMA_M, MMA_K, stages) smem descriptors
    tCrB: cute.Tensor,  # (MMA, MMA_N, MMA_K, stages)
    k_tile_cnt: Int32,
):
    """Accumulate one output tile over K; returns (read_state, release_state)."""
    num_k_blocks = cute.size(tCrA, mode=[2])
    # The caller set ACCUMULATE once; zeroing 64..128 registers per tile is
    # cheaper than carrying the flag through the dynamic k-loop.
    accumulators.fill(0.0)
    cute.nvgpu.warpgroup.fence()
    for k_tile in cutlass.range(k_tile_cnt, unroll=1):
        ab_pipeline.consumer_wait(read_state)
        for k_block in cutlass.range_constexpr(num_k_blocks):
            coord = (None, None, k_block, read_state.index)
            cute.gemm(tiled_mma, accumulators, tCrA[coord], tCrB[coord], accumulators)
        cute.nvgpu.warpgroup.commit_group()
        # Keep one wgmma group in flight; the slot read by the group before it
        # is now free.
        cute.nvgpu.warpgroup.wait_group(1)
        if k_tile > 0:
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
        read_state.advance()
    cute.nvgpu.warpgroup.wait_group(0)
    if k_tile_cnt > 0:
        ab_pipeline.consumer_release(release_state)
        release_state.advance()
    return read_state, release_state


@cute.jit
def skip_tile(
    ab_pipeline: pipeline.PipelineTmaAsync,
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tile_cnt: Int32,
):
    """The idle warpgroup of a half unit (``GemmConfig.split_last_round``):
    every slot's empty barrier counts this warpgroup's warps too, so it waits
    for each k-tile and gives it straight back, without a wgmma. Returns
    (read_state, release_state), advanced as ``consume_tile`` leaves them."""
    for k_tile in cutlass.range(k_tile_cnt, unroll=1):
        ab_pipeline.consumer_wait(read_state)
        ab_pipeline.consumer_release(read_state)
        read_state.advance()
        release_state.advance()
    return read_state, release_state


@cute.jit
def consume_tile_blockscaled(
    ab_pipeline: pipeline.PipelineTmaAsync,
    read_state: pipeline.PipelineState,
    tiled_mma: cute.TiledMma,
    accumulators: cute.Tensor,  # the tile's fp32 result, ((2, 2, BN/8), 1, 1) per thread
    acc_blocks: tuple,  # one or two tensors of one k-tile's raw fp8 products, same shape
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    k_tile_cnt: Int32,
    sSFA: cute.Tensor,  # (BM, 1, stages) fp32 A scales, one per row per k-tile
    rows: tuple,  # this thread's two tile rows (accumulator value mode 1)
    mSFB_nkl: cute.Tensor,  # (ceil(N/128), ceil(K/128), E) fp32 weight scales
    expert: Int32,
    n_block: Int32,
    tile_n: cutlass.Constexpr,
):
    """Accumulate one output tile over K with 1x128 / 128x128 block scales.

    One k-tile is one 128-wide scale block. Its wgmma chain accumulates into
    a product accumulator from zero; once it retires (the slot is released
    right away) the products are promoted into ``accumulators`` on the CUDA
    cores as ``acc += products * a_scale[row] * b_scale[n-block]``. The weight
    scale is one value per (128-row block of N, k-block), the same for every
    thread: it is loaded from global memory one k-tile ahead, right after the
    current k-tile's chain is issued, so its address arithmetic and load run
    while the tensor cores do. Issued before the chain, they sat on the path
    from one k-tile's promotion to the next chain: Nsight Compute put the
    consumer warps' stalls on that integer chain and load at about 13% of
    their samples on fp8 dsv3-prefill-down, and moving them after the issue
    made the fp8 prefill cases 2.4-3.7% faster (paired A/B on H100,
    2026-11-24; the decode cases moved by -1.0% to 0.0%).

    With one product accumulator each k-tile's wgmma is waited for before its
    promotion. With two (``GemmConfig.promote_overlap``) the chain of k-tile
    t + 1 is issued before k-tile t is waited for and promoted, so this
    warpgroup's tensor work and its promotion overlap.
    """
    n0 = n_block * tile_n
    # A tile that spans a 128-column boundary (tile_n = 192) needs the next
    # block's scale for its upper columns (clamped at the last block), from
    # tile column straddle_col on.
    sfb_blocks = (n0 // 128,)
    straddle_col = None
    if cutlass.const_expr(128 % tile_n != 0):
        sfb_blocks = (n0 // 128, cutlass.min(n0 // 128 + 1, cute.size(mSFB_nkl, mode=[0]) - 1))
        straddle_col = (n0 // 128 + 1) * 128 - n0
    accumulators.fill(0.0)
    last_k = k_tile_cnt - 1
    # each block's scales over K, at element offset k_off = k-tile * k_step.
    # 32-bit: a 64-bit offset took a multiply-add chain of about 12
    # instructions per k-tile, a 32-bit one a uniform multiply and a wide
    # add per block (k_off is under ceil(K / 128) times the scales' K stride)
    sfb_k = tuple(mSFB_nkl[(block, None, expert)] for block in sfb_blocks)
    k_step = Int32(sfb_k[0].layout.stride[0])
    k_off = Int32(0)
    sfb = _weight_scales(sfb_k, k_off)
    mma = (ab_pipeline, tiled_mma, tCrA, tCrB, sSFA, rows)
    promotion = (ab_pipeline, accumulators, straddle_col)

    if cutlass.const_expr(len(acc_blocks) == 1):
        for k_tile in cutlass.range(k_tile_cnt, unroll=1):
            scale = _issue_k_tile(mma, read_state, acc_blocks[0], sfb)
            # the next k-tile's weight scales load while this one's chain runs
            # (by index: the running offset of the loop below made ptxas
            # schedule the scales' multiplies and the release's thread-index
            # read ahead of this chain's last wgmma, and the 128x192 tile
            # 10-12% slower; H100, 2026-11-24)
            sfb = _weight_scales(sfb_k, cutlass.min(k_tile + 1, last_k) * k_step)
            _retire_k_tile(promotion, read_state, acc_blocks[0], scale, 0)
            read_state.advance()
    else:
        acc_a, acc_b = acc_blocks
        release_state = read_state.clone()
        # k-tile 0 goes into acc_a; each pass of the loop issues the two
        # k-tiles after the one in flight (into acc_b, then acc_a) and
        # retires the one before each, so one chain is in flight while
        # another is promoted.
        # The scales' offset runs with the k-tiles here: against indexing
        # each k-tile, fp8 dense-like 0.961/0.963, dsv3-prefill-gate_up
        # 0.984/0.976, the mid decode tiles 0.982-0.997 (paired A/B, uniform/
        # skewed, H100, 2026-11-24).
        scale_a = _issue_k_tile(mma, read_state, acc_a, sfb)
        k_off += cutlass.select_(Int32(0) < last_k, k_step, Int32(0))
        sfb = _weight_scales(sfb_k, k_off)
        read_state.advance()
        scale_b = scale_a
        for pair in cutlass.range((k_tile_cnt - 1) // 2, unroll=1):
            k_tile = 2 * pair + 1
            scale_b = _issue_k_tile(mma, read_state, acc_b, sfb)
            k_off += k_step  # k_tile + 1 <= last_k here
            sfb = _weight_scales(sfb_k, k_off)
            read_state.advance()
            _retire_k_tile(promotion, release_state, acc_a, scale_a, 1)
            release_state.advance()
            scale_a = _issue_k_tile(mma, read_state, acc_a, sfb)
            k_off += cutlass.select_(k_tile + 1 < last_k, k_step, Int32(0))
            sfb = _weight_scales(sfb_k, k_off)
            read_state.advance()
            _retire_k_tile(promotion, release_state, acc_b, scale_b, 1)
            release_state.advance()
        # acc_a holds the last k-tile (odd count) or the one before it (even)
        if k_tile_cnt % 2 == 0:
            scale_b = _issue_k_tile(mma, read_state, acc_b, sfb)
            read_state.advance()
            _retire_k_tile(promotion, release_state, acc_a, scale_a, 1)
            release_state.advance()
            _retire_k_tile(promotion, release_state, acc_b, scale_b, 0)
        else:
            _retire_k_tile(promotion, release_state, acc_a, scale_a, 0)
    return read_state


def _weight_scales(sfb_k, k_off):
    """The weight scales at element offset ``k_off`` (a k-tile times the K
    stride) for each 128-row block of N in ``sfb_k`` (one block's scales over
    K, or two for a tile that straddles a block boundary)."""
    values = tuple(
        cute.make_tensor(t.iterator + k_off, cute.make_layout(1))[0] for t in sfb_k
    )
    return (values[0], values[-1])


def _issue_k_tile(mma, state, acc, sfb):
    """Wait for the slot of ``state``, issue its wgmma chain into ``acc`` (from
    zero) and commit it. ``mma``: (pipeline, tiled_mma, tCrA, tCrB, sSFA,
    this thread's two rows); ``sfb``: the k-tile's weight scales. Returns
    scale[row half][weight-scale block] for the promotion."""
    ab_pipeline, tiled_mma, tCrA, tCrB, sSFA, rows = mma
    acc.fill(0.0)
    ab_pipeline.consumer_wait(state)
    # The slot's activation scales are read, and multiplied by the weight
    # scales, before the wgmma is issued: their shared-memory latency then
    # hides behind the wgmma instead of sitting between its retirement and
    # the promotion, when this warpgroup issues nothing to the tensor cores.
    sfa0 = sSFA[(rows[0], 0, state.index)]
    sfa1 = sSFA[(rows[1], 0, state.index)]
    scale = ((sfa0 * sfb[0], sfa0 * sfb[1]), (sfa1 * sfb[0], sfa1 * sfb[1]))
    cute.nvgpu.warpgroup.fence()
    # (plain Python loops: these helpers are traced inline, unrolled)
    for k_block in range(cute.size(tCrA, mode=[2])):
        coord = (None, None, k_block, state.index)
        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
    cute.nvgpu.warpgroup.commit_group()
    return scale


@cute.jit
def _retire_k_tile(promotion, state, acc, scale, still_in_flight: cutlass.Constexpr):
    """Wait until at most ``still_in_flight`` wgmma groups are pending (the
    oldest, ``acc``'s, has retired), give its slot ``state`` back to the
    producer, and promote: accumulators += acc * scale. ``promotion``:
    (pipeline, accumulators, straddle_col), where straddle_col is None or the
    first tile column whose weight scale is the second block's (tile_n = 192:
    64 or 128, since every 192-wide tile starts on a multiple of 64)."""
    ab_pipeline, accumulators, straddle_col = promotion
    cute.nvgpu.warpgroup.wait_group(still_in_flight)
    ab_pipeline.consumer_release(state)
    if cutlass.const_expr(straddle_col is None):
        _promote(accumulators, acc, scale, None)
    else:
        # one unrolled loop per boundary, so no element selects its scale at
        # run time (a select per value put 48 FSEL and about 46 PLOP3 beside
        # the 96 FFMA of each k-tile)
        if straddle_col == 64:
            _promote(accumulators, acc, scale, 64)
        else:
            _promote(accumulators, acc, scale, 128)


def _promote(accumulators, acc, scale, straddle_col):
    """accumulators += acc * scale, the weight scale switching to the second
    block's at tile column ``straddle_col`` (a Python int, or None)."""
    # value i of the wgmma accumulator fragment: column pair (i % 2),
    # row half (i // 2 % 2), 8-column group (i // 4)
    for i in range(cute.size(accumulators)):
        half = (i // 2) % 2
        block = 1 if straddle_col is not None and (i // 4) * 8 >= straddle_col else 0
        accumulators[i] = accumulators[i] + acc[i] * scale[half][block]
