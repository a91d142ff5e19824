"""JSON encoding of records: orjson when installed, the standard library otherwise."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["ENCODER", "dumps"]


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
