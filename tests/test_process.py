"""Process life: SIGTERM, unhandled exceptions, interpreter exit, fork. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import read_jsonl

pytestmark = pytest.mark.subprocess

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _script(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    code = textwrap.dedent(
        f"""
        import sys, os, time, signal
        sys.path.insert(0, {SRC!r})
        import traintrace as tt
        tt.configure(job_id="p", log_dir={str(tmp_path)!r}, backends={{"log": False}}, flush_interval=0.05)
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(tmp_path: Path) -> list[dict]:
    return read_jsonl(tmp_path / "p" / "rank0.jsonl")


def _wait_for(path: Path, text: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_sigterm_flushes_and_ends_spans_as_terminated(tmp_path: Path) -> None:
    """SIGTERM with Python's default handling: open spans end terminated, exit by signal."""
    proc = _script(
        tmp_path,
        """
        with tt.training_loop():
            with tt.checkpoint_save():
                tt.event("inside")
                time.sleep(60)
        """,
    )
    _wait_for(tmp_path / "p" / "rank0.jsonl", '"inside"')
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == -signal.SIGTERM
    records = _records(tmp_path)
    ends = {r["name"]: r["status"] for r in records if r["kind"] == "end"}
    assert ends == {"checkpoint_save_sync": "terminated", "training_loop": "terminated"}
    assert any(r["kind"] == "event" and r["name"] == "signal" for r in records)
    assert records[-1]["kind"] == "close"


def test_sigterm_keeps_the_users_handler(tmp_path: Path) -> None:
    """A handler the user installed before configure() still runs and decides the exit."""
    code = textwrap.dedent(
        f"""
        import sys, time, signal
        sys.path.insert(0, {SRC!r})
        def mine(signum, frame):
            print("user handler ran", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)
        import traintrace as tt
        tt.configure(job_id="p", log_dir={str(tmp_path)!r}, backends={{"log": False}}, flush_interval=0.05)
        with tt.training_loop():
            tt.event("inside")
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "p" / "rank0.jsonl", '"inside"')
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 7
    assert "user handler ran" in (proc.stdout.read() if proc.stdout else "")
    records = _records(tmp_path)
    loop = next(r for r in records if r["kind"] == "end" and r["name"] == "training_loop")
    assert loop["status"] == "terminated"
    assert records[-1]["kind"] == "close"


def test_unhandled_exception_is_recorded_once(tmp_path: Path) -> None:
    """An exception leaving the application span is recorded once and re-raised unchanged."""
    proc = _script(
        tmp_path,
        """
        @tt.application()
        def main():
            with tt.training_loop():
                raise ZeroDivisionError("bad step")
        main()
        """,
    )
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "ZeroDivisionError: bad step" in stderr
    errors = [r for r in _records(tmp_path) if r["kind"] == "error"]
    assert len(errors) == 1
    assert errors[0]["error_type"] == "ZeroDivisionError"


def test_exception_outside_any_span_via_excepthook(tmp_path: Path) -> None:
    """An exception raised outside every span is caught by the excepthook."""
    proc = _script(tmp_path, 'raise LookupError("no span")\n')
    proc.communicate(timeout=30)
    errors = [r for r in _records(tmp_path) if r["kind"] == "error"]
    assert len(errors) == 1 and errors[0]["attrs"]["unhandled"] is True


def test_ctrl_c_outside_any_span_via_excepthook(tmp_path: Path) -> None:
    """Ctrl-C (a real SIGINT) where no span of traintrace's is open (a framework's callbacks began its spans):
    one ``signal`` record says SIGINT, at no span; the interpreter still dies by SIGINT."""
    proc = _script(tmp_path, "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT
    signals = [r for r in _records(tmp_path) if r.get("name") == "signal"]
    assert [(r["attrs"], r["span"]) for r in signals] == [({"signal": "SIGINT", "exception": "KeyboardInterrupt"}, 0)]
    assert not [r for r in _records(tmp_path) if r["kind"] == "error"]


def test_interpreter_exit_flushes(tmp_path: Path) -> None:
    """Without close(), normal exit writes every record and the close record."""
    proc = _script(
        tmp_path,
        """
        tt.configure(job_id="p", log_dir=sys.argv[0] if False else tt.get_recorder().config.log_dir,
                     backends={"log": False}, flush_interval=60)
        for i in range(1000):
            with tt.training_iteration(i):
                pass
        """,
    )
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    records = _records(tmp_path)
    assert len([r for r in records if r.get("name") == "iteration"]) == 1000
    assert records[-1]["kind"] == "close"


def test_sys_exit_inside_spans(tmp_path: Path) -> None:
    """sys.exit ends spans as terminated and still flushes."""
    proc = _script(
        tmp_path,
        """
        with tt.training_loop():
            sys.exit(3)
        """,
    )
    proc.communicate(timeout=30)
    assert proc.returncode == 3
    records = _records(tmp_path)
    assert next(r for r in records if r.get("name") == "training_loop")["status"] == "terminated"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_is_quiet_and_never_deadlocks(tmp_path: Path) -> None:
    """With fork='quiet' a forked child records nothing and exits promptly."""
    proc = _script(
        tmp_path,
        """
        for i in range(20000):
            with tt.training_iteration(i):
                pass
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                with tt.training_iteration(-1):
                    tt.event("child")
                tt.flush()
                tt.close()
                os._exit(0)
            os.waitpid(pid, 0)
        tt.close()
        """,
    )
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    records = _records(tmp_path)
    assert not any(r.get("name") == "child" for r in records)
    assert len([r for r in records if r.get("name") == "iteration"]) == 20000
    assert sorted(p.name for p in (tmp_path / "p").glob("*.jsonl")) == ["rank0.jsonl"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_own_stream(tmp_path: Path) -> None:
    """With fork='own_stream' a multiprocessing child writes its own file."""
    code = textwrap.dedent(
        f"""
        import sys, multiprocessing as mp
        sys.path.insert(0, {SRC!r})
        import traintrace as tt

        def work(n):
            with tt.span("child_work"):
                tt.event("child_event", {{"n": n}})

        if __name__ == "__main__":
            tt.configure(job_id="p", log_dir={str(tmp_path)!r}, backends={{"log": False}}, fork="own_stream")
            ctx = mp.get_context("fork")
            p = ctx.Process(target=work, args=(5,))
            p.start(); p.join()
            tt.close()
            print(p.pid)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    child_pid = int(result.stdout.strip())
    child_file = tmp_path / "p" / f"rank0.pid{child_pid}.jsonl"
    records = read_jsonl(child_file)
    assert records[0]["parent_pid"] != child_pid
    assert any(r.get("name") == "child_event" for r in records)
    assert records[-1]["kind"] == "close"
    parent = read_jsonl(tmp_path / "p" / "rank0.jsonl")
    assert not any(r.get("name") == "child_event" for r in parent)
