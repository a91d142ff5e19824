"""What telemetry adds to a real training step: a small MLP on CPU, five spans and a loss per step.

Each library runs in a child process of its own (the reference library is a
process-wide singleton, and the recording core is chosen at import). Inside it,
blocks of steps with the spans and blocks without them alternate, and the
figure compares the two sets of steps of the same process: step times of one
process against another's differ by more than the effect measured here (the
same loop's median moved by 30% between processes on this machine). The
writer's work for a block runs partly during the next one, so a bit of the
library's cost falls on the steps without spans: the figure is a lower bound
by that much. The modes:

- ``none``: the training loop with no telemetry;
- ``native`` / ``pure``: traintrace (default settings, file backend, statistics
  on), on the native core and on the pure-Python one (``TRAINTRACE_PURE=1``);
- ``reference``: aidot-training-telemetry with its file backend, the same spans
  and the loss as a span metric.

A step is ``iteration`` containing ``forward``, ``backward``, ``zero_grad`` and
``optimizer_step``, and the loss (a float, read with ``.item()`` as training
scripts do) added to the iteration. The figure is the median step time with
spans against without, each process's own, then the median over the rounds.

    bash benchmarks/run.sh bench_mlp.py            # installs torch==2.13.0 in .bench-venv first
    bash benchmarks/run.sh bench_mlp.py --quick
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
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

MODES = ("none", "native", "pure", "reference")


BLOCK = 100


def _bare(name: str, step: int) -> AbstractContextManager[Any]:
    return nullcontext()


def _loop_body(steps: int, spans: Any, add_loss: Any) -> tuple[list[int], list[int]]:
    """Train ``steps`` steps, alternating blocks with ``spans(name, step)`` and without any.

    Returns the step times (ns) with spans and without.
    """
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32, 256)
    target = torch.randn(32, 256)
    traced: list[int] = []
    bare: list[int] = []
    for step in range(steps):
        on = (step // BLOCK) % 2 == 1
        phase = spans if on else _bare
        t0 = time.perf_counter_ns()
        with phase("iteration", step) as iteration:
            with phase("forward", step):
                loss = torch.nn.functional.mse_loss(model(data), target)
            with phase("backward", step):
                loss.backward()
            with phase("zero_grad", step):
                pass
            with phase("optimizer_step", step):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            value = loss.item()
            if on:
                add_loss(iteration, value)
        (traced if on else bare).append(time.perf_counter_ns() - t0)
    return traced, bare


def _child(mode: str, steps: int, folder: str) -> tuple[list[int], list[int]]:
    if mode == "none":
        return _loop_body(steps, _bare, lambda span, value: None)
    if mode in ("native", "pure"):
        import traintrace as tt

        tt.configure(job_id=f"mlp-{mode}", log_dir=folder, backends={"log": False})
        phases = {
            "forward": tt.forward,
            "backward": tt.backward,
            "zero_grad": tt.zero_grad,
            "optimizer_step": tt.optimizer_step,
        }

        def traced(name: str, step: int) -> AbstractContextManager[Any]:
            return tt.training_iteration(step) if name == "iteration" else phases[name]()

        try:
            with tt.training_loop():
                return _loop_body(steps, traced, lambda span, value: span.add_metrics(loss=value))
        finally:
            tt.close()
    import logging

    from training_telemetry import FileBackendConfig, Provider, TelemetryConfig
    from training_telemetry.context import timed_span, training
    from training_telemetry.spans import SpanName
    from training_telemetry.verbosity import Verbosity

    config = TelemetryConfig(
        backends=[FileBackendConfig(output_file_path=str(Path(folder) / "reference"), verbosity=Verbosity.PROFILING)],
        log_level=logging.ERROR,
    )
    Provider._instance = Provider(config)
    Provider._config = config
    names = {
        "iteration": SpanName.ITERATION,
        "forward": SpanName.MODEL_FORWARD,
        "backward": SpanName.MODEL_BACKWARD,
        "zero_grad": SpanName.ZERO_GRAD,
        "optimizer_step": SpanName.OPTIMIZER_UPDATE,
    }

    def reference(name: str, step: int) -> AbstractContextManager[Any]:
        return timed_span(names[name])

    with training():
        return _loop_body(steps, reference, lambda span, value: span.add_metric("loss", value))


def _run_child(mode: str, steps: int) -> tuple[list[int], list[int]] | None:
    env = {**os.environ, "TRAINTRACE_PURE": "1" if mode == "pure" else "0", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="traintrace-mlp-") as folder:
        result = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--steps", str(steps), "--folder", folder],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    if result.returncode != 0:
        if mode == "reference" and "training_telemetry" in result.stderr:
            return None
        raise RuntimeError(f"{mode} run failed:\n{result.stderr[-2000:]}")
    traced, bare = json.loads(result.stdout.splitlines()[-1])
    return traced, bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds, for a smoke run")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (1000 if args.quick else 3000)
    if args.child:
        traced, bare = _child(args.child, steps, args.folder)
        print(json.dumps([traced[BLOCK:], bare[BLOCK:]]))  # each's first block is warm-up
        return
    rounds = args.rounds or (2 if args.quick else 5)
    # Per mode and round: (median step with spans, median step without), in µs.
    medians: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            times = _run_child(mode, steps)
            if times is not None:
                traced, bare = times
                medians[mode].append((statistics.median(traced) / 1000, statistics.median(bare) / 1000))
    load = os.getloadavg()[0]
    print(f"small MLP step (Linear 256-512-256, batch 32, 1 thread), {steps} steps x {rounds} rounds; load {load:.1f}")
    print(f"{'mode':<34} {'step µs, spans':>15} {'without':>10} {'added µs':>10} {'added':>8}")
    labels = {
        "none": "no telemetry (both blocks bare)",
        "native": "traintrace, native core",
        "pure": "traintrace, pure-Python core",
        "reference": "reference (aidot), file backend",
    }
    for mode in MODES:
        if not medians[mode]:
            print(f"{labels[mode]:<34} {'not installed':>15}")
            continue
        traced = statistics.median(t for t, _ in medians[mode])
        bare = statistics.median(b for _, b in medians[mode])
        added = statistics.median(t - b for t, b in medians[mode])
        share = statistics.median((t - b) / b for t, b in medians[mode])
        print(f"{labels[mode]:<34} {traced:>15.1f} {bare:>10.1f} {added:>10.1f} {share:>8.1%}")


if __name__ == "__main__":
    main()
