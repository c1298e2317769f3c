"""Mainloop: the TMA producer warp and the wgmma consumer warpgroups.

The two sides meet in a ring of ``stages`` shared-memory slots, each guarded
by a full/empty mbarrier pair (``cutlass.pipeline.PipelineTmaAsync``):

* producer (one thread of warp 0): for every k-tile of a tile, wait until the
  slot is empty, arm the full barrier with the slot's byte count, and issue
  the A and B bulk tensor copies into it (in a 2-CTA cluster each producer
  loads half of the A tile and multicasts it into both CTAs' slots);
* consumers (128 threads each): wait until the slot is full, issue the wgmma
  chain over the slot's k-blocks, and release the *previous* slot (in every
  CTA that wrote into it) once the wgmma group that read it has retired (one
  group stays in flight, so the tensor cores never wait for the release).

Block-scaled fp8 (``consume_tile_blockscaled``): a stage is one 128-wide scale
block and also carries the tile's activation scales (one more TMA load into
the slot, counted in the same transaction bytes) and its one or two weight
scales (4-byte ``cp.async`` copies whose completion is the full barrier's
second arrival). Each k-tile's products are accumulated from zero, waited
for, and promoted on the CUDA cores with the row's activation scale times
the block's weight scale, as ``GemmConfig.promotion`` says.

Rows past ``max_m`` and columns past K are zero-filled by the TMA unit, so a
partial m/k tile needs no special case here; rows between ``m_e`` and the
end of the tile are real (unused) rows of the same expert and never reach
the output (``epilogue``). With ``GemmConfig.a_chunk_rows`` the producer
loads A in chunks of rows and skips those past ``m_e`` (their slot rows keep
stale data, which feeds only those unstored rows), arming each slot's
barrier with the bytes it really receives. The measurements behind these
choices, and the variants that lost: ``docs/design.md`` (Mainloop, fp8
promotion).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from ..config import FP8_SLOT_WEIGHT_SCALES, Promotion


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
    slot_tx=None,  # the bytes each CTA's slot receives for this tile, or None: the pipeline's count
    sfb_k=None,  # block-scaled fp8: the tile's weight scales over K, per scale block
    sSFB=None,  # (FP8_SLOT_WEIGHT_SCALES, stages) fp32
    b_exps=None,  # MXFP4 weights: (TMA atom, (TMA, k_tiles), (TMA, stages)) of the B tile's E8M0 bytes
) -> pipeline.PipelineState:
    """Load every k-tile of one output tile into the ring; returns the advanced state.

    ``a_loads`` holds (needed, source, destination) for each TMA box of A
    this CTA may load: its share of the tile, or with
    ``GemmConfig.a_chunk_rows`` each of its chunks of rows, loaded only if it
    holds a valid row. The slot's byte count then changes from tile to
    tile: ``slot_tx``, the chunks both CTAs of the cluster load into it plus
    B (and the scales), replaces the pipeline's fixed count.

    With ``sfb_k`` the k-tile's weight scales are copied into the slot's
    ``sSFB`` column as well: after its TMA loads are issued, by ``cp.async``
    (4 bytes each) whose completion arrives on the slot's full barrier
    (``cp.async.mbarrier.arrive.noinc``; the barrier counts two arrivals
    per phase for block-scaled fp8). The consumers read them from shared
    memory with the activation scales, and the producer never waits for
    the load."""
    sfb_atom, sfb_off, sfb_step = None, None, None
    if cutlass.const_expr(sfb_k is not None):
        sfb_atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Float32, num_bits_per_copy=32
        )
        # the k-tile's element offset into each block's scales (32-bit:
        # validation checks that ceil(K/128) - 1 steps of the stride fit)
        sfb_off, sfb_step = Int32(0), Int32(sfb_k[0].layout.stride[0])
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
        if cutlass.const_expr(b_exps is not None):
            cute.copy(b_exps[0], b_exps[1][(None, k_tile)], b_exps[2][(None, producer_state.index)], tma_bar_ptr=bar)
        if cutlass.const_expr(tma_atom_sfa is not None):
            cute.copy(
                tma_atom_sfa, tSFAgSFA_k[(None, k_tile)], tSFAsSFA[(None, producer_state.index)],
                tma_bar_ptr=bar,
            )
        if cutlass.const_expr(sfb_k is not None):
            # after the slot's TMA loads, so they leave first
            with cute.arch.elect_one():
                # one value per block the tile covers (a tile within one
                # block leaves the slot's second value unread)
                for i, t in enumerate(sfb_k):
                    src = cute.make_tensor(t.iterator + sfb_off, cute.make_layout(1))
                    dst_off = cute.crd2idx((i, producer_state.index), sSFB.layout)
                    dst = cute.make_tensor(sSFB.iterator + dst_off, cute.make_layout(1))
                    cute.copy(sfb_atom, src, dst)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
            sfb_off += sfb_step
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
    """The idle warpgroup of a half unit (``Tail.SPLIT``):
    every slot's empty barrier counts this warpgroup's warps too, so it waits
    for each k-tile and gives it straight back, without a wgmma. Returns
    (read_state, release_state), advanced as ``consume_tile`` leaves them."""
    for k_tile in cutlass.range(k_tile_cnt, unroll=1):
        ab_pipeline.consumer_wait(read_state)
        ab_pipeline.consumer_release(read_state)
        read_state.advance()
        release_state.advance()
    return read_state, release_state


class KTileMma(NamedTuple):
    """What issuing one fp8 k-tile needs (built once per kernel)."""

    ab_pipeline: pipeline.PipelineTmaAsync
    # cute.TiledMma; with Promotion.TWO_PARTS the pair (starts from zero, accumulates)
    tiled_mma: object
    tCrA: cute.Tensor  # (MMA, MMA_M, MMA_K, stages) smem descriptors
    tCrB: object  # (MMA, MMA_N, MMA_K, stages); with TWO_PARTS, a tuple: each part's
    sSFA: cute.Tensor  # (BM, 1, stages) fp32 activation scales, one per row per k-tile
    rows: tuple  # this thread's two tile rows (accumulator value mode 1)
    sSFB: cute.Tensor  # (FP8_SLOT_WEIGHT_SCALES, stages) fp32 weight scales


class PromotionTarget(NamedTuple):
    """Where a retired k-tile's products go."""

    ab_pipeline: pipeline.PipelineTmaAsync
    accumulators: cute.Tensor  # the tile's fp32 result, ((2, 2, BN/8), 1, 1) per thread
    straddle_col: object  # None, or the first tile column taking the second weight-scale block


@cute.jit
def consume_tile_blockscaled(
    mma: KTileMma,
    read_state: pipeline.PipelineState,
    accumulators: cute.Tensor,
    products: tuple,  # one k-tile's raw products: one or two tensors (OVERLAPPED),
    # or with TWO_PARTS one tensor per column part; same value order as one set
    k_tile_cnt: Int32,
    n_block: Int32,
    tile_n: cutlass.Constexpr,
    promotion: cutlass.Constexpr,  # config.Promotion
    weight_scale_rows: cutlass.Constexpr = 128,  # 64: the fused SwiGLU's two 64-row blocks per tile
):
    """Accumulate one output tile over K with 1x128 / 128x128 block scales.

    One k-tile is one 128-wide scale block. Its wgmma chain accumulates into
    a product accumulator from zero; once it retires (the slot is released
    right away) the products are promoted into ``accumulators`` on the CUDA
    cores as ``acc += products * a_scale[row] * b_scale[n-block]``. Both
    scales ride in the slot (``produce_tile``) and are read before the chain
    is issued, so their shared-memory latency hides behind it.

    ``Promotion.SERIAL``: each k-tile's wgmma is waited for before its
    promotion. ``OVERLAPPED``: two product sets; the chain of k-tile t + 1 is
    issued before k-tile t is waited for and promoted. ``TWO_PARTS``: one
    product set cut by columns into two chains, committed one after the
    other; part 0 is promoted while part 1's chain still runs (same
    registers as one set, A read from shared memory twice).
    """
    # A tile that spans a 128-column boundary (tile_n = 192) takes the second
    # block's scale for its upper columns, from tile column straddle_col on.
    straddle_col = None
    if cutlass.const_expr(weight_scale_rows == 64):
        straddle_col = 64  # (a Python int: fixed for every tile)
    elif cutlass.const_expr(128 % tile_n != 0):
        n0 = n_block * tile_n
        straddle_col = (n0 // 128 + 1) * 128 - n0
    accumulators.fill(0.0)
    target = PromotionTarget(mma.ab_pipeline, accumulators, straddle_col)

    if cutlass.const_expr(promotion == Promotion.TWO_PARTS):
        for k_tile in cutlass.range(k_tile_cnt, unroll=1):
            scale = _issue_k_tile(mma, read_state, products, True)
            first = 0
            for p in cutlass.range_constexpr(len(products) - 1):
                cute.nvgpu.warpgroup.wait_group(len(products) - 1 - p)
                _promote_at(accumulators, products[p], scale, straddle_col, first)
                first += cute.size(products[p])
            # the last part's chain retired: the slot is free
            _retire_k_tile(target, read_state, products[-1], scale, 0, first)
            read_state.advance()
    elif cutlass.const_expr(promotion == Promotion.SERIAL):
        for k_tile in cutlass.range(k_tile_cnt, unroll=1):
            scale = _issue_k_tile(mma, read_state, products[0], False)
            _retire_k_tile(target, read_state, products[0], scale, 0)
            read_state.advance()
    else:
        acc_a, acc_b = products
        release_state = read_state.clone()
        # k-tile 0 goes into acc_a; each pass of the loop issues the two
        # k-tiles after the one in flight (into acc_b, then acc_a) and
        # retires the one before each, so one chain is in flight while
        # another is promoted.
        scale_a = _issue_k_tile(mma, read_state, acc_a, False)
        read_state.advance()
        scale_b = scale_a
        for pair in cutlass.range((k_tile_cnt - 1) // 2, unroll=1):
            scale_b = _issue_k_tile(mma, read_state, acc_b, False)
            read_state.advance()
            _retire_k_tile(target, release_state, acc_a, scale_a, 1)
            release_state.advance()
            scale_a = _issue_k_tile(mma, read_state, acc_a, False)
            read_state.advance()
            _retire_k_tile(target, release_state, acc_b, scale_b, 1)
            release_state.advance()
        # acc_a holds the last k-tile (odd count) or the one before it (even)
        if k_tile_cnt % 2 == 0:
            scale_b = _issue_k_tile(mma, read_state, acc_b, False)
            read_state.advance()
            _retire_k_tile(target, release_state, acc_a, scale_a, 1)
            release_state.advance()
            _retire_k_tile(target, release_state, acc_b, scale_b, 0)
        else:
            _retire_k_tile(target, release_state, acc_a, scale_a, 0)
    return read_state


def _issue_k_tile(mma: KTileMma, state, acc, in_parts: bool):
    """Wait for the slot of ``state``, issue its wgmma chain into ``acc`` (from
    zero) and commit it; ``in_parts``: ``acc`` is the tuple of column parts,
    one chain each. Returns scale[row half][weight-scale block] for the
    promotion."""
    if not in_parts:
        acc.fill(0.0)
    mma.ab_pipeline.consumer_wait(state)
    # The slot's scales are read, and multiplied, before the wgmma is issued:
    # their shared-memory latency then hides behind the wgmma instead of
    # sitting between its retirement and the promotion.
    sfb = (mma.sSFB[(0, state.index)], mma.sSFB[(FP8_SLOT_WEIGHT_SCALES - 1, state.index)])
    sfa0 = mma.sSFA[(mma.rows[0], 0, state.index)]
    sfa1 = mma.sSFA[(mma.rows[1], 0, state.index)]
    scale = ((sfa0 * sfb[0], sfa0 * sfb[1]), (sfa1 * sfb[0], sfa1 * sfb[1]))
    cute.nvgpu.warpgroup.fence()
    # (plain Python loops: these helpers are traced inline, unrolled)
    if in_parts:
        # each chain starts from zero by its first wgmma's scale-d, not by
        # zeroed registers (which made ptxas wait for the first chain before
        # issuing the second): tiled_mma is (starts from zero, accumulates)
        for acc_h, tCrB_h in zip(acc, mma.tCrB):
            for k_block in range(cute.size(mma.tCrA, mode=[2])):
                coord = (None, None, k_block, state.index)
                cute.gemm(mma.tiled_mma[min(k_block, 1)], acc_h, mma.tCrA[coord],
                          tCrB_h[coord], acc_h)
            cute.nvgpu.warpgroup.commit_group()
        return scale
    for k_block in range(cute.size(mma.tCrA, mode=[2])):
        coord = (None, None, k_block, state.index)
        cute.gemm(mma.tiled_mma, acc, mma.tCrA[coord], mma.tCrB[coord], acc)
    cute.nvgpu.warpgroup.commit_group()
    return scale


@cute.jit
def _retire_k_tile(
    target: PromotionTarget, state, acc, scale, still_in_flight: cutlass.Constexpr, first: cutlass.Constexpr = 0
):
    """Wait until at most ``still_in_flight`` wgmma groups are pending (the
    oldest, ``acc``'s, has retired), give its slot ``state`` back to the
    producer, and promote: accumulators += acc * scale (from value ``first``
    on, for a column part)."""
    cute.nvgpu.warpgroup.wait_group(still_in_flight)
    target.ab_pipeline.consumer_release(state)
    _promote_at(target.accumulators, acc, scale, target.straddle_col, first)


@cute.jit
def _promote_at(accumulators, acc, scale, straddle_col, first: cutlass.Constexpr):
    """``_promote`` with a run-time straddle_col (None, 64 or 128: every
    192-wide tile starts on a multiple of 64)."""
    if cutlass.const_expr(straddle_col is None or isinstance(straddle_col, int)):
        _promote(accumulators, acc, scale, straddle_col, first)
    else:
        # one unrolled loop per boundary, so no element selects its scale at
        # run time (docs/design.md, fp8 promotion)
        if straddle_col == 64:
            _promote(accumulators, acc, scale, 64, first)
        else:
            _promote(accumulators, acc, scale, 128, first)


def _promote(accumulators, acc, scale, straddle_col, first=0):
    """accumulators[first:first + size(acc)] += acc * scale, the weight scale
    switching to the second block's at tile column ``straddle_col`` (a Python
    int, or None)."""
    # value i of the wgmma accumulator fragment: column pair (i % 2),
    # row half (i // 2 % 2), 8-column group (i // 4)
    for v in range(cute.size(acc)):
        i = first + v
        half = (i // 2) % 2
        block = 1 if straddle_col is not None and (i // 4) * 8 >= straddle_col else 0
        accumulators[i] = accumulators[i] + acc[v] * scale[half][block]
