"""A direct OTLP/protobuf encoder for spans: the same bytes the SDK's encoder makes, ~10x faster.

The SDK builds a ReadableSpan and then a protobuf object per span, attribute
and value (about 40 µs a span on a busy machine), which caps one Python
process at some 20,000 spans a second. Here a span goes from traintrace's
record straight to wire-format bytes, with the per-name and per-key pieces
cached. Field numbers are those of opentelemetry/proto/trace/v1/trace.proto.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

_pack_q = struct.Struct("<Q").pack  # fixed64
_pack_d = struct.Struct("<d").pack  # double
_pack_id = struct.Struct(">Q").pack  # span ids are big-endian bytes
_MASK64 = (1 << 64) - 1


_SMALL = [bytes((i,)) for i in range(128)]


def varint(value: int) -> bytes:
    """Protobuf base-128 varint; negative ints as their 64-bit two's complement."""
    if 0 <= value < 0x80:
        return _SMALL[value]
    if 0 < value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    value &= _MASK64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + varint(len(payload)) + payload


# Tags: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited).
_T1, _T2, _T3, _T4, _T5 = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a"
_SPAN_KIND_INTERNAL = b"\x30\x01"
_START, _END = b"\x39", b"\x41"
_SPAN_ATTR, _SPAN_EVENT, _SPAN_LINK, _SPAN_STATUS = b"\x4a", b"\x5a", b"\x6a", b"\x7a"
_EVENT_TIME = b"\x09"
_STATUS_ERROR = b"\x18\x02"


def any_value(value: Any) -> bytes:
    """An AnyValue message (str, bool, int, float, or a tuple of one of those)."""
    kind = type(value)
    if kind is str:
        return field(_T1, value.encode("utf-8", "surrogatepass"))
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        return b"\x18" + varint(value)
    if kind is float:
        return b"\x21" + _pack_d(value)
    if kind is tuple or kind is list:
        return field(b"\x2a", b"".join([field(_T1, any_value(v)) for v in value]))
    return field(_T1, str(value).encode("utf-8", "surrogatepass"))


class _Keys(dict[str, bytes]):
    """Encoded ``key`` fields of KeyValue, cached (attribute keys repeat endlessly)."""

    def __missing__(self, key: str) -> bytes:
        encoded = field(_T1, key.encode("utf-8", "surrogatepass"))
        if len(self) < 4096:
            self[key] = encoded
        return encoded


_keys = _Keys()


def key_values(tag: bytes, attrs: Mapping[str, Any]) -> bytes:
    """Repeated KeyValue fields under ``tag`` (attributes of a span, event or resource)."""
    keys = _keys
    small = _SMALL
    parts: list[bytes] = []
    append = parts.append
    for key, value in attrs.items():
        kind = type(value)
        if kind is float:
            body = keys[key] + b"\x12\x09\x21" + _pack_d(value)
        elif kind is int and 0 <= value < 0x80:
            body = keys[key] + b"\x12\x02\x18" + small[value]
        else:
            body = keys[key] + field(_T2, any_value(value))
        size = len(body)
        append(tag + (small[size] if size < 0x80 else varint(size)) + body)
    return b"".join(parts)


_SPAN_ID_KEY = field(_T1, b"traintrace.span.id")
#: Attributes every span gets from its own fields (``thread.id``, ``traintrace.span.id``): a user's of the same
#: name is left out.
_RESERVED_ATTRS = frozenset(("thread.id", "traintrace.span.id"))


class SpanEncoder:
    """Encodes the spans of one process: one trace id, span ids derived from a salt."""

    def __init__(self, trace_id: int, span_id: Any) -> None:
        self._trace_field = _T1 + b"\x10" + trace_id.to_bytes(16, "big")
        self._trace_bytes = trace_id.to_bytes(16, "big")
        self._span_id = span_id
        self._prefixes: dict[tuple[str, int, int], bytes] = {}

    def _prefix(self, name: str, parent: int, tid: int) -> bytes:
        parent_field = b"\x22\x08" + _pack_id(self._span_id(parent)) if parent else b""
        name_field = field(_T5, name.encode("utf-8", "surrogatepass"))
        thread = key_values(_SPAN_ATTR, {"thread.id": tid})
        return self._trace_field + parent_field + name_field + _SPAN_KIND_INTERNAL + thread

    def span(
        self,
        span_id: int,
        parent: int,
        name: str,
        *,
        start: int,
        end: int,
        attrs: Mapping[str, Any],
        events: Sequence[tuple[str, int, Mapping[str, Any]]],
        link: int | None,
        error: str | None,
        tid: int = 0,
    ) -> bytes:
        """One Span message. ``events`` are (name, time, attributes); ``error`` sets status ERROR.

        Adds the attributes ``thread.id`` (``tid``) and ``traintrace.span.id`` (``span_id``).
        """
        derive = self._span_id
        # Fields may come in any order: what repeats (trace, parent, name, kind,
        # thread) is one cached prefix per (name, parent, thread).
        key = (name, parent, tid)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefix(name, parent, tid)
            if len(self._prefixes) >= 4096:
                self._prefixes.clear()
            self._prefixes[key] = prefix
        span_field = b"\x12\x08" + _pack_id(derive(span_id))
        body = _SPAN_ID_KEY + field(_T2, b"\x18" + varint(span_id))
        parts = [
            prefix,
            span_field,
            _START + _pack_q(start) + _END + _pack_q(end),
            _SPAN_ATTR + _SMALL[len(body)] + body,
        ]
        if attrs:
            if "thread.id" in attrs or "traintrace.span.id" in attrs:
                # The span's own values win, as in the SDK's span: a decoder keeps the last of a repeated key.
                attrs = {k: v for k, v in attrs.items() if k not in _RESERVED_ATTRS}
            parts.append(key_values(_SPAN_ATTR, attrs))
        for event_name, time, event_attrs in events:
            body = _EVENT_TIME + _pack_q(time) + field(_T2, event_name.encode("utf-8", "surrogatepass"))
            if event_attrs:
                body += key_values(_T3, event_attrs)
            parts.append(_SPAN_EVENT + varint(len(body)) + body)
        if link:
            body = field(_T1, self._trace_bytes) + field(_T2, _pack_id(derive(link)))
            parts.append(field(_SPAN_LINK, body))
        if error is not None:
            body = field(_T2, error.encode("utf-8", "surrogatepass")) + _STATUS_ERROR
            parts.append(field(_SPAN_STATUS, body))
        return b"".join(parts)


def scope_message(name: str, version: str) -> bytes:
    """An InstrumentationScope message."""
    return field(_T1, name.encode()) + field(_T2, version.encode())


def resource_message(attrs: Mapping[str, Any]) -> bytes:
    """A Resource message."""
    return key_values(_T1, attrs)


def trace_request(resource: bytes, scope: bytes, spans: Sequence[bytes]) -> bytes:
    """An ExportTraceServiceRequest holding ``spans`` (encoded Span messages)."""
    scope_spans = field(_T1, scope) + b"".join([field(_T2, span) for span in spans])
    resource_spans = field(_T1, resource) + field(_T2, scope_spans)
    return field(_T1, resource_spans)
