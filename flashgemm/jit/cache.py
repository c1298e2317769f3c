"""The in-process level of the compile cache, over the disk level
(``diskcache``): each key is compiled or loaded once per process, and two
threads asking for one new key compile it once."""

from __future__ import annotations

import threading
from typing import Callable, Dict

from . import diskcache

# Every kernel this process compiled or loaded, by key.
_cache: Dict[tuple, Callable] = {}
_lock = threading.Lock()
compile_count = 0  # builds this process ran (tests count them)


def count_compile() -> None:
    global compile_count
    compile_count += 1


def cached(key: tuple, compile_fn: Callable, cache_dir=None):
    """The function for ``key``: from this process, else from disk, else
    ``compile_fn()`` (then stored on disk)."""
    fn = _cache.get(key)  # lock-free hit: the per-call path
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            fn = diskcache.get_or_build(key, compile_fn, cache_dir)
            _cache[key] = fn
    return fn


def store(key: tuple, compile_fn: Callable, cache_dir=None):
    """Build or load ``key`` into ``cache_dir`` (precompile), keeping it here too."""
    with _lock:
        fn = diskcache.get_or_build(key, compile_fn, cache_dir)
        _cache[key] = fn
    return fn
