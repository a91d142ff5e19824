"""The numbers people chart and alert on, as OpenTelemetry instruments over OTLP."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..._names import RecordKind, SpanName, Verbosity
from .._base import Record
from ._common import build_resource, make_exporter, require_otel, scope

log = logging.getLogger("traintrace.lib")

#: Attribute keys of spans and events that become gauges: key -> (instrument, unit).
GAUGES: dict[str, tuple[str, str]] = {
    "loss": ("traintrace.loss", "1"),
    "accuracy": ("traintrace.accuracy", "1"),
    "tokens_per_second": ("traintrace.throughput.tokens", "{token}/s"),
    "samples_per_second": ("traintrace.throughput.samples", "{sample}/s"),
    "steps_per_second": ("traintrace.throughput.steps", "{step}/s"),
    "tflops": ("traintrace.tflops", "TFLOP/s"),
    "mfu": ("traintrace.mfu", "1"),
}

_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
    100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
)  # fmt: skip


class OtlpMetricsBackend:
    """Updates instruments from records on the writer thread; the SDK exports them periodically.

    Instruments: ``traintrace.iteration.duration`` (histogram, s),
    ``traintrace.checkpoint.duration`` (histogram, s, by span name),
    ``traintrace.span.duration`` (histogram, s, by span name),
    ``traintrace.iterations`` (counter), the gauges in :data:`GAUGES`,
    ``traintrace.errors`` (counter, by exception type) and
    ``traintrace.dropped`` (counter, by reason).
    """

    def __init__(
        self,
        exporter: Any = None,
        *,
        exporter_options: Mapping[str, Any] | None = None,
        verbosity: int = Verbosity.TRACING,
        service_name: str | None = None,
        resource_attributes: Mapping[str, Any] | None = None,
        export_interval: float = 10.0,
        close_timeout: float = 3.0,
    ) -> None:
        require_otel("otlp_metrics")
        self.verbosity = int(verbosity)
        self._exporter = exporter if exporter is not None else make_exporter(exporter_options or {"signal": "metrics"})
        self._service_name = service_name
        self._extra = dict(resource_attributes or {})
        self.export_interval = export_interval
        self.close_timeout = close_timeout
        self.provider: Any = None
        self.exports = 0  # finished, successful or not
        self.failed_exports = 0
        self.unfinished_exports = 0  # the final export, when the close budget ran out first
        self._closing: threading.Thread | None = None
        self._deadline = 0.0
        self._count_exports()

    def _count_exports(self) -> None:
        """Count the exporter's exports and failures (the SDK only logs a failure)."""
        exporter = self._exporter
        original = getattr(exporter, "export", None)
        if original is None:
            return
        backend = self

        def export(*args: Any, **kwargs: Any) -> Any:
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                backend.exports += 1
                if getattr(result, "name", None) != "SUCCESS":
                    backend.failed_exports += 1

        try:
            exporter.export = export
        except Exception:  # noqa: BLE001 - an exporter that refuses attributes is not counted
            log.debug("traintrace: otlp_metrics cannot count the exports of %r", exporter)

    def open(self, header: Record) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        reader = PeriodicExportingMetricReader(
            self._exporter,
            export_interval_millis=self.export_interval * 1000.0,
            export_timeout_millis=max(self.close_timeout, 0.5) * 1000.0,
        )
        self.provider = MeterProvider(
            metric_readers=[reader],
            resource=build_resource(header, self._service_name, self._extra),
            shutdown_on_exit=False,
        )
        meter_scope = scope()
        meter = self.provider.get_meter(meter_scope.name, meter_scope.version)
        self._iteration = meter.create_histogram(
            "traintrace.iteration.duration", "s", "Time of one training iteration",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )  # fmt: skip
        self._checkpoint = meter.create_histogram(
            "traintrace.checkpoint.duration", "s", "Time of checkpoint saves and loads",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )  # fmt: skip
        self._span = meter.create_histogram(
            "traintrace.span.duration", "s", "Time of every span, by name",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )  # fmt: skip
        self._iterations = meter.create_counter("traintrace.iterations", "{iteration}", "Iterations done")
        self._errors = meter.create_counter("traintrace.errors", "{error}", "Errors and exceptions recorded")
        self._dropped = meter.create_counter("traintrace.dropped", "{record}", "Records lost before any backend")
        self._gauges = {
            key: meter.create_gauge(name, unit, f"Latest {key} reported") for key, (name, unit) in GAUGES.items()
        }

    def write(self, records: Sequence[Record]) -> None:
        for record in records:
            kind = record["kind"]
            if kind == RecordKind.SPAN:
                self._span_done(record["name"], record.get("dur", 0))
                self._gauge(record.get("attrs"))
            elif kind == RecordKind.START:
                self._gauge(record.get("attrs"))
            elif kind == RecordKind.END:
                self._span_done(record["name"], record.get("dur", 0))
                self._gauge(record.get("attrs"))
            elif kind == RecordKind.EVENT:
                self._gauge(record.get("attrs"))
            elif kind == RecordKind.ERROR:
                self._errors.add(1, {"error.type": str(record.get("error_type") or record.get("name", "error"))})
            elif kind == RecordKind.DROPPED:
                count = record.get("count")
                if isinstance(count, int) and count > 0:
                    self._dropped.add(count, {"reason": str(record.get("reason", "unknown"))})

    def _span_done(self, name: str, dur: int) -> None:
        seconds = dur / 1e9
        by_name = {"traintrace.span.name": name}
        self._span.record(seconds, by_name)
        if name == SpanName.ITERATION:
            self._iteration.record(seconds)
            self._iterations.add(1)
        elif name.startswith("checkpoint_"):
            self._checkpoint.record(seconds, by_name)

    def _gauge(self, attrs: Mapping[str, Any] | None) -> None:
        if not attrs:
            return
        for key, gauge in self._gauges.items():
            value = attrs.get(key)
            if value is not None and type(value) in (int, float):
                gauge.set(value)

    def flush(self) -> None:
        return None

    def begin_close(self, deadline: float | None = None) -> None:
        """Start the final export and shutdown, to end by ``deadline`` (``time.monotonic()``)."""
        if self.provider is None or self._closing is not None:
            return
        own = time.monotonic() + self.close_timeout
        self._deadline = own if deadline is None else min(own, deadline)
        provider = self.provider
        millis = max(self._deadline - time.monotonic(), 0.05) * 1000.0

        def shutdown() -> None:
            try:
                provider.shutdown(timeout_millis=millis)
            except Exception:
                log.debug("traintrace: otlp_metrics shutdown failed", exc_info=True)

        self._closing = threading.Thread(target=shutdown, name="traintrace-otlp_metrics-close", daemon=True)
        self._closing.start()

    def settle(self) -> None:
        """Wait for the final export until the deadline; one not done by then counts as failed."""
        if self._closing is None:
            self.begin_close()
        if self._closing is None:
            return
        self._closing.join(max(self._deadline - time.monotonic(), 0.0))
        if self._closing.is_alive() and self._deadline:
            self._deadline = 0.0
            self.unfinished_exports = 1  # the final export did not finish within the close budget

    def close(self) -> None:
        if self.provider is None:
            return
        self.settle()
        failed = self.failed_exports + self.unfinished_exports
        if failed:
            log.warning(
                "traintrace: otlp_metrics exported %d times, %d exports lost (%d failed, %d not finished "
                "within the close budget of %.1fs)",
                self.exports - self.failed_exports,
                failed,
                self.failed_exports,
                self.unfinished_exports,
                self.close_timeout,
            )
        else:
            log.info("traintrace: otlp_metrics exported %d times, none lost", self.exports)

    def losses(self) -> dict[str, int]:
        """Metric exports lost (each loses that interval's points; not records)."""
        failed = self.failed_exports + self.unfinished_exports
        return {"failed_exports": failed} if failed else {}

    def stats(self) -> dict[str, int]:
        return {
            "exports": self.exports - self.failed_exports,
            "failed_exports": self.failed_exports + self.unfinished_exports,
        }
