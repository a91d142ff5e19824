"""Configuration of the OTLP backends. Importing this module imports no OpenTelemetry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..._config import BackendConfig, ConfigError
from ..._names import Verbosity

if TYPE_CHECKING:
    from ..._config import Config
    from ..._identity import Identity
    from .._base import Backend

PROTOCOLS = ("grpc", "http/protobuf", "console")
COMPRESSIONS = ("gzip", "none")


def parse_pairs(value: str | Mapping[str, Any] | None, where: str, secret: bool = False) -> dict[str, str]:
    """``"k=v,k2=v2"`` (as in ``OTEL_EXPORTER_OTLP_HEADERS``) or a mapping, as a dict.

    With ``secret`` (headers: they carry tokens) an error names the entry by position, not text.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if not isinstance(value, str):
        shown = type(value).__name__ if secret else repr(value)
        raise ConfigError(f"{where}: expected 'key=value,key2=value2' or a table, got {shown}")
    from urllib.parse import unquote

    out: dict[str, str] = {}
    for number, part in enumerate(value.split(","), 1):
        if not part.strip():
            continue
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            shown = f"entry {number}" if secret else repr(part.strip())
            raise ConfigError(f"{where}: {shown} is not key=value")
        out[unquote(key.strip())] = unquote(val.strip())
    return out


@dataclass
class OtlpConfig(BackendConfig):
    """Settings every OTLP backend shares. Unset fields fall back to ``OTEL_*`` variables.

    ``endpoint``: the collector (``http://host:4317`` for gRPC, ``http://host:4318``
    for HTTP; for HTTP a bare host gets ``/v1/<signal>`` appended). ``protocol``:
    ``grpc``, ``http/protobuf`` or ``console``. ``timeout``: seconds one export
    request may take, retries included. ``close_timeout``: the most seconds
    closing waits for the collector before the rest is dropped and counted.
    ``max_batch_bytes``: the most encoded bytes of spans or log records in one
    export request (a collector refuses requests over 4 MiB by default).
    ``certificate``: a PEM file of the CA certificates the collector's TLS
    certificate is checked against (default: the system's, or
    ``OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE``).
    """

    endpoint: str | None = None
    protocol: str | None = None
    headers: str | dict[str, Any] | None = field(default=None, repr=False)  # may carry tokens
    insecure: bool | None = None
    timeout: float | None = None
    compression: str | None = None
    service_name: str | None = None
    resource_attributes: str | dict[str, Any] | None = None
    certificate: str | None = None
    close_timeout: float = 3.0
    max_queue: int = 65536
    batch_size: int = 2048
    max_batch_bytes: int = 4_000_000
    export_interval: float = 1.0

    signal: ClassVar[str] = ""

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.protocol is not None:
            self.protocol = str(self.protocol).strip().lower()
            if self.protocol not in PROTOCOLS:
                raise ConfigError(f"{where}.protocol: expected one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.compression is not None:
            self.compression = str(self.compression).strip().lower()
            if self.compression not in COMPRESSIONS:
                raise ConfigError(f"{where}.compression: expected 'gzip' or 'none', got {self.compression!r}")
        if self.endpoint is not None and (not isinstance(self.endpoint, str) or not self.endpoint.strip()):
            raise ConfigError(f"{where}.endpoint: expected a URL such as http://localhost:4317")
        for name in ("timeout", "close_timeout", "export_interval"):
            value = getattr(self, name)
            if value is None and name == "timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{where}.{name}: expected a positive number of seconds, got {value!r}")
        for name in ("max_queue", "batch_size", "max_batch_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}.{name}: expected a positive integer, got {value!r}")
        if self.insecure is not None and not isinstance(self.insecure, bool):
            raise ConfigError(f"{where}.insecure: expected true or false")
        if self.service_name is not None and (not isinstance(self.service_name, str) or not self.service_name):
            raise ConfigError(f"{where}.service_name: expected a non-empty string")
        if self.certificate is not None:
            import os
            from pathlib import Path

            if not isinstance(self.certificate, str | os.PathLike) or not str(self.certificate):
                raise ConfigError(f"{where}.certificate: expected the path of a PEM file")
            self.certificate = os.fspath(self.certificate)
            if not Path(self.certificate).is_file():
                raise ConfigError(f"{where}.certificate: no such file: {self.certificate}")
            if self.insecure:
                raise ConfigError(f"{where}.certificate: set, but insecure is true (no TLS)")
        self.headers = parse_pairs(self.headers, f"{where}.headers", secret=True)
        self.resource_attributes = parse_pairs_any(self.resource_attributes, f"{where}.resource_attributes")

    def backend_settings(self, level: int) -> dict[str, Any]:
        """The keyword arguments every OTLP backend takes from these settings."""
        return {
            "exporter_options": self.exporter_options(),
            "verbosity": level,
            "service_name": self.service_name,
            "resource_attributes": dict(self.resource_attributes or {}),  # type: ignore[arg-type]
            "max_queue": self.max_queue,
            "batch_size": self.batch_size,
            "max_batch_bytes": self.max_batch_bytes,
            "export_interval": self.export_interval,
            "close_timeout": self.close_timeout,
        }

    def exporter_options(self) -> dict[str, Any]:
        """The settings the exporter factory needs, as plain data."""
        return {
            "signal": self.signal,
            "endpoint": self.endpoint,
            "protocol": self.protocol,
            "headers": dict(self.headers or {}) if isinstance(self.headers, Mapping) else self.headers,
            "insecure": self.insecure,
            "timeout": self.timeout,
            "compression": self.compression,
            "certificate": self.certificate,
        }


def parse_pairs_any(value: str | Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """Like :func:`parse_pairs`, keeping a mapping's values (numbers stay numbers)."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    return dict(parse_pairs(value, where))


@dataclass
class OtlpTracesConfig(OtlpConfig):
    """Spans as OpenTelemetry traces: one trace per job run, shared by all ranks."""

    type: ClassVar[str] = "otlp_traces"
    signal: ClassVar[str] = "traces"
    verbosity: Verbosity | str | int = Verbosity.TRACING

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        from ._traces import OtlpTracesBackend

        return OtlpTracesBackend(**self.backend_settings(level))


@dataclass
class OtlpLogsConfig(OtlpConfig):
    """Every record as an OpenTelemetry log record, correlated with its span.

    ``body``: ``kv`` (key=value, as the log backend writes) or ``json``.
    """

    type: ClassVar[str] = "otlp_logs"
    signal: ClassVar[str] = "logs"
    verbosity: Verbosity | str | int = Verbosity.INFO
    body: str = "kv"

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.body not in ("kv", "json"):
            raise ConfigError(f"{where}.body: expected 'kv' or 'json', got {self.body!r}")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        from ._logs import OtlpLogsBackend

        return OtlpLogsBackend(body=self.body, **self.backend_settings(level))


@dataclass
class OtlpMetricsConfig(OtlpConfig):
    """Iteration time, throughput, loss, checkpoint time, errors and drops as instruments.

    ``export_interval`` defaults to ``OTEL_METRIC_EXPORT_INTERVAL`` (ms) or 10 s.
    """

    type: ClassVar[str] = "otlp_metrics"
    signal: ClassVar[str] = "metrics"
    verbosity: Verbosity | str | int = Verbosity.TRACING
    export_interval: float = field(default=0.0)

    def validate(self, where: str) -> None:
        if not self.export_interval:
            self.export_interval = _metric_interval_from_env()
        super().validate(where)

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        from ._metrics import OtlpMetricsBackend

        return OtlpMetricsBackend(
            exporter_options=self.exporter_options(),
            verbosity=level,
            service_name=self.service_name,
            resource_attributes=dict(self.resource_attributes or {}),  # type: ignore[arg-type]
            export_interval=self.export_interval,
            close_timeout=self.close_timeout,
        )


def _metric_interval_from_env() -> float:
    import os

    raw = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "")
    try:
        value = float(raw) / 1000.0
    except ValueError:
        return 10.0
    return value if value > 0 else 10.0
