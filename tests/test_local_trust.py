"""Local trust (N13b, N13c, N20): what another local user could plant is never run or served.

- a child process does not import from the working directory (a shared directory the server
  was started from);
- the compiled kernels and the converted weights are read back from the cache only when this
  user alone could have written them; else they are built or converted again (or, for a cache
  directory that is not private, the error says how to fix it);
- a cached kernel build that does not load (truncated) is built again, not given up on.

The compiler and the GGUF conversion are faked here (``_build``, ``_convert_gguf``) except in
the one slow test that rebuilds a truncated kernel library for real, in a process of its own.
"""

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from actors.process import ProcessChild, import_path
from models import cpu_kernels, loading
from models.errors import ModelLoadError
from models.private_cache import CacheNotPrivate, private_dir, why_untrusted

from .conftest import ROOT

AS_ROOT = os.geteuid() == 0
OTHER_UID = 54321


def mode_of(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TERCET_CACHE_DIR", str(root))
    return root


# -- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "says"), [(0o020, "its group"), (0o002, "other users"),
                                            (0o022, "its group and other users")])
def test_a_file_writable_by_others_is_untrusted(tmp_path, bits, says):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    f.chmod(0o644)
    assert why_untrusted(f) is None
    f.chmod(0o644 | bits)
    assert f"writable by {says} (mode {0o644 | bits:04o})" in why_untrusted(f)


@pytest.mark.skipif(not AS_ROOT, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_untrusted(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    os.chown(f, OTHER_UID, -1)
    assert f"owned by uid {OTHER_UID}, not by this user" in why_untrusted(f)


def test_private_dir_is_made_0700_and_an_open_one_refused(tmp_path):
    made = private_dir(tmp_path / "a" / "b")
    assert mode_of(made) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # even sticky, as /tmp: another user may add a file under our names
    with pytest.raises(CacheNotPrivate, match=r"writable by its group and other users .*chmod go-w"):
        private_dir(shared)


# -- the kernel library (N13c, N20) --------------------------------------------------------


@pytest.fixture
def fake_build(monkeypatch):
    """``_build`` without the compiler: records where it was asked to build (the real one
    compiles, loads and publishes; here nothing is loaded)."""
    built = []

    def build(target):
        built.append((target, target.exists()))

    monkeypatch.setattr(cpu_kernels, "_build", build)
    monkeypatch.setenv("TERCET_CPU_KERNELS", "1")
    return built


def kernels_target(cache):
    return cache / "kernels" / f"tercet_cpu_{cpu_kernels._digest()}.so"


def load_kernels():
    return cpu_kernels.load.__wrapped__()  # (load() is cached per process)


@pytest.mark.parametrize("bits", [0o020, 0o002])
def test_a_cached_build_writable_by_others_is_not_loaded_but_rebuilt(cache, fake_build, caplog, bits):
    target = kernels_target(cache)
    private_dir(target.parent)
    target.write_bytes(b"planted")
    target.chmod(0o755 | bits)
    with caplog.at_level(logging.WARNING, logger="models.cpu_kernels"):
        assert load_kernels()
    assert fake_build == [(target, False)]  # removed first: never loaded, built again in its place
    assert "rebuilding the tercet CPU kernels" in caplog.text and "writable by" in caplog.text


def test_a_truncated_build_is_rebuilt(cache, fake_build, caplog):
    target = kernels_target(cache)
    private_dir(target.parent)
    target.write_bytes(b"\x7fELF\x02\x01\x01")  # a build cut short (a full disk, a kill)
    target.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="models.cpu_kernels"):
        assert load_kernels()
    assert fake_build == [(target, False)]
    assert "does not load" in caplog.text


def test_a_kernel_cache_that_is_not_private_is_not_used(cache, fake_build, caplog):
    shared = cache / "kernels"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    planted = kernels_target(cache)
    planted.write_bytes(b"planted")
    with caplog.at_level(logging.WARNING, logger="models.cpu_kernels"):
        assert load_kernels()
    ((target, existed),) = fake_build
    assert not target.is_relative_to(cache) and not existed  # built elsewhere, the planted one untouched
    assert not target.parent.exists()  # that private directory is gone once the library is loaded
    assert planted.read_bytes() == b"planted"
    assert "not using the kernel cache" in caplog.text and "chmod go-w" in caplog.text


@pytest.mark.slow
def test_a_truncated_build_is_rebuilt_for_real(cache, tmp_path):
    """The compiler runs (6-35 s, more on a busy host) in a process of its own: this one may have
    the kernels loaded already."""
    target = kernels_target(cache)
    private_dir(target.parent)
    target.write_bytes(b"\x7fELF" + bytes(60))
    target.chmod(0o755)
    code = ("import torch; from models import cpu_kernels; ok = cpu_kernels.load(); "
            "print(ok and torch.ops.tercet.packed_linear_available() in (True, False))")
    env = {**os.environ, "TERCET_CACHE_DIR": str(cache), "TERCET_CPU_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=570, env=env,
                          cwd=ROOT)
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert "does not load" in done.stderr
    assert target.stat().st_size > 10_000 and why_untrusted(target) is None


# -- the converted weights (N13c) ----------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf file and a conversion that writes what the real one does (a marker and a weights
    file), counting its runs."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    runs = []

    def convert(source, out):
        runs.append(out)
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "tercet-source.json").write_text(json.dumps({"gguf": str(source)}))

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    return gguf, runs


def test_a_conversion_is_reused_while_it_is_private(cache, fake_gguf):
    gguf, runs = fake_gguf
    old = os.umask(0o002)  # a umask that lets the group write: tercet's files never do
    try:
        first = loading.converted_gguf_dir(gguf)
    finally:
        os.umask(old)
    assert mode_of(cache) == 0o700 and mode_of(first) == 0o700
    assert all(mode_of(p) & 0o022 == 0 for p in first.iterdir())
    assert loading.converted_gguf_dir(gguf) == first and len(runs) == 1


@pytest.mark.parametrize("what", ["model.safetensors", "tercet-source.json", "."])
def test_a_conversion_writable_by_others_is_converted_again(cache, fake_gguf, caplog, what):
    gguf, runs = fake_gguf
    first = loading.converted_gguf_dir(gguf)
    (first / what).chmod(mode_of(first / what) | 0o002)
    with caplog.at_level(logging.WARNING, logger="models.loading"):
        again = loading.converted_gguf_dir(gguf)
    assert again == first and len(runs) == 2
    assert (again / "model.safetensors").read_bytes() == b"weights" and mode_of(again / what) & 0o022 == 0
    assert "converting" in caplog.text and "writable by other users" in caplog.text


@pytest.mark.skipif(not AS_ROOT, reason="giving a file to another user needs root")
def test_a_conversion_of_another_user_is_converted_again(cache, fake_gguf):
    gguf, runs = fake_gguf
    first = loading.converted_gguf_dir(gguf)
    os.chown(first / "model.safetensors", OTHER_UID, -1)
    assert loading.converted_gguf_dir(gguf) == first and len(runs) == 2
    assert (first / "model.safetensors").stat().st_uid == os.geteuid()


def test_a_new_version_of_a_gguf_prunes_what_earlier_ones_left(cache, fake_gguf, monkeypatch, tmp_path):
    """N15: each changed .gguf used to add a conversion that was never read again, and a conversion
    killed midway left its scratch directory behind for good."""
    gguf, runs = fake_gguf

    def convert(source, out):
        runs.append(out)
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "tercet-source.json").write_text(json.dumps({"path": str(source.resolve())}))

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    first = loading.converted_gguf_dir(gguf)
    twin = tmp_path / "elsewhere" / "model.gguf"  # the same name, another file: its conversion stays
    twin.parent.mkdir()
    twin.write_bytes(b"GGUF, another")
    kept = loading.converted_gguf_dir(twin)
    gguf.write_bytes(b"GGUF, version 2")  # another size: another cache key
    target = cache / f"model-{loading._cache_key(gguf)}"
    killed = cache / f".convert-{target.name}-abc123"  # a conversion of version 2 killed midway
    killed.mkdir()
    second = loading.converted_gguf_dir(gguf)
    assert second == target != first and len(runs) == 3
    assert not first.exists() and not killed.exists() and kept.is_dir()
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == sorted([second.name,
                                                                                                 kept.name])


def test_a_weights_cache_that_is_not_private_is_refused_with_the_fix(cache, fake_gguf):
    gguf, runs = fake_gguf
    cache.mkdir()
    cache.chmod(0o775)
    with pytest.raises(ModelLoadError, match=r"weights cache is not private: .*writable by its group.*chmod go-w"):
        loading.converted_gguf_dir(gguf)
    assert runs == []


# -- child processes (N13b) ----------------------------------------------------------------


class ReportPath:
    """Writes its process's sys.path and PYTHONPATH to ``out``, then stays until stopped."""

    def __init__(self, out):
        self.out = out
        self.stopped = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        import importlib.util

        Path(self.out).write_text(json.dumps({"sys.path": sys.path, "PYTHONPATH": os.environ.get("PYTHONPATH"),
                                              "planted": importlib.util.find_spec("planted") is not None}))
        task_status.started()
        await self.stopped.wait()

    async def stop(self):
        self.stopped.set()
        await trio.lowlevel.checkpoint()


def report_path(hub, out):
    return ReportPath(out)


async def test_a_child_process_does_not_import_from_the_working_directory(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "planted.py").write_text("")
    (shared / "msgspec.py").write_text("raise SystemExit('imported a planted msgspec')")  # the child imports it
    monkeypatch.chdir(shared)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["", ".", "relative/dir", str(tmp_path / "absolute")]))
    out = tmp_path / "report.json"
    child = ProcessChild("tests.test_local_trust:report_path", {"out": str(out)}, name="report")
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            await nursery.start(child.run)
        await child.stop()
    report = json.loads(out.read_text())
    assert not report["planted"]
    assert str(shared) not in report["sys.path"] and "" not in report["sys.path"]
    assert report["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(tmp_path / "absolute")]


def test_import_path_keeps_absolute_entries_once():
    assert import_path(None) == str(ROOT)
    assert import_path(f"{ROOT}{os.pathsep}/x{os.pathsep}{os.pathsep}y") == f"{ROOT}{os.pathsep}/x"


def test_only_builds_unused_for_a_month_are_pruned(tmp_path):
    """Two torch versions (or machines) sharing a cache keep each other's builds (N20)."""
    keep, recent, stale = (tmp_path / f"tercet_cpu_{name}.so" for name in ("new", "other", "old"))
    for f in (keep, recent, stale):
        f.write_bytes(b"so")
    month_ago = os.stat(stale).st_mtime - cpu_kernels.UNUSED_S - 60
    os.utime(stale, (month_ago, month_ago))
    cpu_kernels._prune(keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == [keep.name, recent.name]


def test_an_installed_package_adds_nothing_before_the_standard_library(monkeypatch):
    import site

    from actors import process

    monkeypatch.setattr(site, "getsitepackages", lambda: [str(ROOT)])  # as if installed there
    monkeypatch.setattr(process, "PACKAGE_ROOT", process._package_root())
    assert process.PACKAGE_ROOT is None and import_path("/x") == "/x" and import_path(None) == ""


def test_a_conversion_holds_a_lock_so_a_second_process_waits_and_reuses_it(cache, fake_gguf, monkeypatch):
    """Issue 29 N12: a replica's scheduler and detokenizer start together; while one converts the GGUF
    the other cannot take the file's lock (it waits, then finds the conversion done)."""
    import fcntl

    gguf, runs = fake_gguf
    convert = loading._convert_gguf
    held = []

    def converting(source, out):
        locks = list(out.parent.glob(".*.lock"))
        assert len(locks) == 1, locks
        with open(locks[0], "a") as other:  # another open file description: another process's view
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(locks[0])
        convert(source, out)

    monkeypatch.setattr(loading, "_convert_gguf", converting)
    first = loading.converted_gguf_dir(gguf)
    assert held and len(runs) == 1
    with open(held[0], "a") as other:  # released once done
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert loading.converted_gguf_dir(gguf) == first and len(runs) == 1
