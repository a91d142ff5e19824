"""The Lightning callback on real Lightning runs: tiny models, CPU, a few steps."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traintrace as tt
from tests._fault_runs import answers, check_checkpoint_save, check_straggler, run
from traintrace.integrations.lightning import TraintraceCallback
from traintrace.reader import read_file

HERE = Path(__file__).parent


class TinyModule(L.LightningModule):
    """A linear regression that logs loss and a made-up accuracy, and can fail on demand."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("boom in training_step")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log("train_acc", (loss < 1.0).float())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class CapturingLogger(Logger):
    """A Lightning logger that keeps what Lightning hands to loggers."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), dict(metrics)))


def loaders(samples: int = 64, batch_size: int = 16) -> tuple[DataLoader[Any], DataLoader[Any]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=generator)
    y = torch.randn(samples, 1, generator=generator)
    data = TensorDataset(x, y)
    return DataLoader(data, batch_size=batch_size), DataLoader(data, batch_size=32)


@pytest.fixture
def memory() -> Iterator[tt.MemoryBackend]:
    backend = tt.MemoryBackend()
    tt.configure(backends=[], extra_backends=[backend])
    yield backend
    tt.close()


def trainer(tmp_path: Path, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "max_epochs": 2,
        "default_root_dir": str(tmp_path),
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
    }
    options.update(kwargs)
    return L.Trainer(**options)


def by_id(spans: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {s["id"]: s for s in spans}


class EpochsSeen(L.Callback):
    """Lightning's own epoch at each training batch: the truth for the iteration spans' ``epoch``."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.epochs.append(trainer.current_epoch)


def test_fit_records_nested_spans_steps_and_logged_metrics(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """A fit with validation and a checkpoint: spans nest, counts and metrics match Lightning's."""
    logger = CapturingLogger()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    seen = EpochsSeen()
    run = trainer(tmp_path, callbacks=[TraintraceCallback(), checkpoint, seen], logger=logger)
    train, val = loaders()
    run.fit(TinyModule(), train, val)
    tt.flush()

    spans = memory.spans()
    ids = by_id(spans)
    (app,) = memory.spans(tt.SpanName.APPLICATION)
    (loop,) = memory.spans(tt.SpanName.TRAINING_LOOP)
    assert app["parent"] == 0 and loop["parent"] == app["id"]
    assert app["attrs"]["stage"] == "fit" and app["attrs"]["world_size"] == 1

    iterations = memory.spans(tt.SpanName.ITERATION)
    assert len(iterations) == run.global_step == 8
    assert [s["attrs"]["step"] for s in iterations] == list(range(8))
    # The epoch is read once an epoch (on_train_epoch_start), and is still each batch's own.
    assert [s["attrs"]["epoch"] for s in iterations] == seen.epochs == [0] * 4 + [1] * 4
    for span in iterations:
        assert span["parent"] == loop["id"]
        assert span["attrs"]["batch_size"] == 16
        assert span["status"] == "ok"
    for name in (tt.SpanName.FORWARD, tt.SpanName.BACKWARD, tt.SpanName.OPTIMIZER_STEP):
        phases = memory.spans(name)
        assert len(phases) == 8, name
        for phase in phases:
            parent = ids[phase["parent"]]
            assert parent["name"] == tt.SpanName.ITERATION
            assert parent["ts"] <= phase["ts"] and phase["dur"] <= parent["dur"]
    waits = memory.spans(tt.SpanName.DATA_LOADING)
    assert waits and all(w["parent"] == loop["id"] for w in waits)

    # What Lightning gave its loggers, step by step, equals what the iteration spans carry.
    logged_train = [m for _, m in logger.rows if "train_loss" in m]
    assert len(logged_train) == 8
    assert [s["attrs"]["train_loss"] for s in iterations] == pytest.approx([m["train_loss"] for m in logged_train])
    assert [s["attrs"]["train_acc"] for s in iterations] == pytest.approx([m["train_acc"] for m in logged_train])
    assert [s["attrs"]["loss"] for s in iterations] == pytest.approx([m["train_loss"] for m in logged_train])

    validations = [s for s in memory.spans(tt.SpanName.VALIDATION) if not s["attrs"].get("sanity_check")]
    logged_val = [m["val_loss"] for _, m in logger.rows if "val_loss" in m]
    assert len(validations) == 2 == len(logged_val)
    assert [v["attrs"]["val_loss"] for v in validations] == pytest.approx(logged_val)
    assert all(v["parent"] == loop["id"] and v["attrs"]["batches"] == 2 for v in validations)

    saves = memory.spans(tt.SpanName.CHECKPOINT_SAVE_SYNC)
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(saves) == len(files) == 2
    for save in saves:
        path = Path(save["attrs"]["checkpoint_path"])
        assert path in files
        assert save["attrs"]["checkpoint_size"] == path.stat().st_size
        assert save["parent"] == loop["id"]
    assert memory.errors() == []


def test_exception_in_training_step_is_recorded_once(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """A failing training_step: one error record at the forward span; enclosing spans end as errors."""
    run = trainer(tmp_path, callbacks=[TraintraceCallback()], logger=False, enable_checkpointing=False)
    train, val = loaders()
    with pytest.raises(RuntimeError, match="boom"), tt.span("user_main"):
        run.fit(TinyModule(fail_at=2), train, val)
    tt.flush()

    errors = memory.errors()
    assert len(errors) == 1
    error = errors[0]
    assert error["error_type"] == "RuntimeError" and "boom" in error["message"]
    ids = by_id(memory.spans())
    failed_at = ids[error["span"]]
    assert failed_at["name"] == tt.SpanName.FORWARD
    iteration = ids[failed_at["parent"]]
    assert iteration["name"] == tt.SpanName.ITERATION and iteration["attrs"]["step"] == 2
    assert iteration["status"] == "error"
    (stage,) = memory.spans("lightning_fit")  # a user span was open, so no second application span
    assert stage["status"] == "error"
    assert ids[stage["parent"]]["name"] == "user_main"
    assert [s["status"] for s in memory.spans(tt.SpanName.TRAINING_LOOP)] == ["error"]
    assert len([s for s in memory.spans(tt.SpanName.ITERATION) if s["status"] == "ok"]) == 2


class _InterruptedModule(TinyModule):
    """Ctrl-C at step 2: a real SIGINT to this process, whose default handler raises KeyboardInterrupt in it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # (the interrupt comes first)
        return super().training_step(batch, batch_idx)


def test_ctrl_c_in_a_training_step_is_recorded_as_sigint(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """Lightning catches KeyboardInterrupt, calls on_exception and exits (SystemExit): one ``signal`` record says
    SIGINT at the forward span of step 2 where it came, no error record, the spans end ``terminated``. Nothing
    recorded the interrupt before (`errors` read the job as failed, cause unclear)."""
    run = trainer(tmp_path, callbacks=[TraintraceCallback()], logger=False, enable_checkpointing=False)
    train, val = loaders()
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            run.fit(_InterruptedModule(), train, val)
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores SIGINT while it shuts down
    tt.flush()
    assert memory.errors() == []
    (interrupt,) = memory.events("signal")
    assert interrupt["attrs"] == {"signal": "SIGINT", "exception": "KeyboardInterrupt"}
    at = by_id(memory.spans())[interrupt["span"]]
    assert at["name"] == tt.SpanName.FORWARD and at["status"] == "terminated", at
    iteration = by_id(memory.spans())[at["parent"]]
    assert iteration["attrs"]["step"] == 2 and iteration["status"] == "terminated", iteration


class _ListeningMemory(tt.MemoryBackend):
    """A memory backend that also listens on the caller's thread (as NVTX does): phases become live spans."""

    def span_started(self, span: Any) -> None:
        pass

    def span_stopped(self, span: Any) -> None:
        pass


class _BadSample(TensorDataset):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index == 40:  # the first sample of the batch of step 2 (batches of 16)
            raise ValueError("corrupt sample 40")
        return super().__getitem__(index)


@pytest.mark.parametrize("live", [False, True], ids=["timed", "live"])
def test_exception_while_fetching_a_batch_is_recorded_at_data_loading(tmp_path: Path, live: bool) -> None:
    """A dataset that raises while Lightning fetches the batch of step 2: the error is recorded at a failed
    data_loading span under the training loop, whether phases are timed between hooks or live spans."""
    backend = _ListeningMemory() if live else tt.MemoryBackend()
    tt.configure(backends=[], extra_backends=[backend])
    try:
        run = trainer(tmp_path, callbacks=[TraintraceCallback()], logger=False, enable_checkpointing=False)
        train, val = loaders()
        bad = DataLoader(_BadSample(*train.dataset.tensors), batch_size=16)  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="corrupt sample 40"):
            run.fit(TinyModule(), bad, val)
        tt.flush()
        (error,) = backend.errors()
        ids = by_id(backend.spans())
        failed_at = ids[error["span"]]
        assert failed_at["name"] == tt.SpanName.DATA_LOADING and failed_at["status"] == "error"
        assert ids[failed_at["parent"]]["name"] == tt.SpanName.TRAINING_LOOP
        steps = [s["attrs"]["step"] for s in backend.spans(tt.SpanName.ITERATION)]
        assert steps == [0, 1]  # the step whose batch failed never began
        assert all(s["status"] == "ok" for s in backend.spans(tt.SpanName.DATA_LOADING) if s["id"] != failed_at["id"])
    finally:
        tt.close()


def test_async_checkpoint_records_blocking_and_background_parts_and_load(
    memory: tt.MemoryBackend, tmp_path: Path
) -> None:
    """AsyncCheckpointIO: an async span per save, a linked finalisation span per write; resume loads."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    run = trainer(
        tmp_path,
        max_epochs=1,
        callbacks=[TraintraceCallback(), checkpoint],
        logger=False,
        plugins=[AsyncCheckpointIO()],
    )
    train, val = loaders()
    run.fit(TinyModule(), train, val)
    tt.flush()
    saves = memory.spans(tt.SpanName.CHECKPOINT_SAVE_ASYNC)
    finals = memory.spans(tt.SpanName.CHECKPOINT_SAVE_FINALIZATION)
    assert len(saves) == len(finals) == 1
    assert finals[0]["link"] == saves[0]["id"]
    assert finals[0]["tid"] != saves[0]["tid"]
    path = Path(saves[0]["attrs"]["checkpoint_path"])
    assert finals[0]["attrs"]["checkpoint_size"] == path.stat().st_size > 0
    assert memory.spans(tt.SpanName.CHECKPOINT_SAVE_SYNC) == []

    resumed = trainer(
        tmp_path, max_epochs=2, callbacks=[TraintraceCallback()], logger=False, enable_checkpointing=False
    )
    resumed.fit(TinyModule(), train, val, ckpt_path=str(path))
    tt.flush()
    (load,) = memory.spans(tt.SpanName.CHECKPOINT_LOAD)
    assert load["attrs"]["checkpoint_path"] == str(path)
    assert load["attrs"]["checkpoint_size"] == path.stat().st_size
    restored = memory.events("checkpoint_restored")
    assert restored and restored[0]["attrs"]["global_step"] == 4
    assert resumed.global_step == 8
    assert [s["attrs"]["step"] for s in memory.spans(tt.SpanName.ITERATION)] == list(range(8))


def test_test_loop_records_metrics_equal_to_trainer_test(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """trainer.test(): a test_loop span with the metrics trainer.test returns."""
    run = trainer(tmp_path, callbacks=[TraintraceCallback()], logger=False, enable_checkpointing=False)
    _, val = loaders()
    (result,) = run.test(TinyModule(), val)
    tt.flush()
    (span,) = memory.spans(tt.SpanName.TEST)
    assert span["attrs"]["test_loss"] == pytest.approx(result["test_loss"])
    assert span["attrs"]["batches"] == 2
    (stage,) = memory.spans(tt.SpanName.APPLICATION)
    assert span["parent"] == stage["id"] and stage["attrs"]["stage"] == "test"


def test_callback_configures_and_is_quiet_on_disabled_ranks(tmp_path: Path) -> None:
    """Configured by the callback from its settings; a rank the config disables writes nothing."""
    tt.close()
    callback = TraintraceCallback(
        log_dir=str(tmp_path / "logs"), job_id="quiet", backends={"file": {"ranks": "1"}, "log": False}
    )
    callback = pickle.loads(pickle.dumps(callback))
    run = trainer(tmp_path, max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False)
    train, val = loaders()
    run.fit(TinyModule(), train, val)
    tt.close()
    assert run.global_step == 4
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("*.jsonl"))


def test_callback_survives_pickling_after_a_run(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """After a fit the callback still pickles (ddp_spawn and checkpoints need that), and records again."""
    callback = TraintraceCallback(flops_per_step="measure")
    run = trainer(tmp_path, max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False)
    train, val = loaders()
    run.fit(TinyModule(), train, val)
    copy = pickle.loads(pickle.dumps(callback))
    assert isinstance(copy, TraintraceCallback) and copy.flops_per_step == "measure"
    tt.flush()
    iterations = memory.spans(tt.SpanName.ITERATION)
    flops = {s["attrs"]["flops"] for s in iterations}
    assert len(flops) == 1 and flops.pop() > 0


def test_phase_timings_as_attributes(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """phase_spans=False: no phase or wait spans; their durations are attributes of each iteration."""
    callback = TraintraceCallback(phase_spans=False)
    run = trainer(tmp_path, max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False)
    train, val = loaders()
    run.fit(TinyModule(), train, val)
    tt.flush()
    for name in (
        tt.SpanName.FORWARD,
        tt.SpanName.BACKWARD,
        tt.SpanName.OPTIMIZER_STEP,
        tt.SpanName.DATA_LOADING,
    ):
        assert memory.spans(name) == []
    iterations = memory.spans(tt.SpanName.ITERATION)
    assert len(iterations) == 4
    for span in iterations:
        attrs = span["attrs"]
        assert 0 < attrs["forward_ns"] + attrs["backward_ns"] + attrs["optimizer_ns"] <= span["dur"]
        assert attrs["data_loading_ns"] > 0


def test_lightning_calls_only_the_hooks_the_verbosity_needs(tmp_path: Path) -> None:
    """At `tracing` Lightning never calls the phase hooks (None on the instance); a later fit at
    `profiling` gets them back; forward ends where backward begins."""
    callback = TraintraceCallback()
    phase_hooks = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")
    train, val = loaders()
    tracing = tt.MemoryBackend(verbosity=tt.Verbosity.TRACING)
    tt.configure(backends=[], extra_backends=[tracing], statistics=False)  # statistics need the phases
    try:
        run = trainer(tmp_path, max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False)
        run.fit(TinyModule(), train, val)
        assert all(getattr(callback, hook) is None for hook in phase_hooks)
        assert callback.on_before_zero_grad is None  # type: ignore[comparison-overlap]
        assert callable(callback.on_train_batch_start)
    finally:
        tt.close()
    assert len(tracing.spans(tt.SpanName.ITERATION)) == 4
    assert tracing.spans(tt.SpanName.FORWARD) == tracing.spans(tt.SpanName.BACKWARD) == []

    profiling = tt.MemoryBackend()
    tt.configure(backends=[], extra_backends=[profiling])
    try:
        run = trainer(tmp_path, max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False)
        run.fit(TinyModule(), train, val)
        # Under automatic optimisation backward ends where the optimizer step begins: no on_after_backward.
        assert callable(callback.on_before_backward) and callable(callback.on_before_optimizer_step)
        assert callback.on_after_backward is None  # type: ignore[comparison-overlap]
    finally:
        tt.close()
    forwards = profiling.spans(tt.SpanName.FORWARD)
    backwards = profiling.spans(tt.SpanName.BACKWARD)
    optimizer_steps = profiling.spans(tt.SpanName.OPTIMIZER_STEP)
    assert len(forwards) == len(backwards) == len(optimizer_steps) == 4
    for forward, backward, step in zip(forwards, backwards, optimizer_steps, strict=True):
        assert forward["parent"] == backward["parent"] == step["parent"]
        assert forward["ts"] + forward["dur"] <= backward["ts"]
        assert backward["ts"] + backward["dur"] <= step["ts"]


class ManualModule(TinyModule):
    """Manual optimisation: the step's own code runs between backward and the optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.between: list[tuple[int, int]] = []  # (after backward, before the step), time_ns

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        after_backward = time.time_ns()
        time.sleep(0.02)  # the user's work between backward and the step (clipping, logging, ...)
        self.between.append((after_backward, time.time_ns()))
        optimizer.step()  # type: ignore[union-attr]
        return loss


def test_lightning_manual_optimisation_ends_backward_where_backward_ends(tmp_path: Path) -> None:
    """With manual optimisation the callback keeps on_after_backward: the user's code between
    ``manual_backward`` and ``optimizer.step()`` is in no phase (its own clock says where it ran)."""
    callback = TraintraceCallback()
    profiling = tt.MemoryBackend()
    tt.configure(backends=[], extra_backends=[profiling])
    module = ManualModule()
    try:
        run = trainer(tmp_path, max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False)
        train, _ = loaders()
        run.fit(module, train)
        assert callable(callback.on_after_backward)
    finally:
        tt.close()
    backwards = profiling.spans(tt.SpanName.BACKWARD)
    optimizer_steps = profiling.spans(tt.SpanName.OPTIMIZER_STEP)
    assert len(backwards) == len(optimizer_steps) == len(module.between) == 4
    for backward, step, (after_backward, before_step) in zip(backwards, optimizer_steps, module.between, strict=True):
        # The records' times are the wall clock (through the stream's anchor): a few ms of slack, 20 ms apart.
        assert backward["ts"] + backward["dur"] <= after_backward + 5_000_000
        assert step["ts"] >= before_step - 5_000_000


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_two_cpu_processes_each_rank_writes_its_stream(tmp_path: Path) -> None:
    """strategy='ddp' with 2 CPU processes: one stream per rank, identity from the trainer, steps equal."""
    done = run([sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = int((tmp_path / "global_step.txt").read_text())
    files = sorted((tmp_path / "logs" / "ddp-test").glob("rank*.jsonl"))
    assert [f.name for f in files] == ["rank0.jsonl", "rank1.jsonl"]
    for rank, file in enumerate(files):
        (stream,) = read_file(file).streams
        assert stream.header["rank"] == rank and stream.header["world_size"] == 2
        assert stream.closed_cleanly
        spans = stream.spans()
        names = [s["name"] for s in spans]
        assert names.count(tt.SpanName.ITERATION) == steps
        assert names.count(tt.SpanName.TRAINING_LOOP) == 1
        assert all(s["status"] == "ok" for s in spans)
        app = next(s for s in spans if s["name"] == tt.SpanName.APPLICATION)
        # The script's strategy: DDPStrategy whose ranks meet before the process group forms (its class's name).
        assert app["attrs"]["rank"] == rank and app["attrs"]["strategy"] == "MeetFirst"
        saves = names.count(tt.SpanName.CHECKPOINT_SAVE_SYNC)
        assert saves == (1 if rank == 0 else 0)  # only global rank 0 writes


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
@pytest.mark.parametrize("accumulate", [1, 2], ids=["a batch a step", "gradients accumulated over 2 batches"])
def test_ddp_fault_is_diagnosed_from_the_callbacks_records(tmp_path: Path, accumulate: int) -> None:
    """Rank 1 of a 2-process CPU DDP fit raises in its training step at global step 3; Lightning ends the run.
    `traintrace errors` on what the callback wrote names rank 1, that step and the forward phase, as the
    script's own truth file (written without traintrace) says. With gradients accumulated over two batches, each
    an iteration of the same step, the fault is in the step's second batch: the first one of the step completed,
    and the step is still 3 (it read 4, the step after the last completed iteration's)."""
    import json

    env = {"ACCUMULATE": str(accumulate), "EPOCHS": str(accumulate)}  # 4 batches an epoch
    done = run([sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "3"], tmp_path, **env)
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    truth = json.loads((tmp_path / "fault.json").read_text())
    errors, summary = answers(tmp_path / "logs" / "ddp-test")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (truth["rank"], truth["step"], "model_forward")
    assert "injected failure in training_step" in culprit["cause"]
    assert errors["verdict"].startswith(f"rank 1 raised RuntimeError in forward at step {truth['step']}; rank 0 ")
    assert errors["first_error"]["ts"] >= truth["ts"]
    # Lightning saves a checkpoint at an epoch's end: the iterations (batches) of the epochs before the failing
    # one's completed, the failing epoch's were lost.
    started = (truth["step"] + 1) * accumulate
    saved = started // 4 * 4 if started % 4 else started - 4
    assert summary["status"] == "failed" and summary["steps_completed"] == saved
    assert summary["steps_lost"] == started - saved


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_a_rank_killed_in_forward_after_ddps_buffer_broadcast_died_in_forward(tmp_path: Path) -> None:
    """A model with a BatchNorm layer, under torchrun: DDP broadcasts its buffers from rank 0 before every forward,
    a collective the callback records inside the forward it times without a span. Rank 1 is SIGKILLed in its
    training step at step 2, after that broadcast; torchrun leaves no record of how it ended, and its stream none
    of its last steps: the progress file alone says where it was. `errors` names rank 1, step 2 and forward, as
    the script's truth says (it read "in a step (between phases)" before: the broadcast's end put the file back
    in the iteration)."""
    import json

    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    done = run(
        [*command, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "2", "sigkill"],
        tmp_path,
        BATCH_NORM="1",
        DDP_TIMEOUT_S="10",
    )
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    truth = json.loads((tmp_path / "fault.json").read_text())
    assert (truth["rank"], truth["step"]) == (1, 2), truth  # the premise
    errors, _ = answers(tmp_path / "logs" / "ddp-test")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, 2, "model_forward"), errors["verdict"]
    assert errors["verdict"].startswith("rank 1 ") and "in forward at step 2" in errors["verdict"], errors["verdict"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_loss_that_overflows_on_one_rank_is_diagnosed_as_diverged(tmp_path: Path) -> None:
    """Rank 1's batch at step 2 overflows its loss; DDP's all-reduce puts NaN in both ranks' weights and the fit
    runs to its end. From the callback's records, `errors` says the job diverged on rank 1 at step 2 and that
    rank 0 followed a step later, as the ranks' own notes of their losses (written without traintrace) say."""
    import json
    import math

    done = run([sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "2", "inf"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = {}
    for rank in (0, 1):
        notes = [json.loads(line) for line in (tmp_path / f"losses{rank}.jsonl").read_text().splitlines()]
        first[rank] = min(n["step"] for n in notes if not math.isfinite(n["loss"]))
    assert first == {0: 3, 1: 2}, first
    errors, summary = answers(tmp_path / "logs" / "ddp-test")
    assert errors["status"] == summary["status"] == "diverged", errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"]) == (1, first[1]), errors["verdict"]
    assert culprit["non_finite"]["first_steps"] == {"0": first[0], "1": first[1]}
    assert errors["verdict"].startswith(f"diverged: rank 1's loss became Infinity at step {first[1]}")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
@pytest.mark.parametrize(
    ("mode", "every", "save_every", "batch_norm", "late_exists_ms", "live"),
    [
        ("slow", "1", "0", "0", "0", "0"),
        ("slow_data", "1", "0", "0", "0", "0"),
        ("slow", "2", "0", "0", "0", "0"),
        ("slow_data", "2", "2", "0", "0", "0"),
        ("slow_data", "2", "2:60", "0", "40", "0"),
        ("slow_data", "2", "2", "0", "40", "1"),
        ("slow", "1", "0", "1", "0", "0"),
        ("slow_data", "1", "0", "1", "0", "0"),
    ],
    ids=[
        "slow",
        "slow_data",
        "slow-2",
        "slow_data-2-saves",
        "slow_data-2-saves-rank-0-late",
        "slow_data-2-saves-rank-0-late-live",
        "slow-buffers",
        "slow_data-buffers",
    ],
)
def test_ddp_straggler_is_named_though_ddp_evens_the_step_times(
    tmp_path: Path, *, mode: str, every: str, save_every: str, batch_norm: str, late_exists_ms: str, live: str
) -> None:
    """Rank 1 of a 2-process DDP fit is 60 ms slower from step 6 on: in its training step (``slow``) or fetching
    its batches (``slow_data``). DDP's all-reduce makes rank 0 wait in backward, so both ranks' steps take as
    long (the scripts' own notes); the callbacks record no collective. `traintrace ranks` names rank 1, the part
    and the step it became slow at, as the script's notes say (it named rank 0, slow in compute, before). Slow at
    every other step only: named too, with those steps (it read ``no stragglers`` before). Slow fetching every
    other batch while a ModelCheckpoint saves every 2 steps: each slow batch is fetched after a save, which the
    callback timed nowhere before (``no stragglers``). A model with a BatchNorm layer, whose buffers DDP broadcasts
    from rank 0 before each forward: rank 0 waits there for rank 1, not in backward; the callback records that
    broadcast as a collective (it named rank 0 too before, slow in compute). With saves, rank 0 late by 40 ms to
    ModelCheckpoint's collective before each save (its file-exists check on a slow file system): rank 1 waits
    there; that stretch was recorded as a wait for a batch on both ranks, and fed the next step's only on rank 1,
    which has no save record of its own: its onset read step 2, the first save's (as a loaded CI machine made it
    once), not step 6. The same with the NVTX backend on (``live``: a listener, so the callback opens its spans as
    they begin): the wait, open since the batch's end, ended there as a wait for a batch and read step 2 every
    time; it now ends ``interrupted``. Without the NVTX backend those saves are of 60 MB (``save_every`` "2:60"),
    not 20: on CI's slow disk 20 MB took 0.3 s a save, and the stalls, weighed against a training time with the
    saves in it, read under a tenth of it and ``no stragglers``; 60 MB here does the same (0.38 s a save)."""
    save_every, _, save_mb = save_every.partition(":")
    script = [sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "6", mode]
    done = run(
        script,
        tmp_path,
        EPOCHS="4",
        SLOW_EVERY=every,
        SAVE_EVERY=save_every,
        SAVE_MB=save_mb or "20",
        BATCH_NORM=batch_norm,
        LATE_EXISTS_MS=late_exists_ms,
        **({"TRAINTRACE_BACKENDS_NVTX_ENABLED": "1"} if live == "1" else {}),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if live == "1":  # the premise: the waits were live spans, and those a save cut short say so
        records = (tmp_path / "logs" / "ddp-test" / "rank1.jsonl").read_text()
        assert '"status":"interrupted"' in records, records[-2000:]
    # Lightning broadcasts rank 0's SIGTERM flag before fetching each batch, where every rank waits for rank 0:
    # recorded inside each wait for a batch, as a collective (a loaded machine once read rank 1's waits there, after
    # rank 0's saves, as its own slow fetching from step 2 or 3).
    for rank in (0, 1):
        stream = read_file(tmp_path / "logs" / "ddp-test" / f"rank{rank}.jsonl").streams[0]
        waits = {w["id"] for w in stream.spans(tt.SpanName.DATA_LOADING)}
        broadcasts = [c for c in stream.spans(tt.SpanName.COLLECTIVE) if c["attrs"].get("tensors") == "sigterm"]
        assert len(broadcasts) >= 16 and all(c["parent"] in waits for c in broadcasts), broadcasts[:3]
    data = check_straggler(tmp_path, tmp_path / "logs" / "ddp-test", mode, ranks=2)
    assert any("outside backward" in note for note in data["notes"]), data["notes"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
@pytest.mark.parametrize(
    ("epochs", "every", "saves"), [(3, 3, 4), (1, 2, 2)], ids=["12 steps, a save every 3", "4 steps, a save every 2"]
)
def test_the_rank_that_waits_at_the_barrier_for_rank_0s_save_spends_it_in_checkpoint_save(
    tmp_path: Path, epochs: int, every: int, saves: int
) -> None:
    """A 2-process DDP fit whose ModelCheckpoint saves 80 MB every few steps: rank 0 writes (about 0.14 s a save)
    while rank 1 waits for it at the strategy's barrier, between its steps and outside every span the callback
    records. The job lost the saves' time on both ranks: `summary`'s checkpoint save, the mean over the ranks, is
    what the script's own notes give (rank 0's writes, and rank 1's time in its own `save_checkpoint` call while
    rank 0 wrote). It read half of it before, rank 1's share in `other`; in a job of four steps (too few for the
    ranks' usual step), it missed the wait at the save after the last step."""
    import json

    script = [sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path)]
    done = run(script, tmp_path, SAVE_EVERY=str(every), EPOCHS=str(epochs))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    noted = [json.loads(line) for line in (tmp_path / "saves1.jsonl").read_text().splitlines()]
    writes = [json.loads(line) for line in (tmp_path / "writes0.jsonl").read_text().splitlines()]
    assert len(noted) == len(writes) == saves
    for save, write in zip(noted, writes, strict=True):  # the premise: rank 1 was held for most of each write
        assert min(save["t1"], write["t1"]) - max(save["t0"], write["t0"]) > 0.8 * (write["t1"] - write["t0"])
    _, summary = answers(tmp_path / "logs" / "ddp-test")
    check_checkpoint_save(tmp_path, summary, ranks=2)
    read = summary["breakdown_s"]["checkpoint_save"]
    assert summary["phases_s"]["checkpoint_save_exposed_s"] == read


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_data_loading_fault_is_diagnosed_as_data_loading(tmp_path: Path) -> None:
    """Rank 1's dataset raises in its DataLoader worker process while it fetches the batch of step 3 (a corrupt
    sample); Lightning re-raises it in the training process between two steps. `traintrace errors` names
    rank 1, step 3 and data loading (it said "the training loop (between steps)" before the callback recorded
    the broken wait), against the script's own truth: the worker's note of the sample, and the last step each
    rank began (files written without traintrace)."""
    import json

    done = run([sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "3", "data"], tmp_path)
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    truth = json.loads((tmp_path / "fault.json").read_text())
    assert int((tmp_path / "started1.txt").read_text()) == truth["step"] - 1  # step 3 never began on rank 1
    errors, _ = answers(tmp_path / "logs" / "ddp-test")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, truth["step"], tt.SpanName.DATA_LOADING)
    # The cause is the dataset's own exception, not the loader's "Caught ValueError in DataLoader worker process 0."
    assert (
        culprit["cause"]
        == f"raised ValueError: injected corrupt sample {truth['index']} on rank 1 (in DataLoader worker process 0)"
    )
    assert errors["verdict"].startswith(f"rank 1 raised ValueError in data loading at step {truth['step']}")
    assert errors["first_error"]["ts"] >= truth["ts"]
    # The broken wait is a data_loading span that failed, not one that ended well.
    (stream,) = read_file(tmp_path / "logs" / "ddp-test" / "rank1.jsonl").streams
    waits = [s for s in stream.spans() if s["name"] == tt.SpanName.DATA_LOADING]
    assert waits and waits[-1]["status"] == tt.SpanStatus.ERROR
    assert all(w["status"] == tt.SpanStatus.OK for w in waits[:-1])


def _hang_truth(folder: Path) -> dict[str, Any]:
    """The script's own notes (written without traintrace): where rank 1's read hung, the last step each began."""
    import json

    truth = json.loads((folder / "fault.json").read_text())
    truth["began"] = {rank: int((folder / f"started{rank}.txt").read_text()) for rank in (0, 1)}
    return truth


def _a_rank_hung_for(tmp_path: Path, seconds: float, *, ddp_timeout_s: int) -> tuple[Any, list[int]]:
    """A 2-rank fit whose rank 1 hangs in its training step at step 2, ``seconds`` after it did (by the script's
    note of the fault): the launching process and the pids of it and the ranks (killed if this fails)."""
    from tests._fault_runs import start
    from traintrace.progress import read_progress

    logs = tmp_path / "logs" / "ddp-test"
    script = [sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "2", "hang"]
    launcher = start(script, tmp_path, DDP_TIMEOUT_S=str(ddp_timeout_s))
    pids = [launcher.pid]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "fault.json").exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(seconds)
        progress = [read_progress(logs / f"rank{rank}.progress") for rank in (0, 1)]
        pids += [p.pid for p in progress if p is not None]
        assert launcher.poll() is None, (tmp_path / "output.txt").read_text()[-3000:]
    except BaseException:
        _kill_all(pids, launcher)
        raise
    return launcher, pids


def _kill_all(pids: list[int], launcher: Any) -> None:
    """SIGKILL to each process (the ranks, which Lightning started as children of the first), then reap the
    launching one."""
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(timeout=30)


def _check_data_hang(errors: dict[str, Any], truth: dict[str, Any], state: str | None) -> None:
    # Rank 1 never began the step whose batch it was reading; rank 0 began it and waited in DDP's all-reduce
    # (in backward) until gloo gave up.
    assert truth["began"] == {0: truth["step"], 1: truth["step"] - 1}, truth
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, truth["step"], tt.SpanName.DATA_LOADING)
    if state is not None:
        assert culprit["state"] == state, culprit
    assert errors["rule"] == "hang: the rank the collectives timed out on"
    assert errors["verdict"].startswith(
        f"rank 1 hung in data loading at step {truth['step']}, not in a collective; rank 0 was in backward at step"
    ), errors["verdict"]
    (rank0,) = [r for r in errors["rank_states"] if r["rank"] == 0]
    assert rank0["consequence"] is not None and "timed out" in rank0["consequence"]["message"].lower()


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_data_loading_hang_is_diagnosed_while_the_rank_still_hangs(tmp_path: Path) -> None:
    """Rank 1's DataLoader worker hangs reading the batch of step 3 (no exception); rank 0 waits in the
    all-reduce until gloo times out and Lightning ends it, leaving rank 1 hanging. `traintrace errors`, run
    then, names rank 1, step 3 and data loading: the callback times the wait without a span, so only the
    progress file says where rank 1 is (the monitor's later records in its stream say nothing of that)."""
    import os
    import signal

    from tests._fault_runs import start
    from traintrace.progress import read_progress

    script = [sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "3", "data_hang"]
    code = start(script, tmp_path, DDP_TIMEOUT_S="15").wait(timeout=240)
    # rank 0 (Lightning's launching process) has failed; rank 1 still waits for its loader.
    assert code != 0, (tmp_path / "output.txt").read_text()[-3000:]
    logs = tmp_path / "logs" / "ddp-test"
    progress = read_progress(logs / "rank1.progress")
    assert progress is not None
    try:
        assert progress.state == "running", progress
        errors, _ = answers(logs)
        _check_data_hang(errors, _hang_truth(tmp_path), "running")
        assert "progress file" in errors["culprit"]["source"]
    finally:
        (tmp_path / "release").write_text("")  # the read raises now, and rank 1 ends
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (read_progress(logs / "rank1.progress") or progress).state == "running":
            time.sleep(0.2)
        try:
            os.kill(progress.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_hang_in_a_training_step_is_named_while_the_others_wait_in_backward(tmp_path: Path) -> None:
    """Rank 1 hangs in its training step at step 2 (no exception, no report: hang detection waits 10 minutes, the
    collectives 120 s); rank 0 waits in DDP's all-reduce inside backward, which the callback records no collective
    span for. Read 4 s later, the job runs and `errors` says it waits on rank 1, in forward at step 2, for as long
    as the script's own clock says (it said "running: 2 ranks still writing" before: two ranks outside a recorded
    collective at different places matched no rule)."""
    import json

    logs = tmp_path / "logs" / "ddp-test"
    launcher, pids = _a_rank_hung_for(tmp_path, 4.0, ddp_timeout_s=120)
    try:
        looked = time.time_ns()
        errors, _ = answers(logs)
        answered = time.time_ns()
    finally:
        _kill_all(pids, launcher)
    truth = json.loads((tmp_path / "fault.json").read_text())
    assert (truth["rank"], truth["step"]) == (1, 2)
    culprit = errors["culprit"]
    assert (errors["status"], errors["rule"]) == ("running", "waiting on a rank"), errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, 2, tt.SpanName.FORWARD), errors["verdict"]
    assert errors["verdict"].startswith("running, waiting on rank 1: in forward at step 2, not in a collective, for ")
    assert errors["verdict"].endswith(" s; rank 0 was in backward at step 2"), errors["verdict"]
    # Still since the fault, by the script's clock: the progress files are stamped every flush interval (1 s).
    low, high = (looked - truth["ts"]) / 1e9 - 1.5, (answered - truth["ts"]) / 1e9
    assert low <= culprit["stuck_ns"] / 1e9 <= high, (culprit["stuck_ns"], low, high)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_a_hang_that_the_schedulers_sigterm_ends_is_timed_to_the_signal(tmp_path: Path) -> None:
    """Rank 1 hangs in its training step at step 2; rank 0 waits in DDP's all-reduce inside backward; 2 s later
    the scheduler sends SIGTERM to both. Lightning's own handler, installed over traintrace's, broadcasts to the
    other rank before it calls the one it found: rank 1's broadcast and rank 0's all-reduce wait for each other
    until the collectives' 10 s timeout. traintrace's handler goes over Lightning's and records the signal as it
    comes: rank 1 hung for 2 s, by the script's clock, when the job was terminated; the signals recorded only
    after the timeout read it as 12 s before."""
    import json
    import os
    import signal

    logs = tmp_path / "logs" / "ddp-test"
    launcher, pids = _a_rank_hung_for(tmp_path, 2.0, ddp_timeout_s=10)
    try:
        signalled = time.time_ns()
        for pid in pids[1:]:
            os.kill(pid, signal.SIGTERM)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            _kill_all(pids, launcher)
    truth = json.loads((tmp_path / "fault.json").read_text())
    errors, _ = answers(logs)
    culprit = errors["culprit"]
    assert errors["rule"] == "terminated while waiting for a rank", errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, 2, tt.SpanName.FORWARD), errors["verdict"]
    low, high = (signalled - truth["ts"]) / 1e9 - 0.5, (signalled - truth["ts"]) / 1e9 + 0.5
    assert low <= culprit["stuck_ns"] / 1e9 <= high, (culprit["stuck_ns"], low, high, errors["verdict"])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_data_loading_hang_seen_by_hang_detection(tmp_path: Path) -> None:
    """The same hang with traintrace's hang detection firing first (3 s here; 10 minutes by default, before
    gloo's 30-minute timeout): both ranks report a hang and neither is in a recorded collective. The reports
    carry the progress file's phase, so rank 1 is in data loading and rank 0 in backward of the same step, and
    the rank still loading its batch is the one behind. (Before, the reports said only "between phases" and
    "between steps", and rank 0 was named.)"""

    from tests._fault_runs import start
    from traintrace.progress import read_progress

    logs = tmp_path / "logs" / "ddp-test"
    script = [sys.executable, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "3", "data_hang"]
    launcher = start(script, tmp_path, DDP_TIMEOUT_S="120", TRAINTRACE_HANG_TIMEOUT="3")
    pids = [launcher.pid]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            progress = [read_progress(logs / f"rank{rank}.progress") for rank in (0, 1)]
            pids = [launcher.pid, *(p.pid for p in progress if p is not None)]
            reports = [f for f in logs.glob("rank*.jsonl") if b'"hang_suspected"' in f.read_bytes()]
            if len(reports) == 2:
                break
            time.sleep(0.5)
        assert launcher.poll() is None, (tmp_path / "output.txt").read_text()[-3000:]
        errors, _ = answers(logs)
    finally:
        (tmp_path / "release").write_text("")
        _kill_all(pids, launcher)
    truth = _hang_truth(tmp_path)
    assert truth["began"] == {0: truth["step"], 1: truth["step"] - 1}, truth
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, truth["step"], tt.SpanName.DATA_LOADING)
    assert errors["rule"] == "hang: the rank behind"
    assert errors["verdict"] == (
        f"running, without progress: rank 1 hung in data loading at step {truth['step']}, not in a collective; "
        f"rank 0 was in backward at step {truth['step']}"
    ), errors["verdict"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_data_loading_hang_under_torchrun(tmp_path: Path) -> None:
    """The same hang under torchrun: when rank 0's all-reduce times out, torchrun stops rank 1 with SIGTERM,
    which kills its loader worker (PyTorch then reports `DataLoader worker ... is killed by signal: Terminated`)
    and makes Lightning's SIGTERM handler fail to reach rank 0. Neither is something rank 1 raised: it is named
    as the rank the others waited for, hung in data loading, then terminated."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    done = run(
        [*command, str(HERE / "_lightning_ddp_run.py"), str(tmp_path), "3", "data_hang"], tmp_path, DDP_TIMEOUT_S="15"
    )
    (tmp_path / "release").write_text("")
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    errors, _ = answers(tmp_path / "logs" / "ddp-test")
    # How rank 1 ends is a race. torchrun's SIGTERM kills its loader worker (PyTorch then raises "killed by
    # signal: Terminated"), or Lightning's SIGTERM handler first fails to reach rank 0 and that error ends the
    # fit: a rank terminated when its stack shows the handler, else one failed by a consequence (the exception
    # then comes without its stack). Either way it is the rank that hung, said first.
    _check_data_hang(errors, _hang_truth(tmp_path), None)
    ended = (tmp_path / "ended1.txt").read_text()  # the exception that ended rank 1, by the script
    culprit = errors["culprit"]
    if "killed by signal: Terminated" in ended:
        assert culprit["state"] == "terminated", culprit
    else:
        # Lightning's handler failed to reach rank 0, or found the loader worker gone (the same SIGTERM ended it).
        gone = "exited unexpectedly" in ended
        assert "Connection closed by peer" in ended or gone, ended
        assert culprit["state"] in ("terminated", "error"), culprit
    # How it ended follows the hang in its cause: the signal, or the teardown's error.
    if culprit["state"] == "terminated":
        assert culprit["cause"].endswith("; then terminated by SIGTERM"), culprit["cause"]
    else:
        said = "DataLoader worker" if "exited unexpectedly" in ended else "Connection closed by peer"
        assert f"; then failed as a consequence: RuntimeError: {said}" in culprit["cause"], culprit["cause"]
    # The worker's death by SIGTERM is not the root cause the first-error section shows.
    assert "killed by signal" not in (errors["first_error"]["message"] or "")
    assert all(g["consequence"] for g in errors["groups"]), errors["groups"]


def test_the_progress_file_says_each_timed_phase(tmp_path: Path) -> None:
    """The callback times data loading, forward, backward and the optimizer step between hooks, without spans
    (no listener asks for live ones); the progress file must still say which one the rank is in, for a rank
    that hangs or dies there. Read from inside each phase: the dataset's fetch, the module's forward, a
    gradient hook during backward, the optimizer's step; and after the epoch's last fetch, the training loop."""
    from traintrace.progress import read_progress

    logs = tmp_path / "logs"
    seen: list[tuple[str, str | None]] = []

    def phase(where: str) -> None:
        progress = read_progress(logs / "progress-test" / "rank0.progress")
        seen.append((where, progress.phase if progress else None))

    class Reading(TensorDataset):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
            phase("fetch")
            return super().__getitem__(index)

    class Module(TinyModule):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            phase("forward")
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self(x)
            out.register_hook(lambda grad: phase("backward"))
            return nn.functional.mse_loss(out, y)

        def on_train_epoch_end(self) -> None:
            phase("epoch end")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            optimizer.register_step_post_hook(lambda *args: phase("optimizer step"))  # the closure ran first
            return optimizer

    generator = torch.Generator().manual_seed(0)
    data = Reading(torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator))
    callback = TraintraceCallback(tt.Config(job_id="progress-test", log_dir=str(logs)), backends={"log": False})
    try:
        trainer(tmp_path, max_epochs=1, callbacks=[callback], logger=False).fit(
            Module(), DataLoader(data, batch_size=8)
        )
    finally:
        tt.close()
    expected = {
        "fetch": tt.SpanName.DATA_LOADING,
        "forward": tt.SpanName.FORWARD,
        "backward": tt.SpanName.BACKWARD,
        "optimizer step": tt.SpanName.OPTIMIZER_STEP,
        "epoch end": tt.SpanName.TRAINING_LOOP,
    }
    assert {where for where, _ in seen} == set(expected)
    assert [(where, p) for where, p in seen if p != expected[where]] == []
    assert len([where for where, _ in seen if where == "forward"]) == 4  # the 4 steps


def _fit_records(tmp_path: Path, native_hooks: bool) -> tuple[list[dict[str, Any]], Any]:
    """A seeded fit's records (times, ids and sequence numbers left out, parents by name), and the callback."""
    torch.manual_seed(0)
    callback = TraintraceCallback(flops_per_step=1.0e6)
    callback._native_hooks = native_hooks
    backend = tt.MemoryBackend()
    tt.configure(backends=[], extra_backends=[backend], statistics=False)
    try:
        train, val = loaders()
        run = trainer(tmp_path, callbacks=[callback], logger=CapturingLogger(), log_every_n_steps=3)
        run.fit(TinyModule(), train, val)
    finally:
        tt.close()
    # Spans merged from start and end where the writer saw them open (a matter of thread timing), in order of start.
    records = sorted(backend.spans() + backend.events(), key=lambda r: (r["ts"], r["name"]))
    names = {r["id"]: r["name"] for r in records if "id" in r}
    kept = []
    for record in records:
        attrs = {
            k: v.replace(str(tmp_path), "<root>") if isinstance(v, str) else v
            for k, v in (record.get("attrs") or {}).items()
            if not k.endswith(("_s", "_ns", "time"))
        }
        kept.append(
            {
                "kind": record["kind"],
                "name": record["name"],
                "parent": names.get(record.get("parent")),
                "status": record.get("status"),
                "attrs": attrs,
            }
        )
    return kept, callback


def test_the_native_step_hooks_record_what_the_python_hooks_record(tmp_path: Path) -> None:
    """Under the native core the four per-step hooks are C (``_span.StepHooks``); the same seeded fit records the
    same spans and attributes with them as with the Python hooks, steps whose logged metrics are read (every
    3rd, which the C hooks leave to Python) and validation passes included."""
    from traintrace._recorder import CORE

    # Folders whose names have one length: the checkpoints hold them.
    with_c, callback = _fit_records(tmp_path / "native", native_hooks=True)
    hook_types = {type(callback.on_train_batch_start), type(callback.on_train_batch_end)}
    in_python, callback = _fit_records(tmp_path / "python", native_hooks=False)
    assert {type(callback.on_train_batch_start), type(callback.on_train_batch_end)} == {type(callback.setup)}
    if CORE == "native":
        assert hook_types == {type(len)}  # builtin methods: the C twins
    else:
        assert hook_types == {type(callback.setup)}
    assert len([r for r in with_c if r["name"] == tt.SpanName.ITERATION]) == 8
    assert with_c == in_python
