"""Disk level of the compile cache: compiled kernels as object files.

A compiled TVM-FFI function is exported with ``export_to_c`` to
``<dir>/<sha>.o`` and, where a C compiler is available, linked into
``<sha>.so``. The next process loads the ``.so`` with plain ``tvm_ffi`` after
preloading the DSL's small runtime library: no compile and no import of the
CuTe DSL (0.5-0.8 s of import on the 2-core CPU machine, against ~5 ms for the
load). Without the ``.so`` it falls back to ``cute.runtime.load_module`` on the
object file. ``<sha>`` hashes the full cache key
(package and DSL versions, arch, dtypes, configuration, signal mode), so a
kernel built for another arch or version is simply a different file: a miss,
never a wrong load.

Safety:
* writers export to a private temporary name and ``os.replace`` it into
  place, then write ``<sha>.json`` (key and sha256 of the object) the same
  way; an entry exists only once its json does, so no reader sees half a file;
* an exclusive ``flock`` on ``<sha>.lock`` makes concurrent processes build a
  key once: the second one finds the entry when it gets the lock;
* a json whose key or checksum does not match, or an object that does not
  load, is deleted and rebuilt.

Environment: ``FLASHGEMM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flashgemm`` or
``~/.cache/flashgemm``); ``FLASHGEMM_CACHE`` set to 0, false, no or off (any
case) turns this level off. A directory that cannot be written turns it off
with one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import glob
import hashlib
import json
import os
import shutil
import subprocess
import uuid
import warnings
from typing import Callable, Optional

_OFF = ("0", "false", "no", "off")
_warned = False
load_count = 0  # objects loaded from disk by this process (tests count them)


def cache_dir() -> Optional[str]:
    """The cache directory, or None when the disk level is off."""
    if os.environ.get("FLASHGEMM_CACHE", "1").strip().lower() in _OFF:
        return None
    path = os.environ.get("FLASHGEMM_CACHE_DIR")
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "flashgemm")
    return path


def _digest(key: tuple) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _usable_dir(path: str) -> bool:
    global _warned
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{uuid.uuid4().hex}")
        with open(probe, "w"):
            pass
        os.remove(probe)
        return True
    except OSError as err:
        if not _warned:
            warnings.warn(
                f"flashgemm: cache directory {path!r} is not writable ({err}); "
                "compiled kernels are cached in this process only",
                RuntimeWarning,
                stacklevel=4,
            )
            _warned = True
        return False


@functools.lru_cache(maxsize=None)
def _dsl_runtime() -> Optional[ctypes.CDLL]:
    """Preload the CuTe DSL runtime library (the symbols the exported kernel
    needs) without importing the DSL itself."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for lib in sorted(glob.glob(os.path.join(root, "cu*", "lib", "libcute_dsl_runtime.so"))):
            return ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return None


def _link_shared(obj_path: str, so_path: str) -> bool:
    """Link the exported object into a shared library; False if no C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    try:
        res = subprocess.run([cc, "-shared", "-o", so_path, obj_path], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):  # a broken $CC: keep the object file only
        return False
    return res.returncode == 0


def _load(path: str, name: str, key: tuple, sha: str):
    """The cached function, or None (and the entry removed) if it is unusable."""
    meta_path = os.path.join(path, f"{sha}.json")
    obj_path = os.path.join(path, f"{sha}.o")
    so_path = os.path.join(path, f"{sha}.so")
    if not os.path.exists(meta_path):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("key") != repr(key) or meta.get("sha256") != _sha256_file(obj_path):
            raise ValueError("key or checksum mismatch")
        fn = None
        if meta.get("so_sha256"):
            if _sha256_file(so_path) != meta["so_sha256"]:
                raise ValueError("shared library checksum mismatch")
            if _dsl_runtime():
                import tvm_ffi

                fn = tvm_ffi.load_module(so_path)[name]
        if fn is None:
            import cutlass.cute as cute

            fn = cute.runtime.load_module(obj_path, enable_tvm_ffi=True)[name]
    except Exception:  # corrupt, truncated or foreign entry: rebuild it
        for p in (meta_path, obj_path, so_path):
            with contextlib.suppress(OSError):
                os.remove(p)
        return None
    global load_count
    load_count += 1
    return fn


def _atomic_write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def get_or_build(key: tuple, build: Callable, directory: Optional[str] = None):
    """Load ``key`` from disk, or build it, store it and return it."""
    path = directory or cache_dir()
    if path is None or not _usable_dir(path):
        return build()
    sha = _digest(key)
    name = f"flashgemm_{sha}"
    fn = _load(path, name, key, sha)
    if fn is not None:
        return fn
    with open(os.path.join(path, f"{sha}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fn = _load(path, name, key, sha)  # built by another process meanwhile?
        if fn is not None:
            return fn
        fn = build()
        obj_path = os.path.join(path, f"{sha}.o")
        so_path = os.path.join(path, f"{sha}.so")
        suffix = f".tmp.{os.getpid()}.{uuid.uuid4().hex}"
        tmp_obj, tmp_so = obj_path + suffix, so_path + suffix
        try:
            fn.export_to_c(tmp_obj, name)
            meta = {"key": repr(key), "sha256": _sha256_file(tmp_obj)}
            if _link_shared(tmp_obj, tmp_so):
                meta["so_sha256"] = _sha256_file(tmp_so)
                os.replace(tmp_so, so_path)
            os.replace(tmp_obj, obj_path)
            # the json goes last: an entry exists only once it is complete
            _atomic_write_json(os.path.join(path, f"{sha}.json"), meta)
        except OSError as err:  # disk full, permissions changed: keep the kernel anyway
            for p in (tmp_obj, tmp_so):
                with contextlib.suppress(OSError):
                    os.remove(p)
            warnings.warn(f"flashgemm: could not store a compiled kernel in {path!r}: {err}", RuntimeWarning)
    return fn
