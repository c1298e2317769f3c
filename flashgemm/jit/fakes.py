"""Fake tensors for compiling without a GPU (cutlass imported lazily: the
arch must be set first, ``arch.ensure_arch_env``)."""

from __future__ import annotations


def row_major(dtype, shape, align: int = 4):
    """A compact fake tensor of ``shape`` (symbolic extents allowed), last
    dimension contiguous, base aligned to ``align`` bytes."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align)
