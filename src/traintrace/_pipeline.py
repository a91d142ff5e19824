"""The writer thread: turns queued tuples into records and hands them to backends."""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._names import EventName, RecordKind, SpanStatus, Verbosity
from ._procstat import stat_fields
from ._progress import S_ALIVE
from ._recorder import ERROR, EVENT, Span
from ._redact import Redactor
from ._sanitize import MAX_INT, bound_key, clip_text, convert_mapping
from ._serialize import ENCODER, dumps_lines
from ._wakeup import Wakeup

_native: Any
try:
    if os.environ.get("TRAINTRACE_PURE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ImportError("TRAINTRACE_PURE=1")
    _native = importlib.import_module("traintrace._encode")
except ImportError:  # not built (no compiler), or the pure-Python core asked for
    _native = None

#: The native writer's write-and-yield (not on Windows, where the writer sleeps apart).
_WRITE_PAUSE = _native is not None and hasattr(_native, "write_pause")
#: The names of its waits that ask the training thread for the GIL back as they end (see ``Pipeline._yield``).
_HURRY = ("pause", "wait_readable", "writer_idle")

if TYPE_CHECKING:
    from ._config import Config
    from .backends._base import Backend

log = logging.getLogger("traintrace.lib")

_ERROR_LEVEL = int(Verbosity.ERROR)

# Span.written as the writer sees it: 0 not seen yet; _OPEN its start record is
# written; _DONE its whole record is written; _HELD an observer keeps it back.
_OPEN, _DONE, _HELD = 1, 2, 4

# At most how many queued items the writer converts before writing them out.
_CHUNK = 512
# Items a cycle converts past its budget to reach the stops of spans it wrote whole (see _cycle_body).
_PAST_BUDGET = 8 * _CHUNK
# The writer holds the GIL for at most about this long (ns) before it lets a waiting thread
# in (``Pipeline._yield``): CPython hands the GIL over to a waiting thread only after the
# switch interval (5 ms) unless the holder lets go, so a longer slice stalls the training thread.
_SLICE_NS = 200_000
# Items the pure-Python writer converts between two looks at the clock.
_PURE_STEP = 64
# Nanoseconds the writer sleeps between slices, long enough for a waiting thread to wake and take the GIL.
_YIELD_NS = 50_000
# Seconds of the close budget kept for the close record and the local files.
_CLOSE_RESERVE = 0.25
# Seconds close() waits for the writer beyond its budget (the writer keeps to the budget).
_CLOSE_GRACE = 0.5
# Seconds the writer waits at least between cycles (while records arrive fast; see _run).
_MIN_WAIT = 0.001
#: Seconds between looks at which core the training thread is on (``Pipeline._spare_trainer_core``).
_SPARE_CHECK_S = 1.0
# Bytes of lines the native encoder may hold within a slice before they are written (see _convert_native).
_WRITE_BYTES = 512 * 1024
# The clock anchor (wall time of a monotonic reading): readings tried per cycle, and the widest
# gap between its two monotonic reads (ns) a new anchor may have (see _refresh_anchor).
_ANCHOR_TRIES = 3
_ANCHOR_SLACK_NS = 50_000


Out = list[tuple[int, dict[str, Any]]]

#: ``steps_left`` for the native encoder when no statistics count iterations.
_NO_INTERVAL = 1 << 30


@dataclass
class NativeWriter:
    """The native encoder's side of the pipeline: the file it writes and the routes that want dicts."""

    encoder: Any
    route: Route
    others: list[Route]
    #: The level up to which the encoder hands records back now (see ``Pipeline._dict_level``).
    dict_level: int = -1

    @property
    def level(self) -> int:
        return self.route.level


@dataclass
class Route:
    """One backend as the writer feeds it: its name in the config and the level it runs at."""

    backend: Backend
    name: str
    level: int
    failed_records: int = 0
    warned: bool = False


class SpanObserver(Protocol):
    """A writer-thread hook that sees every span end (``_insight.Insight``).

    All four run on the writer thread; one that raises is logged and the
    others still run.
    """

    def hold(self, span: Span, started: bool) -> bool:
        """True to keep an ended span's record back (released later by ``Pipeline.release_span``)."""
        ...

    def span_ended(self, span: Span, out: Out) -> None:
        """A span ended; records to write may be appended to ``out``."""
        ...

    def flushing(self, out: Out) -> None:
        """Someone waits in ``flush()``: append what is held back and should be written now."""
        ...

    def finish(self, out: Out, open_status: str) -> None:
        """The pipeline closes; spans still open end with ``open_status``."""
        ...


#: A backend's loss reasons that count records, and the reason its ``dropped`` records give.
_RECORD_LOSSES = {"queue_full": "export_queue_full", "failed": "export_failed", "abandoned": "export_abandoned"}

_SAFE_VALUE_TYPES = frozenset({bool, type(None)})
_INFINITIES = (float("inf"), float("-inf"))


def _name(name: object) -> str:
    """A span/event name as a bounded string (any object a caller passed)."""
    if type(name) is str and len(name) <= 256:
        return name
    return bound_key(name)


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


def _plain_value(value: Any) -> bool:
    """A scalar that the sanitizer would leave as it is."""
    kind = type(value)
    if kind is float:
        return not (value != value or value in _INFINITIES)  # noqa: PLR0124 - the NaN test
    if kind is int:
        return bool(-MAX_INT < value < MAX_INT)
    if kind is str:
        return len(value) <= 4096
    return kind in _SAFE_VALUE_TYPES


def _inner_state(inner: dict[Any, Any], known: dict[str, bool] | None) -> int:
    """A nested dict (a lifecycle event's ``data``): 0 if the sanitizer would change it, else
    1, or 2 when one of its keys still needs the redactor's judgement."""
    state = 1
    for key, value in inner.items():
        if type(key) is not str or len(key) > 256 or not _plain_value(value):
            return 0
        if known is not None and known.get(key) is not False:
            state = 2
    return state


def clean_attrs(attrs: Mapping[str, Any], redactor: Redactor | None = None) -> dict[str, Any]:
    """``attrs`` as JSON-safe data, secrets redacted; the common case (str keys, plain numbers,
    dicts of those one level down) passes as is (nested dicts copied), with only its keys to check."""
    if type(attrs) is dict and len(attrs) <= 256:
        # Keys the redactor already judged harmless (its cache) need no second pass.
        known = redactor.judged if redactor else None
        unjudged = False
        nodes = len(attrs)
        nested = False
        for key, value in attrs.items():
            kind = type(value)
            if type(key) is not str or len(key) > 256:
                break
            if known is not None and known.get(key) is not False:
                unjudged = True
            if kind is float:
                if value != value or value in _INFINITIES:  # noqa: PLR0124 - the NaN test
                    break
            elif kind is int:
                if not -MAX_INT < value < MAX_INT:
                    break
            elif kind is str:
                if len(value) > 4096:
                    break
            elif kind is dict:
                nodes += len(value)
                state = _inner_state(value, known) if len(value) <= 256 and nodes <= 4096 else 0
                if not state:
                    break
                unjudged = unjudged or state == 2
                nested = True
            elif kind not in _SAFE_VALUE_TYPES:
                break
        else:
            if nested:  # the record must not change with the caller's dict
                attrs = {k: dict(v) if type(v) is dict else v for k, v in attrs.items()}
            return redactor.apply(attrs) if unjudged and redactor else attrs
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
        #: spans whose start was dropped and that have not stopped yet
        self._starts_dropped = 0
        self._dropped_reported = 0
        self._drop_lock = threading.Lock()
        self.routes = [Route(b, name, level) for b, name, level in routes]
        #: The most verbose level any backend writes (-1: none).
        self.max_route_level = max((r.level for r in self.routes), default=-1)
        self._wake = Wakeup()
        #: The progress file's int64 view, stamped each cycle (set by _progress.attach; None without one).
        self.alive_slot: Any = None
        self._flush_waiters: list[threading.Event] = []
        self._closing: str | None = None
        #: time.monotonic() by which close must be done (set by close()); None while running
        self._deadline: float | None = None
        self._closed = threading.Event()
        #: Set by the writer (a plain attribute: a signal handler may read it) once the stream is closed.
        self.finished = False
        #: Write cycles completed; a signal handler waits for it to move (no lock to take).
        self.cycles = 0
        # Signal events asked for by a signal handler: (attrs, span id, thread ident, mono).
        self._signal_events: list[tuple[dict[str, Any], int, int, int]] = []
        self._seq = 1  # the header is 0
        self._open: dict[int, Span] = {}
        #: Spans this cycle saw first already ended (written whole or held) less their stops seen since.
        self._whole_unstopped = 0
        # Records converted in this cycle's slices, delivered to backends other than the native file a chunk at
        # a time (``_gather_for_delivery``): a slice is short (the GIL's hand-over), a backend's write may be slow.
        self._held: list[tuple[int, dict[str, Any]]] = []
        self._held_routes: list[Route] | None = None
        self._threads: dict[int, int] = {}
        self._anchor_wall = 0
        self._anchor_mono = 0
        self._refresh_anchor()
        #: Writer-thread hooks that see every span end (see ``_insight.IterationStats``).
        self.observers: list[SpanObserver] = []
        #: span id -> (observers still holding it, fields they released it with): spans held by several
        self._holders: dict[int, tuple[int, dict[str, Any]]] = {}
        self._redactor = Redactor(getattr(config, "redact_keys", ()))
        if self._redactor:
            # Judged now, so that the native encoder writes training_iteration(step)'s step from the first.
            self._redactor.secret("step")
        self._warned_drops = False
        self._bad_items = 0
        self._losses_reported: dict[str, dict[str, int]] = {}
        self._close_abandoned = 0
        #: The native encoder when the extension is there and a file backend is the main consumer.
        self.native: NativeWriter | None = self._native_writer()
        #: traintrace._encode, for the writer's waits that take the GIL back at once (None: plain waits).
        self._waits: Any = _native if _native is not None and all(hasattr(_native, n) for n in _HURRY) else None
        #: Set while the statistics absorb the encoder's iterations: events they add are encoded in C.
        self._direct: NativeWriter | None = None
        #: The thread that configured traintrace (the training thread, nearly always): the writer keeps off
        #: its core (``writer_spare_core``).
        self._trainer_tid = threading.get_native_id()
        self._spared_cpu: int | None = None
        self._allowed_cpus: set[int] = set()  # the cores the writer may use, as it started
        self._spare_checked = 0.0
        self._thread = threading.Thread(target=self._run, name="traintrace-writer", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------
    def overflow(self, item: Any, lost: int = 1) -> bool:
        """The queue is full: wait (blocking mode) or drop and count. True if queued.

        ``lost`` is the records the drop loses: 0 for a span's start, whose record
        is still written whole if its stop fits (see :meth:`start_resolved`).
        """
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
            if lost:
                self.dropped += lost
            else:
                self._starts_dropped += 1
        return False

    def start_resolved(self) -> None:
        """A span whose start was dropped stops (its loss, if any, is counted by ``overflow``)."""
        with self._drop_lock:
            self._starts_dropped -= 1

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
            self._deadline = time.monotonic() + max(float(self.config.close_timeout), 0.0)
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

    def open_spans(self) -> list[Span]:
        """The spans whose start is written and whose end is not (a snapshot; any thread)."""
        for _ in range(10):
            try:
                return list(self._open.values())
            except RuntimeError:  # changed size while copying
                continue
        return []

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's queued (and held) items and drop lock are not this process's."""
        self.queue.clear()
        self._held = []
        self._drop_lock = threading.Lock()

    def flush(self, timeout: float) -> bool:
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._flush_waiters.append(done)
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float, open_status: str = SpanStatus.ABANDONED) -> None:
        """Write what is queued and close the backends, all within ``timeout`` seconds.

        What the writer cannot write in time is counted and said in a ``dropped``
        record (reason ``close_timeout``) before the ``close`` record.
        """
        self._deadline = time.monotonic() + max(timeout, 0.0)
        self._closing = open_status
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # The writer keeps to the deadline; the grace is for its last few records.
            self._thread.join(max(timeout, 0.0) + _CLOSE_GRACE)
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
        # A reading is off by up to half the time between its two monotonic reads: on a
        # loaded machine the thread can lose the CPU there for milliseconds, and records
        # written in that cycle would be dated as far off. The tightest of a few readings
        # is taken, and one still too loose keeps the last anchor for this cycle.
        best = (0, 0, 0)
        for attempt in range(_ANCHOR_TRIES):
            mono0 = time.perf_counter_ns()
            wall = time.time_ns()
            mono1 = time.perf_counter_ns()
            if attempt == 0 or mono1 - mono0 < best[0]:
                best = (mono1 - mono0, wall, (mono0 + mono1) // 2)
            if best[0] <= _ANCHOR_SLACK_NS:
                break
        gap, wall, mono = best
        if gap <= _ANCHOR_SLACK_NS or self._anchor_mono == 0:
            self._anchor_wall = wall
            self._anchor_mono = mono

    def _lower_priority(self) -> None:
        """Add ``writer_nice`` to this thread's niceness (Linux, where a thread has its own).

        On a machine with every core busy (a training loop spinning in Python, another process), a writer
        at the training thread's priority that wakes takes the core the training thread was woken on, and
        the loop waits for it to finish: most of the spans over 1 ms in ``bench_stalls.py``. A little lower,
        it waits for a core instead; it still gets its few percent of one (docs/configuration.md).
        """
        nice = self.config.writer_nice
        if not nice or not sys.platform.startswith("linux"):
            return
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
        except OSError as exc:  # a sandbox that forbids it: the writer runs as it would have
            log.debug("traintrace: writer priority left as it is (%s)", exc)

    def _spare_trainer_core(self) -> None:
        """Keep the writer off the core the training thread is on (``writer_spare_core``; Linux).

        ``writer_nice`` makes the writer wait for a core rather than take the training thread's; it still
        takes it now and then, and a loop that finds its core taken stands still for the scheduler's slice
        (``bench_stalls.py``: most of the spans over 1 ms beyond the floor's were such waits). The writer runs
        on the other cores the process may use, and follows the training thread when the kernel moves it
        (looked at once a second at most, from ``/proc``). One allowed core only: left as it is.
        """
        now = time.monotonic()
        if now - self._spare_checked < _SPARE_CHECK_S:
            return
        self._spare_checked = now
        try:
            cpu = _cpu_of(self._trainer_tid)
            if cpu == self._spared_cpu:
                return
            others = self._allowed_cpus - {cpu}
            if not others:
                return
            os.sched_setaffinity(threading.get_native_id(), others)
            self._spared_cpu = cpu
        except (OSError, ValueError, IndexError) as exc:  # the thread is gone, a sandbox: stop looking
            log.debug("traintrace: the writer's cores left as they are (%s)", exc)
            self._spare_checked = math.inf

    def _run(self) -> None:
        self._lower_priority()
        if self.config.writer_spare_core and sys.platform.startswith("linux"):
            try:
                self._allowed_cpus = os.sched_getaffinity(0)
            except OSError:
                self._spare_checked = math.inf
        else:
            self._spare_checked = math.inf
        self._spare_trainer_core()
        interval = self.config.flush_interval
        backlog = max(self.capacity // 4, 1)
        failures = 0
        # Items queued per second while the writer waited: it wakes before the queue passes the backlog
        # (nothing rings it on the way: a span's append must stay cheap), not only every flush_interval.
        rate = 0.0
        ended, left = time.monotonic(), 0
        try:
            while self._closing is None:
                queued = len(self.queue)
                if queued < backlog:
                    timeout = interval
                    if rate > 0:
                        timeout = min(interval, max((backlog - queued) / rate, _MIN_WAIT))
                    self._wait(timeout)
                self._wake.clear()
                self._spare_trainer_core()
                started, queued = time.monotonic(), len(self.queue)
                if started > ended:
                    rate = max(queued - left, 0) / (started - ended)
                try:
                    self._cycle(drain=False)
                except BaseException:  # even SystemExit from a user's __repr__
                    # A bug here must not end telemetry for the rest of the run.
                    failures += 1
                    if failures == 1:
                        log.exception("traintrace: a write cycle failed; its records may be lost")
                ended, left = time.monotonic(), len(self.queue)
            try:
                self._cycle(drain=True)
            except BaseException:  # the close record is still written
                log.exception("traintrace: the final write cycle failed; its records may be lost")
            self._finish(self._closing)
        except BaseException:
            log.exception("traintrace: writer thread failed; telemetry stops here")
        finally:
            if self._waits is not None:
                self._waits.writer_idle()  # nobody should let a writer that is gone in
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
        alive = self.alive_slot
        if alive is not None:
            # In the progress file, which the kernel keeps: a killed rank's file says until when it lived,
            # so a rank stuck since long before the kill is told from one a phase behind (docs/format.md).
            try:
                alive[S_ALIVE] = time.perf_counter_ns()
            except Exception:  # noqa: BLE001 - a released view: no more stamps
                self.alive_slot = None
        wrote = False
        queue = self.queue
        budget = len(queue)
        past = _PAST_BUDGET
        self._whole_unstopped = 0
        native = self.native
        if native is not None:
            native.encoder.whole_unstopped = 0
        # A span that ended after the cycle began is written whole where its start stands in
        # the queue; its events stand between that and its stop. The cycle goes on to the
        # stop (within _PAST_BUDGET), or a backend flushed now would send the span without
        # them (OTLP: an event after its span is exported cannot join it).
        clock = time.perf_counter_ns
        slice_end = clock() + _SLICE_NS
        while queue and (drain or budget > 0 or (past > 0 and self._stops_pending())):
            if self._deadline is not None and time.monotonic() > self._drain_deadline():
                self._abandon_queue()  # close() is out of time: say what is not written
                break
            yielded = False
            # What was queued when the cycle began, exactly: past it, only to reach a stop (above).
            limit = min(budget, _CHUNK) if budget > 0 and not drain else _CHUNK
            if self.native is not None:
                taken, written, yielded = self._convert_native(queue, self.native, slice_end, limit)
            else:
                taken, written = self._convert_pure(queue, slice_end, limit)
            taken = max(taken, 1)
            if budget <= 0:
                past -= taken
            budget -= taken
            wrote = written or wrote
            if clock() >= slice_end:
                if not yielded and queue and self._deadline is None:
                    self._yield()
                slice_end = clock() + _SLICE_NS
        self._deliver_held()
        if self.native is not None and self._write_pending(self.native, self._write_resuming if _WRITE_PAUSE else None):
            wrote = True  # the lines of the cycle's last slice, before anything else is delivered
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
            notes: list[tuple[int, dict[str, Any]]] = []
            self._drop_record(notes)
            if not self._warned_drops and any(r["reason"] == "queue_full" for _, r in notes):
                self._warned_drops = True
                log.warning(
                    "traintrace: the record queue was full; %d records dropped (counted in "
                    "'dropped' records). Set blocking=True or a larger queue_size to keep all.",
                    notes[-1][1]["count"],
                )
            if notes:
                self._deliver(notes)
                wrote = True
        if self._report_losses():
            wrote = True
        if wrote or waiters:
            self._flush_backends()
        self.cycles += 1

    def _stops_pending(self) -> bool:
        """Whether a span seen whole in this cycle still has its stop (and maybe events) in the queue."""
        pending = self._whole_unstopped
        if self.native is not None:
            pending += self.native.encoder.whole_unstopped
        return pending > 0

    def _yield(self) -> None:
        """Let a thread waiting for the GIL (the training thread) take it now.

        Releasing the GIL for an instant is not enough: the writer takes it back before
        the waiting thread wakes, and that thread waits on for the switch interval. The
        writer sleeps long enough for it to wake; not at close, which nobody waits through.
        It has more to do: it asks for the GIL back (``_encode.pause``), or a training loop
        running Python back to back would keep it for the switch interval, or longer.
        """
        if self._waits is not None:
            self._waits.pause(_YIELD_NS, True)
        else:
            time.sleep(_YIELD_NS / 1e9)

    def _wait(self, timeout: float) -> None:
        """Wait for the wake-up or the timeout, then take the GIL back at the training thread's next span stop."""
        if self._waits is not None and not self._wake.is_set():
            try:
                self._waits.wait_readable(self._wake.fileno(), int(timeout * 1e9), True)
                return
            except (OSError, ValueError):
                pass  # (a closed descriptor after a fork, say): as Wakeup waits
        self._wake.wait(timeout)

    @staticmethod
    def _write_resuming(fd: int, data: memoryview) -> int:
        """``os.write`` that takes the GIL back at the training thread's next span stop (no pause)."""
        written: int = _native.write_pause(fd, data, 0, True)
        return written

    @staticmethod
    def _write_hurrying(fd: int, data: memoryview) -> int:
        """``os.write`` that also yields (``_yield``), in one release of the GIL (the native writer's):
        the training thread lets the writer back in at its next span stop (``span.c``: ``let_writer_in``)."""
        written: int = _native.write_pause(fd, data, _YIELD_NS, True)
        return written

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

    def _convert_pure(self, queue: deque[Any], slice_end: int, limit: int = _CHUNK) -> tuple[int, bool]:
        """Convert and deliver up to ``limit`` items, in steps until the slice's time is up; (items taken, wrote)."""
        batch: list[tuple[int, dict[str, Any]]] = []
        taken = 0
        clock = time.perf_counter_ns
        while queue and taken < limit:
            taken += self._convert(queue, batch, min(_PURE_STEP, limit - taken))
            if clock() >= slice_end:
                break
        if batch:
            self._gather_for_delivery(batch)
        return taken, bool(batch)

    def _convert(self, queue: deque[Any], out: list[tuple[int, dict[str, Any]]], limit: int = _CHUNK) -> int:
        """Convert up to ``limit`` queued items into ``out``; returns how many were taken."""
        count = min(len(queue), limit)
        # One iterator for the chunk: after a bad item the loop resumes where it stopped.
        rounds = iter(range(count))
        while True:
            try:
                self._convert_items(queue, rounds, out)
                return count
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
                        if state != _OPEN:
                            self._whole_unstopped -= 1
                        if state == _OPEN or observers:
                            self._seq = seq
                            self._stopped(span, state, out)
                            seq = self._seq
                        continue
                    if span.t1 is not None:
                        self._whole_unstopped += 1
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

    # -- the native encoder (writer thread) --------------------------------
    def _native_writer(self) -> NativeWriter | None:
        """Use the native encoder when exactly one route is the plain file backend.

        It writes that file's lines itself; the other routes still get dicts, and a
        record any of them wants is made by the Python path (for all routes).
        """
        if _native is None:
            return None
        from ._stats import PYTHON_NAMES, RESERVED
        from .backends._file import FileBackend

        files = [r for r in self.routes if type(r.backend) is FileBackend]
        if len(files) != 1:
            return None
        others = [r for r in self.routes if r is not files[0]]
        dict_level = max((r.level for r in others), default=-1)
        if dict_level >= files[0].level:
            return None  # every record the file gets is wanted as a dict too
        cache = self._redactor.judged if self._redactor else None
        style = 1 if ENCODER == "orjson" else 0
        encoder = _native.Encoder(
            self._threads, self._open, cache, PYTHON_NAMES, RESERVED, files[0].level, dict_level, style
        )
        return NativeWriter(encoder, files[0], others, dict_level)

    def _convert_native(
        self, queue: deque[Any], native: NativeWriter, slice_end: int, limit: int = _CHUNK
    ) -> tuple[int, bool, bool]:
        """Convert a chunk with the native encoder, stopping at ``slice_end`` (perf_counter_ns);
        (items taken, True if anything was written, True if its write yielded: ``_write_hurrying``).

        Items it hands back (anything unusual) are converted by ``_convert_items`` and
        their records encoded in place, so the file's lines keep their order.
        """
        wall0 = self._anchor_wall - self._anchor_mono
        if not -(2**62) < wall0 < 2**62:  # a clock the encoder's 64-bit sums cannot hold
            return (*self._convert_pure(queue, slice_end, limit), False)
        encoder = native.encoder
        if native.others:
            level = self._dict_level(native.others)
            if level != native.dict_level:
                encoder.set_dict_level(level)
                native.dict_level = level
        observers = self.observers
        stats = None
        mode = 0
        if observers:
            mode = 2  # every span end goes through Python
            if len(observers) == 1:
                stats = getattr(observers[0], "native_stats", None)
                if stats is not None:
                    mode = 1  # only the statistics, which the encoder knows
                    # The encoder keeps the interval's histogram buckets: they are read through it.
                    stats.native_quantiles = encoder.interval_quantiles
        dicts: list[tuple[int, dict[str, Any]]] = []
        popleft = queue.popleft
        left = chunk = min(len(queue), limit)
        clock = time.perf_counter_ns
        while left > 0:
            budget = slice_end - clock()
            if budget <= 0 and left < chunk:
                break  # the slice is over: write what is converted, the rest after the yield
            if stats is not None:
                steps_left = max(stats.log_interval - stats._steps, 1)
                want_t0 = bool(stats.step_info)
                state = stats.native_state()
            else:
                steps_left, want_t0, state = _NO_INTERVAL, False, None
            try:
                taken, self._seq, item = encoder.convert(
                    popleft, left, wall0, self._seq, mode, steps_left, want_t0, state, max(budget, 1)
                )
            except Exception:  # out of memory in C: the Python path takes over for good
                log.exception("traintrace: the native encoder failed; the pure-Python writer takes over")
                self._write_pending(native)  # its lines so far, before any the Python path writes
                self.native = None
                break
            left -= taken
            # True: the encoder counted an interval's last iteration and stopped for its event.
            more = item is not None
            if item is True:
                item = None
            out: list[tuple[int, dict[str, Any]]] = []
            if stats is not None:
                counted = encoder.take_iterations()
                if counted is not None:
                    # The interval's event goes straight into the encoder's buffer (see emit_event).
                    self._direct = native
                    try:
                        stats.absorb(counted, out)
                    except Exception:
                        log.exception("traintrace: span observer failed")
                    finally:
                        self._direct = None
            if item is not None:
                queue.appendleft(item)
                self._convert(queue, out, 1)
            if out:
                self._encode_python(out, native, dicts)
            if not more:
                break  # the queue is empty, or the chunk's bytes are many: the rest in the next chunk
        slice_over = clock() >= slice_end
        if dicts or not queue or slice_over or encoder.buffered >= _WRITE_BYTES or self._deadline is not None:
            # The slice is over and more is queued: the write lets the training thread in.
            yielded = bool(queue) and self._deadline is None and slice_over and not dicts and _WRITE_PAUSE
            write = None
            if yielded:
                # More is queued: the training thread lets the writer back in at its next span stop.
                write = self._write_hurrying
            wrote = self._write_pending(native, write)
            yielded = yielded and wrote
        else:
            # Within the slice the lines wait in the encoder's buffer, written together at its end: a write
            # lets go of the GIL, and a training loop that holds it (Python running back to back) would keep
            # it for the switch interval (5 ms) before the writer could go on.
            wrote, yielded = encoder.buffered > 0, False
        if dicts:
            wrote = True
            self._gather_for_delivery(dicts, native.others)
        return chunk - left, wrote, yielded

    def _write_pending(self, native: NativeWriter, write: Any = None) -> bool:
        """Write the lines the native encoder holds (``write``: how, see ``_convert_native``); True if any."""
        data, count, first, last = native.encoder.take()
        if not count:
            return False
        try:
            native.route.backend.write_lines(data, count, first, last, write)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - as in _deliver
            self._backend_failed(native.route, exc, count)
        return True

    @staticmethod
    def _dict_level(others: list[Route]) -> int:
        """The level up to which the routes besides the file want records as dicts now.

        The log backend logs the records the encoder writes (spans, events) at INFO and
        skips them while its logger is not enabled for INFO (the default): then it does
        not need them, and the encoder writes them itself. Errors still go through Python.
        """
        from .backends._log import LogBackend

        return max(
            (
                route.level
                for route in others
                if type(route.backend) is not LogBackend or route.backend.logger.isEnabledFor(logging.INFO)
            ),
            default=-1,
        )

    def _encode_python(
        self, out: list[tuple[int, dict[str, Any]]], native: NativeWriter, dicts: list[tuple[int, dict[str, Any]]]
    ) -> None:
        """Records the Python path made mid-chunk: the file's into the encoder's buffer, in order."""
        from .backends._file import seq_range

        records = [record for level, record in out if level <= native.level]
        if records:
            first, last = seq_range(records)
            native.encoder.extend(dumps_lines(records), len(records), first, last)
        if native.others:
            dicts.extend(out)

    def _hold(self, span: Span, started: bool) -> bool:
        """True when an observer keeps an ended span's record back, to release it later."""
        held = 0
        for observer in self.observers:
            try:
                if observer.hold(span, started):
                    held += 1
            except Exception:
                log.exception("traintrace: span observer failed")
        if held:
            span.written = _HELD
            self._open.pop(span.id, None)
            if held > 1:
                # Written once, when the last observer that held it releases it.
                self._holders[span.id] = (held, {})
        return bool(held)

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

    def release_span(
        self,
        span: Span,
        started: bool,
        out: list[tuple[int, dict[str, Any]]],
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Write the record of a span an observer held back (writer thread only).

        ``extra``: top-level fields added to the record (``gpu_dur``); a span held by
        several observers is written when the last one releases it, with all their fields.
        """
        if self._holders:
            holding = self._holders.get(span.id)
            if holding is not None:
                left, fields = holding
                if extra:
                    fields.update(extra)
                if left > 1:
                    self._holders[span.id] = (left - 1, fields)
                    return
                del self._holders[span.id]
                extra = fields
        if started:
            self._end_record(span, span.t1 or time.perf_counter_ns(), span.status, out)
            if extra:
                out[-1][1].update(extra)
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
        if extra:
            record.update(extra)
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
        direct = self._direct
        if direct is not None and not out:
            # Nothing is waiting in ``out`` ahead of it: the native encoder writes the event's line now,
            # the same line as the Python path's; it hands back anything unusual, done below as usual.
            item = (EVENT, name, attrs, span_id, ident, mono, level)
            wall0 = self._anchor_wall - self._anchor_mono
            _, seq, back = direct.encoder.convert(iter((item,)).__next__, 1, wall0, self._seq, 0, _NO_INTERVAL, False)
            if back is None:
                self._seq = seq
                return
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

    def _gather_for_delivery(self, batch: list[tuple[int, dict[str, Any]]], routes: list[Route] | None = None) -> None:
        """Deliver ``batch`` with the records held before it, once they make a chunk (``_deliver_held``)."""
        if self._held and routes is not self._held_routes:
            self._deliver_held()
        self._held.extend(batch)
        self._held_routes = routes
        if len(self._held) >= _CHUNK:
            self._deliver_held()

    def _deliver_held(self) -> None:
        held, self._held = self._held, []
        if held:
            if self._held_routes is None:
                self._deliver(held)
            else:
                self._deliver(held, self._held_routes)

    def _deliver(self, batch: list[tuple[int, dict[str, Any]]], routes: list[Route] | None = None) -> None:
        top = max(level for level, _ in batch)
        everything: list[dict[str, Any]] | None = None
        for route in self.routes if routes is None else routes:
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

    def _backend_failed(self, route: Route, exc: Exception, count: int) -> None:
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
        for route in self.routes:
            try:
                route.backend.flush()
            except Exception as exc:  # noqa: BLE001
                self._backend_failed(route, exc, 0)

    def _finish(self, open_status: str) -> None:
        try:
            self._deliver_held()  # (a cycle that failed midway may have left records)
        except Exception:
            log.exception("traintrace: records held for delivery are lost")
        if self.native is not None:
            self._write_pending(self.native)  # (a cycle that failed midway may have left lines)
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
            else:
                # It stopped, but its stop did not reach the writer (queue full, or close ran out of time).
                self._end_record(span, span.t1, span.status, out)
        with self._drop_lock:
            never_stopped, self._starts_dropped = self._starts_dropped, 0
        if never_stopped > 0:
            # Spans still open at close whose start was dropped: lost whole.
            self.dropped += never_stopped
        self._drop_record(out)
        if out:
            self._deliver(out)
            out = []
        # Backends that send elsewhere finish now, all at once within what is left of the
        # close budget, so that their losses are known when the close record is written.
        self._settle_backends()
        self._report_losses()
        record = self._record(RecordKind.CLOSE, time.perf_counter_ns())
        record["records"] = self._seq
        record["dropped"] = self.dropped
        failed = {r.name: r.failed_records for r in self.routes if r.failed_records}
        if failed:
            record["backend_failures"] = failed
        losses = self.backend_losses()
        if losses:
            record["backend_losses"] = losses
        out.append((int(Verbosity.ERROR), record))
        self._deliver(out)
        for route in self.routes:
            try:
                route.backend.close()
            except Exception as exc:  # noqa: BLE001
                self._backend_failed(route, exc, 0)

    # -- close budget and losses (writer thread) --------------------------
    def _drain_deadline(self) -> float:
        """When the writer stops writing queued records at close, leaving the backends their share."""
        if self._deadline is None:
            return float("inf")
        left = self._deadline - time.monotonic()
        wanted = max((float(getattr(r.backend, "close_timeout", 0.0) or 0.0) for r in self.routes), default=0.0)
        # Queued records come first, but backends that send elsewhere keep up to half the budget.
        reserve = min(wanted, max(left, 0.0) / 2) + _CLOSE_RESERVE
        return self._deadline - reserve

    def _abandon_queue(self) -> None:
        """Close ran out of time: count the records the queued items would have made, and drop them."""
        lost = 0
        queue = self.queue
        while queue:
            try:
                item = queue.popleft()
            except IndexError:
                break
            if item.__class__ is tuple or not item.written:
                lost += 1  # an event, an error, or a span not written at all
            # A span whose start was written gets its end from _finish (it is still in _open).
        if lost:
            self._abandoned_at_close(lost)

    def _abandoned_at_close(self, lost: int) -> None:
        with self._drop_lock:
            self.dropped += lost
        self._close_abandoned += lost
        log.warning(
            "traintrace: close ran out of time (close_timeout); %d queued records not written "
            "(counted in a 'dropped' record, reason close_timeout)",
            lost,
        )

    def _drop_record(self, out: list[tuple[int, dict[str, Any]]]) -> None:
        """A ``dropped`` record for records lost since the last one (queue full, close timeout)."""
        if self.dropped == self._dropped_reported:
            return
        with self._drop_lock:
            count = self.dropped - self._dropped_reported
            self._dropped_reported = self.dropped
        abandoned, self._close_abandoned = self._close_abandoned, 0
        for reason, n in (("close_timeout", abandoned), ("queue_full", count - abandoned)):
            if n > 0:
                record = self._record(RecordKind.DROPPED, time.perf_counter_ns())
                record["count"] = n
                record["total"] = self._dropped_reported
                record["reason"] = reason
                out.append((_ERROR_LEVEL, record))

    def _settle_backends(self) -> None:
        """Let every backend with a sender of its own finish sending, in parallel, by the deadline."""
        settling = [r for r in self.routes if callable(getattr(r.backend, "settle", None))]
        if not settling:
            return
        deadline = None if self._deadline is None else self._deadline - _CLOSE_RESERVE
        for route in settling:
            try:
                route.backend.begin_close(deadline)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001
                self._backend_failed(route, exc, 0)
        for route in settling:
            try:
                route.backend.settle()  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001
                self._backend_failed(route, exc, 0)

    def backend_losses(self) -> dict[str, dict[str, int]]:
        """What each backend that sends elsewhere lost so far, by reason (see ``losses()``)."""
        out: dict[str, dict[str, int]] = {}
        for route in self.routes:
            losses = getattr(route.backend, "losses", None)
            if losses is None:
                continue
            try:
                counts = {str(k): int(v) for k, v in losses().items() if v}
            except Exception:  # noqa: BLE001 - a backend's report must not stop the writer
                continue
            if counts:
                out[route.name] = counts
        return out

    def _report_losses(self) -> bool:
        """``dropped`` records for the records backends lost since the last report; True if any."""
        out: list[tuple[int, dict[str, Any]]] = []
        for name, counts in self.backend_losses().items():
            seen = self._losses_reported.setdefault(name, {})
            for why, total in counts.items():
                if why not in _RECORD_LOSSES:
                    continue  # not records (a metrics export): in the close record and stats() only
                count = total - seen.get(why, 0)
                if count > 0:
                    seen[why] = total
                    record = self._record(RecordKind.DROPPED, time.perf_counter_ns())
                    record["count"] = count
                    record["total"] = total
                    record["reason"] = _RECORD_LOSSES[why]
                    record["backend"] = name
                    out.append((_ERROR_LEVEL, record))
        if out:
            self._deliver(out)
        return bool(out)

    def stats(self) -> dict[str, Any]:
        """Records made and lost so far, and each backend's own figures (any thread)."""
        backends: dict[str, Any] = {}
        for route in self.routes:
            own = getattr(route.backend, "stats", None)
            figures: dict[str, Any] = {}
            if callable(own):
                try:
                    figures = dict(own())
                except Exception:  # noqa: BLE001
                    figures = {}
            if route.failed_records:
                figures["write_failed"] = route.failed_records
            backends[route.name] = figures
        return {
            "records": self._seq,
            "dropped": self.dropped,
            "backends": backends,
            "backend_losses": self.backend_losses(),
        }


def _cpu_of(tid: int) -> int:
    """The core a thread of this process last ran on: field 39 of its ``/proc`` stat line."""
    return int(stat_fields(f"/proc/self/task/{tid}/stat")[39 - 3])
