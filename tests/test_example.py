"""The CPU training example the demo runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_jsonl
from traintrace.reader import read_file

pytestmark = pytest.mark.subprocess


@pytest.mark.xdist_group("cpu_example")
def test_example_trains_and_records(cpu_example_job: Path) -> None:
    """examples/train_cpu.py runs, and its records are complete and valid."""
    path = cpu_example_job / "rank0.jsonl"
    records = read_jsonl(path)
    names = [s["name"] for s in read_file(path).spans()]
    assert names.count("iteration") == 128
    assert names.count("checkpoint_save_sync") == 2
    assert names.count("model_forward") == 128
    iteration = read_file(path).spans("iteration")[0]
    assert isinstance(iteration["attrs"]["loss"], float)
    assert records[-1]["kind"] == "close" and records[-1]["dropped"] == 0
