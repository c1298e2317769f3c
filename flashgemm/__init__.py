"""flashgemm: masked grouped GEMMs for Mixture-of-Experts serving (CuTe DSL, Hopper)."""

from .version import __version__
from .config import GemmConfig, KernelSpec, Operands, Promotion, Staging, Tail, TileOrder
from .api import grouped_gemm_nt_masked, signal_layout
from .sm90.heuristic import choose_config
from .signals import SignalLayout, alloc_signals
from . import reference


def precompile(*args, **kwargs):
    """Build and store kernels ahead of serving (see ``flashgemm.sm90.build.precompile``)."""
    from .sm90.build import precompile as _precompile

    return _precompile(*args, **kwargs)


__all__ = [
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
