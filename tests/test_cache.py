"""The compile cache: in-process and on disk (CPU; compile-only for sm_90a)."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings

import pytest

from flashgemm.config import GemmConfig, KernelSpec
from flashgemm.formats import Format
from flashgemm.jit import cache, diskcache, key
from flashgemm.sm90 import build as sm90_build
from flashgemm.sm90.heuristic import reachable_specs

# a kernel no other test compiles, so every process here starts cold
SPEC = "KernelSpec(GemmConfig(tile_m=64, tile_n=64, stages=5), Format.BF16)"
CHILD = f"""
import json, sys
from flashgemm.config import GemmConfig, KernelSpec
from flashgemm.formats import Format
from flashgemm.jit import cache, diskcache
from flashgemm.sm90.build import get_kernel
get_kernel({SPEC}, arch="sm_90a")
print(json.dumps({{"compiles": cache.compile_count, "loads": diskcache.load_count,
                  "dsl_imported": "cutlass" in sys.modules}}))
"""


def _child(cache_dir, extra_env=None):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASHGEMM_CACHE_DIR=str(cache_dir), **(extra_env or {}))
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc, keep_dsl_flag=False):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    if not keep_dsl_flag:
        got.pop("dsl_imported")
    return got


# One process builds SPEC into an empty directory, then makes the directory
# read-only or noexec (a bind mount onto itself, in a mount namespace of its
# own; or, for a user, mode 555), forgets its kernels and asks again, so both
# halves share one cache key even while the package's sources are edited.
# The kernel was compiled, never loaded, before: the second ask is a real load.
REMOUNT_CHILD = f"""
import json, os, subprocess, sys
from flashgemm.config import GemmConfig, KernelSpec
from flashgemm.formats import Format
from flashgemm.jit import cache, diskcache
from flashgemm.sm90.build import get_kernel
directory, how = sys.argv[1], sys.argv[2]
get_kernel({SPEC}, arch="sm_90a")
assert (cache.compile_count, diskcache.load_count) == (1, 0)
if how == "mode-555":
    os.chmod(directory, 0o555)
else:
    subprocess.run(["mount", "--bind", directory, directory], check=True)
    subprocess.run(["mount", "-o", "remount,bind," + how, directory], check=True)
before = sorted(os.listdir(directory))
cache._cache.clear()
print("-- " + how, file=sys.stderr, flush=True)
get_kernel({SPEC}, arch="sm_90a")

class Kernel:  # a kernel this directory lacks
    def export_to_c(self, path, name):
        open(path, "w").close()

missed = diskcache.get_or_build(("not-in-the-cache",), Kernel)
after = os.listdir(directory)
print(json.dumps({{"compiles": cache.compile_count - 1, "loads": diskcache.load_count,
                  "miss_built": isinstance(missed, Kernel), "removed": sorted(set(before) - set(after)),
                  "stored": sorted(set(after) - set(before)) != []}}))
"""


def _can_mount():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o noexec tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def _remount_child(directory, how):
    """(result, the child's stderr after the directory changed) of REMOUNT_CHILD."""
    cmd = [sys.executable, "-c", REMOUNT_CHILD, str(directory), how]
    if how != "mode-555":
        if not _can_mount():
            pytest.skip("needs root and mount namespaces (unshare)")
        cmd = ["unshare", "--mount", "--propagation", "private", *cmd]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASHGEMM_CACHE_DIR=str(directory))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr.split(f"-- {how}\n", 1)[1]


def _entries(cache_dir, ext):
    return [f for f in os.listdir(cache_dir) if f.endswith(ext)]


@pytest.fixture(scope="module")
def built_entry(tmp_path_factory):
    """(directory, result) of a fresh process that compiled SPEC into an
    empty cache directory; tests work on copies of it."""
    directory = tmp_path_factory.mktemp("built-entry")
    return directory, _result(_child(directory), keep_dsl_flag=True)


def _copy_of(built_entry, tmp_path):
    shutil.copytree(built_entry[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_new_process_loads_instead_of_compiling(built_entry, tmp_path):
    directory, first = built_entry
    assert first == {"compiles": 1, "loads": 0, "dsl_imported": True}
    assert len(_entries(directory, ".o")) == 1 and len(_entries(directory, ".json")) == 1
    # a C compiler is present here, so the entry has a shared library, which
    # loads through tvm_ffi alone: the CuTe DSL is never imported
    assert len(_entries(directory, ".so")) == 1
    tmp_path = _copy_of(built_entry, tmp_path)
    assert _result(_child(tmp_path), keep_dsl_flag=True) == {"compiles": 0, "loads": 1, "dsl_imported": False}


def test_without_a_c_compiler_the_object_file_is_loaded(tmp_path):
    assert _result(_child(tmp_path, {"CC": "/nonexistent/cc"})) == {"compiles": 1, "loads": 0}
    assert _entries(tmp_path, ".so") == []
    assert _result(_child(tmp_path)) == {"compiles": 0, "loads": 1}


@pytest.mark.parametrize("damage", ["truncate", "garbage", "drop-object", "foreign-key", "garbage-so"])
def test_corrupt_entry_is_rebuilt_not_loaded(built_entry, tmp_path, damage):
    tmp_path = _copy_of(built_entry, tmp_path)
    obj = tmp_path / _entries(tmp_path, ".o")[0]
    meta = tmp_path / _entries(tmp_path, ".json")[0]
    if damage == "truncate":
        obj.write_bytes(obj.read_bytes()[: obj.stat().st_size // 2])
    elif damage == "garbage":
        obj.write_bytes(b"\0" * 4096)
    elif damage == "drop-object":
        obj.unlink()
    elif damage == "garbage-so":
        so = tmp_path / _entries(tmp_path, ".so")[0]
        so.write_bytes(b"\x7fELF" + b"\0" * 4092)
    else:
        meta.write_text(json.dumps(dict(json.loads(meta.read_text()), key="('another', 'kernel')")))
    assert _result(_child(tmp_path)) == {"compiles": 1, "loads": 0}
    # the rebuilt entry is whole again and loads
    assert _result(_child(tmp_path)) == {"compiles": 0, "loads": 1}


def test_read_only_prebuilt_cache_is_loaded_and_not_written(tmp_path):
    """A cache directory this process cannot write (a container image's
    prebuilt cache): its entries load; a kernel it lacks is built in process,
    with one warning, and not stored."""
    # root writes through any mode bits: for root the directory is mounted read-only
    got, err = _remount_child(tmp_path, "ro" if os.geteuid() == 0 else "mode-555")
    assert got == {"compiles": 0, "loads": 1, "miss_built": True, "removed": [], "stored": False}, err[-2000:]
    assert err.count("is not writable") == 1 and str(tmp_path) in err, err[-2000:]


def test_noexec_cache_loads_the_object_file_and_says_why(tmp_path):
    """On a noexec mount no shared library maps: the object file is loaded
    through the DSL instead, with one warning, and the entry is kept."""
    got, err = _remount_child(tmp_path, "noexec")
    # the entry is kept (not deleted and rebuilt); the missed kernel is stored
    assert got == {"compiles": 0, "loads": 1, "miss_built": True, "removed": [], "stored": True}, err[-2000:]
    assert err.count("mounted noexec") == 1 and str(tmp_path) in err, err[-2000:]


class _StoredKey:
    """A key as its entry's json spells it (the disk cache reads a key only
    through ``repr``), so a test matches an entry another process built."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def test_library_that_does_not_load_is_reported_and_its_object_loaded(built_entry, tmp_path, monkeypatch):
    import tvm_ffi

    tmp_path = _copy_of(built_entry, tmp_path)
    before = sorted(os.listdir(tmp_path))
    key = _StoredKey(json.loads((tmp_path / _entries(tmp_path, ".json")[0]).read_text())["key"])
    so_path = str(tmp_path / _entries(tmp_path, ".so")[0])

    def load_module(path, *args, **kwargs):
        raise RuntimeError(f"{path}: failed to map segment from shared object")

    def build():
        raise AssertionError("compiled a kernel whose entry is whole")

    monkeypatch.setattr(tvm_ffi, "load_module", load_module)
    monkeypatch.setattr(diskcache, "_warned", set())
    loads = diskcache.load_count
    with pytest.warns(RuntimeWarning, match="cannot load the cached library") as record:
        fn = diskcache.get_or_build(key, build, str(tmp_path))
    assert callable(fn) and diskcache.load_count == loads + 1
    (message,) = [str(w.message) for w in record if str(w.message).startswith("flashgemm:")]
    assert so_path in message and "failed to map segment" in message
    assert sorted(os.listdir(tmp_path)) == before  # kept, not deleted and rebuilt


def test_two_processes_racing_build_one_entry(tmp_path):
    results = [_result(p) for p in [_child(tmp_path), _child(tmp_path)]]
    assert sum(r["compiles"] for r in results) == 1  # the lock holder built it
    assert sum(r["loads"] for r in results) == 1  # the other loaded it
    assert len(_entries(tmp_path, ".o")) == 1 and len(_entries(tmp_path, ".json")) == 1
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_disabled_disk_cache_writes_nothing(tmp_path):
    assert _result(_child(tmp_path, {"FLASHGEMM_CACHE": "0"})) == {"compiles": 1, "loads": 0}
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF"])
def test_cache_switch_turns_the_disk_level_off(monkeypatch, tmp_path, value):
    monkeypatch.setenv("FLASHGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHGEMM_CACHE", value)
    assert diskcache.cache_dir() is None
    calls = []
    assert diskcache.get_or_build(("k", value), lambda: calls.append(1) or "fn") == "fn"
    assert calls == [1] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["1", None])
def test_cache_switch_on_or_unset_keeps_the_disk_level(monkeypatch, tmp_path, value):
    monkeypatch.setenv("FLASHGEMM_CACHE_DIR", str(tmp_path))
    if value is None:
        monkeypatch.delenv("FLASHGEMM_CACHE", raising=False)
    else:
        monkeypatch.setenv("FLASHGEMM_CACHE", value)
    assert diskcache.cache_dir() == str(tmp_path)
    # and without FLASHGEMM_CACHE_DIR: the user cache directory
    monkeypatch.delenv("FLASHGEMM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert diskcache.cache_dir() == os.path.join(str(tmp_path / "xdg"), "flashgemm")


def test_unusable_directory_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(diskcache, "_warned", set())
    calls = []
    with pytest.warns(RuntimeWarning, match="cannot create cache directory"):
        assert diskcache.get_or_build(("k",), lambda: calls.append(1) or "fn", str(blocker / "sub")) == "fn"
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert diskcache.get_or_build(("k",), lambda: "fn2", str(blocker / "sub")) == "fn2"
    assert [str(w.message) for w in again] == []  # no second warning
    assert calls == [1]


def test_two_threads_compile_a_new_key_once(monkeypatch):
    monkeypatch.setenv("FLASHGEMM_CACHE", "0")
    spec = KernelSpec(GemmConfig(tile_m=64, tile_n=64, stages=6), Format.BF16)
    before = cache.compile_count
    got = []
    threads = [threading.Thread(target=lambda: got.append(sm90_build.get_kernel(spec, arch="sm_90a")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.compile_count == before + 1
    assert len(got) == 2 and got[0] is got[1]


def test_key_covers_everything_that_changes_code(monkeypatch):
    cfg = GemmConfig(tile_m=64, tile_n=128)
    spec = KernelSpec(cfg, Format.BF16)
    k = key.cache_key("sm_90a", spec)
    assert k == key.cache_key("sm_90a", KernelSpec(GemmConfig(tile_m=64, tile_n=128), Format.BF16, None))
    others = [
        key.cache_key("sm_90a", KernelSpec(cfg.replace(stages=4), Format.BF16)),
        key.cache_key("sm_90a", KernelSpec(cfg, Format.FP8_BLOCK128)),
        key.cache_key("sm_100a", spec),
        key.cache_key("sm_90a", KernelSpec(cfg, Format.BF16, "m_block")),
        key.cache_key("sm_90a", KernelSpec(cfg, Format.BF16, "expert")),
        sm90_build.combine_key("sm_90a", 64, 4),
        sm90_build.combine_key("sm_90a", 128, 4),
        sm90_build.combine_key("sm_90a", 64, 8),
    ]
    real = key.versions()
    for versions in [("9.9.9", *real[1:]), (real[0], "0.0.1", real[2]), (*real[:2], "0" * 16)]:
        monkeypatch.setattr(key, "versions", lambda v=versions: v)
        others.append(key.cache_key("sm_90a", spec))
    digests = {diskcache._digest(x) for x in [k, *others]}
    assert len(digests) == 1 + len(others)


def test_cli_fills_a_cache_a_new_process_uses(cli_filled_cache):
    """``python -m flashgemm compile --cache-dir DIR`` stores every kernel
    the package can launch (each reachable spec, one combine per signalled
    tile_m, the MoE activations); a new process then loads any of them with
    no compile."""
    res, cache_dir = cli_filled_cache
    assert res.returncode == 0, res.stderr[-2000:]
    specs = reachable_specs()
    block_ms = sm90_build.combine_block_ms(specs)
    from flashgemm.ep.combine import ep_kernel_jobs

    # and the four MoE activation kernels (SwiGLU and gpt-oss's, fp8 and bf16), the expert-parallel ones
    total = len(specs) + len(block_ms) + 4 + len(ep_kernel_jobs("sm_90a", block_ms))
    assert re.search(rf"^{total} kernels for sm_90a in ", res.stdout, re.M), res.stdout
    script = """
import json
from flashgemm.jit import cache, diskcache
from flashgemm.signals import DEFAULT_ROWS_PER_ITEM
from flashgemm.sm90.build import combine_block_ms, get_combine_kernel, get_kernel
from flashgemm.sm90.heuristic import reachable_specs
for spec in reachable_specs():
    get_kernel(spec, arch="sm_90a")
for block_m in combine_block_ms(reachable_specs()):
    get_combine_kernel(block_m, DEFAULT_ROWS_PER_ITEM, arch="sm_90a")
from flashgemm.moe.activation import ActivationKind, get_kernel as get_activation
for kind in ActivationKind:
    for fp8 in (True, False):
        get_activation(fp8, arch="sm_90a", kind=kind)
import torch
from flashgemm.ep.combine import DEFAULT_EP_ROWS_PER_ITEM, get_ep_combine, get_ep_complete, get_token_sum
for block_m in combine_block_ms(reachable_specs()):
    get_ep_combine(block_m, DEFAULT_EP_ROWS_PER_ITEM, arch="sm_90a")
get_ep_complete(arch="sm_90a")
for ids in (torch.int32, torch.int64):
    for out in (torch.float32, torch.bfloat16):
        get_token_sum(8, ids, out, arch="sm_90a")
from flashgemm.ep.device_dispatch import get_ep_dispatch
for fp8 in (True, False):
    for ids in (torch.int32, torch.int64):
        get_ep_dispatch(8, fp8, ids, arch="sm_90a")
print(json.dumps({"compiles": cache.compile_count, "loads": diskcache.load_count}))
"""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASHGEMM_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the prefill tiles (bf16; fp8 192 and 128 wide; MXFP4 weights with fp8
    # activations 192 and 128 wide, with bf16 ones 192 wide), clusters of 2
    # and 1, run their last round split: no signal builds of them
    split = {(s.config, s.fmt) for s in specs if s.config.tail.name == "SPLIT" and s.epilogue.name == "STORE"}
    assert len(split) == 12
    assert not any(s.signal_mode for s in specs if (s.config, s.fmt) in split)
    assert got == {"compiles": 0, "loads": total}
    assert len(specs) == 444 and block_ms == [64, 128, 192]


def test_source_digest_follows_the_code(tmp_path):
    """An edited source with an unchanged version is a different key, in the
    package's top level and in its subpackages alike."""
    import flashgemm

    pkg = os.path.dirname(os.path.abspath(flashgemm.__file__))
    copy = tmp_path / "flashgemm"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "notes.txt").write_text("not code")
    before = key.source_digest(str(copy))
    assert before == key.source_digest(str(copy))
    # the copy digests like the package itself (relative paths, same bytes)
    assert before == key.source_digest()
    (copy / "notes.txt").write_text("still not code")
    (copy / "sm90" / "__pycache__").mkdir()
    (copy / "sm90" / "__pycache__" / "limits.cpython-312.pyc").write_bytes(b"not source")
    assert key.source_digest(str(copy)) == before
    # a file of a subpackage
    limits = copy / "sm90" / "limits.py"
    original = limits.read_bytes()
    limits.write_bytes(original + b"\n# edited\n")
    edited = key.source_digest(str(copy))
    assert edited != before
    limits.write_bytes(original)
    assert key.source_digest(str(copy)) == before
    # a new module in a subpackage, and an edit at the top level
    (copy / "schedule" / "extra.py").write_text("X = 1\n")
    assert key.source_digest(str(copy)) not in (before, edited)
    (copy / "schedule" / "extra.py").unlink()
    with open(copy / "config.py", "a") as f:
        f.write("\n# edited\n")
    assert key.source_digest(str(copy)) not in (before, edited)
    assert key.versions()[2] == key.source_digest()
