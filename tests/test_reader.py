"""The tolerant reader."""

from __future__ import annotations

import json
from pathlib import Path

import traintrace as tt
from traintrace.reader import read_file


def _write_run(tmp_path: Path) -> Path:
    rec = tt.configure(job_id="r", log_dir=str(tmp_path), backends={"log": False})
    path = Path(rec.routes()[0].backend.path)
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
    tt.close()
    return path


def test_reads_streams_and_merges_spans(tmp_path: Path) -> None:
    """A clean file gives one stream, closed cleanly, with no gaps."""
    result = read_file(_write_run(tmp_path))
    assert len(result.streams) == 1
    stream = result.streams[0]
    assert stream.closed_cleanly and stream.gaps() == []
    assert [s["attrs"]["step"] for s in stream.spans("iteration")] == [0, 1, 2]


def test_truncated_last_line_is_reported_not_fatal(tmp_path: Path) -> None:
    """A cut final line (a killed process) is skipped and flagged as the last line."""
    path = _write_run(tmp_path)
    with path.open("ab") as handle:
        handle.write(b'{"seq":99,"kind":"sp')
    result = read_file(path)
    assert len(result.bad_lines) == 1 and result.bad_lines[0].last
    assert len(result.spans("iteration")) == 3


def test_corrupt_binary_and_wrong_schema(tmp_path: Path) -> None:
    """Binary junk, non-records and unknown schema versions are reported, not raised."""
    path = tmp_path / "bad.jsonl"
    header = {"seq": 0, "kind": "header", "ts": 1, "schema": "traintrace", "schema_version": 99}
    path.write_bytes(b"\x00\xff\xfe garbage\n[1,2]\n" + json.dumps(header).encode() + b'\n{"seq":1,"kind":"event"}\n')
    result = read_file(path)
    assert [b.line_number for b in result.bad_lines] == [1, 2, 3]
    assert "unsupported schema" in result.bad_lines[2].reason
    assert result.orphans == 1


def test_open_span_of_a_dead_process(tmp_path: Path) -> None:
    """A start with no end is returned with status open."""
    rec = tt.configure(job_id="r", log_dir=str(tmp_path), backends={"log": False})
    path = Path(rec.routes()[0].backend.path)
    tt.start("checkpoint_save_sync")
    tt.flush()
    result = read_file(path)
    assert result.spans("checkpoint_save_sync")[0]["status"] == "open"


def test_gaps_are_found(tmp_path: Path) -> None:
    """Missing sequence numbers are listed as ranges."""
    path = _write_run(tmp_path)
    lines = path.read_text().splitlines()
    del lines[3:5]
    path.write_text("\n".join(lines) + "\n")
    gaps = read_file(path).streams[0].gaps()
    assert len(gaps) == 1 and gaps[0][1] - gaps[0][0] == 1
