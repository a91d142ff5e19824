"""Plain PyTorch DDP, instrumented with traintrace's context API.

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --log-dir traintrace_logs --job-id ddp-demo

Runs on CPU with the gloo backend (no GPU needed). Each rank writes its own
stream, ``<log-dir>/<job>/rank<N>.jsonl``: traintrace reads the rank, world
size and job id that torchrun puts in the environment. Rank 0 saves a
checkpoint at the end of each epoch; every rank records a validation pass
whose loss is averaged over ranks.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import traintrace as tt
from traintrace.integrations.ddp import record_collectives


def make_data(samples: int, seed: int) -> TensorDataset:
    # One task for both sets (the same true weights); the seed picks the samples.
    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    y = x @ true_w + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-dir", default="traintrace_logs")
    parser.add_argument("--job-id", default=None, help="default: torchrun's run id")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    settings = {"log_dir": args.log_dir, "log_interval": 10}
    if args.job_id:
        settings["job_id"] = args.job_id
    tt.configure(**settings)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoints = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="traintrace-ddp-"))
    checkpoints.mkdir(parents=True, exist_ok=True)

    with tt.application(tt.ApplicationMetrics.create(rank=rank, world_size=world_size, checkpoint_strategy="sync")):
        with tt.distributed_init(backend="gloo"):
            dist.init_process_group("gloo")
        with tt.data_loader_init():
            train_data = make_data(1024, seed=1)
            sampler = DistributedSampler(train_data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            train = DataLoader(train_data, batch_size=args.batch_size, sampler=sampler)
            val = DataLoader(make_data(128, seed=2), batch_size=64)
        with tt.model_init():
            torch.manual_seed(0)
            model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
            record_collectives(model)  # each gradient all-reduce becomes a `collective` span
        with tt.optimizer_init():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
        loss_fn = nn.MSELoss()
        step = 0
        with tt.training_loop(num_epochs=args.epochs, total_iterations=args.epochs * len(train)):
            for epoch in range(args.epochs):
                sampler.set_epoch(epoch)
                batches = iter(train)
                while True:
                    with tt.data_loading():
                        batch = next(batches, None)
                    if batch is None:
                        break
                    x, y = batch
                    with tt.training_iteration(step, {"batch_size": len(x), "epoch": epoch}) as it:
                        with tt.forward():
                            loss = loss_fn(model(x), y)
                        with tt.backward():
                            optimizer.zero_grad(set_to_none=True)
                            loss.backward()  # gradients are all-reduced across ranks here
                        with tt.optimizer_step():
                            optimizer.step()
                        it.add_metrics(loss=loss.detach())
                    step += 1
                with tt.validation(current_iteration=step, epoch=epoch) as v, torch.no_grad():
                    total = torch.zeros(2)
                    for x, y in val:
                        total += torch.tensor([loss_fn(model(x), y).item() * len(x), len(x)])
                    with tt.collective(op="all_reduce"):
                        dist.all_reduce(total)
                    v.add_metrics(loss=(total[0] / total[1]).item())
                if rank == 0:
                    path = checkpoints / f"epoch{epoch}.pt"
                    with tt.checkpoint_save(
                        tt.CheckpointSaveMetrics.create(
                            checkpoint_type=tt.CheckPointType.GLOBAL,
                            current_iteration=step,
                            checkpoint_directory=str(checkpoints),
                            checkpoint_filename=path.name,
                        )
                    ) as save:
                        torch.save(model.module.state_dict(), path)
                        save.add_metrics(checkpoint_size=path.stat().st_size)
                with tt.collective(op="barrier"):
                    dist.barrier()
        dist.destroy_process_group()
    tt.close()
    if rank == 0:
        print(f"rank 0 of {world_size}: trained {step} steps; checkpoints in {checkpoints}")


if __name__ == "__main__":
    main()
