"""``--engine spark``: summary, ranks and errors from Spark SQL (local mode, a real JVM) equal DuckDB's.

The truth of the analyses is tested on DuckDB (tests/test_cli_analysis.py and others); these tests prove that
the two engines agree, over the JSON-lines folder and the Parquet export, on jobs of tests/cli_jobs.py (a
scripted job with a failure, a restart, missing ranks and damaged lines; one recorded between a framework's
hooks), a device-timed job and a real five-process job with injected faults; and that Spark reads the export.
Floats are compared to 1e-9 relative (parallel sums differ in the last bits). One Spark session serves the
module; each job is loaded once per engine and all three analyses are run on it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyspark.sql")
pytest.importorskip("sqlglot")

from tests.cli_jobs import Script, write_framework_job, write_job
from tests.test_cli import faults_job  # noqa: F401 - the real five-process job, as a fixture here too
from tests.test_cli_parquet import DAMAGED_AHEAD_S, answer, damaged_job, export, run, same
from tests.test_device_timing import FakeDevice, _write_job, device  # noqa: F401 - device timing's fixture
from traintrace.cli import EXIT_MISSING_EXTRA, EXIT_USAGE, _analysis, _jsonable
from traintrace.cli._engine import Job
from traintrace.cli._spark import SparkJob, translate

#: Spark's answers against DuckDB's on the same files: which core wrote them does not change the comparison.
pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.xdist_group("spark"), pytest.mark.once]

if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("no Java runtime for Spark", allow_module_level=True)


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    with pytest.MonkeyPatch.context() as patch:
        # The Python UDF's workers: this interpreter (which imports traintrace), not whatever python3 PATH has.
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        session = (
            SparkSession.builder.master("local[2]")
            .appName("traintrace-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "1")
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.sql.codegen.wholeStage", "false")
            # Small jobs, many short statements: compiling each expression's code (Janino) and the JVM's
            # optimising compiler cost more CPU than they save (the module's JVM: 113 s of CPU -> 45 s for the
            # same statements, measured on this suite's damaged job): CI's two CPUs are its limit.
            .config("spark.sql.codegen.factoryMode", "NO_CODEGEN")
            .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("ERROR")
        yield session
        session.stop()


def analyses(job: Job) -> dict[str, Any]:
    """What summary, ranks and errors print with --json, from one loaded job."""
    try:
        out = {
            "summary": _analysis.summary(job),
            "ranks": _analysis.ranks(job),
            "errors": _analysis.errors(job),
        }
    finally:
        job.close()
    return _jsonable(out)  # type: ignore[no-any-return]


def check_engines_agree(path: Path, spark: Any) -> dict[str, Any]:
    duck = analyses(Job.open([path], lean=True))
    sparks = analyses(SparkJob.open([path], lean=True, spark=spark))
    for command in ("summary", "ranks", "errors"):
        same(duck[command], sparks[command], command)
    return duck


def test_the_parquet_export_answers_the_same_on_spark(tmp_path: Path, spark: Any) -> None:
    job = damaged_job(tmp_path / "job")
    out = tmp_path / "job.parquet"
    export(job, out)
    duck = check_engines_agree(out, spark)
    notes = " ".join(duck["summary"]["notes"])
    assert "cut short" in notes and "2 spans without a possible duration" in notes


def test_spark_reads_the_export_as_documented(tmp_path: Path, spark: Any) -> None:
    """Apache Spark (local mode, a real JVM) reads the export: typed columns, ``rank`` from the folders, the
    launcher's records under a null rank, the metadata file skipped; counts and sums as the JSON lines say."""
    script = write_job(tmp_path / "job", Script())
    agent = tmp_path / "job" / "agent.jsonl"
    header = {"seq": 0, "kind": "header", "ts": 1_800_000_000 * 10**9, "schema": "traintrace", "schema_version": 1}
    event = {"seq": 1, "kind": "event", "ts": 1_800_000_000 * 10**9 + 1, "name": "rendezvous"}
    agent.write_text(json.dumps({**header, "role": "agent"}) + "\n" + json.dumps(event) + "\n")
    out = tmp_path / "job.parquet"
    export(tmp_path / "job", out)
    # The truth, from the JSON lines themselves: records and iteration time per rank.
    truth: dict[int | None, tuple[int, int]] = {}
    for rank, path in [*script.files.items(), (None, agent)]:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        iteration_ns = sum(r["dur"] for r in records if r["kind"] == "span" and r.get("name") == "iteration")
        truth[rank] = (len(records), iteration_ns)
    frame = spark.read.parquet(str(out))
    types = dict(frame.dtypes)
    assert types["rank"] == "int" and types["ts"] == "bigint" and types["dur"] == "bigint"
    assert types["attrs"] == "string" and types["step"] == "bigint" and types["kind"] == "string"
    frame.createOrReplaceTempView("records")
    rows = spark.sql(
        "SELECT rank, count(*) AS n, coalesce(sum(CASE WHEN kind = 'span' AND name = 'iteration' THEN dur END), 0) "
        "AS d FROM records GROUP BY rank"
    ).collect()
    assert {row["rank"]: (row["n"], row["d"]) for row in rows} == truth
    steps = spark.sql(
        "SELECT max(step), max(CAST(get_json_object(attrs, '$.step') AS BIGINT)) FROM records "
        "WHERE kind = 'span' AND name = 'iteration'"
    ).collect()[0]
    assert steps[0] == steps[1] == script.steps - 1
    spark.catalog.dropTempView("records")


def test_a_damaged_job_answers_the_same_on_spark_notes_included(tmp_path: Path, spark: Any) -> None:
    """The scripted job (a failure and a restart), two of its six ranks missing, damaged lines among its records,
    its second host's clock ahead."""
    job = damaged_job(tmp_path / "job")
    answers = check_engines_agree(job, spark)
    assert answers["errors"]["clock_offsets"]["offsets_s"] == {"node1": pytest.approx(DAMAGED_AHEAD_S, abs=1e-3)}
    summary = answers["summary"]
    notes = " ".join(summary["notes"])
    assert "cut short" in notes and "2 spans without a possible duration" in notes
    assert "no traintrace header" in notes and "ranks missing entirely" in notes


_ABORTED_IN_A_STEP = """
import json, os, sys, time
import traintrace as tt

tt.configure(log_dir=sys.argv[1], job_id="aborted", flush_interval=0.1, log_interval=1)
with tt.training_loop():
    began = time.time_ns()
    for step in range(5):
        with tt.training_iteration(step):
            time.sleep(0.02)
    with tt.training_iteration(5), tt.span(tt.SpanName.COLLECTIVE):
        time.sleep(1.0)  # waits, writing nothing, until a watchdog aborts it
        with open(sys.argv[2], "w") as out:
            json.dump({"began": began, "aborted": time.time_ns()}, out)
        os.abort()
"""


def test_a_rank_aborted_in_a_step_answers_the_same_on_spark(tmp_path: Path, spark: Any) -> None:
    """A real process aborted (SIGABRT) 1 s into its sixth step, its stream's last record the step's start, no
    checkpoint saved: every step is lost progress, up to its progress file's last stamp, on both engines (the SQL
    differs there: a join on a VALUES list failed on Spark's checkpointed tables; and a one-rank job failed on Spark
    before, a list's second item read where there is none), within a flush interval of the script's own clock."""
    import subprocess

    from tests._reliability import child_env, write_script

    script = write_script(tmp_path, "aborted.py", _ABORTED_IN_A_STEP)
    truth = tmp_path / "truth.json"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "logs"), str(truth)], env=child_env(), timeout=60, check=False
    )
    assert done.returncode == -6
    marks = json.loads(truth.read_text())
    summary = check_engines_agree(tmp_path / "logs" / "aborted", spark)["summary"]
    lost = summary["breakdown_s"]["lost_progress"]
    waited = (marks["aborted"] - marks["began"]) / 1e9
    assert waited - 0.15 <= lost <= waited + 0.01, (lost, waited, summary["breakdown_s"])


def test_a_device_timed_job_answers_the_same_on_spark(device: FakeDevice, tmp_path: Path, spark: Any) -> None:  # noqa: F811
    _write_job(tmp_path, device, "gpu")
    summary = check_engines_agree(tmp_path / "logs", spark)["summary"]
    assert summary["device"]["phase_means_s"]


def test_a_job_recorded_between_a_frameworks_hooks_answers_the_same_on_spark(tmp_path: Path, spark: Any) -> None:
    """Steps own work outside backward, waits tied to the steps they fed, a gather taken out of them; the slow
    rank slow at every third step only, found step by step (its medians are the other rank's)."""
    write_framework_job(tmp_path / "job", 0, 2, "data_loading", gather=True, every=3)
    ranks = check_engines_agree(tmp_path / "job", spark)["ranks"]
    assert ranks["stragglers"] == [0]
    assert ranks["ranks"][0]["slow_in"] == "data_loading" and ranks["ranks"][0]["slow_every"] == 3


def test_the_real_faults_job_answers_the_same_on_spark(faults_job: Path, spark: Any) -> None:  # noqa: F811
    errors = check_engines_agree(faults_job, spark)["errors"]
    assert errors["culprit"] is not None


def test_the_command_runs_spark_and_says_what_is_missing(
    tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``traintrace ranks --engine spark`` prints DuckDB's answer; no Java or no pyspark is said plainly."""
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    same(answer("ranks", tmp_path / "job"), answer("ranks", tmp_path / "job", "--engine", "spark"), "ranks")
    code, _, err = run("summary", str(tmp_path / "job"), "--engine", "spark", "--cache")
    assert code == EXIT_USAGE and "--engine duckdb only" in err
    # No Java runtime and no session running: a configuration error (exit 2), no traceback.
    spark.stop()
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = run("summary", str(tmp_path / "job"), "--engine", "spark")
    assert code == EXIT_USAGE and "needs a Java runtime" in err and "Traceback" not in err
    monkeypatch.setitem(__import__("sys").modules, "pyspark.sql", None)
    code, _, err = run("summary", str(tmp_path / "job"), "--engine", "spark")
    assert code == EXIT_MISSING_EXTRA and "pip install 'traintrace[spark]'" in err


def test_every_statement_translates_for_spark() -> None:
    """The translation is one step: DuckDB's as-of join would not translate, so the SQL no longer uses it."""
    [(action, name, if_not_exists, text)] = translate("CREATE TEMP TABLE IF NOT EXISTS t AS SELECT median(x) FROM y")
    assert (action, name, if_not_exists) == ("table", "t", True)
    assert "percentile(x, 0.5)" in text.lower()
    [(action, _, _, text)] = translate("SELECT quantile_cont(d, 0.9) FROM i WHERE rank = $r")
    assert action == "query" and ":r" in text and "percentile(d, 0.9)" in text.lower()
    source = "".join(
        (Path(_analysis.__file__).parent / name).read_text() for name in ("_analysis.py", "_engine.py", "_diagnosis.py")
    )
    assert "ASOF" not in source and "UPDATE " not in source
