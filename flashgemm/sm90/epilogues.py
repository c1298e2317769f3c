"""The sm_90 device code of each epilogue family (``flashgemm.epilogue``):
one class per family, each built as ``cls(tiled_mma, accumulators, sD,
gD_mem, tile_mn, out_dtype, consumer_tidx, epi_barrier, consumer_barrier,
epi_tile, handoff, target)`` once per consumer thread, each with
``store(expert, m_block, n_block, valid_rows, n_total, sig_pipeline,
sig_state, half, tile_count)`` returning the signal-pipeline state."""

from __future__ import annotations

from ..epilogue import Epilogue
from .act_epilogue import SwigluEpilogue
from .combine_epilogue import CombineEpilogue
from .epilogue import TileEpilogue

DEVICE = {"store": TileEpilogue, "combine": CombineEpilogue, "swiglu": SwigluEpilogue}


def tile_epilogue(epilogue: Epilogue):
    """The device class of ``epilogue``."""
    return DEVICE[epilogue.op.family]
