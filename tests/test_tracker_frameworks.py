"""Lightning and the trackers: the framework's loggers send the module's metrics, traintrace its own figures."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import traintrace as tt
from tests.test_integrations_lightning import TinyModule, loaders, trainer
from traintrace.integrations.lightning import TraintraceCallback


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for file in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(file), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_lightning_logger_and_traintrace_do_not_log_the_same_thing(tmp_path: Path) -> None:
    """With Lightning's TensorBoardLogger on, the loss is Lightning's (train_loss); traintrace adds only
    traintrace/* (step times, throughput, checkpoint and validation timings)."""
    callback = TraintraceCallback(
        job_id="pl",
        log_dir=str(tmp_path / "tt"),
        log_interval=2,
        backends={"log": False, "tensorboard": {"log_dir": str(tmp_path / "tb" / "tt")}},
    )
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="lightning")
    run = trainer(tmp_path, callbacks=[callback], logger=logger)
    train, val = loaders()
    run.fit(TinyModule(), train, val)
    tt.close()
    ours = _scalars(tmp_path / "tb" / "tt")
    theirs = _scalars(tmp_path / "tb" / "lightning")
    assert "train_loss" in theirs
    assert "traintrace/step_time_ms" in ours and "traintrace/validation/validation_loop_s" in ours
    assert all(tag.startswith("traintrace/") for tag in ours), sorted(ours)
    assert not set(ours) & set(theirs)
    assert sorted({step for step, _ in ours["traintrace/step_time_ms"]}) == [1, 3, 5, 7]  # every 2 of 8 steps


def test_without_a_lightning_logger_traintrace_logs_the_loss(tmp_path: Path) -> None:
    """logger=False: nobody else sends the loss, so traintrace's tracker does."""
    callback = TraintraceCallback(
        job_id="pl",
        log_dir=str(tmp_path / "tt"),
        log_interval=2,
        backends={"log": False, "tensorboard": {"log_dir": str(tmp_path / "tb")}},
    )
    run = trainer(tmp_path, callbacks=[callback], logger=False)
    train, val = loaders()
    run.fit(TinyModule(), train, val)
    tt.close()
    ours = _scalars(tmp_path / "tb")
    assert "loss" in ours and len(ours["loss"]) == 4


@pytest.mark.slow
def test_hf_trainer_report_to_tensorboard_and_traintrace_do_not_overlap(tmp_path: Path) -> None:
    """report_to=['tensorboard']: the Trainer logs loss, learning rate, grad norm; traintrace only traintrace/*."""
    pytest.importorskip("transformers")
    from transformers import Trainer

    from tests.test_integrations_transformers import arguments, dataset, tiny_model
    from traintrace.integrations.transformers import TraintraceTrainerCallback

    tt.configure(
        job_id="hf",
        log_dir=str(tmp_path / "tt"),
        log_interval=2,
        backends={"log": False, "tensorboard": {"log_dir": str(tmp_path / "tb" / "tt")}},
    )
    args = arguments(tmp_path, report_to=["tensorboard"])
    trainer = Trainer(
        model=tiny_model(),
        args=args,
        train_dataset=dataset(24),
        eval_dataset=dataset(8),
        callbacks=[TraintraceTrainerCallback()],
    )
    trainer.train()
    tt.close()
    ours = _scalars(tmp_path / "tb" / "tt")
    theirs = _scalars(tmp_path / "out")  # the Trainer writes under its output_dir
    assert "train/loss" in theirs and "train/learning_rate" in theirs
    assert "traintrace/step_time_ms" in ours
    assert all(tag.startswith("traintrace/") for tag in ours), sorted(ours)
