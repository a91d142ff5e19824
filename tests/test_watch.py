"""``traintrace watch``: a live view of a job from its files and progress files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import traintrace as tt
from traintrace.cli import main
from traintrace.cli._watch import RankRow, Watcher, _mark_suspects, render_table

SRC = Path(__file__).resolve().parents[1] / "src"
WORKER = Path(__file__).parent / "_progress_worker.py"


def test_errors_appear_once_as_the_stream_grows(tmp_path: Path) -> None:
    tt.configure(log_dir=str(tmp_path), job_id="j")
    watcher = Watcher(tmp_path / "j")
    with tt.training_loop(), tt.training_iteration(4), tt.forward():
        tt.flush()
        rows, messages = watcher.poll()
        assert messages == []
        assert [(r.rank, r.state, r.step, r.phase) for r in rows] == [(0, "running", 4, "model_forward")]
        tt.error(ValueError("first"))
        tt.flush()
        rows, messages = watcher.poll()
        assert messages == ["rank 0: ValueError: first"]
        assert watcher.poll()[1] == []  # parsed once: the offset moved on
        tt.error(RuntimeError("second\nmore lines"))
        tt.flush()
        assert watcher.poll()[1] == ["rank 0: RuntimeError: second"]
    tt.close()
    rows, _ = watcher.poll()
    assert rows[0].state == "finished"


def test_watch_once_json_and_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tt.configure(log_dir=str(tmp_path), job_id="j")
    with tt.training_iteration(9), tt.backward():
        assert main(["watch", str(tmp_path / "j"), "--once", "--json"]) == 0
        snapshot = json.loads(capsys.readouterr().out)
        assert snapshot["job"] == "j"
        (row,) = snapshot["ranks"]
        assert (row["rank"], row["state"], row["step"], row["phase"]) == (0, "running", 9, "model_backward")
        assert main(["watch", str(tmp_path / "j"), "--once"]) == 0
        (line,) = capsys.readouterr().out.splitlines()
        assert "rank=0 state=running step=9" in line and "phase=model_backward" in line
    assert main(["watch", str(tmp_path / "nothing-here")]) == 3


def test_hang_and_straggler_suspicion() -> None:
    rows = [
        RankRow(0, "running", step=50, step_time_s=0.1, phase="collective", since_s=40, in_collective=True),
        RankRow(1, "running", step=50, step_time_s=0.1, phase="model_forward", since_s=41),
        RankRow(2, "running", step=50, step_time_s=0.1, phase="collective", since_s=39, in_collective=True),
    ]
    _mark_suspects(rows, hang_after_s=30)
    assert rows[1].note.startswith("HANG?")
    assert rows[0].note == rows[2].note == "waiting in collective"
    rows = [RankRow(r, "running", step=20, step_time_s=0.1, since_s=0.01) for r in range(3)]
    rows.append(RankRow(3, "running", step=20, step_time_s=0.3, since_s=0.01))
    _mark_suspects(rows, hang_after_s=30)
    assert rows[3].note.startswith("slow: 3.0x") and not any(r.note for r in rows[:3])
    text = render_table("j", rows, ["rank 3: boom"], color=True)
    assert "\x1b[33m" in text and "rank 3: boom" in text


def test_a_rank_whose_writer_stopped_stamping_is_not_responding() -> None:
    """Its writer's stamp 12 s behind the others': not responding (not a hang suspect); 9 s: nothing yet."""
    rows = [
        RankRow(0, "running", step=7, phase="collective", since_s=12, in_collective=True, silent_s=0.0),
        RankRow(1, "running", step=7, phase="model_forward", since_s=12, silent_s=12.2),
        RankRow(2, "running", step=7, phase="collective", since_s=12, in_collective=True, silent_s=0.1),
    ]
    _mark_suspects(rows, hang_after_s=10)
    assert rows[1].note == "NOT RESPONDING: no sign of life for 12s (its process, writer included)"
    assert rows[0].note.startswith("HANG?") or rows[0].note == "waiting in collective"
    rows[1].silent_s = 9.0
    for row in rows:
        row.note = ""
    _mark_suspects(rows, hang_after_s=30)
    assert not any(r.note for r in rows)


@pytest.mark.subprocess
@pytest.mark.slow
def test_watch_a_running_torchrun_job(tmp_path: Path) -> None:
    """On a job still running, ``watch --once`` shows each rank's step; ``watch`` ends when the job does."""
    pytest.importorskip("torch")
    inherited = ("TRAINTRACE_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_", "MASTER_", "TT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    env.update({"TT_TRUTH": str(tmp_path), "TT_MODE": "run", "TRAINTRACE_LOG_DIR": str(tmp_path / "logs"),
                "TRAINTRACE_BACKENDS_LOG_ENABLED": "0", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])})  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # fmt: skip

    def truth_step(rank: int) -> int:
        lines = (tmp_path / f"truth{rank}.txt").read_text().splitlines()
        return int(lines[-1].split()[0]) if lines else -1

    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"truth{r}.txt").exists() and truth_step(r) >= 3 for r in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start stepping"
            time.sleep(0.1)
        (folder,) = (tmp_path / "logs").iterdir()
        before = [truth_step(r) for r in (0, 1)]
        out = subprocess.run([sys.executable, "-m", "traintrace.cli", "watch", str(folder), "--once"],
                             env=env, capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
        after = [truth_step(r) for r in (0, 1)]
        lines = out.splitlines()
        assert len(lines) == 2, out
        for rank, line in enumerate(lines):
            fields = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
            assert (fields["rank"], fields["state"]) == (str(rank), "running"), line
            assert before[rank] <= int(fields["step"]) <= after[rank], (before, line, after)
        (tmp_path / "stop").touch()
        live = io.StringIO()
        args = ["watch", str(folder), "--interval", "0.2"]
        from traintrace.cli import _parser
        from traintrace.cli._watch import run

        codes: list[int] = []
        watching = threading.Thread(target=lambda: codes.append(run(_parser().parse_args(args), out=live)),
                                    daemon=True)  # fmt: skip
        watching.start()
        watching.join(timeout=120)  # it returns once every rank has finished
        assert codes == [0], live.getvalue()[-2000:]
        assert job.wait(timeout=60) == 0
        final = live.getvalue().splitlines()
        assert final[-1] == "no rank is running any more"
        assert all("state=finished" in line for line in final[-3:-1]), final[-3:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # the launcher and its workers
        job.wait()
