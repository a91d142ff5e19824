"""JSON encoding of records: orjson when installed, the standard library otherwise."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ENCODER", "dumps", "dumps_lines"]


def _std_dumps(record: Any) -> bytes:
    text = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates cannot be UTF-8; escaped as \udXXX the line stays valid JSON.
        return json.dumps(record, separators=(",", ":"), allow_nan=False).encode("ascii")


def _pick() -> tuple[str, Callable[[Any], bytes]]:
    try:
        import orjson
    except ImportError:
        return "json", _std_dumps

    def _orjson_dumps(record: Any) -> bytes:
        try:
            return orjson.dumps(record)
        except TypeError:
            # orjson refuses lone surrogates and >64-bit ints, which json handles.
            return _std_dumps(record)

    return "orjson", _orjson_dumps


ENCODER, dumps = _pick()


def _line_or_note(record: Any) -> bytes:
    """One record as a JSON line; a record that cannot be encoded becomes a ``dropped`` note saying why."""
    try:
        return dumps(record) + b"\n"
    except BaseException as exc:  # noqa: BLE001 - one bad record must not lose its batch
        try:
            seq = record.get("seq")
            why = f"{type(exc).__name__}: {exc}"[:512]
        except BaseException:  # noqa: BLE001
            seq, why = None, type(exc).__name__
        note = {"seq": seq if type(seq) is int else None, "kind": "dropped", "ts": 0, "count": 1}
        note.update(reason="unencodable", error=why)
        try:
            note["ts"] = int(record["ts"])
        except BaseException:  # noqa: BLE001
            pass
        return _std_dumps(note) + b"\n"


def _make_dumps_lines() -> Callable[[Sequence[Any]], bytes]:
    try:
        import orjson
    except ImportError:

        def _std_lines(records: Sequence[Any]) -> bytes:
            try:
                return b"".join([_std_dumps(record) + b"\n" for record in records])
            except BaseException:  # noqa: BLE001 - isolate the bad record
                return b"".join([_line_or_note(record) for record in records])

        return _std_lines
    option = orjson.OPT_APPEND_NEWLINE
    fast = orjson.dumps

    def _orjson_lines(records: Sequence[Any]) -> bytes:
        try:
            return b"".join([fast(record, option=option) for record in records])
        except BaseException:  # noqa: BLE001 - per record, so one bad one costs only itself
            return b"".join([_line_or_note(record) for record in records])

    return _orjson_lines


#: All records of a batch as JSON lines, each ending with a newline.
dumps_lines = _make_dumps_lines()
