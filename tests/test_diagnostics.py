"""Tests for enginekit.diagnostics: each resource shows up in a diff and goes away again."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from enginekit import diagnostics
from enginekit.diagnostics import (
    ProcessSnapshot,
    SnapshotDiff,
    format_table,
    snapshot,
    wait_until_clean,
)
from process_support import HANG_GUARD_S

MIB = 2**20
LINUX = sys.platform.startswith("linux")


def _sleep_command(seconds: int) -> list[str]:
    sleep = shutil.which("sleep")
    if sleep is not None:
        return [sleep, str(seconds)]
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


@pytest.fixture
def blocked_thread() -> Iterator[tuple[threading.Thread, threading.Event]]:
    """A thread that waits on an event; the fixture releases and joins it."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="diagnostics-test-blocked", daemon=True)
    try:
        yield thread, release
    finally:
        release.set()
        if thread.is_alive():
            thread.join(timeout=10)
        assert not thread.is_alive()


def test_snapshot_fields_are_sane() -> None:
    snap = snapshot()
    assert snap.num_threads >= 1
    assert snap.num_threads == len(snap.thread_names)
    assert threading.current_thread().name in snap.thread_names
    assert list(snap.thread_names) == sorted(snap.thread_names)
    if LINUX:
        assert snap.num_fds >= 3
    assert snap.rss_bytes > 0
    assert snap.gc_freeze_count >= 0
    assert all(isinstance(pid, int) and pid > 0 for pid in snap.child_pids)
    assert os.getpid() not in snap.child_pids
    assert snap.sigint_handler
    assert snap.sigterm_handler
    assert snap.num_tensors >= 0
    assert snap.tensor_bytes >= 0
    assert snap.cuda_allocated_bytes >= 0
    with pytest.raises(dataclasses.FrozenInstanceError, match="num_threads"):
        snap.num_threads = 0  # type: ignore[misc]


def test_back_to_back_snapshots_are_clean() -> None:
    first = snapshot()
    second = snapshot()
    diff = first.diff(second)
    assert isinstance(diff, SnapshotDiff)
    assert diff.leaks() == []
    assert (diff.threads, diff.fds, diff.children, diff.gc_freeze_count) == (0, 0, 0, 0)
    assert not diff.handlers_changed
    assert diff.new_thread_names == ()
    assert diff.new_child_pids == ()
    assert str(diff).endswith("clean")
    row = diff.as_row()
    assert row["clean"] is True
    assert row["threads"] == 0
    assert isinstance(row["rss_mib"], float)


def test_collect_false_still_measures() -> None:
    snap = snapshot(collect=False)
    assert snap.num_threads >= 1
    assert snap.rss_bytes > 0


def test_started_thread_shows_up_with_its_name(
    blocked_thread: tuple[threading.Thread, threading.Event],
) -> None:
    thread, release = blocked_thread
    before = snapshot()
    thread.start()
    diff = before.diff(snapshot())
    assert diff.threads == 1
    assert diff.new_thread_names == ("diagnostics-test-blocked",)
    assert any("diagnostics-test-blocked" in leak for leak in diff.leaks())
    assert "threads +1" in str(diff)
    release.set()
    thread.join(timeout=10)
    assert before.diff(snapshot()).leaks() == []


def test_replaced_thread_counts_as_leak_even_if_total_is_unchanged() -> None:
    before = snapshot()
    after = dataclasses.replace(
        before,
        thread_names=tuple(
            sorted([name for name in before.thread_names if name != "MainThread"] + ["other"])
        ),
    )
    diff = before.diff(after)
    assert diff.threads == 0
    assert diff.new_thread_names == ("other",)
    assert any("'other'" in leak for leak in diff.leaks())


@pytest.mark.skipif(not LINUX, reason="counts descriptors through /proc")
def test_opened_file_shows_one_more_fd(tmp_path: Path) -> None:
    path = tmp_path / "held.txt"
    path.write_text("x")
    before = snapshot()
    handle = path.open()
    try:
        diff = before.diff(snapshot())
        assert diff.fds == 1
        assert diff.leaks() == ["file descriptors: +1"]
    finally:
        handle.close()
    assert before.diff(snapshot()).fds == 0


def test_sleep_subprocess_is_a_child_until_it_ends() -> None:
    before = snapshot()
    process = subprocess.Popen(_sleep_command(30))
    try:
        during = before.diff(snapshot())
        assert process.pid in during.after.child_pids
        assert process.pid in during.new_child_pids
        assert during.children == 1
        assert any(str(process.pid) in leak for leak in during.leaks())
    finally:
        _stop(process)
    after = before.diff(snapshot())
    assert process.pid not in after.after.child_pids
    assert after.children == 0
    assert after.new_child_pids == ()


@pytest.mark.skipif(not LINUX, reason="uses a shell and process groups")
@pytest.mark.parametrize("without_psutil", [False, True], ids=["psutil", "proc"])
def test_grandchildren_are_found(monkeypatch: pytest.MonkeyPatch, without_psutil: bool) -> None:
    if without_psutil:
        # An entry of None makes `import psutil` raise ImportError: the /proc fallback runs.
        monkeypatch.setitem(sys.modules, "psutil", None)
    else:
        pytest.importorskip("psutil")
    before = snapshot()
    sleep = " ".join(_sleep_command(30))
    shell = subprocess.Popen(["/bin/sh", "-c", f"{sleep} & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        diff = before.diff(snapshot())
        while len(diff.new_child_pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
            diff = before.diff(snapshot())
        assert shell.pid in diff.new_child_pids
        assert len(diff.new_child_pids) == 2
    finally:
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shell.wait(timeout=10)
    # The orphaned grandchild is reaped by init, not by us; wait for it to disappear.
    final = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert final.new_child_pids == ()


@pytest.mark.skipif(not LINUX, reason="reads process states through /proc or psutil")
@pytest.mark.parametrize("without_psutil", [False, True], ids=["psutil", "proc"])
def test_a_child_that_exited_unreaped_is_a_zombie_until_waited_for(
    monkeypatch: pytest.MonkeyPatch, without_psutil: bool
) -> None:
    if without_psutil:
        monkeypatch.setitem(sys.modules, "psutil", None)
    before = snapshot()
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Wait for the exit without reaping it (WNOWAIT): the child stays a zombie until it is waited for.
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        diff = before.diff(snapshot())
        assert process.pid in diff.after.zombie_pids and process.pid not in diff.after.child_pids
        assert (diff.zombies, diff.new_zombie_pids, diff.children) == (1, (process.pid,), 0)
        assert f"zombie processes (exited, never reaped): +1 (new pids: {process.pid})" in diff.leaks()
        assert diff.as_row()["zombies"] == 1 and "zombies +1" in str(diff)
    finally:
        process.wait(timeout=10)
    assert before.diff(snapshot()).leaks() == []


def test_gc_freeze_grows_and_unfreeze_restores() -> None:
    before = snapshot()
    if before.gc_freeze_count != 0:
        pytest.skip("objects were already frozen before this test")
    gc.freeze()
    try:
        diff = before.diff(snapshot())
        assert diff.gc_freeze_count > 0
        assert any(leak.startswith("gc frozen objects") for leak in diff.leaks())
    finally:
        gc.unfreeze()
    diff = before.diff(snapshot())
    assert diff.gc_freeze_count == 0
    assert diff.leaks() == []


def _custom_handler(signum: int, frame: FrameType | None) -> None:
    """A SIGINT handler that is never called."""


class _HandlerOwner:
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """A bound-method handler that is never called."""


def test_installed_sigint_handler_is_a_change_and_restoring_it_is_not() -> None:
    previous = signal.getsignal(signal.SIGINT)
    before = snapshot()
    signal.signal(signal.SIGINT, _custom_handler)
    try:
        diff = before.diff(snapshot())
        assert diff.handlers_changed
        assert "_custom_handler" in diff.after.sigint_handler
        assert diff.after.sigterm_handler == before.sigterm_handler
        assert any(leak.startswith("signal handlers changed: SIGINT") for leak in diff.leaks())
    finally:
        signal.signal(signal.SIGINT, previous)
    diff = before.diff(snapshot())
    assert not diff.handlers_changed
    assert diff.leaks() == []


def test_handler_descriptions_are_stable() -> None:
    previous = signal.getsignal(signal.SIGINT)
    owner = _HandlerOwner()
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert snapshot(collect=False).sigint_handler == "default_int_handler"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert snapshot(collect=False).sigint_handler == "SIG_IGN"
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        assert snapshot(collect=False).sigint_handler == "SIG_DFL"
        # A fresh bound-method object for the same method and instance reads the same.
        signal.signal(signal.SIGINT, owner.on_signal)
        first = snapshot(collect=False).sigint_handler
        signal.signal(signal.SIGINT, owner.on_signal)
        assert snapshot(collect=False).sigint_handler == first
        assert "_HandlerOwner.on_signal" in first
        signal.signal(signal.SIGINT, _HandlerOwner().on_signal)
        assert snapshot(collect=False).sigint_handler != first
    finally:
        signal.signal(signal.SIGINT, previous)


def test_torch_tensors_are_counted_once_per_storage() -> None:
    torch = pytest.importorskip("torch")
    warmup = torch.zeros(4)
    del warmup
    before = snapshot()
    base = torch.zeros(256, 1024)  # 1 MiB of float32
    view = base[0]
    try:
        diff = before.diff(snapshot())
        assert diff.tensors == 2
        assert diff.tensor_bytes == MIB
        assert any(leak.startswith("tensors: +2") for leak in diff.leaks())
        assert diff.as_row()["tensor_mib"] == 1.0
    finally:
        del base, view
    diff = before.diff(snapshot())
    assert diff.tensors == 0
    assert diff.tensor_bytes == 0
    if not torch.cuda.is_available():
        assert diff.after.cuda_allocated_bytes == 0


def test_snapshot_does_not_import_torch() -> None:
    # Load the diagnostics package on its own so that nothing else in enginekit is imported.
    folder = os.path.dirname(diagnostics.__file__)
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('diag', {diagnostics.__file__!r}, "
        f"submodule_search_locations=[{folder!r}])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['diag'] = module\n"
        "spec.loader.exec_module(module)\n"
        "snap = module.snapshot()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert snap.num_tensors == 0 and snap.tensor_bytes == 0\n"
        "assert snap.cuda_allocated_bytes == 0\n"
        "print('ok')\n"
    )
    assert importlib.util.find_spec("enginekit.diagnostics") is not None
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_rss_and_cuda_growth_are_reported() -> None:
    before = snapshot()
    after = dataclasses.replace(
        before,
        rss_bytes=before.rss_bytes + 100 * MIB,
        cuda_allocated_bytes=before.cuda_allocated_bytes + 2 * MIB,
    )
    diff = before.diff(after)
    leaks = diff.leaks()
    assert any(leak.startswith("resident memory: +100.0 MiB") for leak in leaks)
    assert "CUDA allocated: +2.0 MiB" in leaks
    assert diff.leaks(rss_tolerance_bytes=200 * MIB) == ["CUDA allocated: +2.0 MiB"]
    assert diff.as_row()["rss_mib"] == 100.0
    assert diff.as_row()["cuda_mib"] == 2.0
    assert "2 leak(s)" in str(diff)
    # Shrinking is never a leak.
    assert after.diff(before).leaks() == []


def test_wait_until_clean_returns_clean_once_thread_ends() -> None:
    baseline = snapshot()
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="diagnostics-test-short", daemon=True)
    thread.start()
    full_collections = []

    def release_at_the_second_snapshot(phase: str, info: dict) -> None:
        # wait_until_clean collects fully before each snapshot: its first one sees the thread, which ends
        # while it waits (a timer could fire before it even started, on a busy machine).
        if phase == "start" and info["generation"] == 2:
            full_collections.append(True)
            if len(full_collections) == 2:
                release.set()

    try:
        assert "diagnostics-test-short" in baseline.diff(snapshot()).new_thread_names
        gc.callbacks.append(release_at_the_second_snapshot)
        try:
            diff = wait_until_clean(baseline, timeout=HANG_GUARD_S)
        finally:
            gc.callbacks.remove(release_at_the_second_snapshot)
        assert len(full_collections) >= 2  # the first snapshot still saw the thread: it waited for another
        assert diff.leaks() == []
        assert diff.before is baseline
        assert not thread.is_alive()
    finally:
        release.set()
        thread.join(timeout=10)


def test_wait_until_clean_gives_up_after_timeout(
    blocked_thread: tuple[threading.Thread, threading.Event],
) -> None:
    thread, _ = blocked_thread
    baseline = snapshot()
    thread.start()
    diff = wait_until_clean(baseline, timeout=0.3)  # returns (does not hang) with the leak still there
    assert diff.new_thread_names == ("diagnostics-test-blocked",)
    assert diff.leaks()


def test_wait_until_clean_rejects_negative_timeout() -> None:
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        wait_until_clean(snapshot(), timeout=-1)


def test_format_table_renders_markdown() -> None:
    diff = snapshot().diff(snapshot())
    rows: list[dict[str, object]] = [
        {"mode": "in-process", **diff.as_row()},
        {"mode": "a|b", **diff.as_row(), "note": "extra"},
    ]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 4
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[0] == "mode"
    assert header[1:4] == ["threads", "fds", "children"]
    assert header[-1] == "note"
    separator = lines[1].strip("|").split("|")
    assert all(set(cell) <= {"-", ":"} for cell in separator)
    assert separator[0].endswith("-")  # text column: left-aligned
    assert separator[1].endswith(":")  # numeric column: right-aligned
    assert "a\\|b" in lines[3]
    assert lines[2].rstrip().endswith("|")
    assert len({len(line) for line in lines}) == 1
    rss_cell = lines[2].strip("|").split("|")[header.index("rss_mib")].strip()
    assert re.fullmatch(r"-?\d+\.\d\d", rss_cell)


def test_format_table_rejects_no_rows() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        format_table([])


def test_public_api() -> None:
    assert set(diagnostics.__all__) == {
        "ProcessSnapshot",
        "SnapshotDiff",
        "format_table",
        "snapshot",
        "wait_until_clean",
    }
    assert isinstance(snapshot(), ProcessSnapshot)
