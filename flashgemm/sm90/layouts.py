"""The shared-memory layouts and the wgmma of one sm_90a GEMM build (a base
of ``kernel.MaskedGroupedGemmSm90``): A and B per ring stage (B per
converted buffer with MXFP4 weights), the output staging and the store
warp's view of it, the slots' scales, and the shared-storage struct.

Layouts are made inside the traced call (one made on the host side cannot
enter the kernel).
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils.layout import LayoutEnum

from ..config import FP8_SLOT_WEIGHT_SCALES, Staging
from .storage import shared_storage


class GemmLayouts:
    """Layout helpers; the build sets config, tile_mnk, stages,
    ab_dtype, acc_dtype, out_dtype, epi_stages, num_consumer_wg, a_chunk,
    blockwise, row_max_exchange and converted_b."""

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
        if self.config.staging is Staging.WHOLE_TILE:
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
        return shared_storage(self.config, self.ab_dtype, self.out_dtype, self.stages, self.a_smem_layout,
                              self.b_smem_layout, self.d_smem_layout, self._sfa_smem_layout(),
                              self._sfb_smem_layout(), self.blockwise, self.row_max_exchange,
                              self.tile_mnk[1] if self.converted_b else 0, self.tile_mnk[2])
