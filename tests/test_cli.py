"""The traintrace command (traintrace.cli): real jobs with injected faults, the example, exit codes, output."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._fault_runs import slow_by_own_clock
from tests.cli_jobs import Script, write_job
from traintrace.reader import read_file

pytest.importorskip("duckdb")

from traintrace.cli import EXIT_BAD_INPUT, EXIT_MISSING_EXTRA, EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def cli(*args: str, check: int | None = EXIT_OK) -> subprocess.CompletedProcess[str]:
    """Run ``python -m traintrace.cli`` as a separate process, as a user would."""
    result = subprocess.run(
        [sys.executable, "-m", "traintrace.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    if check is not None:
        assert result.returncode == check, result.stderr
    return result


def cli_json(*args: str) -> Any:
    return json.loads(cli(*args, "--json").stdout)


@pytest.fixture(scope="module")
def faults_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five real processes: rank 0 with slow checkpoints, 1 slow in compute, 2 slow in data loading,
    3 raises at step 25, 4 hangs inside its first checkpoint save (killed once the others are done)."""
    logs = tmp_path_factory.mktemp("faults")
    (logs / "truth").mkdir()  # each rank's own step times, beside the job's folder
    worker = ROOT / "tests" / "cli_worker.py"
    procs = []
    for rank in range(5):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "5", "LOCAL_RANK": str(rank), "TRAINTRACE_JOB_ID": "faults"}
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(worker),
                    str(logs),
                    "--slow-compute",
                    "1",
                    "--slow-data",
                    "2",
                    "--fail",
                    "3:25",
                    "--hang",
                    "4:10",
                    "--steps",
                    "60",
                    "--slow-checkpoint",
                    "0",
                    "--truth",
                    str(logs / "truth"),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    for proc in procs[:4]:
        proc.wait(timeout=120)
    assert procs[3].returncode != 0  # the injected failure ended rank 3
    time.sleep(2.5)  # rank 4 stays silent, hung in its checkpoint
    procs[4].send_signal(signal.SIGKILL)
    procs[4].wait(timeout=30)
    for proc in procs:
        assert proc.stderr is not None
        proc.stderr.close()
    return logs / "faults"


@pytest.mark.subprocess
def test_errors_names_the_failing_rank_step_and_cause(faults_job: Path) -> None:
    """The first error is rank 3's exception, raised in the iteration of step 25, with its stack."""
    e = cli_json("errors", str(faults_job), "--hang-after", "0.5")
    first = e["first_error"]
    assert first["rank"] == 3
    assert first["error_type"] == "RuntimeError"
    assert first["message"] == "injected failure on rank 3 at step 25"
    assert first["in_span"] == "iteration" and first["step"] == 25
    assert "cli_worker.py" in first["stack"]
    by_rank = {r["rank"]: r for r in e["ranks"]}
    assert by_rank[3]["state"] == "error"
    assert by_rank[0]["state"] == "closed"
    # the hung rank: its stream stops inside the checkpoint save it never finished
    assert by_rank[4]["state"] == "ended abruptly"
    assert [s["name"] for s in by_rank[4]["open_spans"]][-1] == "checkpoint_save_sync"
    assert 4 in e["hang_suspects"]
    text = cli("errors", str(faults_job), "--hang-after", "0.5").stdout
    assert "FIRST ERROR (likely root cause): rank 3" in text
    assert "raised in span iteration (step 25)" in text


@pytest.mark.subprocess
def test_ranks_finds_both_stragglers_and_where_they_are_slow(faults_job: Path) -> None:
    """Rank 1 is slow in compute, rank 2 in data loading, rank 0 in its checkpoint saves. Ranks 3 and 4 are not
    made slow, but their processes run beside the others on a host that may be busy (the ranks are not in
    lockstep): named, they must have been slow by their own clocks (a loaded full run here, once: rank 3's sleeps
    of 8 ms took 12 from its step 18 on, and it was named slow in compute)."""
    r = cli_json("ranks", str(faults_job))
    by_rank = {x["rank"]: x for x in r["ranks"]}
    assert {0, 1, 2} <= set(r["stragglers"]) <= {0, 1, 2, 3, 4}
    for rank in set(r["stragglers"]) - {0, 1, 2}:
        named = by_rank[rank]
        part = {"compute": "compute", "data_loading": "data"}.get(named["slow_in"])
        assert part is not None, named  # its saves took 5 ms, as every rank's but rank 0's
        assert slow_by_own_clock(faults_job.parent / "truth", rank, part, named["slow_since_step"] or 0), named
    assert by_rank[1]["slow_in"] == "compute"
    assert by_rank[2]["slow_in"] == "data_loading"
    assert by_rank[0]["slow_in"] == "checkpoint_save"
    assert by_rank[1]["score"] > 1.5
    assert by_rank[1]["slow_since_step"] == 0 and by_rank[2]["slow_since_step"] == 0
    text = cli("ranks", str(faults_job), "--all").stdout
    assert "stragglers:" in text and "data_loading" in text


@pytest.mark.subprocess
def test_summary_of_the_faulty_job(faults_job: Path) -> None:
    """Two streams failed; the steps after the last checkpoint of rank 3 and 4 count as lost progress."""
    s = cli_json("summary", str(faults_job))
    assert s["ranks_seen"] == 5 and s["world_size"] == 5 and s["ranks_missing"] == ""
    assert s["failed_streams"] == 2
    assert s["breakdown_s"]["lost_progress"] > 0
    assert s["breakdown_s"]["checkpoint_save"] > 0
    assert 0 < s["goodput"] < 1
    # rank 4 hung inside its first checkpoint: all its 10 steps are lost (rank 3 lost 6: steps 20-25)
    assert s["steps_lost"] == 10
    lost = cli_json(
        "query",
        str(faults_job),
        "SELECT rank, count(*) AS n FROM steps "
        "WHERE status <> 'ok' OR (rank = 3 AND step >= 20) GROUP BY rank ORDER BY rank",
    )
    assert lost == [{"rank": 3, "n": 6}]
    # the slow checkpoints of rank 0 are its exposed checkpoint time, and nobody else's
    saves = cli_json(
        "query",
        str(faults_job),
        "SELECT rank, sum(dur) / 1e9 AS s FROM spans "
        "WHERE name = 'checkpoint_save_sync' AND status = 'ok' GROUP BY rank ORDER BY s DESC",
    )
    assert saves[0]["rank"] == 0 and saves[0]["s"] >= 6 * 0.3
    assert all(x["s"] < 0.5 for x in saves[1:])


@pytest.mark.subprocess
@pytest.mark.xdist_group("cpu_example")
def test_example_run_summary_matches_an_independent_reading(cpu_example_job: Path) -> None:
    """The CPU example: steps, checkpoints and goodput agree with a plain read of its file."""
    pytest.importorskip("torch")
    folder = cpu_example_job
    s = cli_json("summary", str(folder))
    stream = read_file(folder / "rank0.jsonl").streams[0]
    spans = stream.spans()
    iterations = [x for x in spans if x["name"] == "iteration"]
    start = stream.header["ts"]
    end = max([x["ts"] + x.get("dur", 0) for x in spans if x["kind"] == "span"] + [r["ts"] for r in stream.records])
    productive = sum(x["dur"] for x in iterations) / 1e9
    assert s["steps_completed"] == len(iterations) == 128
    assert s["wall_s"] == pytest.approx((end - start) / 1e9, rel=1e-6)
    assert s["goodput"] == pytest.approx(productive / ((end - start) / 1e9), rel=1e-6)
    saves = sum(x["dur"] for x in spans if x["name"] == "checkpoint_save_sync") / 1e9
    assert s["breakdown_s"]["checkpoint_save"] == pytest.approx(saves, rel=1e-6)
    assert s["breakdown_s"]["validation"] > 0 and s["breakdown_s"]["data_loading"] > 0
    assert s["failed_streams"] == 0 and s["steps_lost"] == 0
    assert s["samples"] == 2 * 2048
    text = cli("summary", str(folder)).stdout
    assert "GOODPUT" in text and "checkpoint save (exposed)" in text


@pytest.mark.subprocess
def test_query_views(tmp_path: Path) -> None:
    """SQL over the documented views answers what the subcommands do not."""
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    rows = cli_json(
        "query",
        str(tmp_path / "job"),
        "SELECT rank, count(*) AS n, max(step) AS last FROM steps GROUP BY rank ORDER BY rank",
    )
    assert rows == [{"rank": r, "n": 40, "last": 39} for r in range(4)]
    kinds = cli_json("query", str(tmp_path / "job"), "SELECT DISTINCT kind FROM records ORDER BY 1")
    assert [k["kind"] for k in kinds] == ["close", "end", "span", "start", "thread"]
    names = cli_json(
        "query", str(tmp_path / "job"), "SELECT count(*) AS n FROM spans WHERE name = 'checkpoint_save_sync'"
    )
    assert names == [{"n": 16}]
    assert cli_json("query", str(tmp_path / "job"), "SELECT count(*) AS n FROM streams") == [{"n": 4}]
    assert cli_json("query", str(tmp_path / "job"), "SELECT count(*) AS n FROM events") == [{"n": 0}]
    assert cli_json("query", str(tmp_path / "job"), "SELECT count(*) AS n FROM errors") == [{"n": 0}]
    table = cli("query", str(tmp_path / "job"), "SELECT 1 AS one").stdout
    assert table.splitlines()[0].strip() == "one"


@pytest.mark.subprocess
def test_exit_codes(tmp_path: Path) -> None:
    """0 on success, 2 for usage and rejected SQL, 3 when there is nothing to read."""
    (tmp_path / "empty").mkdir()
    assert cli("summary", str(tmp_path / "empty"), check=None).returncode == EXIT_BAD_INPUT
    assert cli("summary", str(tmp_path / "nope"), check=None).returncode == EXIT_BAD_INPUT
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.jsonl").write_text('not json\n{"a": 1}\n')
    assert cli("summary", str(tmp_path / "junk"), check=None).returncode == EXIT_BAD_INPUT
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    bad = cli("query", str(tmp_path / "job"), "SELECT nope FROM nowhere", check=None)
    assert bad.returncode == EXIT_USAGE and "query failed" in bad.stderr
    assert cli("frobnicate", check=None).returncode == EXIT_USAGE
    assert cli("summary", str(tmp_path / "job"), "--no-such-option", check=None).returncode == EXIT_USAGE
    assert cli("export", str(tmp_path / "job"), "--ranks", "x-y", check=None).returncode == EXIT_USAGE
    assert main(["summary", str(tmp_path / "job"), "--quiet"]) == EXIT_OK


@pytest.mark.subprocess
def test_the_command_exits_with_its_answer_whole_and_no_scratch_folder_left(tmp_path: Path) -> None:
    """The command ends without the interpreter's teardown (cli.entry): what it printed is all there, its exit code
    is the answer's, and DuckDB's scratch folder is gone, after an answer and after a refusal alike."""
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**ENV, "TMPDIR": str(scratch)}
    for command in ("summary", "ranks", "errors", "report"):
        args = [command, str(tmp_path / "job"), "--json"]
        if command == "report":
            args = [command, str(tmp_path / "job"), "-o", str(tmp_path / "report.html")]
        result = subprocess.run(
            [sys.executable, "-m", "traintrace.cli", *args],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == EXIT_OK, result.stderr
        if command != "report":
            assert json.loads(result.stdout), command  # the whole answer, flushed before the process ended
        assert list(scratch.iterdir()) == [], command
    assert (tmp_path / "report.html").read_text().rstrip().endswith("</html>")
    missing = subprocess.run(
        [sys.executable, "-m", "traintrace.cli", "summary", str(tmp_path / "nothing-here")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert missing.returncode == EXIT_BAD_INPUT and "no such file or folder" in missing.stderr
    assert list(scratch.iterdir()) == []


@pytest.mark.subprocess
def test_help_is_as_wide_as_the_terminal_says() -> None:
    """The options' help wraps at $COLUMNS, as argparse's own lookup of the width would (ours imports less)."""
    for columns in (50, 120):
        result = subprocess.run(
            [sys.executable, "-m", "traintrace.cli", "summary", "--help"],
            check=False,
            capture_output=True,
            text=True,
            env={**ENV, "COLUMNS": str(columns)},
            timeout=120,
        )
        options = result.stdout.split("options:", 1)[1].split("examples:", 1)[0]
        widest = max(len(line) for line in options.splitlines())
        assert columns - 20 < widest <= columns - 2, (columns, widest)


@pytest.mark.subprocess
def test_help_has_examples_and_exit_codes() -> None:
    """Every subcommand's --help shows examples and the exit codes."""
    for command in ("summary", "ranks", "errors", "export", "report", "query"):
        text = cli(command, "--help").stdout
        assert "examples:" in text and "exit codes:" in text, command
    assert "exit codes:" in cli("--help").stdout


@pytest.mark.subprocess
def test_progress_stays_off_stderr_when_not_a_terminal(tmp_path: Path) -> None:
    """Piped output: stdout has the answer, stderr stays empty (no progress, no notes for a clean job)."""
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    result = cli("summary", str(tmp_path / "job"))
    assert result.stderr == ""
    assert result.stdout.startswith("VERDICT: healthy")
    assert "\njob scripted" in result.stdout


@pytest.mark.subprocess
def test_files_given_one_by_one(tmp_path: Path) -> None:
    """A list of files works like the folder; the ranks not given are reported missing."""
    script = write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    s = cli_json("summary", str(script.files[0]), str(script.files[2]))
    assert s["ranks_seen"] == 2 and s["ranks_missing"] == "1,3"


@pytest.mark.subprocess
def test_torchrun_job_where_one_rank_raises(tmp_path: Path) -> None:
    """Under torchrun a raising rank makes the agent stop the others: the root cause is still that rank."""
    pytest.importorskip("torch")
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    result = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "0",
            str(ROOT / "tests" / "cli_worker.py"),
            str(tmp_path),
            "--steps",
            "400",
            "--fail",
            "2:15",
            "--slow-compute",
            "1",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**ENV, "TRAINTRACE_JOB_ID": "tr"},
    )
    assert result.returncode != 0, result.stderr[-3000:]
    folder = tmp_path / "tr"  # TRAINTRACE_JOB_ID overrides the worker's configure(job_id=...)
    assert folder.exists(), result.stderr[-3000:]
    e = cli_json("errors", str(folder))
    assert e["first_error"]["rank"] == 2 and e["first_error"]["step"] == 15
    assert "injected failure on rank 2" in e["first_error"]["message"]
    by_rank = {r["rank"]: r for r in e["ranks"]}
    assert by_rank[2]["state"] == "error"
    assert by_rank[0]["state"] != "closed" or by_rank[0]["open_spans"] == []  # stopped by the agent
    s = cli_json("summary", str(folder))
    assert s["ranks_seen"] == 3 and s["failed_streams"] == 3
    assert cli_json("ranks", str(folder))["top"][0] == 1


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_then_cleared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal a slow read shows progress on stderr and erases it; --quiet keeps stderr empty."""
    from traintrace.cli import _engine

    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None, steps=400))
    monkeypatch.setattr(_engine._Progress, "DELAY", 0.0)  # "slow" from the start
    monkeypatch.setattr(_engine._Progress, "TICK", 0.001)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["summary", str(tmp_path / "job")]) == EXIT_OK
    shown = terminal.getvalue()
    assert "reading 4 files" in shown and shown.endswith("\r\x1b[K")
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(["summary", str(tmp_path / "job"), "--quiet"]) == EXIT_OK
    assert quiet.getvalue() == ""


@pytest.mark.subprocess
def test_missing_duckdb_names_the_extra(tmp_path: Path) -> None:
    """Without DuckDB the command exits 4 and says which extra to install."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "duckdb.py").write_text("raise ImportError('no duckdb here')\n")
    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    result = subprocess.run(
        [sys.executable, "-m", "traintrace.cli", "summary", str(tmp_path / "job")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**ENV, "PYTHONPATH": f"{shadow}:{ENV['PYTHONPATH']}"},
    )
    assert result.returncode == EXIT_MISSING_EXTRA
    assert "pip install 'traintrace[analysis]'" in result.stderr


def test_ranks_names_a_single_straggler_as_a_rank_not_a_count() -> None:
    """One straggler, rank 0: the line must not read "stragglers: 0" (no stragglers?)."""
    from traintrace.cli._render import render_ranks

    ranks = [{"rank": 0, "steps": 3, "median_s": 0.03, "p90_s": 0.03, "p99_s": 0.03, "score": 0.5}]
    one = {"job_median_s": 0.07, "threshold": 1.1, "ranks": ranks, "top": [0], "stragglers": [0], "notes": []}
    assert "straggler: rank 0" in render_ranks(one)
    two = {**one, "stragglers": [0, 13]}
    assert "stragglers: ranks 0, 13" in render_ranks(two)
