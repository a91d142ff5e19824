"""Device timing of spans (``_device_timing``): the resolution logic with a fake event class, the
configuration, and the CPU-only guarantee (nothing from CUDA imported or initialised).

The fake device stands in for CUDA only to test traintrace's own logic: each event records the next
device timestamp from a list the test wrote, and completes when the test says the device got there.
The truths (durations, gaps) are computed by the test from its own timestamps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import traintrace as tt
from tests.conftest import read_jsonl
from traintrace import _device_timing
from traintrace._config import ConfigError, build_config
from traintrace.reader import read_file


class FakeStream:
    def __init__(self, key: int) -> None:
        self.key = key
        #: device timestamps (ns) the next records get, in order
        self.times: deque[int] = deque()
        #: the device has executed everything up to this timestamp
        self.reached = 0


class FakeEvent:
    def __init__(self) -> None:
        self.t: int | None = None
        self.stream: FakeStream | None = None
        self.records = 0

    def record(self, stream: Any = None) -> None:
        assert isinstance(stream, FakeStream)
        self.stream = stream
        self.t = stream.times.popleft() if stream.times else stream.reached
        self.records += 1

    def query(self) -> bool:
        assert self.stream is not None and self.t is not None
        return self.t <= self.stream.reached

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.query() and end_event.query(), "elapsed_time of an event that has not completed"
        assert self.t is not None and end_event.t is not None
        return (end_event.t - self.t) / 1e6


class FakeDevice:
    def __init__(self) -> None:
        self.stream = FakeStream(7)
        self.events: list[FakeEvent] = []

    def current(self) -> tuple[int, Any]:
        return self.stream.key, self.stream

    def new_event(self) -> FakeEvent:
        event = FakeEvent()
        self.events.append(event)
        return event


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDevice]:
    fake = FakeDevice()
    monkeypatch.setattr(_device_timing, "device_factory", lambda: fake)
    yield fake
    tt.close()


def _configure(tmp_path: Path, **settings: Any) -> Path:
    base: dict[str, Any] = {
        "job_id": "gpu",
        "log_dir": str(tmp_path / "logs"),
        "backends": {"log": False, "console": False, "file": {"path": "rank{rank}.jsonl"}},
        "device_sample_interval": 0,
        "hang_timeout": 0,
        "device_timing": True,
    }
    base.update(settings)
    tt.configure(**base)
    return tmp_path / "logs" / "rank0.jsonl"


def _records(path: Path) -> list[dict[str, Any]]:
    """The stream's records, each validated against the record schema (gpu_dur and gpu_idle included)."""
    return read_jsonl(path, check="all")


def _spans(records: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """(name, step) -> the span's record (complete records; start/end pairs merged)."""
    starts = {r["id"]: r for r in records if r["kind"] == "start"}
    out: dict[tuple[str, int], dict[str, Any]] = {}
    counts: dict[str, int] = {}
    for r in records:
        if r["kind"] == "span":
            merged = r
        elif r["kind"] == "end":
            merged = {**starts[r["id"]], **r}
        else:
            continue
        n = counts.get(merged["name"], 0)
        counts[merged["name"]] = n + 1
        out[(merged["name"], n)] = merged
    return out


PHASES = (tt.SpanName.FORWARD, tt.SpanName.BACKWARD, tt.SpanName.OPTIMIZER_STEP)


def _plan(steps: int) -> tuple[list[int], dict[tuple[str, int], tuple[int, int]]]:
    """Device timestamps for each record in order, and each span's (start, end) on the device."""
    times: list[int] = []
    truth: dict[tuple[str, int], tuple[int, int]] = {}
    t = 1_000_000
    for step in range(steps):
        it0 = t
        times.append(it0)
        for k, name in enumerate(PHASES):
            t += 100_000 * (k + 1)  # idle before the phase: 0.1, 0.2, 0.3 ms
            start = t
            t += 2_000_000 + 500_000 * k + 10_000 * step  # busy: 2, 2.5, 3 ms (+ a step's drift)
            truth[(name, step)] = (start, t)
            times += [start, t]
        t += 50_000
        times.append(t)
        truth[(tt.SpanName.ITERATION, step)] = (it0, t)
    return times, truth


def _run(steps: int) -> None:
    with tt.training_loop():
        for step in range(steps):
            with tt.training_iteration(step):
                with tt.forward():
                    pass
                with tt.backward():
                    pass
                with tt.optimizer_step():
                    pass


def test_gpu_dur_and_idle_are_the_device_times(device: FakeDevice, tmp_path: Path) -> None:
    """Each phase's record carries the device time between its events and the gap since the last phase."""
    path = _configure(tmp_path)
    times, truth = _plan(4)
    device.stream.times.extend(times)
    _run(4)
    device.stream.reached = times[-1]  # the device finished everything
    tt.close()
    records = _records(path)
    spans = _spans(records)
    for (name, step), (start, end) in truth.items():
        record = spans[(name, step)]
        assert record["gpu_dur"] == end - start, (name, step)
        assert record["dur"] >= 0
    # The gap: from the previous phase's end to this one's start on the same stream.
    for step in range(4):
        for k, name in enumerate(PHASES):
            record = spans[(name, step)]
            if step == 0 and k == 0:
                assert "gpu_idle" not in record  # no earlier phase
                continue
            previous = truth[(PHASES[k - 1], step)] if k else truth[(PHASES[-1], step - 1)]
            assert record["gpu_idle"] == truth[(name, step)][0] - previous[1]
        assert "gpu_idle" not in spans[(tt.SpanName.ITERATION, step)]
    (note,) = [r for r in records if r["kind"] == "event" and r["name"] == "device_timing"]
    assert note["attrs"] == {"timed": 16, "abandoned": 0}
    # traintrace's own reader accepts the new fields (it checks their types).
    read = read_file(path)
    assert read.bad_lines == []
    assert sum(1 for r in read.records() if "gpu_dur" in r) == 16
    # Every record appears once (no duplicate from holding).
    ids = [r["id"] for r in records if r["kind"] in ("span", "end")]
    assert len(ids) == len(set(ids))


def test_training_iterations_event_reports_device_means(device: FakeDevice, tmp_path: Path) -> None:
    """The statistics' interval event gets the mean device time of the phases resolved in the interval."""
    path = _configure(tmp_path)
    times, truth = _plan(3)
    device.stream.times.extend(times)
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                for name in PHASES:
                    with tt.span(name):
                        pass
        device.stream.reached = times[-1]
        tt.flush()  # the events resolve before the loop's end emits the interval
    tt.close()
    (event,) = [r for r in _records(path) if r["kind"] == "event" and r["name"] == "training_iterations"]
    attrs = event["attrs"]

    def mean(name: str) -> float:
        spans = [end - start for (n, _), (start, end) in truth.items() if n == name]
        return sum(spans) / len(spans) / 1e9

    assert attrs["average_forward_device_time"] == pytest.approx(mean(tt.SpanName.FORWARD), rel=1e-9)
    assert attrs["average_backward_device_time"] == pytest.approx(mean(tt.SpanName.BACKWARD), rel=1e-9)
    assert attrs["average_optimizer_update_device_time"] == pytest.approx(mean(tt.SpanName.OPTIMIZER_STEP), rel=1e-9)
    assert attrs["average_iteration_device_time"] == pytest.approx(mean(tt.SpanName.ITERATION), rel=1e-9)
    assert "average_forward_time" in attrs  # the CPU means stay


def test_records_wait_for_the_device_and_pool_events_are_reused(device: FakeDevice, tmp_path: Path) -> None:
    """A span's record is held until its end event completes (no blocking), then written; pairs recycle."""
    path = _configure(tmp_path)
    recorder = tt.get_recorder()
    assert recorder is not None
    timer = recorder.device_timer
    assert timer is not None
    times, truth = _plan(3)
    device.stream.times.extend(times)
    _run(3)
    tt.flush()
    written = [r for r in _records(path) if r["kind"] in ("span", "end") and r["name"] in PHASES]
    assert written == []  # nothing completed on the device yet: every phase held
    # The device reaches the end of step 0's forward only.
    device.stream.reached = truth[(tt.SpanName.FORWARD, 0)][1]
    tt.flush()
    written = [r for r in _records(path) if r["kind"] in ("span", "end") and r["name"] in PHASES]
    assert [r["name"] for r in written] == [tt.SpanName.FORWARD]
    device.stream.reached = times[-1]
    tt.flush()
    written = [r for r in _records(path) if r["kind"] in ("span", "end") and r["name"] in PHASES]
    assert len(written) == 9
    made = len(device.events)
    # Another 50 steps reuse the pool: no event made per span.
    device.stream.times.clear()
    for _ in range(5):
        _run(10)
        device.stream.reached = 10**15
        tt.flush()
    assert len(device.events) == made
    assert max(e.records for e in device.events) > 2


def test_events_that_never_complete_are_abandoned_and_counted(device: FakeDevice, tmp_path: Path) -> None:
    """Past device_timing_timeout a record is written without device time; close is not held up."""
    path = _configure(tmp_path, device_timing_timeout=0.05, close_timeout=2.0)
    device.stream.reached = -1  # the device never gets anywhere
    device.stream.times.extend(range(10**6, 10**6 + 100))
    _run(2)
    tt.close()
    records = _records(path)
    spans = _spans(records)
    assert len(spans) >= 8  # training_loop, 2 iterations, 6 phases
    assert all("gpu_dur" not in r for r in spans.values())
    (note,) = [r for r in records if r["kind"] == "event" and r["name"] == "device_timing"]
    assert note["attrs"]["abandoned"] == 8
    assert note["attrs"]["timed"] == 0
    assert records[-1]["kind"] == "close"


def test_span_held_by_statistics_and_device_timer_is_written_once(device: FakeDevice, tmp_path: Path) -> None:
    """An iteration with a tensor loss is held by the statistics too: one record, loss read, gpu_dur kept."""
    torch = pytest.importorskip("torch")
    path = _configure(tmp_path, log_interval=2)
    times, truth = _plan(2)
    device.stream.times.extend(times)
    with tt.training_loop():
        for step in range(2):
            with tt.training_iteration(step) as it:
                for name in PHASES:
                    with tt.span(name):
                        pass
                it.add_metrics(loss=torch.tensor(0.5 + step))
    device.stream.reached = times[-1]
    tt.close()
    records = _records(path)
    iterations = [r for r in records if r.get("name") == tt.SpanName.ITERATION and r["kind"] in ("span", "end")]
    assert len(iterations) == 2
    for step, record in enumerate(iterations):
        start, end = truth[(tt.SpanName.ITERATION, step)]
        assert record["gpu_dur"] == end - start
        assert record["attrs"]["loss"] == 0.5 + step


def test_phases_setting_chooses_the_timed_spans(device: FakeDevice, tmp_path: Path) -> None:
    path = _configure(tmp_path, device_timing_phases=[tt.SpanName.BACKWARD])
    device.stream.times.extend(range(10**6, 10**6 + 1000, 10))
    _run(2)
    device.stream.reached = 10**9
    tt.close()
    spans = _spans(_records(path))
    timed = {name for (name, _), r in spans.items() if "gpu_dur" in r}
    assert timed == {tt.SpanName.BACKWARD}


def test_device_timing_off_adds_nothing(device: FakeDevice, tmp_path: Path) -> None:
    path = _configure(tmp_path, device_timing=False)
    recorder = tt.get_recorder()
    assert recorder is not None and recorder.device_timer is None
    _run(2)
    tt.close()
    assert device.events == []
    assert all("gpu_dur" not in r for r in _records(path))


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("value", "expected"), [("auto", "auto"), ("true", True), ("off", False), (True, True), (False, False)]
)
def test_device_timing_values(value: object, expected: object) -> None:
    config = build_config(device_timing=value, env={})
    assert config.device_timing == expected
    assert config.device_timing_phases == list(_device_timing.DEFAULT_PHASES)


def test_device_timing_from_the_environment() -> None:
    config = build_config(env={"TRAINTRACE_DEVICE_TIMING": "auto", "TRAINTRACE_DEVICE_TIMING_TIMEOUT": "3"})
    assert config.device_timing == "auto"
    assert config.device_timing_timeout == 3.0
    config = build_config(env={"TRAINTRACE_DEVICE_TIMING": "0", "TRAINTRACE_DEVICE_TIMING_PHASES": "a,b"})
    assert config.device_timing is False
    assert config.device_timing_phases == ["a", "b"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"device_timing": "sometimes"}, "device_timing: expected 'auto', true or false"),
        ({"device_timing": 2}, "device_timing: expected"),
        ({"device_timing_phases": [3]}, "device_timing_phases: expected a list"),
        ({"device_timing_phases": [""]}, "device_timing_phases: expected a list"),
        ({"device_timing_timeout": -1}, "device_timing_timeout"),
    ],
)
def test_bad_device_timing_settings(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(env={}, **settings)


def test_device_timing_true_without_cuda_is_a_configuration_error(tmp_path: Path) -> None:
    """On a machine without a CUDA device, asking for device timing fails at configure() and says why."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device_timing: true needs a CUDA device"):
        tt.configure(job_id="x", log_dir=str(tmp_path), device_timing=True, backends={"log": False})
    assert tt.get_recorder() is None


# ---------------------------------------------------------------- CPU only

_CPU_ONLY = textwrap.dedent(
    """
    import contextlib, json, sys
    import torch
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(tt):
        phase = (lambda name: tt.span(name)) if tt else (lambda name: contextlib.nullcontext())
        for step in range(5):
            with phase("iteration"):
                with phase("model_forward"):
                    loss = model(torch.randn(2, 4)).sum()
                with phase("model_backward"):
                    loss.backward()
                with phase("optimizer_update"):
                    opt.step()

    train(None)  # torch's own lazy imports happen here, before the snapshot
    before = set(sys.modules)
    import traintrace as tt
    tt.configure(job_id="cpu", log_dir=sys.argv[1], backends={"log": False, "console": False})
    rec = tt.get_recorder()
    with tt.training_loop():
        train(tt)
    timer = rec.device_timer
    tt.close()
    new = sorted(m for m in set(sys.modules) - before if "cuda" in m.lower() or "nvml" in m.lower())
    print(json.dumps({"timer": timer is not None, "cuda_initialized": torch.cuda.is_initialized(), "new": new}))
    """
)


@pytest.mark.subprocess
def test_cpu_only_run_imports_nothing_from_cuda(tmp_path: Path) -> None:
    """torch imported, CUDA not initialised: device timing stays off, nothing CUDA is imported or started."""
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-c", _CPU_ONLY, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(tt.__file__).parents[1])},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"timer": False, "cuda_initialized": False, "new": []}
    (stream,) = tmp_path.rglob("*.jsonl")
    records = [json.loads(line) for line in stream.read_text().splitlines()]
    assert any(r.get("name") == tt.SpanName.FORWARD for r in records)
    assert all("gpu_dur" not in r and r.get("name") != "device_timing" for r in records)


# ---------------------------------------------------------------- the command


def _write_job(tmp_path: Path, device: FakeDevice, kind: str, steps: int = 6) -> dict[str, Any]:
    """A job of ``kind`` (gpu / waiting / cpu) written by the real pipeline with the fake device; returns the
    test's own truths: planned device times, its own CPU timestamps of steps and data loading."""
    phases = {
        "gpu": {
            tt.SpanName.FORWARD: 20_000_000,
            tt.SpanName.BACKWARD: 40_000_000,
            tt.SpanName.OPTIMIZER_STEP: 10_000_000,
        },
        "waiting": {
            tt.SpanName.FORWARD: 3_000_000,
            tt.SpanName.BACKWARD: 3_000_000,
            tt.SpanName.OPTIMIZER_STEP: 3_000_000,
        },
        "cpu": {tt.SpanName.FORWARD: 4_000_000, tt.SpanName.BACKWARD: 4_000_000, tt.SpanName.OPTIMIZER_STEP: 4_000_000},
    }[kind]
    timed = [*phases, tt.SpanName.ITERATION]
    _configure(tmp_path, device_timing_phases=timed)
    stream = device.stream
    t = 10**9
    step_ns: list[int] = []
    loading_ns: list[int] = []
    with tt.training_loop():
        for step in range(steps):
            t0 = time.perf_counter_ns()
            stream.times.append(t)  # the iteration's start
            with tt.training_iteration(step):
                if kind == "waiting":
                    l0 = time.perf_counter_ns()
                    with tt.data_loading():
                        time.sleep(0.05)
                    loading_ns.append(time.perf_counter_ns() - l0)
                for name, busy in phases.items():
                    t += 100_000
                    stream.times.extend([t, t + busy])
                    t += busy
                    with tt.span(name):
                        if kind == "cpu":
                            time.sleep(0.01)
                if kind == "gpu":
                    time.sleep(0.06)  # the CPU waits for the device (loss.item())
                stream.times.append(t)  # the iteration's end
            step_ns.append(time.perf_counter_ns() - t0)
    stream.reached = t
    tt.close()
    return {"phases": phases, "steps": step_ns, "loading": loading_ns}


@pytest.mark.parametrize("kind", ["gpu", "waiting", "cpu"])
def test_summary_uses_device_time(
    device: FakeDevice, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """summary --json: device phase means, the busy share and the bound line, against the test's own figures."""
    pytest.importorskip("duckdb")
    from traintrace.cli import main

    truth = _write_job(tmp_path, device, kind)
    capsys.readouterr()
    assert main(["summary", "--json", str(tmp_path / "logs")]) == 0
    summary = json.loads(capsys.readouterr().out)
    section = summary["device"]
    means = section["phase_means_s"]
    for name, busy in truth["phases"].items():
        assert means[name]["mean_s"] == pytest.approx(busy / 1e9, rel=1e-9)
    # The test's own step times bracket traintrace's iteration spans from above; the sleeps inside each step
    # bound them from below. The busy share must lie between what those give.
    steps = sum(truth["steps"])
    device_busy = sum(truth["phases"].values()) * len(truth["steps"])
    least = {"gpu": 0.06, "waiting": 0.05, "cpu": 0.03}[kind] * 1e9 * len(truth["steps"])
    assert min(device_busy / steps, 1.0) * (1 - 1e-9) <= section["busy_share"] <= min(device_busy / least, 1.0)
    expected = {"gpu": "GPU-bound", "waiting": "waiting for data / communication", "cpu": "CPU-bound"}[kind]
    assert section["line"].startswith(expected)
    if kind == "waiting":
        loading = truth["loading"]
        assert 0.05 <= means[tt.SpanName.DATA_LOADING]["mean_s"] <= sum(loading) / len(loading) / 1e9
        assert least / steps * (1 - 1e-9) <= section["wait_share"] <= 1.0
    # The text summary prints the same line.
    assert main(["summary", str(tmp_path / "logs")]) == 0
    assert f"DEVICE: {expected}" in capsys.readouterr().out


@pytest.mark.subprocess
def test_gpu_check_without_cuda_says_so_and_exits_cleanly(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py on a machine without CUDA: one clear line, exit 0, nothing checked."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run its checks")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu_check: no CUDA device")
    assert "nothing checked" in done.stdout
    assert done.stderr == ""
    assert not (tmp_path / "out.json").exists()


def test_ranks_finds_a_device_compute_straggler(
    device: FakeDevice, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Equal CPU step times (the host waits for the device), rank 1's device 1.5 times slower: the ranks
    command names rank 1, slow in compute, with the device times the test planned."""
    pytest.importorskip("duckdb")
    from traintrace.cli import main

    planned = {0: 6_000_000, 1: 9_000_000}  # per phase; three phases a step
    for rank, busy in planned.items():
        _configure(tmp_path, rank=rank, world_size=2)
        t = 10**9
        with tt.training_loop():
            for step in range(12):
                device.stream.times.append(t)
                with tt.training_iteration(step):
                    for name in PHASES:
                        t += 50_000
                        device.stream.times.extend([t, t + busy])
                        t += busy
                        with tt.span(name):
                            pass
                    time.sleep(0.03)  # the CPU waits for the device: the same step time on both ranks
                    device.stream.times.append(t)  # the iteration's end
        device.stream.reached = t
        tt.close()
        device.stream.times.clear()
        device.stream.reached = 0
    capsys.readouterr()
    assert main(["ranks", "--json", str(tmp_path / "logs")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stragglers"] == [1]
    rows = {r["rank"]: r for r in result["ranks"]}
    assert rows[1]["slow_in"] == "compute"
    for rank, busy in planned.items():
        assert rows[rank]["compute_median_s"] == pytest.approx(3 * busy / 1e9, rel=1e-9)


@pytest.mark.subprocess
def test_report_shows_the_device_line(device: FakeDevice, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The HTML report carries the device section; in a browser (when chromium is here) it draws the line."""
    pytest.importorskip("duckdb")
    from tests.test_cli_report import CHROMIUM, _cards, _dump
    from traintrace.cli import main

    _write_job(tmp_path, device, "gpu", steps=4)
    page = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "logs"), "-o", str(page)]) == 0
    assert "GPU-bound: the device computes" in page.read_text()
    if CHROMIUM is None:
        pytest.skip("chromium is not installed: the page's script was not run")
    dom = _dump(page, tmp_path / "profile")
    assert _cards(dom)["device"] == "GPU-bound"
    line = dom.split('id="device-line">', 1)[1].split("</p>", 1)[0]
    assert line.startswith("Device time: GPU-bound: the device computes")


class _StubPipeline:
    """Just what DeviceTimer calls on its pipeline: what it released, and with which fields."""

    routes = ("stub",)

    def __init__(self) -> None:
        self.released: list[tuple[str, bool, dict[str, Any] | None]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []

    def release_span(self, span: Any, started: bool, out: Any, extra: dict[str, Any] | None = None) -> None:
        self.released.append((span.name, started, extra))

    def emit_event(self, name: str, attrs: dict[str, Any], out: Any, **_: Any) -> None:
        self.events.append((name, attrs))


class _StubSpan:
    def __init__(self, span_id: int, name: str, t0: int) -> None:
        self.id = span_id
        self.name = name
        self.t0 = t0
        self.t1: int | None = None


def test_pool_empty_and_unpaired_spans_are_written_without_device_time_and_counted() -> None:
    """A unit test of the timer's own bookkeeping: a pool of 2 pairs, 3 spans at once; a span the writer
    sees before its end event was recorded."""
    fake = FakeDevice()
    fake.stream.reached = 10**12
    pipeline = _StubPipeline()
    timer = _device_timing.DeviceTimer(pipeline, fake, pool_start=2, pool_max=2)  # type: ignore[arg-type]
    spans = [_StubSpan(i, tt.SpanName.FORWARD, i * 10) for i in (1, 2, 3)]
    for span in spans:
        timer.span_started(span)  # type: ignore[arg-type]
    assert timer.pool_empty == 1  # the third found no free pair
    for span in spans[:2]:
        span.t1 = span.t0 + 5
        timer.span_stopped(span)  # type: ignore[arg-type]
    spans[2].t1 = 40
    timer.span_stopped(spans[2])  # type: ignore[arg-type]
    out: list[Any] = []
    held = [timer.hold(span, False) for span in spans]  # type: ignore[arg-type]
    assert held == [True, True, False]
    timer.flushing(out)
    assert [(name, extra is not None and "gpu_dur" in extra) for name, _, extra in pipeline.released] == [
        (tt.SpanName.FORWARD, True),
        (tt.SpanName.FORWARD, True),
    ]
    # A span whose stop the listener had not recorded yet when the writer saw it.
    late = _StubSpan(4, tt.SpanName.BACKWARD, 100)
    timer.span_started(late)  # type: ignore[arg-type]
    late.t1 = 110
    assert timer.hold(late, False) is False  # type: ignore[arg-type]
    timer.span_stopped(late)  # type: ignore[arg-type]  # finds nothing to record: no error, no leak
    timer.finish(out, "abandoned")
    ((name, attrs),) = pipeline.events
    assert name == "device_timing"
    assert attrs == {"timed": 2, "abandoned": 0, "pool_empty": 1, "unpaired": 1}
    assert len(fake.events) == 4  # never more than the pool's two pairs
