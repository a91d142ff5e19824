"""First-run traps from issue 14: each test failed before its fix."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

import traintrace as tt

ROOT = Path(__file__).resolve().parents[1]


def _record_long_spans(logs: Path, steps: int = 40) -> dict[str, int]:
    """A job whose every fifth iteration, and its checkpoint, outlive a write cycle (start/end pairs).

    Returns the number of spans of each name, counted here, outside traintrace.
    """
    tt.configure(job_id="pairs", log_dir=str(logs), flush_interval=0.02, backends={"log": False})
    truth: dict[str, int] = {}
    with tt.application(), tt.training_loop():
        for step in range(steps):
            with tt.training_iteration(step) as it:
                if step % 5 == 0:
                    time.sleep(0.1)  # long: the writer sees it open and writes a start record
                it.add_metrics(loss=1.0 / (1 + step))
            truth["iteration"] = truth.get("iteration", 0) + 1
            if step == 20:
                with tt.span("long_phase"):
                    time.sleep(0.1)
                truth["long_phase"] = 1
    tt.close()
    truth["training_loop"] = truth["main_function"] = 1
    return truth


def test_spans_view_and_docs_snippet_give_one_row_per_span(tmp_path: Path) -> None:
    """`traintrace query` spans and the docs/format.md DuckDB snippet count each span once, long ones too."""
    duckdb = pytest.importorskip("duckdb")
    logs = tmp_path / "logs"
    truth = _record_long_spans(logs)
    kinds = [json.loads(line)["kind"] for line in (logs / "pairs" / "rank0.jsonl").read_text().splitlines()]
    assert kinds.count("start") >= 8, "the job must contain start/end pairs for this test to mean anything"

    from traintrace.cli import main

    out = tmp_path / "q.json"
    with out.open("w") as sink:
        old, sys.stdout = sys.stdout, sink
        try:
            assert main(["query", str(logs / "pairs"), "--json",
                         "SELECT name, count(*) AS n, count(DISTINCT id) AS ids FROM spans GROUP BY name"]) == 0
        finally:
            sys.stdout = old
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    counted = {row["name"]: row["n"] for row in rows}
    assert {name: counted.get(name) for name in truth} == truth
    assert all(row["n"] == row["ids"] for row in rows)

    snippet = re.search(r"```sql\n(.*?)```", (ROOT / "docs" / "format.md").read_text(), re.S)
    assert snippet is not None
    sql = snippet.group(1).replace("traintrace_logs/myjob", str(logs / "pairs"))
    result = {name: n for name, n, *_ in duckdb.sql(sql).fetchall()}
    assert {name: result.get(name) for name in truth} == truth
