"""A tiny torchrun worker for tests/test_launch.py: gloo all-reduce steps on CPU.

``TT_MODE`` picks the behaviour: ``clean``; ``raise`` (rank 1 raises at step
3); ``restart`` (rank 1 raises at step 3 in the first attempt only, and every
attempt resumes from the step in ``TT_CKPT``); ``kill`` (rank 1 flushes after
step 2, then SIGKILLs itself at step 3).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import traintrace as tt
from traintrace import events


def main() -> None:
    mode = os.environ.get("TT_MODE", "clean")
    steps = int(os.environ.get("TT_STEPS", "6"))
    checkpoint = Path(os.environ["TT_CKPT"]) if os.environ.get("TT_CKPT") else None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tt.configure(log_interval=1)
    with tt.application():
        with tt.distributed_init():
            dist.init_process_group("gloo")
        rank = dist.get_rank()
        first = int(checkpoint.read_text()) if checkpoint is not None and checkpoint.exists() else 0
        with tt.training_loop(first_step=first):
            for step in range(first, steps):
                with tt.training_iteration(step) as it:
                    if rank == 1 and step == 3:
                        if mode == "raise" or (mode == "restart" and restart == 0):
                            raise RuntimeError(f"boom at step {step}")
                        if mode == "kill":
                            os.kill(os.getpid(), signal.SIGKILL)
                    value = torch.ones(4) * (rank + 1)
                    dist.all_reduce(value)
                    it.add_metrics(loss=float(value[0]))
                if checkpoint is not None and rank == 0:
                    with tt.checkpoint_save(step=step + 1):
                        checkpoint.write_text(str(step + 1))
                    events.record(events.EventType.CHECKPOINT_SAVED, data={"step": step + 1})
                if mode == "kill" and rank == 1 and step == 2:
                    tt.flush()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
