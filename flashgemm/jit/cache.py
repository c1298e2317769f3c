"""The in-process level of the compile cache, over the disk level
(``diskcache``): each key is compiled or loaded once per process, and two
threads asking for one new key compile it once. Each key has its own lock, so
a thread waiting for a kernel (another process building it) holds up no other
kernel; compiles themselves still run one at a time (``diskcache``)."""

from __future__ import annotations

import threading
from typing import Callable, Dict

from . import diskcache

# Every kernel this process compiled or loaded, by key.
_cache: Dict[tuple, Callable] = {}
_key_locks: Dict[tuple, threading.Lock] = {}
_key_locks_lock = threading.Lock()  # guards _key_locks only, held for a lookup
compile_count = 0  # builds this process ran (tests count them)


def count_compile() -> None:
    global compile_count
    compile_count += 1


def _key_lock(key: tuple) -> threading.Lock:
    with _key_locks_lock:
        return _key_locks.setdefault(key, threading.Lock())


def cached(key: tuple, compile_fn: Callable, cache_dir=None):
    """The function for ``key``: from this process, else from disk, else
    ``compile_fn()`` (then stored on disk)."""
    fn = _cache.get(key)  # lock-free hit: the per-call path
    if fn is not None:
        return fn
    with _key_lock(key):
        fn = _cache.get(key)
        if fn is None:
            fn = diskcache.get_or_build(key, compile_fn, cache_dir)
            _cache[key] = fn
    return fn


def store(key: tuple, compile_fn: Callable, cache_dir=None):
    """Build or load ``key`` into ``cache_dir`` (precompile), keeping it here too."""
    with _key_lock(key):
        fn = diskcache.get_or_build(key, compile_fn, cache_dir)
        _cache[key] = fn
    return fn
