"""The compile-cache key: package and DSL versions, a digest of the package's
sources, the target arch, and what the kernel is (``KernelSpec`` or another
tuple). A kernel built from other code, for another arch or by another DSL is
a different key: a miss, never a wrong load."""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Optional

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest(package_dir: Optional[str] = None) -> str:
    """sha256 (16 hex digits) of every Python source under the package,
    subpackages included, which generate the device code: a development build
    or a patched install with an unchanged version number must never load a
    kernel built from other code."""
    package_dir = package_dir or _PACKAGE_DIR
    h = hashlib.sha256()
    files = []
    for root, dirs, names in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files.extend(os.path.join(root, n) for n in names if n.endswith(".py"))
    for path in sorted(files):
        h.update(os.path.relpath(path, package_dir).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def versions() -> tuple[str, str, str]:
    """(package version, DSL version, source digest), once per process
    (importlib.metadata scans site-packages; the digest reads every source)."""
    import importlib.metadata as md

    from ..version import __version__

    try:
        dsl_version = md.version("nvidia-cutlass-dsl")
    except md.PackageNotFoundError:  # pragma: no cover
        dsl_version = "unknown"
    return __version__, dsl_version, source_digest()


def cache_key(arch: str, *what) -> tuple:
    return (*versions(), arch, *what)
