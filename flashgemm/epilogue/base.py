"""What every epilogue declares (``EpilogueOp``)."""

from __future__ import annotations

import dataclasses

# how each fused combine's rows leave: the PTX feature of its sends (kernels_cli.PTX_FEATURES)
COMBINE_SENDS = frozenset({"combine-reduce", "combine-reduce-bf16", "combine-peer-store"})
# the fused combine's per-expert bias, read in 16-byte loads: the only ones a GEMM issues
COMBINE_BIAS_LOAD = "v4-load"
# what the fused combines' kernels alone show
COMBINE_ONLY = COMBINE_SENDS | {COMBINE_BIAS_LOAD}


@dataclasses.dataclass(frozen=True)
class EpilogueOp:
    """One epilogue.

    name: its ``Epilogue`` value. family: the device code that runs it
    ("store", "combine", "swiglu"). params: the launch slots it fills beyond
    the GEMM's own (``sm90.launch.SLOTS``). writes_out: the tile leaves
    into ``out`` (else into its own target). signals: it can publish
    completion signals (and be traced, and stage whole tiles). rows_dtype:
    the dtype the rows leave in (None: out's). extra_smem: shared memory
    bytes per tile row beyond the output staging. ptx_required /
    ptx_forbidden: the PTX features its kernels must and must not show
    (``kernels_cli.PTX_FEATURES``)."""

    name: str
    family: str
    params: tuple = ()
    writes_out: bool = True
    signals: bool = False
    rows_dtype: str = ""
    extra_smem: int = 0
    ptx_required: frozenset = frozenset()
    ptx_forbidden: frozenset = frozenset()
    fp8_out: bool = False  # the rows leave as fp8 with their 1x128 scales (``out_scale``)

    def smem_bytes(self, tile_m: int) -> int:
        """Shared memory beyond the output staging, for a tile of ``tile_m`` rows."""
        return self.extra_smem * tile_m

    def ptx_ok(self, feats) -> bool:
        feats = set(feats)
        return self.ptx_required <= feats and not self.ptx_forbidden & feats
