"""record_collectives on a real DDP model (gloo, CPU, one process): the gradient all-reduces and the broadcast
of the module's buffers before each forward, as collective spans."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import traintrace as tt
from traintrace import MemoryBackend, SpanName

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from traintrace.integrations.ddp import record_collectives  # noqa: E402


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith(("TRAINTRACE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_", "MASTER_")):
            monkeypatch.delenv(key)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    tt.close()
    dist.destroy_process_group()


def _train(model: Any, memory: MemoryBackend, steps: int = 3) -> list[dict[str, Any]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(4, 8)
        with tt.training_iteration(step):
            with tt.forward():
                loss = model(x).square().mean()
            with tt.backward():
                loss.backward()
            optimizer.step()
    tt.flush()
    return memory.spans(SpanName.COLLECTIVE)


def _configure() -> MemoryBackend:
    memory = MemoryBackend()
    tt.configure(backends=[], extra_backends=[memory], job_id="j")
    return memory


@pytest.mark.usefixtures("group")
def test_the_buffer_broadcast_before_each_forward_is_a_collective_inside_it() -> None:
    """A model with BatchNorm: each forward holds one broadcast span, which ends before the model's own forward
    ran (its spans follow it); the all-reduces are in backward as before."""
    memory = _configure()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)))
    assert model.will_sync_module_buffers()  # the premise: DDP broadcasts the buffers at each forward
    record_collectives(model)
    spans = _train(model, memory)
    forwards = {s["id"]: s for s in memory.spans(SpanName.FORWARD)}
    backwards = {s["id"] for s in memory.spans(SpanName.BACKWARD)}
    broadcasts = [s for s in spans if s["attrs"]["op"] == "broadcast"]
    assert len(broadcasts) == 3 and all(s["attrs"]["tensors"] == "buffers" for s in broadcasts)
    for span in broadcasts:
        outer = forwards[span["parent"]]
        assert outer["ts"] <= span["ts"] and span["ts"] + span["dur"] <= outer["ts"] + outer["dur"]
    reduces = [s for s in spans if s["attrs"]["op"] == "all_reduce"]
    assert reduces and all(s["parent"] in backwards for s in reduces)


@pytest.mark.usefixtures("group")
def test_a_model_without_buffers_gets_no_broadcast_span() -> None:
    memory = _configure()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1)))
    record_collectives(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert {s["attrs"]["op"] for s in _train(model, memory)} == {"all_reduce"}


@pytest.mark.usefixtures("group")
def test_a_copy_of_a_recorded_model_syncs_its_own_buffers_unrecorded() -> None:
    """copy.deepcopy of a recorded DDP model (an EMA copy, say): it broadcasts its own buffers, as without
    traintrace, and records nothing; the original goes on recording."""
    import copy

    memory = _configure()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)))
    record_collectives(model)
    twin = copy.deepcopy(model)
    synced: list[Any] = []
    original = twin._sync_module_buffers
    twin._sync_module_buffers = lambda *a: synced.append(twin) or original(*a)  # type: ignore[method-assign]
    with tt.forward():
        twin(torch.randn(4, 8))
    assert synced == [twin]
    tt.flush()
    assert memory.spans(SpanName.COLLECTIVE) == []
    with tt.forward():
        model(torch.randn(4, 8))
    tt.flush()
    assert [s["attrs"]["op"] for s in memory.spans(SpanName.COLLECTIVE)] == ["broadcast"]


@pytest.mark.usefixtures("group")
def test_a_forward_that_raises_ends_its_broadcast_span_and_the_next_forward_records_its_own() -> None:
    memory = _configure()

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(8)
            self.fail = True

        def forward(self, x: Any) -> Any:
            if self.fail:
                raise RuntimeError("bad batch")
            return self.norm(x).sum()

    inner = Fails()
    model = DistributedDataParallel(inner)
    record_collectives(model)
    with tt.forward(), pytest.raises(RuntimeError, match="bad batch"):
        model(torch.randn(4, 8))
    inner.fail = False
    with tt.forward():
        model(torch.randn(4, 8))
    tt.flush()
    broadcasts = [s for s in memory.spans(SpanName.COLLECTIVE) if s["attrs"]["op"] == "broadcast"]
    assert len(broadcasts) == 2 and all(s["dur"] is not None for s in broadcasts)
    assert tt.current_span() is None  # nothing left open on the training thread


@pytest.mark.usefixtures("group")
def test_a_broadcast_that_fails_ends_its_span_with_the_error_recorded_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer gone mid-broadcast (here: DDP's buffer sync raising as gloo does): the span ends with status error
    and the exception is recorded once, at the collective, not at the forward around it."""
    memory = _configure()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)))
    record_collectives(model)

    def gone() -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(model, "_sync_module_buffers", lambda *_: gone())
    with pytest.raises(RuntimeError, match="closed by peer"), tt.forward():
        model(torch.randn(4, 8))
    tt.flush()
    (broadcast,) = [s for s in memory.spans(SpanName.COLLECTIVE) if s["attrs"]["op"] == "broadcast"]
    assert broadcast["status"] == "error"
    (error,) = memory.errors()
    assert error["span"] == broadcast["id"] and error["error_type"] == "RuntimeError"
    assert tt.current_span() is None
