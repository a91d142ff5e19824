"""traintrace._scan, the command's JSON-lines scanner, against ``json.loads`` as the truth.

For any bytes, every line the scanner converts itself must be valid JSON whose values ``json.loads``
reads the same (kind, name, status as text; ids, times and durations as 64-bit integers; attrs as
the same object; step and batch_size of plain iterations; the rare fields of headers, errors,
thread names and drop notes); every line ``json.loads`` rejects must be left to DuckDB's reader
(``deferred``), byte for byte. Well-formed records (what traintrace and well-behaved writers produce,
in any key order, with escapes and any Unicode) must be converted, not left. Duplicate keys are read
as DuckDB reads them: the first one counts. A crash in C ends the test run, which is the point.
"""

from __future__ import annotations

import gc
import json
import os
import random
import time
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._examples import examples

scan = pytest.importorskip("traintrace._scan")
#: The scanner reads alike whatever core records (TRAINTRACE_PURE does not reach it).
pytestmark = pytest.mark.once
duckdb = pytest.importorskip("duckdb")

from traintrace._format import SQL_COLUMNS  # noqa: E402
from traintrace.cli._engine import CORE_COLUMNS, RARE_FIELDS, RARE_KINDS  # noqa: E402
from traintrace.cli._reader import scan_fields  # noqa: E402

INT64 = (-(2**63), 2**63 - 1)
TEXT_FIELDS = [k for k in CORE_COLUMNS if SQL_COLUMNS[k] == "VARCHAR"]
INT_FIELDS = [k for k in CORE_COLUMNS if SQL_COLUMNS[k] == "BIGINT"]
RARE_TEXT = [k for k in RARE_FIELDS if SQL_COLUMNS[k] == "VARCHAR"]
RARE_INT = [k for k in RARE_FIELDS if SQL_COLUMNS[k] == "BIGINT"]
SETTINGS = settings(
    max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def scanner(paths: list[Path], *, lean: bool = False, threads: int = 1, chunk_size: int = 4 << 20) -> Any:
    return scan.Scanner(
        [str(p) for p in paths],
        scan_fields(CORE_COLUMNS),
        "span",
        "iteration",
        ("step", "batch_size"),
        RARE_KINDS,
        lean=lean,
        threads=threads,
        chunk_size=chunk_size,
    )


@cache
def _connection() -> Any:
    """One DuckDB database for the module: opening one costs 25 to 50 ms, most of a property test's example."""
    return duckdb.connect()


def read(s: Any) -> list[tuple[Any, ...]]:
    """Every row of the scanner's stream, read by DuckDB (an Arrow C stream consumer)."""
    con = _connection()
    con.register("scanned", s)
    try:
        rows: list[tuple[Any, ...]] = con.execute("SELECT * FROM scanned").fetchall()
    finally:
        con.unregister("scanned")
    return rows


def first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object as DuckDB's reader sees it: of a key given twice, the first value."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


def loads(line: bytes) -> Any:
    """The line as json.loads reads it (strict UTF-8, first key wins); raises ValueError when it is not JSON."""
    return json.loads(line.decode("utf-8"), object_pairs_hook=first_wins)


def model(record: dict[str, Any], file: int, *, lean: bool) -> tuple[Any, ...] | None:
    """The row the scanner gives for a record (None: no row, the record has no kind); values as read back."""
    kind = record.get("kind")
    if kind is None:
        return None
    plain = kind == "span" and record.get("name") == "iteration"
    attrs = record.get("attrs")
    row: list[Any] = [file]
    for name in CORE_COLUMNS:
        value = record.get(name)
        if name == "attrs":
            row.append(None if value is None or (lean and plain) else ("attrs", value))
        else:
            row.append(value)
    row.append(attrs.get("step") if plain and isinstance(attrs, dict) else None)
    row.append(attrs.get("batch_size") if plain and isinstance(attrs, dict) else None)
    if kind in RARE_KINDS:
        row.append(("rare", {k: record[k] for k in RARE_FIELDS if record.get(k) is not None}))
    else:
        row.append(None)
    return tuple(row)


def normalised(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A row read back, with attrs and rare parsed as the model holds them."""
    out = list(row)
    attrs_at = 1 + CORE_COLUMNS.index("attrs")
    if out[attrs_at] is not None:
        out[attrs_at] = ("attrs", loads(out[attrs_at].encode()))
    if out[-1] is not None:
        out[-1] = ("rare", loads(out[-1].encode()))
    return tuple(out)


def key(row: tuple[Any, ...]) -> str:
    return json.dumps(row, sort_keys=True, default=str)


def check_file(path: Path, *, lean: bool, must_convert: set[bytes] = frozenset(), **kwargs: Any) -> Any:  # type: ignore[assignment]
    """Scan one file and check every line against json.loads; returns the scanner."""
    s = scanner([path], lean=lean, **kwargs)
    rows = read(s)
    deferred = s.deferred().get(0, b"")
    assert deferred == b"" or deferred.endswith(b"\n")
    left = Counter(deferred.split(b"\n")[:-1])
    content = path.read_bytes()
    if content.startswith(b"\xef\xbb\xbf"):
        content = content[3:]
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    expected: list[tuple[Any, ...]] = []
    for line in lines:
        if left[line] > 0:
            left[line] -= 1
            assert line not in must_convert, ("a well-formed line was left to DuckDB", line)
            continue
        if not line.strip(b" \t\r"):
            continue  # a blank line: no record
        try:
            record = loads(line)
        except ValueError:
            raise AssertionError(("a line json.loads rejects was converted", line)) from None
        assert isinstance(record, dict), line
        row = model(record, 0, lean=lean)
        if row is not None:
            expected.append(row)
    assert +left == Counter(), ("deferred lines that are not lines of the file", +left)
    assert sorted(map(key, map(normalised, rows))) == sorted(map(key, expected))
    assert s.rows == len(rows)
    return s


# ------------------------------------------------------------------ strategies

texts = st.text(max_size=12) | st.sampled_from(["span", "iteration", "ok", "header", "error", "é", "😀", 'a"b\\c'])
int64s = st.integers(*INT64)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
attrs_values = st.dictionaries(
    st.sampled_from(["step", "batch_size", "loss", "lr", "x"]) | st.text(max_size=6),
    st.none() | int64s | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6) | json_values,
    max_size=5,
)


@st.composite
def records(draw: st.DrawFn, *, well_formed: bool) -> dict[str, Any]:
    """A record of the format (any subset of its fields, any order, extra fields); well-formed: typed as the
    format says (text, 64-bit integers, attrs an object with integer step and batch_size)."""
    record: dict[str, Any] = {}
    kinds = st.sampled_from(["span", "start", "end", "event", "header", "error", "thread", "dropped", "close"])
    if draw(st.booleans()) or well_formed:
        record["kind"] = draw(kinds | texts)
    if draw(st.booleans()):
        record["name"] = draw(st.sampled_from(["iteration", "forward", "checkpoint_save_sync"]) | texts)
    for name in TEXT_FIELDS + RARE_TEXT:
        if name not in record and draw(st.integers(0, 3)) == 0:
            record[name] = draw(st.none() | texts)
    for name in INT_FIELDS + RARE_INT:
        if draw(st.integers(0, 2)) == 0:
            record[name] = draw(st.none() | int64s)
    if draw(st.booleans()):
        attrs = draw(attrs_values)
        if well_formed:
            for name in ("step", "batch_size"):
                if name in attrs:
                    attrs[name] = draw(st.none() | int64s)
        record["attrs"] = attrs
    if not well_formed:
        for name in draw(st.lists(st.sampled_from([*INT_FIELDS, *TEXT_FIELDS, "attrs", *RARE_FIELDS]), max_size=3)):
            record[name] = draw(json_values)
    for name in draw(st.lists(st.text(max_size=6), max_size=3)):
        if not (well_formed and name in SQL_COLUMNS):  # a field of the format is typed above
            record.setdefault(name, draw(json_values))
    order = draw(st.permutations(list(record)))
    return {k: record[k] for k in order}


def dump(record: dict[str, Any], rnd: random.Random) -> bytes:
    """A JSON line as some writer writes it: compact or spaced, ASCII-escaped or not."""
    separators = rnd.choice([(",", ":"), (", ", ": "), (" ,", " : ")])
    text = json.dumps(record, ensure_ascii=rnd.random() < 0.5, separators=separators)
    return text.encode("utf-8")


def hostile(line: bytes, rnd: random.Random) -> bytes:
    """The line damaged: cut, a byte flipped or inserted (NUL, invalid UTF-8, a quote, a brace), a lone surrogate,
    a duplicated key, trailing garbage."""
    choice = rnd.randrange(8)
    at = rnd.randrange(len(line) + 1)
    if choice == 0:
        return line[:at]
    if choice == 1:
        return line[:at] + bytes([rnd.choice([0, 0xFF, 0xC0, 0xED, 0x22, 0x7B, 0x7D, 0x5C, 0x09, 0x20])]) + line[at:]
    if choice == 2 and line:
        return line[:at] + bytes([rnd.randrange(256)]) + line[at + 1 :]
    if choice == 3:
        return line.replace(b'"}', b'\\ud800"}', 1)
    if choice == 4:
        return line.replace(b"{", b'{"kind":"span",', 1)
    if choice == 5:
        return line + rnd.choice([b" x", b"}", b",", b" {}", b"\x00", b"\r"])
    if choice == 6:
        return line.replace(b":", rnd.choice([b': 1.5e3, "x":', b': Infinity, "y":', b': NaN, "z":']), 1)
    return line.replace(b"1", b"1.0", 1)


# ------------------------------------------------------------------ properties


@SETTINGS
@given(
    batch=st.lists(records(well_formed=True), max_size=25), rnd=st.randoms(use_true_random=False), lean=st.booleans()
)
def test_well_formed_records_are_read_as_json_loads_reads_them(
    tmp_path: Path, batch: list[dict[str, Any]], rnd: random.Random, lean: bool
) -> None:
    """Records typed as the format says, in any key order, escaped or raw Unicode: converted (none left to
    DuckDB), every value as json.loads reads it."""
    lines = [dump(r, rnd) for r in batch]
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    s = check_file(path, lean=lean, must_convert=set(lines))
    assert s.deferred_lines == 0


@SETTINGS
@given(
    batch=st.lists(records(well_formed=False), max_size=20), rnd=st.randoms(use_true_random=False), lean=st.booleans()
)
def test_any_record_is_converted_right_or_left_to_duckdb(
    tmp_path: Path, batch: list[dict[str, Any]], rnd: random.Random, lean: bool
) -> None:
    """Fields of any JSON type (floats where integers belong, numbers where text belongs, nested values, huge
    integers), some lines damaged: what is converted equals json.loads; what json.loads rejects is left."""
    lines = [dump(r, rnd) for r in batch]
    lines = [hostile(line, rnd) if rnd.random() < 0.4 else line for line in lines]
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(b"\n".join(lines) + rnd.choice([b"\n", b""]))
    check_file(path, lean=lean)


@SETTINGS
@given(data=st.binary(max_size=300), lean=st.booleans())
def test_arbitrary_bytes_never_crash_and_never_make_up_a_record(tmp_path: Path, data: bytes, lean: bool) -> None:
    """Random bytes (NULs, invalid UTF-8, half a record): nothing json.loads rejects becomes a row."""
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(data)
    check_file(path, lean=lean)


@SETTINGS
@given(
    batch=st.lists(records(well_formed=False), min_size=1, max_size=30),
    rnd=st.randoms(use_true_random=False),
    chunk_size=st.integers(1, 200),
    threads=st.integers(1, 4),
)
def test_chunks_and_threads_do_not_change_what_is_read(
    tmp_path: Path, batch: list[dict[str, Any]], rnd: random.Random, chunk_size: int, threads: int
) -> None:
    """A file cut into chunks of any size (down to one byte), read by several threads: the same rows and the same
    deferred lines, in file order, as one chunk read by one thread."""
    lines = [hostile(dump(r, rnd), rnd) if rnd.random() < 0.3 else dump(r, rnd) for r in batch]
    paths = []
    for i in range(2):
        path = tmp_path / f"rank{i}.jsonl"
        path.write_bytes(b"\n".join(lines[i::2]) + (b"\n" if i else b""))
        paths.append(path)
    one = scanner(paths)
    many = scanner(paths, threads=threads, chunk_size=chunk_size)
    assert sorted(map(key, read(one))) == sorted(map(key, read(many)))
    assert one.deferred() == many.deferred()
    check_file(paths[0], lean=False, threads=threads, chunk_size=chunk_size)


# ------------------------------------------------------------------ examples


near_keys = st.sampled_from(["name", "names", "nam", "n\\u0061me", "kind", "kinds", "stat", "status", "id", "ids", "x"])


@SETTINGS
@given(
    base=records(well_formed=True),
    changes=st.lists(st.tuples(st.integers(0, 12), near_keys, json_values), max_size=12),
    rnd=st.randoms(use_true_random=False),
    lean=st.booleans(),
)
def test_lines_that_repeat_a_key_order_are_read_key_by_key(
    tmp_path: Path, base: dict[str, Any], changes: list[tuple[int, str, Any]], rnd: random.Random, lean: bool
) -> None:
    """The scanner expects each line's keys in the previous line's order: lines of one key order, some with a key
    at a position replaced by one that starts like the expected one, extends it, or spells it with an escape."""
    base_line = json.dumps(base, separators=(",", ":")).encode()
    lines = [base_line, base_line]
    well_formed = {base_line}
    for position, near, value in changes:
        items = list(base.items())
        if not items:
            break
        at = position % len(items)
        key_text = json.dumps(near).replace("\\\\u", "\\u")
        parts = [json.dumps(k) + ":" + json.dumps(v) for k, v in items]
        parts[at] = key_text + ":" + json.dumps(value)
        line = ("{" + ",".join(parts) + "}").encode()
        lines += [line, base_line]
        spelled = json.loads(key_text)
        if spelled not in SQL_COLUMNS and spelled not in base:  # a key of no field, once: as well-formed
            well_formed.add(line)
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    check_file(path, lean=lean, must_convert=well_formed)


near_attr_keys = st.sampled_from(
    ["step", "steps", "ste", "st\\u0065p", "batch_size", "batch_sizes", "batch_siz", "b\\u0061tch_size", "loss", "x"]
)
attr_values = st.integers(-5, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | json_values


@SETTINGS
@given(
    attrs=st.lists(st.tuples(st.sampled_from(["step", "batch_size", "loss", "lr", "x" * 45]), attr_values), max_size=6),
    changes=st.lists(st.tuples(st.integers(0, 8), near_attr_keys, attr_values), max_size=10),
    lean=st.booleans(),
)
def test_iterations_that_repeat_an_attrs_key_order_are_read_key_by_key(
    tmp_path: Path, attrs: list[tuple[str, Any]], changes: list[tuple[int, str, Any]], lean: bool
) -> None:
    """attrs' keys are expected in the previous line's order too: plain iterations of one attrs key order (keys
    twice, a key longer than any compared), some with a key at a position replaced by one that starts like the
    expected one, extends it, or spells it with an escape; each read as json.loads and DuckDB's cast read it."""
    head = '{"kind":"span","name":"iteration","ts":1,"dur":2,"attrs":{'

    def line(parts: list[str]) -> bytes:
        return (head + ",".join(parts) + "}}").encode()

    parts = [json.dumps(k) + ":" + json.dumps(v) for k, v in attrs]
    base_line = line(parts)
    lines = [base_line, base_line]
    for position, near, value in changes:
        changed = list(parts) or [""]
        changed[position % len(changed)] = json.dumps(near).replace("\\\\u", "\\u") + ":" + json.dumps(value)
        lines += [line([p for p in changed if p]), base_line]
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    plain = all(type(v) is int and 0 <= v < 2**63 for k, v in attrs if k in ("step", "batch_size"))
    check_file(path, lean=lean, must_convert={base_line} if plain else set())


def test_what_duckdb_decides_is_left_to_it(tmp_path: Path) -> None:
    """Values whose conversion is DuckDB's (a float duration rounds half to even, a number in a text field, an
    escaped key, a key twice, NaN, a lone surrogate, a cut line) are left, byte for byte; the rest is converted."""
    left = [
        b'{"kind":"span","dur":2.5}',
        b'{"kind":5}',
        b'{"k\\u0069nd":"span"}',
        b'{"kind":"span","kind":"event"}',
        b'{"kind":"span","name":"iteration","attrs":{"step":"7"}}',
        b'{"kind":"span","name":"iteration","attrs":{"step":1.0}}',
        b'{"kind":"event","attrs":{"x":NaN}}',
        b'{"kind":"span","name":"iteration","attrs":{"loss":Infinity}}',  # json.dumps(inf); not JSON
        b'{"kind":"x\\ud800"}',
        b'{"kind":"span","ts":12',
        b'{"kind":"span","ts":9223372036854775808}',
        b'{"kind":"span"} {"kind":"end"}',
    ]
    kept = [
        b'{"kind":"event","attrs":{"step":"7"}}',  # step is read from plain iterations only
        b'  {"ts":-9223372036854775808,"kind":"span","name":"iteration","attrs":{"step":3,"step":"x"}}\r',
        b'{"kind":"sp\\u0061n","name":"it\\u00e9ration","message":"\\ud83d\\ude00"}',
        b'{"kind":"header","rank":0,"host":"h\\"1","schema_version":1,"job":null}',
    ]
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(kept[:2] + left + kept[2:]) + b"\n\n   \n")
    s = check_file(path, lean=False, must_convert=set(kept))
    assert s.deferred()[0] == b"".join(line + b"\n" for line in left)
    rows = {(r[1], r[4]): r for r in read(scanner([path]))}
    plain = rows["span", "iteration"]
    assert plain[2] == -(2**63) and plain[-3] == 3  # the first step counts, as in DuckDB
    assert plain[1 + CORE_COLUMNS.index("attrs")] == '{"step":3,"step":"x"}'  # attrs as written
    assert ("span", "itération") in rows  # escapes decoded
    assert json.loads(rows["header", None][-1]) == {"rank": 0, "host": 'h"1', "schema_version": 1}


def test_a_lean_read_keeps_no_attrs_of_plain_iterations(tmp_path: Path) -> None:
    """lean: a plain iteration keeps step and batch_size, not its attrs text; other records keep theirs."""
    path = tmp_path / "rank0.jsonl"
    path.write_text(
        '{"kind":"span","name":"iteration","attrs":{"step":4,"batch_size":32,"loss":0.5}}\n'
        '{"kind":"span","name":"forward","attrs":{"step":4,"batch_size":32}}\n'
    )
    other, plain = sorted(read(scanner([path], lean=True)), key=lambda r: r[4])
    attrs_at = 1 + CORE_COLUMNS.index("attrs")
    assert plain[4] == "iteration" and plain[attrs_at] is None and plain[-3:] == (4, 32, None)
    assert other[attrs_at] == '{"step":4,"batch_size":32}' and other[-3:] == (None, None, None)


def test_many_distinct_names_and_long_lines(tmp_path: Path) -> None:
    """Thousands of distinct names (the dictionary grows) and a line of a megabyte, across chunk borders."""
    path = tmp_path / "rank0.jsonl"
    lines = [json.dumps({"kind": "span", "name": f"n{i}", "dur": i}) for i in range(5000)]
    lines.insert(2500, json.dumps({"kind": "event", "attrs": {"blob": "x" * 1_000_000}}))
    path.write_text("\n".join(lines) + "\n")
    s = scanner([path], threads=3, chunk_size=65536)
    rows = read(s)
    assert len(rows) == 5001 and s.deferred_lines == 0
    assert {r[4] for r in rows if r[1] == "span"} == {f"n{i}" for i in range(5000)}
    assert max(len(r[1 + CORE_COLUMNS.index("attrs")] or "") for r in rows) > 1_000_000


def test_each_file_is_read_once_and_the_stream_taken_once(tmp_path: Path) -> None:
    """One chunk per small file: every byte read once. A second stream would read the files again: refused."""
    paths = []
    for i in range(3):
        path = tmp_path / f"rank{i}.jsonl"
        path.write_text("".join(json.dumps({"kind": "span", "seq": n, "dur": 1}) + "\n" for n in range(100 + i)))
        paths.append(path)
    s = scanner(paths)
    assert len(read(s)) == 303
    assert s.bytes_read == sum(p.stat().st_size for p in paths)
    with pytest.raises(RuntimeError, match="once"):
        s.__arrow_c_stream__()
    assert [r[0] for r in read(scanner(paths[1:]))].count(1) == 102  # file numbers are places in the list


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_started_early_the_stream_gives_the_same_rows_and_an_unread_scanner_stops(tmp_path: Path) -> None:
    """start() reads ahead on the workers (the engine calls it before DuckDB is imported): the stream then gives
    the rows a scanner started by its stream gives. A scanner started and dropped unread stops its workers
    (they wait for room no reader makes), and a vanished file still fails the stream."""
    paths = []
    for i in range(4):
        path = tmp_path / f"rank{i}.jsonl"
        path.write_text(
            "".join(
                json.dumps({"kind": "span", "name": "iteration", "seq": n, "ts": n, "dur": i, "attrs": {"step": n}})
                + "\n"
                for n in range(3000)
            )
        )
        paths.append(path)
    expected = sorted(read(scanner(paths, lean=True, threads=3, chunk_size=4096)))
    early = scanner(paths, lean=True, threads=3, chunk_size=4096)
    before = _threads()
    early.start()
    early.start()  # once
    assert _threads() == before + 3
    time.sleep(0.2)  # the workers fill their window and wait
    assert sorted(read(early)) == expected and len(expected) == 12000
    with pytest.raises(RuntimeError, match="once"):
        early.start()

    for _ in range(3):
        dropped = scanner(paths, threads=2, chunk_size=4096)
        dropped.start()
        time.sleep(0.05)
        del dropped
        gc.collect()
    assert _threads() == before

    gone = tmp_path / "gone.jsonl"
    gone.write_text('{"kind":"span"}\n' * 10)
    s = scanner([gone], threads=2)
    gone.unlink()
    s.start()
    with pytest.raises(OSError, match=r"gone\.jsonl"):
        s._drain()


def test_an_unread_stream_has_no_deferred_lines_and_bad_paths_raise(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text('{"kind":\n')
    s = scanner([path])
    with pytest.raises(RuntimeError, match="did not complete"):
        s.deferred()
    assert s._drain() == 0 and s.deferred() == {0: b'{"kind":\n'}
    with pytest.raises(OSError):
        scanner([tmp_path / "missing.jsonl"])
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert read(scanner([empty, path])) == []


def test_a_file_that_vanishes_fails_the_stream(tmp_path: Path) -> None:
    """The file removed between listing and reading: the stream ends with the OS error (the engine then lets
    DuckDB's reader report it), never a crash."""
    path = tmp_path / "rank0.jsonl"
    path.write_text('{"kind":"span"}\n' * 10)
    s = scanner([path])
    path.unlink()
    with pytest.raises(OSError, match=r"rank0\.jsonl"):
        s._drain()
