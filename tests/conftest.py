import os
import tempfile

import pytest
import torch

# Compile-only tests target Hopper when no GPU is present; must be set before
# cutlass is imported anywhere in the session.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# the disk cache of compiled kernels: a private one per test session
os.environ.setdefault("FLASHGEMM_CACHE_DIR", tempfile.mkdtemp(prefix="flashgemm-test-cache-"))


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs an sm_90 GPU")


@pytest.fixture(scope="session")
def bench_script():
    """scripts/bench.py loaded as a module (its parsing and table helpers need no GPU)."""
    return _load_script("bench")


@pytest.fixture
def sustained_script():
    """scripts/sustained.py loaded as a module (its summary needs no GPU)."""
    return _load_script("sustained")


@pytest.fixture
def swap_bound_script():
    """scripts/probe_swap_bound.py loaded as a module (its configs need no GPU)."""
    return _load_script("probe_swap_bound")


def _load_script(name):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"flashgemm_{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def seed():
    # fresh random data every run, but printed so a failure can be replayed
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
