"""A small PyTorch training run on CPU, instrumented with traintrace.

    python examples/train_cpu.py --log-dir traintrace_logs --job-id demo

Trains a two-layer network on a synthetic regression task for a few epochs
(well under a minute), with a validation pass and a checkpoint each epoch.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traintrace as tt


def make_data(samples: int, features: int, seed: int) -> TensorDataset:
    # One task for both sets (the same true weights); the seed picks the samples.
    true_w = torch.randn(features, 1, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    y = x @ true_w + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def run(args: argparse.Namespace, checkpoint_dir: Path) -> int:
    """The instrumented run; the number of steps it made."""
    torch.manual_seed(0)
    with tt.application(tt.ApplicationMetrics.create(checkpoint_enabled=True, checkpoint_strategy="sync")):
        with tt.data_loader_init():
            train = DataLoader(make_data(2048, 16, 1), batch_size=args.batch_size, shuffle=True)
            val = DataLoader(make_data(256, 16, 2), batch_size=args.batch_size)
        with tt.model_init():
            model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        with tt.optimizer_init():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train))
        loss_fn = nn.MSELoss()
        step = 0
        with tt.training_loop(num_epochs=args.epochs):
            for epoch in range(args.epochs):
                batches = iter(train)
                while True:
                    with tt.data_loading():
                        batch = next(batches, None)
                    if batch is None:
                        break
                    x, y = batch
                    with tt.training_iteration(step) as it:
                        with tt.zero_grad():
                            optimizer.zero_grad()
                        with tt.forward():
                            loss = loss_fn(model(x), y)
                        with tt.backward():
                            loss.backward()
                        with tt.optimizer_step():
                            optimizer.step()
                        it.add_metrics(
                            loss=loss.detach(), batch_size=len(x), epoch=epoch, learning_rate=schedule.get_last_lr()[0]
                        )
                        schedule.step()
                    step += 1
                with tt.validation(current_iteration=step) as v, torch.no_grad():
                    total = sum(loss_fn(model(x), y).item() * len(x) for x, y in val)
                    v.add_metrics(loss=total / len(val.dataset))
                path = checkpoint_dir / f"epoch{epoch}.pt"
                with tt.checkpoint_save(
                    tt.CheckpointSaveMetrics.create(
                        checkpoint_type=tt.CheckPointType.LOCAL,
                        current_iteration=step,
                        checkpoint_directory=str(checkpoint_dir),
                        checkpoint_filename=path.name,
                    )
                ) as save:
                    torch.save(model.state_dict(), path)
                    save.add_metrics(checkpoint_size=path.stat().st_size)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log-dir", default="traintrace_logs")
    parser.add_argument("--job-id", default="demo")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    tt.configure(job_id=args.job_id, log_dir=args.log_dir, log_interval=20)
    # The checkpoints are the demo's own: removed when it ends (the records stay in the log folder).
    with tempfile.TemporaryDirectory(prefix="traintrace-demo-") as scratch:
        step = run(args, Path(scratch))
    tt.close()
    print(f"trained {step} steps; records in {Path(args.log_dir) / args.job_id}")


if __name__ == "__main__":
    main()
