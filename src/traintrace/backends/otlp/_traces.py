"""Spans as OpenTelemetry traces over OTLP."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..._names import RecordKind, SpanStatus, Verbosity
from .._base import Record
from ._common import (
    DEFAULT_MAX_BATCH_BYTES,
    AttrValue,
    Sender,
    build_resource,
    estimated_size,
    exporter_class,
    flatten_attrs,
    is_flat,
    require_otel,
    resolve_protocol,
    scope,
    span_id_for,
    span_salt,
    trace_id_for,
)
from ._encode import SpanEncoder, resource_message, scope_message, trace_request

#: Finished spans held for events that follow them in the queue, when the writer is backlogged.
_WINDOW = 4096
#: Events waiting for a span whose record has not arrived yet (an iteration held for its tensors).
_MAX_WAITING = 16384


class _Pending:
    """A span seen by the backend and not yet exported."""

    __slots__ = ("attrs", "end", "error", "events", "id", "link", "name", "parent", "start", "status", "tid")

    def __init__(self, record: Record, finished: bool = False) -> None:
        self.id: int = record["id"]
        self.name: str = record["name"]
        self.parent: int = record.get("parent") or 0
        self.start: int = record["ts"]
        self.tid: int = record.get("tid") or 0
        self.link: int | None = record.get("link")
        self.attrs: dict[str, AttrValue] = {}
        attrs = record.get("attrs")
        if attrs:
            flatten_attrs(attrs, self.attrs)
        self.events: list[tuple[str, int, dict[str, AttrValue]]] = []
        self.end = 0
        self.status: str = SpanStatus.OK
        self.error: str | None = None
        if finished:
            self.end = self.start + record.get("dur", 0)
            self.status = record.get("status", SpanStatus.OK)


def _within(pending: _Pending) -> list[tuple[str, int, dict[str, AttrValue]]]:
    """The span's events, their times kept inside the span.

    They happened in it; a time outside is the wall clock's re-anchoring
    between the writer's cycles (at most microseconds), not a real difference.
    """
    start, end = pending.start, pending.end
    events = pending.events
    if all(start <= ts <= end for _, ts, _ in events):
        return events
    return [(name, min(max(ts, start), end), attrs) for name, ts, attrs in events]


class Encoded:
    """A batch of spans already encoded as an ExportTraceServiceRequest."""

    __slots__ = ("count", "request")

    def __init__(self, request: bytes, count: int) -> None:
        self.request = request
        self.count = count

    def __len__(self) -> int:
        return self.count


_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class _BytesStub:
    """The trace service stub, sending a request that is already bytes unchanged."""

    def __init__(self, stub: Any, channel: Any) -> None:
        self._stub = stub
        self._raw = channel.unary_unary(_EXPORT_METHOD)  # no serializer: bytes in, bytes out

    def Export(self, request: Any, **kwargs: Any) -> Any:
        if type(request) is bytes:
            return self._raw(request, **kwargs)
        return self._stub.Export(request, **kwargs)


def make_trace_exporter(options: Mapping[str, Any]) -> tuple[Any, bool]:
    """The exporter for ``options``, and whether it takes batches we encoded ourselves.

    For gRPC it is the official exporter, taught to accept an :class:`Encoded`
    batch: the SDK's own encoder costs ~10x ours per span and would cap throughput.
    """
    base, kwargs = exporter_class(options)
    if resolve_protocol("traces", options.get("protocol")) != "grpc" or not callable(
        getattr(base, "_translate_data", None)
    ):
        return base(**kwargs), False  # the SDK's encoder
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    class PreEncodedExporter(base):  # type: ignore[misc,valid-type]
        # The exporter sets ``_client`` whenever it (re)connects; wrapping it lets
        # our bytes go out as they are instead of being parsed and serialised again.
        @property
        def _client(self) -> Any:
            return self.__dict__.get("_traintrace_client")

        @_client.setter
        def _client(self, stub: Any) -> None:
            channel = self.__dict__.get("_channel")
            wrapped = _BytesStub(stub, channel) if stub is not None and channel is not None else stub
            self.__dict__["_traintrace_client"] = wrapped

        def _translate_data(self, data: Any) -> Any:
            if isinstance(data, Encoded):
                if isinstance(self._client, _BytesStub):
                    return data.request
                return ExportTraceServiceRequest.FromString(data.request)
            return super()._translate_data(data)

    return PreEncodedExporter(**kwargs), True


class OtlpTracesBackend:
    """Exports spans to an OpenTelemetry collector as one trace per job run.

    Conversion happens on traintrace's writer thread; export on the sender's
    own thread, from a bounded queue (see :class:`Sender`). Events become span
    events, errors an ``exception`` event and status ERROR.
    """

    def __init__(
        self,
        exporter: Any = None,
        *,
        exporter_options: Mapping[str, Any] | None = None,
        verbosity: int = Verbosity.TRACING,
        service_name: str | None = None,
        resource_attributes: Mapping[str, Any] | None = None,
        max_queue: int = 65536,
        batch_size: int = 2048,
        export_interval: float = 1.0,
        close_timeout: float = 3.0,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ) -> None:
        require_otel("otlp_traces")
        self.verbosity = int(verbosity)
        if exporter is None:
            exporter, self.fast = make_trace_exporter(exporter_options or {"signal": "traces"})
        else:
            self.fast = False
        self._exporter = exporter
        self._service_name = service_name
        self._extra = dict(resource_attributes or {})
        self._queue_options = (max_queue, batch_size, export_interval, close_timeout)
        self.max_batch_bytes = max_batch_bytes
        self.close_timeout = close_timeout
        self.sender: Sender | None = None
        self.trace_id = 0
        self._salt = 0
        self._open: dict[int, _Pending] = {}
        self._done: dict[int, _Pending | Record] = {}
        self._sent: set[int] = set()
        #: span id -> (events and errors for it, the open span to fall back to), until its record comes.
        self._waiting: dict[int, tuple[list[Record], int]] = {}
        self._waiting_count = 0
        self.unattached = 0

    # -- backend protocol -------------------------------------------------
    def open(self, header: Record) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self._Event, self._ReadableSpan, self._Link = Event, ReadableSpan, Link
        self._SpanContext, self._Status, self._StatusCode = SpanContext, Status, StatusCode
        self._kind = SpanKind.INTERNAL
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        self._ok = Status(StatusCode.UNSET)
        self.resource = build_resource(header, self._service_name, self._extra)
        self._scope = scope()
        job, restart = str(header.get("job", "")), int(header.get("restart", 0))
        self.trace_id = trace_id_for(job, restart)
        self._salt = span_salt(
            job, restart, int(header.get("rank", 0)), str(header.get("host", "")), int(header.get("pid", 0))
        )
        prepare = None
        if self.fast:
            salt = self._salt
            self._encoder = SpanEncoder(self.trace_id, lambda n: span_id_for(salt, n))
            resource = resource_message(dict(self.resource.attributes))
            scope_bytes = scope_message(self._scope.name, self._scope.version or "")

            def prepare(batch: list[bytes]) -> Encoded:
                return Encoded(trace_request(resource, scope_bytes, batch), len(batch))

        max_queue, batch_size, interval, close_timeout = self._queue_options
        self.sender = Sender(
            self._exporter,
            "otlp_traces",
            max_queue=max_queue,
            batch_size=batch_size,
            export_interval=interval,
            close_timeout=close_timeout,
            success=SpanExportResult.SUCCESS,
            prepare=prepare,
            max_batch_bytes=self.max_batch_bytes,
            size_of=len if self.fast else estimated_size,
        )

    def write(self, records: Sequence[Record]) -> None:
        done, open_spans = self._done, self._open
        ended: list[int] = []
        for record in records:
            kind = record["kind"]
            if kind == RecordKind.SPAN:
                # Kept as the record itself until an event or error needs a _Pending.
                done[record["id"]] = record
                if self._waiting:
                    self._arrived(record["id"])
            elif kind == RecordKind.START:
                pending = _Pending(record)
                open_spans[pending.id] = pending
                if self._waiting:
                    self._arrived(pending.id)
            elif kind == RecordKind.END:
                found = open_spans.pop(record["id"], None)
                if found is None:
                    continue
                # Start plus the monotonic duration: the end record's wall time may be
                # derived from a later clock anchor, a few microseconds apart.
                dur = record.get("dur")
                found.end = found.start + dur if type(dur) is int else record["ts"]
                found.status = record.get("status", SpanStatus.OK)
                attrs = record.get("attrs")
                if attrs:
                    flatten_attrs(attrs, found.attrs)
                done[found.id] = found
                if self._waiting:
                    ended.append(found.id)
            elif kind in (RecordKind.EVENT, RecordKind.ERROR):
                self._attach(record)
        # Only after the whole batch: a held span's end can come just before the held
        # span that waiting events belong to (both released together), so an ended
        # span gets the waiting events only if theirs did not come with it.
        for span_id in ended:
            if self._waiting:
                self._fall_back(span_id)
        if len(done) > 2 * _WINDOW:
            # The writer is backlogged and flush() waits for an empty queue: send all
            # but the newest spans now (their events are at most a window behind).
            held = list(done.items())
            self._done = dict(held[-_WINDOW:])
            self._send([pending for _, pending in held[:-_WINDOW]])

    def _found(self, span_id: int) -> _Pending | None:
        found = self._done.get(span_id) or self._open.get(span_id)
        if found is not None and not isinstance(found, _Pending):
            found = self._done[span_id] = _Pending(found, finished=True)
        return found

    def _innermost(self, tid: Any) -> _Pending | None:
        for pending in reversed(self._open.values()):
            if pending.tid == tid:
                return pending
        return None

    def _attach(self, record: Record) -> None:
        span_id = record.get("span") or 0
        target = self._found(span_id) if span_id else None
        if target is None and span_id:
            if span_id in self._sent:
                self.unattached += 1  # its span is already on its way: too late to add to it
                return
            # Its span's record is still to come (an iteration held back until its tensors
            # are read), or never comes (a span finer than this backend's verbosity): wait
            # for it, and fall back to the thread's innermost open span when that one ends.
            if self._waiting_count < _MAX_WAITING:
                fallback = self._innermost(record.get("tid"))
                waiting = self._waiting.get(span_id)
                if waiting is None:
                    self._waiting[span_id] = ([record], fallback.id if fallback is not None else 0)
                else:
                    waiting[0].append(record)
                self._waiting_count += 1
                return
        if target is None:
            target = self._innermost(record.get("tid"))
        if target is None:
            self.unattached += 1
            return
        self._add(target, record)

    def _arrived(self, span_id: int) -> None:
        """The record of a span with waiting events arrived: they are its own."""
        waiting = self._waiting.pop(span_id, None)
        if waiting is None:
            return
        target = self._found(span_id)
        self._waiting_count -= len(waiting[0])
        for record in waiting[0]:
            if target is None:
                self.unattached += 1
            else:
                self._add(target, record)

    def _fall_back(self, ended: int) -> None:
        """Span ``ended`` ends: events whose own span never came go to it (as before they waited)."""
        for span_id, (records, fallback) in list(self._waiting.items()):
            if fallback == ended:
                del self._waiting[span_id]
                self._waiting_count -= len(records)
                target = self._found(ended)
                for record in records:
                    if target is None:
                        self.unattached += 1
                    else:
                        self._add(target, record)

    def _add(self, target: _Pending, record: Record) -> None:
        attrs: dict[str, AttrValue] = {}
        if record["kind"] == RecordKind.ERROR:
            error_type = record.get("error_type") or record.get("name", "error")
            message = record.get("message", "")
            attrs["exception.type"] = str(error_type)
            attrs["exception.message"] = str(message)
            attrs["exception.stacktrace"] = str(record.get("stack", ""))
            raw = record.get("attrs")
            if raw:
                flatten_attrs(raw, attrs)
            target.events.append(("exception", record["ts"], attrs))
            target.error = f"{error_type}: {message}" if message else str(error_type)
            return
        raw = record.get("attrs")
        if raw:
            flatten_attrs(raw, attrs)
        target.events.append((record["name"], record["ts"], attrs))

    def flush(self) -> None:
        done = self._done
        if not done or self.sender is None:
            return
        self._done = {}
        self._send(list(done.values()))
        self.sender.request_flush()  # export now rather than at the next export_interval

    def _send(self, spans: list[_Pending | Record]) -> None:
        if self.sender is None:
            return
        sent = self._sent
        if len(sent) > 4 * _WINDOW:
            sent.clear()
        out: list[Any] = []
        append = out.append
        if self.fast:
            encode, encode_record = self._encode, self._encode_record
            for span in spans:
                if type(span) is _Pending:
                    sent.add(span.id)
                    append(encode(span))
                else:
                    sent.add(span["id"])  # type: ignore[index]
                    append(encode_record(span))  # type: ignore[arg-type]
        else:
            for span in spans:
                pending = span if type(span) is _Pending else _Pending(span, finished=True)  # type: ignore[arg-type]
                sent.add(pending.id)
                append(self._convert(pending))
        self.sender.put(out)

    def _encode_record(self, record: Record) -> bytes:
        """A ``span`` record with no events, encoded without building a _Pending."""
        attrs = record.get("attrs") or {}
        if attrs and not is_flat(attrs):
            flat: dict[str, AttrValue] = {}
            flatten_attrs(attrs, flat)
            attrs = flat
        status = record.get("status", SpanStatus.OK)
        error = None
        if status != SpanStatus.OK:
            attrs = {**attrs, "traintrace.status": status}
            if status == SpanStatus.ERROR:
                error = ""
        start = record["ts"]
        return self._encoder.span(
            record["id"],
            record.get("parent") or 0,
            record["name"],
            start=start,
            end=start + record.get("dur", 0),
            attrs=attrs,
            events=(),
            link=record.get("link"),
            error=error,
            tid=record.get("tid") or 0,
        )

    def _encode(self, pending: _Pending) -> bytes:
        attrs = pending.attrs
        # An error recorded in the span (tt.error inside it) makes it ERROR whatever its ending.
        error = pending.error
        if pending.status != SpanStatus.OK:
            attrs["traintrace.status"] = pending.status
            if pending.status == SpanStatus.ERROR and error is None:
                error = ""
        return self._encoder.span(
            pending.id,
            pending.parent,
            pending.name,
            start=pending.start,
            end=pending.end,
            attrs=attrs,
            events=_within(pending),
            link=pending.link,
            error=error,
            tid=pending.tid,
        )

    def _convert(self, pending: _Pending) -> Any:
        trace_id, salt, flags, context = self.trace_id, self._salt, self._flags, self._SpanContext
        attrs = pending.attrs
        attrs["thread.id"] = pending.tid
        attrs["traintrace.span.id"] = pending.id
        status = self._ok
        if pending.status != SpanStatus.OK:
            attrs["traintrace.status"] = pending.status
        if pending.error is not None or pending.status == SpanStatus.ERROR:
            status = self._Status(self._StatusCode.ERROR, pending.error)
        links: Sequence[Any] = ()
        if pending.link:
            links = (self._Link(context(trace_id, span_id_for(salt, pending.link), False, flags)),)
        return self._ReadableSpan(
            name=pending.name,
            context=context(trace_id, span_id_for(salt, pending.id), False, flags),
            parent=context(trace_id, span_id_for(salt, pending.parent), False, flags) if pending.parent else None,
            resource=self.resource,
            attributes=attrs,
            events=[self._Event(name, attrs, ts) for name, ts, attrs in _within(pending)],
            links=links,
            kind=self._kind,
            status=status,
            start_time=pending.start,
            end_time=pending.end,
            instrumentation_scope=self._scope,
        )

    def _send_rest(self) -> None:
        # Spans still open here were never ended; the pipeline ends them before closing.
        for records, _ in self._waiting.values():
            self.unattached += len(records)
        self._waiting.clear()
        self._waiting_count = 0
        self.flush()

    def begin_close(self, deadline: float | None = None) -> None:
        """Send the rest now, without waiting; stop by ``deadline`` (``time.monotonic()``)."""
        self._send_rest()
        if self.sender is not None:
            self.sender.begin_close(deadline)

    def settle(self) -> None:
        """Wait until all is sent or the deadline passes (the rest counted as abandoned)."""
        if self.sender is not None:
            self.sender.settle()

    def close(self) -> None:
        self._send_rest()
        if self.sender is not None:
            self.sender.close()

    def losses(self) -> dict[str, int]:
        """Spans lost so far, by reason: ``queue_full``, ``failed``, ``abandoned``."""
        return self.sender.losses() if self.sender is not None else {}

    def stats(self) -> dict[str, int]:
        """Exported, dropped (queue full), failed (collector), abandoned (at close), queued."""
        out = self.sender.stats() if self.sender is not None else {}
        out["unattached_events"] = self.unattached
        return out
