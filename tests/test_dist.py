"""Identity refresh from a real torch.distributed process group (gloo, CPU)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import traintrace as tt
from traintrace import MemoryBackend
from traintrace.reader import read_file

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith(("TRAINTRACE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_", "SLURM_", "MASTER_")):
            monkeypatch.delenv(key)
    yield
    tt.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_refresh_identity_before_configure_and_without_a_group() -> None:
    """No recorder: None. No process group: the identity is unchanged and nothing is recorded."""
    tt.close()
    assert tt.refresh_identity() is None
    memory = MemoryBackend()
    tt.configure(backends=[], extra_backends=[memory], job_id="j")
    before = tt.get_recorder().identity  # type: ignore[union-attr]
    assert tt.refresh_identity() == before
    tt.flush()
    assert memory.events("identity") == []


def test_explicit_configuration_wins_over_the_process_group(tmp_path: Path) -> None:
    """A configured world size that the group contradicts is kept, and the conflict recorded once."""
    memory = MemoryBackend()
    tt.configure(backends=[], extra_backends=[memory], job_id="j", rank=0, world_size=2)
    tt._recorder._warned.discard("identity_conflict")
    with pytest.warns(tt.TraintraceWarning, match="configuration wins"), tt.distributed_init():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    tt.refresh_identity()
    tt.flush()
    (event,) = memory.events("identity")
    assert event["attrs"]["applied"] is False
    assert (event["attrs"]["detected_rank"], event["attrs"]["detected_world_size"]) == (0, 1)
    assert tt.get_recorder().identity.world_size == 2  # type: ignore[union-attr]


def _spawned_rank(rank: int, folder: str) -> None:
    import torch.distributed as dist

    import traintrace as tt

    # Plain multiprocessing: nothing in the environment says which rank this is.
    backends = {"log": False, "file": {"path": "{job}/pid{pid}.jsonl"}}
    tt.configure(log_dir=folder, job_id="mp", backends=backends)
    with tt.distributed_init():
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    with tt.training_iteration(0):
        dist.barrier()
    dist.destroy_process_group()
    tt.close()


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once  # the rank a process registers under, whichever core records
def test_refresh_from_the_process_group_in_plain_multiprocessing(tmp_path: Path) -> None:
    """Two spawned processes learn their rank when distributed_init ends, and register under it."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_spawned_rank, args=(rank, str(tmp_path))) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    files = sorted((tmp_path / "mp").glob("pid*.jsonl"))
    assert len(files) == 2
    seen = set()
    for path in files:
        (stream,) = read_file(path).streams
        assert stream.header["rank"] == 0  # what the environment said at configure()
        (identity,) = stream.of_kind("event")[:1]
        assert identity["name"] == "identity"
        assert identity["attrs"]["world_size"] == 2
        assert identity["attrs"]["applied"] is True
        seen.add(identity["attrs"]["rank"])
    assert seen == {0, 1}
    registered = sorted(p.name for p in (tmp_path / "mp" / "ranks").iterdir())
    assert "rank1.restart0.json" in registered
