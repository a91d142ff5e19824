"""Subscribe to lifecycle events: callbacks run on a dispatcher thread.

>>> import traintrace.events as events
>>> import traintrace.publisher as publisher
>>> def on_exit(event: events.LifecycleEvent) -> None:
...     print(event.name, event.worker_id, event.exit_code)
>>> sub = publisher.get_default_event_publisher().subscribe(events.EventType.WORKER_EXIT, on_event=on_exit)
>>> publisher.get_default_event_publisher().unsubscribe(sub)
True

Design: :func:`traintrace.events.record` never runs a callback on the
caller's thread. When anyone is subscribed it appends one tuple to this
publisher's queue (and wakes the dispatcher if it sleeps); a daemon thread
named ``traintrace-events`` builds the :class:`~traintrace.events.LifecycleEvent`
and calls the subscribers in the order they subscribed. So a slow or
blocking callback delays other callbacks, never training. A callback that
raises is logged (with its traceback the first time, then counted) and the
others still run. Events still queued when the process exits are delivered
by an ``atexit`` hook; :meth:`EventPublisher.flush` waits for delivery.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._lifecycle import EventType, LifecycleEvent, build_event

__all__ = ["ALL", "EventPublisher", "Subscription", "get_default_event_publisher"]

log = logging.getLogger("traintrace.lib")

#: Pass as the event type to receive every lifecycle event.
ALL = "all"

_FLUSH = object()

Callback = Callable[["LifecycleEvent"], object]


@dataclass(eq=False)
class Subscription:
    """A handle returned by :meth:`EventPublisher.subscribe`; pass it to ``unsubscribe``."""

    types: frozenset[str] | None
    on_event: Callback
    failures: int = 0
    calls: int = field(default=0)

    def wants(self, name: str) -> bool:
        return self.types is None or name in self.types


def _type_names(types: EventType | str | Iterable[EventType | str] | None) -> frozenset[str] | None:
    if types is None or (isinstance(types, str) and types == ALL):
        return None
    if isinstance(types, str):  # an EventType is a str too
        return frozenset({str(getattr(types, "value", types))})
    names = frozenset(str(getattr(t, "value", t)) for t in types)
    if ALL in names:
        return None
    return names


class EventPublisher:
    """Delivers lifecycle events to subscribers on one background thread."""

    def __init__(self) -> None:
        self._subscriptions: tuple[Subscription, ...] = ()
        self._lock = threading.Lock()
        #: True while at least one subscriber exists; read by ``events.record``.
        self.listening = False
        self.pending: deque[tuple[Any, ...]] = deque()
        self.wake = threading.Event()
        self._delivered = 0
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    # -- subscribing ---------------------------------------------------------
    def subscribe(
        self,
        event_type: EventType | str | Iterable[EventType | str] | None = ALL,
        on_event: Callback | None = None,
    ) -> Subscription:
        """Call ``on_event(event)`` for each event of ``event_type``.

        ``event_type`` is one :class:`~traintrace.events.EventType`, a set of
        them, or :data:`ALL` (also ``None``). Returns a handle for
        :meth:`unsubscribe`.
        """
        if on_event is None or not callable(on_event):
            raise TypeError("subscribe() needs a callable on_event")
        subscription = Subscription(_type_names(event_type), on_event)
        with self._lock:
            self._subscriptions = (*self._subscriptions, subscription)
            self.listening = True
            self._ensure_thread()
        return subscription

    def unsubscribe(self, subscription: Subscription | Callback) -> bool:
        """Stop a subscription (or every subscription of a callback). True if one was found."""
        with self._lock:
            kept = tuple(s for s in self._subscriptions if s is not subscription and s.on_event is not subscription)
            found = len(kept) != len(self._subscriptions)
            self._subscriptions = kept
            self.listening = bool(kept)
        return found

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        return self._subscriptions

    # -- delivery --------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if os.getpid() != self._pid:  # forked: the parent's thread is not ours
            self._after_fork()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="traintrace-events", daemon=True)
            self._thread.start()

    def _after_fork(self) -> None:
        self._pid = os.getpid()
        self._thread = None
        self._lock = threading.Lock()
        self.wake = threading.Event()
        self.pending.clear()

    def _run(self) -> None:
        while True:
            self.wake.wait(1.0)
            self.wake.clear()
            self.drain()

    def drain(self) -> None:
        """Deliver every queued event now, on the calling thread."""

        pending = self.pending
        while pending:
            try:
                item = pending.popleft()
            except IndexError:
                break
            if item[0] is _FLUSH:
                item[1].set()
                continue
            try:
                event = build_event(item)
            except Exception:
                log.warning("traintrace: could not build a lifecycle event", exc_info=True)
                continue
            self.publish(event)
            self._delivered += 1

    def publish(self, event: LifecycleEvent) -> None:
        """Call the subscribers of ``event`` now, on this thread; never raises."""
        name = event.name
        for subscription in self._subscriptions:
            if not subscription.wants(name):
                continue
            subscription.calls += 1
            try:
                subscription.on_event(event)
            except Exception:
                subscription.failures += 1
                if subscription.failures == 1:
                    log.warning(
                        "traintrace: lifecycle subscriber %r raised on %s; it stays subscribed, "
                        "later failures are counted",
                        subscription.on_event,
                        name,
                        exc_info=True,
                    )

    def enqueue(self, item: tuple[Any, ...]) -> None:
        """Queue a raw event for the dispatcher (what ``events.record`` does inline)."""
        self.pending.append(item)
        if not self.wake.is_set():
            self.wake.set()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until events queued so far have been delivered; True if done in time."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            self.drain()
            return True
        done = threading.Event()
        self.pending.append((_FLUSH, done))
        self.wake.set()
        return done.wait(timeout)


_default = EventPublisher()


def get_default_event_publisher() -> EventPublisher:
    """The process-wide publisher that :func:`traintrace.events.record` feeds."""
    return _default


def _flush_at_exit() -> None:
    if _default.pending and _default.listening:
        _default.flush(2.0)


atexit.register(_flush_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default._after_fork)
