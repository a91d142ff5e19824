"""A torchrun worker for tests/test_progress_jobs.py: gloo on CPU, with a fault at a known place.

Each rank writes its own truth to ``$TT_TRUTH/truth<rank>.txt``, outside
traintrace: one line ``<step> <phase>`` as the first thing inside each phase, ``<step> done``
after each step. The iteration's metrics hold a tensor (held back by traintrace
until its next ``log_interval``).

``TT_MODE``: ``kill`` / ``segv`` (rank ``TT_VICTIM`` sends itself SIGKILL / SIGSEGV
in phase ``TT_PHASE`` of step ``TT_STEP``); ``pause`` (that rank writes
``$TT_TRUTH/paused`` with its pid and sleeps there, for a SIGTERM from the
test); ``run`` (every rank steps slowly until ``$TT_TRUTH/stop`` exists).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import traintrace as tt


def main() -> None:
    mode = os.environ.get("TT_MODE", "run")
    victim = int(os.environ.get("TT_VICTIM", "1"))
    fault_step = int(os.environ.get("TT_STEP", "5"))
    fault_phase = os.environ.get("TT_PHASE", tt.SpanName.BACKWARD)
    truth_dir = Path(os.environ["TT_TRUTH"])
    tt.configure(log_interval=1000)
    with tt.application():
        with tt.distributed_init():
            dist.init_process_group("gloo")
        rank = dist.get_rank()
        truth = os.open(truth_dir / f"truth{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

        def enter(step: int, phase: str) -> None:
            os.write(truth, f"{step} {phase}\n".encode())
            if rank == victim and step == fault_step and phase == fault_phase:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "segv":
                    os.kill(os.getpid(), signal.SIGSEGV)
                if mode == "pause":
                    (truth_dir / "paused.tmp").write_text(str(os.getpid()))
                    (truth_dir / "paused.tmp").rename(truth_dir / "paused")
                    time.sleep(60)

        weights = torch.zeros(8)
        step = 0
        with tt.training_loop():
            while mode != "run" or not (truth_dir / "stop").exists():
                with tt.training_iteration(step) as it:
                    enter(step, tt.SpanName.ITERATION)
                    with tt.data_loading():
                        enter(step, tt.SpanName.DATA_LOADING)
                        batch = torch.ones(8) * (rank + 1)
                    with tt.forward():
                        enter(step, tt.SpanName.FORWARD)
                        loss = (weights * batch).sum()
                    with tt.backward():
                        enter(step, tt.SpanName.BACKWARD)
                        grad = batch.clone()
                    with tt.span(tt.SpanName.COLLECTIVE):
                        enter(step, tt.SpanName.COLLECTIVE)
                        dist.all_reduce(grad)
                    with tt.optimizer_step():
                        enter(step, tt.SpanName.OPTIMIZER_STEP)
                        weights -= 0.01 * grad
                    it.add_metrics(loss=loss)  # a tensor: the record waits for log_interval
                os.write(truth, f"{step} done\n".encode())
                step += 1
                if mode == "run":
                    time.sleep(0.05)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
