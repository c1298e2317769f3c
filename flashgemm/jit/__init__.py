"""Compilation support shared by every arch: target detection, the cache key,
the in-process cache and its disk level."""
