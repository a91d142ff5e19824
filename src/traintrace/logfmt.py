"""The key=value ("logfmt") line format used by the log backend, and its parser.

Format, for each pair, separated by one space::

    key=value

* A key keeps the characters ``A-Z a-z 0-9 _ . - : /``; any other character
  becomes ``_`` (an empty key becomes ``_``).
* A value is written bare when it is non-empty and made only of printable
  ASCII other than space, ``"``, ``=`` and ``\\``. Otherwise it is quoted:
  ``"..."`` with ``\\"``, ``\\\\``, ``\\n``, ``\\r``, ``\\t`` and ``\\uXXXX``
  for other control characters. Non-ASCII text is kept, quoted.
* ``True``/``False`` are ``true``/``false``, ``None`` is ``null``, floats use
  Python's shortest round-tripping form, and nested mappings are flattened
  with dotted keys (``a.b=1``).

:func:`parse_line` reads such a line back into a dict of strings:
``parse_line(format_line(d)) == d`` for any dict ``d`` of valid keys to
strings. It also reads lines of other logfmt writers (bare keys become
``"true"``) and never raises on malformed input.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["clean_key", "format_line", "format_value", "parse_line", "typed_value"]

_KEY_BAD = re.compile(r"[^A-Za-z0-9_.\-:/]")
_BARE_OK = re.compile(r"[!#-<>-\[\]-~]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_UNESCAPES = {'"': '"', "\\": "\\", "n": "\n", "r": "\r", "t": "\t", "/": "/"}


def clean_key(key: str) -> str:
    """``key`` with every character outside the key alphabet replaced by ``_``."""
    return _KEY_BAD.sub("_", key) or "_"


def _quote(text: str) -> str:
    out = ['"']
    for char in text:
        escaped = _ESCAPES.get(char)
        if escaped is not None:
            out.append(escaped)
        elif char < " " or char == "\x7f":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def format_value(value: Any) -> str:
    """One value in its key=value form."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int | float):
        return repr(value)
    text = value if isinstance(value, str) else str(value)
    if _BARE_OK.fullmatch(text):
        return text
    return _quote(text)


def _flatten(prefix: str, mapping: Mapping[Any, Any], out: list[str]) -> None:
    for key, value in mapping.items():
        name = f"{prefix}{clean_key(str(key))}"
        if isinstance(value, Mapping):
            _flatten(name + ".", value, out)
        elif isinstance(value, list | tuple):
            out.append(f"{name}={format_value(','.join(map(str, value)))}")
        else:
            out.append(f"{name}={format_value(value)}")


def format_line(pairs: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> str:
    """A mapping (or sequence of pairs) as one key=value line, with no newline."""
    out: list[str] = []
    mapping = pairs if isinstance(pairs, Mapping) else dict(pairs)
    _flatten("", mapping, out)
    return " ".join(out)


def parse_line(line: str) -> dict[str, str]:
    """Read one key=value line into a dict of strings. Never raises."""
    result: dict[str, str] = {}
    index, length = 0, len(line)
    while index < length:
        while index < length and line[index] == " ":
            index += 1
        if index >= length:
            break
        start = index
        while index < length and line[index] not in " =":
            index += 1
        key = line[start:index]
        if index >= length or line[index] == " ":
            if key:
                result[key] = "true"
            continue
        index += 1  # the '='
        if index < length and line[index] == '"':
            value, index = _read_quoted(line, index + 1)
        else:
            start = index
            while index < length and line[index] != " ":
                index += 1
            value = line[start:index]
        if key:
            result[key] = value
    return result


def _read_quoted(line: str, index: int) -> tuple[str, int]:
    out: list[str] = []
    length = len(line)
    while index < length:
        char = line[index]
        if char == '"':
            return "".join(out), index + 1
        if char == "\\" and index + 1 < length:
            nxt = line[index + 1]
            if nxt == "u" and _is_hex(line[index + 2 : index + 6]):
                out.append(chr(int(line[index + 2 : index + 6], 16)))
                index += 6
                continue
            out.append(_UNESCAPES.get(nxt, "\\" + nxt))
            index += 2
            continue
        out.append(char)
        index += 1
    return "".join(out), index


def _is_hex(text: str) -> bool:
    return len(text) == 4 and all(c in "0123456789abcdefABCDEF" for c in text)


def typed_value(text: str) -> Any:
    """Best-effort conversion of a parsed value: ints, floats, booleans, null."""
    if text == "true":
        return True
    if text == "false":
        return False
    if text == "null":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
