"""Process death: SIGKILL at random points, SIGTERM, exceptions, exits and segfaults.

Each case runs a real child Python that records at full speed and dies the way
a training job dies; the test then reads the stream back with
``traintrace.reader`` and checks what survived.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._reliability import child_env, run_script, schema_errors, write_script
from traintrace.reader import read_file

#: How many SIGKILL points the kill test tries (raise it for a longer hunt).
KILL_POINTS = int(os.environ.get("RELIAB_KILL_POINTS", "12"))

BUSY = """
import sys, traintrace as tt
log_dir, file_name = sys.argv[1], sys.argv[2]
tt.configure(job_id="death", log_dir=log_dir, backends={"file": {"path": file_name}, "log": False},
             flush_interval=0.02)
big = "x" * 30000
step = 0
with tt.application(), tt.training_loop():
    while True:
        with tt.training_iteration(step) as it:
            with tt.forward():
                pass
            tt.event("progress", {"step": step, "blob": big if step % 97 == 0 else ""})
            it.add_metrics(loss=1.0 / (step + 1))
        if step % 50 == 49:
            tt.flush()
            print(step, flush=True)
        step += 1
"""


def _busy_child(tmp_path: Path, file_name: str) -> subprocess.Popen[str]:
    script = write_script(tmp_path, "busy.py", BUSY)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "logs"), file_name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def _steps(stream_records: list[dict[str, object]]) -> list[int]:
    return [
        r["attrs"]["step"]  # type: ignore[index]
        for r in stream_records
        if r.get("kind") == "event" and r.get("name") == "progress"
    ]


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigkill_at_random_points_keeps_everything_flushed(tmp_path: Path) -> None:
    """SIGKILL at many random points: every record up to the last flush reads back, no gaps,
    at most the final line cut (and reported); a restart appends to the same file and starts
    on a fresh line (five kills per file)."""
    rng = random.Random(int(os.environ.get("RELIAB_KILL_SEED", "8")))
    bad_before: dict[Path, int] = {}
    kept_after_flush = 0
    cut = 0
    for point in range(KILL_POINTS):
        path = tmp_path / "logs" / f"death{point // 5}.jsonl"
        child = _busy_child(tmp_path, path.name)
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.strip().isdigit(), child.stderr.read() if child.stderr else first
        time.sleep(rng.uniform(0.0, 0.25))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL
        last_flushed = [int(line) for line in (first + out).split()][-1]

        result = read_file(path)
        assert len(result.streams) == point % 5 + 1
        stream = result.streams[-1]
        steps = _steps(stream.records)
        # Everything up to the last completed flush, once each, in order; nothing in between missing.
        assert steps[: last_flushed + 1] == list(range(last_flushed + 1))
        assert steps == list(range(len(steps)))
        assert stream.gaps() == []
        kept_after_flush += len(steps) - (last_flushed + 1)
        new_bad = result.bad_lines[bad_before.get(path, 0) :]
        assert len(new_bad) <= 1
        if new_bad:
            cut += 1
            assert new_bad[0].last and result.truncated
        bad_before[path] = len(result.bad_lines)
        sample = stream.records if point == 0 else rng.sample(stream.records, min(200, len(stream.records)))
        assert not schema_errors([stream.header, *sample])
    print(
        f"kill points: {KILL_POINTS}, cut final lines: {cut}, "
        f"records written after the last acknowledged flush and kept: {kept_after_flush}"
    )


SAVE_THEN_KILLED = """
import json, os, signal, sys, threading, time, traintrace as tt
log_dir = sys.argv[1]
# A flush interval far longer than the job: only a checkpoint's end makes the writer write.
tt.configure(job_id="saved", log_dir=log_dir, backends={"file": {}, "log": False}, flush_interval=60)
with tt.application(), tt.training_loop():
    for step in range(3):
        with tt.training_iteration(step):
            pass
    with tt.checkpoint_save(current_iteration=3):
        pass
    blocking = tt.start(tt.SpanName.CHECKPOINT_SAVE_ASYNC, {"current_iteration": 3})
    tt.stop(blocking)
    def finish_save():
        with tt.checkpoint_save_finalization(blocking):
            pass
    background = threading.Thread(target=finish_save)
    background.start()
    background.join()
    with open(os.path.join(log_dir, "truth.json"), "w") as truth:
        json.dump({"steps_done": 3, "saved_at_step": 3}, truth)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.subprocess
def test_a_checkpoint_save_is_written_at_once_and_survives_sigkill(tmp_path: Path) -> None:
    """SIGKILLed 0.3 s after a checkpoint save, with a 60 s flush interval: the saves' records
    (sync, async, its background part) and every record before them are on disk, and the
    command counts the steps the checkpoint holds as completed (the script's own truth)."""
    script = write_script(tmp_path, "saved.py", SAVE_THEN_KILLED)
    logs = tmp_path / "logs"
    done = run_script(script, str(logs))
    assert done.returncode == -signal.SIGKILL, done.stderr
    truth = json.loads((logs / "truth.json").read_text())
    (stream_path,) = logs.rglob("rank0.jsonl")
    (stream,) = read_file(stream_path).streams
    names = [r.get("name") for r in stream.records]
    for name in ("checkpoint_save_sync", "checkpoint_save_async", "checkpoint_save_finalization"):
        assert name in names, names
    (sync,) = [r for r in stream.records if r.get("name") == "checkpoint_save_sync"]
    assert sync["attrs"]["current_iteration"] == truth["saved_at_step"]  # type: ignore[index]
    assert names.count("iteration") == truth["steps_done"]

    pytest.importorskip("duckdb")
    from tests._fault_runs import answers

    _, summary = answers(stream_path.parent)
    assert summary["steps_completed"] == truth["saved_at_step"], summary
    assert summary["steps_lost"] == truth["steps_done"] - truth["saved_at_step"]


def test_cut_final_line_is_reported_and_a_restart_starts_a_fresh_line(tmp_path: Path) -> None:
    """A line cut by death mid-write (as on a full disk or a network file system) is the one
    bad line, reported as the last; the next process appends after it on a new line."""
    import traintrace as tt

    path = tmp_path / "cut.jsonl"
    settings = {"log_dir": str(tmp_path), "backends": {"file": {"path": "cut.jsonl"}, "log": False}}
    tt.configure(job_id="cut", **settings)
    for step in range(10):
        tt.event("progress", {"step": step})
    tt.close()
    with path.open("ab") as handle:
        handle.write(b'{"seq":12,"kind":"event","ts":1,"name":"prog')
    result = read_file(path)
    assert result.truncated and len(result.bad_lines) == 1
    assert "not JSON" in result.bad_lines[0].reason
    assert _steps(result.streams[0].records) == list(range(10))

    tt.configure(job_id="cut", **settings)
    tt.event("progress", {"step": 0})
    tt.close()
    again = read_file(path)
    assert len(again.streams) == 2 and not again.truncated
    assert len(again.bad_lines) == 1 and not again.bad_lines[0].last
    assert _steps(again.streams[1].records) == [0] and again.streams[1].closed_cleanly


def _terminated_run(
    tmp_path: Path, script_body: str, *, wait_line: bool = True, sig: int = signal.SIGTERM
) -> tuple[int, Path, str]:
    script = write_script(tmp_path, "term.py", script_body)
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert child.stdout is not None
    if wait_line:
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read() if child.stderr else line
    child.send_signal(sig)
    _, err = child.communicate(timeout=30)
    return child.returncode, tmp_path / "logs" / "term.jsonl", err


TERM = """
import signal, sys, time, traintrace as tt
HANDLER
tt.configure(job_id="term", log_dir=sys.argv[1], backends={"file": {"path": "term.jsonl"}, "log": False})
with tt.application(), tt.training_loop():
    step = 0
    while not globals().get("stop_now"):
        with tt.training_iteration(step):
            with tt.span("checkpoint_save_sync"):
                time.sleep(0.001)
        if step == 20:
            tt.flush()
            print("ready", flush=True)
        step += 1
print("left the loop", flush=True)
"""


def _statuses(path: Path) -> dict[str, str]:
    stream = read_file(path).streams[0]
    return {s["name"]: s["status"] for s in stream.spans() if s["name"] in ("main_function", "training_loop")}


def _ended_by(tmp_path: Path, sig: signal.Signals) -> None:
    """The TERM loop with no handler of its own, sent ``sig``: open spans end 'terminated', the stream closes with
    one `signal` record that names ``sig``, and the process dies of it, as without traintrace."""
    code, path, err = _terminated_run(tmp_path, TERM.replace("HANDLER", ""), sig=sig)
    assert code == -sig, err
    result = read_file(path)
    stream = result.streams[0]
    assert stream.closed_cleanly and not result.bad_lines
    assert _statuses(path) == {"main_function": "terminated", "training_loop": "terminated"}
    signals = [r for r in stream.of_kind("event") if r["name"] == "signal"]
    assert [r["attrs"]["reason"] for r in signals] == [sig.name]
    assert not schema_errors(stream.records)


@pytest.mark.subprocess
def test_sigterm_default_flushes_ends_spans_terminated_and_dies_by_the_signal(tmp_path: Path) -> None:
    """No handler of the user's: open spans end 'terminated', the stream closes, and the exit
    status is death by SIGTERM, as without traintrace."""
    _ended_by(tmp_path, signal.SIGTERM)


@pytest.mark.subprocess
def test_sighup_ends_the_process_as_sigterm_does(tmp_path: Path) -> None:
    """SIGHUP (its terminal closed) with nothing else handling it: as SIGTERM, the queued records, the spans ended
    'terminated', the close record, a `signal` record that says SIGHUP; the process still dies of SIGHUP. Before,
    it died at once and lost everything since the writer's last cycle, and nothing said why."""
    _ended_by(tmp_path, signal.SIGHUP)


@pytest.mark.subprocess
@pytest.mark.parametrize("disposition", ["nohup", "a handler of its own"])
def test_sighup_that_the_program_ignores_or_handles_is_left_to_it(tmp_path: Path, disposition: str) -> None:
    """Under `nohup` (SIGHUP ignored) the process goes on, and a handler of the program's own (installed before
    configure()) decides: traintrace neither records nor ends anything."""
    if disposition == "nohup":
        handler = "signal.signal(signal.SIGHUP, signal.SIG_IGN)"
        body = TERM.replace("HANDLER", handler).replace('while not globals().get("stop_now"):', "while step < 400:")
    else:
        handler = "signal.signal(signal.SIGHUP, lambda s, f: globals().update(stop_now=True))"
        body = TERM.replace("HANDLER", handler)
    code, path, err = _terminated_run(tmp_path, body, sig=signal.SIGHUP)
    assert code == 0, err
    stream = read_file(path).streams[0]
    assert stream.closed_cleanly
    assert _statuses(path) == {"main_function": "ok", "training_loop": "ok"}
    assert not [r for r in stream.of_kind("event") if r["name"] == "signal"]


@pytest.mark.subprocess
def test_sigterm_with_user_handler_that_exits_keeps_its_exit_status(tmp_path: Path) -> None:
    """A handler installed before configure() that calls sys.exit(143): it still runs, the
    status is 143, and the spans it unwinds end 'terminated'."""
    handler = "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))"
    code, path, err = _terminated_run(tmp_path, TERM.replace("HANDLER", handler))
    assert code == 143, err
    stream = read_file(path).streams[0]
    assert stream.closed_cleanly
    assert _statuses(path) == {"main_function": "terminated", "training_loop": "terminated"}
    assert any(r["name"] == "signal" for r in stream.of_kind("event"))


@pytest.mark.subprocess
def test_sigterm_with_user_handler_that_continues(tmp_path: Path) -> None:
    """A handler that asks the loop to stop: the program finishes its own way (status 0)."""
    handler = "signal.signal(signal.SIGTERM, lambda s, f: globals().update(stop_now=True))"
    script = TERM.replace("HANDLER", handler)
    code, path, err = _terminated_run(tmp_path, script)
    assert code == 0, err
    stream = read_file(path).streams[0]
    assert _statuses(path) == {"main_function": "ok", "training_loop": "ok"}
    assert any(r["name"] == "signal" for r in stream.of_kind("event"))


@pytest.mark.subprocess
def test_sigterm_ignored_stays_ignored(tmp_path: Path) -> None:
    """SIG_IGN before configure(): the signal is recorded and otherwise ignored."""
    body = TERM.replace("HANDLER", "signal.signal(signal.SIGTERM, signal.SIG_IGN)").replace(
        'while not globals().get("stop_now"):', "while step < 400:"
    )
    code, path, err = _terminated_run(tmp_path, body)
    assert code == 0, err
    stream = read_file(path).streams[0]
    ignored = [r for r in stream.of_kind("event") if r["name"] == "signal"]
    assert ignored and ignored[0]["attrs"].get("ignored") is True
    assert _statuses(path) == {"main_function": "ok", "training_loop": "ok"}


ENDINGS = """
import os, sys, traintrace as tt
tt.configure(job_id="end", log_dir=sys.argv[1], backends={"file": {"path": "end.jsonl"}, "log": False})
how = sys.argv[2]
if how == "os_exit_after_close":
    with tt.application():
        with tt.training_iteration(0):
            pass
    tt.close()
    os._exit(7)
with tt.application(), tt.training_loop():
    for step in range(5):
        with tt.training_iteration(step):
            pass
    with tt.training_iteration(5):
        if how == "exception":
            raise ValueError("loss is NaN")
        if how == "exit":
            sys.exit(3)
        if how == "sigint":  # Ctrl-C: Python's own handler raises KeyboardInterrupt here
            import signal
            with tt.forward():
                os.kill(os.getpid(), signal.SIGINT)
        if how == "segfault":
            tt.flush()
            import faulthandler
            faulthandler._sigsegv()
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("how", "code", "status"),
    [
        ("exception", 1, "error"),
        ("exit", 3, "terminated"),
        ("sigint", -signal.SIGINT, "terminated"),
        ("os_exit_after_close", 7, None),
    ],
)
def test_exception_exit_and_os_exit(tmp_path: Path, how: str, code: int, status: str | None) -> None:
    """Unhandled exception, sys.exit, Ctrl-C (SIGINT: KeyboardInterrupt) and os._exit after close(): the user's
    exit status (the interpreter dies by SIGINT after a KeyboardInterrupt), a cleanly closed stream, the exception
    recorded once, the interrupt once as a ``signal`` event in the span it came in, the spans' status right."""
    script = write_script(tmp_path, "end.py", ENDINGS)
    done = run_script(script, str(tmp_path / "logs"), how)
    assert done.returncode == code, done.stderr
    result = read_file(tmp_path / "logs" / "end.jsonl")
    stream = result.streams[0]
    assert stream.closed_cleanly and not result.bad_lines and stream.gaps() == []
    assert not schema_errors(stream.records)
    if how == "exception":
        assert "ValueError: loss is NaN" in done.stderr  # Python's own report still happens
        errors = stream.of_kind("error")
        assert len(errors) == 1 and errors[0]["error_type"] == "ValueError"
    signals = [r for r in stream.of_kind("event") if r["name"] == "signal"]
    if how == "sigint":
        forward = stream.spans("model_forward")[-1]
        assert [(r["attrs"], r["span"]) for r in signals] == [
            ({"signal": "SIGINT", "exception": "KeyboardInterrupt"}, forward["id"])
        ]
        assert forward["status"] == "terminated" and signals[0]["ts"] == forward["ts"] + forward["dur"]
        assert not stream.of_kind("error")
    else:
        assert not signals
    if status is not None:
        assert {s["name"]: s["status"] for s in stream.spans() if s["name"] not in ("iteration", "model_forward")} == {
            "main_function": status,
            "training_loop": status,
        }
        assert stream.spans("iteration")[-1]["status"] == status
    else:
        assert [s["status"] for s in stream.spans()] == ["ok", "ok"]


@pytest.mark.subprocess
def test_segfault_stacks_go_to_the_fault_file(tmp_path: Path) -> None:
    """A segmentation fault: records up to the last flush are there, the open spans show as
    open, and the Python stacks are in ``<stream>.faults.txt``, which the reader picks up."""
    script = write_script(tmp_path, "end.py", ENDINGS)
    done = run_script(script, str(tmp_path / "logs"), "segfault")
    assert done.returncode == -signal.SIGSEGV
    path = tmp_path / "logs" / "end.jsonl"
    result = read_file(path)
    stream = result.streams[0]
    assert not stream.closed_cleanly
    open_spans = {s["name"] for s in stream.spans() if s["status"] == "open"}
    assert open_spans == {"main_function", "training_loop", "iteration"}
    assert "Segmentation fault" in result.faults
    assert 'File "' in result.faults and "end.py" in result.faults


@pytest.mark.subprocess
def test_the_processes_of_one_stream_file_each_have_their_part_of_the_fault_file(tmp_path: Path) -> None:
    """A job's restarts append to one stream file, and so to one fault file: a process that crashed, one that
    ended cleanly (its marker line taken out again: the file as the first left it, byte for byte), one that
    crashed too. The reader gives both crashes' stacks without the marker lines; ``errors`` reads each stream's
    process's own part (the first's stream is not the file's last: before, it had none)."""
    from traintrace._format import FAULTS_MARKER
    from traintrace.cli._diagnosis import _fault_stacks

    script = write_script(tmp_path, "end.py", ENDINGS)
    logs, path = tmp_path / "logs", tmp_path / "logs" / "end.jsonl"
    faults = path.with_name(path.name + ".faults.txt")
    assert run_script(script, str(logs), "segfault").returncode == -signal.SIGSEGV
    first = faults.read_bytes()
    assert first.startswith(FAULTS_MARKER.encode()) and b"Segmentation fault" in first
    assert run_script(script, str(logs), "exit").returncode == 3
    assert faults.read_bytes() == first
    assert run_script(script, str(logs), "segfault").returncode == -signal.SIGSEGV
    result = read_file(path)
    assert [s.closed_cleanly for s in result.streams] == [False, True, False]
    assert result.faults.count("Segmentation fault") == 2 and FAULTS_MARKER not in result.faults
    pids = [s.header["pid"] for s in result.streams]
    parts = [_fault_stacks(str(path), pid, last_in_file=i == 2) for i, pid in enumerate(pids)]
    assert parts[1] is None  # the clean run's: no stacks
    for part in (parts[0], parts[2]):
        assert part is not None and part.count("Segmentation fault") == 1 and "end.py" in part
    assert parts[0] + parts[2] == result.faults


@pytest.mark.subprocess
def test_fault_file_is_removed_after_a_clean_run(tmp_path: Path) -> None:
    """A run that ends normally leaves no fault file behind."""
    script = write_script(tmp_path, "end.py", ENDINGS)
    assert run_script(script, str(tmp_path / "logs"), "exit").returncode == 3
    assert not list((tmp_path / "logs").rglob("*.faults.txt"))
    assert (tmp_path / "logs" / "end.jsonl").exists()


# ---------------------------------------------------------------- SIGTERM hardening (issue 17, items 3 and 4)

FULL_QUEUE = """
import sys, time, traintrace as tt
from traintrace.backends import BaseBackend

class Slow(BaseBackend):
    def write(self, records):
        time.sleep(0.02)

tt.configure(job_id="full", log_dir=sys.argv[1], backends={"file": {"path": "full.jsonl"}, "log": False},
             extra_backends=[Slow()], queue_size=16, statistics=False, fault_handler=False)
print("ready", flush=True)
step = 0
while True:
    tt.event("e", {"step": step})   # the queue is always full: every call takes the overflow path
    step += 1
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_with_a_full_queue_never_hangs(tmp_path: Path) -> None:
    """SIGTERM while the training thread keeps hitting a full queue (the handler used to re-enter
    the lock that thread held): every one of 16 children dies by SIGTERM within 20 s, with a
    closed stream that records the signal."""
    script = write_script(tmp_path, "full.py", FULL_QUEUE)
    rng = random.Random(17)
    hung = 0
    for attempt in range(16):
        logs = tmp_path / f"logs{attempt}"
        child = subprocess.Popen(
            [sys.executable, str(script), str(logs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.02, 0.2))
        child.send_signal(signal.SIGTERM)
        try:
            child.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            hung += 1
            child.kill()
            child.communicate()
            continue
        assert child.returncode == -signal.SIGTERM
        stream = read_file(logs / "full.jsonl").streams[0]
        assert stream.closed_cleanly
        assert any(r["name"] == "signal" for r in stream.of_kind("event"))
    assert hung == 0


BURST = """
import sys, time, traintrace as tt
from traintrace.backends import BaseBackend

class Slow(BaseBackend):
    # A slow second sink: the final flush takes about a second.
    def write(self, records):
        time.sleep(0.06)

tt.configure(job_id="burst", log_dir=sys.argv[1], backends={"file": {"path": "burst.jsonl"}, "log": False},
             extra_backends=[Slow()], flush_interval=30, statistics=False, fault_handler=False)
for step in range(8000):
    tt.event("e", {"step": step})
print("ready", flush=True)
if sys.argv[2] == "close":
    tt.close()
    print("closed", flush=True)
time.sleep(60)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("when", ["twice", "during_close"])
def test_a_second_sigterm_or_one_during_close_keeps_the_first_flush(tmp_path: Path, when: str) -> None:
    """Two SIGTERMs 5 ms apart (a scheduler's cancel plus torchrun's forwarding), or one while
    close() is flushing: all 8,000 queued records and the close record are written, then the
    process dies by SIGTERM (or, after a completed close, by the signal as usual)."""
    script = write_script(tmp_path, "burst.py", BURST)
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "logs"), "close" if when == "during_close" else "run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    if when == "during_close":
        time.sleep(0.05)  # close() has started its flush (about a second long)
        child.send_signal(signal.SIGTERM)
    else:
        child.send_signal(signal.SIGTERM)
        time.sleep(0.005)
        child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM, err
    stream = read_file(tmp_path / "logs" / "burst.jsonl").streams[0]
    steps = [r["attrs"]["step"] for r in stream.of_kind("event") if r["name"] == "e"]
    assert steps == list(range(8000))
    assert stream.closed_cleanly
