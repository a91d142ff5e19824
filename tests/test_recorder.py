"""The recorder: nesting, ids, exceptions, misuse, and the low-level API."""

from __future__ import annotations

import asyncio
import sys
import threading
import warnings
from pathlib import Path

import pytest

import traintrace as tt
from tests.conftest import validate_record


def _by_name(memory: tt.MemoryBackend) -> dict[str, dict]:
    return {s["name"]: s for s in memory.spans()}


def test_nested_spans_have_parent_ids(memory: tt.MemoryBackend) -> None:
    """A span's parent is the span open around it in the same thread."""
    with tt.training_loop():
        with tt.training_iteration(0):
            with tt.forward():
                pass
    tt.flush()
    spans = _by_name(memory)
    assert spans["training_loop"]["parent"] == 0
    assert spans["iteration"]["parent"] == spans["training_loop"]["id"]
    assert spans["model_forward"]["parent"] == spans["iteration"]["id"]
    assert spans["iteration"]["attrs"]["step"] == 0
    for record in memory.records:
        validate_record(record)


def test_nesting_is_per_thread(memory: tt.MemoryBackend) -> None:
    """Spans opened in another thread do not become parents of this thread's spans."""
    ready = threading.Event()
    release = threading.Event()

    def other() -> None:
        with tt.span("other_thread"):
            ready.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    ready.wait(5)
    with tt.span("main_thread"):
        pass
    release.set()
    thread.join()
    tt.flush()
    spans = _by_name(memory)
    assert spans["main_thread"]["parent"] == 0
    assert spans["other_thread"]["parent"] == 0
    assert spans["main_thread"]["tid"] != spans["other_thread"]["tid"]


def test_nesting_is_per_asyncio_task(memory: tt.MemoryBackend) -> None:
    """Concurrent asyncio tasks keep their own span stacks."""

    async def worker(name: str) -> None:
        with tt.span(name):
            await asyncio.sleep(0.01)
            with tt.span(name + "_child"):
                await asyncio.sleep(0.01)

    async def main() -> None:
        with tt.span("root"):
            await asyncio.gather(worker("a"), worker("b"))

    asyncio.run(main())
    tt.flush()
    spans = _by_name(memory)
    assert spans["a_child"]["parent"] == spans["a"]["id"]
    assert spans["b_child"]["parent"] == spans["b"]["id"]
    assert spans["a"]["parent"] == spans["root"]["id"]


def test_exception_recorded_once_and_spans_marked_error(memory: tt.MemoryBackend) -> None:
    """One exception crossing three spans gives one error record and three error statuses."""
    with pytest.raises(KeyError):
        with tt.training_loop():
            with tt.training_iteration(3):
                with tt.backward():
                    raise KeyError("missing")
    tt.flush()
    errors = memory.errors()
    assert len(errors) == 1
    error = errors[0]
    assert error["error_type"] == "KeyError"
    assert "missing" in error["message"]
    assert "test_exception_recorded_once" in error["stack"]
    spans = _by_name(memory)
    assert error["span"] == spans["model_backward"]["id"]
    assert {s["status"] for s in spans.values()} == {"error"}


def test_stack_includes_frames_above_the_span(memory: tt.MemoryBackend) -> None:
    """The recorded stack starts at the program's entry, not at the span."""

    def outer_caller() -> None:
        inner_with_span()

    def inner_with_span() -> None:
        with tt.span("s"):
            raise RuntimeError("deep")

    with pytest.raises(RuntimeError):
        outer_caller()
    tt.flush()
    stack = memory.errors()[0]["stack"]
    assert stack.index("outer_caller") < stack.index("inner_with_span") < stack.index("RuntimeError: deep")


def test_system_exit_is_terminated_not_error(memory: tt.MemoryBackend) -> None:
    """SystemExit ends spans as terminated and is not an error; one ``system_exit`` event, in the innermost span
    it left, says the status the process exits with (a message: status 1; none: 0)."""
    with pytest.raises(SystemExit):
        with tt.span("outer"), tt.span("s"):
            raise SystemExit(3)
    for argument in ("bad config", None):
        with pytest.raises(SystemExit), tt.span("again"):
            sys.exit(argument)
    tt.flush()
    assert [s["status"] for s in memory.spans()] == ["terminated"] * 4
    assert memory.errors() == []
    inner = memory.spans("s")[0]["id"]
    exits = memory.events(tt.EventName.SYSTEM_EXIT)
    assert [(e["span"], e["attrs"]) for e in exits] == [
        (inner, {"exit_code": 3}),
        (memory.spans("again")[0]["id"], {"exit_code": 1, "message": "bad config"}),
        (memory.spans("again")[1]["id"], {"exit_code": 0}),
    ]


def test_low_level_start_stop_across_callbacks(memory: tt.MemoryBackend) -> None:
    """start() in one callback and stop() in another, with metrics at both ends."""
    rec = tt.get_recorder()
    assert rec is not None
    handle = rec.start("fit", {"epochs": 2})
    inner = rec.start("iteration", {"step": 1}, level=tt.Verbosity.TRACING)
    rec.event("note", {"x": 1})
    rec.stop(inner, {"loss": 0.5})
    rec.stop(handle, status="ok")
    tt.flush()
    spans = _by_name(memory)
    assert spans["iteration"]["parent"] == spans["fit"]["id"]
    assert spans["iteration"]["attrs"] == {"step": 1, "loss": 0.5}
    assert memory.events("note")[0]["span"] == spans["iteration"]["id"]


def test_stop_from_another_thread(memory: tt.MemoryBackend) -> None:
    """A span may be stopped by a different thread than the one that started it."""
    handle = tt.start("background_save")
    thread = threading.Thread(target=tt.stop, args=(handle,), kwargs={"metrics": {"ok": True}})
    thread.start()
    thread.join()
    with tt.span("next"):
        pass
    tt.flush()
    spans = _by_name(memory)
    assert spans["background_save"]["attrs"] == {"ok": True}
    assert spans["next"]["parent"] == 0, "a stopped span is never a parent"


def test_event_without_span_is_allowed(memory: tt.MemoryBackend) -> None:
    """An event outside any span is recorded with span 0."""
    tt.event("lonely", {"v": 1})
    tt.flush()
    assert memory.events("lonely")[0]["span"] == 0


def test_open_span_start_is_written_before_it_ends(memory: tt.MemoryBackend) -> None:
    """A span still open at a flush is already in the stream as a start record."""
    handle = tt.start("checkpoint_save_sync")
    tt.flush()
    starts = memory.of_kind("start")
    assert [s["name"] for s in starts] == ["checkpoint_save_sync"]
    tt.stop(handle)
    tt.flush()
    ends = memory.of_kind("end")
    assert ends[0]["id"] == starts[0]["id"]
    assert ends[0]["dur"] >= 0


def test_close_ends_open_spans_as_abandoned(memory: tt.MemoryBackend) -> None:
    """Spans still open at close() get an end record with status abandoned."""
    tt.start("never_stopped")
    tt.close()
    ends = memory.of_kind("end")
    assert ends[0]["name"] == "never_stopped"
    assert ends[0]["status"] == "abandoned"
    assert memory.records[-1]["kind"] == "close"
    assert memory.closed


def test_sequence_numbers_are_contiguous(memory: tt.MemoryBackend) -> None:
    """seq runs 1, 2, 3... without gaps when nothing is dropped."""
    for step in range(500):
        with tt.training_iteration(step):
            tt.event("e")
    tt.close()
    seqs = [r["seq"] for r in memory.records]
    assert seqs == list(range(1, len(seqs) + 1))


def test_misuse_warns_once_and_never_raises(memory: tt.MemoryBackend) -> None:
    """Stopping twice, stopping a non-span, or adding metrics late warn once each."""
    handle = tt.start("x")
    tt.stop(handle)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tt.stop(handle)
        tt.stop(handle)
        tt.stop("not a span")  # type: ignore[arg-type]
        handle.add_metrics(late=1)
        handle.add_metrics(late=2)
    messages = [str(w.message) for w in caught]
    assert sum("stopped twice" in m for m in messages) == 1
    assert sum("not a Span" in m for m in messages) == 1
    assert sum("after it stopped" in m for m in messages) == 1


def test_misuse_with_warnings_as_errors_still_does_not_raise(memory: tt.MemoryBackend) -> None:
    """Even with -W error, misuse never raises into the caller."""
    handle = tt.start("x")
    tt.stop(handle)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tt.stop(handle)


def test_use_after_close_is_a_no_op(memory: tt.MemoryBackend) -> None:
    """After close(), API calls do nothing and raise nothing."""
    rec = tt.get_recorder()
    assert rec is not None
    tt.close()
    count = len(memory.records)
    with tt.training_iteration(1) as it:
        it.add_metrics(loss=1.0)
    rec.event("late")
    rec.error(ValueError("late"))
    handle = rec.start("late")
    rec.stop(handle)
    assert len(memory.records) == count


def test_unconfigured_calls_are_no_ops() -> None:
    """Before configure(), every call works and records nothing."""
    assert not tt.is_configured()
    with tt.training_loop() as loop:
        loop.add_metrics(a=1)
        with tt.training_iteration(0):
            tt.event("x")
            tt.error("y")
    handle = tt.start("z")
    tt.stop(handle)
    assert tt.flush()
    assert not Path("traintrace_logs").exists()


def test_error_message_without_exception(memory: tt.MemoryBackend) -> None:
    """error("text") records a message and the caller's stack."""
    with tt.span("s"):
        tt.error("disk almost full", {"free_gb": 1})
    tt.flush()
    error = memory.errors()[0]
    assert error["message"] == "disk almost full"
    assert "error_type" not in error
    assert "test_error_message_without_exception" in error["stack"]
    assert error["attrs"] == {"free_gb": 1}


def test_same_exception_passed_to_error_twice_is_recorded_once(memory: tt.MemoryBackend) -> None:
    """Passing one exception object to error() again is not a second error."""
    exc = ValueError("x")
    tt.error(exc)
    tt.error(exc)
    tt.flush()
    assert len(memory.errors()) == 1


def test_decorator_makes_a_span_per_call(memory: tt.MemoryBackend) -> None:
    """@span and the helpers decorate functions and coroutines."""

    @tt.span("work")
    def work(x: int) -> int:
        return x * 2

    @tt.validation
    def validate() -> str:
        return "done"

    @tt.span("coro")
    async def coro() -> int:
        return 7

    assert work(2) == 4
    assert work(3) == 6
    assert validate() == "done"
    assert asyncio.run(coro()) == 7
    tt.flush()
    assert len(memory.spans("work")) == 2
    assert len(memory.spans("validation_loop")) == 1
    assert len(memory.spans("coro")) == 1


def test_decorator_applied_before_configure_records_after(tmp_path: Path) -> None:
    """A function decorated at import time records once traintrace is configured."""

    @tt.training_iteration
    def step() -> None:
        pass

    memory = tt.MemoryBackend()
    tt.configure(job_id="t", log_dir=str(tmp_path), backends={"log": False}, extra_backends=[memory])
    step()
    tt.flush()
    assert len(memory.spans("iteration")) == 1


def test_checkpoint_finalization_links_to_async_save(memory: tt.MemoryBackend) -> None:
    """The background part of an async save names the blocking part in link."""
    with tt.checkpoint_save_async() as save:
        pass
    done = threading.Event()

    def finalize() -> None:
        with tt.checkpoint_save_finalization(save):
            pass
        done.set()

    threading.Thread(target=finalize).start()
    done.wait(5)
    tt.flush()
    spans = _by_name(memory)
    assert spans["checkpoint_save_finalization"]["link"] == spans["checkpoint_save_async"]["id"]


def test_verbosity_filters_before_the_queue(tmp_path: Path) -> None:
    """Spans above every backend's verbosity are not recorded at all."""
    memory = tt.MemoryBackend(verbosity=tt.Verbosity.INFO)
    tt.configure(job_id="t", log_dir=str(tmp_path), backends=[], extra_backends=[memory])
    with tt.training_loop():
        with tt.training_iteration(1):
            with tt.forward():
                pass
    tt.flush()
    assert [s["name"] for s in memory.spans()] == ["training_loop"]


def test_current_span_reports_innermost_open(memory: tt.MemoryBackend) -> None:
    """current_span() is the innermost open span."""
    assert tt.current_span() is None
    with tt.span("outer") as outer:
        with tt.span("inner") as inner:
            assert tt.current_span() is inner
        assert tt.current_span() is outer
    assert tt.current_span() is None


def test_after_a_span_stops_everything_sees_its_parent(memory: tt.MemoryBackend) -> None:
    """A stop leaves the context on the stopped span; every reader moves on to the open parent.

    Events, errors, lifecycle events, new spans and asyncio tasks created after a child
    stopped all belong to the parent, and nested stops unwind to the outermost open span.
    """
    from traintrace import events

    async def in_task() -> int:
        with tt.span("task_child") as child:
            pass
        return child.parent.id if child.parent is not None else 0

    with tt.span("outer") as outer:
        with tt.span("middle"):
            with tt.span("inner"):
                pass
        tt.event("after")
        events.record(events.EventType.WORKER_START)
        tt.error("noted")
        with tt.span("sibling") as sibling:
            pass
        task_parent = asyncio.run(in_task())
        assert tt.current_span() is outer
    assert tt.current_span() is None
    tt.flush()
    assert sibling.parent is outer and task_parent == outer.id
    attached = [r for r in memory.records if r["kind"] in ("event", "error")]
    assert [r.get("span") for r in attached] == [outer.id] * len(attached) and len(attached) >= 3
