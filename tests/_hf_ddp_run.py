"""Run by test_integrations_transformers under ``traintrace-run --nproc-per-node 2``: a tiny GPT-2 trained by
the Hugging Face Trainer with DDP over gloo on the CPU, the traintrace callback on. With a second argument N,
rank 1 raises while computing its loss at global step N, after writing the truth (``fault.json``: rank,
step, time) without traintrace; with a third argument ``data``, rank 1's dataset raises instead, in the
DataLoader's worker process, on the first sample of the N-th batch it fetches (``data_hang``: that read hangs
until a file ``release`` appears in the output folder). Faults tests/transformers_sweep.py draws too:
``sigkill`` and ``hang`` while computing the loss, ``backward`` (a gradient hook raises inside the backward
pass), ``optimizer`` (the optimizer's step raises), ``save`` (writing the checkpoint of step N raises; a save
every 2 steps). Each rank notes the last step it began (``started<rank>.txt``), also without traintrace.
``DDP_TIMEOUT_S`` (default 20): the collective timeout; ``FAULT_RANK`` (default 1): the faulty rank.
Stragglers: ``slow`` (the faulty rank's loss computation sleeps ``SLOW_MS``, default 60, from step N on) and
``slow_data`` (its dataset sleeps ``SLOW_MS`` on the first sample of each batch from its N-th on, in the
training process); with ``SLOW_EVERY`` K, at every K-th step (batch) from step N on only, each noted
(``slow<rank>.jsonl``); ``fault.json`` is written at the first slow step or batch, and each rank notes when each
step's own code began (``steps<rank>.jsonl``) and its own work in it, outside backward (``work/rank<rank>.jsonl``).
``MAX_STEPS`` (default 8); ``GRAD_ACCUM`` (default 1): batches a step.
``WRITE_DELAY_MS``: each write of the model (process zero's, under DDP) takes that much longer, a slow disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers.trainer
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from traintrace.integrations.transformers import TraintraceTrainerCallback

OUT = Path(sys.argv[1])
FAULT_STEP = int(sys.argv[2]) if len(sys.argv) > 2 else -1
MODE = sys.argv[3] if len(sys.argv) > 3 else ""
IN_DATA = MODE in ("data", "data_hang", "slow_data")
SLOW_S = float(os.environ.get("SLOW_MS", "60")) / 1000
SLOW_EVERY = int(os.environ.get("SLOW_EVERY", "1"))
BATCH = 4
VOCAB, SEQ = 50, 8
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
WRITE_DELAY_S = float(os.environ.get("WRITE_DELAY_MS", "0")) / 1000


def slow_at(step: int) -> bool:
    """A straggler's slow steps (or batches): from FAULT_STEP on, every SLOW_EVERY-th."""
    return step >= FAULT_STEP and (step - FAULT_STEP) % SLOW_EVERY == 0


def note_slow(rank: int, **where: int) -> None:
    """Each slow step or batch and when it began (``slow<rank>.jsonl``), written without traintrace."""
    with (OUT / f"slow{rank}.jsonl").open("a") as notes:
        notes.write(json.dumps({**where, "ts": time.time_ns()}) + "\n")


def note_fault(rank: int, step: int, **more: Any) -> None:
    """The truth of where the fault was injected, written without traintrace."""
    (OUT / "fault.json").write_text(json.dumps({"rank": rank, "step": step, "ts": time.time_ns(), **more}))


class FaultyData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rank 1's loader worker raises on the first sample of its FAULT_STEP-th batch (0-based)."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        fetched, self.fetched = self.fetched, self.fetched + 1
        rank = int(os.environ.get("RANK", "0"))
        if MODE == "slow_data":
            if rank == FAULT_RANK and fetched % BATCH == 0 and slow_at(fetched // BATCH):
                if fetched == FAULT_STEP * BATCH:
                    note_fault(rank, FAULT_STEP, batch=FAULT_STEP, index=index)
                note_slow(rank, batch=fetched // BATCH)
                time.sleep(SLOW_S)
            return self.rows[index]
        if rank == FAULT_RANK and fetched == FAULT_STEP * BATCH:
            (OUT / "fault.json").write_text(
                json.dumps({"rank": rank, "batch": FAULT_STEP, "index": index, "ts": time.time_ns()})
            )
            if MODE == "data_hang":
                # A read that does not return until the test says so (or 300 s).
                deadline = time.monotonic() + 300
                while not (OUT / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            raise ValueError(f"injected corrupt sample {index} on rank {rank}")
        return self.rows[index]


class OwnWork:
    """Each step's own work by the script's own clock (``work/rank<rank>.jsonl``: ``step``, ``compute_ns``): from
    one step's training_step to the next's, less the time in backward (where DDP's all-reduce waits for the slowest
    rank), in fetching batches, in saving checkpoints, in the Trainer's loss gather and in DDP's broadcast of the
    buffers. What is left is the forward pass, the optimizer and the Trainer's own code, what `traintrace ranks`
    calls a step's compute. The last step is not noted (no next step ends it)."""

    def __init__(self) -> None:
        self.began: tuple[int, int] | None = None  # the step and when it began
        self.waited = 0

    def step_began(self, rank: int, step: int) -> None:
        now = time.perf_counter_ns()
        if self.began is not None and self.began[0] == step:
            return  # the step's next batch (gradient accumulation): the step goes on
        if self.began is not None:
            (OUT / "work").mkdir(exist_ok=True)
            with (OUT / "work" / f"rank{rank}.jsonl").open("a") as notes:
                notes.write(json.dumps({"step": self.began[0], "compute_ns": now - self.began[1] - self.waited}) + "\n")
        self.began, self.waited = (step, now), 0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        began = time.perf_counter_ns()
        try:
            yield
        finally:
            self.waited += time.perf_counter_ns() - began

    def timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def waits(*args: Any, **kwargs: Any) -> Any:
            with self.waiting():
                return function(*args, **kwargs)

        return waits


own_work = OwnWork()


class FaultyTrainer(Trainer):
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        (OUT / f"started{self.args.process_index}.txt").write_text(str(self.state.global_step))
        with (OUT / f"steps{self.args.process_index}.jsonl").open("a") as notes:  # when each step's own code began
            notes.write(json.dumps({"step": self.state.global_step, "ts": time.time_ns()}) + "\n")
        own_work.step_began(self.args.process_index, self.state.global_step)
        return super().training_step(*args, **kwargs)

    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        with own_work.waiting():  # fetching the step's batches, the token-count gather among them
            return super().get_batch_samples(*args, **kwargs)

    def _faulty(self, *modes: str) -> bool:
        return self.args.process_index == FAULT_RANK and self.state.global_step == FAULT_STEP and MODE in modes

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        rank, step = self.args.process_index, self.state.global_step
        if MODE == "slow" and rank == FAULT_RANK and slow_at(step) and model.training:
            if step == FAULT_STEP and not (OUT / "fault.json").exists():
                note_fault(rank, step)
            note_slow(rank, step=step)
            time.sleep(SLOW_S)
        if self._faulty("", "sigkill", "hang"):
            note_fault(rank, step)
            if MODE == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "hang":
                time.sleep(3600)
            raise RuntimeError(f"injected failure in compute_loss on rank {rank} at step {step}")
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self._faulty("backward") and isinstance(loss, torch.Tensor):

            def fail(grad: torch.Tensor) -> torch.Tensor:
                note_fault(rank, step)
                raise RuntimeError(f"injected failure in backward on rank {rank} at step {step}")

            loss.register_hook(fail)
        return loss

    def save_model(self, *args: Any, **kwargs: Any) -> Any:
        if WRITE_DELAY_S and self.args.should_save:
            time.sleep(WRITE_DELAY_S)
        return super().save_model(*args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        if self._faulty("save"):
            note_fault(self.args.process_index, self.state.global_step)
            raise OSError(f"injected failure saving the checkpoint of step {self.state.global_step}")
        with own_work.waiting():
            return super()._save_checkpoint(*args, **kwargs)


class FaultySGD(torch.optim.SGD):
    """SGD whose step raises on the faulty rank at FAULT_STEP (``optimizer``)."""

    trainer: FaultyTrainer | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        trainer = self.trainer
        if trainer is not None and trainer._faulty("optimizer"):
            note_fault(trainer.args.process_index, trainer.state.global_step)
            raise RuntimeError(f"injected failure in the optimizer step on rank {trainer.args.process_index}")
        return super().step(closure)


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    if os.environ.get("BUFFERS") == "1":
        # A buffer, as BatchNorm's running statistics or a transformer's position ids: DDP broadcasts the module's
        # buffers from rank 0 before every forward (GPT-2 has none in this transformers).
        model.transformer.register_buffer("position_scale", torch.ones(SEQ))
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=generator) for _ in range(64)]
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in rows]
    arguments = TrainingArguments(
        output_dir=str(OUT / "out"),
        max_steps=int(os.environ.get("MAX_STEPS", "8")),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=int(os.environ.get("GRAD_ACCUM", "1")),
        save_steps=2,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=int(os.environ.get("DDP_TIMEOUT_S", "20")),
        disable_tqdm=True,
        dataloader_num_workers=1 if IN_DATA and MODE != "slow_data" else 0,
        logging_steps=1,
    )
    train = FaultyData(data) if IN_DATA else data
    optimizer = FaultySGD(model.parameters(), lr=0.05)
    trainer = FaultyTrainer(
        model=model,
        args=arguments,
        train_dataset=train,
        callbacks=[TraintraceTrainerCallback()],
        optimizers=(optimizer, None) if MODE == "optimizer" else (None, None),
    )
    optimizer.trainer = trainer
    trainer.accelerator.backward = own_work.timed(trainer.accelerator.backward)  # type: ignore[method-assign]
    transformers.trainer.nested_gather = own_work.timed(transformers.trainer.nested_gather)  # the loss gather
    # DDP's broadcast of the buffers before each forward (BUFFERS), where rank 0 waits for the others.
    torch.distributed._broadcast_coalesced = own_work.timed(torch.distributed._broadcast_coalesced)
    trainer.train()


if __name__ == "__main__":
    main()
