"""Turning whatever a user passes as a metric into bounded, JSON-safe data.

Runs on the writer thread, never on the caller's. The limits are part of the
record format (docs/format.md, "Values").
"""

from __future__ import annotations

import datetime as _dt
import enum
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Final

MAX_STRING: Final = 4096
MAX_KEY: Final = 256
MAX_ITEMS: Final = 256
MAX_DEPTH: Final = 6
MAX_NODES: Final = 4096
#: Integers at least this large (in magnitude) are written as a float (or a note when they overflow one):
#: JSON readers lose precision beyond 2**63 and Python cannot print one over 4,300 digits.
MAX_INT: Final = 2**64
TRUNCATION_MARK: Final = "…[+{} chars]"

_ATOMIC = (str, int, float, bool, type(None))

#: Decides whether a key names a secret (``Redactor.secret``); its value is then not converted.
Secret = Callable[[str], bool] | None
REDACTED: Final = "<redacted>"


def clip_text(text: str, limit: int = MAX_STRING) -> str:
    """Cut ``text`` to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + TRUNCATION_MARK.format(len(text) - limit)


def bound_key(key: object) -> str:
    """A metric key as a bounded string (``logfmt.clean_key`` is the log line's key alphabet)."""
    text = key if isinstance(key, str) else _safe_str(key)
    return clip_text(text, MAX_KEY)


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except BaseException:  # noqa: BLE001 - a user's __str__ may raise anything
        return f"<unprintable {type(value).__name__}>"


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except BaseException:  # noqa: BLE001 - a user's __repr__ may raise anything
        return f"<unrepresentable {type(value).__name__}>"


def _float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _big_int(value: int) -> float | str:
    """An integer too large for JSON readers: a float, or a note when it overflows one."""
    try:
        return float(value)
    except OverflowError:
        return f"<integer of {value.bit_length()} bits>"


def _scalar_from_array(value: Any) -> Any:
    """numpy scalars, 0-d arrays and 0-d/1-element torch tensors, as Python numbers."""
    try:
        size = value.size() if callable(getattr(value, "size", None)) else value.size
        numel = value.numel() if hasattr(value, "numel") else int(size)
    except BaseException:  # noqa: BLE001
        return _MISSING
    if numel == 1:
        try:
            return value.item()
        except BaseException:  # noqa: BLE001
            return _MISSING
    return _MISSING


_MISSING: Final = object()


def _cut_array(value: Any) -> Any:
    """An array (numpy, torch) cut to what a record keeps *before* it is converted.

    Each axis keeps at most MAX_ITEMS entries and all of them at most MAX_NODES / 2
    elements, by slicing (a view: nothing is copied), so a 1e8-element array
    costs the writer 256 conversions, not 1e8 (and gigabytes) while it holds the GIL.
    """
    try:
        shape = [int(n) for n in value.shape]
    except BaseException:  # noqa: BLE001
        return value
    if not shape:
        return value
    limits = [min(n, MAX_ITEMS) for n in shape]
    total = 1
    for n in limits:
        total *= n
    while total > MAX_NODES // 2:  # room left for the lists that hold them
        axis = limits.index(max(limits))
        total //= limits[axis]
        limits[axis] = max(1, limits[axis] // 2)
        total *= limits[axis]
    if limits == shape:
        return value
    try:
        return value[tuple(slice(0, n) for n in limits)]
    except BaseException:  # noqa: BLE001 - not sliceable: convert as it is
        return value


def to_jsonable(value: Any, secret: Secret = None) -> Any:
    """Return a JSON-safe, size-bounded copy of ``value``. Never raises.

    With ``secret``, the value of every mapping key it names (at any depth, in
    lists too) is ``"<redacted>"``; the key is judged before it is cut to size.
    """
    return _guarded(value, 0, [MAX_NODES], secret)


def _guarded(value: Any, depth: int, budget: list[int], secret: Secret = None) -> Any:
    try:
        return _convert(value, depth, budget, secret)
    except BaseException:  # noqa: BLE001 - the point is that nothing escapes
        return f"<unconvertible {type(value).__name__}>"


def _convert(value: Any, depth: int, budget: list[int], secret: Secret = None) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        return "<truncated>"
    kind = type(value)
    if kind is str:
        return clip_text(value)
    if kind is bool or value is None:
        return value
    if kind is int:
        return value if -MAX_INT < value < MAX_INT else _big_int(value)
    if kind is float:
        return _float(value)
    if isinstance(value, enum.Enum):
        return _convert(value.value, depth, budget, secret)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        number = int(value)
        return number if -MAX_INT < number < MAX_INT else _big_int(number)
    if isinstance(value, float):
        return _float(float(value))
    if isinstance(value, str):
        return clip_text(str(value))
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value[: MAX_STRING // 2])
        text = raw.hex()
        extra = len(value) - len(raw)
        return text + (TRUNCATION_MARK.format(extra * 2) if extra > 0 else "")
    if isinstance(value, os.PathLike):
        return clip_text(_safe_str(os.fspath(value)))
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    if depth >= MAX_DEPTH:
        return clip_text(f"<too deep: {type(value).__name__}>")
    if isinstance(value, Mapping):
        return _convert_mapping(value, depth + 1, budget, secret)
    if isinstance(value, list | tuple):
        return [_guarded(item, depth + 1, budget, secret) for item in value[:MAX_ITEMS]]
    if isinstance(value, set | frozenset):
        items = [_guarded(item, depth + 1, budget) for item in list(value)[:MAX_ITEMS]]
        return sorted(items, key=_safe_repr)
    if hasattr(value, "item") and (hasattr(value, "numel") or hasattr(value, "size")):
        scalar = _scalar_from_array(value)
        if scalar is not _MISSING:
            return _convert(scalar, depth, budget)
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        try:
            listed = _cut_array(value).tolist()
        except BaseException:  # noqa: BLE001
            listed = _MISSING
        if listed is not _MISSING and not hasattr(listed, "tolist"):
            return _convert(listed, depth, budget, secret)
    if isinstance(value, complex):
        return clip_text(_safe_str(value))
    return clip_text(_safe_repr(value))


def convert_mapping(value: Mapping[Any, Any], secret: Secret = None) -> dict[str, Any]:
    """A mapping as a dict of string keys to JSON-safe values (at most MAX_ITEMS keys).

    ``secret``: as for :func:`to_jsonable`.
    """
    return _convert_mapping(value, 0, [MAX_NODES], secret)


def _convert_mapping(value: Mapping[Any, Any], depth: int, budget: list[int], secret: Secret = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        items = list(value.items())
    except BaseException:  # noqa: BLE001 - a broken mapping becomes a note, not a crash
        return {"<unreadable>": _safe_repr(type(value))}
    for index, (key, item) in enumerate(items):
        if index >= MAX_ITEMS:
            out["…"] = f"{len(items) - MAX_ITEMS} more keys dropped"
            break
        if secret is None:
            out[bound_key(key)] = _guarded(item, depth, budget)
            continue
        text = key if isinstance(key, str) else _safe_str(key)
        out[clip_text(text, MAX_KEY)] = REDACTED if secret(text) else _guarded(item, depth, budget, secret)
    return out
