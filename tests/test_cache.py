"""The compile cache: in-process and on disk (CPU; compile-only for sm_90a)."""

import json
import os
import subprocess
import sys
import threading

import pytest

from flashgemm import compile as fg_compile
from flashgemm import diskcache
from flashgemm.config import GemmConfig

# a config no other test compiles, so every process here starts cold
CFG = "GemmConfig(tile_m=64, tile_n=64, consumer_warpgroups=1, stages=5)"
CHILD = f"""
import json, sys
from flashgemm import compile as c, diskcache
from flashgemm.config import GemmConfig
c.get_kernel({CFG}, arch="sm_90a")
print(json.dumps({{"compiles": c.compile_count, "loads": diskcache.load_count,
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


def _entries(cache_dir, ext):
    return [f for f in os.listdir(cache_dir) if f.endswith(ext)]


def test_new_process_loads_instead_of_compiling(tmp_path):
    assert _result(_child(tmp_path)) == {"compiles": 1, "loads": 0}
    assert len(_entries(tmp_path, ".o")) == 1 and len(_entries(tmp_path, ".json")) == 1
    # a C compiler is present here, so the entry has a shared library, which
    # loads through tvm_ffi alone: the CuTe DSL is never imported
    assert len(_entries(tmp_path, ".so")) == 1
    assert _result(_child(tmp_path), keep_dsl_flag=True) == {"compiles": 0, "loads": 1, "dsl_imported": False}


def test_without_a_c_compiler_the_object_file_is_loaded(tmp_path):
    assert _result(_child(tmp_path, {"CC": "/nonexistent/cc"})) == {"compiles": 1, "loads": 0}
    assert _entries(tmp_path, ".so") == []
    assert _result(_child(tmp_path)) == {"compiles": 0, "loads": 1}


@pytest.mark.parametrize("damage", ["truncate", "garbage", "drop-object", "foreign-key", "garbage-so"])
def test_corrupt_entry_is_rebuilt_not_loaded(tmp_path, damage):
    _result(_child(tmp_path))
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


def test_two_processes_racing_build_one_entry(tmp_path):
    results = [_result(p) for p in [_child(tmp_path), _child(tmp_path)]]
    assert sum(r["compiles"] for r in results) == 1  # the lock holder built it
    assert sum(r["loads"] for r in results) == 1  # the other loaded it
    assert len(_entries(tmp_path, ".o")) == 1 and len(_entries(tmp_path, ".json")) == 1
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_disabled_disk_cache_writes_nothing(tmp_path):
    assert _result(_child(tmp_path, {"FLASHGEMM_CACHE": "0"})) == {"compiles": 1, "loads": 0}
    assert os.listdir(tmp_path) == []


def test_unwritable_directory_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(diskcache, "_warned", False)
    calls = []
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert diskcache.get_or_build(("k",), lambda: calls.append(1) or "fn", str(blocker / "sub")) == "fn"
    assert diskcache.get_or_build(("k",), lambda: "fn2", str(blocker / "sub")) == "fn2"  # no second warning
    assert calls == [1]


def test_two_threads_compile_a_new_key_once(monkeypatch):
    monkeypatch.setenv("FLASHGEMM_CACHE", "0")
    cfg = GemmConfig(tile_m=64, tile_n=64, consumer_warpgroups=1, stages=6)
    before = fg_compile.compile_count
    got = []
    threads = [threading.Thread(target=lambda: got.append(fg_compile.get_kernel(cfg, arch="sm_90a")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fg_compile.compile_count == before + 1
    assert got[0] is got[1]


def test_key_covers_everything_that_changes_code(monkeypatch):
    cfg = GemmConfig(tile_m=64, tile_n=128, consumer_warpgroups=1)
    key = fg_compile.cache_key(cfg, "bf16", "bf16", "sm_90a", None)
    assert key == fg_compile.cache_key(GemmConfig(tile_m=64, tile_n=128, consumer_warpgroups=1), "bf16", "bf16", "sm_90a", None)
    others = [
        fg_compile.cache_key(GemmConfig(tile_m=64, tile_n=128, consumer_warpgroups=1, stages=4), "bf16", "bf16", "sm_90a", None),
        fg_compile.cache_key(cfg, "fp16", "fp16", "sm_90a", None),
        fg_compile.cache_key(cfg, "bf16", "bf16", "sm_100a", None),
        fg_compile.cache_key(cfg, "bf16", "bf16", "sm_90a", "m_block"),
    ]
    real = fg_compile._versions()
    for versions in [("9.9.9", *real[1:]), (real[0], "0.0.1", real[2]), (*real[:2], "0" * 16)]:
        monkeypatch.setattr(fg_compile, "_versions", lambda v=versions: v)
        others.append(fg_compile.cache_key(cfg, "bf16", "bf16", "sm_90a", None))
    digests = {diskcache._digest(k) for k in [key, *others]}
    assert len(digests) == 1 + len(others)


def test_cli_fills_a_cache_a_new_process_uses(tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    res = subprocess.run([sys.executable, "-m", "flashgemm", "compile", "--arch", "sm_90a", "--cache-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    script = """
import json
from flashgemm import compile as c, diskcache
from flashgemm.config import FP8_HEURISTIC_CONFIGS, HEURISTIC_CONFIGS
for cfg in HEURISTIC_CONFIGS + FP8_HEURISTIC_CONFIGS:
    for mode in c.signal_modes_of(cfg):
        c.get_kernel(cfg, c.operand_dtype(cfg), arch="sm_90a", signal_mode=mode)
print(json.dumps({"compiles": c.compile_count, "loads": diskcache.load_count}))
"""
    out = subprocess.run([sys.executable, "-c", script], env=dict(env, FLASHGEMM_CACHE_DIR=str(tmp_path)),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    from flashgemm.config import FP8_HEURISTIC_CONFIGS, HEURISTIC_CONFIGS

    configs = HEURISTIC_CONFIGS + FP8_HEURISTIC_CONFIGS
    split = sum(c.split_last_round for c in configs)
    # the prefill tiles (bf16; fp8 192 and 128 wide), clusters of 2 and 1: no signal builds
    assert split == 6
    assert got == {"compiles": 0, "loads": 3 * len(configs) - 2 * split}


def test_source_digest_follows_the_code(tmp_path):
    """An edited kernel source with an unchanged version is a different key."""
    pkg = os.path.dirname(fg_compile.__file__)
    for name in ("kernel.py", "mainloop.py"):
        (tmp_path / name).write_bytes(open(os.path.join(pkg, name), "rb").read())
    (tmp_path / "notes.txt").write_text("not code")
    before = fg_compile.source_digest(str(tmp_path))
    assert before == fg_compile.source_digest(str(tmp_path))
    (tmp_path / "notes.txt").write_text("still not code")
    assert fg_compile.source_digest(str(tmp_path)) == before
    with open(tmp_path / "mainloop.py", "a") as f:
        f.write("\n# edited\n")
    assert fg_compile.source_digest(str(tmp_path)) != before
    assert fg_compile._versions()[2] == fg_compile.source_digest()
