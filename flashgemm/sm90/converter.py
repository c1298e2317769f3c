"""The converter warpgroups of the MXFP4-weight GEMMs (``Format.FP8_MXFP4``,
``Format.BF16_MXFP4``): Hopper's wgmma takes no fp4, so the weights enter
shared memory packed and become e4m3 (or bf16) in place, where the wgmma
reads (docs/design.md, "MXFP4 weights on Hopper").

The TMA ring's slots hold A, the converted B tile and its (tile_n x
tile_k / 32) E8M0 bytes. The packed B tile (``mxfp4.prepare_weights``'
layout) lands in the first half (bf16: quarter) of the slot's B and is
converted in place: a slot is converted once it is full and read by the
wgmma until it is released, so conversion needs no buffer of its own and
every ring slot can be converted ahead (docs/design.md, "Conversion in
place"). A k-tile row of B is one 128-byte swizzle row either way: 128 e4m3
or 64 bf16 values. The converter warps work in teams of ``TEAM_WARPS``:
team t converts the slots whose sequence number is t modulo the team count,
so several slots convert at once, and steps from one of its slots to the
next. For e4m3 each team first writes ``scaled_table(d)`` for every shift d
into shared memory, so that a group's table is one load. Per slot, once its
loads landed:

1. each thread reads its groups' exponents (a group: 32 values of one row);
   e4m3 only: the tile's largest, s_max, is reduced over the team (a warp
   max, then the warps' maxima through shared memory and
   ``barriers.CONVERTERS`` + t);
2. each thread converts its groups (16 packed bytes into 32 e4m3 or 64 bf16
   bytes) and stores them at their 128-byte-swizzled place in the slot's B,
   once the team's barrier has ordered every packed load of the slot before
   (the s_max exchange's for e4m3, one of its own for bf16). e4m3: the
   group's exponent folded in as 2**(s - s_max + 6) (the team's copy of
   ``device.e2m1.scaled_table``); bf16: as 2**(s - 127), exactly
   (``device.e2m1.bf16_table``);
3. e4m3 only: thread 0 of the team writes the slot's weight scale
   2**(s_max - 6 - 127) into both sSFB entries, where the fp8 recipe's
   128x128 scale goes, so the consumers' promotion is unchanged;
4. each thread fences its stores for the async proxy (wgmma reads through
   it), and each warp of the team arrives on the slot's *converted* mbarrier.

The consumers wait on the slot's full barrier and then on its converted one
(``ConvertedRing``); releasing the slot frees its A and its B for the next
TMA fill (the converters' stores were fenced for the async proxy before
their arrival).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Uint32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from ..device.e2m1 import MAX_SHIFT, MIN_SHIFT, bf16_table, e2m1x8_to_bf16x8, e2m1x8_to_e4m3x8, scaled_table
from ..device.layout import batch_last
from ..formats import Format
from . import barriers
from .storage import CONVERTER_TABLE_WORDS, MAX_CONVERTER_WARPS
from .walk import start_walk, to_next_unit

CHUNK = 16  # bytes of one 16-byte bank group of a swizzled row
ROW_BYTES = 128  # one converted k-tile row: 128 e4m3 or 64 bf16 values, one 128-byte swizzle row
GROUP = 32  # values per E8M0 exponent
# warps per converter team: the teams convert alternate slots at once, each
# slot by one team (its warps share the slot's largest exponent)
TEAM_WARPS = 2
# the e4m3 s_max exchange's team barrier also orders each slot's packed loads before its in-place stores
assert TEAM_WARPS > 1
MAX_TEAMS = MAX_CONVERTER_WARPS // TEAM_WARPS
# e4m3: each team's copy of scaled_table(d) for d in [TABLE_FIRST_SHIFT, MAX_SHIFT],
# entry d - TABLE_FIRST_SHIFT (entry 0: a flushed group's zeros)
TABLE_FIRST_SHIFT = MIN_SHIFT - 1
TABLE_ENTRIES = MAX_SHIFT - TABLE_FIRST_SHIFT + 1
assert 2 * TABLE_ENTRIES * MAX_TEAMS == CONVERTER_TABLE_WORDS


class ConverterSmem(NamedTuple):
    """The converters' shared memory, as typed views."""

    packed: cute.Tensor  # (tile_n * tile_k / 8, stages) Uint32: packed rows of tile_k / 2 bytes, inside sB
    exps: cute.Tensor  # (tile_n * tile_k / 32, stages) Uint8: group-major E8M0 bytes (n + g * tile_n)
    sB: cute.Tensor  # (tile_n * 32, stages) Uint32: the converted, swizzled rows
    scale_bits: object  # e4m3: (2, stages) Int32 view of sSFB; bf16: None
    maxima: cute.Tensor  # (TEAM_WARPS, 2, teams) Int32: each team warp's s_max, per visit parity
    converted: object  # mbarrier pointer: one per slot
    tables: cute.Tensor  # (2 * TABLE_ENTRIES, teams) Int32: e4m3 tables (lo, hi) by shift, per team


def packed_smem_layout(tile_n: int, tile_k: int, stages: int):
    """(n, packed byte, stage): the TMA box of packed rows, unswizzled, in
    the first half (bf16: quarter) of each slot's converted B."""
    row = tile_k // 2
    return cute.make_layout((tile_n, row, stages), stride=(row, 1, tile_n * ROW_BYTES))


def exps_smem_layout(tile_n: int, tile_k: int, stages: int):
    """(n, group, stage): the E8M0 box, N contiguous (the exponents' stored layout)."""
    groups = tile_k // GROUP
    return cute.make_layout((tile_n, groups, stages), stride=(1, tile_n, tile_n * groups))


def packed_b_boxes(mSFB: cute.Tensor, tile_mnk: tuple):
    """Host side of the loads: (the packed B box's smem layout, its box
    shape, (the exponents' TMA atom, its tensor)) for a (tile_n, tile_k) tile."""
    tile_n, tile_k = tile_mnk[1], tile_mnk[2]
    exps_atom = cute.nvgpu.cpasync.make_tiled_tma_atom(
        cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
        batch_last(mSFB),
        cute.slice_(exps_smem_layout(tile_n, tile_k, 1), (None, None, 0)),
        (tile_n, tile_k // GROUP),
    )
    return cute.slice_(packed_smem_layout(tile_n, tile_k, 1), (None, None, 0)), (tile_n, tile_k // 2), exps_atom


def packed_b_partitions(storage, tma_atom_b, mB_nkl, tma_atom_exps, mExps, tile_mnk: tuple, stages: int):
    """Kernel side of the loads: the packed tile (into the slot's sB) and
    its (tile_n, 4) exponents per slot, TMA-loaded together. Returns ((TMA, stages) and
    (TMA, RestN, RestK, E) of the packed B, (atom, source, destination) of
    the exponents)."""
    tile_n, tile_k = tile_mnk[1], tile_mnk[2]
    sBp = cute.make_tensor(cute.recast_ptr(storage.sB.data_ptr(), dtype=cutlass.Int8),
                           packed_smem_layout(tile_n, tile_k, stages))
    gBp = cute.local_tile(mB_nkl, (tile_n, tile_k // 2), (None, None, None))
    tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
        tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sBp, 0, 2), cute.group_modes(gBp, 0, 2))
    sExps = storage.sBsf.get_tensor(exps_smem_layout(tile_n, tile_k, stages))
    gExps = cute.local_tile(mExps, (tile_n, tile_k // GROUP), (None, None, None))
    tEs, tEg = cute.nvgpu.cpasync.tma_partition(
        tma_atom_exps, 0, cute.make_layout(1), cute.group_modes(sExps, 0, 2), cute.group_modes(gExps, 0, 2))
    return tBsB, tBgB, (tma_atom_exps, tEg, tEs)


def converter_smem(storage, sB: cute.Tensor, sSFB, tile_n: int, tile_k: int, stages: int) -> ConverterSmem:
    """``sSFB``: the slots' weight scales (e4m3), or None (bf16: no scale)."""
    return ConverterSmem(
        cute.make_tensor(cute.recast_ptr(storage.sB.data_ptr(), dtype=Uint32),
                         cute.make_layout((tile_n * tile_k // 8, stages), stride=(1, tile_n * ROW_BYTES // 4))),
        cute.make_tensor(storage.sBsf.data_ptr(), cute.make_layout((tile_n * tile_k // GROUP, stages))),
        cute.make_tensor(cute.recast_ptr(sB.iterator, dtype=Uint32), cute.make_layout((tile_n * ROW_BYTES // 4, stages))),
        None if sSFB is None else cute.make_tensor(cute.recast_ptr(sSFB.iterator, dtype=Int32), sSFB.layout),
        cute.make_tensor(storage.conv_max.data_ptr(), cute.make_layout((TEAM_WARPS, 2, MAX_TEAMS))),
        storage.conv_mbar.data_ptr(),
        cute.make_tensor(storage.conv_tables.data_ptr(), cute.make_layout((2 * TABLE_ENTRIES, MAX_TEAMS))),
    )


def init_converted_barriers(mbar, stages: int, warps: int) -> None:
    """One thread, before the cluster-wide barrier-init sync: one arrival per
    warp of the team that converts the slot."""
    for s in range(stages):
        cute.arch.mbarrier_init(mbar + s, warps)


class ConvertedRing:
    """The consumers' view of the operand ring when the converters write B:
    a slot is ready once it is full and converted; releasing it is
    unchanged."""

    def __init__(self, ab_pipeline, converted):
        self.ab_pipeline = ab_pipeline
        self.converted = converted

    # (carried through the consumers' dynamic loops as its device values)
    def __extract_mlir_values__(self):
        return extract_mlir_values([self.ab_pipeline, self.converted])

    def __new_from_mlir_values__(self, values):
        ab_pipeline, converted = new_from_mlir_values([self.ab_pipeline, self.converted], values)
        return ConvertedRing(ab_pipeline, converted)

    def consumer_wait(self, state, try_wait_token=None):
        self.ab_pipeline.consumer_wait(state, try_wait_token)
        cute.arch.mbarrier_wait(self.converted + state.index, state.phase)

    def consumer_release(self, state):
        self.ab_pipeline.consumer_release(state)


class WeightConverter:
    """Trace-time helper of the converter warpgroups (see the module docstring)."""

    def __init__(self, config, fmt: Format, tile_n: int, tile_k: int, stages: int, warpgroups: int):
        self.config = config
        self.bf16 = fmt is Format.BF16_MXFP4  # else e4m3 (FP8_MXFP4)
        self.tile_n = tile_n
        self.groups = tile_k // GROUP  # exponents per row and k-tile
        self.packed_row_words = tile_k // 8
        self.chunks_per_group = ROW_BYTES // CHUNK // self.groups
        self.stages = stages
        self.teams = warpgroups * 4 // TEAM_WARPS
        self.team_threads = 32 * TEAM_WARPS

    @cute.jit
    def run(self, ctid, walk_args, feed, balance, ab_pipeline, smem: ConverterSmem, k_tile_cnt):
        """Convert every slot the producer fills, for every tile of this role's
        walk (the same tiles as the producer's): team t takes the slots whose
        sequence number is t modulo the team count, and steps from one to
        the next without visiting the others."""
        team = ctid // self.team_threads
        ttid = ctid % self.team_threads
        barrier = pipeline.NamedBarrier(barrier_id=barriers.CONVERTERS + team, num_threads=self.team_threads)
        if cutlass.const_expr(not self.bf16):
            # the team's shift tables, once: a group's table is then one load
            if ttid < TABLE_ENTRIES:
                lo, hi = scaled_table(ttid + TABLE_FIRST_SHIFT)
                smem.tables[(2 * ttid, team)] = lo
                smem.tables[(2 * ttid + 1, team)] = hi
            barrier.arrive_and_wait()
        sched, used = start_walk(self.config, walk_args, feed, None, balance)
        work = sched.work()
        # the team's next slot; its count is the slot's sequence number
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if team > 0:
            state.advance(team)
        tile_end = Int32(0)
        visits = Int32(0)
        while work.is_valid:
            tile_end += k_tile_cnt
            while state.count < tile_end:
                ab_pipeline.consumer_wait(state)
                self.convert_slot(smem, state.index, visits % 2, ttid, team, barrier)
                visits += 1
                state.advance(self.teams)
            used = to_next_unit(self.config, sched, feed, used)
            work = sched.work()

    @cute.jit
    def convert_slot(self, smem: ConverterSmem, stage, parity, ttid, team, barrier):
        lane = ttid % 32
        warp = ttid // 32
        # this thread's groups: group lane % groups of rows lane // groups + (32 / groups) * warp + step * i
        group = lane % self.groups
        row0 = lane // self.groups + (32 // self.groups) * warp
        step = self.team_threads // self.groups
        passes = self.tile_n // step
        exps, packed = self.load_groups(smem, stage, group, row0, step, passes)
        if cutlass.const_expr(self.bf16):
            # in place: every packed byte of the slot is read before any converted one is written
            barrier.arrive_and_wait()
            # every group's exponent folds into bf16 exactly: no tile scale
            self.store_groups(smem, stage, [bf16_table(e) for e in exps], packed, group, row0,
                              step, passes)
        else:
            # 1. s_max over the team's warps
            s_max = cute.arch.warp_redux_sync(_max_tree(exps), "max")
            if cutlass.const_expr(TEAM_WARPS > 1):
                if lane == 0:
                    smem.maxima[(warp, parity, team)] = s_max
                barrier.arrive_and_wait()
                s_max = _max_tree([smem.maxima[(w, parity, team)] for w in range(TEAM_WARPS)])
            base = s_max - MAX_SHIFT  # the slot scale's biased exponent
            # 2. convert and store, each group's table looked up by its shift (below MIN_SHIFT: entry 0, zeros)
            tables = [self.table(smem, team, cutlass.max(e - base - TABLE_FIRST_SHIFT, Int32(0))) for e in exps]
            self.store_groups(smem, stage, tables, packed, group, row0, step, passes)
            # 3. the slot's weight scale, as fp32 bits (0 for a tile whose values are all below 2**-126)
            if ttid == 0:
                bits = Int32(0)
                if base >= 1:
                    bits = base << 23
                smem.scale_bits[(0, stage)] = bits
                smem.scale_bits[(1, stage)] = bits
        # 4. stores visible to the wgmma (async proxy), then one arrival per warp
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(smem.converted + stage)

    def table(self, smem: ConverterSmem, team, entry):
        """(lo, hi) of the team's table ``entry`` (traced inline)."""
        src = cute.make_tensor(smem.tables[(None, team)].iterator + 2 * entry, cute.make_layout(2))
        words = cute.make_rmem_tensor((2,), Int32)
        cute.autovec_copy(src, words)
        return words[0], words[1]

    def load_groups(self, smem: ConverterSmem, stage, group, row0, step, passes):
        """Every load of the slot first (one dependent chain per group would
        leave the warp waiting on shared memory): each group's exponent and
        its four packed words (traced inline, unrolled)."""
        exps, packed = [], []
        for i in range(passes):
            n = row0 + step * i
            exps.append(Int32(smem.exps[(n + group * self.tile_n, stage)]) & Int32(0xFF))
            src = cute.make_tensor(smem.packed[(None, stage)].iterator + n * self.packed_row_words + 4 * group,
                                   cute.make_layout(4))
            words = cute.make_rmem_tensor((4,), Uint32)
            cute.autovec_copy(src, words)
            packed.append(words)
        return exps, packed

    def store_groups(self, smem: ConverterSmem, stage, tables, packed, group, row0, step, passes):
        """Each group's converted bytes into its 16-byte chunks of the row
        (e4m3: 2g, 2g + 1; bf16: 4g .. 4g + 3), at their swizzled places
        (Swizzle<3,4,3>: chunk index XOR row % 8; row0 % 8 is every pass's,
        as step is a multiple of 8)."""
        words_out = 4 * self.chunks_per_group
        out = cute.make_rmem_tensor((words_out,), Uint32)
        for i in range(passes):
            n = row0 + step * i
            for w in range(4):
                if cutlass.const_expr(self.bf16):
                    for j, v in enumerate(e2m1x8_to_bf16x8(Int32(packed[i][w]), tables[i])):
                        out[4 * w + j] = Uint32(v)
                else:
                    lo, hi = e2m1x8_to_e4m3x8(Int32(packed[i][w]), tables[i])
                    out[2 * w], out[2 * w + 1] = Uint32(lo), Uint32(hi)
            for part in range(self.chunks_per_group):
                chunk = (self.chunks_per_group * group + part) ^ (row0 % 8)
                at = (n * ROW_BYTES + chunk * CHUNK) // 4
                dst = cute.make_tensor(smem.sB[(None, stage)].iterator + at, cute.make_layout(4))
                cute.autovec_copy(_quarter(out, part), dst)


def _quarter(out, part):
    """Words 4 * part .. 4 * part + 3 of ``out`` as a tensor of their own."""
    return cute.make_tensor(out.iterator + 4 * part, cute.make_layout(4))


def _max_tree(values):
    while len(values) > 1:
        values = [cutlass.max(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]
