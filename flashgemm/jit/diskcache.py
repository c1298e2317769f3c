"""Disk level of the compile cache: compiled kernels as object files.

A compiled TVM-FFI function is exported with ``export_to_c`` to
``<dir>/<sha>.o`` and, where a C compiler is available, linked into
``<sha>.so``. The next process loads the ``.so`` with plain ``tvm_ffi`` after
preloading the DSL's small runtime library: no compile and no import of the
CuTe DSL (the import's cost against the load's: docs/design.md). Without the ``.so`` it falls back to ``cute.runtime.load_module`` on the
object file. ``<sha>`` hashes the full cache key
(package and DSL versions, arch, dtypes, configuration, signal mode), so a
kernel built for another arch or version is simply a different file: a miss,
never a wrong load.

Trust: loading a ``.so`` runs its constructors, and the checksums in the json
are written by whoever writes the entry, so they catch damage, not tampering.
The directory is the guard. As ssh does with its keys, the cache refuses a
directory (and each parent it creates, with mode 0700) that is not owned by
this user or root or that group or others may write: it warns once, loads
nothing from it, stores nothing in it and compiles in process. Entry files
(json, object, library) are opened without following symlinks and are used
only if they are regular files of this user or root that group and others
cannot write. In a directory only its owner can write, no one else can swap
a file between the check and the load.

Safety of the entries:
* writers export to a private temporary name, clear its group and other
  write bits and ``os.replace`` it into place, then write ``<sha>.json`` (key
  and sha256 of each file) the same way; an entry exists only once its json
  does, so no reader sees half a file;
* an exclusive ``flock`` on ``<sha>.lock`` (one lock file per entry, opened
  with ``O_NOFOLLOW`` and never truncated) makes concurrent processes build a
  key once: the second one finds the entry when it gets the lock. A waiter
  polls; after ``LOCK_NOTICE_S`` it warns which lock it waits on, and after
  ``FLASHGEMM_CACHE_LOCK_TIMEOUT`` seconds (default ``LOCK_TIMEOUT_S``) it
  compiles in process and stores nothing;
* an entry whose key or checksum does not match, or that does not load, is
  reported once and compiled in process; only the lock holder deletes it
  and stores it anew;
* a ``.so`` that does not load (a ``noexec`` mount, found with ``statvfs``;
  a missing library) is reported once per directory, and the object file is
  loaded through the DSL instead.

Environment: ``FLASHGEMM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flashgemm`` or
``~/.cache/flashgemm``); ``FLASHGEMM_CACHE`` set to 0, false, no or off (any
case) turns this level off; ``FLASHGEMM_CACHE_LOCK_TIMEOUT`` bounds the wait
for another process's build (seconds, ``inf`` for no bound). A directory that
cannot be created turns this level off with one warning; one that cannot be
written (a container image's prebuilt cache) is still read, and nothing is
stored in it (one warning).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import glob
import hashlib
import json
import os
import shutil
import stat
import subprocess
import threading
import time
import uuid
import warnings
from typing import Callable, Optional

_OFF = ("0", "false", "no", "off")
LOCK_TIMEOUT_S = 600.0  # the longest wait for another process's build of a key
LOCK_NOTICE_S = 5.0  # a wait this long is reported
_POLL_S = 0.1
_warned: set = set()  # (what, where) already reported by this process
load_count = 0  # objects loaded from disk by this process (tests count them)
# The CuTe DSL is not known to be thread-safe: its compiles, exports and
# object-file loads run one at a time in a process. Waits on another
# process's lock happen outside it.
_dsl_lock = threading.RLock()


class UntrustedEntry(Exception):
    """A cache entry file that someone other than this user or root could
    have written, or that is not a regular file."""


def cache_dir() -> Optional[str]:
    """The cache directory, or None when the disk level is off."""
    if os.environ.get("FLASHGEMM_CACHE", "1").strip().lower() in _OFF:
        return None
    path = os.environ.get("FLASHGEMM_CACHE_DIR")
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "flashgemm")
    return path


def lock_timeout() -> float:
    """Seconds to wait for another process building the same key."""
    text = os.environ.get("FLASHGEMM_CACHE_LOCK_TIMEOUT", "").strip()
    if not text:
        return LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ValueError(f"FLASHGEMM_CACHE_LOCK_TIMEOUT={text!r}: expected a number of seconds >= 0 (or inf)")
    return value


def untrusted(st: os.stat_result, uid: Optional[int] = None) -> Optional[str]:
    """Why a file or directory with status ``st`` may have been written by
    someone other than ``uid`` (default: this process's user) or root; None
    if it cannot."""
    uid = os.getuid() if uid is None else uid
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by you (uid {uid}) or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "group or others may write it"
    return None


def _warn_once(what: tuple, message: str) -> None:
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _digest(key: tuple) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _describe(key: tuple) -> str:
    text = repr(key)
    return text if len(text) <= 200 else text[:197] + "..."


def _missing_dirs(path: str) -> list:
    """``path`` and those of its parents that do not exist, outermost first."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return missing[::-1]


def _usable_dir(path: str) -> bool:
    """Create ``path`` if it is missing (private, parents included) and say
    whether the cache may read it: a directory that only this user or root
    can write."""
    missing = _missing_dirs(path)
    try:
        for d in missing:
            with contextlib.suppress(FileExistsError):  # another process made it meanwhile
                os.mkdir(d, 0o700)
        checked = [(d, os.stat(d)) for d in dict.fromkeys([*missing, os.path.abspath(path)])]
    except OSError as err:
        _warn_once(("create", path), f"flashgemm: cannot create cache directory {path!r} ({err}); "
                   "compiled kernels are cached in this process only")
        return False
    for d, st in checked:
        if not stat.S_ISDIR(st.st_mode):
            _warn_once(("create", path), f"flashgemm: cache directory {path!r} cannot be used: {d!r} is not a "
                       "directory; compiled kernels are cached in this process only")
            return False
        why = untrusted(st)
        if why is None:
            continue
        fix = f"run `chmod go-w {d}`" if st.st_uid == os.getuid() else "use a directory you own"
        _warn_once(("untrusted", d), (
            f"flashgemm: not using cache directory {d!r} (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): {why}, and a library planted there would run when loaded. "
            f"Compiled kernels are cached in this process only. To use the cache, {fix} or set "
            "FLASHGEMM_CACHE_DIR to a directory only you can write."))
        return False
    return True


def _read_entry(path: str) -> bytes:
    """A cache entry file's bytes; ``UntrustedEntry`` unless it is a regular
    file (not a symlink) that only this user or root can write."""
    try:
        # O_NONBLOCK: a FIFO in its place is refused below instead of blocking the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UntrustedEntry(f"{path} is a symbolic link; expected a regular file") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else untrusted(st)
        if why:
            raise UntrustedEntry(f"{path}: {why} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        return f.read()


def _noexec(path: str) -> bool:
    """Whether ``path`` is on a filesystem mounted ``noexec`` (no ``.so`` maps there)."""
    flag = getattr(os, "ST_NOEXEC", 0)
    try:
        return bool(flag and os.statvfs(path).f_flag & flag)
    except OSError:
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


def _load_entry(path: str, name: str, key: tuple, sha: str):
    """The function of a present entry; raises if it is damaged, foreign,
    untrusted or does not load."""
    obj_path = os.path.join(path, f"{sha}.o")
    so_path = os.path.join(path, f"{sha}.so")
    meta = json.loads(_read_entry(os.path.join(path, f"{sha}.json")))
    if meta.get("key") != repr(key):
        raise ValueError("its json names another key")
    if meta.get("sha256") != hashlib.sha256(_read_entry(obj_path)).hexdigest():
        raise ValueError(f"{obj_path} does not match its checksum")
    fn = None
    if meta.get("so_sha256"):
        if hashlib.sha256(_read_entry(so_path)).hexdigest() != meta["so_sha256"]:
            raise ValueError(f"{so_path} does not match its checksum")
        if _noexec(path):
            _warn_once(("noexec", path), (
                f"flashgemm: cache directory {path!r} is on a filesystem mounted noexec, where no shared "
                "library can be loaded; loading the object files through the CuTe DSL instead (it imports "
                "the DSL, 0.5-0.8 s). Set FLASHGEMM_CACHE_DIR to a directory on an exec mount."))
        elif _dsl_runtime():
            import tvm_ffi

            try:
                fn = tvm_ffi.load_module(so_path)[name]
            except Exception as err:
                _warn_once(("so-load", path), (
                    f"flashgemm: cannot load the cached library {so_path!r} ({err}); loading the "
                    "object files of this cache through the CuTe DSL instead"))
    if fn is None:
        with _dsl_lock:
            import cutlass.cute as cute

            fn = cute.runtime.load_module(obj_path, enable_tvm_ffi=True)[name]
    return fn


def _load(path: str, name: str, key: tuple, sha: str, repair: bool):
    """The cached function, or None. An unusable entry is reported once and,
    by the lock holder (``repair``), removed so that it is rebuilt."""
    meta_path = os.path.join(path, f"{sha}.json")
    if not os.path.lexists(meta_path):
        return None
    try:
        fn = _load_entry(path, name, key, sha)
    except Exception as err:  # corrupt, truncated, foreign or planted
        _warn_once(("entry", meta_path), f"flashgemm: cannot use cache entry {meta_path!r} ({err}); "
                   "compiling the kernel in this process")
        if repair:
            for ext in (".json", ".o", ".so"):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(path, sha + ext))  # a symlink itself, never its target
        return None
    global load_count
    load_count += 1
    return fn


def _acquire(fd: int, lock_path: str, key: tuple) -> bool:
    """Take the exclusive lock on ``fd``, waiting at most ``lock_timeout()``;
    False on timeout."""
    timeout = lock_timeout()
    start = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as err:  # a filesystem without flock
            _warn_once(("flock", lock_path), f"flashgemm: cannot lock {lock_path} ({err}); compiling in this "
                       "process without the disk cache")
            return False
        waited = time.monotonic() - start
        if waited >= timeout:
            warnings.warn(f"flashgemm: gave up after {waited:.0f} s waiting for another process building "
                          f"{_describe(key)} (lock held on {lock_path}); compiling it in this process "
                          "without the disk cache (FLASHGEMM_CACHE_LOCK_TIMEOUT sets the bound)",
                          RuntimeWarning, stacklevel=3)
            return False
        if not told and waited >= LOCK_NOTICE_S:
            bound = f"compiling here after {timeout:.0f} s" if timeout < float("inf") else "no time limit"
            warnings.warn(f"flashgemm: waiting for another process building {_describe(key)} (lock held on "
                          f"{lock_path}); {bound} (FLASHGEMM_CACHE_LOCK_TIMEOUT)", RuntimeWarning, stacklevel=3)
            told = True
        time.sleep(min(_POLL_S, timeout - waited))


def _seal(path: str) -> None:
    """Clear the group and other write bits a umask may have left."""
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def _atomic_write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
    _seal(tmp)
    os.replace(tmp, path)


def _store(path: str, name: str, key: tuple, sha: str, fn) -> None:
    obj_path = os.path.join(path, f"{sha}.o")
    so_path = os.path.join(path, f"{sha}.so")
    suffix = f".tmp.{os.getpid()}.{uuid.uuid4().hex}"
    tmp_obj, tmp_so = obj_path + suffix, so_path + suffix
    try:
        with _dsl_lock:
            fn.export_to_c(tmp_obj, name)
        _seal(tmp_obj)
        meta = {"key": repr(key), "sha256": _sha256_file(tmp_obj)}
        if _link_shared(tmp_obj, tmp_so):
            _seal(tmp_so)
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


def _build(build: Callable):
    with _dsl_lock:
        return build()


def get_or_build(key: tuple, build: Callable, directory: Optional[str] = None):
    """Load ``key`` from disk, or build it, store it and return it."""
    path = directory or cache_dir()
    if path is None or not _usable_dir(path):
        return _build(build)
    sha = _digest(key)
    name = f"flashgemm_{sha}"
    fn = _load(path, name, key, sha, repair=False)
    if fn is not None:
        return fn
    lock_path = os.path.join(path, f"{sha}.lock")
    fd, why_not = None, "no write access"
    if os.access(path, os.W_OK):
        try:
            # no O_TRUNC, no symlink: a planted link must not make us clobber its target
            fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                _warn_once(("lock", lock_path), f"flashgemm: cannot open lock file {lock_path!r} ({err}); "
                           "expected a regular file, not a symlink; compiling in this process without the "
                           "disk cache")
                return _build(build)
            why_not = str(err)
    if fd is None:
        _warn_once(("read-only", path), f"flashgemm: cache directory {path!r} is not writable ({why_not}); "
                   "loading the kernels it holds, compiling the others in this process without storing them")
        return _build(build)
    with os.fdopen(fd, "rb") as lock:
        if _acquire(lock.fileno(), lock_path, key):
            fn = _load(path, name, key, sha, repair=True)  # built by another process meanwhile?
            if fn is None:
                fn = _build(build)
                _store(path, name, key, sha, fn)
            return fn
    return _build(build)  # timed out: the other process stores it
