"""flashgemm: masked grouped GEMMs for Mixture-of-Experts serving (CuTe DSL, Hopper)."""

__version__ = "0.1.0"

from .config import GemmConfig, choose_config  # noqa: E402
from .launcher import grouped_gemm_nt_masked, signal_layout  # noqa: E402
from .signals import SignalLayout, alloc_signals  # noqa: E402
from . import reference  # noqa: E402


def precompile(*args, **kwargs):
    """Build and store kernels ahead of serving (see ``flashgemm.compile.precompile``)."""
    from .compile import precompile as _precompile

    return _precompile(*args, **kwargs)

__all__ = [
    "GemmConfig",
    "SignalLayout",
    "alloc_signals",
    "choose_config",
    "grouped_gemm_nt_masked",
    "precompile",
    "reference",
    "signal_layout",
    "__version__",
]
