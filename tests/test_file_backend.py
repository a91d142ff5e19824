"""The JSON-lines file backend: append mode, schema validity, recovery."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import traintrace as tt
from tests.conftest import read_jsonl
from traintrace.backends import FileBackend


def _run(tmp_path: Path, steps: int = 5, **settings: object) -> Path:
    settings.setdefault("backends", {"log": False})
    rec = tt.configure(job_id="job", log_dir=str(tmp_path), **settings)
    path = rec.routes()[0].backend.path
    with tt.application():
        with tt.training_loop():
            for step in range(steps):
                with tt.training_iteration(step) as it:
                    it.add_metrics(loss=1.0 / (step + 1))
    tt.close()
    return Path(path)


def test_default_layout_and_valid_records(tmp_path: Path) -> None:
    """rank0.jsonl under <log_dir>/<job>/, every line valid against the schema."""
    path = _run(tmp_path)
    assert path == (tmp_path / "job" / "rank0.jsonl").resolve()
    records = read_jsonl(path, check="all")
    assert records[0]["kind"] == "header"
    assert records[-1]["kind"] == "close"
    assert len([r for r in records if r.get("name") == "iteration"]) == 5


def test_restart_appends_and_never_truncates(tmp_path: Path) -> None:
    """A second process run appends a new stream after the first."""
    path = _run(tmp_path, steps=3)
    _run(tmp_path, steps=2)
    records = read_jsonl(path)
    headers = [r for r in records if r["kind"] == "header"]
    assert len(headers) == 2
    assert len([r for r in records if r.get("name") == "iteration"]) == 5


def test_partial_last_line_gets_a_fresh_line(tmp_path: Path) -> None:
    """A line cut by a killed process does not swallow the next stream's header."""
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "rank0.jsonl").write_bytes(b'{"seq":0,"kind":"header"\n{"seq":5,"kind":"sp')
    path = _run(tmp_path, steps=1)
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == b'{"seq":5,"kind":"sp'
    assert json.loads(lines[2])["kind"] == "header"


def test_file_permissions(tmp_path: Path) -> None:
    """Files are created with the configured mode (default owner rw, group r)."""
    old = os.umask(0)
    try:
        path = _run(tmp_path, steps=1)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        path2 = _run(tmp_path / "b", steps=1, **{"backends": {"log": False, "file": {"file_mode": 0o600}}})
        assert stat.S_IMODE(path2.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_write_failure_is_counted_and_reported_after_recovery(tmp_path: Path) -> None:
    """A failing write drops the batch, and a dropped note follows once writes work."""
    from traintrace._config import Config
    from traintrace._identity import detect
    from traintrace._setup import _header

    backend = FileBackend(tmp_path / "f.jsonl")
    backend.open(_header(detect(), Config(job_id="j"), {}))
    real_fd = backend._fd
    backend._fd = os.open("/dev/full", os.O_WRONLY)
    backend.write([{"seq": 1, "kind": "event", "ts": 2, "name": "a", "span": 0, "tid": 1}])
    backend.write([{"seq": 2, "kind": "event", "ts": 3, "name": "b", "span": 0, "tid": 1}])
    os.close(backend._fd)
    backend._fd = real_fd
    backend.write([{"seq": 3, "kind": "event", "ts": 4, "name": "c", "span": 0, "tid": 1}])
    backend.close()
    records = read_jsonl(tmp_path / "f.jsonl")
    kinds = [(r["kind"], r.get("name")) for r in records]
    assert ("event", "a") not in kinds
    dropped = next(r for r in records if r["kind"] == "dropped")
    assert (dropped["count"], dropped["first_seq"], dropped["last_seq"]) == (2, 1, 2)
    assert dropped["reason"] == "write_error"
    assert "No space left" in dropped["error"]


def test_hostile_values_are_valid_json(tmp_path: Path) -> None:
    """Everything a user might pass as a metric yields schema-valid lines."""
    import datetime
    import enum
    import math

    class Colour(enum.Enum):
        RED = "red"

    cyclic: dict = {}
    cyclic["self"] = cyclic
    rec = tt.configure(job_id="j", log_dir=str(tmp_path), backends={"log": False})
    path = rec.routes()[0].backend.path
    with tt.span("s") as s:
        s.add_metrics(
            {
                "nan": math.nan,
                "inf": math.inf,
                "colour": Colour.RED,
                "path": Path("/tmp/x"),
                "when": datetime.datetime(2026, 1, 2, 3, 4, 5),
                "raw": b"\x00\xff",
                "set": {3, 1, 2},
                "obj": object(),
                "cyclic": cyclic,
                "huge": "x" * 100_000,
                'key with = and "quotes"\n': "ünïcode ✓",
                7: "int key",
                "big": 2**80,
                "surrogate": "\udc80",
            }
        )
    tt.close()
    records = read_jsonl(Path(path), check="all")
    attrs = next(r for r in records if r.get("name") == "s")["attrs"]
    assert attrs["nan"] == "NaN" and attrs["inf"] == "Infinity"
    assert attrs["colour"] == "red" and attrs["path"] == "/tmp/x"
    assert attrs["set"] == [1, 2, 3]
    assert len(attrs["huge"]) < 5000
    assert attrs["7"] == "int key"


def test_a_moved_file_is_noticed_at_the_next_write_cycle(tmp_path: Path) -> None:
    """The backend looks for a moved file at the first write after each flush (the writer flushes at
    the end of every write cycle): the rest of the cycle goes to the moved file, nothing is lost,
    and the next cycle starts a new file at the path with the header again."""
    path = tmp_path / "s.jsonl"
    backend = FileBackend(path, fsync_on_close=False)
    backend.open({"kind": "header", "seq": 0})
    backend.write_lines(b'{"seq":1}\n', 1, 1, 1)
    path.rename(tmp_path / "s.jsonl.1")
    backend.write_lines(b'{"seq":2}\n', 1, 2, 2)  # the same cycle: to the moved file
    backend.flush()
    backend.write_lines(b'{"seq":3}\n', 1, 3, 3)
    backend.close()
    moved = [json.loads(line) for line in (tmp_path / "s.jsonl.1").read_text().splitlines()]
    new = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["seq"] for r in moved] == [0, 1, 2]
    assert [r["seq"] for r in new] == [0, 3] and new[0]["kind"] == "header"
