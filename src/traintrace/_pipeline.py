"""The writer thread: turns queued tuples into records and hands them to backends."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._names import RecordKind, SpanStatus, Verbosity
from ._recorder import ERROR, EVENT, START, STOP, Span
from ._redact import Redactor
from ._sanitize import clean_key, convert_mapping

if TYPE_CHECKING:
    from ._config import Config
    from .backends._base import Backend

log = logging.getLogger("traintrace.lib")

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


def _plain(attrs: Mapping[str, Any]) -> bool:
    """True when ``attrs`` is already JSON-safe (the common case: str -> number)."""
    for key, value in attrs.items():
        if type(key) is not str or len(key) > 256:
            return False
        kind = type(value)
        if kind is int or kind is bool:
            continue
        if kind is float:
            if value - value != 0.0:  # NaN or infinity
                return False
            continue
        if kind is str and len(value) <= 4096:
            continue
        return False
    return True


def _name(name: object) -> str:
    """A span/event name as a bounded string (any object a caller passed)."""
    if type(name) is str and len(name) <= 256:
        return name
    return clean_key(name)


def _merge(attrs: Any, metrics: dict[str, Any]) -> Any:
    """Attributes given at start with metrics added while open (either may be a user's oddity)."""
    try:
        return {**attrs, **metrics} if attrs else metrics
    except Exception:  # noqa: BLE001 - attrs that are not a mapping: keep the metrics
        return metrics


def _link_id(link: object) -> int:
    try:
        value: int = int(link)  # type: ignore[call-overload]
        return max(0, value)
    except Exception:  # noqa: BLE001 - a link that is not an id is dropped
        return 0


def clean_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    if type(attrs) is dict and len(attrs) <= 256 and _plain(attrs):
        return attrs
    return convert_mapping(attrs)


class Pipeline:
    """A bounded queue, drained in batches by one daemon thread."""

    def __init__(
        self, config: Config, header: dict[str, Any], routes: list[tuple[Backend, str, int]]
    ) -> None:
        self.config = config
        self.header = header
        self.queue: deque[tuple[Any, ...]] = deque()
        self.capacity = config.queue_size
        self.blocking = config.blocking
        self.dropped = 0
        self._dropped_reported = 0
        self._drop_lock = threading.Lock()
        self._routes = [_Route(b, name, level) for b, name, level in routes]
        self._max_route_level = max((r.level for r in self._routes), default=-1)
        self._wake = threading.Event()
        self._flush_waiters: list[threading.Event] = []
        self._closing: str | None = None
        self._closed = threading.Event()
        self._seq = 1  # the header is 0
        self._open: dict[int, Span] = {}
        self._threads: dict[int, int] = {}
        self._anchor_wall = 0
        self._anchor_mono = 0
        self._refresh_anchor()
        self.records_written = 0
        self._redactor = Redactor(getattr(config, "redact_keys", ()))
        self._warned_drops = False
        self.unconvertible = 0
        self._thread = threading.Thread(target=self._run, name="traintrace-writer", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------
    def overflow(self, item: tuple[Any, ...]) -> None:
        """The queue is full: wait (blocking mode) or drop and count."""
        self._wake.set()
        if self.blocking and threading.current_thread() is not self._thread:
            deadline = time.monotonic() + 60.0
            while len(self.queue) >= self.capacity and not self._closed.is_set():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0002)
                self._wake.set()
            else:
                self.queue.append(item)
                return
        with self._drop_lock:
            self.dropped += 1

    def wake(self) -> None:
        self._wake.set()

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
        try:
            while self._closing is None:
                self._wake.wait(interval)
                self._wake.clear()
                self._cycle()
            self._cycle()
            self._finish(self._closing)
        except BaseException:  # noqa: BLE001 - the writer must never die silently
            log.exception("traintrace: writer thread failed; telemetry stops here")
        finally:
            self._closed.set()
            for waiter in self._flush_waiters:
                waiter.set()

    def _cycle(self) -> None:
        waiters, self._flush_waiters = self._flush_waiters, []
        self._refresh_anchor()
        wrote = False
        queue = self.queue
        while queue:
            batch: list[tuple[int, dict[str, Any]]] = []
            self._convert(queue, batch)
            if batch:
                self._deliver(batch)
                wrote = True
            time.sleep(0)  # let the training thread have the GIL between chunks
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
        for waiter in waiters:
            waiter.set()

    def _clean(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        cleaned = clean_attrs(attrs)
        return self._redactor.apply(cleaned) if self._redactor else cleaned

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

    def _convert(self, queue: deque[tuple[Any, ...]], out: list[tuple[int, dict[str, Any]]]) -> None:
        try:
            self._convert_items(queue, out)
        except Exception:  # one unconvertible item must not stop the writer
            self.unconvertible += 1
            if self.unconvertible == 1:
                log.warning("traintrace: a record could not be built; skipped", exc_info=True)

    def _convert_items(
        self, queue: deque[tuple[Any, ...]], out: list[tuple[int, dict[str, Any]]]
    ) -> None:
        popleft = queue.popleft
        threads = self._threads
        open_spans = self._open
        for _ in range(min(len(queue), _CHUNK)):
            item = popleft()
            tag = item[0]
            if tag == START:
                span: Span = item[1]
                tid = threads.get(span.tid) or self._thread_id(span.tid, out)
                t1 = span.t1
                record = self._record(RecordKind.SPAN if t1 is not None else RecordKind.START, span.t0)
                record["name"] = _name(span.name)
                record["id"] = span.id
                parent = span.parent
                record["parent"] = parent.id if parent is not None else 0
                record["tid"] = tid
                if span.link is not None:
                    link = span.link
                    record["link"] = link.id if isinstance(link, Span) else _link_id(link)
                if t1 is not None:
                    span.written = True
                    record["dur"] = t1 - span.t0
                    record["status"] = span.status
                    attrs = span.attrs
                    metrics = span.metrics
                    if metrics:
                        attrs = _merge(attrs, metrics)
                else:
                    open_spans[span.id] = span
                    attrs = span.attrs
                if attrs is not None and (type(attrs) is not dict or attrs):
                    record["attrs"] = self._clean(attrs)
                out.append((span.level, record))
            elif tag == STOP:
                span = item[1]
                if span.written:
                    continue
                self._end_record(span, span.t1 or time.perf_counter_ns(), span.status, out)
            elif tag == EVENT:
                _, name, attrs, span_id, ident, mono, level = item
                tid = threads.get(ident) or self._thread_id(ident, out)
                record = self._record(RecordKind.EVENT, mono)
                record["name"] = _name(name)
                record["span"] = span_id
                record["tid"] = tid
                if attrs:
                    record["attrs"] = self._clean(attrs)
                out.append((level, record))
            elif tag == ERROR:
                _, name, attrs, span_id, ident, mono, info = item
                tid = threads.get(ident) or self._thread_id(ident, out)
                record = self._record(RecordKind.ERROR, mono)
                record["name"] = _name(name)
                record["span"] = span_id
                record["tid"] = tid
                error_type, message, stack = info
                if error_type is not None:
                    record["error_type"] = error_type
                record["message"] = message
                record["stack"] = stack
                if attrs:
                    record["attrs"] = self._clean(attrs)
                out.append((int(Verbosity.ERROR), record))

    def _end_record(
        self, span: Span, t1: int, status: str, out: list[tuple[int, dict[str, Any]]]
    ) -> None:
        self._open.pop(span.id, None)
        span.written = True
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
                "traintrace: backend %s failed (%s: %s); its records are dropped and counted "
                "until it recovers",
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
        for span in list(self._open.values()):
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
