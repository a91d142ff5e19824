"""The writer thread: turns queued tuples into records and hands them to backends."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._names import EventName, RecordKind, SpanStatus, Verbosity
from ._recorder import ERROR, EVENT, Span
from ._redact import Redactor
from ._sanitize import MAX_INT, clean_key, clip_text, convert_mapping
from ._wakeup import Wakeup

if TYPE_CHECKING:
    from ._config import Config
    from .backends._base import Backend

log = logging.getLogger("traintrace.lib")

_ERROR_LEVEL = int(Verbosity.ERROR)

# Span.written as the writer sees it: 0 not seen yet; _OPEN its start record is
# written; _DONE its whole record is written; _HELD an observer keeps it back.
_OPEN, _DONE, _HELD = 1, 2, 4

# How many queued items the writer converts before letting other threads run.
_CHUNK = 512


@dataclass
class _Route:
    backend: Backend
    name: str
    level: int
    failures: int = 0
    failed_records: int = 0
    warned: bool = False


_SAFE_VALUE_TYPES = frozenset({bool, type(None)})
_INFINITIES = (float("inf"), float("-inf"))


def _name(name: object) -> str:
    """A span/event name as a bounded string (any object a caller passed)."""
    if type(name) is str and len(name) <= 256:
        return name
    return clean_key(name)


def _why(exc: BaseException) -> str:
    """``Type: message`` of an exception, even one whose ``str`` raises."""
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001
        text = "?"
    return clip_text(f"{type(exc).__name__}: {text}", 512)


def _merge(attrs: Any, metrics: dict[str, Any]) -> Any:
    """Attributes given at start with metrics added while open (either may be a user's oddity)."""
    try:
        return {**attrs, **metrics} if attrs else metrics
    except BaseException:  # noqa: BLE001 - attrs that are not a mapping: keep the metrics
        return metrics


def _link_id(link: object) -> int:
    """The id a ``link=`` names: a span's (0 if it was never entered), or an int given as one."""
    if isinstance(link, Span):
        return link.span_id
    try:
        value: int = int(link)  # type: ignore[call-overload]
        return max(0, value)
    except BaseException:  # noqa: BLE001 - a link that is not an id is dropped
        return 0


def clean_attrs(attrs: Mapping[str, Any], redactor: Redactor | None = None) -> dict[str, Any]:
    """``attrs`` as JSON-safe data, secrets redacted; the common case (str keys, plain numbers)
    passes as is (with only its top-level keys to check)."""
    if type(attrs) is dict and len(attrs) <= 256:
        for key, value in attrs.items():
            kind = type(value)
            if type(key) is not str or len(key) > 256:
                break
            if kind is float:
                if value != value or value in _INFINITIES:  # noqa: PLR0124 - the NaN test
                    break
            elif kind is int:
                if not -MAX_INT < value < MAX_INT:
                    break
            elif kind is str:
                if len(value) > 4096:
                    break
            elif kind not in _SAFE_VALUE_TYPES:
                break
        else:
            return redactor.apply(attrs) if redactor else attrs
    return convert_mapping(attrs, redactor.secret if redactor else None)


class Pipeline:
    """A bounded queue, drained in batches by one daemon thread."""

    def __init__(self, config: Config, header: dict[str, Any], routes: list[tuple[Backend, str, int]]) -> None:
        self.config = config
        self.header = header
        self.queue: deque[Any] = deque()
        self.capacity = config.queue_size
        self.blocking = config.blocking
        self.dropped = 0
        self._dropped_reported = 0
        self._drop_lock = threading.Lock()
        self._routes = [_Route(b, name, level) for b, name, level in routes]
        self._max_route_level = max((r.level for r in self._routes), default=-1)
        self._wake = Wakeup()
        self._flush_waiters: list[threading.Event] = []
        self._closing: str | None = None
        self._closed = threading.Event()
        #: Set by the writer (a plain attribute: a signal handler may read it) once the stream is closed.
        self.finished = False
        #: Write cycles completed; a signal handler waits for it to move (no lock to take).
        self.cycles = 0
        # Signal events asked for by a signal handler: (attrs, span id, thread ident, mono).
        self._signal_events: list[tuple[dict[str, Any], int, int, int]] = []
        self._seq = 1  # the header is 0
        self._open: dict[int, Span] = {}
        self._threads: dict[int, int] = {}
        self._anchor_wall = 0
        self._anchor_mono = 0
        self._refresh_anchor()
        self.records_written = 0
        #: Writer-thread hooks that see every span end (see ``_insight.IterationStats``).
        self.observers: list[Any] = []
        self._redactor = Redactor(getattr(config, "redact_keys", ()))
        self._warned_drops = False
        self._bad_items = 0
        self._thread = threading.Thread(target=self._run, name="traintrace-writer", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------
    def overflow(self, item: Any) -> bool:
        """The queue is full: wait (blocking mode) or drop and count. True if queued."""
        self._wake.set()
        if self.blocking and threading.current_thread() is not self._thread:
            deadline = time.monotonic() + 60.0
            while len(self.queue) >= self.capacity and not self._closed.is_set():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
                self._wake.set()
            else:
                self.queue.append(item)
                return True
        with self._drop_lock:
            self.dropped += 1
        return False

    def wake(self) -> None:
        self._wake.set()

    # -- from a signal handler: no lock taken, nothing that can block -----------
    def signal_event(self, attrs: dict[str, Any], span_id: int, ident: int) -> int:
        """Have the writer record a ``signal`` event; returns the cycle count to wait past."""
        self._signal_events.append((attrs, span_id, ident, time.perf_counter_ns()))
        cycles = self.cycles
        self._wake.set()
        return cycles

    def terminate_from_signal(self, attrs: dict[str, Any], span_id: int, ident: int) -> None:
        """Record a ``signal`` event, write everything queued, end open spans ``terminated``, close."""
        self.signal_event(attrs, span_id, ident)
        if self._closing is None:
            self._closing = SpanStatus.TERMINATED
        self._wake.set()

    def wait_from_signal(self, timeout: float, past_cycle: int | None = None) -> bool:
        """Sleep-poll (no lock) until the stream is closed, or a cycle after ``past_cycle`` ended."""
        deadline = time.monotonic() + timeout
        while not self.finished and (past_cycle is None or self.cycles <= past_cycle + 1):
            if time.monotonic() > deadline:
                return False
            self._wake.set()
            time.sleep(0.002)
        return True

    def flush(self, timeout: float) -> bool:
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._flush_waiters.append(done)
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float, open_status: str = SpanStatus.ABANDONED) -> None:
        self._closing = open_status
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "traintrace: the writer did not finish within %.1fs; %d queued records not written",
                timeout,
                len(self.queue),
            )

    # -- writer thread -----------------------------------------------------
    def _refresh_anchor(self) -> None:
        # Wall time is derived from the monotonic clock so the caller reads one
        # clock; the pair is re-read every cycle, which bounds drift to a cycle.
        mono0 = time.perf_counter_ns()
        wall = time.time_ns()
        mono1 = time.perf_counter_ns()
        self._anchor_wall = wall
        self._anchor_mono = (mono0 + mono1) // 2

    def _run(self) -> None:
        interval = self.config.flush_interval
        backlog = max(self.capacity // 4, 1)
        failures = 0
        try:
            while self._closing is None:
                if len(self.queue) < backlog:
                    self._wake.wait(interval)
                self._wake.clear()
                try:
                    self._cycle(drain=False)
                except BaseException:  # even SystemExit from a user's __repr__
                    # A bug here must not end telemetry for the rest of the run.
                    failures += 1
                    if failures == 1:
                        log.exception("traintrace: a write cycle failed; its records may be lost")
            try:
                self._cycle(drain=True)
            except BaseException:  # the close record is still written
                log.exception("traintrace: the final write cycle failed; its records may be lost")
            self._finish(self._closing)
        except BaseException:
            log.exception("traintrace: writer thread failed; telemetry stops here")
        finally:
            self.finished = True
            self._closed.set()
            for waiter in self._flush_waiters:
                waiter.set()

    def _cycle(self, drain: bool) -> None:
        """Write what was queued when the cycle began (everything, when ``drain``)."""
        waiters, self._flush_waiters = self._flush_waiters, []
        try:
            self._cycle_body(drain, waiters)
        finally:
            # Even after a failure: flush() must not wait out its timeout.
            for waiter in waiters:
                waiter.set()

    def _cycle_body(self, drain: bool, waiters: list[threading.Event]) -> None:
        self._refresh_anchor()
        wrote = False
        chunks = 0
        queue = self.queue
        budget = len(queue)
        while queue and (drain or budget > 0):
            budget -= _CHUNK
            batch: list[tuple[int, dict[str, Any]]] = []
            self._convert(queue, batch)
            if batch:
                self._deliver(batch)
                wrote = True
            chunks += 1
            if chunks % 16 == 0:
                time.sleep(0)  # let the training thread have the GIL now and then
        if self._signal_events:
            signalled: list[tuple[int, dict[str, Any]]] = []
            while self._signal_events:
                attrs, span_id, ident, mono = self._signal_events.pop(0)
                self.emit_event(
                    EventName.SIGNAL, attrs, signalled, span_id=span_id, ident=ident, mono=mono, level=_ERROR_LEVEL
                )
            self._deliver(signalled)
            wrote = True
        if waiters and self.observers:
            held: list[tuple[int, dict[str, Any]]] = []
            for observer in self.observers:
                try:
                    observer.flushing(held)
                except Exception:
                    log.exception("traintrace: span observer failed at flush")
            if held:
                self._deliver(held)
                wrote = True
        if self.dropped != self._dropped_reported:
            with self._drop_lock:
                count = self.dropped - self._dropped_reported
                self._dropped_reported = self.dropped
            record = self._record(RecordKind.DROPPED, time.perf_counter_ns())
            record["count"] = count
            record["total"] = self._dropped_reported
            record["reason"] = "queue_full"
            if not self._warned_drops:
                self._warned_drops = True
                log.warning(
                    "traintrace: the record queue was full; %d records dropped (counted in "
                    "'dropped' records). Set blocking=True or a larger queue_size to keep all.",
                    count,
                )
            self._deliver([(int(Verbosity.ERROR), record)])
            wrote = True
        if wrote or waiters:
            self._flush_backends()
        self.cycles += 1

    def _clean(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return clean_attrs(attrs, self._redactor)
        except BaseException as exc:  # noqa: BLE001 - e.g. a dict another thread changes meanwhile
            # The record keeps its place; its attributes say why they are missing.
            return {"<unconvertible>": _why(exc)}

    def _bad_item(self, exc: BaseException, out: list[tuple[int, dict[str, Any]]]) -> None:
        """An item that could not become a record: a ``dropped`` note in its place says why."""
        self._bad_items += 1
        if self._bad_items == 1:
            log.warning("traintrace: a record could not be converted (%s); a 'dropped' note replaces it", _why(exc))
        record = self._record(RecordKind.DROPPED, time.perf_counter_ns())
        record["count"] = 1
        record["reason"] = "unconvertible"
        record["error"] = _why(exc)
        out.append((_ERROR_LEVEL, record))

    def _record(self, kind: str, mono: int) -> dict[str, Any]:
        seq = self._seq
        self._seq = seq + 1
        return {"seq": seq, "kind": kind, "ts": self._anchor_wall + (mono - self._anchor_mono)}

    def _thread_id(self, ident: int, out: list[tuple[int, dict[str, Any]]]) -> int:
        native = self._threads.get(ident)
        if native is not None:
            return native
        name = "?"
        native = ident
        for thread in threading.enumerate():
            if thread.ident == ident:
                name = thread.name
                native = thread.native_id or ident
                break
        self._threads[ident] = native
        record = self._record(RecordKind.THREAD, time.perf_counter_ns())
        record["tid"] = native
        record["thread_name"] = name
        out.append((int(Verbosity.INFO), record))
        return native

    def _convert(self, queue: deque[Any], out: list[tuple[int, dict[str, Any]]]) -> None:
        # One iterator for the chunk: after a bad item the loop resumes where it stopped.
        rounds = iter(range(min(len(queue), _CHUNK)))
        while True:
            try:
                self._convert_items(queue, rounds, out)
                return
            except BaseException as exc:  # noqa: BLE001 - a user's value may raise anything
                self._bad_item(exc, out)

    def _convert_items(self, queue: deque[Any], rounds: Any, out: list[tuple[int, dict[str, Any]]]) -> None:
        popleft = queue.popleft
        append = out.append
        threads = self._threads
        open_spans = self._open
        observers = self.observers
        wall0 = self._anchor_wall - self._anchor_mono
        seq = self._seq
        try:
            for _ in rounds:
                item = popleft()
                if item.__class__ is not tuple:
                    span: Span = item
                    state = span.written
                    if state:
                        # Second sighting: the span's stop.
                        if state == _OPEN or observers:
                            self._seq = seq
                            self._stopped(span, state, out)
                            seq = self._seq
                        continue
                    if observers and span.t1 is not None:
                        self._seq = seq
                        held = self._hold(span, False)
                        seq = self._seq
                        if held:
                            continue
                    tid = threads.get(span.tid)
                    if tid is None:
                        self._seq = seq
                        tid = self._thread_id(span.tid, out)
                        seq = self._seq
                    parent = span.parent
                    t1 = span.t1
                    if t1 is not None:
                        span.written = _DONE
                        record = {
                            "seq": seq,
                            "kind": "span",
                            "ts": wall0 + span.t0,
                            "name": _name(span.name),
                            "id": span.id,
                            "parent": parent.id if parent is not None else 0,
                            "tid": tid,
                            "dur": t1 - span.t0,
                            "status": span.status,
                        }
                        attrs = span.attrs
                        metrics = span.metrics
                        if metrics:
                            attrs = _merge(attrs, metrics)
                    else:
                        record = {
                            "seq": seq,
                            "kind": "start",
                            "ts": wall0 + span.t0,
                            "name": _name(span.name),
                            "id": span.id,
                            "parent": parent.id if parent is not None else 0,
                            "tid": tid,
                        }
                        open_spans[span.id] = span
                        span.written = _OPEN
                        attrs = span.attrs
                    if span.link is not None:
                        record["link"] = _link_id(span.link)
                    if attrs is not None and (attrs.__class__ is not dict or attrs):
                        record["attrs"] = self._clean(attrs)
                    seq += 1
                    append((span.level, record))
                    continue
                tag = item[0]
                if tag == EVENT:
                    _, name, attrs, span_id, ident, mono, level = item
                    tid = threads.get(ident)
                    if tid is None:
                        self._seq = seq
                        tid = self._thread_id(ident, out)
                        seq = self._seq
                    record = {
                        "seq": seq,
                        "kind": "event",
                        "ts": wall0 + mono,
                        "name": _name(name),
                        "span": span_id,
                        "tid": tid,
                    }
                    if attrs:
                        record["attrs"] = self._clean(attrs)
                    seq += 1
                    append((level, record))
                elif tag == ERROR:
                    _, name, attrs, span_id, ident, mono, info = item
                    tid = threads.get(ident)
                    if tid is None:
                        self._seq = seq
                        tid = self._thread_id(ident, out)
                        seq = self._seq
                    error_type, message, stack = info
                    record = {"seq": seq, "kind": "error", "ts": wall0 + mono, "name": _name(name)}
                    record["span"] = span_id
                    record["tid"] = tid
                    if error_type is not None:
                        record["error_type"] = error_type
                    record["message"] = message
                    record["stack"] = stack
                    if attrs:
                        record["attrs"] = self._clean(attrs)
                    seq += 1
                    append((_ERROR_LEVEL, record))
        finally:
            self._seq = seq

    def _hold(self, span: Span, started: bool) -> bool:
        """True when an observer keeps an ended span's record back, to release it later."""
        held = False
        for observer in self.observers:
            try:
                held = observer.hold(span, started) or held
            except Exception:
                log.exception("traintrace: span observer failed")
        if held:
            span.written = _HELD
            self._open.pop(span.id, None)
        return held

    def _stopped(self, span: Span, state: int, out: list[tuple[int, dict[str, Any]]]) -> None:
        """The writer sees a span's stop; ``state`` is what it wrote at its start."""
        if self.observers:
            if state == _OPEN and self._hold(span, True):
                self._observe(span, out)
                return
            self._observe(span, out)
        if state == _OPEN:
            self._end_record(span, span.t1 or time.perf_counter_ns(), span.status, out)

    def _observe(self, span: Span, out: list[tuple[int, dict[str, Any]]]) -> None:
        """Show an ended span to the observers, in the order spans ended."""
        for observer in self.observers:
            try:
                observer.span_ended(span, out)
            except Exception:
                log.exception("traintrace: span observer failed")

    def release_span(self, span: Span, started: bool, out: list[tuple[int, dict[str, Any]]]) -> None:
        """Write the record of a span an observer held back (writer thread only)."""
        if started:
            self._end_record(span, span.t1 or time.perf_counter_ns(), span.status, out)
            return
        tid = self._threads.get(span.tid) or self._thread_id(span.tid, out)
        record = self._record(RecordKind.SPAN, span.t0)
        record["name"] = _name(span.name)
        record["id"] = span.id
        parent = span.parent
        record["parent"] = parent.id if parent is not None else 0
        record["tid"] = tid
        if span.link is not None:
            record["link"] = _link_id(span.link)
        record["dur"] = (span.t1 or span.t0) - span.t0
        record["status"] = span.status
        attrs = span.attrs
        if span.metrics:
            attrs = _merge(attrs, span.metrics)
        if attrs:
            record["attrs"] = self._clean(attrs)
        out.append((span.level, record))

    def emit_event(
        self,
        name: str,
        attrs: dict[str, Any],
        out: list[tuple[int, dict[str, Any]]],
        *,
        span_id: int,
        ident: int,
        mono: int,
        level: int,
    ) -> None:
        """Add an event made on the writer thread (writer thread only)."""
        tid = self._threads.get(ident) or self._thread_id(ident, out)
        record = self._record(RecordKind.EVENT, mono)
        record["name"] = _name(name)
        record["span"] = span_id
        record["tid"] = tid
        if attrs:
            record["attrs"] = self._clean(attrs)
        out.append((level, record))

    def _end_record(self, span: Span, t1: int, status: str, out: list[tuple[int, dict[str, Any]]]) -> None:
        self._open.pop(span.id, None)
        span.written = _DONE
        record = self._record(RecordKind.END, t1)
        record["name"] = _name(span.name)
        record["id"] = span.id
        record["dur"] = t1 - span.t0
        record["status"] = status
        if span.metrics:
            record["attrs"] = self._clean(span.metrics)
        out.append((span.level, record))

    def _deliver(self, batch: list[tuple[int, dict[str, Any]]]) -> None:
        top = max(level for level, _ in batch)
        everything: list[dict[str, Any]] | None = None
        for route in self._routes:
            if route.level >= top:
                if everything is None:
                    everything = [record for _, record in batch]
                records = everything
            else:
                records = [record for level, record in batch if level <= route.level]
                if not records:
                    continue
            try:
                route.backend.write(records)
            except Exception as exc:  # noqa: BLE001 - one broken backend must not stop others
                self._backend_failed(route, exc, len(records))
        self.records_written += len(batch)

    def _backend_failed(self, route: _Route, exc: Exception, count: int) -> None:
        route.failures += 1
        route.failed_records += count
        if not route.warned:
            route.warned = True
            log.warning(
                "traintrace: backend %s failed (%s: %s); its records are dropped and counted until it recovers",
                route.name,
                type(exc).__name__,
                exc,
            )

    def _flush_backends(self) -> None:
        for route in self._routes:
            try:
                route.backend.flush()
            except Exception as exc:  # noqa: BLE001
                self._backend_failed(route, exc, 0)

    def _finish(self, open_status: str) -> None:
        now = time.perf_counter_ns()
        out: list[tuple[int, dict[str, Any]]] = []
        for observer in self.observers:
            try:
                observer.finish(out, open_status)
            except Exception:
                log.exception("traintrace: span observer failed at close")
        for span in list(self._open.values()):
            if span.t1 is None:
                span.t1 = now  # no longer anyone's parent
            self._end_record(span, now, open_status, out)
        record = self._record(RecordKind.CLOSE, now)
        record["records"] = self._seq
        record["dropped"] = self.dropped
        failed = {r.name: r.failed_records for r in self._routes if r.failed_records}
        if failed:
            record["backend_failures"] = failed
        out.append((int(Verbosity.ERROR), record))
        self._deliver(out)
        for route in self._routes:
            try:
                route.backend.close()
            except Exception as exc:  # noqa: BLE001
                self._backend_failed(route, exc, 0)

    def wall_ns(self, mono: int) -> int:
        return self._anchor_wall + (mono - self._anchor_mono)
