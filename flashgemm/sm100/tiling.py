"""Trace-time tiling of one sm_100 build: the tiled MMAs, the per-stage
shared-memory layouts of A, B and the scale factors, the epilogue sub-tile
and the tensor-memory column map. Built inside ``__call__`` (layouts made on
the host side of a jit function cannot enter the kernel otherwise)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.utils import LayoutEnum

from ..formats import Format
from .config import CtaGroup, Sm100Config
from .limits import EPI_BUFFERS, EPI_N, MMA_INSTS_PER_K_TILE, acc_stages, resolved_stages, sf_tmem_cols


class Tiling:
    """Everything static the kernel derives from its config and dtypes."""

    def __init__(self, config: Sm100Config, ab_dtype, sf_dtype, out_dtype, b_dtype=None):
        self.config = config
        self.ab_dtype = ab_dtype
        self.b_dtype = b_dtype or ab_dtype  # the MMA's B type (e2m1 beside e4m3 A for MXFP4 weights)
        # e2m1 B read by kind::mxf8f6f4 sits in shared memory padded, 16 codes in
        # 16 bytes (the TMA's .b4x16_p64 unpack): the smem layout of an 8-bit B
        self.b_padded = config.fmt is Format.MXFP8_MXFP4
        self.b_smem_dtype = ab_dtype if self.b_padded else self.b_dtype
        self.sf_dtype = sf_dtype
        self.out_dtype = out_dtype
        self.acc_dtype = cutlass.Float32
        self.block_scaled = config.fmt.block_scaled
        self.two_cta = config.cta_group is CtaGroup.TWO
        self.cta_group = tcgen05.CtaGroup.TWO if self.two_cta else tcgen05.CtaGroup.ONE
        self.cluster_shape_mn = (config.cluster_size, 1)
        self.stages = resolved_stages(config)
        self.acc_stages = acc_stages(config)
        self.epi_buffers = EPI_BUFFERS
        self.c_layout = LayoutEnum.ROW_MAJOR
        self.sf_vec = config.fmt.sf_vec_size

    def make_tiled_mma(self, cta_group, mma_mn):
        if cutlass.const_expr(self.block_scaled):
            return sm100_utils.make_blockscaled_trivial_tiled_mma(
                self.ab_dtype, self.b_dtype, OperandMajorMode.K, OperandMajorMode.K,
                self.sf_dtype, self.sf_vec, cta_group, mma_mn,
            )
        return sm100_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, OperandMajorMode.K, OperandMajorMode.K,
            self.acc_dtype, cta_group, mma_mn,
        )

    def setup(self):
        cfg = self.config
        mma_mn = (cfg.tile_m, cfg.tile_n)
        self.tiled_mma = self.make_tiled_mma(self.cta_group, mma_mn)
        inst_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        self.mma_tiler = (cfg.tile_m, cfg.tile_n, inst_k * MMA_INSTS_PER_K_TILE)
        self.cta_tile_mnk = (cfg.cta_tile_m, cfg.tile_n, self.mma_tiler[2])
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma.thr_id.shape,)
        )
        self.a_smem_layout = sm100_utils.make_smem_layout_a(self.tiled_mma, self.mma_tiler, self.ab_dtype, self.stages)
        self.b_smem_layout = sm100_utils.make_smem_layout_b(self.tiled_mma, self.mma_tiler, self.b_smem_dtype,
                                                            self.stages)
        # epilogue sub-tile: all 128 rows of the CTA (one per thread), EPI_N columns
        self.epi_tile = (cfg.cta_tile_m, EPI_N)
        self.c_smem_layout = sm100_utils.make_smem_layout_epi(
            self.out_dtype, self.c_layout, self.epi_tile, self.epi_buffers
        )
        self.acc_cols = cfg.tile_n * self.acc_stages
        if cutlass.const_expr(self.block_scaled):
            # SFB is tiled over N rounded up to the 128-row atom, by one CTA
            # (the scales of both halves of B sit in each CTA's TMEM)
            self.mma_mn_sfb = (cfg.cta_tile_m, cute.round_up(cfg.tile_n, 128))
            self.tiled_mma_sfb = self.make_tiled_mma(tcgen05.CtaGroup.ONE, self.mma_mn_sfb)
            self.mma_tiler_sfb = (*self.mma_mn_sfb, self.mma_tiler[2])
            self.cluster_layout_sfb_vmnk = cute.tiled_divide(
                cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma_sfb.thr_id.shape,)
            )
            self.sfa_smem_layout = blockscaled_utils.make_smem_layout_sfa(
                self.tiled_mma, self.mma_tiler, self.sf_vec, self.stages
            )
            self.sfb_smem_layout = blockscaled_utils.make_smem_layout_sfb(
                self.tiled_mma, self.mma_tiler, self.sf_vec, self.stages
            )
            self.sfa_cols = (cfg.cta_tile_m // 32) * MMA_INSTS_PER_K_TILE
            self.sf_cols = sf_tmem_cols(cfg)
        return self

    def acc_fragment(self):
        """(MMA, MMA_M, MMA_N, ACC_STAGE) accumulator layout in TMEM (no address yet)."""
        acc_shape = self.tiled_mma.partition_shape_C(self.mma_tiler[:2])
        return self.tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))

    def stage_tx_bytes(self) -> int:
        """Bytes the TMA brings into one stage of the whole cluster pair."""
        one = cute.size_in_bytes(self.ab_dtype, cute.slice_(self.a_smem_layout, (None, None, None, 0)))
        b_bytes = cute.size_in_bytes(self.b_smem_dtype, cute.slice_(self.b_smem_layout, (None, None, None, 0)))
        # the transaction counts global bytes: a padded e2m1 tile is half its smem
        one += b_bytes // 2 if self.b_padded else b_bytes
        if cutlass.const_expr(self.block_scaled):
            one += cute.size_in_bytes(self.sf_dtype, cute.slice_(self.sfa_smem_layout, (None, None, None, 0)))
            one += cute.size_in_bytes(self.sf_dtype, cute.slice_(self.sfb_smem_layout, (None, None, None, 0)))
        return one * cute.size(self.tiled_mma.thr_id.shape)
