"""Progress files in real torchrun jobs (gloo on CPU) whose ranks die by a signal mid-step.

The worker (tests/_progress_worker.py) writes its own truth, outside
traintrace: the step and phase it enters. The progress file's step and phase
must equal it exactly, and traintrace-run's ``worker_failure`` event must name the
rank, the exit code, the signal and that same step and phase.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from traintrace.cli._watch import Watcher
from traintrace.progress import DEAD, read_job_progress, stream_state
from traintrace.reader import read_file

pytest.importorskip("torch")

WORKER = Path(__file__).parent / "_progress_worker.py"
SRC = Path(__file__).resolve().parents[1] / "src"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    inherited = ("TRAINTRACE_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_", "MASTER_", "TT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    env.update(
        {
            "TT_TRUTH": str(tmp_path),
            "TRAINTRACE_LOG_DIR": str(tmp_path / "logs"),
            "TRAINTRACE_BACKENDS_LOG_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
            **extra,
        }
    )
    return env


def _launch(tmp_path: Path, nproc: int, launcher: str, **extra: str) -> subprocess.Popen[str]:
    module = "traintrace.launch" if launcher == "traintrace-run" else "torch.distributed.run"
    command = [sys.executable, "-m", module, "--standalone", "--nproc-per-node", str(nproc),
               "--monitor-interval", "0.1", str(WORKER)]  # fmt: skip
    return subprocess.Popen(command, cwd=tmp_path, env=_env(tmp_path, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def _end(proc: subprocess.Popen[str]) -> None:
    """Kill the launcher and its workers, if a failed test left them running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _truth(tmp_path: Path, rank: int) -> tuple[int, str]:
    step, phase = (tmp_path / f"truth{rank}.txt").read_text().splitlines()[-1].split()
    return int(step), phase


def _agent_failures(job: Path) -> dict[int, dict[str, Any]]:
    (agent,) = read_file(job / "agent.jsonl").streams
    found = {}
    for record in agent.records:
        if record.get("kind") == "event" and record.get("name") == "worker_failure":
            found[record["attrs"]["rank"]] = record["attrs"]
    return found


CASES = {
    "SIGKILL": ("kill", -9, "model_backward"),
    "SIGSEGV": ("segv", -11, "collective"),
    "SIGTERM": ("pause", -15, "model_forward"),
}


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("signame", list(CASES))
def test_a_rank_killed_mid_step_leaves_its_exact_step_and_phase(tmp_path: Path, signame: str) -> None:
    mode, exit_code, phase = CASES[signame]
    proc = _launch(tmp_path, 2, "traintrace-run", TT_MODE=mode, TT_VICTIM="1", TT_STEP="40", TT_PHASE=phase)
    try:
        if signame == "SIGTERM":
            deadline = time.monotonic() + 90
            while not (tmp_path / "paused").exists():
                assert proc.poll() is None and time.monotonic() < deadline, "the victim never paused"
                time.sleep(0.05)
            os.kill(int((tmp_path / "paused").read_text()), signal.SIGTERM)  # from outside
        output, _ = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert proc.returncode != 0, output[-3000:]
    (job,) = (tmp_path / "logs").iterdir()
    truth = _truth(tmp_path, 1)
    assert truth == (40, phase)

    progress = read_job_progress(job)
    assert sorted(progress) == [0, 1]
    victim = progress[1]
    assert (victim.step, victim.phase) == truth
    assert victim.in_collective == (phase == "collective")
    assert victim.state == ("terminated" if signame == "SIGTERM" else "running")
    assert victim.steps_done == 40 and victim.step_done == 39
    # The survivor, stopped by the launcher wherever it was: its step is its own truth's.
    assert progress[0].step == _truth(tmp_path, 0)[0]

    failure = _agent_failures(job)[1]
    assert failure["exit_code"] == exit_code
    assert failure["data"]["signal"] == signame
    assert (failure["data"]["last_step"], failure["data"]["last_phase"]) == truth
    assert failure["data"]["in_collective"] == (phase == "collective")
    assert failure["data"]["pid"] == victim.pid

    expected = "failed" if signame == "SIGTERM" else DEAD
    assert stream_state(victim) == expected

    # traintrace watch, after the fact: the death as the launcher saw it, and the rank's state.
    rows, messages = Watcher(job).poll()
    died = f"rank 1 died (launcher): exit code {exit_code}, {signame}, at step 40 in {phase}"
    assert died in messages
    assert {r.rank: r.state for r in rows}[1] == expected


@pytest.mark.subprocess
@pytest.mark.slow
def test_plain_torchrun_progress_files_give_the_last_step(tmp_path: Path) -> None:
    """Without traintrace-run, the progress files alone hold the killed rank's step and phase."""
    proc = _launch(tmp_path, 2, "torchrun", TT_MODE="kill", TT_VICTIM="0", TT_STEP="25", TT_PHASE="optimizer_update")
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert proc.returncode != 0, output[-3000:]
    (job,) = (tmp_path / "logs").iterdir()
    assert not (job / "agent.jsonl").exists()
    victim = read_job_progress(job)[0]
    assert (victim.step, victim.phase) == _truth(tmp_path, 0) == (25, "optimizer_update")
    assert stream_state(victim) == DEAD
    (stream,) = read_file(job / "rank0.jsonl").streams
    assert not stream.closed_cleanly
