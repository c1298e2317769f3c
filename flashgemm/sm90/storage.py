"""The CTA's shared memory of the sm_90a GEMM, as a struct (plain Python:
its fields differ by dtype and configuration)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..config import GemmConfig, Tail, TileOrder
from ..schedule.dynamic import FEED_STAGES
from .epilogue import SIGNAL_STAGES

MAX_CONVERTER_WARPS = 8
# the converter teams' e4m3 tables: 4 teams at most, 16 tables of two words each (``converter``)
CONVERTER_TABLE_WORDS = 4 * 16 * 2


def shared_storage(config: GemmConfig, ab, out, stages, a_layout, b_layout, d_layout, sfa_layout, sfb_layout,
                   blockwise: bool, row_max_exchange: bool = False, converted_tile_n: int = 0, tile_k: int = 128):
    """The ring (A, B and their mbarriers; for fp8 the slots' scales), the
    output staging, the signal handoff's mbarriers, and what the balance
    rule, the dynamic order, the fused fp8 SwiGLU's row-maximum exchange
    (``act_epilogue``) and MXFP4 weights (``converted_tile_n``: the
    exponents of the (tile_n, tile_k) tiles and the converted barriers; the
    packed tiles land in sB, ``converter``) add."""
    a_size, b_size = cute.cosize(a_layout), cute.cosize(b_layout)
    d_size = cute.cosize(d_layout)
    sfa_size = cute.cosize(sfa_layout) if blockwise else 4
    sfb_size = cute.cosize(sfb_layout) if blockwise else 4
    fields = {  # (built explicitly: annotations are strings under postponed evaluation)
        "ab_mbar": cute.struct.MemRange[cutlass.Int64, stages * 2],
        "sig_mbar": cute.struct.MemRange[cutlass.Int64, SIGNAL_STAGES * 2],
        "sA": cute.struct.Align[cute.struct.MemRange[ab, a_size], 1024],
        "sB": cute.struct.Align[cute.struct.MemRange[ab, b_size], 1024],
        "sD": cute.struct.Align[cute.struct.MemRange[out, d_size], 1024],
        "sSFA": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, sfa_size], 128],
        # block-scaled fp8: each slot's weight scales, copied in by the producer
        "sSFB": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, sfb_size], 16],
    }
    if converted_tile_n:
        fields["conv_mbar"] = cute.struct.MemRange[cutlass.Int64, stages]
        fields["sBsf"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, converted_tile_n * tile_k // 32 * stages], 128]
        # the converter warps' exponent maxima, per slot parity (``converter``)
        fields["conv_max"] = cute.struct.Align[cute.struct.MemRange[Int32, 2 * MAX_CONVERTER_WARPS], 16]
        # each team's e4m3 tables by shift (``converter``)
        fields["conv_tables"] = cute.struct.Align[cute.struct.MemRange[Int32, CONVERTER_TABLE_WORDS], 16]
    if config.tail is Tail.BALANCE and config.order is not TileOrder.N_MAJOR:
        fields["active"] = cute.struct.MemRange[Int32, 1]  # the producer's count
    if config.order is TileOrder.DYNAMIC:
        fields["feed_mbar"] = cute.struct.MemRange[cutlass.Int64, 2 * FEED_STAGES]
        fields["feed_slots"] = cute.struct.Align[cute.struct.MemRange[Int32, FEED_STAGES], 16]
    if row_max_exchange:
        # per tile parity: the peer's row maxima, and one mbarrier per consumer warpgroup
        fields["amax_mbar"] = cute.struct.MemRange[cutlass.Int64, 2 * config.consumer_warpgroups]
        fields["peer_amax"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * config.tile_m], 16]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
