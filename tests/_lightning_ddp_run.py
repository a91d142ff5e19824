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
and every rank writes its losses (``losses<rank>.jsonl``). A rank that fails writes the exception that
ended it (``ended<rank>.txt``). ``DDP_TIMEOUT_S`` (default 20) is the
collective timeout. Run under torchrun, Lightning starts no process itself.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traintrace as tt
from traintrace.integrations.lightning import TraintraceCallback

OUT = Path(sys.argv[1])
FAULT_STEP = int(sys.argv[2]) if len(sys.argv) > 2 else -1
MODE = sys.argv[3] if len(sys.argv) > 3 else ""
IN_DATA = MODE in ("data", "data_hang")
BATCH = 8
TIMEOUT_S = float(os.environ.get("DDP_TIMEOUT_S", "20"))


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        (OUT / f"started{self.global_rank}.txt").write_text(str(self.global_step))  # the last step begun
        if self.global_rank == 1 and self.global_step == FAULT_STEP and not IN_DATA and MODE != "inf":
            truth = {"rank": self.global_rank, "step": self.global_step, "ts": time.time_ns()}
            (OUT / "fault.json").write_text(json.dumps(truth))
            raise RuntimeError(f"injected failure in training_step on rank 1 at step {self.global_step}")
        if self.global_rank == 1 and self.global_step == FAULT_STEP and MODE == "inf":
            x, y = x * 1e30, y * 1e30  # a corrupt batch: the loss overflows float32
        loss = nn.functional.mse_loss(self.net(x), y)
        with (OUT / f"losses{self.global_rank}.jsonl").open("a") as notes:
            notes.write(json.dumps({"step": self.global_step, "loss": float(loss.detach())}) + "\n")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class FaultyData(TensorDataset):
    """On rank 1, the first sample of the batch for step FAULT_STEP raises (in the loader's worker process,
    which fetches this rank's samples in order, whichever sampler Lightning gave the loader)."""

    def __init__(self, data: TensorDataset, rank: int) -> None:
        super().__init__(*data.tensors)
        self.rank = rank
        self.fetched = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        fetched, self.fetched = self.fetched, self.fetched + 1
        if self.rank == 1 and fetched == FAULT_STEP * BATCH:
            truth = {"rank": self.rank, "step": FAULT_STEP, "index": index, "ts": time.time_ns()}
            (OUT / "fault.json").write_text(json.dumps(truth))
            if MODE == "data_hang":
                # A read that does not return (a stalled network file system, say), until the test says so.
                deadline = time.monotonic() + 300
                while not (OUT / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise ValueError(f"released the read of sample {index} on rank 1")
            raise ValueError(f"injected corrupt sample {index} on rank 1")
        return super().__getitem__(index)


def main() -> None:
    out = OUT
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
    train = DataLoader(data, batch_size=BATCH)
    if IN_DATA:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        train = DataLoader(FaultyData(data, rank), batch_size=BATCH, num_workers=1)
    callback = TraintraceCallback(tt.Config(job_id="ddp-test", log_dir=str(out / "logs")), backends={"log": False})
    trainer = L.Trainer(
        # A short collective timeout: the rank left waiting for a failed one gives up soon.
        strategy=L.pytorch.strategies.DDPStrategy(timeout=datetime.timedelta(seconds=TIMEOUT_S)),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[callback],
        default_root_dir=str(out),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
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
