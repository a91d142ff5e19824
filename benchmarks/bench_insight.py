"""Cost of training-loop insight.

    python benchmarks/bench_insight.py step        # per-step cost, statistics on vs off
    python benchmarks/bench_insight.py threads     # sampler + watchdog CPU over 60 s
    REFERENCE_PYTHON=/path/to/python python benchmarks/bench_insight.py step

``step`` times ``with training_iteration(i) as it: it.add_metrics(loss=...)``
with the file backend, with ``statistics`` on (the default: statistics,
sampler and watchdog) and off, in alternating rounds, and prints medians of:
the caller's wall time per step, the caller thread's own CPU time per step
(what training pays), and the writer thread's CPU per step (paid off the
training thread). With REFERENCE_PYTHON naming an interpreter that has
``aidot-training-telemetry`` installed, the reference's iteration span with
its file backend is timed in the same run.

``threads`` runs a recorder at the default periods for 60 s (a slow training
loop, 10 steps/s) and reads the CPU time of the sampler and watchdog threads.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

STEPS = 100_000
ROUNDS = 5


def run_steps(on: bool, folder: str) -> tuple[float, float, float]:
    import traintrace as tt

    tt.configure(
        log_dir=folder,
        job_id=f"bench-{'on' if on else 'off'}",
        backends={"log": False},
        statistics=on,
        queue_size=1 << 20,
    )
    loss = 0.5
    iteration = tt.training_iteration
    cpu0 = time.process_time_ns()
    thread0 = time.thread_time_ns()
    wall0 = time.perf_counter_ns()
    with tt.training_loop():
        for step in range(STEPS):
            with iteration(step) as it:
                it.add_metrics(loss=loss)
    wall = time.perf_counter_ns() - wall0
    thread = time.thread_time_ns() - thread0
    tt.close(60)
    writer = time.process_time_ns() - cpu0 - thread
    return wall / STEPS, thread / STEPS, writer / STEPS


REFERENCE = """
import sys, time, tempfile, logging
from training_telemetry.config import TelemetryConfig, FileBackendConfig
from training_telemetry.provider import Provider
from training_telemetry.context import timed_span
from training_telemetry.spans import SpanName
steps = int(sys.argv[1])
folder = tempfile.mkdtemp()
backends = [FileBackendConfig(output_file_path=folder + "/ref")]
config = TelemetryConfig(backends=backends, log_level=logging.ERROR)
Provider.set_provider(config)
t0 = time.perf_counter_ns()
c0 = time.thread_time_ns()
for step in range(steps):
    with timed_span(SpanName.ITERATION) as span:
        pass
print((time.perf_counter_ns() - t0) / steps, (time.thread_time_ns() - c0) / steps)
"""


def step_benchmark() -> None:
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(ROUNDS):
            for on in (False, True):
                results[on].append(run_steps(on, folder))
    print(f"{STEPS} steps x {ROUNDS} rounds, file backend, medians (ns per step)")
    print(f"{'statistics':<12}{'caller wall':>14}{'caller CPU':>14}{'writer CPU':>14}")
    medians = {}
    for on in (False, True):
        wall, thread, writer = (statistics.median(r[i] for r in results[on]) for i in range(3))
        medians[on] = (wall, thread, writer)
        print(f"{'on' if on else 'off':<12}{wall:>14.0f}{thread:>14.0f}{writer:>14.0f}")
    extra = [medians[True][i] - medians[False][i] for i in range(3)]
    print(f"{'extra':<12}{extra[0]:>14.0f}{extra[1]:>14.0f}{extra[2]:>14.0f}")
    reference = os.environ.get("REFERENCE_PYTHON")
    if reference:
        out = subprocess.run(
            [reference, "-c", REFERENCE, str(STEPS // 10)], capture_output=True, text=True, check=True
        ).stdout.split()
        wall, thread = float(out[0]), float(out[1])
        print(f"{'reference':<12}{wall:>14.0f}{thread:>14.0f}{'-':>14}  (aidot iteration span)")


def threads_benchmark(seconds: float = 60.0) -> None:
    import traintrace as tt

    with tempfile.TemporaryDirectory() as folder:
        rec = tt.configure(log_dir=folder, job_id="bench-threads", backends={"log": False})
        insight = rec.insight  # type: ignore[attr-defined]
        monitors = [t._thread for t in (insight.sampler, insight.watchdog)]
        clocks = {t.name: time.pthread_getcpuclockid(t.ident) for t in monitors if t.ident}
        before = {name: time.clock_gettime_ns(clock) for name, clock in clocks.items()}
        end = time.monotonic() + seconds
        step = 0
        with tt.training_loop():
            while time.monotonic() < end:
                with tt.training_iteration(step):
                    time.sleep(0.1)
                step += 1
        used = {name: time.clock_gettime_ns(clock) - before[name] for name, clock in clocks.items()}
        tt.close()
    print(f"{seconds:.0f} s at default periods (sampler 10 s, watchdog 5 s), {step} steps")
    total = 0
    for name, ns in used.items():
        total += ns
        print(f"  {name:<22}{ns / 1e6:8.2f} ms CPU  {100 * ns / (seconds * 1e9):.4f}% of one core")
    print(f"  {'together':<22}{total / 1e6:8.2f} ms CPU  {100 * total / (seconds * 1e9):.4f}% of one core")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "step"
    if what == "threads":
        threads_benchmark(float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
    else:
        step_benchmark()
