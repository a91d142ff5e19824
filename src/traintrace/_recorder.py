"""The recorder: spans, events and errors from the caller's thread into a queue.

The caller's thread only reads a clock, updates the per-context current span,
and appends a small tuple to a deque. Everything else (building records,
serialising, I/O) happens on the writer thread in ``_pipeline``.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import itertools
import os
import sys
import threading
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from time import perf_counter_ns
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ._names import EventName, SpanName, SpanStatus, Verbosity
from ._progress import COLLECTIVE_CODE as _COLLECTIVE
from ._progress import COUNTER_STEP as _COUNTER_STEP
from ._progress import ITERATION_CODE as _ITERATION
from ._progress import PHASE_CODES as _PHASES
from ._progress import PHASE_MASK as _PHASE_MASK
from ._progress import (
    S_COLLECTIVE,
    S_COLLECTIVE_T0,
    S_COUNTER,
    S_FIRST_STEP_T0,
    S_ITERATIONS,
    S_LAST_DONE,
    S_LAST_STEP_NS,
    S_PHASE_T0,
    S_STEP,
    S_STEP_T0,
    S_STEPS_DONE,
    S_UPDATED,
)
from ._progress import STATE_CLOSED as _STATE_CLOSED
from ._progress import STATE_TERMINATED as _STATE_TERMINATED
from ._progress import adopt as _progress_adopt
from ._progress import failed as _progress_failed
from ._progress import finish as _progress_finish
from ._sanitize import clip_text

if TYPE_CHECKING:
    from ._config import Config
    from ._identity import Identity
    from ._insight import Insight
    from ._pipeline import Route

F = TypeVar("F", bound=Callable[..., Any])

# Queue items: a Span object (its start the first time the writer sees it,
# its stop the second), or a tuple tagged EVENT or ERROR.
EVENT, ERROR = 2, 3
# Span.written when its start did not fit in the queue.
_START_DROPPED = 3

_INFO = int(Verbosity.INFO)
_ERROR = int(Verbosity.ERROR)
#: Spans whose end has the writer write at once (the native core finds them in PHASE_CODES).
_SAVES = frozenset(
    {SpanName.CHECKPOINT_SAVE_SYNC, SpanName.CHECKPOINT_SAVE_ASYNC, SpanName.CHECKPOINT_SAVE_FINALIZATION}
)


def _load_native() -> Any:
    """The native core (``traintrace._span``), or None: not built, or ``TRAINTRACE_PURE=1``."""
    if os.environ.get("TRAINTRACE_PURE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    try:
        module = importlib.import_module("traintrace._span")
    except ImportError:
        return None
    from . import _progress as progress

    expected = {name: getattr(progress, name) for name in module.SLOTS if name.startswith(("S_", "PHASE_"))}
    expected["START_DROPPED"] = _START_DROPPED
    if dict(module.SLOTS) != expected:  # a stale build: its slots are not this version's
        return None
    if not all(hasattr(module, name) for name in ("SpanCore", "RecorderCore", "Counter", "Factory", "install")):
        return None  # a stale build, from before a part was added
    return module


_native: Any = _load_native()
#: Which recording core runs spans on the caller's thread: ``"native"`` (C) or ``"pure"`` (Python).
CORE = "native" if _native is not None else "pure"
#: Span ids, shared by spans started (in C when native) and spans recorded whole (``record_span``).
_ids: Any = _native.Counter(1, 1) if _native is not None else itertools.count(1)
_counter: Any = _native.Counter if _native is not None else itertools.count
_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar("traintrace_current_span", default=None)
_get_ident = threading.get_ident

#: The recorder that module-level calls use; None when not configured.
_active: Recorder | None = None
#: The recorder configured last (kept after close, for ``stats()``).
_last: Recorder | None = None
#: The recorder whose close() started last (a SIGTERM during close waits for it).
_closing: Recorder | None = None


class TraintraceWarning(RuntimeWarning):
    """Misuse of the API: shown once per kind, never raised into the caller."""


_warned: set[str] = set()


def warn_once(kind: str, message: str) -> None:
    """Warn about misuse once per kind per process; never raise."""
    if kind in _warned:
        return
    _warned.add(kind)
    try:
        warnings.warn(f"traintrace: {message}", TraintraceWarning, stacklevel=4)
    except Exception:  # noqa: BLE001 - with -W error a warning raises; training must not
        pass


def current_span() -> Span | None:
    """The innermost open span of this thread or asyncio task, or None."""
    span = _current.get()
    while span is not None and span.t1 is not None:
        span = span.parent
    return span


def _label(name: object) -> str:
    """``repr(name)`` for a warning, even when the name's repr raises."""
    try:
        return repr(name)[:200]
    except Exception:  # noqa: BLE001
        return f"<{type(name).__name__}>"


#: perf_counter_ns() readings are never negative and stay far below this.
_MAX_NS = 2**62


def _label_str(name: object) -> str:
    """``str(name)``, even when the name's ``__str__`` raises."""
    try:
        return str(name)
    except Exception:  # noqa: BLE001
        return f"<{type(name).__name__}>"


def as_level(level: object) -> int:
    """A verbosity level from what a caller passed; INFO (and a warning) if unusable."""
    if type(level) is int:
        return level
    try:
        value: int = int(level)  # type: ignore[call-overload]
        return value
    except Exception:  # noqa: BLE001 - misuse warns, never raises
        warn_once("bad_level", f"level {_label(level)} is not a verbosity; using info")
        return _INFO


def as_attrs(metrics: object) -> dict[str, Any] | None:
    """A caller's metrics as a fresh dict (None if empty or not a mapping, with a warning).

    A snapshot of the values as they are now (one dict copy, in C), so a dict the
    caller reuses and changes later does not change what is written. Values that
    are objects (a nested dict or list, a tensor) are read on the writer thread.
    """
    if metrics.__class__ is dict:
        return metrics.copy() or None
    if metrics is None:
        return None
    try:
        return dict(metrics) if metrics else None  # type: ignore[call-overload]
    except Exception:  # noqa: BLE001 - misuse warns, never raises
        warn_once("bad_metrics", f"metrics of type {type(metrics).__name__} are not a mapping; ignored")
        return None


class _PySpanCore:
    """The pure-Python core of :class:`Span`: its fields, start and stop.

    ``_span.SpanCore`` (src/native/span.c) is the same in C and replaces it
    when the extension is built, unless ``TRAINTRACE_PURE=1``; this class is
    the reference for its semantics.
    """

    # _prev_t0, _prev_word: the progress file's phase start and update word as the span found them (see
    # progress_exit in span.c).
    __slots__ = (
        "_prev_t0",
        "_prev_word",
        "_rec",
        "attrs",
        "id",
        "level",
        "link",
        "metrics",
        "name",
        "parent",
        "status",
        "t0",
        "t1",
        "tid",
        "written",
    )
    # Set when a recorder starts the span (never read on an unrecorded span).
    parent: Span | None
    t0: int
    t1: int | None
    tid: int
    status: str
    written: int
    metrics: dict[str, Any] | None

    def __init__(
        self,
        name: str,
        attrs: Mapping[str, Any] | None = None,
        level: int = _INFO,
        link: Span | int | None = None,
    ) -> None:
        self.name = name
        self.attrs = attrs
        self.level = level
        self.link = link
        self._rec: Recorder | None = None

    # -- context manager -------------------------------------------------
    # The start and stop logic is written out here, not delegated, because a
    # Python call costs about as much as everything else a span does.
    def __enter__(self) -> Span:
        rec = _active
        if rec is None or self.level > rec.max_level:
            return self  # type: ignore[return-value] # always a Span
        if self._rec is not None:
            warn_once("span_reused", f"span {_label(self.name)} entered twice; make a new span for each use")
            return self  # type: ignore[return-value] # always a Span
        parent = _current.get()
        while parent is not None and parent.t1 is not None:
            parent = parent.parent
        self.parent = parent
        self.id = next(_ids)
        self.tid = _get_ident()
        self.metrics = None
        self.status = "ok"
        self.written = 0
        self.t1 = None
        self._rec = rec
        _current.set(self)  # type: ignore[arg-type] # the pure core's self is always a Span
        if rec._listeners:
            for listener in rec._listeners:
                listener.span_started(self)
        self.t0 = t0 = perf_counter_ns()
        prog = rec._progress
        if prog is not None and (self.tid == rec._progress_tid or _progress_adopt(rec, self)):
            # The progress file (_progress.py): a few int64 stores into the mapped page.
            try:
                # "in" and [] rather than .get(): no bound method made (3.11 does not specialise it).
                name = self.name
                if name in _PHASES:
                    code = _PHASES[name]
                    self._prev_word = prog[S_COUNTER]
                    self._prev_t0 = prog[S_PHASE_T0]
                    if code == _ITERATION:
                        attrs = self.attrs
                        step = attrs.get("step") if attrs.__class__ is dict else None
                        prog[S_STEP] = step if step.__class__ is int else -1
                        prog[S_STEP_T0] = t0
                        started = next(rec._progress_iterations)
                        prog[S_ITERATIONS] = started
                        if started == 1:
                            prog[S_FIRST_STEP_T0] = t0
                    elif code == _COLLECTIVE:
                        prog[S_COLLECTIVE] += 1
                        prog[S_COLLECTIVE_T0] = t0
                    prog[S_PHASE_T0] = t0
                    prog[S_COUNTER] = next(rec._progress_seq) | code  # counter and phase, one store
            except Exception:  # noqa: BLE001 - never raise into training
                _progress_failed(rec, self, t0)
        queue = rec._queue
        if len(queue) < rec._cap:
            queue.append(self)
        elif not rec._pipeline.overflow(self, 0):
            # Counted when its stop is dropped too (or at close, if it never stops).
            self.written = _START_DROPPED
        return self  # type: ignore[return-value] # always a Span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        t1 = perf_counter_ns()
        rec = self._rec
        if rec is None:
            return
        if self.t1 is not None or rec.closed:
            rec._late_stop(self, t1)
            return
        if exc is not None:
            rec._span_failed(self, exc, t1)
        self.t1 = t1
        # _current is left on this span: every reader skips closed spans up to the innermost
        # open one, and a set per stop (a new context mapping, a token) cost about 100 ns of a
        # native span's 500. The next start in this context moves it on.
        if rec._listeners:
            for listener in rec._listeners:
                listener.span_stopped(self)
        prog = rec._progress
        if prog is not None and self.tid == rec._progress_tid:
            try:
                name = self.name
                if name in _PHASES:
                    code = _PHASES[name]
                    if code == _ITERATION:
                        # An iteration that failed (an exception, a status set) did not complete its step.
                        if self.status == SpanStatus.OK:
                            prog[S_STEPS_DONE] = next(rec._progress_steps_done)
                            prog[S_LAST_STEP_NS] = t1 - self.t0
                            prog[S_LAST_DONE] = prog[S_ITERATIONS]
                    elif code == _COLLECTIVE and prog[S_COLLECTIVE] > 0:
                        prog[S_COLLECTIVE] -= 1
                    # Back in the enclosing standard phase (0: none), or where the file was when this span
                    # started, if that was set within the enclosing phase: a phase an integration times without
                    # a span (the Lightning callback's forward) outlives a span that starts and stops inside it.
                    parent = self.parent
                    while parent is not None and parent.name not in _PHASES:
                        parent = parent.parent
                    prog[S_UPDATED] = t1
                    try:
                        prev_t0 = self._prev_t0
                    except AttributeError:  # started before this thread kept the file
                        prev_t0 = -1
                    if (0 if parent is None else parent.t0) <= prev_t0 <= self.t0:
                        prog[S_PHASE_T0] = prev_t0
                        code = self._prev_word & _PHASE_MASK
                    else:
                        code = 0 if parent is None else _PHASES[parent.name]
                    prog[S_COUNTER] = next(rec._progress_seq) | code
            except Exception:  # noqa: BLE001 - never raise into training
                _progress_failed(rec)
        if self.written != _START_DROPPED:
            # No room check: the queue exceeds its bound by at most the open spans.
            rec._queue.append(self)
        else:
            rec._pipeline.start_resolved()
            if len(rec._queue) < rec._cap:
                self.written = 0  # the writer sees it once, ended: one complete record
                rec._queue.append(self)
            else:
                rec._pipeline.overflow(self)
        # A checkpoint save is written now, not at the end of the flush interval: a job killed
        # within that time would lose the record, and with it the steps the checkpoint holds.
        try:
            if self.name in _SAVES:
                rec.wake()
        except Exception:  # noqa: BLE001 - an optimisation; never raise into training
            pass


def _warn_reused(span: Span) -> None:
    """The native core's warning for a span entered twice."""
    warn_once("span_reused", f"span {_label(span.name)} entered twice; make a new span for each use")


if TYPE_CHECKING:
    _SpanBase = _PySpanCore
else:
    _SpanBase = _native.SpanCore if _native is not None else _PySpanCore


class Span(_SpanBase):
    """A timed phase. A context manager, a decorator, and a handle for ``stop``.

    Add metrics with :meth:`add_metrics` while it is open; they are written
    with the span's end.
    """

    __slots__ = ()

    # -- decorator -------------------------------------------------------
    def __call__(self, func: F) -> F:
        """Use as ``@span("name")``: a fresh span for every call of ``func``."""
        name, attrs, level, cls = self.name, self.attrs, self.level, type(self)
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with cls(name, attrs, level):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with cls(name, attrs, level):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    # -- while open ------------------------------------------------------
    def add_metrics(self, metrics: Mapping[str, Any] | None = None, **more: Any) -> Span:
        """Attach metrics to the span; they are written with its end."""
        if self._rec is None:
            return self
        if self.t1 is not None:
            warn_once("metrics_after_stop", f"metrics added to span {_label(self.name)} after it stopped")
            return self
        current = self.metrics
        if current is None:
            current = self.metrics = {}
        try:
            if metrics:
                current.update(metrics)
            if more:
                current.update(more)
        except Exception:  # noqa: BLE001 - misuse warns, never raises
            warn_once("bad_metrics", f"metrics for span {_label(self.name)} are not a mapping; ignored")
        return self

    def event(self, name: str, metrics: Mapping[str, Any] | None = None) -> None:
        """Record an event inside this span."""
        rec = self._rec
        if rec is not None:
            rec.record_event(name, metrics, _INFO, self.id)

    @property
    def open(self) -> bool:
        """True between start and stop of a recorded span."""
        return self._rec is not None and self.t1 is None

    @property
    def span_id(self) -> int:
        """The span's id in the stream, 0 when it was not recorded."""
        return self.id if self._rec is not None else 0

    @property
    def duration_ns(self) -> int | None:
        """Monotonic duration, once stopped."""
        if self._rec is None or self.t1 is None:
            return None
        return int(self.t1 - self.t0)

    def __repr__(self) -> str:
        if self._rec is None:
            return f"<Span {_label(self.name)} unrecorded>"
        return f"<Span {_label(self.name)} id={self.id} {'open' if self.t1 is None else 'closed'}>"


class InertSpan(Span):
    """What the helpers hand out when nothing would be recorded: shared and stateless.

    Entering it does nothing; as a decorator it still makes a real span per call,
    so functions decorated before ``configure()`` record once it is called.
    """

    __slots__ = ()

    def __enter__(self) -> Span:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    if _native is not None and not TYPE_CHECKING:
        # The same, in C: a `with` over a disabled span costs no Python frame.
        __enter__ = _native.SpanCore._noop_enter
        __exit__ = _native.SpanCore._noop_exit

    def __call__(self, func: F) -> F:
        return Span(self.name, self.attrs, self.level)(func)


class RecordSink(Protocol):
    """The queue side of a :class:`Recorder`: what it hands items to (``_pipeline.Pipeline``).

    The caller's thread appends to ``queue`` while it holds fewer than
    ``capacity`` items and calls ``overflow`` otherwise; everything else runs
    on the writer thread behind it.
    """

    queue: deque[Any]
    capacity: int
    config: Config
    header: dict[str, Any]
    dropped: int
    routes: list[Route]
    #: The progress file's int64 view, stamped by the writer every cycle (None: no file).
    alive_slot: Any

    def overflow(self, item: Any, lost: int = 1) -> bool:
        """The queue is full: wait or drop and count ``lost`` records (0 for a span's start). True if queued."""
        ...

    def start_resolved(self) -> None:
        """A span whose start was dropped stops (its loss, if any, is counted by ``overflow``)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Records made and lost so far, and each backend's own figures."""
        ...

    def wake(self) -> None:
        """Have the writer run a cycle now."""
        ...

    def flush(self, timeout: float) -> bool:
        """Write what is queued; True when done within ``timeout`` seconds."""
        ...

    def close(self, timeout: float, open_status: str = ...) -> None:
        """Write what is queued, end open spans with ``open_status``, close backends."""
        ...

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's queued items."""
        ...

    def signal_event(self, attrs: dict[str, Any], span_id: int, ident: int) -> int:
        """From a signal handler (no lock): have the writer record a ``signal`` event; the cycle to wait past."""
        ...

    def terminate_from_signal(self, attrs: dict[str, Any], span_id: int, ident: int) -> None:
        """From a signal handler (no lock): record the signal, write what is queued, close as ``terminated``."""
        ...

    def wait_from_signal(self, timeout: float, past_cycle: int | None = None) -> bool:
        """From a signal handler: sleep-poll until closed (or a cycle after ``past_cycle`` ended)."""
        ...


if TYPE_CHECKING:
    _RecorderBase = object
else:
    _RecorderBase = _native.RecorderCore if _native is not None else object


class Recorder(_RecorderBase):
    """The low-level API: ``start``/``stop``/``event``/``error``/``close``.

    Made by :func:`traintrace.configure`. Methods never raise after
    configuration; misuse warns once per kind.
    """

    #: Who this process is (set by ``configure()``; updated by ``refresh_identity()``).
    identity: Identity | None = None
    #: Statistics, sampler and watchdog, when statistics are on (``_insight.attach``).
    insight: Insight | None = None
    #: A rank/world-size disagreement with the process group was reported once.
    identity_conflict_reported: bool = False
    #: Device (GPU) time of phases (``_device_timing.DeviceTimer``), when on.
    device_timer: Any = None
    #: The user's own SIGTERM handler is running (``_setup._on_sigterm``): the process is being ended, and the time
    #: its cleanup takes (an emergency checkpoint save) is no hang of training.
    handling_signal: bool = False

    def __init__(self, pipeline: RecordSink, max_level: int, listeners: list[Any]) -> None:
        self._pipeline = pipeline
        self._queue: deque[Any] = pipeline.queue
        self._cap = pipeline.capacity
        self.max_level = max_level
        self._listeners = tuple(listeners)
        self.closed = False
        self._recorded_exceptions: deque[int] = deque(maxlen=64)
        self.config = pipeline.config
        self.header = pipeline.header
        # The progress file's int64 view and the thread that updates it (_progress.py).
        self._progress: memoryview | None = None
        self._progress_file: Any = None
        self._progress_tid = 0
        self._progress_seq: Iterator[int] = _counter(_COUNTER_STEP, _COUNTER_STEP)
        self._progress_iterations: Iterator[int] = _counter(1)
        self._progress_steps_done: Iterator[int] = _counter(1)
        self._progress_error = False

    # -- hot path --------------------------------------------------------
    def put(self, item: Any) -> None:
        """Queue an item (a Span or an EVENT/ERROR tuple), or hand it to overflow when full."""
        queue = self._queue
        if len(queue) < self._cap:
            queue.append(item)
        else:
            self._pipeline.overflow(item)

    def _late_stop(self, span: _PySpanCore, t1: int) -> None:
        if self.closed:
            warn_once("stop_after_close", f"span {_label(span.name)} stopped after close(); not recorded")
            if span.t1 is None:
                span.t1 = t1
            return
        warn_once("stop_twice", f"span {_label(span.name)} stopped twice; the second stop is ignored")

    def record_event(self, name: str, metrics: Mapping[str, Any] | None, level: int, span_id: int) -> None:
        """An event in span ``span_id`` (0: none) at ``level``, as given: no current-span lookup."""
        if level > self.max_level or self.closed:
            return
        attrs = as_attrs(metrics)
        self.put((EVENT, name, attrs, span_id, _get_ident(), perf_counter_ns(), level))

    def _span_failed(self, span: _PySpanCore, exc: BaseException, when: int) -> None:
        if isinstance(exc, Exception):
            span.status = SpanStatus.ERROR
            if span.parent is None:
                self._progress_error = True  # out of the outermost span: the program fails
            self.record_exception(exc, EventName.EXCEPTION, None, span.id, when)
        else:
            # SystemExit, KeyboardInterrupt, GeneratorExit: an ending, not a fault.
            span.status = SpanStatus.TERMINATED
            if isinstance(exc, SystemExit):
                self._record_exit(exc, span.id, when)
            elif isinstance(exc, KeyboardInterrupt):
                self.record_interrupt(exc, span.id, when)

    def record_interrupt(self, exc: KeyboardInterrupt, span_id: int, when: int = 0) -> None:
        """A ``signal`` event for ``KeyboardInterrupt`` leaving a span (once per exception): Python's SIGINT (Ctrl-C
        in the job's terminal, which signals the launcher and every rank), else the process's end reads as an
        unexplained failure of every rank."""
        if self.closed or _already_recorded(exc, self._recorded_exceptions):
            return
        attrs = {"signal": "SIGINT", "exception": "KeyboardInterrupt"}
        self.put((EVENT, EventName.SIGNAL, attrs, span_id, _get_ident(), when or perf_counter_ns(), _ERROR))
        self._pipeline.wake()

    def _record_exit(self, exc: SystemExit, span_id: int, when: int) -> None:
        """A ``system_exit`` event for ``sys.exit()`` leaving a span (once per exit): the exit status it gives, which
        a stream otherwise lacks where no launcher of traintrace's sees the process end (plain torchrun)."""
        if self.closed or _already_recorded(exc, self._recorded_exceptions):
            return
        code = exc.code
        attrs: dict[str, Any] = {"exit_code": int(code) if isinstance(code, int) else 0 if code is None else 1}
        if code is not None and not isinstance(code, int):
            attrs["message"] = clip_text(str(code))  # printed to stderr by the interpreter, status 1
        self.put((EVENT, EventName.SYSTEM_EXIT, attrs, span_id, _get_ident(), when, _ERROR))

    def record_exception(
        self, exc: BaseException, name: str, metrics: Mapping[str, Any] | None, span_id: int, when: int = 0
    ) -> bool:
        """Record ``exc`` unless it already was; True if it was recorded now.

        Its time is ``when`` (a span's end, for an exception leaving it), else now:
        read before the traceback is formatted, which takes a while.
        """
        when = when or perf_counter_ns()
        if _already_recorded(exc, self._recorded_exceptions):
            return False
        if self.closed:
            return False
        info = describe_exception(exc)
        attrs = as_attrs(metrics)
        if attrs and attrs.get("unhandled") is True and "thread" not in attrs:
            self._progress_error = True  # sys.excepthook: the program ends with it
        self.put((ERROR, name, attrs, span_id, _get_ident(), when, info))
        self._pipeline.wake()
        return True

    # -- public low-level API -------------------------------------------
    def start(
        self,
        name: str,
        metrics: Mapping[str, Any] | None = None,
        *,
        level: int | Verbosity = Verbosity.INFO,
        link: Span | int | None = None,
    ) -> Span:
        """Open a span and return its handle; stop it later with :meth:`stop`."""
        span = Span(name, as_attrs(metrics), as_level(level), link)
        if self is _active:
            span.__enter__()
        return span

    def record_span(
        self,
        name: str,
        t0: int,
        t1: int,
        *,
        parent: Span | None = None,
        metrics: Mapping[str, Any] | None = None,
        level: int | Verbosity = Verbosity.INFO,
        status: str = SpanStatus.OK,
    ) -> Span | None:
        """Record a span that already ended, timed by two ``time.perf_counter_ns()`` readings.

        For phases timed between two framework hooks: it does not change the
        current span, and costs less than a start and a stop. Returns the span,
        or None when nothing would record it.
        """
        chosen = as_level(level)
        if chosen > self.max_level or self.closed:
            return None
        try:
            begin, end = int(t0), int(t1)
            if not (0 <= begin < _MAX_NS and 0 <= end < _MAX_NS):
                raise ValueError("out of range")
        except Exception:  # noqa: BLE001 - misuse warns, never raises
            warn_once("bad_times", f"record_span {_label(name)}: t0/t1 are not perf_counter_ns() readings; ignored")
            return None
        if end < begin:
            warn_once("negative_duration", f"record_span {_label(name)}: t1 is before t0; recorded with duration 0")
            end = begin
        if status.__class__ is not str:
            warn_once("bad_status", f"record_span {_label(name)}: status is not a string; recorded as 'ok'")
            status = SpanStatus.OK
        span = Span(name if name.__class__ is str else _label_str(name), as_attrs(metrics), chosen)
        span.parent = parent if isinstance(parent, Span) else None
        span.id = next(_ids)
        span.tid = _get_ident()
        span.metrics = None
        span.status = status
        span.written = 0
        span._rec = self
        span.t0 = begin
        span.t1 = end
        # Seen twice by the writer, like any span: once to write it, once as its end.
        queue = self._queue
        if len(queue) < self._cap:
            queue.append(span)
            queue.append(span)
        elif self._pipeline.overflow(span):
            queue.append(span)
        return span

    if _native is not None and not TYPE_CHECKING:
        # The native core does the common case (src/native/span.c: recorder_record_span) and
        # hands anything it would have to warn about to this method.
        _record_span_checked = record_span
        record_span = _native.RecorderCore.record_span

    def stop(
        self,
        span: Span,
        metrics: Mapping[str, Any] | None = None,
        *,
        status: str | None = None,
    ) -> None:
        """Close a span opened by :meth:`start` (from any thread or callback)."""
        if not isinstance(span, Span):
            warn_once("stop_unknown", f"stop() got {type(span).__name__}, not a Span; ignored")
            return
        if span._rec is None:
            return
        if metrics is not None:
            span.add_metrics(metrics)
        if status is not None and span.t1 is None:
            try:
                span.status = str(status)
            except Exception:  # noqa: BLE001 - misuse warns, never raises
                warn_once("bad_status", f"status for span {_label(span.name)} is not a string; ignored")
        span.__exit__(None, None, None)

    def event(
        self,
        name: str,
        metrics: Mapping[str, Any] | None = None,
        *,
        level: int | Verbosity = Verbosity.INFO,
    ) -> None:
        """Record a point event, inside the current span if one is open."""
        span = current_span()
        try:
            self.record_event(name, metrics, as_level(level), span.id if span is not None else 0)
        except Exception:  # noqa: BLE001 - event() must never fail the caller
            warn_once("bad_event", f"event {_label(name)} has metrics that are not a mapping; ignored")

    def error(
        self,
        error: BaseException | str | None = None,
        metrics: Mapping[str, Any] | None = None,
        *,
        name: str = EventName.ERROR,
    ) -> None:
        """Record an exception (once, however often it is passed) or an error message."""
        span = current_span()
        span_id = span.id if span is not None else 0
        try:
            if isinstance(error, BaseException):
                self.record_exception(error, name, metrics, span_id)
                return
            if self.closed:
                return
            when = perf_counter_ns()
            message = "" if error is None else str(error)
            stack = "".join(traceback.format_stack(sys._getframe(1)))
            info = (None, clip_text(message, 65536), clip_text(stack, 65536))
            attrs = as_attrs(metrics)
            self.put((ERROR, name, attrs, span_id, _get_ident(), when, info))
            self._pipeline.wake()
        except Exception:  # noqa: BLE001 - error() must never fail the caller
            warn_once("bad_error", "error() could not record its argument")

    def flush(self, timeout: float | None = None) -> bool:
        """Write everything recorded so far; True when done within ``timeout``."""
        if self.closed:
            return True
        return self._pipeline.flush(self.config.close_timeout if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, end spans still open (status ``abandoned``) and close backends."""
        global _active, _closing
        if self.closed:
            return
        _closing = self
        if _active is self:
            _active = None
        self.closed = True
        self._pipeline.close(self.config.close_timeout if timeout is None else timeout)
        _progress_finish(self, _STATE_CLOSED)

    def signalled(self, attrs: dict[str, Any], *, terminate: bool) -> None:
        """Called from a signal handler: takes no lock the interrupted code may hold.

        Without ``terminate``: a ``signal`` event, written before this returns (at
        most a second). With it: the signal event, everything queued, open spans
        ended ``terminated`` and the stream closed, by the writer, waited for
        (``close_timeout``); also when a ``close()`` was already under way.
        """
        global _active
        span = current_span()
        where = (span.id if span is not None else 0, _get_ident())
        pipeline = self._pipeline
        if not terminate:
            if not self.closed:
                pipeline.wait_from_signal(1.0, pipeline.signal_event(attrs, *where))
            return
        if not self.closed:
            self.closed = True
            if _active is self:
                _active = None
            pipeline.terminate_from_signal(attrs, *where)
        pipeline.wait_from_signal(float(self.config.close_timeout) + 1.0)
        # The progress file says how the process ended (stores into a mapped page: no lock).
        _progress_finish(self, _STATE_TERMINATED)

    def terminate(self, reason: str) -> None:
        """Flush and end open spans as ``terminated``: the process is about to die."""
        global _active
        if self.closed:
            return
        self.event(EventName.SIGNAL, {"reason": reason}, level=Verbosity.ERROR)
        if _active is self:
            _active = None
        self.closed = True
        self._pipeline.close(self.config.close_timeout, open_status=SpanStatus.TERMINATED)
        _progress_finish(self, _STATE_TERMINATED)

    def wake(self) -> None:
        """Have the writer run a cycle now (after an error, a hang report)."""
        self._pipeline.wake()

    @property
    def listeners(self) -> tuple[Any, ...]:
        """The backends told of every span start and stop on the caller's thread (NVTX)."""
        return self._listeners

    def routes(self) -> list[Route]:
        """The backends this recorder writes to, with their names and levels."""
        return list(self._pipeline.routes)

    def backend(self, name: str) -> Any:
        """The backend configured under ``name`` (``"file"``, ``"otlp_traces"``), or None."""
        return next((route.backend for route in self._pipeline.routes if route.name == name), None)

    def forget_after_fork(self) -> None:
        """In a forked child: this recorder is the parent's; never drain or close its queue here."""
        self.closed = True
        self._pipeline.forget_after_fork()

    @property
    def dropped(self) -> int:
        """Records dropped so far because the queue was full."""
        return self._pipeline.dropped

    def stats(self) -> dict[str, Any]:
        """What was recorded and lost so far (see :func:`traintrace.stats`), and the core that ran."""
        result = self._pipeline.stats()
        result["core"] = CORE
        return result

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _already_recorded(exc: BaseException, recent: deque[int]) -> bool:
    try:
        if getattr(exc, "__traintrace_recorded__", False):
            return True
        exc.__traintrace_recorded__ = True  # type: ignore[attr-defined]
        return False
    except Exception:  # noqa: BLE001 - some exception types refuse attributes
        key = id(exc)
        if key in recent:
            return True
        recent.append(key)
        return False


def describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """(type, message, stack) with the frames above the catching point included."""
    kind = type(exc)
    qualname = kind.__qualname__
    module = kind.__module__
    type_name = qualname if module in ("builtins", "__main__") else f"{module}.{qualname}"
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001
        message = f"<unprintable {qualname}>"
    try:
        stack = format_full_traceback(exc)
    except Exception:  # noqa: BLE001
        stack = "".join(traceback.format_exception_only(kind, exc))
    return type_name, clip_text(message, 65536), clip_text(stack, 65536)


def format_full_traceback(exc: BaseException) -> str:
    """The traceback from the program's entry, not only from where it was caught.

    While an exception unwinds, its traceback holds only the frames it has left
    so far; the frames above are still live and are added here.
    """
    parts: list[str] = []
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None:
        parts.extend(traceback.format_exception(cause))
        parts.append(
            "\nThe above exception was the direct cause of the following exception:\n\n"
            if exc.__cause__ is not None
            else "\nDuring handling of the above exception, another exception occurred:\n\n"
        )
    tb = exc.__traceback__
    outer: list[traceback.FrameSummary] = []
    if tb is not None and tb.tb_frame.f_back is not None:
        outer = list(traceback.extract_stack(tb.tb_frame.f_back))
    inner = list(traceback.extract_tb(tb)) if tb is not None else []
    if outer or inner:
        parts.append("Traceback (most recent call last):\n")
        parts.extend(traceback.format_list(outer + inner))
    parts.extend(traceback.format_exception_only(type(exc), exc))
    return "".join(parts)


def set_active(recorder: Recorder | None) -> Recorder | None:
    """Install ``recorder`` for module-level calls; return the previous one."""
    global _active, _last
    previous, _active = _active, recorder
    if recorder is not None:
        _last = recorder
    return previous


def stats() -> dict[str, Any]:
    """What the current (or, after ``close()``, the last) recorder recorded and lost.

    ``records``: records made in the stream; ``dropped``: records lost before
    any backend (queue full, close out of time); ``backend_losses``: what each
    backend that sends elsewhere lost, by reason (``queue_full``, ``failed``,
    ``abandoned``; ``failed_exports`` for metrics); ``backends``: each backend's
    own figures (OTLP: ``exported``, ``dropped``, ``failed``, ``abandoned``,
    ``queued``); ``core``: the recording core that ran the spans (``"native"``,
    the C extension, or ``"pure"``, see ``TRAINTRACE_PURE``). Empty before ``configure()``. The same losses are in the
    stream's ``dropped`` records and its ``close`` record.
    """
    rec = _active or _last
    if rec is None:
        return {}
    try:
        return rec.stats()
    except Exception:  # noqa: BLE001 - a report must never fail the caller
        return {}


def get_active() -> Recorder | None:
    """The configured recorder, or None."""
    return _active


if _native is not None:
    _native.install(
        namespace=globals(),
        current=_current,
        phases=_PHASES,
        iteration_code=_ITERATION,
        collective_code=_COLLECTIVE,
        iteration_name=SpanName.ITERATION,
        info=_INFO,
        ids=_ids,
        adopt=_progress_adopt,
        failed=_progress_failed,
        reused=_warn_reused,
        span=Span,
    )
