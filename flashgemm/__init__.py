"""flashgemm: masked grouped GEMMs for Mixture-of-Experts serving (CuTe DSL;
Hopper, and Blackwell with MXFP8 / NVFP4)."""

from .version import __version__
from .config import Epilogue, GemmConfig, KernelSpec, Promotion, Staging, Tail, TileOrder
from .api import choose_config, grouped_gemm_nt_masked, signal_layout
from .formats import Format
from .signals import SignalLayout, alloc_signals
from .routing import Combine
from . import reference
from . import torch_ops  # noqa: F401  (registers torch.ops.flashgemm.*)


def precompile(specs=None, *, arch=None, cache_dir=None, progress=False):
    """Build and store every kernel the package can launch on ``arch``
    (default: this GPU's, else sm_90a) ahead of serving, without a GPU: the
    backend's GEMMs (``specs``, or every one its heuristic can reach) and
    its other kernels, and with no ``specs`` also the MoE activations and,
    where the backend has signalled GEMMs, the expert-parallel kernels for
    top-8 (``flashgemm.ep.combine.precompile`` takes other top-k). Returns
    how many."""
    from . import backend
    from .jit.arch import default_arch

    arch = arch or default_arch()
    be = backend.for_arch(arch)
    count = be.precompile(specs, arch=arch, cache_dir=cache_dir, progress=progress)
    if specs is None:
        from .jit import cache
        from .moe.activation import activation_jobs

        for job in activation_jobs(arch):
            cache.store(job.key, lambda job=job: job.build(False), cache_dir)
            count += 1
        if any(e.combines for e in be.epilogues):
            from .ep.combine import precompile as _precompile_ep

            count += _precompile_ep(arch=arch, cache_dir=cache_dir)
    return count


def __getattr__(name):
    # each backend's configuration type, through the registry (flashgemm.Sm100Config)
    if name == "Sm100Config":
        from . import backend

        return backend.get("sm100").config_type
    raise AttributeError(f"module 'flashgemm' has no attribute {name!r}")


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
