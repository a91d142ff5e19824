"""TensorBoard backend: what a real training loop wrote, read back with TensorBoard's own reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._trackers import STEPS, train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def _load(folder: Path) -> EventAccumulator:
    files = list(folder.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_text_and_summary_in_tensorboard(tmp_path: Path) -> None:
    """Interval statistics and loss against the step, checkpoint/validation timings, the error as text,
    goodput at the end."""
    truth = train(tmp_path, {"tensorboard": {}})
    acc = _load(tmp_path / "trk" / "tensorboard")
    tags = acc.Tags()
    scalars = set(tags["scalars"])
    for tag in (
        "traintrace/step_time_ms",
        "traintrace/step_time_p90_ms",
        "traintrace/samples_per_second",
        "traintrace/iterations_per_second",
        "loss",
        "traintrace/checkpoint/checkpoint_save_sync_s",
        "traintrace/validation/validation_loop_s",
        "traintrace/goodput",
        "traintrace/errors",
    ):
        assert tag in scalars, (tag, sorted(scalars))
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == pytest.approx(truth.losses, rel=1e-6)
    assert sorted({e.step for e in acc.Scalars("traintrace/step_time_ms")}) == truth.interval_ends
    assert all(e.value >= 2.0 for e in acc.Scalars("traintrace/step_time_ms"))  # each step sleeps 2 ms
    samples = acc.Scalars("traintrace/samples_per_second")
    assert all(e.value > 0 for e in samples)
    (save,) = acc.Scalars("traintrace/checkpoint/checkpoint_save_sync_s")
    assert 0.05 <= save.value <= truth.checkpoint_s  # traintrace's span lies inside our own clock's window
    assert save.step == 9
    (val,) = acc.Scalars("traintrace/validation/validation_loop_s")
    assert 0.03 <= val.value <= truth.validation_s
    goodput = acc.Scalars("traintrace/goodput")[-1].value
    assert 0 < goodput < 1
    completed = acc.Scalars("traintrace/completed_steps")[-1].value
    assert completed == STEPS
    (text_tag,) = tags["tensors"]
    assert text_tag == "traintrace/error_text" and text_tag not in scalars  # one kind of data per tag
    (event,) = acc.Tensors(text_tag)
    text = event.tensor_proto.string_val[0].decode()
    assert "ValueError: bad batch 7" in text and "Traceback" in text
    assert event.step == 7  # the step it happened in


def test_a_stuck_tracker_never_blocks_training_or_close(tmp_path: Path) -> None:
    """A tracker that blocks forever: training goes on (points dropped and counted) and close() returns."""
    import threading

    import traintrace as tt
    from traintrace.backends import TrackerBackend

    release = threading.Event()

    class Stuck(TrackerBackend):
        name = "stuck"

        def _tool_open(self, header: object) -> None:
            return None

        def _tool_scalars(self, step: int, values: dict[str, float]) -> None:
            release.wait()  # a tracker server that never answers

        def _tool_text(self, step: int, tag: str, text: str) -> None:
            release.wait()

        def _tool_summary(self, values: dict[str, float]) -> None:
            release.wait()

    stuck = Stuck(queue_size=2)
    tt.configure(job_id="stuck", log_dir=str(tmp_path), log_interval=1, backends={"log": False}, extra_backends=[stuck])
    with tt.training_loop():
        for step in range(50):
            with tt.training_iteration(step) as it:
                it.add_metrics(loss=1.0)
    tt.close()
    try:
        assert stuck.dropped > 0
        text = (tmp_path / "stuck" / "rank0.jsonl").read_text()
        assert text.count('"name":"iteration"') == 50  # the file got everything
        close = json.loads(text.splitlines()[-1])
        assert close["kind"] == "close"
        (losses,) = close["backend_losses"].values()  # the tracker's losses are in the file
        assert losses["queue_full"] == stuck.dropped and losses["abandoned"] >= 1
    finally:
        release.set()
