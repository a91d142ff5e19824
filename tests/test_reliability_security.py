"""Security: file permissions, nothing recorded that was not asked for, redaction of
secret-looking keys before any backend, and paths that cannot leave the log folder."""

from __future__ import annotations

import faulthandler
import io
import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import traintrace as tt
from tests._examples import examples
from traintrace.backends import MemoryBackend
from traintrace.reader import read_file

SECRET = "hunter2-s3cr3t"


@pytest.fixture
def no_umask() -> Iterator[None]:
    """Permissions as configured, not as the test runner's umask cuts them; and pytest's own
    faulthandler off, since traintrace leaves one that someone else enabled alone."""
    old = os.umask(0)
    had_faulthandler = faulthandler.is_enabled()
    faulthandler.disable()
    try:
        yield
    finally:
        os.umask(old)
        if had_faulthandler:
            faulthandler.enable(file=sys.__stderr__)


@pytest.mark.usefixtures("no_umask")
@pytest.mark.parametrize(("file_mode", "dir_mode"), [(0o600, 0o700), (0o640, 0o750), (0o644, 0o755)])
def test_file_and_folder_permissions_follow_file_mode(tmp_path: Path, file_mode: int, dir_mode: int) -> None:
    """Owner-only, group-readable or world-readable: the stream, its fault file and the folders
    traintrace creates get matching permissions (a folder is listable by whoever may read)."""
    tt.configure(
        job_id="perm",
        log_dir=str(tmp_path),
        backends={"file": {"path": "{job}/sub/rank{rank}.jsonl", "file_mode": file_mode}, "log": False},
    )
    stream = tmp_path / "perm" / "sub" / "rank0.jsonl"
    faults = stream.with_name(stream.name + ".faults.txt")
    assert stat.S_IMODE(faults.stat().st_mode) == file_mode
    tt.close()
    assert stat.S_IMODE(stream.stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "perm" / "sub").stat().st_mode) == dir_mode
    assert not faults.exists()


def test_no_environment_or_command_line_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Variables and arguments, secret or not, appear nowhere in the stream or the log lines,
    even around an exception; the header holds only the documented identity fields."""
    monkeypatch.setenv("MY_SERVICE_TOKEN", SECRET + "-env")
    monkeypatch.setattr(sys, "argv", ["train.py", f"--api-key={SECRET}-argv"])
    text = io.StringIO()
    logger = logging.getLogger("traintrace.sec.records")
    logger.handlers[:] = [logging.StreamHandler(text)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    tt.configure(
        job_id="env",
        log_dir=str(tmp_path),
        backends={"file": {"path": "env.jsonl"}, "log": {"logger": logger.name, "verbosity": "profiling"}},
    )
    try:
        with tt.application(), tt.training_iteration(0):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    tt.close()
    raw = (tmp_path / "env.jsonl").read_text()
    assert SECRET not in raw and SECRET not in text.getvalue()
    header = read_file(tmp_path / "env.jsonl").streams[0].header
    assert set(header) <= {
        "seq", "kind", "ts", "schema", "schema_version", "time", "mono", "job", "job_name", "run",
        "rank", "world_size", "local_rank", "local_world_size", "node_rank", "restart", "host", "pid",
        "launcher", "library_version", "python", "metadata", "parent_pid",
    }  # fmt: skip


def _record_secrets() -> None:
    with tt.span("login", {"password": SECRET, "user": "ana"}) as span:
        span.add_metrics(hf_token=SECRET, tokens_per_second=1234.5, num_tokens=10, token_count=3)
        tt.event("auth", {"apiKey": SECRET, "nested": {"db_password": SECRET, "host": "db"}})
        tt.event("list", {"items": [{"AWS_SECRET_ACCESS_KEY": SECRET}]})
        tt.error("failed", {"Authorization": SECRET, "code": 401})


def test_default_redaction_reaches_no_backend(tmp_path: Path) -> None:
    """password, *_token, apiKey, Authorization, nested and in lists: written as '<redacted>' in
    the file, the log lines, an extra backend and the header's metadata; tokens_per_second,
    num_tokens and token_count are kept."""
    text = io.StringIO()
    logger = logging.getLogger("traintrace.sec2.records")
    logger.handlers[:] = [logging.StreamHandler(text)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    memory = MemoryBackend()
    tt.configure(
        job_id="red",
        log_dir=str(tmp_path),
        backends={"file": {"path": "red.jsonl"}, "log": {"logger": logger.name, "verbosity": "profiling"}},
        extra_backends=[memory],
        metadata={"wandb_api_key": SECRET, "lr": 0.1},
    )
    _record_secrets()
    tt.close()
    for where in (
        (tmp_path / "red.jsonl").read_text(),
        text.getvalue(),
        repr(memory.records),
        repr(memory.header),
    ):
        assert SECRET not in where
        assert "<redacted>" in where
    login = memory.spans("login")[0]["attrs"]
    assert login["password"] == login["hf_token"] == "<redacted>"
    assert (login["tokens_per_second"], login["num_tokens"], login["token_count"]) == (1234.5, 10, 3)
    assert memory.events("auth")[0]["attrs"]["nested"] == {"db_password": "<redacted>", "host": "db"}
    assert memory.header is not None and memory.header["metadata"]["lr"] == 0.1


def test_redaction_list_is_configurable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """redact_keys replaces the defaults (from configure() or TRAINTRACE_REDACT_KEYS); an
    empty list turns redaction off."""
    memory = MemoryBackend()
    monkeypatch.setenv("TRAINTRACE_REDACT_KEYS", "user, loss")
    tt.configure(job_id="r2", log_dir=str(tmp_path), backends={}, extra_backends=[memory])
    _record_secrets()
    tt.close()
    login = memory.spans("login")[0]["attrs"]
    assert login["user"] == "<redacted>" and login["password"] == SECRET
    monkeypatch.delenv("TRAINTRACE_REDACT_KEYS")
    memory = MemoryBackend()
    tt.configure(job_id="r3", log_dir=str(tmp_path), backends={}, extra_backends=[memory], redact_keys=[])
    _record_secrets()
    tt.close()
    assert memory.spans("login")[0]["attrs"]["password"] == SECRET
    with pytest.raises(tt.ConfigError, match="redact_keys"):
        tt.configure(redact_keys=[1, 2])


@pytest.mark.parametrize("job", ["../../etc", "/etc", "..", ".hidden", "a/../../b", "x\x00y"])
def test_job_id_cannot_leave_the_log_folder(tmp_path: Path, job: str) -> None:
    """A job id (from config or a scheduler's variable) is made one safe path component."""
    logs = tmp_path / "logs"
    tt.configure(job_id=job, log_dir=str(logs), backends={"file": {}, "log": False})
    tt.close()
    files = list(tmp_path.rglob("*.jsonl"))
    assert len(files) == 1 and files[0].is_relative_to(logs)
    assert files[0].parent.parent == logs


def test_path_templates_and_symlinks_cannot_escape(tmp_path: Path) -> None:
    """A relative template that climbs out, or a symlink inside log_dir pointing out, is a
    ConfigError naming backends.file.path; nothing is created outside."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "out").symlink_to(tmp_path / "elsewhere")
    for template in ("../x.jsonl", "{job}/../../x.jsonl", "out/x.jsonl"):
        with pytest.raises(tt.ConfigError, match=r"backends\.file\.path"):
            tt.configure(job_id="j", log_dir=str(logs), backends={"file": {"path": template}, "log": False})
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "elsewhere").exists()


# ---------------------------------------------------------------- secrets (issue 17, item 1)

_SECRET_NAMES = [
    "pwd",
    "pass",
    "auth",
    "bearer",
    "jwt",
    "session_id",
    "api_key_1",
    "token2",
    "password_hash",
    "db_pass",
    "authHeader",
    "HF_TOKEN",
    "sessionId",
    "client-secret",
    "x.api_key",
]
_NOT_SECRET = ["tokens_per_second", "num_tokens", "token_count", "author", "passes", "bos_token_ids", "step"]


def test_redaction_matches_word_parts_not_a_fixed_list() -> None:
    """Common secret names the fixed list missed (pwd, pass, auth, bearer, jwt, session_id,
    api_key_1, token2, password_hash) are secret; counts of tokens and other words are not."""
    from traintrace._redact import DEFAULT_REDACT_KEYS, Redactor

    redactor = Redactor(DEFAULT_REDACT_KEYS)
    assert [name for name in _SECRET_NAMES if not redactor.secret(name)] == []
    assert [name for name in _NOT_SECRET if redactor.secret(name)] == []


_words = st.sampled_from(["run", "db", "user", "hf", "wandb", "x", "my", "aws"])
_secret_words = st.sampled_from(["password", "pwd", "pass", "secret", "token", "api_key", "auth", "jwt", "bearer"])
_tails = st.sampled_from(["", "_1", "2", "_hash", "_value", "Hash"])


@st.composite
def _secret_key(draw: st.DrawFn) -> str:
    """A key that names a secret: some words, a secret word, maybe a number or qualifier, in any style."""
    parts = [*draw(st.lists(_words, max_size=3)), draw(_secret_words)]
    style = draw(st.sampled_from(["_", "-", ".", "camel", "upper"]))
    if style == "camel":
        key = parts[0] + "".join(p.replace("_", " ").title().replace(" ", "") for p in parts[1:])
    elif style == "upper":
        key = "_".join(parts).upper()
    else:
        key = style.join(parts)
    return key + draw(_tails)


@st.composite
def _nested_with_secret(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A mapping holding SECRET under a secret key somewhere: in dicts, lists, lists of lists,
    under a key longer than 256 characters."""
    key = draw(_secret_key())
    if draw(st.booleans()):
        key = "k" * draw(st.integers(250, 2000)) + "_" + key
    value: Any = {key: SECRET, "ok": 1}
    for wrap in draw(st.lists(st.sampled_from(["dict", "list", "tuple"]), max_size=4)):
        if wrap == "dict":
            value = {draw(_words): value, "n": 2}
        elif wrap == "list":
            value = [1, value]
        else:
            value = (value,)
    top = value if isinstance(value, dict) else {"items": value}
    return top, key


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_nested_with_secret())
def test_secrets_never_reach_a_backend_at_any_depth(tmp_path: Path, case: tuple[dict[str, Any], str]) -> None:
    """Whatever the nesting (lists in lists, tuples, dicts) and however long the key, a secret
    given to a span, an event or an error is written as '<redacted>' by the real writer."""
    attrs, _ = case
    memory = MemoryBackend()
    tt.configure(
        job_id="hy",
        log_dir=str(tmp_path),
        backends={"file": False, "log": False},
        extra_backends=[memory],
        statistics=False,
    )
    with tt.span("s", attrs):
        tt.event("e", attrs)
        tt.error("failed", attrs)
    tt.close()
    written = repr(memory.records)
    assert SECRET not in written
    assert "<redacted>" in written


def test_manifest_is_redacted_private_and_holds_no_exporter_headers(tmp_path: Path) -> None:
    """manifest.json: metadata redacted as in the header, OTLP headers' values and an endpoint's
    credentials never written, mode 0o640 (file_mode) even under umask 0; the registration too."""
    from traintrace.backends.otlp import OtlpTracesConfig

    old = os.umask(0)
    try:
        tt.configure(
            job_id="man",
            log_dir=str(tmp_path),
            backends={
                "file": {},
                "log": False,
                "otlp_traces": OtlpTracesConfig(
                    enabled=False,
                    endpoint=f"http://user:{SECRET}@localhost:4318",
                    headers={"authorization": f"Bearer {SECRET}", "x-tenant": SECRET},
                ),
            },
            metadata={"hf_token": SECRET, "runs": [[{"password": SECRET}]], "lr": 0.1},
        )
        tt.close()
    finally:
        os.umask(old)
    folder = tmp_path / "man"
    manifest = folder / "manifest.json"
    registration = folder / "ranks" / "rank0.restart0.json"
    for path in (manifest, registration):
        assert SECRET not in path.read_text()
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    for path in (folder, folder / "ranks"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o750
    data = json.loads(manifest.read_text())
    assert data["config"]["metadata"]["lr"] == 0.1
    assert data["config"]["metadata"]["hf_token"] == "<redacted>"
    assert sorted(data["config"]["backends"]["otlp_traces"]["headers"]) == ["authorization", "x-tenant"]
    assert "localhost:4318" in data["config"]["backends"]["otlp_traces"]["endpoint"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_launcher_records_no_command_line(tmp_path: Path) -> None:
    """traintrace-run with secrets in the script's arguments: neither manifest.json nor
    agent.jsonl nor a rank's stream holds them (docs: no command line is recorded)."""
    pytest.importorskip("torch")
    script = tmp_path / "noop.py"
    script.write_text("import traintrace as tt\ntt.configure()\nwith tt.training_iteration(0):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINTRACE_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update({"TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_BACKENDS_LOG_ENABLED": "0"})
    env["PYTHONPATH"] = str(Path(tt.__file__).parents[1])
    command = [
        sys.executable,
        "-m",
        "traintrace.launch",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(script),
        f"--hf_token={SECRET}",
        "--password",
        SECRET,
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (job,) = (tmp_path / "logs").iterdir()
    files = [p for p in job.rglob("*") if p.is_file()]
    assert {"manifest.json", "agent.jsonl", "rank0.jsonl"} <= {p.name for p in files}
    for path in files:
        assert SECRET not in path.read_text(errors="replace"), path


# ---------------------------------------------------------------- symlinks (issue 17, item 2)

VICTIM_TEXT = "do not touch\n"


def _victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    victim = outside / name
    victim.write_text(VICTIM_TEXT)
    return victim


@pytest.mark.usefixtures("no_umask")
def test_planted_links_are_never_written_through(tmp_path: Path) -> None:
    """Links planted where traintrace writes (the manifest's and a registration's temporary
    files under their old predictable names, the fault file) leave their targets untouched, and
    nothing is created outside log_dir; the manifest and registration are still written."""
    logs = tmp_path / "logs"
    job = logs / "planted"
    (job / "ranks").mkdir(parents=True)
    victim = _victim(tmp_path)
    pid = os.getpid()
    (job / f".manifest.json.{pid}.tmp").symlink_to(victim)
    (job / "ranks" / f".rank0.restart0.json.{pid}.tmp").symlink_to(victim)
    created = tmp_path / "outside" / "created.txt"
    (job / "rank0.jsonl.faults.txt").symlink_to(created)
    tt.configure(job_id="planted", log_dir=str(logs), backends={"file": {}, "log": False})
    tt.event("x")
    tt.close()
    assert victim.read_text() == VICTIM_TEXT
    assert not created.exists()
    assert json.loads((job / "manifest.json").read_text())["job"] == "planted"
    assert json.loads((job / "ranks" / "rank0.restart0.json").read_text())["rank"] == 0
    assert read_file(job / "rank0.jsonl").streams[0].closed_cleanly


def test_a_stream_or_folder_swapped_for_a_link_mid_run_redirects_nothing(tmp_path: Path) -> None:
    """The stream file replaced by a link, then its folder replaced by a link: every later write
    stays out of the links' targets (those writes are refused and counted), and the process
    never sees an error."""
    logs = tmp_path / "logs"
    victim = _victim(tmp_path)
    elsewhere = tmp_path / "outside" / "folder"
    elsewhere.mkdir()
    tt.configure(job_id="swap", log_dir=str(logs), backends={"file": {}, "log": False}, fault_handler=False)
    job = logs / "swap"
    stream = job / "rank0.jsonl"
    tt.event("before")
    tt.flush()
    stream.rename(job / "moved.jsonl")
    stream.symlink_to(victim)
    tt.event("through_file_link")
    tt.flush()
    stream.unlink()
    job.rename(logs / "swap.moved")
    job.symlink_to(elsewhere, target_is_directory=True)
    tt.event("through_folder_link")
    tt.flush()
    job.unlink()
    tt.event("after")
    tt.close()
    assert victim.read_text() == VICTIM_TEXT
    assert list(elsewhere.iterdir()) == []
    moved = read_file(logs / "swap.moved" / "moved.jsonl").streams[0]
    assert [r["name"] for r in moved.records if r.get("kind") == "event"] == ["before"]
    # Once no link is in the way the stream goes on, saying how many records it could not write.
    later = read_file(job / "rank0.jsonl").streams[0]
    assert [r["name"] for r in later.records if r.get("kind") == "event"] == ["after"]
    notes = [r for r in later.records if r.get("kind") == "dropped" and r.get("reason") == "write_error"]
    assert sum(n["count"] for n in notes) >= 2


def test_report_replaces_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    """`traintrace report <dir>` where <dir>/report.html is a link: the link is replaced by the
    report; its target keeps its contents."""
    pytest.importorskip("duckdb")
    from traintrace.cli import main

    logs = tmp_path / "logs"
    tt.configure(job_id="rep", log_dir=str(logs), backends={"file": {}, "log": False}, fault_handler=False)
    for step in range(3):
        with tt.training_iteration(step):
            pass
    tt.close()
    victim = _victim(tmp_path)
    report = logs / "rep" / "report.html"
    report.symlink_to(victim)
    assert main(["report", str(logs / "rep"), "--quiet"]) == 0
    assert victim.read_text() == VICTIM_TEXT
    assert not report.is_symlink() and "<html" in report.read_text().lower()


@pytest.mark.usefixtures("no_umask")
def test_every_folder_created_gets_the_folder_mode(tmp_path: Path) -> None:
    """Under umask 0, every folder traintrace creates (log_dir's missing parents included, and
    ranks/) gets 0o750 for the default file_mode, never 0o777."""
    logs = tmp_path / "a" / "b" / "logs"
    tt.configure(job_id="deep", log_dir=str(logs), backends={"file": {"path": "{job}/x/y/r.jsonl"}, "log": False})
    tt.close()
    deep = logs / "deep"
    created = [tmp_path / "a", tmp_path / "a" / "b", logs, deep, deep / "x", deep / "x" / "y", deep / "ranks"]
    assert {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in created} == {
        str(p.relative_to(tmp_path)): "0o750" for p in created
    }


# ---------------------------------------------------------------- job ids (issue 17, item 13)


@settings(max_examples=examples(300), deadline=None)
@given(a=st.text(min_size=1, max_size=200), b=st.text(min_size=1, max_size=200))
def test_different_job_ids_never_share_a_folder(a: str, b: str) -> None:
    """Two different job ids give two different folder names, each one safe path component of
    at most 128 characters, even when sanitising changes them (``a/b``, ``a\\x00b``, ``a_b``)
    or they share a 128-character prefix."""
    from traintrace._identity import safe_component

    for text in (a, b):
        name = safe_component(text)
        assert 1 <= len(name) <= 128 and "/" not in name and "\x00" not in name and not name.startswith(".")
    if a != b:
        assert safe_component(a) != safe_component(b)


def test_colliding_job_ids_get_their_own_folders(tmp_path: Path) -> None:
    """The ids the review found sharing a folder now write three folders and two long ones;
    an id that needs no change keeps its name."""
    long = "x" * 128
    ids = ["a/b", "a\x00b", "a_b", long + "1", long + "2"]
    for job in ids:
        tt.configure(job_id=job, log_dir=str(tmp_path), backends={"file": {}, "log": False}, fault_handler=False)
        tt.close()
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == len(ids) and "a_b" in folders
    assert all(len(name) <= 128 for name in folders)
