"""``traintrace export --format parquet``: every command reads the export with the same answers as the files.

The jobs: the scripted ones of tests/cli_jobs.py (a failure and restart, a clean run, a missing rank,
damaged files), benchmarks/gen_job.py's synthetic job, and the real jobs the suite records (five
processes with injected faults, the CPU example). Answers are compared field by field; floats to
1e-9 relative (DuckDB's parallel sums differ in the last bits from run to run on the same files).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("duckdb")

from tests._examples import examples
from tests.cli_jobs import SCRIPT_IDS, SCRIPTS, S, Script, clock_ahead, scripts, write_job
from tests.test_cli import faults_job  # noqa: F401 - the real five-process job, as a fixture here too
from tests.test_device_timing import FakeDevice, _write_job, device  # noqa: F401 - device timing's fixture
from traintrace.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_USAGE, main

# The export and analysis of files: written by hand (tests/cli_jobs.py), or recorded, where both cores write the same
# records (tests/test_native_encoder.py): the same in both passes.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("summary", "ranks", "errors")


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def answer(command: str, path: Path, *extra: str) -> Any:
    code, out, err = run(command, str(path), "--json", "--quiet", *extra)
    assert code == EXIT_OK, err
    return json.loads(out)


def same(a: Any, b: Any, where: str = "") -> None:
    """``a == b``, floats to 1e-9 relative."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, int | float) and isinstance(b, int | float), (where, a, b)
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def export(job: Path, out: Path) -> dict[str, Any]:
    code, text, err = run("export", str(job), "--format", "parquet", "-o", str(out), "--json", "--quiet")
    assert code == EXIT_OK, err
    data: dict[str, Any] = json.loads(text)
    return data


def check_round_trip(job: Path, tmp_path: Path) -> dict[str, Any]:
    """Export ``job`` and assert that summary, ranks and errors answer the same from both."""
    out = tmp_path / "job.parquet"
    data = export(job, out)
    summary = answer("summary", job)
    assert data["records"] == summary["records"]
    assert data["partitions"] == len({p.name for p in out.iterdir() if p.name.startswith("rank=")})
    for command in COMMANDS:
        same(answer(command, job), answer(command, out), command)
    return summary


#: The damaged job's second host's clock runs this far ahead of the first's.
DAMAGED_AHEAD_S = 0.5


def damaged_job(folder: Path) -> Path:
    """A scripted job with what the reader tolerates: a cut last line, impossible durations, no header; ranks 4
    and 5 missing; two hosts of two ranks in lockstep, node1's clock ``DAMAGED_AHEAD_S`` ahead."""
    script = write_job(folder, Script(world_size=6, ranks_per_host=2, straggler=None))
    clock_ahead(folder, [2, 3], int(DAMAGED_AHEAD_S * S))
    with script.files[1].open("a") as handle:
        ts = 1_800_000_000 * 10**9 + 10**9
        handle.write(json.dumps({"seq": 9000, "kind": "span", "ts": ts, "name": "forward", "dur": -5}) + "\n")
        handle.write(json.dumps({"seq": 9001, "kind": "span", "ts": ts, "name": "forward", "dur": 9e18}) + "\n")
        handle.write('{"seq": 9002, "kind": "span", "ts": 18')  # the writer was killed mid-line
    (folder / "stray.jsonl").write_text(json.dumps({"seq": 1, "kind": "event", "ts": 5, "name": "x"}) + "\n")
    return folder


@pytest.mark.parametrize("script", SCRIPTS, ids=SCRIPT_IDS)
def test_scripted_jobs_answer_the_same_from_parquet(script: Script, tmp_path: Path) -> None:
    write_job(tmp_path / "job", script)
    check_round_trip(tmp_path / "job", tmp_path)


@pytest.mark.once
@pytest.mark.slow
@settings(
    max_examples=examples(10),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(script=scripts())
def test_random_scripted_jobs_answer_the_same_from_parquet(
    script: Script, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Any scripted job (tests/cli_jobs.py: failures of every kind the scripts make, restarts, hosts, missing
    ranks): the export answers as the files do."""
    folder = tmp_path_factory.mktemp("random")
    write_job(folder / "job", script)
    check_round_trip(folder / "job", folder)


def test_a_damaged_job_answers_the_same_notes_included(tmp_path: Path) -> None:
    job = damaged_job(tmp_path / "job")
    summary = check_round_trip(job, tmp_path)
    errors = answer("errors", tmp_path / "job.parquet")
    assert errors["clock_offsets"]["offsets_s"] == {"node1": pytest.approx(DAMAGED_AHEAD_S, abs=1e-3)}
    notes = " ".join(summary["notes"])
    assert "cut short" in notes and "2 spans without a possible duration" in notes
    assert "no traintrace header" in notes and "ranks missing entirely" in notes


def test_the_synthetic_benchmark_job_answers_the_same(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gen_job import generate
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    generate(tmp_path / "job", 6, 1200, 300)
    summary = check_round_trip(tmp_path / "job", tmp_path)
    assert summary["ranks_seen"] == 6 and summary["restarts"] == 1


@pytest.mark.parametrize("kind", ["gpu", "waiting"])
def test_a_device_timed_job_answers_the_same(device: FakeDevice, tmp_path: Path, kind: str) -> None:  # noqa: F811
    """gpu_dur and gpu_idle travel through the export: the device section is the same."""
    _write_job(tmp_path, device, kind)
    summary = check_round_trip(tmp_path / "logs", tmp_path)
    assert summary["device"]["phase_means_s"]


@pytest.mark.subprocess
def test_the_real_faults_job_answers_the_same(faults_job: Path, tmp_path: Path) -> None:  # noqa: F811
    check_round_trip(faults_job, tmp_path)


@pytest.mark.subprocess
@pytest.mark.xdist_group("cpu_example")
def test_the_cpu_example_job_answers_the_same(cpu_example_job: Path, tmp_path: Path) -> None:
    check_round_trip(cpu_example_job, tmp_path)


def test_the_export_is_typed_and_partitioned_by_rank(tmp_path: Path) -> None:
    """Any Parquet reader sees typed columns and the stream's rank as the partition key (DuckDB here)."""
    import duckdb

    script = write_job(tmp_path / "job", Script())
    out = tmp_path / "job.parquet"
    export(tmp_path / "job", out)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"rank={r}" for r in range(script.ranks)]
    meta = json.loads((out / "_traintrace.json").read_text())
    assert meta["format"] == "traintrace-parquet" and len(meta["files"]) == script.ranks
    con = duckdb.connect()
    files = [str(p) for p in out.rglob("*.parquet")]
    described = con.execute("DESCRIBE SELECT * FROM read_parquet($f, hive_partitioning=true)", {"f": files})
    types = {row[0]: row[1] for row in described.fetchall()}
    assert types["ts"] == "BIGINT" and types["dur"] == "BIGINT" and types["attrs"] == "VARCHAR"
    assert types["step"] == "BIGINT" and types["kind"] == "VARCHAR"
    # Counted independently of traintrace: every line of rank 2's file is one row of partition rank=2.
    lines = sum(1 for _ in script.files[2].open())
    rows = con.execute(
        "SELECT count(*) FROM read_parquet($f, hive_partitioning=true) WHERE rank = 2", {"f": files}
    ).fetchone()
    assert rows is not None and rows[0] == lines
    steps = con.execute(
        "SELECT max(step), max(try_cast(json_extract_string(attrs, '$.step') AS BIGINT)) "
        "FROM read_parquet($f, hive_partitioning=true) WHERE kind = 'span' AND name = 'iteration'",
        {"f": files},
    ).fetchone()
    assert steps is not None and steps[0] == steps[1] == script.steps - 1


def test_query_and_chrome_export_read_the_parquet_export(tmp_path: Path) -> None:
    write_job(tmp_path / "job", Script())
    out = tmp_path / "job.parquet"
    export(tmp_path / "job", out)
    sql = "SELECT rank, count(*) AS n, sum(dur) AS d FROM steps GROUP BY rank ORDER BY rank"
    assert answer("query", tmp_path / "job", sql) == answer("query", out, sql)
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    code, _, err = run("export", str(tmp_path / "job"), "-o", str(a), "--quiet")
    assert code == EXIT_OK, err
    code, _, err = run("export", str(out), "-o", str(b), "--quiet")
    assert code == EXIT_OK, err

    def events(path: Path) -> list[str]:
        return sorted(json.dumps(e, sort_keys=True) for e in json.loads(path.read_text())["traceEvents"])

    assert events(a) == events(b)


def test_export_refuses_a_folder_it_did_not_write_and_replaces_its_own(tmp_path: Path) -> None:
    write_job(tmp_path / "job", Script())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, _, err = run("export", str(tmp_path / "job"), "--format", "parquet", "-o", str(mine), "--quiet")
    assert code == EXIT_BAD_INPUT and "not a traintrace Parquet export" in err
    assert (mine / "notes.txt").read_text() == "keep me"
    out = tmp_path / "job.parquet"
    first = export(tmp_path / "job", out)
    second = export(tmp_path / "job", out)
    assert first["records"] == second["records"] == answer("summary", out)["records"]
    code, _, err = run("export", str(tmp_path / "job"), "--format", "parquet", "--ranks", "0", "--quiet")
    assert code == EXIT_USAGE and "--format chrome only" in err


def test_the_cache_answers_the_same_and_follows_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--cache``: the first command keeps the tables, the next ones open them; a changed file is read again."""
    from traintrace.cli._engine import Job

    monkeypatch.setenv("TRAINTRACE_CACHE_DIR", str(tmp_path / "cache"))
    script = write_job(tmp_path / "job", Script())
    job = tmp_path / "job"
    plain = {command: answer(command, job) for command in COMMANDS}
    first = Job.open([job], cache=True)
    assert not first.cached and first.cache_path is not None and first.cache_path.is_file()
    second = Job.open([job], cache=True)
    assert second.cached and second.cache_path == first.cache_path
    for command in COMMANDS:
        same(plain[command], answer(command, job, "--cache"), command)
    code, out, err = run("query", str(job), "--cache", "--json", "SELECT count(*) AS n FROM steps")
    assert code == EXIT_OK, err
    assert json.loads(out)[0]["n"] == answer("query", job, "SELECT count(*) AS n FROM steps")[0]["n"]
    # One more record in rank 0's file: a new key, the files are read again, the answer counts it.
    with script.files[0].open("a") as handle:
        handle.write(json.dumps({"seq": 9000, "kind": "event", "ts": 1_800_000_001 * 10**9, "name": "x"}) + "\n")
    third = Job.open([job], cache=True)
    assert not third.cached and third.cache_path != first.cache_path
    assert answer("summary", job, "--cache")["records"] == plain["summary"]["records"] + 1
