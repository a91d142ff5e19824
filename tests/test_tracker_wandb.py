"""W&B backend: a real training loop logged offline, read back with W&B's own .wandb reader."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._trackers import STEPS, train

pytest.importorskip("wandb")


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B's caches and settings inside the test's folder; offline, quiet."""
    for name in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    return tmp_path


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's .wandb transaction log, read by `wandb leet inspect --json`."""
    (log,) = run_dir.glob("run-*.wandb")
    wandb_cli = shutil.which("wandb", path=str(Path(sys.executable).parent))
    assert wandb_cli is not None
    result = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", str(log)], capture_output=True, text=True, timeout=120, check=True
    )
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.subprocess
def test_history_summary_and_errors_in_wandb(wandb_home: Path) -> None:
    """History rows against traintrace/step, the error as HTML at its step, goodput in the summary."""
    truth = train(
        wandb_home / "logs", {"wandb": {"mode": "offline", "dir": str(wandb_home / "runs"), "project": "proj"}}
    )
    (run_dir,) = (wandb_home / "runs" / "wandb").glob("offline-run-*")
    records = _records(run_dir)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "trk" and run["project"] == "proj"
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    loss = {row["traintrace/step"]: row["loss"] for row in history if "loss" in row}
    assert loss == pytest.approx(truth.losses, rel=1e-6)
    timed = [row for row in history if "traintrace/step_time_p90_ms" in row]
    assert [row["traintrace/step"] for row in timed] == truth.interval_ends
    (save,) = [row for row in history if "traintrace/checkpoint/checkpoint_save_sync_s" in row]
    assert 0.05 <= save["traintrace/checkpoint/checkpoint_save_sync_s"] <= truth.checkpoint_s
    assert save["traintrace/step"] == 9
    (error,) = [row for row in history if row.get("traintrace/error_text._type") == "html-file"]
    assert error["traintrace/step"] == 7
    page = run_dir / "files" / error["traintrace/error_text.path"]
    assert "ValueError: bad batch 7" in page.read_text()
    summary: dict[str, Any] = {}
    for record in records:
        if record["type"] == "summary":
            summary.update(record["summary"].get("update", {}))
    assert 0 < summary["traintrace/goodput"] < 1
    assert summary["traintrace/completed_steps"] == STEPS
    assert summary["traintrace/last_error"] == "ValueError: bad batch 7"
    steps = [r["metric"] for r in records if r["type"] == "metric" and r["metric"].get("step_metric")]
    assert steps and all(m["step_metric"] == "traintrace/step" for m in steps)
    assert any(r["type"] == "exit" for r in records)  # the run traintrace started was finished


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_already_started_is_used_and_left_to_its_owner(wandb_home: Path) -> None:
    """wandb.init() before configure(): traintrace logs into that run, charts only its own figures against
    traintrace/step, and does not finish it."""
    import wandb

    run = wandb.init(mode="offline", dir=str(wandb_home / "runs"), project="mine", name="owner")
    try:
        train(wandb_home / "logs", {"wandb": {}})
        assert wandb.run is run  # still running: its owner finishes it
        run.log({"mine": 1.0})
    finally:
        run.finish()
    (run_dir,) = (wandb_home / "runs" / "wandb").glob("offline-run-*")
    records = _records(run_dir)
    (info,) = [r["run"] for r in records if r["type"] == "run"]
    assert info["display_name"] == "owner"
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert any("traintrace/step_time_ms" in row for row in history)
    assert any("mine" in row for row in history)
    globs = {r["metric"].get("glob_name") for r in records if r["type"] == "metric"}
    assert "traintrace/*" in globs and "*" not in globs
