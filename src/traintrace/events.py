"""Lifecycle events of a distributed job: workers, rendezvous, nodes, the job.

In the shape users know from ``torch.distributed.elastic.events``::

    import traintrace.events as events

    events.record(events.EventType.WORKER_EXIT, worker_id=0, exit_code=0,
                  data={"epoch": 10, "loss": 0.01})

    handler = events.get_logging_handler()     # also emit them as log lines
    handler.set_format("%(asctime)s %(message)s")
    handler.setLevel(logging.INFO)

A lifecycle event is written as an ``event`` record whose ``name`` is the
event type (``worker_exit``) into the same streams and backends as every
other record, with ``attrs``: ``source`` (``agent`` or ``worker``), the
recording process's ``rank``, ``local_rank``, ``node_rank`` and ``restart``
(or the worker's, for events the agent records about a worker),
``worker_id`` and ``exit_code`` when given, and ``data``, the free-form
mapping. Failures, suspected hangs and non-zero exits are recorded at
``error`` verbosity (so they reach every backend on every rank), the rest at
``info``. Subscribers (:mod:`traintrace.publisher`) receive a
:class:`LifecycleEvent`.

``record()`` works before ``configure()`` too: subscribers and the logging
handler still get the event. On the caller's thread it reads a clock, builds
one small dict and appends to a queue (about a microsecond); subscribers and
log lines run on a dispatcher thread.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from threading import get_ident
from time import perf_counter_ns
from typing import IO, Any

from . import _recorder
from ._lifecycle import EventSource, EventType, LifecycleEvent
from ._names import Verbosity
from .publisher import ALL, get_default_event_publisher

__all__ = [
    "EventSource",
    "EventType",
    "LifecycleEvent",
    "LifecycleLogHandler",
    "get_logging_handler",
    "record",
]

log = logging.getLogger("traintrace.lib")


_NAMES: dict[Any, str] = {member: member.value for member in EventType}
_NAMES.update({member.value: member.value for member in EventType})
_SOURCES: dict[Any, str] = {member: member.value for member in EventSource}
_SOURCES.update({"agent": "agent", "worker": "worker", "AGENT": "agent", "WORKER": "worker"})

_INFO = int(Verbosity.INFO)
_ERROR = int(Verbosity.ERROR)
_LEVELS: dict[str, int] = {
    EventType.WORKER_FAILURE.value: _ERROR,
    EventType.HANG_SUSPECTED.value: _ERROR,
    EventType.NODE_LEAVE.value: _ERROR,
}

_EVENT_TAG = _recorder.EVENT
_publisher = get_default_event_publisher()


# ---------------------------------------------------------------- identity cache

_cache_rec: Any = object()  # the recorder the cache below was built for
_cache_attrs: dict[str, Any] = {}
_cache_full: dict[str, Any] = {}
_cache_source = "worker"
#: The identity fields every lifecycle event carries in its attributes.
_RANK_FIELDS = ("rank", "local_rank", "node_rank", "restart")


def _refresh_cache(rec: _recorder.Recorder | None) -> None:
    """Precompute the identity attributes of events recorded through ``rec``."""
    global _cache_rec, _cache_attrs, _cache_full, _cache_source
    identity = rec.identity if rec is not None else None
    if identity is None:
        from ._identity import detect

        identity = detect()
    header = rec.header if rec is not None else {}
    _cache_source = "agent" if header.get("role") == "agent" else "worker"
    fields = identity.to_dict()
    _cache_attrs = {key: fields[key] for key in _RANK_FIELDS}
    _cache_full = {**_cache_attrs, **{key: fields[key] for key in ("world_size", "job", "host", "pid")}}
    _cache_rec = rec


def invalidate_identity_cache() -> None:
    """Forget the cached identity (after ``refresh_identity()`` changed it)."""
    global _cache_rec
    _cache_rec = object()


# ---------------------------------------------------------------- record


def record(
    event_type: EventType | str,
    worker_id: int | str | None = None,
    exit_code: int | None = None,
    data: Mapping[str, Any] | None = None,
    *,
    source: EventSource | str | None = None,
    identity: Mapping[str, Any] | None = None,
) -> None:
    """Record a lifecycle event. Never raises.

    ``source`` defaults to ``agent`` in a launcher's agent stream and to
    ``worker`` elsewhere. ``identity`` overrides the rank fields (``rank``,
    ``local_rank``, ``node_rank``, ``restart``), for an agent recording an
    event about one of its workers. A string that is not an :class:`EventType`
    value is recorded as a custom type.
    """
    mono = perf_counter_ns()
    try:
        name = _NAMES.get(event_type) or str(event_type)
        rec = _recorder._active
        if rec is not _cache_rec:
            _refresh_cache(rec)
        attrs: dict[str, Any] = {
            "source": _cache_source if source is None else _SOURCES.get(source) or str(source),
            **_cache_attrs,
        }
        if identity:
            attrs.update(identity)
        if worker_id is not None:
            attrs["worker_id"] = worker_id
        if exit_code is not None:
            attrs["exit_code"] = exit_code
        if data:
            attrs["data"] = dict(data)
        if rec is not None:
            level = _LEVELS.get(name, _INFO) if exit_code is None or exit_code == 0 else _ERROR
            if level <= rec.max_level and not rec.closed:
                span = _recorder._current.get()
                if span is not None and span.t1 is not None:
                    span = _recorder.current_span()
                item = (_EVENT_TAG, name, attrs, span.id if span is not None else 0, get_ident(), mono, level)
                rec.put(item)
        if _publisher.listening:
            _publisher.enqueue((name, mono, attrs, _cache_full))
    except Exception as exc:  # never raise into the caller, but for a signal (below)
        if type(exc).__name__ == "SignalException":
            raise  # torchrun's handler raised it here, in its agent: the signal, not a failure of this call
        _recorder.warn_once("bad_lifecycle_event", f"events.record({event_type!r}) could not record; ignored")


# ---------------------------------------------------------------- logging handler

DEFAULT_LOGGER = "traintrace.events"
DEFAULT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LifecycleLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Emits lifecycle events as log lines through a logger it is attached to.

    Made by :func:`get_logging_handler`. The message is ``key=value`` pairs
    (``set_format("json")`` for JSON); any other ``set_format`` string is a
    :class:`logging.Formatter` format for the whole line. The log record has
    the event in its ``traintrace_event`` attribute.
    """

    def __init__(self, stream: IO[str] | None = None, logger: logging.Logger | None = None) -> None:
        super().__init__(stream)
        self.body = "kv"
        self.setFormatter(logging.Formatter(DEFAULT_FORMAT))
        self.logger: logging.Logger = logging.getLogger(DEFAULT_LOGGER)
        if logger is None:
            if self.logger.level == logging.NOTSET:
                self.logger.setLevel(logging.INFO)
            self.logger.propagate = False
        else:
            self.logger = logger
        self.logger.addHandler(self)
        self.subscription = _publisher.subscribe(ALL, on_event=self.on_event)

    def set_format(self, fmt: str) -> LifecycleLogHandler:
        """``"kv"`` or ``"json"`` picks the message; anything else is a logging format string."""
        if fmt in ("kv", "json"):
            self.body = fmt
        else:
            self.setFormatter(logging.Formatter(fmt))
        return self

    def set_stream(self, stream: IO[str]) -> LifecycleLogHandler:
        """Write lines to ``stream`` from now on."""
        self.setStream(stream)
        return self

    def set_logger(self, logger: logging.Logger | str) -> LifecycleLogHandler:
        """Move this handler to ``logger`` and emit events through it (its level applies)."""
        target = logging.getLogger(logger) if isinstance(logger, str) else logger
        if target is not self.logger:
            self.logger.removeHandler(self)
            self.logger = target
            target.addHandler(self)
        return self

    def message(self, event: LifecycleEvent) -> str:
        fields = event.to_dict()
        fields.pop("timestamp_ns", None)
        if self.body == "json":
            return json.dumps(fields, default=repr, separators=(",", ":"))
        from .logfmt import format_line

        return format_line({"lifecycle": fields.pop("name"), **fields})

    def on_event(self, event: LifecycleEvent) -> None:
        failed = event.exit_code not in (None, 0) or _LEVELS.get(event.name) == _ERROR
        level = logging.WARNING if failed else logging.INFO
        logger = self.logger
        if not logger.isEnabledFor(level):
            return
        extra = {"traintrace_event": event}
        message = self.message(event)
        record = logger.makeRecord(logger.name, level, __file__, 0, message, (), None, extra=extra)
        record.created = event.timestamp
        record.msecs = (event.timestamp_ns // 1_000_000) % 1000
        logger.handle(record)

    def close(self) -> None:
        _publisher.unsubscribe(self.subscription)
        self.logger.removeHandler(self)
        super().close()


_handler: LifecycleLogHandler | None = None


def get_logging_handler() -> LifecycleLogHandler:
    """The process's lifecycle log handler (made on first call, writing to stderr).

    Change it with ``set_format(fmt)``, ``set_stream(stream)``,
    ``setLevel(level)`` and ``set_logger(logger)``. ``close()`` stops it.
    """
    global _handler
    if _handler is None or _handler.subscription not in _publisher.subscriptions:
        _handler = LifecycleLogHandler(sys.stderr)
    return _handler


def _after_fork() -> None:
    invalidate_identity_cache()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
