"""traintrace.cli._engine and the report's JSON embedding: parsers and escapes, property-tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.cli_jobs import Recording
from traintrace.cli._engine import (
    ScratchFolder,
    check_tail,
    compress_ranks,
    discover,
    last_run_start,
    parse_ranks,
)

pytest.importorskip("duckdb")

from traintrace.cli._report import _safe_json

# The analysis of files written by hand (tests/cli_jobs.py), not by either core: the same in both passes.
pytestmark = pytest.mark.once


@given(st.sets(st.integers(min_value=0, max_value=5000), max_size=200))
def test_rank_lists_round_trip(ranks: set[int]) -> None:
    """compress_ranks writes what parse_ranks reads back, for any set of ranks."""
    assert parse_ranks(compress_ranks(sorted(ranks))) == sorted(ranks)


def test_rank_list_examples() -> None:
    """Ranges and singles, in the form the commands print."""
    assert compress_ranks([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert parse_ranks("0-2, 5") == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        parse_ranks("x-y")


@given(st.text())
def test_embedded_json_never_closes_the_script_block(text: str) -> None:
    """Any record text embedded in the report stays inside its <script type=application/json> block."""
    embedded = _safe_json({"name": text, "message": text})
    assert "<" not in embedded and ">" not in embedded and "&" not in embedded
    assert "\u2028" not in embedded and "\u2029" not in embedded
    assert json.loads(embedded) == {"name": text, "message": text}


def test_discover_and_tail_check(tmp_path: Path) -> None:
    """Folders are searched recursively; a cut last line is detected without reading the whole file."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    good = tmp_path / "a" / "rank0.jsonl"
    good.write_text('{"kind":"header"}\n')
    cut = tmp_path / "a" / "b" / "rank1.jsonl"
    cut.write_text('{"kind":"header"}\n{"kind":"sp')
    (tmp_path / "a" / "notes.txt").write_text("x")
    assert sorted(p.name for p in discover([tmp_path])) == ["rank0.jsonl", "rank1.jsonl"]
    assert not check_tail(good).truncated_last_line
    assert check_tail(cut).truncated_last_line


def _small_job(folder: Path, ranks: int = 2, steps: int = 5) -> Path:
    """A finished job written record by record: header, iterations, one error, close."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = 1_790_000_000_000_000_000
    for rank in range(ranks):
        lines = [
            {
                "seq": 0,
                "kind": "header",
                "ts": t0,
                "schema": "traintrace",
                "schema_version": 1,
                "rank": rank,
                "world_size": ranks,
                "restart": 0,
                "host": "h",
                "pid": 100 + rank,
                "job": "j",
            },
        ]
        ts = t0 + 1000
        for step in range(steps):
            lines.append(
                {
                    "seq": len(lines),
                    "kind": "span",
                    "ts": ts,
                    "name": "iteration",
                    "id": step + 1,
                    "tid": 1,
                    "dur": 1_000_000,
                    "status": "ok",
                    "attrs": {"step": step, "batch_size": 8},
                }
            )
            ts += 1_000_000
        lines.append(
            {
                "seq": len(lines),
                "kind": "error",
                "ts": ts,
                "name": "exception",
                "error_type": "ValueError",
                "message": "bad",
                "tid": 1,
            }
        )
        lines.append({"seq": len(lines), "kind": "close", "ts": ts + 1})
        (folder / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


@pytest.mark.subprocess
@pytest.mark.parametrize("command", ["summary", "ranks", "errors"])
def test_commands_import_nothing_they_do_not_use(tmp_path: Path, command: str) -> None:
    """summary, ranks and errors pay for DuckDB and the analyses only: no dataframe libraries, no SQL translator,
    no recording side of the library (their import time is most of a small job's cost)."""
    job = _small_job(tmp_path / "job")
    code = (
        "import json, sys\n"
        "from traintrace.cli import main\n"
        f"code = main([{command!r}, {str(job)!r}, '--json', '--quiet'])\n"
        "sys.stdout = sys.__stdout__\n"
        "print('MODULES', json.dumps(sorted(sys.modules)))\n"
        "sys.exit(code)\n"
    )
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    env.pop("TRAINTRACE_READER")  # the default reader, DuckDB's on a job this small
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    modules = set(json.loads(result.stdout.rsplit("MODULES ", 1)[1]))
    # DuckDB's engine, without the package's Python layers where it ships the engine as a module of its own.
    assert "_duckdb" in modules and "duckdb._relation" not in modules
    unwanted = {"pandas", "pyarrow", "numpy", "sqlglot", "pyspark", "traintrace.events", "traintrace._recorder"}
    # Nor the other commands' modules (watch's: 9 ms), nor the progress files' reader where the job has none.
    unwanted |= {"traintrace.cli._watch", "traintrace.progress", "socket", "decimal", "uuid"}
    # Nor tempfile, shutil (bz2, lzma) and traceback, which a command needs only when something goes wrong (5 ms).
    unwanted |= {"tempfile", "shutil", "traceback"}
    assert not unwanted & modules, sorted(unwanted & modules)


def test_each_command_reads_each_file_once_with_its_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With DuckDB's reader, opening a job is one read_json of all its files, with the columns given (nothing
    sampled), and the analyses never read the files again: every table they use is derived from that one scan.
    (The scanner's single read: tests/test_cli_reader.py.)"""
    from traintrace.cli import _analysis
    from traintrace.cli._engine import Job

    monkeypatch.setenv("TRAINTRACE_READER", "duckdb")

    job_dir = _small_job(tmp_path / "job", ranks=3)
    log: list[str] = []
    connect = Job._connect
    monkeypatch.setattr(Job, "_connect", lambda self, **kw: Recording(connect(self, **kw), log))
    job = Job.open([job_dir], lean=True)
    reads = [sql for sql in log if "read_json" in sql]
    assert len(reads) == 1, reads
    assert "columns=" in reads[0]
    assert all(str(path.resolve()) in reads[0] for path in job_dir.glob("*.jsonl")), reads[0]
    del log[:]
    _analysis.summary(job)
    _analysis.ranks(job)
    _analysis.errors(job)
    assert log and not [sql for sql in log if "read_json" in sql or "read_parquet" in sql]


def _without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in ("load_seconds", "seconds", "elapsed")}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    if isinstance(value, float):
        return round(value, 12)  # sums over one thread or two differ in the last bits
    return value


def test_a_small_job_gets_the_answers_of_the_full_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job under SMALL_JOB_BYTES is read on one DuckDB thread without the costliest optimisers (their planning
    costs more than the queries on it), one under TINY_JOB_BYTES without any: every answer is the one the engine
    gives with its defaults, on a job with a straggler, checkpoints, a failure and a restart."""
    from tests.cli_jobs import Script, write_job
    from traintrace.cli import _analysis, _engine

    monkeypatch.setenv("TRAINTRACE_READER", "duckdb")
    write_job(tmp_path / "job", Script())

    def answers(threads: int | None = None, lean: bool = True) -> tuple[Any, tuple[int, set[str], bool]]:
        job = _engine.Job.open([tmp_path / "job"], lean=lean, threads=threads)
        settings = job.con.execute(
            "SELECT current_setting('threads'), current_setting('disabled_optimizers'), "
            "current_setting('enable_optimizer')"
        )
        found = settings.fetchone()
        assert found is not None
        data = [_analysis.summary(job), _analysis.ranks(job), _analysis.errors(job)]
        threads, skipped, optimised = found
        return _without_timings(data), (threads, set(filter(None, skipped.split(","))), optimised)

    # Under TINY_JOB_BYTES, summary, ranks and errors (lean) plan without optimisers; query and report keep them.
    tiny, tiny_settings = answers()
    assert tiny_settings == (1, set(), False)
    assert answers(lean=False)[1] == (1, set(_engine.SMALL_JOB_SKIPPED_OPTIMIZERS), True)
    monkeypatch.setattr(_engine, "TINY_JOB_BYTES", 0)
    small, small_settings = answers()
    assert small_settings == (1, set(_engine.SMALL_JOB_SKIPPED_OPTIMIZERS), True)
    assert answers(threads=2)[1][0] == 2  # --threads is the user's word
    monkeypatch.setattr(_engine, "SMALL_JOB_BYTES", 0)
    full, full_settings = answers()
    assert full_settings == (os.cpu_count(), set(), True)
    assert tiny == small == full
    assert small[2]["culprit"] is not None or small[2]["errors"], small[2]  # a failing job: something to compare


def test_a_job_beyond_the_memory_limit_is_kept_compressed_with_the_same_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose files outgrow COMPRESS_ABOVE_SHARE of the memory limit goes into a database file in the
    scratch folder, compressed, instead of memory: every answer is the in-memory one (a straggler, checkpoints,
    a failure, a restart), the tables really are compressed, and the cache keeps them as it keeps in-memory ones."""
    from tests.cli_jobs import Script, write_job
    from traintrace.cli import _analysis, _engine

    write_job(tmp_path / "job", Script())
    monkeypatch.setattr(_engine, "SMALL_JOB_BYTES", 0)  # the threshold applies to jobs that are not small

    def answers(job: Any) -> Any:
        return _without_timings([_analysis.summary(job), _analysis.ranks(job), _analysis.errors(job)])

    in_memory = _engine.Job.open([tmp_path / "job"], lean=True)
    assert in_memory.storage == "memory"
    expected = answers(in_memory)
    monkeypatch.setattr(_engine, "COMPRESS_ABOVE_SHARE", 0.0)
    job = _engine.Job.open([tmp_path / "job"], lean=True)
    assert job.storage == "compressed"
    database = job.con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()")
    assert Path(database.fetchone()[0]).parent == Path(job.scratch)
    assert answers(job) == expected
    assert expected[2]["culprit"] is not None or expected[2]["errors"]  # a failing job: something to compare
    monkeypatch.setenv("TRAINTRACE_CACHE_DIR", str(tmp_path / "cache"))
    written = _engine.Job.open([tmp_path / "job"], cache=True)
    assert written.storage == "compressed" and not written.cached and written.cache_path is not None
    reread = _engine.Job.open([tmp_path / "job"], cache=True)
    assert reread.cached and answers(reread) == answers(written) == expected


def test_a_compressed_job_database_holds_compressed_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a job of more than one DuckDB row group (122,880 rows: benchmarks/gen_job.py, 3 ranks x 50,000 steps)
    the raw table is written compressed (NULL columns constant, integers bit-packed, names a dictionary), with the
    in-memory answers."""
    from traintrace.cli import _analysis, _engine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from gen_job import generate
    finally:
        sys.path.pop(0)
    generate(tmp_path / "job", 3, 50_000, 10_000)

    def answers(job: Any) -> Any:
        return _without_timings([_analysis.summary(job), _analysis.errors(job)])

    expected = answers(_engine.Job.open([tmp_path / "job"], lean=True))
    monkeypatch.setattr(_engine, "COMPRESS_ABOVE_SHARE", 0.0)
    job = _engine.Job.open([tmp_path / "job"], lean=True)
    assert job.storage == "compressed" and job.record_count > 150_000
    storage = job.con.execute("SELECT compression, count(*) FROM pragma_storage_info('raw') GROUP BY ALL")
    segments = dict(storage.fetchall())
    assert {"Constant", "BitPacking"} <= set(segments), segments
    assert answers(job) == expected


def test_the_scratch_folder_is_private_where_tmpdir_says_and_goes_with_what_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    folder = ScratchFolder("traintrace-duckdb-")
    made = Path(folder.name)
    assert made.parent == tmp_path and made.name.startswith("traintrace-duckdb-")
    assert made.stat().st_mode & 0o777 == 0o700
    (made / "spilled").mkdir()
    (made / "spilled" / "block.bin").write_bytes(b"x" * 100)
    folder.cleanup()
    assert not made.exists()
    folder.cleanup()  # twice: nothing more to do
    # A TMPDIR that cannot take a folder: the next place, as tempfile would.
    monkeypatch.setenv("TMPDIR", str(tmp_path / "no" / "such" / "folder"))
    other = ScratchFolder("traintrace-duckdb-")
    elsewhere = Path(other.name)
    assert elsewhere.is_dir() and not elsewhere.is_relative_to(tmp_path)
    del other  # removed when it goes, as TemporaryDirectory is
    assert not elsewhere.exists()


def test_memory_sizes_are_read_as_duckdb_reads_them() -> None:
    """MB is 1000**2 bytes and MiB 1024**2, as in DuckDB; what only DuckDB interprets (80%) gives None, and the
    job then stays in memory."""
    from traintrace.cli._engine import size_bytes

    assert size_bytes("1500MB") == 1_500_000_000
    assert size_bytes(" 4 GiB ") == 4 << 30
    assert size_bytes("1.5gb") == 1_500_000_000
    assert size_bytes("512kib") == 512 << 10
    assert size_bytes("80%") is None and size_bytes("1500") is None and size_bytes("MB") is None


@pytest.mark.parametrize("version", ["1.1.3", "1.2.2"])
def test_a_duckdb_older_than_the_floor_is_named_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], version: str
) -> None:
    """DuckDB before 1.3 lacks what the command's statements use (read_json's file_index): the command says
    which version it needs and how to get it, and exits with the missing-extra status, instead of a binder
    error's traceback (measured: 1.1.3 and 1.2.2 failed so, 1.3.2 to 2.0.1 answer alike)."""
    from traintrace.cli import main
    from traintrace.cli._engine import MIN_DUCKDB, MissingExtra, _version_tuple, import_duckdb

    engine = import_duckdb()
    monkeypatch.setattr(engine, "__version__", version)
    with pytest.raises(MissingExtra, match=r"DuckDB 1\.3 or later \(this environment has " + version):
        import_duckdb()
    assert main(["summary", str(_small_job(tmp_path / "job"))]) == 4
    assert "pip install -U 'traintrace[analysis]'" in capsys.readouterr().err
    assert _version_tuple("1.3.0") == MIN_DUCKDB and _version_tuple("2.0.1") > MIN_DUCKDB
    assert _version_tuple("1.10.0") > MIN_DUCKDB and _version_tuple("dev") > MIN_DUCKDB


def test_a_job_beyond_the_memory_limit_says_to_raise_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DuckDB out of memory under --memory-limit is the user's limit, not a bug: exit 5 and what to do, no
    traceback, whether it runs out while loading (a real 1 MB limit) or in an analysis (ranks' medians per step)."""
    from traintrace.cli import EXIT_OUT_OF_MEMORY, _analysis, main
    from traintrace.cli._engine import DEFAULT_MEMORY_LIMIT, import_duckdb

    job = _small_job(tmp_path / "job", ranks=2, steps=200)
    assert main(["summary", str(job), "--memory-limit", "1MB"]) == EXIT_OUT_OF_MEMORY
    err = capsys.readouterr().err
    assert "limit (1MB) allows: raise --memory-limit" in err and "Traceback" not in err, err

    engine = import_duckdb()

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise engine.OutOfMemoryException("Out of Memory Error: failed to allocate data of size 16.0 MiB")

    monkeypatch.setattr(_analysis, "ranks", out_of_memory)
    assert main(["ranks", str(job)]) == EXIT_OUT_OF_MEMORY
    err = capsys.readouterr().err
    assert f"limit ({DEFAULT_MEMORY_LIMIT}) allows" in err and "16.0 MiB" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("streams", "expected"),
    [
        # Restarts: each file's restart numbers go up.
        ([("r0", 10, 0, 1, 40), ("r0", 50, 1, 2, 90), ("r1", 11, 0, 3, 40), ("r1", 51, 1, 4, 90)], None),
        # A second configure() in one process: the same pid.
        ([("r0", 10, 0, 1, 15), ("r0", 20, 0, 1, 30)], None),
        # Run again: every file's numbers begin again; the launcher's stream comes before its workers'.
        (
            [
                *[("a", 9, 0, 1, 60), ("r0", 10, 0, 2, 50), ("r1", 11, 0, 3, 50)],
                *[("a", 99, 0, 4, 160), ("r0", 100, 0, 5, 150), ("r1", 101, 0, 6, 150)],
            ],
            99,
        ),
        # Run again after a restart: 0, 1, then 0, 1.
        ([("r0", 10, 0, 1, 15), ("r0", 20, 1, 2, 25), ("r0", 30, 0, 3, 35), ("r0", 40, 1, 4, 45)], 30),
        # Three runs, rank 2 missing from the third: its last new run (the second's, which began 2 later than rank
        # 0's) is not the last run's; the third run's ranks start 2 apart too.
        (
            [
                *[("r0", 10, 0, 1, 40), ("r0", 50, 0, 2, 90), ("r0", 102, 0, 3, 150)],
                *[("r2", 12, 0, 4, 40), ("r2", 52, 0, 5, 90), ("r1", 100, 0, 6, 150)],
            ],
            100,
        ),
    ],
    ids=["restarts", "second-configure", "run-again", "run-again-after-a-restart", "rank-missing-from-the-last"],
)
def test_the_last_run_of_a_job_run_again_under_its_id(
    streams: list[tuple[str, int, int, int, int]], expected: int | None
) -> None:
    """(file, start, restart, pid, end) of each stream -> where the last run of the job began."""
    assert last_run_start(streams) == expected
