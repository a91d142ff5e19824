"""The module-level recording API: start/stop, events, errors and the span helpers.

Setting up (``configure()`` and the process hooks) is in ``_setup``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import _faults, _recorder
from ._config import ConfigError
from ._dist import DistributedInitSpan
from ._names import EventName, SpanName, Verbosity, level_of
from ._recorder import InertSpan, Span, as_attrs, as_level, get_active, warn_once
from ._setup import configure, get_recorder, is_configured

__all__ = [
    "application",
    "close",
    "configure",
    "error",
    "event",
    "flush",
    "get_recorder",
    "is_configured",
    "span",
    "start",
    "stop",
    "training_iteration",
]


# ---------------------------------------------------------------- module-level API


def start(
    name: str,
    metrics: Mapping[str, Any] | None = None,
    *,
    level: int | Verbosity = Verbosity.INFO,
    link: Span | int | None = None,
) -> Span:
    """Open a span (low-level API); close it with :func:`stop`. No-op before configure."""
    rec = get_active()
    if rec is None:
        return Span(name, None, as_level(level))
    return rec.start(name, metrics, level=level, link=link)


def stop(span: Span, metrics: Mapping[str, Any] | None = None, *, status: str | None = None) -> None:
    """Close a span opened by :func:`start`, from any thread or callback."""
    if not isinstance(span, Span):
        warn_once("stop_unknown", f"stop() got {type(span).__name__}, not a Span; ignored")
        return
    rec = span._rec
    if rec is not None:
        rec.stop(span, metrics, status=status)


def event(name: str, metrics: Mapping[str, Any] | None = None, *, level: int | Verbosity = Verbosity.INFO) -> None:
    """Record a point event, inside the current span if one is open."""
    rec = get_active()
    if rec is not None:
        rec.event(name, metrics, level=level)


def error(
    error: BaseException | str | None = None,
    metrics: Mapping[str, Any] | None = None,
    *,
    name: str = EventName.ERROR,
) -> None:
    """Record an exception (once, however often it is passed) or an error message."""
    rec = get_active()
    if rec is not None:
        rec.error(error, metrics, name=name)


def flush(timeout: float | None = None) -> bool:
    """Write everything recorded so far; True when done within ``timeout`` seconds."""
    rec = get_active()
    return True if rec is None else rec.flush(timeout)


def close(timeout: float | None = None) -> None:
    """Flush and stop recording; later calls are no-ops until ``configure()``."""
    rec = get_active()
    if rec is not None:
        rec.close(timeout)
    _faults.release()


# ---------------------------------------------------------------- context helpers


def _attrs_arg(metrics: Any) -> Any:
    """A snapshot of the caller's metrics (``as_attrs``): later changes to the dict are not written."""
    if metrics.__class__ is dict:
        return metrics.copy() or None  # the common case, inlined
    return None if metrics is None else as_attrs(metrics)


def span(
    name: str,
    metrics: Mapping[str, Any] | None = None,
    *,
    level: int | Verbosity | None = None,
    link: Span | int | None = None,
) -> Span:
    """A span named ``name``: ``with span("x") as s:`` or ``@span("x")``.

    A span records when traintrace is configured at the time it is made; made
    earlier it stays inert (decorators are the exception: they make a fresh
    span per call).
    """
    chosen = level_of(name) if level is None else as_level(level)
    rec = _recorder._active
    if rec is None or chosen > rec.max_level:
        return InertSpan(name, metrics, chosen)
    return Span(name, _attrs_arg(metrics), chosen, link)


class _ApplicationSpan(Span):
    """The outermost span. Configures defaults on entry when nothing is configured."""

    __slots__ = ()

    def __enter__(self) -> Span:
        if get_active() is None:
            try:
                configure()
            except ConfigError as exc:
                warn_once("auto_configure", f"could not configure from defaults: {exc}")
        return super().__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        rec = self._rec
        super().__exit__(exc_type, exc, tb)
        if rec is not None and not rec.closed:
            rec.flush()


def application(metrics: Mapping[str, Any] | None = None) -> Span:
    """The whole program. Records an unhandled exception once and re-raises it.

    When ``configure()`` was not called, entering it configures from the
    defaults, the config file and ``TRAINTRACE_*`` variables.
    """
    return _ApplicationSpan(SpanName.APPLICATION, metrics, int(Verbosity.INFO))


def _helper(name: str, doc: str, span_class: type[Span] = Span) -> Callable[..., Span]:
    level = level_of(name)
    inert = InertSpan(name, None, level)

    def helper(metrics: Mapping[str, Any] | Callable[..., Any] | None = None, **attrs: Any) -> Any:
        if metrics is None:  # the common case first: no call made for it
            if not attrs:
                rec = _recorder._active
                if rec is None or level > rec.max_level:
                    return inert
                return span_class(name, None, level)
        elif callable(metrics):
            return span_class(name, attrs or None, level)(metrics)
        rec = _recorder._active
        if rec is None or level > rec.max_level:
            return inert
        given: dict[str, Any] | None = None if metrics is None else _attrs_arg(metrics)
        if attrs:
            given = {**given, **attrs} if given else attrs
        return span_class(name, given, level)

    helper.__name__ = helper.__qualname__ = name
    helper.__doc__ = doc + "\n\nA context manager and a decorator; ``metrics`` are written with the span."
    return _fast(helper, span_class, name, level, inert, iteration=False)


def _fast(
    helper: Callable[..., Any], cls: type[Span], name: str, level: int, inert: Span, *, iteration: bool
) -> Callable[..., Any]:
    """The native core's version of ``helper`` (the same results, made in C when called with
    no argument, or an iteration's int step), or ``helper`` itself on the pure core."""
    native = _recorder._native
    if native is None:
        return helper
    made: Callable[..., Any] = native.Factory(helper, cls, name, level, inert, iteration)
    return made


distributed_init = _helper(
    SpanName.DISTRIBUTED_INIT,
    "Initialising the process group. When it ends, the rank and world size are checked "
    "against the process group (see ``refresh_identity``).",
    DistributedInitSpan,
)
model_init = _helper(SpanName.MODEL_INIT, "Building the model.")
optimizer_init = _helper(SpanName.OPTIMIZER_INIT, "Building the optimizer.")
data_loader_init = _helper(SpanName.DATA_LOADER_INIT, "Building the data loaders.")
training_loop = _helper(SpanName.TRAINING_LOOP, "The training loop.")
data_loading = _helper(SpanName.DATA_LOADING, "Waiting for the next batch.")
forward = _helper(SpanName.FORWARD, "The forward pass.")
backward = _helper(SpanName.BACKWARD, "The backward pass.")
zero_grad = _helper(SpanName.ZERO_GRAD, "Zeroing gradients.")
optimizer_step = _helper(SpanName.OPTIMIZER_STEP, "The optimizer step.")
validation = _helper(SpanName.VALIDATION, "A validation pass.")
test = _helper(SpanName.TEST, "A test pass.")
checkpoint_save = _helper(SpanName.CHECKPOINT_SAVE_SYNC, "A checkpoint save that blocks training.")
checkpoint_save_async = _helper(SpanName.CHECKPOINT_SAVE_ASYNC, "The blocking part of an asynchronous checkpoint save.")
checkpoint_load = _helper(SpanName.CHECKPOINT_LOAD, "Loading a checkpoint.")
collective = _helper(
    SpanName.COLLECTIVE,
    "Communication with the other ranks (all-reduce, barrier, broadcast): time waiting for peers. "
    "``traintrace ranks`` subtracts it to find the rank slow in its own work.",
)

_ITERATION_LEVEL = level_of(SpanName.ITERATION)


_INERT_ITERATION = InertSpan(SpanName.ITERATION, None, _ITERATION_LEVEL)


def training_iteration(step: int | Callable[..., Any] | None = None, metrics: Mapping[str, Any] | None = None) -> Any:
    """One training step: ``with training_iteration(step) as it: it.add_metrics(loss=...)``."""
    rec = _recorder._active
    if rec is None or rec.max_level < _ITERATION_LEVEL:
        if callable(step):
            return Span(SpanName.ITERATION, None, _ITERATION_LEVEL)(step)
        return _INERT_ITERATION
    if metrics is None and step.__class__ is int:
        return Span(SpanName.ITERATION, {"step": step}, _ITERATION_LEVEL)
    if step is None:
        return Span(SpanName.ITERATION, _attrs_arg(metrics), _ITERATION_LEVEL)
    if callable(step):
        return Span(SpanName.ITERATION, None, _ITERATION_LEVEL)(step)
    metrics = _attrs_arg(metrics)
    if metrics:
        return Span(SpanName.ITERATION, {"step": step, **metrics}, _ITERATION_LEVEL)
    return Span(SpanName.ITERATION, {"step": step}, _ITERATION_LEVEL)


if not TYPE_CHECKING:
    training_iteration = _fast(
        training_iteration, Span, SpanName.ITERATION, _ITERATION_LEVEL, _INERT_ITERATION, iteration=True
    )


def checkpoint_save_finalization(async_save: Span | None = None, metrics: Mapping[str, Any] | None = None) -> Span:
    """The background part of an asynchronous save, linked to its blocking part."""
    return Span(SpanName.CHECKPOINT_SAVE_FINALIZATION, _attrs_arg(metrics), int(Verbosity.INFO), async_save)


def timed_span(name: str, metrics: Mapping[str, Any] | None = None) -> Span:
    """The reference library's name for :func:`span`."""
    return span(name, metrics)


# The reference library's names, so that migrated code runs unchanged.
application_running = application
running = application
training = training_loop
