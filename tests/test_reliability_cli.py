"""The traintrace command given corrupt, truncated, binary, huge-line, wrong-version and
adversarial files next to a real stream: a clear message, never a traceback, bounded memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import traintrace as tt

pytestmark = pytest.mark.subprocess

pytest.importorskip("duckdb")

ROOT = Path(__file__).resolve().parents[1]

HEADER = {
    "seq": 0, "kind": "header", "ts": 1_795_000_000_000_000_000, "schema": "traintrace", "schema_version": 1,
    "time": "2026-11-29T20:00:00+00:00", "mono": 1, "job": "hostile", "rank": 1, "world_size": 2,
    "local_rank": 1, "local_world_size": 2, "node_rank": 0, "restart": 0, "host": "h", "pid": 1,
    "library_version": "0",
}  # fmt: skip


def _hostile_job(root: Path) -> Path:
    job = root / "hostile"
    job.mkdir(parents=True)
    # A real rank 0 that ran a few steps.
    tt.configure(job_id="hostile", log_dir=str(root), rank=0, world_size=2, backends={"log": False})
    with tt.application(), tt.training_loop():
        for step in range(5):
            with tt.training_iteration(step):
                tt.event("progress", {"step": step, "<b>": "<script>alert(1)</script>"})
    tt.close()
    head = json.dumps(HEADER)
    good = json.dumps({"seq": 1, "kind": "event", "ts": HEADER["ts"] + 1, "name": "e", "span": 0, "tid": 1})
    (job / "truncated.jsonl").write_text(head + "\n" + good + "\n" + good[:25])
    (job / "binary.jsonl").write_bytes(os.urandom(4096))
    (job / "v2.jsonl").write_text(json.dumps({**HEADER, "schema_version": 2, "rank": 1}) + "\n" + good + "\n")
    (job / "types.jsonl").write_text(
        head + '\n{"seq":"x","kind":"span","id":[1],"dur":"long","ts":"now","name":{"a":1}}\n'
        '{"kind":null}\n[1,2,3]\n' + "[" * 50000 + "\n" + good + "\n"
    )
    with (job / "huge.jsonl").open("wb") as handle:
        handle.write(head.encode() + b"\n")
        handle.write(b'{"seq":2,"kind":"event","name":"' + b"x" * (24 << 20) + b'"}\n')
        handle.write(good.encode() + b"\n")
    (job / "empty.jsonl").write_text("")
    return job


@pytest.mark.parametrize(
    "command",
    [["summary"], ["ranks"], ["errors"], ["export", "-o", "{tmp}/trace.json"], ["report", "-o", "{tmp}/r.html"]],
)
def test_cli_on_hostile_files(tmp_path: Path, command: list[str]) -> None:
    """Each subcommand reads what it can and says what it skipped: exit 0 (or 3 for nothing
    readable), never a traceback (exit 1), and the process stays well under 2 GiB."""
    job = _hostile_job(tmp_path / "logs")
    args = [part.replace("{tmp}", str(tmp_path)) for part in command]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(
        [sys.executable, "-m", "traintrace.cli", args[0], str(job), *args[1:]],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        check=False,
    )
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert done.returncode in (0, 3), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    assert max(peak_kib, before) < 2 * 1024 * 1024
    if args[0] == "summary":
        assert "truncated.jsonl: last line cut short" in done.stdout + done.stderr
    if args[0] == "report":
        page = (tmp_path / "r.html").read_text()
        assert "<script>alert(1)</script>" not in page


# ---------------------------------------------------------------- issue 17, item 12


def _small_job(root: Path, name: str = "small") -> Path:
    tt.configure(job_id=name, log_dir=str(root), backends={"log": False}, fault_handler=False)
    with tt.application(), tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                tt.event("progress", {"step": step})
        tt.error("boom \x1b[2J\x1b]8;;http://evil.example/\x07link\x1b]8;;\x07 \rhidden\x9b31m")
    tt.close()
    return root / name


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "args",
    [
        ["ranks", "--windows", "0"],
        ["ranks", "--top", "-3"],
        ["ranks", "--threshold", "nan"],
        ["export", "--start", "nan"],
        ["export", "--end", "inf"],
        ["summary", "--threads", "-1"],
        ["summary", "--memory-limit", "abc"],
        ["query", "select 1", "--limit", "-1"],
        ["report", "--windows", "0"],
        ["errors", "--hang-after", "nan"],
    ],
)
def test_bad_arguments_are_usage_errors_not_tracebacks(tmp_path: Path, args: list[str]) -> None:
    """``--windows 0``, ``--start nan``, ``--threads -1``, ``--memory-limit abc``, ``--limit -1``
    and their kind: exit 2 with a message naming the option, never a traceback."""
    from traintrace.cli import EXIT_USAGE

    job = _small_job(tmp_path / "logs")
    command, rest = args[0], args[1:]
    positional = [rest.pop(0)] if command == "query" else []
    done = subprocess.run(
        [sys.executable, "-m", "traintrace.cli", command, str(job), *positional, *rest],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    assert done.returncode == EXIT_USAGE, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and rest[0] in done.stderr


def test_terminal_output_escapes_control_characters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An error message holding clear-screen, an OSC-8 link, a carriage return and a C1 CSI is
    printed by ``errors`` with those characters escaped (``\\x1b``), none of them raw."""
    from traintrace.cli import main

    job = _small_job(tmp_path / "logs")
    assert main(["errors", str(job), "--quiet"]) == 0
    out = capsys.readouterr()
    for raw in ("\x1b", "\r", "\x07", "\x9b"):
        assert raw not in out.out and raw not in out.err
    assert "\\x1b[2J" in out.out and "\\rhidden" in out.out


def _limited_memory() -> None:
    """The child may not take the shared machine down: 3 GiB of address space at most."""
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.slow
@pytest.mark.subprocess
def test_hostile_job_folder_names_headers_and_numbers(tmp_path: Path) -> None:
    """A file literally named ``rank*.jsonl`` (read once, not as a glob), a headerless file, a
    span lasting 9e18 ns and one 1e308, a header claiming world_size 1e9, and a TMPDIR with a
    quote in it: every subcommand exits 0 with notes, no traceback, within 3 GiB."""
    job = _small_job(tmp_path / "logs", "odd")
    (job / "rank*.jsonl").write_bytes((job / "rank0.jsonl").read_bytes())
    header = {**HEADER, "job": "odd", "rank": 1, "world_size": 1e9}
    span = {
        "seq": 1,
        "kind": "span",
        "ts": HEADER["ts"] + 5,
        "name": "iteration",
        "id": 1,
        "parent": 0,
        "tid": 1,
        "status": "ok",
        "attrs": {"step": 0},
    }
    lines = [json.dumps(header), json.dumps({**span, "dur": 9e18}), json.dumps({**span, "seq": 2, "dur": 1e308})]
    (job / "rank1.jsonl").write_text("\n".join(lines) + "\n")
    (job / "headerless.jsonl").write_text(json.dumps({**span, "dur": 10}) + "\n")
    quoted = tmp_path / "tmp'quote"
    quoted.mkdir()
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": str(quoted)}
    for command in (
        ["summary", "--json"],
        ["ranks"],
        ["errors"],
        ["export", "-o", str(tmp_path / "t.json")],
        ["report", "-o", str(tmp_path / "r.html")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "traintrace.cli", command[0], str(job), *command[1:]],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            check=False,
            preexec_fn=_limited_memory,
        )
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        if command[0] == "summary":
            data = json.loads(done.stdout)
            # rank0.jsonl and its copy: two streams of three steps, not the copy read twice.
            assert data["files"] == 4 and data["streams"] == 3, data
            notes = " ".join(data["notes"])
            assert "possible duration" in notes and "no traintrace header" in notes


def test_analyses_cannot_reach_files_but_query_can(tmp_path: Path) -> None:
    """After loading, summary/ranks/errors/export/report run with DuckDB's external access off
    (only the job's scratch folder allowed); ``query`` keeps it (documented)."""
    from traintrace.cli._engine import Job

    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret\n")
    job = Job.open([str(_small_job(tmp_path / "logs"))])
    assert job.con.execute(f"SELECT count(*) FROM read_text('{secret}')").fetchone()[0] == 1
    job.restrict_external_access()
    with pytest.raises(Exception, match=r"disabled|Permission"):
        job.con.execute(f"SELECT * FROM read_text('{secret}')").fetchall()
    with pytest.raises(Exception, match=r"disabled|Permission"):
        job.con.execute(f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'")
    job.con.execute(f"COPY (SELECT 1) TO '{Path(job.scratch) / 'ok.csv'}'")
    assert not (tmp_path / "out.csv").exists()
