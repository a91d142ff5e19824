"""An in-memory backend for users' tests."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .._names import RecordKind, Verbosity
from ._base import Record


class MemoryBackend:
    """Keeps every record in a list. Call ``traintrace.flush()`` before reading.

    >>> memory = MemoryBackend()
    >>> traintrace.configure(backends=[], extra_backends=[memory])  # doctest: +SKIP
    >>> memory.spans("iteration")  # doctest: +SKIP
    """

    def __init__(self, verbosity: int = Verbosity.PROFILING) -> None:
        self.verbosity = int(verbosity)
        self.header: dict[str, Any] | None = None
        self.records: list[dict[str, Any]] = []
        self.closed = False
        self._lock = threading.Lock()

    def open(self, header: Record) -> None:
        self.header = dict(header)

    def write(self, records: Sequence[Record]) -> None:
        with self._lock:
            self.records.extend(dict(r) for r in records)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def clear(self) -> None:
        with self._lock:
            self.records.clear()

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.records if r.get("kind") in kinds]

    def spans(self, name: str | None = None) -> list[dict[str, Any]]:
        """Finished spans (complete records, and start records merged with their end)."""
        with self._lock:
            records = list(self.records)
        starts: dict[int, dict[str, Any]] = {}
        out: list[dict[str, Any]] = []
        for record in records:
            kind = record.get("kind")
            if kind == RecordKind.SPAN:
                out.append(record)
            elif kind == RecordKind.START:
                starts[record["id"]] = record
            elif kind == RecordKind.END:
                start = starts.pop(record["id"], None)
                if start is not None:
                    merged = {**start, **record, "kind": RecordKind.SPAN, "ts": start["ts"]}
                    attrs = {**start.get("attrs", {}), **record.get("attrs", {})}
                    if attrs:
                        merged["attrs"] = attrs
                    merged["seq"] = start["seq"]
                    out.append(merged)
        return [r for r in out if name is None or r.get("name") == name]

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.of_kind(RecordKind.EVENT) if name is None or r.get("name") == name]

    def errors(self) -> list[dict[str, Any]]:
        return self.of_kind(RecordKind.ERROR)
