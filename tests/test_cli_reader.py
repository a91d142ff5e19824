"""The two readers of a job's JSON lines (cli/_reader.py): traintrace's scanner and DuckDB's read_json give the
same ``raw`` table, row for row, and so the same answers.

The jobs: the scripted ones of tests/cli_jobs.py, a damaged job (cut line, impossible durations, a file with no
header), benchmarks/gen_job.py's synthetic job, device-timed jobs, the real jobs the suite records (five
processes with injected faults, the CPU example), and random files of records with hostile lines among them.
The tables are compared whole (every column, attrs text included, lean and not); the commands' answers field by
field (floats to 1e-9 relative: DuckDB's parallel sums differ in the last bits from run to run).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("duckdb")
pytest.importorskip("traintrace._scan")

from tests._examples import examples
from tests.cli_jobs import SCRIPT_IDS, SCRIPTS, Recording, Script, write_job
from tests.test_cli import faults_job  # noqa: F401 - the real five-process job, as a fixture here too
from tests.test_cli_parquet import answer, damaged_job, same
from tests.test_device_timing import FakeDevice, _write_job, device  # noqa: F401 - device timing's fixture
from tests.test_native_scan import dump, hostile, records
from traintrace.cli import _analysis, _reader
from traintrace.cli._engine import Job, LoadError

#: Each test names the reader it uses (``use``), whatever TRAINTRACE_PURE says.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("summary", "ranks", "errors")


def use(reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read with ``reader`` from now on (the native one regardless of TRAINTRACE_PURE, which the suite sets)."""
    monkeypatch.delenv("TRAINTRACE_PURE", raising=False)
    monkeypatch.setenv("TRAINTRACE_READER", reader)


def tables(paths: list[Path], reader: str, *, lean: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The raw and rare tables (sorted rows), the record count and the notes, as ``reader`` loads the files."""
    use(reader, monkeypatch)
    job = Job(list(paths), lean=lean)
    try:
        job._load()
    except LoadError:
        pass  # no header: still compared, table by table
    assert job.reader == reader, job.reader_error
    out = {name: sorted(job.con.execute(f"SELECT * FROM {name}").fetchall(), key=repr) for name in ("raw", "rare")}
    out["types"] = job.con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'raw'")
    out["types"] = out["types"].fetchall()
    out["records"] = job.record_count
    out["notes"] = job.notes
    return out


def same_tables(paths: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    for lean in (True, False):
        native = tables(paths, "native", lean=lean, monkeypatch=monkeypatch)
        duckdb = tables(paths, "duckdb", lean=lean, monkeypatch=monkeypatch)
        for name in native:
            assert native[name] == duckdb[name], (name, lean)


def same_answers(job: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """summary, ranks and errors from both readers, equal; returns the summary."""
    found = sorted(job.rglob("*.jsonl"))
    same_tables(found, monkeypatch)
    answers = {}
    for reader in ("native", "duckdb"):
        use(reader, monkeypatch)
        answers[reader] = {command: answer(command, job) for command in COMMANDS}
    same(answers["native"], answers["duckdb"])
    summary: dict[str, Any] = answers["native"]["summary"]
    return summary


@pytest.mark.parametrize("script", SCRIPTS, ids=SCRIPT_IDS)
def test_scripted_jobs_are_read_the_same(script: Script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_job(tmp_path / "job", script)
    same_answers(tmp_path / "job", monkeypatch)


def test_a_damaged_job_is_read_the_same_notes_included(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut last line, impossible durations (a float: left to DuckDB's reader) and a file without a header."""
    job = damaged_job(tmp_path / "job")
    with (job / "rank0.jsonl").open("a") as handle:  # records only DuckDB's reader decides on
        handle.write('{"seq": 9100, "kind": "event", "ts": 1.8e18, "name": "x", "attrs": {"a": 1.50, "b": NaN}}\n')
        handle.write('{"seq": 9101, "kind": "span", "ts": 1800000000000000001, "name": "iteration", "dur": 1.5e6,')
        handle.write(' "status": "ok", "attrs": {"step": "7", "batch_size": 8.0}}\n')
    summary = same_answers(job, monkeypatch)
    notes = " ".join(summary["notes"])
    assert "cut short" in notes and "2 spans without a possible duration" in notes and "no traintrace header" in notes


def test_the_synthetic_benchmark_job_is_read_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gen_job import generate
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    generate(tmp_path / "job", 6, 1200, 300)
    summary = same_answers(tmp_path / "job", monkeypatch)
    assert summary["ranks_seen"] == 6 and summary["restarts"] == 1


@pytest.mark.parametrize("kind", ["gpu", "waiting"])
def test_a_device_timed_job_is_read_the_same(
    device: FakeDevice,  # noqa: F811
    tmp_path: Path,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _write_job(tmp_path, device, kind)
    summary = same_answers(tmp_path / "logs", monkeypatch)
    assert summary["device"]["phase_means_s"]


@pytest.mark.subprocess
def test_the_real_faults_job_is_read_the_same(faults_job: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    same_answers(faults_job, monkeypatch)


@pytest.mark.subprocess
@pytest.mark.xdist_group("cpu_example")
def test_the_cpu_example_job_is_read_the_same(cpu_example_job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    same_answers(cpu_example_job, monkeypatch)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.lists(records(well_formed=False), min_size=1, max_size=20),
    rnd=st.randoms(use_true_random=False),
)
def test_random_files_give_the_same_table(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    batch: list[dict[str, Any]],
    rnd: random.Random,
) -> None:
    """Records of any types with damaged lines among them, spread over two files (one starting with a byte-order
    mark): the scanner plus DuckDB's reader for the lines it leaves give read_json's table exactly."""
    folder = tmp_path_factory.mktemp("random")
    header = {"seq": 0, "kind": "header", "ts": 1, "schema": "traintrace", "schema_version": 1, "rank": 0}
    lines = [dump(r, rnd) for r in batch]
    lines = [hostile(line, rnd) if rnd.random() < 0.3 else line for line in lines]
    paths = [folder / "rank0.jsonl", folder / "rank1.jsonl"]
    paths[0].write_bytes(b"\xef\xbb\xbf" + json.dumps(header).encode() + b"\n" + b"\n".join(lines[::2]) + b"\n")
    paths[1].write_bytes(b"\n".join(lines[1::2]))
    same_tables(paths, monkeypatch)


def test_the_scanner_is_used_when_built_and_duckdb_reads_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built: the scanner reads (also under TRAINTRACE_PURE=0), by default only a job of SCANNER_MIN_BYTES or
    more; TRAINTRACE_READER=duckdb or TRAINTRACE_PURE=1: DuckDB's read_json, as before; a compressed file is
    always DuckDB's."""
    write_job(tmp_path / "job", Script(ranks=2))
    size = sum(p.stat().st_size for p in (tmp_path / "job").glob("*.jsonl"))
    monkeypatch.delenv("TRAINTRACE_READER", raising=False)
    monkeypatch.setenv("TRAINTRACE_PURE", "0")
    assert Job.open([tmp_path / "job"], lean=True).reader == "duckdb"  # small: the default leaves it to DuckDB
    monkeypatch.setattr(_reader, "SCANNER_MIN_BYTES", size)
    assert Job.open([tmp_path / "job"], lean=True).reader == "native"
    monkeypatch.setattr(_reader, "SCANNER_MIN_BYTES", size + 1)
    assert Job.open([tmp_path / "job"], lean=True).reader == "duckdb"
    use("native", monkeypatch)
    assert Job.open([tmp_path / "job"], lean=True).reader == "native"
    monkeypatch.setenv("TRAINTRACE_PURE", "1")
    assert Job.open([tmp_path / "job"], lean=True).reader == "duckdb"
    use("duckdb", monkeypatch)
    assert Job.open([tmp_path / "job"], lean=True).reader == "duckdb"
    use("native", monkeypatch)
    assert _reader.scanner([tmp_path / "x.jsonl.gz"], ["kind"], [], lean=True, threads=1) is None


@pytest.fixture
def scanners(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The scanners the engine makes, kept for the test to inspect."""
    made: list[Any] = []
    real = _reader.scanner

    def keep(*args: Any, **kwargs: Any) -> Any:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(_reader, "scanner", keep)
    yield made


def test_a_command_reads_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scanners: list[Any]) -> None:
    """Opening a job reads every byte of every file once, in one scan (the lines it leaves to DuckDB are read
    from copies in the job's scratch folder), and the analyses never read a file again."""
    use("native", monkeypatch)
    write_job(tmp_path / "job", Script())
    with (tmp_path / "job" / "rank1.jsonl").open("a") as handle:
        handle.write('{"seq": 999, "kind": "event", "ts": 1.5, "name": "x"}\n{"seq": 1000, "kind"')
    log: list[str] = []
    connect = Job._connect
    monkeypatch.setattr(Job, "_connect", lambda self, **kw: Recording(connect(self, **kw), log))
    job = Job.open([tmp_path / "job"], lean=True)
    assert job.reader == "native" and len(scanners) == 1
    files = sorted((tmp_path / "job").glob("*.jsonl"))
    assert scanners[0].bytes_read == sum(p.stat().st_size for p in files)
    assert scanners[0].deferred_lines == 2
    reads = [sql for sql in log if "read_json" in sql or "read_parquet" in sql]
    assert len(reads) == 1  # the two lines left, from the scratch folder
    del log[:]
    _analysis.summary(job)
    _analysis.ranks(job)
    _analysis.errors(job)
    assert log and not [sql for sql in log if "read_json" in sql or "read_parquet" in sql or "_scan" in sql]


@pytest.mark.subprocess
def test_the_scanner_needs_no_python_layer_of_duckdb_but_its_sources(tmp_path: Path) -> None:
    """The Arrow scan of the scanner's columns sets up DuckDB's ``_sources`` modules alone (not the package's other
    layers, 90 ms to import); a later ``import duckdb`` runs the package as usual, and its scan still works."""
    import os
    import subprocess

    write_job(tmp_path / "job", Script(ranks=2))
    code = (
        "import json, sys\n"
        "from traintrace.cli._engine import Job\n"
        f"first = Job.open([{str(tmp_path / 'job')!r}], lean=True)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'duckdb')\n"
        "import duckdb\n"
        "assert duckdb.sql('SELECT 42').fetchall() == [(42,)]\n"
        f"second = Job.open([{str(tmp_path / 'job')!r}], lean=True)\n"
        "print('ANSWER', json.dumps([first.reader, first.reader_error, first.record_count, loaded,"
        " second.reader, second.reader_error, second.record_count, 'duckdb._relation' in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRAINTRACE_READER": "native"}
    env.pop("TRAINTRACE_PURE", None)
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    reader, error, records, loaded, reader2, error2, records2, package = json.loads(
        result.stdout.rsplit("ANSWER ", 1)[1]
    )
    assert (reader, error) == ("native", "") and (reader2, error2) == ("native", "")
    assert records == records2 > 0
    assert "duckdb._sources" in loaded and "duckdb" not in loaded and "duckdb._relation" not in loaded, loaded
    assert package  # the package imported later is whole
