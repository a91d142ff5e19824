"""The writer's native encoder (``traintrace._encode``) against the pure-Python path, byte for byte.

The same queued items (spans, events, errors with fixed clock readings) go through a
pipeline with the native encoder and through one without; the files must be identical
apart from the wall-clock ``ts`` of each record (the pipelines' clock anchors differ).
Values are hostile on purpose: the encoder must either write them exactly as the
Python serialiser does or hand the item back to Python.
"""

from __future__ import annotations

import datetime
import enum
import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traintrace import _pipeline, _recorder
from traintrace._config import Config
from traintrace._pipeline import Pipeline, clean_attrs
from traintrace._recorder import ERROR, EVENT, Span
from traintrace._redact import DEFAULT_REDACT_KEYS, Redactor
from traintrace._serialize import ENCODER, dumps
from traintrace._stats import IterationStats
from traintrace.backends._file import FileBackend

#: The extension itself: these tests compare it with the Python path even under TRAINTRACE_PURE=1.
native = pytest.importorskip("traintrace._encode")

STYLE = 1 if ENCODER == "orjson" else 0
#: Makes a span as ``training_iteration(step)`` does on the native core: its attrs are the int step
#: until something reads them, and the encoder writes ``{"step": ...}`` from the struct (None: pure core).
STEP_SPAN = getattr(_recorder._native, "_step_span", None)
_TS = re.compile(rb'"ts":-?\d+')


# ---------------------------------------------------------------- values

floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, 1e-5, -1.5e-5, 1e-6, 1e-7, 1e15, 1e16, -1e16, 5e-324, 1.7976931348623157e308, 0.1, 2.5e-5]
)
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.sampled_from(
    [2**63, 2**64 - 1, 2**64, -(2**64), -(2**64) + 1, 10**30]
)
texts = (
    st.text(max_size=12)
    | st.text(alphabet=st.characters(max_codepoint=0x24), max_size=8)
    | st.sampled_from(["\ud800", "a\udfffb", '\x00\x1f\x7f"\\/', "\u2028é漢字😀", "x" * 4096, "y" * 4097])
)
scalars = st.none() | st.booleans() | floats | ints | texts


class Level(enum.IntEnum):
    LOW = 1


class Text(str):
    pass


class Number(float):
    pass


class Mapping(dict):  # type: ignore[type-arg]
    pass


class Hostile:
    """Every conversion of it raises, except on a thread other than the writer's (hypothesis prints it)."""

    def __repr__(self) -> str:
        if threading.current_thread().name == "traintrace-writer":
            raise RuntimeError("no repr")
        return "Hostile()"

    def __str__(self) -> str:
        raise RuntimeError("no str")


odd = st.sampled_from(
    [Level.LOW, Text("sub"), Number(1.5), Mapping(a=1), Hostile(), b"\x00\xff", (1, "a"), {3, 1}, Path("/tmp/x")]
) | st.builds(lambda n: datetime.datetime(2020, 1, 1) + datetime.timedelta(seconds=n), st.integers(0, 10**6))
values = (
    scalars
    | odd
    | st.lists(scalars | odd, max_size=3)
    | st.dictionaries(st.text(max_size=5) | st.sampled_from(["token", "api_key"]), scalars, max_size=3)
)
keys = (
    st.text(max_size=10)
    | st.sampled_from(["step", "iteration", "current_iteration", "num_iterations", "batch_size", "skipped"])
    | st.sampled_from(["loss", "lr", "hf_token", "password", "tokens", "api_key_1", "k" * 257, "\ud800k"])
    | st.integers(min_value=-3, max_value=3)
    | st.sampled_from([Text("step"), Level.LOW, Hostile(), ("tuple", 1), None])
)
attr_dicts = st.none() | st.dictionaries(keys, values, max_size=5)
try:
    import torch
except ImportError:  # the tensor cases need torch
    torch = None
#: Tensors as losses come: on the CPU, float32 or float64 (read by the encoder), integer (held in Python).
_tensors = (
    st.floats(width=32).map(torch.tensor)
    | st.floats(allow_nan=False).map(lambda x: torch.tensor(x, dtype=torch.float64))
    | st.integers(-5, 5).map(torch.tensor)
    | st.just(torch.ones(2))
    if torch is not None
    else st.nothing()
)
#: Samples, tokens and FLOPs as frameworks give them per step (or not: then step_info counts).
_consumption = st.integers(0, 64) | st.floats(0, 2.0**40, width=32) | st.none() | st.text(max_size=2) | _tensors
#: What training loops put on iterations: a step, a loss, the same key in attrs and metrics.
_iteration_values = {
    "loss": st.floats(width=32) | _tensors,
    "acc": st.integers(-5, 5),
    "tag": st.text(max_size=3),
    "flag": st.booleans(),
    "none": st.none(),
    "current_iteration": st.integers(0, 9),
    "num_iterations": st.integers(0, 9),
    "batch_size": _consumption,
    "tokens": _consumption,
    "flops": _consumption,
}
iteration_attrs = st.fixed_dictionaries({"step": st.integers(0, 99)}, optional=_iteration_values)
#: training_iteration(step)'s step: small, or beyond what the encoder writes itself (left to Python).
iteration_steps = st.integers(0, 99) | st.sampled_from([-1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**30])
iteration_metrics = st.none() | st.fixed_dictionaries({}, optional={**_iteration_values, "step": st.integers(0, 9)})


def test_encode_attrs_matches_python_serialiser() -> None:
    """Plain values: the same bytes as dumps(clean_attrs(...)); anything else is refused (None)."""

    @settings(max_examples=400, deadline=None)
    @given(st.dictionaries(keys, values, max_size=6), st.booleans())
    def check(attrs: dict[Any, Any], redact: bool) -> None:
        redactor = Redactor(DEFAULT_REDACT_KEYS if redact else ())
        for key in attrs:
            if isinstance(key, str):
                redactor.secret(key)  # as the Python path fills the cache
        cache = redactor.judged if redactor else None
        encoded = native.encode_attrs(attrs, cache, STYLE)
        if encoded is None:
            return
        assert encoded == dumps(clean_attrs(attrs, redactor if redactor else None))
        assert all(isinstance(k, str) and not (redactor and redactor.secret(k)) for k in attrs)

    check()


def test_integers_are_written_digit_for_digit() -> None:
    """Every digit count, both signs, the int64 ends: as Python writes them (two digits per division in C)."""
    numbers = [0, -(2**63), 2**63 - 1]
    for power in range(19):
        numbers += [10**power - 1, 10**power, 10**power + 1, 5 * 10**power + 42]
    numbers += [-n for n in numbers if 0 < n < 2**63]
    encoded = native.encode_attrs({str(i): n for i, n in enumerate(numbers)}, None, STYLE)
    assert json.loads(encoded) == {str(i): n for i, n in enumerate(numbers)}
    assert encoded == dumps({str(i): n for i, n in enumerate(numbers)})


def test_plain_values_are_encoded_not_refused() -> None:
    """The fast path covers what training loops send (or the encoder would be pointless)."""
    attrs = {"step": 3, "loss": 0.25, "lr": 1e-5, "tiny": 2.5e-7, "big": 1e16, "name": "é\n", "ok": True, "n": None}
    encoded = native.encode_attrs(attrs, None, STYLE)
    assert encoded == dumps(clean_attrs(attrs))


# ---------------------------------------------------------------- whole pipelines


class _Stats(IterationStats):
    """The statistics observer on its own (as ``_insight.Insight`` wires it)."""

    def __init__(self, pipeline: Pipeline, log_interval: int) -> None:
        super().__init__(pipeline, log_interval, None)
        self.native_stats = self


class _Other:
    """An observer the native encoder does not know: every span end goes through Python."""

    def __init__(self) -> None:
        self.seen = 0

    def hold(self, span: Span, started: bool) -> bool:
        return False

    def span_ended(self, span: Span, out: Any) -> None:
        self.seen += 1

    def flushing(self, out: Any) -> None:
        pass

    def finish(self, out: Any, open_status: str) -> None:
        pass


HEADER = {"seq": 0, "kind": "header", "ts": 0, "schema": "traintrace", "schema_version": 1}
_IDENTS = [threading.get_ident(), 987654321]


def run_pipeline(
    path: Path,
    items: list[Any],
    *,
    use_native: bool,
    observer: str,
    log_interval: int,
    redact: bool,
    dict_route: bool = False,
    step_info: bool = False,
    flush: bool = False,
    queue_size: int = 100_000,
    keep: list[Pipeline] | None = None,
) -> bytes:
    saved = _pipeline._native
    _pipeline._native = native if use_native else None
    try:
        config = Config(queue_size=queue_size, flush_interval=3600.0)
        config.redact_keys = DEFAULT_REDACT_KEYS if redact else ()
        backend = FileBackend(path, fsync_on_close=False)
        backend.open(HEADER)
        routes: list[Any] = [(backend, "file", 4)]
        memory = None
        if dict_route:
            from traintrace.backends._memory import MemoryBackend

            memory = MemoryBackend()
            routes.append((memory, "memory", 1))
        pipeline = Pipeline(config, HEADER, routes)
    finally:
        _pipeline._native = saved
    assert (pipeline.native is not None) == use_native
    if observer == "stats":
        stats = _Stats(pipeline, log_interval)
        if step_info:
            stats.step_info = ((0, {"batch_size": 8, "tokens": 100, "flops": 1.5e9}),)
        pipeline.observers.append(stats)
    elif observer == "other":
        pipeline.observers.append(_Other())
    pipeline.queue.extend(items)
    if flush:
        assert pipeline.flush(30.0)  # a write cycle before close: the writer yields between slices
    pipeline.close(30.0)
    if keep is not None:
        keep.append(pipeline)
    return path.read_bytes()


def normalise(data: bytes) -> list[bytes]:
    return [_TS.sub(b'"ts":0', line) for line in data.splitlines()]


# Span descriptions: (name, attrs, metrics, status, level, link, parent index, ident index, sightings)
names = st.sampled_from(
    [
        *("iteration", "iteration", "iteration", "iteration", "model_forward", "zero_grad", "training_loop"),
        *("model_initialization", "validation_loop", "checkpoint_save_sync", "my_phase", "x" * 300),
    ]
) | st.text(max_size=6)


@st.composite
def workloads(draw: Any) -> list[Any]:
    """Queue items in order; ``_Stop(span, t1)`` is a span's second sighting after a start seen open."""
    count = draw(st.integers(min_value=1, max_value=40))
    items: list[Any] = []
    pending: list[Any] = []
    spans: list[Span] = []
    clock = 1_000_000
    for index in range(count):
        while pending and draw(st.booleans()):
            items.append(pending.pop(draw(st.integers(0, len(pending) - 1))))
        what = draw(st.integers(min_value=0, max_value=9))
        clock += draw(st.integers(min_value=1, max_value=10_000))
        ident = _IDENTS[draw(st.integers(min_value=0, max_value=1))]
        if what == 0:
            level = draw(st.sampled_from([1, 2, 3, 4]))
            items.append((EVENT, draw(names), draw(attr_dicts), draw(st.integers(0, 5)), ident, clock, level))
            continue
        if what == 1:
            items.append((ERROR, draw(names), draw(attr_dicts), 0, ident, clock, ("ValueError", "bad", "stack")))
            continue
        link = draw(st.integers(0, 5)) if draw(st.integers(0, 9)) == 0 else None
        name = draw(names)
        typical = name == "iteration" and draw(st.integers(0, 3)) > 0
        level = draw(st.sampled_from([1, 3, 3, 4]))
        if typical and STEP_SPAN is not None and draw(st.booleans()):
            span = STEP_SPAN(Span, name, draw(iteration_steps), level)
            span.link = link
        else:
            span = Span(name, draw(iteration_attrs if typical else attr_dicts), level, link)
        span.parent = spans[draw(st.integers(0, len(spans) - 1))] if spans and draw(st.booleans()) else None
        span.id = index + 1
        span.tid = ident
        span.metrics = draw(iteration_metrics if typical else st.none() | st.dictionaries(keys, values, max_size=3))
        span.status = draw(st.sampled_from(["ok", "ok", "ok", "error", "terminated"]))
        span.written = 0
        span.t0 = clock
        t1 = clock + draw(st.integers(min_value=1, max_value=5_000_000))
        spans.append(span)
        if draw(st.booleans()):
            span.t1 = t1  # stopped before the writer saw it: one whole record
            items.append(span)
            pending.append(span)
        else:
            span.t1 = None  # seen open: a start record, then an end record
            items.append(span)
            pending.append(_Stop(span, t1))
    items.extend(pending)
    return items


class _Stop:
    """A span's second sighting; its stop time is set only as the writer takes it from the queue."""

    def __init__(self, span: Span, t1: int) -> None:
        self.span = span
        self.t1 = t1


def _copy(span: Span, copies: dict[int, Span]) -> Span:
    step = getattr(span, "_attrs_step", None)  # read without making the attrs dict
    if step is not None:
        new = STEP_SPAN(type(span), span.name, step, span.level)
        new.link = span.link
    else:
        new = Span(span.name, span.attrs, span.level, span.link)
    parent = span.parent
    new.parent = copies.get(id(parent)) if parent is not None else None
    new.id, new.tid, new.metrics, new.status = span.id, span.tid, span.metrics, span.status
    new.written, new.t0, new.t1 = 0, span.t0, span.t1
    return new


def fresh(workload: list[Any]) -> tuple[list[Any], dict[int, int]]:
    """New span objects for one run (the pipeline changes them), and the t1 to set when each queue index is popped."""
    copies: dict[int, Span] = {}
    queued: list[Any] = []
    stops: dict[int, int] = {}
    for item in workload:
        if isinstance(item, _Stop):
            stops[len(queued)] = item.t1
            queued.append(copies[id(item.span)])
        elif isinstance(item, Span):
            if id(item) not in copies:
                copies[id(item)] = _copy(item, copies)
            queued.append(copies[id(item)])
        else:
            queued.append(item)
    return queued, stops


def run_both(tmp_path: Path, workload: list[Any], **options: Any) -> tuple[list[bytes], list[bytes]]:
    from collections import deque

    outputs = []
    for use_native in (True, False):
        queued, stops = fresh(workload)

        class StoppingDeque(deque):  # type: ignore[type-arg]
            """The queue as the writer sees it: a span's stop time is set when its stop is taken."""

            popped = 0
            stop_times = stops

            def popleft(self) -> Any:
                item = super().popleft()
                t1 = self.stop_times.get(StoppingDeque.popped)
                StoppingDeque.popped += 1
                if t1 is not None:
                    item.t1 = t1
                return item

            def appendleft(self, item: Any) -> None:
                StoppingDeque.popped -= 1
                super().appendleft(item)

        path = tmp_path / f"{'native' if use_native else 'python'}-{len(list(tmp_path.iterdir()))}.jsonl"
        original = _pipeline.deque
        _pipeline.deque = StoppingDeque  # type: ignore[misc]
        try:
            outputs.append(normalise(run_pipeline(path, queued, use_native=use_native, **options)))
        finally:
            _pipeline.deque = original  # type: ignore[misc]
    return outputs[0], outputs[1]


@pytest.mark.once  # both paths, whichever core the pass asks for
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    workload=workloads(),
    observer=st.sampled_from(["none", "stats", "stats", "other"]),
    log_interval=st.integers(min_value=1, max_value=5),
    redact=st.booleans(),
    dict_route=st.booleans(),
    step_info=st.booleans(),
)
def test_native_and_python_files_are_identical(
    tmp_path: Path,
    *,
    workload: list[Any],
    observer: str,
    log_interval: int,
    redact: bool,
    dict_route: bool,
    step_info: bool,
) -> None:
    native_lines, python_lines = run_both(
        tmp_path,
        workload,
        observer=observer,
        log_interval=log_interval,
        redact=redact,
        dict_route=dict_route,
        step_info=step_info,
    )
    assert native_lines == python_lines
    for line in native_lines:
        json.loads(line)


def _open_loop(clock: int) -> Any:
    """A training_loop span as the queue holds it at its start (id 1, the first thread)."""
    loop = Span("training_loop", None, 1)
    loop.parent, loop.id, loop.tid, loop.metrics, loop.status = None, 1, _IDENTS[0], None, "ok"
    loop.written, loop.t0, loop.t1 = 0, clock, None
    return loop


@pytest.mark.parametrize("log_interval", [100, 1000])
def test_long_plain_run_is_identical(tmp_path: Path, log_interval: int) -> None:
    """A training loop's shape (iterations with a loss, phases, events) over many chunks and intervals.

    At 1,000 steps an interval's durations fill more histogram buckets than the encoder's table
    holds, so it flushes them to the histogram mid-interval."""
    clock = 10_000
    loop = _open_loop(clock)
    items: list[Any] = [loop]
    next_id = 2
    for step in range(3000):
        it = Span("iteration", {"step": step}, 3)
        it.parent, it.id, it.tid, it.status, it.written = loop, next_id, _IDENTS[0], "ok", 0
        it.metrics = {"loss": 1.0 / (step + 1), "lr": 1e-5 * (step % 7)} if step % 3 else None
        next_id += 1
        it.t0 = clock
        clock += 1000 + (step * 7919) % 90_000  # durations over many histogram buckets
        it.t1 = clock
        fwd = Span("model_forward", None, 4)
        fwd.parent, fwd.id, fwd.tid, fwd.status, fwd.written = it, next_id, _IDENTS[0], "ok", 0
        fwd.metrics, fwd.t0, fwd.t1 = None, it.t0 + 10, it.t0 + 500
        plain = Span("my_phase", {"k": "v"}, 4)
        plain.parent, plain.id, plain.tid, plain.status, plain.written = it, next_id + 1, _IDENTS[0], "ok", 0
        plain.metrics, plain.t0, plain.t1 = None, it.t0 + 600, it.t0 + 700
        next_id += 2
        items.extend([it, fwd, fwd, plain, plain, it])
        if step % 250 == 0:
            items.append((EVENT, "note", {"step": step, "text": "ok ✓"}, it.id, _IDENTS[0], clock, 1))
    items.append(_Stop(loop, clock + 1))
    native_lines, python_lines = run_both(tmp_path, items, observer="stats", log_interval=log_interval, redact=True)
    assert native_lines == python_lines
    events = [json.loads(line) for line in native_lines if b'"training_iterations"' in line]
    assert len(events) == 3000 // log_interval + 1  # the intervals and the loop's end
    assert events[0]["attrs"]["interval"] == log_interval and events[-1]["attrs"]["final"] is True
    assert all(not math.isnan(e["attrs"].get("average_iteration_time", 0.0)) for e in events)


def _training_items(steps: int) -> list[Any]:
    """A training loop's queue: iterations with a loss inside a loop span, two phases each."""
    loop = Span("training_loop", None, 1)
    loop.parent, loop.id, loop.tid, loop.metrics, loop.status = None, 1, _IDENTS[0], None, "ok"
    loop.written, loop.t0, loop.t1 = 0, 1000, None
    items: list[Any] = [loop]
    clock = 1000
    for step in range(steps):
        it = Span("iteration", {"step": step}, 3)
        it.parent, it.id, it.tid, it.status, it.written = loop, 2 * step + 2, _IDENTS[0], "ok", 0
        it.metrics = {"loss": 1.0 / (step + 1)}
        it.t0, it.t1 = clock, clock + 5000 + step % 977
        fwd = Span("model_forward", None, 4)
        fwd.parent, fwd.id, fwd.tid, fwd.status, fwd.written = it, 2 * step + 3, _IDENTS[0], "ok", 0
        fwd.metrics, fwd.t0, fwd.t1 = None, clock + 10, clock + 900
        clock = it.t1
        items.extend([it, fwd, fwd, it])
    items.append(_Stop(loop, clock + 1))
    return items


def test_any_slice_length_writes_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer stops converting when its slice of time is up (mid-chunk, mid-interval) and lets the
    training thread in: with slices so short that each call converts a few items, both paths still
    write the file that one long slice writes."""
    items = _training_items(1500)
    options: dict[str, Any] = {"observer": "stats", "log_interval": 7, "redact": True, "flush": True}
    whole, _ = run_both(tmp_path, items, **options)
    monkeypatch.setattr(_pipeline, "_SLICE_NS", 1)
    monkeypatch.setattr(_pipeline, "_PURE_STEP", 5)
    # A small bound: most of the queue is past an eighth of it, where the writer hurries.
    native_lines, python_lines = run_both(tmp_path, items, queue_size=8000, **options)
    assert native_lines == python_lines == whole
    assert sum(b'"kind":"span"' in line for line in whole) == 3000


def test_write_pause_writes_like_os_write(tmp_path: Path) -> None:
    """The writer's write-and-yield: the bytes written and their count, as ``os.write``; errors as OSError."""
    import os

    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert native.write_pause(fd, b"abc\n", 1000) == 4
        assert native.write_pause(fd, memoryview(b"xdef\n")[1:], 0, True) == 4
    finally:
        os.close(fd)
    assert path.read_bytes() == b"abc\ndef\n"
    with pytest.raises(OSError):
        native.write_pause(fd, b"closed", 1000, True)


class _Impostor:
    """Not a Span, but carrying Span's slot descriptors (the encoder must not read its memory as a Span's)."""

    name = Span.__dict__.get("name", "impostor")
    attrs = None
    written = 0


def test_objects_that_are_not_spans_are_left_to_python(tmp_path: Path) -> None:
    """Queue items of the wrong shape become the same 'dropped' notes on both paths; nothing crashes."""
    span = Span("iteration", {"step": 1}, 3)
    span.parent, span.id, span.tid, span.metrics, span.status = None, 1, _IDENTS[0], None, "ok"
    span.written, span.t0, span.t1 = 0, 100, 200
    workload = [_Impostor(), object(), (), (EVENT,), (99, "x"), span, span]
    native_lines, python_lines = run_both(tmp_path, workload, observer="stats", log_interval=1, redact=False)
    assert native_lines == python_lines
    kinds = [json.loads(line)["kind"] for line in native_lines]
    assert kinds.count("dropped") >= 3 and "span" in kinds


def _iterations(spans: list[Span]) -> list[Any]:
    """Each span stopped before the writer sees it, under one open training loop: the queue's items."""
    items: list[Any] = [_open_loop(1)]
    for index, span in enumerate(spans):
        span.parent, span.id, span.tid, span.status = items[0], index + 2, _IDENTS[0], "ok"
        span.written, span.t0, span.t1 = 0, 1000 * index + 10, 1000 * index + 500 + index
        items.extend([span, span])
    items.append(_Stop(items[0], 1000 * len(spans) + 10))
    return items


@pytest.mark.skipif(STEP_SPAN is None, reason="the native recording core is not built or not used")
@pytest.mark.parametrize("redact", [False, True])
def test_a_native_iterations_fields_are_read_from_its_struct(tmp_path: Path, *, redact: bool) -> None:
    """Spans as training_iteration(step) makes them are written from their C fields, their attrs dict never made.

    Steps the encoder cannot write itself, and metrics that name a step of their own, go through the
    getters (the dict is then made): the file is the Python path's either way."""
    steps = [0, 7, 2**63 - 1, 2**63, -5, 10**30]
    spans = []
    for index, step in enumerate(steps * 2):
        span = STEP_SPAN(Span, "iteration", step, 3)
        span.metrics = {"loss": 0.25 * index} if index % 3 else ({"step": 1} if index == 3 else None)
        spans.append(span)
    items = _iterations(spans)
    native_lines, python_lines = run_both(tmp_path, items, observer="stats", log_interval=4, redact=redact)
    assert native_lines == python_lines
    written = [json.loads(line)["attrs"] for line in native_lines if b'"name":"iteration"' in line]
    expected = [{"step": step, **(span.metrics or {})} for step, span in zip(steps * 2, spans, strict=True)]
    # (a step beyond 64 bits is bounded as the Python path bounds any int: the same in both files)
    assert [w for w, e in zip(written, expected, strict=True) if abs(e["step"]) < 2**63] == [
        e for e in expected if abs(e["step"]) < 2**63
    ]

    kept: list[Pipeline] = []
    queued, _ = fresh(items)
    run_pipeline(
        tmp_path / "kept.jsonl", queued, use_native=True, observer="stats", log_interval=4, redact=redact, keep=kept
    )
    copies = [item for item in queued[1:] if isinstance(item, Span) and item.name == "iteration"][::2]
    assert kept[0].native is not None
    fast = [
        copy
        for copy, step, span in zip(copies, steps * 2, spans, strict=True)
        if -(2**63) <= step < 2**63 and (span.metrics is None or "step" not in span.metrics)
    ]
    assert len(fast) == 8
    # Each of those read twice from its struct (written whole, then counted at its stop), and the loop's
    # stop; the others once each (their attrs, once made, are a dict: read through the getters).
    assert kept[0].native.encoder.struct_reads >= 2 * len(fast) + 1
    # Their {"step": ...} dict was never made; when redacting, a metric key seen for the first time ("loss")
    # is judged in Python, which reads (and so makes) the attrs of its span: the second round only.
    unmade = [s._attrs_step for s in fast]
    assert unmade == [0, 7, 2**63 - 1, -5] * 2 if not redact else unmade[4:] == [0, 7, 2**63 - 1, -5]


@settings(max_examples=300, deadline=None)
@given(
    durations=st.lists(st.integers(0, 10**12) | st.integers(900, 1100), min_size=1, max_size=300),
    extra=st.sampled_from([(), (0.25,), (0.999, 1.0), (1e-9,)]),
)
def test_interval_quantiles_are_the_histograms(durations: list[int], extra: tuple[float, ...]) -> None:
    """The encoder's quantiles of an interval's histogram equal LogHistogram.quantiles, float for float."""
    from traintrace._histogram import LogHistogram

    hist = LogHistogram()
    hist.add_many(durations)
    qs = (0.5, 0.9, 0.99, *extra)
    encoder = native.Encoder({}, {}, None, frozenset(), frozenset(), 4, -1, STYLE)
    found = encoder.interval_quantiles(hist._buckets, qs, hist.count, hist.gamma, hist.min, hist.max)
    assert found == hist.quantiles(qs)
    hist._buckets[1.5] = 1  # type: ignore[index]  # a key C does not read: left to Python
    assert encoder.interval_quantiles(hist._buckets, qs, hist.count, hist.gamma, hist.min, hist.max) is None


class _Renamed(Span):
    """A user's Span whose name is a property: its spans are read through it, not from the struct."""

    __slots__ = ()

    @property  # type: ignore[override]
    def name(self) -> str:
        return "renamed"

    @name.setter
    def name(self, value: str) -> None:
        pass


@pytest.mark.skipif(STEP_SPAN is None, reason="the native recording core is not built or not used")
def test_a_span_class_that_redefines_a_field_is_read_through_it(tmp_path: Path) -> None:
    """A subclass's own field wins over the struct, as attribute access would have it."""
    items = _iterations([_Renamed("iteration", {"step": 1}, 3), Span("iteration", {"step": 2}, 3)])
    native_lines, python_lines = run_both(tmp_path, items, observer="stats", log_interval=1, redact=False)
    assert native_lines == python_lines
    names = [json.loads(line).get("name") for line in native_lines]
    assert "renamed" in names and names.count("iteration") == 1


def test_huge_records_split_chunks_and_stay_identical(tmp_path: Path) -> None:
    """A chunk stops early once a megabyte is buffered (the writer holds the GIL meanwhile); nothing is lost."""
    workload: list[Any] = []
    for index in range(40):
        span = Span("my_phase", {f"key{k}": "é" * 1000 + str(k) for k in range(150)}, 3)
        span.parent, span.id, span.tid, span.metrics, span.status = None, index + 1, _IDENTS[0], None, "ok"
        span.written, span.t0, span.t1 = 0, 1000 * index + 1, 1000 * index + 500
        workload.extend([span, span])
    native_lines, python_lines = run_both(tmp_path, workload, observer="stats", log_interval=3, redact=True)
    assert native_lines == python_lines
    assert sum(b'"kind":"span"' in line for line in native_lines) == 40


def test_encoder_failure_hands_over_to_python(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """If the encoder itself fails (out of memory in C), the Python path writes everything from then on."""
    import traintrace as tt

    class Failing:
        def __init__(self, real: Any) -> None:
            self.real = real

        def convert(self, *args: Any) -> Any:
            raise MemoryError("no memory for the encoder")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    saved = _pipeline._native
    _pipeline._native = native
    try:
        rec = tt.configure(job_id="j", log_dir=str(tmp_path), backends={"log": False}, flush_interval=3600)
    finally:
        _pipeline._native = saved
    pipeline = rec._pipeline
    assert pipeline.native is not None
    pipeline.native.encoder = Failing(pipeline.native.encoder)
    with tt.training_loop():
        for step in range(1000):
            with tt.training_iteration(step):
                pass
    tt.close()
    assert pipeline.native is None
    assert "the native encoder failed" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "j" / "rank0.jsonl").read_text().splitlines()]
    assert [r["seq"] for r in records] == list(range(len(records)))
    assert sum(r.get("name") == "iteration" for r in records) == 1000


#: Values whose sum depends on the order of the additions (0.1 + 1e16 - 1e16 is 0.0, 1e16 - 1e16 + 0.1 is 0.1).
_ORDERED = [0.1, 1e16, -1e16, 0.3, 1e-300, -0.0, 2.5e-5, 1e16, 0.7, -1e16, 3.0, 1.7976931348623157e308 / 4, 1e-7]


def _iteration_span(step: int, parent: Span, span_id: int, *, t0: int, t1: int, metrics: Any) -> Span:
    it = Span("iteration", {"step": step}, 3)
    it.parent, it.id, it.tid, it.status, it.written = parent, span_id, _IDENTS[0], "ok", 0
    it.metrics, it.t0, it.t1 = metrics, t0, t1
    return it


@pytest.mark.parametrize("log_interval", [7, 100, 1500])
def test_interval_means_sum_in_pythons_order(tmp_path: Path, log_interval: int) -> None:
    """The encoder's C sums of metrics and phases end as the Python path's sequential sums, bit for bit.

    Float metrics whose sum depends on the order of additions, more keys than the encoder's table
    holds at once (it writes them back mid-chunk), keys that come and go, equal keys that are different
    str objects, intervals longer than a chunk (the sum continues from the dict's value), iterations
    the statistics take in Python mid-interval (``tokens``), and phase sums beyond 64 bits.
    """
    clock = 10_000
    loop = _open_loop(clock)
    items: list[Any] = [loop]
    next_id = 2
    for step in range(3000):
        value = _ORDERED[step % len(_ORDERED)] * (1 + step % 5)
        metrics: dict[str, Any] = {"".join(["lo", "ss"]): value, "lr": _ORDERED[(step * 7) % len(_ORDERED)]}
        if step % 11 < 4:
            metrics.update({f"m{k}": _ORDERED[(step + k) % len(_ORDERED)] for k in range(step % 60)})
        if step % 97 == 0:
            metrics["tokens"] = 100  # a reserved count: this iteration goes through Python
        if step % 13 == 5:
            metrics = {"acc": step}  # no float: keys disappear for a while
        t0 = clock
        clock += 1000 + (step * 7919) % 90_000
        it = _iteration_span(step, loop, next_id, t0=t0, t1=clock, metrics=metrics)
        fwd = Span("model_forward", None, 4)
        fwd.parent, fwd.id, fwd.tid, fwd.status, fwd.written = it, next_id + 1, _IDENTS[0], "ok", 0
        fwd.metrics, fwd.t0, fwd.t1 = None, t0 + 10, t0 + 500
        items.extend([it, fwd, fwd, it])
        next_id += 2
        if step % 400 == 399:
            # phases of 2**61 - 2 ns each: the interval's phase sum passes 2**63
            for _ in range(6):
                big = Span("model_backward", None, 4)
                big.parent, big.id, big.tid, big.status, big.written = it, next_id, _IDENTS[0], "ok", 0
                big.metrics, big.t0, big.t1 = None, 1, 2**61 - 1
                items.extend([big, big])
                next_id += 1
    items.append(_Stop(loop, clock + 1))
    native_lines, python_lines = run_both(tmp_path, items, observer="stats", log_interval=log_interval, redact=False)
    assert native_lines == python_lines
    events = [json.loads(line)["attrs"] for line in native_lines if b'"training_iterations"' in line]
    assert len(events) == 3000 // log_interval + 1
    assert any("m30" in e for e in events) and any("average_backward_time" in e for e in events)


def test_interval_means_match_a_python_sum(tmp_path: Path) -> None:
    """One interval over several chunks: the mean written is Python's sum in order, divided by the count."""
    finite = [value for value in _ORDERED if abs(value) < 1e300]
    values = [finite[i % len(finite)] for i in range(2000)]
    loop = Span("training_loop", None, 1)
    loop.parent, loop.id, loop.tid, loop.metrics, loop.status = None, 1, _IDENTS[0], None, "ok"
    loop.written, loop.t0, loop.t1 = 0, 1000, None
    items: list[Any] = [loop]
    for step, value in enumerate(values):
        items.extend(
            [_iteration_span(step, loop, step + 2, t0=2000 + step * 10, t1=2005 + step * 10, metrics={"x": value})] * 2
        )
    items.append(_Stop(loop, 10**8))
    native_lines, python_lines = run_both(tmp_path, items, observer="stats", log_interval=10_000, redact=False)
    assert native_lines == python_lines
    total = 0.0
    for value in values:
        total += value
    assert total != math.fsum(values)  # the order of the additions shows
    (event,) = [json.loads(line)["attrs"] for line in native_lines if b'"training_iterations"' in line]
    assert event["x"] == total / len(values)


def test_recurring_floats_are_written_as_python_writes_them(tmp_path: Path) -> None:
    """The encoder keeps the text of recent floats by their bits: recurring, colliding and signed zeros."""
    pool = [0.0, -0.0, 1e-5, -1e-5, 1.5e-5, 1e-4, 3e-4, 1e15, 1e16, -1e16, 0.1, 1 / 3, 5e-324, 2.5e-5, 1e-7]
    pool += [step * 1.000000001e-3 for step in range(600)]  # more values than the cache holds
    items: list[Any] = []
    for step in range(3000):
        value = pool[(step * 37) % len(pool)]
        attrs = {"step": step, "lr": pool[step % 15], "loss": value, "neg": -value}
        span = Span("my_phase", attrs, 3)
        span.parent, span.id, span.tid, span.metrics, span.status = None, step + 1, _IDENTS[0], None, "ok"
        span.written, span.t0, span.t1 = 0, 1000 * step + 1, 1000 * step + 500
        items.extend([span, span])
    for observer in ("none", "stats"):
        native_lines, python_lines = run_both(tmp_path, items, observer=observer, log_interval=10, redact=False)
        assert native_lines == python_lines


def test_floats_of_every_kind_are_written_as_python_writes_them(tmp_path: Path) -> None:
    """The shortest-digit formatter in files: random doubles, losses, and values it leaves to dtoa."""
    import random
    import struct

    rnd = random.Random(7)
    pool = [struct.unpack("<d", struct.pack("<Q", rnd.getrandbits(64)))[0] for _ in range(6000)]
    pool = [x for x in pool if math.isfinite(x)]
    pool += [1.0 / (i + 1) for i in range(2000)] + [1e23, 5e-324, 1.7976931348623157e308, 2.0**-1022, 9.5e15]
    fallbacks = [x for x in pool if native.float_fast(x) is None]
    assert fallbacks  # both ways are in the files
    items: list[Any] = []
    for step, value in enumerate(pool):
        attrs = {"step": step, "loss": value, "neg": -value, "scaled": value * 1e-300}
        span = Span("my_phase", attrs, 3)
        span.parent, span.id, span.tid, span.metrics, span.status = None, step + 1, _IDENTS[0], None, "ok"
        span.written, span.t0, span.t1 = 0, 1000 * step + 1, 1000 * step + 500
        items.extend([span, span])
    native_lines, python_lines = run_both(tmp_path, items, observer="none", log_interval=10, redact=False)
    assert native_lines == python_lines
    assert len(native_lines) >= len(pool)


def test_sums_the_encoder_cannot_continue_in_c_go_on_in_python() -> None:
    """Dict values C does not hold (an int sum, counts past 64 bits) and a phase sum passing 2**63."""
    from traintrace._stats import PHASE_FIELDS, PYTHON_NAMES, RESERVED

    threads = {_IDENTS[0]: 7}
    encoder = native.Encoder(threads, {}, None, PYTHON_NAMES, RESERVED, 4, -1, STYLE)
    spans: list[Span] = []
    for index in range(6):
        it = Span("iteration", {"step": index}, 3)
        it.parent, it.id, it.tid, it.status, it.written = None, 10 + index, _IDENTS[0], "ok", 0
        it.metrics, it.t0, it.t1 = {"a": 0.1, "b": 1e16, "c": 0.3}, 1000 + index, 2000 + index
        fwd = Span("model_forward", None, 4)
        fwd.parent, fwd.id, fwd.tid, fwd.status, fwd.written = it, 20 + index, _IDENTS[0], "ok", 0
        fwd.metrics, fwd.t0, fwd.t1 = None, 1, 2**61 - 1
        spans.extend([it, it, fwd, fwd])
    metric_sum: dict[str, Any] = {"a": 10**30, "c": -1e16}
    metric_count: dict[str, int] = {"a": 3, "b": 2**70, "c": 5}
    phase_sum: dict[str, int] = {"average_forward_time": 2**62}
    phase_count: dict[str, int] = {}
    state = (PHASE_FIELDS, phase_sum, phase_count, metric_sum, metric_count, {}, {}, 1.0)
    queue = list(spans)
    taken, _, back = encoder.convert(iter(queue).__next__, len(queue), 0, 1, 1, 1000, False, state)
    assert (taken, back) == (len(queue), None)
    expected_sum: dict[str, Any] = {"a": 10**30, "c": -1e16}
    expected_count: dict[str, int] = {"a": 3, "b": 2**70, "c": 5}
    for _ in range(6):
        for key, value in (("a", 0.1), ("b", 1e16), ("c", 0.3)):
            expected_sum[key] = expected_sum.get(key, 0.0) + value
            expected_count[key] = expected_count.get(key, 0) + 1
    assert metric_sum == expected_sum and list(metric_sum) == ["a", "c", "b"]
    assert metric_count == expected_count
    assert all(type(metric_sum[k]) is type(expected_sum[k]) for k in expected_sum)
    assert phase_sum == {"average_forward_time": 2**62 + 6 * (2**61 - 2)}
    assert phase_count == {"average_forward_time": 6}


@pytest.mark.parametrize("step_info", [False, True])
@pytest.mark.parametrize("log_interval", [7, 100])
def test_framework_iterations_are_counted_in_c_as_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_interval: int, step_info: bool
) -> None:
    """Iterations as the Lightning and HF callbacks record them: batch_size and flops as attributes
    (tokens now and then), a loss as a CPU float tensor. The encoder reads the tensor and counts the
    samples, tokens and FLOPs itself (no iteration goes through the Python statistics), and the file
    is the Python path's, byte for byte; the interval's figures are the sums this test makes."""
    torch = pytest.importorskip("torch")
    python_iterations = 0
    original = IterationStats._iteration

    def counting(self: IterationStats, span: Span, out: Any) -> None:
        nonlocal python_iterations
        python_iterations += 1
        original(self, span, out)

    monkeypatch.setattr(IterationStats, "_iteration", counting)
    clock = 10_000
    loop = _open_loop(clock)
    items: list[Any] = [loop]
    truth: list[tuple[int, int, float, float]] = []  # (samples, tokens, flops, loss) per step
    for step in range(700):
        batch, flops, loss = 8 + step % 3, 1.0e9 * (1 + step % 4), 1.0 / (step + 1)
        attrs: dict[str, Any] = {"step": step, "batch_idx": step, "epoch": 0, "batch_size": batch, "flops": flops}
        tokens = 0
        if step % 5 == 0:
            tokens = attrs["tokens"] = 100 + step
        elif step_info:
            tokens = 100  # from step_info, as run_pipeline sets it
        t0 = clock
        clock += 50_000 + (step * 7919) % 9_000
        it = Span("iteration", attrs, 3)
        it.parent, it.id, it.tid, it.status, it.written = loop, step + 2, _IDENTS[0], "ok", 0
        it.metrics = {"loss": torch.tensor(loss, dtype=torch.float64)}
        it.t0, it.t1 = t0, clock
        items.extend([it, it])
        truth.append((batch, tokens, flops, loss))
    items.append(_Stop(loop, clock + 1))
    native_lines, python_lines = run_both(
        tmp_path, items, observer="stats", log_interval=log_interval, redact=False, step_info=step_info
    )
    assert native_lines == python_lines
    assert python_iterations == 700  # all of them in the Python run, none in the native one
    events = [json.loads(line)["attrs"] for line in native_lines if b'"training_iterations"' in line]
    assert len(events) == 700 // log_interval + 1
    for index, event in enumerate(events[:-1]):
        chunk = truth[index * log_interval : (index + 1) * log_interval]
        assert event["interval"] == log_interval
        assert event["loss"] == pytest.approx(sum(t[3] for t in chunk) / log_interval, rel=1e-12)
        assert event["batch_size"] == pytest.approx(sum(t[0] for t in chunk) / log_interval)
        productive = event["interval"] / event["iterations_per_second"]
        assert event["tflops"] == pytest.approx(sum(t[2] for t in chunk) / productive / 1e12, rel=1e-6)
        if step_info:
            assert event["tokens_per_second"] == pytest.approx(sum(t[1] for t in chunk) / productive, rel=1e-6)
    assert events[-1]["consumed_samples"] == sum(t[0] for t in truth)
    iterations = [json.loads(line) for line in native_lines if b'"name":"iteration"' in line]
    assert [r["attrs"]["loss"] for r in iterations] == [t[3] for t in truth]  # read, in order, not held
