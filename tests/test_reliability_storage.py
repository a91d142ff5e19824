"""Storage faults: full disk, read-only folder, file deleted or rotated, slow sink.

The full-disk and read-only cases mount a small tmpfs in the test's own mount
namespace (``unshare -m``, needs root); they are skipped, saying why, where
that is not possible.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import traintrace as tt
from tests._reliability import child_env, needs_namespace, schema_errors, write_script
from traintrace.backends import BaseBackend, FileBackend, MemoryBackend
from traintrace.reader import read_file

# The start of a script run inside `unshare -m`: mounts a tmpfs of the size its second argument says on the folder
# its first names, and gathers the library's warnings.
ON_A_TMPFS = r"""
import json, logging, os, subprocess, sys, time
from pathlib import Path
import traintrace as tt
from traintrace.reader import read_file

mnt = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={sys.argv[2]}", "tmpfs", str(mnt)], check=True)
warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("traintrace.lib").addHandler(Catch())
logs = mnt / "logs"
def fill(path):  # a file at path that takes the disk's last byte
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    for size in (4096, 1):
        try:
            while True:
                os.write(fd, b"\0" * size)
        except OSError:
            pass
    os.close(fd)
"""

# Fills a 256 KiB tmpfs, frees it, makes it read-only after a rotation, then writable again; prints what happened as
# JSON (the mount is gone after).
FULL_DISK = r"""
# No reserve: every write once the disk is full fails (test_a_full_disk_leaves_room_for_the_failure has one).
tt.configure(job_id="disk", log_dir=str(logs), backends={"file": {"path": "s.jsonl", "reserve_bytes": 0}, "log": False},
             flush_interval=0.01)
def steps(first, last):
    for step in range(first, last):
        with tt.training_iteration(step):
            tt.event("progress", {"step": step, "pad": "p" * 200})
    tt.flush()

steps(0, 100)
filler = mnt / "filler"
fill(filler)
steps(100, 300)                            # all of these fail: disk full
full_warnings = len(warnings)
filler.unlink()                            # space returns
steps(300, 400)
# The folder becomes unwritable after the file was rotated away.
os.rename(logs / "s.jsonl", logs / "s.jsonl.1")
subprocess.run(["mount", "--bind", str(logs), str(logs)], check=True)
subprocess.run(["mount", "-o", "remount,bind,ro", str(logs)], check=True)
steps(400, 500)                            # cannot reopen: read-only
ro_warnings = len(warnings)
subprocess.run(["umount", str(logs)], check=True)
steps(500, 600)
tt.close()
def summary(path):
    result = read_file(path)
    records = [r for s in result.streams for r in s.records]
    return {
        "streams": len(result.streams),
        "headers": [s.header for s in result.streams],
        "records": records,
        "bad_lines": [b.reason for b in result.bad_lines],
    }
print(json.dumps({"warnings": warnings, "full_warnings": full_warnings, "ro_warnings": ro_warnings,
                  "first": summary(logs / "s.jsonl.1"), "second": summary(logs / "s.jsonl")}))
"""


def run_on_a_tmpfs(tmp_path: Path, script: str, size: str) -> dict[str, Any]:
    """``script`` after ``ON_A_TMPFS`` in a mount namespace of its own, on a tmpfs of ``size``: what it printed."""
    path = write_script(tmp_path, "on_tmpfs.py", ON_A_TMPFS + script)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, str(path), str(mnt), size],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.mark.subprocess
@needs_namespace
def test_full_disk_then_read_only_folder_then_recovery(tmp_path: Path) -> None:
    """Disk full, then (after a rotation) a read-only folder: training goes on, one warning per
    fault, the lost records are counted with their sequence numbers, and writing resumes when
    space or write access returns."""
    report = run_on_a_tmpfs(tmp_path, FULL_DISK, "256k")
    # One warning for the full disk, one for the read-only folder; none for recovery.
    assert report["full_warnings"] == 1 and report["ro_warnings"] == 2, report["warnings"]
    assert "No space left" in report["warnings"][0]
    assert "Read-only" in report["warnings"][1]

    first, second = report["first"], report["second"]
    records = first["records"] + second["records"]
    dropped = [r for r in records if r["kind"] == "dropped"]
    assert [d["reason"] for d in dropped] == ["write_error", "write_error"]
    lost = set()
    for note in dropped:
        lost |= set(range(note["first_seq"], note["last_seq"] + 1))
    kept = {r["seq"] for r in records if isinstance(r.get("seq"), int)}
    top = max(kept)
    # Every sequence number is either in a file or inside a range a `dropped` note names.
    assert kept | lost == set(range(1, top + 1))
    assert sum(d["count"] for d in dropped) >= len(lost - kept) > 0
    steps_kept = {r["attrs"]["step"] for r in records if r["kind"] == "event" and r["name"] == "progress"}
    assert set(range(100)) <= steps_kept and set(range(300, 400)) <= steps_kept
    assert set(range(500, 600)) <= steps_kept
    assert not steps_kept & set(range(400, 500))  # written while read-only: lost, and counted
    # The new file after rotation starts with the header again.
    assert second["streams"] == 1 and second["headers"][0]["job"] == "disk"
    assert second["records"][-1]["kind"] == "close"
    # A torn line at the moment the disk filled is the only kind of bad line.
    assert len(first["bad_lines"]) <= 1
    assert not schema_errors(records)


# A 1 MiB tmpfs holds the stream and what fills it (a checkpoint, say); the exception that follows, and the records
# after it up to the reserve's size, are written; prints what happened as JSON.
RESERVE = r"""
tt.configure(job_id="disk", log_dir=str(logs), backends={"file": {"path": "s.jsonl"}, "log": False},
             flush_interval=0.01)
reserve = logs / ".s.jsonl.reserve"
reserved = os.stat(reserve).st_blocks * 512
with tt.training_loop():
    for step in range(20):
        with tt.training_iteration(step):
            pass
    tt.flush()
    fill(mnt / "checkpoint")
    try:
        with tt.checkpoint_save({"step": 20}):
            raise OSError(28, "No space left on device")
    except OSError:
        pass
    tt.flush()
    after_failure = reserve.exists()
    for step in range(20, 2000):  # 128 KiB: about a thousand of these
        with tt.training_iteration(step):
            tt.event("progress", {"step": step, "pad": "p" * 60})
        if step % 100 == 0:
            tt.flush()
tt.flush()
os.unlink(mnt / "checkpoint")  # space returns: the drops are noted, then the close record
tt.close()
result = read_file(logs / "s.jsonl")
print(json.dumps({"warnings": warnings, "reserved": reserved, "reserve_after_failure": after_failure,
                  "reserve_after_close": reserve.exists(), "records": [r for s in result.streams for r in s.records],
                  "bad_lines": len(result.bad_lines)}))
"""


@pytest.mark.subprocess
@needs_namespace
def test_a_full_disk_leaves_room_for_the_failure(tmp_path: Path) -> None:
    """The stream's file system fills up (a checkpoint on the same disk) and the save fails: the stream's reserve,
    128 KiB set aside in a hidden file when it started, is released by the first write that finds no room, so
    the save's error is written, and the records after it until that space is used; then they are dropped and
    counted as before (noted once space returns). The reserve file is gone after close."""
    report = run_on_a_tmpfs(tmp_path, RESERVE, "1m")
    assert report["reserved"] >= 128 * 1024, report["reserved"]
    # (The save's error may fit in the file's last page, which the full disk had already given it.)
    assert not report["reserve_after_close"]
    assert "reserve is released" in report["warnings"][0], report["warnings"]
    records = report["records"]
    saves = [r for r in records if r.get("name") == "checkpoint_save_sync" and r["kind"] in ("span", "end")]
    assert [s["status"] for s in saves] == ["error"], saves
    errors = [r for r in records if r["kind"] == "error"]
    assert errors and "No space left on device" in json.dumps(errors[0]), errors
    steps = [r["attrs"]["step"] for r in records if r["kind"] == "event" and r["name"] == "progress"]
    # After the failure: a run of steps in the reserve's room (about 300 bytes each; a page's slack holds 14), then
    # drops, counted.
    assert steps and steps == list(range(20, 20 + len(steps))) and len(steps) > 200, (len(steps), steps[:3])
    dropped = [r for r in records if r["kind"] == "dropped"]
    assert 20 + len(steps) < 2000 and dropped and dropped[0]["reason"] == "write_error", (len(steps), dropped)
    # (The note of what was lost follows the first batch that could be written: here, the close record's.)
    assert [r["kind"] for r in records[-2:]] == ["close", "dropped"] and report["bad_lines"] <= 1
    assert not schema_errors(records)


def test_dev_full_never_raises_and_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Writing to /dev/full (always 'no space'): configure and training go on, one warning,
    the other backends get everything."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    full = FileBackend("/dev/full")
    memory = MemoryBackend()
    with caplog.at_level(logging.WARNING, logger="traintrace.lib"):
        tt.configure(job_id="full", backends={}, extra_backends=[full, memory], flush_interval=0.01)
        for step in range(200):
            with tt.training_iteration(step):
                tt.event("progress", {"step": step})
            if step % 50 == 0:
                tt.flush()
        tt.close()
    warnings = [r for r in caplog.records if "/dev/full" in r.getMessage()]
    assert len(warnings) == 1
    assert full._lost > 0  # counted, waiting for the disk to come back
    assert len(memory.events("progress")) == 200
    assert not Path("/dev/full.faults.txt").exists()


def _progress(records: list[dict[str, Any]]) -> list[int]:
    return [r["attrs"]["step"] for r in records if r.get("kind") == "event" and r.get("name") == "progress"]


@pytest.mark.parametrize("how", ["deleted", "rotated"])
def test_file_deleted_or_rotated_while_open(tmp_path: Path, how: str) -> None:
    """The stream file is deleted (or renamed by logrotate) while open: the next write cycle
    notices, reopens the path, writes the header again and carries on; nothing is duplicated,
    and with rotation nothing is lost."""
    tt.configure(job_id="rot", log_dir=str(tmp_path), backends={"file": {"path": "r.jsonl"}, "log": False})
    path = tmp_path / "r.jsonl"
    for step in range(50):
        tt.event("progress", {"step": step})
    tt.flush()
    if how == "deleted":
        path.unlink()
    else:
        path.rename(tmp_path / "r.jsonl.1")
    for step in range(50, 100):
        tt.event("progress", {"step": step})
    tt.close()
    new = read_file(path)
    assert len(new.streams) == 1 and new.streams[0].header["job"] == "rot"
    assert _progress(new.streams[0].records) == list(range(50, 100))
    assert new.streams[0].closed_cleanly and not new.bad_lines
    if how == "rotated":
        old = read_file(tmp_path / "r.jsonl.1")
        assert _progress(old.streams[0].records) == list(range(50))
        seqs = [r["seq"] for r in old.streams[0].records + new.streams[0].records]
        assert seqs == list(range(1, len(seqs) + 1))


class SlowSink(BaseBackend):
    """A backend on a slow disk: every write takes 50 ms."""

    def __init__(self) -> None:
        self.records = 0

    def write(self, records: Sequence[Any]) -> None:
        time.sleep(0.05)
        self.records += len(records)


def test_slow_sink_training_continues_drops_counted_once_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sink that sleeps 50 ms per write with a small queue: the loop never waits, one
    warning, and produced = written + dropped, with the drops in `dropped` records."""
    slow = SlowSink()
    produced = 20000
    with caplog.at_level(logging.WARNING, logger="traintrace.lib"):
        rec = tt.configure(
            job_id="slow",
            log_dir=str(tmp_path),
            backends={"file": {"path": "slow.jsonl"}, "log": False},
            extra_backends=[slow],
            queue_size=512,
        )
        for step in range(produced):
            tt.event("progress", {"step": step})
        dropped = rec.dropped
        tt.close()
    assert dropped > 0
    warnings = [r for r in caplog.records if "queue was full" in r.getMessage()]
    assert len(warnings) == 1
    stream = read_file(tmp_path / "slow.jsonl").streams[0]
    written = _progress(stream.records)
    assert len(written) == len(set(written))
    notes = stream.of_kind("dropped")
    assert notes and sum(n["count"] for n in notes) == dropped == notes[-1]["total"]
    assert stream.records[-1]["dropped"] == dropped
    assert len(written) + dropped == produced
    assert stream.gaps() == []


HEADER_RETRY = r"""
import resource, signal, sys
import traintrace as tt
from traintrace.reader import read_file

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))   # no byte fits: as a full disk at the start
tt.configure(job_id="hdr", log_dir=sys.argv[1], backends={"file": {"path": "h.jsonl"}, "log": False},
             fault_handler=False, manifest=False)
for step in range(5):
    tt.event("lost", {"step": step})
tt.flush()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))   # space returns
for step in range(5):
    tt.event("kept", {"step": step})
tt.close()
print("done")
"""


@pytest.mark.subprocess
def test_disk_full_at_start_writes_the_header_once_space_returns(tmp_path: Path) -> None:
    """The header cannot be written at configure() (no byte fits); once writing works again the
    file starts with the header, a write_error note counts what was lost, and the records after
    it belong to the stream (none is an orphan)."""
    script = write_script(tmp_path, "hdr.py", HEADER_RETRY)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
    result = read_file(tmp_path / "h.jsonl")
    assert len(result.streams) == 1 and not result.orphans and not result.bad_lines
    stream = result.streams[0]
    assert stream.header["job"] == "hdr" and stream.closed_cleanly
    assert [r["attrs"]["step"] for r in stream.of_kind("event") if r["name"] == "kept"] == list(range(5))
    notes = [r for r in stream.records if r.get("kind") == "dropped" and r.get("reason") == "write_error"]
    assert notes and notes[0]["count"] >= 5
