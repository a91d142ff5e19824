"""The NVTX backend, proven by an injection library that records every NVTX call."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nvtx")

import traintrace as tt
from traintrace import _recorder
from traintrace.backends._nvtx import PHASE_COLORS, NvtxBackend, color_for

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith(("TRAINTRACE_", "NVTX_")):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    _recorder._warned.clear()
    yield
    tt.close()


@pytest.fixture(scope="module")
def injection(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recording injection library, built with the system C compiler."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the NVTX injection library")
    library = tmp_path_factory.mktemp("nvtx") / "libnvtx_recorder.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(library), str(HERE / "nvtx_recorder.c")],
        check=True,
        timeout=120,
    )
    return library


def _run_with_injection(injection: Path, tmp_path: Path, body: str, backend: str = "{}") -> list[list[str]]:
    """Run ``body`` after configuring an NVTX backend under the recorder; the calls it made."""
    calls = tmp_path / "calls.tsv"
    script = "import threading\nimport traintrace as tt\n"
    script += (
        f"tt.configure(job_id='nv', backends={{'file': False, 'log': False, 'nvtx': {backend}}})\n"
        "assert tt.get_recorder().listeners[0].enabled\n"
    )
    script += textwrap.dedent(body) + "\ntt.close()\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINTRACE_", "NVTX_"))}
    env.update(NVTX_INJECTION64_PATH=str(injection), TT_NVTX_LOG=str(calls))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return [line.split("\t") for line in calls.read_text().splitlines()]


TRAINING = """
with tt.training_loop():
    for step in range(3):
        with tt.training_iteration(step):
            with tt.forward():
                pass
            with tt.backward():
                pass
            tt.event("batch_ready")
    try:
        with tt.checkpoint_save():
            with tt.span("write_shard"):
                raise OSError("disk full")
    except OSError:
        pass
"""


def _balanced(calls: list[list[str]]) -> bool:
    depth: Counter[str] = Counter()
    for call in calls:
        if call[0] == "push":
            depth[call[2]] += 1
        elif call[0] == "pop":
            depth[call[2]] -= 1
            if depth[call[2]] < 0:
                return False
    return all(value == 0 for value in depth.values())


@pytest.mark.subprocess
def test_ranges_are_named_coloured_and_carry_the_step(injection: Path, tmp_path: Path) -> None:
    """Each span pushes one range named by the span (no counter), coloured by phase, step as payload."""
    calls = _run_with_injection(injection, tmp_path, TRAINING)
    assert ["domain", "traintrace"] in calls
    pushes = [c for c in calls if c[0] == "push"]
    assert {c[1] for c in pushes} == {"traintrace"}
    names = [c[3] for c in pushes]
    assert names.count("iteration") == 3 and names.count("model_forward") == 3
    assert set(names) == {
        "training_loop",
        "iteration",
        "model_forward",
        "model_backward",
        "checkpoint_save_sync",
        "write_shard",
    }
    iterations = [c for c in pushes if c[3] == "iteration"]
    assert [(c[5], c[6]) for c in iterations] == [("2", "0"), ("2", "1"), ("2", "2")]  # INT64 payloads
    assert int(iterations[0][4], 16) == PHASE_COLORS["iteration"]
    colours = {c[3]: int(c[4], 16) for c in pushes}
    assert colours["model_forward"] != colours["model_backward"] != colours["iteration"]
    assert colours["write_shard"] == color_for("write_shard")
    forward = [c for c in pushes if c[3] == "model_forward"]
    assert all(int(c[7]) == 3 for c in forward)  # nested: loop > iteration > forward


@pytest.mark.subprocess
def test_ranges_stay_balanced_when_spans_exit_by_exception(injection: Path, tmp_path: Path) -> None:
    """An exception unwinding two spans pops both ranges; every thread ends at depth 0."""
    calls = _run_with_injection(injection, tmp_path, TRAINING)
    assert _balanced(calls)
    pops = [c for c in calls if c[0] == "pop"]
    assert pops[-1][3] == "0"


@pytest.mark.subprocess
def test_events_and_errors_become_marks(injection: Path, tmp_path: Path) -> None:
    """Events and errors are marked in the domain, errors in red with the exception type."""
    calls = _run_with_injection(injection, tmp_path, TRAINING)
    marks = [c for c in calls if c[0] == "mark"]
    assert [c[3] for c in marks].count("event: batch_ready") == 3
    (error,) = [c for c in marks if c[3].startswith("error")]
    assert error[3] == "error: OSError" and int(error[4], 16) == 0xFF0000


@pytest.mark.subprocess
def test_threads_keep_their_own_ranges(injection: Path, tmp_path: Path) -> None:
    """Spans in several threads push and pop on those threads, balanced on each."""
    body = """
    def work(n):
        for step in range(20):
            with tt.training_iteration(step):
                with tt.span("io"):
                    pass
    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    """
    calls = _run_with_injection(injection, tmp_path, body)
    pushes = [c for c in calls if c[0] == "push"]
    assert len(pushes) == 120
    assert len({c[2] for c in pushes}) == 3
    assert _balanced(calls)


@pytest.mark.subprocess
def test_verbosity_limits_which_spans_push(injection: Path, tmp_path: Path) -> None:
    """At verbosity tracing, profiling spans (forward, backward) push no range; marks can be off."""
    calls = _run_with_injection(injection, tmp_path, TRAINING, backend="{'verbosity': 'tracing', 'marks': False}")
    names = {c[3] for c in calls if c[0] == "push"}
    assert "iteration" in names and "model_forward" not in names
    assert not [c for c in calls if c[0] == "mark"]
    assert _balanced(calls)


def test_without_a_profiler_the_backend_is_a_no_op() -> None:
    """With no NVTX tool attached, the listener methods are bare no-ops and training runs."""
    tt.configure(job_id="nv", backends={"file": False, "log": False, "nvtx": {}})
    (listener,) = tt.get_recorder().listeners  # type: ignore[union-attr]
    assert isinstance(listener, NvtxBackend)
    assert listener.enabled is False
    with tt.training_iteration(0):
        with tt.forward():
            pass
    tt.event("x")
    tt.close()


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"domain": ""}, "backends.nvtx.domain"),
        ({"colors": {"iteration": "green"}}, "backends.nvtx.colors"),
        ({"marks": "sometimes"}, "backends.nvtx.marks"),
    ],
)
def test_bad_settings_name_the_field(settings: dict[str, Any], field: str) -> None:
    """A bad NVTX setting raises ConfigError naming it."""
    with pytest.raises(tt.ConfigError, match=field.replace(".", r"\.")):
        tt.configure(job_id="nv", backends={"file": False, "log": False, "nvtx": settings})


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the nvtx package, configure() says which extra to install."""
    monkeypatch.setitem(sys.modules, "nvtx", None)
    with pytest.raises(tt.ConfigError, match=r"traintrace\[nvtx\]"):
        tt.configure(job_id="nv", backends={"file": False, "log": False, "nvtx": {}})


@pytest.mark.subprocess
def test_a_span_stopped_on_another_thread_leaves_the_ranges_balanced(injection: Path, tmp_path: Path) -> None:
    """A span started here and stopped by another thread: its range is popped on its own thread, in order.

    Later pops close their own ranges, and the application's range is the last to close.
    """
    body = """
    with tt.application():
        handle = tt.start("async_save")
        with tt.span("after_start"):
            pass
        stopper = threading.Thread(target=tt.stop, args=(handle,))
        stopper.start()
        stopper.join()
        for step in range(3):
            with tt.training_iteration(step):
                with tt.span("io"):
                    pass
    """
    calls = _run_with_injection(injection, tmp_path, body, backend="{'verbosity': 'profiling'}")
    pushes = [c for c in calls if c[0] == "push"]
    pops = [c for c in calls if c[0] == "pop"]
    assert len(pushes) == len(pops) == 9
    assert {c[2] for c in pushes} == {c[2] for c in pops}  # every pop on the pushing thread
    assert _balanced(calls)
    # Replay the stack: each pop closes the range the code expects, the application's last.
    stack: list[str] = []
    closed: list[str] = []
    for call in calls:
        if call[0] == "push":
            stack.append(call[3])
        elif call[0] == "pop":
            closed.append(stack.pop())
    assert closed[-1] == "main_function"
    assert closed.index("async_save") < closed.index("iteration")
    assert closed.count("io") == 3 and closed.count("iteration") == 3
