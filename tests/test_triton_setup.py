"""Triton's per-process set-up beside the first import of the kernel modules
(streamkl_gpu/_core/triton_setup.py): it starts once, runs while the caller's work runs, and is
finished when that work's block exits; off where it is not wanted."""
from __future__ import annotations

import threading
import time

from streamkl_gpu._core import triton_setup


def test_runs_once_beside_the_work_and_is_done_when_the_block_exits(monkeypatch):
    monkeypatch.setattr(triton_setup, "_DONE", False)
    monkeypatch.setattr(triton_setup, "_wanted", lambda: True)
    started, finished = threading.Event(), []

    def slow_setup():
        started.set()
        time.sleep(0.2)
        finished.append(threading.current_thread().name)

    monkeypatch.setattr(triton_setup, "_setup", slow_setup)
    with triton_setup.beside():
        assert started.wait(5)  # running while the block's work runs
        assert finished == []
    assert finished == ["streamkl-triton-setup"]
    with triton_setup.beside():  # once per process
        pass
    assert finished == ["streamkl-triton-setup"]


def test_not_started_where_not_wanted(monkeypatch):
    monkeypatch.setattr(triton_setup, "_DONE", False)
    monkeypatch.setattr(triton_setup, "_setup", lambda: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with triton_setup.beside():
        pass
    monkeypatch.setattr(triton_setup, "_DONE", False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("STREAMKL_TRITON_SETUP_AHEAD", "0")
    assert not triton_setup._wanted()


def test_an_error_in_the_set_up_is_left_for_the_launch(monkeypatch):
    import triton.runtime

    class Broken:
        @property
        def active(self):
            raise RuntimeError("no driver here")

    monkeypatch.setattr(triton.runtime, "driver", Broken())
    triton_setup._setup()  # returns quietly
