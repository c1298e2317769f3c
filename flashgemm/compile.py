"""JIT compilation and the compile cache (in-process, then on disk).

Kernels are compiled from fake tensors whose extents (E, max_m, N, K) and
strides are symbolic, so one compiled object serves every shape: only the
dtypes, the configuration and the target arch change the generated code, and
those (with the package and DSL versions and a digest of the package's
sources) form the cache key. masked_m is
data, so a new token distribution never recompiles.

Compiled objects take torch tensors directly through TVM-FFI and launch on
torch's current stream.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import threading
from typing import Callable, Dict, Optional

from . import diskcache
from .config import CLAIM_COUNTER_INTS, GemmConfig

# Every compile the process made, by key (tests count them).
_cache: Dict[tuple, Callable] = {}
_lock = threading.Lock()
compile_count = 0


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


def source_digest(package_dir: Optional[str] = None) -> str:
    """sha256 (16 hex digits) of the package's Python sources, which generate
    the device code: a development build or a patched install with an
    unchanged version number must never load a kernel built from other code."""
    import hashlib

    package_dir = package_dir or os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in sorted(os.listdir(package_dir)):
        if name.endswith(".py"):
            h.update(name.encode() + b"\0")
            with open(os.path.join(package_dir, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _versions() -> tuple[str, str, str]:
    # importlib.metadata scans site-packages (~0.1 ms): once per process, not per call
    import importlib.metadata as md

    from . import __version__

    try:
        dsl_version = md.version("nvidia-cutlass-dsl")
    except md.PackageNotFoundError:  # pragma: no cover
        dsl_version = "unknown"
    # (~0.3 ms for the package's files, once per process)
    return __version__, dsl_version, source_digest()


def cache_key(
    config: GemmConfig, ab_dtype: str, out_dtype: str, arch: str, signal_mode: Optional[str] = None
) -> tuple:
    return (*_versions(), arch, ab_dtype, out_dtype, config, signal_mode)


def _cutlass_dtype(name: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8e4m3": cutlass.Float8E4M3FN}[name]


def _fake_args(ab_dtype, out_dtype):
    """Fake (E, max_m, K) / (E, N, K) / (E, max_m, N) / (E,) tensors with symbolic
    extents and 16-byte-aligned symbolic strides (the TMA requirement)."""
    import cutlass
    import cutlass.cute as cute

    def ld(dtype):  # a stride in elements that is a multiple of 16 bytes
        return cute.sym_int64(divisibility=128 // dtype.width)

    e, m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    fake = cute.runtime.make_fake_tensor
    a = fake(ab_dtype, (e, m, k), (ld(ab_dtype), ld(ab_dtype), 1), assumed_align=16)
    b = fake(ab_dtype, (e, n, k), (ld(ab_dtype), ld(ab_dtype), 1), assumed_align=16)
    d = fake(out_dtype, (e, m, n), (ld(out_dtype), ld(out_dtype), 1), assumed_align=16)
    masked_m = fake(cutlass.Int32, (e,), (1,), assumed_align=4)
    signals = fake(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)
    sfa = sfb = None
    if ab_dtype.width == 8:
        f32 = cutlass.Float32
        kb, nb = cute.sym_int(), cute.sym_int()
        # activation scales (E, max_m, K/128), M contiguous, TMA-aligned strides;
        # weight scales (E, N/128, K/128) read element-wise: any strides
        sfa = fake(f32, (e, m, kb), (ld(f32), 1, ld(f32)), assumed_align=16)
        sfb = fake(f32, (e, nb, kb), (cute.sym_int64(), cute.sym_int64(), cute.sym_int64()), assumed_align=4)
    return a, b, d, masked_m, signals, sfa, sfb


@contextlib.contextmanager
def _compile_options(keep_ptx: bool):
    """TVM-FFI compile options. With keep_ptx the DSL writes the PTX to a file
    named after the function (the same name for every config) and reads it back
    into ``__ptx__``: give each build a private directory, so concurrent builds
    (two test runs, two processes) never read each other's PTX."""
    if not keep_ptx:
        yield "--enable-tvm-ffi"
        return
    with tempfile.TemporaryDirectory(prefix="flashgemm-ptx-") as dump_dir:
        yield f"--enable-tvm-ffi --keep-ptx --dump-dir {dump_dir}"


def build(
    config: GemmConfig,
    ab_dtype: str = "bf16",
    out_dtype: str = "bf16",
    arch: Optional[str] = None,
    keep_ptx: bool = False,
    signal_mode: Optional[str] = None,
    trace: bool = False,
):
    """Compile one kernel (no caching). Returns the TVM-FFI callable
    ``fn(a, b, out, masked_m, signals, a_scale, b_scale, counter, num_ctas)``
    (``signals`` is None without a ``signal_mode``; the scales are None for
    16-bit operands; ``counter``, an int32 (2,)
    workspace that is zero between launches, only for ``config.dynamic``,
    else None); with ``keep_ptx`` its
    ``__ptx__`` holds the generated PTX. ``signal_mode``: None, "m_block" or
    "expert". ``trace``: a development build whose ``signals`` argument is a
    ``flashgemm.trace`` timeline buffer (never cached)."""
    arch = ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .kernel import MaskedGroupedGemmSm90

    global compile_count
    ab_t, out_t = _cutlass_dtype(ab_dtype), _cutlass_dtype(out_dtype)
    config.validate(ab_t.width // 8, out_t.width // 8)
    gemm = MaskedGroupedGemmSm90(config, ab_t, out_t, signal_mode, trace=trace)
    a, b, d, masked_m, signals, sfa, sfb = _fake_args(ab_t, out_t)
    if signal_mode is None and not trace:
        # no signals tensor to pass: each tensor argument costs the call a
        # DLPack conversion and its checks (about 0.25 us on the H100 host)
        signals = None
    counter = None
    if config.dynamic:
        counter = cute.runtime.make_fake_tensor(cutlass.Int32, (CLAIM_COUNTER_INTS,), (1,), assumed_align=4)
    with _compile_options(keep_ptx) as options:
        fn = cute.compile(
            gemm,
            a,
            b,
            d,
            masked_m,
            signals,
            sfa,
            sfb,
            counter,
            cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    compile_count += 1
    return fn


def get_kernel(
    config: GemmConfig,
    ab_dtype: str = "bf16",
    out_dtype: str = "bf16",
    arch: Optional[str] = None,
    signal_mode: Optional[str] = None,
):
    """The cached compiled kernel for this key (compiled on first use, once per process)."""
    arch = arch or default_arch()
    key = cache_key(config, ab_dtype, out_dtype, arch, signal_mode)
    return _cached(key, lambda: build(config, ab_dtype, out_dtype, arch, signal_mode=signal_mode))


def _cached(key: tuple, compile_fn: Callable):
    """Two-level cache: this process's dictionary, then the disk
    (``diskcache``); two threads asking for one new key compile it once."""
    fn = _cache.get(key)  # lock-free hit: the per-call path
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            fn = diskcache.get_or_build(key, compile_fn)
            _cache[key] = fn
    return fn


def operand_dtype(config: GemmConfig) -> str:
    """The operand dtype a config is built for: a stage is one 128-byte row,
    so tile_k 64 means 16-bit (bf16) operands and 128 means fp8."""
    return "fp8e4m3" if config.tile_k == 128 else "bf16"


def signal_modes_of(config: GemmConfig, modes=(None, "m_block", "expert")) -> tuple:
    """The signal modes among ``modes`` a config can be launched with: a
    ``split_last_round`` config publishes no signals (the launcher refuses)."""
    return tuple(m for m in modes if m is None or not config.split_last_round)


def precompile(
    configs=None,
    *,
    signal_modes=(None, "m_block", "expert"),
    arch: Optional[str] = None,
    cache_dir: Optional[str] = None,
) -> int:
    """Build the kernels a deployment will launch and store them in the disk
    cache (``cache_dir`` or $FLASHGEMM_CACHE_DIR), so serving never compiles.
    ``configs`` defaults to every configuration the heuristic can choose, bf16
    and fp8 (a config's tile_k picks its dtype: 64 bf16, 128 fp8).
    Works without a GPU. Returns the number of kernels now cached."""
    from .config import FP8_HEURISTIC_CONFIGS, HEURISTIC_CONFIGS

    arch = ensure_arch_env(arch or default_arch())
    count = 0
    for cfg in configs or HEURISTIC_CONFIGS + FP8_HEURISTIC_CONFIGS:
        ab = operand_dtype(cfg)
        for mode in signal_modes_of(cfg, signal_modes):
            key = cache_key(cfg, ab, "bf16", arch, mode)
            fn = diskcache.get_or_build(
                key, lambda: build(cfg, ab, "bf16", arch, signal_mode=mode), cache_dir
            )
            _cache[key] = fn
            count += 1
    return count


def build_combine(
    block_m: int, arch: Optional[str] = None, keep_ptx: bool = False, rows_per_item: Optional[int] = None
):
    """Compile the reference combine (``combine.MaskedCombineSm90``), no caching."""
    ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .combine import MaskedCombineSm90
    from .overlap import DEFAULT_ROWS_PER_ITEM

    global compile_count
    # N is a multiple of 8 (validated): rows of out are 16-byte aligned
    e, m, t = cute.sym_int(), cute.sym_int(), cute.sym_int()
    n = cute.sym_int(divisibility=8)
    fake = cute.runtime.make_fake_compact_tensor

    def row_major(dt, shape, align=4):
        return fake(dt, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align)

    with _compile_options(keep_ptx) as options:
        fn = cute.compile(
            MaskedCombineSm90(block_m, rows_per_item or DEFAULT_ROWS_PER_ITEM),
            row_major(cutlass.BFloat16, (e, m, n), 16),
            fake(cutlass.Int32, (e,), assumed_align=4),
            fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4),
            row_major(cutlass.Int32, (e, m)),
            row_major(cutlass.Float32, (e, m)),
            row_major(cutlass.Float32, (t, n)),
            fake(cutlass.Int32, (1,), assumed_align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=options,
        )
    compile_count += 1
    return fn


def get_combine_kernel(block_m: int, rows_per_item: int, arch: Optional[str] = None):
    """The compiled reference combine, cached like the GEMMs."""
    arch = arch or default_arch()
    return _cached(
        (*_versions(), arch, "combine", block_m, rows_per_item),
        lambda: build_combine(block_m, arch, rows_per_item=rows_per_item),
    )
