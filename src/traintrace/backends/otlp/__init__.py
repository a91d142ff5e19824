"""OpenTelemetry backends: traces, logs and metrics over OTLP (extra ``otel``).

The configurations are importable without OpenTelemetry installed; the
backends import it when created. See docs/otel.md.
"""

from ._common import span_id_for, span_salt, trace_id_for
from ._config import OtlpConfig, OtlpLogsConfig, OtlpMetricsConfig, OtlpTracesConfig

__all__ = [
    "OtlpConfig",
    "OtlpLogsConfig",
    "OtlpMetricsConfig",
    "OtlpTracesConfig",
    "span_id_for",
    "span_salt",
    "trace_id_for",
]


def __getattr__(name: str) -> object:
    if name in ("OtlpTracesBackend", "OtlpLogsBackend", "OtlpMetricsBackend"):
        from . import _logs, _metrics, _traces

        for module in (_traces, _logs, _metrics):
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(name)
