"""Hostile input: property tests on every public function, and corrupt files for the reader.

No exception may reach the caller except ConfigError from configure(); every
record written must validate against record-v1.schema.json; the reader must
never raise on content and must keep its memory bounded.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import itertools
import json
import logging
import os
import threading
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import traintrace as tt
from tests._examples import examples
from tests._reliability import schema_errors
from traintrace._config import resolve_path
from traintrace._identity import Identity
from traintrace.backends import MemoryBackend
from traintrace.reader import MAX_LINE_BYTES, read_file

EXAMPLES = int(os.environ.get("RELIAB_FUZZ_EXAMPLES", str(examples(120))))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
_files = itertools.count()


class Nasty:
    """An object whose every conversion raises (while the operations run; hypothesis must
    still be able to print it when it reports an example)."""

    hostile = False

    def __repr__(self) -> str:
        if Nasty.hostile:
            raise RuntimeError("no repr")
        return "Nasty()"

    def __str__(self) -> str:
        if Nasty.hostile:
            raise RuntimeError("no str")
        return "Nasty()"

    def __bool__(self) -> bool:
        if Nasty.hostile:
            raise RuntimeError("no truth")
        return True

    def __hash__(self) -> int:
        return 7


class NastyMapping(dict):  # type: ignore[type-arg]
    """A mapping whose items() raises."""

    def items(self) -> Any:
        if Nasty.hostile:
            raise RuntimeError("no items")
        return super().items()

    def keys(self) -> Any:
        if Nasty.hostile:
            raise RuntimeError("no keys")
        return super().keys()


keys = st.one_of(
    st.text(max_size=40),
    st.integers(),
    st.tuples(st.integers()),
    st.just(Nasty()),
    st.sampled_from(["password", "hf_token", "tokens_per_second", "loss", "apiKey", "x" * 300]),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**64, max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=60),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.binary(max_size=20),
    st.datetimes(),
    st.timedeltas(),
    st.complex_numbers(),
    st.sampled_from(list(tt.CheckPointType)),
    st.just(Nasty()),
    st.just(Path("/tmp/x")),
    st.just("y" * 5000),
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(keys, inner, max_size=4)
        | st.tuples(inner, inner)
        | st.frozensets(st.integers(), max_size=4)
    ),
    max_leaves=12,
)
metrics = st.one_of(
    st.none(),
    st.dictionaries(keys, values, max_size=6),
    st.lists(values, max_size=2),
    st.integers(),
    st.text(max_size=4),
    st.just(Nasty()),
    st.just(NastyMapping(a=1)),
)
names = st.one_of(st.text(max_size=80), st.integers(), st.none(), st.just(Nasty()), st.just("n" * 1000))
levels = st.one_of(st.sampled_from([0, 1, 3, 4]), st.integers(-3, 9), st.text(max_size=3), st.just(Nasty()))
HELPERS = [
    "training_iteration",
    "forward",
    "backward",
    "checkpoint_save",
    "validation",
    "application",
    "timed_span",
]

ops = st.one_of(
    st.tuples(st.just("span"), names, metrics, levels, metrics),
    st.tuples(st.just("helper"), st.sampled_from(HELPERS), metrics),
    st.tuples(st.just("iteration"), st.one_of(st.integers(), st.text(max_size=3), st.none()), metrics),
    st.tuples(st.just("start"), names, metrics, levels),
    st.tuples(st.just("stop"), st.integers(0, 5), metrics, st.one_of(st.none(), st.text(max_size=5))),
    st.tuples(st.just("stop_garbage"), st.one_of(st.integers(), st.none(), st.text(max_size=3))),
    st.tuples(st.just("event"), names, metrics, levels),
    st.tuples(
        st.just("error"),
        st.one_of(st.none(), st.text(max_size=20), st.just(ValueError("v")), st.just(Nasty())),
        metrics,
    ),
    st.tuples(st.just("raise"), names),
    st.tuples(st.just("metric_sets"), st.dictionaries(st.sampled_from(["loss", "step", "x", "rank"]), values)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("current")),
    st.tuples(st.just("close")),
)


def _run_op(op: tuple[Any, ...], handles: list[tt.Span]) -> None:
    Nasty.hostile = True
    try:
        _run_op_hostile(op, handles)
    finally:
        Nasty.hostile = False


def _run_op_hostile(op: tuple[Any, ...], handles: list[tt.Span]) -> None:
    kind = op[0]
    if kind == "span":
        with tt.span(op[1], op[2], level=op[3]) as s:
            s.add_metrics(op[4] if isinstance(op[4], dict) else None)
            s.event("inner", op[4])
    elif kind == "helper":
        with getattr(tt, HELPERS[HELPERS.index(op[1])])(op[2]) if op[1] != "timed_span" else tt.timed_span("t", op[2]):
            pass
    elif kind == "iteration":
        with tt.training_iteration(op[1], op[2]) as it:
            it.add_metrics(loss=0.1)
    elif kind == "start":
        handles.append(tt.start(op[1], op[2], level=op[3]))
    elif kind == "stop":
        if handles:
            tt.stop(handles[op[1] % len(handles)], op[2], status=op[3])
    elif kind == "stop_garbage":
        tt.stop(op[1])  # type: ignore[arg-type]
    elif kind == "event":
        tt.event(op[1], op[2], level=op[3])
    elif kind == "error":
        tt.error(op[1], op[2])
    elif kind == "raise":
        try:
            with tt.span(op[1]):
                raise KeyError("expected")
        except KeyError:
            pass
    elif kind == "metric_sets":
        extra = {k: v for k, v in op[1].items() if k not in ("rank",)}
        tt.event("m", tt.IterationMetrics.create(current_iteration=1, **extra))
        tt.event("m", tt.CustomMetrics.create(**op[1]))
    elif kind == "flush":
        tt.flush(1.0)
    elif kind == "current":
        tt.current_span()
    elif kind == "close":
        tt.close()


def _configure(tmp: Path, name: str, memory: MemoryBackend) -> tuple[Path, io.StringIO]:
    stream = io.StringIO()
    logger = logging.getLogger("traintrace.fuzz.records")
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    tt.configure(
        job_id="fuzz",
        log_dir=str(tmp),
        backends={"file": {"path": name}, "log": {"logger": logger.name, "verbosity": "profiling"}},
        extra_backends=[memory],
        flush_interval=0.01,
        handle_sigterm=False,
    )
    return tmp / name, stream


def _check_outputs(path: Path, memory: MemoryBackend, log_text: str) -> None:
    assert memory.header is not None
    assert not schema_errors([memory.header, *memory.records])
    closes = memory.of_kind("close")
    assert len(closes) == 1 and "backend_failures" not in closes[0], closes
    result = read_file(path)
    assert not result.bad_lines and len(result.streams) == 1
    assert len(result.streams[0].records) == len(memory.records)
    for record in memory.records:
        attrs = record.get("attrs") or {}
        for secret in ("password", "hf_token", "apiKey"):
            if secret in attrs:
                assert attrs[secret] == "<redacted>"
    assert "Traceback" not in log_text or "KeyError: 'expected'" in log_text or "ValueError" in log_text


@FUZZ
@given(sequence=st.lists(ops, max_size=25))
def test_public_api_never_raises_and_writes_valid_records(tmp_path: Path, sequence: list[Any]) -> None:
    """Random names, metric values and structures through every recording function, in random
    (mis)use order: nothing raises, every record validates, every backend took every record."""
    memory = MemoryBackend()
    path, log_text = _configure(tmp_path, f"f{next(_files)}.jsonl", memory)
    handles: list[tt.Span] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in sequence:
            _run_op(op, handles)
        tt.close()
    _check_outputs(path, memory, log_text.getvalue())


@settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
@given(sequences=st.lists(st.lists(ops, max_size=15), min_size=3, max_size=3))
def test_misuse_from_several_threads(tmp_path: Path, sequences: list[list[Any]]) -> None:
    """Three threads run random operations at once, stopping each other's spans: nothing raises
    in any thread, and the stream is valid."""
    memory = MemoryBackend()
    path, log_text = _configure(tmp_path, f"t{next(_files)}.jsonl", memory)
    shared: list[tt.Span] = []
    failures: list[BaseException] = []
    barrier = threading.Barrier(3)

    def work(sequence: list[Any]) -> None:
        try:
            barrier.wait(5)
            for op in sequence:
                if op[0] != "close":
                    _run_op(op, shared)
        except BaseException as exc:
            failures.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=work, args=(s,)) for s in sequences]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        tt.close()
    assert failures == []
    _check_outputs(path, memory, log_text.getvalue())


config_fields = [f.name for f in dataclasses.fields(tt.Config) if f.name not in ("log_dir", "backends")]
any_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


@FUZZ
@given(
    chosen=st.dictionaries(st.sampled_from(config_fields) | st.text(max_size=8), any_value, max_size=5),
    file_settings=st.dictionaries(
        st.sampled_from(["verbosity", "ranks", "file_mode", "enabled", "verbosity_elsewhere", "fsync_on_close"]),
        any_value,
        max_size=3,
    ),
)
def test_configure_raises_only_config_error(
    tmp_path: Path, chosen: dict[str, Any], file_settings: dict[str, Any]
) -> None:
    """configure() with random settings either works or raises ConfigError naming a field."""
    chosen.pop("handle_sigterm", None)  # keep the test process's own SIGTERM handling
    try:
        tt.configure(
            log_dir=str(tmp_path),
            backends={"file": {**file_settings, "path": f"c{next(_files)}.jsonl"}, "log": False},
            **chosen,
        )
    except tt.ConfigError as exc:
        assert str(exc)
        return
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tt.event("after", {"x": 1})
            tt.close()


@pytest.mark.parametrize("name", ["flush_interval", "close_timeout"])
@pytest.mark.parametrize("value", [1e300, float("inf"), float("nan"), 0, -1])
def test_out_of_range_intervals_are_config_errors(tmp_path: Path, name: str, value: float) -> None:
    """An interval a thread cannot wait for (infinite, huge, NaN) is refused at configure(),
    not found later as a dead writer thread or an OverflowError in close()."""
    with pytest.raises(tt.ConfigError, match=name):
        tt.configure(log_dir=str(tmp_path), backends={"log": False}, **{name: value})


_SECONDS_FIELDS = [
    "flush_interval",
    "close_timeout",
    "hang_timeout",
    "hang_check_interval",
    "device_sample_interval",
    "hang_exit_after",
    "peak_tflops",
]
_bad_seconds = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-9, 1e300, -1.0, 2**70])


@FUZZ
@given(name=st.sampled_from(_SECONDS_FIELDS), value=_bad_seconds)
def test_every_interval_and_timeout_refuses_nan_infinity_and_busy_loops(
    tmp_path: Path, name: str, value: float
) -> None:
    """NaN, infinity, 1e-9 (a busy loop), 1e300 or a negative value for any interval or timeout
    is a ConfigError naming the field (issue 17, item 9: NaN timeouts raised ValueError,
    device_sample_interval=inf killed the sampler thread)."""
    if name == "peak_tflops" and value in (1e-9, 1e300, 2**70):
        value = -1.0  # any finite positive peak is valid
    with pytest.raises(tt.ConfigError, match=name):
        tt.configure(log_dir=str(tmp_path), backends={"log": False}, **{name: value})
    with pytest.raises(tt.ConfigError, match="phase_timeouts"):
        tt.configure(log_dir=str(tmp_path), backends={"log": False}, phase_timeouts={"validation": value})


@FUZZ
@given(template=st.text(alphabet=st.sampled_from("ab/{}\x00._-job"), min_size=1, max_size=20))
def test_path_templates_give_a_stream_or_a_config_error(tmp_path: Path, template: str) -> None:
    """Any template (NUL characters, unbalanced braces, unknown placeholders) either makes a
    stream or raises ConfigError naming backends.file.path (not ValueError)."""
    try:
        tt.configure(job_id="t", log_dir=str(tmp_path / "logs"), backends={"file": {"path": template}, "log": False})
    except tt.ConfigError as exc:
        assert "backends.file" in str(exc)
    finally:
        tt.close()


def test_a_nul_in_log_dir_and_a_huge_world_are_config_errors(tmp_path: Path) -> None:
    """A NUL in log_dir, world_size=2**70 (a MemoryError before): ConfigError naming them."""
    with pytest.raises(tt.ConfigError, match="log_dir"):
        tt.configure(log_dir=str(tmp_path) + "/a\x00b")
    with pytest.raises(tt.ConfigError, match="world_size"):
        tt.configure(log_dir=str(tmp_path), world_size=2**70, rank=0)


def test_a_rank_range_far_beyond_the_world_costs_nothing(tmp_path: Path) -> None:
    """``ranks="0-99999999"`` (minutes and 10 GB before): selects rank 0 at once, using a few
    kilobytes; a selector also works on a world of the maximum size."""
    from traintrace._config import MAX_WORLD_SIZE, parse_ranks, rank_selected

    tracemalloc.start()
    try:
        tt.configure(job_id="r", log_dir=str(tmp_path), backends={"file": {"ranks": "0-99999999"}, "log": False})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        tt.close()
    assert peak < 20_000_000
    assert (tmp_path / "r" / "rank0.jsonl").exists()
    assert rank_selected("0-99999999", MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE)
    assert not rank_selected("2-99999999,-1", 1, 10) and rank_selected("-1", 9, 10)
    assert parse_ranks("5-99999999", 8) == {5, 6, 7}


class _NoStr:
    def __str__(self) -> str:
        raise RuntimeError("no str")

    __repr__ = __str__


@FUZZ
@given(
    name=st.one_of(st.text(max_size=10), st.just(_NoStr()), st.lists(st.integers(), max_size=2)),
    t0=st.one_of(st.integers(-(10**12), 10**12), st.none(), st.text(max_size=3), st.floats()),
    t1=st.one_of(st.integers(-(10**12), 10**12), st.none(), st.floats(allow_nan=False, allow_infinity=False)),
    level=st.one_of(st.integers(-5, 50), st.text(max_size=4), st.none()),
    metrics=st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=4), st.integers(), max_size=3)),
    status=st.one_of(st.text(max_size=8), st.integers(), st.none()),
)
def test_record_span_and_span_never_raise_and_write_valid_records(  # noqa: PLR0917 - one per strategy
    tmp_path: Path, name: Any, t0: Any, t1: Any, level: Any, metrics: Any, status: Any
) -> None:
    """record_span with any name (one whose __str__ raises, a list), times (None, text, t1 before
    t0), level, metrics (5) and status (an int): never raises, and what it writes validates
    (dur never negative, status a string); tt.span(["a"]) is a span too."""
    memory = MemoryBackend()
    tt.configure(job_id="rs", backends={"file": False, "log": False}, extra_backends=[memory], statistics=False)
    rec = tt.get_recorder()
    assert rec is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec.record_span(name, t0, t1, metrics=metrics, level=level, status=status)
        with tt.span(name, metrics):
            pass
    tt.close()
    assert not schema_errors(memory.records)
    assert all(r["dur"] >= 0 and isinstance(r["status"], str) for r in memory.records if r.get("kind") == "span")


# ---------------------------------------------------------------- reader

RECORD_FIELDS = [
    "seq",
    "kind",
    "ts",
    "name",
    "id",
    "parent",
    "span",
    "tid",
    "dur",
    "status",
    "attrs",
    "count",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
HEADER = {
    "seq": 0, "kind": "header", "ts": 1, "schema": "traintrace", "schema_version": 1, "time": "t", "mono": 1,
    "job": "j", "rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "node_rank": 0,
    "restart": 0, "host": "h", "pid": 1, "library_version": "0",
}  # fmt: skip


def _exercise(path: Path) -> None:
    result = read_file(path)
    for stream in result.streams:
        stream.spans()
        stream.gaps()
        stream.of_kind("event")
        assert isinstance(stream.closed_cleanly, bool)
    result.records()
    result.spans("iteration")
    assert isinstance(result.truncated, bool)


@FUZZ
@given(data=st.binary(max_size=3000))
def test_reader_never_raises_on_random_bytes(tmp_path: Path, data: bytes) -> None:
    """Random bytes, after a valid header or not: the reader reports, never raises."""
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(HEADER).encode() + b"\n" + data)
    _exercise(path)
    path.write_bytes(data)
    _exercise(path)


@FUZZ
@given(
    records=st.lists(
        st.dictionaries(st.sampled_from(RECORD_FIELDS), json_values)
        | st.fixed_dictionaries({"kind": st.sampled_from(["span", "start", "end", "event", "header"])}),
        max_size=15,
    )
)
def test_reader_never_raises_on_wrong_field_types(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    """Valid JSON with fields of the wrong type (ids as lists, attrs as strings, ...): bad lines
    are reported, the rest read, and spans()/gaps() never raise."""
    path = tmp_path / "typed.jsonl"
    lines = [json.dumps(HEADER)] + [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    _exercise(path)


def test_reader_on_corrupt_truncated_binary_and_wrong_version_files(tmp_path: Path) -> None:
    """Each broken file gets a clear reason per bad line, and the good records still read."""
    good = json.dumps({"seq": 1, "kind": "event", "ts": 2, "name": "e", "span": 0, "tid": 1})
    cases = {
        "truncated": json.dumps(HEADER) + "\n" + good + "\n" + good[:20],
        "binary": json.dumps(HEADER) + "\n\x00\xff\xfe garbage\n" + good + "\n",
        "deep": json.dumps(HEADER) + "\n" + "[" * 100000 + "\n" + good + "\n",
        "v2": json.dumps({**HEADER, "schema_version": 2}) + "\n" + good + "\n",
        "not_records": json.dumps(HEADER) + "\n[1,2]\n\"text\"\n{\"kind\": 5}\n" + good + "\n",
        "wrong_types": json.dumps(HEADER) + '\n{"seq":"1","kind":"event","ts":1}\n'
        + '{"seq":2,"kind":"start","id":[1],"ts":1}\n' + good + "\n",
    }  # fmt: skip
    reasons = {}
    for name, text in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(text.encode("utf-8", "surrogateescape") if name != "binary" else text.encode("latin-1"))
        result = read_file(path)
        reasons[name] = [b.reason for b in result.bad_lines]
        _exercise(path)
        if name != "v2":
            assert [r["name"] for r in result.records()] == ["e"], name
    assert reasons["truncated"][0].startswith("not JSON") and read_file(tmp_path / "truncated.jsonl").truncated
    assert reasons["binary"][0].startswith("not JSON")
    assert reasons["deep"] == ["not JSON: nested too deeply"]
    assert reasons["v2"] == ["unsupported schema 'traintrace' v2"]
    assert read_file(tmp_path / "v2.jsonl").orphans == 1
    assert len(reasons["not_records"]) == 3
    assert reasons["wrong_types"] == ["bad 'seq': '1'", "bad 'id': expected int, got list"]


def test_reader_memory_is_bounded_on_a_huge_line(tmp_path: Path) -> None:
    """A 48 MiB line with no newline: reported as one bad line, read with memory bounded by
    the line limit (16 MiB), not by the line."""
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as handle:
        handle.write(json.dumps(HEADER).encode() + b"\n")
        chunk = b"x" * (1 << 20)
        for _ in range(48):
            handle.write(chunk)
        handle.write(b"\n" + json.dumps({"seq": 1, "kind": "event", "ts": 1, "name": "e"}).encode() + b"\n")
    tracemalloc.start()
    try:
        result = read_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [b.reason for b in result.bad_lines] == [f"line longer than {MAX_LINE_BYTES} bytes"]
    assert [r["name"] for r in result.records()] == ["e"]
    assert peak < 2.5 * MAX_LINE_BYTES


# ---------------------------------------------------------------- paths and redaction


@FUZZ
@given(job=st.text(min_size=1, max_size=60), host=st.text(min_size=1, max_size=30))
def test_placeholders_never_leave_the_log_folder(tmp_path: Path, job: str, host: str) -> None:
    """Any job id or host name (``../../etc``, ``/``, NUL, dots): the file stays in log_dir."""
    identity = Identity(job, 0, 1, 0, 1, 0, 0, host, 1)
    for template in ("{job}/rank{rank}.jsonl", "{host}-{job}.jsonl", "{job}{host}/x.jsonl"):
        path = resolve_path(template, tmp_path, identity)
        assert path.is_relative_to(tmp_path.resolve())


@FUZZ
@given(prefix=st.text(max_size=10), secret=st.sampled_from(["password", "token", "api_key", "secret"]))
def test_redaction_catches_secret_suffixes(prefix: str, secret: str) -> None:
    """A key whose words end with a secret word is redacted, however it is prefixed."""
    from traintrace._redact import DEFAULT_REDACT_KEYS, Redactor

    redactor = Redactor(DEFAULT_REDACT_KEYS)
    key = f"{prefix}_{secret}"
    assert redactor.apply({key: "s3cr3t", "nested": {key: 1}}) == {
        key: "<redacted>",
        "nested": {key: "<redacted>"},
    }


@pytest.mark.parametrize("when", [dt.datetime(2026, 1, 1)])
def test_values_round_trip_through_the_file(tmp_path: Path, when: dt.datetime) -> None:
    """Awkward values end up as the documented JSON forms in the file."""
    tt.configure(job_id="v", log_dir=str(tmp_path), backends={"file": {"path": "v.jsonl"}, "log": False})
    tt.event("v", {"nan": float("nan"), "when": when, "big": 2**80, "surrogate": "\ud800", 5: "int key"})
    tt.close()
    attrs = read_file(tmp_path / "v.jsonl").records()[-2]["attrs"]
    assert attrs == {
        "nan": "NaN",
        "when": "2026-01-01T00:00:00",
        "big": 2**80,
        "surrogate": "\ud800",
        "5": "int key",
    }


@FUZZ
@given(
    line=st.text(max_size=300),
    pairs=st.dictionaries(st.text(max_size=10), json_values | st.floats() | st.text(), max_size=5),
)
def test_logfmt_never_raises(line: str, pairs: dict[str, Any]) -> None:
    """logfmt parses any text, and formats any JSON-safe record (what the log backend gets,
    after the writer's conversion) into one line, without raising."""
    from traintrace import logfmt

    parsed = logfmt.parse_line(line)
    for value in parsed.values():
        logfmt.typed_value(value)
    formatted = logfmt.format_line(pairs)
    assert "\n" not in formatted


# ---------------------------------------------------------------- one bad item (issue 17, items 5 and 6)


def _file_events(path: Path, name: str = "e") -> list[int]:
    stream = read_file(path).streams[0]
    assert not schema_errors(stream.records)
    return [r["attrs"]["i"] for r in stream.of_kind("event") if r["name"] == name]


def _configure_file(tmp_path: Path, **settings: Any) -> Path:
    backends = {"file": {"path": "bad.jsonl"}, "log": False}
    tt.configure(job_id="bad", log_dir=str(tmp_path), backends=backends, statistics=False, **settings)
    return tmp_path / "bad.jsonl"


def test_a_link_to_a_span_never_entered_loses_nothing(tmp_path: Path) -> None:
    """``link=`` to a span that was never entered: that span is written (without a link) and
    so is every record around it."""
    path = _configure_file(tmp_path)
    never = tt.span("never_entered")
    for i in range(600):
        tt.event("e", {"i": i})
        if i == 300:
            with tt.span("linked", link=never):
                pass
    tt.close()
    assert _file_events(path) == list(range(600))
    (linked,) = read_file(path).streams[0].spans("linked")
    assert linked.get("link", 0) == 0


def test_a_metric_too_large_to_print_loses_nothing(tmp_path: Path) -> None:
    """An integer over 4,300 digits (Python refuses to print it) among 600 events: every event
    is written, the huge value as a note, a merely large one as a float."""
    path = _configure_file(tmp_path)
    for i in range(600):
        attrs: dict[str, Any] = {"i": i}
        if i == 300:
            attrs.update(huge=10**5000, large=2**70, nested={"huge": -(10**5000)})
        tt.event("e", attrs)
    tt.close()
    assert _file_events(path) == list(range(600))
    (big,) = [r for r in read_file(path).streams[0].of_kind("event") if r["attrs"]["i"] == 300]
    assert big["attrs"]["large"] == float(2**70)
    assert "integer of" in big["attrs"]["huge"] and "integer of" in big["attrs"]["nested"]["huge"]


@pytest.mark.slow
def test_a_dict_changed_by_another_thread_loses_nothing(tmp_path: Path) -> None:
    """Another thread keeps adding and removing keys of the dict passed to ``span()`` and
    ``event()`` while the writer converts them: every one of 10,000 spans and events is written.
    Each record holds 150 to 250 keys: on a loaded machine the pure core's writer took over the
    default 5 s ``close_timeout`` to finish its queue (CI: 4,801 dropped, reason ``close_timeout``,
    as documented), so the close here waits as long as it needs: what is tested is the conversion."""
    path = _configure_file(tmp_path, flush_interval=0.005, blocking=True, close_timeout=300.0)
    shared: dict[str, Any] = {"i": 0, **{f"v{n}": n for n in range(150)}}
    stop = threading.Event()

    def mutate() -> None:
        n = 0
        while not stop.is_set():
            if (n // 100) % 2:
                shared.pop(f"k{n % 100}", None)  # the size keeps changing: 151 to 251 keys
            else:
                shared[f"k{n % 100}"] = n
            n += 1

    thread = threading.Thread(target=mutate)
    thread.start()
    try:
        for i in range(10000):
            shared["i"] = i
            with tt.span("s", shared):
                tt.event("e", shared)
    finally:
        stop.set()
        thread.join()
    tt.close()
    stream = read_file(path).streams[0]
    assert len(stream.spans("s")) == 10000
    assert len([r for r in stream.of_kind("event") if r["name"] == "e"]) == 10000
    seqs = [r["seq"] for r in stream.records]
    assert seqs == list(range(1, len(seqs) + 1))


class _Raises:
    """A value whose repr raises what it is given (KeyboardInterrupt, SystemExit, GeneratorExit)."""

    def __init__(self, kind: type[BaseException]) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        raise self.kind("from __repr__")

    __str__ = __repr__


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit, GeneratorExit, RuntimeError])
def test_a_repr_raising_a_base_exception_does_not_stop_the_writer(tmp_path: Path, kind: type[BaseException]) -> None:
    """A value whose ``__repr__`` raises KeyboardInterrupt, SystemExit or GeneratorExit (as a
    name, a value, a key, a link): the writer keeps writing; every record is there, the bad
    values replaced by notes."""
    path = _configure_file(tmp_path)
    for i in range(600):
        if i == 300:
            tt.event(_Raises(kind), {"i": -1})  # type: ignore[arg-type]
            tt.event("e", {"i": i, "bad": _Raises(kind), _Raises(kind): 1})  # type: ignore[dict-item]
            with tt.span("linked", link=_Raises(kind)):  # type: ignore[arg-type]
                pass
        else:
            tt.event("e", {"i": i})
    assert tt.flush(30)
    tt.close()
    assert _file_events(path) == list(range(600))
    assert read_file(path).streams[0].closed_cleanly


def test_flush_returns_at_once_after_a_failed_cycle(tmp_path: Path) -> None:
    """A write cycle that fails (here: its delivery raises once) still releases the flush()
    waiting on it: flush reports success instead of waiting out its timeout; writing goes on."""
    path = _configure_file(tmp_path)
    rec = tt.get_recorder()
    assert rec is not None
    pipeline = rec._pipeline
    real = pipeline._deliver
    calls = itertools.count()

    def fail_once(batch: list[tuple[int, dict[str, Any]]]) -> None:
        if next(calls) == 0:
            raise OSError("injected")
        real(batch)

    pipeline._deliver = fail_once  # type: ignore[method-assign]
    tt.event("lost", {"i": -1})
    assert tt.flush(10) is True
    tt.event("e", {"i": 0})
    tt.close()
    assert _file_events(path) == [0]


# ---------------------------------------------------------------- values as they were at the call (issue 17, item 8)

_scalars = st.one_of(st.integers(-1000, 1000), st.floats(-1e6, 1e6), st.text(max_size=8), st.booleans())
_reused_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(
    steps=st.lists(
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), _reused_values, min_size=1), min_size=2, max_size=6
    )
)
def test_a_reused_dict_is_written_as_it_was_at_each_call(tmp_path: Path, steps: list[dict[str, Any]]) -> None:
    """One dict reused between calls of span(), event(), add_metrics(), error() and
    record_span(), its values replaced after each call: each record holds the values of its own
    call (the test's own copies), not the last ones (``step = 4`` five times, before)."""
    memory = MemoryBackend()
    tt.configure(
        job_id="snap", backends={"file": False, "log": False}, extra_backends=[memory], statistics=False, redact_keys=[]
    )
    rec = tt.get_recorder()
    assert rec is not None
    reused: dict[str, Any] = {}
    expected: list[dict[str, Any]] = []
    for number, values in enumerate(steps):
        reused.update(values)
        reused["step"] = number
        expected.append(json.loads(json.dumps(reused)))
        with tt.span("s", reused) as span:
            tt.event("e", reused)
            span.add_metrics(reused)
            tt.error("err", reused)
        started = time.perf_counter_ns()
        rec.record_span("r", started, started + 1000, metrics=reused)
        for key in list(reused):  # the caller moves on: every value replaced
            reused[key] = "changed"
    tt.close()

    def attrs_of(kinds: tuple[str, ...], name: str) -> list[dict[str, Any]]:
        return [r["attrs"] for r in memory.records if r.get("kind") in kinds and r.get("name") == name]

    def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
        return all(k in got and json.dumps(got[k], sort_keys=True) == json.dumps(want[k], sort_keys=True) for k in want)

    # A span is one record, or a start (attributes) and an end (metrics added while open).
    ends = attrs_of(("end",), "s")
    for kinds, name in ((("span", "start"), "s"), (("event",), "e"), (("error",), "error"), (("span",), "r")):
        written = attrs_of(kinds, name)
        assert len(written) == len(expected), (kinds, name)
        assert all(same(got, want) for got, want in zip(written, expected, strict=True)), (kinds, name)
    assert all(any(same(end, want) for want in expected) for end in ends)
