"""Helpers for the tests that run a real training script in subprocesses and ask the command about it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"


def child_env(**extra: str) -> dict[str, str]:
    """This environment without traintrace settings or a rank's identity, with the checkout's sources first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINTRACE_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run(command: list[str], cwd: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, env=child_env(**extra_env), cwd=cwd, capture_output=True, text=True, check=False, timeout=240
    )


def start(command: list[str], cwd: Path, **extra_env: str) -> subprocess.Popen[bytes]:
    """Start ``command`` with its output in ``cwd/output.txt``: a process the job leaves running (a hung rank)
    would keep open the pipes that a capture waits on."""
    with (cwd / "output.txt").open("w") as output:
        return subprocess.Popen(command, env=child_env(**extra_env), cwd=cwd, stdout=output, stderr=subprocess.STDOUT)


def answers(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``traintrace errors`` and ``traintrace summary`` say of the job in ``folder``."""
    from traintrace.cli import _analysis
    from traintrace.cli._engine import Job

    job = Job.open([folder])
    try:
        return _analysis.errors(job), _analysis.summary(job)
    finally:
        job.close()


def say_wrong(job: object, folder: Path) -> None:
    """A sweep's line for a job whose answer was wrong (an assertion or anything else raised while checking it)."""
    import traceback

    print(f"WRONG {job} ({folder}):\n{traceback.format_exc(limit=2)}", flush=True)


def tally(jobs: int, wrong: int) -> int:
    """A sweep's last line, and its exit status: the number of wrong answers (at most 99)."""
    print(f"{jobs - wrong} of {jobs} jobs answered right")
    return min(wrong, 99)
