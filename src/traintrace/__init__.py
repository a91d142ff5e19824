"""traintrace: telemetry for model training that never slows or breaks it.

Quick start::

    import traintrace as tt

    tt.configure()                      # files under ./traintrace_logs/<job>/
    with tt.training_loop():
        for step, batch in enumerate(loader):
            with tt.training_iteration(step) as it:
                loss = train_step(batch)
                it.add_metrics(loss=loss)
"""

# The names below are imported on first use (PEP 562), so that ``import traintrace.cli`` (the command)
# does not load the recording core: its start-up cost is the command's fixed cost. Type checkers see
# the imports as usual.
from importlib import import_module as _import_module
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:
    from ._api import (
        application,
        application_running,
        backward,
        checkpoint_load,
        checkpoint_save,
        checkpoint_save_async,
        checkpoint_save_finalization,
        close,
        collective,
        data_loader_init,
        data_loading,
        distributed_init,
        error,
        event,
        flush,
        forward,
        model_init,
        optimizer_init,
        optimizer_step,
        running,
        span,
        start,
        stop,
        test,
        timed_span,
        training,
        training_iteration,
        training_loop,
        validation,
        zero_grad,
    )
    from ._config import (
        BackendConfig,
        Config,
        ConfigError,
        FileBackendConfig,
        LogBackendConfig,
    )
    from ._dist import refresh_identity
    from ._insight import count_flops, counters, heartbeat, set_step_info
    from ._metrics import (
        ApplicationMetrics,
        CheckpointMetrics,
        CheckpointSaveMetrics,
        CheckPointType,
        CustomMetrics,
        EvaluationMetrics,
        IterationMetrics,
        TestMetrics,
        ValidationMetrics,
    )
    from ._monitor import DEFAULT_PHASE_TIMEOUTS
    from ._names import EventName, RecordKind, SpanName, SpanStatus, Verbosity
    from ._peaks import PEAK_BF16_TFLOPS, peak_tflops
    from ._recorder import Recorder, Span, TraintraceWarning, current_span, stats
    from ._setup import configure, get_recorder, is_configured
    from ._version import __version__
    from .backends import Backend, BaseBackend, FileBackend, LogBackend, MemoryBackend
    from .progress import Progress, read_progress, stream_state

#: Public name -> the private module that defines it.
_LAZY: dict[str, str] = {
    "application": "._api",
    "application_running": "._api",
    "backward": "._api",
    "checkpoint_load": "._api",
    "checkpoint_save": "._api",
    "checkpoint_save_async": "._api",
    "checkpoint_save_finalization": "._api",
    "close": "._api",
    "collective": "._api",
    "data_loader_init": "._api",
    "data_loading": "._api",
    "distributed_init": "._api",
    "error": "._api",
    "event": "._api",
    "flush": "._api",
    "forward": "._api",
    "model_init": "._api",
    "optimizer_init": "._api",
    "optimizer_step": "._api",
    "running": "._api",
    "span": "._api",
    "start": "._api",
    "stop": "._api",
    "test": "._api",
    "timed_span": "._api",
    "training": "._api",
    "training_iteration": "._api",
    "training_loop": "._api",
    "validation": "._api",
    "zero_grad": "._api",
    "BackendConfig": "._config",
    "Config": "._config",
    "ConfigError": "._config",
    "FileBackendConfig": "._config",
    "LogBackendConfig": "._config",
    "refresh_identity": "._dist",
    "count_flops": "._insight",
    "counters": "._insight",
    "heartbeat": "._insight",
    "set_step_info": "._insight",
    "ApplicationMetrics": "._metrics",
    "CheckpointMetrics": "._metrics",
    "CheckpointSaveMetrics": "._metrics",
    "CheckPointType": "._metrics",
    "CustomMetrics": "._metrics",
    "EvaluationMetrics": "._metrics",
    "IterationMetrics": "._metrics",
    "TestMetrics": "._metrics",
    "ValidationMetrics": "._metrics",
    "DEFAULT_PHASE_TIMEOUTS": "._monitor",
    "EventName": "._names",
    "RecordKind": "._names",
    "SpanName": "._names",
    "SpanStatus": "._names",
    "Verbosity": "._names",
    "PEAK_BF16_TFLOPS": "._peaks",
    "peak_tflops": "._peaks",
    "Recorder": "._recorder",
    "Span": "._recorder",
    "TraintraceWarning": "._recorder",
    "current_span": "._recorder",
    "stats": "._recorder",
    "configure": "._setup",
    "get_recorder": "._setup",
    "is_configured": "._setup",
    "__version__": "._version",
    "Backend": ".backends",
    "BaseBackend": ".backends",
    "FileBackend": ".backends",
    "LogBackend": ".backends",
    "MemoryBackend": ".backends",
    "Progress": ".progress",
    "read_progress": ".progress",
    "stream_state": ".progress",
}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        if not name.startswith("__"):
            # A submodule (``traintrace.events``), reachable as an attribute as before the API
            # became lazy, when importing the API imported it.
            try:
                return _import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "DEFAULT_PHASE_TIMEOUTS",
    "PEAK_BF16_TFLOPS",
    "ApplicationMetrics",
    "Backend",
    "BackendConfig",
    "BaseBackend",
    "CheckPointType",
    "CheckpointMetrics",
    "CheckpointSaveMetrics",
    "Config",
    "ConfigError",
    "CustomMetrics",
    "EvaluationMetrics",
    "EventName",
    "FileBackend",
    "FileBackendConfig",
    "IterationMetrics",
    "LogBackend",
    "LogBackendConfig",
    "MemoryBackend",
    "Progress",
    "RecordKind",
    "Recorder",
    "Span",
    "SpanName",
    "SpanStatus",
    "TestMetrics",
    "TraintraceWarning",
    "ValidationMetrics",
    "Verbosity",
    "__version__",
    "application",
    "application_running",
    "backward",
    "checkpoint_load",
    "checkpoint_save",
    "checkpoint_save_async",
    "checkpoint_save_finalization",
    "close",
    "collective",
    "configure",
    "count_flops",
    "counters",
    "current_span",
    "data_loader_init",
    "data_loading",
    "distributed_init",
    "error",
    "event",
    "flush",
    "forward",
    "get_recorder",
    "heartbeat",
    "is_configured",
    "model_init",
    "optimizer_init",
    "optimizer_step",
    "peak_tflops",
    "read_progress",
    "refresh_identity",
    "running",
    "set_step_info",
    "span",
    "start",
    "stats",
    "stop",
    "stream_state",
    "test",
    "timed_span",
    "training",
    "training_iteration",
    "training_loop",
    "validation",
    "zero_grad",
]
