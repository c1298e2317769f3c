"""Kernel configurations and the heuristic that picks one.

A :class:`GemmConfig` holds every choice that changes the generated code apart
from the dtypes. It is frozen so it can key the compile cache. The shared-memory
budget lives here too, because validation must reject a config the hardware
cannot run before anything is compiled.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# Hopper: 227 KiB of dynamic shared memory per CTA (sm_90 opt-in limit).
SM90_SMEM_BYTES = 232448
# mbarriers and alignment slack kept out of the operand ring.
_SMEM_RESERVED_BYTES = 1024
# Block-scaled fp8: the fp32 weight scales each slot carries, one per
# 128-row block of N the tile covers (two for a 192-wide tile that straddles
# a block boundary; mainloop.produce_tile copies them in)
FP8_SLOT_WEIGHT_SCALES = 2
EPI_STAGES = 2
# The dynamic order's claim counter: int32 (next unit, finished clusters).
# Here, not in dynamic_scheduler, so the launcher allocates it without cutlass.
CLAIM_COUNTER_INTS = 2


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration.

    tile_m: rows of the CTA tile (64 per consumer warpgroup).
    tile_n: columns of the CTA tile (wgmma N; 64..256, multiple of 64 here).
    tile_k: K depth of one pipeline stage: one 128-byte swizzle row, so 64 for
        bf16 and 128 for fp8 (where one stage is one 128-wide scale block).
    stages: depth of the TMA -> wgmma shared-memory ring; 0 = as many as fit.
    cluster_m / cluster_n: CTA cluster shape. cluster_n=2 pairs CTAs on
        adjacent n-blocks of one m-block; each loads half of the A tile and
        TMA-multicasts it to both, halving A's L2 reads (cluster_m is 1).
    consumer_warpgroups: wgmma warpgroups (1-3); each owns 64 rows of the tile.
    l2_hints: TMA loads of the weights (read once) evict-first, of the
        activations (re-read by every n-block) evict-last.
    pdl: programmatic dependent launch. The kernel may start while the
        kernel before it on the stream finishes (its CTAs set up shared
        memory, then wait in ``griddepcontrol.wait`` before touching global
        memory), and once every CTA has issued its last loads it lets a
        PDL-launched kernel after it do the same. On by default: graphs of
        back-to-back calls ran 1-2.6% faster on the decode cases (qwen3-30b
        fp8 23.7 -> 23.1 us, bf16 42.9 -> 41.7; H100, 2026-11-23, paired
        rounds), and prefill moved by less than its noise.
    dynamic: each cluster claims every unit it runs from a global counter
        (one per stream, or per graph-captured launch) instead of taking
        every G-th unit (``dynamic_scheduler``): SMs that start late or run
        slow tiles take fewer units, and a cluster that never gets an SM
        takes none.
    l2_warmup: with ``pdl``, each CTA prefetches into L2 the first ring's
        worth of weight k-tiles of its likely first tile before waiting for
        the previous kernel, so the weight stream starts during its tail.
    promote_overlap: block-scaled fp8 only; each consumer warpgroup keeps two
        product accumulators, so the next k-tile's wgmma runs while the
        current one is scaled into the running sum (tile_n <= 128).
    balance_rounds: static order only; when the units (counted on the
        device) would leave the grid's last round at most half full, fewer
        clusters take them, in the same number of full rounds
        (``scheduler.active_clusters``).
    n_major: units numbered n-group first (``scheduler.NMajorTileScheduler``),
        so every round holds a slice of every expert instead of one or two
        whole experts.
    n_major_window: with n_major, 0 (one window of every expert), or a power
        of two up to 32: the experts are taken that many at a time, each
        window numbered n-group first, so each window's experts finish
        before the next window starts. 1 is the expert-major order found by
        the n-major scan (what calls with completion signals use).
    split_last_round: static expert-major order, two consumer warpgroups,
        calls without signals; when the units (counted on the device) leave
        the grid's last round at most half full, each of its units runs as
        two half units on two clusters, one warpgroup each
        (``scheduler.tail_start``).
    a_chunk_rows: 0, or load the A tile as boxes of this many rows and
        fetch only those that hold a valid row (``mainloop.produce_tile``);
        the others are not loaded, and each slot's barrier expects only the
        bytes that are.
    epi_whole_tile: the epilogue's staging area holds the whole output tile
        (tile_n / 32 buffers instead of 2), so each consumer warpgroup stages
        its rows of every sub-tile and hands them to the store warp on its own
        pair of named barriers, once per tile, without waiting for the other
        warpgroups (``epilogue``); costs shared memory, so fewer stages may fit.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 0
    cluster_m: int = 1
    cluster_n: int = 1
    consumer_warpgroups: int = 2
    # Off by default, on where choose_config expects every expert to fit one
    # m-block (fp8 128x128: two, run in the same round). Otherwise a later
    # m-block's CTA re-reads an evicted weight tile (H100, 2026-11-22 sweep:
    # tile_m=64 on dsv3-ep32 gate_up 288 vs 253 us); see choose_config.
    l2_hints: bool = False
    pdl: bool = True
    dynamic: bool = False
    # With pdl: before its griddepcontrol.wait, each CTA's producer asks the
    # TMA unit to prefetch into L2 the first ring's worth of weight k-tiles
    # of the tile it will likely start on (kernel._warm_l2_weights), so the
    # weight stream starts while the kernel before it drains. Paired A/B on
    # H100, 2026-11-23 (`ab_revision.py --set l2_warmup=1`, heuristic
    # configs, uniform m): fp8 decode 0.941-0.996 (qwen3-235b-ep8-down 41.7
    # -> 39.2 us, dsv3-ep32-down 58.7 -> 56.8, qwen3-30b 22.5 -> 22.0), bf16
    # decode 0.975-1.008, prefill 0.990-1.003; sparse routing, where the
    # guess is often an empty expert, 0.881-1.011. Twice the depth: fp8
    # qwen3-30b 1.058, the rest within 2%, so one ring it is.
    l2_warmup: bool = True
    # Block-scaled fp8 only: two product accumulators per warpgroup, so the
    # wgmma chain of k-tile t + 1 runs while k-tile t is promoted on the CUDA
    # cores (mainloop.consume_tile_blockscaled). Costs tile_n / 2 registers.
    promote_overlap: bool = False
    # Static order only: spread a last round that is at most half full over
    # the earlier rounds (scheduler.active_clusters has the measurements).
    balance_rounds: bool = False
    n_major: bool = False
    n_major_window: int = 0
    # Compute-bound tiles: a last round of a few units costs a whole round
    # on an otherwise idle GPU; halving them halves that tail (measurements
    # in scheduler.tail_start).
    split_last_round: bool = False
    # A decode tile past m_e holds rows nobody stores: an expert of 146 rows
    # in 128-row tiles loads 110 rows of A for nothing in its second m-block,
    # and every cluster of n-blocks loads them again from L2.
    a_chunk_rows: int = 0
    epi_whole_tile: bool = False
    # Block-scaled fp8 with one product set: each k-tile's wgmma chain is
    # issued as this many chains, each over tile_n / promote_parts columns,
    # and part p is promoted while the chains after it still run
    # (mainloop.consume_tile_blockscaled has the measurements). 1: one chain.
    promote_parts: int = 1

    def __post_init__(self):
        # The launcher hashes the config into its plan key on every call; the
        # generated hash (a tuple of every field, 13 at the time) cost 0.2-0.36 us of a
        # 2-3 us call on the development CPU, so it is computed once.
        object.__setattr__(
            self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        )

    def __hash__(self) -> int:
        return self._hash

    # ---- derived facts -------------------------------------------------
    @property
    def tile_mnk(self) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, self.tile_k)

    @property
    def threads(self) -> int:
        # one producer warpgroup (TMA warp, store warp, two idle) + consumers
        return 128 * (1 + self.consumer_warpgroups)

    @property
    def epi_tile(self) -> tuple[int, int]:
        # One bulk store per (tile_m x 32) sub-tile: 32 columns keep the
        # staging buffer at 4 KiB per 64 rows and stage.
        return (self.tile_m, 32)

    @property
    def epi_buffers(self) -> int:
        """Staging buffers of one epi_tile each: the whole tile, or a pair."""
        return self.tile_n // self.epi_tile[1] if self.epi_whole_tile else EPI_STAGES

    def n_groups(self, n: int) -> int:
        """Units of work along N: ceil(ceil(N / tile_n) / cluster_n)."""
        return -(-(-(-n // self.tile_n)) // self.cluster_n)

    def n_clusters(self, num_sms: int) -> int:
        """Clusters a persistent grid capped at num_sms runs at once (at least 1)."""
        return max(1, num_sms // self.cluster_n)

    def grid_clusters(self, num_experts: int, max_m: int, n: int, num_sms: int) -> int:
        """Clusters the launcher starts: capped at num_sms, and never more
        than the units of work every expert at max_m rows would make."""
        max_units = num_experts * -(-max_m // self.tile_m) * self.n_groups(n)
        if self.split_last_round:  # a last round of halves may use twice the clusters
            max_units *= 2
        return max(1, min(num_sms // self.cluster_n, max_units))

    def stage_bytes(self, elem_bytes: int = 2) -> int:
        operands = (self.tile_m + self.tile_n) * self.tile_k * elem_bytes
        if elem_bytes == 1:  # block-scaled fp8: the tile's fp32 row and weight scales ride along
            operands += (self.tile_m + FP8_SLOT_WEIGHT_SCALES) * 4
        return operands

    def epi_bytes(self, out_elem_bytes: int = 2) -> int:
        em, en = self.epi_tile
        return em * en * out_elem_bytes * self.epi_buffers

    def resolved_stages(self, elem_bytes: int = 2, out_elem_bytes: int = 2) -> int:
        """Stages actually used: the explicit count, or as many as fit."""
        if self.stages:
            return self.stages
        free = SM90_SMEM_BYTES - _SMEM_RESERVED_BYTES - self.epi_bytes(out_elem_bytes)
        return max(free // self.stage_bytes(elem_bytes), 0)

    def smem_bytes(self, elem_bytes: int = 2, out_elem_bytes: int = 2) -> int:
        return (
            _SMEM_RESERVED_BYTES
            + self.resolved_stages(elem_bytes, out_elem_bytes) * self.stage_bytes(elem_bytes)
            + self.epi_bytes(out_elem_bytes)
        )

    def validate(self, elem_bytes: int = 2, out_elem_bytes: int = 2) -> "GemmConfig":
        """Raise ValueError naming the field if this config cannot be built."""
        if self.consumer_warpgroups not in (1, 2, 3):
            raise ValueError(
                f"config.consumer_warpgroups must be 1, 2 or 3, got {self.consumer_warpgroups}"
            )
        if self.consumer_warpgroups == 3 and self.tile_n > 128:
            # 512 threads share 64K registers: 152 per consumer thread, of
            # which tile_n / 2 hold accumulators
            raise ValueError(
                f"config.tile_n must be <= 128 with 3 consumer warpgroups, got {self.tile_n}"
            )
        if self.tile_m != 64 * self.consumer_warpgroups:
            raise ValueError(
                f"config.tile_m must be 64 * consumer_warpgroups "
                f"({64 * self.consumer_warpgroups}), got {self.tile_m}"
            )
        if self.tile_n not in (64, 128, 192, 256):
            raise ValueError(f"config.tile_n must be one of 64, 128, 192, 256, got {self.tile_n}")
        if self.tile_k * elem_bytes != 128:
            raise ValueError(
                f"config.tile_k must be {128 // elem_bytes} for {8 * elem_bytes}-bit operands "
                f"(one 128-byte row per stage), got {self.tile_k}"
            )
        if elem_bytes == 1 and self.tile_n > 192:
            # a block-scaled tile holds two accumulator sets (the running sum
            # and one k-block's products): tile_n fp32 registers per thread
            raise ValueError(f"config.tile_n must be <= 192 for fp8, got {self.tile_n}")
        if elem_bytes == 1 and self.consumer_warpgroups == 3 and self.tile_n > 64:
            raise ValueError(
                f"config.tile_n must be 64 for fp8 with 3 consumer warpgroups, got {self.tile_n}"
            )
        if self.promote_overlap and elem_bytes != 1:
            raise ValueError("config.promote_overlap applies to block-scaled fp8 operands only")
        if self.promote_parts != 1 and (
            elem_bytes != 1 or self.promote_overlap or self.promote_parts not in (2, 3, 4)
            or self.tile_n % (8 * self.promote_parts)
        ):
            raise ValueError(
                "config.promote_parts (2, 3 or 4) applies to block-scaled fp8 with one product "
                "set (no promote_overlap), tile_n a multiple of 8 * promote_parts; got "
                f"promote_parts={self.promote_parts}, tile_n={self.tile_n}"
            )
        if self.promote_overlap and self.tile_n > 128:
            # three accumulator sets: 3 * tile_n / 2 registers per thread
            raise ValueError(
                f"config.tile_n must be <= 128 with promote_overlap, got {self.tile_n}"
            )
        if self.balance_rounds and self.dynamic:
            raise ValueError(
                "config.balance_rounds applies to the static order; a dynamic config "
                "(config.dynamic=True) already gives late clusters fewer units"
            )
        if self.split_last_round and self.consumer_warpgroups != 2:
            raise ValueError(
                "config.split_last_round runs each half of a split unit on one of two "
                f"consumer warpgroups; got consumer_warpgroups={self.consumer_warpgroups}"
            )
        if self.split_last_round and (self.dynamic or self.balance_rounds or self.n_major):
            raise ValueError(
                "config.split_last_round applies to the static expert-major order; "
                "turn off config.dynamic, config.balance_rounds and config.n_major"
            )
        if self.n_major_window and (
            not self.n_major or self.n_major_window not in (1, 2, 4, 8, 16, 32)
        ):
            raise ValueError(
                "config.n_major_window must be 0, or a power of two up to 32 with "
                f"config.n_major=True; got {self.n_major_window} (n_major={self.n_major})"
            )
        if self.a_chunk_rows and (
            self.a_chunk_rows not in (16, 32, 64) or self.tile_m % (self.a_chunk_rows * self.cluster_n)
        ):
            raise ValueError(
                "config.a_chunk_rows must be 0, or 16, 32 or 64 dividing tile_m / cluster_n "
                f"({self.tile_m} / {self.cluster_n}), got {self.a_chunk_rows}"
            )
        if self.cluster_m != 1 or self.cluster_n not in (1, 2):
            raise ValueError(
                f"config cluster shape ({self.cluster_m}, {self.cluster_n}) is not supported; "
                "use cluster_m=1 and cluster_n in (1, 2)"
            )
        # 64 x tile_n fp32 accumulators per warpgroup thread: tile_n/2 registers.
        if self.tile_n // 2 > 128:
            raise ValueError(f"config.tile_n={self.tile_n} needs too many accumulator registers")
        if self.stages < 0:
            raise ValueError(f"config.stages must be >= 0 (0 = auto), got {self.stages}")
        n_stages = self.resolved_stages(elem_bytes, out_elem_bytes)
        if n_stages < 2:
            raise ValueError(
                f"config needs at least 2 pipeline stages; {n_stages} fit in shared memory"
            )
        if self.smem_bytes(elem_bytes, out_elem_bytes) > SM90_SMEM_BYTES:
            raise ValueError(
                f"config uses {self.smem_bytes(elem_bytes, out_elem_bytes)} bytes of shared "
                f"memory; sm_90 allows {SM90_SMEM_BYTES} (lower config.stages)"
            )
        return self

    def short_name(self) -> str:
        return (
            f"m{self.tile_m}n{self.tile_n}k{self.tile_k}"
            f"s{self.resolved_stages(max(1, 128 // self.tile_k))}wg{self.consumer_warpgroups}"
            f"c{self.cluster_m}x{self.cluster_n}" + ("-l2hint" if self.l2_hints else "")
            + ("" if self.pdl else "-nopdl") + ("-dyn" if self.dynamic else "")
            + ("" if self.l2_warmup else "-nowarm") + ("-po" if self.promote_overlap else "")
            + ("-bal" if self.balance_rounds else "") + ("-nmaj" if self.n_major else "")
            + (f"-w{self.n_major_window}" if self.n_major_window else "")
            + ("-split" if self.split_last_round else "")
            + (f"-ac{self.a_chunk_rows}" if self.a_chunk_rows else "")
            + ("-ew" if self.epi_whole_tile else "")
            + (f"-pp{self.promote_parts}" if self.promote_parts != 1 else "")
        )


# Decode: a few rows per expert, the weights stream once, so the tile is as
# short in M as wgmma allows (64) while every expert fits one m-block; when
# m_e (expected_m +-30%) can pass 64 a 128-row tile avoids a second, nearly
# empty m-block, and 64 columns keep enough tiles to fill the SMs. Mid and
# prefill: two consumer warpgroups sharing each B tile halve its
# shared-memory traffic per FLOP. All pair CTAs along N to multicast A
# (1-4% faster in every case of the sweep).
# Every decode tile is hinted (l2_hints): expected_m + 30% stays inside one
# m-block in all three, so each weight tile is read by one cluster only.
# The smallest-m tiles (expected_m <= 48, bf16 and fp8) claim their units
# dynamically: many experts of a few rows give 8-16 units per cluster, and
# when routing is uneven the hot experts' extra m-blocks make some units cost
# more than others. Paired A/B, dynamic vs static (H100, 2026-11-23,
# `scripts/ab_revision.py --set dynamic=1`, dsv3-ep8 gate_up / down): bf16
# uniform 1.001 / 0.995, skewed 0.962 / 0.964; fp8 uniform 1.008 / 0.993,
# skewed 0.967 / 0.946. Fewer units per cluster pay the first claim's round
# trip without that gain (qwen3-30b, 1.5-3 units: 1.04-1.06), so the other
# tiles keep the static order.
# The 128x128 tile (fp8 from expected_m 49 up) also balances its rounds
# (balance_rounds): its experts span one or two m-blocks, so the unit count,
# and with it the last round, moves with masked_m. Paired A/B against the
# same kernel without it (H100, 2026-11-24, `ab_revision.py --base`): fp8
# dsv3-ep32-down 0.968 uniform / 0.964 skewed, the other 128x128 cases
# 0.996-1.010. The other tiles gained nothing there (bf16 0.969-1.018, fp8
# 128x64 0.980-1.020) and keep the count off their start.
# Every tile up to expected_m 256 loads A in 32-row chunks and skips the
# chunks with no valid row (a_chunk_rows): a partial m-block then reads only
# its rows, from HBM once and from L2 once per cluster of n-blocks.
# Paired A/B on H100, 2026-11-24 (`ab_revision.py --set a_chunk_rows=32`,
# bit-identical outputs, uniform routing): bf16 decode 0.975-1.008
# (qwen3-235b-ep8 0.975-0.976), fp8 0.971-0.999 (dsv3-ep32-gate_up 98.7 ->
# 95.6 us). 16-row chunks gained no more and cost the 192-row bf16 tile six
# loads per k-tile (dsv3-ep32-down 1.081). Reading the empty chunks from
# past max_m instead, which the TMA unit fills with zeros at the same byte
# count, ran 1.005-1.42x the heuristic's time.
A_CHUNK_ROWS = 32
DECODE_CONFIG = GemmConfig(
    tile_m=64, tile_n=64, consumer_warpgroups=1, cluster_n=2, l2_hints=True, dynamic=True,
    a_chunk_rows=A_CHUNK_ROWS,
)
DECODE_128_CONFIG = GemmConfig(
    tile_m=128, tile_n=64, consumer_warpgroups=2, cluster_n=2, l2_hints=True, a_chunk_rows=A_CHUNK_ROWS
)
# expected_m 97..144: m_e stays under 192 (+30%), so a 192-row tile holds each
# expert in one m-block where 128-row tiles cut most of them in two.
MID_192_CONFIG = GemmConfig(
    tile_m=192, tile_n=64, consumer_warpgroups=3, cluster_n=2, l2_hints=True, a_chunk_rows=A_CHUNK_ROWS
)
# The same rows, 128 columns: half the units, each reading A once for twice
# the columns. Paired A/B on H100, 2026-11-24 (`ab_revision.py --set
# tile_n=128 --dtype bf16`, uniform / skewed routing): dsv3-ep32-gate_up
# (N 4096: 2 rounds of 192x128 units against 4 of 192x64) 0.952 / 0.892,
# dsv3-ep32-down (N 7168: 4 rounds against 7) 1.040 / 0.903. So a 192x128
# unit costs about 0.91-0.95 of two 192x64 units, and choose_config takes it
# where its rounds, weighted so, are fewer (mid_192_wide_wins).
MID_192_N128_CONFIG = dataclasses.replace(MID_192_CONFIG, tile_n=128)
WIDE_UNIT_COST = 0.93
MID_CONFIG = GemmConfig(
    tile_m=128, tile_n=128, consumer_warpgroups=2, cluster_n=2, balance_rounds=True,
    a_chunk_rows=A_CHUNK_ROWS,
)
# Prefill splits a last round that is at most half full into half units
# (split_last_round). Paired A/B on H100, 2026-11-24 (`ab_revision.py --set
# split_last_round=1`, bit-identical outputs), uniform / skewed routing:
# dsv3-prefill-gate_up (4.12 rounds of 128x256 units) 0.893 / 0.944,
# dsv3-prefill-down (8.06 rounds) 0.950 / 0.961, E8 m512 N4096 K7168 0.953,
# E4 m1024 N2048 0.973; where no round was cut, 0.994-1.031 (dense-like,
# whose last round is 58/66 full) and 1.003-1.007.
PREFILL_CONFIG = GemmConfig(
    tile_m=128, tile_n=256, consumer_warpgroups=2, cluster_n=2, split_last_round=True
)
_REGIME_CONFIGS = (
    DECODE_CONFIG, DECODE_128_CONFIG, MID_192_CONFIG, MID_192_N128_CONFIG, MID_CONFIG, PREFILL_CONFIG,
    dataclasses.replace(PREFILL_CONFIG, split_last_round=False),  # with signals
)

# Block-scaled fp8: 128-deep stages (one scale block each). Two accumulator
# sets per thread (running sum + one k-block's products) cap tile_n at 192;
# the mid tiles keep a third set (promote_overlap) and so stop at 128. See
# choose_config for the measurements.
# Two builds that hold more rows per weight tile were timed and removed (H100,
# 2026-11-24, docs/benchmarks.md): 256x128 with two 64-row slabs per
# warpgroup, promoted one after the other through one product set, ran
# 1.000-1.016 of 128x128 per FLOP on prefill and 1.16-1.41 on dsv3-ep32;
# 192x128 on three warpgroups with one product set, 0.993-1.487 on the mid
# cases.
FP8_DECODE_CONFIG = GemmConfig(
    tile_m=64, tile_n=128, tile_k=128, consumer_warpgroups=1, cluster_n=2, l2_hints=True, dynamic=True,
    a_chunk_rows=A_CHUNK_ROWS,
)
# K >= 4096: 64-wide tiles. A unit's time grows with K, and the last units a
# cluster claims set the launch's tail; halving the unit halves that step.
# Paired A/B on H100, 2026-11-24 (`ab_revision.py --set tile_n=64 --dtype
# fp8`, uniform / skewed routing, bit-identical outputs): dsv3-ep8-gate_up
# (K 7168) 0.983-0.984 / 0.997-1.002 (sparse 0.973-0.981), E16 N3072 K4096
# 0.984 / 0.995, E64 m16 K7168 0.986 / 0.986, E8 K7168 0.998 / 1.018. With
# short K the doubled per-tile costs (epilogue, pipeline refill) won instead:
# dsv3-ep8-down (K 2048) 0.983-0.985 / 1.033-1.042, E16 K1536 1.038 / 1.030,
# E16 N1536 K2048 1.020 / 1.114, E8 N7168 K2048 0.972 / 1.077.
FP8_DECODE_N64_CONFIG = dataclasses.replace(FP8_DECODE_CONFIG, tile_n=64)
FP8_DECODE_N64_MIN_K = 4096
# The two-warpgroup fp8 tiles keep a second k-tile's wgmma in flight while
# they promote (promote_overlap). Paired A/B on H100, 2026-11-24
# (`ab_revision.py --set promote_overlap=1`, bit-identical outputs): uniform
# prefill 0.917-0.949 (dsv3-prefill-gate_up 277.2 -> 252.3 us), dsv3-ep32
# 0.971 / 0.973, qwen3-30b 0.959, qwen3-235b-ep8 0.990-0.995; skewed
# 0.915-0.992. The 64x128 decode tile (one warpgroup) moved by -0.8% to
# +0.5% and spills a few registers with it, so it keeps one product set.
# Other widths re-measured against these (same method and day, uniform /
# skewed routing): 128x64 instead of 128x128 on dsv3-ep32 and qwen3-235b-ep8
# 1.013-1.178; 128x192 (one product set) won qwen3-30b before this change
# (0.903, skewed 1.085, sparse 1.560) and lost elsewhere; 192x64 on three
# warpgroups 1.066-1.200 on dsv3-ep32.
# Up to expected_m 256 both two-warpgroup fp8 tiles number their units
# n-group first (n_major), so every round mixes experts of one and two
# m-blocks. Paired A/B on H100, 2026-11-24 (`ab_revision.py --set n_major=1
# --dtype fp8`, bit-identical outputs), uniform / skewed / sparse routing:
# dsv3-ep32-down 0.925-0.928 / 0.963-0.966 / 0.938, qwen3-30b (128x64)
# 0.929-0.931 / 0.921-0.931 / 0.888, dsv3-ep32-gate_up 1.004-1.005 / 0.853-
# 0.867 / 0.965, qwen3-235b-ep8 0.989-0.999 / 0.953-1.002 / 0.870-0.955.
# Prefill keeps the expert-major order: uniform dsv3-prefill 1.018 / 1.020
# (dense-like 0.981), though skewed prefill gained (0.943-0.979). The
# one-warpgroup fp8 decode tile (dsv3-ep8: 1.006-1.028) and the bf16 tiles
# (dsv3-ep8-gate_up 1.132 / 1.235, dsv3-ep32-gate_up 1.053-1.055,
# qwen3-235b-ep8-gate_up 1.035-1.058; qwen3-30b 0.939-1.000) lost with it.
# A call with completion signals keeps the expert-major order: in the
# n-group-major one every expert's last tile comes at the end of the launch,
# so a combine waiting on the signals has nothing to ship until then (fp8,
# combine on 20 SMs, `bench_overlap.py`: overlapped / longer alone went from
# 1.043-1.220x to 1.156-1.687x, dsv3-ep32-down 1.687x). In an MoE layer only
# the down projection is followed by the combine; gate_up gets n_major.
# Windows of 2 or 4 experts, each numbered n-group first, ran faster alone
# but made GEMM plus combine slower on all four cases timed (dsv3-ep32-down
# 71.8 us with W=2 and 77.6 with W=4, against 68.7 expert-major), so a call
# with signals gets windows of one expert (FP8_SIGNAL_WINDOW).
FP8_MID_CONFIG = dataclasses.replace(MID_CONFIG, tile_k=128, promote_overlap=True, n_major=True)
FP8_MID_N64_CONFIG = dataclasses.replace(
    DECODE_128_CONFIG, tile_k=128, l2_hints=False, promote_overlap=True, n_major=True
)
# Prefill splits a last round that is at most half full (split_last_round)
# instead of balancing it. Paired A/B against the balanced tile (H100,
# 2026-11-24, `ab_revision.py --set split_last_round=1`, bit-identical
# outputs), uniform / skewed routing: dsv3-prefill-gate_up (8.24 rounds)
# 0.904 / 0.966, dsv3-prefill-down (16.12 rounds) 0.986 / 1.008, E2 m300
# N4096 K4096 0.894; where no round was cut 0.969-1.009 (dense-like 0.994 /
# 0.969). Calls with signals keep the balanced tile.
# Prefill tiles with K up to 2048 are 192 wide with one product set: fewer,
# longer tiles, so fewer epilogues and pipeline refills per FLOP. Paired A/B
# against 128x128 with two product sets (H100, 2026-11-24, `ab_revision.py
# --dtype fp8`, runs of 6-8 rounds, bit-identical outputs), uniform routing:
# dsv3-prefill-down (K 2048) 0.949-0.960, E8 m512 N7168 K2048 0.955-0.976,
# E16 m384 N4096 K1536 0.961-0.972, E16 m512 N1536 K2048 0.958 (skewed
# 0.969-1.015); with K 7168 the two tiles tie or the wider loses:
# dsv3-prefill-gate_up 0.988-1.012, dense-like 0.982-1.050, E8 m512 N4096
# K7168 0.979-1.008 (docs/benchmarks.md, fifteenth session; since the
# twenty-third session's leaner loop the wider tile wins there too, see
# FP8_WIDE_ROUND_SLACK). In
# steady state the wider tile moves fewer shared-memory bytes per FLOP (TMA
# writes plus wgmma reads, per cycle at the tensor cores' rate: 160 B for
# 128x128, 139 for 128x192, the SM's limit 128), but with one product set
# the tensor cores wait during each promotion; on long K the two came out
# even (not profiled). Making the two warpgroups issue their chains strictly
# in turn (a pair of named barriers) gave 128x192 1.044 / 0.980 / 1.098 on
# the three dsv3 cases against 1.015 / 0.954 / 1.118 without (one run of 3
# rounds) and was dropped.
# The 192-wide tile needed the promotion's weight scale picked per column
# block at trace time: with a select per value (the tile straddles a
# 128-column scale block) the same A/B had read 1.29-1.49.
# The wider tile also makes each round of the grid coarser: with E2 m600 N2048
# K7168 (one round) skewed routing put one expert's 2048 rows on the grid and
# the 192-wide tiles ran 1.466x the 128-wide ones' time (two whole rounds
# against two and a half split ones), while uniform routing gave 0.890. So
# the 192-wide tile is taken only where the host expects at least
# FP8_WIDE_MIN_ROUNDS rounds of it (``fp8_prefill_wide``).
# The 192-wide tile stages its whole output tile before the store warp takes
# it (epi_whole_tile): two named barriers per tile instead of twelve, for
# 32 KiB more staging and one stage fewer (4). Paired A/B on H100,
# 2026-11-24 (`ab_revision.py --set epi_whole_tile=1 --dtype fp8`, 6 and 10
# rounds, bit-identical outputs), uniform / skewed routing: dsv3-prefill-down
# 0.955-0.956 / 0.958-0.964, E8 m512 N7168 K2048 0.966 / 0.964-0.965, E16
# m384 N4096 K1536 0.970 / 0.971, E16 m512 N1536 K2048 0.990 / 0.986. The
# 128-wide long-K tile tied (dsv3-prefill-gate_up 0.991-1.000 / 0.980-0.995,
# dense-like 0.990-1.052 / 0.972-0.996, E8 m512 N4096 K7168 0.994 / 1.002;
# one stage fewer, 5), the fp8 mid tiles, mostly partial tiles, lost
# (dsv3-ep32 1.018-1.041), and bf16 prefill (128x256, 3 stages instead of 4)
# moved by 0.978-1.031: those keep two buffers.
# Since each warpgroup hands its own rows to the store warp (twenty-fourth
# session, epilogue.WarpgroupHandoff) neither waits for the other at the end
# of a tile. Paired A/B on H100, 2026-11-25, uniform / skewed routing: tree
# against the joint handoff (`ab_revision.py --base`, bit-identical outputs),
# dsv3-prefill-down 0.962 / 0.968, dsv3-prefill-gate_up 0.988 / 0.985; and
# the 128-wide tile now gains from the whole-tile staging too (`--set
# epi_whole_tile=1`, 8 rounds): dense-like 0.988 / 0.990, E2 m600 N2048 K7168
# 0.974 / 0.983, E4 m2048 N2048 K4096 0.969 / 0.995. bf16's 128x256 still
# loses with it (one stage fewer, 3): 0.962-0.991 uniform but 0.970-1.111
# skewed (E4 m1024 N2048 K2048 1.111, dsv3-prefill-gate_up 1.034).
# The 192-wide tile issues each k-tile as two 96-wide chains and promotes
# the first while the second runs (promote_parts=2; measurements at
# mainloop.consume_tile_blockscaled).
FP8_PREFILL_CONFIG = dataclasses.replace(
    FP8_MID_CONFIG, tile_n=192, promote_overlap=False, n_major=False, balance_rounds=False,
    split_last_round=True, a_chunk_rows=0, epi_whole_tile=True, promote_parts=2,
)
FP8_PREFILL_N128_CONFIG = dataclasses.replace(
    FP8_PREFILL_CONFIG, tile_n=128, promote_overlap=True, promote_parts=1
)
FP8_WIDE_MIN_ROUNDS = 4
FP8_WIDE_MAX_K = 2048
# Longer K: since the consumer loop runs fewer instructions per k-tile
# (uniform descriptors, 32-bit scale offsets; twenty-third session) the
# 192-wide tile is faster per FLOP there too, and loses only where its
# coarser rounds cost more than that. Paired A/B against 128x128 with two
# product sets (H100, 2026-11-24, `ab_revision.py --set tile_n=192 --set
# promote_overlap=0 --set stages=4 --set epi_whole_tile=1`, uniform routing;
# expected rounds 192 / 128 in brackets): dsv3-prefill-gate_up 0.960-0.976
# (6 / 9), E8 m512 N4096 K7168 0.960 (6 / 9), E16 m384 N4096 K7168 0.987
# (10 / 14), E8 m768 N3072 K4096 0.941 (7 / 10), E4 m2048 N4096 K7168
# 0.964 (11 / 16), dense-like 1.043-1.057 (6 / 8). A 192-wide unit does 1.5
# narrow ones' work, so the wide tile is taken where its rounds cost at most
# FP8_WIDE_ROUND_SLACK times the narrow tile's (dense-like: 9 / 8 = 1.125).
FP8_WIDE_ROUND_SLACK = 1.1
# Calls with signals: the expert-major order, found by the n-major walker
# (n_major_window=1). Paired A/B on H100, 2026-11-24 (`ab_revision.py --set
# n_major_window=1` against the expert-major walker, bit-identical outputs),
# uniform / skewed routing: qwen3-30b 0.927 / 0.947, qwen3-235b-ep8-down
# 0.982 / 0.988, dsv3-ep32 0.992-0.996. Same order, so the same overlap with
# a combine (`bench_overlap.py --dtype fp8`: GEMM plus combine within 0.5%).
FP8_SIGNAL_WINDOW = 1
_FP8_MID_TILES = tuple(
    dataclasses.replace(c, l2_hints=hints, n_major_window=window)
    for c in (FP8_MID_CONFIG, FP8_MID_N64_CONFIG) for hints in (False, True)
    for window in (0, FP8_SIGNAL_WINDOW)  # without and with signals
)
_FP8_REGIME_CONFIGS = (FP8_DECODE_CONFIG, FP8_DECODE_N64_CONFIG) + _FP8_MID_TILES + tuple(
    c for p in (FP8_PREFILL_CONFIG, FP8_PREFILL_N128_CONFIG)
    for c in (p, dataclasses.replace(p, split_last_round=False, balance_rounds=True))  # with signals
)


def _with_single_cta(configs):
    return configs + tuple(dataclasses.replace(c, cluster_n=1) for c in configs)  # num_sms == 1


HEURISTIC_CONFIGS: tuple[GemmConfig, ...] = _with_single_cta(_REGIME_CONFIGS)
FP8_HEURISTIC_CONFIGS: tuple[GemmConfig, ...] = _with_single_cta(_FP8_REGIME_CONFIGS)


def wave_efficiency(cfg: GemmConfig, num_experts: int, expected_m: int, n: int, num_sms: int) -> float:
    """Share of the persistent grid's rounds that is busy, for the units the
    host expects: m_e varies around expected_m (the benchmark draws +-30%), so
    an expert whose mean fills a tile spills into a second m-block about half
    the time: expected_m / tile_m + 0.5 m-blocks per expert, at least one."""
    m_blocks = max(1.0, expected_m / cfg.tile_m + 0.5)
    units, rounds = _units_and_rounds(cfg, num_experts, m_blocks, n, num_sms)
    return units / (rounds * cfg.n_clusters(num_sms))


def _units_and_rounds(cfg: GemmConfig, num_experts: int, m_blocks: float, n: int, num_sms: int):
    """Units of work of num_experts experts holding m_blocks m-blocks each on
    average, and the rounds of the persistent grid they take. The two
    estimates above and below differ only in how they count m_blocks."""
    units = max(1, round(num_experts * m_blocks * cfg.n_groups(n)))
    return units, -(-units // cfg.n_clusters(num_sms))


def expected_rounds(cfg: GemmConfig, num_experts: int, expected_m: int, n: int, num_sms: int) -> int:
    """Rounds of the persistent grid for the units the host expects, with m_e
    spread evenly over expected_m * [0.7, 1.3] (the benchmark's draw)."""
    lo, hi = 0.7 * expected_m, 1.3 * expected_m
    m_blocks, edge = 1.0, cfg.tile_m  # every expert has at least one m-block
    while edge < hi:  # the share of experts past each further m-block edge
        m_blocks += (hi - max(edge, lo)) / (hi - lo)
        edge += cfg.tile_m
    return _units_and_rounds(cfg, num_experts, m_blocks, n, num_sms)[1]


def mid_192_wide_wins(num_experts: int, expected_m: int, n: int, num_sms: int) -> bool:
    """bf16, expected_m 97..144: 192x128 tiles when their rounds, each costing
    2 * WIDE_UNIT_COST rounds of 192x64 tiles, take less time."""
    wide = expected_rounds(MID_192_N128_CONFIG, num_experts, expected_m, n, num_sms)
    narrow = expected_rounds(MID_192_CONFIG, num_experts, expected_m, n, num_sms)
    return 2 * WIDE_UNIT_COST * wide < narrow


def fp8_prefill_wide(num_experts: Optional[int], expected_m: int, n: int, k: int, num_sms: int) -> bool:
    """fp8, expected_m over 256: 128x192 tiles where the host expects at
    least FP8_WIDE_MIN_ROUNDS rounds of them (which needs ``num_experts``),
    and, when K is over FP8_WIDE_MAX_K, their rounds (each 1.5 narrow ones)
    cost at most FP8_WIDE_ROUND_SLACK times those of 128x128 tiles."""
    if not num_experts:
        return False
    wide = expected_rounds(FP8_PREFILL_CONFIG, num_experts, expected_m, n, num_sms)
    if wide < FP8_WIDE_MIN_ROUNDS:
        return False
    if k <= FP8_WIDE_MAX_K:
        return True
    narrow = expected_rounds(FP8_PREFILL_N128_CONFIG, num_experts, expected_m, n, num_sms)
    return 1.5 * wide <= FP8_WIDE_ROUND_SLACK * narrow


def choose_config(
    expected_m: Optional[int],
    max_m: int,
    n: int,
    k: int,
    num_sms: int,
    fp8: bool = False,
    num_experts: Optional[int] = None,
    signals: bool = False,
) -> GemmConfig:
    """Pick a configuration from host-side facts only (never reads masked_m).
    ``signals``: the call publishes completion signals (the fp8 mid tiles then
    keep the expert-major order, walked by the n-major scan with windows of
    one expert, so experts finish one after another; the prefill tiles run
    their last round unsplit).

    From the config sweeps of scripts/bench.py on H100 (2026-11-22, CUDA-graph
    timings, docs/benchmarks.md):
    * expected_m 32: 64x64 tiles (dsv3-ep8 gate_up 654.7 us vs 664.2 for 64x128,
      down 333.4 vs 338.4, same run; 64x128 had beaten 128x128, 664 vs 691);
    * expected_m 64 (m_e 44..83): 128x64 (qwen3-235b-ep8 gate_up 155.9 vs 172.2 us
      for 64x128, down 81.8 vs 86.7; qwen3-30b 46.3 vs 45.4, a 2% loss);
    * expected_m 97..144 (dsv3-ep32: m_e 89..166): 192x64 with three consumer
      warpgroups, one m-block per expert. Since partial tiles leave in 16-byte
      pieces it beat 128x128 on dsv3-ep32-down in both sweeps (99.2 vs
      104.3-107.3 us; 99.6 vs 102.1; before that change: 114.9 vs 115.4 and
      115.3 vs 113.5), and tied or won gate_up (189.1 vs 185.3-189.8; 194.7 vs
      198.5; 194.9 vs 199.1). 192x128 won gate_up (188.1) but lost down (129.5
      vs 113.5); since 2026-11-24 it is taken where its rounds of the grid are
      fewer (``mid_192_wide_wins``: dsv3-ep32-gate_up 0.958). 145..256: 128x128
      (dsv3-ep32 gate_up 198.5 us vs 208.5 for 128x64 and 239.1 for 64x128);
    * expected_m 1024: 128x256 (dsv3-prefill gate_up 435 vs 457 us for 128x128),
      with a last round at most half full split into half units (bf16 and fp8,
      ``split_last_round``, measured 2026-11-24).

    The three decode tiles (expected_m <= 144) load the weights evict-first
    and the activations evict-last (``l2_hints``). A/B on H100, 2026-11-23,
    each (case, config) in its own process after an L2 flush, twice, the two
    runs within 0.2 us: qwen3-30b-ep8 42.9 -> 40.1 us, qwen3-235b-ep8 gate_up
    152.3 -> 149.7 and down 78.8 -> 76.3, dsv3-ep32-down 97.9 -> 95.7,
    dsv3-ep8-down 333.3 -> 329.3. (Timed in one process after a hinted kernel,
    an unhinted one inherits L2 lines marked evict-last, which biased the
    earlier in-process comparisons.)

    fp8 (`bench.py --dtype both --sweep`, same day, after partial tiles moved to
    16-byte stores): 64x128 with one consumer warpgroup for expected_m 32
    (dsv3-ep8 gate_up 340.7 us vs 359.4 for 128x128, down 183.2 vs 196.6), 64x64
    from K 4096 on (``FP8_DECODE_N64_CONFIG``, measured 2026-11-24); 128x128
    from expected_m 64 up (qwen3-235b-ep8 gate_up 81.3 vs 87.3 for 64x128, down
    45.6 vs 48.1; dsv3-ep32 down 60.1 vs 61.3, gate_up 100.8 vs 111.1;
    dsv3-prefill gate_up 247-272 vs 351). Up to expected_m 256, 128x64 replaces
    128x128 when its rounds are much fuller (``wave_efficiency`` 0.15 higher,
    which needs ``num_experts``): qwen3-30b-ep8 (96 units of 128x128 on 66
    clusters, 1.45 rounds) 25.6 vs 28.3 us; where both fill their rounds
    128x128 stays ahead (dsv3-ep32 gate_up 100.5 vs 116.9, qwen3-235b-ep8 down
    44.8 vs 47.0), since 64-wide tiles re-read A twice as often. Where every
    expert should fit one 128-row m-block (expected_m <= 98), fp8 loads the
    weights evict-first and the activations evict-last (``l2_hints``):
    qwen3-235b-ep8-down 41.4 vs 44.0 us, qwen3-30b 23.1 vs 24.7 (128x64),
    qwen3-235b-ep8-gate_up 79.7 vs 79.8 (same run); and the 64x128 decode tile
    (separate processes, as for bf16, twice: dsv3-ep8 gate_up 337.3 -> 335.0 us,
    down 175.7 -> 173.1). The 128x128 tile is hinted as well where an expert
    spans at most two m-blocks that run in the same round (same A/B:
    dsv3-ep32-down 59.8 -> 56.4 us, gate_up 100.1 -> 97.9; 56 and 32 units per
    expert on 66 clusters). An earlier in-process sweep had seen bf16 64x128
    tiles lose with hints on dsv3-ep32 (three m-blocks per expert), so the
    rule stops at two. Prefill takes 128x192 tiles with one product set where
    at least 4 rounds of them are expected and, on K over 2048, their rounds
    are not much coarser than 128x128 ones (``fp8_prefill_wide``;
    dsv3-prefill-down 0.949-0.960 of 128x128, dsv3-prefill-gate_up
    0.960-0.976, H100, 2026-11-24, measurements above FP8_PREFILL_CONFIG and
    FP8_WIDE_ROUND_SLACK).
    """
    m = max_m if expected_m is None else max(1, min(int(expected_m), max_m))
    if fp8:
        cfg = FP8_DECODE_CONFIG if m <= 48 else FP8_MID_CONFIG if m <= 256 else FP8_PREFILL_CONFIG
        if cfg is FP8_PREFILL_CONFIG and not fp8_prefill_wide(num_experts, m, n, k, num_sms):
            cfg = FP8_PREFILL_N128_CONFIG
        if cfg is FP8_DECODE_CONFIG and k >= FP8_DECODE_N64_MIN_K:
            cfg = FP8_DECODE_N64_CONFIG
        if cfg is FP8_MID_CONFIG and num_experts:
            wide = wave_efficiency(FP8_MID_CONFIG, num_experts, m, n, num_sms)
            narrow = wave_efficiency(FP8_MID_N64_CONFIG, num_experts, m, n, num_sms)
            if narrow - wide >= 0.15:
                cfg = FP8_MID_N64_CONFIG
        if m * 1.3 <= cfg.tile_m or (
            m * 1.3 <= 2 * cfg.tile_m and 2 * cfg.n_groups(n) <= cfg.n_clusters(num_sms)
        ):
            # Load weights evict-first, activations evict-last where every
            # expert fits one m-block (m_e up to expected_m + 30%), so no second
            # CTA re-reads a weight tile, or two m-blocks whose units all fit
            # one round of the grid, so the second read of a weight tile comes
            # while the first is still in L2.
            cfg = dataclasses.replace(cfg, l2_hints=True)
        if signals and cfg.n_major:
            cfg = dataclasses.replace(cfg, n_major_window=FP8_SIGNAL_WINDOW)
    elif m <= 48:
        cfg = DECODE_CONFIG
    elif m <= 96:
        cfg = DECODE_128_CONFIG
    elif m <= 144:
        wide = num_experts and mid_192_wide_wins(num_experts, m, n, num_sms)
        cfg = MID_192_N128_CONFIG if wide else MID_192_CONFIG
    elif m <= 256:
        cfg = MID_CONFIG
    else:
        cfg = PREFILL_CONFIG
    if signals and cfg.split_last_round:
        # A split tile's halves finish on two CTAs, and a signal counts tiles.
        # The fp8 tile balances its last round instead, as it did before.
        cfg = dataclasses.replace(cfg, split_last_round=False, balance_rounds=fp8)
    if num_sms < cfg.cluster_n:
        cfg = dataclasses.replace(cfg, cluster_n=1)
    return cfg
