"""What the OTLP backends share: identifiers, attributes, resource, exporters, the sender."""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._config import ConfigError
from ..._version import __version__

log = logging.getLogger("traintrace.lib")

_MASK64 = (1 << 64) - 1
#: The most encoded bytes of items in one export request: under the 4 MiB a collector takes by default.
DEFAULT_MAX_BATCH_BYTES = 4_000_000
_DEFAULT_HTTP = "http://localhost:4318"
_HTTP_PATHS = {"traces": "/v1/traces", "logs": "/v1/logs", "metrics": "/v1/metrics"}


def require_otel(kind: str) -> None:
    """Import the SDK or raise a ConfigError naming the extra to install."""
    try:
        importlib.import_module("opentelemetry.sdk.resources")
    except ImportError:
        raise ConfigError(f"backends.{kind}: needs OpenTelemetry: pip install 'traintrace[otel]'") from None


# ---------------------------------------------------------------- identifiers


def trace_id_for(job_id: str, restart: int) -> int:
    """The trace id of one run of a job: every rank of the run computes the same one.

    The first 16 bytes of SHA-256 over ``"traintrace:<job id>:<restart count>"``,
    so a restarted job (restart count + 1) starts a new trace.
    """
    digest = hashlib.sha256(f"traintrace:{job_id}:{int(restart)}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


def span_salt(job_id: str, restart: int, rank: int, host: str, pid: int) -> int:
    """A per-process 64-bit number that span ids are derived from."""
    text = f"traintrace:{job_id}:{int(restart)}:{int(rank)}:{host}:{int(pid)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def span_id_for(salt: int, span_id: int) -> int:
    """The OpenTelemetry span id of traintrace span ``span_id`` in the process ``salt`` names.

    SplitMix64 of ``salt + span_id``: a bijection, so the ids of one process never
    collide, and ids from different processes collide with probability ~2^-64.
    """
    z = (salt + span_id + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) or 1


# ---------------------------------------------------------------- attributes

AttrValue = str | bool | int | float | tuple[Any, ...]
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def flatten_attrs(attrs: Mapping[str, Any], out: dict[str, AttrValue], prefix: str = "") -> None:
    """Record attributes as valid OpenTelemetry attribute values.

    Nested mappings become dotted keys; lists of one primitive type stay lists;
    mixed lists become their JSON text; ``None`` is left out (OpenTelemetry has no null).
    """
    for key, value in attrs.items():
        name = prefix + key if prefix else key
        if not key:
            name += "_"  # OpenTelemetry drops empty keys
        kind = type(value)
        if kind is str or kind is bool or kind is float:
            out[name] = value
        elif kind is int:
            out[name] = value if _INT64_MIN <= value <= _INT64_MAX else str(value)
        elif value is None:
            continue
        elif isinstance(value, Mapping):
            flatten_attrs(value, out, name + ".")
        elif isinstance(value, list | tuple):
            out[name] = _sequence(value)
        else:
            out[name] = str(value)


def is_flat(attrs: Mapping[str, Any]) -> bool:
    """True when ``attrs`` are already valid OpenTelemetry attributes (the usual case)."""
    for key, value in attrs.items():
        kind = type(value)
        if not key or not (
            kind is str or kind is float or kind is bool or (kind is int and _INT64_MIN <= value <= _INT64_MAX)
        ):
            return False
    return True


def _sequence(values: Sequence[Any]) -> AttrValue:
    if not values:
        return ()
    first = type(values[0])
    if first in (str, bool, float) and all(type(v) is first for v in values):
        return tuple(values)
    if first is int and all(type(v) is int and _INT64_MIN <= v <= _INT64_MAX for v in values):
        return tuple(values)
    if first in (int, float) and all(type(v) in (int, float) for v in values):
        return tuple(float(v) for v in values)
    import json

    return json.dumps(values, default=str, separators=(",", ":"))


# ---------------------------------------------------------------- resource


def resource_attributes(
    header: Mapping[str, Any], service_name: str | None, extra: Mapping[str, Any]
) -> dict[str, AttrValue]:
    """Our resource attributes, before ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``."""
    job = str(header.get("job", ""))
    rank = int(header.get("rank", 0))
    restart = int(header.get("restart", 0))
    out: dict[str, AttrValue] = {
        "service.name": service_name or str(header.get("job_name") or job or "traintrace"),
        "service.instance.id": f"{job}/rank{rank}/restart{restart}",
        "host.name": str(header.get("host", "")),
        "process.pid": int(header.get("pid", os.getpid())),
        "process.runtime.name": platform.python_implementation().lower(),
        "process.runtime.version": platform.python_version(),
        "traintrace.job.id": job,
        "traintrace.rank": rank,
        "traintrace.world_size": int(header.get("world_size", 1)),
        "traintrace.local_rank": int(header.get("local_rank", 0)),
        "traintrace.node_rank": int(header.get("node_rank", 0)),
        "traintrace.restart_count": restart,
        "traintrace.version": __version__,
    }
    for key in ("job_name", "run", "launcher"):
        value = header.get(key)
        if value:
            out[f"traintrace.{'job.name' if key == 'job_name' else key}"] = str(value)
    flatten_attrs(extra, out)
    return out


def build_resource(header: Mapping[str, Any], service_name: str | None, extra: Mapping[str, Any]) -> Any:
    """The SDK Resource: SDK defaults < ours < configured < ``OTEL_*`` variables."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    ours = Resource.create(resource_attributes(header, service_name, extra))
    return ours.merge(OTELResourceDetector().detect())


def scope() -> Any:
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    return InstrumentationScope("traintrace", __version__)


# ---------------------------------------------------------------- exporters


def _env(signal: str, name: str) -> str | None:
    return os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")


def resolve_protocol(signal: str, protocol: str | None) -> str:
    """Configured, else ``OTEL_EXPORTER_OTLP_[SIGNAL_]PROTOCOL``, else ``grpc``.

    gRPC is the default (as in OpenTelemetry Python's own auto-configuration)
    because traintrace encodes spans for it directly, several times faster.
    """
    chosen = (protocol or _env(signal, "PROTOCOL") or "grpc").strip().lower()
    if chosen == "http":
        chosen = "http/protobuf"
    if chosen not in ("grpc", "http/protobuf", "console"):
        raise ConfigError(
            f"backends.otlp_{signal}.protocol: {chosen!r} is not supported (grpc, http/protobuf or console)"
        )
    return chosen


def http_endpoint(signal: str, endpoint: str | None) -> str:
    """The URL an HTTP exporter posts to, as the OTLP specification builds it."""
    if endpoint:
        from urllib.parse import urlparse

        parsed = urlparse(endpoint)
        if parsed.path in ("", "/"):
            return endpoint.rstrip("/") + _HTTP_PATHS[signal]
        return endpoint
    specific = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return specific
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or _DEFAULT_HTTP
    return base.rstrip("/") + _HTTP_PATHS[signal]


_MODULES = {
    ("grpc", "traces"): ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    ("grpc", "logs"): ("opentelemetry.exporter.otlp.proto.grpc._log_exporter", "OTLPLogExporter"),
    ("grpc", "metrics"): ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
    ("http/protobuf", "traces"): (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "OTLPSpanExporter",
    ),
    ("http/protobuf", "logs"): ("opentelemetry.exporter.otlp.proto.http._log_exporter", "OTLPLogExporter"),
    ("http/protobuf", "metrics"): (
        "opentelemetry.exporter.otlp.proto.http.metric_exporter",
        "OTLPMetricExporter",
    ),
    ("console", "traces"): ("opentelemetry.sdk.trace.export", "ConsoleSpanExporter"),
    ("console", "logs"): ("opentelemetry.sdk._logs.export", "ConsoleLogExporter"),
    ("console", "metrics"): ("opentelemetry.sdk.metrics.export", "ConsoleMetricExporter"),
}


def make_exporter(options: Mapping[str, Any]) -> Any:
    """An official OpenTelemetry exporter for ``options`` (see ``OtlpConfig.exporter_options``)."""
    cls, kwargs = exporter_class(options)
    return cls(**kwargs)


def exporter_class(options: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The official exporter class for ``options`` and the arguments to make it with."""
    signal = options["signal"]
    protocol = resolve_protocol(signal, options.get("protocol"))
    module_name, class_name = _MODULES[(protocol, signal)]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        package = {
            "grpc": "opentelemetry-exporter-otlp-proto-grpc",
            "http/protobuf": "opentelemetry-exporter-otlp-proto-http",
        }.get(protocol, "opentelemetry-sdk")
        raise ConfigError(
            f"backends.otlp_{signal}: protocol {protocol} needs {package}: pip install 'traintrace[otel]'"
        ) from None
    cls = getattr(module, class_name)
    if protocol == "console":
        return cls, {}
    kwargs: dict[str, Any] = {}
    headers = options.get("headers")
    if headers:
        kwargs["headers"] = dict(headers)
    if options.get("timeout"):
        kwargs["timeout"] = float(options["timeout"])
    compression = options.get("compression")
    certificate = options.get("certificate")
    if protocol == "grpc":
        if options.get("endpoint"):
            kwargs["endpoint"] = options["endpoint"]
        if options.get("insecure") is not None:
            kwargs["insecure"] = options["insecure"]
        if certificate:
            import grpc

            try:
                roots = Path(certificate).read_bytes()
            except OSError as exc:
                raise ConfigError(f"backends.otlp_{signal}.certificate: cannot read {certificate}: {exc}") from None
            kwargs["credentials"] = grpc.ssl_channel_credentials(root_certificates=roots)
            kwargs.setdefault("insecure", False)  # a CA was given: never fall back to plain text
        if compression:
            import grpc

            kwargs["compression"] = grpc.Compression.Gzip if compression == "gzip" else grpc.Compression.NoCompression
    else:
        kwargs["endpoint"] = http_endpoint(signal, options.get("endpoint"))
        certificate = certificate or _env(signal, "CERTIFICATE")
        if certificate:
            kwargs["certificate_file"] = certificate
            kwargs["session"] = _pinned_session()
        if compression:
            from opentelemetry.exporter.otlp.proto.http import Compression

            kwargs["compression"] = Compression.Gzip if compression == "gzip" else Compression.NoCompression
    return cls, kwargs


def _pinned_session() -> Any:
    """A requests Session that keeps the CA file it is given.

    A plain Session checks against ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE``
    whenever one is set, ignoring the exporter's ``certificate_file`` (requests
    issue 3829), so the collector's certificate would fail to verify.
    """
    import requests

    class PinnedSession(requests.Session):
        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
            chosen = self.verify if verify is None else verify
            return super().merge_environment_settings(url, proxies, stream, chosen, cert)

    return PinnedSession()


def call_with_timeout(func: Callable[[], Any], timeout: float, name: str) -> bool:
    """Run ``func`` on a daemon thread; True if it finished within ``timeout`` seconds."""
    done = threading.Event()

    def run() -> None:
        try:
            func()
        except Exception:
            log.debug("traintrace: %s failed", name, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name=f"traintrace-{name}", daemon=True).start()
    return done.wait(timeout)


# ---------------------------------------------------------------- the sender


def _text_bytes(value: Any) -> int:
    kind = type(value)
    if kind is str:
        return len(value.encode("utf-8", "surrogatepass")) + 3
    if kind is tuple or kind is list:
        return sum(_text_bytes(v) for v in value) + 3
    return 11


def _attrs_bytes(attrs: Any) -> int:
    if not attrs:
        return 0
    return sum(len(key) + 6 + _text_bytes(value) for key, value in attrs.items())


def estimated_size(item: Any) -> int:
    """About the encoded bytes of an SDK span or log record (never much below the real size)."""
    record = getattr(item, "log_record", item)
    size = 96 + _attrs_bytes(getattr(record, "attributes", None))
    body = getattr(record, "body", None)
    if body is not None:
        size += _text_bytes(body if type(body) is str else str(body))
    name = getattr(record, "name", None)
    if type(name) is str:
        size += len(name) * 4
    for event in getattr(record, "events", None) or ():
        size += 32 + len(event.name) * 4 + _attrs_bytes(event.attributes)
    return size


class Sender:
    """Exports batches on its own daemon thread from a bounded queue.

    ``put`` never blocks: what does not fit is dropped and counted. A batch
    holds at most ``batch_size`` items and ``max_batch_bytes`` encoded bytes
    (``size_of`` tells an item's size). A failed export drops that batch
    (counted) and backs off, so a dead collector costs bounded memory and no
    training time. Closing is in steps that share one deadline across all
    backends: :meth:`begin_close` (send the rest, now), :meth:`settle` (wait
    until sent or the deadline, then abandon the rest, counted), :meth:`close`.
    """

    def __init__(
        self,
        exporter: Any,
        name: str,
        *,
        max_queue: int,
        batch_size: int,
        export_interval: float,
        close_timeout: float,
        success: Any,
        prepare: Callable[[list[Any]], Any] | None = None,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        size_of: Callable[[Any], int] | None = None,
    ) -> None:
        self.exporter = exporter
        self.name = name
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        self.export_interval = export_interval
        self.close_timeout = close_timeout
        self._success = success
        self._prepare = prepare
        self._size_of = size_of
        self._items: deque[Any] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._closing = False  # begin_close: send without waiting for full batches
        self._stop = False  # close: the thread ends once nothing is queued
        self._flush_requested = False
        self._backoff = 0.0
        self._deadline: float | None = None
        self.exported = 0
        self.dropped = 0  # queue full
        self.failed = 0  # the collector refused or was unreachable
        self.abandoned = 0  # still queued (or being sent) when close gave up
        self.batches = 0
        self._in_flight = 0
        self._gave_up = False
        self._warned_at = 0.0
        self._reported = 0
        self._thread = threading.Thread(target=self._run, name=f"traintrace-{name}", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._items)

    def put(self, items: Sequence[Any]) -> None:
        if not items:
            return
        with self._cond:
            if self._gave_up:
                self.abandoned += len(items)  # closing ran out of time: nothing more goes out
                return
            room = self.max_queue - len(self._items)
            if room >= len(items):
                self._items.extend(items)
            else:
                if room > 0:
                    self._items.extend(items[:room])
                self.dropped += len(items) - max(room, 0)
            if self._closing or len(self._items) >= self.batch_size:
                self._cond.notify_all()
        if self.dropped or self.failed:
            self._maybe_warn()

    def request_flush(self) -> None:
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()

    def _maybe_warn(self) -> None:
        lost = self.dropped + self.failed
        now = time.monotonic()
        if lost != self._reported and now - self._warned_at > 30.0:
            self._warned_at = now
            self._reported = lost
            log.warning(
                "traintrace: %s lost %d items so far (%d queue full, %d export failed); is the collector reachable?",
                self.name,
                lost,
                self.dropped,
                self.failed,
            )

    def _take(self) -> list[Any]:
        items = self._items
        count = min(len(items), self.batch_size)
        size_of = self._size_of
        if size_of is None:
            return [items.popleft() for _ in range(count)]
        # Split by encoded size too: a collector refuses requests over its limit (4 MiB by default).
        batch: list[Any] = []
        budget = self.max_batch_bytes
        for _ in range(count):
            size = size_of(items[0])
            if batch and size > budget:
                break
            batch.append(items.popleft())
            budget -= size
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._closing and not self._items and not self._stop:
                    self._cond.wait()
                if not self._closing and len(self._items) < self.batch_size and not self._flush_requested:
                    self._cond.wait(self.export_interval)
                self._flush_requested = False
                batch = self._take()
                closing, stop = self._closing, self._stop
                self._in_flight = len(batch)  # settle() waits for it
            if batch:
                self._export(batch)
                if self._backoff and not closing:
                    self._sleep(self._backoff)
            elif stop:
                return

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _export(self, batch: list[Any]) -> None:
        try:
            result = self.exporter.export(self._prepare(batch) if self._prepare else batch)
        except Exception as exc:
            log.debug("traintrace: %s export raised %s", self.name, exc, exc_info=True)
            result = None
        with self._cond:
            self._in_flight = 0
            self.batches += 1
            if self._gave_up:
                self._cond.notify_all()
                return  # close already counted this batch as abandoned
            if result == self._success or getattr(result, "name", None) == "SUCCESS":
                self.exported += len(batch)
                self._backoff = 0.0
            else:
                self.failed += len(batch)
                self._backoff = min(max(self._backoff * 2, 1.0), 30.0)
            self._cond.notify_all()
        if self.failed:
            self._maybe_warn()

    # -- closing -----------------------------------------------------------
    def begin_close(self, deadline: float | None = None) -> None:
        """Send everything queued now, without waiting between batches; stop by ``deadline``.

        ``deadline`` (``time.monotonic()``) is the pipeline's, shared by every
        backend; this sender's own ``close_timeout`` applies from now within it.
        """
        own = time.monotonic() + self.close_timeout
        with self._cond:
            if self._deadline is None:
                self._deadline = own if deadline is None else min(own, deadline)
            self._closing = True
            self._cond.notify_all()

    def settle(self) -> None:
        """Wait until everything queued is sent or the deadline passes; then abandon the rest (counted)."""
        if self._deadline is None:
            self.begin_close()
        deadline = self._deadline or 0.0
        with self._cond:
            while (self._items or self._in_flight) and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            if self._items or self._in_flight:
                self._give_up()

    def _give_up(self) -> None:
        """(Lock held.) Count what is queued or being sent as abandoned; nothing more goes out."""
        if not self._gave_up:
            self._gave_up = True
            self.abandoned += len(self._items) + self._in_flight
            self._items.clear()

    def close(self) -> None:
        """Send what is left within the deadline, shut the exporter down, and report the sender's totals."""
        self.settle()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        deadline = self._deadline or time.monotonic()
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        with self._cond:
            if self._thread.is_alive():
                self._give_up()
        call_with_timeout(
            self.exporter.shutdown, min(max(deadline - time.monotonic(), 0.05), 0.5), f"{self.name}-shutdown"
        )
        lost = self.dropped + self.failed + self.abandoned
        if lost:
            log.warning(
                "traintrace: %s exported %d, lost %d (%d queue full, %d export failed, "
                "%d not sent within the close budget of %.1fs)",
                self.name,
                self.exported,
                lost,
                self.dropped,
                self.failed,
                self.abandoned,
                self.close_timeout,
            )
        else:
            log.info("traintrace: %s exported %d, lost none", self.name, self.exported)

    def losses(self) -> dict[str, int]:
        """Items lost so far, by reason (queue_full, failed, abandoned); zeros left out."""
        out = {"queue_full": self.dropped, "failed": self.failed, "abandoned": self.abandoned}
        return {reason: count for reason, count in out.items() if count}

    def stats(self) -> dict[str, int]:
        return {
            "exported": self.exported,
            "dropped": self.dropped,
            "failed": self.failed,
            "abandoned": self.abandoned,
            "queued": len(self._items),
            "batches": self.batches,
        }
