"""What the progress file costs the training thread (budget: 100 ns per update).

Figures, all in one process, medians of interleaved repeats:

* ``store floor``: one bare ``view[i] = x`` into an int64 memoryview over an mmap;
* ``update``: the statements ``Span.__enter__`` runs for a standard phase
  (dictionary look-up of the name, thread check, two stores: the phase's
  start, and the update counter with the phase code in its low byte),
  against a real mapped progress file, loop cost subtracted;
* ``span``: ``with tt.forward(): pass`` on one recorder, with the progress view
  attached and detached (chunks alternated, writer drained between chunks); the
  difference is two updates (start and stop); the same for
  ``with tt.training_iteration(step): pass`` (an iteration stores more: step,
  its start, the iteration counts).

Run::

    PYTHONPATH=src python benchmarks/bench_progress.py [--quick] [--json out.json]

Times are the training thread's CPU time (``time.thread_time_ns``), so that
other processes on a shared machine inflate them less; read the ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import traintrace as tt
from bench_core import floor_loop  # the same floor as bench_core (run as a script: its folder is on sys.path)
from traintrace import _progress
from traintrace._identity import detect
from traintrace._progress import COUNTER_STEP, PHASE_CODES, S_COUNTER, S_PHASE_T0, S_STEP

_NAME = tt.SpanName.FORWARD


def _per_op(loop: Callable[[int], None], n: int) -> float:
    # This thread's CPU time: the training thread's own cost, not the time other
    # processes (or the writer thread) held the CPU meanwhile.
    started = time.thread_time_ns()
    loop(n)
    return (time.thread_time_ns() - started) / n


def empty_loop(view: memoryview) -> Callable[[int], None]:
    def loop(n: int) -> None:
        t0 = 123456789
        for _ in range(n):
            pass
        del t0

    return loop


def store_loop(view: memoryview) -> Callable[[int], None]:
    def loop(n: int) -> None:
        t0 = 123456789
        for _ in range(n):
            view[S_STEP] = t0

    return loop


class _FakeRecorder:
    __slots__ = ("_progress", "_progress_seq", "_progress_tid")

    def __init__(self, view: memoryview) -> None:
        self._progress = view
        self._progress_tid = threading.get_ident()
        self._progress_seq = itertools.count(COUNTER_STEP, COUNTER_STEP)


def update_loop(view: memoryview) -> Callable[[int], None]:
    """The statements Span.__enter__ runs for a standard phase that is not an iteration."""
    rec = _FakeRecorder(view)
    name = _NAME
    tid = threading.get_ident()
    phases = PHASE_CODES
    iteration, collective = _progress.ITERATION_CODE, _progress.COLLECTIVE_CODE

    def loop(n: int) -> None:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            prog = rec._progress
            if prog is not None and tid == rec._progress_tid:
                try:
                    if name in phases:
                        code = phases[name]
                        if code == iteration:  # noqa: SIM114 - the same two tests as Span.__enter__
                            pass
                        elif code == collective:
                            pass
                        prog[S_PHASE_T0] = t0
                        prog[S_COUNTER] = next(rec._progress_seq) | code
                except Exception:
                    pass

    return loop


def span_chunk(n: int) -> None:
    forward = tt.forward
    for _ in range(n):
        with forward():
            pass


def iteration_chunk(n: int) -> None:
    iteration = tt.training_iteration
    for step in range(n):
        with iteration(step):
            pass


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    repeats, n, chunk = (9, 200_000, 5_000) if args.quick else (25, 1_000_000, 10_000)

    with tempfile.TemporaryDirectory() as folder:
        opened = _progress.ProgressFile(Path(folder) / "bench.progress", detect())
        view = opened.view
        loops = {
            "empty": empty_loop(view),
            "store": store_loop(view),
            "update": update_loop(view),
            "floor_loop": floor_loop,
        }
        samples: dict[str, list[float]] = {key: [] for key in loops}
        for _ in range(repeats):
            for key, loop in loops.items():
                samples[key].append(_per_op(loop, n))
        opened.release()

        rec = tt.configure(log_dir=folder, job_id="bench", backends={"file": {}, "log": {"enabled": False}})
        attached = rec._progress
        assert attached is not None, "the progress file was not opened"
        spans: dict[str, list[float]] = {k: [] for k in ("span_with", "span_without", "it_with", "it_without")}
        for _ in range(repeats):
            for key, view_now, body in (
                ("span_with", attached, span_chunk),
                ("span_without", None, span_chunk),
                ("it_with", attached, iteration_chunk),
                ("it_without", None, iteration_chunk),
            ):
                rec._progress = view_now
                total = 0.0
                for _ in range(max(1, n // chunk // 4)):
                    tt.flush(60)
                    total += _per_op(body, chunk)
                spans[key].append(total / max(1, n // chunk // 4))
        rec._progress = attached
        tt.close()

    med = {key: statistics.median(values) for key, values in {**samples, **spans}.items()}
    store = med["store"] - med["empty"]
    update = med["update"] - med["empty"]
    span_delta = med["span_with"] - med["span_without"]
    result = {
        "python": sys.version.split()[0],
        "repeats": repeats,
        "store_floor_ns": round(store, 1),
        "empty_with_ns": round(med["floor_loop"], 1),
        "update_ns": round(update, 1),
        "update_over_store": round(update / store, 2) if store > 0 else None,
        "span_with_progress_ns": round(med["span_with"], 1),
        "span_without_progress_ns": round(med["span_without"], 1),
        "span_ratio": round(med["span_with"] / med["span_without"], 3),
        "per_update_in_span_ns": round(span_delta / 2, 1),
        "iteration_with_progress_ns": round(med["it_with"], 1),
        "iteration_without_progress_ns": round(med["it_without"], 1),
        "per_update_in_iteration_ns": round((med["it_with"] - med["it_without"]) / 2, 1),
        "budget_ns": 100,
    }
    from traintrace._recorder import CORE

    result["core"] = CORE
    print(f"{CORE} core (TRAINTRACE_PURE=1 for the pure-Python one); python {result['python']}")
    print(f"empty `with` statement (machine)     {med['floor_loop']:8.1f} ns   (bench_core's floor)")
    print(f"store floor (one int64 store)        {store:8.1f} ns")
    print(f"update as traintrace does it         {update:8.1f} ns   ({result['update_over_store']}x the floor)")
    print(f"span (start+stop) with progress file {med['span_with']:8.1f} ns")
    print(f"span (start+stop) without            {med['span_without']:8.1f} ns   (ratio {result['span_ratio']})")
    print(f"per update, from the span difference {span_delta / 2:8.1f} ns   (budget 100 ns)")
    it_delta = med["it_with"] - med["it_without"]
    print(f"iteration span with / without        {med['it_with']:8.1f} / {med['it_without']:.1f} ns")
    print(f"per update, from the iteration diff. {it_delta / 2:8.1f} ns")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
