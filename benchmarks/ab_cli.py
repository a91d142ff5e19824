"""A/B of the traintrace command: another checkout against this one, in the same run, on the same jobs.

    python benchmarks/ab_cli.py --old /path/to/old/checkout/src JOB [JOB ...] [--repeats 5]

Each command (``summary``, ``ranks``, ``errors``, ``--json --quiet``) runs as a fresh process with
``PYTHONPATH`` pointing at one side's ``src`` folder, the two sides interleaved (the order alternating
between repeats), so both see the same machine. Prints the median wall and CPU seconds (user + system,
all threads) of each side, and whether the two sides' JSON answers are identical (timings left out).
A side's native extensions must be built in its ``src/traintrace`` (or copied there when the C is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COMMANDS = ("summary", "ranks", "errors")
#: Keys whose values are timings of the run, not answers.
TIMING_KEYS = {"load_seconds", "seconds", "elapsed"}


def _answer(text: str) -> Any:
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items() if k not in TIMING_KEYS}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, float):
            return float(f"{value:.10g}")  # a parallel sum differs in its last bits between runs
        return value

    return walk(json.loads(text))


def _run(src: str, command: str, job: str) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "traintrace.cli", command, job, "--json", "--quiet"],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if not done.stdout.strip():
        raise SystemExit(f"{command} {job} ({src}) wrote no answer: {done.stderr.strip()[-500:]}")
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jobs", nargs="+", help="job folders (benchmarks/gen_job.py writes them)")
    parser.add_argument("--old", required=True, help="the other checkout's src folder")
    parser.add_argument("--new", default=str(HERE.parent / "src"), help="this checkout's src folder (default)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sides = {"old": args.old, "new": args.new}
    # Both sides with their bytecode cached, as an installed package has it: with PYTHONDONTWRITEBYTECODE set (as
    # on this project's machines) a side whose caches were never written would compile its sources every run.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for src in sides.values():
        _run(src, COMMANDS[0], args.jobs[0])
    print(f"{'job':36} {'command':8} {'wall old':>9} {'wall new':>9} {'CPU old':>8} {'CPU new':>8}  same answers")
    for job in args.jobs:
        for command in COMMANDS:
            runs: dict[str, list[tuple[float, float, str]]] = {"old": [], "new": []}
            for repeat in range(args.repeats):
                for side in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                    runs[side].append(_run(sides[side], command, job))
            same = _answer(runs["old"][0][2]) == _answer(runs["new"][0][2])
            wall = {s: statistics.median(r[0] for r in runs[s]) for s in runs}
            cpu = {s: statistics.median(r[1] for r in runs[s]) for s in runs}
            print(
                f"{Path(job).name:36} {command:8} {wall['old']:9.3f} {wall['new']:9.3f} "
                f"{cpu['old']:8.3f} {cpu['new']:8.3f}  {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
