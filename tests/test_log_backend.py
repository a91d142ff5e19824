"""The key=value log backend."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

import traintrace as tt
from traintrace.logfmt import parse_line


@contextlib.contextmanager
def _keep_log_records(level: int) -> Iterator[list[logging.LogRecord]]:
    """What the log backend's logger emits at ``level``, collected in a list."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("traintrace.records")
    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


@pytest.fixture
def captured() -> Iterator[list[logging.LogRecord]]:
    with _keep_log_records(logging.INFO) as records:
        yield records


def test_lines_parse_back_with_identity(tmp_path: Path, captured: list[logging.LogRecord]) -> None:
    """Each record is one parseable line with job, rank, kind and name."""
    tt.configure(job_id="kv-job", log_dir=str(tmp_path), backends={"file": False})
    with tt.checkpoint_save(tt.CheckpointSaveMetrics.create(checkpoint_type=tt.CheckPointType.GLOBAL)) as save:
        save.add_metrics({"note": 'has "quotes" and = signs\nand a newline'})
    tt.close()
    lines = [parse_line(r.getMessage()) for r in captured]
    save_line = next(line for line in lines if line.get("name") == "checkpoint_save_sync")
    assert save_line["job"] == "kv-job" and save_line["rank"] == "0"
    assert save_line["checkpoint_type"] == "global"
    assert save_line["note"] == 'has "quotes" and = signs\nand a newline'
    assert float(save_line["dur_ms"]) >= 0
    assert lines[0]["kind"] == "header"


def test_iterations_are_not_logged_at_info(tmp_path: Path, captured: list[logging.LogRecord]) -> None:
    """Per-iteration spans (tracing) stay out of the info-level log."""
    tt.configure(job_id="j", log_dir=str(tmp_path), backends={"file": False})
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
    tt.close()
    names = [parse_line(r.getMessage()).get("name") for r in captured]
    assert "training_loop" in names
    assert "iteration" not in names


def test_errors_log_at_error_level(tmp_path: Path, captured: list[logging.LogRecord]) -> None:
    """Error records use logging.ERROR."""
    tt.configure(job_id="j", log_dir=str(tmp_path), backends={"file": False})
    tt.error(RuntimeError("bad"))
    tt.close()
    errors = [r for r in captured if r.levelno == logging.ERROR]
    assert parse_line(errors[0].getMessage())["message"] == "bad"


def test_json_format(tmp_path: Path, captured: list[logging.LogRecord]) -> None:
    """format=json logs each record as a JSON object."""
    tt.configure(job_id="j", log_dir=str(tmp_path), backends={"file": False, "log": {"format": "json"}})
    tt.event("e", {"a": 1})
    tt.close()
    parsed = [json.loads(r.getMessage()) for r in captured]
    assert any(p.get("name") == "e" and p["attrs"] == {"a": 1} for p in parsed)


def test_only_errors_on_other_ranks(tmp_path: Path, captured: list[logging.LogRecord]) -> None:
    """On rank 1, the default log backend writes errors but not spans."""
    tt.configure(job_id="j", rank=1, world_size=2, log_dir=str(tmp_path), backends={"file": False})
    with tt.training_loop():
        tt.error("only this")
    tt.close()
    kinds = [parse_line(r.getMessage())["kind"] for r in captured]
    assert "error" in kinds and "span" not in kinds


def test_lifecycle_events_follow_the_loggers_level(tmp_path: Path) -> None:
    """While the log's logger skips INFO, events go to the file alone (the native encoder
    writes them); once it is enabled they are logged too, and the file has every event."""
    from traintrace import events

    logger = logging.getLogger("traintrace.records")
    with _keep_log_records(logging.WARNING) as records:
        tt.configure(job_id="ev", log_dir=str(tmp_path))
        events.record(events.EventType.WORKER_EXIT, worker_id=0, exit_code=0, data={"epoch": 1, "loss": 0.5})
        tt.flush()
        assert not [r for r in records if "worker_exit" in r.getMessage()]
        logger.setLevel(logging.INFO)
        events.record(events.EventType.WORKER_EXIT, worker_id=1, exit_code=0, data={"epoch": 2, "loss": 0.25})
        tt.flush()
        tt.close()
    logged = [parse_line(r.getMessage()) for r in records if "worker_exit" in r.getMessage()]
    assert [line["worker_id"] for line in logged] == ["1"]
    written = [json.loads(line) for line in (tmp_path / "ev" / "rank0.jsonl").read_text().splitlines()]
    exits = [r["attrs"] for r in written if r.get("name") == "worker_exit"]
    expected = [(0, {"epoch": 1, "loss": 0.5}), (1, {"epoch": 2, "loss": 0.25})]
    assert [(a["worker_id"], a["data"]) for a in exits] == expected
