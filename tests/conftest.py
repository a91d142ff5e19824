"""Shared fixtures: every test gets a clean traintrace and a clean environment."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import traintrace as tt
from traintrace import _recorder
from traintrace.backends._scalars import framework_logs

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "src" / "traintrace" / "schema" / "record-v1.schema.json"


@cache
def _validator() -> Any:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def validate_record(record: dict[str, Any]) -> None:
    """Fail the test if ``record`` does not match record format v1."""
    errors = sorted(_validator().iter_errors(record), key=str)
    assert not errors, f"{record} violates the schema: {errors[0].message}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSONL file, parsed and validated against the schema."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for record in records:
        validate_record(record)
    return records


@pytest.fixture(autouse=True)
def _clean_traintrace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith(("TRAINTRACE_", "OTEL_")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
            "SLURM_PROCID",
            "SLURM_JOB_ID",
            "MASTER_PORT",
        ):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    _recorder._warned.clear()
    framework_logs.active = False  # set by the Lightning/HF callbacks for the process (trackers' tests)
    yield
    tt.close()
    _recorder._warned.clear()


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[tt.MemoryBackend]:
    """traintrace configured with only an in-memory backend (and a file under tmp_path)."""
    backend = tt.MemoryBackend()
    tt.configure(job_id="test", log_dir=str(tmp_path / "logs"), backends={"log": False}, extra_backends=[backend])
    yield backend
    tt.close()
