"""Records as key=value (or JSON) lines through a standard ``logging`` logger."""

from __future__ import annotations

import datetime as _dt
import logging
import re
from collections.abc import Sequence
from typing import Any

from .. import logfmt
from .._names import RecordKind, Verbosity
from .._serialize import dumps
from ._base import Record

_LEVELS = {
    RecordKind.ERROR: logging.ERROR,
    RecordKind.DROPPED: logging.WARNING,
}
# Fields written first, in this order; the rest follow.
_LEADING = ("kind", "name", "job", "rank")


def iso_time(ts_ns: int) -> str:
    """Epoch nanoseconds as local ISO-8601 with offset, microsecond precision."""
    moment = _dt.datetime.fromtimestamp(ts_ns / 1e9, tz=_dt.timezone.utc).astimezone()
    return moment.isoformat(timespec="microseconds")


def to_line_fields(record: Record, identity: dict[str, Any]) -> dict[str, Any]:
    """The flat fields of a record's log line (attrs flattened as ``key=`` pairs)."""
    out: dict[str, Any] = {"ts": iso_time(int(record.get("ts") or 0))}
    out["kind"] = record.get("kind")
    if "name" in record:
        out["name"] = record["name"]
    out.update(identity)
    for key, value in record.items():
        if key in ("ts", "kind", "name", "attrs"):
            continue
        if key == "dur":
            out["dur_ms"] = round(value / 1e6, 6)
            continue
        out[key] = value
    attrs = record.get("attrs")
    if attrs:
        for key, value in attrs.items():
            out[key if key not in out else f"attr.{key}"] = value
    return out


_MESSAGE_CHARS = 300


def _without_stack(record: Record) -> Record:
    """An error record for a log line: the stack's innermost frame instead of the stack."""
    out = {key: value for key, value in record.items() if key != "stack"}
    frames = re.findall(r'File "([^"]+)", line (\d+)', str(record.get("stack") or ""))
    if frames:
        file, line = frames[-1]
        out["at"] = f"{file.rsplit('/', 1)[-1]}:{line}"
    message = out.get("message")
    if isinstance(message, str) and len(message) > _MESSAGE_CHARS:
        out["message"] = message[:_MESSAGE_CHARS] + "…"
    return out


class LogBackend:
    """Emits every record as one log line on the writer thread.

    The line format is :mod:`traintrace.logfmt` (``format="kv"``) or one JSON
    object (``format="json"``). Errors log at ERROR, drops at WARNING, the rest
    at INFO. Each line carries ``job`` and ``rank``, as log lines are often read
    without the stream's header. An error's stack is left to the file (an
    exception the user catches must not print kilobytes): the line names the
    innermost frame as ``at=file:line``, unless ``stacks=True``.
    """

    def __init__(
        self,
        logger: str | logging.Logger = "traintrace.records",
        *,
        format: str = "kv",  # noqa: A002 - the natural name for the setting
        verbosity: int = Verbosity.INFO,
        stacks: bool = False,
    ) -> None:
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.format = format
        self.verbosity = int(verbosity)
        self.stacks = stacks
        self._identity: dict[str, Any] = {}

    def open(self, header: Record) -> None:
        self._identity = {"job": header.get("job"), "rank": header.get("rank")}
        self.write([header])

    def write(self, records: Sequence[Record]) -> None:
        logger = self.logger
        if not logger.isEnabledFor(logging.ERROR):
            return
        info_enabled = logger.isEnabledFor(logging.INFO)
        for original in records:
            level = _LEVELS.get(original.get("kind", ""), logging.INFO)
            if level == logging.INFO and not info_enabled:
                continue
            record = _without_stack(original) if "stack" in original and not self.stacks else original
            if self.format == "json":
                line = dumps(dict(record)).decode("utf-8", "replace")
            else:
                line = logfmt.format_line(to_line_fields(record, self._identity))
            logger.log(level, line)

    def flush(self) -> None:
        for handler in self.logger.handlers:
            handler.flush()

    def close(self) -> None:
        self.flush()
