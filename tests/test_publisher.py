"""Subscribers: types, unsubscribe, isolation of failing callbacks, the thread they run on."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

import traintrace as tt
from traintrace import MemoryBackend, events, publisher

ET = events.EventType


@pytest.fixture
def pub() -> Iterator[publisher.EventPublisher]:
    """The default publisher, with every subscription of a test removed afterwards."""
    default = publisher.get_default_event_publisher()
    before = default.subscriptions
    yield default
    for sub in default.subscriptions:
        if sub not in before:
            default.unsubscribe(sub)


def test_subscribe_one_type_a_set_and_all(pub: publisher.EventPublisher) -> None:
    """Each subscriber gets exactly the types it asked for."""
    one: list[str] = []
    some: list[str] = []
    every: list[str] = []
    pub.subscribe(ET.WORKER_EXIT, on_event=lambda e: one.append(e.name))
    pub.subscribe({ET.WORKER_START, ET.WORKER_FAILURE}, on_event=lambda e: some.append(e.name))
    pub.subscribe(publisher.ALL, on_event=lambda e: every.append(e.name))
    for kind in (ET.WORKER_START, ET.WORKER_EXIT, ET.WORKER_FAILURE, ET.JOB_END):
        events.record(kind)
    assert pub.flush()
    assert one == ["worker_exit"]
    assert some == ["worker_start", "worker_failure"]
    assert every == ["worker_start", "worker_exit", "worker_failure", "job_end"]


def test_unsubscribe_by_handle_and_by_callback(pub: publisher.EventPublisher) -> None:
    """unsubscribe takes the handle or the callback; afterwards nothing arrives."""
    got: list[str] = []

    def callback(event: events.LifecycleEvent) -> None:
        got.append(event.name)

    handle = pub.subscribe(ET.JOB_START, on_event=callback)
    assert pub.unsubscribe(handle)
    pub.subscribe(ET.JOB_START, on_event=callback)
    assert pub.unsubscribe(callback)
    assert not pub.unsubscribe(callback)
    events.record(ET.JOB_START)
    pub.flush()
    assert got == []


def test_a_raising_subscriber_is_logged_and_isolated(
    pub: publisher.EventPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback that raises is logged once; later subscribers and the recorder carry on."""
    memory = MemoryBackend()
    tt.configure(backends=[], extra_backends=[memory], job_id="pub")
    got: list[int | str | None] = []

    def broken(event: events.LifecycleEvent) -> None:
        raise RuntimeError("subscriber bug")

    sub = pub.subscribe(ET.WORKER_EXIT, on_event=broken)
    pub.subscribe(ET.WORKER_EXIT, on_event=lambda e: got.append(e.worker_id))
    try:
        with caplog.at_level(logging.WARNING, logger="traintrace.lib"):
            events.record(ET.WORKER_EXIT, worker_id=0, exit_code=0)
            events.record(ET.WORKER_EXIT, worker_id=1, exit_code=0)
            pub.flush()
        tt.flush()
    finally:
        tt.close()
    assert got == [0, 1]
    assert sub.failures == 2
    warnings = [r for r in caplog.records if "subscriber" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].exc_info is not None
    assert len(memory.events("worker_exit")) == 2


def test_callbacks_run_on_the_dispatcher_thread(pub: publisher.EventPublisher) -> None:
    """record() returns before a slow callback runs; callbacks run on traintrace-events."""
    threads: list[str] = []
    release = threading.Event()

    def slow(event: events.LifecycleEvent) -> None:
        release.wait(5)
        threads.append(threading.current_thread().name)

    pub.subscribe(ET.HANG_SUSPECTED, on_event=slow)
    events.record(ET.HANG_SUSPECTED)  # returns although the callback blocks
    assert threads == []
    release.set()
    assert pub.flush()
    assert threads == ["traintrace-events"]


def test_event_fields(pub: publisher.EventPublisher) -> None:
    """A subscriber sees wall time, source, ids, data and the identity."""
    got: list[events.LifecycleEvent] = []
    pub.subscribe(ET.WORKER_EXIT, on_event=got.append)
    before = time.time_ns()
    events.record(ET.WORKER_EXIT, worker_id=3, exit_code=0, data={"epoch": 10}, source="agent")
    pub.flush()
    (event,) = got
    assert before - 10**9 <= event.timestamp_ns <= time.time_ns() + 10**9
    assert (event.source, event.worker_id, event.exit_code, event.data) == ("agent", 3, 0, {"epoch": 10})
    assert "job" in event.identity
    assert event.to_dict()["data"] == {"epoch": 10}


def test_subscribe_needs_a_callable(pub: publisher.EventPublisher) -> None:
    """A missing callback is a TypeError at subscribe time, not a failure later."""
    with pytest.raises(TypeError):
        pub.subscribe(ET.JOB_END, on_event=None)
