"""First-run traps from issue 14: each test failed before its fix."""

from __future__ import annotations

import json
import re
import subprocess
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
            assert (
                main(
                    [
                        "query",
                        str(logs / "pairs"),
                        "--json",
                        "SELECT name, count(*) AS n, count(DISTINCT id) AS ids FROM spans GROUP BY name",
                    ]
                )
                == 0
            )
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


CAUGHT = """
import traintrace as tt
tt.configure(job_id="caught", log_dir={logs!r})

def deep(n):
    if n == 0:
        raise ValueError("bad batch, skipped")
    return deep(n - 1)

with tt.application():
    for step in range(3):
        with tt.training_iteration(step):
            try:
                with tt.span("load_batch"):
                    deep(30)
            except ValueError:
                pass  # the user handles it: training goes on
tt.close()
print("done")
"""


@pytest.mark.subprocess
def test_a_caught_exception_is_quiet_on_stderr_and_whole_in_the_file(tmp_path: Path) -> None:
    """An exception the user catches inside a span: one short line on stderr; the stack stays in the file."""
    logs = tmp_path / "logs"
    result = subprocess.run(
        [sys.executable, "-c", CAUGHT.format(logs=str(logs))],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert result.stdout.strip() == "done"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3, result.stderr  # one per caught exception at most
    assert all(len(line) < 400 for line in lines), result.stderr
    assert "Traceback" not in result.stderr
    assert all("ValueError" in line and "bad batch, skipped" in line for line in lines), result.stderr
    records = [json.loads(line) for line in (logs / "caught" / "rank0.jsonl").read_text().splitlines()]
    errors = [r for r in records if r["kind"] == "error"]
    assert len(errors) == 3
    assert all("in deep" in r["stack"] and "ValueError: bad batch, skipped" in r["stack"] for r in errors)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.slow
@pytest.mark.subprocess
def test_traintrace_run_help_shows_its_own_options_first() -> None:
    """`traintrace-run --help`: traintrace's options, then torchrun's; exit 0."""
    pytest.importorskip("torch")
    result = _run("from traintrace.launch import main; main(['--help'])")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: traintrace-run")
    assert 0 < result.stdout.index("--metrics-port") < result.stdout.index("--nproc-per-node")


@pytest.mark.subprocess
def test_traintrace_run_help_works_without_torch() -> None:
    """Without torch, --help still prints traintrace's options and says how to get torchrun's."""
    result = _run("import sys; sys.modules['torch'] = None\nfrom traintrace.launch import main; main(['--help'])")
    assert result.returncode == 0, result.stderr
    assert "--metrics-port" in result.stdout and "pip install 'traintrace[torch]'" in result.stdout
    result = _run("import sys; sys.modules['torch'] = None\nfrom traintrace.launch import main; main(['x.py'])")
    assert result.returncode == 2 and "traintrace[torch]" in result.stderr


def test_traintrace_run_splits_its_options_from_torchruns() -> None:
    """Own options anywhere before the script; the script's own arguments are left alone."""
    from traintrace._run_options import OptionError, split

    options, rest = split(
        ["--standalone", "--metrics-port", "9100", "--nproc-per-node", "2", "train.py", "--metrics-port", "1", "--help"]
    )
    assert options.metrics_port == 9100 and not options.help
    assert rest == ["--standalone", "--nproc-per-node", "2", "train.py", "--metrics-port", "1", "--help"]
    options, rest = split(["--nnodes=1", "--metrics-port=0", "-m", "pkg.train"])
    assert options.metrics_port == 0 and rest == ["--nnodes=1", "-m", "pkg.train"]
    with pytest.raises(OptionError, match="port"):
        split(["--metrics-port", "99999", "train.py"])


@pytest.mark.subprocess
def test_export_chrome_works_without_duckdb(tmp_path: Path) -> None:
    """With DuckDB unimportable, `export --format chrome` still writes the trace (from the plain reader)."""
    from collections import Counter

    from tests.cli_jobs import Script, write_job

    script = write_job(tmp_path / "job", Script())
    out = tmp_path / "trace.json"
    result = _run(
        "import sys; sys.modules['duckdb'] = None\nfrom traintrace.cli import main\n"
        f"sys.exit(main(['export', {str(tmp_path / 'job')!r}, '-o', {str(out)!r}]))"
    )
    assert result.returncode == 0, result.stderr
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert set(Counter(e["ph"] for e in events)) == {"M", "X", "i", "C"}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r} (h)" for r in range(script.ranks)}
    iterations = [e for e in events if e["ph"] == "X" and e["name"] == "iteration"]
    assert len(iterations) == script.ranks * (25 + 20) + 1  # 25 + 20 steps per rank, and rank 3's failed one
    straggler = [e for e in iterations if e["pid"] == 2 and e["args"].get("step") == 3]
    assert straggler and straggler[0]["dur"] == pytest.approx(script.step_dur(2) / 1000)
    assert min(e["ts"] for e in events if e["ph"] == "X") == 0.0
    errors = [e for e in events if e["ph"] == "i" and e["cat"] == "error"]
    assert len(errors) == 1 and errors[0]["pid"] == 3 and errors[0]["args"]["message"] == script.message
    saves = [e for e in events if e["ph"] == "X" and e["name"] == "checkpoint_save_sync"]
    assert len(saves) == script.ranks * 2 + 2 * script.ranks  # two saves before the failure, two after the resume
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


@pytest.mark.parametrize("args", [["ranks", "--top", "-1"], ["ranks", "--windows", "0"], ["report", "--windows", "0"]])
def test_nonsense_counts_are_usage_errors(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--top -1 and --windows 0 are rejected before anything is read, with a message naming the option."""
    from traintrace.cli import main

    with pytest.raises(SystemExit) as info:
        main([args[0], str(tmp_path), *args[1:]])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert args[1] in err and "must be at least 1" in err
