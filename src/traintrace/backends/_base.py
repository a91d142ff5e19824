"""The backend protocol: what the writer thread calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Record = Mapping[str, Any]


@runtime_checkable
class Backend(Protocol):
    """Receives records on traintrace's writer thread, never the caller's.

    ``records`` are plain dicts in the v1 record format (docs/format.md); a
    backend must not change them. ``open`` is called once, at ``configure()``,
    where an exception becomes a configuration error; after that an exception
    from ``write`` or ``flush`` is logged, counted, and the batch is dropped for
    that backend only. ``verbosity`` (0 error .. 4 profiling) may be set as an
    attribute; records above it are not passed.
    """

    def open(self, header: Record) -> None:
        """Start a stream; ``header`` is the stream's identity record."""

    def write(self, records: Sequence[Record]) -> None:
        """Take a batch of records, in sequence order."""

    def flush(self) -> None:
        """Make what was written durable (or visible) now."""

    def close(self) -> None:
        """Flush and release resources. Called once."""


@runtime_checkable
class SpanListener(Protocol):
    """A backend that must act on the caller's thread (NVTX ranges, for instance).

    Called synchronously from ``start``/``stop``: keep these to a few hundred
    nanoseconds and never raise.
    """

    def span_started(self, span: Any) -> None: ...

    def span_stopped(self, span: Any) -> None: ...


class BaseBackend:
    """A convenient base with no-op methods; override what you need."""

    verbosity: int = 4

    def open(self, header: Record) -> None:
        return None

    def write(self, records: Sequence[Record]) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None
