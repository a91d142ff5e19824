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


def _make_dumps_lines() -> Callable[[Sequence[Any]], bytes]:
    try:
        import orjson
    except ImportError:

        def _std_lines(records: Sequence[Any]) -> bytes:
            return b"".join([_std_dumps(record) + b"\n" for record in records])

        return _std_lines
    option = orjson.OPT_APPEND_NEWLINE
    fast = orjson.dumps

    def _orjson_lines(records: Sequence[Any]) -> bytes:
        try:
            return b"".join([fast(record, option=option) for record in records])
        except TypeError:
            return b"".join([dumps(record) + b"\n" for record in records])

    return _orjson_lines


#: All records of a batch as JSON lines, each ending with a newline.
dumps_lines = _make_dumps_lines()
