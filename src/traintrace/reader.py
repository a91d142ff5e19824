"""Reading traintrace streams back: tolerant of truncated and corrupt lines.

>>> from traintrace.reader import read_file
>>> result = read_file("traintrace_logs/job/rank0.jsonl")   # doctest: +SKIP
>>> result.spans("iteration")                               # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._format import CHECKED_TYPES, FAULTS_MARKER, SCHEMA, SCHEMA_VERSION

__all__ = ["BadLine", "Stream", "StreamFile", "iter_lines", "read_file"]

#: Lines longer than this are reported as bad without being parsed.
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass
class BadLine:
    """A line that could not be read as a record."""

    path: str
    line_number: int
    reason: str
    last: bool = False


@dataclass
class Stream:
    """The records of one process (one header and what follows it)."""

    header: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def closed_cleanly(self) -> bool:
        return bool(self.records) and self.records[-1].get("kind") == "close"

    def gaps(self) -> list[tuple[int, int]]:
        """Ranges of sequence numbers missing from the stream, as (first, last)."""
        seqs = sorted(r["seq"] for r in self.records if isinstance(r.get("seq"), int))
        out: list[tuple[int, int]] = []
        previous = self.header.get("seq", 0)
        for seq in seqs:
            if seq > previous + 1:
                out.append((previous + 1, seq - 1))
            previous = max(previous, seq)
        return out

    def spans(self, name: str | None = None) -> list[dict[str, Any]]:
        """Spans as single records: complete ones, and start/end pairs merged.

        A span that started but never ended is returned with ``status``
        ``"open"`` and no ``dur``.
        """
        out: list[dict[str, Any]] = []
        starts: dict[int, dict[str, Any]] = {}
        for record in self.records:
            kind = record.get("kind")
            if kind == "span":
                out.append(record)
            elif kind == "start":
                starts[record.get("id", 0)] = record
            elif kind == "end":
                start = starts.pop(record.get("id", 0), None)
                if start is None:
                    continue
                merged = {**start, "kind": "span", "dur": record.get("dur"), "status": record.get("status")}
                attrs = {**start.get("attrs", {}), **record.get("attrs", {})}
                if attrs:
                    merged["attrs"] = attrs
                out.append(merged)
        for start in starts.values():
            out.append({**start, "kind": "span", "status": "open"})
        return [s for s in out if name is None or s.get("name") == name]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kind]


@dataclass
class StreamFile:
    """Everything read from one file: its streams (one per process start) and bad lines."""

    path: str
    streams: list[Stream] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)
    orphans: int = 0
    #: Python stacks written on a fatal signal (segfault, abort), from ``<path>.faults.txt``.
    faults: str = ""

    @property
    def truncated(self) -> bool:
        """True when the file's last line is cut (the process died while writing it)."""
        return bool(self.bad_lines) and self.bad_lines[-1].last

    def spans(self, name: str | None = None) -> list[dict[str, Any]]:
        return [s for stream in self.streams for s in stream.spans(name)]

    def records(self) -> list[dict[str, Any]]:
        return [r for stream in self.streams for r in stream.records]


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes | None, str]]:
    """(line number, raw line or None, problem) for each line; huge lines are skipped."""
    with Path(path).open("rb") as handle:
        number = 0
        while True:
            raw = handle.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                del raw
                skipped = b"-"
                while skipped and not skipped.endswith(b"\n"):
                    skipped = handle.readline(1 << 20)  # skip the rest in small pieces
                yield number, None, f"line longer than {MAX_LINE_BYTES} bytes"
                continue
            yield number, raw, ""


def read_file(path: str | os.PathLike[str]) -> StreamFile:
    """Read a JSON-lines file written by traintrace. Never raises on bad content."""
    result = StreamFile(str(path))
    current: Stream | None = None
    last_number = 0
    for number, raw, problem in iter_lines(path):
        last_number = number
        if raw is None:
            result.bad_lines.append(BadLine(str(path), number, problem))
            continue
        text = raw.strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            result.bad_lines.append(BadLine(str(path), number, f"not JSON: {exc}"[:200]))
            continue
        except RecursionError:
            result.bad_lines.append(BadLine(str(path), number, "not JSON: nested too deeply"))
            continue
        shape = _shape_problem(record)
        if shape:
            result.bad_lines.append(BadLine(str(path), number, shape))
            continue
        if record["kind"] == "header":
            version = record.get("schema_version")
            if record.get("schema") != SCHEMA or version != SCHEMA_VERSION:
                result.bad_lines.append(
                    BadLine(str(path), number, f"unsupported schema {record.get('schema')!r} v{version}")
                )
                current = None
                continue
            current = Stream(record)
            result.streams.append(current)
            continue
        if current is None:
            result.orphans += 1
            continue
        current.records.append(record)
    for bad in result.bad_lines:
        bad.last = bad.line_number == last_number
    result.faults = _read_faults(path)
    return result


#: Fields whose type the reader relies on, and the types they must have (``_format.FIELDS``).
_FIELD_TYPES = CHECKED_TYPES


def _shape_problem(record: object) -> str:
    """Why ``record`` is not a usable record, or "" when it is."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return "not a traintrace record (no 'kind')"
    seq = record.get("seq")
    if seq is not None and (type(seq) is not int or seq < 0):
        return f"bad 'seq': {str(seq)[:40]!r}"
    for key, kinds in _FIELD_TYPES.items():
        value = record.get(key)
        if value is not None and (type(value) is bool or not isinstance(value, kinds)):
            return f"bad {key!r}: expected {kinds[0].__name__}, got {type(value).__name__}"
    return ""


#: At most this much of a fault file is read.
MAX_FAULTS_BYTES = 1024 * 1024


def _read_faults(path: str | os.PathLike[str]) -> str:
    from ._faults import faults_path

    try:
        with faults_path(path).open("rb") as handle:
            data = handle.read(MAX_FAULTS_BYTES)
    except OSError:
        return ""
    # The lines that say which process wrote what follows (``FAULTS_MARKER``) are not stacks.
    text = data.decode("utf-8", "replace")
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(FAULTS_MARKER))
