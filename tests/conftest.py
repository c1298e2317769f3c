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
    """benchmarks/bench.py loaded as a module (its parsing and table helpers need no GPU)."""
    return _load_script("benchmarks", "bench")


@pytest.fixture
def sustained_script():
    """tools/sustained.py loaded as a module (its summary needs no GPU)."""
    return _load_script("tools", "sustained")


@pytest.fixture
def probe_script():
    """tools/probe.py loaded as a module (its configs and argument checks need no GPU)."""
    return _load_script("tools", "probe")


def _load_script(folder, name):
    """``<repo>/<folder>/<name>.py`` as a module (each script puts the
    checkout and benchmarks/ on sys.path itself)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", folder, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"flashgemm_{folder}_{name}_script", path)
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


from flashgemm.timing import capture_graph  # noqa: E402,F401  (the GPU tests import it from here)


class _Recorder:
    """Stands in for the compiled kernel: records each launch's arguments."""

    def __init__(self):
        self.launches = []

    def __call__(self, *args):
        self.launches.append(args)


@pytest.fixture
def stub_launch(monkeypatch):
    """The sm_90 launcher on CPU tensors: the device checks record their
    tensors and pass, the compile records its spec; returns (specs, tensors,
    launcher)."""
    from flashgemm import api
    from flashgemm.plan import PlanCache
    from flashgemm.sm90 import build

    specs, seen, fn = [], [], _Recorder()
    monkeypatch.setattr(api, "validate_device", lambda tensors, *rest, **kw: seen.append(tensors) or 132)
    monkeypatch.setattr(build, "get_kernel", lambda spec, *rest, **kw: specs.append(spec) or fn)
    monkeypatch.setattr(api, "_PLANS", PlanCache())
    return specs, seen, fn


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device 0 with 132 SMs as far as ``flashgemm.api`` can tell
    (``device_facts`` and torch's availability), so host-only paths that
    need the SM count run on CPU. Returns the list of device indices
    ``device_facts`` was asked about."""
    from flashgemm import api

    asked = []

    def device_facts(index):
        asked.append(index)
        return (9, 0), 132, "NVIDIA H100 (fake)"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(api, "device_facts", device_facts)
    return asked


@pytest.fixture
def cpu_launches(monkeypatch):
    """The launcher on CPU tensors with the device checks and the sm_90
    kernel stubbed: each call appends (spec, its tensors) here instead of
    launching."""
    from flashgemm import api
    from flashgemm.plan import PlanCache
    from flashgemm.sm90 import build

    calls = []
    monkeypatch.setattr(api, "validate_device", lambda *args, **kw: 132)
    monkeypatch.setattr(build, "get_kernel", lambda spec, *a, **kw: lambda *t: calls.append((spec, t)))
    monkeypatch.setattr(api, "_PLANS", PlanCache())
    return calls


# ---------------------------------------------------------------------------
# The runs of the compile command line, which compile every kernel the
# package can launch (a few minutes each on a 2-core machine). Each starts in
# a child process as soon as collection shows a selected test needs it, so it
# compiles on the other core while the in-process tests run, and the tests
# that wait for one run last.
#
# * cli_compile_listing / cli_filled_cache: one run of ``compile --arch
#   sm_90a --cache-dir DIR`` (``flashgemm.__main__.main`` in a child process,
#   which lists every kernel and stores it) with the builds wrapped to keep
#   each kernel's PTX;
#   afterwards the child builds the other kernels the selected test modules
#   name in ``PTX_SPECS``. ``kernel_ptx`` hands the tests those PTX texts, so
#   a kernel the listing compiles is not compiled a second time here.
# ---------------------------------------------------------------------------

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTING, FILLED_CACHE, PTX = "cli_compile_listing", "cli_filled_cache", "kernel_ptx"
_runs: dict = {}

_LISTING_CHILD = r"""
import hashlib, os, pickle, sys
from flashgemm.sm90 import build as sm90_build

ptx_dir, extra_path, cache_dir = sys.argv[1], sys.argv[2], sys.argv[3]

def key_of(what):
    return hashlib.sha256(repr(what).encode()).hexdigest()[:32]

def keep(what, fn):
    tmp = os.path.join(ptx_dir, key_of(what) + ".tmp")
    with open(tmp, "w") as f:
        f.write(fn.__ptx__ or "")
    os.replace(tmp, os.path.join(ptx_dir, key_of(what) + ".ptx"))
    return fn

real_build, real_combine = sm90_build.build, sm90_build.build_combine

def build(spec, arch=None, keep_ptx=False, trace=False):
    fn = real_build(spec, arch, keep_ptx=keep_ptx, trace=trace)
    return keep(spec, fn) if keep_ptx and not trace else fn

def build_combine(block_m, arch=None, keep_ptx=False, rows_per_item=None):
    fn = real_combine(block_m, arch, keep_ptx=keep_ptx, rows_per_item=rows_per_item)
    return keep(("combine", block_m, rows_per_item), fn) if keep_ptx else fn

sm90_build.build, sm90_build.build_combine = build, build_combine
from flashgemm.__main__ import main

rc = main(["compile", "--arch", "sm_90a", "--cache-dir", cache_dir])
sys.stdout.flush()
with open(extra_path, "rb") as f:
    extra = pickle.load(f)
for spec in extra:
    if not os.path.exists(os.path.join(ptx_dir, key_of(spec) + ".ptx")):
        try:
            build(spec, "sm_90a", keep_ptx=True)
        except Exception as exc:  # the test that builds it in process reports it
            print(f"PTX_SPECS: {spec!r}: {exc!r}", file=sys.stderr)
sys.exit(rc)
"""


def ptx_key(what) -> str:
    """The file name stem of a kept PTX: a KernelSpec, or ("combine", block_m, rows_per_item)."""
    import hashlib

    return hashlib.sha256(repr(what).encode()).hexdigest()[:32]


class _BackgroundRun:
    def __init__(self, name, extra_specs=()):
        import pickle
        import subprocess
        import sys

        self.dir = tempfile.mkdtemp(prefix=f"flashgemm-{name}-")
        self.cache_dir = os.path.join(self.dir, "cache")
        self.ptx_dir = os.path.join(self.dir, "ptx")
        if name == LISTING:
            os.makedirs(self.ptx_dir)
            extra_path = os.path.join(self.dir, "extra.pickle")
            with open(extra_path, "wb") as f:
                pickle.dump(list(extra_specs), f)
            self.args = [sys.executable, "-c", _LISTING_CHILD, self.ptx_dir, extra_path, self.cache_dir]
        else:
            raise ValueError(name)
        # output to files: a pipe nobody reads until the end could fill up
        self._out = open(os.path.join(self.dir, "stdout"), "w+")
        self._err = open(os.path.join(self.dir, "stderr"), "w+")
        self.proc = subprocess.Popen(
            self.args, cwd=_REPO, env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"),
            stdout=self._out, stderr=self._err, text=True,
        )

    def result(self, timeout=900):
        import subprocess

        self.proc.wait(timeout=timeout)
        self._out.seek(0)
        self._err.seek(0)
        return subprocess.CompletedProcess(self.args, self.proc.returncode, self._out.read(), self._err.read())

    def ptx(self, what):
        """The kept PTX of ``what`` (waiting while the run may still write
        it), or None once the run ended without it."""
        import time

        path = os.path.join(self.ptx_dir, ptx_key(what) + ".ptx")
        while not os.path.exists(path) and self.proc.poll() is None:
            time.sleep(0.2)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return f.read()

    def close(self):
        import shutil

        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _run(name, extra_specs=()) -> _BackgroundRun:
    if name not in _runs:
        _runs[name] = _BackgroundRun(name, extra_specs)
    return _runs[name]


def _fixtures(item):
    return set(getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(session, config, items):
    # the tests that wait for a background run go last (those reading PTX,
    # then those checking a whole run), so the in-process tests run while it
    # compiles
    items.sort(key=lambda item: 2 if _fixtures(item) & {LISTING, FILLED_CACHE} else 1 if PTX in _fixtures(item) else 0)


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    needed = set().union(*map(_fixtures, session.items)) if session.items else set()
    if needed & {LISTING, FILLED_CACHE}:
        extra = {}
        for item in session.items:
            if PTX in _fixtures(item):
                extra.update(dict.fromkeys(getattr(item.module, "PTX_SPECS", ())))
        _run(LISTING, list(extra))


def pytest_sessionfinish(session, exitstatus):
    while _runs:
        _runs.popitem()[1].close()


@pytest.fixture(scope="session")
def cli_compile_listing():
    """The finished ``compile --arch sm_90a`` (a ``subprocess.CompletedProcess``
    with text stdout and stderr)."""
    return _run(LISTING).result()


@pytest.fixture(scope="session")
def cli_filled_cache():
    """(finished run, cache directory) of ``python -m flashgemm compile
    --arch sm_90a --cache-dir DIR``."""
    run = _run(LISTING)  # the listing run fills the cache as it compiles
    return run.result(), run.cache_dir


@pytest.fixture(scope="session")
def kernel_ptx():
    """``kernel_ptx(spec)`` / ``kernel_ptx(("combine", block_m, rows_per_item))``:
    the kernel's PTX, kept by the listing run when one is running (the
    kernels it lists and the modules' ``PTX_SPECS``), else built here; each
    kernel once per session."""
    from flashgemm.config import KernelSpec
    from flashgemm.sm90 import build as sm90_build

    kept = {}
    listing = _runs.get(LISTING)

    def get(what):
        if what not in kept:
            text = listing.ptx(what) if listing is not None else None
            if text is None:
                if isinstance(what, KernelSpec):
                    text = sm90_build.build(what, arch="sm_90a", keep_ptx=True).__ptx__
                else:
                    _, block_m, rows = what
                    text = sm90_build.build_combine(block_m, "sm_90a", keep_ptx=True, rows_per_item=rows).__ptx__
            kept[what] = text
        return kept[what]

    return get
