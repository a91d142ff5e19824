"""The writer pipeline: bounded queue, drops, blocking mode, slow and failing backends."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import traintrace as tt
from traintrace import _pipeline, _recorder


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
@pytest.mark.parametrize(("setting", "added"), [(None, 3), ("0", 0), ("7", 7)])
def test_the_writer_runs_a_little_nicer_than_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None, added: int
) -> None:
    """``writer_nice`` (default 3, ``TRAINTRACE_WRITER_NICE``) is added to the writer thread's niceness,
    and only to it: the training thread and the process keep theirs."""
    if setting is not None:
        monkeypatch.setenv("TRAINTRACE_WRITER_NICE", setting)
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    tt.configure(job_id="j", log_dir=str(tmp_path), backends={"log": False})
    tt.event("written")
    tt.flush()  # the writer has run its first cycle, where it sets its priority
    writers = [t for t in threading.enumerate() if t.name == "traintrace-writer"]
    assert len(writers) == 1 and writers[0].native_id is not None
    assert os.getpriority(os.PRIO_PROCESS, writers[0].native_id) == min(main + added, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
    tt.close()


def _writer() -> threading.Thread:
    writers = [t for t in threading.enumerate() if t.name == "traintrace-writer"]
    assert len(writers) == 1 and writers[0].native_id is not None
    return writers[0]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="needs two cores, Linux"
)
def test_the_writer_keeps_off_the_training_threads_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``writer_spare_core`` (default on): the writer runs on every core it may use but the one the configuring
    thread is on, and follows that thread when it moves (here: pinned by the test to one core, then another);
    off, it keeps the cores it was started with."""
    monkeypatch.setattr(_pipeline, "_SPARE_CHECK_S", 0.0)  # look at every cycle, not once a second
    allowed = os.sched_getaffinity(0)
    first, second = sorted(allowed)[:2]
    try:
        tt.configure(job_id="j", log_dir=str(tmp_path), backends={"log": False})
        os.sched_setaffinity(0, {first})  # the kernel moves this thread there now
        tt.event("written")
        tt.flush()
        writer = _writer()
        assert writer.native_id is not None
        assert os.sched_getaffinity(writer.native_id) == allowed - {first}
        os.sched_setaffinity(0, {second})
        tt.event("moved")
        tt.flush()
        assert os.sched_getaffinity(writer.native_id) == allowed - {second}
        tt.close()
        monkeypatch.setenv("TRAINTRACE_WRITER_SPARE_CORE", "0")
        tt.configure(job_id="j", log_dir=str(tmp_path / "off"), backends={"log": False})
        tt.flush()
        writer = _writer()
        assert writer.native_id is not None
        assert os.sched_getaffinity(writer.native_id) == {second}  # inherited from this thread, untouched
    finally:
        tt.close()
        os.sched_setaffinity(0, allowed)


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


class CallLog(tt.BaseBackend):
    """Keeps every write (its records) and every flush, in the order they came."""

    def __init__(self, verbosity: int) -> None:
        self.verbosity = verbosity
        self.calls: list[tuple[str, list[dict[str, Any]]]] = []

    def write(self, records: Sequence[Any]) -> None:
        self.calls.append(("write", [dict(r) for r in records]))

    def flush(self) -> None:
        self.calls.append(("flush", []))

    def call_with(self, kind: str, name: str) -> int:
        """The index of the write holding the record of that kind and name."""
        (index,) = [
            i for i, (call, records) in enumerate(self.calls)
            if any(r["kind"] == kind and r.get("name") == name for r in records)
        ]  # fmt: skip
        return index


@pytest.mark.parametrize("beside_file", [False, True], ids=["dicts_only", "beside_the_native_file_writer"])
def test_no_flush_between_a_span_written_whole_and_its_events(tmp_path: Path, beside_file: bool) -> None:
    """A span that ends while the writer is mid-cycle, its event queued past the cycle's budget.

    The writer writes it whole where its start stands in the queue; the cycle must go on to
    its stop before flushing the backends, or a backend that attaches events to their span
    (OTLP traces) would have sent it already when the event comes.
    """
    calls = CallLog(int(tt.Verbosity.TRACING))
    # Beside a file at a finer level the native encoder writes the file and hands the
    # records the other backend wants to Python: the two count the span together.
    backends: Any = {"file": {"verbosity": "profiling"}, "log": False} if beside_file else []
    rec = tt.configure(
        job_id="late", log_dir=str(tmp_path), backends=backends, extra_backends=[calls], flush_interval=5.0
    )
    if beside_file and _recorder.CORE == "native":
        assert rec._pipeline.native is not None
    stalled, resume = threading.Event(), threading.Event()

    class Stall:
        def __repr__(self) -> str:  # converted on the writer thread, which waits here
            stalled.set()
            resume.wait(10)
            return "stall"

    with tt.span("outer"):
        tt.flush()  # the writer is idle now, for flush_interval
        tt.event("filler", {"stall": Stall()})
        for i in range(510):  # the cycle's first chunk (512 items) ends with the span's start
            tt.event("filler", {"i": i})
        span = tt.start("late_span")
        rec._pipeline.wake()
        assert stalled.wait(10), "the writer did not begin a cycle"
        tt.event("inside_late_span")  # past the cycle's budget
        tt.stop(span)
        resume.set()
    tt.close()
    written = calls.call_with("span", "late_span")
    event = calls.call_with("event", "inside_late_span")
    assert written <= event
    assert ("flush", []) not in calls.calls[written:event]


class _Clocks:
    """Scripted clock readings: (perf_counter_ns, time_ns) pairs taken in the order _refresh_anchor asks."""

    def __init__(self, readings: list[tuple[int, int, int]]) -> None:
        # Each reading: monotonic before, wall, monotonic after.
        self.mono = [value for before, _, after in readings for value in (before, after)]
        self.wall = [wall for _, wall, _ in readings]

    def perf_counter_ns(self) -> int:
        return self.mono.pop(0)

    def time_ns(self) -> int:
        return self.wall.pop(0)


def _anchor_after(monkeypatch: pytest.MonkeyPatch, readings: list[tuple[int, int, int]], previous: int) -> Any:
    clocks = _Clocks(readings)
    monkeypatch.setattr(_pipeline.time, "perf_counter_ns", clocks.perf_counter_ns)
    monkeypatch.setattr(_pipeline.time, "time_ns", clocks.time_ns)
    pipeline = object.__new__(_pipeline.Pipeline)
    pipeline._anchor_wall, pipeline._anchor_mono = previous * 10, previous
    pipeline._refresh_anchor()
    monkeypatch.undo()
    return pipeline._anchor_wall, pipeline._anchor_mono, len(clocks.wall)


def test_the_clock_anchor_is_taken_from_a_tight_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reading interrupted between its monotonic reads (a loaded machine) is not the anchor."""
    loose, tight = (1_000, 7, 3_001_000), (3_002_000, 9, 3_002_100)
    assert _anchor_after(monkeypatch, [loose, tight], previous=5) == (9, 3_002_050, 0)
    # Three loose readings: the last anchor stays for this cycle.
    assert _anchor_after(monkeypatch, [loose, loose, loose], previous=5) == (50, 5, 0)
    # The first anchor is taken whatever its reading.
    assert _anchor_after(monkeypatch, [loose, loose, loose], previous=0) == (7, 1_501_000, 0)
    # A tight first reading is enough.
    assert _anchor_after(monkeypatch, [tight, loose], previous=5) == (9, 3_002_050, 1)


def test_a_rung_and_cleared_wakeup_waits_again() -> None:
    """clear() empties the pipe: the next wait waits (on the pipe too, as the native writer's does)."""
    import select

    from traintrace._wakeup import Wakeup

    wake = Wakeup()
    wake.set()
    assert wake.wait(0.0)
    wake.clear()
    assert not wake.is_set()
    assert not wake.wait(0.01)
    assert select.select([wake.fileno()], [], [], 0)[0] == []


def test_an_idle_writer_waits_between_cycles(tmp_path: Path) -> None:
    """With nothing queued the writer waits its flush interval (or a ring), never loops on an empty queue."""
    rec = tt.configure(job_id="idle", log_dir=str(tmp_path), backends={"log": False}, flush_interval=0.2)
    with tt.training_loop():
        for step in range(1000):  # an arrival rate for the writer to pace itself on
            with tt.training_iteration(step):
                pass
    assert tt.flush(10)
    before = rec._pipeline.cycles
    time.sleep(1.0)
    idle_cycles = rec._pipeline.cycles - before
    tt.close()
    assert idle_cycles <= 10  # one per flush interval (5 in the second), not one per empty wait


class BatchSizes(tt.BaseBackend):
    """Notes the size of every batch it is given, and the records in order."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.steps: list[int] = []

    def write(self, records: Sequence[Any]) -> None:
        self.sizes.append(len(records))
        self.steps.extend(r["attrs"]["step"] for r in records if r.get("name") == "e")


@pytest.mark.parametrize("beside_file", [False, True], ids=["dicts_only", "beside_the_native_file_writer"])
def test_a_backend_gets_records_a_chunk_at_a_time_however_short_the_writers_slices(
    tmp_path: Path, beside_file: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer hands the GIL back every slice (0.2 ms); a backend other than the native file still gets full
    chunks, in order: a slow one (a network, 60 ms a write) would otherwise be called for every slice's few
    records, and a close under a deadline would run out of time (test_reliability_death's two SIGTERMs)."""
    monkeypatch.setattr(_pipeline, "_SLICE_NS", 1)  # every conversion call ends its slice
    sizes = BatchSizes()
    backends: Any = {"file": {"path": "f.jsonl"}, "log": False} if beside_file else []
    tt.configure(job_id="chunks", log_dir=str(tmp_path), backends=backends, extra_backends=[sizes], flush_interval=30)
    try:
        for step in range(3000):
            tt.event("e", {"step": step})
        assert tt.flush(timeout=30)
    finally:
        tt.close()
    assert sizes.steps == list(range(3000))
    assert all(size >= _pipeline._CHUNK for size in sizes.sizes[:-2]), sizes.sizes  # the last: the rest, the close
    assert len(sizes.sizes) <= 3000 // _pipeline._CHUNK + 3, sizes.sizes
