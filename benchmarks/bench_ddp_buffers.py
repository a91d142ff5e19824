"""What recording DDP's buffer broadcast adds to a forward: a DDP model with a BatchNorm layer on CPU.

``record_collectives`` (and the Lightning and Trainer callbacks) time DDP's ``_sync_buffers`` for a model that has
buffers (the class's method, wrapped once), one ``collective`` span per forward. This times a whole forward
(``model(x)``: DDP's buffer broadcast, then the module) of a small model in a one-process gloo group, the user's
cost, in three child processes:

- ``traintrace``: blocks of forwards of a model recorded by ``record_collectives`` (file backend, default
  settings) alternate with blocks of an identical model without the hooks, in the same process;
- ``traintrace-off``: the same, with traintrace not configured (the wrapper runs and records nothing);
- ``reference``: aidot-training-telemetry cannot record the broadcast; its nearest is a ``timed_span`` around
  each forward (file backend), against the same forwards without it.

Each figure is the median forward with the recording against without, in the same process, one forward of each
in turn; the floor is the forward without anything.

    bash benchmarks/run.sh bench_ddp_buffers.py           # installs torch==2.13.0 in .bench-venv first
    bash benchmarks/run.sh bench_ddp_buffers.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

MODES = ("traintrace", "traintrace-off", "reference")


def _model() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 1))


def _child(mode: str, forwards: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="traintrace-ddp-buffers-")
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    plain = DistributedDataParallel(_model())
    recorded = DistributedDataParallel(_model())
    around: Callable[[], AbstractContextManager[Any]] = nullcontext
    close: Callable[[], None] = lambda: None  # noqa: E731
    if mode.startswith("traintrace"):
        import traintrace as tt
        from traintrace.integrations.ddp import record_collectives

        if mode == "traintrace":
            tt.configure(log_dir=folder, job_id="bench", rank=0, world_size=1)
            close = tt.close
        record_collectives(recorded)
    else:
        import logging

        from training_telemetry import FileBackendConfig, Provider, TelemetryConfig
        from training_telemetry.context import timed_span
        from training_telemetry.spans import SpanName
        from training_telemetry.verbosity import Verbosity

        config = TelemetryConfig(
            backends=[FileBackendConfig(output_file_path=str(Path(folder) / "ref"), verbosity=Verbosity.PROFILING)],
            log_level=logging.ERROR,
        )
        Provider._instance = Provider(config)
        Provider._config = config
        recorded = plain

        def around() -> AbstractContextManager[Any]:
            return timed_span(SpanName.MODEL_FORWARD)

    x = torch.randn(32, 64)
    timings: dict[str, list[int]] = {"without": [], "with": []}
    # One forward of each, in turn (the order alternating): blocks of each drift apart by more than the effect.
    sides = [("without", plain, nullcontext), ("with", recorded, around)]
    for i in range(forwards):
        for side, model, wrap in sides if i % 2 else sides[::-1]:
            t0 = time.perf_counter_ns()
            with wrap():
                model(x)
            timings[side].append(time.perf_counter_ns() - t0)
    close()
    dist.destroy_process_group()
    return {side: statistics.median(times[forwards // 10 :]) / 1e3 for side, times in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    forwards = 4_000 if args.quick else 20_000
    if args.child:
        print(json.dumps(_child(args.child, forwards)))
        return
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINTRACE_PURE": "0"}
            command = [sys.executable, __file__, "--child", mode, *(["--quick"] if args.quick else [])]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                if mode == "reference" and "training_telemetry" in done.stderr:
                    print("reference: not installed (bash benchmarks/run.sh installs it)", file=sys.stderr)
                    continue
                raise SystemExit(done.stderr[-3000:])
            results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rounds = args.rounds
    print(f"forward of a DDP model with a BatchNorm layer, µs (median of {rounds} rounds of each process's medians)")
    print("| case | forward without | with | added | added / floor |")
    print("|---|---:|---:|---:|---:|")
    labels = {
        "traintrace": "traintrace, record_collectives (file backend)",
        "traintrace-off": "traintrace wrapper, not configured",
        "reference": "reference (aidot), timed_span around the forward",
    }
    for mode, rounds in results.items():
        if not rounds:
            continue
        without = statistics.median(r["without"] for r in rounds)
        with_ = statistics.median(r["with"] for r in rounds)
        added = statistics.median(r["with"] - r["without"] for r in rounds)
        print(f"| {labels[mode]} | {without:.1f} | {with_:.1f} | {added:+.2f} | {added / without:+.1%} |")


if __name__ == "__main__":
    main()
