"""The plain-PyTorch examples run for real: torchrun with 2 gloo CPU ranks, and async checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import traintrace as tt
from traintrace.reader import read_file

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).parent.parent


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINTRACE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
@pytest.mark.once  # each rank's stream under the pure core: tests/test_diagnosis.py's jobs
def test_torchrun_ddp_example_writes_one_stream_per_rank(tmp_path: Path) -> None:
    """torchrun --nproc-per-node 2: each rank's stream has its identity, every step, and rank 0 the saves."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "ddp_torchrun.py"), "--log-dir", str(tmp_path / "logs"), "--job-id", "ddp",
        "--checkpoint-dir", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=environment(), cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        (stream,) = read_file(tmp_path / "logs" / "ddp" / f"rank{rank}.jsonl").streams
        assert stream.header["rank"] == rank and stream.header["world_size"] == 2
        assert stream.header.get("launcher") == "torchelastic" and stream.closed_cleanly
        spans = stream.spans()
        names = [s["name"] for s in spans]
        # 1024 samples / 2 ranks / batch 32 = 16 steps per epoch, 2 epochs.
        assert names.count(tt.SpanName.ITERATION) == 32
        assert names.count(tt.SpanName.VALIDATION) == 2
        assert names.count(tt.SpanName.CHECKPOINT_SAVE_SYNC) == (2 if rank == 0 else 0)
        assert all(s["status"] == "ok" for s in spans)
        ids = {s["id"]: s for s in spans}
        loop = next(s for s in spans if s["name"] == tt.SpanName.TRAINING_LOOP)
        for span in spans:
            if span["name"] == tt.SpanName.FORWARD:
                assert ids[span["parent"]]["name"] == tt.SpanName.ITERATION
            if span["name"] == tt.SpanName.ITERATION:
                assert span["parent"] == loop["id"]
        # The DDP hook: one all-reduce per step, inside backward, ended when the reduced bucket was ready.
        collectives = [s for s in spans if s["name"] == tt.SpanName.COLLECTIVE]
        in_backward = [s for s in collectives if ids[s["parent"]]["name"] == tt.SpanName.BACKWARD]
        assert len(in_backward) == 32 and all(s["attrs"]["op"] == "all_reduce" for s in in_backward)
        assert len(collectives) == 32 + 2 + 2  # and the validation all-reduce and the barrier, each epoch


@pytest.mark.slow
def test_async_checkpoint_example_links_background_writes(tmp_path: Path) -> None:
    """Each async save: a blocking span and a linked finalisation span that ends with the size written."""
    command = [
        sys.executable, str(ROOT / "examples" / "async_checkpoint.py"), "--log-dir", str(tmp_path / "logs"),
        "--job-id", "async", "--steps", "20", "--every", "10", "--checkpoint-dir", str(tmp_path / "checkpoints"),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=environment(), cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (stream,) = read_file(next((tmp_path / "logs" / "async").glob("*.jsonl"))).streams
    saves = stream.spans(tt.SpanName.CHECKPOINT_SAVE_ASYNC)
    finals = stream.spans(tt.SpanName.CHECKPOINT_SAVE_FINALIZATION)
    assert len(saves) == len(finals) == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step10", "step20"]
    assert {s["attrs"]["checkpoint_directory"] for s in saves} == {str(tmp_path / "checkpoints")}
    assert sorted(f["link"] for f in finals) == sorted(s["id"] for s in saves)
    assert all(f["status"] == "ok" and f["attrs"]["checkpoint_size"] > 0 for f in finals)
    loop = stream.spans(tt.SpanName.TRAINING_LOOP)[0]
    iterations = stream.spans(tt.SpanName.ITERATION)
    assert len(iterations) == 20 and all(i["parent"] == loop["id"] for i in iterations)
