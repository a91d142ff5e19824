"""Sustained iteration spans carrying a float loss (``it.add_metrics(loss=1.0 / (i + 1))``), blocking.

Prints spans/s and the writer thread's CPU per span (up to the last flush), best of ``--repeats``
runs (a shared machine only slows a run down). Run it with two PYTHONPATHs to compare builds:

    PYTHONPATH=src python benchmarks/bench_float_loss.py 100000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import traintrace as tt
from bench_core import core_name, writer_cpu_s


def run(folder: Path, total: int, statistics: bool, job: str) -> tuple[float, float | None]:
    tt.configure(job_id=job, log_dir=str(folder), backends={"log": False}, blocking=True, statistics=statistics)
    writer0 = writer_cpu_s()
    started = time.perf_counter_ns()
    iteration = tt.training_iteration
    with tt.training_loop():
        for step in range(total):
            with iteration(step) as it:
                it.add_metrics(loss=1.0 / (step + 1))
    tt.flush(120)
    writer1 = writer_cpu_s()
    elapsed = (time.perf_counter_ns() - started) / 1e9
    tt.close()
    writer = None if writer0 is None or writer1 is None else (writer1 - writer0) / total * 1e6
    return total / elapsed, writer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spans", type=int, nargs="?", default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for statistics in (False, True):
            best_rate, best_writer = 0.0, float("inf")
            for repeat in range(args.repeats):
                rate, writer = run(Path(scratch), args.spans, statistics, f"loss-{statistics}-{repeat}")
                best_rate = max(best_rate, rate)
                if writer is not None:
                    best_writer = min(best_writer, writer)
            print(
                f"{core_name()} core, statistics {'on ' if statistics else 'off'}: {best_rate:10,.0f} spans/s, "
                f"writer {best_writer:.3f} us/span (best of {args.repeats} x {args.spans:,})"
            )


if __name__ == "__main__":
    main()
