"""traintrace export --format chrome: Trace Event Format that Perfetto and chrome://tracing open."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests._examples import examples
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


#: gloo's message when a peer's process ended, as a real job's rank recorded it (its stack held a '#' comment too).
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:24971: "
    "Connection reset by peer. GLHF! \U0001f3d6\ufe0f\n\nAt:\n  torch/distributed/algorithms/ddp_comm_hooks/"
    "default_hooks.py(31): <lambda>\n    return Variable._execution_engine.run_backward(  # Calls into the C++ engine"
)


@pytest.mark.once  # the export's writing, not the core that recorded
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=1, max_size=300))
@example(GLOO_RESET)
@example("#")
@example('"quoted", with a comma; a \x01 and a \x02 and a tab\t')
def test_any_error_message_gives_a_trace_that_parses_and_keeps_it(tmp_path: Path, message: str) -> None:
    """Whatever a rank's error says (a stack holds '#' comments, quotes, commas, emoji, control characters), the
    trace is JSON that Perfetto reads and holds the message as recorded. (DuckDB 2.0 quoted every line holding a
    '#' with the export's quote character: a real job's trace did not parse.)"""
    folder = tmp_path / f"job{abs(hash(message))}"
    write_job(folder, Script(ranks=2, steps=4, checkpoint_every=2, fail_rank=1, fail_step=2, message=message))
    trace = _export(folder, folder / "trace.json")  # json.loads: the whole file parses
    [error] = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["cat"] == "error"]
    assert error["args"]["message"] == message
    assert error["args"]["stack"].endswith(f"RuntimeError: {message}")


def test_filters_by_rank_and_time_window(tmp_path: Path) -> None:
    """--ranks and --start/--end keep only what they name."""
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    trace = _export(tmp_path / "job", tmp_path / "part.json", "--ranks", "1,3", "--start", "2", "--end", "3")
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {1, 3}
    assert all(e["ts"] + e["dur"] >= 2e6 and e["ts"] <= 3e6 for e in xs)
    steps = [e for e in xs if e["name"] == "iteration"]
    assert 0 < len(steps) <= 2 * 12


def _steps_as_written(folder: Path) -> dict[tuple[int, int], list[float]]:
    """The starts of each rank's iterations of a step that ended (one an attempt), µs from the job's first
    record, read from the files as written. A step written in two (its start, then its end: rank 3's failed
    one) counts by its start; one never ended (a rank killed in it) is not drawn."""
    records = [
        (int(path.stem.removeprefix("rank")), json.loads(line))
        for path in folder.glob("rank*.jsonl")
        for line in path.read_text().splitlines()
    ]
    first = min(r["ts"] for _, r in records if isinstance(r.get("ts"), int))
    ended = {(rank, r["id"]) for rank, r in records if r.get("kind") == "end"}
    steps: dict[tuple[int, int], list[float]] = {}
    for rank, r in records:
        if r.get("name") != "iteration" or "step" not in (r.get("attrs") or {}):
            continue
        if r.get("kind") == "span" or (r.get("kind") == "start" and (rank, r["id"]) in ended):
            steps.setdefault((rank, r["attrs"]["step"]), []).append((r["ts"] - first) / 1000)
    return {k: sorted(v) for k, v in steps.items()}


@pytest.mark.parametrize("ahead_ms", [500, -2000])
def test_the_timeline_of_hosts_whose_clocks_differ_is_on_one_clock(tmp_path: Path, ahead_ms: int) -> None:
    """Two hosts of two ranks in lockstep, node1's files rewritten as if its clock ran ahead (or behind): by the
    raw times its ranks' steps would be drawn half a second after (or 2 s before) the steps they ran with. On
    the reference host's clock (``errors`` proves the offset), every step is where the files put it before the
    clock was moved, and a note in the trace's ``otherData`` says so."""
    from tests.cli_jobs import clock_ahead

    write_job(tmp_path / "job", Script(ranks=4, ranks_per_host=2, straggler=None, fail_rank=3, fail_step=25))
    truth = _steps_as_written(tmp_path / "job")
    clock_ahead(tmp_path / "job", [2, 3], ahead_ms * 1_000_000)
    trace = _export(tmp_path / "job", tmp_path / "trace.json")
    drawn: dict[tuple[int, int], list[float]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "iteration" and "step" in e["args"]:
            drawn.setdefault((e["pid"], e["args"]["step"]), []).append(e["ts"])
    drawn = {k: sorted(v) for k, v in drawn.items()}
    assert drawn.keys() == truth.keys()
    assert all(drawn[k] == pytest.approx(truth[k], abs=0.002) for k in truth), [
        (k, drawn[k], truth[k]) for k in truth if drawn[k] != pytest.approx(truth[k], abs=0.002)
    ][:5]
    assert trace["otherData"]["clock_offsets"] == {"reference": "node0", "offsets_s": {"node1": ahead_ms / 1000}}
