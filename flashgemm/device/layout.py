"""Layout views of the kernels' global tensors."""

from __future__ import annotations

import cutlass.cute as cute


def batch_last(t: cute.Tensor) -> cute.Tensor:
    """View a torch-ordered (E, X, Y) tensor as CuTe's (X, Y, E)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 2, 0]))
