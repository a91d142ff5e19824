"""The native span driven with hostile values, against the pure-Python core as the truth.

Each example runs one sequence of operations (start, stop with or without an exception,
stop twice, change a field, stop from another thread, close) twice in this process: with
``traintrace.Span`` (the native core when built) and with a span class built on
``_recorder._PySpanCore`` (the pure core). Both must raise the same exceptions at the same
operations and write the same records (apart from times and ids). A crash in C ends the
whole test run, which is the point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import traintrace as tt
from tests._examples import examples
from tests._reliability import child_env, write_script
from tests.test_native_core import _normalise
from traintrace import _recorder

pytestmark = pytest.mark.skipif(_recorder.CORE != "native", reason="the native core is not in use")


class PureSpan(_recorder._PySpanCore):
    """The pure core's start and stop, in a process that runs the native one."""

    __slots__ = ()


class HashRaises:
    def __hash__(self) -> int:
        raise RuntimeError("no hash")

    def __str__(self) -> str:
        raise RuntimeError("no str")

    def __repr__(self) -> str:  # hypothesis prints a failing example
        return "HashRaises()"


class EqRaises(str):
    """Hashes as "iteration" but never compares equal (nor unequal)."""

    def __hash__(self) -> int:
        return hash("iteration")

    def __eq__(self, other: object) -> bool:
        raise ValueError("no eq")

    __ne__ = __eq__  # type: ignore[assignment]


class Interrupting(str):
    def __hash__(self) -> int:
        raise KeyboardInterrupt


NAME_VALUES: list[Any] = [
    "plain",
    "iteration",
    "model_forward",
    "collective",
    "data_loading",
    "",
    "é" * 300,
    123,
    None,
    b"bytes",
    ("tuple", 1),
    2**100,
    float("nan"),
    HashRaises(),
    EqRaises("iteration"),
]
# By index: hypothesis hashes what sampled_from holds, and some of these refuse.
NAMES = st.integers(0, len(NAME_VALUES) - 1).map(NAME_VALUES.__getitem__)
STEPS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([True, 1.5, "7", None, 2**63, -(2**63), 2**63 - 1]),
)
ATTRS = st.one_of(
    st.none(),
    st.just({}),
    st.builds(lambda s: {"step": s}, STEPS),
    st.builds(lambda s: {"step": s, EqRaises("step"): 1}, STEPS),
    st.sampled_from([[("a", 1)], "text", 5, {"nested": {"x": [1, 2]}}]),
)
LEVELS = st.one_of(
    st.integers(-3, 8),
    st.sampled_from([2**80, -(2**80), "x", None, 1.5, tt.Verbosity.TRACING]),
)
FIELD_VALUES = st.sampled_from(
    [
        ("t0", 0),
        ("t0", 2**62),
        ("t0", -(2**63)),
        ("t0", "x"),
        ("t1", None),
        ("t1", 5),
        ("written", 3),
        ("written", 2**70),
        ("status", "custom"),
        ("status", 7),
        ("metrics", {"m": 1}),
        ("metrics", "not a dict"),
        ("attrs", {"step": 2**70}),
        ("name", "iteration"),
        ("level", "x"),
        ("parent", None),
        ("parent", "not a span"),
        ("_rec", 5),
        ("id", 2**70),
        ("tid", -1),
    ]
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("make"), NAMES, ATTRS, LEVELS),
        st.tuples(st.just("enter"), st.integers(0, 5)),
        st.tuples(st.just("exit"), st.integers(0, 5)),
        st.tuples(st.just("exit_error"), st.integers(0, 5)),
        st.tuples(st.just("exit_interrupt"), st.integers(0, 5)),
        st.tuples(st.just("exit_thread"), st.integers(0, 5)),
        st.tuples(st.just("set"), st.integers(0, 5), FIELD_VALUES),
        st.tuples(st.just("progress_off")),
        st.tuples(st.just("close")),
    ),
    max_size=25,
)


def _apply(cls: type, ops: list[Any], folder: Path) -> tuple[list[Any], list[Any]]:
    """Run ``ops`` with spans of ``cls``; the outcome of each op and the records written."""
    memory = tt.MemoryBackend()
    rec = tt.configure(
        job_id="fuzz", log_dir=str(folder), backends={"log": False}, extra_backends=[memory], statistics=False
    )
    _recorder._current.set(None)
    _recorder._warned.clear()
    spans: list[Any] = []
    outcomes: list[Any] = []

    def pick(index: int) -> Any:
        return spans[index % len(spans)] if spans else None

    for op in ops:
        kind = op[0]
        try:
            if kind == "make":
                spans.append(cls(op[1], op[2], op[3]))
            elif kind == "close":
                tt.close()
            elif kind == "progress_off":
                rec._progress = None
            else:
                span = pick(op[1])
                if span is None:
                    outcomes.append("no span")
                    continue
                if kind == "enter":
                    span.__enter__()
                elif kind == "exit":
                    span.__exit__(None, None, None)
                elif kind == "exit_error":
                    error = ValueError("fuzz")
                    span.__exit__(ValueError, error, None)
                elif kind == "exit_interrupt":
                    span.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
                elif kind == "exit_thread":
                    raised: list[str] = []

                    def stop(target: Any = span, into: list[str] = raised) -> None:
                        try:
                            target.__exit__(None, None, None)
                        except BaseException as exc:
                            into.append(type(exc).__name__)

                    thread = threading.Thread(target=stop)
                    thread.start()
                    thread.join()
                    outcomes.append(("thread", raised))
                    continue
                elif kind == "set":
                    field, value = op[2]
                    setattr(span, field, value)
            outcomes.append("ok")
        except BaseException as exc:
            outcomes.append(type(exc).__name__)
        if kind.startswith("exit"):
            # The writer reads an ended span when it converts it: a later op that changes the span (its t1 reset,
            # then a second exit) would otherwise show in the record or not by the writer's timing, in both cores.
            tt.flush()
    tt.close()
    _recorder._current.set(None)
    return outcomes, _normalise(memory.records)


# Fields whose setter the native core restricts (the pure core's slots take anything): a
# sequence that sets one to a value of another type is compared up to that operation only.
RESTRICTED = [
    ("t0", "x"),
    ("written", 2**70),
    ("parent", "not a span"),
    ("_rec", 5),
    ("id", 2**70),
    ("tid", -1),
]


@given(ops=OPS)
@example(  # a span ended with an error, its t1 reset, ended again: what the first end wrote stays
    ops=[
        ("make", "plain", None, 0),
        ("enter", 0),
        ("exit_error", 0),
        ("set", 0, ("t1", None)),
        ("exit_interrupt", 0),
    ]
)
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_native_span_behaves_as_the_pure_core(ops: list[Any], tmp_path: Path) -> None:
    cut = next(
        (i for i, op in enumerate(ops) if op[0] == "set" and op[2] in RESTRICTED),
        len(ops),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native = _apply(tt.Span, ops[:cut], tmp_path / "native")
        pure = _apply(PureSpan, ops[:cut], tmp_path / "pure")
        assert native == pure
        # The restricted setters refuse cleanly, and nothing breaks afterwards.
        if cut < len(ops):
            _apply(tt.Span, ops, tmp_path / "restricted")


def test_restricted_fields_refuse_other_types() -> None:
    span = tt.Span("x")
    for field, value in RESTRICTED:
        with pytest.raises((TypeError, OverflowError)):
            setattr(span, field, value)
    for field in ("name", "t0", "parent", "_rec"):
        with pytest.raises(TypeError):
            delattr(span, field)
    assert span.t1 is None and span.parent is None and span.span_id == 0


@pytest.mark.subprocess
def test_spans_in_a_forked_child(tmp_path: Path) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    script = write_script(
        tmp_path,
        "fork.py",
        """
        import os, sys, traintrace as tt
        rec = tt.configure(log_dir=sys.argv[1], job_id="fork", backends={"log": False})
        outer = rec.start("open across the fork")
        with tt.training_iteration(1):
            pid = os.fork()
            if pid == 0:
                # The parent's spans and progress file are not the child's.
                with tt.training_iteration(2), tt.forward():
                    pass
                outer.__exit__(None, None, None)
                rec.stop(outer)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        rec.stop(outer)
        tt.close()
        print("done")
        """,
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
