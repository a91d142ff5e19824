"""A torchrun worker for the Prometheus test: ten steps, then it writes its truth and waits to be released."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import traintrace as tt

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
tt.configure(log_interval=5)
tt.set_step_info(batch_size=4)
truth: dict[str, float] = {}
with tt.application(), tt.training_loop():
    for step in range(10):
        truth["last_start"] = time.time()
        with tt.training_iteration(step):
            time.sleep(0.01)
            total = torch.ones(1)
            dist.all_reduce(total)
            if rank == 1 and step == 3:
                try:
                    with tt.span("load_batch"):
                        raise ValueError("skipped a bad batch")
                except ValueError:
                    pass
    truth["t_end"] = time.time()
    tt.flush()
    truth.update(last_step=9, errors=1 if rank == 1 else 0, world=float(dist.get_world_size()))
    (out / f"truth{rank}.json").write_text(json.dumps(truth))
    while not (out / "go").exists():  # still running while the test scrapes
        time.sleep(0.05)
tt.close()
dist.destroy_process_group()
