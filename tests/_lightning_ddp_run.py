"""Run by test_integrations_lightning: a 2-process CPU DDP fit with the callback.

Lightning starts rank 1 by running this script again; each rank's callback
configures traintrace with the trainer's rank and world size. With a second
argument N, rank 1 raises in its training step at global step N, after writing
the truth (``fault.json``: rank, step, time) without traintrace; with a third
argument ``data``, rank 1's dataset raises instead, in the DataLoader's worker
process, while it fetches the batch of step N (the truth written there); with
``data_hang`` that read hangs until a file ``release`` appears in the output
folder (or 300 s), then raises; with ``inf``, rank 1's batch at step N is
scaled until its loss overflows (the all-reduce spreads NaN to both ranks),
and every rank writes its losses (``losses<rank>.jsonl``). Faults the Lightning
sweep (tests/lightning_sweep.py) draws too: ``sigkill`` and ``hang`` in the
training step, ``backward`` (a gradient hook raises inside the backward pass),
``optimizer`` (the optimizer's step raises), ``validation`` (the validation
step raises in the pass that follows step N - 1, N a multiple of the steps of an
epoch). A rank that fails writes the exception that
ended it (``ended<rank>.txt``). ``DDP_TIMEOUT_S`` (default 20) is the
collective timeout; ``FAULT_RANK`` (default 1) the faulty rank, ``EPOCHS``
(default 1) the epochs (4 steps each); ``DEVICES`` (default 2) the ranks; ``ACCUMULATE`` (default 1) the batches
whose gradients a step accumulates (an in-step fault then comes in the step's last batch).
Stragglers: ``slow`` (the faulty rank's training step sleeps ``SLOW_MS``, default 60, from step N on)
and ``slow_data`` (its dataset sleeps ``SLOW_MS`` per batch from the batch of step N on, in the
training process: ``num_workers=0``); with ``SLOW_EVERY`` K, at every K-th step (batch) from step N on only, each
noted (``slow<rank>.jsonl``); the truth (``fault.json``) is written at the first slow step, and
every rank notes when each step's own code began (``steps<rank>.jsonl``, ``time.time_ns()``) and how long it
took (``work/rank<rank>.jsonl``).
Checkpoints: with ``SAVE_EVERY`` K, a ``ModelCheckpoint`` saves every K steps, ``SAVE_MB`` (default 80) more in
each checkpoint; global rank 0 alone writes, the others wait at the strategy's barrier. Every rank notes when
its ``Trainer.save_checkpoint`` began and ended (``saves<rank>.jsonl``), when ModelCheckpoint's collective before it
(whether the file exists) began and ended (``exists<rank>.jsonl``), and the writing rank when its write began
and ended (``writes<rank>.jsonl``), without traintrace. ``LATE_EXISTS_MS``: global rank 0's check whether each
checkpoint's file exists, which ModelCheckpoint shares with every rank by a collective, takes that long.
Under torchrun, Lightning starts no process itself.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traintrace as tt
from traintrace.integrations.lightning import TraintraceCallback

OUT = Path(sys.argv[1])
FAULT_STEP = int(sys.argv[2]) if len(sys.argv) > 2 else -1
MODE = sys.argv[3] if len(sys.argv) > 3 else ""
IN_DATA = MODE in ("data", "data_hang", "slow_data")
SLOW_S = float(os.environ.get("SLOW_MS", "60")) / 1000
SLOW_EVERY = int(os.environ.get("SLOW_EVERY", "1"))
BATCH = 8
TIMEOUT_S = float(os.environ.get("DDP_TIMEOUT_S", "20"))
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
EPOCHS = int(os.environ.get("EPOCHS", "1"))
DEVICES = int(os.environ.get("DEVICES", "2"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "0"))
SAVE_MB = float(os.environ.get("SAVE_MB", "80"))
# Rank 0's check whether a checkpoint's file exists (ModelCheckpoint's, before each save, shared with every rank by
# a collective) takes this many milliseconds: a slow shared file system, or rank 0 late to the save.
LATE_EXISTS_MS = float(os.environ.get("LATE_EXISTS_MS", "0"))
# A BatchNorm layer: buffers, which DDP broadcasts from rank 0 before every forward (rank 0 waits there).
BATCH_NORM = os.environ.get("BATCH_NORM") == "1"
# Gradients accumulated over this many batches a step (each batch an iteration of the same global step): an
# in-step fault comes in the step's last batch.
ACCUMULATE = int(os.environ.get("ACCUMULATE", "1"))
#: Modes that fail inside the training step's own code.
IN_STEP = ("", "sigkill", "hang")


def slow_at(step: int) -> bool:
    """A straggler's slow steps (or batches): from FAULT_STEP on, every SLOW_EVERY-th."""
    return step >= FAULT_STEP and (step - FAULT_STEP) % SLOW_EVERY == 0


def note_slow(rank: int, **where: int) -> None:
    """Each slow step or batch and when it began (``slow<rank>.jsonl``), written without traintrace."""
    with (OUT / f"slow{rank}.jsonl").open("a") as notes:
        notes.write(json.dumps({**where, "ts": time.time_ns()}) + "\n")


def note_fault(rank: int, step: int, **more: object) -> None:
    """The truth of where the fault was injected, written without traintrace."""
    truth = {"rank": rank, "step": step, "mode": MODE, "ts": time.time_ns(), **more}
    (OUT / "fault.json").write_text(json.dumps(truth))


class FaultySGD(torch.optim.SGD):
    """SGD whose step raises on the faulty rank at FAULT_STEP (``optimizer``)."""

    def __init__(self, params: object, rank: int, module: L.LightningModule) -> None:
        super().__init__(params, lr=0.05)  # type: ignore[arg-type]
        self.rank, self.module = rank, module

    def step(self, closure: object = None) -> object:  # type: ignore[override]
        loss = super().step(closure)  # type: ignore[arg-type]  # Lightning's closure runs forward and backward
        if MODE == "optimizer" and self.rank == FAULT_RANK and self.module.global_step == FAULT_STEP:
            note_fault(self.rank, self.module.global_step)
            raise RuntimeError(f"injected failure in the optimizer step on rank {self.rank}")
        return loss


def note_interval(name: str, rank: int, t0: int, t1: int) -> None:
    """A checkpoint's call or write, begun at ``t0`` and ended at ``t1`` (``time.time_ns()``), without traintrace."""
    with (OUT / f"{name}{rank}.jsonl").open("a") as notes:
        notes.write(json.dumps({"t0": t0, "t1": t1}) + "\n")


class NotedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose every save is noted on every rank (the write on rank 0, the barrier after it)."""

    def file_exists(self, filepath: object, trainer: L.Trainer) -> bool:  # type: ignore[override]
        t0 = time.time_ns()
        if LATE_EXISTS_MS and trainer.is_global_zero:
            time.sleep(LATE_EXISTS_MS / 1000)
        exists = super().file_exists(filepath, trainer)  # type: ignore[arg-type]
        note_interval("exists", trainer.global_rank, t0, time.time_ns())  # ModelCheckpoint's collective, every rank
        return exists

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        t0 = time.time_ns()
        super()._save_checkpoint(trainer, filepath)
        note_interval("saves", trainer.global_rank, t0, time.time_ns())


class NotedIO(TorchCheckpointIO):
    """The checkpoint write, noted (only the writing rank calls it)."""

    def save_checkpoint(self, checkpoint: dict[str, object], path: object, storage_options: object = None) -> None:
        t0 = time.time_ns()
        super().save_checkpoint(checkpoint, path, storage_options)  # type: ignore[arg-type]
        note_interval("writes", int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))), t0, time.time_ns())


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        normed = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
        self.net = normed if BATCH_NORM else nn.Linear(8, 1)
        # Written into every checkpoint, not a buffer: DDP would broadcast a buffer from rank 0 at every forward.
        self.pad = torch.ones(int(SAVE_MB * 2**20 / 4)) if SAVE_EVERY else None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        began = time.perf_counter_ns()
        x, y = batch
        (OUT / f"started{self.global_rank}.txt").write_text(str(self.global_step))  # the last step begun
        with (OUT / f"steps{self.global_rank}.jsonl").open("a") as notes:  # when each step's own code began
            notes.write(json.dumps({"step": self.global_step, "ts": time.time_ns()}) + "\n")
        faulty = self.global_rank == FAULT_RANK and self.global_step == FAULT_STEP
        if faulty and MODE in IN_STEP and (batch_idx + 1) % ACCUMULATE == 0:
            note_fault(self.global_rank, self.global_step)
            if MODE == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "hang":
                time.sleep(3600)
            raise RuntimeError(
                f"injected failure in training_step on rank {self.global_rank} at step {self.global_step}"
            )
        if MODE == "slow" and self.global_rank == FAULT_RANK and slow_at(self.global_step):
            if self.global_step == FAULT_STEP:
                note_fault(self.global_rank, self.global_step)
            note_slow(self.global_rank, step=self.global_step)
            time.sleep(SLOW_S)
        if faulty and MODE == "inf":
            x, y = x * 1e30, y * 1e30  # a corrupt batch: the loss overflows float32
        loss = nn.functional.mse_loss(self.net(x), y)
        if faulty and MODE == "backward":
            step, rank = self.global_step, self.global_rank

            def fail(grad: torch.Tensor) -> torch.Tensor:
                note_fault(rank, step)
                raise RuntimeError(f"injected failure in backward on rank {rank} at step {step}")

            loss.register_hook(fail)
        with (OUT / f"losses{self.global_rank}.jsonl").open("a") as notes:
            notes.write(json.dumps({"step": self.global_step, "loss": float(loss.detach())}) + "\n")
        self.log("train_loss", loss)
        # Its own work by its own clock (``work/rank<rank>.jsonl``): the training step's code, the forward pass
        # (DDP's broadcast of the buffers comes before it, backward after).
        (OUT / "work").mkdir(exist_ok=True)
        with (OUT / "work" / f"rank{self.global_rank}.jsonl").open("a") as notes:
            notes.write(json.dumps({"step": self.global_step, "compute_ns": time.perf_counter_ns() - began}) + "\n")
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        if MODE == "validation" and self.global_rank == FAULT_RANK and self.global_step == FAULT_STEP:
            note_fault(self.global_rank, self.global_step)
            raise ValueError(f"injected failure in validation_step on rank {self.global_rank}")
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, object]) -> None:
        if self.pad is not None:
            checkpoint["pad"] = self.pad

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return FaultySGD(self.parameters(), self.global_rank, self)


class MeetFirst(L.pytorch.strategies.DDPStrategy):
    """DDP whose ranks all reach the process group's creation before it is created (a file each in the output
    folder): the short collective timeout (``DDP_TIMEOUT_S``) also bounds how long rank 0 waits there for the
    others, and on a loaded machine rank 1, a new process importing Lightning, came too late (``Timed out after 11
    seconds waiting for clients. 1/2 clients joined``)."""

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        (OUT / f"meet{self.global_rank}").touch()
        deadline = time.monotonic() + 180
        while len(list(OUT.glob("meet*"))) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        super().setup_distributed()


class FaultyData(TensorDataset):
    """On rank 1, the first sample of the batch for step FAULT_STEP raises (in the loader's worker process,
    which fetches this rank's samples in order, whichever sampler Lightning gave the loader)."""

    def __init__(self, data: TensorDataset, rank: int) -> None:
        super().__init__(*data.tensors)
        self.rank = rank
        self.fetched = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        fetched, self.fetched = self.fetched, self.fetched + 1
        if MODE == "slow_data":
            if self.rank == FAULT_RANK and fetched % BATCH == 0 and slow_at(fetched // BATCH):
                if fetched == FAULT_STEP * BATCH:
                    note_fault(self.rank, FAULT_STEP, index=index)
                note_slow(self.rank, batch=fetched // BATCH)
                time.sleep(SLOW_S)
            return super().__getitem__(index)
        if self.rank == FAULT_RANK and fetched == FAULT_STEP * BATCH:
            note_fault(self.rank, FAULT_STEP, index=index)
            if MODE == "data_hang":
                # A read that does not return (a stalled network file system, say), until the test says so.
                deadline = time.monotonic() + 300
                while not (OUT / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise ValueError(f"released the read of sample {index} on rank {self.rank}")
            raise ValueError(f"injected corrupt sample {index} on rank {self.rank}")
        return super().__getitem__(index)


def main() -> None:
    out = OUT
    generator = torch.Generator().manual_seed(0)
    samples = 32 * DEVICES  # 4 batches a rank and epoch
    data = TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 1, generator=generator))
    train = DataLoader(data, batch_size=BATCH)
    if IN_DATA:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        train = DataLoader(FaultyData(data, rank), batch_size=BATCH, num_workers=0 if MODE == "slow_data" else 1)
    callback = TraintraceCallback(tt.Config(job_id="ddp-test", log_dir=str(out / "logs")), backends={"log": False})
    callbacks: list[L.Callback] = [callback]
    if SAVE_EVERY:
        callbacks.append(NotedCheckpoint(dirpath=out / "ck", every_n_train_steps=SAVE_EVERY, save_top_k=-1))
    trainer = L.Trainer(
        # A short collective timeout: the rank left waiting for a failed one gives up soon.
        strategy=MeetFirst(timeout=datetime.timedelta(seconds=TIMEOUT_S)),
        accelerator="cpu",
        devices=DEVICES,
        max_epochs=EPOCHS,
        callbacks=callbacks,
        plugins=[NotedIO()] if SAVE_EVERY else None,
        default_root_dir=str(out),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        accumulate_grad_batches=ACCUMULATE,
    )
    trainer.fit(Tiny(), train, DataLoader(data, batch_size=16))
    if trainer.global_rank == 0:
        (out / "global_step.txt").write_text(str(trainer.global_step))
    tt.close()


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:
        # The truth of how the rank ended (the exception that left the fit), written without traintrace.
        rank = os.environ.get("LOCAL_RANK", "0")
        (OUT / f"ended{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
