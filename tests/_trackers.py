"""A small real training loop for the tracker backends' tests, with its truth computed here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import traintrace as tt

STEPS = 20
INTERVAL = 5


@dataclass
class Truth:
    """What the loop did, measured outside traintrace."""

    losses: dict[int, float] = field(default_factory=dict)  # last step of each interval -> mean loss
    interval_ends: list[int] = field(default_factory=list)
    checkpoint_s: float = 0.0  # our own clock around the save
    validation_s: float = 0.0
    error_message: str = "bad batch 7"
    wall_s: float = 0.0


def train(log_dir: Path, backends: dict[str, Any], job: str = "trk") -> Truth:
    truth = Truth()
    start = time.perf_counter()
    tt.configure(job_id=job, log_dir=str(log_dir), log_interval=INTERVAL, backends={"log": False, **backends})
    tt.set_step_info(batch_size=8, num_iterations=STEPS)
    losses: list[float] = []
    with tt.application(), tt.training_loop():
        for step in range(STEPS):
            with tt.training_iteration(step) as it:
                time.sleep(0.002)
                loss = 4.0 / (step + 1)
                losses.append(loss)
                it.add_metrics(loss=loss)
                if step == 7:
                    try:
                        with tt.span("load_batch"):
                            raise ValueError(truth.error_message)
                    except ValueError:
                        pass
            if (step + 1) % INTERVAL == 0:
                truth.interval_ends.append(step)
                truth.losses[step] = sum(losses[-INTERVAL:]) / INTERVAL
            if step == 9:
                t0 = time.perf_counter()
                with tt.checkpoint_save(
                    tt.CheckpointSaveMetrics.create(checkpoint_type=tt.CheckPointType.LOCAL, current_iteration=step + 1)
                ):
                    time.sleep(0.05)
                truth.checkpoint_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                with tt.validation():
                    time.sleep(0.03)
                truth.validation_s = time.perf_counter() - t0
    tt.close()
    truth.wall_s = time.perf_counter() - start
    return truth
