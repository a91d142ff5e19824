"""The two recording cores: the native one (``traintrace._span``, C) and the pure-Python one.

The same scripted run, once on each core in its own process, must write the same
records (apart from times, ids and process details) and leave the same progress file.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import traintrace as tt
from tests._reliability import child_env, write_script
from traintrace import _recorder
from traintrace.progress import Progress, read_progress

NATIVE_BUILT = importlib.util.find_spec("traintrace._span") is not None
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="the native core is not built (setup.py build_ext)")

# A run that touches every path of span start and stop: nesting, standard phases and the
# progress file, metrics, events, an exception leaving a span, a span stopped twice, a span
# below the level, a span stopped on another thread, a span recorded whole, asyncio tasks,
# a decorator, a reused span, names that are not strings, a stop after close.
SCRIPT = """
import asyncio, sys, threading, warnings
import traintrace as tt

warnings.simplefilter("ignore")
log_dir, core_wanted = sys.argv[1], sys.argv[2]
rec = tt.configure(log_dir=log_dir, job_id="same", backends={"file": {}, "log": {"enabled": False}},
                   log_interval=4)
assert tt.stats()["core"] == core_wanted, tt.stats()

@tt.span("decorated")
def decorated(x):
    return x * 2

with tt.application():
    with tt.training_loop():
        for step in range(6):
            with tt.training_iteration(step) as it:
                with tt.data_loading():
                    pass
                with tt.forward({"batch": step}):
                    with tt.span("inner", {"k": [1, 2]}) as inner:
                        inner.add_metrics(a=step, b="x")
                        tt.event("note", {"step": step})
                with tt.backward():
                    pass
                with tt.collective():
                    pass
                with tt.optimizer_step():
                    decorated(step)
                it.add_metrics(loss=1.0 / (step + 1))
        try:
            with tt.training_iteration(6):
                with tt.forward():
                    raise ValueError("boom")
        except ValueError:
            pass
        with tt.training_iteration(2**70):  # a step that is no int64
            pass
        with tt.training_iteration("seven"):
            pass
    s = tt.span("twice")
    with s:
        pass
    s.__exit__(None, None, None)  # a second stop: warned, ignored
    with s:  # entered again: warned, not recorded again
        pass
    with tt.span("too detailed", level=tt.Verbosity.PROFILING + 5):
        pass
    with tt.span(12345):
        pass
    with tt.span(("a", 1)):
        pass
    handle = rec.start("across threads", {"t": 1})
    thread = threading.Thread(target=rec.stop, args=(handle, {"stopped": "elsewhere"}))
    thread.start(); thread.join()
    t0 = __import__("time").perf_counter_ns()
    rec.record_span("whole", t0, t0 + 1000, metrics={"w": 1})
    # record_span's cases, the native core's own (the first four) and those it hands to Python
    with tt.span("holder") as holder:
        rec.record_span("phase", t0, t0 + 10, parent=holder, level=tt.Verbosity.PROFILING.value)
        rec.record_span("phase", t0, t0 + 10, parent=holder, metrics={}, status="error", level=1)
        rec.record_span("phase", t0, t0, metrics={"n": 2, "s": "x"}, level=tt.Verbosity.PROFILING.value + 5)
        reused = {"k": 1}
        rec.record_span("phase", t0, t0 + 5, metrics=reused)
        reused["k"] = 2  # the record holds the value at the call
        rec.record_span("phase", t0 + 5, t0, parent="not a span", level=tt.Verbosity.PROFILING)
        rec.record_span(("a", 2), t0, t0 + 1, status=3)
        rec.record_span("phase", "t0", t0, metrics=[1])

    async def task(n):
        with tt.span(f"task{n}"):
            await asyncio.sleep(0)
            with tt.span("in task"):
                await asyncio.sleep(0)

    async def main():
        await asyncio.gather(*(task(n) for n in range(3)))

    asyncio.run(main())
    late = rec.start("stopped after close")
tt.close()
rec.stop(late)
"""

# Fields that differ between any two runs (times, process, ids).
VOLATILE = {"ts", "dur", "time", "mono", "pid", "host", "tid", "elapsed_time", "thread_name"}


def _normalise(records: list[dict[str, Any]]) -> list[Any]:
    """The records without what differs between any two runs: times, process details, ids
    (renumbered in order of appearance) and whether the writer saw a span open (a ``start``
    and an ``end`` record) or already ended (one ``span`` record): a matter of thread timing."""
    ids: dict[int, int] = {}

    def span_id(value: Any) -> Any:
        if isinstance(value, int) and value:
            return ids.setdefault(value, len(ids) + 1)
        return value

    ends = {r["id"]: r for r in records if r.get("kind") == "end"}
    program, statistics = [], []
    for original in records:
        kind = original.get("kind")
        if kind == "end":
            continue
        record = {k: v for k, v in original.items() if k not in VOLATILE and k != "seq"}
        if isinstance(record.get("name"), str):
            record["name"] = str.__str__(record["name"])  # a str subclass's own == may raise
        if kind == "close":
            record.pop("records", None)  # two records for a span seen open, one for a span seen ended
        if kind == "start":
            end = ends.get(record["id"], {})
            record["kind"] = "span"
            record["status"] = end.get("status")
            attrs = {**(record.get("attrs") or {}), **(end.get("attrs") or {})}
            record.pop("attrs", None)
            if attrs:
                record["attrs"] = attrs
        for key in ("id", "parent", "span", "link"):
            if key in record:
                record[key] = span_id(record[key])
        attrs = record.get("attrs")
        if record.get("name") == "training_iterations" and isinstance(attrs, dict):
            # Interval statistics: measured times dropped, counts kept.
            record["attrs"] = {k: v for k, v in attrs.items() if not isinstance(v, float) or k == "loss"}
            statistics.append(record)
        else:
            program.append(record)
    return [program, statistics]


def _run(tmp_path: Path, pure: bool) -> tuple[list[Any], Progress]:
    logs = tmp_path / ("pure" if pure else "native")
    script = write_script(tmp_path, "same_run.py", SCRIPT)
    env = child_env(TRAINTRACE_PURE="1" if pure else "0")
    done = subprocess.run(
        [sys.executable, str(script), str(logs), "pure" if pure else "native"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    streams = sorted(logs.rglob("*.jsonl"))
    streams = [p for p in streams if p.name.startswith("rank")]
    assert len(streams) == 1, streams
    records = [json.loads(line) for line in streams[0].read_text().splitlines()]
    progress = read_progress(streams[0].with_suffix(".progress"))
    assert progress is not None
    return _normalise(records), progress


@needs_native
@pytest.mark.subprocess
def test_both_cores_write_the_same_records(tmp_path: Path) -> None:
    native, native_progress = _run(tmp_path, pure=False)
    pure, pure_progress = _run(tmp_path, pure=True)
    # The run really exercised the paths: spans, the exception, the warnings' effects.
    names = [r.get("name") for r in native[0] if r.get("kind") == "span"]
    steps = [(r.get("attrs") or {}).get("step") for r in native[0] if r.get("name") == "iteration"]
    assert {0, 1, 2, 3, 4, 5, 6, "seven"} <= set(steps)
    assert "12345" in names and "across threads" in names and "whole" in names
    assert any(r.get("kind") == "error" and r.get("message") == "boom" for r in native[0])
    assert names.count("twice") == 1
    assert names.count("phase") == 4 and "('a', 2)" in names  # record_span: one above the level, one bad
    assert "too detailed" not in names
    assert native == pure
    keep = ("step", "phase", "state", "iterations", "steps_done", "step_done", "in_collective", "counter")
    assert {k: getattr(native_progress, k) for k in keep} == {k: getattr(pure_progress, k) for k in keep}
    assert native_progress.steps_done == 8  # step 6 raised "boom": it completed nothing
    assert native_progress.iterations == 9


def test_the_core_in_use_is_reported(tmp_path: Path) -> None:
    tt.configure(log_dir=str(tmp_path), job_id="core", backends={"log": False})
    assert tt.stats()["core"] == _recorder.CORE
    assert _recorder.CORE in ("native", "pure")


@needs_native
@pytest.mark.subprocess
def test_traintrace_pure_selects_the_pure_core(tmp_path: Path) -> None:
    code = "import traintrace._recorder as r; print(r.CORE, r.Span.__mro__[1].__name__)"
    for value, expected in (("1", "pure _PySpanCore"), ("0", "native SpanCore")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=child_env(TRAINTRACE_PURE=value),
            check=True,
            timeout=60,
        )
        assert out.stdout.strip() == expected


@pytest.mark.skipif(_recorder.CORE != "native", reason="the native core is not in use")
def test_native_spans_are_not_tracked_by_the_garbage_collector(tmp_path: Path) -> None:
    tt.configure(log_dir=str(tmp_path), job_id="gc", backends={"log": False})
    with tt.training_iteration(1) as it, tt.forward() as fw:
        assert not gc.is_tracked(it)
        assert not gc.is_tracked(fw)
        assert fw.parent is it

    class WithDict(tt.Span):
        pass

    assert gc.is_tracked(WithDict("x"))  # a user's subclass with a __dict__ stays collectable


@pytest.mark.skipif(_recorder.CORE != "native", reason="the native core is not in use")
def test_a_long_chain_of_spans_is_freed_without_recursion() -> None:
    # A million spans started and never stopped form such a chain (each the parent of the next).
    deepest = tt.Span("root")
    for _ in range(300_000):
        child = tt.Span("deep")
        child.parent = deepest
        deepest = child
    deepest.link = tt.Span("linked")
    del child
    del deepest  # a recursive free would overflow the C stack here


def test_progress_file_fields_match_a_truth(tmp_path: Path) -> None:
    rec = tt.configure(log_dir=str(tmp_path), job_id="prog", backends={"log": False})
    assert rec._progress is not None
    for step in range(5):
        with tt.training_iteration(step * 10):
            with tt.collective():
                pass
    with tt.training_iteration(99), tt.forward():
        path = next(tmp_path.rglob("rank0.progress"))
        now = read_progress(path)
        assert now is not None
        assert now.step == 99
        assert now.phase == tt.SpanName.FORWARD
        assert now.iterations == 6
        assert now.steps_done == 5
        assert not now.in_collective


class _Name(str):
    """A span name of a str subclass: never remembered by object in the native core's phase cache."""


def test_the_progress_phase_follows_names_however_they_are_made(tmp_path: Path) -> None:
    """Phase names as copies, as a str subclass, and among many other names (which churn the native
    core's cache of names it looked up): the progress file names the phase each span is in."""
    tt.configure(log_dir=str(tmp_path), job_id="names", backends={"log": False})
    path = tmp_path / "names" / "rank0.progress"

    def phase_now() -> str | None:
        now = read_progress(path)
        assert now is not None
        return now.phase

    forward, backward = "".join(["model_", "forward"]), _Name("model_backward")
    assert forward is not tt.SpanName.FORWARD
    for round_ in range(3):
        for index in range(40):  # names the cache has not seen, and that are no phase
            with tt.span(f"custom_{round_}_{index}"):
                assert phase_now() is None
        with tt.span(forward):
            assert phase_now() == tt.SpanName.FORWARD
            with tt.span(f"inner_{round_}"):
                assert phase_now() == tt.SpanName.FORWARD  # a custom span leaves the phase as it is
            assert phase_now() == tt.SpanName.FORWARD
        with tt.span(backward):
            assert phase_now() == tt.SpanName.BACKWARD
        assert phase_now() is None


@pytest.mark.skipif(_recorder.CORE != "native", reason="the native core is not in use")
@pytest.mark.parametrize("configured", ["no", "yes", "level too low"])
def test_native_helpers_make_what_the_python_helpers_make(tmp_path: Path, configured: str) -> None:
    if configured != "no":
        verbosity = "info" if configured == "level too low" else "profiling"
        tt.configure(
            log_dir=str(tmp_path),
            job_id="helpers",
            backends={"log": False, "file": {"verbosity": verbosity}},
            statistics=False,  # statistics raise the level to profiling
        )
        rec = tt.get_recorder()
        assert rec is not None
        assert (rec.max_level < int(tt.Verbosity.TRACING)) == (configured == "level too low")
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    for helper in (tt.training_iteration, tt.forward, tt.collective, tt.distributed_init):
        for args, kwargs in (
            ((), {}),
            ((3,), {}),
            ((True,), {}),
            ((None,), {}),
            ((2**70,), {}),
            (({"a": 1},), {}),
            ((5, {"b": 2}), {}),
            ((), {"k": 1}),
        ):
            if helper is not tt.training_iteration and len(args) > 1:
                continue
            calls.append((helper, args, kwargs))
    warnings.simplefilter("ignore", tt.TraintraceWarning)
    for helper, args, kwargs in calls:
        python_helper = helper.__wrapped__  # type: ignore[attr-defined]
        try:
            native = helper(*args, **kwargs)
        except TypeError as exc:
            with pytest.raises(type(exc)):
                python_helper(*args, **kwargs)
            continue
        pure = python_helper(*args, **kwargs)
        assert type(native) is type(pure), (helper, args)
        assert (native.name, native.attrs, native.level, native.link) == (pure.name, pure.attrs, pure.level, pure.link)
        assert (native is pure) == isinstance(pure, _recorder.InertSpan), (helper, args)
    assert tt.forward.__name__ == tt.SpanName.FORWARD
    assert "forward pass" in (tt.forward.__doc__ or "")


def test_an_iterations_attrs_read_changed_or_replaced_are_what_is_written(tmp_path: Path) -> None:
    """``training_iteration(step)``'s attrs are ``{"step": step}`` however they are used: never read
    (the native core makes that dict only when something reads it), read and changed in place, or
    replaced; the file and the progress file say so on either core."""
    tt.configure(job_id="attrs", log_dir=str(tmp_path), backends={"log": False}, statistics=False)
    with tt.training_loop():
        with tt.training_iteration(0):
            pass
        with tt.training_iteration(1) as read:
            first = read.attrs
            assert first == {"step": 1} and read.attrs is first
            first["extra"] = "x"
        with tt.training_iteration(2) as replaced:
            replaced.attrs = {"other": 3}
        with tt.training_iteration(2**70) as huge:  # no int64: not a progress step, still an attribute
            pass
        with tt.training_iteration(7):
            assert tt.current_span() is not None
            now = read_progress(tmp_path / "attrs" / "rank0.progress")
            assert now is not None and now.step == 7
    tt.close()
    assert huge.attrs == {"step": 2**70}
    records = [json.loads(line) for line in (tmp_path / "attrs" / "rank0.jsonl").read_text().splitlines()]
    written: dict[Any, Any] = {}
    for record in records:
        if record.get("name") == tt.SpanName.ITERATION and record.get("kind") in ("span", "start", "end"):
            key = record["id"]
            written[key] = {**written.get(key, {}), **(record.get("attrs") or {})}
    assert list(written.values()) == [
        {"step": 0},
        {"step": 1, "extra": "x"},
        {"other": 3},
        {"step": 2**70},
        {"step": 7},
    ]
