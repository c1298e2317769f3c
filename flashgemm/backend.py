"""The interface every architecture's kernels sit behind, and the registry
that finds them.

An arch package (``flashgemm.sm90``, ``flashgemm.sm100``) holds a module
``backend`` with one ``BACKEND``, an instance of :class:`Backend`. The
arch-neutral code (the top level, ``moe``, ``ep``, ``compat``) reaches an
arch only through :func:`get`, :func:`for_capability` or :func:`for_arch`,
which import it by the name ``jit.arch.BACKENDS`` gives a compute capability:
no arch-neutral module names an arch package (``tests/test_package_structure``).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import sys
import time
from typing import Callable, Iterable, Optional

from .config import Epilogue
from .formats import Format
from .jit.arch import BACKENDS, ensure_arch_env


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One kernel to build ahead of serving: its name, its cache key, a
    builder (``keep_ptx`` -> the compiled function) and the PTX rule its
    listing checks (the features found -> whether the kernel has what it must)."""

    name: str
    key: tuple
    build: Callable[[bool], object]
    check: Callable[[list], bool]


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """A ``grouped_gemm_nt_masked`` call after the arch-neutral checks:
    what a backend needs to make its launch plan."""

    fmt: Format
    sizes: tuple  # (E, max_m, N, K), K in elements
    tensors: dict  # the named tensors: a, b, out, masked_m, a_scale, b_scale, signals, alpha
    routing: tuple  # the fused combine's six fields (token_index, weight, combined, err, peers, bias), or ()
    combine: Optional[object]  # the routing.Combine, or None
    expected_m: Optional[int]
    config: Optional[object]
    granularity: str
    grid_cap: int
    device_index: int
    epilogue: Optional[Epilogue] = None  # a fused epilogue other than the combine's (the SwiGLU of gate_up)


class Backend(abc.ABC):
    """One architecture's kernels: its formats and epilogues, its
    configuration type and heuristic, the kernels it can reach, their
    builds and their launch plans."""

    name: str
    label: str  # the GPUs it serves, in words ("sm_90")
    formats: tuple  # the operand formats it has kernels for
    epilogues: frozenset  # the Epilogue kinds it builds
    config_type: type

    @abc.abstractmethod
    def choose_config(self, fmt: Format, expected_m: Optional[int], max_m: int, n: int, k: int, num_sms: int,
                      num_experts: Optional[int] = None, signals: bool = False,
                      epilogue: Epilogue = Epilogue.STORE):
        """The heuristic's configuration, from host-side facts only."""

    @abc.abstractmethod
    def check_config_arg(self, config, fmt: Format, signals: bool, combine: bool) -> int:
        """A caller's ``config`` of this backend's type, before the device is
        known; returns its CTAs per cluster (``num_sms`` must reach it)."""

    @abc.abstractmethod
    def reachable_specs(self) -> tuple:
        """Every GEMM kernel the heuristic can pick (what precompile builds)."""

    @abc.abstractmethod
    def make_plan(self, call: GemmCall):
        """The ``plan.LaunchPlan`` of a checked call."""

    @abc.abstractmethod
    def signal_layout(self, fmt: Format, num_experts: int, max_m: int, n: int, k: int, expected_m, grid_cap: int,
                      config, granularity: str):
        """The ``SignalLayout`` the same call will use."""

    @abc.abstractmethod
    def gemm_jobs_of(self, specs: Iterable, arch: str) -> list:
        """``CompileJob`` of the given specs."""

    def gemm_jobs(self, arch: str, match: str = "") -> list:
        """``CompileJob`` of every reachable GEMM (whose name contains ``match``)."""
        return self.gemm_jobs_of([s for s in self.reachable_specs() if match in s.name()], arch)

    def kernel(self, spec):
        """The compiled kernel of one spec, cached (memory, then disk)."""
        raise NotImplementedError(f"the {self.name} backend builds no {type(spec).__name__}")

    def signal_block_ms(self, specs: Iterable) -> list:
        """The m-block heights a combine may wait on: the tile_m of every
        signalled kernel among ``specs`` (none for a backend without them)."""
        return []

    def reference_combine(self, block_m: int, rows_per_item: int):
        """The compiled single-GPU reference combine (``flashgemm.overlap``)."""
        raise ValueError(f"the reference combine runs on sm_90 only; this GPU's kernels are {self.name}'s")

    def extra_jobs(self, arch: str, block_ms: list) -> list:
        """Arch kernels beside the GEMMs that precompile builds (the
        reference combine on sm_90)."""
        return []

    def precompile(self, specs=None, *, arch: str, cache_dir=None, progress: bool = False) -> int:
        """Build ``specs`` (default: every reachable GEMM and the arch's
        other kernels) into the disk cache; returns how many."""
        from .jit import cache

        arch = ensure_arch_env(arch)
        if specs is None:
            jobs = self.gemm_jobs(arch)
            jobs += self.extra_jobs(arch, self.signal_block_ms(self.reachable_specs()))
        else:
            jobs = self.gemm_jobs_of(specs, arch)
        t0 = time.perf_counter()
        for i, job in enumerate(jobs):
            cache.store(job.key, lambda job=job: job.build(False), cache_dir)
            if progress:
                print(f"  [{i + 1}/{len(jobs)}] {job.name}  ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
        return len(jobs)


def names() -> tuple:
    """The arch packages with kernels, in the registry's order."""
    return tuple(dict.fromkeys(BACKENDS.values()))


def get(name: str) -> Backend:
    """The backend of arch package ``name`` ("sm90", "sm100")."""
    if name not in names():
        raise ValueError(f"no backend named {name!r}; there are {', '.join(names())}")
    return importlib.import_module(f"{__package__}.{name}.backend").BACKEND


def for_capability(capability: tuple) -> Optional[Backend]:
    """The backend for a GPU of this compute capability, or None."""
    name = BACKENDS.get(tuple(capability))
    return None if name is None else get(name)


def for_arch(arch: str) -> Backend:
    """The backend of a compile target ("sm_90a", "sm_100a", "sm_103a")."""
    digits = arch.removeprefix("sm_").rstrip("af")
    capability = (int(digits[:-1]), int(digits[-1])) if digits.isdigit() and len(digits) >= 2 else None
    backend = for_capability(capability) if capability else None
    if backend is None:
        raise ValueError(f"no backend compiles for {arch!r}")
    return backend


def for_config(config) -> Backend:
    """The backend whose configuration type ``config`` is; TypeError naming
    every backend's type otherwise."""
    found = [get(name) for name in names()]
    for backend in found:
        if isinstance(config, backend.config_type):
            return backend
    kinds = ", ".join(f"a flashgemm.{b.config_type.__name__} ({b.label})" for b in found)
    raise TypeError(f"config must be {kinds} or None, got {type(config).__name__}")


def check_format(backend: Backend, fmt: Format) -> None:
    """Refuse a format the backend has no kernel for, naming both."""
    if fmt not in backend.formats:
        taken = ", ".join(f.value for f in backend.formats) or "none"
        where = "needs a Blackwell GPU (sm_100/sm_103)"
        if fmt in get("sm90").formats:  # (MXFP4 weights: converted in the Hopper kernels only)
            where = "runs on Hopper (sm_90) only"
        hint = {  # MXFP4 weights take another activation recipe on each generation
            Format.FP8_MXFP4: "; on Blackwell, MXFP4 weights go with MXFP8 activations (E8M0 a_scale per 32, "
                              "blocked) and the checkpoint's packed b: flashgemm.mxfp4.blackwell_weights",
            Format.MXFP8_MXFP4: "; on Hopper, MXFP4 weights go with 1x128 fp8 activations (float32 a_scale) or "
                                "bf16, and b from flashgemm.mxfp4.prepare_weights",
        }.get(fmt, "")
        raise ValueError(f"format {fmt.value!r} {where}; this GPU's kernels ({backend.name}) take: {taken}{hint}")
