"""The Lightning callback's per-step hooks in C (``_span.StepHooks``) against its Python hooks, as the truth.

Each example drives one sequence of steps (batch start, before backward, before the optimizer step, batch
end) through two callbacks in this process: one with the C twins ``setup`` installs on the native core, one
with the class's Python hooks. The trainer, the batch, the outputs and the callback's own state are drawn,
hostile ones included (a ``global_step`` that raises, a shape that is no tuple, a ``_timings`` that is no
dict, a zero ``_every``). Both must raise the same exceptions at the same calls and, where nothing raised,
leave the same state and write the same records (apart from times and ids). A crash in C ends the whole
test run, which is the point. Real fits with both are in test_integrations_lightning.py.
"""

from __future__ import annotations

import contextvars
import copy
import warnings
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("lightning")

import torch

import traintrace as tt
from tests._examples import examples
from tests.test_native_core import _normalise
from traintrace import _recorder
from traintrace.integrations.lightning import TraintraceCallback

pytestmark = pytest.mark.skipif(_recorder.CORE != "native", reason="the native core is not in use")

HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class Trainer:
    """What the hooks read from Lightning's trainer: ``global_step`` and ``current_epoch``."""

    def __init__(self, step: Any, epoch: Any) -> None:
        self._step = step
        self.current_epoch = epoch

    @property
    def global_step(self) -> Any:
        if isinstance(self._step, BaseException):
            raise self._step
        return self._step


class Shaped:
    """A batch item with a ``shape`` of any kind (a torch.Size, a list, None, one that raises)."""

    def __init__(self, shape: Any) -> None:
        self._shape = shape

    @property
    def shape(self) -> Any:
        if isinstance(self._shape, BaseException):
            raise self._shape
        return self._shape


class Size(tuple):  # type: ignore[type-arg]
    """A tuple subclass as a shape (torch.Size is one)."""


BATCHES = st.one_of(
    st.just((torch.zeros(8, 4), torch.zeros(8, 1))),
    st.just([torch.zeros(3, 2)]),
    st.just({"input_ids": torch.zeros(2, 5, dtype=torch.long)}),
    st.just(torch.zeros(6, 2)),
    st.sampled_from([(), [], None, "text", 7]),
    st.builds(
        lambda shape, many: (Shaped(shape),) * many,
        st.one_of(
            st.just(torch.Size([4, 2])),
            st.builds(Size, st.lists(st.integers(-5, 10**20), max_size=2)),
            st.lists(st.integers(0, 9), max_size=2),
            st.sampled_from([None, (), (True,), (2.5,), ("x",), ValueError("shape"), KeyError("shape")]),
        ),
        st.integers(1, 5),
    ),
)

OUTPUTS = st.one_of(
    st.sampled_from([None, {}, {"loss": None}, {"loss": 1.5}, {"other": 2}, 3, "loss"]),
    st.just({"loss": torch.tensor(0.25)}),
    st.just(MappingProxyType({"loss": 2.0})),
    st.just(torch.tensor(0.5)),
)

STEPS = st.one_of(st.integers(0, 10**6), st.sampled_from([10**30, -3, 2.0, "7", None, RuntimeError("step")]))

#: Attributes of the callback a step may find changed: the states the C hooks hand to Python, and odd values.
STATE = st.builds(
    lambda odd, collective: {**odd, **collective},
    st.dictionaries(
        st.sampled_from(
            ["_every", "_timings", "_epoch", "_flops", "_flop_counter", "_phase", "_wait_t0", "log_metrics"]
        ),
        st.sampled_from([None, 0, 1, 3, -2, {}, {"forward_ns": 5}, [], "x", 2.5, 1e6, True, tt.SpanName.FORWARD]),
        max_size=2,
    ),
    # A collective timed inside the wait for a batch (Lightning's SIGTERM broadcast), which only its wrapper sets.
    st.sampled_from([{}, {"_wait_collective": None}, {"_wait_collective": (5, 9, "ok")}]),
)

STEP = st.tuples(BATCHES, OUTPUTS, STEPS, st.integers(0, 3), STATE, st.booleans())


@pytest.fixture
def memory() -> Iterator[tt.MemoryBackend]:
    backend = tt.MemoryBackend()
    # The writer waits for each run's flush: every span it sees has ended, whatever the machine's load (a span
    # seen open is two records, a matter of thread timing).
    tt.configure(backends=[], extra_backends=[backend], statistics=False, flush_interval=3600.0)
    yield backend
    tt.close()


def _callback(native: bool) -> TraintraceCallback:
    """A callback set up as ``setup`` leaves it for a profiling fit, without a trainer."""
    callback = TraintraceCallback(flops_per_step=2.0e6)
    callback._native_hooks = native
    callback._rec = _recorder._active
    callback._info = callback._trace = callback._profile = True
    callback._live_phases = False
    callback._every = 2
    callback._flops = 2.0e6
    callback._skip_unneeded_hooks(automatic=True)
    return callback


def _state(callback: TraintraceCallback) -> dict[str, Any]:
    """The per-step state, spans by name."""

    def plain(value: Any) -> Any:
        return ("span", value.name) if isinstance(value, tt.Span) else value

    names = (
        *("_iter", "_phase", "_phase_span", "_wait_t0", "_wait_span", "_wait_collective"),
        *("_mark", "_epoch", "_timings", "_seen"),
    )
    state = {name: plain(getattr(callback, name)) for name in names}
    # Times differ between the two runs; whether one is set does not.
    state["_wait_t0"] = state["_wait_t0"] is not None
    state["_mark"] = state["_mark"] != 0
    return state


def _run(steps: list[Any], native: bool, backend: tt.MemoryBackend) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """(what each call raised, the state after, the records) of ``steps`` through one callback, in a context of its
    own: an iteration a raising hook left open is the current span of the context it ran in, and would be the
    parent of the next run's first iteration."""
    return contextvars.Context().run(_run_in_context, steps, native, backend)


def _run_in_context(
    steps: list[Any], native: bool, backend: tt.MemoryBackend
) -> tuple[list[Any], dict[str, Any], list[Any]]:
    callback = _callback(native)
    kinds = {type(getattr(callback, hook)).__name__ for hook in HOOKS}
    assert kinds == ({"builtin_function_or_method"} if native else {"method"})
    raised: list[Any] = []
    backend.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, (batch, outputs, step, epoch, state, skip_phases) in enumerate(steps):
            for name, value in state.items():
                # A copy: the hooks change a dict they hold (_timings), and both runs read the same drawn value.
                setattr(callback, name, copy.deepcopy(value))
            trainer = Trainer(step, epoch)
            calls: list[tuple[str, tuple[Any, ...]]] = [("on_train_batch_start", (trainer, None, batch, index))]
            if not skip_phases:
                calls.append(("on_before_backward", (trainer, None, None)))
                calls.append(("on_before_optimizer_step", (trainer, None, None)))
            calls.append(("on_train_batch_end", (trainer, None, outputs, batch, index)))
            for hook, args in calls:
                try:
                    getattr(callback, hook)(*args)
                    raised.append(None)
                except Exception as exc:  # the same exception from both is the check
                    raised.append((hook, type(exc).__name__))
        state_after = _state(callback)
        callback._close_open(None)
    tt.flush()
    # (A thread's first record names it: the first run's alone.)
    return raised, state_after, _normalise([dict(r) for r in backend.records if r.get("kind") != "thread"])


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEP, min_size=1, max_size=6))
@example(steps=[((torch.zeros(8, 4),), {"loss": torch.tensor(1.0)}, 5, 0, {}, False)] * 3)
def test_the_c_hooks_do_what_the_python_hooks_do(memory: tt.MemoryBackend, steps: list[Any]) -> None:
    in_c = _run(steps, native=True, backend=memory)
    in_python = _run(steps, native=False, backend=memory)
    assert tt.current_span() is None  # what a run left open stayed in its own context
    assert in_c[0] == in_python[0]
    if not any(in_python[0]):
        # An exception leaves the state where each raised (C checks what it leaves to Python before it changes
        # anything, Python as it goes): compared where nothing raised.
        assert in_c[1] == in_python[1]
        assert in_c[2] == in_python[2]


def test_a_step_through_the_c_hooks_records_its_iteration_and_phases(memory: tt.MemoryBackend) -> None:
    """The common step, read back: the data wait, the iteration with its attributes and loss, three phases."""
    callback = _callback(native=True)
    trainer = Trainer(3, 1)
    batch = (torch.zeros(8, 4), torch.zeros(8, 1))
    for index in range(2):
        trainer._step = 3 + index  # odd, then even: the even step's logged metrics are read in Python
        callback.on_train_batch_start(trainer, None, batch, index)
        callback.on_before_backward(trainer, None, None)
        callback.on_before_optimizer_step(trainer, None, None)
        callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(0.5)}, batch, index)
    callback.on_train_batch_start(trainer, None, batch, 2)
    callback._close_open(None)
    tt.flush()
    iterations = memory.spans(tt.SpanName.ITERATION)
    assert [i["attrs"]["step"] for i in iterations] == [3, 4, 4]
    first = iterations[0]
    assert {k: first["attrs"][k] for k in ("step", "batch_idx", "epoch", "batch_size", "flops", "loss")} == {
        "step": 3,
        "batch_idx": 0,
        "epoch": 1,
        "batch_size": 8,
        "flops": 2.0e6,
        "loss": 0.5,
    }
    for name in (tt.SpanName.FORWARD, tt.SpanName.BACKWARD, tt.SpanName.OPTIMIZER_STEP):
        phases = memory.spans(name)
        assert [p["parent"] for p in phases] == [i["id"] for i in iterations[:2]]
    (wait,) = memory.spans(tt.SpanName.DATA_LOADING)[:1]
    assert wait["ts"] >= iterations[0]["ts"] + iterations[0]["dur"]
    assert wait["ts"] + wait["dur"] <= iterations[1]["ts"]


def test_the_c_hooks_are_installed_only_where_they_cover_the_configuration(memory: tt.MemoryBackend) -> None:
    """Phases as attributes, a span listener, a batch or token function, measured FLOPs, a subclass's own hook:
    the Python hooks (the C twins do not cover them)."""

    class Own(TraintraceCallback):
        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            super().on_before_backward(trainer, pl_module, loss)

    def kinds(callback: TraintraceCallback) -> dict[str, bool]:
        callback._rec = _recorder._active
        callback._info = callback._trace = callback._profile = True
        callback._skip_unneeded_hooks(automatic=True)
        return {hook: type(getattr(callback, hook)).__name__ == "builtin_function_or_method" for hook in HOOKS}

    assert all(kinds(TraintraceCallback()).values())
    assert not any(kinds(TraintraceCallback(phase_spans=False)).values())
    assert not any(kinds(TraintraceCallback(batch_size_fn=len)).values())
    assert not any(kinds(TraintraceCallback(tokens_fn=len)).values())
    assert not any(kinds(TraintraceCallback(flops_per_step="measure")).values())
    live = TraintraceCallback()
    live._live_phases = True
    live._rec = _recorder._active
    live._info = live._trace = live._profile = True
    live._skip_unneeded_hooks(automatic=True)
    assert not any(type(getattr(live, hook)).__name__ == "builtin_function_or_method" for hook in HOOKS)
    assert kinds(Own()) == {hook: hook != "on_before_backward" for hook in HOOKS}
