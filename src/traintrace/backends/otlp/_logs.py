"""Every record as an OpenTelemetry log record over OTLP, correlated with its span."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ... import logfmt
from ..._names import RecordKind, SpanStatus, Verbosity
from ..._serialize import dumps
from .._base import Record
from .._log import to_line_fields
from ._common import (
    DEFAULT_MAX_BATCH_BYTES,
    AttrValue,
    Sender,
    build_resource,
    estimated_size,
    flatten_attrs,
    make_exporter,
    require_otel,
    scope,
    span_id_for,
    span_salt,
    trace_id_for,
)

# Record fields that become log attributes under ``traintrace.<field>``.
_FIELDS = ("seq", "id", "parent", "span", "tid", "dur", "status", "link", "count", "total", "reason")


class OtlpLogsBackend:
    """Exports each record as a log record: body key=value (or JSON), severity from the kind.

    Errors are ERROR with ``exception.*`` attributes, drops WARN, spans that
    ended in error WARN, everything else INFO. A record inside a span carries
    that span's trace and span id, so a log view links to the trace.
    """

    def __init__(
        self,
        exporter: Any = None,
        *,
        exporter_options: Mapping[str, Any] | None = None,
        verbosity: int = Verbosity.INFO,
        body: str = "kv",
        service_name: str | None = None,
        resource_attributes: Mapping[str, Any] | None = None,
        max_queue: int = 65536,
        batch_size: int = 2048,
        export_interval: float = 1.0,
        close_timeout: float = 3.0,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ) -> None:
        require_otel("otlp_logs")
        self.verbosity = int(verbosity)
        self.body = body
        self._exporter = exporter if exporter is not None else make_exporter(exporter_options or {"signal": "logs"})
        self._service_name = service_name
        self._extra = dict(resource_attributes or {})
        self._queue_options = (max_queue, batch_size, export_interval, close_timeout)
        self.max_batch_bytes = max_batch_bytes
        self.close_timeout = close_timeout
        self.sender: Sender | None = None
        self._identity: dict[str, Any] = {}

    def open(self, header: Record) -> None:
        from opentelemetry._logs import LogRecord, SeverityNumber

        try:
            from opentelemetry.sdk._logs.export import LogRecordExportResult as Result
        except ImportError:  # older SDKs
            from opentelemetry.sdk._logs.export import LogExportResult as Result  # type: ignore[assignment]
        from opentelemetry.trace import TraceFlags

        try:
            from opentelemetry.sdk._logs import ReadableLogRecord
        except ImportError:  # older SDKs
            from opentelemetry.sdk._logs import LogData as ReadableLogRecord  # type: ignore[attr-defined,no-redef]
        self._LogRecord, self._Readable = LogRecord, ReadableLogRecord
        self._severity = {
            RecordKind.ERROR: (SeverityNumber.ERROR, "ERROR"),
            RecordKind.DROPPED: (SeverityNumber.WARN, "WARN"),
        }
        self._info = (SeverityNumber.INFO, "INFO")
        self._warn = (SeverityNumber.WARN, "WARN")
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        self.resource = build_resource(header, self._service_name, self._extra)
        self._scope = scope()
        job, restart = str(header.get("job", "")), int(header.get("restart", 0))
        self.trace_id = trace_id_for(job, restart)
        self._salt = span_salt(
            job, restart, int(header.get("rank", 0)), str(header.get("host", "")), int(header.get("pid", 0))
        )
        self._identity = {"job": header.get("job"), "rank": header.get("rank")}
        max_queue, batch_size, interval, close_timeout = self._queue_options
        self.sender = Sender(
            self._exporter,
            "otlp_logs",
            max_queue=max_queue,
            batch_size=batch_size,
            export_interval=interval,
            close_timeout=close_timeout,
            success=Result.SUCCESS,
            max_batch_bytes=self.max_batch_bytes,
            size_of=estimated_size,
        )
        self.write([header])

    def write(self, records: Sequence[Record]) -> None:
        if self.sender is not None:
            convert = self._convert
            self.sender.put([convert(record) for record in records])

    def _convert(self, record: Record) -> Any:
        kind = record.get("kind", "")
        severity = self._severity.get(kind, self._info)
        if record.get("status", SpanStatus.OK) == SpanStatus.ERROR:
            severity = self._warn
        attrs: dict[str, AttrValue] = {"traintrace.kind": kind}
        name = record.get("name")
        if name is not None:
            attrs["traintrace.name"] = str(name)
        for key in _FIELDS:
            value = record.get(key)
            if value is not None:
                attrs[f"traintrace.{key}"] = value
        if kind == RecordKind.ERROR:
            attrs["exception.type"] = str(record.get("error_type") or name or "error")
            attrs["exception.message"] = str(record.get("message", ""))
            attrs["exception.stacktrace"] = str(record.get("stack", ""))
        raw = record.get("attrs")
        if raw:
            flatten_attrs(raw, attrs)
        if self.body == "json":
            body = dumps(dict(record)).decode("utf-8", "replace")
        else:
            body = logfmt.format_line(to_line_fields(record, self._identity))
        span = record.get("id") if kind in (RecordKind.SPAN, RecordKind.START, RecordKind.END) else record.get("span")
        log_record = self._LogRecord(
            timestamp=record.get("ts"),
            observed_timestamp=time.time_ns(),
            severity_number=severity[0],
            severity_text=severity[1],
            body=body,
            attributes=attrs,
            event_name=f"traintrace.{kind}",
        )
        log_record.trace_id = self.trace_id
        log_record.span_id = span_id_for(self._salt, span) if span else 0
        log_record.trace_flags = self._flags
        return self._Readable(log_record=log_record, resource=self.resource, instrumentation_scope=self._scope)

    def flush(self) -> None:
        if self.sender is not None:
            self.sender.request_flush()

    def begin_close(self, deadline: float | None = None) -> None:
        """Send the rest now, without waiting; stop by ``deadline`` (``time.monotonic()``)."""
        if self.sender is not None:
            self.sender.begin_close(deadline)

    def settle(self) -> None:
        """Wait until all is sent or the deadline passes (the rest counted as abandoned)."""
        if self.sender is not None:
            self.sender.settle()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def losses(self) -> dict[str, int]:
        """Log records lost so far, by reason: ``queue_full``, ``failed``, ``abandoned``."""
        return self.sender.losses() if self.sender is not None else {}

    def stats(self) -> dict[str, int]:
        return self.sender.stats() if self.sender is not None else {}
