"""The key=value line format and its parser."""

from __future__ import annotations

import string

from hypothesis import given
from hypothesis import strategies as st

from traintrace.logfmt import clean_key, format_line, format_value, parse_line, typed_value

KEY_ALPHABET = string.ascii_letters + string.digits + "_.-:/"
keys = st.text(alphabet=KEY_ALPHABET, min_size=1, max_size=20)


@given(st.dictionaries(keys, st.text(max_size=50), max_size=8))
def test_round_trip_of_strings(pairs: dict[str, str]) -> None:
    """parse_line(format_line(d)) == d for valid keys and any string values."""
    line = format_line(pairs)
    assert "\n" not in line
    assert parse_line(line) == pairs


@given(st.dictionaries(st.text(max_size=20), st.text(max_size=30), max_size=6))
def test_any_keys_give_one_parseable_line(pairs: dict[str, str]) -> None:
    """Any key becomes a clean key; the line stays one line and parses."""
    line = format_line(pairs)
    assert "\n" not in line and "\r" not in line
    parsed = parse_line(line)
    cleaned = {}
    for key, value in pairs.items():
        cleaned[clean_key(key)] = value
    assert parsed == cleaned


@given(st.text(max_size=200))
def test_parser_never_raises(line: str) -> None:
    """Arbitrary input parses to some dict of strings."""
    result = parse_line(line)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in result.items())


def test_typed_values() -> None:
    """Numbers, booleans and null come back typed."""
    line = format_line({"i": 3, "f": 0.25, "t": True, "n": None, "s": "x y"})
    assert line == 'i=3 f=0.25 t=true n=null s="x y"'
    parsed = {k: typed_value(v) for k, v in parse_line(line).items()}
    assert parsed == {"i": 3, "f": 0.25, "t": True, "n": None, "s": "x y"}


def test_escapes() -> None:
    """Quotes, backslashes, newlines, control characters and = are escaped."""
    assert format_value('a"b') == '"a\\"b"'
    assert format_value("a\\b") == '"a\\\\b"'
    assert format_value("a\nb") == '"a\\nb"'
    assert format_value("\x01") == '"\\u0001"'
    assert format_value("a=b") == '"a=b"'
    assert format_value("") == '""'
    assert format_value("ü") == '"ü"'


def test_nested_mappings_flatten_with_dots() -> None:
    """Nested dicts become dotted keys; lists become comma-joined values."""
    assert format_line({"a": {"b": {"c": 1}}, "l": [1, 2]}) == "a.b.c=1 l=1,2"


def test_reads_other_writers_lines() -> None:
    """Bare keys and extra spaces from other logfmt writers are accepted."""
    assert parse_line('  flag   k=v  msg="hi there" ') == {"flag": "true", "k": "v", "msg": "hi there"}
    assert parse_line('k="unterminated') == {"k": "unterminated"}
