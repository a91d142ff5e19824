"""Console progress: one short line per interval on rank 0 when stderr is a terminal."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from traintrace._console import duration, human, progress_line

ROOT = Path(__file__).resolve().parents[1]

TRAIN = """
import time, traintrace as tt
tt.configure(job_id="console", log_dir={logs!r}, log_interval=10)
tt.set_step_info(batch_size=32, num_iterations=30, flops=2e11, peak_tflops=100.0)
with tt.application(), tt.training_loop():
    for step in range(30):
        with tt.training_iteration(step) as it:
            time.sleep(0.01)
            it.add_metrics(loss=10.0 / (step + 1))
tt.close()
"""


def _run_on_terminal(logs: Path, env: dict[str, str] | None = None) -> str:
    """Run the loop with stderr on a pseudo-terminal; returns what the terminal showed."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN.format(logs=str(logs))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", **(env or {})},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.subprocess
def test_one_line_per_interval_on_a_terminal(tmp_path: Path) -> None:
    """Three intervals of ten steps: three lines with step, ms/step (p90), samples/s, MFU, loss, ETA."""
    shown = _run_on_terminal(tmp_path / "logs")
    lines = [line for line in shown.splitlines() if "traintrace" in line and "ms/step" in line]
    assert len(lines) == 3, shown
    for number, line in enumerate(lines):
        last = 10 * number + 9
        assert re.match(r"\d\d:\d\d:\d\d traintrace step ", line), line
        assert f"step {last}/30" in line, line
        assert re.search(r"\d ms/step \(p90 [\d.,]+\)", line), line
        assert re.search(r"[\d,]+ samples/s", line), line
        assert "MFU " in line, line
        mean_loss = sum(10.0 / (s + 1) for s in range(last - 9, last + 1)) / 10  # truth, computed here
        assert f"loss {human(mean_loss, 4)}" in line, line
        assert ("ETA " in line) == (number < 2), line  # nothing left after the last step
        assert len(line) < 140
        assert not re.search(r"\d\.\d{5,}", line), line  # rounded for people


@pytest.mark.subprocess
def test_off_by_a_setting_and_off_without_a_terminal(tmp_path: Path) -> None:
    """TRAINTRACE_BACKENDS_CONSOLE_ENABLED=0 silences it; so does a stderr that is not a terminal."""
    shown = _run_on_terminal(tmp_path / "a", {"TRAINTRACE_BACKENDS_CONSOLE_ENABLED": "0"})
    assert "ms/step" not in shown
    result = subprocess.run(
        [sys.executable, "-c", TRAIN.format(logs=str(tmp_path / "b"))],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=True,
    )
    assert "ms/step" not in result.stderr


def test_lines_follow_the_users_logging(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With logging configured (here pytest's), the lines go through it at INFO on 'traintrace.progress'."""
    import traintrace as tt

    caplog.set_level("INFO", logger="traintrace.progress")
    tt.configure(job_id="c", log_dir=str(tmp_path), log_interval=5, backends={"console": {"enabled": True}})
    with tt.training_loop():
        for step in range(10):
            with tt.training_iteration(step):
                time.sleep(0.001)
    tt.close()
    lines = [r for r in caplog.records if r.name == "traintrace.progress"]
    assert [r.levelname for r in lines] == ["INFO", "INFO"]
    assert "step 4 " in lines[0].getMessage() and "step 9 " in lines[1].getMessage()


def test_numbers_are_rounded_for_people() -> None:
    """Three significant digits, thousands separators, short durations."""
    assert human(0.005376047950000001) == "0.00538"
    assert human(182.4) == "182"
    assert human(15234.7) == "15,235"
    assert human(12.345) == "12.3"
    assert human(0.0) == "0"
    assert duration(45.2) == "45s" and duration(692) == "11m32s" and duration(3 * 3600 + 300) == "3h05m"
    line = progress_line(
        {
            "average_iteration_time": 0.005376047950000001,
            "iteration_time_p90": 0.0061,
            "current_iteration": 1199,
            "completed_steps": 1200,
            "num_iterations": 5000,
            "interval": 100,
            "elapsed_time": 0.6,
            "tokens_per_second": 123456.789,
            "samples_per_second": 60.2,
            "mfu": 0.41234,
            "loss": 2.3141592,
        }
    )
    assert line == "step 1,199/5,000 | 5.38 ms/step (p90 6.1) | 123,457 tokens/s | MFU 41% | loss 2.314 | ETA 23s"
    assert progress_line({"interval": 0}) is None
