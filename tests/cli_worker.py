"""One rank of a small real job for the traintrace command's tests (no torch: starts fast).

RANK=1 WORLD_SIZE=4 python tests/cli_worker.py LOG_DIR [--slow-compute R] [--slow-data R]
    [--fail R:STEP] [--hang R:STEP] [--slow-checkpoint R] [--truth DIR]

With ``--truth``, each step's data-loading and compute time as the worker measured them itself (its own clock
around each sleep, outside traintrace): ``DIR/rank<N>.jsonl``, one line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import traintrace as tt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow-compute", type=int, default=-1)
    parser.add_argument("--slow-data", type=int, default=-1)
    parser.add_argument("--slow-checkpoint", type=int, default=-1)
    parser.add_argument("--fail", default="")
    parser.add_argument("--hang", default="")
    parser.add_argument("--truth", default="")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    fail = tuple(int(x) for x in args.fail.split(":")) if args.fail else (-1, -1)
    hang = tuple(int(x) for x in args.hang.split(":")) if args.hang else (-1, -1)
    truth = open(os.path.join(args.truth, f"rank{rank}.jsonl"), "w", buffering=1) if args.truth else None  # noqa: SIM115
    tt.configure(job_id="faults", log_dir=args.log_dir)
    with tt.application():
        with tt.model_init():
            time.sleep(0.01)
        with tt.training_loop():
            for step in range(args.steps):
                with tt.data_loading():
                    t0 = time.perf_counter_ns()
                    time.sleep(0.008 + (0.02 if rank == args.slow_data else 0.0))
                    t1 = time.perf_counter_ns()
                with tt.training_iteration(step) as it:
                    with tt.forward():
                        t2 = time.perf_counter_ns()
                        time.sleep(0.008 + (0.02 if rank == args.slow_compute else 0.0))
                        t3 = time.perf_counter_ns()
                    if truth is not None:
                        truth.write(json.dumps({"step": step, "data_ns": t1 - t0, "compute_ns": t3 - t2}) + "\n")
                    if (rank, step) == fail:
                        raise RuntimeError(f"injected failure on rank {rank} at step {step}")
                    it.add_metrics(loss=1.0 / (step + 1), batch_size=4)
                if (step + 1) % 10 == 0:
                    with tt.checkpoint_save(current_iteration=step + 1):
                        if (rank, step + 1) == hang:
                            tt.flush()
                            time.sleep(3600)
                        time.sleep(0.3 if rank == args.slow_checkpoint else 0.005)


if __name__ == "__main__":
    main()
