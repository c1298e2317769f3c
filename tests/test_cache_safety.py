"""The disk cache's guards (CPU, no DSL compile): which directories and files
it trusts, its lock files, how long it waits and what it says meanwhile.

Entries here are planted by hand: a "kernel" whose ``export_to_c`` writes a
few bytes, and a shared library whose constructor leaves a marker file, which
shows whether the cache ever loaded it."""

import fcntl
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

import pytest

from flashgemm.jit import cache, diskcache

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


class FakeKernel:
    """What a build returns, as far as the disk cache sees it."""

    def export_to_c(self, path, name):
        with open(path, "wb") as f:
            f.write(b"not an object file: " + name.encode())


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test starts with nothing reported yet, and without a C compiler
    (the fake objects do not link)."""
    monkeypatch.setattr(diskcache, "_warned", set())
    monkeypatch.setenv("CC", "/nonexistent/cc")


def _key(tag="k"):
    return ("test-cache-safety", tag, uuid.uuid4().hex)


def _private_dir(path):
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path


def _flashgemm_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("flashgemm:")]


def _plant_entry(directory, key, marker, elsewhere=None):
    """A complete, matching entry for ``key`` whose ``.so`` writes ``marker``
    when loaded. With ``elsewhere``, the files are written there, and the
    caller links or copies each into ``directory``."""
    target = elsewhere or directory
    sha = diskcache._digest(key)
    src = target / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                   f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    so = target / f"{sha}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    src.unlink()
    obj = target / f"{sha}.o"
    obj.write_bytes(b"object")
    meta = {"key": repr(key), "sha256": hashlib.sha256(obj.read_bytes()).hexdigest(),
            "so_sha256": hashlib.sha256(so.read_bytes()).hexdigest()}
    (target / f"{sha}.json").write_text(json.dumps(meta))
    for p in target.iterdir():
        os.chmod(p, 0o644)
    return sha


@pytest.mark.parametrize("owner, mode, trusted", [
    (1000, 0o700, True), (1000, 0o755, True), (0, 0o755, True),  # this user's, root's
    (1001, 0o700, False),  # another user's
    (1000, 0o770, False), (1000, 0o702, False), (0, 0o775, False),  # others may write
])
def test_trust_rule_is_sshs(owner, mode, trusted):
    st = os.stat_result((stat.S_IFDIR | mode, 0, 0, 1, owner, owner, 4096, 0, 0, 0))
    why = diskcache.untrusted(st, uid=1000)
    assert (why is None) == trusted
    if not trusted:
        assert ("uid 1001" in why) if owner == 1001 else ("group or others may write" in why)


@needs_cc
@pytest.mark.parametrize("how", ["group-writable", "world-writable", "another-owner"])
def test_planted_library_in_an_untrusted_directory_never_runs(tmp_path, monkeypatch, how):
    directory = _private_dir(tmp_path / "cache")
    key, marker = _key(), tmp_path / "constructor-ran"
    _plant_entry(directory, key, marker)
    if how == "group-writable":
        os.chmod(directory, 0o770)
    elif how == "world-writable":
        os.chmod(directory, 0o707)
    elif os.getuid() == 0:
        os.chown(directory, 4242, 4242)
    else:  # as a user: the directory is ours, so pretend to be someone else
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
    before = sorted(os.listdir(directory))
    calls = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn = diskcache.get_or_build(key, lambda: calls.append(1) or FakeKernel(), str(directory))
    assert not marker.exists()  # the planted constructor never ran
    assert isinstance(fn, FakeKernel) and calls == [1]  # compiled in process
    assert sorted(os.listdir(directory)) == before  # nothing written: no lock, no entry
    (message,) = _flashgemm_warnings(record)
    assert message.startswith("flashgemm: not using cache directory")
    assert str(directory) in message and "FLASHGEMM_CACHE_DIR" in message
    st = os.stat(directory)
    assert f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}" in message
    assert ("use a directory you own" if how == "another-owner" else f"chmod go-w {directory}") in message
    # reported once per process
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        diskcache.get_or_build(key, FakeKernel, str(directory))
    assert _flashgemm_warnings(again) == []
    assert not marker.exists()


def test_created_directories_and_entries_are_private_under_a_loose_umask(tmp_path):
    directory = tmp_path / "a" / "b" / "cache"
    key = _key()
    old = os.umask(0o002)
    try:
        assert isinstance(diskcache.get_or_build(key, FakeKernel, str(directory)), FakeKernel)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", directory):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    sha = diskcache._digest(key)
    assert sorted(os.listdir(directory)) == [f"{sha}.json", f"{sha}.lock", f"{sha}.o"]
    for name in os.listdir(directory):
        assert not os.stat(directory / name).st_mode & 0o022, name


@pytest.mark.parametrize("content", ["symlink", "regular"])
def test_lock_file_is_neither_followed_nor_truncated(tmp_path, content):
    directory = _private_dir(tmp_path / "cache")
    key = _key()
    lock = directory / f"{diskcache._digest(key)}.lock"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    if content == "symlink":
        lock.symlink_to(victim)
    else:
        lock.write_text("precious")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn = diskcache.get_or_build(key, FakeKernel, str(directory))
    assert victim.read_text() == "precious"
    assert isinstance(fn, FakeKernel)
    if content == "symlink":
        (message,) = _flashgemm_warnings(record)
        assert f"cannot open lock file '{lock}'" in message and "not a symlink" in message
        # built, but not stored: it never held the lock
        assert not (directory / f"{diskcache._digest(key)}.json").exists()
    else:
        assert lock.read_text() == "precious" and _flashgemm_warnings(record) == []


@needs_cc
@pytest.mark.parametrize("planted", ["json-symlink", "o-symlink", "so-symlink", "so-group-writable"])
def test_planted_entry_files_are_not_loaded(tmp_path, planted):
    """In a directory of ours, an entry file that is a symlink, or that
    others may write, is refused: the entry is rebuilt, the link removed (not
    its target), and the library never loaded."""
    directory = _private_dir(tmp_path / "cache")
    elsewhere = _private_dir(tmp_path / "elsewhere")
    key, marker = _key(), tmp_path / "constructor-ran"
    sha = _plant_entry(directory, key, marker, elsewhere)
    ext, how = planted.split("-", 1)
    for name in os.listdir(elsewhere):
        if how == "symlink" and name == f"{sha}.{ext}":
            os.symlink(elsewhere / name, directory / name)
        else:
            shutil.copy2(elsewhere / name, directory / name)
    if how == "group-writable":
        os.chmod(directory / f"{sha}.so", 0o664)
    calls = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn = diskcache.get_or_build(key, lambda: calls.append(1) or FakeKernel(), str(directory))
    assert not marker.exists()  # the planted constructor never ran
    assert isinstance(fn, FakeKernel) and calls == [1]
    (message,) = _flashgemm_warnings(record)
    assert message.startswith("flashgemm: cannot use cache entry")
    assert (f"{sha}.{ext} is a symbolic link" if how == "symlink" else "group or others may write") in message
    # rebuilt as regular files; the link's target is untouched
    assert os.path.isfile(elsewhere / f"{sha}.{ext}")
    for name in (f"{sha}.json", f"{sha}.o"):
        assert not os.path.islink(directory / name) and os.path.isfile(directory / name)
    assert json.loads((directory / f"{sha}.json").read_text())["key"] == repr(key)


class _HeldLock:
    """The flock another process would hold while building a key."""

    def __init__(self, path):
        self.file = open(path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def release(self):
        self.file.close()


def _in_thread(fn):
    out = {}

    def run():
        out["result"] = fn()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _lock_held_by_another(tmp_path, monkeypatch, timeout: str, notice_s: float):
    """A private cache directory whose key's lock another holder has, with
    the lock timeout and the notice delay set: (directory, key, lock path, holder)."""
    monkeypatch.setenv("FLASHGEMM_CACHE_LOCK_TIMEOUT", timeout)
    monkeypatch.setattr(diskcache, "LOCK_NOTICE_S", notice_s, raising=False)
    directory = _private_dir(tmp_path / "cache")
    key = _key()
    lock_path = directory / f"{diskcache._digest(key)}.lock"
    return directory, key, lock_path, _HeldLock(lock_path)


def test_lock_wait_is_reported_and_bounded(tmp_path, monkeypatch):
    directory, key, lock_path, holder = _lock_held_by_another(tmp_path, monkeypatch, "1.5", 0.3)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            t, out = _in_thread(lambda: diskcache.get_or_build(key, FakeKernel, str(directory)))
            t.join(timeout=20)
            elapsed = time.monotonic() - t0
        assert not t.is_alive(), "still waiting for the lock after 20 s"
    finally:
        holder.release()
    assert 1.5 <= elapsed < 15
    assert isinstance(out["result"], FakeKernel)  # compiled in process ...
    assert not (directory / f"{diskcache._digest(key)}.json").exists()  # ... and not stored
    waiting, gave_up = _flashgemm_warnings(record)
    assert "waiting for another process building" in waiting and str(lock_path) in waiting
    assert "'test-cache-safety'" in waiting  # names the key
    assert "gave up after" in gave_up and str(lock_path) in gave_up


def test_waiter_goes_on_when_the_lock_is_released(tmp_path, monkeypatch):
    directory, key, lock_path, holder = _lock_held_by_another(tmp_path, monkeypatch, "60", 0.2)
    calls = []
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            t, out = _in_thread(lambda: diskcache.get_or_build(key, lambda: calls.append(1) or FakeKernel(),
                                                               str(directory)))
            deadline = time.monotonic() + 10
            while not _flashgemm_warnings(record) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [m for m in _flashgemm_warnings(record) if str(lock_path) in m], "no word about the wait"
    finally:
        holder.release()
    t.join(timeout=20)
    assert not t.is_alive()
    assert isinstance(out["result"], FakeKernel) and calls == [1]
    assert (directory / f"{diskcache._digest(key)}.json").exists()  # it held the lock: stored


@pytest.mark.parametrize("value, expected", [(None, 600.0), ("2.5", 2.5), ("0", 0.0), ("inf", float("inf"))])
def test_lock_timeout_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("FLASHGEMM_CACHE_LOCK_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("FLASHGEMM_CACHE_LOCK_TIMEOUT", value)
    assert diskcache.lock_timeout() == expected


@pytest.mark.parametrize("value", ["ten", "-1", "nan"])
def test_bad_lock_timeout_setting_is_named(monkeypatch, value):
    monkeypatch.setenv("FLASHGEMM_CACHE_LOCK_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"FLASHGEMM_CACHE_LOCK_TIMEOUT='{value}'"):
        diskcache.lock_timeout()


def test_a_wait_for_one_kernel_holds_up_no_other(tmp_path, monkeypatch):
    """A thread waiting for another process to build kernel A leaves the
    other threads free to get kernel B."""
    monkeypatch.setenv("FLASHGEMM_CACHE_LOCK_TIMEOUT", "60")
    directory = _private_dir(tmp_path / "cache")
    key_a, key_b = _key("a"), _key("b")
    holder = _HeldLock(directory / f"{diskcache._digest(key_a)}.lock")
    at_lock = threading.Event()
    real_flock = fcntl.flock

    def flock(fd, op):  # tells when the thread for A reaches the disk lock
        at_lock.set()
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        ta, out_a = _in_thread(lambda: cache.cached(key_a, FakeKernel, str(directory)))
        assert at_lock.wait(10)
        tb, out_b = _in_thread(lambda: cache.cached(key_b, FakeKernel, str(directory)))
        tb.join(timeout=10)
        assert not tb.is_alive(), "kernel B waited for kernel A's lock"
        assert isinstance(out_b["result"], FakeKernel)
        assert ta.is_alive()  # A still waits for the other process
    finally:
        holder.release()
    ta.join(timeout=20)
    assert not ta.is_alive() and isinstance(out_a["result"], FakeKernel)
