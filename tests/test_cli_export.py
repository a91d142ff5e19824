"""traintrace export --format chrome: Trace Event Format that Perfetto and chrome://tracing open."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.cli_jobs import Script, write_job

pytest.importorskip("duckdb")

from traintrace.cli import main


def _export(folder: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["export", str(folder), "-o", str(out), "--quiet", *extra]) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_one_track_per_rank_and_every_kind_of_event(tmp_path: Path) -> None:
    """Ranks are processes with names, spans are X events, errors instants, loss a counter."""
    script = write_job(tmp_path / "job", Script())
    trace = _export(tmp_path / "job", tmp_path / "trace.json")
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms"
    phases = Counter(e["ph"] for e in events)
    assert set(phases) == {"M", "X", "i", "C"}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r} (h)" for r in range(script.ranks)}
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(script.ranks))
    iterations = [e for e in events if e["ph"] == "X" and e["name"] == "iteration"]
    # 25 + 20 steps on each rank, plus rank 3's failed step
    assert len(iterations) == script.ranks * (25 + 20) + 1
    straggler = [e for e in iterations if e["pid"] == 2 and e["args"].get("step") == 3]
    assert straggler and straggler[0]["dur"] == pytest.approx(150_000.0)  # µs
    first = min(e["ts"] for e in events if e["ph"] == "X")
    assert first == 0.0  # times are µs from the job start
    errors = [e for e in events if e["ph"] == "i" and e["cat"] == "error"]
    assert len(errors) == 1 and errors[0]["pid"] == 3 and errors[0]["args"]["error_type"] == "RuntimeError"
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "loss"]
    assert counters and all(isinstance(e["args"]["loss"], float) for e in counters)
    # an open span (a killed rank's step) is drawn up to where its stream ends
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_filters_by_rank_and_time_window(tmp_path: Path) -> None:
    """--ranks and --start/--end keep only what they name."""
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    trace = _export(tmp_path / "job", tmp_path / "part.json", "--ranks", "1,3", "--start", "2", "--end", "3")
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {1, 3}
    assert all(e["ts"] + e["dur"] >= 2e6 and e["ts"] <= 3e6 for e in xs)
    steps = [e for e in xs if e["name"] == "iteration"]
    assert 0 < len(steps) <= 2 * 12
