"""flashgemm: masked grouped GEMMs for Mixture-of-Experts serving (CuTe DSL;
Hopper, and Blackwell with MXFP8 / NVFP4)."""

from .version import __version__
from .config import Epilogue, GemmConfig, KernelSpec, Promotion, Staging, Tail, TileOrder
from .api import grouped_gemm_nt_masked, signal_layout
from .formats import Format
from .sm100.config import Sm100Config
from .sm90.heuristic import choose_config
from .signals import SignalLayout, alloc_signals
from .routing import Combine
from . import reference
from . import torch_ops  # noqa: F401  (registers torch.ops.flashgemm.*)


def precompile(specs=None, *, arch=None, cache_dir=None, progress=False):
    """Build and store every kernel the package can launch on ``arch``
    (default: this GPU's, else sm_90a) ahead of serving, without a GPU (see
    ``flashgemm.sm90.build.precompile`` / ``flashgemm.sm100.build.precompile``);
    on sm_90a with no ``specs`` also the expert-parallel kernels for top-8
    (``flashgemm.ep.combine.precompile`` takes other top-k). Returns how many."""
    from .jit.arch import default_arch

    arch = arch or default_arch()
    if arch.startswith("sm_10"):
        from .sm100.build import precompile as _precompile
    else:
        from .sm90.build import precompile as _precompile
    count = _precompile(specs, arch=arch, cache_dir=cache_dir, progress=progress)
    if specs is None and not arch.startswith("sm_10"):
        from .ep.combine import precompile as _precompile_ep

        count += _precompile_ep(arch=arch, cache_dir=cache_dir)
    return count


__all__ = [
    "Combine",
    "Epilogue",
    "Format",
    "GemmConfig",
    "KernelSpec",
    "Promotion",
    "SignalLayout",
    "Sm100Config",
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
