"""Security: file permissions, nothing recorded that was not asked for, redaction of
secret-looking keys before any backend, and paths that cannot leave the log folder."""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import traintrace as tt
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
