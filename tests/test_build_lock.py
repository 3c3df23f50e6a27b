"""The C++ extension's build lock: a ``lock`` file left by a killed build is removed, not waited on forever,
and a live build elsewhere is waited for (kernels/build_lock.py, and kernels/cpu_kernels.load using it)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from specgraph.kernels import build_lock, cpu_kernels


def test_a_lock_left_by_a_killed_build_is_removed_with_a_warning(tmp_path):
    stale = tmp_path / build_lock.TORCH_LOCK
    stale.touch()
    with pytest.warns(UserWarning, match="left by a build of the C.. CPU kernels that was killed"):
        with build_lock.exclusive_build(str(tmp_path)):
            assert not stale.exists()


def test_no_lock_file_no_warning(tmp_path, recwarn):
    with build_lock.exclusive_build(str(tmp_path)):
        pass
    assert not [w for w in recwarn if "killed" in str(w.message)]


def test_a_live_build_in_another_process_is_waited_for_and_its_lock_kept(tmp_path, capfd):
    # another process holds the specgraph lock (a build in progress) and torch's lock file is there: both are
    # live, so this process waits, says so, and finds torch's file gone only because the builder removed it
    torch_lock = tmp_path / build_lock.TORCH_LOCK
    torch_lock.touch()
    builder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        with open({str(tmp_path / build_lock.OWN_LOCK)!r}, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            print("held", flush=True)
            time.sleep(1.0)
            os.remove({str(torch_lock)!r})  # the build ends: torch removes its lock, then ours is released
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def enter():
            with build_lock.exclusive_build(str(tmp_path)):
                entered.set()

        waiter = threading.Thread(target=enter)
        t0 = time.perf_counter()
        waiter.start()
        assert not entered.wait(0.3), "entered while another process held the build lock"
        waiter.join(timeout=10)
        assert entered.is_set() and time.perf_counter() - t0 >= 0.5
    finally:
        returncode = builder.wait(timeout=10)
    assert returncode == 0, "the live builder's lock file was removed under it"
    assert "waiting for another process that is building" in capfd.readouterr().err


def test_a_killed_builders_flock_does_not_block(tmp_path):
    # the kernel drops a dead process's flock: what the torch lock file alone could not tell
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        f = open({str(tmp_path / build_lock.OWN_LOCK)!r}, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        open({str(tmp_path / build_lock.TORCH_LOCK)!r}, "w").close()
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(timeout=10)
    with pytest.warns(UserWarning, match="killed"):
        with build_lock.exclusive_build(str(tmp_path)):
            assert not (tmp_path / build_lock.TORCH_LOCK).exists()


def test_load_builds_under_the_lock_with_a_stale_torch_lock_gone(tmp_path, monkeypatch):
    (tmp_path / build_lock.TORCH_LOCK).touch()
    seen = {}

    def fake_build():
        seen["torch lock during the build"] = os.path.exists(tmp_path / build_lock.TORCH_LOCK)
        raise RuntimeError("no compiler here")  # load's own fallback: a warning, the torch path

    monkeypatch.setattr(cpu_kernels, "build_directory", lambda: str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_build", fake_build)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    with pytest.warns(UserWarning) as warned:
        assert cpu_kernels.load() is None
    assert seen == {"torch lock during the build": False}
    assert cpu_kernels.build_error() == "RuntimeError: no compiler here"
    assert any("killed" in str(w.message) for w in warned)
