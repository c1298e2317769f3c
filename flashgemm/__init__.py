"""flashgemm: masked grouped GEMMs for Mixture-of-Experts serving (CuTe DSL, Hopper)."""

from .version import __version__
from .config import Epilogue, GemmConfig, KernelSpec, Operands, Promotion, Staging, Tail, TileOrder
from .api import grouped_gemm_nt_masked, signal_layout
from .sm90.heuristic import choose_config
from .signals import SignalLayout, alloc_signals
from .routing import Combine
from . import reference
from . import torch_ops  # noqa: F401  (registers torch.ops.flashgemm.*)


def precompile(*args, **kwargs):
    """Build and store kernels ahead of serving (see ``flashgemm.sm90.build.precompile``)."""
    from .sm90.build import precompile as _precompile

    return _precompile(*args, **kwargs)


__all__ = [
    "Combine",
    "Epilogue",
    "GemmConfig",
    "KernelSpec",
    "Operands",
    "Promotion",
    "SignalLayout",
    "Staging",
    "Tail",
    "TileOrder",
    "alloc_signals",
    "choose_config",
    "grouped_gemm_nt_masked",
    "precompile",
    "reference",
    "signal_layout",
    "__version__",
]
