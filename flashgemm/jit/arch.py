"""The compile target, and which arch package serves a GPU.

The CuTe DSL reads ``CUTE_DSL_ARCH`` when cutlass is first imported; without a
GPU it must be set before that, so every build goes through
``ensure_arch_env``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

# compute capability -> the arch package with kernels for it
BACKENDS = {(9, 0): "sm90", (10, 0): "sm100", (10, 3): "sm100"}


@functools.lru_cache(maxsize=None)
def default_arch() -> str:
    """The target: $CUTE_DSL_ARCH if set, else the visible GPU, else sm_90a."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}a"
    except Exception:  # pragma: no cover - torch without CUDA runtime
        pass
    return "sm_90a"


def ensure_arch_env(arch: Optional[str] = None) -> str:
    """Set CUTE_DSL_ARCH before cutlass is imported (needed without a GPU)."""
    arch = arch or default_arch()
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    if os.environ["CUTE_DSL_ARCH"] != arch:
        raise RuntimeError(
            f"CUTE_DSL_ARCH is {os.environ['CUTE_DSL_ARCH']!r} in this process; "
            f"cannot compile for {arch!r} too"
        )
    return arch


@functools.lru_cache(maxsize=None)
def device_facts(index: int) -> tuple[tuple[int, int], int, str]:
    """(compute capability, SM count, name) of CUDA device ``index``."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count, props.name


def backend_name(capability: tuple[int, int]) -> Optional[str]:
    """The arch package for a GPU of this compute capability, or None."""
    return BACKENDS.get(tuple(capability))
