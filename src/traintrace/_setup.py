"""Setting up recording: configure(), identity, the stream header, backends, process hooks.

``configure()`` builds a :class:`Recorder` from a validated config; the process
hooks (SIGTERM, unhandled exceptions, exit, fork) keep what was recorded when
the process ends. The module-level recording API is in ``_api``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from . import _device_timing, _faults, _progress, _recorder
from ._config import Config, ConfigError, FileBackendConfig, build_config, disabled, resolve_path
from ._dist import after_start
from ._format import SCHEMA, SCHEMA_VERSION
from ._identity import Identity, detect
from ._names import EventName, RecordKind, Verbosity
from ._pipeline import Pipeline
from ._recorder import Recorder, get_active, set_active
from ._version import __version__
from .backends._base import Backend

__all__ = ["configure", "get_recorder", "is_configured", "resolve_path", "start_stream"]

log = logging.getLogger("traintrace.lib")

_configure_lock = threading.RLock()


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
        **identity.to_dict(),
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


def start_stream(
    config: Config, extra_backends: Sequence[Backend] = (), header_extra: Mapping[str, Any] | None = None
) -> Recorder:
    """Start recording with an already built ``config``; ``header_extra`` goes into the header.

    What ``configure()`` does after merging the settings; the launcher's agent
    stream (``role: "agent"``) is started this way.
    """
    with _configure_lock:
        return _start(config, list(extra_backends), dict(header_extra or {}))


def _start(config: Config, extra_backends: list[Backend], header_extra: dict[str, Any]) -> Recorder:
    previous = get_active()
    if previous is not None:
        previous.close()
    if disabled():
        config.backends = {}
        extra_backends = []
    if config.backends or extra_backends:
        _device_timing.check(config)  # device_timing = true without CUDA: a ConfigError now
    identity = _identity(config)
    header = _header(identity, config, header_extra)
    routes: list[tuple[Backend, str, int]] = []
    opened: list[Backend] = []
    try:
        for name, cfg in config.backends.items():
            level = cfg.effective_verbosity(identity.rank, identity.world_size)
            if level is None:
                continue
            backend = cfg.create(config, identity, int(level))
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
    device_timer = _device_timing.attach(listeners, pipeline, config)
    recorder = Recorder(pipeline, max_level, listeners)
    recorder.device_timer = device_timer
    recorder.identity = identity
    _progress.attach(recorder, config, identity)
    from ._insight import attach

    insight = attach(recorder, pipeline, config, identity)
    if device_timer is not None and insight is not None:
        device_timer.statistics = insight.stats
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
    # SIGHUP (its terminal closed: an ssh session dropped, a tmux-less shell exited) ends a process that neither
    # handles nor ignores it (``nohup``) as SIGTERM does, and torchrun passes it on to its workers: handled the same
    # way there, and left alone where anything else decided what it does.
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) == signal.SIG_DFL:
        try:
            signal.signal(hangup, _on_hangup)
        except (ValueError, OSError):
            log.debug("traintrace: cannot install a SIGHUP handler here")


_terminating = False
#: A framework's SIGTERM handler runs inside ``noting_sigterm``'s wrapper, which recorded the signal already.
_noted = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # A handler runs between two bytecodes of the main thread, which may hold any lock
    # (the queue's, an Event's): nothing here takes one. The writer thread records the
    # signal and closes the stream; this only sets flags, rings a pipe and sleep-polls.
    previous = _previous_sigterm
    rec = get_active()
    if callable(previous) or previous == signal.SIG_IGN:
        # The user's handler decides whether the process ends; spans unwind normally.
        if rec is not None and not _noted:
            attrs: dict[str, Any] = {"signal": "SIGTERM"}
            if not callable(previous):
                attrs["ignored"] = True
            rec.signalled(attrs, terminate=False)
        if callable(previous):
            _handling(rec, previous, signum, frame)
        return
    _end_by_signal(signum, "SIGTERM")


def _on_hangup(signum: int, frame: FrameType | None) -> None:
    _end_by_signal(signum, "SIGHUP")


def _end_by_signal(signum: int, name: str) -> None:
    """Record the signal, write what is queued, end open spans ``terminated``, close; then the signal's default
    action ends the process, as it would have without traintrace."""
    global _terminating
    if _terminating:
        return  # a second signal: the first one's flush goes on, then the process ends
    _terminating = True
    # Also when close() was under way: its flush finishes before the process ends.
    closing = get_active() or _recorder._closing
    if closing is not None:
        closing.signalled({"reason": name}, terminate=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _handling(rec: Recorder | None, handler: Callable[[int, FrameType | None], Any], *args: Any) -> None:
    """Run a SIGTERM handler not traintrace's with hang detection paused (the process is being ended)."""
    was = rec.handling_signal if rec is not None else False
    if rec is not None:
        rec.handling_signal = True
    try:
        handler(*args)
    finally:
        if rec is not None:
            rec.handling_signal = was


def noting_sigterm(handler: Callable[[int, FrameType | None], Any]) -> Callable[[int, FrameType | None], Any]:
    """``handler`` (a framework's SIGTERM handler, installed over traintrace's) behind one that records the signal
    first, on its arrival, and pauses hang detection while ``handler`` runs. Lightning's broadcasts to the other
    ranks before it calls the handler it found (traintrace's): a rank whose peer was blocked in a collective
    waited there until the collective's timeout, and its signal, recorded only then, read as the end of 10 s
    without progress before it."""

    def noted(signum: int, frame: FrameType | None) -> None:
        global _noted
        rec = get_active()
        if rec is None or _noted:
            handler(signum, frame)
            return
        rec.signalled({"signal": "SIGTERM"}, terminate=False)
        _noted = True
        try:
            _handling(rec, handler, signum, frame)
        finally:
            _noted = False

    noted.traintrace_noting = True  # type: ignore[attr-defined]
    return noted


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    rec = get_active()
    if rec is not None and isinstance(exc, Exception):
        rec.record_exception(exc, EventName.EXCEPTION, {"unhandled": True}, 0)
        rec.flush(1.0)
    elif rec is not None and isinstance(exc, KeyboardInterrupt):
        # Ctrl-C that left no span of traintrace's (a framework's callbacks began them): recorded here, once.
        rec.record_interrupt(exc, 0)
    hook = _previous_excepthook or sys.__excepthook__
    hook(kind, exc, tb)


def _thread_excepthook(args: Any) -> None:
    rec = get_active()
    if rec is not None and isinstance(args.exc_value, Exception):
        thread = getattr(args.thread, "name", "?")
        rec.record_exception(args.exc_value, EventName.EXCEPTION, {"unhandled": True, "thread": thread}, 0)
    hook = _previous_thread_excepthook or threading.__excepthook__
    hook(args)


def _at_exit() -> None:
    rec = get_active()
    if rec is not None and rec.header.get("pid") == os.getpid():
        rec.close()
    _faults.release()


def _after_fork_in_child() -> None:
    global _configure_lock
    # Another thread may have held it in configure() at the fork: that thread does not
    # exist here, so the child would wait for it forever.
    _configure_lock = threading.RLock()
    _faults.after_fork_in_child()
    rec = get_active()
    if rec is None:
        return
    set_active(None)
    # Spans open in the parent are not the child's: its spans start at the top level.
    _recorder._current.set(None)
    # The parent's queue and writer are not ours: never drain or close them here.
    rec.forget_after_fork()
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
