"""configure(), the context helpers, and the module-level recorder functions."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import platform
import signal
import string
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from . import _faults, _recorder
from ._config import (
    BackendConfig,
    Config,
    ConfigError,
    FileBackendConfig,
    LogBackendConfig,
    build_config,
)
from ._dist import DistributedInitSpan, after_start
from ._identity import Identity, detect, safe_component
from ._names import DEFAULT_SPAN_VERBOSITY, EventName, RecordKind, SpanName, Verbosity
from ._pipeline import Pipeline
from ._recorder import InertSpan, Recorder, Span, as_attrs, as_level, get_active, set_active, warn_once
from ._version import __version__
from .backends._base import Backend

log = logging.getLogger("traintrace.lib")

SCHEMA = "traintrace"
SCHEMA_VERSION = 1

_configure_lock = threading.RLock()
_extra_backends_of_last: list[Backend] = []


# ---------------------------------------------------------------- identity


def _identity(config: Config) -> Identity:
    found = detect()
    overrides = {
        "job_id": config.job_id,
        "rank": config.rank,
        "world_size": config.world_size,
        "local_rank": config.local_rank,
        "local_world_size": config.local_world_size,
        "node_rank": config.node_rank,
        "restart_count": config.restart_count,
        "host": config.host,
    }
    chosen: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    identity = dataclasses.replace(found, **chosen)
    if identity.rank >= identity.world_size:
        raise ConfigError(f"rank: {identity.rank} is not below world_size {identity.world_size} (set both, or neither)")
    return identity


def _header(identity: Identity, config: Config, extra: Mapping[str, Any]) -> dict[str, Any]:
    mono = time.perf_counter_ns()
    wall = time.time_ns()
    from .backends._log import iso_time

    header: dict[str, Any] = {
        "seq": 0,
        "kind": RecordKind.HEADER,
        "ts": wall,
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "time": iso_time(wall),
        "mono": mono,
        "job": identity.job_id,
        "rank": identity.rank,
        "world_size": identity.world_size,
        "local_rank": identity.local_rank,
        "local_world_size": identity.local_world_size,
        "node_rank": identity.node_rank,
        "restart": identity.restart_count,
        "host": identity.host,
        "pid": identity.pid,
        "library_version": __version__,
        "python": platform.python_version(),
    }
    if config.job_name:
        header["job_name"] = config.job_name
    if identity.run_id:
        header["run"] = identity.run_id
    if identity.launcher:
        header["launcher"] = identity.launcher
    if config.metadata:
        from ._redact import Redactor
        from ._sanitize import convert_mapping

        redactor = Redactor(config.redact_keys)
        header["metadata"] = convert_mapping(config.metadata, redactor.secret if redactor else None)
    header.update(extra)
    return header


# ---------------------------------------------------------------- backends

_PLACEHOLDERS = ("job", "rank", "local_rank", "node", "world_size", "restart", "host", "pid", "date", "time")


def resolve_path(template: str, log_dir: str | os.PathLike[str], identity: Identity) -> Path:
    """The file a path template names for ``identity``; raises ConfigError if unsafe."""
    now = time.localtime()
    values = {
        "job": safe_component(identity.job_id),
        "rank": str(identity.rank),
        "local_rank": str(identity.local_rank),
        "node": str(identity.node_rank),
        "world_size": str(identity.world_size),
        "restart": str(identity.restart_count),
        "host": safe_component(identity.host),
        "pid": str(identity.pid),
        "date": time.strftime("%Y%m%d", now),
        "time": time.strftime("%H%M%S", now),
    }
    for _, field_name, _, _ in string.Formatter().parse(template):
        if field_name is not None and field_name not in values:
            raise ConfigError(
                f"backends.file.path: unknown placeholder {{{field_name}}} "
                f"(known: {', '.join('{' + p + '}' for p in _PLACEHOLDERS)})"
            )
    try:
        rendered = template.format(**values)
    except (ValueError, IndexError) as exc:
        raise ConfigError(f"backends.file.path: {exc}") from None
    path = Path(rendered)
    if path.is_absolute():
        return path
    root = Path(log_dir).resolve()
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        raise ConfigError(f"backends.file.path: {template!r} leaves the log folder {root}")
    return full


def _create_backend(name: str, cfg: BackendConfig, level: int, config: Config, identity: Identity) -> Backend:
    if isinstance(cfg, FileBackendConfig):
        from .backends._file import FileBackend

        path = resolve_path(cfg.path, config.log_dir, identity)
        return FileBackend(path, verbosity=level, file_mode=cfg.file_mode, fsync_on_close=cfg.fsync_on_close)
    if isinstance(cfg, LogBackendConfig):
        from .backends._log import LogBackend

        return LogBackend(cfg.logger, format=cfg.format, verbosity=level)
    create = getattr(cfg, "create", None)
    if create is None:
        raise ConfigError(f"backends.{name}: {type(cfg).__name__} has no create(config, identity, level)")
    backend: Backend = create(config, identity, level)
    return backend


# ---------------------------------------------------------------- configure


def configure(
    config: Config | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
    extra_backends: Sequence[Backend] = (),
    **settings: Any,
) -> Recorder:
    """Start recording. Returns the recorder that module-level calls now use.

    Settings come from, lowest precedence first: defaults, ``config_file`` (or
    ``TRAINTRACE_CONFIG``), ``config`` and keyword ``settings``, then
    ``TRAINTRACE_*`` environment variables. A second call closes the first
    recorder (flushing it) and replaces it. Raises :class:`ConfigError` for a
    bad setting, naming it; never raises afterwards.
    """
    with _configure_lock:
        merged = build_config(config, config_file=config_file, **settings)
        return _start(merged, list(extra_backends), {})


def _start(config: Config, extra_backends: list[Backend], header_extra: dict[str, Any]) -> Recorder:
    previous = get_active()
    if previous is not None:
        previous.close()
    if os.environ.get("TRAINTRACE_DISABLED", "").lower() in ("1", "true", "yes"):
        config.backends = {}
        extra_backends = []
    identity = _identity(config)
    header = _header(identity, config, header_extra)
    routes: list[tuple[Backend, str, int]] = []
    opened: list[Backend] = []
    try:
        for name, cfg in config.backends.items():
            level = cfg.effective_verbosity(identity.rank, identity.world_size)
            if level is None:
                continue
            backend = _create_backend(name, cfg, int(level), config, identity)
            _open(backend, name, header)
            opened.append(backend)
            routes.append((backend, name, int(level)))
        for index, backend in enumerate(extra_backends):
            name = f"{type(backend).__name__}#{index}"
            _open(backend, name, header)
            opened.append(backend)
            routes.append((backend, name, int(getattr(backend, "verbosity", Verbosity.PROFILING))))
    except BaseException:
        for backend in opened:
            try:
                backend.close()
            except Exception:  # noqa: BLE001
                pass
        raise
    listeners = [b for b, _, _ in routes if hasattr(b, "span_started") and hasattr(b, "span_stopped")]
    max_level = max((level for _, _, level in routes), default=-1)
    if config.statistics and routes:
        # Statistics need iteration and sub-phase spans even where no backend writes them.
        max_level = max(max_level, int(Verbosity.PROFILING))
    pipeline = Pipeline(config, header, routes)
    recorder = Recorder(pipeline, max_level, listeners)
    recorder.identity = identity  # type: ignore[attr-defined]
    from ._insight import attach

    attach(recorder, pipeline, config, identity)
    _extra_backends_of_last[:] = extra_backends
    set_active(recorder)
    _install_process_hooks(config)
    if config.fault_handler:
        from .backends._file import FileBackend

        for backend, _, _ in routes:
            if isinstance(backend, FileBackend):
                _faults.enable(backend.path, backend.file_mode)
                break
    if config.fork == "own_stream":
        import multiprocessing.util

        # multiprocessing children leave through os._exit, which skips atexit;
        # its after-fork hooks run once the child has cleared its finalizers.
        multiprocessing.util.register_after_fork(recorder, _close_at_multiprocessing_exit)
    after_start(recorder)
    for backend, name, _ in routes:
        path = getattr(backend, "path", None)
        if path is not None:
            log.info("traintrace: %s backend writes %s", name, path)
    return recorder


def _open(backend: Backend, name: str, header: dict[str, Any]) -> None:
    try:
        backend.open(header)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"backends.{name}: cannot start: {type(exc).__name__}: {exc}") from exc


def get_recorder() -> Recorder | None:
    """The recorder in use, or None before ``configure()``."""
    return get_active()


def is_configured() -> bool:
    return get_active() is not None


# ---------------------------------------------------------------- process hooks

_hooks_installed = False
_previous_sigterm: Any = None
_previous_excepthook: Callable[..., Any] | None = None
_previous_thread_excepthook: Callable[..., Any] | None = None


def _install_process_hooks(config: Config) -> None:
    global _hooks_installed, _previous_excepthook, _previous_thread_excepthook
    if not _hooks_installed:
        _hooks_installed = True
        atexit.register(_at_exit)
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        _previous_thread_excepthook = threading.excepthook
        threading.excepthook = _thread_excepthook
    if config.handle_sigterm:
        _install_sigterm()


def _install_sigterm() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        log.debug("traintrace: configure() not on the main thread; SIGTERM is not handled")
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    _previous_sigterm = current
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        log.debug("traintrace: cannot install a SIGTERM handler here")


_terminating = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # A handler runs between two bytecodes of the main thread, which may hold any lock
    # (the queue's, an Event's): nothing here takes one. The writer thread records the
    # signal and closes the stream; this only sets flags, rings a pipe and sleep-polls.
    global _terminating
    previous = _previous_sigterm
    rec = get_active()
    span = _recorder.current_span()
    where = (span.id if span is not None else 0, threading.get_ident())
    if callable(previous) or previous == signal.SIG_IGN:
        # The user's handler decides whether the process ends; spans unwind normally.
        if rec is not None:
            attrs: dict[str, Any] = {"signal": "SIGTERM"}
            if not callable(previous):
                attrs["ignored"] = True
            cycle = rec._pipeline.signal_event(attrs, *where)
            rec._pipeline.wait_from_signal(1.0, cycle)
        if callable(previous):
            previous(signum, frame)
        return
    if _terminating:
        return  # a second SIGTERM: the first one's flush goes on, then the process ends
    _terminating = True
    closing = rec or _recorder._closing
    if rec is not None:
        rec.closed = True
        if _recorder._active is rec:
            set_active(None)
        rec._pipeline.terminate_from_signal({"reason": "SIGTERM"}, *where)
    if closing is not None:
        # Also when close() was under way: its flush finishes before the process ends.
        closing._pipeline.wait_from_signal(closing.config.close_timeout)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    rec = get_active()
    if rec is not None and isinstance(exc, Exception):
        rec._exception(exc, EventName.EXCEPTION, {"unhandled": True}, 0)
        rec.flush(1.0)
    hook = _previous_excepthook or sys.__excepthook__
    hook(kind, exc, tb)


def _thread_excepthook(args: Any) -> None:
    rec = get_active()
    if rec is not None and isinstance(args.exc_value, Exception):
        thread = getattr(args.thread, "name", "?")
        rec._exception(args.exc_value, EventName.EXCEPTION, {"unhandled": True, "thread": thread}, 0)
    hook = _previous_thread_excepthook or threading.__excepthook__
    hook(args)


def _at_exit() -> None:
    rec = get_active()
    if rec is not None and rec.header.get("pid") == os.getpid():
        rec.close()
    _faults.release()


def _after_fork_in_child() -> None:
    _faults.after_fork_in_child()
    rec = get_active()
    if rec is None:
        return
    set_active(None)
    # Spans open in the parent are not the child's: its spans start at the top level.
    _recorder._current.set(None)
    # The parent's queue and writer are not ours: never drain or close them here.
    rec.closed = True
    rec._pipeline.queue.clear()
    rec._pipeline._drop_lock = threading.Lock()
    if rec.config.fork != "own_stream":
        return
    try:
        config = dataclasses.replace(rec.config, backends=dict(rec.config.backends))
        for name, cfg in config.backends.items():
            if isinstance(cfg, FileBackendConfig):
                template = Path(cfg.path)
                suffix = "".join(template.suffixes) or ".jsonl"
                stem = template.name[: -len(suffix)] if template.suffixes else template.name
                forked = template.with_name(f"{stem}.pid{{pid}}{suffix}")
                config.backends[name] = dataclasses.replace(cfg, path=str(forked))
        _start(config, [], {"parent_pid": rec.header.get("pid")})
    except Exception:
        log.warning("traintrace: the forked child could not start its own stream", exc_info=True)


def _close_at_multiprocessing_exit(_: object) -> None:
    util = sys.modules.get("multiprocessing.util")
    child = get_active()
    if util is not None and child is not None:
        util.Finalize(None, _close_forked, args=(child,), exitpriority=100)


def _close_forked(rec: Recorder) -> None:
    rec.close()
    if get_active() is None:
        _faults.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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



def _level_of(name: str) -> int:
    return int(DEFAULT_SPAN_VERBOSITY.get(name, Verbosity.INFO))


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
    chosen = _level_of(name) if level is None else as_level(level)
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
    level = _level_of(name)
    inert = InertSpan(name, None, level)

    def helper(metrics: Mapping[str, Any] | Callable[..., Any] | None = None, **attrs: Any) -> Any:
        if callable(metrics):
            return span_class(name, attrs or None, level)(metrics)
        rec = _recorder._active
        if rec is None or level > rec.max_level:
            return inert
        given: dict[str, Any] | None = _attrs_arg(metrics)
        if attrs:
            given = {**given, **attrs} if given else attrs
        return span_class(name, given, level)

    helper.__name__ = helper.__qualname__ = name
    helper.__doc__ = doc + "\n\nA context manager and a decorator; ``metrics`` are written with the span."
    return helper


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

_ITERATION_LEVEL = _level_of(SpanName.ITERATION)


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
