"""The CPU training example the demo runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import read_jsonl
from traintrace.reader import read_file

ROOT = Path(__file__).resolve().parents[1]


def test_example_trains_and_records(tmp_path: Path) -> None:
    """examples/train_cpu.py runs, and its records are complete and valid."""
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_cpu.py"), "--log-dir", str(tmp_path), "--epochs", "2"],
        check=True,
        capture_output=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    path = tmp_path / "demo" / "rank0.jsonl"
    records = read_jsonl(path)
    names = [s["name"] for s in read_file(path).spans()]
    assert names.count("iteration") == 128
    assert names.count("checkpoint_save_sync") == 2
    assert names.count("model_forward") == 128
    iteration = read_file(path).spans("iteration")[0]
    assert isinstance(iteration["attrs"]["loss"], float)
    assert records[-1]["kind"] == "close" and records[-1]["dropped"] == 0
