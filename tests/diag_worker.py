"""One rank of a small DDP job (gloo, CPU) with a fault injected, for tests/test_diagnosis.py.

    traintrace-run --standalone --nproc-per-node 3 tests/diag_worker.py TRUTH_DIR \
        --fault backward --fault-rank 1 --fault-step 7

The worker uses traintrace as a user would (the context API, the DDP hook) and
writes its own truth beside it, without traintrace: ``TRUTH_DIR/rank<N>.jsonl``,
one JSON line per step start and end, checkpoint start and end, and fault, with
``time.time_ns()`` timestamps. The test computes goodput and the culprit from
those lines and compares them with what ``traintrace`` says.

Faults (``--fault``): ``data``, ``forward``, ``backward``, ``optimizer``, ``iteration`` (between phases),
``checkpoint`` (an exception there); ``sigkill``, ``sigsegv`` (a real null
pointer read), ``sigterm`` (waits in forward for the test to send SIGTERM);
``kill_in_checkpoint``; ``hang_compute`` (sleeps in forward); ``hang_collective``
(an all-reduce its partner never joins); ``slow_compute`` and ``slow_data``
(from ``--fault-step`` on); ``none``.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import traintrace as tt
from traintrace.integrations.ddp import record_collectives


class Truth:
    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.handle = (folder / f"rank{rank}.jsonl").open("a", buffering=1)

    def write(self, **fields: Any) -> None:
        self.handle.write(json.dumps({"ts": time.time_ns(), **fields}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=7)
    parser.add_argument("--slow-ms", type=float, default=40.0)
    parser.add_argument("--gloo-timeout", type=float, default=6.0)
    # Seconds a rank stays alive after an exception left main (and traintrace recorded it), before
    # exiting: a process slow to tear down on a loaded machine.
    parser.add_argument("--linger", type=float, default=0.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    truth = Truth(Path(args.truth), rank)
    truth.write(event="process_start")
    # Registered before traintrace's own: runs after it (exit handlers run last-in first-out).
    atexit.register(truth.write, event="exit")

    def on_sigterm(signum: int, frame: object) -> None:
        truth.write(event="sigterm")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)  # a user's own handler: traintrace records, then calls it
    tt.configure(hang_timeout=1.5, hang_check_interval=0.25, flush_interval=0.1, log_interval=5)
    if args.linger:
        recorded = sys.excepthook

        def linger(*exc_info: Any) -> None:
            recorded(*exc_info)
            time.sleep(args.linger)

        sys.excepthook = linger
    mine = rank == args.fault_rank
    fault = args.fault if mine else "none"
    fault_step = args.fault_step
    checkpoints = Path(tempfile.mkdtemp(prefix="tt-diag-"))

    def injected(where: str, step: int) -> None:
        if fault == where and step == fault_step:
            truth.write(event="fault", kind=where, step=step)
            raise RuntimeError(f"injected failure in {where} on rank {rank} at step {step}")

    with tt.application():
        with tt.distributed_init(backend="gloo"):
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.gloo_timeout))
            partner = dist.new_group([args.fault_rank, (args.fault_rank + 1) % world])
        with tt.model_init():
            torch.manual_seed(0)
            model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
            record_collectives(model)
        with tt.optimizer_init():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        with tt.training_loop():
            for step in range(args.steps):
                with tt.data_loading():
                    injected("data", step)
                    x = torch.randn(4, 8, generator=generator)
                    y = x.sum(dim=1, keepdim=True)
                    if fault == "slow_data" and step >= fault_step:
                        time.sleep(args.slow_ms / 1e3)
                truth.write(event="step_start", step=step)
                with tt.training_iteration(step, {"batch_size": len(x)}) as it:
                    with tt.forward():
                        injected("forward", step)
                        time.sleep(args.step_ms / 1e3)
                        if fault == "slow_compute" and step >= fault_step:
                            time.sleep(args.slow_ms / 1e3)
                        if step == fault_step and fault in ("sigkill", "sigsegv", "sigterm", "hang_compute"):
                            truth.write(event="fault", kind=fault, step=step)
                            if fault == "sigkill":
                                os.kill(os.getpid(), signal.SIGKILL)
                            elif fault == "sigsegv":
                                ctypes.string_at(0)
                            elif fault == "sigterm":
                                (Path(args.truth) / "sigterm.pid").write_text(str(os.getpid()))
                                time.sleep(120)
                            else:
                                time.sleep(3600)
                        loss = nn.functional.mse_loss(model(x), y)
                    with tt.backward():
                        injected("backward", step)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                    with tt.optimizer_step():
                        injected("optimizer", step)
                        optimizer.step()
                    injected("iteration", step)  # inside the step, between its phases
                    if fault == "hang_collective" and step == fault_step:
                        truth.write(event="fault", kind=fault, step=step)
                        with tt.collective(op="all_reduce", group="pair"):
                            dist.all_reduce(torch.ones(1), group=partner)
                    it.add_metrics(loss=loss.detach())
                truth.write(event="step_end", step=step)
                if rank == 0 and (step + 1) % args.checkpoint_every == 0:
                    truth.write(event="checkpoint_start", step=step + 1)
                    with tt.checkpoint_save(current_iteration=step + 1):
                        if fault == "checkpoint" and step + 1 == fault_step:
                            truth.write(event="fault", kind="checkpoint", step=step + 1)
                            raise OSError(f"injected failure in checkpoint on rank {rank} at step {step + 1}")
                        if fault == "kill_in_checkpoint" and step + 1 == fault_step:
                            truth.write(event="fault", kind=fault, step=step + 1)
                            time.sleep(0.05)
                            os.kill(os.getpid(), signal.SIGKILL)
                        torch.save(model.module.state_dict(), checkpoints / f"step{step + 1}.pt")
                    truth.write(event="checkpoint_end", step=step + 1)
        dist.barrier()
        dist.destroy_process_group()
    tt.close()
    truth.write(event="process_end")


if __name__ == "__main__":
    main()
