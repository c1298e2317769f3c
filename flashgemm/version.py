"""The package version (its own module, so the cache key reads it without
importing the package's public API)."""

__version__ = "0.1.0"
