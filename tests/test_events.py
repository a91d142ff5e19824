"""Lifecycle events: records in the streams, verbosity, the logging handler."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

import traintrace as tt
from traintrace import MemoryBackend, Verbosity, events
from traintrace._config import build_config
from traintrace._setup import _start
from traintrace.publisher import get_default_event_publisher

SCHEMA = json.loads((Path(__file__).parent.parent / "src/traintrace/schema/record-v1.schema.json").read_text())


@pytest.fixture
def memory() -> Iterator[MemoryBackend]:
    """A recorder writing to memory only."""
    backend = MemoryBackend()
    tt.configure(backends=[], extra_backends=[backend], job_id="ev", rank=1, world_size=2)
    yield backend
    tt.close()


def _flush() -> None:
    get_default_event_publisher().flush()
    tt.flush()


def test_record_writes_a_lifecycle_event(memory: MemoryBackend) -> None:
    """The torch-shaped call writes an event record named after the type, with identity and data."""
    events.record(events.EventType.WORKER_EXIT, worker_id=0, exit_code=0, data={"epoch": 10, "loss": 0.01})
    _flush()
    (record,) = memory.events("worker_exit")
    attrs = record["attrs"]
    assert attrs["source"] == "worker"
    assert (attrs["worker_id"], attrs["exit_code"]) == (0, 0)
    assert attrs["data"] == {"epoch": 10, "loss": 0.01}
    assert (attrs["rank"], attrs["node_rank"], attrs["restart"]) == (1, 0, 0)
    assert record["ts"] > 0
    jsonschema.validate(record, SCHEMA)


def test_failures_are_error_records_and_the_rest_info() -> None:
    """Failures and non-zero exits reach an error-only backend; starts do not."""
    errors_only = MemoryBackend(verbosity=Verbosity.ERROR)
    tt.configure(backends=[], extra_backends=[errors_only], job_id="ev")
    try:
        events.record(events.EventType.WORKER_START, worker_id=0)
        events.record(events.EventType.WORKER_FAILURE, worker_id=1, exit_code=1)
        events.record(events.EventType.WORKER_EXIT, worker_id=2, exit_code=-9)
        events.record(events.EventType.HANG_SUSPECTED, data={"seconds": 600})
        _flush()
        names = [r["name"] for r in errors_only.events()]
        assert names == ["worker_failure", "worker_exit", "hang_suspected"]
    finally:
        tt.close()


def test_custom_types_and_sources(memory: MemoryBackend) -> None:
    """A plain string is a custom type; source and identity can be given."""
    events.record("my_phase", data={"x": 1}, source=events.EventSource.AGENT, identity={"rank": 7})
    events.record(events.EventType.CHECKPOINT_SAVED, data={"step": 100}, source="agent")
    _flush()
    (custom,) = memory.events("my_phase")
    assert custom["attrs"]["source"] == "agent"
    assert custom["attrs"]["rank"] == 7
    assert memory.events("checkpoint_saved")[0]["attrs"]["source"] == "agent"


def test_event_inside_a_span_names_the_span(memory: MemoryBackend) -> None:
    """A lifecycle event recorded in a span carries the span's id."""
    with tt.span("phase") as span:
        events.record(events.EventType.CHECKPOINT_SAVED, data={"step": 1})
    _flush()
    assert memory.events("checkpoint_saved")[0]["span"] == span.id


def test_agent_stream_defaults_to_agent_source() -> None:
    """In a stream whose header says role agent, events default to source agent."""
    memory = MemoryBackend()
    _start(build_config(backends=[], job_id="ag"), [memory], {"role": "agent"})
    try:
        events.record(events.EventType.JOB_START)
        _flush()
        assert memory.events("job_start")[0]["attrs"]["source"] == "agent"
    finally:
        tt.close()


def test_bad_arguments_never_raise(memory: MemoryBackend) -> None:
    """Data that is not a mapping is ignored with one warning, never raised."""
    tt._recorder._warned.discard("bad_lifecycle_event")
    with pytest.warns(tt.TraintraceWarning):
        events.record(events.EventType.JOB_END, data=[1, 2, 3])  # type: ignore[arg-type]
    events.record(events.EventType.JOB_END, data=42)  # type: ignore[arg-type]


def test_record_before_configure_reaches_subscribers() -> None:
    """Without a recorder, subscribers still get events (with a detected identity)."""
    tt.close()
    got: list[events.LifecycleEvent] = []
    publisher = get_default_event_publisher()
    sub = publisher.subscribe(events.EventType.JOB_START, on_event=got.append)
    try:
        events.record(events.EventType.JOB_START, data={"a": 1})
        publisher.flush()
    finally:
        publisher.unsubscribe(sub)
    assert [e.name for e in got] == ["job_start"]
    assert got[0].data == {"a": 1}
    assert got[0].identity["rank"] == 0
    assert got[0].type is events.EventType.JOB_START


@pytest.fixture
def handler() -> Iterator[events.LifecycleLogHandler]:
    """The process's lifecycle log handler, writing to a string."""
    made = events.get_logging_handler()
    made.set_stream(io.StringIO())
    yield made
    made.close()


def _text(h: events.LifecycleLogHandler) -> str:
    get_default_event_publisher().flush()
    stream = h.stream
    assert isinstance(stream, io.StringIO)
    return stream.getvalue()


def test_logging_handler_emits_lines(memory: MemoryBackend, handler: events.LifecycleLogHandler) -> None:
    """Events come out as key=value log lines, in a format the user sets."""
    handler.set_format("%(levelname)s %(message)s")
    events.record(events.EventType.WORKER_EXIT, worker_id=0, exit_code=0, data={"epoch": 10})
    text = _text(handler)
    assert text.startswith("INFO lifecycle=worker_exit source=worker worker_id=0 exit_code=0")
    assert "data.epoch=10" in text
    assert "job=ev" in text


def test_logging_handler_level_and_json(handler: events.LifecycleLogHandler) -> None:
    """setLevel filters; set_format('json') makes the message JSON."""
    handler.set_format("%(message)s").set_format("json")
    handler.setLevel(logging.WARNING)
    events.record(events.EventType.WORKER_START, worker_id=0)
    events.record(events.EventType.WORKER_FAILURE, worker_id=1, exit_code=3)
    lines = _text(handler).splitlines()
    assert len(lines) == 1
    payload = json.loads(lines[0])
    assert (payload["name"], payload["worker_id"], payload["exit_code"]) == ("worker_failure", 1, 3)


def test_logging_handler_set_logger(handler: events.LifecycleLogHandler) -> None:
    """set_logger moves the handler; the events then pass through that logger."""
    logger = logging.getLogger("test.lifecycle")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    collector = Collect()
    logger.addHandler(collector)
    try:
        handler.set_logger(logger)
        assert handler in logger.handlers
        assert handler not in logging.getLogger(events.DEFAULT_LOGGER).handlers
        events.record(events.EventType.NODE_JOIN, data={"node": "a"})
        text = _text(handler)
    finally:
        logger.removeHandler(collector)
    assert "lifecycle=node_join" in text
    assert seen[0].traintrace_event.name == "node_join"  # type: ignore[attr-defined]
    assert seen[0].name == "test.lifecycle"
