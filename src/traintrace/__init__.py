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
