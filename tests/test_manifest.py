"""The job folder: manifest written once, registrations, missing ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import traintrace as tt
from traintrace.manifest import MANIFEST_NAME, read_job


@pytest.fixture(autouse=True)
def _closed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith(("TRAINTRACE_", "RANK", "WORLD_SIZE", "TORCHELASTIC_", "SLURM_")):
            monkeypatch.delenv(key)
    yield
    tt.close()


def _configure(tmp_path: Path, **settings: object) -> None:
    tt.configure(log_dir=str(tmp_path), job_id="job1", backends={"log": False}, **settings)
    tt.close()


def test_rank_zero_writes_manifest_and_registration(tmp_path: Path) -> None:
    """Rank 0 writes the manifest (job, world size, config, version) and registers."""
    _configure(tmp_path, rank=0, world_size=2, job_name="demo")
    folder = tmp_path / "job1"
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["job"] == "job1"
    assert manifest["job_name"] == "demo"
    assert manifest["world_size"] == 2
    assert manifest["created_by"] == "rank0"
    assert manifest["library_version"] == tt.__version__
    assert manifest["config"]["backends"]["file"]["path"] == "{job}/rank{rank}.jsonl"
    assert manifest["created_ns"] > 0
    info = read_job(folder)
    assert info.ranks() == [0]
    assert info.missing_ranks() == [1]
    assert info.hosts
    assert info.registrations[0]["stream"].endswith("rank0.jsonl")


def test_manifest_is_written_once(tmp_path: Path) -> None:
    """A second start (a restart) registers again but leaves the manifest alone."""
    _configure(tmp_path, rank=0, world_size=2)
    first = (tmp_path / "job1" / MANIFEST_NAME).read_text()
    _configure(tmp_path, rank=0, world_size=2, restart_count=1, job_name="changed")
    assert (tmp_path / "job1" / MANIFEST_NAME).read_text() == first
    info = read_job(tmp_path / "job1")
    assert info.restarts == 1
    assert info.ranks(restart=0) == [0]
    assert info.ranks() == [0]


def test_other_ranks_only_register(tmp_path: Path) -> None:
    """Rank 1 registers and writes no manifest; with rank 0 the job is complete."""
    _configure(tmp_path, rank=1, world_size=2)
    assert not (tmp_path / "job1" / MANIFEST_NAME).exists()
    _configure(tmp_path, rank=0, world_size=2)
    info = read_job(tmp_path / "job1")
    assert info.ranks() == [0, 1]
    assert info.missing_ranks() == []


def test_manifest_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """manifest=False (or TRAINTRACE_MANIFEST=0) writes neither manifest nor registration."""
    _configure(tmp_path, manifest=False)
    monkeypatch.setenv("TRAINTRACE_MANIFEST", "0")
    _configure(tmp_path, job_name="x")
    folder = tmp_path / "job1"
    assert not (folder / MANIFEST_NAME).exists()
    assert not (folder / "ranks").exists()


def test_bad_manifest_value_is_a_config_error(tmp_path: Path) -> None:
    """A non-boolean manifest setting names the field."""
    with pytest.raises(tt.ConfigError, match="manifest"):
        tt.configure(log_dir=str(tmp_path), manifest="sometimes")


def test_read_job_tolerates_damage(tmp_path: Path) -> None:
    """A corrupt manifest or registration is skipped, not raised."""
    folder = tmp_path / "job"
    (folder / "ranks").mkdir(parents=True)
    (folder / MANIFEST_NAME).write_text("{not json")
    (folder / "ranks" / "rank0.restart0.json").write_text('{"rank": 0, "world_size": 3, "host": "a"}')
    (folder / "ranks" / "rank1.restart0.json").write_text("garbage")
    info = read_job(folder)
    assert info.manifest is None
    assert info.world_size == 3
    assert info.missing_ranks() == [1, 2]
    assert info.hosts == ["a"]
    assert read_job(tmp_path / "absent").registrations == []
