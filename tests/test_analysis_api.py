"""traintrace.analysis.open: the command's answers as dataclasses and DataFrames."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from tests.cli_jobs import Script, expected, write_job
from traintrace import analysis
from traintrace.cli import main

pytest.importorskip("duckdb")
pandas = pytest.importorskip("pandas")


def _same(ours: Any, theirs: Any) -> None:
    """Equal, numbers to a relative 1e-9 (DuckDB's parallel sums may differ in the last bits)."""
    if isinstance(ours, dict):
        assert set(ours) == set(theirs)
        for key in ours:
            _same(ours[key], theirs[key])
    elif isinstance(ours, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _same(a, b)
    elif isinstance(ours, float) and theirs is not None:
        assert ours == pytest.approx(theirs, rel=1e-9)
    else:
        assert ours == theirs


def _command(*args: str) -> Any:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*args, "--json", "--quiet"]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Script]:
    folder = tmp_path_factory.mktemp("job")
    return folder, write_job(folder, Script())


def test_summary_ranks_errors_and_sql_equal_the_commands(job: tuple[Path, Script]) -> None:
    """Same engine, same numbers: each answer equals the command's JSON, and the scripted truth."""
    folder, script = job
    truth = expected(script)
    with analysis.open(folder) as loaded:
        summary = loaded.summary()
        command = _command("summary", str(folder))
        _same(json.loads(json.dumps(summary.raw, default=str)), command)
        assert summary.goodput == pytest.approx(truth["goodput"])
        assert summary.steps_completed == command["steps_completed"] and summary.job == "scripted"

        ranks = loaded.ranks()
        assert isinstance(ranks, pandas.DataFrame)
        assert ranks["rank"].iloc[0] == script.straggler  # slowest first
        by_rank = {r["rank"]: r for r in _command("ranks", str(folder), "--all")["ranks"]}
        for row in ranks.to_dict("records"):
            assert row["median_s"] == pytest.approx(by_rank[row["rank"]]["median_s"])
            assert bool(row["straggler"]) == by_rank[row["rank"]]["straggler"]

        errors = loaded.errors()
        command_errors = _command("errors", str(folder))
        _same(errors.first_error, command_errors["first_error"])
        assert errors.first_error is not None and errors.first_error["rank"] == script.fail_rank
        assert errors.first_error["message"] == script.message
        assert list(errors.groups["count"]) == [1]
        assert errors.verdict == command_errors["verdict"] == summary.verdict
        assert errors.culprit is not None and errors.culprit["rank"] == script.fail_rank

        steps = loaded.sql("SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank")
        assert isinstance(steps, pandas.DataFrame)
        assert steps.to_dict("records") == _command(
            "query", str(folder), "SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank"
        )

        page = loaded._repr_html_()
        assert "goodput" in page and "<table>" in page
        assert "RuntimeError" in errors._repr_html_()


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        analysis.open(tmp_path / "absent")
