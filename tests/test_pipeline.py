"""The writer pipeline: bounded queue, drops, blocking mode, slow and failing backends."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import traintrace as tt


class SlowBackend(tt.BaseBackend):
    """Takes ``delay`` seconds per batch."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.records: list[dict[str, Any]] = []

    def write(self, records: Sequence[Any]) -> None:
        time.sleep(self.delay)
        self.records.extend(records)


class BrokenBackend(tt.BaseBackend):
    """Raises on every write."""

    def __init__(self) -> None:
        self.calls = 0

    def write(self, records: Sequence[Any]) -> None:
        self.calls += 1
        raise OSError("backend down")


def test_full_queue_drops_and_reports(tmp_path: Path) -> None:
    """With a tiny queue and a slow sink, the caller never waits; drops are recorded."""
    slow = SlowBackend(0.05)
    memory = tt.MemoryBackend()
    rec = tt.configure(job_id="j", log_dir=str(tmp_path), backends=[], extra_backends=[slow, memory], queue_size=16)
    for step in range(2000):
        with tt.training_iteration(step):
            pass
    dropped = rec.dropped
    tt.close()
    assert dropped > 0
    reported = sum(r["count"] for r in memory.of_kind("dropped"))
    assert reported == dropped
    close = memory.records[-1]
    assert close["kind"] == "close" and close["dropped"] == dropped
    spans = len(memory.spans("iteration"))
    assert spans < 2000


def test_blocking_mode_loses_nothing(tmp_path: Path) -> None:
    """blocking=True waits for room instead of dropping."""
    memory = tt.MemoryBackend()
    slow = SlowBackend(0.001)
    rec = tt.configure(
        job_id="j", log_dir=str(tmp_path), backends=[], extra_backends=[slow, memory], queue_size=16, blocking=True
    )
    for step in range(3000):
        with tt.training_iteration(step):
            pass
    tt.close()
    assert rec.dropped == 0
    assert [s["attrs"]["step"] for s in memory.spans("iteration")] == list(range(3000))


def test_failing_backend_does_not_stop_others(tmp_path: Path, caplog: Any) -> None:
    """A backend that raises is logged once, counted, and others still get every record."""
    broken = BrokenBackend()
    memory = tt.MemoryBackend()
    tt.configure(job_id="j", log_dir=str(tmp_path), backends=[], extra_backends=[broken, memory])
    for step in range(10):
        with tt.training_iteration(step):
            pass
        tt.flush()
    tt.close()
    assert len(memory.spans("iteration")) == 10
    assert broken.calls >= 10
    warnings = [r for r in caplog.records if "BrokenBackend" in r.getMessage()]
    assert len(warnings) == 1
    assert memory.records[-1]["backend_failures"]["BrokenBackend#0"] >= 10


def test_flush_interval_writes_without_flush_calls(tmp_path: Path) -> None:
    """Records reach the file within the flush interval without any flush()."""
    rec = tt.configure(job_id="j", log_dir=str(tmp_path), backends={"log": False}, flush_interval=0.05)
    path = rec.routes()[0].backend.path
    tt.event("soon")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and b'"soon"' not in path.read_bytes():
        time.sleep(0.01)
    assert b'"soon"' in path.read_bytes()


def test_slow_backend_does_not_delay_close_beyond_timeout(tmp_path: Path) -> None:
    """close() gives up after close_timeout when a backend hangs."""
    hanging = SlowBackend(3.0)
    tt.configure(job_id="j", log_dir=str(tmp_path), backends=[], extra_backends=[hanging], close_timeout=0.3)
    tt.event("x")
    tt.flush(0.05)
    started = time.monotonic()
    tt.close()
    assert time.monotonic() - started < 2.5
