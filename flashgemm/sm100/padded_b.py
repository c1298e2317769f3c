"""MXFP4 weights as ``kind::mxf8f6f4``'s B: the TMA that unpacks them.

The f8f6f4 MMA kinds read a 4-bit operand from shared memory padded: each
16 e2m1 codes (8 bytes of a packed row) in 16 bytes, their 8 bytes first
(PTX ``.b4x16_p64``). The TMA writes that form itself from the packed
weights when its tensor map's data type is ``CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B``,
which the DSL's TMA atoms do not offer, so B gets a tensor map of its own
(``cutlass.experimental.cuda``) and a plain ``cp.async.bulk.tensor`` per
stage. A padded k-tile of 128 codes is 128 bytes per row, so B's stage has
the shared-memory layout (and MMA descriptors) of an 8-bit operand. In a CTA
pair each CTA loads its half of the rows onto the leader's barrier, as the
DSL's 2-SM TMA atoms do for MXFP8.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.experimental import primitives as prims
from cutlass.experimental.cuda import TensorMapDataFormat, TensorMapSwizzle, create_tensor_map_tiled_from_view

# the padded format's box is one 64-byte packed row piece: 128 codes of K
PADDED_BOX_K = 128
# bit 24 of a CTA pair's shared-memory address names the CTA: cleared, the
# peer's address of a barrier is the leader's (as the DSL's 2-SM TMA atoms do)
LEADER_MASK = 0xFEFFFFFF


def padded_b_descriptor(mB: cute.Tensor, mma_tiler, pair: int):
    """The tensor map of B (E, N, K) e2m1, K contiguous: a (tile_n / pair,
    128) box of an expert (each CTA of a pair loads its half of the tile's
    rows), unpacked to 16-byte groups with the 128-byte swizzle (what
    ``make_smem_layout_b`` gives an 8-bit K-major stage)."""
    if cutlass.const_expr(mma_tiler[2] != PADDED_BOX_K):
        raise ValueError(f"padded e2m1 B needs k-tiles of {PADDED_BOX_K}, got {mma_tiler[2]}")
    return create_tensor_map_tiled_from_view(
        mB, (1, mma_tiler[1] // pair, PADDED_BOX_K), stride_order=(2, 1, 0),
        swizzle=TensorMapSwizzle.s128b, tma_format=TensorMapDataFormat.B4X16_P64,
    )


@cute.jit
def prefetch_padded_b(desc):
    """Warm B's descriptor (one lane of the TMA warp)."""
    with cute.arch.elect_one():
        prims.prefetch_tensormap(desc.get_ptr())


@cute.jit
def load_padded_b(desc, sB_stage: cute.Tensor, k_tile, n_block, expert, tile_n: cutlass.Constexpr,
                  pair: cutlass.Constexpr, cta_v, mbar):
    """This CTA's stage of B: k-tile ``k_tile`` of its tile_n / pair rows from
    ``n_block * tile_n + cta_v * tile_n / pair`` on, of ``expert``, into
    ``sB_stage``; completes their packed bytes (64 a row) on ``mbar``, in a
    pair on the leader CTA's barrier (``.cta_group::2`` routes it)."""
    coords = [k_tile * PADDED_BOX_K, n_block * tile_n + cta_v * (tile_n // pair), expert]
    with cute.arch.elect_one():
        if cutlass.const_expr(pair == 1):
            prims.cp_async_bulk_tensor_shared_cta_global(sB_stage.iterator, desc.get_ptr(), coords, mbar)
        else:
            # .cta_group::2: this CTA's smem, the leader's barrier (the raw op:
            # the wrapper's pair path wants an Array barrier)
            dst = llvm.addrspacecast(llvm.PointerType.get(cute.AddressSpace.dsmem.value),
                                     sB_stage.iterator.llvm_ptr)
            prims.dialect.cp_async_bulk_tensor_shared_cluster_global(
                dst, desc.get_ptr(), [Int32(c) for c in coords], mbar.raw_ptr() & Int32(LEADER_MASK), [],
                group=nvvm.CTAGroupKind.CTA_2)
