"""The ray runtime's driver re-executes itself under Ray's jemalloc (see tba.allocator); the
re-execution itself is exercised by the end-to-end CLI run in test_cli_integration.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tba import allocator

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


def test_jemalloc_ships_with_ray():
    path = allocator.jemalloc_path()
    assert path is not None and path.name == "libjemalloc.so" and path.parent.name == "core"


def test_choice_from_the_environment(monkeypatch):
    monkeypatch.delenv(allocator.ENV_CHOICE, raising=False)
    assert allocator.wanted()
    monkeypatch.setenv(allocator.ENV_CHOICE, "System")
    assert not allocator.wanted()
    monkeypatch.setenv(allocator.ENV_CHOICE, "tcmalloc")
    with pytest.raises(ValueError, match="TBA_ALLOCATOR='tcmalloc': use 'jemalloc'"):
        allocator.wanted()


def test_the_reexecuted_process_gives_children_the_users_preload(monkeypatch):
    """After the re-execution, LD_PRELOAD is the user's own again, and a second re-execution is refused."""
    monkeypatch.setattr(allocator, "_reexecuted", False)
    monkeypatch.setenv("TBA_ALLOCATOR_REEXEC", "1")
    monkeypatch.setenv("TBA_ALLOCATOR_SAVED_PRELOAD", "/opt/libmine.so")
    monkeypatch.setenv("LD_PRELOAD", "/x/ray/core/libjemalloc.so /opt/libmine.so")
    allocator.restore_environment()
    assert os.environ["LD_PRELOAD"] == "/opt/libmine.so"
    assert "TBA_ALLOCATOR_REEXEC" not in os.environ and allocator._reexecuted
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    allocator.reexec_under_jemalloc(["train"])
    assert calls == []  # never twice


def test_reexec_sets_the_preload_and_keeps_the_arguments(monkeypatch):
    monkeypatch.setattr(allocator, "_reexecuted", False)
    monkeypatch.setattr(allocator, "loaded", lambda: False)
    monkeypatch.delenv("TBA_ALLOCATOR_REEXEC", raising=False)
    monkeypatch.delenv(allocator.ENV_CHOICE, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/libmine.so")
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    allocator.reexec_under_jemalloc(["train", "--trainer.steps=5"])
    ((exe, argv, env),) = calls
    assert exe == sys.executable and argv == [sys.executable, "-m", "tba", "train", "--trainer.steps=5"]
    assert env["LD_PRELOAD"] == f"{allocator.jemalloc_path()} /opt/libmine.so"
    assert env["TBA_ALLOCATOR_SAVED_PRELOAD"] == "/opt/libmine.so" and env["TBA_ALLOCATOR_REEXEC"] == "1"


def test_a_bad_choice_stops_tba_train_in_one_line(tmp_path):
    env = {**os.environ, allocator.ENV_CHOICE: "fast"}
    proc = subprocess.run(
        [sys.executable, "-m", "tba", "train", "--runtime.type=ray", f"--run.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "TBA_ALLOCATOR='fast'" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())
